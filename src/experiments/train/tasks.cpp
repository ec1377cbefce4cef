// Synthetic training tasks and their models: the masked copy task (clustered
// attention paper, appendix C.2) over an encoder with a token head, and
// sequence transduction (reverse / sort) over an encoder-decoder with greedy
// decoding. Sampling draws only from the generator it is given.
#include <cmath>
#include <nlohmann/json.hpp>

#include "fastattn/experiments/lm_tasks.h"
#include "fastattn/experiments/train.h"
#include "experiments/train/json_fields.h"

namespace fastattn::train {

namespace {

torch::Tensor embed(torch::nn::Embedding& embedding, const torch::Tensor& tokens, int64_t d_model) {
  // nn::Embedding starts at N(0, 1) per coordinate, the scale of the positions:
  // no sqrt(D) factor, which would drown the positions.
  auto x = embedding(tokens);  // (N, L, D)
  return x + sinusoidal_positions(tokens.size(1), d_model, x.scalar_type()).unsqueeze(0);
}

}  // namespace

torch::Tensor sinusoidal_positions(int64_t length, int64_t d_model, torch::ScalarType dtype) {
  auto pos = torch::arange(length, torch::kDouble).unsqueeze(1);  // (L, 1)
  auto i = torch::arange(d_model, torch::kLong);                  // (D,)
  auto freq = torch::exp(-(i.div(2, "floor") * 2).to(torch::kDouble) *
                         (std::log(10000.0) / static_cast<double>(d_model)));  // (D,)
  auto angle = pos * freq.unsqueeze(0);                                        // (L, D)
  auto even = (i.remainder(2) == 0).unsqueeze(0);
  return torch::where(even, angle.sin(), angle.cos()).to(dtype);
}

// ---- models -------------------------------------------------------------------------

EncoderClassifierImpl::EncoderClassifierImpl(int64_t vocab, const nlohmann::json& encoder_config) {
  TORCH_CHECK(vocab >= 1, "EncoderClassifier: vocab must be >= 1, got ", vocab);
  auto builder = EncoderBuilder::from_json(encoder_config);
  encoder_ = register_module("encoder", builder.build());
  d_model_ = encoder_->layers().front()->options().d_model();
  embedding_ = register_module("embedding", torch::nn::Embedding(vocab, d_model_));
  head_ = register_module("head", torch::nn::Linear(d_model_, vocab));
}

torch::Tensor EncoderClassifierImpl::forward(const torch::Tensor& tokens,  // (N, L)
                                             const Mask& mask) {
  return head_(encoder_(embed(embedding_, tokens, d_model_), mask));  // (N, L, vocab)
}

Seq2SeqImpl::Seq2SeqImpl(int64_t vocab, const nlohmann::json& config) {
  TORCH_CHECK(vocab >= 1, "Seq2Seq: vocab must be >= 1, got ", vocab);
  check_keys("Seq2Seq config", config, {"encoder", "decoder"});
  const auto enc = config.value("encoder", nlohmann::json::object());
  const auto dec = config.value("decoder", nlohmann::json::object());
  decoder_builder_ = DecoderBuilder::from_json(dec);
  encoder_ = register_module("encoder", EncoderBuilder::from_json(enc).build());
  decoder_ = register_module("decoder", decoder_builder_.build());
  d_model_ = encoder_->layers().front()->options().d_model();
  const int64_t dd = decoder_->layers().front()->options().d_model();
  TORCH_CHECK(dd == d_model_, "Seq2Seq: the decoder's d_model (", dd,
              ") must equal the encoder's (", d_model_, ")");
  embedding_ = register_module("embedding", torch::nn::Embedding(vocab, d_model_));
  head_ = register_module("head", torch::nn::Linear(d_model_, vocab));
}

torch::Tensor Seq2SeqImpl::encode(const torch::Tensor& source,  // (N, S)
                                  const torch::Tensor& source_lengths) {
  return encoder_(embed(embedding_, source, d_model_),
                  Mask().with_key_lengths(source_lengths));  // (N, S, D)
}

torch::Tensor Seq2SeqImpl::decode(const torch::Tensor& target_in,  // (N, T)
                                  const torch::Tensor& memory,     // (N, S, D)
                                  const torch::Tensor& source_lengths) {
  auto y = decoder_(embed(embedding_, target_in, d_model_), memory, Mask(),
                    Mask().with_key_lengths(source_lengths));
  return head_(y);  // (N, T, vocab)
}

bool Seq2SeqImpl::has_step_decoder() const {
  const auto& names = recurrent_attention_names();
  return std::find(names.begin(), names.end(), decoder_builder_.self_attention_spec().type) !=
         names.end();
}

RecurrentDecoder Seq2SeqImpl::make_step_decoder() const {
  TORCH_CHECK(has_step_decoder(), "Seq2Seq: the decoder's self-attention '",
              decoder_builder_.self_attention_spec().type, "' has no step form");
  auto twin = make_recurrent_decoder(decoder_builder_);
  copy_parameters(*twin, *decoder_);
  twin->eval();
  return twin;
}

torch::Tensor Seq2SeqImpl::embed_step(const torch::Tensor& tokens, int64_t position) {
  auto x = embedding_(tokens);  // (N, D)
  return x + sinusoidal_positions(position + 1, d_model_, x.scalar_type())[position];
}

// ---- masked copy ----------------------------------------------------------------------

CopyTask::CopyTask(CopyTaskOptions o) : options_(std::move(o)) {
  TORCH_CHECK(options_.length >= 1, "copy task: length must be >= 1, got ", options_.length);
  TORCH_CHECK(options_.vocab >= 2, "copy task: vocab must be >= 2, got ", options_.vocab);
  TORCH_CHECK(options_.mask_fraction > 0 && options_.mask_fraction <= 0.5,
              "copy task: mask_fraction must be in (0, 0.5], got ", options_.mask_fraction);
  TORCH_CHECK(options_.loss == "masked" || options_.loss == "all",
              "copy task: loss must be one of masked, all, got '", options_.loss, "'");
  const int64_t k = std::llround(options_.mask_fraction * options_.length);
  TORCH_CHECK(k >= 1, "copy task: mask_fraction ", options_.mask_fraction, " of length ",
              options_.length, " masks no position; use a larger length or fraction");
}

nlohmann::json CopyTask::config() const {
  return {{"name", "copy"},
          {"length", options_.length},
          {"vocab", options_.vocab},
          {"mask_fraction", options_.mask_fraction},
          {"loss", options_.loss}};
}

std::shared_ptr<torch::nn::Module> CopyTask::make_model(const nlohmann::json& model_config) const {
  return EncoderClassifier(options_.vocab + 2, model_config).ptr();
}

Batch CopyTask::sample(int64_t B, at::Generator& gen) const {
  TORCH_CHECK(B >= 1, "copy task: batch size must be >= 1, got ", B);
  const int64_t n = options_.length, V = options_.vocab;
  const int64_t k = std::llround(options_.mask_fraction * n);
  auto x = torch::randint(1, V + 1, {B, n}, gen, torch::kLong);  // (B, n) symbols
  // A random permutation per row: its first k positions are masked in the
  // first copy, the next k in the second.
  auto order =
      torch::rand({B, n}, gen, torch::kDouble).argsort(/*dim=*/1, /*descending=*/false);  // (B, n)
  auto rank = torch::empty_like(order).scatter_(1, order, torch::arange(n).expand({B, n}));
  auto mask1 = rank < k, mask2 = (rank >= k) & (rank < 2 * k);  // (B, n)
  auto sep = torch::zeros({B, 1}, torch::kLong);
  auto target = torch::cat({sep, x, sep, x}, 1);  // (B, 2n+2)
  auto no = torch::zeros({B, 1}, torch::kBool);
  auto masked = torch::cat({no, mask1, no, mask2}, 1);  // (B, 2n+2)
  auto input = target.masked_fill(masked, V + 1);
  return {{"input", input}, {"target", target}, {"masked", masked}};
}

torch::Tensor CopyTask::loss(torch::nn::Module& model, const Batch& b) const {
  auto& m = dynamic_cast<EncoderClassifierImpl&>(model);
  auto logits = m.forward(b.at("input"));  // (B, L, V+2)
  auto flat = logits.reshape({-1, logits.size(-1)});
  auto target = b.at("target").reshape({-1});
  if (options_.loss == "all") return torch::nn::functional::cross_entropy(flat, target);
  auto sel = b.at("masked").reshape({-1}).nonzero().squeeze(1);
  return torch::nn::functional::cross_entropy(flat.index_select(0, sel),
                                              target.index_select(0, sel));
}

nlohmann::json CopyTask::evaluate(torch::nn::Module& model,
                                  const std::vector<Batch>& batches) const {
  auto& m = dynamic_cast<EncoderClassifierImpl&>(model);
  double correct = 0, total = 0, seq_correct = 0, seqs = 0, loss_sum = 0;
  for (const auto& b : batches) {
    auto logits = m.forward(b.at("input"));
    auto masked = b.at("masked");
    auto target = b.at("target");
    auto right = logits.argmax(-1) == target;  // (B, L)
    correct += (right & masked).sum().item<double>();
    total += masked.sum().item<double>();
    seq_correct += (right | ~masked).all(1).sum().item<double>();
    seqs += static_cast<double>(target.size(0));
    auto sel = masked.reshape({-1}).nonzero().squeeze(1);
    auto flat = logits.reshape({-1, logits.size(-1)}).index_select(0, sel);
    loss_sum += torch::nn::functional::cross_entropy(
                    flat, target.reshape({-1}).index_select(0, sel),
                    torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum))
                    .item<double>();
  }
  return {{"accuracy", correct / total},
          {"sequence_accuracy", seq_correct / seqs},
          {"loss", loss_sum / total},
          {"masked_positions", total}};
}

