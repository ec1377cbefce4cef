// safetensors reading, writing and validation (format in
// include/fastattn/safetensors.h), atomic file writes, and loading a module's
// parameters by name. Reading is O(file size): the file is read once and each
// tensor's bytes are copied into its own CPU tensor.
#include "fastattn/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <random>
#include <set>
#include <sstream>

namespace fastattn {

namespace {

struct DtypeInfo {
  const char* name;
  torch::ScalarType dtype;
};

const DtypeInfo kDtypes[] = {
    {"F64", torch::kDouble},    {"F32", torch::kFloat}, {"F16", torch::kHalf},
    {"BF16", torch::kBFloat16}, {"I64", torch::kLong},  {"I32", torch::kInt},
    {"I16", torch::kShort},     {"I8", torch::kChar},   {"U8", torch::kByte},
    {"BOOL", torch::kBool},
};

std::string dtype_names() {
  std::string out;
  for (const auto& d : kDtypes) out += (out.empty() ? "" : ", ") + std::string(d.name);
  return out;
}

bool host_is_little_endian() {
  const uint16_t x = 1;
  uint8_t b = 0;
  std::memcpy(&b, &x, 1);
  return b == 1;
}

std::string errno_text() { return std::strerror(errno); }

// Closes a file descriptor on scope exit.
struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

std::string safetensors_dtype_name(torch::ScalarType dtype) {
  for (const auto& d : kDtypes) {
    if (d.dtype == dtype) return d.name;
  }
  TORCH_CHECK(false, "safetensors: dtype ", dtype, " is not supported; supported: ", dtype_names());
}

torch::ScalarType safetensors_dtype(const std::string& name, const std::string& context) {
  for (const auto& d : kDtypes) {
    if (name == d.name) return d.dtype;
  }
  TORCH_CHECK(false, context, context.empty() ? "" : ": ", "unknown dtype '", name,
              "'; supported: ", dtype_names());
}

std::string safetensors_bytes(const std::map<std::string, torch::Tensor>& tensors,
                              const std::map<std::string, std::string>& metadata) {
  TORCH_CHECK(host_is_little_endian(), "safetensors: writing needs a little-endian host");
  nlohmann::json header = nlohmann::json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::vector<torch::Tensor> contiguous;
  uint64_t offset = 0;
  for (const auto& [name, tensor] : tensors) {
    TORCH_CHECK(!name.empty(), "safetensors: tensor names must not be empty");
    TORCH_CHECK(name != "__metadata__", "safetensors: '__metadata__' is not a valid tensor name");
    TORCH_CHECK(tensor.defined(), "safetensors: tensor '", name, "' is undefined");
    auto t = tensor.detach().to(torch::kCPU).contiguous();
    const uint64_t n = static_cast<uint64_t>(t.numel()) * t.element_size();
    header[name] = {{"dtype", safetensors_dtype_name(t.scalar_type())},
                    {"shape", t.sizes().vec()},
                    {"data_offsets", {offset, offset + n}}};
    offset += n;
    contiguous.push_back(t);
  }
  std::string json = header.dump();
  // Pad with spaces so that the data section starts 8-byte aligned (as the
  // Hugging Face writer does).
  json.append((8 - json.size() % 8) % 8, ' ');
  std::string out(8 + json.size() + offset, '\0');
  const uint64_t hlen = json.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((hlen >> (8 * i)) & 0xff);
  std::memcpy(&out[8], json.data(), json.size());
  char* data = &out[8 + json.size()];
  for (const auto& t : contiguous) {
    const size_t n = static_cast<size_t>(t.numel()) * t.element_size();
    if (n > 0) std::memcpy(data, t.data_ptr(), n);
    data += n;
  }
  return out;
}

SafetensorsFile parse_safetensors(const std::string& bytes, const std::string& source) {
  const std::string who = "safetensors file '" + source + "': ";
  TORCH_CHECK(host_is_little_endian(), who, "reading needs a little-endian host");
  TORCH_CHECK(bytes.size() >= 8, who, "truncated: ", bytes.size(),
              " bytes, too short for the 8-byte header length");
  uint64_t hlen = 0;
  for (int i = 0; i < 8; ++i)
    hlen |= static_cast<uint64_t>(static_cast<uint8_t>(bytes[i])) << (8 * i);
  TORCH_CHECK(hlen >= 2 && hlen <= kSafetensorsMaxHeaderBytes, who, "header length ", hlen,
              " is out of bounds (expected 2..", kSafetensorsMaxHeaderBytes, " bytes)");
  TORCH_CHECK(hlen <= bytes.size() - 8, who, "truncated: the header needs ", hlen,
              " bytes after the length but the file has only ", bytes.size() - 8);
  const std::string header_text = bytes.substr(8, hlen);

  // Parse, rejecting duplicate top-level names (JSON allows them; safetensors does not).
  std::set<std::string> seen;
  std::string duplicate;
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(
        header_text, [&](int depth, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
          if (depth == 1 && event == nlohmann::json::parse_event_t::key) {
            const auto key = parsed.get<std::string>();
            if (!seen.insert(key).second && duplicate.empty()) duplicate = key;
          }
          return true;
        });
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, who, "the header is not valid JSON: ", e.what());
  }
  TORCH_CHECK(duplicate.empty(), who, "the header names '", duplicate, "' twice");
  TORCH_CHECK(header.is_object(), who, "the header must be a JSON object, got ",
              header.type_name());

