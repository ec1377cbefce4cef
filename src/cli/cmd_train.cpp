// `fastattn train`: trains a model on a built-in task (masked copy, sequence
// transduction, digits generation, character-level language modelling) with
// the Trainer (include/fastattn/experiments/train.h, lm_tasks.h): checkpoints, exact
// resume, a time budget, JSON-lines metrics, a progress bar on a terminal.
//   fastattn train --task copy --attention improved-clustered:clusters=15 --steps 2000
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <functional>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli/attention_spec.h"
#include "cli/command.h"
#include "cli/dist_launch.h"
#include "cli/task_flags.h"
#include "fastattn/experiments/distributed.h"
#include "fastattn/experiments/lm_tasks.h"
#include "fastattn/experiments/train.h"

namespace fastattn::cli {
namespace {

volatile std::sig_atomic_t g_interrupted = 0;
void on_signal(int) { g_interrupted = 1; }

std::string duration_text(double seconds) {
  if (!(seconds >= 0) || seconds > 1e7) return "?";
  const int64_t s = static_cast<int64_t>(seconds + 0.5);
  char buf[32];
  if (s >= 3600) {
    std::snprintf(buf, sizeof(buf), "%lldh%02lldm", (long long)(s / 3600),
                  (long long)(s / 60 % 60));
  } else if (s >= 60) {
    std::snprintf(buf, sizeof(buf), "%lldm%02llds", (long long)(s / 60), (long long)(s % 60));
  } else {
    std::snprintf(buf, sizeof(buf), "%llds", (long long)s);
  }
  return buf;
}

std::string fmt(double x, const char* f = "%.4g") {
  char buf[32];
  std::snprintf(buf, sizeof(buf), f, x);
  return buf;
}

std::string metrics_text(const nlohmann::json& m) {
  std::string out;
  for (const auto& [k, v] : m.items()) {
    out += (out.empty() ? "" : " ") + k + " " + (v.is_number() ? fmt(v.get<double>()) : v.dump());
  }
  return out;
}

// Output of ranks other than 0 goes nowhere.
std::ostream& null_stream() {
  static std::ostream sink(nullptr);
  return sink;
}

// ---- task types (train::task_types()) as flags and help ------------------------------

const std::vector<train::TaskSetting>& train_settings(const train::TaskType& type) {
  return type.settings;
}

// The "Tasks:" paragraphs of the help, each description wrapped at 80 columns.
std::string task_list() {
  const size_t indent = 16, width = 80;
  std::string out;
  for (const auto& t : train::task_types()) {
    std::string line = "  " + t.name;
    line += std::string(line.size() < indent ? indent - line.size() : 1, ' ');
    std::istringstream words(t.description);
    std::string word;
    bool first_word = true;
    while (words >> word) {
      if (!first_word && line.size() + 1 + word.size() > width) {
        out += line + "\n";
        line = std::string(indent, ' ') + word;
      } else {
        line += (first_word ? "" : " ") + word;
      }
      first_word = false;
    }
    out += line + "\n";
  }
  return out;
}

std::string train_usage() {
  return "Trains a transformer on a synthetic task and reports evaluation metrics.\n\n"
         "Tasks:\n" +
         task_list() +
         "  (decoder-only tasks need a causal attention type: full, causal-linear,\n"
         "  causal-improved-clustered, ...; sample with `fastattn generate "
         "--checkpoint`.)\n\n"
         "The model comes from the size flags, or from --config FILE: builder JSON\n"
         "(docs/training.md; for transduction {\"encoder\": {...}, \"decoder\": {...}}).\n"
         "Attention specs are TYPE[:PARAM=VALUE...] as in `fastattn bench`.\n\n"
         "Checkpoints: --checkpoint DIR writes DIR/checkpoint.safetensors (everything)\n"
         "and DIR/model.safetensors (weights) atomically every --checkpoint-every steps,\n"
         "at the end, and on Ctrl-C / SIGTERM. --resume continues from DIR with the\n"
         "stored config (flags may change only --steps, --eval-every, --checkpoint-every)\n"
         "and gives the same result as an uninterrupted run with the same --threads.\n"
         "--time-budget S stops once the training time (time inside optimiser steps, not\n"
         "evaluation or checkpoints) reaches S seconds; the time is stored in the\n"
         "checkpoint, so a resumed run continues the same budget (a new --time-budget\n"
         "replaces the stored one). --steps still caps the run and sets the schedule.\n"
         "--result FILE writes the final evaluation, step and training time as JSON.\n\n"
         "examples:\n"
         "  fastattn train --task copy --length 32 --steps 2000 --eval-every 200\n"
         "  fastattn train --task copy --attention improved-clustered:clusters=15 \\\n"
         "      --checkpoint runs/ic --metrics runs/ic/metrics.jsonl\n"
         "  fastattn train --checkpoint runs/ic --resume --steps 4000\n"
         "  fastattn train --task transduction --mode sort --min-length 20 --max-length 60\n"
         "  fastattn train --task digits --attention causal-linear --time-budget 600 \\\n"
         "      --checkpoint runs/digits-linear --result runs/digits-linear/result.json\n"
         "  fastattn train --task charlm --length 128 --attention causal-linear\n"
         "\n"
         "Data parallel (docs/distributed.md): --nproc N starts N local processes; or "
         "start\n"
         "one process per rank with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set (as\n"
         "torchrun does). --batch is per process; rank 0 alone writes checkpoints and "
         "logs.\n"
         "  fastattn train --task copy --nproc 2 --batch 16 --checkpoint runs/dp\n";
}

class TrainCommand : public Command {
 public:
  TrainCommand()
      : Command("train",
                "train a model on a built-in task (copy, reverse/sort, digits, charlm), with "
                "checkpoints",
                train_usage()) {}
  std::vector<FlagSpec> flags() const override {
    std::vector<FlagSpec> out = {FlagSpec::value("task", "NAME", train::task_type_names(), "copy")};
    const auto task_flags = setting_flag_specs(train_settings);
    out.insert(out.end(), task_flags.begin(), task_flags.end());
    const std::vector<FlagSpec> rest = {
        FlagSpec::value("attention", "SPEC", "encoder self-attention", "full"),
        FlagSpec::value("decoder-attention", "SPEC",
                        "transduction: decoder self-attention (causal)", "full"),
        FlagSpec::value("cross-attention", "SPEC", "transduction: decoder cross-attention", "full"),
        FlagSpec::value("layers", "N", "layers (each of encoder and decoder)", "4"),
        FlagSpec::value("heads", "H", "attention heads", "4"),
        FlagSpec::value("d-model", "D", "model width", "128"),
        FlagSpec::value("d-ff", "F", "feed-forward width", "4 * d-model"),
        FlagSpec::value("dropout", "P", "dropout", "0.1"),
        FlagSpec::value("config", "FILE", "model config JSON (instead of the size flags)"),
        FlagSpec::value("steps", "N", "optimiser steps", "1000"),
        FlagSpec::value("batch", "B", "sequences per step", "32"),
        FlagSpec::value("optimizer", "NAME", train::optimizer_names(), "radam"),
        FlagSpec::value("lr", "LR", "peak learning rate", "0.001"),
        FlagSpec::value("weight-decay", "W", "L2 (adam, radam) or decoupled (adamw)", "0"),
        FlagSpec::value("warmup", "N", "linear warm-up steps", "0"),
        FlagSpec::value("decay", "KIND", "after warm-up: constant, linear or cosine", "constant"),
        FlagSpec::value("min-lr-ratio", "R", "final lr of linear/cosine decay, times --lr", "0"),
        FlagSpec::value("clip", "C", "max global gradient norm (0: off)", "0"),
        FlagSpec::value("eval-every", "N", "evaluate every N steps (0: only at the end)", "100"),
        FlagSpec::value("eval-batches", "N", "evaluation batches (fixed for the run)", "4"),
        FlagSpec::value("seed", "S", "seed of initialisation, data and dropout", "0"),
        FlagSpec::value("checkpoint", "DIR", "checkpoint directory"),
        FlagSpec::value("checkpoint-every", "N", "checkpoint every N steps (0: only at the end)",
                        "500"),
        FlagSpec::boolean("resume", "continue from the checkpoint in --checkpoint DIR"),
        FlagSpec::value("metrics", "FILE", "append JSON lines: step records and evaluations"),
        FlagSpec::value("log-every", "N", "log / metrics line every N steps", "10"),
        FlagSpec::value("nproc", "N", "data parallel: start N local worker processes"),
        FlagSpec::value("dist-timeout", "S",
                        "data parallel: seconds before a missing or dead rank is an error", "60"),
        FlagSpec::value("dist-bucket-mb", "M", "data parallel: gradient all-reduce bucket (MiB)",
                        "4"),
        FlagSpec::boolean("dist-no-overlap",
                          "data parallel: all-reduce after backward instead of during it"),
        FlagSpec::value("time-budget", "S",
                        "stop after S seconds of training (summed over resumes; 0: no limit)", "0"),
        FlagSpec::value("result", "FILE", "write the final evaluation as JSON"),
    };
    out.insert(out.end(), rest.begin(), rest.end());
    return out;
  }

