// CUDA registrations of the full_attention operators (fused softmax
// attention): full_attention (no-grad composite), full_attention_forward,
// full_attention_backward, full_attention_lse_topk (no-grad composite) and
// full_attention_lse_topk_forward. The kernels are in
// src/kernels/full/full_attention_{forward,backward}_cuda.cu (head dims E,
// M <= 128).
//
// Differences from the CPU op: the lse output is float32 whatever q's dtype
// (the backward takes lse of any floating dtype and reads it as float32), and
// delta = rowsum(grad_out ∘ out) - grad_lse is formed in float32 with ATen.
// Few queries (N·H·ceil(L/64) blocks below the SM count over S >= 4096
// keys, no attn_mask: the centroids of clustered attention, decoding a
// token) and full_attention_lse_topk_forward with topk > 0 (the centroids of
// improved clustering) are computed from materialised float32 scores
// (ops::full_attention_dense: cuBLAS products; the top-k columns by our
// selection kernel, stable_topk_select_cuda, in place of a stable sort of
// their scores), which the top-k needs anyway and which beats the fused
// kernel's few blocks (measured on an H200: git show
// 5f604de:docs/benchmarks.md, "CUDA operators").
#include <torch/library.h>

#include "kernels/full/full_attention_cuda.h"
#include "kernels/clustered_topk/stable_topk_cuda.h"
#include "ops/cuda/cuda_op_util.h"
#include "ops/full_attention_internal.h"
#include "ops/mask_util.h"
#include "ops/op_shell.h"
#include "ops/op_util.h"

