// The instruction-set region of a CPU kernel translation unit. Each kernel
// source (*_cpu.cpp) is compiled once per level (FASTATTN_ISA_LEVEL = 0, 1,
// 2; see kernels/common/cpu_isa.h), the bfloat16 sources (*_bf16.cpp) at
// levels 3 and 4 only; its code sits between FASTATTN_ISA_BEGIN and
// FASTATTN_ISA_END, which open the level's namespace
// (fastattn::kernels::isa_default, isa_avx2, isa_avx512, isa_avx512_bf16,
// isa_amx) and, above the
// default level, a `#pragma GCC target` region (clang: `#pragma clang
// attribute`) enabling the level's instructions for the functions defined in
// it.
//
// Why a region and not -mavx512f on the command line: inline functions and
// templates of the standard library instantiated in a translation unit are
// emitted as weak symbols, and the linker keeps one copy per name; one built
// with -mavx512f could be the copy every caller gets, and fault on a CPU
// without AVX-512. Here the standard headers are included (below) before the
// region, so their functions keep the baseline target, and everything compiled
// for a level is named in that level's namespace. tests/cpp/check_isa_symbols.sh
// checks the built objects for leaks.
//
// The headers of kernels/common/ that hold vector code (simd.h, gemm.h,
// softmax_rows.h, parallel.h, feature_maps/elu.h) wrap themselves in the
// region; a kernel source includes them, then writes its own code inside
// FASTATTN_ISA_BEGIN ... FASTATTN_ISA_END.
#pragma once

// Every standard header the kernels use, compiled before any target region.
#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <numeric>
#include <stdexcept>
#include <type_traits>
#include <utility>
#include <vector>

#include <omp.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "kernels/common/cpu_isa.h"

#ifndef FASTATTN_ISA_LEVEL
#error \
    "FASTATTN_ISA_LEVEL is not set: CPU kernel sources are compiled through CMakeLists.txt's per-level targets"
#endif

// A _Pragma takes one string literal, not a concatenation: no reflowing.
// clang-format off
#if FASTATTN_ISA_LEVEL == 0
#define FASTATTN_ISA_NS isa_default
#define FASTATTN_ISA_PUSH_
#define FASTATTN_ISA_POP_
#elif FASTATTN_ISA_LEVEL == 1
#define FASTATTN_ISA_NS isa_avx2
#define FASTATTN_SIMD_AVX2 1
#if defined(__clang__)
#define FASTATTN_ISA_PUSH_ _Pragma("clang attribute push(__attribute__((target(\"avx2,fma,bmi,bmi2,popcnt\"))), apply_to = function)")
#else
#define FASTATTN_ISA_PUSH_ \
  _Pragma("GCC push_options") _Pragma("GCC target(\"avx2,fma,bmi,bmi2,popcnt\")")
#endif
#elif FASTATTN_ISA_LEVEL == 2
#define FASTATTN_ISA_NS isa_avx512
#define FASTATTN_SIMD_AVX2 1
#define FASTATTN_SIMD_AVX512 1
#if defined(__clang__)
#define FASTATTN_ISA_PUSH_ _Pragma("clang attribute push(__attribute__((target(\"avx2,fma,bmi,bmi2,popcnt,avx512f,avx512bw,avx512dq,avx512vl,avx512cd\"))), apply_to = function)")
#else
#define FASTATTN_ISA_PUSH_             \
  _Pragma("GCC push_options") _Pragma( \
      "GCC target(\"avx2,fma,bmi,bmi2,popcnt,avx512f,avx512bw,avx512dq,avx512vl,avx512cd\")")
#endif
#elif FASTATTN_ISA_LEVEL == 3
#define FASTATTN_ISA_NS isa_avx512_bf16
#define FASTATTN_SIMD_AVX2 1
#define FASTATTN_SIMD_AVX512 1
#if defined(__clang__)
#define FASTATTN_ISA_PUSH_ _Pragma("clang attribute push(__attribute__((target(\"avx2,fma,bmi,bmi2,popcnt,avx512f,avx512bw,avx512dq,avx512vl,avx512cd,avx512bf16\"))), apply_to = function)")
#else
#define FASTATTN_ISA_PUSH_             \
  _Pragma("GCC push_options") _Pragma( \
      "GCC target(\"avx2,fma,bmi,bmi2,popcnt,avx512f,avx512bw,avx512dq,avx512vl,avx512cd,avx512bf16\")")
#endif
#elif FASTATTN_ISA_LEVEL == 4
#define FASTATTN_ISA_NS isa_amx
#define FASTATTN_SIMD_AVX2 1
#define FASTATTN_SIMD_AVX512 1
#if defined(__clang__)
#define FASTATTN_ISA_PUSH_ _Pragma("clang attribute push(__attribute__((target(\"avx2,fma,bmi,bmi2,popcnt,avx512f,avx512bw,avx512dq,avx512vl,avx512cd,avx512bf16,amx-tile,amx-bf16\"))), apply_to = function)")
#else
#define FASTATTN_ISA_PUSH_             \
  _Pragma("GCC push_options") _Pragma( \
      "GCC target(\"avx2,fma,bmi,bmi2,popcnt,avx512f,avx512bw,avx512dq,avx512vl,avx512cd,avx512bf16,amx-tile,amx-bf16\")")
#endif
#else
#error "FASTATTN_ISA_LEVEL must be 0 (default), 1 (avx2), 2 (avx512), 3 (avx512_bf16) or 4 (amx)"
#endif
// clang-format on

#if FASTATTN_ISA_LEVEL > 0
#if defined(__clang__)
#define FASTATTN_ISA_POP_ _Pragma("clang attribute pop")
#else
#define FASTATTN_ISA_POP_ _Pragma("GCC pop_options")
#endif
#endif

#define FASTATTN_ISA_BEGIN FASTATTN_ISA_PUSH_ namespace fastattn::kernels::FASTATTN_ISA_NS {
#define FASTATTN_ISA_END \
  }                      \
  FASTATTN_ISA_POP_