  int run(const Args& args) override {
    if (args.has("nproc") && args.get_int("nproc", 1) != 1) {
      return launch_local_workers(args.get_int("nproc", 1));
    }
    const bool resume = args.get_bool("resume");
    const std::string dir = args.get("checkpoint");
    if (resume && dir.empty()) throw UsageError("--resume needs --checkpoint DIR");
    train::TrainConfig c = resume ? train::Trainer::checkpoint_config(dir) : train::TrainConfig();
    // Resuming keeps the stored values of every flag not given.
    auto given = [&](const char* flag) { return !resume || args.has(flag); };
    auto int_flag = [&](const char* flag, int64_t def) { return args.get_int(flag, def); };

    // ---- task
    const std::string task =
        resume && !args.has("task") ? c.task.value("name", "copy") : args.get("task", "copy");
    const train::TaskType* type = train::find_task_type(task);
    if (type == nullptr)
      throw UsageError("--task must be " + train::task_type_names() + ", got '" + task + "'");
    nlohmann::json t =
        resume && c.task.value("name", "") == task ? c.task : nlohmann::json{{"name", task}};
    // Flags that belong to other task types are errors, not silently ignored;
    // those not given keep the stored value (resume) or the task's default.
    refuse_other_types_flags(*type, train_settings, args);
    t.update(given_settings(type->settings, args));
    c.task = t;

    // ---- model
    const bool seq2seq = type->encoder_decoder;
    if (args.has("config")) {
      for (const char* f : {"attention", "decoder-attention", "cross-attention", "layers", "heads",
                            "d-model", "d-ff", "dropout"}) {
        if (args.has(f)) {
          throw UsageError(std::string("--") + f + " and --config both set the model; give one");
        }
      }
      std::ifstream in(args.get("config"));
      if (!in) throw UsageError("--config: cannot open '" + args.get("config") + "'");
      try {
        c.model = nlohmann::json::parse(in);
      } catch (const nlohmann::json::exception& e) {
        throw UsageError("--config '" + args.get("config") + "' is not valid JSON: " + e.what());
      }
    } else {
      if (!resume)
        c.model = seq2seq ? nlohmann::json{{"encoder", nlohmann::json::object()},
                                           {"decoder", nlohmann::json::object()}}
                          : nlohmann::json::object();
      std::vector<nlohmann::json*> parts;
      if (seq2seq) {
        if (!c.model.contains("encoder") || !c.model.contains("decoder")) {
          throw UsageError(
              "the checkpoint's model has no encoder/decoder; it is not a transduction model");
        }
        parts = {&c.model["encoder"], &c.model["decoder"]};
      } else {
        parts = {&c.model};
      }
      for (auto* p : parts) {
        if (given("layers")) (*p)["layers"] = int_flag("layers", 4);
        if (given("heads")) (*p)["heads"] = int_flag("heads", 4);
        if (given("d-model")) (*p)["d_model"] = int_flag("d-model", 128);
        if (args.has("d-ff")) (*p)["feed_forward_dimensions"] = int_flag("d-ff", 0);
        if (given("dropout")) (*p)["dropout"] = args.get_double("dropout", 0.1);
      }
      if (given("attention"))
        (*parts[0])["attention"] = attention_json(args.get("attention", "full"));
      if (seq2seq) {
        if (given("decoder-attention")) {
          (*parts[1])["self_attention"] = attention_json(args.get("decoder-attention", "full"));
        }
        if (given("cross-attention")) {
          (*parts[1])["cross_attention"] = attention_json(args.get("cross-attention", "full"));
        }
      } else {
        for (const char* f : {"decoder-attention", "cross-attention"}) {
          if (args.has(f))
            throw UsageError(
                std::string("--") + f + " applies to --task " +
                task_types_where([](const train::TaskType& t) { return t.encoder_decoder; }));
        }
      }
    }

    // ---- optimisation
    if (given("steps")) c.steps = int_flag("steps", 1000);
    if (given("batch")) c.batch_size = int_flag("batch", 32);
    if (given("optimizer")) c.optimizer.name = args.get("optimizer", "radam");
    if (given("lr")) c.optimizer.lr = args.get_double("lr", 1e-3);
    if (given("weight-decay")) c.optimizer.weight_decay = args.get_double("weight-decay", 0);
    if (given("warmup")) c.schedule.warmup = int_flag("warmup", 0);
    if (given("decay")) c.schedule.decay = args.get("decay", "constant");
    if (given("min-lr-ratio")) c.schedule.min_lr_ratio = args.get_double("min-lr-ratio", 0);
    if (given("clip")) c.clip = args.get_double("clip", 0);
    if (given("eval-every")) c.eval_every = int_flag("eval-every", 100);
    if (given("eval-batches")) c.eval_batches = int_flag("eval-batches", 4);
    if (given("seed")) c.seed = int_flag("seed", 0);
    if (given("checkpoint-every")) c.checkpoint_every = int_flag("checkpoint-every", 500);
    if (given("time-budget")) c.time_budget = args.get_double("time-budget", 0);
    const int64_t log_every = int_flag("log-every", 10);
    if (log_every < 1)
      throw UsageError("--log-every must be >= 1, got " + std::to_string(log_every));
    if (!train::is_optimizer_name(c.optimizer.name)) {
      throw UsageError("--optimizer must be " + train::optimizer_names() + ", got '" +
                       c.optimizer.name + "'");
    }
    if (c.schedule.decay != "constant" && c.schedule.decay != "linear" &&
        c.schedule.decay != "cosine") {
      throw UsageError("--decay must be constant, linear or cosine, got '" + c.schedule.decay +
                       "'");
    }

    // Data parallel when started with WORLD_SIZE > 1 (by --nproc or torchrun).
    train::DistOptions dist;
    dist.timeout_s = args.get_double("dist-timeout", 60);
    dist.bucket_mb = args.get_double("dist-bucket-mb", 4);
    dist.overlap = !args.get_bool("dist-no-overlap");
    if (!(dist.timeout_s > 0)) throw UsageError("--dist-timeout must be > 0");
    if (!(dist.bucket_mb > 0)) throw UsageError("--dist-bucket-mb must be > 0");
    const auto dp = train::DataParallel::from_env(dist);
    const bool lead = !dp || dp->rank() == 0;  // only rank 0 logs and writes

    // A bad setting (a size, a task parameter) is a usage error naming it.
    auto trainer = registry_call([&] { return std::make_unique<train::Trainer>(c, dp); });
    if (resume) trainer->load_checkpoint(dir);

    std::ofstream metrics;
    if (lead && args.has("metrics")) {
      metrics.open(args.get("metrics"), std::ios::app);
      if (!metrics)
        throw std::runtime_error("cannot open --metrics file '" + args.get("metrics") + "'");
    }
    int64_t params = 0;
    for (const auto& p : trainer->model().parameters()) params += p.numel();
    const bool tty = lead && ::isatty(STDERR_FILENO) == 1;
    std::ostream& log = lead ? std::cerr : null_stream();
    log << "train: task " << trainer->task().config().dump() << ", " << params << " parameters, "
        << c.steps << " steps of "
        << (dp ? std::to_string(dp->world_size()) + " processes x " : std::string()) << c.batch_size
        << ", " << c.optimizer.name << " lr " << c.optimizer.lr << ", " << args.get("threads")
        << " threads" << (resume ? ", resumed at step " + std::to_string(trainer->step()) : "")
        << "\n";
    if (metrics) {
      metrics << nlohmann::json{{"event", "start"},
                                {"step", trainer->step()},
                                {"config", trainer->config().to_json()},
                                {"parameters", params}}
                     .dump()
              << "\n"
              << std::flush;
    }

    std::signal(SIGINT, on_signal);
    std::signal(SIGTERM, on_signal);
    const auto t0 = std::chrono::steady_clock::now();
    const int64_t first = trainer->step();
    double loss_sum = 0;
    int64_t loss_n = 0;
    nlohmann::json last_eval;
    bool bar_open = false;  // a progress bar line without its newline yet
    auto on_step = [&](const train::StepRecord& r) {
      loss_sum += r.loss;
      ++loss_n;
      const double elapsed =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      const double rate = static_cast<double>(r.step - first) / std::max(elapsed, 1e-9);
      const double eta = static_cast<double>(c.steps - r.step) / std::max(rate, 1e-9);
      if (r.step % log_every == 0 || r.step == c.steps || r.eval) {
        nlohmann::json rec = {{"step", r.step},           {"loss", loss_sum / loss_n},
                              {"aux_loss", r.aux_loss},   {"lr", r.lr},
                              {"grad_norm", r.grad_norm}, {"elapsed_s", elapsed}};
        if (r.eval) rec["eval"] = *r.eval;
        if (metrics) metrics << rec.dump() << "\n" << std::flush;
        if (!tty) {
          log << "step " << r.step << "/" << c.steps << " loss " << fmt(loss_sum / loss_n) << " lr "
              << fmt(r.lr, "%.3g") << " " << fmt(rate, "%.1f") << " steps/s";
          if (r.eval) log << " | eval " << metrics_text(*r.eval);
          log << "\n";
        }
        loss_sum = 0;
        loss_n = 0;
      }
      if (r.eval) last_eval = *r.eval;
      if (tty) {
        const int width = 30;
        const int filled = static_cast<int>(width * r.step / std::max<int64_t>(c.steps, 1));
        std::cerr << "\r[" << std::string(filled, '#') << std::string(width - filled, '.') << "] "
                  << r.step << "/" << c.steps << " loss " << fmt(r.loss) << " " << fmt(rate, "%.1f")
                  << " it/s ETA " << duration_text(eta)
                  << (last_eval.empty() ? "" : " | " + metrics_text(last_eval)) << "\x1b[K"
                  << std::flush;
        bar_open = !r.eval;
        if (r.eval) std::cerr << "\n";
      }
    };
    trainer->run(dir, on_step, [] { return g_interrupted != 0; });
    if (bar_open) std::cerr << "\n";
    std::signal(SIGINT, SIG_DFL);
    std::signal(SIGTERM, SIG_DFL);
    // A rank stopped early by another rank's interrupt reports it too (a
    // time budget also stops runs early: that is their end, not an interrupt).
    const bool stopped_early = trainer->step() < c.steps && !(c.time_budget > 0);
    if (g_interrupted || (dp && stopped_early)) {
      log << "train: interrupted at step " << trainer->step()
          << (dir.empty() ? " (no --checkpoint: nothing saved)"
                          : "; checkpoint saved in " + dir + " (continue with --resume)")
          << "\n";
      return 130;
    }
    const auto final_eval = trainer->evaluate();
    nlohmann::json result = {{"event", "end"}, {"step", trainer->step()}, {"eval", final_eval}};
    result["train_seconds"] = trainer->train_seconds();
    if (metrics) metrics << result.dump() << "\n" << std::flush;
    if (!lead) return 0;
    if (args.has("result")) {
      nlohmann::json out = {{"step", trainer->step()},
                            {"train_seconds", trainer->train_seconds()},
                            {"eval", final_eval},
                            {"parameters", params},
                            {"threads", at::get_num_threads()},
                            {"config", trainer->config().to_json()}};
      std::ofstream f(args.get("result"));
      if (!f) throw std::runtime_error("cannot write --result file '" + args.get("result") + "'");
      f << out.dump(2) << "\n";
    }
    std::cout << "step " << trainer->step() << ": " << metrics_text(final_eval) << "\n";
    if (!dir.empty()) std::cout << "checkpoint: " << dir << "/" << train::kCheckpointFile << "\n";
    return 0;
  }
};

FASTATTN_REGISTER_COMMAND(TrainCommand);

}  // namespace
}  // namespace fastattn::cli
