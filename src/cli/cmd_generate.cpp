// `fastattn generate`: autoregressive generation with a decoder-only language
// model (fastattn::CausalLanguageModel, randomly initialised) in its recurrent
// form; with --checkpoint DIR from a model trained by `fastattn train`, by its
// task type's generator (train::TaskGenerator; digits: images as ASCII / PGM,
// charlm: text; lm_tasks.h); with --bench the time per
// token at given positions for the attention type against a baseline (default: causal-linear
// against full attention with a key/value cache).
//
//   fastattn generate --prefix 1,2,3 --max-new-tokens 20 --temperature 0.8 --top-k 40
//   fastattn generate --bench --positions 1024,4096,16384,65536
//
// What --bench measures at position t (each (type, t) in its own forked
// child): the recurrent model's state is set to that of a sequence of t
// tokens without generating them — causal-linear: S (N,H,F,M) and Z (N,H,F)
// of one real step scaled by t (their size, and so the step's cost, does not
// depend on t); full: a key/value cache of t random rows per layer (the
// step's cost depends only on t); any other type: t real steps (exact but
// slow). Then 2 untimed steps (the full cache is copied once into buffers
// with room to grow), then --steps timed steps, each one token through the
// whole model (embedding, every layer, output projection); the median is
// reported. The attention column times the attention step alone (one layer's
// recurrent attention with a state of the same size).
#include <ATen/Parallel.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <iostream>
#include <sstream>

#include "cli/attention_spec.h"
#include "cli/task_flags.h"
#include "cli/command.h"
#include "cli/measure.h"
#include "fastattn/generation.h"
#include "fastattn/experiments/lm_tasks.h"
#include "fastattn/recurrent.h"

