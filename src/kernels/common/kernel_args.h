// Argument structs shared by an operator's CPU and CUDA launchers. An op's
// kernel header (kernels/<op>/<op>.h) defines its structs once, as templates
// over the element type T: the CPU kernels take them with T = float or
// double (typed pointers and scalars, row layouts of kernels/common/rows.h),
// the CUDA launchers (kernels/<op>/<op>_cuda.h) with T = void (untyped
// pointers whose element type is the struct's `dtype`, float32 scalars and
// float32 statistics). The ops layer fills them in one place for both
// (src/ops/<op>_args.h). Fields that one backend alone reads say which.
#pragma once

#include <cstdint>
#include <type_traits>

#include "kernels/common/cuda_dtype.h"
#include "kernels/common/rows.h"

namespace fastattn::kernels {

// A bfloat16 element (its bits) of the CPU kernels that take bfloat16
// operands as they are (the AMX ones: kernels/common/cpu_isa.h).
struct Bf16 {
  uint16_t bits;
};

// A kernel's scalars and float-only buffers: T on the CPU, float32 on CUDA
// and for bfloat16 operands.
template <typename T>
using KernelScalar = std::conditional_t<std::is_void_v<T> || std::is_same_v<T, Bf16>, float, T>;

using cuda::DType;

// The operands and sizes every kernel of attention over q (N, H, L, E), k
// (N, H, S, E), v (N, H, S, M) takes, which an op's params struct derives
// from. The CPU kernels read the rows at their row strides (the layers'
// (N, L, H, E) views in place); the CUDA ones take contiguous operands only.
template <typename T>
struct QKVParams {
  const T* q = nullptr;                  // (N, H, L, E), rows at q_rows
  const T* k = nullptr;                  // (N, H, S, E), rows at k_rows
  const T* v = nullptr;                  // (N, H, S, M), rows at v_rows
  RowStrides q_rows, k_rows, v_rows;     // CPU; default: contiguous
  const int64_t* key_lengths = nullptr;  // (N,) in [0, S] on q's device, or nullptr for S
  int64_t N = 0, H = 0, L = 0, S = 0, E = 0, M = 0;
  int num_threads = 1;            // CPU
  DType dtype = DType::kFloat32;  // CUDA: the element type of the void pointers
};

}  // namespace fastattn::kernels
