// The CPU kernels' instruction-set level (include/fastattn/ops.h,
// src/kernels/common/cpu_isa.h), as C++ functions and as operators:
//   cpu_capability() -> str
//   supported_cpu_capabilities() -> str[]
//   set_cpu_capability(str level) -> ()
#include <torch/library.h>

#include <stdexcept>

#include "fastattn/ops.h"
#include "kernels/common/cpu_isa.h"

namespace fastattn {

namespace {

// std::invalid_argument from the kernels' layer as a c10 error, so Python sees
// a ValueError-like RuntimeError with the same message.
template <typename F>
auto checked(F f) {
  try {
    return f();
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK(false, e.what());
  }
}

}  // namespace

std::string cpu_capability() {
  return checked([] { return std::string(kernels::cpu_isa_name(kernels::cpu_isa())); });
}

std::vector<std::string> supported_cpu_capabilities() {
  std::vector<std::string> out;
  for (auto isa : kernels::supported_cpu_isas()) out.emplace_back(kernels::cpu_isa_name(isa));
  return out;
}

void set_cpu_capability(const std::string& level) {
  checked([&] { kernels::set_cpu_isa(kernels::parse_cpu_isa(level, "cpu capability")); });
}

}  // namespace fastattn

// Schemas in schemas.cpp. No tensor arguments: the dispatcher looks these up under an empty key
// set, where a CompositeImplicitAutograd kernel is installed (as for attention_types).
TORCH_LIBRARY_IMPL(fastattn, CompositeImplicitAutograd, m) {
  m.impl("cpu_capability", [] { return fastattn::cpu_capability(); });
  m.impl("supported_cpu_capabilities", [] { return fastattn::supported_cpu_capabilities(); });
  m.impl("set_cpu_capability", [](std::string level) { fastattn::set_cpu_capability(level); });
}
