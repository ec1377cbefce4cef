// The attention registry: typed parameter specs, validation with errors that
// name what is wrong and list what is valid, the conditional-full:<type>
// decorator, JSON description and parsing. The built-in types are registered
// by explicit calls (attention/builtin_types.h), not by static initialisers.
#include "fastattn/registry.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "attention/builtin_types.h"

namespace fastattn {

namespace {

constexpr const char* kConditionalPrefix = "conditional-full:";
constexpr const char* kLengthLimit = "length_limit";

bool is_conditional(const std::string& name) { return name.rfind(kConditionalPrefix, 0) == 0; }

std::string join(const std::vector<std::string>& items) {
  std::string out;
  for (const auto& s : items) out += (out.empty() ? "" : ", ") + s;
  return out;
}

std::string spec_names(const std::vector<ParamSpec>& specs) {
  std::vector<std::string> names;
  for (const auto& s : specs) names.push_back(s.name);
  return names.empty() ? "(none)" : join(names);
}

// 1 rather than 1.0 for bounds; shortest round-trip form otherwise.
std::string number_str(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  if (x == std::floor(x) && std::abs(x) < 1e15) return std::to_string(static_cast<int64_t>(x));
  return nlohmann::json(x).dump();
}

const char* value_kind(const ParamValue& v) {
  switch (v.index()) {
    case 0:
      return "int";
    case 1:
      return "float";
    case 2:
      return "bool";
    default:
      return "string";
  }
}

const ParamSpec* find_spec(const std::vector<ParamSpec>& specs, const std::string& name) {
  for (const auto& s : specs) {
    if (s.name == name) return &s;
  }
  return nullptr;
}

// Checks one value against its spec and returns it in the spec's kind (an int
// given to a Float spec becomes a double). `where` names the parameter in a
// message: a callable giving a string, called only when the value is refused.
template <typename Where>
ParamValue coerce(const ParamSpec& spec, const ParamValue& v, const Where& where) {
  const auto got = [&] { return std::string(value_kind(v)) + " " + param_value_to_string(v); };
  ParamValue out = v;
  switch (spec.type) {
    case ParamType::Int:
      TORCH_CHECK(std::holds_alternative<int64_t>(v), where(), " must be an int, got ", got());
      break;
    case ParamType::Float:
      if (std::holds_alternative<int64_t>(v)) {
        out = static_cast<double>(std::get<int64_t>(v));
      }
      TORCH_CHECK(std::holds_alternative<double>(out), where(), " must be a float, got ", got());
      TORCH_CHECK(std::isfinite(std::get<double>(out)), where(), " must be a finite float, got ",
                  got());
      break;
    case ParamType::Bool:
      TORCH_CHECK(std::holds_alternative<bool>(v), where(), " must be a bool, got ", got());
      break;
    case ParamType::Choice: {
      const auto* s = std::get_if<std::string>(&v);
      bool ok = s && std::find(spec.choices.begin(), spec.choices.end(), *s) != spec.choices.end();
      TORCH_CHECK(ok, where(), " must be one of ", join(spec.choices), ", got ", got());
      break;
    }
    case ParamType::String:
      TORCH_CHECK(std::holds_alternative<std::string>(v), where(), " must be a string, got ",
                  got());
      break;
  }
  if (spec.type == ParamType::Int || spec.type == ParamType::Float) {
    const double x = spec.type == ParamType::Int ? static_cast<double>(std::get<int64_t>(out))
                                                 : std::get<double>(out);
    bool ok = true;
    if (spec.min) ok = ok && (spec.min_exclusive ? x > *spec.min : x >= *spec.min);
    if (spec.max) ok = ok && (spec.max_exclusive ? x < *spec.max : x <= *spec.max);
    TORCH_CHECK(ok, where(), " must be ", spec.range_string(), ", got ", param_value_to_string(v));
  }
  return out;
}

std::string param_where(const std::string& type, const std::string& param) {
  return "parameter '" + param + "' of attention type '" + type + "'";
}

// The values of `p` whose names `specs` has.
Params subset(const Params& p, const std::vector<ParamSpec>& specs) {
  ParamMap out;
  for (const auto& s : specs) {
    auto it = p.values().find(s.name);
    if (it != p.values().end()) out.emplace(it->first, it->second);
  }
  return Params(std::move(out));
}

nlohmann::json value_json(const ParamValue& v) {
  return std::visit([](const auto& x) { return nlohmann::json(x); }, v);
}

nlohmann::json spec_json(const ParamSpec& s) {
  nlohmann::json j;
  j["name"] = s.name;
  j["type"] = param_type_name(s.type);
  j["default"] = s.default_value ? value_json(*s.default_value) : nlohmann::json(nullptr);
  j["help"] = s.help;
  if (s.min) j["min"] = *s.min;
  if (s.max) j["max"] = *s.max;
  if (s.min_exclusive) j["min_exclusive"] = true;
  if (s.max_exclusive) j["max_exclusive"] = true;
  if (s.type == ParamType::Choice) j["choices"] = s.choices;
  return j;
}

ParamSpec length_limit_spec() {
  return ParamSpec::integer(kLengthLimit, 512,
                            "full attention while max(L, S) <= length_limit, the inner "
                            "type beyond",
                            1);
}

}  // namespace

// ---- values and specs -------------------------------------------------------

const char* param_type_name(ParamType t) {
  switch (t) {
    case ParamType::Int:
      return "int";
    case ParamType::Float:
      return "float";
    case ParamType::Bool:
      return "bool";
    case ParamType::Choice:
      return "choice";
    case ParamType::String:
      return "string";
  }
  return "?";
}

std::string param_value_to_string(const ParamValue& v) {
  if (const auto* i = std::get_if<int64_t>(&v)) return std::to_string(*i);
  if (const auto* d = std::get_if<double>(&v)) {
    if (!std::isfinite(*d)) return number_str(*d);
    return nlohmann::json(*d).dump();  // keeps the ".0" of a float
  }
  if (const auto* b = std::get_if<bool>(&v)) return *b ? "true" : "false";
  return nlohmann::json(std::get<std::string>(v)).dump();
}

namespace {

ParamSpec spec(std::string name, ParamType type, std::optional<ParamValue> def, std::string help,
               std::optional<double> min = std::nullopt, std::optional<double> max = std::nullopt) {
  ParamSpec s;
  s.name = std::move(name);
  s.type = type;
  s.default_value = std::move(def);
  s.help = std::move(help);
  s.min = min;
  s.max = max;
  return s;
}

template <typename T>
std::optional<ParamValue> value_or_none(const std::optional<T>& v) {
  return v ? std::optional<ParamValue>(*v) : std::nullopt;
}

}  // namespace

ParamSpec ParamSpec::integer(std::string name, std::optional<int64_t> def, std::string help,
                             std::optional<double> min, std::optional<double> max) {
  return spec(std::move(name), ParamType::Int, value_or_none(def), std::move(help), min, max);
}

ParamSpec ParamSpec::real(std::string name, std::optional<double> def, std::string help,
                          std::optional<double> min, std::optional<double> max) {
  return spec(std::move(name), ParamType::Float, value_or_none(def), std::move(help), min, max);
}

ParamSpec ParamSpec::boolean(std::string name, bool def, std::string help) {
  return spec(std::move(name), ParamType::Bool, ParamValue(def), std::move(help));
}

ParamSpec ParamSpec::choice(std::string name, std::string def, std::vector<std::string> choices,
                            std::string help) {
  ParamSpec s =
      spec(std::move(name), ParamType::Choice, ParamValue(std::move(def)), std::move(help));
  s.choices = std::move(choices);
  return s;
}

ParamSpec ParamSpec::exclusive_min() const {
  ParamSpec s = *this;
  s.min_exclusive = true;
  return s;
}

ParamSpec ParamSpec::exclusive_max() const {
  ParamSpec s = *this;
  s.max_exclusive = true;
  return s;
}

std::string ParamSpec::range_string() const {
  if (min && max) {
    return std::string("in ") + (min_exclusive ? "(" : "[") + number_str(*min) + ", " +
           number_str(*max) + (max_exclusive ? ")" : "]");
  }
  if (min) return (min_exclusive ? "> " : ">= ") + number_str(*min);
  if (max) return (max_exclusive ? "< " : "<= ") + number_str(*max);
  return "";
}

// ---- Params -----------------------------------------------------------------

const ParamValue& Params::at(const std::string& name) const {
  auto it = values_.find(name);
  if (it == values_.end()) {
    std::vector<std::string> set;
    for (const auto& kv : values_) set.push_back(kv.first);
    TORCH_CHECK(false, "Params: parameter '", name,
                "' has no value; parameters with a value: ", set.empty() ? "(none)" : join(set));
  }
  return it->second;
}

int64_t Params::get_int(const std::string& name) const {
  const auto& v = at(name);
  TORCH_CHECK(std::holds_alternative<int64_t>(v), "Params: parameter '", name,
              "' is not an int: it holds ", value_kind(v), " ", param_value_to_string(v));
  return std::get<int64_t>(v);
}

double Params::get_float(const std::string& name) const {
  const auto& v = at(name);
  if (const auto* i = std::get_if<int64_t>(&v)) return static_cast<double>(*i);
  TORCH_CHECK(std::holds_alternative<double>(v), "Params: parameter '", name,
              "' is not a float: it holds ", value_kind(v), " ", param_value_to_string(v));
  return std::get<double>(v);
}

bool Params::get_bool(const std::string& name) const {
  const auto& v = at(name);
  TORCH_CHECK(std::holds_alternative<bool>(v), "Params: parameter '", name,
              "' is not a bool: it holds ", value_kind(v), " ", param_value_to_string(v));
  return std::get<bool>(v);
}

const std::string& Params::get_string(const std::string& name) const {
  const auto& v = at(name);
  TORCH_CHECK(std::holds_alternative<std::string>(v), "Params: parameter '", name,
              "' is not a string: it holds ", value_kind(v), " ", param_value_to_string(v));
  return std::get<std::string>(v);
}

std::optional<int64_t> Params::get_optional_int(const std::string& name) const {
  if (!has(name)) return std::nullopt;
  return get_int(name);
}

std::optional<double> Params::get_optional_float(const std::string& name) const {
  if (!has(name)) return std::nullopt;
  return get_float(name);
}

// ---- registry -----------------------------------------------------------------

AttentionRegistry& AttentionRegistry::global() {
  // Function-local static: built on first use, after everything it calls.
  static AttentionRegistry registry = [] {
    AttentionRegistry r;
    register_builtin_types(r);
    return r;
  }();
  return registry;
}

void AttentionRegistry::add(AttentionType type) {
  const auto& name = type.name;
  TORCH_CHECK(!name.empty(), "AttentionRegistry::add: the type name must not be empty");
  TORCH_CHECK(name.find(':') == std::string::npos, "AttentionRegistry::add: type name '", name,
              "' must not contain ':' (reserved for decorators such as conditional-full:<type>)");
  TORCH_CHECK(!types_.count(name), "AttentionRegistry::add: attention type '", name,
              "' is already registered");
  TORCH_CHECK(type.factory, "AttentionRegistry::add: attention type '", name,
              "' needs a factory, got none");
  const auto& caps = type.capabilities;
  TORCH_CHECK(caps.causal || caps.bidirectional, "AttentionRegistry::add: attention type '", name,
              "' must run causal, bidirectional or both");
  TORCH_CHECK(caps.causal || caps.incremental == IncrementalRows::No,
              "AttentionRegistry::add: attention type '", name,
              "': incremental rows need causal attention");
  std::set<std::string> seen;
  for (const auto& spec : type.params) {
    TORCH_CHECK(!spec.name.empty(), "AttentionRegistry::add: attention type '", name,
                "' has a parameter without a name");
    TORCH_CHECK(seen.insert(spec.name).second, "AttentionRegistry::add: attention type '", name,
                "' declares parameter '", spec.name, "' twice");
    TORCH_CHECK(spec.type != ParamType::Choice || !spec.choices.empty(),
                "AttentionRegistry::add: choice parameter '", spec.name, "' of '", name,
                "' has no choices");
    // A default must pass its own spec (catches a wrong kind or range early).
    if (spec.default_value)
      coerce(spec, *spec.default_value,
             [&] { return "default of " + param_where(name, spec.name); });
  }
  types_.emplace(name, std::move(type));
}

bool AttentionRegistry::contains(const std::string& name) const {
  if (is_conditional(name)) {
    const auto inner = name.substr(std::string(kConditionalPrefix).size());
    return !is_conditional(inner) && types_.count(inner) > 0 && types_.count("full") > 0;
  }
  return types_.count(name) > 0;
}

// The names in the enums' order.
const char* to_string(MaskKinds kinds) {
  static const char* const names[] = {"none", "bool", "any"};
  return names[static_cast<int>(kinds)];
}

const char* to_string(IncrementalRows rows) {
  static const char* const names[] = {"no", "yes", "stride"};
  return names[static_cast<int>(rows)];
}

nlohmann::json Capabilities::to_json() const {
  return {{"causal", causal},
          {"bidirectional", bidirectional},
          {"attn_mask", to_string(attn_mask)},
          {"incremental", to_string(incremental)},
          {"learned", learned},
          {"causal_form", causal_form},
          {"bidirectional_form", bidirectional_form},
          {"oracle", oracle},
          {"selects", selects},
          {"channelwise", channelwise}};
}

namespace {

[[noreturn]] void refuse(const std::string& type, const char* argument, const std::string& got,
                         const std::string& takes, const std::string& twin) {
  std::ostringstream os;
  os << type << ": " << argument << ": got " << got << ", which " << type << " does not take ("
     << takes << ")";
  if (!twin.empty()) os << "; use the type '" << twin << "'";
  TORCH_CHECK(false, os.str());
}

std::string masks_taken(const Capabilities& caps) {
  switch (caps.attn_mask) {
    case MaskKinds::None:
      return caps.causal ? "only the causal mask and key_lengths" : "only key_lengths";
    case MaskKinds::Bool:
      return "boolean attn_masks (true = keep), not additive ones";
    case MaskKinds::Any:
      break;
  }
  return "any attn_mask";
}

}  // namespace

void check_declared(const std::string& type, const Capabilities& caps, const torch::Tensor& queries,
                    const torch::Tensor& values, const Mask& mask) {
  if (mask.is_causal() && !caps.causal) {
    refuse(type, "causal", "a causal mask", "it is bidirectional only", caps.causal_form);
  }
  if (!mask.is_causal() && !caps.bidirectional) {
    refuse(type, "causal", "no causal mask", "it is causal only", caps.bidirectional_form);
  }
  if (const auto& m = mask.attn_mask()) {
    const bool is_bool = m->scalar_type() == at::kBool;
    if (caps.attn_mask == MaskKinds::None || (caps.attn_mask == MaskKinds::Bool && !is_bool)) {
      std::ostringstream got;
      if (is_bool) {
        got << "a boolean attn_mask";
      } else {
        got << "an additive " << m->scalar_type() << " attn_mask";
      }
      got << " of shape " << m->sizes();
      refuse(type, "attn_mask", got.str(), "it takes " + masks_taken(caps), "");
    }
  }
  if (caps.channelwise && values.size(-1) != queries.size(-1)) {
    std::ostringstream takes;
    takes << "it works channel by channel: values as wide as the queries and keys, E = "
          << queries.size(-1);
    refuse(type, "values", "values of width M = " + std::to_string(values.size(-1)), takes.str(),
           "");
  }
}

namespace {

// conditional-full:<type> runs full or <type> by length: it can do what both can.
Capabilities both(const Capabilities& a, const Capabilities& b) {
  Capabilities c;
  c.causal = a.causal && b.causal;
  c.bidirectional = a.bidirectional && b.bidirectional;
  c.attn_mask = std::min(a.attn_mask, b.attn_mask);
  c.incremental = a.incremental == b.incremental ? a.incremental : IncrementalRows::No;
  c.learned = a.learned || b.learned;
  c.selects = a.selects || b.selects;
  c.channelwise = a.channelwise || b.channelwise;
  return c;
}

}  // namespace

std::vector<std::string> AttentionRegistry::recurrent_names() const {
  std::vector<std::string> out;
  for (const auto& kv : types_)
    if (kv.second.recurrent) out.push_back(kv.first);
  return out;
}

std::vector<std::string> AttentionRegistry::names() const {
  std::vector<std::string> out;
  for (const auto& kv : types_) out.push_back(kv.first);
  return out;
}

AttentionType AttentionRegistry::get(const std::string& name) const {
  if (!is_conditional(name)) {
    auto it = types_.find(name);
    TORCH_CHECK(it != types_.end(), "unknown attention type '", name,
                "'; valid types: ", join(names()), " and the decorator conditional-full:<type>");
    return it->second;
  }
  const auto inner_name = name.substr(std::string(kConditionalPrefix).size());
  TORCH_CHECK(!is_conditional(inner_name), "attention type '", name,
              "': conditional-full cannot wrap another conditional-full");
  auto inner_it = types_.find(inner_name);
  TORCH_CHECK(inner_it != types_.end(), "unknown attention type '", inner_name, "' in '", name,
              "'; valid types: ", join(names()));
  auto full_it = types_.find("full");
  TORCH_CHECK(full_it != types_.end(), "attention type '", name,
              "' needs the type 'full', which this registry lacks");
  const AttentionType& inner = inner_it->second;
  const AttentionType& full = full_it->second;
  TORCH_CHECK(!find_spec(inner.params, kLengthLimit), "attention type '", name,
              "': the inner type already has a parameter '", kLengthLimit,
              "', which the decorator adds");

  // Parameters: the inner type's, then each of full's (softmax_temp,
  // attention_dropout) that the inner type lacks, then length_limit. Where the
  // inner type has a parameter of the same name (e.g. softmax_temp of a
  // softmax-based type) one value serves both parts and the inner type's spec
  // validates it: both parts then agree on the scale, which keeps the switch
  // at length_limit from changing the model's temperature.
  AttentionType t;
  t.name = name;
  t.description = "full attention while max(L, S) <= length_limit, '" + inner_name + "' beyond (" +
                  inner.description + ")";
  t.params = inner.params;
  for (const auto& spec : full.params) {
    if (!find_spec(inner.params, spec.name)) t.params.push_back(spec);
  }
  t.params.push_back(length_limit_spec());
  t.capabilities = both(inner.capabilities, full.capabilities);
  t.factory = [inner, full](const Params& p, const AttentionDims& dims) -> AttentionPtr {
    auto inner_module = inner.factory(subset(p, inner.params), dims);
    auto full_module =
        std::dynamic_pointer_cast<FullAttention>(full.factory(subset(p, full.params), dims));
    TORCH_CHECK(full_module, "conditional-full: the 'full' factory did not build a FullAttention");
    return std::make_shared<ConditionalFullAttention>(
        std::move(inner_module), std::move(full_module), p.get_int(kLengthLimit));
  };
  return t;
}

std::optional<Capabilities> AttentionRegistry::capabilities(const std::string& name) const {
  if (!is_conditional(name)) {
    auto it = types_.find(name);
    if (it == types_.end()) return std::nullopt;
    return it->second.capabilities;
  }
  // As get() synthesizes it, without building the record.
  const auto inner_name = name.substr(std::string(kConditionalPrefix).size());
  if (is_conditional(inner_name)) return std::nullopt;
  const auto inner = capabilities(inner_name), full = capabilities("full");
  if (!inner || !full) return std::nullopt;
  return both(*inner, *full);
}

const AttentionType& AttentionRegistry::find(const std::string& name,
                                             AttentionType& scratch) const {
  if (!is_conditional(name)) {
    auto it = types_.find(name);
    if (it != types_.end()) return it->second;
  }
  scratch = get(name);  // synthesizes conditional-full, or names the unknown type
  return scratch;
}

Params AttentionRegistry::validate(const std::string& name, const ParamMap& params) const {
  AttentionType scratch;
  return validate(find(name, scratch), params);
}

Params AttentionRegistry::validate(const AttentionType& type, const ParamMap& params) const {
  const std::string& name = type.name;
  for (const auto& kv : params) {
    TORCH_CHECK(find_spec(type.params, kv.first), "attention type '", name, "' has no parameter '",
                kv.first, "'; its parameters: ", spec_names(type.params));
  }
  ParamMap out;
  for (const auto& spec : type.params) {
    const auto where = [&] { return param_where(name, spec.name); };
    auto it = params.find(spec.name);
    if (it != params.end()) {
      out.emplace(spec.name, coerce(spec, it->second, where));
    } else if (spec.default_value) {
      out.emplace(spec.name, coerce(spec, *spec.default_value, where));
    }
  }
  return Params(std::move(out));
}

AttentionPtr AttentionRegistry::build(const std::string& name, const ParamMap& params,
                                      const AttentionDims& dims) const {
  TORCH_CHECK(dims.heads >= 1 && dims.query_dim >= 1 && dims.value_dim >= 1, "attention type '",
              name, "': dims must be >= 1, got heads=", dims.heads, ", query_dim=", dims.query_dim,
              ", value_dim=", dims.value_dim);
  AttentionType scratch;
  const AttentionType& type = find(name, scratch);
  auto attention = type.factory(validate(type, params), dims);
  TORCH_CHECK(attention, "attention type '", name, "': its factory returned null");
  return attention;
}

nlohmann::json AttentionRegistry::describe() const {
  nlohmann::json types = nlohmann::json::array();
  for (const auto& kv : types_) {
    nlohmann::json params = nlohmann::json::array();
    for (const auto& s : kv.second.params) params.push_back(spec_json(s));
    auto caps = kv.second.capabilities.to_json();
    caps["recurrent"] = static_cast<bool>(kv.second.recurrent);
    types.push_back({{"name", kv.first},
                     {"description", kv.second.description},
                     {"params", params},
                     {"capabilities", caps}});
  }
  nlohmann::json added = nlohmann::json::array({spec_json(length_limit_spec())});
  auto full = types_.find("full");
  if (full != types_.end()) {
    for (const auto& s : full->second.params) added.push_back(spec_json(s));
  }
  nlohmann::json decorators = nlohmann::json::array();
  decorators.push_back(
      {{"name", std::string(kConditionalPrefix) + "<type>"},
       {"description",
        "full attention while max(L, S) <= length_limit, <type> beyond; takes <type>'s "
        "parameters plus these (a parameter of full that <type> also has is shared)"},
       {"params", added}});
  return {{"types", types}, {"decorators", decorators}};
}

ParamMap params_from_json(const nlohmann::json& j) {
  TORCH_CHECK(j.is_object(), "params_from_json: expected a JSON object of parameters, got ",
              j.type_name(), " ", j.dump());
  ParamMap out;
  for (const auto& item : j.items()) {
    const auto& v = item.value();
    if (v.is_boolean()) {
      out.emplace(item.key(), v.get<bool>());
    } else if (v.is_number_unsigned()) {
      const auto u = v.get<uint64_t>();
      TORCH_CHECK(u <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()),
                  "params_from_json: parameter '", item.key(), "' is too large: ", v.dump());
      out.emplace(item.key(), static_cast<int64_t>(u));
    } else if (v.is_number_integer()) {
      out.emplace(item.key(), v.get<int64_t>());
    } else if (v.is_number_float()) {
      out.emplace(item.key(), v.get<double>());
    } else if (v.is_string()) {
      out.emplace(item.key(), v.get<std::string>());
    } else {
      TORCH_CHECK(false, "params_from_json: parameter '", item.key(),
                  "' must be a number, bool or string, got ", v.type_name(), " ", v.dump());
    }
  }
  return out;
}

}  // namespace fastattn
