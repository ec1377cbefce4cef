// Registry of attention types by name, with typed parameter specs.
//
//   auto attn = fastattn::make_attention("full", {{"softmax_temp", 0.125}});
//
// Every type registers its name, a description, its parameters (name, type,
// default, range or choices, help) and a factory. User-given parameters are
// validated against the specs: an unknown type or parameter, a value of the
// wrong type or out of range gives an error that names it and lists what is
// valid. The decorator "conditional-full:<type>" adds a `length_limit`
// parameter to the inner type's.
#pragma once

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "fastattn/attention.h"

namespace fastattn {

enum class ParamType { Int, Float, Bool, Choice, String };
const char* param_type_name(ParamType t);

// A parameter value as the user gives it (an Int spec also takes no double; a
// Float spec takes an int).
using ParamValue = std::variant<int64_t, double, bool, std::string>;
using ParamMap = std::map<std::string, ParamValue>;
std::string param_value_to_string(const ParamValue& v);

struct ParamSpec {
  std::string name;
  ParamType type = ParamType::Int;
  // The default; std::nullopt means "optional, no value" (e.g. softmax_temp,
  // whose absence means 1/sqrt(E)).
  std::optional<ParamValue> default_value;
  std::string help;
  std::optional<double> min;  // for Int and Float; inclusive unless min_exclusive
  std::optional<double> max;  // for Int and Float; inclusive unless max_exclusive
  bool min_exclusive = false;
  bool max_exclusive = false;
  std::vector<std::string> choices;  // for Choice

  // Shorthands for the common specs.
  static ParamSpec integer(std::string name, std::optional<int64_t> def, std::string help,
                           std::optional<double> min = std::nullopt,
                           std::optional<double> max = std::nullopt);
  static ParamSpec real(std::string name, std::optional<double> def, std::string help,
                        std::optional<double> min = std::nullopt,
                        std::optional<double> max = std::nullopt);
  static ParamSpec boolean(std::string name, bool def, std::string help);
  static ParamSpec choice(std::string name, std::string def, std::vector<std::string> choices,
                          std::string help);
  // Open bounds: ParamSpec::real("p", 0.0, "...", 0.0, 1.0).exclusive_max() is [0, 1).
  ParamSpec exclusive_min() const;
  ParamSpec exclusive_max() const;
  // "[0, 1)", ">= 1", "> 0" or "" without bounds.
  std::string range_string() const;
};

// Validated parameters: every spec'd name is present (with its default) or
// explicitly absent (optional without default).
class Params {
 public:
  Params() = default;
  explicit Params(ParamMap values) : values_(std::move(values)) {}
  bool has(const std::string& name) const { return values_.count(name) > 0; }
  int64_t get_int(const std::string& name) const;
  double get_float(const std::string& name) const;
  bool get_bool(const std::string& name) const;
  const std::string& get_string(const std::string& name) const;  // Choice and String
  std::optional<int64_t> get_optional_int(const std::string& name) const;
  std::optional<double> get_optional_float(const std::string& name) const;
  const ParamMap& values() const { return values_; }

 private:
  const ParamValue& at(const std::string& name) const;
  ParamMap values_;
};

using AttentionFactory = std::function<AttentionPtr(const Params&, const AttentionDims&)>;

class RecurrentAttentionBase;
// The step form of a type (make_recurrent_attention), from the same
// validated parameters as its batch factory.
using RecurrentFactory =
    std::function<std::shared_ptr<RecurrentAttentionBase>(const Params&, const AttentionDims&)>;
class RecurrentCrossAttentionBase;
// A dedicated cross-attention step form over a cached memory
// (make_recurrent_cross_attention); types without one run their batch form
// over the memory.
using RecurrentCrossFactory = std::function<std::shared_ptr<RecurrentCrossAttentionBase>(
    const Params&, const AttentionDims&)>;

// The attention masks a type takes besides causal and key lengths, each
// kind taking what the one before it takes: none; boolean masks (true
// keeps); any (boolean, or an additive float mask). Named "none", "bool",
// "any" in JSON, `fastattn list` and fastattn.capabilities().
enum class MaskKinds { None, Bool, Any };
// Whether causal attention of fewer queries than keys gives the rows of the
// whole causal computation: no; yes; only with an explicit `stride`
// parameter ("no", "yes", "stride" in JSON).
enum class IncrementalRows { No, Yes, Stride };
const char* to_string(MaskKinds kinds);
const char* to_string(IncrementalRows rows);

// What a type can do, declared with its entry: `fastattn list`, the Python
// bindings (fastattn.hf, fastattn.nn) and the recurrent code read it, and
// tests/cpp/test_capabilities.cpp holds every type to it (what is declared
// runs; what is not is refused with an error).
struct Capabilities {
  bool causal = true;         // takes a causal mask
  bool bidirectional = true;  // runs without one
  // Masks besides causal and key lengths (MaskKinds).
  MaskKinds attn_mask = MaskKinds::None;
  // Causal attention of fewer queries than keys (L < S: the last L
  // positions, as with a key/value cache) gives the rows of the whole causal
  // computation (IncrementalRows).
  IncrementalRows incremental = IncrementalRows::No;
  bool learned = false;  // holds trained parameters (ClusterFormer's centroids)
  // The type that does this one's job in the other direction, if any
  // ("linear" -> causal "causal-linear"), for suggestions in errors.
  std::string causal_form;
  std::string bidirectional_form;
  // Compute-bound reference rather than a speed-up (exact-topk builds the
  // L x S scores): said in `fastattn list`.
  bool oracle = false;
  // Picks keys, clusters or buckets from scores or hashes (clustering, top-k,
  // LSH, argmax): in float16 / bfloat16 a near-tie may pick differently from
  // float32, so its results there follow the picks, not float32's.
  bool selects = false;
  // Works channel by channel (AFT): values as wide as the queries and keys
  // (M = E); other widths are refused.
  bool channelwise = false;

