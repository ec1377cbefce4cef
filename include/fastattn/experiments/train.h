// Training: the RAdam optimiser, learning-rate schedules, synthetic tasks
// (masked copy, sequence transduction) with their models, and a Trainer with
// exact resume from atomic safetensors checkpoints. docs/training.md has the
// details (checkpoint format, reproducibility guarantees).
//
//   fastattn::train::TrainConfig config;
//   config.task = {{"name", "copy"}, {"length", 16}, {"vocab", 8}};
//   config.model = {{"layers", 2}, {"heads", 2}, {"d_model", 32}, {"attention", "full"}};
//   config.steps = 500;
//   fastattn::train::Trainer trainer(config);
//   trainer.run("checkpoints/");            // checkpoints every config.checkpoint_every steps
//   auto metrics = trainer.evaluate();      // {"accuracy": ..., "loss": ...}
#pragma once

#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "fastattn/mask.h"
#include "fastattn/recurrent_transformer.h"
#include "fastattn/safetensors.h"
#include "fastattn/transformer.h"

namespace fastattn::train {

// ---- RAdam ------------------------------------------------------------------------

// Rectified Adam (Liu et al. 2020, "On the Variance of the Adaptive Learning
// Rate and Beyond"), as torch.optim.RAdam computes it. With g the gradient
// (plus weight_decay·θ unless decoupled), at step t:
//   m = β1 m + (1-β1) g,  v = β2 v + (1-β2) g²,  m̂ = m / (1-β1^t)
//   ρ∞ = 2/(1-β2) - 1,  ρt = ρ∞ - 2 t β2^t / (1-β2^t)
//   ρt > 5:  θ -= lr · m̂ · rt · sqrt(1-β2^t) / (sqrt(v) + eps),
//            rt = sqrt((ρt-4)(ρt-2)ρ∞ / ((ρ∞-4)(ρ∞-2)ρt))
//   else:    θ -= lr · m̂                    (un-adapted momentum SGD)
// With decoupled_weight_decay, θ -= lr·weight_decay·θ first (AdamW-style).
struct RAdamOptions : public torch::optim::OptimizerCloneableOptions<RAdamOptions> {
  RAdamOptions(double lr = 1e-3) : lr_(lr) {}
  TORCH_ARG(double, lr) = 1e-3;
  typedef std::tuple<double, double> betas_t;
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, weight_decay) = 0;
  TORCH_ARG(bool, decoupled_weight_decay) = false;

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
};

struct RAdamParamState : public torch::optim::OptimizerCloneableParamState<RAdamParamState> {
  TORCH_ARG(int64_t, step) = 0;
  TORCH_ARG(torch::Tensor, exp_avg);
  TORCH_ARG(torch::Tensor, exp_avg_sq);

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
};

class RAdam : public torch::optim::Optimizer {
 public:
  explicit RAdam(std::vector<torch::optim::OptimizerParamGroup> param_groups,
                 RAdamOptions defaults = {});
  explicit RAdam(std::vector<torch::Tensor> params, RAdamOptions defaults = {});
  torch::Tensor step(LossClosure closure = nullptr) override;
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;
};

// ---- optimisers and schedules -------------------------------------------------------

struct OptimizerConfig {
  std::string name = "radam";  // adam, adamw, radam
  double lr = 1e-3;
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  double weight_decay = 0.0;  // L2 for adam/radam, decoupled for adamw
};

// Builds the optimiser over `params`; throws naming a bad setting.
std::unique_ptr<torch::optim::Optimizer> make_optimizer(const OptimizerConfig& config,
                                                        std::vector<torch::Tensor> params);
// The names make_optimizer takes: "adam, adamw or radam" and those registered.
std::string optimizer_names(const char* last_separator = " or ");
bool is_optimizer_name(const std::string& name);

// One parameter's optimiser state as a step count and named tensors of the
// parameter's shape (undefined ones are left out of checkpoints); the
// callee may replace any of them (loading).
using OptimizerStateFields =
    std::function<void(int64_t& step, const std::map<std::string, torch::Tensor*>& tensors)>;

