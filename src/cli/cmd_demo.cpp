// `fastattn demo` (what `make demo` runs): a short tour on synthetic data.
//   (a) the registered attention types
//   (b) the fused full attention against the plain-ATen reference (float64 and
//       float32 outputs, masks, gradients)
//   (c) fused vs reference time and peak memory at a few lengths, and the
//       memory the reference's L×S scores need
//   (d) every registered type at one length: forward and forward+backward
//       time, each against full attention
//   (e) a small encoder from EncoderBuilder: forward and backward
//   (f) where to go next
// Every computing step runs in a forked child (see measure.h): the parent
// never starts LibTorch's OpenMP threads, which do not survive fork.
// A few minutes on 2 cores; `--quick` shortens (c).
#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <iostream>

#include "cli/command.h"
#include "cli/measure.h"
#include "fastattn/mask.h"
#include "fastattn/ops.h"
#include "fastattn/registry.h"
#include "fastattn/transformer.h"

namespace fastattn::cli {
namespace {

std::string sci(double x) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2e", x);
  return buf;
}

double max_abs(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kDouble) - b.to(torch::kDouble)).abs().max().item<double>();
}

// (b): one row per check: what, dtype, max |fused - reference|, tolerance.
nlohmann::json check_against_reference() {
  torch::manual_seed(0);
  const int64_t N = 2, H = 3, L = 97, S = 131, E = 33, M = 17;  // awkward sizes on purpose
  auto f64 = torch::TensorOptions().dtype(torch::kDouble);
  const auto q = torch::randn({N, H, L, E}, f64);
  const auto k = torch::randn({N, H, S, E}, f64);
  const auto v = torch::randn({N, H, S, M}, f64);
  const auto lengths = torch::tensor(std::vector<int64_t>{S, 60});  // (N,)
  const auto bool_mask = torch::rand({L, S}, f64) > 0.3;            // (L, S), true = keep
  const auto add_mask = torch::randn({N, 1, L, S}, f64) * 0.5;      // (N, 1, L, S), additive

  struct Case {
    std::string name;
    std::optional<torch::Tensor> mask, lengths;
    bool causal;
  };
  const std::vector<Case> cases = {
      {"no mask", std::nullopt, std::nullopt, false},
      {"causal (S > L, bottom-right) + key lengths", std::nullopt, lengths, true},
      {"boolean mask (L, S)", bool_mask, std::nullopt, false},
      {"additive mask (N, 1, L, S)", add_mask, std::nullopt, false},
  };
  nlohmann::json rows = nlohmann::json::array();
  for (const auto& c : cases) {
    const auto ref = reference::full_attention(q, k, v, c.mask, c.lengths, c.causal);
    const auto out64 = full_attention(q, k, v, c.mask, c.lengths, c.causal);
    rows.push_back(
        {{"check", c.name}, {"dtype", "float64"}, {"error", max_abs(out64, ref)}, {"tol", 1e-10}});
    std::optional<torch::Tensor> mask32;
    if (c.mask) mask32 = c.mask->is_floating_point() ? c.mask->to(torch::kFloat) : *c.mask;
    const auto out32 = full_attention(q.to(torch::kFloat), k.to(torch::kFloat), v.to(torch::kFloat),
                                      mask32, c.lengths, c.causal);
    rows.push_back(
        {{"check", c.name}, {"dtype", "float32"}, {"error", max_abs(out32, ref)}, {"tol", 2e-5}});
  }
  // Gradients: the fused backward against autograd through the reference.
  auto grads = [&](bool fused) {
    auto qg = q.clone().requires_grad_(true), kg = k.clone().requires_grad_(true),
         vg = v.clone().requires_grad_(true);
    auto out = fused ? full_attention(qg, kg, vg, std::nullopt, lengths, true)
                     : reference::full_attention(qg, kg, vg, std::nullopt, lengths, true);
    out.backward(torch::ones_like(out));
    return std::vector<torch::Tensor>{qg.grad(), kg.grad(), vg.grad()};
  };
  const auto gf = grads(true), gr = grads(false);
  double gerr = 0;
  for (size_t i = 0; i < gf.size(); ++i) gerr = std::max(gerr, max_abs(gf[i], gr[i]));
  rows.push_back({{"check", "gradients dq, dk, dv (causal + key lengths)"},
                  {"dtype", "float64"},
                  {"error", gerr},
                  {"tol", 1e-9}});
  return rows;
}

