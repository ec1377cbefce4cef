// The Trainer: config, optimisation loop, evaluation, and checkpoints that
// resume to bit-identical results (one atomic safetensors file with a
// checksum; format in docs/training.md).
#include <ATen/CPUGeneratorImpl.h>
#include <sys/stat.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>

#include "fastattn/attention.h"
#include "fastattn/experiments/distributed.h"
#include "fastattn/safetensors.h"
#include "fastattn/experiments/train.h"
#include "experiments/train/json_fields.h"

namespace fastattn::train {

namespace {

constexpr const char* kFormat = "fastattn-checkpoint";
constexpr const char* kVersion = "1";
// Config keys that may differ between a checkpoint and the run resuming it.
const std::vector<std::string> kResumableKeys = {"steps", "eval_every", "checkpoint_every",
                                                 "time_budget"};

// Seeds of the trainer's independent streams, derived from the run's seed.
uint64_t stream_seed(int64_t seed, uint64_t stream) {
  // splitmix64 of seed + stream·golden ratio: well-separated streams.
  uint64_t z = static_cast<uint64_t>(seed) + stream * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

at::Generator seeded_generator(uint64_t seed) {
  return at::make_generator<at::CPUGeneratorImpl>(seed);
}

// FNV-1a over names, dtypes, shapes and bytes of the tensors in name order.
std::string checksum(const std::map<std::string, torch::Tensor>& tensors) {
  uint64_t h = 0xcbf29ce484222325ull;
  auto mix = [&](const void* data, size_t n) {
    const auto* p = static_cast<const unsigned char*>(data);
    for (size_t i = 0; i < n; ++i) {
      h ^= p[i];
      h *= 0x100000001b3ull;
    }
  };
  for (const auto& [name, tensor] : tensors) {
    auto t = tensor.detach().to(torch::kCPU).contiguous();
    mix(name.data(), name.size() + 1);
    const auto dtype = safetensors_dtype_name(t.scalar_type());
    mix(dtype.data(), dtype.size());
    for (int64_t d : t.sizes()) mix(&d, sizeof d);
    mix(t.data_ptr(), static_cast<size_t>(t.numel()) * t.element_size());
  }
  std::ostringstream os;
  os << std::hex << h;
  return os.str();
}

nlohmann::json comparable(const TrainConfig& c) {
  auto j = c.to_json();
  for (const auto& k : kResumableKeys) j.erase(k);
  return j;
}

void make_dir(const std::string& dir) {
  std::string partial;
  for (const auto& part : [&] {
         std::vector<std::string> parts;
         std::string cur;
         for (char ch : dir) {
           if (ch == '/') {
             parts.push_back(cur + "/");
             cur.clear();
           } else {
             cur += ch;
           }
         }
         if (!cur.empty()) parts.push_back(cur);
         return parts;
       }()) {
    partial += part;
    if (::mkdir(partial.c_str(), 0755) != 0 && errno != EEXIST) {
      TORCH_CHECK(false, "checkpoint: cannot create directory '", partial,
                  "': ", std::strerror(errno));
    }
  }
}

// Reads and verifies <dir>/checkpoint.safetensors.
SafetensorsFile read_checkpoint(const std::string& dir) {
  const std::string path = dir + "/" + kCheckpointFile;
  struct stat st;
  TORCH_CHECK(::stat(path.c_str(), &st) == 0, "checkpoint: no checkpoint at '", path, "' (",
              std::strerror(errno), ")");
  auto file = load_safetensors(path);
  auto meta = [&](const char* key) {
    auto it = file.metadata.find(key);
    TORCH_CHECK(it != file.metadata.end(), "checkpoint '", path, "' is incomplete: no '", key,
                "' in its metadata");
    return it->second;
  };
  TORCH_CHECK(meta("format") == kFormat, "checkpoint '", path, "': format is '", meta("format"),
              "', expected '", kFormat, "'");
  TORCH_CHECK(meta("version") == kVersion, "checkpoint '", path, "': version ", meta("version"),
              " is not supported (expected ", kVersion, ")");
  TORCH_CHECK(std::to_string(file.tensors.size()) == meta("tensors"), "checkpoint '", path,
              "' is incomplete: it holds ", file.tensors.size(), " tensors, its metadata says ",
              meta("tensors"));
  const auto sum = checksum(file.tensors);
  TORCH_CHECK(sum == meta("checksum"), "checkpoint '", path,
              "' is corrupt: checksum of its tensors is ", sum, ", its metadata says ",
              meta("checksum"));
  return file;
}

}  // namespace

// ---- config -------------------------------------------------------------------------

nlohmann::json TrainConfig::to_json() const {
  return {{"task", task},
          {"model", model},
          {"optimizer",
           {{"name", optimizer.name},
            {"lr", optimizer.lr},
            {"beta1", optimizer.beta1},
            {"beta2", optimizer.beta2},
            {"eps", optimizer.eps},
            {"weight_decay", optimizer.weight_decay}}},
          {"schedule",
           {{"warmup", schedule.warmup},
            {"decay", schedule.decay},
            {"min_lr_ratio", schedule.min_lr_ratio}}},
          {"clip", clip},
          {"steps", steps},
          {"batch_size", batch_size},
          {"eval_every", eval_every},
          {"eval_batches", eval_batches},
          {"checkpoint_every", checkpoint_every},
          {"seed", seed},
          {"time_budget", time_budget}};
}

TrainConfig TrainConfig::from_json(const nlohmann::json& j) {
  const char* who = "train config";
  check_keys(who, j,
             {"task", "model", "optimizer", "schedule", "clip", "steps", "batch_size", "eval_every",
              "eval_batches", "checkpoint_every", "seed", "time_budget"});
  TrainConfig c;
  if (j.contains("task")) c.task = j["task"];
  if (j.contains("model")) c.model = j["model"];
  if (j.contains("optimizer")) {
    const auto& o = j["optimizer"];
    check_keys("train config: optimizer", o,
               {"name", "lr", "beta1", "beta2", "eps", "weight_decay"});
    read_field(who, o, "name", c.optimizer.name);
    read_field(who, o, "lr", c.optimizer.lr);
    read_field(who, o, "beta1", c.optimizer.beta1);
    read_field(who, o, "beta2", c.optimizer.beta2);
    read_field(who, o, "eps", c.optimizer.eps);
    read_field(who, o, "weight_decay", c.optimizer.weight_decay);
  }
  if (j.contains("schedule")) {
    const auto& s = j["schedule"];
    check_keys("train config: schedule", s, {"warmup", "decay", "min_lr_ratio"});
    read_field(who, s, "warmup", c.schedule.warmup);
    read_field(who, s, "decay", c.schedule.decay);
    read_field(who, s, "min_lr_ratio", c.schedule.min_lr_ratio);
  }
  read_field(who, j, "clip", c.clip);
  read_field(who, j, "steps", c.steps);
  read_field(who, j, "batch_size", c.batch_size);
  read_field(who, j, "eval_every", c.eval_every);
  read_field(who, j, "eval_batches", c.eval_batches);
  read_field(who, j, "checkpoint_every", c.checkpoint_every);
  read_field(who, j, "seed", c.seed);
  read_field(who, j, "time_budget", c.time_budget);
  return c;
}

// ---- trainer ------------------------------------------------------------------------

namespace {

// Puts the trainer's stream into the global CPU generator for its lifetime
// and takes it out again (restoring the caller's state), exceptions included.
class GlobalRngScope {
 public:
  GlobalRngScope(torch::Tensor& stream) : stream_(stream) {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    saved_ = gen.get_state();
    gen.set_state(stream_);
  }
  ~GlobalRngScope() {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    stream_ = gen.get_state();
    gen.set_state(saved_);
  }