// An optimiser by name, as `fastattn train --optimizer NAME` and the
// training config's "optimizer": {"name": ...} use it. For checkpoints:
// `state_fields` shows a state of this optimiser's kind to f and returns
// true (false: not its kind), `fresh_state` makes an empty state for an
// optimiser it made (nullptr: not one of its own).
struct OptimizerType {
  std::string name;
  std::function<std::unique_ptr<torch::optim::Optimizer>(const OptimizerConfig&,
                                                         std::vector<torch::Tensor>)>
      make;
  std::function<bool(torch::optim::OptimizerParamState&, const OptimizerStateFields& f)>
      state_fields;
  std::function<std::unique_ptr<torch::optim::OptimizerParamState>(const torch::optim::Optimizer&)>
      fresh_state;
};
// The built-ins (adam, adamw, radam), then those added by
// register_optimizer_type, in order. Register before training starts, not
// from several threads at once.
const std::vector<OptimizerType>& optimizer_types();
// A name already taken, an empty name or a missing function is an error.
void register_optimizer_type(OptimizerType type);

// The optimiser's per-parameter state as named tensors "<prefix><i>.<field>"
// (i = the parameter's index over all groups; the fields its OptimizerType
// shows, e.g. exp_avg, exp_avg_sq, max_exp_avg_sq, and step as an int64
// scalar) and back.
// Loading checks that every parameter with state in the map gets it, with
// matching shapes.
std::map<std::string, torch::Tensor> optimizer_state_tensors(const torch::optim::Optimizer& opt,
                                                             const std::string& prefix);
void load_optimizer_state_tensors(torch::optim::Optimizer& opt,
                                  const std::map<std::string, torch::Tensor>& tensors,
                                  const std::string& prefix);

// Learning rate at step `step` (0-based): linear warm-up from lr/warmup to lr
// over the first `warmup` steps, then `decay` over the remaining steps to
// min_lr_ratio·lr at step total_steps: "constant", "linear" or "cosine".
struct ScheduleConfig {
  int64_t warmup = 0;
  std::string decay = "constant";
  double min_lr_ratio = 0.0;
};
double scheduled_lr(const ScheduleConfig& schedule, double lr, int64_t step, int64_t total_steps);

// ---- models -------------------------------------------------------------------------

// Sinusoidal positions (Vaswani et al.): (L, D) of sin/cos at geometric
// frequencies.
torch::Tensor sinusoidal_positions(int64_t length, int64_t d_model, torch::ScalarType dtype);

// Token embedding (N(0, 1) initialised, unscaled) + sinusoidal positions, an encoder from
// EncoderBuilder::from_json(config), a linear head to the vocabulary.
// Submodules: embedding, encoder, head.
class EncoderClassifierImpl : public torch::nn::Module {
 public:
  EncoderClassifierImpl(int64_t vocab, const nlohmann::json& encoder_config);
  // tokens (N, L) int64 -> logits (N, L, vocab)
  torch::Tensor forward(const torch::Tensor& tokens, const Mask& mask = Mask());
  int64_t d_model() const { return d_model_; }

 private:
  int64_t d_model_;
  torch::nn::Embedding embedding_{nullptr};
  TransformerEncoder encoder_{nullptr};
  torch::nn::Linear head_{nullptr};
};
TORCH_MODULE(EncoderClassifier);

// Encoder-decoder over one shared vocabulary and embedding: config
// {"encoder": <EncoderBuilder JSON>, "decoder": <DecoderBuilder JSON>}.
// Submodules: embedding, encoder, decoder, head.
class Seq2SeqImpl : public torch::nn::Module {
 public:
  Seq2SeqImpl(int64_t vocab, const nlohmann::json& config);
  // source (N, S), source_lengths (N,) -> memory (N, S, D)
  torch::Tensor encode(const torch::Tensor& source, const torch::Tensor& source_lengths);
  // target_in (N, T) -> logits (N, T, vocab), causal over target_in.
  torch::Tensor decode(const torch::Tensor& target_in, const torch::Tensor& memory,
                       const torch::Tensor& source_lengths);

  // ---- token-by-token decoding (inference) ----
  // Whether the decoder's self-attention type has a step form
  // (recurrent_attention_names(): full, causal-linear, hard-retrieval).
  bool has_step_decoder() const;
  // The decoder's recurrent twin holding the current weights, in eval mode
  // (an error when has_step_decoder() is false).
  RecurrentDecoder make_step_decoder() const;
  // Token embedding plus position `position` of tokens (N,) -> (N, D).
  torch::Tensor embed_step(const torch::Tensor& tokens, int64_t position);
  // Decoder output (N, D) -> logits (N, vocab).
  torch::Tensor logits(const torch::Tensor& decoder_output) { return head_(decoder_output); }