// (c): fused and reference at one length: median times and peak growth.
nlohmann::json time_one_length(int64_t L, int64_t repeat, bool with_reference) {
  torch::manual_seed(0);
  const int64_t N = 1, H = 8, E = 64;
  const auto q = torch::randn({N, H, L, E}), k = torch::randn({N, H, L, E}),
             v = torch::randn({N, H, L, E});
  torch::NoGradGuard no_grad;
  nlohmann::json out;
  auto fused = [&] { auto o = full_attention(q, k, v); };
  auto fused_times = time_ms(fused, repeat, repeat > 1 ? 1 : 0);
  out["fused_ms"] = median(fused_times);
  auto fused_peak = measure_peak_growth(fused);
  out["fused_peak"] = fused_peak ? nlohmann::json(*fused_peak) : nlohmann::json();
  if (with_reference) {
    auto ref = [&] { auto o = reference::full_attention(q, k, v); };
    out["reference_ms"] = median(time_ms(ref, repeat));
    auto ref_peak = measure_peak_growth(ref);
    out["reference_peak"] = ref_peak ? nlohmann::json(*ref_peak) : nlohmann::json();
    out["max_error"] = max_abs(full_attention(q, k, v), reference::full_attention(q, k, v));
  }
  return out;
}

// (d): every registered type with its default parameters at one length (a
// position bias covering it)
// (causal for the causal-* types): median forward and forward+backward times.
nlohmann::json time_every_type(int64_t L, int64_t repeat) {
  torch::manual_seed(0);
  const int64_t N = 1, H = 8, E = 64;
  AttentionDims dims;
  dims.heads = H;
  dims.query_dim = E;
  dims.value_dim = E;
  const auto q = torch::randn({N, H, L, E}), k = torch::randn({N, H, L, E}),
             v = torch::randn({N, H, L, E});
  std::vector<std::pair<std::string, bool>> cases;  // (type, causal)
  for (const auto& name : AttentionRegistry::global().names()) {
    cases.emplace_back(name, name.rfind("causal-", 0) == 0);
    if (name == "full") cases.emplace_back(name, true);  // the causal types' yardstick
  }
  auto qg = q.clone().requires_grad_(), kg = k.clone().requires_grad_(),
       vg = v.clone().requires_grad_();
  // The forward and forward+backward of a type, with the mask of its causality.
  struct Passes {
    std::function<void()> forward, forward_backward;
  };
  auto passes = [&](const AttentionPtr& attn, bool causal) {
    const Mask mask = Mask().with_causal(causal);
    Passes p;
    p.forward = [=] {
      torch::NoGradGuard no_grad;
      attn->forward(q, k, v, mask);
      attn->take_auxiliary_loss();
    };
    p.forward_backward = [=] {
      auto loss = attn->forward(qg, kg, vg, mask).sum();
      auto aux = attn->take_auxiliary_loss();
      if (aux.defined()) loss = loss + aux;
      loss.backward();
    };
    return p;
  };
  // Full attention is timed in turn with each type (alternated_ms), so that
  // each "x full" compares the same minutes of the machine: timed one type
  // after another, a busy VM moved single ratios by 1.5x and more.
  const auto full = make_attention("full", {}, dims);
  const Passes full_passes[2] = {passes(full, false), passes(full, true)};
  nlohmann::json rows = nlohmann::json::array();
  for (const auto& [name, causal] : cases) {
    const Passes& yardstick = full_passes[causal ? 1 : 0];
    nlohmann::json row = {{"type", name}, {"causal", causal}};
    if (name == "full") {
      row["forward_ms"] = row["full_forward_ms"] = median(time_ms(yardstick.forward, repeat));
      row["backward_ms"] = row["full_backward_ms"] =
          median(time_ms(yardstick.forward_backward, repeat));
    } else {
      // Types with a learned position bias (aft-full) sized for this length.
      ParamMap params;
      for (const auto& spec : AttentionRegistry::global().get(name).params)
        if (spec.name == "max_sequence_length") params[spec.name] = L;
      const Passes own = passes(make_attention(name, params, dims), causal);
      const auto fwd = alternated_ms(own.forward, yardstick.forward, repeat);
      const auto fb = alternated_ms(own.forward_backward, yardstick.forward_backward, repeat);
      row["forward_ms"] = median(fwd.first);
      row["full_forward_ms"] = median(fwd.second);
      row["backward_ms"] = median(fb.first);
      row["full_backward_ms"] = median(fb.second);
    }
    rows.push_back(row);
  }
  return rows;
}

