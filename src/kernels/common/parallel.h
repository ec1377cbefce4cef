// Parallel loops for the kernels (OpenMP, the same runtime LibTorch uses on
// Debian; the op layer passes at::get_num_threads()).
#pragma once

#include <cstdint>

#include <omp.h>

namespace fastattn::kernels {

// Calls init(thread_scratch&) once per thread, then body(item, scratch) for
// every item in [0, n), dynamically scheduled (work items may differ in cost,
// e.g. causal tiles).
template <typename Scratch, typename Init, typename Body>
void parallel_items(int64_t n, int num_threads, Init init, Body body) {
  if (n <= 0) return;
  if (num_threads < 1) num_threads = 1;
  if (n < num_threads) num_threads = static_cast<int>(n);
#pragma omp parallel num_threads(num_threads)
  {
    Scratch scratch;
    init(scratch);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) body(i, scratch);
  }
}

}  // namespace fastattn::kernels
