// The aft_attention operator (Zhai et al. 2021, "An Attention Free
// Transformer", eq. 2): input checks, the forward and backward on the CPU
// and CUDA, the autograd function, the C++ entry point and the plain-ATen
// reference.
//   q, k, v (N,H,L|S,E), position_bias (L,S) or (H,L,S) or none -> (N,H,L,E)
//   out_t = sigmoid(q_t) ⊙ Σ_s exp(k_s + w_ts) ⊙ v_s / Σ_s exp(k_s + w_ts)
// element-wise in the channels, over the keys row t sees (causal: s <= t +
// S - L; s < key_lengths[n]); a row without keys gives zeros.
//
// Two ways to compute it:
// - Without a position bias on the CPU (AFT-simple): the scans of
//   kernels/aft/aft.h, O(S·E) exps per (n, h), causal or not.
// - Otherwise (AFT-full; AFT-simple on CUDA): the exponent splits,
//   exp(k_sc + w_ts) = exp(w_ts - m_t)·exp(k_sc - M_c)·exp(m_t + M_c) with
//   m_t the row maximum of w over the row's keys and M_c the channel maximum
//   of k, and the common factor cancels in the ratio, so numerator and
//   denominator are two matrix products of Ew = exp(w - m) (L×S) with
//   Ek ⊙ V and Ek (S×E): O(L·S·E) multiply-adds on BLAS / cuBLAS and
//   O(L·S + S·E) exps. A 2-D bias is shared by every head and batch item:
//   one product over all of them. Under causal the products go by blocks of
//   rows, each over the keys its rows see (about half the work). An element
//   whose denominator falls below
//   2^-60 (float32; 2^-800 float64), where the split's two factors lose it
//   to underflow, is recomputed exactly (a log-sum-exp over its keys).
// Saved for the backward: a (the average before the gate) and lse (log of
// the denominator), both (N,H,L,E). The backward is the same products
// transposed: with G = da / den' (da = dout ⊙ sigmoid(q), den' the split's
// denominator),
//   dv = Ek ⊙ (Ewᵀ G),  dk = Ek ⊙ (v ⊙ (Ewᵀ G) - Ewᵀ (G ⊙ a)),
//   dw = Ew ⊙ (G (Ek ⊙ v)ᵀ - (G ⊙ a) Ekᵀ)   (summed over what shares w),
// and the exactly recomputed elements' terms added exactly.
// Tested by tests/cpp/test_aft.cpp.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <vector>

#include "fastattn/ops.h"
#include "kernels/aft/aft.h"
#include "ops/mask_util.h"
#include "ops/op_shell.h"
#include "ops/op_util.h"