// (e): a 2-layer encoder on random data with padding, forward and backward.
nlohmann::json encoder_step() {
  torch::manual_seed(0);
  auto encoder =
      EncoderBuilder().layers(2).heads(4).d_model(128).dropout(0.1).attention("full", {}).build();
  encoder->train();
  int64_t n_params = 0;
  for (const auto& p : encoder->parameters()) n_params += p.numel();
  const auto x = torch::randn({4, 256, 128});                                   // (N, L, D)
  const auto lengths = torch::tensor(std::vector<int64_t>{256, 200, 128, 64});  // (N,)
  const auto target = torch::randn({4, 256, 128});                              // (N, L, D)
  const auto mask = Mask().with_key_lengths(lengths);
  const auto t0 = std::chrono::steady_clock::now();
  auto y = encoder->forward(x, mask);
  const auto t1 = std::chrono::steady_clock::now();
  auto loss = (y - target).pow(2).mean();
  loss.backward();
  const auto t2 = std::chrono::steady_clock::now();
  int64_t with_grad = 0, total = 0;
  double grad_sq = 0;
  for (const auto& p : encoder->parameters()) {
    ++total;
    if (p.grad().defined() && p.grad().abs().sum().item<double>() > 0) ++with_grad;
    if (p.grad().defined()) grad_sq += p.grad().pow(2).sum().item<double>();
  }
  return {{"params", n_params},
          {"output_shape", std::vector<int64_t>(y.sizes().begin(), y.sizes().end())},
          {"loss", loss.item<double>()},
          {"forward_ms", std::chrono::duration<double, std::milli>(t1 - t0).count()},
          {"backward_ms", std::chrono::duration<double, std::milli>(t2 - t1).count()},
          {"tensors_with_grad", with_grad},
          {"tensors", total},
          {"grad_norm", std::sqrt(grad_sq)},
          {"finite", torch::isfinite(y).all().item<bool>()}};
}

class DemoCommand : public Command {
 public:
  DemoCommand()
      : Command("demo", "a short tour on synthetic data (what `make demo` runs)",
                "Lists the attention types, checks the fused full attention against the\n"
                "plain-ATen reference, times both at a few lengths with their peak memory,\n"
                "times every attention type at one length, builds a small encoder and runs\n"
                "forward and backward. A few minutes on 2 cores. Every step runs in a\n"
                "forked child process.\n\n"
                "examples:\n"
                "  fastattn demo\n"
                "  fastattn demo --quick --threads 1\n") {}
  std::vector<FlagSpec> flags() const override {
    return {FlagSpec::boolean("quick", "shorter timings: lengths 256 and 1024, one repeat")};
  }

