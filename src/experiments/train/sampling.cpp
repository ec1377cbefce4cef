// Sampling from trained decoder-only checkpoints (lm_tasks.h): loading a
// model written by the Trainer, drawing sequences with the recurrent form
// where the attention type has one (else by rerunning the prefix), and
// rendering digits as ASCII art or PGM images. Tested by
// tests/cpp/test_lm_tasks.cpp.
#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <mutex>
#include <sstream>

#include "fastattn/experiments/lm_tasks.h"
#include "fastattn/recurrent.h"
#include "fastattn/safetensors.h"
#include "experiments/train/as_lm.h"

namespace fastattn::train {

// ---- trained models and sampling ------------------------------------------------------

TrainedModel load_trained_model(const std::string& dir) {
  const std::string path = dir + "/" + kModelFile;
  auto file = load_safetensors(path);
  auto it = file.metadata.find("config");
  TORCH_CHECK(it != file.metadata.end(), "'", path,
              "' has no training config in its metadata; it was not written by the Trainer");
  TrainedModel t;
  t.config = TrainConfig::from_json(nlohmann::json::parse(it->second));
  if (auto s = file.metadata.find("step"); s != file.metadata.end()) t.step = std::stoll(s->second);
  t.task = make_task(t.config.task);
  // Initialisation draws from the global generator; keep the caller's stream.
  auto gen = at::detail::getDefaultCPUGenerator();
  torch::Tensor saved;
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    saved = gen.get_state();
  }
  t.model = t.task->make_model(t.config.model);
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(saved);
  }
  load_state(*t.model, file.tensors, /*strict=*/true);
  t.model->eval();
  return t;
}

namespace {

// Continues `prefix` (N, P) by `new_tokens`, each drawn from the softmax over
// the first `allowed` logits. Returns (N, P + new_tokens).
torch::Tensor sample_loop(CausalLanguageModelImpl& m, const torch::Tensor& prefix,
                          int64_t new_tokens, int64_t allowed, const SampleOptions& o,
                          bool use_rnn) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(o.seed);
  auto pick = [&](const torch::Tensor& logits) {  // (N, V) -> (N,)
    auto l = logits.narrow(-1, 0, allowed);
    if (o.greedy) return l.argmax(-1);
    auto p = torch::softmax(l.to(torch::kDouble) / o.temperature, -1);
    return torch::multinomial(p, 1, /*replacement=*/false, gen).squeeze(1);
  };
  std::vector<torch::Tensor> out = {prefix};
  if (use_rnn) {
    auto rnn = m.recurrent();
    rnn->eval();
    LanguageModelState state;
    torch::Tensor logits;
    for (int64_t i = 0; i < prefix.size(1); ++i) {
      std::tie(logits, state) = rnn->step(prefix.select(1, i), state);
    }
    for (int64_t i = 0; i < new_tokens; ++i) {
      auto next = pick(logits);
      out.push_back(next.unsqueeze(1));
      if (i + 1 < new_tokens) std::tie(logits, state) = rnn->step(next, state);
    }
  } else {
    auto seq = prefix;
    for (int64_t i = 0; i < new_tokens; ++i) {
      auto next = pick(m.forward(seq).select(1, -1));
      seq = torch::cat({seq, next.unsqueeze(1)}, 1);
    }
    return seq;
  }
  return torch::cat(out, 1);
}

bool has_recurrent_form(const TrainedModel& t) {
  const auto type = EncoderBuilder::from_json(t.config.model).attention_spec().type;
  const auto& names = recurrent_attention_names();
  return std::find(names.begin(), names.end(), type) != names.end();
}