namespace fastattn::cli {
namespace {

struct ModelConfig {
  int64_t layers = 1, d_model = 512, heads = 8, d_ff = 2048, vocab = 256, seed = 0;
  torch::ScalarType dtype = torch::kFloat;
  std::string dtype_name = "float32";
};

EncoderBuilder encoder_builder(const ModelConfig& m, const AttentionSpec& spec) {
  return EncoderBuilder()
      .layers(m.layers)
      .heads(m.heads)
      .d_model(m.d_model)
      .feed_forward_dimensions(m.d_ff)
      .dropout(0.0)
      .attention(spec.type, spec.params);
}

RecurrentCausalLanguageModel make_model(const ModelConfig& m, const AttentionSpec& spec) {
  torch::manual_seed(static_cast<uint64_t>(m.seed));
  RecurrentCausalLanguageModel model(m.vocab, encoder_builder(m, spec));
  model->to(m.dtype);
  model->eval();
  return model;
}

double now_ms() {
  using clock = std::chrono::steady_clock;
  return std::chrono::duration<double, std::milli>(clock::now().time_since_epoch()).count();
}

int64_t state_bytes(const RecurrentState& s) {
  int64_t b = 0;
  // A growing cache holds {K, V, K buffer, V buffer, filled}: count the buffers.
  const size_t from = s.tensors.size() == 5 ? 2 : 0;
  for (size_t i = from; i < s.tensors.size(); ++i) b += s.tensors[i].nbytes();
  return b;
}

// One attention step's state at position t, of the shapes `type` uses.
// `one_step` is the state after one real step.
RecurrentState state_at(const std::string& type, const RecurrentState& one_step, int64_t t,
                        int64_t N, int64_t H, int64_t E, int64_t M, torch::ScalarType dtype) {
  if (type == "causal-linear") {
    return RecurrentState{{one_step.tensors[0] * static_cast<double>(t),
                           one_step.tensors[1] * static_cast<double>(t)}};
  }
  TORCH_CHECK(type == "full", "state_at: no shortcut for ", type);
  return RecurrentState{{torch::randn({N, H, t, E}, dtype), torch::randn({N, H, t, M}, dtype)}};
}

// The bench case (spec, position t), inside the child.
nlohmann::json bench_case(const ModelConfig& m, const AttentionSpec& spec, int64_t t,
                          int64_t steps) {
  torch::NoGradGuard no_grad;
  auto model = make_model(m, spec);
  const int64_t N = 1, H = m.heads, E = m.d_model / m.heads, M = E;
  const bool shortcut = spec.type == "causal-linear" || spec.type == "full";
  auto token = torch::zeros({N}, torch::kLong);
  LanguageModelState state;
  if (shortcut) {
    auto [l, one] = model->step(token, state);
    for (const auto& s : one.layers) {
      state.layers.push_back(state_at(spec.type, s, t, N, H, E, M, m.dtype));
    }
    state.position = t;
  } else {
    for (int64_t i = 0; i < t; ++i) state = model->step(token, state).second;
  }
  // Whole model: 2 untimed steps, then `steps` timed ones.
  for (int i = 0; i < 2; ++i) state = model->step(token, state).second;
  std::vector<double> times;
  for (int64_t i = 0; i < steps; ++i) {
    const double t0 = now_ms();
    auto [logits, next] = model->step(token, state);
    token = logits.argmax(-1);  // greedy: the next token depends on this step's output
    times.push_back(now_ms() - t0);
    state = std::move(next);
  }
  int64_t bytes = 0;
  for (const auto& s : state.layers) bytes += state_bytes(s);

  // The attention step alone.
  AttentionDims dims;
  dims.heads = H;
  dims.query_dim = E;
  dims.value_dim = M;
  auto attn = make_recurrent_attention(spec.type, spec.params, dims);
  attn->eval();
  auto q = torch::randn({N, H, E}, m.dtype), k = torch::randn({N, H, E}, m.dtype),
       v = torch::randn({N, H, M}, m.dtype);
  RecurrentState as;
  if (shortcut) {
    as = state_at(spec.type, attn->step(q, k, v, {}).second, t, N, H, E, M, m.dtype);
  } else {
    for (int64_t i = 0; i < t; ++i) as = attn->step(q, k, v, as).second;
  }
  for (int i = 0; i < 2; ++i) as = attn->step(q, k, v, as).second;
  std::vector<double> attn_times;
  for (int64_t i = 0; i < steps; ++i) {
    const double t0 = now_ms();
    auto [o, next] = attn->step(q, k, v, as);
    attn_times.push_back(now_ms() - t0);
    as = std::move(next);
  }
  return {{"ms_per_token", median(times)},
          {"times_ms", times},
          {"attention_ms", median(attn_times)},
          {"attention_times_ms", attn_times},
          {"state_bytes", bytes}};
}

std::string join_tokens(const torch::Tensor& row) {
  std::ostringstream os;
  for (int64_t i = 0; i < row.size(0); ++i) os << (i ? "," : "") << row[i].item<int64_t>();
  return os.str();
}

// One line per task type with a generator: its default --samples and own flags.
std::string generator_list() {
  std::string out;
  for (const auto& t : train::task_types()) {
    if (!t.generator.run) continue;
    std::string line =
        "  " + t.name + ": --samples N (default " + std::to_string(t.generator.default_count) + ")";
    for (const auto& f : t.generator.flags)
      line += ", --" + f.flag + (f.metavar.empty() ? "" : " " + f.metavar);
    out += line + "\n";
  }
  return out;
}

std::string generate_usage() {
  return "Builds a decoder-only language model (token embedding, sinusoidal positions,\n"
         "a causal encoder stack, output projection; fastattn::CausalLanguageModel) with\n"
         "random weights (--seed), and generates from --prefix token by token in its\n"
         "recurrent form (fastattn::generate). Prints the tokens and the time per token.\n\n"
         "--bench: for each position t in --positions and each of --attention and\n"
         "--baseline, sets the recurrent state to that of t tokens without generating\n"
         "them (causal-linear: the (S, Z) state of one real step scaled by t, whose size\n"
         "does not depend on t; full: a key/value cache of t random rows per layer; other\n"
         "types: t real steps), runs 2 untimed steps, then times --steps single-token\n"
         "steps of the whole model (median). 'attention ms' times one layer's attention\n"
         "step alone at the same position. Each case runs in a forked child.\n\n"
         "examples:\n"
         "  fastattn generate --prefix 1,2,3 --max-new-tokens 20 --greedy\n"
         "  fastattn generate --attention full --temperature 0.8 --top-k 40 --seed 3\n"
         "  fastattn generate --bench --positions 1024,4096,16384,65536 --json gen.json\n\n"
         "--checkpoint DIR: loads DIR/model.safetensors written by `fastattn train` and\n"
         "samples from it with its task type's generator, in the recurrent form (the\n"
         "batch model re-run over the prefix for types without one, or with --batch-form):\n" +
         generator_list() +
         "Prints the samples per second; --json FILE writes it with the settings.\n"
         "  fastattn generate --checkpoint runs/digits --samples 8 --pgm digits.pgm\n"
         "  fastattn generate --checkpoint runs/charlm --prompt 'The ' --max-new-tokens "
         "200\n";
}

class GenerateCommand : public Command {
 public:
  GenerateCommand()
      : Command("generate",
                "generate tokens with a recurrent language model; --bench: time per token",
                generate_usage()) {}
  static const std::vector<train::TaskSetting>& generate_flags(const train::TaskType& t) {
    return t.generator.flags;
  }
  // The flags of the random model, --bench and --checkpoint, before the task types' own.
  static std::vector<FlagSpec> common_flags() {
    return {
        FlagSpec::value("attention", "SPEC",
                        "self-attention type with a recurrent form (causal-linear, full), "
                        "TYPE[:PARAM=VALUE...]",
                        "causal-linear"),
        FlagSpec::value("layers", "N", "layers", "1"),
        FlagSpec::value("d-model", "D", "model width", "512"),
        FlagSpec::value("heads", "H", "heads (E = D / H)", "8"),
        FlagSpec::value("d-ff", "F", "feed-forward width", "4 * d-model"),
        FlagSpec::value("vocab", "V", "vocabulary size", "256"),
        FlagSpec::value("dtype", "T", "float32 or float64", "float32"),
        FlagSpec::value("seed", "S", "seed of the weights and of sampling", "0"),
        FlagSpec::value("prefix", "TOKENS", "comma-separated token ids to start from", "0"),
        FlagSpec::value("max-new-tokens", "T", "tokens to generate", "32"),
        FlagSpec::boolean("greedy", "argmax decoding instead of sampling"),
        FlagSpec::value("temperature", "X", "sampling temperature (> 0)", "1.0"),
        FlagSpec::value("top-k", "K", "sample among the K most likely tokens"),
        FlagSpec::value("stop-token", "ID", "stop a sequence at this token"),
        FlagSpec::boolean("bench", "time per token at --positions instead of generating"),
        FlagSpec::value("baseline", "SPEC", "--bench: the type compared with --attention", "full"),
        FlagSpec::value("positions", "LIST", "--bench: positions t, comma-separated",
                        "1024,4096,16384,65536"),
        FlagSpec::value("steps", "N", "--bench: timed steps per case (median reported)", "16"),
        FlagSpec::value("json", "FILE", "--bench, --checkpoint: also write the results as JSON"),
        FlagSpec::value("checkpoint", "DIR",
                        "sample from a model trained on --task " +
                            task_types_where([](const train::TaskType& t) {
                              return static_cast<bool>(t.generator.run);
                            })),
        FlagSpec::value("samples", "N", "--checkpoint: samples to draw (default: the task's)"),
        FlagSpec::boolean("batch-form",
                          "--checkpoint: re-run the batch model per token, not the recurrent form"),
    };
  }
  // The task types' own --checkpoint flags not among the common ones
  // (charlm's --max-new-tokens is).
  static std::vector<FlagSpec> task_only_flags() {
    const auto common = common_flags();
    std::vector<FlagSpec> out;
    for (auto f : setting_flag_specs(generate_flags)) {
      const bool taken = std::any_of(common.begin(), common.end(),
                                     [&](const FlagSpec& c) { return c.name == f.name; });
      if (taken) continue;
      f.help = "--checkpoint, " + f.help;
      out.push_back(std::move(f));
    }
    return out;
  }