namespace fastattn {
namespace {

using torch::Tensor;

constexpr const char* kOp = "fastattn::full_attention";
constexpr const char* kLseTopkOp = "fastattn::full_attention_lse_topk";

void check_cuda_inputs(const char* op, const Tensor& q, const Tensor& k, const Tensor& v) {
  TORCH_CHECK(q.is_cuda(), op, ": q must be a CUDA tensor here, got ", q.device());
  TORCH_CHECK(q.size(3) <= cuda::kFullAttentionCudaMaxHeadDim, op,
              ": the CUDA kernels take head dims up to ", cuda::kFullAttentionCudaMaxHeadDim,
              ", got E = ", q.size(3));
  TORCH_CHECK(v.size(3) >= 1 && v.size(3) <= cuda::kFullAttentionCudaMaxHeadDim, op,
              ": the CUDA kernels take value dims in [1, ", cuda::kFullAttentionCudaMaxHeadDim,
              "], got M = ", v.size(3));
  (void)k;
}

std::tuple<Tensor, Tensor> forward_impl(const char* op, const Tensor& q, const Tensor& k,
                                        const Tensor& v, const c10::optional<Tensor>& attn_mask,
                                        const c10::optional<Tensor>& key_lengths, bool causal,
                                        double softmax_temp) {
  check_cuda_inputs(op, q, k, v);
  const c10::cuda::CUDAGuard guard(q.device());
  const auto p = ops::full_attention_inputs(q, k, v, attn_mask, key_lengths);
  auto out = torch::empty({q.size(0), q.size(1), q.size(2), v.size(3)}, q.options());
  auto lse = torch::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(torch::kFloat));
  cuda::FullAttentionForwardCudaArgs a;
  ops::fill_full_attention_args(a, op, p, causal, softmax_temp);
  a.out = out.data_ptr();
  a.lse = lse.data_ptr<float>();
  cuda::full_attention_forward_cuda(a, ops::cuda::current_stream());
  return {out, lse};
}

// The fused forward runs a block per 64 queries and (n, h), each over all S
// keys: below one block per SM and from S = 4096 keys the dense products
// (cuBLAS, float32 scores of at most 256 MiB) are faster (as measured for
// 100 centroids at S = 16k, N·H = 8, on an H200).
bool few_query_blocks(const Tensor& q, const Tensor& k) {
  const int64_t N = q.size(0), H = q.size(1), L = q.size(2), S = k.size(2);
  const int64_t blocks = N * H * ((L + 63) / 64);
  const int sms = at::cuda::getDeviceProperties(q.device().index())->multiProcessorCount;
  return blocks > 0 && blocks < sms && S >= 4096 && N * H * L * S <= (int64_t(64) << 20);
}

std::tuple<Tensor, Tensor> full_attention_forward_cuda_op(const Tensor& q, const Tensor& k,
                                                          const Tensor& v,
                                                          const c10::optional<Tensor>& attn_mask,
                                                          const c10::optional<Tensor>& key_lengths,
                                                          bool causal, double softmax_temp,
                                                          double dropout_p, int64_t dropout_seed) {
  ops::check_full_attention_inputs(q, k, v, attn_mask, key_lengths);
  ops::cuda::check_no_dropout(kOp, dropout_p);
  Tensor out, lse;
  if (!attn_mask && few_query_blocks(q, k)) {
    check_cuda_inputs(kOp, q, k, v);  // the backward's kernels
    const c10::cuda::CUDAGuard guard(q.device());
    std::tie(out, lse, std::ignore) =
        ops::full_attention_dense(q, k, v, key_lengths, causal, softmax_temp, /*topk=*/0);
  } else {
    std::tie(out, lse) = forward_impl(kOp, q, k, v, attn_mask, key_lengths, causal, softmax_temp);
  }
  // The CPU op's layout (its kernels write q's row layout), which the fake
  // implementation promises.
  return {ops::in_rows_layout_of(out, q), lse};
}

// The backward kernel on prepared inputs, into grad_q/k/v (contiguous, q's
// dtype), overwriting or adding.
void backward_impl(const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
                   const Tensor& out, const Tensor& lse, const c10::optional<Tensor>& attn_mask,
                   const c10::optional<Tensor>& key_lengths, bool causal, double softmax_temp,
                   const c10::optional<Tensor>& grad_lse, Tensor& gq, Tensor& gk, Tensor& gv,
                   bool accumulate) {
  check_cuda_inputs(kOp, q, k, v);
  const c10::cuda::CUDAGuard guard(q.device());
  const auto p = ops::full_attention_inputs(q, k, v, attn_mask, key_lengths);
  auto go = grad_out.to(q.device(), q.scalar_type()).contiguous();
  // d lse / d score_j = P_j: a gradient on lse enters as -grad_lse in delta.
  auto delta = (go.to(torch::kFloat) * out.to(q.device(), torch::kFloat)).sum(-1);
  if (grad_lse) delta = delta - grad_lse->to(q.device(), torch::kFloat);
  delta = delta.contiguous();
  auto lse_c = lse.to(q.device(), torch::kFloat).contiguous();
  auto ws =
      torch::empty({q.size(0), q.size(1), q.size(2), q.size(3)}, q.options().dtype(torch::kFloat));
  cuda::FullAttentionBackwardCudaArgs a;
  ops::fill_full_attention_args(a, kOp, p, causal, softmax_temp);
  a.grad_out = go.data_ptr();
  a.lse = lse_c.data_ptr<float>();
  a.delta = delta.data_ptr<float>();
  ops::set_qkv_grads<void>(a, gq, gk, gv);
  a.dq_workspace = ws.data_ptr<float>();
  a.accumulate = accumulate;
  cuda::full_attention_backward_cuda(a, ops::cuda::current_stream());
}

std::tuple<Tensor, Tensor, Tensor> full_attention_backward_cuda_op(
    const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
    const Tensor& lse, const c10::optional<Tensor>& attn_mask,
    const c10::optional<Tensor>& key_lengths, bool causal, double softmax_temp,
    const c10::optional<Tensor>& grad_lse, double dropout_p, int64_t dropout_seed) {
  ops::check_full_attention_inputs(q, k, v, attn_mask, key_lengths);
  ops::cuda::check_no_dropout(kOp, dropout_p);
  ops::check_full_attention_grads(grad_out, out, lse, grad_lse);
  auto gq = torch::empty(q.sizes(), q.options());
  auto gk = torch::empty(k.sizes(), k.options());
  auto gv = torch::empty(v.sizes(), v.options());
  backward_impl(grad_out, q, k, v, out, lse, attn_mask, key_lengths, causal, softmax_temp, grad_lse,
                gq, gk, gv, /*accumulate=*/false);
  return {ops::in_rows_layout_of(gq, q), ops::in_rows_layout_of(gk, k),
          ops::in_rows_layout_of(gv, v)};
}

std::tuple<Tensor, Tensor, Tensor> full_attention_lse_topk_forward_cuda_op(
    const Tensor& q, const Tensor& k, const Tensor& v, const c10::optional<Tensor>& key_lengths,
    double softmax_temp, int64_t topk) {
  ops::check_lse_topk_inputs(q, k, v, key_lengths, topk);
  check_cuda_inputs(kLseTopkOp, q, k, v);  // the backward's kernels
  if (topk == 0) {
    auto [out, lse] = forward_impl(kLseTopkOp, q, k, v, c10::nullopt, key_lengths, /*causal=*/false,
                                   softmax_temp);
    return {out, lse,
            torch::empty({q.size(0), q.size(1), q.size(2), 0}, q.options().dtype(torch::kLong))};
  }
  const c10::cuda::CUDAGuard guard(q.device());
  return ops::full_attention_dense(q, k, v, key_lengths, /*causal=*/false, softmax_temp, topk);
}

}  // namespace

