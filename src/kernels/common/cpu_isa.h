// Run-time choice of the CPU kernels' instruction set. Every CPU kernel is
// compiled once per level (CMakeLists.txt: fastattn_cpu_kernels_<level>,
// each translation unit inside kernels/common/isa_target.h's namespace and
// target region), and each entry point dispatches on cpu_isa():
//   default  x86-64 baseline (SSE2) or any other CPU: the scalar code path
//   avx2     AVX2 + FMA (+ BMI1/2, POPCNT): 8 floats per vector
//   avx512   AVX-512 F/BW/DQ/VL/CD on top of avx2: 16 floats per vector
//   avx512_bf16
//            avx512 plus AVX512-BF16: bfloat16 operands multiplied by
//            vdpbf16ps dot products (the kernels with a _bf16 variant: full
//            attention's forward and backward); every other kernel runs its
//            avx512 code
//   amx      avx512_bf16 plus AMX (TILE, BF16), with the OS's permission to
//            use the tiles: the _bf16 kernels' products on AMX tiles
// The best level the CPU runs is used (avx512_bf16 only on CPUs whose
// vdpbf16ps runs at the rate of their float32 FMAs, best_cpu_isa() below)
// unless the environment variable
// FASTATTN_CPU_CAPABILITY (read once, at the first kernel call) or
// set_cpu_isa() asks for a lower one, as PyTorch's ATEN_CPU_CAPABILITY does:
// for tests and for reproducing figures.
#pragma once

#include <string>
#include <vector>

// Highest level compiled into this build (0 off x86-64, 4 on it); set by
// CMake. Levels 0-2 compile every kernel; levels 3 and 4 only the _bf16
// sources.
#ifndef FASTATTN_CPU_ISA_MAX
#define FASTATTN_CPU_ISA_MAX 0
#endif

namespace fastattn::kernels {

enum class CpuIsa : int { kDefault = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3, kAmx = 4 };

constexpr int kCompiledIsaMax = FASTATTN_CPU_ISA_MAX;

// "default", "avx2", "avx512", "avx512_bf16", "amx".
const char* cpu_isa_name(CpuIsa isa);
// The level of a name (case-insensitive); std::invalid_argument naming
// `what` and the accepted names otherwise.
CpuIsa parse_cpu_isa(const std::string& name, const std::string& what = "cpu capability");
// Compiled into this build and runnable on this CPU (and enabled by its OS;
// for amx, the first call asks Linux for the tile data permission).
bool cpu_isa_supported(CpuIsa isa);
// The supported levels, lowest first.
std::vector<CpuIsa> supported_cpu_isas();
// The level used when none is asked for: the highest supported one, except
// that avx512_bf16 is passed over (for avx512) on CPUs other than AMD's. Its
// dot products pay where vdpbf16ps runs at the float32 FMA's instruction
// rate, twice its FLOP rate (an AMD EPYC Zen 4); an Emerald Rapids Xeon
// without AMX ran it at half the FMA's FLOP rate (docs/benchmarks.md,
// "Machines"; bench/cpu/fma_bf16_rate.c).
CpuIsa best_cpu_isa();
// The level the kernels use now: FASTATTN_CPU_CAPABILITY if set (an unknown
// or unsupported value throws std::invalid_argument, on every call), else
// best_cpu_isa().
CpuIsa cpu_isa();
// Uses `isa` from now on, for every thread; std::invalid_argument if it is not
// supported.
void set_cpu_isa(CpuIsa isa);

// The OpenBLAS core type to ask for (OPENBLAS_CORETYPE) when OpenBLAS chose
// `chosen` (its openblas_get_corename(), any case) on a CPU whose best vector
// level is `cpu`: "SkylakeX" (its AVX-512 kernels) at avx512 and above,
// "Haswell" (AVX2 + FMA) at avx2, where `chosen` is a core without AVX2
// kernels; nullptr otherwise (the choice stands). OpenBLAS releases older
// than the CPU take a generic core for it: Debian 12's 0.3.21 runs an
// Emerald Rapids Xeon (family 6, model 207) as "Prescott": SSE3 kernels,
// far slower than the AVX-512 ones, for every LibTorch matmul.
const char* openblas_core_override(const std::string& chosen, CpuIsa cpu);

}  // namespace fastattn::kernels