 public:
  std::vector<FlagSpec> flags() const override {
    auto out = common_flags();
    const auto own = task_only_flags();
    out.insert(out.end(), own.begin(), own.end());
    return out;
  }

  int run(const Args& args) override {
    if (args.has("checkpoint")) return run_checkpoint(args);
    for (const char* f : {"samples", "batch-form"}) {
      if (args.has(f)) throw UsageError(std::string("--") + f + " needs --checkpoint DIR");
    }
    for (const auto& f : task_only_flags()) {
      if (args.has(f.name)) throw UsageError("--" + f.name + " needs --checkpoint DIR");
    }
    ModelConfig m;
    m.layers = args.get_int("layers", 1);
    m.d_model = args.get_int("d-model", 512);
    m.heads = args.get_int("heads", 8);
    m.vocab = args.get_int("vocab", 256);
    m.seed = args.get_int("seed", 0);
    for (auto [n, x] : {std::pair<const char*, int64_t>{"layers", m.layers},
                        {"d-model", m.d_model},
                        {"heads", m.heads},
                        {"vocab", m.vocab}}) {
      if (x < 1)
        throw UsageError(std::string("--") + n + " must be >= 1, got " + std::to_string(x));
    }
    if (m.d_model % m.heads != 0) {
      throw UsageError("--d-model (" + std::to_string(m.d_model) +
                       ") must be divisible by --heads (" + std::to_string(m.heads) + ")");
    }
    m.d_ff = args.get_int("d-ff", 4 * m.d_model);
    if (m.d_ff < 1) throw UsageError("--d-ff must be >= 1, got " + std::to_string(m.d_ff));
    m.dtype_name = args.get("dtype", "float32");
    if (m.dtype_name == "float64") {
      m.dtype = torch::kDouble;
    } else if (m.dtype_name != "float32") {
      throw UsageError("--dtype must be float32 or float64, got '" + m.dtype_name + "'");
    }
    const auto spec = parse_recurrent_spec(args.get("attention", "causal-linear"), "--attention");
    if (args.get_bool("bench")) return run_bench(args, m, spec);
    return run_generate(args, m, spec);
  }

