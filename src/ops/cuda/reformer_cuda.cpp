// CUDA registrations of the Reformer LSH operators (the CPU ones are in
// src/ops/reformer_attention.cpp): lsh_hash, reformer_attention (the no-grad
// entry, shared with the CPU), reformer_attention_forward and
// reformer_attention_backward, in float32, float16 and bfloat16 (float32
// accumulation, tensor cores for float16/bfloat16; the stats stay float64
// (N, H, L, 2) as on the CPU). Same checks
// and messages as the CPU op (ops/reformer_attention_internal.h), plus head
// dimensions E, M <= cuda::kReformerCudaMaxHeadDim.
// The per-round sort of the valid positions by (bucket, position) is ATen on
// the GPU (a sort of the unique keys bucket·L + position, padding after every
// valid key); the chunk attention, the round merge and the backward are our
// kernels (src/kernels/reformer/reformer_{forward,backward}_cuda.cu). The backward's
// delta = rowsum(grad_out ∘ out) is ATen in float32.
// Tested by tests/cuda/test_cuda_reformer.cpp (against the CPU op in float64).
#include <torch/library.h>

#include "kernels/reformer/reformer_cuda.h"
#include "ops/cuda/cuda_op_util.h"
#include "ops/op_shell.h"
#include "ops/op_util.h"
#include "ops/reformer_attention_internal.h"

