// CUDA registrations of the clustered top-k operators (schemas in
// src/ops/schemas.cpp; CPU side, checks and autograd in
// src/ops/clustered_topk_attention.cpp):
//  - clustered_topk_attention / _backward: the per-cluster top-k kernels of
//    src/kernels/clustered_topk/clustered_topk_cuda.cu in their plain form
//    (masses given; used as float32 by the kernel).
//  - improved_clustered_attention (no-grad composite), _forward, _backward:
//    centroids = member means (our kernel), the centroid pass through the
//    dispatcher (fastattn::full_attention_lse_topk_forward; its backward
//    fastattn::full_attention_backward with grad_lse), then the top-k kernels
//    in their improved form; the centroid gradients reach the members through
//    add_centroid_grads_cuda. Gradients accumulate in float32 buffers
//    (atomics for k and v) and are cast to the dtype at the end; ATen does
//    the casts, zero fills and the sums of the two passes' k / v gradients.
// Tested by tests/cuda/test_cuda_sparse_product.cpp against the CPU ops (on a
// GPU); the kernels under the emulator by tests/cuda_emu/test_clustered_topk.cpp.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "kernels/clustered_topk/clustered_topk_cuda.h"
#include "ops/clustered_topk_args.h"
#include "ops/cuda/cuda_op_util.h"
#include "ops/mask_util.h"
#include "ops/op_shell.h"
#include "ops/op_util.h"

