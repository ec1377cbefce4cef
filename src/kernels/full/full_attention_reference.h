// The plain reference of the fused softmax attention kernels
// (full_attention.h): scalar loops over the same argument structs, in
// float64, on one thread, one query row at a time with its whole score row
// (no tiles, no online softmax; kernels/common/softmax_reference.h), the
// additive mask, key lengths, causal alignment, the fused dropout's keep mask
// and the top-k keys. tests/cpp/test_kernel_references.cpp holds the CPU
// kernels at every instruction-set level to it, tests/cuda_emu/test_full.cpp
// the CUDA kernels. (src/ops/full_attention_reference.cpp is the operator's
// reference over tensors; this one is the kernels'.)
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

#include "kernels/common/softmax_reference.h"
#include "kernels/full/full_attention.h"

namespace fastattn::kernels {

namespace full_attention_detail {

// The scaled, masked scores of query i (-inf where a key is not kept).
inline std::vector<double> scores(const FullAttentionParams<double>& a, int64_t nh, int64_t i) {
  const int64_t n = nh / a.H, h = nh % a.H;
  const int64_t len = a.key_lengths ? a.key_lengths[n] : a.S;
  std::vector<double> s(a.S, -std::numeric_limits<double>::infinity());
  const double* q = a.q_rows.row(a.q, nh, a.H, i);
  for (int64_t j = 0; j < a.S; ++j) {
    if (j >= len || (a.causal && j > i + a.S - a.L)) continue;
    s[j] = a.scale * reference::dot(q, a.k_rows.row(a.k, nh, a.H, j), a.E) +
           (a.mask ? a.mask[n * a.mask_sn + h * a.mask_sh + i * a.mask_sl + j] : 0.0);
  }
  return s;
}

}  // namespace full_attention_detail

// out_i = Σ_j softmax(s_i)_j z_ij v_j (zeros without a kept key), lse_i =
// log Σ_j exp(s_ij) (-inf without one); top_idx where asked: by descending
// score, ties to the lower index, the unkept keys last in increasing index.
inline void full_attention_forward_reference(const FullAttentionForwardArgs<double>& args) {
  auto a = args;
  resolve_qkv_rows(a);
  auto scores = [&](int64_t nh, int64_t i) { return full_attention_detail::scores(a, nh, i); };
  reference::softmax_attention_forward(a, scores, a.out, a.out_rows.resolved(a.H, a.L, a.M), a.lse);
  if (a.topk == 0) return;
  for (int64_t nh = 0; nh < a.N * a.H; ++nh)
    for (int64_t i = 0; i < a.L; ++i) {
      const auto s = scores(nh, i);
      std::vector<int64_t> order(a.S);
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) {
        const bool kx = !std::isinf(s[x]), ky = !std::isinf(s[y]);
        if (kx != ky) return kx;
        return kx && s[x] > s[y];
      });
      std::copy_n(order.begin(), a.topk, a.top_idx + (nh * a.L + i) * a.topk);
    }
}

// The gradients from the given lse and delta (softmax_attention_backward),
// written or, with accumulate, added.
inline void full_attention_backward_reference(const FullAttentionBackwardArgs<double>& args) {
  auto a = args;
  resolve_qkv_rows(a);
  resolve_grad_rows(a);
  auto scores = [&](int64_t nh, int64_t i) { return full_attention_detail::scores(a, nh, i); };
  reference::softmax_attention_backward(a, scores, a.scale, a.accumulate);
}

}  // namespace fastattn::kernels
