// CUDA registrations of the hard_retrieval_attention operator: the same checks
// as the CPU op (ops/hard_retrieval_args.h), then the kernels of
// src/kernels/hard_retrieval/hard_retrieval_cuda.cu (forward: argmax or the
// CPU's counter-based sampling, so the same seed gives the same indices on
// both backends; backward: straight-through, dQ and dK of the soft attention
// and dV by an index-add). On CUDA the lse is float32 whatever the dtype (the
// backward takes it so); gradients are accumulated in float32 and converted.
// Tested by tests/cuda/test_cuda_hard_retrieval.cpp.
#include <torch/library.h>

#include "kernels/hard_retrieval/hard_retrieval_cuda.h"
#include "ops/cuda/cuda_op_util.h"
#include "ops/hard_retrieval_args.h"
#include "ops/mask_util.h"
#include "ops/op_shell.h"
#include "ops/op_util.h"

namespace fastattn {
namespace {

using torch::Tensor;

constexpr const char* kOp = "fastattn::hard_retrieval_attention";

struct Prepared {
  ops::HardRetrievalInputs in;
  cuda::HardRetrievalCudaParams params;
};

Prepared prepare(const Tensor& q, const Tensor& k, const Tensor& v,
                 const c10::optional<Tensor>& attn_mask, const c10::optional<Tensor>& key_lengths,
                 bool causal, double temp) {
  ops::check_hard_retrieval_inputs(kOp, q, k, v, attn_mask, key_lengths);
  TORCH_CHECK(
      q.size(3) <= cuda::kHardRetrievalCudaMaxDim && v.size(3) <= cuda::kHardRetrievalCudaMaxDim,
      kOp, ": the CUDA kernels take head dims E and M up to ", cuda::kHardRetrievalCudaMaxDim,
      ", got E = ", q.size(3), ", M = ", v.size(3));
  Prepared p{ops::prepare_hard_retrieval(q, k, v, attn_mask, key_lengths), {}};
  ops::fill_hard_retrieval_args(p.params, kOp, p.in, causal, temp);
  return p;
}

// (out, index, lse, soft_out); lse (float32) is empty (numel 0) unless
// sample or need_lse; soft_out is always empty here (the CUDA backward
// recomputes delta in its own pass).
std::tuple<Tensor, Tensor, Tensor, Tensor> hard_retrieval_attention_forward_cuda_op(
    const Tensor& q, const Tensor& k, const Tensor& v, const c10::optional<Tensor>& attn_mask,
    const c10::optional<Tensor>& key_lengths, bool causal, bool sample, double softmax_temp,
    int64_t seed, bool need_lse) {
  c10::cuda::CUDAGuard guard(q.device());
  ops::resolve_softmax_temp(kOp, q, softmax_temp);
  const auto p = prepare(q, k, v, attn_mask, key_lengths, causal, softmax_temp);
  const int64_t N = q.size(0), H = q.size(1), L = q.size(2);
  auto out = torch::empty({N, H, L, v.size(3)}, q.options());
  auto index = torch::empty({N, H, L}, q.options().dtype(torch::kLong));
  const bool with_lse = sample || need_lse;
  const auto f32 = q.options().dtype(torch::kFloat);
  auto lse = with_lse ? torch::empty({N, H, L}, f32) : torch::empty({0}, f32);
  cuda::HardRetrievalForwardCudaArgs a;
  static_cast<cuda::HardRetrievalCudaParams&>(a) = p.params;
  a.sample = sample;
  a.seed = static_cast<uint64_t>(seed);
  a.out = out.data_ptr();
  a.index = index.data_ptr<int64_t>();
  a.lse = with_lse ? lse.data_ptr<float>() : nullptr;
  cuda::hard_retrieval_forward_cuda(a, ops::cuda::current_stream());
  // In q's row layout, as the CPU op writes it and the fake promises.
  return {ops::in_rows_layout_of(out, q), index, lse, torch::empty({0}, f32)};
}

std::tuple<Tensor, Tensor, Tensor> hard_retrieval_attention_backward_cuda_op(
    const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& index,
    const Tensor& lse, const Tensor& soft_out, const c10::optional<Tensor>& attn_mask,
    const c10::optional<Tensor>& key_lengths, bool causal, double softmax_temp) {
  c10::cuda::CUDAGuard guard(q.device());
  const auto p = prepare(q, k, v, attn_mask, key_lengths, causal, softmax_temp);
  ops::check_hard_retrieval_backward(kOp, grad_out, q, k, v, index, lse, soft_out);
  ops::cuda::check_same_device(kOp, "grad_out", grad_out, q.device());
  ops::cuda::check_same_device(kOp, "index", index, q.device());
  ops::cuda::check_same_device(kOp, "lse", lse, q.device());
  const int64_t N = q.size(0), H = q.size(1), L = q.size(2), M = v.size(3);
  auto go = grad_out.to(q.scalar_type()).contiguous();
  auto idx = index.contiguous();
  auto lse_c = lse.contiguous();
  const auto f32 = q.options().dtype(torch::kFloat);
  auto ws_out = torch::empty({N, H, L, M}, f32);
  auto ws_lse = torch::empty({N, H, L}, f32), ws_delta = torch::empty({N, H, L}, f32);
  const ops::cuda::Float32QkvGrads g(q, k, v);
  cuda::HardRetrievalBackwardCudaArgs a;
  static_cast<cuda::HardRetrievalCudaParams&>(a) = p.params;
  a.grad_out = go.data_ptr();
  a.index = idx.data_ptr<int64_t>();
  a.lse = lse_c.data_ptr<float>();
  a.ws_out = ws_out.data_ptr<float>();
  a.ws_lse = ws_lse.data_ptr<float>();
  a.ws_delta = ws_delta.data_ptr<float>();
  g.set(a);
  cuda::hard_retrieval_backward_cuda(a, ops::cuda::current_stream());
  return g.in_layouts_of(q, k, v);
}

}  // namespace

TORCH_LIBRARY_IMPL(fastattn, CUDA, m) {
  ops::impl_halves(m, c10::DispatchKey::CUDA, "hard_retrieval_attention",
                   hard_retrieval_attention_forward_cuda_op,
                   hard_retrieval_attention_backward_cuda_op);
}

}  // namespace fastattn