 private:
  DecoderBuilder decoder_builder_;
  int64_t d_model_;
  torch::nn::Embedding embedding_{nullptr};
  TransformerEncoder encoder_{nullptr};
  TransformerDecoder decoder_{nullptr};
  torch::nn::Linear head_{nullptr};
};
TORCH_MODULE(Seq2Seq);

// ---- tasks --------------------------------------------------------------------------

// A batch: named tensors (the task decides the names).
using Batch = std::map<std::string, torch::Tensor>;

class Task {
 public:
  virtual ~Task() = default;
  virtual std::string name() const = 0;
  // The task's settings with defaults filled in.
  virtual nlohmann::json config() const = 0;
  // The model for `model_config` (builder JSON), initialised from the global generator.
  virtual std::shared_ptr<torch::nn::Module> make_model(
      const nlohmann::json& model_config) const = 0;
  // A batch drawn from `gen` only.
  virtual Batch sample(int64_t batch_size, at::Generator& gen) const = 0;
  // The training loss (scalar) of a batch.
  virtual torch::Tensor loss(torch::nn::Module& model, const Batch& batch) const = 0;
  // Metrics over evaluation batches (model in eval mode, no grad).
  virtual nlohmann::json evaluate(torch::nn::Module& model,
                                  const std::vector<Batch>& batches) const = 0;
  // The fixed evaluation set of a run: by default `count` batches of
  // `batch_size` drawn with sample(). Tasks with held-out data override it
  // (digits: the whole test split; charlm: windows of the validation split).
  virtual std::vector<Batch> evaluation_batches(int64_t batch_size, int64_t count,
                                                at::Generator& gen) const;
};

// The task of {"name": NAME, ...} for any registered task type (below);
// unknown names or keys are errors listing the valid ones.
std::unique_ptr<Task> make_task(const nlohmann::json& config);

// ---- task types by name --------------------------------------------------------------

// A setting of a task type that `fastattn train` offers as --flag: it sets
// `key` of the task's JSON.
struct TaskSetting {
  enum class Kind { Integer, Number, Text, Boolean };
  std::string flag;  // "mask-fraction"
  std::string key;   // "mask_fraction"
  Kind kind = Kind::Integer;
  std::string metavar;       // "F" (booleans take none)
  std::string help;          // "fraction masked in each half, (0, 0.5]"
  std::string default_text;  // "0.2"; "" where the default is not one value
};

struct TrainedModel;     // lm_tasks.h
struct GenerateRequest;  // lm_tasks.h
struct GenerateReport;   // lm_tasks.h

// How `fastattn generate --checkpoint` samples from a model trained on a task
// type (the digits and charlm types have one; copy and transduction none: an
// empty `run`). `flags` are the type's own generate flags (their `key`s name
// the entries of GenerateRequest::values); the program checks the common
// ones (--samples, --greedy, --temperature, --seed, --batch-form), refuses a
// flag of another type, and prints and records what `run` reports.
struct TaskGenerator {
  std::vector<TaskSetting> flags;
  int64_t default_count = 1;  // samples when --samples is not given
  std::function<GenerateReport(TrainedModel&, const GenerateRequest&)> run;
};

// What make_task builds for {"name": name, ...}, and what `fastattn train`
// (and `fastattn generate --checkpoint`) says about it.
struct TaskType {
  std::string name;
  std::string description;       // a paragraph of `fastattn train --help`
  bool encoder_decoder = false;  // its model JSON is {"encoder": {...}, "decoder": {...}}
  std::vector<TaskSetting> settings;
  std::function<std::unique_ptr<Task>(const nlohmann::json&)> make;
  TaskGenerator generator = {};  // optional
};

// Every task type: the built-ins (copy, transduction, digits, charlm), then
// those added by register_task_type, in order. Register before training
// starts, not from several threads at once.
const std::vector<TaskType>& task_types();
const TaskType* find_task_type(const std::string& name);  // nullptr if none
// A name already taken, an empty name or no factory is an error.
void register_task_type(TaskType type);
// "copy, transduction, digits or charlm"
std::string task_type_names(const char* last_separator = " or ");