namespace fastattn {
namespace {

using torch::Tensor;

// Every tensor on q's CUDA device.
void check_devices(const char* op, const Tensor& q,
                   std::initializer_list<std::pair<const char*, const Tensor*>> tensors) {
  for (const auto& [name, t] : tensors) ops::cuda::check_same_device(op, name, *t, q.device());
}

Tensor workspace_for(const Tensor& q, int64_t L, int64_t C, int64_t K, int64_t M) {
  return torch::empty({cuda::clustered_topk_cuda_workspace_bytes(q.size(0), q.size(1), L, C, K, M)},
                      q.options().dtype(torch::kByte));
}

// The common kernel arguments (contiguous tensors).
void fill_common(cuda::ClusteredTopkCudaArgs& a, const char* op, const ops::QKVInputs& in,
                 const Tensor& topk, const Tensor& assignments, double temp,
                 const Tensor& workspace) {
  ops::fill_clustered_topk_args(a, op, in, topk, assignments, temp);
  a.workspace = workspace.data_ptr();
}

// ---- clustered_topk_attention -----------------------------------------------------

Tensor clustered_topk_attention_cuda_op(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in,
                                        const Tensor& topk_in, const Tensor& mass_in,
                                        const Tensor& assignments_in,
                                        const c10::optional<Tensor>& key_lengths,
                                        double softmax_temp, double dropout_p,
                                        c10::optional<int64_t> /*dropout_seed*/) {
  constexpr const char* op = ops::kClusteredTopkOp;
  ops::cuda::check_no_dropout(op, dropout_p);
  check_devices(op, q_in,
                {{"topk", &topk_in}, {"mass", &mass_in}, {"assignments", &assignments_in}});
  ops::check_clustered_topk_inputs(q_in, k_in, v_in, topk_in, mass_in, assignments_in, key_lengths);
  ops::resolve_softmax_temp(op, q_in, softmax_temp);  // checks it is finite and > 0
  const c10::cuda::CUDAGuard guard(q_in.device());
  const auto in = ops::qkv_inputs(q_in, k_in, v_in, key_lengths);
  const auto &q = in.q, &v = in.v;
  const auto topk = topk_in.contiguous(), assignments = assignments_in.contiguous();
  const auto mass = mass_in.to(torch::kFloat).contiguous();
  auto out = torch::zeros({q.size(0), q.size(1), q.size(2), v.size(3)}, q.options());
  const auto ws = workspace_for(q, q.size(2), topk.size(2), topk.size(3), v.size(3));
  cuda::ClusteredTopkForwardCudaArgs a;
  fill_common(a, op, in, topk, assignments, softmax_temp, ws);
  a.mass = mass.data_ptr<float>();
  a.out = out.data_ptr();
  cuda::clustered_topk_forward_cuda(a, ops::cuda::current_stream());
  return ops::in_rows_layout_of(out, q_in);
}

std::tuple<Tensor, Tensor, Tensor, Tensor> clustered_topk_attention_backward_cuda_op(
    const Tensor& grad_out, const Tensor& q_in, const Tensor& k_in, const Tensor& v_in,
    const Tensor& topk_in, const Tensor& mass_in, const Tensor& assignments_in,
    const c10::optional<Tensor>& key_lengths, double softmax_temp, double dropout_p,
    int64_t /*dropout_seed*/) {
  constexpr const char* op = ops::kClusteredTopkOp;
  ops::cuda::check_no_dropout(op, dropout_p);
  check_devices(op, q_in,
                {{"topk", &topk_in},
                 {"mass", &mass_in},
                 {"assignments", &assignments_in},
                 {"grad_out", &grad_out}});
  ops::check_clustered_topk_inputs(q_in, k_in, v_in, topk_in, mass_in, assignments_in, key_lengths);
  TORCH_CHECK(grad_out.dim() == 4 && grad_out.size(0) == q_in.size(0) &&
                  grad_out.size(1) == q_in.size(1) && grad_out.size(2) == q_in.size(2) &&
                  grad_out.size(3) == v_in.size(3),
              op, ": grad_out must have shape (N, H, L, M), got ", grad_out.sizes());
  const c10::cuda::CUDAGuard guard(q_in.device());
  const auto in = ops::qkv_inputs(q_in, k_in, v_in, key_lengths);
  const auto &q = in.q, &k = in.k, &v = in.v;
  const auto topk = topk_in.contiguous(), assignments = assignments_in.contiguous();
  const auto mass = mass_in.to(torch::kFloat).contiguous();
  const auto go = grad_out.to(q.scalar_type()).contiguous();
  const ops::cuda::Float32QkvGrads g(q, k, v);
  auto gm = torch::empty(mass.sizes(), q.options().dtype(torch::kFloat));
  const auto ws = workspace_for(q, q.size(2), topk.size(2), topk.size(3), v.size(3));
  cuda::ClusteredTopkBackwardCudaArgs a;
  fill_common(a, op, in, topk, assignments, softmax_temp, ws);
  a.mass = mass.data_ptr<float>();
  a.grad_out = go.data_ptr();
  g.set(a);
  a.grad_mass = gm.data_ptr<float>();
  cuda::clustered_topk_backward_cuda(a, ops::cuda::current_stream());
  const auto [gq, gk, gv] = g.in_layouts_of(q_in, k_in, v_in);
  return {gq, gk, gv, gm.to(mass_in.scalar_type())};
}

// ---- improved_clustered_attention -------------------------------------------------

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> improved_clustered_attention_forward_cuda_op(
    const Tensor& q_in, const Tensor& k_in, const Tensor& v_in, const Tensor& assignments_in,
    const Tensor& counts_in, int64_t topk, const c10::optional<Tensor>& key_lengths,
    double softmax_temp, double dropout_p, int64_t /*dropout_seed*/) {
  constexpr const char* op = ops::kImprovedClusteredOp;
  ops::cuda::check_no_dropout(op, dropout_p);
  ops::check_qkv(op, q_in, k_in, v_in);
  ops::check_masks(op, q_in, k_in.size(2), std::nullopt, to_std(key_lengths));
  check_devices(op, q_in, {{"assignments", &assignments_in}, {"counts", &counts_in}});
  ops::check_improved_clusters(q_in, assignments_in, counts_in);
  TORCH_CHECK(topk >= 1 && topk <= k_in.size(2), op, ": topk must be in [1, S] = [1, ",
              k_in.size(2), "], got ", topk);
  const c10::cuda::CUDAGuard guard(q_in.device());
  const auto in = ops::qkv_inputs(q_in, k_in, v_in, key_lengths);
  const auto &q = in.q, &k = in.k, &v = in.v;
  const auto assignments = assignments_in.contiguous(), counts = counts_in.contiguous();
  const int64_t N = q.size(0), H = q.size(1), L = q.size(2), E = q.size(3), C = counts.size(2);
  const auto stream = ops::cuda::current_stream();
  auto centroids = torch::empty({N, H, C, E}, q.options());
  // One workspace: the means' grouping of the queries serves the top-k pass.
  const auto ws = workspace_for(q, L, C, topk, v.size(3));
  {
    cuda::ClusterMeansCudaArgs a;
    a.q = q.data_ptr();
    a.assignments = assignments.data_ptr<int64_t>();
    a.counts = counts.data_ptr<int64_t>();
    a.centroids = centroids.data_ptr();
    a.NH = N * H;
    a.H = H;
    a.L = L;
    a.C = C;
    a.E = E;
    a.dtype = ops::kernel_dtype(op, "q", q);
    a.workspace = ws.data_ptr();
    cuda::cluster_means_cuda(a, stream);
  }
  static auto lse_topk = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("fastattn::full_attention_lse_topk_forward", "")
                             .typed<std::tuple<Tensor, Tensor, Tensor>(
                                 const Tensor&, const Tensor&, const Tensor&,
                                 const c10::optional<Tensor>&, double, int64_t)>();
  Tensor out_c, lse, top_idx;
  const auto klen = in.lengths.defined() ? c10::optional<Tensor>(in.lengths) : c10::nullopt;
  std::tie(out_c, lse, top_idx) = lse_topk.call(centroids, k, v, klen, softmax_temp, topk);
  const auto lse_f = lse.to(torch::kFloat).contiguous();
  const auto out_cc = out_c.contiguous(), idx = top_idx.contiguous();
  auto out = torch::zeros({N, H, L, v.size(3)}, q.options());
  cuda::ClusteredTopkForwardCudaArgs a;
  fill_common(a, op, in, idx, assignments, softmax_temp, ws);
  a.grouped = true;
  a.centroids = centroids.data_ptr();
  a.lse = lse_f.data_ptr<float>();
  a.out_c = out_cc.data_ptr();
  a.out = out.data_ptr();
  cuda::clustered_topk_forward_cuda(a, stream);
  return {ops::in_rows_layout_of(out, q_in), centroids, lse, out_c, top_idx};
}

std::tuple<Tensor, Tensor, Tensor> improved_clustered_attention_backward_cuda_op(
    const Tensor& grad_out, const Tensor& q_in, const Tensor& k_in, const Tensor& v_in,
    const Tensor& assignments_in, const Tensor& counts_in, const Tensor& centroids_in,
    const Tensor& lse, const Tensor& out_c_in, const Tensor& top_idx_in,
    const c10::optional<Tensor>& key_lengths, double softmax_temp, double dropout_p,
    int64_t /*dropout_seed*/) {
  constexpr const char* op = ops::kImprovedClusteredOp;
  ops::cuda::check_no_dropout(op, dropout_p);
  ops::check_qkv(op, q_in, k_in, v_in);
  check_devices(op, q_in,
                {{"grad_out", &grad_out},
                 {"assignments", &assignments_in},
                 {"counts", &counts_in},
                 {"centroids", &centroids_in},
                 {"lse", &lse},
                 {"out_c", &out_c_in},
                 {"top_idx", &top_idx_in}});
  ops::check_improved_clusters(q_in, assignments_in, counts_in);
  const c10::cuda::CUDAGuard guard(q_in.device());
  const auto in = ops::qkv_inputs(q_in, k_in, v_in, key_lengths);
  const auto &q = in.q, &k = in.k, &v = in.v;
  const auto assignments = assignments_in.contiguous(), counts = counts_in.contiguous();
  const auto centroids = centroids_in.to(q.scalar_type()).contiguous();
  const auto out_c = out_c_in.to(q.scalar_type()).contiguous();
  const auto top_idx = top_idx_in.contiguous();
  const auto lse_f = lse.to(torch::kFloat).contiguous();
  const auto go = grad_out.to(q.scalar_type()).contiguous();
  const int64_t N = q.size(0), H = q.size(1), L = q.size(2), E = q.size(3), C = counts.size(2);
  const auto f32 = q.options().dtype(torch::kFloat);
  const ops::cuda::Float32QkvGrads g(q, k, v);
  auto g_cen = torch::empty({N, H, C, E}, f32), g_lse = torch::empty({N, H, C}, f32),
       g_out_c = torch::empty({N, H, C, v.size(3)}, f32);
  const auto stream = ops::cuda::current_stream();
  {
    const auto ws = workspace_for(q, L, C, top_idx.size(3), v.size(3));
    cuda::ClusteredTopkBackwardCudaArgs a;
    fill_common(a, op, in, top_idx, assignments, softmax_temp, ws);
    a.centroids = centroids.data_ptr();
    a.lse = lse_f.data_ptr<float>();
    a.out_c = out_c.data_ptr();
    a.grad_out = go.data_ptr();
    g.set(a);
    a.grad_centroids = g_cen.data_ptr<float>();
    a.grad_lse = g_lse.data_ptr<float>();
    a.grad_out_c = g_out_c.data_ptr<float>();
    cuda::clustered_topk_backward_cuda(a, stream);
  }
  // The centroid pass: its gradients to k and v add to the top-k ones; to the
  // centroids, then to every member query (centroid = mean of the members).
  static auto fa_backward =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("fastattn::full_attention_backward", "")
          .typed<std::tuple<Tensor, Tensor, Tensor>(
              const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
              const Tensor&, const c10::optional<Tensor>&, const c10::optional<Tensor>&, bool,
              double, const c10::optional<Tensor>&, double, int64_t)>();
  Tensor gc2, gk2, gv2;
  std::tie(gc2, gk2, gv2) = fa_backward.call(
      g_out_c.to(q.scalar_type()), centroids, k, v, out_c, lse, c10::nullopt,
      in.lengths.defined() ? c10::optional<Tensor>(in.lengths) : c10::nullopt,
      /*causal=*/false, softmax_temp, c10::optional<Tensor>(g_lse.to(lse.scalar_type())),
      /*dropout_p=*/0.0, /*dropout_seed=*/0);
  g_cen.add_(gc2.to(torch::kFloat));
  g.k.add_(gk2.to(torch::kFloat));
  g.v.add_(gv2.to(torch::kFloat));
  cuda::AddCentroidGradsCudaArgs a;
  a.dst = g.q.data_ptr<float>();
  a.table = g_cen.data_ptr<float>();
  a.assignments = assignments.data_ptr<int64_t>();
  a.counts = counts.data_ptr<int64_t>();
  a.NH = N * H;
  a.H = H;
  a.L = L;
  a.C = C;
  a.E = E;
  cuda::add_centroid_grads_cuda(a, stream);
  return g.in_layouts_of(q_in, k_in, v_in);
}

}  // namespace

TORCH_LIBRARY_IMPL(fastattn, CUDA, m) {
  m.impl("clustered_topk_attention", clustered_topk_attention_cuda_op);
  m.impl("clustered_topk_attention_backward", clustered_topk_attention_backward_cuda_op);
  ops::impl_halves(m, c10::DispatchKey::CUDA, "improved_clustered_attention",
                   improved_clustered_attention_forward_cuda_op,
                   improved_clustered_attention_backward_cuda_op);
}

}  // namespace fastattn