  SafetensorsFile file;
  const uint64_t data_begin = 8 + hlen;
  const uint64_t data_size = bytes.size() - data_begin;
  struct Entry {
    std::string name;
    torch::ScalarType dtype;
    std::vector<int64_t> shape;
    uint64_t begin, end;
  };
  std::vector<Entry> entries;
  for (const auto& [name, info] : header.items()) {
    if (name == "__metadata__") {
      TORCH_CHECK(info.is_object(), who, "__metadata__ must be an object of strings, got ",
                  info.dump());
      for (const auto& [key, value] : info.items()) {
        TORCH_CHECK(value.is_string(), who, "__metadata__ value of '", key,
                    "' must be a string, got ", value.dump());
        file.metadata[key] = value.get<std::string>();
      }
      continue;
    }
    const std::string what = who + "tensor '" + name + "': ";
    TORCH_CHECK(info.is_object(), what, "expected an object with dtype, shape, data_offsets, got ",
                info.dump());
    for (const auto& [key, value] : info.items()) {
      TORCH_CHECK(key == "dtype" || key == "shape" || key == "data_offsets", what, "unknown key '",
                  key, "' (expected dtype, shape, data_offsets)");
    }
    TORCH_CHECK(info.contains("dtype") && info["dtype"].is_string(), what,
                "'dtype' must be a string");
    TORCH_CHECK(info.contains("shape") && info["shape"].is_array(), what,
                "'shape' must be an array of non-negative integers");
    TORCH_CHECK(info.contains("data_offsets") && info["data_offsets"].is_array() &&
                    info["data_offsets"].size() == 2,
                what, "'data_offsets' must be [begin, end]");
    Entry e;
    e.name = name;
    e.dtype = safetensors_dtype(info["dtype"].get<std::string>(), what.substr(0, what.size() - 2));
    uint64_t numel = 1;
    bool overflow = false;
    for (const auto& d : info["shape"]) {
      TORCH_CHECK(d.is_number_unsigned() || (d.is_number_integer() && d.get<int64_t>() >= 0), what,
                  "'shape' must hold non-negative integers, got ", info["shape"].dump());
      const uint64_t v = d.get<uint64_t>();
      TORCH_CHECK(v <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()), what,
                  "dimension ", v, " is too large");
      if (v != 0 && numel > std::numeric_limits<uint64_t>::max() / v) overflow = true;
      numel *= v;
      e.shape.push_back(static_cast<int64_t>(v));
    }
    for (const auto& o : info["data_offsets"]) {
      TORCH_CHECK(o.is_number_unsigned() || (o.is_number_integer() && o.get<int64_t>() >= 0), what,
                  "'data_offsets' must be non-negative integers, got ",
                  info["data_offsets"].dump());
    }
    e.begin = info["data_offsets"][0].get<uint64_t>();
    e.end = info["data_offsets"][1].get<uint64_t>();
    TORCH_CHECK(e.begin <= e.end, what, "data_offsets [", e.begin, ", ", e.end,
                "] has begin after end");
    TORCH_CHECK(e.end <= data_size, what, "data_offsets [", e.begin, ", ", e.end,
                "] run past the end of the data section (", data_size,
                " bytes; the file may be truncated)");
    const uint64_t elem = c10::elementSize(e.dtype);
    TORCH_CHECK(!overflow && numel <= data_size / std::max<uint64_t>(elem, 1) &&
                    numel * elem == e.end - e.begin,
                what, "shape ", info["shape"].dump(), " of ", info["dtype"].get<std::string>(),
                " needs ", overflow ? std::string("too many") : std::to_string(numel * elem),
                " bytes but data_offsets [", e.begin, ", ", e.end, "] hold ", e.end - e.begin);
    entries.push_back(std::move(e));
  }
  // The tensors must tile the data section: sorted by offset, each begins
  // where the previous ended, and the last ends at the end of the file.
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t expected = 0;
  const Entry* previous = nullptr;
  for (const auto& e : entries) {
    TORCH_CHECK(e.begin >= expected, who, "tensor '", e.name, "' (data_offsets [", e.begin, ", ",
                e.end, "]) overlaps tensor '", previous ? previous->name : "", "' (ending at ",
                expected, ")");
    TORCH_CHECK(e.begin == expected, who, "a gap of ", e.begin - expected, " bytes before tensor '",
                e.name, "' (data_offsets [", e.begin, ", ", e.end,
                "]); tensors must tile the data section");
    expected = e.end;
    previous = &e;
  }
  TORCH_CHECK(expected == data_size, who, "the data section has ", data_size,
              " bytes but the tensors cover ", expected,
              expected < data_size ? " (trailing bytes)" : "");
  for (const auto& e : entries) {
    auto t = torch::empty(e.shape, torch::TensorOptions().dtype(e.dtype));
    if (e.end > e.begin)
      std::memcpy(t.data_ptr(), bytes.data() + data_begin + e.begin, e.end - e.begin);
    if (e.dtype == torch::kBool) {
      // Only 0 and 1 are valid bools; anything else would be undefined behaviour later.
      auto u = t.view(torch::kByte);
      TORCH_CHECK(u.numel() == 0 || u.max().item<int64_t>() <= 1, who, "tensor '", e.name,
                  "' of BOOL holds a byte other than 0 or 1");
    }
    file.tensors[e.name] = t;
  }
  return file;
}