// ---- transduction ---------------------------------------------------------------------

namespace {
constexpr int64_t kPad = 0, kBegin = 1, kEnd = 2, kFirstSymbol = 3;
}

TransductionTask::TransductionTask(TransductionTaskOptions o) : options_(std::move(o)) {
  TORCH_CHECK(options_.mode == "reverse" || options_.mode == "sort",
              "transduction task: mode must be one of reverse, sort, got '", options_.mode, "'");
  TORCH_CHECK(options_.vocab >= 2, "transduction task: vocab must be >= 2, got ", options_.vocab);
  TORCH_CHECK(options_.min_length >= 1, "transduction task: min_length must be >= 1, got ",
              options_.min_length);
  TORCH_CHECK(options_.max_length >= options_.min_length,
              "transduction task: max_length must be >= min_length (", options_.min_length,
              "), got ", options_.max_length);
}

nlohmann::json TransductionTask::config() const {
  return {{"name", "transduction"},
          {"mode", options_.mode},
          {"vocab", options_.vocab},
          {"min_length", options_.min_length},
          {"max_length", options_.max_length}};
}

std::shared_ptr<torch::nn::Module> TransductionTask::make_model(
    const nlohmann::json& model_config) const {
  return Seq2Seq(options_.vocab + kFirstSymbol, model_config).ptr();
}