void check_sample_options(const SampleOptions& o) {
  TORCH_CHECK(o.count >= 1, "sample: count must be >= 1, got ", o.count);
  TORCH_CHECK(std::isfinite(o.temperature) && o.temperature > 0,
              "sample: temperature must be a finite number > 0, got ", o.temperature);
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

SampleResult sample_digits(TrainedModel& t, const SampleOptions& o) {
  auto* task = dynamic_cast<const DigitsTask*>(t.task.get());
  TORCH_CHECK(task, "sample_digits: the checkpoint's task is '", t.task->name(), "', not digits");
  check_sample_options(o);
  torch::NoGradGuard no_grad;
  auto& m = as_lm(*t.model, "sample_digits");
  SampleResult r;
  auto start = torch::full({o.count}, DigitsTask::kStart, torch::kLong);
  if (task->options().conditional) {
    if (o.label) {
      TORCH_CHECK(*o.label >= 0 && *o.label <= 9, "sample_digits: label must be in [0, 9], got ",
                  *o.label);
      r.labels = torch::full({o.count}, *o.label, torch::kLong);
    } else {
      auto gen = at::make_generator<at::CPUGeneratorImpl>(o.seed + 0x5bd1e995u);
      r.labels = torch::randint(0, 10, {o.count}, gen, torch::kLong);
    }
    start = start + r.labels;
  } else {
    TORCH_CHECK(!o.label,
                "sample_digits: a label needs a conditional model (trained with "
                "conditional: true)");
  }
  r.recurrent = o.recurrent && has_recurrent_form(t);
  const auto t0 = std::chrono::steady_clock::now();
  auto seq =
      sample_loop(m, start.unsqueeze(1), DigitsTask::kPixels, DigitsTask::kLevels, o, r.recurrent);
  r.seconds = seconds_since(t0);
  r.tokens = seq.narrow(1, 1, DigitsTask::kPixels);
  return r;
}

SampleResult sample_text(TrainedModel& t, const std::string& prompt, int64_t new_tokens,
                         const SampleOptions& o) {
  auto* task = dynamic_cast<const CharLMTask*>(t.task.get());
  TORCH_CHECK(task, "sample_text: the checkpoint's task is '", t.task->name(), "', not charlm");
  check_sample_options(o);
  TORCH_CHECK(!prompt.empty(), "sample_text: the prompt must hold at least one character");
  TORCH_CHECK(new_tokens >= 0, "sample_text: new tokens must be >= 0, got ", new_tokens);
  torch::NoGradGuard no_grad;
  auto& m = as_lm(*t.model, "sample_text");
  SampleResult r;
  r.recurrent = o.recurrent && has_recurrent_form(t);
  auto prefix = task->encode(prompt).unsqueeze(0).expand({o.count, -1}).contiguous();
  const auto t0 = std::chrono::steady_clock::now();
  r.tokens = sample_loop(m, prefix, new_tokens, task->vocab_size(), o, r.recurrent);
  r.seconds = seconds_since(t0);
  return r;
}

// ---- the generators of `fastattn generate --checkpoint` ---------------------------------

namespace {

using Kind = TaskSetting::Kind;

double per_second(double count, double seconds) { return count / std::max(seconds, 1e-12); }

// Images (N, 64) as ASCII, up to 8 side by side, a blank line after each row of them.
std::string digits_ascii_rows(const torch::Tensor& images) {
  std::string out;
  const int64_t n = images.size(0);
  for (int64_t first = 0; first < n; first += 8) {
    std::vector<std::string> art;
    for (int64_t i = first; i < std::min<int64_t>(n, first + 8); ++i)
      art.push_back(digit_ascii(images[i]));
    for (size_t y = 0; y < 8; ++y) {
      for (const auto& a : art) out += a.substr(y * 17, 16) + "  ";
      out += "\n";
    }
    out += "\n";
  }
  return out;
}

}  // namespace

TaskGenerator digits_generator() {
  TaskGenerator g;
  g.flags = {{"label", "label", Kind::Integer, "D", "the digit to draw (conditional models)", ""},
             {"pgm", "pgm", Kind::Text, "FILE", "write the images as a PGM picture", ""}};
  g.default_count = 16;
  g.run = [](TrainedModel& t, const GenerateRequest& request) {
    auto o = request.options;
    if (request.values.contains("label")) o.label = request.values["label"].get<int64_t>();
    GenerateReport r;
    r.result = sample_digits(t, o);
    r.unit = "images";
    r.text = digits_ascii_rows(r.result.tokens);
    if (r.result.labels.defined()) {
      std::vector<int64_t> labels(r.result.labels.data_ptr<int64_t>(),
                                  r.result.labels.data_ptr<int64_t>() + r.result.labels.numel());
      std::string line;
      for (auto l : labels) line += (line.empty() ? "" : ",") + std::to_string(l);
      r.text += "labels: " + line + "\n";
      r.record["labels"] = labels;
    }
    if (request.values.contains("pgm")) {
      const auto path = request.values["pgm"].get<std::string>();
      std::ofstream f(path, std::ios::binary);
      TORCH_CHECK(f, "cannot write --pgm file '", path, "'");
      f << digits_pgm(r.result.tokens);
      TORCH_CHECK(f.flush(), "cannot write --pgm file '", path, "'");
      r.notes.push_back("wrote " + path);
    }
    r.record["images_per_second"] = per_second(static_cast<double>(o.count), r.result.seconds);
    return r;
  };
  return g;
}

TaskGenerator charlm_generator() {
  TaskGenerator g;
  g.flags = {{"prompt", "prompt", Kind::Text, "TEXT", "text to continue", "\\n"},
             {"max-new-tokens", "max_new_tokens", Kind::Integer, "T", "bytes to add", "32"}};
  g.default_count = 1;
  g.run = [](TrainedModel& t, const GenerateRequest& request) {
    const auto& o = request.options;
    const int64_t n = request.values.value("max_new_tokens", int64_t{32});
    TORCH_CHECK(n >= 0, "--max-new-tokens must be >= 0, got ", n);
    const auto prompt = request.values.value("prompt", std::string("\n"));
    GenerateReport r;
    r.result = sample_text(t, prompt, n, o);
    r.unit = "sequences";
    const auto& lm = dynamic_cast<const CharLMTask&>(*t.task);
    for (int64_t i = 0; i < o.count; ++i) {
      r.text += (o.count > 1 ? "---- sample " + std::to_string(i + 1) + "\n" : "") +
                lm.decode(r.result.tokens[i]) + "\n";
    }
    r.record["new_tokens"] = n;
    r.record["tokens_per_second"] = per_second(static_cast<double>(o.count * n), r.result.seconds);
    return r;
  };
  return g;
}

std::string digit_ascii(const torch::Tensor& pixels) {
  static const char* shades = " .:-=+*#%@";
  auto p = pixels.to(torch::kLong).contiguous().reshape({64});
  std::string s;
  for (int64_t y = 0; y < 8; ++y) {
    for (int64_t x = 0; x < 8; ++x) {
      const int64_t v = std::clamp<int64_t>(p[y * 8 + x].item<int64_t>(), 0, 16);
      s += std::string(2, shades[v * 9 / 16]);
    }
    s += '\n';
  }
  return s;
}

std::string digits_pgm(const torch::Tensor& images, int64_t scale) {
  TORCH_CHECK(images.dim() == 2 && images.size(1) == 64, "digits_pgm: images must be (N, 64), got ",
              images.sizes());
  TORCH_CHECK(scale >= 1, "digits_pgm: scale must be >= 1, got ", scale);
  const int64_t n = images.size(0), cols = std::min<int64_t>(n, 8), rows = (n + cols - 1) / cols;
  const int64_t cell = 8 * scale + 1;  // one pixel of gap
  const int64_t W = cols * cell + 1, H = rows * cell + 1;
  std::string px(static_cast<size_t>(W * H), static_cast<char>(16));  // white
  auto img = images.to(torch::kLong).contiguous();
  const auto* p = img.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t ox = 1 + (i % cols) * cell, oy = 1 + (i / cols) * cell;
    for (int64_t y = 0; y < 8 * scale; ++y) {
      for (int64_t x = 0; x < 8 * scale; ++x) {
        const int64_t v = std::clamp<int64_t>(p[i * 64 + (y / scale) * 8 + x / scale], 0, 16);
        px[static_cast<size_t>((oy + y) * W + ox + x)] = static_cast<char>(16 - v);  // ink dark
      }
    }
  }
  return "P5\n" + std::to_string(W) + " " + std::to_string(H) + "\n16\n" + px;
}

}  // namespace fastattn::train
