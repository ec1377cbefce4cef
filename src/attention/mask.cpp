// fastattn::Mask: one mask object (attention mask, key/query lengths, causal)
// with checks against an attention call's shapes and the dense forms that
// references and a few types need. The dense logic is ops/mask_util's.
#include "fastattn/mask.h"

#include <limits>
#include <sstream>

#include "ops/mask_util.h"

namespace fastattn {

namespace {

// (N,) integer tensor with values >= 0; the upper bound is checked in check().
void check_lengths(const char* name, const torch::Tensor& lengths) {
  TORCH_CHECK(lengths.defined(), "Mask: ", name, " must be a defined tensor");
  TORCH_CHECK(!lengths.is_floating_point() && !lengths.is_complex() &&
                  lengths.scalar_type() != torch::kBool,
              "Mask: ", name, " must be an integer tensor, got ", lengths.scalar_type());
  TORCH_CHECK(lengths.dim() == 1, "Mask: ", name, " must have shape (N,), got ", lengths.sizes());
  if (lengths.numel() > 0) {
    const auto mn = lengths.min().item<int64_t>();
    TORCH_CHECK(mn >= 0, "Mask: ", name, " must be >= 0, got a minimum of ", mn);
  }
}

// lengths (N,) as a (N, size) keep mask: position < length.
torch::Tensor lengths_keep(const std::optional<torch::Tensor>& lengths, int64_t N, int64_t size,
                           const torch::Device& device) {
  auto opts = torch::TensorOptions().dtype(torch::kBool).device(device);
  if (!lengths) return torch::ones({N, size}, opts);
  auto pos = torch::arange(size, opts.dtype(torch::kLong)).view({1, size});
  return pos < lengths->to(device, torch::kLong).view({N, 1});
}

}  // namespace

Mask Mask::with_attn_mask(const torch::Tensor& attn_mask) const {
  TORCH_CHECK(attn_mask.defined(), "Mask: attn_mask must be a defined tensor");
  TORCH_CHECK(attn_mask.scalar_type() == torch::kBool || attn_mask.is_floating_point(),
              "Mask: attn_mask must be bool (true = keep) or floating (additive), got ",
              attn_mask.scalar_type());
  TORCH_CHECK(attn_mask.dim() >= 2 && attn_mask.dim() <= 4,
              "Mask: attn_mask must have shape (L, S), (N, L, S) or (N, H, L, S), got ",
              attn_mask.sizes());
  Mask m = *this;
  m.attn_mask_ = attn_mask;
  return m;
}

Mask Mask::with_key_lengths(const torch::Tensor& key_lengths) const {
  check_lengths("key_lengths", key_lengths);
  Mask m = *this;
  m.key_lengths_ = key_lengths;
  return m;
}

Mask Mask::with_query_lengths(const torch::Tensor& query_lengths) const {
  check_lengths("query_lengths", query_lengths);
  Mask m = *this;
  m.query_lengths_ = query_lengths;
  return m;
}

Mask Mask::with_causal(bool causal) const {
  Mask m = *this;
  m.causal_ = causal;
  return m;
}

bool Mask::is_all_ones() const {
  return !attn_mask_ && !key_lengths_ && !query_lengths_ && !causal_;
}

void Mask::check(int64_t N, int64_t H, int64_t L, int64_t S) const {
  if (!attn_mask_ && !key_lengths_ && !query_lengths_) return;  // causal alone: nothing to check
  // check_masks reads N, H, L and the device from a queries tensor: an empty
  // (N, H, L, 0) stand-in on the mask's device costs nothing.
  const auto device = attn_mask_ ? attn_mask_->device() : torch::Device(torch::kCPU);
  auto q = torch::empty({N, H, L, 0}, torch::TensorOptions().device(device));
  ops::check_masks("Mask", q, S, attn_mask_, key_lengths_);
  if (query_lengths_) {
    const auto& ql = *query_lengths_;
    TORCH_CHECK(ql.size(0) == N, "Mask: query_lengths must have shape (N,) = (", N, "), got ",
                ql.sizes());
    if (N > 0) {
      const auto mx = ql.max().item<int64_t>();
      TORCH_CHECK(mx <= L, "Mask: query_lengths must lie in [0, L] = [0, ", L,
                  "], got a maximum of ", mx);
    }
  }
}

torch::Tensor Mask::dense_bool(int64_t N, int64_t H, int64_t L, int64_t S,
                               const torch::Device& device) const {
  std::optional<torch::Tensor> am;
  if (attn_mask_) am = attn_mask_->to(device);
  return ops::dense_keep(N, L, S, am, key_lengths_, causal_, device).expand({N, H, L, S});
}

torch::Tensor Mask::dense_additive(int64_t N, int64_t H, int64_t L, int64_t S,
                                   torch::ScalarType dtype, const torch::Device& device) const {
  auto keep = dense_bool(N, H, L, S, device);
  auto opts = torch::TensorOptions().dtype(dtype).device(device);
  torch::Tensor add = torch::zeros({1, 1, 1, 1}, opts).expand({N, H, L, S});
  if (attn_mask_ && attn_mask_->is_floating_point()) {
    add = ops::broadcast_mask(attn_mask_->to(device, dtype), N, H, L, S);
  }
  return add.masked_fill(keep.logical_not(), -std::numeric_limits<double>::infinity());
}

torch::Tensor Mask::key_keep(int64_t N, int64_t S, const torch::Device& device) const {
  return lengths_keep(key_lengths_, N, S, device);
}

torch::Tensor Mask::query_keep(int64_t N, int64_t L, const torch::Device& device) const {
  return lengths_keep(query_lengths_, N, L, device);
}

std::string Mask::to_string() const {
  if (is_all_ones()) return "Mask(none)";
  std::ostringstream os;
  os << "Mask(";
  const char* sep = "";
  if (causal_) {
    os << "causal";
    sep = ", ";
  }
  if (attn_mask_) {
    os << sep << "attn_mask=" << attn_mask_->scalar_type() << attn_mask_->sizes();
    sep = ", ";
  }
  if (key_lengths_) {
    os << sep << "key_lengths=" << key_lengths_->sizes();
    sep = ", ";
  }
  if (query_lengths_) os << sep << "query_lengths=" << query_lengths_->sizes();
  os << ")";
  return os.str();
}

}  // namespace fastattn