  int run(const Args& args) override {
    const bool quick = args.get_bool("quick");
    const int64_t threads = args.get_int("threads", 1);
    int problems = 0;
    std::cout << "fastattn demo (" << threads << " threads; change with --threads N)\n";

    // (a)
    std::cout << "\n(a) Attention types in the registry (details: fastattn list)\n";
    const auto d = AttentionRegistry::global().describe();
    for (const auto& t : d.value("types", nlohmann::json::array())) {
      std::cout << "  " << t.value("name", "?") << ": " << t.value("description", "") << "\n";
    }
    for (const auto& t : d.value("decorators", nlohmann::json::array())) {
      std::cout << "  " << t.value("name", "?") << ": " << t.value("description", "") << "\n";
    }

    // (b)
    std::cout << "\n(b) Fused full attention vs the plain-ATen reference (N=2 H=3 L=97 S=131 "
                 "E=33 M=17;\n    reference in float64)\n"
              << std::flush;
    const auto checks = run_in_child(check_against_reference);
    if (checks.is_object() && checks.contains("error")) {
      std::cout << "  failed: " << checks["error"].get<std::string>() << "\n";
      ++problems;
    } else {
      std::vector<std::vector<std::string>> rows;
      for (const auto& r : checks) {
        const bool ok = r["error"].get<double>() <= r["tol"].get<double>();
        problems += ok ? 0 : 1;
        rows.push_back({r["check"].get<std::string>(), r["dtype"].get<std::string>(),
                        sci(r["error"].get<double>()), sci(r["tol"].get<double>()),
                        ok ? "ok" : "TOO LARGE"});
      }
      std::cout << indent(format_table({"check", "dtype", "max abs error", "tolerance", ""}, rows,
                                       {false, false, true, true, false}));
    }

    // (c)
    const std::vector<int64_t> lengths =
        quick ? std::vector<int64_t>{256, 1024} : std::vector<int64_t>{512, 1024, 2048, 4096};
    const int64_t repeat = quick ? 1 : 3;
    std::cout << "\n(c) Time and memory, forward, N=1 H=8 E=M=64 float32, L = S, median of "
              << repeat << (repeat > 1 ? " after 1 warm-up" : "") << "\n"
              << "    peak = growth of peak resident memory during one call, beyond the inputs;\n"
              << "    scores = the L x S matrix the reference materialises (N*H*L*S*4 bytes)\n";
    const std::vector<std::string> header = {"L",        "fused ms",   "reference ms",
                                             "speed-up", "fused peak", "reference peak",
                                             "scores",   "max error"};
    const std::vector<size_t> widths = {6, 9, 12, 8, 10, 14, 9, 9};
    print_fixed_row(header, widths);
    for (int64_t L : lengths) {
      const auto r = run_in_child([&] { return time_one_length(L, repeat, true); });
      if (r.contains("error") && r["error"].is_string()) {
        std::cout << "  L=" << L << " failed: " << r["error"].get<std::string>() << "\n";
        ++problems;
        continue;
      }
      const double f = r["fused_ms"].get<double>(), ref = r["reference_ms"].get<double>();
      print_fixed_row({std::to_string(L), format_fixed(f, 1), format_fixed(ref, 1),
                       format_fixed(ref / f, 1) + "x", bytes_or_na(r["fused_peak"]),
                       bytes_or_na(r["reference_peak"]), format_bytes(8.0 * L * L * 4),
                       sci(r["max_error"].get<double>())},
                      widths);
    }
    const int64_t long_L = quick ? 4096 : 16384;
    std::cout << "    fused only at L=" << long_L << " (one call, no warm-up): " << std::flush;
    const auto r = run_in_child([&] { return time_one_length(long_L, 1, false); });
    if (r.contains("error") && r["error"].is_string()) {
      std::cout << "failed: " << r["error"].get<std::string>() << "\n";
      ++problems;
    } else {
      std::cout << format_fixed(r["fused_ms"].get<double>(), 0) << " ms, peak "
                << bytes_or_na(r["fused_peak"]) << "; the reference's scores alone would be "
                << format_bytes(8.0 * long_L * long_L * 4) << "\n";
    }

    // (d)
    const int64_t types_L = quick ? 1024 : 4096;
    std::cout << "\n(d) Every attention type with its default parameters, N=1 H=8 E=M=64 float32,\n"
              << "    L = S = " << types_L << " (causal for causal-*), median of " << repeat
              << "; x full = full attention's time\n    (same causality, timed in turn with the "
                 "type) / the type's\n"
              << std::flush;
    const auto every = run_in_child([&] { return time_every_type(types_L, repeat); });
    if (every.is_object() && every.contains("error")) {
      std::cout << "  failed: " << every["error"].get<std::string>() << "\n";
      ++problems;
    } else {
      std::vector<std::vector<std::string>> rows;
      for (const auto& r : every) {
        const bool c = r["causal"].get<bool>();
        const double f = r["forward_ms"].get<double>(), b = r["backward_ms"].get<double>();
        const double x_f = r["full_forward_ms"].get<double>() / f,
                     x_b = r["full_backward_ms"].get<double>() / b;
        const std::string label =
            r["type"].get<std::string>() + (c && r["type"] == "full" ? " (causal)" : "");
        rows.push_back({label, format_fixed(f, 1), format_fixed(x_f, 1) + "x", format_fixed(b, 1),
                        format_fixed(x_b, 1) + "x"});
      }
      std::cout << indent(format_table({"type", "forward ms", "x full", "fwd+bwd ms", "x full"},
                                       rows, {false, true, true, true, true}));
    }

    // (e)
    std::cout << "\n(e) EncoderBuilder: 2 layers, 4 heads, d_model 128, full attention, dropout "
                 "0.1;\n    x (4, 256, 128) with key lengths 256, 200, 128, 64; loss = mean((y - "
                 "t)^2), t random\n"
              << std::flush;
    const auto e = run_in_child(encoder_step);
    if (e.contains("error") && e["error"].is_string()) {
      std::cout << "  failed: " << e["error"].get<std::string>() << "\n";
      ++problems;
    } else {
      const bool ok = e["finite"].get<bool>() && e["tensors_with_grad"] == e["tensors"];
      problems += ok ? 0 : 1;
      std::cout << "  parameters: " << e["params"].get<int64_t>() << "; output "
                << e["output_shape"].dump() << "; loss " << format_fixed(e["loss"].get<double>(), 4)
                << "\n  forward " << format_fixed(e["forward_ms"].get<double>(), 1)
                << " ms, backward " << format_fixed(e["backward_ms"].get<double>(), 1)
                << " ms; gradient norm " << format_fixed(e["grad_norm"].get<double>(), 4) << "; "
                << e["tensors_with_grad"].get<int64_t>() << " of " << e["tensors"].get<int64_t>()
                << " parameter tensors got a gradient" << (ok ? "" : "  <-- PROBLEM") << "\n";
    }

    // (f)
    std::cout << "\n(f) Next\n"
              << "  fastattn list                      every type, its parameters and ranges\n"
              << "  fastattn bench --help              time any type: --attention "
                 "full,full:softmax_temp=0.1\n"
              << "  fastattn bench --length 1024,4096 --pass both --json out.json\n"
              << "  PYTHONPATH=python /usr/bin/python3 -c 'import fastattn'   (docs/python.md)\n"
              << "  docs/cli.md, docs/python.md, README.md; make test runs every test\n";
    if (problems > 0) {
      std::cout << "\ndemo: " << problems << " problem(s) above\n";
      return 1;
    }
    std::cout << "\ndemo: all checks passed\n";
    return 0;
  }

 private:
  static std::string indent(const std::string& text) {
    std::string out = "  ";
    for (size_t i = 0; i < text.size(); ++i) {
      out += text[i];
      if (text[i] == '\n' && i + 1 < text.size()) out += "  ";
    }
    return out;
  }
  static std::string bytes_or_na(const nlohmann::json& j) {
    return j.is_number() ? format_bytes(j.get<double>()) : "n/a";
  }
  static void print_fixed_row(const std::vector<std::string>& cells,
                              const std::vector<size_t>& widths) {
    std::string line = "  ";
    for (size_t i = 0; i < cells.size(); ++i) {
      if (i > 0) line += "  ";
      line += std::string(widths[i] > cells[i].size() ? widths[i] - cells[i].size() : 0, ' ') +
              cells[i];
    }
    std::cout << line << std::endl;
  }
};

FASTATTN_REGISTER_COMMAND(DemoCommand);

}  // namespace
}  // namespace fastattn::cli
