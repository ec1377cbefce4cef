// BERT encoder over any registered attention type, Hugging Face weight
// loading and mean pooling (include/fastattn/experiments/bert.h). Cost per layer:
// O(N·L·D²) for the projections and feed-forward plus the attention type's.
// Tests: ./build/fastattn_tests --gtest_filter='Bert*:MiniLM*'
#include "fastattn/experiments/bert.h"

#include <nlohmann/json.hpp>

#include <fstream>
#include <set>

#include "fastattn/safetensors.h"

namespace fastattn {

namespace {

int64_t json_int(const nlohmann::json& j, const char* key, int64_t def, const std::string& path) {
  if (!j.contains(key)) return def;
  TORCH_CHECK(j[key].is_number_integer(), "BERT config '", path, "': '", key,
              "' must be an integer, got ", j[key].dump());
  return j[key].get<int64_t>();
}

std::string join_names(const std::vector<std::string>& v) {
  std::string s;
  for (size_t i = 0; i < v.size() && i < 20; ++i) s += (i ? ", " : "") + v[i];
  if (v.size() > 20) s += ", ... (" + std::to_string(v.size()) + " in all)";
  return s;
}

}  // namespace

BertConfig BertConfig::from_json_file(const std::string& path) {
  std::ifstream in(path);
  TORCH_CHECK(in, "BERT config '", path, "': cannot open");
  nlohmann::json j;
  try {
    in >> j;
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, "BERT config '", path, "': not valid JSON: ", e.what());
  }
  TORCH_CHECK(j.is_object(), "BERT config '", path, "': expected a JSON object");
  auto expect = [&](const char* key, const char* value) {
    if (!j.contains(key)) return;
    TORCH_CHECK(j[key].is_string() && j[key].get<std::string>() == value, "BERT config '", path,
                "': '", key, "' = ", j[key].dump(), " is not supported (only \"", value, "\")");
  };
  expect("model_type", "bert");
  expect("hidden_act", "gelu");
  expect("position_embedding_type", "absolute");
  BertConfig c;
  c.vocab_size = json_int(j, "vocab_size", c.vocab_size, path);
  c.hidden_size = json_int(j, "hidden_size", c.hidden_size, path);
  c.num_hidden_layers = json_int(j, "num_hidden_layers", c.num_hidden_layers, path);
  c.num_attention_heads = json_int(j, "num_attention_heads", c.num_attention_heads, path);
  c.intermediate_size = json_int(j, "intermediate_size", c.intermediate_size, path);
  c.max_position_embeddings =
      json_int(j, "max_position_embeddings", c.max_position_embeddings, path);
  c.type_vocab_size = json_int(j, "type_vocab_size", c.type_vocab_size, path);
  if (j.contains("layer_norm_eps")) {
    TORCH_CHECK(j["layer_norm_eps"].is_number(), "BERT config '", path,
                "': 'layer_norm_eps' must be a number");
    c.layer_norm_eps = j["layer_norm_eps"].get<double>();
  }
  try {
    c.check();
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "BERT config '", path, "': ", e.what_without_backtrace());
  }
  return c;
}

void BertConfig::check() const {
  TORCH_CHECK(
      vocab_size > 0 && hidden_size > 0 && num_hidden_layers > 0 && num_attention_heads > 0 &&
          intermediate_size > 0 && max_position_embeddings > 0 && type_vocab_size > 0,
      "BertConfig: sizes must be positive, got vocab_size=", vocab_size,
      " hidden_size=", hidden_size, " num_hidden_layers=", num_hidden_layers,
      " num_attention_heads=", num_attention_heads, " intermediate_size=", intermediate_size,
      " max_position_embeddings=", max_position_embeddings, " type_vocab_size=", type_vocab_size);
  TORCH_CHECK(hidden_size % num_attention_heads == 0, "BertConfig: num_attention_heads (",
              num_attention_heads, ") must divide hidden_size (", hidden_size, ")");
  TORCH_CHECK(layer_norm_eps > 0, "BertConfig: layer_norm_eps must be > 0, got ", layer_norm_eps);
}

// ---- layers ----------------------------------------------------------------------

BertSelfAttentionImpl::BertSelfAttentionImpl(const BertConfig& config, AttentionPtr attention)
    : heads_(config.num_attention_heads) {
  const int64_t D = config.hidden_size;
  query_ = register_module("query", torch::nn::Linear(D, D));
  key_ = register_module("key", torch::nn::Linear(D, D));
  value_ = register_module("value", torch::nn::Linear(D, D));
  inner_attention_ = register_module("inner_attention", std::move(attention));
}

void BertSelfAttentionImpl::set_attention(AttentionPtr attention) {
  inner_attention_ = replace_module("inner_attention", std::move(attention));
}

torch::Tensor BertSelfAttentionImpl::forward(const torch::Tensor& x, const Mask& mask) {
  const int64_t N = x.size(0), L = x.size(1), D = x.size(2), H = heads_, E = D / H;
  auto q = query_(x).view({N, L, H, E}).transpose(1, 2);  // (N, H, L, E)
  auto k = key_(x).view({N, L, H, E}).transpose(1, 2);    // (N, H, L, E)
  auto v = value_(x).view({N, L, H, E}).transpose(1, 2);  // (N, H, L, E)
  auto out = inner_attention_->forward(q, k, v, mask);    // (N, H, L, E)
  return out.transpose(1, 2).reshape({N, L, D});
}