namespace ops {

Tensor stable_topk_select_cuda(const Tensor& scores, int64_t k) {
  TORCH_CHECK(scores.is_cuda() && scores.scalar_type() == torch::kFloat,
              "stable_topk_select_cuda: scores must be float32 on CUDA, got ", scores.scalar_type(),
              " on ", scores.device());
  const c10::cuda::CUDAGuard guard(scores.device());
  const auto s = scores.contiguous();
  auto shape = s.sizes().vec();
  shape.back() = k;
  auto out = torch::empty(shape, s.options().dtype(torch::kLong));
  fastattn::cuda::StableTopkCudaArgs a;
  a.scores = s.data_ptr<float>();
  a.out = out.data_ptr<int64_t>();
  a.S = s.size(-1);
  a.rows = a.S > 0 ? s.numel() / a.S : 0;
  a.k = k;
  fastattn::cuda::stable_topk_select_cuda(a, ops::cuda::current_stream());
  return out;
}

void full_attention_backward_accumulate_cuda(const Tensor& grad_out, const Tensor& grad_lse,
                                             const Tensor& q, const Tensor& k, const Tensor& v,
                                             const Tensor& out, const Tensor& lse,
                                             const std::optional<Tensor>& key_lengths,
                                             double softmax_temp, Tensor& grad_q, Tensor& grad_k,
                                             Tensor& grad_v) {
  TORCH_CHECK(grad_q.scalar_type() == q.scalar_type() && grad_k.scalar_type() == q.scalar_type() &&
                  grad_v.scalar_type() == q.scalar_type(),
              "full_attention_backward_accumulate: gradient buffers must have q's dtype");
  TORCH_CHECK(
      grad_q.sizes() == q.sizes() && grad_k.sizes() == k.sizes() && grad_v.sizes() == v.sizes(),
      "full_attention_backward_accumulate: gradient buffers must have q's, k's, v's shapes");
  TORCH_CHECK(grad_q.device() == q.device() && grad_k.device() == q.device() &&
                  grad_v.device() == q.device(),
              "full_attention_backward_accumulate: gradient buffers must be on q's device");
  backward_impl(grad_out, q, k, v, out, lse, c10::nullopt, to_c10(key_lengths),
                /*causal=*/false, softmax_temp, grad_lse, grad_q, grad_k, grad_v,
                /*accumulate=*/true);
}

}  // namespace ops

TORCH_LIBRARY_IMPL(fastattn, CUDA, m) {
  ops::impl_halves(m, c10::DispatchKey::CUDA, "full_attention", full_attention_forward_cuda_op,
                   full_attention_backward_cuda_op);
  ops::impl_halves(m, c10::DispatchKey::CUDA, "full_attention_lse_topk",
                   full_attention_lse_topk_forward_cuda_op);
}

}  // namespace fastattn
