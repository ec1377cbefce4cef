// The row layout of a kernel operand (N, H, R, C) whose rows are contiguous
// but need not follow one another: row r of head (n, h) starts
// n·sn + h·sh + r·sr elements after the data pointer. The transformer layers
// and fast-transformers' (N, L, H, E) tensors viewed as (N, H, L, E) have
// sr = H·E and sh = E; kernels that take a RowStrides read them in place
// instead of the op layer copying them to the contiguous layout (such copies
// into fresh buffers took longer than linear attention itself; git show
// 5f604de:docs/benchmarks.md, "Against fast-transformers, the bounds per
// type, and bfloat16"). Inputs may use any strides >= 0 (0 on a broadcast
// dim); outputs must not overlap.
#pragma once

#include <algorithm>
#include <cstdint>

namespace fastattn::kernels {

struct RowStrides {
  // Negative (the default): the contiguous layout, resolved() fills it in.
  int64_t sn = -1, sh = -1, sr = -1;

  // These strides, or the contiguous ones of H heads of R rows of C entries.
  RowStrides resolved(int64_t H, int64_t R, int64_t C) const {
    return sr >= 0 ? *this : RowStrides{H * R * C, R * C, C};
  }
  // The first row of head nh = n·H + h.
  template <typename T>
  T* head(T* data, int64_t nh, int64_t H) const {
    return data + (nh / H) * sn + (nh % H) * sh;
  }
  // Row r of head nh.
  template <typename T>
  T* row(T* data, int64_t nh, int64_t H, int64_t r) const {
    return head(data, nh, H) + r * sr;
  }
};

// The q_rows, k_rows and v_rows of a kernel's parameters (with H, L, S, E, M
// fields) left at their defaults made explicit.
template <typename Params>
void resolve_qkv_rows(Params& p) {
  p.q_rows = p.q_rows.resolved(p.H, p.L, p.E);
  p.k_rows = p.k_rows.resolved(p.H, p.S, p.E);
  p.v_rows = p.v_rows.resolved(p.H, p.S, p.M);
}

// The grad_out_rows, grad_q_rows, grad_k_rows and grad_v_rows of a backward
// kernel's parameters (fields as above) left at their defaults made explicit.
template <typename Params>
void resolve_grad_rows(Params& p) {
  p.grad_out_rows = p.grad_out_rows.resolved(p.H, p.L, p.M);
  p.grad_q_rows = p.grad_q_rows.resolved(p.H, p.L, p.E);
  p.grad_k_rows = p.grad_k_rows.resolved(p.H, p.S, p.E);
  p.grad_v_rows = p.grad_v_rows.resolved(p.H, p.S, p.M);
}

// Zeroes rows x cols values, rows ld apart.
template <typename T>
void zero_rows(T* x, int64_t rows, int64_t cols, int64_t ld) {
  if (ld == cols) {
    std::fill(x, x + rows * cols, T{});
  } else {
    for (int64_t r = 0; r < rows; ++r) std::fill(x + r * ld, x + r * ld + cols, T{});
  }
}

// Sets `rows` rows of `cols` entries of every head of x (layout s) to zero.
// Zeroes the rows [max(t·tile, len), min((t + 1)·tile, S)) of head nh's
// grad_k and (when not null) grad_v for the key tiles t = split,
// split + splits, ...: the rows past a key length that a backward work item
// owns but never visits.
template <typename Args>
void zero_key_grads_past(const Args& a, int64_t nh, int64_t len, int64_t tile, int64_t split,
                         int64_t splits) {
  for (int64_t t = split; t * tile < a.S; t += splits) {
    const int64_t j0 = std::max(t * tile, len), j1 = std::min((t + 1) * tile, a.S);
    if (j0 >= j1) continue;
    zero_rows(a.grad_k_rows.head(a.grad_k, nh, a.H) + j0 * a.grad_k_rows.sr, j1 - j0, a.E,
              a.grad_k_rows.sr);
    if (a.grad_v)
      zero_rows(a.grad_v_rows.head(a.grad_v, nh, a.H) + j0 * a.grad_v_rows.sr, j1 - j0, a.M,
                a.grad_v_rows.sr);
  }
}

template <typename T>
void zero_all_rows(T* x, const RowStrides& s, int64_t NH, int64_t H, int64_t rows, int64_t cols) {
  for (int64_t nh = 0; nh < NH; ++nh) zero_rows(s.head(x, nh, H), rows, cols, s.sr);
}

// Asks for `rows` rows of `cols` entries, ld apart, to be brought towards
// the core ahead of their use (`write`: the rows will be stored to). Rows
// that do not follow one another (the layers' views, ld = H·E: 256-byte rows
// 2 KiB apart at H = 8, E = 64) are not followed by the hardware
// prefetcher; contiguous rows are, and are left to it.
template <typename T>
void prefetch_rows(const T* x, int64_t rows, int64_t cols, int64_t ld, bool write = false) {
  if (ld == cols) return;
  const int64_t bytes = cols * static_cast<int64_t>(sizeof(T));
  for (int64_t r = 0; r < rows; ++r) {
    const char* row = reinterpret_cast<const char*>(x + r * ld);
    for (int64_t b = 0; b < bytes; b += 64) {
      if (write) {
        __builtin_prefetch(row + b, 1, 2);
      } else {
        __builtin_prefetch(row + b, 0, 2);
      }
    }
  }
}

// In a pass over rows 0..L-1 of x (ld apart), at row l: the row kRowsAhead
// further, whose latency the rows in between then hide.
template <typename T>
void prefetch_ahead(const T* x, int64_t l, int64_t L, int64_t cols, int64_t ld,
                    bool write = false) {
  constexpr int64_t kRowsAhead = 16;
  if (l + kRowsAhead < L) prefetch_rows(x + (l + kRowsAhead) * ld, 1, cols, ld, write);
}

// The same for rows idx[0..n) of x (rows sr apart): rows in an order of
// their own (Reformer's buckets), which no hardware prefetcher foresees, for
// the next piece of work while this one computes. (A prefetch_row helper
// shared with prefetch_rows, otherwise the same code, made the linear
// attention forward on the layers' views slower; git show
// 5f604de:docs/benchmarks.md, "Local and Reformer past 10x".)
template <typename T>
void prefetch_indexed_rows(const T* x, int64_t sr, const int64_t* idx, int64_t n, int64_t cols,
                           bool write = false) {
  const int64_t bytes = cols * static_cast<int64_t>(sizeof(T));
  for (int64_t r = 0; r < n; ++r) {
    const char* row = reinterpret_cast<const char*>(x + idx[r] * sr);
    for (int64_t b = 0; b < bytes; b += 64) {
      if (write) {
        __builtin_prefetch(row + b, 1, 2);
      } else {
        __builtin_prefetch(row + b, 0, 2);
      }
    }
  }
}

}  // namespace fastattn::kernels