// ---- entry points ----------------------------------------------------------
// At the end of a kernel translation unit, after FASTATTN_ISA_END, one line per
// entry point declared in the kernel's header:
//   FASTATTN_CPU_KERNEL(full_attention_forward_cpu, FullAttentionForwardArgs)
// for `template <typename T> void name(const Args<T>&)` (T = float, double), or
//   FASTATTN_CPU_KERNEL_PLAIN(cluster_codes_cpu, ClusterParams)
// for `void name(const Params&)`. In the default-level compile it defines the
// public fastattn::kernels::name, which calls the active level's definition;
// in the others it instantiates that level's.
#define FASTATTN_CPU_KERNEL_DISPATCH_(call)                                             \
  switch (::fastattn::kernels::cpu_isa()) {                                             \
    case ::fastattn::kernels::CpuIsa::kAmx:                                             \
    case ::fastattn::kernels::CpuIsa::kAvx512Bf16:                                      \
    case ::fastattn::kernels::CpuIsa::kAvx512:                                          \
      if constexpr (::fastattn::kernels::kCompiledIsaMax >= 2) return isa_avx512::call; \
      [[fallthrough]];                                                                  \
    case ::fastattn::kernels::CpuIsa::kAvx2:                                            \
      if constexpr (::fastattn::kernels::kCompiledIsaMax >= 1) return isa_avx2::call;   \
      [[fallthrough]];                                                                  \
    default:                                                                            \
      return isa_default::call;                                                         \
  }

#if !defined(FASTATTN_ISA_LEVEL) || FASTATTN_ISA_LEVEL == 0
#define FASTATTN_CPU_KERNEL(name, Args)            \
  namespace fastattn::kernels {                    \
  namespace isa_default {                          \
  template void name<float>(const Args<float>&);   \
  template void name<double>(const Args<double>&); \
  }                                                \
  namespace isa_avx2 {                             \
  template <typename T>                            \
  void name(const Args<T>&);                       \
  }                                                \
  namespace isa_avx512 {                           \
  template <typename T>                            \
  void name(const Args<T>&);                       \
  }                                                \
  template <typename T>                            \
  void name(const Args<T>& args) {                 \
    FASTATTN_CPU_KERNEL_DISPATCH_(name<T>(args))   \
  }                                                \
  template void name<float>(const Args<float>&);   \
  template void name<double>(const Args<double>&); \
  }
// The same, for T = Bf16 (bfloat16 operands, float32 arithmetic) as well.
#define FASTATTN_CPU_KERNEL_WITH_BF16(name, Args) \
  FASTATTN_CPU_KERNEL(name, Args)                 \
  namespace fastattn::kernels {                   \
  namespace isa_default {                         \
  template void name<Bf16>(const Args<Bf16>&);    \
  }                                               \
  template void name<Bf16>(const Args<Bf16>&);    \
  }
#define FASTATTN_CPU_KERNEL_PLAIN(name, Params)                               \
  namespace fastattn::kernels {                                               \
  namespace isa_avx2 {                                                        \
  void name(const Params&);                                                   \
  }                                                                           \
  namespace isa_avx512 {                                                      \
  void name(const Params&);                                                   \
  }                                                                           \
  void name(const Params& args) { FASTATTN_CPU_KERNEL_DISPATCH_(name(args)) } \
  }
#else
#define FASTATTN_CPU_KERNEL(name, Args)            \
  namespace fastattn::kernels::FASTATTN_ISA_NS {   \
  template void name<float>(const Args<float>&);   \
  template void name<double>(const Args<double>&); \
  }
#define FASTATTN_CPU_KERNEL_WITH_BF16(name, Args) \
  FASTATTN_CPU_KERNEL(name, Args)                 \
  namespace fastattn::kernels::FASTATTN_ISA_NS {  \
  template void name<Bf16>(const Args<Bf16>&);    \
  }
#define FASTATTN_CPU_KERNEL_PLAIN(name, Params)
#endif
