// CUDA registrations of the block_sparse_attention operator (local, Sparse
// Transformer strided / fixed): the same checks as the CPU op
// (ops/block_sparse_pattern.h), the pattern's parts turned into plans on the
// host (kernels::make_sparse_plans: per head group the part's query / key
// orders and per-query kept ranges, a few int64 per query), copied to the
// device and cached per (pattern, shape, device), then the kernels of
// src/kernels/block_sparse/block_sparse_attention_{forward,backward}_cuda.cu.
// On CUDA the lse is float32 whatever the dtype; the gradients are accumulated
// in float32 and converted; delta = rowsum(grad_out ∘ out) is one ATen
// reduction.
// Tested by tests/cuda/test_cuda_block_sparse.cpp.
#include <torch/library.h>

#include <map>
#include <mutex>
#include <tuple>

#include "kernels/block_sparse/block_sparse_attention.h"
#include "kernels/block_sparse/block_sparse_attention_cuda.h"
#include "ops/block_sparse_pattern.h"
#include "ops/cuda/cuda_op_util.h"
#include "ops/op_shell.h"
#include "ops/op_util.h"

namespace fastattn {
namespace {

using torch::Tensor;

constexpr const char* kOp = "fastattn::block_sparse_attention";

// The plans of a pattern on a device, made on the host and copied once, then
// cached by (pattern, params, causal, H, L, S, device): a training loop calls
// the op with the same shapes every step. At most kMaxPlans entries (the
// cache is emptied when full). Returns a copy (the entry may go any time).
struct PlanEntry {
  Tensor buf;  // int64 on the device
  std::vector<kernels::SparsePlanLayout> layouts;
};

PlanEntry device_plan(int kind, const std::vector<int64_t>& params, bool causal, int64_t H,
                      int64_t L, int64_t S, const torch::Device& device) {
  constexpr size_t kMaxPlans = 64;
  using Key = std::tuple<int, std::vector<int64_t>, bool, int64_t, int64_t, int64_t, int>;
  static std::mutex mutex;
  // Never destroyed: freeing device memory from a static destructor at exit
  // can run after the CUDA allocator is gone.
  static auto& cache = *new std::map<Key, PlanEntry>();
  const Key key{kind, params, causal, H, L, S, device.index()};
  std::lock_guard<std::mutex> lock(mutex);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  if (cache.size() >= kMaxPlans) cache.clear();
  const auto parts = kernels::make_sparse_parts(kind, params, causal, H);
  TORCH_CHECK(parts.size() <= 2, kOp, ": internal: more than two parts");
  const auto plans = kernels::make_sparse_plans(parts, H, L, S, cuda::kBlockSparseCudaBq,
                                                cuda::kBlockSparseCudaBk);
  PlanEntry e;
  auto buf = kernels::flatten_sparse_plans(plans, H, L, S, cuda::kBlockSparseCudaBq,
                                           cuda::kBlockSparseCudaBk, &e.layouts);
  // A synchronous copy from pageable memory: buf may go once it returns.
  e.buf = torch::from_blob(buf.data(), {static_cast<int64_t>(buf.size())}, torch::kLong).to(device);
  return cache.emplace(key, std::move(e)).first->second;
}

struct Prepared {
  ops::QKVInputs in;
  Tensor plan;  // the flattened plans (int64, on q's device)
  cuda::BlockSparseCudaParams params;
};

Prepared prepare(const Tensor& q, const Tensor& k, const Tensor& v, const std::string& pattern,
                 c10::IntArrayRef params, const c10::optional<Tensor>& key_lengths, bool causal,
                 double temp) {
  const std::vector<int64_t> pv(params.begin(), params.end());
  const int kind = ops::check_block_sparse_inputs(kOp, q, k, v, pattern, pv, key_lengths);
  TORCH_CHECK(
      q.size(3) <= cuda::kBlockSparseCudaMaxDim && v.size(3) <= cuda::kBlockSparseCudaMaxDim, kOp,
      ": the CUDA kernels take head dims E and M up to ", cuda::kBlockSparseCudaMaxDim,
      ", got E = ", q.size(3), ", M = ", v.size(3));
  const int64_t H = q.size(1), L = q.size(2), S = k.size(2);
  Prepared p;
  p.in = ops::qkv_inputs(q, k, v, key_lengths);
  const PlanEntry plan = device_plan(kind, pv, causal, H, L, S, q.device());  // a copy
  p.plan = plan.buf;
  // The cached buffer may be freed (evicted) while this call's kernels still
  // read it: tell the allocator which stream uses it.
  p.plan.record_stream(at::cuda::getCurrentCUDAStream());
  const auto& lay = plan.layouts;
  auto& a = p.params;
  ops::set_qkv_args(a, kOp, p.in);
  a.scale = static_cast<float>(temp);
  a.num_parts = static_cast<int>(lay.size());
  const int64_t* base = p.plan.data_ptr<int64_t>();
  for (int i = 0; i < a.num_parts; ++i) {
    auto& pc = a.parts[i];
    pc.max_sp = lay[i].max_sp;
    pc.head_group = base + lay[i].head_group;
    pc.head_flags = base + lay[i].head_flags;
    pc.group_sp = base + lay[i].group_sp;
    pc.q_order = base + lay[i].q_order;
    pc.k_order = base + lay[i].k_order;
    pc.ranges = base + lay[i].ranges;
    pc.q_tile_kb = base + lay[i].q_tile_kb;
    pc.kt_ptr = base + lay[i].kt_ptr;
    pc.kt_q = base + lay[i].kt_q;
  }
  return p;
}

std::tuple<Tensor, Tensor> block_sparse_attention_forward_cuda_op(
    const Tensor& q, const Tensor& k, const Tensor& v, c10::string_view pattern,
    c10::IntArrayRef params, const c10::optional<Tensor>& key_lengths, bool causal,
    double softmax_temp, double dropout_p, int64_t /*dropout_seed*/) {
  ops::cuda::check_no_dropout(kOp, dropout_p);
  c10::cuda::CUDAGuard guard(q.device());
  const auto p = prepare(q, k, v, std::string(pattern), params, key_lengths, causal, softmax_temp);
  const int64_t N = q.size(0), H = q.size(1), L = q.size(2), M = v.size(3);
  auto out = torch::empty({N, H, L, M}, q.options());
  auto lse = torch::empty({N, H, L}, q.options().dtype(torch::kFloat));
  Tensor ws_acc, ws_ml;
  cuda::BlockSparseForwardCudaArgs a;
  static_cast<cuda::BlockSparseCudaParams&>(a) = p.params;
  a.out = out.data_ptr();
  a.lse = lse.data_ptr<float>();
  if (a.num_parts > 1) {
    ws_acc = torch::empty({N, H, L, M}, q.options().dtype(torch::kFloat));
    ws_ml = torch::empty({2, N, H, L}, q.options().dtype(torch::kFloat));
    a.ws_acc = ws_acc.data_ptr<float>();
    a.ws_ml = ws_ml.data_ptr<float>();
  }
  cuda::block_sparse_attention_forward_cuda(a, ops::cuda::current_stream());
  // In q's row layout, as the CPU op writes it and the fake promises.
  return {ops::in_rows_layout_of(out, q), lse};
}

std::tuple<Tensor, Tensor, Tensor> block_sparse_attention_backward_cuda_op(
    const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
    const Tensor& lse, c10::string_view pattern, c10::IntArrayRef params,
    const c10::optional<Tensor>& key_lengths, bool causal, double softmax_temp, double dropout_p,
    int64_t /*dropout_seed*/) {
  ops::cuda::check_no_dropout(kOp, dropout_p);
  c10::cuda::CUDAGuard guard(q.device());
  const auto p = prepare(q, k, v, std::string(pattern), params, key_lengths, causal, softmax_temp);
  ops::check_block_sparse_backward(kOp, grad_out, out, lse);
  ops::cuda::check_same_device(kOp, "grad_out", grad_out, q.device());
  ops::cuda::check_same_device(kOp, "out", out, q.device());
  ops::cuda::check_same_device(kOp, "lse", lse, q.device());
  auto go = grad_out.to(q.scalar_type()).contiguous();
  auto delta = (go.to(torch::kFloat) * out.to(torch::kFloat)).sum(-1).contiguous();  // (N, H, L)
  auto lse_f = lse.to(torch::kFloat).contiguous();
  const ops::cuda::Float32QkvGrads g(q, k, v);
  cuda::BlockSparseBackwardCudaArgs a;
  static_cast<cuda::BlockSparseCudaParams&>(a) = p.params;
  a.grad_out = go.data_ptr();
  a.lse = lse_f.data_ptr<float>();
  a.delta = delta.data_ptr<float>();
  g.set(a);
  cuda::block_sparse_attention_backward_cuda(a, ops::cuda::current_stream());
  return g.in_layouts_of(q, k, v);
}

}  // namespace

TORCH_LIBRARY_IMPL(fastattn, CUDA, m) {
  ops::impl_halves(m, c10::DispatchKey::CUDA, "block_sparse_attention",
                   block_sparse_attention_forward_cuda_op, block_sparse_attention_backward_cuda_op);
}

}  // namespace fastattn
