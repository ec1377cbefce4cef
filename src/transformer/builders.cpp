// EncoderBuilder and DecoderBuilder: resolve and check the settings, build
// the attention types through the registry, read the settings from JSON.
#include <algorithm>
#include <nlohmann/json.hpp>

#include "fastattn/transformer.h"

namespace fastattn {

namespace {

// The sizes a config resolves to (see TransformerConfig).
struct ResolvedConfig {
  int64_t d_model, query_dim, value_dim, d_ff;
};

ResolvedConfig resolve(const TransformerConfig& c, const char* who) {
  TORCH_CHECK(c.layers >= 1, who, ": layers must be >= 1, got ", c.layers);
  TORCH_CHECK(c.heads >= 1, who, ": heads must be >= 1, got ", c.heads);
  TORCH_CHECK(!c.d_model || *c.d_model >= 1, who, ": d_model must be >= 1, got ", *c.d_model);
  TORCH_CHECK(!c.query_dimensions || *c.query_dimensions >= 1, who,
              ": query_dimensions must be >= 1, got ", *c.query_dimensions);
  TORCH_CHECK(!c.value_dimensions || *c.value_dimensions >= 1, who,
              ": value_dimensions must be >= 1, got ", *c.value_dimensions);
  TORCH_CHECK(!c.feed_forward_dimensions || *c.feed_forward_dimensions >= 1, who,
              ": feed_forward_dimensions must be >= 1, got ", *c.feed_forward_dimensions);
  TORCH_CHECK(c.dropout >= 0 && c.dropout < 1, who, ": dropout must be in [0, 1), got ", c.dropout);
  TORCH_CHECK(c.activation == "relu" || c.activation == "gelu", who,
              ": activation must be one of relu, gelu, got '", c.activation, "'");
  ResolvedConfig r{};
  if (c.query_dimensions) {
    r.query_dim = *c.query_dimensions;
  } else if (c.d_model) {
    TORCH_CHECK(*c.d_model % c.heads == 0, who, ": d_model (", *c.d_model,
                ") must be divisible by heads (", c.heads, ") when query_dimensions is not given");
    r.query_dim = *c.d_model / c.heads;
  } else {
    r.query_dim = 64;
  }
  r.d_model = c.d_model.value_or(c.heads * r.query_dim);
  r.value_dim = c.value_dimensions.value_or(r.query_dim);
  r.d_ff = c.feed_forward_dimensions.value_or(4 * r.d_model);
  return r;
}

AttentionDims dims_of(const TransformerConfig& c, const ResolvedConfig& r) {
  AttentionDims d;
  d.heads = c.heads;
  d.query_dim = r.query_dim;
  d.value_dim = r.value_dim;
  return d;
}

// Validates the attention spec up front, so that the error names the setting.
void check_attention(const char* who, const char* setting, const AttentionSpec& spec) {
  try {
    AttentionRegistry::global().validate(spec.type, spec.params);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, who, ": ", setting, ": ", e.what_without_backtrace());
  }
}

// The spec of layer r: a Sparse Transformer type with mode interleaved and no
// explicit part gets part r mod 2 + 1 (layer 0 A1, layer 1 A2, ...), the
// paper's attend(X, A^(r mod p)) with p = 2.
AttentionSpec layer_spec(const AttentionSpec& spec, int64_t r) {
  if (spec.type != "sparse-strided" && spec.type != "sparse-fixed") return spec;
  auto mode = spec.params.find("mode");
  if (mode == spec.params.end() || spec.params.count("part")) return spec;
  const auto* name = std::get_if<std::string>(&mode->second);
  if (name == nullptr || *name != "interleaved") return spec;
  AttentionSpec out = spec;
  out.params["part"] = int64_t{r % 2 + 1};
  return out;
}

AttentionLayer attention_layer(const AttentionSpec& spec, const TransformerConfig& c,
                               const ResolvedConfig& r, std::optional<int64_t> d_model_keys) {
  auto attention = AttentionRegistry::global().build(spec.type, spec.params, dims_of(c, r));
  return AttentionLayer(attention, AttentionLayerOptions(r.d_model, c.heads)
                                       .d_keys(r.query_dim)
                                       .d_values(r.value_dim)
                                       .d_model_keys(d_model_keys));
}

TransformerLayerOptions layer_options(const TransformerConfig& c, const ResolvedConfig& r) {
  return TransformerLayerOptions(r.d_model)
      .d_ff(r.d_ff)
      .dropout(c.dropout)
      .activation(c.activation)
      .norm_first(c.norm_first);
}

// The stack's final norm, or none.
torch::nn::LayerNorm final_norm(const TransformerConfig& c, const ResolvedConfig& r) {
  if (!c.final_normalization) return torch::nn::LayerNorm(nullptr);
  return torch::nn::LayerNorm(torch::nn::LayerNormOptions({r.d_model}));
}

// ---- JSON ---------------------------------------------------------------------

int64_t json_int(const char* who, const std::string& key, const nlohmann::json& v) {
  TORCH_CHECK(v.is_number_integer(), who, ": '", key, "' must be an integer, got ", v.dump());
  return v.get<int64_t>();
}

double json_number(const char* who, const std::string& key, const nlohmann::json& v) {
  TORCH_CHECK(v.is_number(), who, ": '", key, "' must be a number, got ", v.dump());
  return v.get<double>();
}

bool json_bool(const char* who, const std::string& key, const nlohmann::json& v) {
  TORCH_CHECK(v.is_boolean(), who, ": '", key, "' must be true or false, got ", v.dump());
  return v.get<bool>();
}

std::string json_string(const char* who, const std::string& key, const nlohmann::json& v) {
  TORCH_CHECK(v.is_string(), who, ": '", key, "' must be a string, got ", v.dump());
  return v.get<std::string>();
}

// "full" or {"type": "full", <params>}.
AttentionSpec json_attention(const char* who, const std::string& key, const nlohmann::json& v) {
  AttentionSpec spec;
  if (v.is_string()) {
    spec.type = v.get<std::string>();
    return spec;
  }
  TORCH_CHECK(v.is_object() && v.contains("type") && v["type"].is_string(), who, ": '", key,
              "' must be a type name or an object {\"type\": <name>, <parameters>}, got ",
              v.dump());
  spec.type = v["type"].get<std::string>();
  auto params = v;
  params.erase("type");
  spec.params = params_from_json(params);
  return spec;
}

const std::vector<std::string> kCommonKeys = {
    "activation", "d_model", "dropout",    "feed_forward_dimensions", "final_normalization",
    "heads",      "layers",  "norm_first", "query_dimensions",        "value_dimensions"};

// Applies one of the shared keys; false when `key` is not one of them.
template <class Builder>
bool apply_common_key(Builder& b, const char* who, const std::string& key,
                      const nlohmann::json& v) {
  if (key == "layers") {
    b.layers(json_int(who, key, v));
  } else if (key == "heads") {
    b.heads(json_int(who, key, v));
  } else if (key == "d_model") {
    b.d_model(json_int(who, key, v));
  } else if (key == "query_dimensions") {
    b.query_dimensions(json_int(who, key, v));
  } else if (key == "value_dimensions") {
    b.value_dimensions(json_int(who, key, v));
  } else if (key == "feed_forward_dimensions") {
    b.feed_forward_dimensions(json_int(who, key, v));
  } else if (key == "dropout") {
    b.dropout(json_number(who, key, v));
  } else if (key == "activation") {
    b.activation(json_string(who, key, v));
  } else if (key == "norm_first") {
    b.norm_first(json_bool(who, key, v));
  } else if (key == "final_normalization") {
    b.final_normalization(json_bool(who, key, v));
  } else {
    return false;
  }
  return true;
}

std::string join_keys(std::vector<std::string> keys) {
  std::sort(keys.begin(), keys.end());
  std::string out;
  for (const auto& k : keys) out += (out.empty() ? "" : ", ") + k;
  return out;
}

void check_object(const char* who, const nlohmann::json& j) {
  TORCH_CHECK(j.is_object(), who, ": expected a JSON object of settings, got ", j.type_name(), " ",
              j.dump());
}

}  // namespace

