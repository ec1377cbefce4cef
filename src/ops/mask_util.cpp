#include "ops/mask_util.h"

#include <sstream>

#include "ops/op_util.h"

namespace fastattn::ops {

namespace {
std::string shape_str(const torch::Tensor& t) {
  std::ostringstream os;
  os << t.sizes();
  return os.str();
}
}  // namespace

void check_masks(const char* op, const torch::Tensor& q, int64_t S,
                 const std::optional<torch::Tensor>& attn_mask,
                 const std::optional<torch::Tensor>& key_lengths) {
  const int64_t N = q.size(0), H = q.size(1), L = q.size(2);
  if (attn_mask) {
    const auto& m = *attn_mask;
    TORCH_CHECK(m.scalar_type() == torch::kBool || m.is_floating_point(), op,
                ": attn_mask must be bool (true = keep) or floating (additive), got ",
                m.scalar_type());
    TORCH_CHECK(m.device() == q.device(), op, ": attn_mask must be on ", q.device(), ", got ",
                m.device());
    const auto d = m.dim();
    bool ok = d >= 2 && d <= 4 && m.size(-2) == L && m.size(-1) == S;
    if (ok && d >= 3) ok = m.size(0) == N || m.size(0) == 1;
    if (ok && d == 4) ok = m.size(1) == H || m.size(1) == 1;
    TORCH_CHECK(ok, op, ": attn_mask must have shape (L, S), (N, L, S) or (N, H, L, S) = (", L,
                ", ", S, "), (", N, ", ", L, ", ", S, ") or (", N, ", ", H, ", ", L, ", ", S,
                "), got ", shape_str(m));
  }
  if (key_lengths) {
    const auto& kl = *key_lengths;
    TORCH_CHECK(!kl.is_floating_point() && kl.scalar_type() != torch::kBool, op,
                ": key_lengths must be an integer tensor, got ", kl.scalar_type());
    TORCH_CHECK(kl.dim() == 1 && kl.size(0) == N, op, ": key_lengths must have shape (N,) = (", N,
                "), got ", shape_str(kl));
    if (N > 0 && check_values()) {
      const auto mn = kl.min().item<int64_t>(), mx = kl.max().item<int64_t>();
      TORCH_CHECK(mn >= 0 && mx <= S, op, ": key_lengths must lie in [0, S] = [0, ", S,
                  "], got values in [", mn, ", ", mx, "]");
    }
  }
}

torch::Tensor broadcast_mask(const torch::Tensor& attn_mask, int64_t N, int64_t H, int64_t L,
                             int64_t S) {
  auto m = attn_mask;
  if (m.dim() == 2) m = m.view({1, 1, L, S});
  if (m.dim() == 3) m = m.unsqueeze(1);
  return m.expand({N, H, L, S});
}

torch::Tensor dense_keep(int64_t N, int64_t L, int64_t S,
                         const std::optional<torch::Tensor>& attn_mask,
                         const std::optional<torch::Tensor>& key_lengths, bool causal,
                         const torch::Device& device) {
  auto opts = torch::TensorOptions().dtype(torch::kBool).device(device);
  auto keep = torch::ones({N, 1, L, S}, opts);
  if (causal) {
    auto i = torch::arange(L, opts.dtype(torch::kLong)).view({L, 1});
    auto j = torch::arange(S, opts.dtype(torch::kLong)).view({1, S});
    keep = keep & (j <= i + (S - L)).view({1, 1, L, S});
  }
  if (key_lengths) {
    auto j = torch::arange(S, opts.dtype(torch::kLong)).view({1, S});
    auto kk = j < key_lengths->to(device, torch::kLong).view({N, 1});  // (N, S)
    keep = keep & kk.view({N, 1, 1, S});
  }
  if (attn_mask) {
    const int64_t H = attn_mask->dim() == 4 ? attn_mask->size(1) : 1;
    auto m = broadcast_mask(*attn_mask, N, H, L, S);
    auto mk = attn_mask->scalar_type() == torch::kBool ? m : torch::isfinite(m) | (m > 0);
    keep = keep & mk;
  }
  return keep;
}

}  // namespace fastattn::ops
