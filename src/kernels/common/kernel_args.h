// Argument structs shared by an operator's CPU and CUDA launchers. An op's
// kernel header (kernels/<op>/<op>.h) defines its structs once, as templates
// over the element type T: the CPU kernels take them with T = float or
// double (typed pointers and scalars, row layouts of kernels/common/rows.h),
// the CUDA launchers (kernels/<op>/<op>_cuda.h) with T = void (untyped
// pointers whose element type is the struct's `dtype`, float32 scalars and
// float32 statistics). The ops layer fills them in one place for both
// (src/ops/<op>_args.h). Fields that one backend alone reads say which.
#pragma once

#include <type_traits>

#include "kernels/common/cuda_dtype.h"
#include "kernels/common/rows.h"

namespace fastattn::kernels {

// A kernel's scalars and float-only buffers: T on the CPU, float32 on CUDA.
template <typename T>
using KernelScalar = std::conditional_t<std::is_void_v<T>, float, T>;

using cuda::DType;

}  // namespace fastattn::kernels