Batch TransductionTask::sample(int64_t B, at::Generator& gen) const {
  TORCH_CHECK(B >= 1, "transduction task: batch size must be >= 1, got ", B);
  const int64_t S = options_.max_length, V = options_.vocab;
  auto lengths = torch::randint(options_.min_length, options_.max_length + 1, {B}, gen,
                                torch::kLong);                                         // (B,)
  auto x = torch::randint(kFirstSymbol, kFirstSymbol + V, {B, S}, gen, torch::kLong);  // (B, S)
  auto pos = torch::arange(S).unsqueeze(0);                                            // (1, S)
  auto valid = pos < lengths.unsqueeze(1);                                             // (B, S)
  auto source = x.masked_fill(~valid, kPad);
  torch::Tensor y;
  if (options_.mode == "reverse") {
    // y_i = x_{len-1-i} for i < len.
    auto idx = (lengths.unsqueeze(1) - 1 - pos).clamp_min(0);
    y = source.gather(1, idx).masked_fill(~valid, kPad);
  } else {
    // Sort with the padding (as a large value) last.
    y = std::get<0>(source.masked_fill(~valid, kFirstSymbol + V).sort(1)).masked_fill(~valid, kPad);
  }
  auto end_col = torch::full({B, 1}, kPad, torch::kLong);
  auto target_out = torch::cat({y, end_col}, 1);       // (B, S+1)
  target_out.scatter_(1, lengths.unsqueeze(1), kEnd);  // end token at len
  auto target_in = torch::cat({torch::full({B, 1}, kBegin, torch::kLong), y}, 1);  // (B, S+1)
  return {{"source", source},
          {"source_lengths", lengths},
          {"target_in", target_in},
          {"target_out", target_out},
          {"target_lengths", lengths + 1}};
}