 private:
  int run_checkpoint(const Args& args) {
    for (const char* f :
         {"attention", "layers", "d-model", "heads", "d-ff", "vocab", "dtype", "prefix", "top-k",
          "stop-token", "bench", "baseline", "positions", "steps"}) {
      if (args.has(f)) {
        throw UsageError(std::string("--") + f +
                         " does not apply to --checkpoint (the model comes from the checkpoint)");
      }
    }
    auto trained = train::load_trained_model(args.get("checkpoint"));
    const std::string task = trained.task->name();
    const train::TaskType* type = train::find_task_type(task);
    if (type == nullptr || !type->generator.run) {
      throw UsageError("--checkpoint: the model was trained on --task " + task +
                       "; generate samples from models of --task " +
                       task_types_where([](const train::TaskType& t) {
                         return static_cast<bool>(t.generator.run);
                       }) +
                       " only");
    }
    refuse_other_types_flags(*type, generate_flags, args,
                             " (the checkpoint's task is " + task + ")");
    train::GenerateRequest request;
    auto& o = request.options;
    o.count = args.get_int("samples", type->generator.default_count);
    if (o.count < 1) throw UsageError("--samples must be >= 1, got " + std::to_string(o.count));
    o.greedy = args.get_bool("greedy");
    o.temperature = args.get_double("temperature", 1.0);
    if (!(o.temperature > 0) || !std::isfinite(o.temperature)) {
      throw UsageError("--temperature must be a finite number > 0, got " + args.get("temperature"));
    }
    o.seed = static_cast<uint64_t>(args.get_int("seed", 0));
    o.recurrent = !args.get_bool("batch-form");
    request.values = given_settings(type->generator.flags, args);
    const auto r = registry_call([&] { return type->generator.run(trained, request); });
    std::cout << r.text;
    for (const auto& note : r.notes) std::cout << note << "\n";

    const auto attention = trained.config.model.value("attention", nlohmann::json("full"));
    nlohmann::json rec = {{"checkpoint", args.get("checkpoint")},
                          {"task", trained.task->config()},
                          {"model", trained.config.model},
                          {"step", trained.step},
                          {"samples", o.count},
                          {"threads", at::get_num_threads()},
                          {"seconds", r.result.seconds},
                          {"recurrent", r.result.recurrent}};
    rec.update(r.record);
    const double seconds = std::max(r.result.seconds, 1e-12);
    std::cout << "generate: " << o.count << " " << r.unit << " in "
              << format_fixed(r.result.seconds, 3) << " s ("
              << format_fixed(static_cast<double>(o.count) / seconds, 2) << " " << r.unit << "/s), "
              << attention.dump() << ", "
              << (r.result.recurrent ? "recurrent form" : "batch model re-run per token")
              << ", step " << trained.step << "\n";
    if (args.has("json")) {
      std::ofstream f(args.get("json"));
      if (!f) throw std::runtime_error("cannot write --json file '" + args.get("json") + "'");
      f << rec.dump(2) << "\n";
    }
    return 0;
  }

