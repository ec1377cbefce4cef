// `fastattn bench`: times attention types over sequence lengths on random
// data, with peak memory, GFLOP/s (full attention) and the max abs error
// against exact attention. Each (type, length) case runs in its own forked
// child process (see measure.h for why and how memory is measured).
//
//   fastattn bench --attention full,full:softmax_temp=0.1 --length 1024,4096 --pass both
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iostream>

#include "cli/attention_spec.h"
#include "cli/command.h"
#include "cli/measure.h"
#include "fastattn/attention.h"
#include "fastattn/mask.h"
#include "fastattn/ops.h"
#include "fastattn/registry.h"

namespace fastattn::cli {
namespace {

struct BenchConfig {
  std::vector<AttentionSpec> specs;
  std::vector<int64_t> lengths;
  int64_t batch = 1, heads = 8, dim = 64;
  bool forward = true, backward = false;
  bool causal = false;
  int64_t repeat = 3;
  torch::ScalarType dtype = torch::kFloat;
  std::string dtype_name = "float32";
  int64_t error_max_length = 4096;
  int64_t seed = 0;
  int64_t threads = 1;
};

// Query-key pairs a query attends to: L·S, or under the bottom-right causal
// alignment (query i keeps key j iff j <= i + S - L) the kept ones only.
double kept_pairs(int64_t L, int64_t S, bool causal) {
  if (!causal) return static_cast<double>(L) * static_cast<double>(S);
  double n = 0;
  for (int64_t i = 0; i < L; ++i)
    n += static_cast<double>(std::clamp<int64_t>(i + S - L + 1, 0, S));
  return n;
}

// Nominal FLOPs, defined for `full` only: forward 4·N·H·pairs·E (QK^T and PV,
// E = M); "backward" records time forward + backward and count 3.5× the
// forward (the backward as 2.5× the forward: recomputed scores, dV, dP, dQ,
// dK), as FlashAttention's benchmarks do.
std::optional<double> nominal_flops(const BenchConfig& c, const std::string& type, int64_t L,
                                    bool backward) {
  if (type != "full") return std::nullopt;
  const double fwd =
      4.0 * static_cast<double>(c.batch * c.heads * c.dim) * kept_pairs(L, L, c.causal);
  return backward ? 3.5 * fwd : fwd;
}

// One (type, length) case, run inside the child: timings, memory and error
// for each requested pass.
nlohmann::json run_case(const BenchConfig& c, const AttentionSpec& spec, int64_t L) {
  torch::manual_seed(static_cast<uint64_t>(c.seed));
  const auto opts = torch::TensorOptions().dtype(c.dtype);
  const auto q = torch::randn({c.batch, c.heads, L, c.dim}, opts);  // (N, H, L, E)
  const auto k = torch::randn({c.batch, c.heads, L, c.dim}, opts);  // (N, H, S, E)
  const auto v = torch::randn({c.batch, c.heads, L, c.dim}, opts);  // (N, H, S, M)
  AttentionDims dims;
  dims.heads = c.heads;
  dims.query_dim = c.dim;
  dims.value_dim = c.dim;
  AttentionPtr attn = AttentionRegistry::global().build(spec.type, spec.params, dims);
  attn->to(c.dtype);  // learned parameters (ClusterFormer) in the inputs' dtype
  const Mask mask = Mask().with_causal(c.causal);
  nlohmann::json out = nlohmann::json::object();

  if (c.forward) {
    attn->eval();
    auto run = [&] {
      torch::NoGradGuard no_grad;
      auto o = attn->forward(q, k, v, mask);
    };
    auto times = time_ms(run, c.repeat);
    auto mem = measure_peak_growth(run);
    out["forward"] = {{"times_ms", times},
                      {"time_ms", median(times)},
                      {"peak_memory_bytes", mem ? nlohmann::json(*mem) : nlohmann::json()}};
  }
  if (c.backward) {
    attn->train();
    auto qg = q.clone().requires_grad_(true);
    auto kg = k.clone().requires_grad_(true);
    auto vg = v.clone().requires_grad_(true);
    const auto grad_out = torch::randn({c.batch, c.heads, L, c.dim}, opts);  // (N, H, L, M)
    auto run = [&] {
      for (auto* t : {&qg, &kg, &vg}) t->mutable_grad().reset();
      attn->zero_grad();
      auto o = attn->forward(qg, kg, vg, mask);
      o.backward(grad_out);
    };
    auto times = time_ms(run, c.repeat);
    for (auto* t : {&qg, &kg, &vg}) t->mutable_grad().reset();
    auto mem = measure_peak_growth(run);
    out["backward"] = {{"times_ms", times},
                       {"time_ms", median(times)},
                       {"peak_memory_bytes", mem ? nlohmann::json(*mem) : nlohmann::json()}};
  }
  if (L <= c.error_max_length) {
    torch::NoGradGuard no_grad;
    attn->eval();
    const auto o = attn->forward(q, k, v, mask);
    // `full` itself is compared with the plain-ATen oracle (otherwise it would
    // be compared with itself); every other type with the fused full attention.
    const auto exact =
        spec.type == "full"
            ? reference::full_attention(q, k, v, std::nullopt, std::nullopt, c.causal)
            : full_attention(q, k, v, std::nullopt, std::nullopt, c.causal);
    out["max_abs_error"] = (o - exact).abs().max().item<double>();
  }
  return out;
}

class BenchCommand : public Command {
 public:
  BenchCommand()
      : Command(
            "bench", "time attention types over lengths: time, peak memory, GFLOP/s, error vs full",
            "Runs each attention type at each length on random N(0,1) data (L = S, E = M =\n"
            "--dim) and prints one row per (type, length, pass) as it finishes.\n\n"
            "Attention specs (--attention, comma-separated):\n"
            "  TYPE[:PARAM=VALUE[:PARAM=VALUE...]]   e.g. full:softmax_temp=0.125\n"
            "  conditional-full:TYPE[:PARAM=VALUE...] (segments without '=' name the type)\n"
            "  See `fastattn list` for the types and their parameters.\n\n"
            "Columns:\n"
            "  time ms   median of --repeat timed calls after one untimed warm-up; 'backward'\n"
            "            times forward + backward (module in training mode; forward runs in\n"
            "            evaluation mode without autograd)\n"
            "  GFLOP/s   for `full` only: forward 4*N*H*P*E FLOPs, P the attended query-key\n"
            "            pairs (L*S, or fewer when causal); backward rows count 3.5x that\n"
            "  peak mem  growth of the process's peak resident memory during one more call,\n"
            "            beyond the inputs: each case runs in a forked child, which trims\n"
            "            malloc, resets VmHWM (/proc/self/clear_refs) and reads VmHWM - VmRSS\n"
            "  max err   max |out - exact| in the run's dtype, for L <= --error-max-length;\n"
            "            exact = fastattn::full_attention (for `full` itself: the plain-ATen\n"
            "            reference, so the column checks the fused kernel)\n\n"
            "examples:\n"
            "  fastattn bench\n"
            "  fastattn bench --attention full --length 512,1024,2048 --pass both --causal\n"
            "  fastattn --threads 1 bench --attention full:softmax_temp=0.1 --dtype float64 \\\n"
            "      --repeat 5 --json results.json\n") {}
  std::vector<FlagSpec> flags() const override {
    return {
        FlagSpec::value("attention", "SPECS", "attention types to time, comma-separated", "full"),
        FlagSpec::value("length", "LIST", "sequence lengths L = S, comma-separated", "1024,4096"),
        FlagSpec::value("batch", "N", "batch size", "1"),
        FlagSpec::value("heads", "H", "heads", "8"),
        FlagSpec::value("dim", "E", "head dim of queries, keys and values (E = M)", "64"),
        FlagSpec::value("pass", "P", "forward, backward (times forward+backward) or both",
                        "forward"),
        FlagSpec::boolean("causal", "causal masking"),
        FlagSpec::value("repeat", "R", "timed calls per case (median reported)", "3"),
        FlagSpec::value("dtype", "T", "float32, float64 or bfloat16", "float32"),
        FlagSpec::value("error-max-length", "L",
                        "compute the error against full attention only up to this length", "4096"),
        FlagSpec::value("seed", "S", "seed of the random inputs and types", "0"),
        FlagSpec::value("json", "FILE", "also write the records to FILE as a JSON array"),
    };
  }

