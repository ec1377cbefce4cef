// safetensors files (https://huggingface.co/docs/safetensors): read, write,
// validate, and load into a module by parameter name.
//
// Format: 8 bytes little-endian u64 N, then N bytes of UTF-8 JSON
//   {"<name>": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]},
//    ..., "__metadata__": {"<key>": "<string value>", ...}}
// then the data section; offsets are relative to its start, the data is
// row-major little-endian, and the tensors tile the data section with no
// gaps or overlaps (the Hugging Face reader's rule). Dtypes: F64, F32, F16,
// BF16, I64, I32, I16, I8, U8, BOOL.
//
//   fastattn::save_safetensors("w.safetensors", {{"w", torch::randn({2, 3})}}, {{"step", "7"}});
//   auto file = fastattn::load_safetensors("w.safetensors");   // file.tensors.at("w")
//   fastattn::load_state(*model, "w.safetensors");              // by parameter name
//
// Every problem (short file, header length out of bounds, bad JSON, unknown
// dtype, shape/offset mismatch, offsets past the end, overlaps, gaps) throws a
// c10::Error naming the file and what is wrong.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace fastattn {

// Largest JSON header accepted (the Hugging Face reader's limit is 100 MB).
constexpr uint64_t kSafetensorsMaxHeaderBytes = 100u * 1000u * 1000u;

struct SafetensorsFile {
  std::map<std::string, torch::Tensor> tensors;  // contiguous CPU tensors
  std::map<std::string, std::string> metadata;   // "__metadata__", if any
};

// "F32" etc. for a dtype; throws for dtypes safetensors cannot hold here.
std::string safetensors_dtype_name(torch::ScalarType dtype);
// The dtype for "F32" etc.; throws naming `context` for an unknown name.
torch::ScalarType safetensors_dtype(const std::string& name, const std::string& context = "");

// The file's bytes for `tensors` (any device/layout: copied to contiguous CPU)
// and `metadata`. Tensors are laid out in name order.
std::string safetensors_bytes(const std::map<std::string, torch::Tensor>& tensors,
                              const std::map<std::string, std::string>& metadata = {});

// Parses and validates bytes of a safetensors file; `source` names it in errors.
SafetensorsFile parse_safetensors(const std::string& bytes, const std::string& source);

// Writes the file atomically: to a temporary file in the same directory,
// fsync, rename over `path`, fsync the directory. A crash leaves either the
// old file or the new one, never a half-written `path`.
void save_safetensors(const std::string& path, const std::map<std::string, torch::Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

// Reads and validates a whole file.
SafetensorsFile load_safetensors(const std::string& path);

// Writes the bytes to `path` atomically (as save_safetensors does).
void write_file_atomically(const std::string& path, const std::string& bytes);

// ---- modules -------------------------------------------------------------------

// The module's parameters and buffers by their dotted names.
std::map<std::string, torch::Tensor> state_tensors(const torch::nn::Module& module);

// save_safetensors(path, state_tensors(module), metadata).
void save_state(const torch::nn::Module& module, const std::string& path,
                const std::map<std::string, std::string>& metadata = {});

struct LoadStateReport {
  std::vector<std::string> missing;     // in the module, not in the file
  std::vector<std::string> unexpected;  // in the file, not in the module
};

// Copies tensors from `tensors` into the module's parameters and buffers of
// the same name (converting dtype where both are floating point, never
// changing shapes). A shape mismatch or a non-float/float dtype mismatch is
// always an error naming the tensor; with `strict`, missing or unexpected
// names are errors too (listing them). `prefix` is stripped from file names
// first (e.g. "bert."); names without it count as unexpected.
LoadStateReport load_state(torch::nn::Module& module,
                           const std::map<std::string, torch::Tensor>& tensors, bool strict = true,
                           const std::string& prefix = "");
LoadStateReport load_state(torch::nn::Module& module, const std::string& path, bool strict = true,
                           const std::string& prefix = "");

}  // namespace fastattn