torch::Tensor TransductionTask::loss(torch::nn::Module& model, const Batch& b) const {
  auto& m = dynamic_cast<Seq2SeqImpl&>(model);
  auto memory = m.encode(b.at("source"), b.at("source_lengths"));
  auto logits = m.decode(b.at("target_in"), memory, b.at("source_lengths"));  // (B, T, V)
  return torch::nn::functional::cross_entropy(
      logits.reshape({-1, logits.size(-1)}), b.at("target_out").reshape({-1}),
      torch::nn::functional::CrossEntropyFuncOptions().ignore_index(kPad));
}

torch::Tensor TransductionTask::greedy_decode(Seq2SeqImpl& model, const torch::Tensor& source,
                                              const torch::Tensor& source_lengths,
                                              int64_t max_steps, const std::string& method,
                                              bool stop_at_end) const {
  TORCH_CHECK(method == "auto" || method == "step" || method == "rerun",
              "greedy_decode: method must be one of auto, step, rerun, got '", method, "'");
  const bool step = method == "step" || (method == "auto" && model.has_step_decoder());
  const int64_t B = source.size(0);
  auto memory = model.encode(source, source_lengths);
  auto done = torch::zeros({B}, torch::kBool);
  auto next = torch::full({B}, kBegin, torch::kLong);
  std::vector<torch::Tensor> out;
  if (step) {
    auto decoder = model.make_step_decoder();
    auto state = decoder->prepare(memory, Mask().with_key_lengths(source_lengths));
    for (int64_t t = 0; t < max_steps; ++t) {
      auto [y, s] = decoder->step(model.embed_step(next, t), state);
      state = std::move(s);
      next = model.logits(y).argmax(-1).masked_fill(done, kPad);  // (B,)
      out.push_back(next);
      done = done | (next == kEnd);
      if (stop_at_end && done.all().item<bool>()) break;
    }
  } else {
    auto prefix = next.unsqueeze(1);  // (B, 1)
    for (int64_t t = 0; t < max_steps; ++t) {
      auto logits = model.decode(prefix, memory, source_lengths);  // (B, t+1, V)
      next = logits.select(1, t).argmax(-1).masked_fill(done, kPad);
      out.push_back(next);
      done = done | (next == kEnd);
      if (stop_at_end && done.all().item<bool>()) break;
      prefix = torch::cat({prefix, next.unsqueeze(1)}, 1);
    }
  }
  auto tokens = torch::stack(out, 1);  // (B, steps)
  if (tokens.size(1) < max_steps) {
    tokens = torch::cat({tokens, torch::zeros({B, max_steps - tokens.size(1)}, torch::kLong)}, 1);
  }
  return tokens;
}