void write_file_atomically(const std::string& path, const std::string& bytes) {
  TORCH_CHECK(!path.empty(), "write_file_atomically: path must not be empty");
  const auto slash = path.find_last_of('/');
  const std::string dir =
      slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
  std::random_device rd;
  const std::string tmp = path + ".tmp-" + std::to_string(::getpid()) + "-" + std::to_string(rd());
  {
    Fd f;
    f.fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    TORCH_CHECK(f.fd >= 0, "cannot create '", tmp, "': ", errno_text());
    size_t done = 0;
    while (done < bytes.size()) {
      const ssize_t n = ::write(f.fd, bytes.data() + done, bytes.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        const std::string err = errno_text();
        ::unlink(tmp.c_str());
        TORCH_CHECK(false, "cannot write '", tmp, "': ", err);
      }
      done += static_cast<size_t>(n);
    }
    if (::fsync(f.fd) != 0) {
      const std::string err = errno_text();
      ::unlink(tmp.c_str());
      TORCH_CHECK(false, "cannot fsync '", tmp, "': ", err);
    }
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string err = errno_text();
    ::unlink(tmp.c_str());
    TORCH_CHECK(false, "cannot rename '", tmp, "' to '", path, "': ", err);
  }
  // Make the rename itself durable.
  Fd d;
  d.fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (d.fd >= 0) ::fsync(d.fd);
}

