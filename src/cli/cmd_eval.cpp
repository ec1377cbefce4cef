// `fastattn eval`: evaluates the weights of a `fastattn train` checkpoint,
// optionally with other attention types than they were trained with (the
// clustered paper's cross-evaluation; hard retrieval's train soft / decode
// hard), and times greedy decoding of transduction models.
//   fastattn eval --checkpoint runs/soft --decoder-attention hard-retrieval
//       --cross-attention hard-retrieval   (one command line)
#include <chrono>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>

#include "cli/attention_spec.h"
#include "cli/command.h"
#include "fastattn/experiments/train.h"

namespace fastattn::cli {
namespace {

class EvalCommand : public Command {
 public:
  EvalCommand()
      : Command(
            "eval", "evaluate a training checkpoint, optionally with other attention types",
            "Loads the weights of a `fastattn train` checkpoint and evaluates them on the\n"
            "run's fixed evaluation set (same seed, batch and --eval-batches as the run\n"
            "unless given). The attention flags replace the attention types the weights\n"
            "were trained with; every learned parameter of the new model must be in the\n"
            "checkpoint (types without learned parameters can be swapped freely).\n"
            "Transduction models are also timed: greedy decoding of the evaluation set,\n"
            "token by token through the decoder's recurrent form (--decode step, the\n"
            "default when the decoder self-attention has one) or re-running the decoder\n"
            "over the prefix (--decode rerun); the timing repeats --repeat times and\n"
            "reports the fastest.\n\n"
            "examples:\n"
            "  fastattn eval --checkpoint runs/copy --attention improved-clustered:clusters=15\n"
            "  fastattn eval --checkpoint runs/soft --decoder-attention hard-retrieval \\\n"
            "      --cross-attention hard-retrieval --json soft-as-hard.json\n") {}
  std::vector<FlagSpec> flags() const override {
    return {
        FlagSpec::value("checkpoint", "DIR", "checkpoint directory of `fastattn train`"),
        FlagSpec::value("attention", "SPEC", "encoder self-attention", "as trained"),
        FlagSpec::value("decoder-attention", "SPEC", "transduction: decoder self-attention",
                        "as trained"),
        FlagSpec::value("cross-attention", "SPEC", "transduction: decoder cross-attention",
                        "as trained"),
        FlagSpec::value("eval-batches", "N", "evaluation batches", "as trained"),
        FlagSpec::value("batch", "B", "sequences per evaluation batch", "as trained"),
        FlagSpec::value("decode", "METHOD", "transduction: auto, step or rerun", "auto"),
        FlagSpec::value("repeat", "N", "transduction: timed decoding passes", "3"),
        FlagSpec::value("json", "FILE", "write the result as JSON"),
    };
  }