// Masked copy (clustered attention paper, appendix C.2). Tokens: 0 separator,
// 1..vocab symbols, vocab+1 mask. A random x of `length` symbols gives the
// target [0, x, 0, x] (length 2·length+2); the input masks
// round(mask_fraction·length) positions of the first copy and as many other
// positions of the second, so every symbol is visible in exactly one half or
// both. Loss: cross-entropy on the masked positions ("loss": "masked") or all
// ("all"). Metrics: accuracy on masked positions, sequence_accuracy (every
// masked position right), loss.
struct CopyTaskOptions {
  int64_t length = 32;
  int64_t vocab = 10;
  double mask_fraction = 0.2;
  std::string loss = "masked";
};
class CopyTask : public Task {
 public:
  explicit CopyTask(CopyTaskOptions options);
  std::string name() const override { return "copy"; }
  nlohmann::json config() const override;
  std::shared_ptr<torch::nn::Module> make_model(const nlohmann::json& model_config) const override;
  // "input", "target" (N, 2·length+2) int64, "masked" (N, 2·length+2) bool.
  Batch sample(int64_t batch_size, at::Generator& gen) const override;
  torch::Tensor loss(torch::nn::Module& model, const Batch& batch) const override;
  nlohmann::json evaluate(torch::nn::Module& model,
                          const std::vector<Batch>& batches) const override;
  const CopyTaskOptions& options() const { return options_; }

 private:
  CopyTaskOptions options_;
};

// Sequence transduction for encoder-decoder models: a source of
// min_length..max_length symbols, target its reverse ("reverse") or its
// sorted copy ("sort"). Tokens: 0 pad, 1 begin, 2 end, 3..vocab+2 symbols.
// Loss: teacher-forced cross-entropy on the target and its end token.
// Metrics: exact_match under greedy decoding (the whole output up to the end
// token equals the target), token_accuracy (teacher-forced), loss.
struct TransductionTaskOptions {
  std::string mode = "reverse";
  int64_t vocab = 10;
  int64_t min_length = 20;
  int64_t max_length = 60;
};
class TransductionTask : public Task {
 public:
  explicit TransductionTask(TransductionTaskOptions options);
  std::string name() const override { return "transduction"; }
  nlohmann::json config() const override;
  std::shared_ptr<torch::nn::Module> make_model(const nlohmann::json& model_config) const override;
  // "source" (N, S), "source_lengths" (N,), "target_in" (N, T) (begin + target),
  // "target_out" (N, T) (target + end, pad 0), "target_lengths" (N,) (with the end token).
  Batch sample(int64_t batch_size, at::Generator& gen) const override;
  torch::Tensor loss(torch::nn::Module& model, const Batch& batch) const override;
  nlohmann::json evaluate(torch::nn::Module& model,
                          const std::vector<Batch>& batches) const override;
  // Greedy decoding: (N, max_steps) tokens, 0 after each row's end token.
  // "step": token by token through the decoder's recurrent twin (cached
  // self-attention state, memory prepared once; O(T) decoder work);
  // "rerun": the batch decoder over the whole prefix at every step (O(T²));
  // "auto": step when the self-attention type has a step form, else rerun.
  // Decoding stops once every row has emitted its end token, unless
  // stop_at_end is false (then it runs all max_steps, e.g. for timing).
  torch::Tensor greedy_decode(Seq2SeqImpl& model, const torch::Tensor& source,
                              const torch::Tensor& source_lengths, int64_t max_steps,
                              const std::string& method = "auto", bool stop_at_end = true) const;
  const TransductionTaskOptions& options() const { return options_; }

 private:
  TransductionTaskOptions options_;
};

// ---- trainer ------------------------------------------------------------------------

class DataParallel;  // fastattn/experiments/distributed.h

struct TrainConfig {
  nlohmann::json task = {{"name", "copy"}};
  nlohmann::json model = nlohmann::json::object();  // builder JSON (see the task)
  OptimizerConfig optimizer;
  ScheduleConfig schedule;
  double clip = 0.0;  // max global gradient norm; 0 = no clipping
  int64_t steps = 1000;
  int64_t batch_size = 32;
  int64_t eval_every = 0;        // 0 = only when asked
  int64_t eval_batches = 4;      // of batch_size sequences, fixed for the run
  int64_t checkpoint_every = 0;  // 0 = only at the end of run()
  int64_t seed = 0;
  // Stop run() once the training time (seconds spent in train_step, summed
  // over resumed runs) reaches this; 0 = no limit. `steps` still caps the run
  // and sets the schedule's length. Checkpoints store the training time only
  // when a budget is set (it varies from run to run; without a budget a
  // resumed run's checkpoint stays byte-identical to an uninterrupted one's).
  double time_budget = 0.0;

