// Reading the training configs' JSON objects (tasks.cpp, trainer.cpp):
// unknown keys refused, each present field's type checked, messages naming
// `who` and the key.
#pragma once

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <string>
#include <type_traits>
#include <vector>

namespace fastattn::train {

// Checks that `j` is an object whose keys are all in `valid`.
inline void check_keys(const char* who, const nlohmann::json& j,
                       const std::vector<std::string>& valid) {
  TORCH_CHECK(j.is_object(), who, ": expected a JSON object, got ", j.dump());
  for (const auto& [key, value] : j.items()) {
    if (std::find(valid.begin(), valid.end(), key) == valid.end()) {
      std::string list;
      for (const auto& v : valid) list += (list.empty() ? "" : ", ") + v;
      TORCH_CHECK(false, who, ": unknown key '", key, "'; valid keys: ", list);
    }
  }
}

// j[key] into `out` when j has it (else `out` keeps its default): a string, a
// boolean, an integer or a number as T is.
template <class T>
void read_field(const char* who, const nlohmann::json& j, const char* key, T& out) {
  if (!j.contains(key)) return;
  const auto& v = j[key];
  if constexpr (std::is_same_v<T, std::string>) {
    TORCH_CHECK(v.is_string(), who, ": '", key, "' must be a string, got ", v.dump());
  } else if constexpr (std::is_same_v<T, bool>) {
    TORCH_CHECK(v.is_boolean(), who, ": '", key, "' must be true or false, got ", v.dump());
  } else if constexpr (std::is_integral_v<T>) {
    TORCH_CHECK(v.is_number_integer(), who, ": '", key, "' must be an integer, got ", v.dump());
  } else {
    TORCH_CHECK(v.is_number(), who, ": '", key, "' must be a number, got ", v.dump());
  }
  out = v.get<T>();
}

}  // namespace fastattn::train