  // Builders for the declarations:
  // Capabilities().masks(MaskKinds::Any).rows(IncrementalRows::Yes).
  Capabilities causal_only(std::string bidirectional_twin) const {
    auto c = *this;
    c.bidirectional = false;
    c.bidirectional_form = std::move(bidirectional_twin);
    return c;
  }
  Capabilities bidirectional_only(std::string causal_twin) const {
    auto c = *this;
    c.causal = false;
    c.causal_form = std::move(causal_twin);
    return c;
  }
  Capabilities masks(MaskKinds kinds) const {
    auto c = *this;
    c.attn_mask = kinds;
    return c;
  }
  Capabilities rows(IncrementalRows how) const {
    auto c = *this;
    c.incremental = how;
    return c;
  }
  Capabilities with_learned_parameters() const {
    auto c = *this;
    c.learned = true;
    return c;
  }
  Capabilities as_oracle() const {
    auto c = *this;
    c.oracle = true;
    return c;
  }
  Capabilities selecting() const {
    auto c = *this;
    c.selects = true;
    return c;
  }
  Capabilities channel_by_channel() const {
    auto c = *this;
    c.channelwise = true;
    return c;
  }

  nlohmann::json to_json() const;
};

// Refuses what `caps` does not declare, in one message format:
//   "<type>: <argument>: got <what came>, which <type> does not take (<what
//   it takes>)[; use the type '<twin>']"
// for a causal mask (causal), its absence (bidirectional), an attn_mask by
// kind (attn_mask) and values narrower or wider than the keys (channelwise).
// Every registered type's forward runs it through
// check_attention_inputs(type_name(), ...); incremental rows refuse nothing
// (a type without them computes the aligned rows, not the whole's).
void check_declared(const std::string& type, const Capabilities& caps, const torch::Tensor& queries,
                    const torch::Tensor& values, const Mask& mask);

struct AttentionType {
  std::string name;
  std::string description;
  std::vector<ParamSpec> params;
  AttentionFactory factory;
  Capabilities capabilities;
  RecurrentFactory recurrent{};             // empty: no step form
  RecurrentCrossFactory recurrent_cross{};  // empty: the batch form over the memory
};

class AttentionRegistry {
 public:
  // The process-wide registry, with every built-in type registered.
  static AttentionRegistry& global();

  void add(AttentionType type);                  // throws if the name is taken
  bool contains(const std::string& name) const;  // understands conditional-full:<type>
  // The type's record; for "conditional-full:<type>" a synthesized record.
  AttentionType get(const std::string& name) const;
  // The declaration of `name` (conditional-full:<type> included), or nullopt
  // for a name the registry lacks (a user's type built without it).
  std::optional<Capabilities> capabilities(const std::string& name) const;
  std::vector<std::string> names() const;  // sorted, without the decorator
  // Validates `params` against the type's specs and fills in defaults.
  Params validate(const std::string& name, const ParamMap& params) const;
  AttentionPtr build(const std::string& name, const ParamMap& params = {},
                     const AttentionDims& dims = {}) const;
  // The names of the types with a step form, sorted.
  std::vector<std::string> recurrent_names() const;
  // Every type with its specs, as JSON (what `fastattn list --json` prints):
  //   {"types": [{"name", "description", "params": [{"name", "type", "default"
  //   (null when optional), "help", and where they apply "min", "max",
  //   "min_exclusive", "max_exclusive", "choices"}], "capabilities":
  //   {Capabilities' fields, "recurrent": bool}}],
  //    "decorators": [{"name": "conditional-full:<type>", "description",
  //   "params": [the parameters it adds to the inner type's]}]}
  nlohmann::json describe() const;

 private:
  // The record of `name` without a copy: the stored one, or conditional-full's
  // synthesized into `scratch` (this runs on every call of a registry-built
  // type).
  const AttentionType& find(const std::string& name, AttentionType& scratch) const;
  Params validate(const AttentionType& type, const ParamMap& params) const;

  std::map<std::string, AttentionType> types_;
};

inline AttentionPtr make_attention(const std::string& name, const ParamMap& params = {},
                                   const AttentionDims& dims = {}) {
  return AttentionRegistry::global().build(name, params, dims);
}

// Parameters from a JSON object ({"softmax_temp": 0.125, ...}); numbers keep
// their JSON kind (integer or floating), which validation then coerces.
ParamMap params_from_json(const nlohmann::json& j);

}  // namespace fastattn