  nlohmann::json to_json() const;
  // Missing keys keep their defaults; unknown keys are errors.
  static TrainConfig from_json(const nlohmann::json& j);
};

struct StepRecord {
  int64_t step = 0;                    // steps done after this one
  double loss = 0;                     // task loss
  double aux_loss = 0;                 // take_auxiliary_losses (0 when none)
  double lr = 0;                       // learning rate used
  double grad_norm = 0;                // global norm before clipping
  std::optional<nlohmann::json> eval;  // when this step evaluated
};

// Runs training. All randomness is the trainer's own: model initialisation
// and the global CPU generator stream (dropout, attention types without a
// seed) come from `seed`, batches from a separate data generator, evaluation
// from a fixed set and a generator seeded per evaluation; the global
// generator's state is swapped in around each step and swapped out after, so
// several trainers in one process do not disturb each other.
//
// With a DataParallel (fastattn/experiments/distributed.h, docs/distributed.md) the
// trainer is one rank of W: batch_size is per rank, every rank draws the same
// batch of W·batch_size from the data generator and keeps its slice, so W
// ranks see exactly the batch one process with batch W·batch_size sees;
// rank 0's parameters are broadcast at start; gradients are averaged over the
// ranks before clipping; ranks r > 0 draw dropout from streams of their own;
// only rank 0 writes checkpoints (with every rank's generator state and the
// world size, which a resume must match). Every rank must call run(),
// save_checkpoint() and load_checkpoint() together.
class Trainer {
 public:
  explicit Trainer(TrainConfig config, std::shared_ptr<DataParallel> data_parallel = nullptr);

  const TrainConfig& config() const { return config_; }
  const Task& task() const { return *task_; }
  torch::nn::Module& model() { return *model_; }
  torch::optim::Optimizer& optimizer() { return *optimizer_; }
  int64_t step() const { return step_; }
  // The fixed evaluation batches (drawn from the seed at construction).
  const std::vector<Batch>& eval_set() const { return eval_set_; }
  // Seconds spent in train_step so far, including runs before a resume
  // when the checkpoint was written with a time budget.
  double train_seconds() const { return train_seconds_; }

  // One optimiser step (forward, task + auxiliary loss, backward, clip, step).
  StepRecord train_step();
  // Metrics on the fixed evaluation set.
  nlohmann::json evaluate();
  // Steps until config().steps (or the time budget is spent, or `stop()`
  // returns true), evaluating every
  // eval_every steps and checkpointing into `checkpoint_dir` (if not empty)
  // every checkpoint_every steps and at the end.
  void run(const std::string& checkpoint_dir = "",
           const std::function<void(const StepRecord&)>& on_step = {},
           const std::function<bool()>& stop = {});

  // <dir>/checkpoint.safetensors (everything) and <dir>/model.safetensors
  // (weights only), each written atomically; creates dir.
  void save_checkpoint(const std::string& dir);
  // Restores the state from <dir>/checkpoint.safetensors after verifying it
  // (format, checksum, config equal to this trainer's except `steps`,
  // `eval_every`, `checkpoint_every`).
  void load_checkpoint(const std::string& dir);
  // The config stored in a checkpoint (verifies the file).
  static TrainConfig checkpoint_config(const std::string& dir);
  // Loads only the model weights of the checkpoint in `dir` (verified), to
  // evaluate them under another model config (other attention types: the
  // clustered paper's cross-evaluation, train soft / decode hard). Every
  // parameter of this model must be in the checkpoint with its shape; a
  // buffer it lacks keeps its own value (e.g. the random projections of a
  // feature map the weights were not trained with). Returns the names that
  // did not match (missing buffers, checkpoint tensors this model has not).
  LoadStateReport load_weights(const std::string& dir);

 private:
  void swap_rng_in();
  void swap_rng_out();

  TrainConfig config_;
  std::unique_ptr<Task> task_;
  std::shared_ptr<torch::nn::Module> model_;
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  at::Generator data_gen_;
  torch::Tensor global_rng_state_;  // the trainer's stream of the global generator
  torch::Tensor saved_global_state_;
  std::vector<Batch> eval_set_;
  int64_t step_ = 0;
  std::shared_ptr<DataParallel> dp_;  // null: one process
  double train_seconds_ = 0.0;
};

// Name of the checkpoint file in a checkpoint directory.
constexpr const char* kCheckpointFile = "checkpoint.safetensors";
constexpr const char* kModelFile = "model.safetensors";

}  // namespace fastattn::train
