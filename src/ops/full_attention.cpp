// The full_attention operator: input checks, CPU implementations of the
// forward/backward kernels, the autograd function, and the C++ entry point.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <limits>

#include "fastattn/ops.h"
#include "kernels/common/cpu_isa.h"
#include "kernels/full/full_attention.h"
#include "ops/full_attention_internal.h"
#include "ops/mask_util.h"
#include "ops/op_shell.h"
#include "ops/op_util.h"
#include "ops/row_dots.h"

namespace fastattn {
namespace {

using torch::Tensor;
using torch::autograd::variable_list;

constexpr char kOp[] = "fastattn::full_attention";

void check_inputs(const Tensor& q, const Tensor& k, const Tensor& v,
                  const c10::optional<Tensor>& attn_mask,
                  const c10::optional<Tensor>& key_lengths) {
  ops::check_full_attention_inputs(q, k, v, attn_mask, key_lengths);
}

// bfloat16 operands as they are, the products on AMX tiles or AVX512-BF16
// dot products (kernels/full/full_attention_bf16.cpp); lse in float32, as
// the widened path gives it.
std::tuple<Tensor, Tensor> forward_bf16(const Tensor& q, const Tensor& k, const Tensor& v,
                                        const c10::optional<Tensor>& attn_mask,
                                        const c10::optional<Tensor>& key_lengths, bool causal,
                                        double softmax_temp) {
#if FASTATTN_CPU_ISA_MAX >= 3
  auto p = ops::full_attention_inputs(q, k, v, attn_mask, key_lengths);
  auto out = ops::empty_rows_like(q, v.size(3));
  auto lse = torch::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(torch::kFloat32));
  kernels::FullAttentionForwardArgs<kernels::Bf16> a;
  ops::fill_full_attention_args(a, kOp, p, causal, softmax_temp);
  a.out = ops::kernel_data<kernels::Bf16>(out);
  a.out_rows = ops::row_strides(out);
  a.lse = lse.data_ptr<float>();
  kernels::full_attention_forward_bf16(a);
  return {out, lse};
#else
  TORCH_CHECK(false, kOp, ": no bfloat16 kernels in this build");
#endif
}

// Its backward: delta in float32 from float32 copies of grad_out and out,
// the gradients in bfloat16, in their inputs' row layouts.
std::tuple<Tensor, Tensor, Tensor> backward_bf16(const Tensor& grad_out, const Tensor& q,
                                                 const Tensor& k, const Tensor& v,
                                                 const Tensor& out, const Tensor& lse,
                                                 const c10::optional<Tensor>& attn_mask,
                                                 const c10::optional<Tensor>& key_lengths,
                                                 bool causal, double softmax_temp,
                                                 const c10::optional<Tensor>& grad_lse) {
#if FASTATTN_CPU_ISA_MAX >= 3
  auto p = ops::full_attention_inputs(q, k, v, attn_mask, key_lengths);
  auto go = grad_out.to(q.scalar_type());
  auto delta = ops::row_dots(go.to(torch::kFloat), out.to(torch::kFloat));
  if (grad_lse) delta = delta - grad_lse->to(torch::kFloat);
  delta = delta.contiguous();
  auto lse_c = lse.to(torch::kFloat).contiguous();
  auto gq = ops::empty_rows_like(q, q.size(3)), gk = ops::empty_rows_like(k, k.size(3)),
       gv = ops::empty_rows_like(v, v.size(3));
  go = ops::rows_contiguous(go);
  kernels::FullAttentionBackwardArgs<kernels::Bf16> a;
  ops::fill_full_attention_args(a, kOp, p, causal, softmax_temp);
  a.grad_out = ops::kernel_data<kernels::Bf16>(go);
  ops::set_grad_rows(a, go, gq, gk, gv);
  a.lse = lse_c.data_ptr<float>();
  a.delta = delta.data_ptr<float>();
  ops::set_qkv_grads<kernels::Bf16>(a, gq, gk, gv);
  kernels::full_attention_backward_bf16(a);
  return {gq, gk, gv};
#else
  TORCH_CHECK(false, kOp, ": no bfloat16 kernels in this build");
#endif
}

std::tuple<Tensor, Tensor> full_attention_forward_cpu_op(const Tensor& q, const Tensor& k,
                                                         const Tensor& v,
                                                         const c10::optional<Tensor>& attn_mask,
                                                         const c10::optional<Tensor>& key_lengths,
                                                         bool causal, double softmax_temp,
                                                         double dropout_p, int64_t dropout_seed) {
  check_inputs(q, k, v, attn_mask, key_lengths);
  ops::check_dropout(kOp, dropout_p);
  // The bfloat16 kernels have no dropout: with it, the float32 kernels.
  if (q.scalar_type() == torch::kBFloat16 && dropout_p == 0 &&
      kernels::cpu_isa() >= kernels::CpuIsa::kAvx512Bf16)
    return forward_bf16(q, k, v, attn_mask, key_lengths, causal, softmax_temp);
  if (ops::is_reduced_float(q)) {
    auto [out, lse] =
        ops::in_float32<1>(q.scalar_type(), full_attention_forward_cpu_op, q, k, v, attn_mask,
                           key_lengths, causal, softmax_temp, dropout_p, dropout_seed);
    return {ops::in_rows_layout_of(out, q), lse};
  }
  auto p = ops::full_attention_inputs(q, k, v, attn_mask, key_lengths);
  // Every query tile reads all of K and V: contiguous copies when there are
  // more than two tiles (rows H·E apart, re-read per tile, cost TLB misses);
  // in place for a few queries (clustered attention's centroids), where the
  // copy would cost more than it saves. q's tiles are read once, in place.
  if (q.size(2) > 2 * kernels::kFullForwardQueryTile) {
    p.k = p.k.contiguous();
    p.v = p.v.contiguous();
  }
  // out in q's row layout: the layers' transpose back to (N, L, H, M) is a view.
  auto out = ops::empty_rows_like(q, v.size(3));
  auto lse = torch::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "full_attention_forward_cpu_op", [&] {
    kernels::FullAttentionForwardArgs<scalar_t> a;
    ops::fill_full_attention_args(a, kOp, p, causal, softmax_temp);
    ops::set_dropout_args(a, dropout_p, dropout_seed);
    a.out = out.data_ptr<scalar_t>();
    a.out_rows = ops::row_strides(out);
    a.lse = lse.data_ptr<scalar_t>();
    kernels::full_attention_forward_cpu(a);
  });
  return {out, lse};
}