namespace fastattn {
namespace {

using torch::Tensor;
using torch::autograd::variable_list;

constexpr char kOp[] = "fastattn::aft_attention";
constexpr double kInf = std::numeric_limits<double>::infinity();

void check_inputs(const Tensor& q, const Tensor& k, const Tensor& v,
                  const c10::optional<Tensor>& position_bias,
                  const c10::optional<Tensor>& key_lengths) {
  ops::check_qkv(kOp, q, k, v);
  const int64_t H = q.size(1), L = q.size(2), S = k.size(2), E = q.size(3);
  TORCH_CHECK(v.size(3) == E, kOp, ": AFT works channel by channel: v must have the width E = ", E,
              " of q and k, got ", v.size(3));
  ops::check_masks(kOp, q, S, std::nullopt, to_std(key_lengths));
  if (!position_bias) return;
  const auto& w = *position_bias;
  TORCH_CHECK((w.dim() == 2 && w.size(0) == L && w.size(1) == S) ||
                  (w.dim() == 3 && w.size(0) == H && w.size(1) == L && w.size(2) == S),
              kOp, ": position_bias must have shape (L, S) = (", L, ", ", S, ") or (H, L, S) = (",
              H, ", ", L, ", ", S, "), got ", w.sizes());
  TORCH_CHECK(w.scalar_type() == q.scalar_type(), kOp, ": position_bias must have q's dtype ",
              q.scalar_type(), ", got ", w.scalar_type());
  TORCH_CHECK(w.device() == q.device(), kOp, ": position_bias must be on q's device ", q.device(),
              ", got ", w.device());
}

// The dtype the operator computes in: float32 for float16 / bfloat16.
torch::ScalarType compute_dtype(const Tensor& q) { return ops::stats_dtype(q); }

double split_threshold(torch::ScalarType dtype) {
  return std::ldexp(1.0, dtype == torch::kDouble ? -800 : -60);
}

// Batch items computed together: all of them without key lengths, one by
// one with (their lengths read on the host).
struct Group {
  int64_t n0, count, len;
};
std::vector<Group> groups(const Tensor& q, int64_t S, const c10::optional<Tensor>& key_lengths) {
  const int64_t N = q.size(0);
  if (!key_lengths || N == 0) return {{0, N, S}};
  auto lengths = key_lengths->to(torch::kCPU, torch::kLong).contiguous();
  std::vector<Group> g;
  for (int64_t n = 0; n < N; ++n) g.push_back({n, 1, lengths.data_ptr<int64_t>()[n]});
  return g;
}

// The bias side of the split: wm = w with -inf where row t does not see key
// s, m its row maximum (0 for a row without keys), Ew = exp(wm - m); all
// (Hw, L, S) / (Hw, L, 1). Without a bias w = 0.
struct BiasSide {
  Tensor wm, m, Ew;
};
BiasSide bias_side(const Tensor& w3, int64_t L, int64_t S, int64_t len, bool causal,
                   const torch::TensorOptions& opt) {
  BiasSide b;
  b.wm = w3.defined() ? w3 : torch::zeros({1, L, S}, opt);
  if (causal || len < S) {  // (otherwise every row sees every key: w as it is)
    auto s = torch::arange(S, opt.dtype(torch::kLong));
    auto seen = s.lt(len).view({1, S}).expand({L, S});
    if (causal) {
      auto t = torch::arange(L, opt.dtype(torch::kLong)).view({L, 1}) + (S - L);
      seen = seen & s.view({1, S}).le(t);
    }
    b.wm = b.wm.masked_fill(seen.logical_not(), -kInf);
  }
  b.m = b.wm.amax(-1, true);
  b.m.masked_fill_(b.m.eq(-kInf), 0.0);
  b.Ew = (b.wm - b.m).exp_();
  return b;
}

// The key side: km = k with -inf from len on, M its channel maximum (0 when
// no key), Ek = exp(km - M); (g, H, S, E) / (g, H, 1, E).
struct KeySide {
  Tensor km, M, Ek;
};
KeySide key_side(const Tensor& k, int64_t len) {
  KeySide r;
  r.km = k;
  if (len < k.size(2)) {
    r.km = k.clone();
    r.km.narrow(2, len, k.size(2) - len).fill_(-kInf);
  }
  r.M = r.km.amax(2, true);
  r.M.masked_fill_(r.M.eq(-kInf), 0.0);
  r.Ek = (r.km - r.M).exp_();
  return r;
}

// Row blocks of a product: one block, or under causal about a sixteenth of
// the rows each (>= 64), so that each block multiplies only the keys (or
// queries) its rows can see: about half the work of the whole square.
std::vector<std::pair<int64_t, int64_t>> row_blocks(int64_t R, bool causal) {
  if (!causal) return {{0, R}};
  const int64_t b = std::max<int64_t>(64, (R + 15) / 16);
  std::vector<std::pair<int64_t, int64_t>> out;
  for (int64_t r0 = 0; r0 < R; r0 += b) out.push_back({r0, std::min(R, r0 + b)});
  return out;
}

// A (Hw, R, K) times Bm (Hw, K, X) -> (Hw, R, X), where the rows [r0, r1)
// of A are zero outside the inner indices inner(r0, r1) = [lo, hi).
template <typename Inner>
Tensor banded_bmm(const Tensor& A, const Tensor& Bm, bool causal, Inner inner) {
  const auto blocks = row_blocks(A.size(1), causal);
  if (blocks.size() == 1) return A.bmm(Bm);
  auto out = torch::zeros({A.size(0), A.size(1), Bm.size(2)}, Bm.options());
  for (const auto& [r0, r1] : blocks) {
    const auto [lo, hi] = inner(r0, r1);
    if (hi <= lo) continue;
    out.narrow(1, r0, r1 - r0)
        .copy_(A.narrow(1, r0, r1 - r0).narrow(2, lo, hi - lo).bmm(Bm.narrow(1, lo, hi - lo)));
  }
  return out;
}

// Σ_k A[h, r, k] B[i, h, k, :] for B (g, H, K, X) -> (g, H, R, X); A
// (Hw, R, K) with Hw = 1 (shared: one product over every item and head) or H.
template <typename Inner>
Tensor apply_bias(const Tensor& A, const Tensor& B, bool causal, Inner inner) {
  const int64_t g = B.size(0), H = B.size(1), K = B.size(2), X = B.size(3), R = A.size(1);
  if (A.size(0) == 1) {
    auto Rm = banded_bmm(A, B.permute({2, 0, 1, 3}).reshape({1, K, g * H * X}), causal, inner);
    return Rm.view({R, g, H, X}).permute({1, 2, 0, 3});
  }
  auto Rm = banded_bmm(A, B.permute({1, 2, 0, 3}).reshape({H, K, g * X}), causal, inner);
  return Rm.view({H, R, g, X}).permute({2, 0, 1, 3});
}

// Σ over what shares the bias of C[i, h] B[i, h]ᵀ: C (g, H, L, X), B (g, H,
// S, X) -> (Hw, L, S); under causal only the keys each row block sees
// (the rest is zero).
Tensor bias_products(const Tensor& C, const Tensor& B, int64_t Hw, bool causal) {
  const int64_t g = C.size(0), H = C.size(1), L = C.size(2), S = B.size(2), X = C.size(3);
  const int64_t Y = Hw == 1 ? g * H * X : g * X;
  const auto rows = [&](const Tensor& T, int64_t n) {
    return Hw == 1 ? T.permute({2, 0, 1, 3}).reshape({1, n, Y})
                   : T.permute({1, 2, 0, 3}).reshape({H, n, Y});
  };
  const auto Cl = rows(C, L), Bs = rows(B, S);
  const auto blocks = row_blocks(L, causal);
  if (blocks.size() == 1) return Cl.bmm(Bs.transpose(1, 2));
  auto out = torch::zeros({Hw, L, S}, C.options());
  for (const auto& [t0, t1] : blocks) {
    const int64_t hi = std::min(S, t1 + (S - L));
    if (hi <= 0) continue;
    out.narrow(1, t0, t1 - t0)
        .narrow(2, 0, hi)
        .copy_(Cl.narrow(1, t0, t1 - t0).bmm(Bs.narrow(1, 0, hi).transpose(1, 2)));
  }
  return out;
}

// The elements recomputed exactly: their indices (i, h, t, c) in the group
// and, over the keys, x = k[i,h,:,c] + w[h,t,:] (F, S) with -inf where
// unseen, and v[i,h,:,c].
struct Exact {
  Tensor i, h, t, c, x, v;
};
Exact exact_elements(const Tensor& where, const KeySide& ks, const BiasSide& bs, const Tensor& v) {
  Exact e;
  auto idx = where.nonzero();
  e.i = idx.select(1, 0);
  e.h = idx.select(1, 1);
  e.t = idx.select(1, 2);
  e.c = idx.select(1, 3);
  auto hw = bs.wm.size(0) == 1 ? torch::zeros_like(e.h) : e.h;
  auto kT = ks.km.transpose(2, 3);  // (g, H, E, S)
  e.x = kT.index({e.i, e.h, e.c}) + bs.wm.index({hw, e.t});
  e.v = v.transpose(2, 3).index({e.i, e.h, e.c});
  return e;
}

// The forward in the split form (any device): (out, a, lse) in q's compute dtype.
std::tuple<Tensor, Tensor, Tensor> split_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                                 const Tensor& w3,
                                                 const c10::optional<Tensor>& key_lengths,
                                                 bool causal) {
  const int64_t H = q.size(1), L = q.size(2), S = k.size(2), E = q.size(3);
  const double thr = split_threshold(q.scalar_type());
  std::vector<Tensor> as, ls;  // per group
  for (const auto& gr : groups(q, S, key_lengths)) {
    if (L == 0 || gr.len == 0 || gr.count == 0) {  // no keys: zeros, -inf
      as.push_back(torch::zeros({gr.count, H, L, E}, q.options()));
      ls.push_back(torch::full({gr.count, H, L, E}, -kInf, q.options()));
      continue;
    }
    const auto kg = k.narrow(0, gr.n0, gr.count), vg = v.narrow(0, gr.n0, gr.count);
    const auto bs = bias_side(w3, L, S, gr.len, causal, q.options());
    const auto ks = key_side(kg, gr.len);
    // Row t sees the keys [0, t + S - L].
    auto R =
        apply_bias(bs.Ew, torch::cat({ks.Ek * vg, ks.Ek}, -1), causal, [&](int64_t t0, int64_t t1) {
          return std::pair<int64_t, int64_t>{0, std::min(S, t1 + (S - L))};
        });
    auto num = R.narrow(-1, 0, E), den = R.narrow(-1, E, E);
    auto ag = (num / den).contiguous();
    auto lg = den.log().add_(bs.m.unsqueeze(0)).add_(ks.M).contiguous();
    // Rows without keys have den = 0 exactly and become (0, -inf); others
    // below the threshold are recomputed.
    auto low = den.le(thr);
    if (low.any().item<bool>()) {
      ag.masked_fill_(low, 0.0);
      lg.masked_fill_(low, -kInf);
      auto rows = bs.wm.amax(-1).gt(-kInf).unsqueeze(0).unsqueeze(-1);  // (1, Hw, L, 1)
      auto redo = low & rows;
      if (redo.any().item<bool>()) {
        const auto e = exact_elements(redo, ks, bs, vg);
        auto l = torch::logsumexp(e.x, -1);
        auto seen = l.gt(-kInf);
        auto p = torch::exp(e.x - l.masked_fill(seen.logical_not(), 0.0).unsqueeze(-1));
        ag.index_put_({e.i, e.h, e.t, e.c},
                      torch::where(seen, (p * e.v).sum(-1), torch::zeros_like(l)));
        lg.index_put_({e.i, e.h, e.t, e.c}, l);
      }
    }
    as.push_back(ag);
    ls.push_back(lg);
  }
  auto a = as.size() == 1 ? as[0] : torch::cat(as, 0);
  auto lse = ls.size() == 1 ? ls[0] : torch::cat(ls, 0);
  return {(torch::sigmoid(q) * a).contiguous(), a, lse};
}

// The backward in the split form: (dq, dk, dv, dw or undefined).
std::tuple<Tensor, Tensor, Tensor, Tensor> split_backward(
    const Tensor& go, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& w3,
    const Tensor& a, const Tensor& lse, const c10::optional<Tensor>& key_lengths, bool causal) {
  const int64_t L = q.size(2), S = k.size(2), E = q.size(3);
  const auto sg = torch::sigmoid(q);
  const auto da = go * sg;
  auto dq = go * a * sg * (1 - sg);
  auto dk = torch::zeros_like(k), dv = torch::zeros_like(v);
  Tensor dw = w3.defined() ? torch::zeros_like(w3) : Tensor();
  const double log_thr = std::log(split_threshold(q.scalar_type()));
  if (L == 0 || S == 0) return {dq, dk, dv, dw};
  for (const auto& gr : groups(q, S, key_lengths)) {
    if (gr.len == 0) continue;
    const auto sl = [&](const Tensor& t) { return t.narrow(0, gr.n0, gr.count); };
    const auto kg = sl(k), vg = sl(v), ag = sl(a), lg = sl(lse), dag = sl(da);
    const auto bs = bias_side(w3, L, S, gr.len, causal, q.options());
    const auto ks = key_side(kg, gr.len);
    // log of the split's denominator; G = da / den' where it is above the threshold.
    auto rel = lg - bs.m.unsqueeze(0) - ks.M;
    auto split = rel.ge(log_thr) & lg.gt(-kInf);
    auto G = torch::where(split, dag * torch::exp(-rel.masked_fill(split.logical_not(), 0.0)),
                          torch::zeros_like(rel));
    auto C = torch::cat({G, G * ag}, -1);
    // Key s is seen by the rows [s - (S - L), L).
    auto RT =
        apply_bias(bs.Ew.transpose(1, 2), C, causal,  // (g, H, S, 2E)
                   [&](int64_t s0, int64_t) {
                     return std::pair<int64_t, int64_t>{std::max<int64_t>(0, s0 - (S - L)), L};
                   });
    auto R1 = RT.narrow(-1, 0, E), R2 = RT.narrow(-1, E, E);
    sl(dv).copy_(ks.Ek * R1);
    sl(dk).copy_(ks.Ek * (vg * R1 - R2));
    if (dw.defined()) {
      dw.add_(bs.Ew *
              bias_products(C, torch::cat({ks.Ek * vg, -ks.Ek}, -1), bs.Ew.size(0), causal));
    }
    auto redo = split.logical_not() & lg.gt(-kInf);
    if (!redo.any().item<bool>()) continue;
    const auto e = exact_elements(redo, ks, bs, vg);
    auto p = torch::exp(e.x - lg.index({e.i, e.h, e.t, e.c}).unsqueeze(-1));  // (F, S)
    auto cv = dag.index({e.i, e.h, e.t, e.c}).unsqueeze(-1) * p;
    auto ck = cv * (e.v - ag.index({e.i, e.h, e.t, e.c}).unsqueeze(-1));
    const int64_t F = p.size(0);
    auto s = torch::arange(S, e.i.options()).view({1, S}).expand({F, S});
    auto col = [&](const Tensor& x) { return x.unsqueeze(-1).expand({F, S}); };
    sl(dv).index_put_({col(e.i), col(e.h), s, col(e.c)}, cv, true);
    sl(dk).index_put_({col(e.i), col(e.h), s, col(e.c)}, ck, true);
    if (dw.defined()) {
      auto hw = dw.size(0) == 1 ? torch::zeros_like(e.h) : e.h;
      dw.index_put_({col(hw), col(e.t), s}, ck, true);
    }
  }
  return {dq, dk, dv, dw};
}

Tensor bias3(const c10::optional<Tensor>& position_bias, torch::ScalarType dtype) {
  if (!position_bias) return {};
  auto w = position_bias->to(dtype);
  return w.dim() == 2 ? w.unsqueeze(0) : w;
}

// The scan kernels' inputs (contiguous q, k, v of the compute dtype; int64
// key lengths or undefined).
template <typename T>
kernels::AftScanArgs<T> scan_args(const Tensor& q, const Tensor& k, const Tensor& v,
                                  const Tensor& lengths, bool causal) {
  kernels::AftScanArgs<T> s;
  s.q = q.data_ptr<T>();
  s.k = k.data_ptr<T>();
  s.v = v.data_ptr<T>();
  s.key_lengths = lengths.defined() ? lengths.data_ptr<int64_t>() : nullptr;
  s.causal = causal;
  s.N = q.size(0), s.H = q.size(1), s.L = q.size(2), s.S = k.size(2), s.E = q.size(3);
  s.num_threads = at::get_num_threads();
  return s;
}

// (out, a, lse): out in q's dtype, a and lse in the compute dtype.
std::tuple<Tensor, Tensor, Tensor> aft_attention_forward_cpu_op(
    const Tensor& q, const Tensor& k, const Tensor& v, const c10::optional<Tensor>& position_bias,
    const c10::optional<Tensor>& key_lengths, bool causal, bool need_stats) {
  check_inputs(q, k, v, position_bias, key_lengths);
  const auto ct = compute_dtype(q);
  auto qc = q.to(ct).contiguous(), kc = k.to(ct).contiguous(), vc = v.to(ct).contiguous();
  Tensor out, a, lse;
  if (!position_bias && q.is_cpu()) {
    out = torch::empty_like(qc);
    a = need_stats ? torch::empty_like(out) : torch::empty({0}, qc.options());
    lse = need_stats ? torch::empty_like(out) : torch::empty({0}, qc.options());
    auto lengths = key_lengths ? key_lengths->to(torch::kLong).contiguous() : Tensor();
    AT_DISPATCH_FLOATING_TYPES(ct, "aft_attention_forward_cpu", [&] {
      auto s = scan_args<scalar_t>(qc, kc, vc, lengths, causal);
      s.out = out.data_ptr<scalar_t>();
      s.a = need_stats ? a.data_ptr<scalar_t>() : nullptr;
      s.lse = need_stats ? lse.data_ptr<scalar_t>() : nullptr;
      kernels::aft_scan_forward_cpu(s);
    });
  } else {
    std::tie(out, a, lse) =
        split_forward(qc, kc, vc, bias3(position_bias, ct), key_lengths, causal);
  }
  if (!need_stats) {  // two tensors: outputs of an operator must not alias
    a = torch::empty({0}, out.options());
    lse = torch::empty({0}, out.options());
  }
  return {out.to(q.scalar_type()), a, lse};
}

// (grad_q, grad_k, grad_v, grad_position_bias): the last empty without a bias.
std::tuple<Tensor, Tensor, Tensor, Tensor> aft_attention_backward_cpu_op(
    const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
    const c10::optional<Tensor>& position_bias, const Tensor& a, const Tensor& lse,
    const c10::optional<Tensor>& key_lengths, bool causal) {
  check_inputs(q, k, v, position_bias, key_lengths);
  const auto ct = compute_dtype(q);
  TORCH_CHECK(grad_out.sizes() == q.sizes(), kOp, ": grad_out must have q's shape ", q.sizes(),
              ", got ", grad_out.sizes());
  TORCH_CHECK(a.sizes() == q.sizes() && lse.sizes() == q.sizes() && a.scalar_type() == ct &&
                  lse.scalar_type() == ct,
              kOp, ": a and lse must be ", ct, " of q's shape ", q.sizes(), ", got ",
              a.scalar_type(), " ", a.sizes(), " and ", lse.scalar_type(), " ", lse.sizes());
  auto go = grad_out.to(ct).contiguous(), qc = q.to(ct).contiguous(), kc = k.to(ct).contiguous(),
       vc = v.to(ct).contiguous();
  auto ac = a.contiguous(), lc = lse.contiguous();
  Tensor dq, dk, dv, dw;
  if (!position_bias && q.is_cpu()) {
    dq = torch::empty_like(qc);
    dk = torch::empty_like(kc);
    dv = torch::empty_like(vc);
    auto lengths = key_lengths ? key_lengths->to(torch::kLong).contiguous() : Tensor();
    AT_DISPATCH_FLOATING_TYPES(ct, "aft_attention_backward_cpu", [&] {
      auto s = scan_args<scalar_t>(qc, kc, vc, lengths, causal);
      s.grad_out = go.data_ptr<scalar_t>();
      s.a_in = ac.data_ptr<scalar_t>();
      s.lse_in = lc.data_ptr<scalar_t>();
      s.grad_q = dq.data_ptr<scalar_t>();
      s.grad_k = dk.data_ptr<scalar_t>();
      s.grad_v = dv.data_ptr<scalar_t>();
      kernels::aft_scan_backward_cpu(s);
    });
  } else {
    auto w3 = bias3(position_bias, ct);
    std::tie(dq, dk, dv, dw) = split_backward(go, qc, kc, vc, w3, ac, lc, key_lengths, causal);
    if (dw.defined()) dw = dw.view(position_bias->sizes()).to(position_bias->scalar_type());
  }
  const auto dt = q.scalar_type();
  return {dq.to(dt), dk.to(dt), dv.to(dt), dw.defined() ? dw : torch::empty({0}, q.options())};
}

constexpr char kForwardOp[] = "fastattn::aft_attention_forward";
constexpr char kBackwardOp[] = "fastattn::aft_attention_backward";

struct AftOp {
  struct Saved {
    Tensor q, k, v, position_bias, a, lse, key_lengths;
    bool causal = false;
    auto tensors() { return std::tie(q, k, v, position_bias, a, lse, key_lengths); }
  };

