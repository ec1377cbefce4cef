// Plain-ATen oracle for block_sparse_attention: the pattern as a dense
// (H, L, S) boolean mask, then a dense masked softmax. Used only by tests and
// benchmarks (never on a hot path).
#include "fastattn/ops.h"
#include "ops/block_sparse_pattern.h"

namespace fastattn::reference {

torch::Tensor block_sparse_mask(const std::string& pattern, const std::vector<int64_t>& params,
                                bool causal, int64_t H, int64_t L, int64_t S) {
  const int kind = ops::check_sparse_pattern("reference::block_sparse_mask", pattern, params, H);
  auto opts = torch::TensorOptions().dtype(torch::kLong);
  auto p = torch::arange(L, opts).view({L, 1}) + (S - L);  // query positions
  auto j = torch::arange(S, opts).view({1, S});
  auto d = j - p;  // (L, S)
  auto past = d <= 0;
  if (kind == 0) {  // local
    const int64_t w = params[0];
    auto keep = causal ? (d >= -(w - 1)) & past : (d >= -(w / 2)) & (d <= w - 1 - w / 2);
    return keep.unsqueeze(0).expand({H, L, S}).contiguous();
  }
  if (kind == 3) {  // window: offsets [-left, right], causal: and <= 0
    auto keep = (d >= -params[0]) & (d <= params[1]);
    if (causal) keep = keep & past;
    return keep.unsqueeze(0).expand({H, L, S}).contiguous();
  }
  const int64_t l = params[0];
  const bool fixed = kind == 2;
  const int64_t which = fixed ? params[2] : params[1];
  std::vector<torch::Tensor> a1s, a2s;
  for (int64_t h = 0; h < H; ++h) {
    torch::Tensor a1, a2;
    if (fixed) {
      const int64_t c = params[1];
      const int64_t groups = std::max<int64_t>(1, l / c);
      const int64_t g = params[3] ? h % groups : 0;
      const int64_t hi = l - c * g, lo = hi - c;
      a1 = torch::div(p, l, "floor") == torch::div(j, l, "floor");
      auto res = torch::remainder(j, l);
      a2 = ((res >= lo) & (res < hi)).expand({L, S});
    } else {
      a1 = causal ? (d >= -l) : (d.abs() <= l);
      a2 = torch::remainder(d, l) == 0;
    }
    if (causal) {
      a1 = a1 & past;
      a2 = a2 & past;
    }
    a1s.push_back(a1);
    a2s.push_back(a2);
  }
  std::vector<torch::Tensor> heads;
  for (int64_t h = 0; h < H; ++h) {
    switch (which) {
      case 0:
        heads.push_back(a1s[h] | a2s[h]);
        break;
      case 1:
        heads.push_back(a1s[h]);
        break;
      case 2:
        heads.push_back(a2s[h]);
        break;
      default:
        heads.push_back(h < (H + 1) / 2 ? a1s[h] : a2s[h]);
        break;
    }
  }
  return torch::stack(heads);
}

torch::Tensor block_sparse_attention(const torch::Tensor& q, const torch::Tensor& k,
                                     const torch::Tensor& v, const std::string& pattern,
                                     const std::vector<int64_t>& params,
                                     const std::optional<torch::Tensor>& key_lengths, bool causal,
                                     std::optional<double> softmax_temp,
                                     const std::optional<torch::Tensor>& dropout_keep) {
  const int64_t N = q.size(0), H = q.size(1), L = q.size(2), S = k.size(2);
  auto keep = block_sparse_mask(pattern, params, causal, H, L, S).to(q.device());
  return full_attention(q, k, v, keep.unsqueeze(0).expand({N, H, L, S}), key_lengths, false,
                        softmax_temp, dropout_keep);
}

}  // namespace fastattn::reference