  int run(const Args& args) override {
    if (!args.has("checkpoint")) throw UsageError("eval: --checkpoint DIR is required");
    const std::string dir = args.get("checkpoint");
    auto c = registry_call([&] { return train::Trainer::checkpoint_config(dir); });
    const auto* type = train::find_task_type(c.task.value("name", ""));
    const bool seq2seq = type != nullptr && type->encoder_decoder;
    nlohmann::json overrides = nlohmann::json::object();
    auto set_attention = [&](const char* flag, nlohmann::json& part, const char* key) {
      if (!args.has(flag)) return;
      part[key] = attention_json(args.get(flag));
      overrides[flag] = args.get(flag);
    };
    if (seq2seq) {
      set_attention("attention", c.model["encoder"], "attention");
      set_attention("decoder-attention", c.model["decoder"], "self_attention");
      set_attention("cross-attention", c.model["decoder"], "cross_attention");
    } else {
      for (const char* f : {"decoder-attention", "cross-attention", "decode", "repeat"}) {
        if (args.has(f)) {
          throw UsageError(std::string("--") + f + " applies to transduction checkpoints; '" + dir +
                           "' holds a " + c.task.value("name", "?") + " model");
        }
      }
      set_attention("attention", c.model, "attention");
    }
    auto positive = [&](const char* flag, int64_t def) {
      const int64_t v = args.get_int(flag, def);
      if (v < 1)
        throw UsageError(std::string("--") + flag + " must be >= 1, got " + std::to_string(v));
      return v;
    };
    c.eval_batches = positive("eval-batches", c.eval_batches);
    c.batch_size = positive("batch", c.batch_size);
    const int64_t repeat = positive("repeat", 3);
    const std::string decode = args.get("decode", "auto");
    if (decode != "auto" && decode != "step" && decode != "rerun") {
      throw UsageError("--decode must be auto, step or rerun, got '" + decode + "'");
    }

    auto trainer = registry_call([&] { return std::make_unique<train::Trainer>(c); });
    const auto report = trainer->load_weights(dir);
    if (!report.missing.empty()) {
      std::cerr << "eval: " << report.missing.size()
                << " buffer(s) not in the checkpoint keep this model's values:";
      for (const auto& n : report.missing) std::cerr << " " << n;
      std::cerr << "\n";
    }
    if (!report.unexpected.empty()) {
      std::cerr << "eval: " << report.unexpected.size()
                << " checkpoint tensor(s) unused by this model:";
      for (const auto& n : report.unexpected) std::cerr << " " << n;
      std::cerr << "\n";
    }

    nlohmann::json result = {{"checkpoint", dir},
                             {"overrides", overrides},
                             {"model", c.model},
                             {"metrics", trainer->evaluate()}};
    if (seq2seq) result["decode"] = time_decoding(*trainer, decode, repeat);

    std::cout << "eval " << dir;
    for (const auto& [k, v] : overrides.items())
      std::cout << " --" << k << " " << v.get<std::string>();
    std::cout << "\n";
    for (const auto& [k, v] : result["metrics"].items()) std::cout << "  " << k << " " << v << "\n";
    if (seq2seq) {
      const auto& d = result["decode"];
      std::cout << "  decode (" << d["method"].get<std::string>() << ", batch "
                << d["batch"].get<int64_t>() << "): " << d["sequences_per_second"].get<double>()
                << " sequences/s, " << d["ms_per_step"].get<double>() << " ms per step\n";
    }
    if (args.has("json")) {
      std::ofstream out(args.get("json"));
      if (!out) throw std::runtime_error("cannot write --json file '" + args.get("json") + "'");
      out << result.dump(2) << "\n";
    }
    return 0;
  }

 private:
  // Times greedy decoding of the evaluation set (fastest of `repeat` passes).
  static nlohmann::json time_decoding(train::Trainer& trainer, const std::string& method,
                                      int64_t repeat) {
    const auto& task = dynamic_cast<const train::TransductionTask&>(trainer.task());
    auto& model = dynamic_cast<train::Seq2SeqImpl&>(trainer.model());
    const bool step = method == "step" || (method == "auto" && model.has_step_decoder());
    torch::NoGradGuard no_grad;
    model.eval();
    double best = 0;
    int64_t steps = 0, sequences = 0;
    for (int64_t r = 0; r < repeat; ++r) {
      steps = sequences = 0;
      const auto t0 = std::chrono::steady_clock::now();
      for (const auto& b : trainer.eval_set()) {
        auto tokens = task.greedy_decode(model, b.at("source"), b.at("source_lengths"),
                                         b.at("target_out").size(1), step ? "step" : "rerun");
        // Steps run: up to the last row's end token.
        steps += (tokens != 0).sum(1).max().item<int64_t>();
        sequences += tokens.size(0);
      }
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (r == 0 || s < best) best = s;
    }
    model.train();
    return {{"method", step ? "step" : "rerun"},
            {"seconds", best},
            {"sequences", sequences},
            {"steps", steps},
            {"batch", trainer.config().batch_size},
            {"sequences_per_second", sequences / best},
            {"ms_per_step", 1e3 * best / std::max<int64_t>(steps, 1)}};
  }
};

}  // namespace
FASTATTN_REGISTER_COMMAND(EvalCommand);
}  // namespace fastattn::cli
