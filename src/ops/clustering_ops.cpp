// The hashing and clustering operators of clustered attention:
//   hash_queries(x (N,H,L,E), planes (B,E+1)) -> codes (N,H,L) int64
//   cluster_codes(codes (N,H,L), lengths (N,)?, clusters, iterations, seed)
//       -> (assignments (N,H,L) int64, counts (N,H,min(C, L)) int64)
// Input checks, CPU implementations over src/kernels/{hashing,clustering},
// the C++ entry points and the hashing reference. Neither op is
// differentiable (integer outputs).
// Cost: hashing N·H·L·B·E; clustering (iterations + 2)·N·H·L·C popcounts.
// Tested by tests/cpp/test_clustering.cpp.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "fastattn/ops.h"
#include "kernels/clustering/clustering.h"
#include "kernels/hashing/hashing.h"
#include "ops/clustering_args.h"
#include "ops/op_shell.h"
#include "ops/op_util.h"

namespace fastattn {
namespace ops {

using torch::Tensor;

void check_hash_inputs(const Tensor& x, const Tensor& planes) {
  constexpr const char* op = "fastattn::hash_queries";
  TORCH_CHECK(x.defined() && planes.defined(), op, ": x and planes must be defined tensors");
  TORCH_CHECK(x.dim() == 4, op, ": x must have shape (N, H, L, E), got ", x.dim(), " dimensions ",
              x.sizes());
  ops::check_float_dtype(op, "x", x);
  TORCH_CHECK(planes.dim() == 2 && planes.size(1) == x.size(3) + 1, op,
              ": planes must have shape (B, E + 1) = (B, ", x.size(3) + 1, "), got ",
              planes.sizes());
  TORCH_CHECK(planes.size(0) >= 1 && planes.size(0) <= 64, op,
              ": planes must have 1 to 64 rows (bits B), got ", planes.size(0));
  TORCH_CHECK(planes.scalar_type() == x.scalar_type(), op, ": planes must be ", x.scalar_type(),
              " like x, got ", planes.scalar_type());
  TORCH_CHECK(planes.device() == x.device(), op, ": planes must be on ", x.device(),
              " like x, got ", planes.device());
}

Tensor check_cluster_codes_inputs(const Tensor& codes, const c10::optional<Tensor>& lengths,
                                  int64_t clusters, int64_t iterations) {
  constexpr const char* op = "fastattn::cluster_codes";
  TORCH_CHECK(codes.defined(), op, ": codes must be a defined tensor");
  TORCH_CHECK(codes.dim() == 3, op, ": codes must have shape (N, H, L), got ", codes.dim(),
              " dimensions ", codes.sizes());
  TORCH_CHECK(codes.scalar_type() == torch::kLong, op, ": codes must be int64, got ",
              codes.scalar_type());
  TORCH_CHECK(clusters >= 1, op, ": clusters must be >= 1, got ", clusters);
  TORCH_CHECK(iterations >= 0 && iterations <= kMaxClusterIterations, op,
              ": iterations must be in [0, ", kMaxClusterIterations, "], got ", iterations);
  const int64_t N = codes.size(0), L = codes.size(2);
  Tensor len;
  if (lengths) {
    TORCH_CHECK(lengths->dim() == 1 && lengths->size(0) == N, op,
                ": lengths must have shape (N,) = (", N, "), got ", lengths->sizes());
    TORCH_CHECK(!lengths->is_floating_point() && !lengths->is_complex() &&
                    lengths->scalar_type() != torch::kBool,
                op, ": lengths must be an integer tensor, got ", lengths->scalar_type());
    TORCH_CHECK(lengths->device() == codes.device(), op, ": lengths must be on ", codes.device(),
                " like codes, got ", lengths->device());
    len = lengths->to(torch::kLong).contiguous();
    if (N > 0) {
      TORCH_CHECK(len.min().item<int64_t>() >= 0 && len.max().item<int64_t>() <= L, op,
                  ": lengths must be in [0, L] = [0, ", L, "], got ", len);
    }
  }
  return len;
}

}  // namespace ops

namespace {

using torch::Tensor;

constexpr char kHashQueriesOp[] = "fastattn::hash_queries";
constexpr char kClusterCodesOp[] = "fastattn::cluster_codes";

Tensor hash_queries_cpu_op(const Tensor& x, const Tensor& planes) {
  ops::check_hash_inputs(x, planes);
  if (ops::is_reduced_float(x))
    return ops::in_float32(x.scalar_type(), hash_queries_cpu_op, x, planes);
  auto xc = ops::rows_contiguous(x);  // the layers' (N, L, H, E) views read in place
  auto pc = planes.contiguous();
  auto codes = torch::empty({x.size(0), x.size(1), x.size(2)}, x.options().dtype(torch::kLong));
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "hash_queries_cpu_op", [&] {
    kernels::HashParams<scalar_t> p;
    ops::fill_hash_args(p, xc, pc, codes);
    kernels::hash_queries_cpu(p);
  });
  return codes;
}

std::tuple<Tensor, Tensor> cluster_codes_cpu_op(const Tensor& codes,
                                                const c10::optional<Tensor>& lengths,
                                                int64_t clusters, int64_t iterations,
                                                int64_t seed) {
  const Tensor len = ops::check_cluster_codes_inputs(codes, lengths, clusters, iterations);
  const int64_t N = codes.size(0), H = codes.size(1), L = codes.size(2);
  const int64_t C = ops::effective_clusters(clusters, L);
  auto cc = codes.contiguous();
  auto assignments = torch::empty({N, H, L}, codes.options());
  auto counts = torch::empty({N, H, C}, codes.options());
  const auto p = ops::cluster_args(cc, len, assignments, counts, iterations, seed);
  kernels::cluster_codes_cpu(p);
  return {assignments, counts};
}

}  // namespace

TORCH_LIBRARY_IMPL(fastattn, CPU, m) {
  m.impl("hash_queries", hash_queries_cpu_op);
  m.impl("cluster_codes", cluster_codes_cpu_op);
}

Tensor hash_queries(const Tensor& x, const Tensor& planes) {
  ops::check_defined(kHashQueriesOp, {"x", "planes"}, {x, planes});
  return ops::call_op<kHashQueriesOp, hash_queries_cpu_op>(x, planes);
}

std::tuple<Tensor, Tensor> cluster_codes(const Tensor& codes, const std::optional<Tensor>& lengths,
                                         int64_t clusters, int64_t iterations, int64_t seed) {
  ops::check_defined(kClusterCodesOp, {"codes"}, {codes});
  return ops::call_op<kClusterCodesOp, cluster_codes_cpu_op>(codes, to_c10(lengths), clusters,
                                                             iterations, seed);
}

namespace reference {

Tensor hash_queries(const Tensor& x, const Tensor& planes) {
  ops::check_hash_inputs(x, planes);
  const int64_t E = x.size(3), B = planes.size(0);
  auto proj = torch::matmul(x, planes.narrow(1, 0, E).t()) + planes.select(1, E);  // (N,H,L,B)
  auto bits = (proj > 0).to(torch::kLong);
  auto weights = torch::ones({B}, bits.options())
                     .bitwise_left_shift(torch::arange(
                         B, bits.options()));  // 1 << b, bit 63 wraps to INT64_MIN as intended
  return (bits * weights).sum(-1);             // distinct bits: the sum is their OR
}

}  // namespace reference
}  // namespace fastattn
