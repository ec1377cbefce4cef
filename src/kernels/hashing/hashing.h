// Sign-of-random-projection hashing of queries (clustered attention, Vyas et
// al. 2020, sec. 3.2.2): bit b of a query's code is 1 iff x·w_b + bias_b > 0,
// B planes, 1 <= B <= 64 (bit 63 uses the full unsigned range; codes are
// stored in int64 with the same bit pattern).
//
// Cost: N·H·L·B·E multiply-adds, O(B·E) extra memory.
// Tested by tests/cpp/test_clustering.cpp (HashQueries.*); timed inside
// bench/bench_clustered_attention.cpp.
#pragma once

#include <cstdint>

#include "kernels/common/kernel_args.h"

namespace fastattn::kernels {

// The arguments of both backends (kernels/common/kernel_args.h): T = float or
// double for the CPU kernel below, void for the CUDA launcher
// (hash_queries_cuda.h), which takes contiguous rows only.
template <typename T>
struct HashParams {
  const T* x = nullptr;       // (N, H, L, E), rows at x_rows: rows = N·H·L
  const T* planes = nullptr;  // (B, E + 1) contiguous: w_b = planes[b, :E], bias_b = planes[b, E]
  int64_t* codes = nullptr;   // (rows,) contiguous, written: bit b = x·w_b + bias_b > 0
  int64_t rows = 0, E = 0;
  // CPU. Default: the rows follow one another. Otherwise row (n, h, l) = r
  // of x at x_rows (kernels/common/rows.h), r = (n·H + h)·L + l.
  RowStrides x_rows;
  int64_t H = 1, L = 1;
  int B = 0;                      // bits, in [1, 64]
  int num_threads = 1;            // CPU
  DType dtype = DType::kFloat32;  // CUDA: the element type of the void pointers
};

template <typename T>
void hash_queries_cpu(const HashParams<T>& p);

}  // namespace fastattn::kernels