  static AttentionSpec parse_recurrent_spec(const std::string& text, const std::string& flag) {
    auto spec = parse_attention_spec(text);
    registry_call([&] {
      // Validates the parameters and that the type has a recurrent form.
      return make_recurrent_attention(spec.type, spec.params, {});
    });
    (void)flag;
    return spec;
  }

  int run_generate(const Args& args, const ModelConfig& m, const AttentionSpec& spec) {
    std::vector<int64_t> prefix = args.get_int_list("prefix", {0});
    for (auto t : prefix) {
      if (t < 0 || t >= m.vocab) {
        throw UsageError("--prefix tokens must be in [0, --vocab = " + std::to_string(m.vocab) +
                         "), got " + std::to_string(t));
      }
    }
    GenerationOptions o;
    o.max_new_tokens = args.get_int("max-new-tokens", 32);
    if (o.max_new_tokens < 0) {
      throw UsageError("--max-new-tokens must be >= 0, got " + std::to_string(o.max_new_tokens));
    }
    o.greedy = args.get_bool("greedy");
    o.temperature = args.get_double("temperature", 1.0);
    if (!(o.temperature > 0) || !std::isfinite(o.temperature)) {
      throw UsageError("--temperature must be a finite number > 0, got " + args.get("temperature"));
    }
    if (args.has("top-k")) {
      o.top_k = args.get_int("top-k", 0);
      if (*o.top_k < 1 || *o.top_k > m.vocab) {
        throw UsageError("--top-k must be in [1, --vocab = " + std::to_string(m.vocab) + "], got " +
                         std::to_string(*o.top_k));
      }
    }
    if (args.has("stop-token")) {
      o.stop_token = args.get_int("stop-token", 0);
      if (*o.stop_token < 0 || *o.stop_token >= m.vocab) {
        throw UsageError("--stop-token must be in [0, --vocab = " + std::to_string(m.vocab) +
                         "), got " + std::to_string(*o.stop_token));
      }
    }
    o.seed = static_cast<uint64_t>(m.seed);
    auto model = make_model(m, spec);
    const auto prefix_t = torch::tensor(prefix, torch::kLong).unsqueeze(0);  // (1, P)
    const double t0 = now_ms();
    const auto result = generate(*model, prefix_t, o);
    const double ms = now_ms() - t0;
    const int64_t P = prefix_t.size(1), total = result.lengths[0].item<int64_t>();
    // Model steps run: the prefix, then one per new token but the last.
    const int64_t steps = P + std::max<int64_t>(0, result.tokens.size(1) - P - 1);
    std::cout << "generate: " << spec.text << ", " << m.layers << " layer(s), d_model " << m.d_model
              << ", " << m.heads << " heads, vocab " << m.vocab << ", " << m.dtype_name
              << ", random weights (seed " << m.seed << "), "
              << (o.greedy ? std::string("greedy")
                           : "sampling (temperature " + format_fixed(o.temperature, 3) +
                                 (o.top_k ? ", top-k " + std::to_string(*o.top_k) : "") + ")")
              << "\n";
    std::cout << "prefix:    " << join_tokens(prefix_t[0]) << "\n";
    std::cout << "generated: " << join_tokens(result.tokens[0].narrow(0, P, total - P)) << "\n";
    std::cout << (total - P) << " new token(s), " << steps << " model steps in "
              << format_fixed(ms, 2) << " ms ("
              << format_fixed(steps > 0 ? ms / static_cast<double>(steps) : 0.0, 3)
              << " ms per step)\n";
    return 0;
  }