nlohmann::json TransductionTask::evaluate(torch::nn::Module& model,
                                          const std::vector<Batch>& batches) const {
  auto& m = dynamic_cast<Seq2SeqImpl&>(model);
  double exact = 0, seqs = 0, tok_right = 0, toks = 0, loss_sum = 0;
  for (const auto& b : batches) {
    auto memory = m.encode(b.at("source"), b.at("source_lengths"));
    auto logits = m.decode(b.at("target_in"), memory, b.at("source_lengths"));
    auto target = b.at("target_out");
    auto real = target != kPad;
    tok_right += ((logits.argmax(-1) == target) & real).sum().item<double>();
    toks += real.sum().item<double>();
    loss_sum += torch::nn::functional::cross_entropy(
                    logits.reshape({-1, logits.size(-1)}), target.reshape({-1}),
                    torch::nn::functional::CrossEntropyFuncOptions().ignore_index(kPad).reduction(
                        torch::kSum))
                    .item<double>();
    auto decoded = greedy_decode(m, b.at("source"), b.at("source_lengths"), target.size(1));
    // Both are 0 after the end token, so equal rows are exact matches.
    exact += (decoded == target).all(1).sum().item<double>();
    seqs += static_cast<double>(target.size(0));
  }
  return {{"exact_match", exact / seqs},
          {"token_accuracy", tok_right / toks},
          {"loss", loss_sum / toks}};
}

std::vector<Batch> Task::evaluation_batches(int64_t batch_size, int64_t count,
                                            at::Generator& gen) const {
  std::vector<Batch> out;
  for (int64_t i = 0; i < count; ++i) out.push_back(sample(batch_size, gen));
  return out;
}

// ---- task types ----------------------------------------------------------------------

namespace {

using Kind = TaskSetting::Kind;

std::vector<TaskType> builtin_task_types() {
  std::vector<TaskType> out;
  out.push_back(
      TaskType{"copy",
               "masked copy (clustered attention paper, appendix C.2): input [sep, x, sep, x] with "
               "--mask-fraction of each half masked (never the same position in both); an encoder "
               "predicts the masked symbols. Metric: accuracy on the masked positions.",
               false,
               {{"length", "length", Kind::Integer, "N", "symbols per half", "32"},
                {"vocab", "vocab", Kind::Integer, "V", "number of symbols", "10"},
                {"mask-fraction", "mask_fraction", Kind::Number, "F",
                 "fraction masked in each half, (0, 0.5]", "0.2"}},
               [](const nlohmann::json& j) {
                 check_keys("copy task", j, {"name", "length", "vocab", "mask_fraction", "loss"});
                 CopyTaskOptions o;
                 read_field("copy task", j, "length", o.length);
                 read_field("copy task", j, "vocab", o.vocab);
                 read_field("copy task", j, "mask_fraction", o.mask_fraction);
                 read_field("copy task", j, "loss", o.loss);
                 return std::unique_ptr<Task>(std::make_unique<CopyTask>(o));
               }});
  out.push_back(TaskType{
      "transduction",
      "encoder-decoder: the output is the reverse (--mode reverse) or the sorted copy (--mode "
      "sort) of a sequence of --min-length to --max-length symbols. Metric: exact match under "
      "greedy decoding.",
      true,
      {{"vocab", "vocab", Kind::Integer, "V", "number of symbols", "10"},
       {"mode", "mode", Kind::Text, "M", "reverse or sort", "reverse"},
       {"min-length", "min_length", Kind::Integer, "N", "shortest sequence", "20"},
       {"max-length", "max_length", Kind::Integer, "N", "longest sequence", "60"}},
      [](const nlohmann::json& j) {
        check_keys("transduction task", j, {"name", "mode", "vocab", "min_length", "max_length"});
        TransductionTaskOptions o;
        read_field("transduction task", j, "mode", o.mode);
        read_field("transduction task", j, "vocab", o.vocab);
        read_field("transduction task", j, "min_length", o.min_length);
        read_field("transduction task", j, "max_length", o.max_length);
        return std::unique_ptr<Task>(std::make_unique<TransductionTask>(o));
      }});
  out.push_back(TaskType{
      "digits",
      "decoder-only: the 8x8 digits of scikit-learn (Debian's python3-sklearn; "
      "scripts/install_deps.sh extracts the file), pixel by pixel over 17 grey levels; "
      "--conditional makes the label the first token. Metric: bits per dimension on the last "
      "297 images.",
      false,
      {{"data", "path", Kind::Text, "PATH", "the digits.csv.gz file", "searched"},
       {"conditional", "conditional", Kind::Boolean, "", "the first token is the image's label",
        ""}},
      [](const nlohmann::json& j) {
        check_keys("digits task", j, {"name", "path", "conditional", "test_size"});
        DigitsTaskOptions o;
        read_field("digits task", j, "path", o.path);
        read_field("digits task", j, "conditional", o.conditional);
        read_field("digits task", j, "test_size", o.test_size);
        return std::unique_ptr<Task>(std::make_unique<DigitsTask>(o));
      },
      digits_generator()});
  out.push_back(TaskType{
      "charlm",
      "decoder-only: bytes of a text corpus (--data, default the `fortunes` package), random "
      "windows of --length. Metric: bits per character on the held-out split (every 10th 10 kB "
      "block).",
      false,
      {{"length", "length", Kind::Integer, "N", "window", "256"},
       {"data", "path", Kind::Text, "PATH", "a text file or directory",
        "/usr/share/games/fortunes"}},
      [](const nlohmann::json& j) {
        check_keys("charlm task", j, {"name", "path", "length", "vocabulary"});
        CharLMTaskOptions o;
        read_field("charlm task", j, "path", o.path);
        read_field("charlm task", j, "length", o.length);
        if (j.contains("vocabulary"))
          read_field("charlm task", j, "vocabulary", o.vocabulary.emplace());
        return std::unique_ptr<Task>(std::make_unique<CharLMTask>(o));
      },
      charlm_generator()});
  return out;
}

std::vector<TaskType>& task_type_table() {
  static std::vector<TaskType> table = builtin_task_types();
  return table;
}

}  // namespace

