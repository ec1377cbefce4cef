// The plain reference of the block-sparse kernels (block_sparse_attention.h):
// scalar loops over the same argument structs, in float64, on one thread.
// Each key is tested against each of the head's parts by the parts'
// definitions (no orders, ranges or tiles), and the kept keys of a query take
// one softmax, with the fused dropout's keep mask (as full attention's:
// kernels/common/softmax_reference.h). tests/cpp/test_kernel_references.cpp holds the
// CPU kernels at every instruction-set level to it. (The operator's reference
// over tensors is src/ops/block_sparse_reference.cpp.)
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "kernels/block_sparse/block_sparse_attention.h"
#include "kernels/common/softmax_reference.h"

namespace fastattn::kernels {

namespace block_sparse_detail {

inline int64_t floor_div(int64_t a, int64_t b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }

// Whether part `pt` of head h keeps key j for the query at key position p.
inline bool part_keeps(const SparsePart& pt, int64_t h, int64_t p, int64_t j) {
  if (h < pt.head_begin || h >= pt.head_end) return false;
  const int64_t l = pt.stride;
  if (pt.kind == SparsePartKind::Band) return j - p >= pt.lo && j - p <= pt.hi;
  if (pt.causal && j > p) return false;
  switch (pt.kind) {
    case SparsePartKind::SameBlock:
      return floor_div(j, l) == floor_div(p, l);
    case SparsePartKind::Residue:
      return (j - p) % l == 0 && !(pt.exclude && std::abs(j - p) <= l);
    case SparsePartKind::Summary: {
      const int64_t group = pt.per_head ? h % std::max<int64_t>(1, l / pt.summary) : 0;
      const int64_t hi = l - pt.summary * group, lo = hi - pt.summary;
      return j % l >= lo && j % l < hi && !(pt.exclude && floor_div(j, l) == floor_div(p, l));
    }
    default:
      return false;
  }
}

// The scaled scores of query i (-inf where no part keeps the key, or past
// the key length).
inline std::vector<double> scores(const BlockSparseParams<double>& a, int64_t nh, int64_t i) {
  const int64_t h = nh % a.H, len = a.key_lengths ? a.key_lengths[nh / a.H] : a.S;
  const int64_t p = i + a.S - a.L;
  std::vector<double> s(a.S, -std::numeric_limits<double>::infinity());
  const double* q = a.q_rows.row(a.q, nh, a.H, i);
  for (int64_t j = 0; j < std::min(len, a.S); ++j) {
    bool kept = false;
    for (int x = 0; x < a.num_parts; ++x) kept = kept || part_keeps(a.parts[x], h, p, j);
    if (!kept) continue;
    s[j] = a.scale * reference::dot(q, a.k_rows.row(a.k, nh, a.H, j), a.E);
  }
  return s;
}

}  // namespace block_sparse_detail

// Softmax attention over the kept keys (softmax_attention_forward).
inline void block_sparse_attention_forward_reference(const BlockSparseForwardArgs<double>& args) {
  auto a = args;
  resolve_qkv_rows(a);
  auto scores = [&](int64_t nh, int64_t i) { return block_sparse_detail::scores(a, nh, i); };
  reference::softmax_attention_forward(a, scores, a.out, a.out_rows.resolved(a.H, a.L, a.M), a.lse);
}

// Its gradients from the given lse and delta (softmax_attention_backward).
inline void block_sparse_attention_backward_reference(const BlockSparseBackwardArgs<double>& args) {
  auto a = args;
  resolve_qkv_rows(a);
  resolve_grad_rows(a);
  auto scores = [&](int64_t nh, int64_t i) { return block_sparse_detail::scores(a, nh, i); };
  reference::softmax_attention_backward(a, scores, a.scale, /*accumulate=*/false);
}

}  // namespace fastattn::kernels