std::tuple<Tensor, Tensor, Tensor> full_attention_backward_cpu_op(
    const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
    const Tensor& lse, const c10::optional<Tensor>& attn_mask,
    const c10::optional<Tensor>& key_lengths, bool causal, double softmax_temp,
    const c10::optional<Tensor>& grad_lse, double dropout_p, int64_t dropout_seed) {
  check_inputs(q, k, v, attn_mask, key_lengths);
  ops::check_full_attention_grads(grad_out, out, lse, grad_lse);
  ops::check_dropout(kOp, dropout_p);
  if (q.scalar_type() == torch::kBFloat16 && dropout_p == 0 &&
      kernels::cpu_isa() >= kernels::CpuIsa::kAvx512Bf16)
    return backward_bf16(grad_out, q, k, v, out, lse, attn_mask, key_lengths, causal, softmax_temp,
                         grad_lse);
  if (ops::is_reduced_float(q)) {
    return ops::in_rows_layouts_of(
        ops::in_float32(q.scalar_type(), full_attention_backward_cpu_op, grad_out, q, k, v, out,
                        lse, attn_mask, key_lengths, causal, softmax_temp, grad_lse, dropout_p,
                        dropout_seed),
        q, k, v);
  }
  auto p = ops::full_attention_inputs(q, k, v, attn_mask, key_lengths);
  // Every key tile reads all the queries and output gradients of its head:
  // contiguous copies; K and V are read once per tile, in place.
  p.q = p.q.contiguous();
  auto go = grad_out.to(q.scalar_type()).contiguous();
  // d lse / d score_j = P_j: a gradient on lse enters as -grad_lse in delta.
  auto delta = ops::row_dots(go, out.to(go.scalar_type()));  // (N, H, L)
  if (grad_lse) delta = delta - grad_lse->to(q.scalar_type());
  delta = delta.contiguous();
  auto lse_c = lse.contiguous();
  // Gradients in the row layouts of their inputs.
  auto gq = ops::empty_rows_like(q, q.size(3)), gk = ops::empty_rows_like(k, k.size(3)),
       gv = ops::empty_rows_like(v, v.size(3));
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "full_attention_backward_cpu_op", [&] {
    kernels::FullAttentionBackwardArgs<scalar_t> a;
    ops::fill_full_attention_args(a, kOp, p, causal, softmax_temp);
    ops::set_dropout_args(a, dropout_p, dropout_seed);
    a.grad_out = go.data_ptr<scalar_t>();
    ops::set_grad_rows(a, go, gq, gk, gv);
    a.lse = lse_c.data_ptr<scalar_t>();
    a.delta = delta.data_ptr<scalar_t>();
    ops::set_qkv_grads<scalar_t>(a, gq, gk, gv);
    kernels::full_attention_backward_cpu(a);
  });
  return {gq, gk, gv};
}