void save_safetensors(const std::string& path, const std::map<std::string, torch::Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  write_file_atomically(path, safetensors_bytes(tensors, metadata));
}

SafetensorsFile load_safetensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in, "safetensors file '", path, "': cannot open: ", errno_text());
  std::ostringstream ss;
  ss << in.rdbuf();
  TORCH_CHECK(!in.bad(), "safetensors file '", path, "': read error");
  return parse_safetensors(ss.str(), path);
}

// ---- modules -------------------------------------------------------------------

std::map<std::string, torch::Tensor> state_tensors(const torch::nn::Module& module) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& p : module.named_parameters(/*recurse=*/true)) out[p.key()] = p.value();
  for (const auto& b : module.named_buffers(/*recurse=*/true)) {
    if (b.value().defined()) out[b.key()] = b.value();
  }
  return out;
}

void save_state(const torch::nn::Module& module, const std::string& path,
                const std::map<std::string, std::string>& metadata) {
  save_safetensors(path, state_tensors(module), metadata);
}

LoadStateReport load_state(torch::nn::Module& module,
                           const std::map<std::string, torch::Tensor>& tensors, bool strict,
                           const std::string& prefix) {
  auto targets = state_tensors(module);
  LoadStateReport report;
  std::map<std::string, torch::Tensor> source;
  for (const auto& [name, t] : tensors) {
    if (name.compare(0, prefix.size(), prefix) == 0 && targets.count(name.substr(prefix.size()))) {
      source[name.substr(prefix.size())] = t;
    } else {
      report.unexpected.push_back(name);
    }
  }
  for (const auto& [name, t] : targets) {
    if (!source.count(name)) report.missing.push_back(name);
  }
  auto join = [](const std::vector<std::string>& v) {
    std::string s;
    for (size_t i = 0; i < v.size() && i < 20; ++i) s += (i ? ", " : "") + v[i];
    if (v.size() > 20) s += ", ... (" + std::to_string(v.size()) + " in all)";
    return s;
  };
  TORCH_CHECK(!strict || report.missing.empty(), "load_state: ", report.missing.size(),
              " tensor(s) of the module are missing from the file: ", join(report.missing));
  TORCH_CHECK(!strict || report.unexpected.empty(), "load_state: ", report.unexpected.size(),
              " tensor(s) in the file are not in the module",
              prefix.empty() ? "" : " (after the prefix '" + prefix + "')", ": ",
              join(report.unexpected));
  // Check everything before changing anything.
  for (const auto& [name, src] : source) {
    const auto& dst = targets.at(name);
    TORCH_CHECK(src.sizes() == dst.sizes(), "load_state: tensor '", name, "' has shape ",
                src.sizes(), " in the file but ", dst.sizes(), " in the module");
    TORCH_CHECK(src.scalar_type() == dst.scalar_type() ||
                    (src.is_floating_point() && dst.is_floating_point()),
                "load_state: tensor '", name, "' is ", src.scalar_type(), " in the file but ",
                dst.scalar_type(), " in the module");
  }
  torch::NoGradGuard no_grad;
  for (const auto& [name, src] : source) targets.at(name).copy_(src);
  return report;
}

LoadStateReport load_state(torch::nn::Module& module, const std::string& path, bool strict,
                           const std::string& prefix) {
  const auto file = load_safetensors(path);
  try {
    return load_state(module, file.tensors, strict, prefix);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "'", path, "': ", e.what_without_backtrace());
  }
}

}  // namespace fastattn
