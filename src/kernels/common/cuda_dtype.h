// The storage dtypes of fastattn's CUDA kernels, as the launchers' parameter
// structs name them (plain C++: the op layer includes it without CUDA headers).
#pragma once

namespace fastattn::cuda {

enum class DType { kFloat32, kFloat16, kBFloat16 };

// Bytes per element.
constexpr int dtype_size(DType d) { return d == DType::kFloat32 ? 4 : 2; }

}  // namespace fastattn::cuda