// ---- EncoderBuilder -------------------------------------------------------------

EncoderBuilder& EncoderBuilder::attention(std::string type, ParamMap params) {
  attention_ = {std::move(type), std::move(params)};
  return *this;
}

TransformerEncoder EncoderBuilder::build() const {
  const char* who = "EncoderBuilder";
  const auto r = resolve(config_, who);
  check_attention(who, "attention", attention_);
  std::vector<TransformerEncoderLayer> layers;
  for (int64_t i = 0; i < config_.layers; ++i) {
    layers.emplace_back(attention_layer(layer_spec(attention_, i), config_, r, std::nullopt),
                        layer_options(config_, r));
  }
  return TransformerEncoder(std::move(layers), final_norm(config_, r));
}

EncoderBuilder EncoderBuilder::from_json(const nlohmann::json& j) {
  const char* who = "EncoderBuilder::from_json";
  check_object(who, j);
  EncoderBuilder b;
  for (const auto& item : j.items()) {
    const auto& key = item.key();
    if (apply_common_key(b, who, key, item.value())) continue;
    if (key == "attention") {
      b.attention_ = json_attention(who, key, item.value());
      continue;
    }
    auto valid = kCommonKeys;
    valid.push_back("attention");
    TORCH_CHECK(false, who, ": unknown key '", key, "'; valid keys: ", join_keys(valid));
  }
  return b;
}