  int run(const Args& args) override {
    BenchConfig c;
    for (const auto& s : args.get_list("attention", {"full"})) {
      c.specs.push_back(parse_attention_spec(s));
    }
    c.lengths = args.get_int_list("length", {1024, 4096});
    for (auto L : c.lengths) {
      if (L < 1) throw UsageError("--length values must be >= 1, got " + std::to_string(L));
    }
    c.batch = args.get_int("batch", 1);
    c.heads = args.get_int("heads", 8);
    c.dim = args.get_int("dim", 64);
    for (auto [n, x] :
         {std::pair<const char*, int64_t>{"batch", c.batch}, {"heads", c.heads}, {"dim", c.dim}}) {
      if (x < 1)
        throw UsageError(std::string("--") + n + " must be >= 1, got " + std::to_string(x));
    }
    const std::string pass = args.get("pass", "forward");
    if (pass == "forward") {
      c.forward = true;
    } else if (pass == "backward") {
      c.forward = false;
      c.backward = true;
    } else if (pass == "both") {
      c.forward = c.backward = true;
    } else {
      throw UsageError("--pass must be forward, backward or both, got '" + pass + "'");
    }
    c.causal = args.get_bool("causal");
    c.repeat = args.get_int("repeat", 3);
    if (c.repeat < 1) throw UsageError("--repeat must be >= 1, got " + std::to_string(c.repeat));
    c.dtype_name = args.get("dtype", "float32");
    if (c.dtype_name == "float32") {
      c.dtype = torch::kFloat;
    } else if (c.dtype_name == "float64") {
      c.dtype = torch::kDouble;
    } else if (c.dtype_name == "bfloat16") {
      c.dtype = torch::kBFloat16;
    } else {
      throw UsageError("--dtype must be float32, float64 or bfloat16, got '" + c.dtype_name + "'");
    }
    c.error_max_length = args.get_int("error-max-length", 4096);
    c.seed = args.get_int("seed", 0);
    c.threads = args.get_int("threads", 1);
    const std::string json_path = args.get("json");
    std::ofstream json_file;
    if (!json_path.empty()) {
      json_file.open(json_path);
      if (!json_file) throw std::runtime_error("cannot write --json file '" + json_path + "'");
    }

    std::cout << "bench: N=" << c.batch << " H=" << c.heads << " E=M=" << c.dim << " "
              << c.dtype_name << (c.causal ? " causal" : "") << ", " << c.threads
              << " threads, CPU kernels " << cpu_capability() << ", median of " << c.repeat
              << " after 1 warm-up\n\n";
    size_t label_w = std::string("attention").size();
    for (const auto& s : c.specs) label_w = std::max(label_w, s.text.size());
    const std::vector<size_t> widths = {label_w, 7, 8, 11, 9, 11, 9};
    const std::vector<std::string> header = {"attention", "L",        "pass",   "time ms",
                                             "GFLOP/s",   "peak mem", "max err"};
    auto print_row = [&](const std::vector<std::string>& cells) {
      std::string line;
      for (size_t i = 0; i < cells.size(); ++i) {
        const std::string& s = cells[i];
        const std::string pad(widths[i] > s.size() ? widths[i] - s.size() : 0, ' ');
        if (i > 0) line += "  ";
        line += (i == 0 || i == 2) ? s + pad : pad + s;
      }
      std::cout << line << std::endl;
    };
    print_row(header);
    std::vector<std::string> rule;
    for (size_t w : widths) rule.push_back(std::string(w, '-'));
    print_row(rule);

    nlohmann::json records = nlohmann::json::array();
    int failures = 0;
    for (const auto& spec : c.specs) {
      for (int64_t L : c.lengths) {
        const auto result = run_in_child([&] { return run_case(c, spec, L); });
        std::vector<std::string> passes;
        if (c.forward) passes.push_back("forward");
        if (c.backward) passes.push_back("backward");
        for (const auto& p : passes) {
          nlohmann::json params = nlohmann::json::object();
          for (const auto& kv : spec.params) {
            std::visit([&](const auto& x) { params[kv.first] = x; }, kv.second);
          }
          nlohmann::json rec = {{"attention", spec.text},
                                {"type", spec.type},
                                {"params", params},
                                {"batch", c.batch},
                                {"heads", c.heads},
                                {"length", L},
                                {"dim", c.dim},
                                {"dtype", c.dtype_name},
                                {"causal", c.causal},
                                {"pass", p},
                                {"threads", c.threads},
                                {"repeat", c.repeat},
                                {"cpu_capability", cpu_capability()}};
          if (result.contains("error")) {
            rec["error"] = result["error"];
            ++failures;
            print_row({spec.text, std::to_string(L), p, "failed", "", "", ""});
            std::cout << "  error: " << result["error"].get<std::string>() << std::endl;
            records.push_back(rec);
            continue;
          }
          const auto& r = result[p];
          const double t = r["time_ms"].get<double>();
          rec["time_ms"] = t;
          rec["times_ms"] = r["times_ms"];
          rec["peak_memory_bytes"] = r["peak_memory_bytes"];
          const auto flops = nominal_flops(c, spec.type, L, p == "backward");
          rec["gflops"] = flops ? nlohmann::json(*flops / (t * 1e6)) : nlohmann::json();
          rec["max_abs_error"] =
              result.contains("max_abs_error") ? result["max_abs_error"] : nlohmann::json();
          char err[32] = "-";
          if (rec["max_abs_error"].is_number()) {
            std::snprintf(err, sizeof(err), "%.2e", rec["max_abs_error"].get<double>());
          }
          print_row({spec.text, std::to_string(L), p, format_fixed(t, 2),
                     flops ? format_fixed(*flops / (t * 1e6), 1) : "-",
                     r["peak_memory_bytes"].is_number()
                         ? format_bytes(r["peak_memory_bytes"].get<double>())
                         : "n/a",
                     err});
          records.push_back(rec);
        }
      }
    }
    if (json_file.is_open()) {
      json_file << records.dump(2) << "\n";
      std::cout << "\nwrote " << records.size() << " records to " << json_path << "\n";
    }
    if (failures > 0) {
      std::cerr << "bench: " << failures << " record(s) failed\n";
      return 1;
    }
    return 0;
  }
};

FASTATTN_REGISTER_COMMAND(BenchCommand);

}  // namespace
}  // namespace fastattn::cli