BertDenseNormImpl::BertDenseNormImpl(int64_t in, int64_t out, double eps) {
  dense_ = register_module("dense", torch::nn::Linear(in, out));
  norm_ = register_module("LayerNorm",
                          torch::nn::LayerNorm(torch::nn::LayerNormOptions({out}).eps(eps)));
}

torch::Tensor BertDenseNormImpl::forward(const torch::Tensor& h, const torch::Tensor& residual) {
  return norm_(dense_(h) + residual);
}

BertLayerImpl::BertLayerImpl(const BertConfig& c, AttentionPtr attention) {
  auto attention_holder = register_module("attention", std::make_shared<torch::nn::Module>());
  self_ = attention_holder->register_module("self", BertSelfAttention(c, std::move(attention)));
  attention_output_ = attention_holder->register_module(
      "output", BertDenseNorm(c.hidden_size, c.hidden_size, c.layer_norm_eps));
  auto intermediate = register_module("intermediate", std::make_shared<torch::nn::Module>());
  intermediate_ =
      intermediate->register_module("dense", torch::nn::Linear(c.hidden_size, c.intermediate_size));
  output_ = register_module("output",
                            BertDenseNorm(c.intermediate_size, c.hidden_size, c.layer_norm_eps));
}

torch::Tensor BertLayerImpl::forward(const torch::Tensor& x, const Mask& mask) {
  auto a = attention_output_(self_(x, mask), x);
  return output_(torch::gelu(intermediate_(a)), a);
}

// ---- encoder ---------------------------------------------------------------------

BertEncoderImpl::BertEncoderImpl(const BertConfig& config, const std::string& type,
                                 const ParamMap& params)
    : config_(config), type_(type) {
  config_.check();
  const auto& c = config_;
  const AttentionDims dims{c.num_attention_heads, c.hidden_size / c.num_attention_heads,
                           c.hidden_size / c.num_attention_heads};
  auto embeddings = register_module("embeddings", std::make_shared<torch::nn::Module>());
  word_ = embeddings->register_module("word_embeddings",
                                      torch::nn::Embedding(c.vocab_size, c.hidden_size));
  position_ = embeddings->register_module(
      "position_embeddings", torch::nn::Embedding(c.max_position_embeddings, c.hidden_size));
  token_type_ = embeddings->register_module("token_type_embeddings",
                                            torch::nn::Embedding(c.type_vocab_size, c.hidden_size));
  embedding_norm_ = embeddings->register_module(
      "LayerNorm",
      torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.hidden_size}).eps(c.layer_norm_eps)));
  auto encoder = register_module("encoder", std::make_shared<torch::nn::Module>());
  auto list = encoder->register_module("layer", torch::nn::ModuleList());
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    layers_.push_back(BertLayer(c, make_attention(type, params, dims)));
    list->push_back(layers_.back());
  }
}

void BertEncoderImpl::set_attention(const std::string& type, const ParamMap& params) {
  const auto& c = config_;
  const AttentionDims dims{c.num_attention_heads, c.hidden_size / c.num_attention_heads,
                           c.hidden_size / c.num_attention_heads};
  // Build every layer's instance first, so that a bad type changes nothing.
  std::vector<AttentionPtr> built;
  for (size_t i = 0; i < layers_.size(); ++i) built.push_back(make_attention(type, params, dims));
  const auto options = word_->weight.options();
  for (size_t i = 0; i < layers_.size(); ++i) {
    built[i]->to(options.device(), options.dtype().toScalarType());
    layers_[i]->self_attention()->set_attention(built[i]);
  }
  type_ = type;
}

