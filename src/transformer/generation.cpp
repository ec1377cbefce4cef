// CausalLanguageModel (batch), RecurrentCausalLanguageModel (its
// token-by-token twin) and generate(): greedy or sampled (temperature, top-k)
// decoding in the recurrent form. See include/fastattn/generation.h.
// Cost per generated token: one recurrent step of each layer plus the
// O(N·D·V) output projection.
// Tested by tests/cpp/test_generation.cpp.
#include "fastattn/generation.h"

#include <ATen/CPUGeneratorImpl.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <vector>

#include "transformer/step_linear.h"

namespace fastattn {

using torch::Tensor;

Tensor sinusoidal_positions(int64_t start, int64_t length, int64_t d_model,
                            const torch::TensorOptions& options) {
  TORCH_CHECK(start >= 0 && length >= 0,
              "sinusoidal_positions: start and length must be >= 0, got ", start, " and ", length);
  TORCH_CHECK(d_model >= 1, "sinusoidal_positions: d_model must be >= 1, got ", d_model);
  // In float64 (positions in the millions keep their phase), then cast. A
  // plain loop: one row costs D sin/cos, far less than a chain of ATen ops,
  // which matters for a recurrent step.
  auto pe = torch::empty({length, d_model}, torch::kDouble);  // (L, D)
  double* out = pe.data_ptr<double>();
  std::vector<double> freq(static_cast<size_t>(d_model));
  for (int64_t i = 0; i < d_model; ++i) {
    freq[i] = std::exp(-static_cast<double>(2 * (i / 2)) / static_cast<double>(d_model) *
                       std::log(10000.0));
  }
  at::parallel_for(0, length, 64, [&](int64_t begin, int64_t end) {
    for (int64_t l = begin; l < end; ++l) {
      const double p = static_cast<double>(start + l);
      for (int64_t i = 0; i < d_model; ++i) {
        out[l * d_model + i] = i % 2 == 0 ? std::sin(p * freq[i]) : std::cos(p * freq[i]);
      }
    }
  });
  return pe.to(options.device(), c10::typeMetaToScalarType(options.dtype()));
}

namespace {

void check_vocab(const char* who, int64_t vocab_size) {
  TORCH_CHECK(vocab_size >= 1, who, ": vocab_size must be >= 1, got ", vocab_size);
}

// tokens must be integer with every value in [0, V).
void check_tokens(const char* who, const char* name, const Tensor& tokens, int64_t dim,
                  const char* shape, int64_t V) {
  TORCH_CHECK(tokens.defined() && tokens.dim() == dim, who, ": ", name, " must have shape ", shape,
              ", got ", tokens.defined() ? tokens.sizes() : c10::IntArrayRef{});
  TORCH_CHECK(!tokens.is_floating_point() && tokens.scalar_type() != torch::kBool, who, ": ", name,
              " must be an integer tensor, got ", tokens.scalar_type());
  if (tokens.numel() > 0) {
    const auto lo = tokens.min().item<int64_t>(), hi = tokens.max().item<int64_t>();
    TORCH_CHECK(lo >= 0 && hi < V, who, ": ", name, " must be token ids in [0, ", V, "), got [", lo,
                ", ", hi, "]");
  }
}

int64_t resolved_d_model(const EncoderBuilder& b) {
  const auto& c = b.config();
  if (c.d_model) return *c.d_model;
  return c.heads * c.query_dimensions.value_or(64);
}

}  // namespace

// ---- batch model ------------------------------------------------------------

CausalLanguageModelImpl::CausalLanguageModelImpl(int64_t vocab_size, const EncoderBuilder& encoder)
    : vocab_size_(vocab_size), d_model_(resolved_d_model(encoder)), builder_(encoder) {
  check_vocab("CausalLanguageModel", vocab_size_);
  embedding_ = register_module("embedding", torch::nn::Embedding(vocab_size_, d_model_));
  encoder_ = register_module("encoder", builder_.build());
  output_ = register_module("output", torch::nn::Linear(d_model_, vocab_size_));
}

Tensor CausalLanguageModelImpl::forward(const Tensor& tokens,  // (N, L)
                                        const std::optional<Tensor>& key_lengths) {
  check_tokens("CausalLanguageModel", "tokens", tokens, 2, "(N, L)", vocab_size_);
  const int64_t L = tokens.size(1);
  auto x = embedding_(tokens.to(torch::kLong));  // (N, L, D)
  x = x + sinusoidal_positions(0, L, d_model_, x.options()).unsqueeze(0);
  Mask mask = Mask::causal_mask();
  if (key_lengths) mask = mask.with_key_lengths(*key_lengths);
  return output_(encoder_(x, mask));  // (N, L, V)
}

std::shared_ptr<RecurrentCausalLanguageModelImpl> CausalLanguageModelImpl::recurrent() const {
  auto rnn = std::make_shared<RecurrentCausalLanguageModelImpl>(vocab_size_, builder_);
  const auto p = embedding_->weight;
  rnn->to(p.device(), p.scalar_type());
  copy_parameters(*rnn, *this);
  rnn->train(is_training());
  return rnn;
}

// ---- recurrent model --------------------------------------------------------

RecurrentCausalLanguageModelImpl::RecurrentCausalLanguageModelImpl(int64_t vocab_size,
                                                                   const EncoderBuilder& encoder)
    : vocab_size_(vocab_size), d_model_(resolved_d_model(encoder)) {
  check_vocab("RecurrentCausalLanguageModel", vocab_size_);
  embedding_ = register_module("embedding", torch::nn::Embedding(vocab_size_, d_model_));
  encoder_ = register_module("encoder", make_recurrent_encoder(encoder));
  output_ = register_module("output", torch::nn::Linear(d_model_, vocab_size_));
}

std::pair<Tensor, LanguageModelState> RecurrentCausalLanguageModelImpl::step(
    const Tensor& token,  // (N,)
    const LanguageModelState& state) {
  check_tokens("RecurrentCausalLanguageModel", "token", token, 1, "(N,)", vocab_size_);
  TORCH_CHECK(state.position >= 0,
              "RecurrentCausalLanguageModel: state.position must be >= 0, got ", state.position);
  auto x = embedding_(token.to(torch::kLong));  // (N, D)
  x = x + sinusoidal_positions(state.position, 1, d_model_, x.options());
  auto [y, layers] = encoder_->step(x, state.layers);
  LanguageModelState next;
  next.layers = std::move(layers);
  next.position = state.position + 1;
  return {detail::step_linear(output_, y), std::move(next)};  // (N, V)
}

// ---- generation -------------------------------------------------------------

GenerationResult generate(RecurrentCausalLanguageModelImpl& model, const Tensor& prefix,
                          const GenerationOptions& o) {
  const char* who = "generate";
  const int64_t V = model.vocab_size();
  check_tokens(who, "prefix", prefix, 2, "(N, P)", V);
  TORCH_CHECK(prefix.size(1) >= 1, who, ": prefix must hold at least one token per sequence, got ",
              prefix.sizes());
  TORCH_CHECK(o.max_new_tokens >= 0, who, ": max_new_tokens must be >= 0, got ", o.max_new_tokens);
  TORCH_CHECK(std::isfinite(o.temperature) && o.temperature > 0, who,
              ": temperature must be a finite number > 0, got ", o.temperature);
  TORCH_CHECK(!o.top_k || (*o.top_k >= 1 && *o.top_k <= V), who, ": top_k must be in [1, ", V,
              "], got ", o.top_k.value_or(0));
  TORCH_CHECK(!o.stop_token || (*o.stop_token >= 0 && *o.stop_token < V), who,
              ": stop_token must be a token id in [0, ", V, "), got ", o.stop_token.value_or(0));
  torch::NoGradGuard no_grad;
  const int64_t N = prefix.size(0), P = prefix.size(1);
  const auto tokens_in = prefix.to(torch::kLong);
  auto generator = at::make_generator<at::CPUGeneratorImpl>(o.seed);

  LanguageModelState state;
  Tensor logits;  // (N, V)
  for (int64_t i = 0; i < P; ++i) {
    auto [l, s] = model.step(tokens_in.select(1, i), state);
    logits = l;
    state = std::move(s);
  }
  std::vector<Tensor> out{tokens_in.cpu()};
  auto finished = torch::zeros({N}, torch::kBool);
  auto lengths = torch::full({N}, P, torch::kLong);
  for (int64_t t = 0; t < o.max_new_tokens; ++t) {
    Tensor next;  // (N,) int64 on the CPU
    if (o.greedy) {
      next = logits.argmax(-1).cpu();
    } else {
      auto z = logits.to(torch::kCPU, torch::kDouble) / o.temperature;  // (N, V)
      if (o.top_k && *o.top_k < V) {
        auto kth = std::get<0>(z.topk(*o.top_k, -1)).narrow(1, *o.top_k - 1, 1);  // (N, 1)
        z = z.masked_fill(z < kth, -std::numeric_limits<double>::infinity());
      }
      next =
          torch::multinomial(torch::softmax(z, -1), 1, /*replacement=*/false, generator).squeeze(1);
    }
    if (o.stop_token) next = next.masked_fill(finished, *o.stop_token);
    lengths += finished.logical_not().to(torch::kLong);
    out.push_back(next.unsqueeze(1));
    if (o.stop_token) finished = finished.logical_or(next == *o.stop_token);
    if (finished.all().item<bool>() || t + 1 == o.max_new_tokens) break;
    auto [l, s] = model.step(next.to(prefix.device()), state);
    logits = l;
    state = std::move(s);
  }
  return {torch::cat(out, 1).to(prefix.device()), lengths};
}

}  // namespace fastattn