  static Tensor forward(Saved* saved, const Tensor& q, const Tensor& k, const Tensor& v,
                        const c10::optional<Tensor>& position_bias,
                        const c10::optional<Tensor>& key_lengths, bool causal) {
    // Statistics only when a gradient will be asked for.
    const bool need_stats = saved && (q.requires_grad() || k.requires_grad() || v.requires_grad() ||
                                      (position_bias && position_bias->requires_grad()));
    auto [out, a, lse] = ops::call_op<kForwardOp, aft_attention_forward_cpu_op>(
        q, k, v, position_bias, key_lengths, causal, need_stats);
    if (saved)
      *saved = {
          q,     k, v, ops::or_undefined(position_bias), a, lse, ops::or_undefined(key_lengths),
          causal};
    return out;
  }

  static variable_list backward(const Saved& s, const variable_list& grads) {
    if (!grads[0].defined()) return {};
    auto [dq, dk, dv, dw] = ops::call_op<kBackwardOp, aft_attention_backward_cpu_op>(
        grads[0], s.q, s.k, s.v, ops::opt(s.position_bias), s.a, s.lse, ops::opt(s.key_lengths),
        s.causal);
    return {dq, dk, dv, s.position_bias.defined() ? dw : Tensor()};
  }
};

using AftShell = ops::Shell<AftOp>;

}  // namespace

