// Attention specs on the command line: `TYPE[:PARAM=VALUE[:PARAM=VALUE...]]`,
// e.g. `full`, `full:softmax_temp=0.125`, `conditional-full:linear:length_limit=512`.
// Segments without '=' belong to the type name (so the decorator
// conditional-full:<type> needs no quoting); segments with '=' are parameters.
// Values are read by the kind of the type's ParamSpec (int, float, bool
// true|false, choice/string as is); the registry then validates them, so a bad
// type or parameter is a UsageError naming it and listing what is valid.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <variant>
#include <vector>

#include "cli/command.h"
#include "fastattn/registry.h"

namespace fastattn::cli {

// Runs a registry call, turning its errors (bad type, bad parameter) into
// usage errors with the registry's message.
template <typename F>
auto registry_call(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const c10::Error& e) {
    throw UsageError(e.what_without_backtrace());
  } catch (const UsageError&) {
    throw;
  } catch (const std::exception& e) {
    throw UsageError(e.what());
  }
}

struct AttentionSpec {
  std::string text;  // as the user wrote it (used as the label)
  std::string type;
  ParamMap params;
};

inline AttentionSpec parse_attention_spec(const std::string& text) {
  AttentionSpec spec;
  spec.text = text;
  std::vector<std::pair<std::string, std::string>> raw;
  for (const auto& seg : split(text, ':')) {
    const auto eq = seg.find('=');
    if (eq == std::string::npos) {
      if (!raw.empty()) {
        throw UsageError("attention spec '" + text + "': type name segment '" + seg +
                         "' after a parameter (write TYPE[:PARAM=VALUE...])");
      }
      spec.type += (spec.type.empty() ? "" : ":") + seg;
    } else {
      raw.emplace_back(seg.substr(0, eq), seg.substr(eq + 1));
    }
  }
  if (spec.type.empty()) throw UsageError("attention spec '" + text + "' has no type name");
  const auto& reg = AttentionRegistry::global();
  const AttentionType type = registry_call([&] { return reg.get(spec.type); });
  for (const auto& [name, value] : raw) {
    if (name.empty()) throw UsageError("attention spec '" + text + "': empty parameter name");
    if (spec.params.count(name)) {
      throw UsageError("attention spec '" + text + "': parameter " + name + " given twice");
    }
    const ParamSpec* ps = nullptr;
    for (const auto& p : type.params) {
      if (p.name == name) ps = &p;
    }
    const std::string what = "parameter " + name + " of " + spec.type;
    if (ps == nullptr || ps->type == ParamType::Choice || ps->type == ParamType::String) {
      spec.params[name] = value;  // unknown names: the registry reports them below
    } else if (ps->type == ParamType::Int) {
      spec.params[name] = parse_int(value, what);
    } else if (ps->type == ParamType::Float) {
      spec.params[name] = parse_double(value, what);
    } else {
      spec.params[name] = parse_bool(value, what);
    }
  }
  registry_call([&] { return reg.validate(spec.type, spec.params); });
  return spec;
}

// The builder JSON of a spec: {"type": TYPE, PARAM: VALUE, ...}.
inline nlohmann::json attention_json(const std::string& text) {
  const auto spec = parse_attention_spec(text);
  nlohmann::json j = {{"type", spec.type}};
  for (const auto& [name, value] : spec.params) {
    std::visit([&, n = name](const auto& v) { j[n] = v; }, value);
  }
  return j;
}

}  // namespace fastattn::cli
