// Attention-type helpers shared by the robustness tests (test_validation.cpp,
// test_edge_numerics.cpp) and the operator fuzzer (fuzz/fuzz_ops.cpp, which
// includes this header from both the fuzzer and the test build): the
// registered types without the throwaway "test-*" types that other tests
// register, their dimensions, and a type built with seeded defaults.
// No GoogleTest here: the libFuzzer build has none.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

#include "fastattn/registry.h"

namespace fastattn::cases {

// Other tests register throwaway types named "test-*" in the global registry;
// the robustness tables and the fuzzer skip them.
inline bool is_throwaway_type(const std::string& name) { return name.rfind("test-", 0) == 0; }

// The registered type names (registry order), without the throwaway ones.
inline std::vector<std::string> registered_types() {
  std::vector<std::string> names;
  for (const auto& n : AttentionRegistry::global().names()) {
    if (!is_throwaway_type(n)) names.push_back(n);
  }
  return names;
}

inline AttentionDims dims(int64_t heads, int64_t query_dim, int64_t value_dim) {
  AttentionDims d;
  d.heads = heads;
  d.query_dim = query_dim;
  d.value_dim = value_dim;
  return d;
}

// True when the type `name` has a parameter called `param`.
inline bool has_param(const std::string& name, const std::string& param) {
  for (const auto& s : AttentionRegistry::global().get(name).params) {
    if (s.name == param) return true;
  }
  return false;
}

// Builds `name` in eval mode with `params`, plus seed = `seed` when the type
// takes a `seed` parameter that `params` leaves out; torch's global generator
// is seeded with `init_seed` first (for the types' parameter initialisation).
inline AttentionPtr build_type(const std::string& name, const AttentionDims& d,
                               ParamMap params = {}, int64_t seed = 1, uint64_t init_seed = 5) {
  if (has_param(name, "seed") && !params.count("seed")) params["seed"] = seed;
  torch::manual_seed(init_seed);
  auto a = make_attention(name, params, d);
  a->eval();
  return a;
}

}  // namespace fastattn::cases