// The split form is ATen throughout: the same halves serve CUDA tensors
// (cuBLAS products; AFT-simple on CUDA takes the split form too).
TORCH_LIBRARY_FRAGMENT(fastattn, m) {
  ops::impl_shell<AftOp>(m, "aft_attention", aft_attention_forward_cpu_op,
                         aft_attention_backward_cpu_op);
  ops::impl_halves(m, c10::DispatchKey::CUDA, "aft_attention", aft_attention_forward_cpu_op,
                   aft_attention_backward_cpu_op);
}

Tensor aft_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                     const std::optional<Tensor>& position_bias,
                     const std::optional<Tensor>& key_lengths, bool causal) {
  ops::check_defined(kOp, {"q", "k", "v"}, {q, k, v});
  return ops::call_op<kOp, AftShell::no_grad>(q, k, v, to_c10(position_bias), to_c10(key_lengths),
                                              causal);
}

// ---- reference ----------------------------------------------------------------

namespace reference {

Tensor aft_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                     const std::optional<Tensor>& position_bias,
                     const std::optional<Tensor>& key_lengths, bool causal) {
  const int64_t N = q.size(0), H = q.size(1), L = q.size(2), S = k.size(2);
  auto keep = ops::dense_keep(N, L, S, std::nullopt, key_lengths, causal, q.device());  // (N,1,L,S)
  auto w = position_bias ? (position_bias->dim() == 2 ? position_bias->view({1, 1, L, S})
                                                      : position_bias->unsqueeze(0))
                         : torch::zeros({1, 1, L, S}, q.options());
  w = w.expand({N, H, L, S}).masked_fill(keep.logical_not(), -kInf);
  // x[n,h,t,s,c] = k[n,h,s,c] + w[n,h,t,s]; softmax over s.
  auto x = k.unsqueeze(2) + w.unsqueeze(-1);
  auto seen = keep.any(-1).unsqueeze(-1);  // (N,1,L,1)
  auto p = torch::softmax(x.masked_fill(seen.logical_not().unsqueeze(-1), 0.0), 3);
  auto avg = (p * v.unsqueeze(2)).sum(3).masked_fill(seen.logical_not(), 0.0);
  return torch::sigmoid(q) * avg;
}

}  // namespace reference
}  // namespace fastattn
