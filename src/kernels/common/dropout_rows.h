// The kernels' attention-dropout loops over a row of weights
// (kernels/common/dropout.h has the generator): inside the instruction-set
// region, so that each level's kernels get them vectorised (outside it they
// were compiled for the baseline, without 32-bit vector multiplies, and ran
// scalar; docs/benchmarks.md, "Attention dropout fused in the softmax types
// (issue 64)").
#pragma once

#include <cstdint>

#include "kernels/common/dropout.h"
#include "kernels/common/isa_target.h"

FASTATTN_ISA_BEGIN

// out[c] = row[c] · (kept ? scale : 0): the dropped weights beside the
// undropped ones (the backward needs both).
template <typename T>
inline void dropped_copy(const T* row, int64_t cols, uint64_t row_key, int64_t j0,
                         uint32_t threshold, T scale, T* out) {
  const uint32_t lo = static_cast<uint32_t>(row_key), hi = static_cast<uint32_t>(row_key >> 32);
  const uint32_t base = static_cast<uint32_t>(j0) + lo;
  const int32_t t = dropout_signed(threshold);
  for (int64_t c = 0; c < cols; ++c) {
    const uint32_t u = dropout_hash32(dropout_hash32(base + static_cast<uint32_t>(c)) ^ hi);
    // kept as an int32 first: static_cast<T>(bool) left the loop scalar (GCC 12)
    const int32_t kept = dropout_signed(u) >= t;
    out[c] = row[c] * (static_cast<T>(kept) * scale);
  }
}

// dropped_copy for columns whose key indices are keys[c] (a kernel's own
// key order: a block-sparse part's residue-major or summary order).
template <typename T>
inline void dropped_copy_at(const T* row, int64_t cols, uint64_t row_key, const int64_t* keys,
                            uint32_t threshold, T scale, T* out) {
  const uint32_t lo = static_cast<uint32_t>(row_key), hi = static_cast<uint32_t>(row_key >> 32);
  const int32_t t = dropout_signed(threshold);
  for (int64_t c = 0; c < cols; ++c) {
    const uint32_t u = dropout_hash32(dropout_hash32(static_cast<uint32_t>(keys[c]) + lo) ^ hi);
    const int32_t kept = dropout_signed(u) >= t;
    out[c] = row[c] * (static_cast<T>(kept) * scale);
  }
}

// In place: row[c] *= (kept ? scale : 0), the forward's dropped weights.
template <typename T>
inline void apply_dropout(T* row, int64_t cols, uint64_t row_key, int64_t j0, uint32_t threshold,
                          T scale) {
  dropped_copy(row, cols, row_key, j0, threshold, scale, row);
}

FASTATTN_ISA_END