constexpr char kForwardOp[] = "fastattn::full_attention_forward";
constexpr char kBackwardOp[] = "fastattn::full_attention_backward";

struct FullOp {
  struct Saved {
    Tensor q, k, v, out, lse, attn_mask, key_lengths;
    bool causal = false;
    double temp = 0.0, dropout_p = 0.0;
    int64_t dropout_seed = 0;
    auto tensors() { return std::tie(q, k, v, out, lse, attn_mask, key_lengths); }
  };

  static Tensor forward(Saved* saved, const Tensor& q, const Tensor& k, const Tensor& v,
                        const c10::optional<Tensor>& attn_mask,
                        const c10::optional<Tensor>& key_lengths, bool causal,
                        c10::optional<double> softmax_temp, double dropout_p,
                        c10::optional<int64_t> dropout_seed) {
    ops::check_qkv(kOp, q, k, v);
    ops::check_dropout(kOp, dropout_p);
    const double temp = ops::resolve_softmax_temp(kOp, q, softmax_temp);
    // One seed for the forward and the backward: the same keep mask.
    const int64_t seed = ops::resolve_dropout_seed(dropout_p, dropout_seed);
    auto [out, lse] = ops::call_op<kForwardOp, full_attention_forward_cpu_op>(
        q, k, v, attn_mask, key_lengths, causal, temp, dropout_p, seed);
    if (saved)
      *saved = {q,
                k,
                v,
                out,
                lse,
                ops::or_undefined(attn_mask),
                ops::or_undefined(key_lengths),
                causal,
                temp,
                dropout_p,
                seed};
    return out;
  }

  static auto backward(const Saved& s, const variable_list& grads) {
    return ops::call_op<kBackwardOp, full_attention_backward_cpu_op>(
        grads[0], s.q, s.k, s.v, s.out, s.lse, ops::opt(s.attn_mask), ops::opt(s.key_lengths),
        s.causal, s.temp, c10::nullopt, s.dropout_p, s.dropout_seed);
  }
};

// ---- full_attention_lse_topk ------------------------------------------------------

constexpr char kLseTopkOp[] = "fastattn::full_attention_lse_topk";

std::tuple<Tensor, Tensor, Tensor> full_attention_lse_topk_forward_cpu_op(
    const Tensor& q, const Tensor& k, const Tensor& v, const c10::optional<Tensor>& key_lengths,
    double softmax_temp, int64_t topk) {
  return ops::full_attention_lse_topk_cpu(q, k, v, key_lengths, softmax_temp, topk, 0.0, 0);
}

constexpr char kLseTopkForwardOp[] = "fastattn::full_attention_lse_topk_forward";

// (out, lse, indices of the top-k keys): the backward takes a gradient on
// lse too (it enters delta), none on the indices.
struct LseTopkOp {
  struct Saved {
    Tensor q, k, v, out, lse, key_lengths;
    double temp = 0.0;
    auto tensors() { return std::tie(q, k, v, out, lse, key_lengths); }
  };

  static std::tuple<Tensor, Tensor, Tensor> forward(Saved* saved, const Tensor& q, const Tensor& k,
                                                    const Tensor& v,
                                                    const c10::optional<Tensor>& key_lengths,
                                                    c10::optional<double> softmax_temp,
                                                    int64_t topk) {
    ops::check_qkv(kLseTopkOp, q, k, v);
    const double temp = ops::resolve_softmax_temp(kLseTopkOp, q, softmax_temp);
    auto r = ops::call_op<kLseTopkForwardOp, full_attention_lse_topk_forward_cpu_op>(
        q, k, v, key_lengths, temp, topk);
    if (saved)
      *saved = {q, k, v, std::get<0>(r), std::get<1>(r), ops::or_undefined(key_lengths), temp};
    return r;
  }