torch::Tensor BertEncoderImpl::forward(const torch::Tensor& input_ids, const torch::Tensor& lengths,
                                       const torch::Tensor& token_type_ids) {
  TORCH_CHECK(input_ids.dim() == 2 && input_ids.scalar_type() == torch::kLong,
              "BertEncoder: input_ids must be (N, L) int64, got ", input_ids.sizes(), " ",
              input_ids.scalar_type());
  const int64_t N = input_ids.size(0), L = input_ids.size(1);
  TORCH_CHECK(N > 0 && L > 0, "BertEncoder: input_ids must not be empty, got ", input_ids.sizes());
  TORCH_CHECK(L <= config_.max_position_embeddings, "BertEncoder: length ", L,
              " exceeds max_position_embeddings = ", config_.max_position_embeddings,
              " (truncate the input)");
  TORCH_CHECK(lengths.dim() == 1 && lengths.size(0) == N &&
                  (lengths.scalar_type() == torch::kLong || lengths.scalar_type() == torch::kInt),
              "BertEncoder: lengths must be (N,) = (", N, ") integers, got ", lengths.sizes(), " ",
              lengths.scalar_type());
  TORCH_CHECK(lengths.min().item<int64_t>() >= 1 && lengths.max().item<int64_t>() <= L,
              "BertEncoder: lengths must lie in [1, L] = [1, ", L, "], got [",
              lengths.min().item<int64_t>(), ", ", lengths.max().item<int64_t>(), "]");
  const int64_t lo = input_ids.min().item<int64_t>(), hi = input_ids.max().item<int64_t>();
  TORCH_CHECK(lo >= 0 && hi < config_.vocab_size, "BertEncoder: input_ids must lie in [0, ",
              config_.vocab_size, "), got [", lo, ", ", hi, "]");
  auto types = token_type_ids;
  if (!types.defined()) {
    types = torch::zeros_like(input_ids);
  } else {
    TORCH_CHECK(types.sizes() == input_ids.sizes() && types.scalar_type() == torch::kLong,
                "BertEncoder: token_type_ids must be int64 of the shape of input_ids ",
                input_ids.sizes(), ", got ", types.sizes(), " ", types.scalar_type());
    TORCH_CHECK(
        types.min().item<int64_t>() >= 0 && types.max().item<int64_t>() < config_.type_vocab_size,
        "BertEncoder: token_type_ids must lie in [0, ", config_.type_vocab_size, ")");
  }
  auto positions = torch::arange(L, input_ids.options());
  auto x = embedding_norm_(word_(input_ids) + position_(positions).unsqueeze(0) +
                           token_type_(types));  // (N, L, D)
  const auto lens = lengths.to(torch::kLong);
  const Mask mask = Mask().with_key_lengths(lens).with_query_lengths(lens);
  for (auto& layer : layers_) x = layer(x, mask);
  return x;
}

// ---- loading and pooling ---------------------------------------------------------

BertLoadReport load_bert_weights(BertEncoderImpl& model, const std::string& path,
                                 const std::string& prefix) {
  const auto file = load_safetensors(path);
  const auto targets = state_tensors(model);
  BertLoadReport report;
  std::map<std::string, torch::Tensor> use;
  std::vector<std::string> unexpected;
  for (const auto& [full_name, t] : file.tensors) {
    if (full_name.compare(0, prefix.size(), prefix) != 0) {
      unexpected.push_back(full_name);
      continue;
    }
    const std::string name = full_name.substr(prefix.size());
    if (targets.count(name)) {
      use[name] = t;
    } else if (name == "embeddings.position_ids") {
      const int64_t P = model.config().max_position_embeddings;
      TORCH_CHECK(t.numel() == P && t.flatten().to(torch::kLong).equal(torch::arange(P)), "'", path,
                  "': embeddings.position_ids is not 0..", P - 1,
                  " (positions other than absolute ones are not supported)");
      report.ignored.push_back(full_name);
    } else if (name.compare(0, 7, "pooler.") == 0) {
      report.ignored.push_back(full_name);
    } else {
      unexpected.push_back(full_name);
    }
  }
  std::vector<std::string> missing;
  for (const auto& [name, t] : targets) {
    if (!use.count(name) && name.find(".inner_attention.") == std::string::npos) {
      missing.push_back(name);
    }
  }
  TORCH_CHECK(missing.empty(), "'", path, "': ", missing.size(),
              " weight(s) of the BERT encoder are missing from the file",
              prefix.empty() ? "" : " (after the prefix '" + prefix + "')", ": ",
              join_names(missing));
  TORCH_CHECK(unexpected.empty(), "'", path, "': ", unexpected.size(),
              " tensor(s) in the file are not BERT encoder weights",
              prefix.empty() ? "" : " (after the prefix '" + prefix + "')", ": ",
              join_names(unexpected));
  try {
    load_state(model, use, /*strict=*/false);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "'", path, "': ", e.what_without_backtrace());
  }
  return report;
}

torch::Tensor mean_pool_normalize(const torch::Tensor& hidden, const torch::Tensor& lengths) {
  TORCH_CHECK(hidden.dim() == 3, "mean_pool_normalize: hidden must be (N, L, D), got ",
              hidden.sizes());
  const int64_t N = hidden.size(0), L = hidden.size(1);
  TORCH_CHECK(lengths.dim() == 1 && lengths.size(0) == N,
              "mean_pool_normalize: lengths must be (N,) = (", N, "), got ", lengths.sizes());
  const auto lens = lengths.to(hidden.device(), torch::kLong);
  TORCH_CHECK(N == 0 || (lens.min().item<int64_t>() >= 1 && lens.max().item<int64_t>() <= L),
              "mean_pool_normalize: lengths must lie in [1, L] = [1, ", L, "]");
  auto keep = torch::arange(L, lens.options()).unsqueeze(0).lt(lens.unsqueeze(1));  // (N, L)
  auto w = keep.to(hidden.scalar_type()).unsqueeze(2);                              // (N, L, 1)
  auto mean = (hidden * w).sum(1) / lens.to(hidden.scalar_type()).unsqueeze(1);     // (N, D)
  // As sentence-transformers' Normalize (F.normalize, eps 1e-12).
  return mean / mean.norm(2, 1, true).clamp_min(1e-12);
}

}  // namespace fastattn