// ---- DecoderBuilder -------------------------------------------------------------

DecoderBuilder& DecoderBuilder::self_attention(std::string type, ParamMap params) {
  self_attention_ = {std::move(type), std::move(params)};
  return *this;
}

DecoderBuilder& DecoderBuilder::cross_attention(std::string type, ParamMap params) {
  cross_attention_ = {std::move(type), std::move(params)};
  return *this;
}

DecoderBuilder& DecoderBuilder::memory_dimensions(int64_t d) {
  memory_dimensions_ = d;
  return *this;
}

TransformerDecoder DecoderBuilder::build() const {
  const char* who = "DecoderBuilder";
  const auto r = resolve(config_, who);
  TORCH_CHECK(!memory_dimensions_ || *memory_dimensions_ >= 1, who,
              ": memory_dimensions must be >= 1, got ", memory_dimensions_.value_or(0));
  check_attention(who, "self_attention", self_attention_);
  check_attention(who, "cross_attention", cross_attention_);
  std::vector<TransformerDecoderLayer> layers;
  for (int64_t i = 0; i < config_.layers; ++i) {
    layers.emplace_back(
        attention_layer(layer_spec(self_attention_, i), config_, r, std::nullopt),
        attention_layer(layer_spec(cross_attention_, i), config_, r, memory_dimensions_),
        layer_options(config_, r));
  }
  return TransformerDecoder(std::move(layers), final_norm(config_, r));
}

DecoderBuilder DecoderBuilder::from_json(const nlohmann::json& j) {
  const char* who = "DecoderBuilder::from_json";
  check_object(who, j);
  DecoderBuilder b;
  for (const auto& item : j.items()) {
    const auto& key = item.key();
    if (apply_common_key(b, who, key, item.value())) continue;
    if (key == "self_attention") {
      b.self_attention_ = json_attention(who, key, item.value());
    } else if (key == "cross_attention") {
      b.cross_attention_ = json_attention(who, key, item.value());
    } else if (key == "memory_dimensions") {
      b.memory_dimensions(json_int(who, key, item.value()));
    } else {
      auto valid = kCommonKeys;
      valid.insert(valid.end(), {"cross_attention", "memory_dimensions", "self_attention"});
      TORCH_CHECK(false, who, ": unknown key '", key, "'; valid keys: ", join_keys(valid));
    }
  }
  return b;
}

}  // namespace fastattn