  static variable_list backward(const Saved& s, const variable_list& grads) {
    auto grad_out = grads[0].defined() ? grads[0] : torch::zeros_like(s.out);
    auto [gq, gk, gv] = ops::call_op<kBackwardOp, full_attention_backward_cpu_op>(
        grad_out, s.q, s.k, s.v, s.out, s.lse, c10::nullopt, ops::opt(s.key_lengths),
        /*causal=*/false, s.temp, ops::opt(grads[1]), /*dropout_p=*/0.0, /*dropout_seed=*/0);
    return {gq, gk, gv};
  }
};

using FullShell = ops::Shell<FullOp>;
using LseTopkShell = ops::Shell<LseTopkOp>;

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastattn, m) {
  ops::impl_shell<FullOp>(m, "full_attention", full_attention_forward_cpu_op,
                          full_attention_backward_cpu_op);
  ops::impl_shell<LseTopkOp>(m, "full_attention_lse_topk", full_attention_lse_topk_forward_cpu_op);
}

Tensor full_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                      const std::optional<Tensor>& attn_mask,
                      const std::optional<Tensor>& key_lengths, bool causal,
                      std::optional<double> softmax_temp, double dropout_p,
                      std::optional<int64_t> dropout_seed) {
  ops::check_defined("fastattn::full_attention", {"q", "k", "v"}, {q, k, v});
  return ops::call_op<kOp, FullShell::no_grad>(q, k, v, to_c10(attn_mask), to_c10(key_lengths),
                                               causal, to_c10(softmax_temp), dropout_p,
                                               to_c10(dropout_seed));
}

std::tuple<Tensor, Tensor, Tensor> full_attention_lse_topk(const Tensor& q, const Tensor& k,
                                                           const Tensor& v,
                                                           const std::optional<Tensor>& key_lengths,
                                                           std::optional<double> softmax_temp,
                                                           int64_t topk) {
  ops::check_defined(kLseTopkOp, {"q", "k", "v"}, {q, k, v});
  return ops::call_op<kLseTopkOp, LseTopkShell::no_grad>(q, k, v, to_c10(key_lengths),
                                                         to_c10(softmax_temp), topk);
}

