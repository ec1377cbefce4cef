// Detection and choice of the CPU kernels' instruction set (cpu_isa.h).
// Compiled once, for the baseline target.
#include "kernels/common/cpu_isa.h"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdlib>
#include <stdexcept>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif

namespace fastattn::kernels {
namespace {

constexpr const char* kNames[] = {"default", "avx2", "avx512", "avx512_bf16", "amx"};
constexpr int kLevels = 5;

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
// AVX512-BF16 (CPUID leaf 7, subleaf 1, EAX bit 5).
bool avx512_bf16_flag() {
  unsigned a, b, c, d;
  return __get_cpuid_count(7, 1, &a, &b, &c, &d) && ((a >> 5) & 1);
}

// CPUID's vendor string is "AuthenticAMD".
bool amd_cpu() {
  unsigned a, b, c, d;
  if (!__get_cpuid(0, &a, &b, &c, &d)) return false;
  return b == 0x68747541 && d == 0x69746e65 && c == 0x444d4163;  // "Auth" "enti" "cAMD"
}

// AVX512-BF16, AMX-TILE and AMX-BF16 (CPUID leaf 7), the tile state enabled
// in XCR0 (bits 17, 18), and on Linux the process's permission to use the
// tile data (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA, kernel >= 5.16),
// asked once: without it the first tile instruction faults.
bool amx_usable() {
  static const bool usable = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool tile = (d >> 24) & 1, bf16_tile = (d >> 22) & 1;
    if (!(tile && bf16_tile && avx512_bf16_flag())) return false;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !((c >> 27) & 1)) return false;  // OSXSAVE
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if (((lo >> 17) & 3) != 3) return false;
#if defined(__linux__)
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
    return false;
#endif
  }();
  return usable;
}
#endif

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
    case CpuIsa::kAvx512Bf16:
      return cpu_runs(CpuIsa::kAvx512) && avx512_bf16_flag();
    case CpuIsa::kAmx:
      return cpu_runs(CpuIsa::kAvx512Bf16) && amx_usable();
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

// -1: not chosen yet (the environment decides at the first call).
std::atomic<int> g_active{-1};

}  // namespace

const char* cpu_isa_name(CpuIsa isa) {
  const int i = static_cast<int>(isa);
  return i >= 0 && i < kLevels ? kNames[i] : "unknown";
}

CpuIsa parse_cpu_isa(const std::string& name, const std::string& what) {
  std::string lower = name;
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  for (int i = 0; i < kLevels; ++i)
    if (lower == kNames[i]) return static_cast<CpuIsa>(i);
  std::string names;
  for (const char* n : kNames) names += std::string(names.empty() ? "" : ", ") + n;
  throw std::invalid_argument(what + ": expected one of " + names + "; got '" + name + "'");
}

bool cpu_isa_supported(CpuIsa isa) {
  return static_cast<int>(isa) <= kCompiledIsaMax && cpu_runs(isa);
}

std::vector<CpuIsa> supported_cpu_isas() {
  std::vector<CpuIsa> out;
  for (int i = 0; i < kLevels; ++i)
    if (cpu_isa_supported(static_cast<CpuIsa>(i))) out.push_back(static_cast<CpuIsa>(i));
  return out;
}

CpuIsa best_cpu_isa() {
  const CpuIsa best = supported_cpu_isas().back();
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  if (best == CpuIsa::kAvx512Bf16 && !amd_cpu()) return CpuIsa::kAvx512;
#endif
  return best;
}

CpuIsa cpu_isa() {
  const int active = g_active.load(std::memory_order_relaxed);
  if (active >= 0) return static_cast<CpuIsa>(active);
  // A level chosen by the environment is checked alone: below amx, Linux is
  // never asked for the tile permission (which also enlarges every signal
  // frame of the process).
  CpuIsa chosen;
  if (const char* env = std::getenv("FASTATTN_CPU_CAPABILITY"); env && *env) {
    chosen = parse_cpu_isa(env, "FASTATTN_CPU_CAPABILITY");
    if (!cpu_isa_supported(chosen))
      throw std::invalid_argument(
          std::string("FASTATTN_CPU_CAPABILITY=") + env +
          ": not supported by this CPU or build; supported: " + supported_list());
  } else {
    chosen = best_cpu_isa();
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

const char* openblas_core_override(const std::string& chosen, CpuIsa cpu) {
  if (cpu < CpuIsa::kAvx2) return nullptr;
  // OpenBLAS's x86-64 cores with AVX2 kernels (its dynamic.c names).
  static const char* const kAvx2Cores[] = {"haswell", "excavator",  "zen",           "skylakex",
                                           "dhyana",  "cooperlake", "sapphirerapids"};
  std::string lower = chosen;
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  for (const char* core : kAvx2Cores)
    if (lower == core) return nullptr;
  return cpu >= CpuIsa::kAvx512 ? "SkylakeX" : "Haswell";
}

}  // namespace fastattn::kernels
