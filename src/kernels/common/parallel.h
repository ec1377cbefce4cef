// Parallel loops for the kernels (OpenMP, the same runtime LibTorch uses on
// Debian; the op layer passes at::get_num_threads()).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>

#include <omp.h>

#include "kernels/common/isa_target.h"
#include "kernels/common/rows.h"

FASTATTN_ISA_BEGIN

// Calls init(thread_scratch&) once per thread, then body(item, scratch) for
// every item in [0, n), dynamically scheduled (work items may differ in cost,
// e.g. causal tiles).
//
// An exception thrown by init or body (std::bad_alloc from a scratch buffer,
// a check) must not leave the OpenMP region, where it would end the process
// (std::terminate): the first one is kept, the remaining items are skipped,
// and it is rethrown on the calling thread once every thread has finished.
template <typename Scratch, typename Init, typename Body>
void parallel_items(int64_t n, int num_threads, Init init, Body body) {
  if (n <= 0) return;
  if (num_threads < 1) num_threads = 1;
  if (n < num_threads) num_threads = static_cast<int>(n);
  std::exception_ptr error;
  std::atomic<bool> failed{false};
  auto record = [&] {
#pragma omp critical(fastattn_parallel_items_error)
    {
      if (!error) error = std::current_exception();
    }
    failed.store(true, std::memory_order_relaxed);
  };
#pragma omp parallel num_threads(num_threads)
  {
    Scratch scratch;
    try {
      init(scratch);
    } catch (...) {
      record();
    }
    // Every thread reaches the worksharing loop (OpenMP requires it), even
    // one whose init failed; nothing runs once anything has failed.
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) {
      if (failed.load(std::memory_order_relaxed)) continue;
      try {
        body(i, scratch);
      } catch (...) {
        record();
      }
    }
  }
  if (error) std::rethrow_exception(error);
}

// parallel_items without per-thread scratch: body(item) for every item in
// [0, n).
template <typename Body>
void parallel_for_items(int64_t n, int num_threads, Body body) {
  struct None {};
  parallel_items<None>(
      n, num_threads, [](None&) {}, [&](int64_t i, None&) { body(i); });
}

// zero_all_rows (rows.h) split between the threads: zeroing a gradient or
// output on one thread first (the first touch of a fresh allocation's pages)
// left the other threads waiting, a large part of a backward whose own work
// is small (full attention's with 100 queries over 16384 keys).
template <typename T>
void zero_all_rows_parallel(T* x, const RowStrides& s, int64_t NH, int64_t H, int64_t rows,
                            int64_t cols, int num_threads) {
  constexpr int64_t kSerialValues = int64_t{1} << 16;
  if (num_threads <= 1 || NH * rows * cols <= kSerialValues) {
    zero_all_rows(x, s, NH, H, rows, cols);
    return;
  }
  // A few pieces per thread, each a run of one head's rows.
  const int64_t pieces = std::clamp<int64_t>((4 * num_threads + NH - 1) / NH, 1, rows);
  const int64_t piece_rows = (rows + pieces - 1) / pieces;
  parallel_for_items(NH * pieces, num_threads, [&](int64_t item) {
    const int64_t r0 = item % pieces * piece_rows;
    if (r0 >= rows) return;
    zero_rows(s.head(x, item / pieces, H) + r0 * s.sr, std::min(piece_rows, rows - r0), cols, s.sr);
  });
}

FASTATTN_ISA_END