 private:
  torch::Tensor& stream_;
  torch::Tensor saved_;
};

}  // namespace

Trainer::Trainer(TrainConfig config, std::shared_ptr<DataParallel> data_parallel)
    : config_(std::move(config)), dp_(std::move(data_parallel)) {
  const auto& c = config_;
  TORCH_CHECK(c.steps >= 0, "train: steps must be >= 0, got ", c.steps);
  TORCH_CHECK(c.batch_size >= 1, "train: batch_size must be >= 1, got ", c.batch_size);
  TORCH_CHECK(c.eval_every >= 0, "train: eval_every must be >= 0, got ", c.eval_every);
  TORCH_CHECK(c.eval_batches >= 1, "train: eval_batches must be >= 1, got ", c.eval_batches);
  TORCH_CHECK(c.checkpoint_every >= 0, "train: checkpoint_every must be >= 0, got ",
              c.checkpoint_every);
  TORCH_CHECK(std::isfinite(c.clip) && c.clip >= 0, "train: clip must be >= 0 (0 = off), got ",
              c.clip);
  TORCH_CHECK(c.seed >= 0, "train: seed must be >= 0, got ", c.seed);
  TORCH_CHECK(std::isfinite(c.time_budget) && c.time_budget >= 0,
              "train: time_budget must be >= 0 seconds (0 = no limit), got ", c.time_budget);
  scheduled_lr(c.schedule, c.optimizer.lr, 0, c.steps);  // validates the schedule
  task_ = make_task(c.task);
  config_.task = task_->config();  // defaults filled in, so checkpoints compare exactly
  global_rng_state_ = seeded_generator(stream_seed(c.seed, 0)).get_state();
  data_gen_ = seeded_generator(stream_seed(c.seed, 1));
  {
    GlobalRngScope scope(global_rng_state_);
    model_ = task_->make_model(c.model);
  }
  optimizer_ = make_optimizer(c.optimizer, model_->parameters());
  const int64_t world = dp_ ? dp_->world_size() : 1;
  if (dp_) {
    dp_->broadcast_module(*model_);
    dp_->attach(*model_);
    // Rank 0 goes on with the single-process stream; other ranks draw dropout
    // from streams of their own (docs/distributed.md).
    if (dp_->rank() > 0) {
      global_rng_state_ =
          seeded_generator(stream_seed(c.seed, 1000 + static_cast<uint64_t>(dp_->rank())))
              .get_state();
    }
  }
  // Evaluation batches of the global batch size: W ranks evaluate the set
  // one process with batch W·batch_size evaluates.
  auto eval_gen = seeded_generator(stream_seed(c.seed, 2));
  eval_set_ = task_->evaluation_batches(c.batch_size * world, c.eval_batches, eval_gen);
}

StepRecord Trainer::train_step() {
  const auto t0 = std::chrono::steady_clock::now();
  struct AddTime {  // counts the step's time, exceptions included
    double& total;
    std::chrono::steady_clock::time_point t0;
    ~AddTime() {
      total += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
  } add_time{train_seconds_, t0};
  GlobalRngScope scope(global_rng_state_);
  model_->train();
  StepRecord r;
  r.lr = scheduled_lr(config_.schedule, config_.optimizer.lr, step_, config_.steps);
  for (auto& group : optimizer_->param_groups()) group.options().set_lr(r.lr);
  // Data parallel: every rank draws the global batch, keeps its rows.
  auto batch = task_->sample(config_.batch_size * (dp_ ? dp_->world_size() : 1), data_gen_);
  if (dp_) batch = dp_->shard(batch);
  optimizer_->zero_grad();
  auto loss = task_->loss(*model_, batch);
  auto aux = take_auxiliary_losses(*model_);
  auto total = aux.defined() ? loss + aux : loss;
  r.loss = loss.item<double>();
  r.aux_loss = aux.defined() ? aux.item<double>() : 0.0;
  if (dp_) {  // the mean over ranks, so every rank takes the same decision below
    auto m = dp_->allreduce_mean(torch::tensor({r.loss, r.aux_loss}, torch::kFloat64));
    r.loss = m[0].item<double>();
    r.aux_loss = m[1].item<double>();
  }
  TORCH_CHECK(std::isfinite(r.loss) && std::isfinite(r.aux_loss), "train: the loss is ", r.loss,
              " (auxiliary ", r.aux_loss, ") at step ", step_ + 1,
              "; lower the learning rate or set --clip");
  if (dp_) dp_->begin_backward();
  total.backward();
  if (dp_) dp_->finish_backward();  // averaged gradients: clipping sees the global norm
  r.grad_norm = torch::nn::utils::clip_grad_norm_(
      model_->parameters(),
      config_.clip > 0 ? config_.clip : std::numeric_limits<double>::infinity());
  optimizer_->step();
  r.step = ++step_;
  return r;
}

nlohmann::json Trainer::evaluate() {
  // Evaluation draws (e.g. attention types without a seed) from a stream of
  // its own, the same at every evaluation: it never disturbs training.
  auto eval_stream = seeded_generator(stream_seed(config_.seed, 3)).get_state();
  GlobalRngScope scope(eval_stream);
  torch::NoGradGuard no_grad;
  model_->eval();
  auto metrics = task_->evaluate(*model_, eval_set_);
  model_->train();
  (void)take_auxiliary_losses(*model_);  // drop losses of the evaluation forwards
  return metrics;
}

void Trainer::run(const std::string& checkpoint_dir,
                  const std::function<void(const StepRecord&)>& on_step,
                  const std::function<bool()>& stop) {
  while (step_ < config_.steps) {
    bool halt = stop && stop();
    if (config_.time_budget > 0 && train_seconds_ >= config_.time_budget) halt = true;
    if (dp_) halt = dp_->any(halt);  // every rank stops at the same step
    if (halt) break;
    auto r = train_step();
    if (config_.eval_every > 0 && (step_ % config_.eval_every == 0 || step_ == config_.steps)) {
      r.eval = evaluate();
    }
    if (!checkpoint_dir.empty() && config_.checkpoint_every > 0 &&
        step_ % config_.checkpoint_every == 0 && step_ < config_.steps) {
      save_checkpoint(checkpoint_dir);
    }
    if (on_step) on_step(r);
  }
  if (!checkpoint_dir.empty()) save_checkpoint(checkpoint_dir);
}

void Trainer::save_checkpoint(const std::string& dir) {
  TORCH_CHECK(!dir.empty(), "checkpoint: directory must not be empty");
  // Data parallel: every rank hands its generator state to rank 0, which writes.
  std::vector<torch::Tensor> rank_rng;
  if (dp_) rank_rng = dp_->allgather(global_rng_state_);
  if (dp_ && dp_->rank() != 0) return;
  make_dir(dir);
  std::map<std::string, torch::Tensor> tensors;
  const auto weights = state_tensors(*model_);
  for (const auto& [name, t] : weights) tensors["model." + name] = t;
  for (const auto& [name, t] : optimizer_state_tensors(*optimizer_, "optimizer.")) {
    tensors[name] = t;
  }
  tensors["rng.global"] = global_rng_state_;
  tensors["rng.data"] = data_gen_.get_state();
  for (size_t r = 1; r < rank_rng.size(); ++r) {
    tensors["rng.global.rank" + std::to_string(r)] = rank_rng[r];
  }
  std::map<std::string, std::string> meta = {
      {"world_size", std::to_string(dp_ ? dp_->world_size() : 1)},
      {"format", kFormat},
      {"version", kVersion},
      {"step", std::to_string(step_)},
      {"config", config_.to_json().dump()},
      {"tensors", std::to_string(tensors.size())},
      {"checksum", checksum(tensors)},
      {"threads", std::to_string(at::get_num_threads())},
  };
  // The training time only where a time budget needs it: it differs between
  // runs, and checkpoints of runs without a budget stay byte-identical
  // between a resumed and an uninterrupted run.
  if (config_.time_budget > 0) meta["train_seconds"] = std::to_string(train_seconds_);
  // The full checkpoint first, then the weights-only file: a crash between
  // the two leaves a complete checkpoint and an older model file.
  save_safetensors(dir + "/" + kCheckpointFile, tensors, meta);
  save_safetensors(dir + "/" + kModelFile, weights,
                   {{"format", "fastattn-model"},
                    {"step", std::to_string(step_)},
                    {"config", config_.to_json().dump()}});
}

TrainConfig Trainer::checkpoint_config(const std::string& dir) {
  const auto file = read_checkpoint(dir);
  try {
    return TrainConfig::from_json(nlohmann::json::parse(file.metadata.at("config")));
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, "checkpoint in '", dir, "': its config is not valid JSON: ", e.what());
  }
}

void Trainer::load_checkpoint(const std::string& dir) {
  const auto file = read_checkpoint(dir);
  const auto stored = TrainConfig::from_json(nlohmann::json::parse(file.metadata.at("config")));
  const auto a = comparable(stored), b = comparable(config_);
  if (a != b) {
    std::string diffs;
    for (const auto& [key, value] : b.items()) {
      if (!a.contains(key) || a[key] != value) {
        diffs += "\n  " + key + ": checkpoint " + (a.contains(key) ? a[key].dump() : "(none)") +
                 ", this run " + value.dump();
      }
    }
    TORCH_CHECK(false, "checkpoint in '", dir,
                "' was made with a different config (only steps, eval_every and "
                "checkpoint_every may change):",
                diffs);
  }
  std::map<std::string, torch::Tensor> model, optim;
  for (const auto& [name, t] : file.tensors) {
    if (name.rfind("model.", 0) == 0) model[name.substr(6)] = t;
    if (name.rfind("optimizer.", 0) == 0) optim[name] = t;
  }
  const int64_t world = dp_ ? dp_->world_size() : 1, rank = dp_ ? dp_->rank() : 0;
  const auto ws = file.metadata.find("world_size");
  const std::string stored_world = ws == file.metadata.end() ? "1" : ws->second;
  TORCH_CHECK(stored_world == std::to_string(world), "checkpoint in '", dir, "' was made by ",
              stored_world, " process(es) and this run has ", world,
              ": resume with the same number of processes (--nproc / WORLD_SIZE), since the "
              "batch per process, the data slices and the dropout streams depend on it");
  const std::string rng_key = rank == 0 ? "rng.global" : "rng.global.rank" + std::to_string(rank);
  TORCH_CHECK(file.tensors.count(rng_key) && file.tensors.count("rng.data"), "checkpoint in '", dir,
              "' is incomplete: no generator states ('", rng_key, "', 'rng.data')");
  load_state(*model_, model, /*strict=*/true);
  load_optimizer_state_tensors(*optimizer_, optim, "optimizer.");
  global_rng_state_ = file.tensors.at(rng_key).clone();
  data_gen_.set_state(file.tensors.at("rng.data"));
  step_ = std::stoll(file.metadata.at("step"));
  // Checkpoints of runs without a time budget do not store the training time.
  auto secs = file.metadata.find("train_seconds");
  train_seconds_ = secs == file.metadata.end() ? 0.0 : std::stod(secs->second);
}

LoadStateReport Trainer::load_weights(const std::string& dir) {
  const auto file = read_checkpoint(dir);
  std::map<std::string, torch::Tensor> model;
  for (const auto& [name, t] : file.tensors) {
    if (name.rfind("model.", 0) == 0) model[name.substr(6)] = t;
  }
  std::string missing;
  for (const auto& p : model_->named_parameters()) {
    if (!model.count(p.key())) missing += (missing.empty() ? "" : ", ") + p.key();
  }
  TORCH_CHECK(missing.empty(), "checkpoint in '", dir,
              "' lacks parameters this model needs (was it trained with another size or an "
              "attention type without learned parameters?): ",
              missing);
  return load_state(*model_, model, /*strict=*/false);
}

}  // namespace fastattn::train