namespace ops {

void check_full_attention_inputs(const Tensor& q, const Tensor& k, const Tensor& v,
                                 const c10::optional<Tensor>& attn_mask,
                                 const c10::optional<Tensor>& key_lengths) {
  check_qkv(kOp, q, k, v);
  check_masks(kOp, q, k.size(2), to_std(attn_mask), to_std(key_lengths));
}

void check_full_attention_grads(const Tensor& grad_out, const Tensor& out, const Tensor& lse,
                                const c10::optional<Tensor>& grad_lse) {
  TORCH_CHECK(grad_out.sizes() == out.sizes(), kOp, ": grad_out must have shape ", out.sizes(),
              ", got ", grad_out.sizes());
  TORCH_CHECK(!grad_lse || grad_lse->sizes() == lse.sizes(), kOp, ": grad_lse must have shape ",
              lse.sizes(), ", got ", grad_lse ? grad_lse->sizes() : torch::IntArrayRef{});
}

void check_lse_topk_inputs(const Tensor& q, const Tensor& k, const Tensor& v,
                           const c10::optional<Tensor>& key_lengths, int64_t topk) {
  check_qkv(kLseTopkOp, q, k, v);
  check_masks(kLseTopkOp, q, k.size(2), std::nullopt, to_std(key_lengths));
  TORCH_CHECK(topk >= 0 && topk <= k.size(2), kLseTopkOp, ": topk must be in [0, S] = [0, ",
              k.size(2), "], got ", topk);
}

Tensor stable_topk_indices(const Tensor& scores, int64_t k) {
  const int64_t S = scores.size(-1);
  TORCH_CHECK(k >= 1 && k <= S, "stable_topk_indices: k must be in [1, S] = [1, ", S, "], got ", k);
  Tensor idx;  // the selected columns in increasing order
#ifdef FASTATTN_WITH_CUDA
  if (scores.is_cuda()) idx = stable_topk_select_cuda(scores, k);
#endif
  if (!idx.defined()) {
    const auto t = std::get<0>(scores.topk(k, -1, /*largest=*/true, /*sorted=*/false))
                       .amin(-1, /*keepdim=*/true);  // the k-th largest value
    // Running count of the selected columns: all above t, then the first
    // k - #(above t) equal to t. It steps by one exactly at a selected column.
    auto count = scores.gt(t).cumsum(-1, torch::kInt);
    const auto need = count.narrow(-1, S - 1, 1).neg().add_(k);
    auto at_t = scores.eq(t).cumsum(-1, torch::kInt);
    at::minimum_out(at_t, at_t, need);
    count.add_(at_t);
    at_t = Tensor();
    auto shape = scores.sizes().vec();
    shape.back() = k;
    const auto targets =
        torch::arange(1, k + 1, count.options()).expand(shape).contiguous();  // 1, ..., k
    // Clamped for rows holding NaN (never all selected).
    idx = torch::searchsorted(count, targets).clamp_max_(S - 1);
  }
  const auto order =
      std::get<1>(scores.gather(-1, idx).sort(/*stable=*/true, /*dim=*/-1, /*descending=*/true));
  return idx.gather(-1, order);
}

namespace {

// a (..., M, K) · b (..., K, N) for few rows M and a long K: batched GEMMs
// over slices of 1024 of K, summed (cuBLAS runs the plain product as a few
// output tiles, each over the whole K: too few blocks to fill the GPU, as
// measured for 100 centroids over 16384 keys on an H200).
Tensor matmul_split_k(const Tensor& a, const Tensor& b) {
  constexpr int64_t kSlice = 1024;
  const int64_t K = a.size(-1), slices = K / kSlice, K0 = slices * kSlice;
  if (slices < 2) return torch::matmul(a, b);
  auto a_sizes = a.sizes().vec(), b_sizes = b.sizes().vec();
  a_sizes.back() = kSlice;  // (..., M, K0) -> (..., M, slices, kSlice)
  a_sizes.insert(a_sizes.end() - 1, slices);
  b_sizes[b_sizes.size() - 2] = kSlice;  // (..., K0, N) -> (..., slices, kSlice, N)
  b_sizes.insert(b_sizes.end() - 2, slices);
  const auto as = a.narrow(-1, 0, K0).reshape(a_sizes).transpose(-3, -2);
  const auto bs = b.narrow(-2, 0, K0).reshape(b_sizes);
  auto out = torch::matmul(as, bs).sum(-3);  // (..., M, N)
  if (K0 < K) out.add_(torch::matmul(a.narrow(-1, K0, K - K0), b.narrow(-2, K0, K - K0)));
  return out;
}

}  // namespace

std::tuple<Tensor, Tensor, Tensor> full_attention_dense(const Tensor& q, const Tensor& k,
                                                        const Tensor& v,
                                                        const c10::optional<Tensor>& key_lengths,
                                                        bool causal, double softmax_temp,
                                                        int64_t topk) {
  check_lse_topk_inputs(q, k, v, key_lengths, topk);
  TORCH_CHECK(!causal || topk == 0, "full_attention_dense: no top-k with the causal mask");
  const int64_t N = q.size(0), H = q.size(1), L = q.size(2), S = k.size(2);
  auto scores = torch::matmul(q.to(torch::kFloat), k.to(torch::kFloat).transpose(-1, -2))
                    .mul_(softmax_temp);  // (N, H, L, S)
  constexpr double kMinusInf = -std::numeric_limits<double>::infinity();
  const auto cols = torch::arange(S, q.options().dtype(torch::kLong));
  if (key_lengths) {
    const auto len = key_lengths->to(q.device(), torch::kLong).view({N, 1, 1, 1});
    scores.masked_fill_(cols.view({1, 1, 1, S}).ge(len), kMinusInf);
  }
  if (causal) {  // query i keeps the keys j <= i + S - L
    const auto last = torch::arange(S - L, S, cols.options()).view({L, 1});
    scores.masked_fill_(cols.view({1, S}).gt(last), kMinusInf);
  }
  auto idx = topk > 0 && N * H * L > 0
                 ? stable_topk_indices(scores, topk)
                 : torch::empty({N, H, L, topk}, q.options().dtype(torch::kLong));
  auto lse = scores.logsumexp(-1);  // -inf for rows without a kept key
  scores.sub_(lse.masked_fill(lse.isinf(), 0).unsqueeze(-1)).exp_();
  auto out = matmul_split_k(scores, v.to(torch::kFloat)).to(q.scalar_type());
  return {out, lse, idx};
}

std::tuple<Tensor, Tensor, Tensor> full_attention_lse_topk_cpu(
    const Tensor& q, const Tensor& k, const Tensor& v, const c10::optional<Tensor>& key_lengths,
    double softmax_temp, int64_t topk, double dropout_p, int64_t dropout_seed) {
  ops::check_lse_topk_inputs(q, k, v, key_lengths, topk);
  ops::check_dropout(kLseTopkOp, dropout_p);
  if (ops::is_reduced_float(q))
    return ops::in_float32<1>(q.scalar_type(), full_attention_lse_topk_cpu, q, k, v, key_lengths,
                              softmax_temp, topk, dropout_p, dropout_seed);
  const auto p = ops::full_attention_inputs(q, k, v, c10::nullopt, key_lengths);
  const int64_t N = q.size(0), H = q.size(1), L = q.size(2);
  auto out = ops::empty_output({N, H, L, v.size(3)}, q.options());
  auto lse = torch::empty({N, H, L}, q.options());
  auto idx = torch::empty({N, H, L, topk}, q.options().dtype(torch::kLong));
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "full_attention_lse_topk_forward_cpu_op", [&] {
    kernels::FullAttentionForwardArgs<scalar_t> a;
    ops::fill_full_attention_args(a, kOp, p, /*causal=*/false, softmax_temp);
    a.out = out.data_ptr<scalar_t>();
    a.lse = lse.data_ptr<scalar_t>();
    ops::set_dropout_args(a, dropout_p, dropout_seed);
    a.topk = topk;
    a.top_idx = idx.data_ptr<int64_t>();
    kernels::full_attention_forward_cpu(a);
  });
  return {out, lse, idx};
}

