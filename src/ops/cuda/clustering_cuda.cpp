// CUDA registrations of hash_queries and cluster_codes (schemas in
// src/ops/schemas.cpp; CPU side and checks in src/ops/clustering_ops.cpp):
//   hash_queries(x (N,H,L,E), planes (B,E+1)) -> codes (N,H,L) int64
//     (float32 / float16 / bfloat16, projections accumulated in float32),
//   cluster_codes(codes, lengths?, clusters, iterations, seed)
//     -> (assignments (N,H,L), counts (N,H,C)), identical to the CPU op.
// Kernels: src/kernels/hashing/hash_queries_cuda.cu,
// src/kernels/clustering/cluster_codes_cuda.cu (one block per (n, h)).
// Tested by tests/cuda/test_cuda_clustering.cpp against the CPU op.
#include <torch/library.h>

#include "kernels/clustering/cluster_codes_cuda.h"
#include "kernels/hashing/hash_queries_cuda.h"
#include "ops/clustering_args.h"
#include "ops/cuda/cuda_op_util.h"

namespace fastattn {
namespace {

using torch::Tensor;

Tensor hash_queries_cuda_op(const Tensor& x, const Tensor& planes) {
  ops::check_hash_inputs(x, planes);
  const c10::cuda::CUDAGuard guard(x.device());
  const auto xc = x.contiguous();
  const auto pc = planes.contiguous();
  auto codes = torch::empty({x.size(0), x.size(1), x.size(2)}, x.options().dtype(torch::kLong));
  cuda::HashQueriesCudaArgs a;
  ops::fill_hash_args(a, xc, pc, codes);
  cuda::hash_queries_cuda(a, ops::cuda::current_stream());
  return codes;
}

std::tuple<Tensor, Tensor> cluster_codes_cuda_op(const Tensor& codes,
                                                 const c10::optional<Tensor>& lengths,
                                                 int64_t clusters, int64_t iterations,
                                                 int64_t seed) {
  const Tensor len = ops::check_cluster_codes_inputs(codes, lengths, clusters, iterations);
  const c10::cuda::CUDAGuard guard(codes.device());
  const int64_t N = codes.size(0), H = codes.size(1), L = codes.size(2);
  const int64_t C = ops::effective_clusters(clusters, L);
  const auto cc = codes.contiguous();
  auto assignments = torch::empty({N, H, L}, codes.options());
  auto counts = torch::empty({N, H, C}, codes.options());
  auto workspace = torch::empty({cuda::cluster_codes_cuda_workspace_bytes(N, H, L, C)},
                                codes.options().dtype(torch::kByte));
  auto a = ops::cluster_args(cc, len, assignments, counts, iterations, seed);
  a.workspace = workspace.data_ptr();
  cuda::cluster_codes_cuda(a, ops::cuda::current_stream());
  return {assignments, counts};
}

}  // namespace

TORCH_LIBRARY_IMPL(fastattn, CUDA, m) {
  m.impl("hash_queries", hash_queries_cuda_op);
  m.impl("cluster_codes", cluster_codes_cuda_op);
}

}  // namespace fastattn
