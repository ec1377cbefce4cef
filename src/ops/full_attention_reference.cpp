// Plain-ATen oracle for full attention: materialises the (N,H,L,S) scores.
// Used only by tests and benchmarks (never on a hot path).
#include "fastattn/ops.h"
#include "kernels/common/dropout.h"
#include "ops/mask_util.h"
#include "ops/op_util.h"

namespace fastattn::reference {

torch::Tensor full_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             const std::optional<torch::Tensor>& attn_mask,
                             const std::optional<torch::Tensor>& key_lengths, bool causal,
                             std::optional<double> softmax_temp,
                             const std::optional<torch::Tensor>& dropout_keep) {
  const int64_t N = q.size(0), H = q.size(1), L = q.size(2), S = k.size(2), E = q.size(3);
  const double temp = softmax_temp.value_or(1.0 / std::sqrt(static_cast<double>(E)));
  auto scores = torch::matmul(q, k.transpose(-1, -2)) * temp;                        // (N,H,L,S)
  auto keep = ops::dense_keep(N, L, S, attn_mask, key_lengths, causal, q.device());  // (N,1,L,S)
  if (attn_mask && attn_mask->is_floating_point()) {
    scores = scores + ops::broadcast_mask(*attn_mask, N, H, L, S).to(scores.scalar_type());
  }
  scores = scores.masked_fill(keep.logical_not(), -std::numeric_limits<double>::infinity());
  // Rows with no kept key: softmax gives NaN; the contract says zeros.
  auto any = keep.any(-1, /*keepdim=*/true);
  auto probs = torch::softmax(scores, -1).masked_fill(any.logical_not(), 0.0);
  if (dropout_keep) probs = probs * dropout_keep->to(probs.scalar_type());
  return torch::matmul(probs, v);
}

torch::Tensor attention_dropout_keep(int64_t seed, double dropout_p, int64_t N, int64_t H,
                                     int64_t L, int64_t S) {
  const uint32_t threshold = kernels::dropout_threshold(dropout_p);
  const double scale = 1.0 / (1.0 - dropout_p);
  auto out = torch::empty({N, H, L, S}, torch::kDouble);
  auto a = out.accessor<double, 4>();
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < L; ++i) {
        const uint64_t key = kernels::dropout_row_key(static_cast<uint64_t>(seed), n * H + h, i);
        for (int64_t j = 0; j < S; ++j)
          a[n][h][i][j] = kernels::dropout_bits(key, j) >= threshold ? scale : 0.0;
      }
  return out;
}

}  // namespace fastattn::reference
