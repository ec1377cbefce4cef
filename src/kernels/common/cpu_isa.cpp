// Detection and choice of the CPU kernels' instruction set (cpu_isa.h).
// Compiled once, for the baseline target.
#include "kernels/common/cpu_isa.h"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdlib>
#include <stdexcept>

namespace fastattn::kernels {
namespace {

constexpr const char* kNames[] = {"default", "avx2", "avx512"};

bool cpu_runs(CpuIsa isa) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  // __builtin_cpu_supports also checks that the OS saves the wider registers.
  switch (isa) {
    case CpuIsa::kDefault:
      return true;
    case CpuIsa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2") &&
             __builtin_cpu_supports("popcnt");
    case CpuIsa::kAvx512:
      return cpu_runs(CpuIsa::kAvx2) && __builtin_cpu_supports("avx512f") &&
             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512cd");
  }
  return false;
#else
  return isa == CpuIsa::kDefault;
#endif
}

std::string supported_list() {
  std::string s;
  for (CpuIsa isa : supported_cpu_isas())
    s += std::string(s.empty() ? "" : ", ") + cpu_isa_name(isa);
  return s;
}

CpuIsa best_supported() {
  const auto all = supported_cpu_isas();
  return all.back();
}

// -1: not chosen yet (the environment decides at the first call).
std::atomic<int> g_active{-1};

}  // namespace

const char* cpu_isa_name(CpuIsa isa) {
  const int i = static_cast<int>(isa);
  return i >= 0 && i < 3 ? kNames[i] : "unknown";
}

CpuIsa parse_cpu_isa(const std::string& name, const std::string& what) {
  std::string lower = name;
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  for (int i = 0; i < 3; ++i)
    if (lower == kNames[i]) return static_cast<CpuIsa>(i);
  throw std::invalid_argument(what + ": expected one of default, avx2, avx512; got '" + name + "'");
}

bool cpu_isa_supported(CpuIsa isa) {
  return static_cast<int>(isa) <= kCompiledIsaMax && cpu_runs(isa);
}

std::vector<CpuIsa> supported_cpu_isas() {
  std::vector<CpuIsa> out;
  for (int i = 0; i < 3; ++i)
    if (cpu_isa_supported(static_cast<CpuIsa>(i))) out.push_back(static_cast<CpuIsa>(i));
  return out;
}

CpuIsa cpu_isa() {
  const int active = g_active.load(std::memory_order_relaxed);
  if (active >= 0) return static_cast<CpuIsa>(active);
  CpuIsa chosen = best_supported();
  if (const char* env = std::getenv("FASTATTN_CPU_CAPABILITY"); env && *env) {
    chosen = parse_cpu_isa(env, "FASTATTN_CPU_CAPABILITY");
    if (!cpu_isa_supported(chosen))
      throw std::invalid_argument(
          std::string("FASTATTN_CPU_CAPABILITY=") + env +
          ": not supported by this CPU or build; supported: " + supported_list());
  }
  int expected = -1;
  g_active.compare_exchange_strong(expected, static_cast<int>(chosen));
  return static_cast<CpuIsa>(g_active.load(std::memory_order_relaxed));
}

void set_cpu_isa(CpuIsa isa) {
  if (!cpu_isa_supported(isa))
    throw std::invalid_argument(
        std::string("cpu capability '") + cpu_isa_name(isa) +
        "' is not supported by this CPU or build; supported: " + supported_list());
  g_active.store(static_cast<int>(isa), std::memory_order_relaxed);
}

}  // namespace fastattn::kernels