const std::vector<TaskType>& task_types() { return task_type_table(); }

const TaskType* find_task_type(const std::string& name) {
  for (const auto& t : task_type_table())
    if (t.name == name) return &t;
  return nullptr;
}

void register_task_type(TaskType type) {
  TORCH_CHECK(!type.name.empty(), "register_task_type: the name must not be empty");
  TORCH_CHECK(type.make, "register_task_type: task type '", type.name, "' needs a factory");
  TORCH_CHECK(find_task_type(type.name) == nullptr, "register_task_type: task type '", type.name,
              "' is already registered");
  TORCH_CHECK(type.generator.run || type.generator.flags.empty(), "register_task_type: task type '",
              type.name, "' has generate flags but no generator.run");
  TORCH_CHECK(!type.generator.run || type.generator.default_count >= 1,
              "register_task_type: task type '", type.name,
              "': generator.default_count must be >= 1, got ", type.generator.default_count);
  task_type_table().push_back(std::move(type));
}

std::string task_type_names(const char* last_separator) {
  const auto& types = task_type_table();
  std::string out;
  for (size_t i = 0; i < types.size(); ++i) {
    if (i > 0) out += i + 1 == types.size() ? last_separator : ", ";
    out += types[i].name;
  }
  return out;
}

std::unique_ptr<Task> make_task(const nlohmann::json& j) {
  TORCH_CHECK(j.is_object() && j.contains("name") && j["name"].is_string(),
              "task: expected {\"name\": TYPE, ...} with TYPE one of ", task_type_names(", "),
              "; got ", j.dump());
  const auto name = j["name"].get<std::string>();
  const TaskType* type = find_task_type(name);
  TORCH_CHECK(type != nullptr, "task: name must be one of ", task_type_names(", "), ", got '", name,
              "'");
  return type->make(j);
}

}  // namespace fastattn::train