namespace fastattn {
namespace {

using torch::Tensor;
using namespace ops::reformer;
using ops::cuda::check_no_dropout;
using ops::cuda::check_same_device;
using ops::cuda::current_stream;

Tensor lsh_hash_cuda_op(const Tensor& x, const Tensor& rotations) {
  check_hash_inputs(x, rotations);
  const c10::cuda::CUDAGuard guard(x.device());
  auto xc = x.contiguous();
  auto rc = rotations.contiguous();
  const int64_t R = rotations.size(0);
  auto buckets =
      torch::empty({x.size(0), x.size(1), R, x.size(2)}, x.options().dtype(torch::kLong));
  cuda::LshHashCudaArgs a;
  fill_lsh_hash_args(a, xc, rc, buckets);
  cuda::lsh_hash_cuda(a, current_stream());
  return buckets;
}

struct Prepared {
  Tensor q, v, lengths, perm;
};

// Checks (as the CPU op) and the per-round permutation (N, H, R, L): the
// valid positions sorted by (bucket, position), then the padded ones.
Prepared prepare(const Tensor& q, const Tensor& v, const Tensor& buckets,
                 const c10::optional<Tensor>& key_lengths, int64_t chunk_size) {
  check_inputs(q, v, buckets, key_lengths, chunk_size);
  TORCH_CHECK(
      q.size(3) <= cuda::kReformerCudaMaxHeadDim && v.size(3) <= cuda::kReformerCudaMaxHeadDim, kOp,
      ": on CUDA the head dimensions E and M must be <= ", cuda::kReformerCudaMaxHeadDim,
      ", got E = ", q.size(3), ", M = ", v.size(3));
  Prepared p;
  p.q = q.contiguous();
  p.v = v.contiguous();
  const int64_t N = q.size(0), L = q.size(2);
  auto b = buckets.contiguous();
  auto pos = torch::arange(L, b.options());
  auto key = b * L + pos;  // unique per row: sorting it is the stable sort by bucket
  if (key_lengths) {
    p.lengths = key_lengths->to(q.device(), torch::kLong).contiguous();
    auto valid = pos.view({1, 1, 1, L}).lt(p.lengths.view({N, 1, 1, 1}));
    key = torch::where(valid, key, pos + kMaxBuckets * L);  // padding after every valid key
  }
  p.perm = std::get<1>(key.sort(-1)).contiguous();
  return p;
}

void fill_params(cuda::ReformerCudaParams& a, const Prepared& p, int64_t chunk_size, bool causal,
                 bool mask_self, double temp) {
  fill_reformer_args(a, p.q, p.v, p.lengths, p.perm.size(2), chunk_size, causal, mask_self, temp);
  a.perm = p.perm.data_ptr<int64_t>();
}

std::tuple<Tensor, Tensor> reformer_attention_forward_cuda_op(
    const Tensor& q, const Tensor& v, const Tensor& buckets,
    const c10::optional<Tensor>& key_lengths, int64_t chunk_size, bool causal, bool mask_self,
    double softmax_temp, double dropout_p, int64_t /*seed*/) {
  TORCH_CHECK(q.defined(), kOp, ": q must be a defined tensor");
  check_no_dropout(kOp, dropout_p);
  // The checks come before the guard: a CPU q with CUDA buckets dispatches here too.
  const auto p = prepare(q, v, buckets, key_lengths, chunk_size);
  const c10::cuda::CUDAGuard guard(q.device());
  const int64_t N = q.size(0), H = q.size(1), L = q.size(2), M = v.size(3);
  auto out = torch::empty({N, H, L, M}, q.options());
  auto stats = torch::empty({N, H, L, 2}, q.options().dtype(torch::kDouble));
  auto ws = torch::empty({N * H * L * M}, q.options().dtype(torch::kFloat));
  cuda::ReformerForwardCudaArgs a;
  fill_params(a, p, chunk_size, causal, mask_self, softmax_temp);
  a.out = out.data_ptr();
  a.stats = stats.data_ptr<double>();
  a.workspace = ws.data_ptr<float>();
  cuda::reformer_forward_cuda(a, current_stream());
  // In q's row layout, as the CPU op writes it and the fake promises.
  return {ops::in_rows_layout_of(out, q), stats};
}

std::tuple<Tensor, Tensor> reformer_attention_backward_cuda_op(
    const Tensor& grad_out, const Tensor& q, const Tensor& v, const Tensor& buckets,
    const Tensor& out, const Tensor& stats, const c10::optional<Tensor>& key_lengths,
    int64_t chunk_size, bool causal, bool mask_self, double softmax_temp, double dropout_p,
    int64_t /*seed*/) {
  TORCH_CHECK(q.defined(), kOp, ": q must be a defined tensor");
  check_no_dropout(kOp, dropout_p);
  const auto p = prepare(q, v, buckets, key_lengths, chunk_size);
  check_backward_inputs(grad_out, q, v, out, stats);
  check_same_device(kOp, "grad_out", grad_out, q.device());
  check_same_device(kOp, "out", out, q.device());
  check_same_device(kOp, "stats", stats, q.device());
  const c10::cuda::CUDAGuard guard(q.device());
  auto go = grad_out.to(q.scalar_type()).contiguous();
  auto delta = (go.to(torch::kFloat) * out.to(torch::kFloat)).sum(-1).contiguous();  // (N, H, L)
  auto stats_c = stats.to(torch::kDouble).contiguous();
  const int64_t N = q.size(0), H = q.size(1), L = q.size(2), E = q.size(3), M = v.size(3);
  auto gq = torch::empty_like(p.q), gv = torch::empty_like(p.v);
  auto ws = torch::empty({N * H * L * (2 * E + M)}, q.options().dtype(torch::kFloat));
  cuda::ReformerBackwardCudaArgs a;
  fill_params(a, p, chunk_size, causal, mask_self, softmax_temp);
  a.grad_out = go.data_ptr();
  a.stats = stats_c.data_ptr<double>();
  a.delta = delta.data_ptr<float>();
  a.grad_q = gq.data_ptr();
  a.grad_v = gv.data_ptr();
  a.workspace = ws.data_ptr<float>();
  cuda::reformer_backward_cuda(a, current_stream());
  return {ops::in_rows_layout_of(gq, q), ops::in_rows_layout_of(gv, v)};
}

}  // namespace

TORCH_LIBRARY_IMPL(fastattn, CUDA, m) {
  m.impl("lsh_hash", lsh_hash_cuda_op);
  ops::impl_halves(m, c10::DispatchKey::CUDA, "reformer_attention",
                   reformer_attention_forward_cuda_op, reformer_attention_backward_cuda_op);
}

}  // namespace fastattn