  int run_bench(const Args& args, const ModelConfig& m, const AttentionSpec& spec) {
    const auto baseline = parse_recurrent_spec(args.get("baseline", "full"), "--baseline");
    const auto positions = args.get_int_list("positions", {1024, 4096, 16384, 65536});
    for (auto t : positions) {
      if (t < 0) throw UsageError("--positions values must be >= 0, got " + std::to_string(t));
    }
    const int64_t steps = args.get_int("steps", 16);
    if (steps < 1) throw UsageError("--steps must be >= 1, got " + std::to_string(steps));
    const std::string json_path = args.get("json");
    std::ofstream json_file;
    if (!json_path.empty()) {
      json_file.open(json_path);
      if (!json_file) throw std::runtime_error("cannot write --json file '" + json_path + "'");
    }
    std::cout << "generate --bench: N=1, " << m.layers << " layer(s), d_model " << m.d_model
              << ", H=" << m.heads << " E=M=" << m.d_model / m.heads << ", d_ff " << m.d_ff
              << ", vocab " << m.vocab << ", " << m.dtype_name << ", " << at::get_num_threads()
              << " threads; median of " << steps << " single-token steps after 2 warm-up steps\n\n";
    const std::vector<std::string> header = {"attention",    "position",   "ms/token", "ratio",
                                             "attention ms", "attn ratio", "state"};
    std::vector<std::vector<std::string>> rows;
    nlohmann::json records = nlohmann::json::array();
    int failures = 0;
    for (int64_t t : positions) {
      double ours = 0, ours_attn = 0;
      for (const auto* s : {&spec, &baseline}) {
        const auto r = run_in_child([&] { return bench_case(m, *s, t, steps); });
        nlohmann::json rec = {{"attention", s->text}, {"position", t},
                              {"layers", m.layers},   {"d_model", m.d_model},
                              {"heads", m.heads},     {"d_ff", m.d_ff},
                              {"vocab", m.vocab},     {"dtype", m.dtype_name},
                              {"steps", steps},       {"threads", at::get_num_threads()}};
        if (r.contains("error")) {
          std::cout << s->text << " at position " << t << ": " << r["error"].get<std::string>()
                    << std::endl;
          rec["error"] = r["error"];
          ++failures;
          records.push_back(rec);
          continue;
        }
        for (const auto& item : r.items()) rec[item.key()] = item.value();
        const double ms = r["ms_per_token"].get<double>();
        const double attn_ms = r["attention_ms"].get<double>();
        std::string speedup, attn_speedup;
        if (s == &spec) {
          ours = ms;
          ours_attn = attn_ms;
        } else if (ours > 0 && ours_attn > 0) {
          // How many times slower the baseline is than --attention.
          rec["model_ratio"] = ms / ours;
          rec["attention_ratio"] = attn_ms / ours_attn;
          speedup = format_fixed(ms / ours, 1) + "x";
          attn_speedup = format_fixed(attn_ms / ours_attn, 1) + "x";
        }
        rows.push_back({s->text, std::to_string(t), format_fixed(ms, 3), speedup,
                        format_fixed(attn_ms, 4), attn_speedup,
                        format_bytes(static_cast<double>(r["state_bytes"].get<int64_t>()))});
        std::cout << s->text << " at " << t << ": " << rows.back()[2] << " ms/token" << std::endl;
        records.push_back(rec);
      }
    }
    std::cout << "\n"
              << format_table(header, rows, {false, true, true, true, true, true, true})
              << "\nratio: the baseline's time / " << spec.text
              << "'s time at the same position (model, attention step alone); state: the\n"
              << "recurrent state of all layers (a growing cache counts its buffers)\n";
    if (json_file.is_open()) json_file << records.dump(2) << "\n";
    return failures ? 1 : 0;
  }
};

FASTATTN_REGISTER_COMMAND(GenerateCommand);

}  // namespace
}  // namespace fastattn::cli