void full_attention_backward_accumulate(const Tensor& grad_out, const Tensor& grad_lse,
                                        const Tensor& q, const Tensor& k, const Tensor& v,
                                        const Tensor& out, const Tensor& lse,
                                        const std::optional<Tensor>& key_lengths,
                                        double softmax_temp, Tensor& grad_q, Tensor& grad_k,
                                        Tensor& grad_v, double dropout_p, int64_t dropout_seed) {
  if (q.is_cuda()) {
    TORCH_CHECK(dropout_p == 0,
                "full_attention_backward_accumulate: attention dropout is CPU-only so far");
    TORCH_CHECK(grad_q.is_contiguous() && grad_k.is_contiguous() && grad_v.is_contiguous(),
                "full_attention_backward_accumulate: gradient buffers must be contiguous");
#ifdef FASTATTN_WITH_CUDA
    full_attention_backward_accumulate_cuda(grad_out, grad_lse, q, k, v, out, lse, key_lengths,
                                            softmax_temp, grad_q, grad_k, grad_v);
    return;
#else
    TORCH_CHECK(false, "full_attention_backward_accumulate: this build has no CUDA operators");
#endif
  }
  const auto p = ops::full_attention_inputs(q, k, v, c10::nullopt, to_c10(key_lengths));
  auto go = grad_out.to(q.scalar_type()).contiguous();
  auto delta =
      (ops::row_dots(go, out.to(go.scalar_type())) - grad_lse.to(q.scalar_type())).contiguous();
  auto lse_c = lse.contiguous();
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "full_attention_backward_accumulate", [&] {
    kernels::FullAttentionBackwardArgs<scalar_t> a;
    ops::fill_full_attention_args(a, kOp, p, /*causal=*/false, softmax_temp);
    ops::set_dropout_args(a, dropout_p, dropout_seed);
    a.grad_out = go.data_ptr<scalar_t>();
    a.lse = lse_c.data_ptr<scalar_t>();
    a.delta = delta.data_ptr<scalar_t>();
    ops::set_qkv_grads<scalar_t>(a, grad_q, grad_k, grad_v);
    // Any row layout (kernels/common/rows.h): the gradients of the layers' views.
    a.grad_q_rows = ops::row_strides(grad_q);
    a.grad_k_rows = ops::row_strides(grad_k);
    a.grad_v_rows = ops::row_strides(grad_v);
    a.accumulate = true;
    kernels::full_attention_backward_cpu(a);
  });
}

FullAttentionInputs full_attention_inputs(const Tensor& q, const Tensor& k, const Tensor& v,
                                          const c10::optional<Tensor>& attn_mask,
                                          const c10::optional<Tensor>& key_lengths) {
  FullAttentionInputs p{qkv_inputs(q, k, v, key_lengths), {}};
  if (attn_mask) {
    p.mask = broadcast_mask(additive_mask(*attn_mask, q.scalar_type()).contiguous(), q.size(0),
                            q.size(1), q.size(2), k.size(2));
  }
  return p;
}

}  // namespace ops

}  // namespace fastattn
