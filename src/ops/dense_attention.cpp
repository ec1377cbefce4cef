// The dense-attention engine (src/ops/dense_attention.h): its CPU route on the
// block-sparse kernels' "window" pattern, packed sequences one by one, and the
// logsumexp merge.
#include "ops/dense_attention.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>
#include <torch/version.h>

#include <atomic>
#include <cstdlib>
#include <limits>
#include <string>

#include "ops/op_shell.h"
#include "ops/op_util.h"

// PyTorch's flash attention ops with windows: torch >= 2.4 (their signature
// of 2.4-2.15 up to the window arguments, which is all this file passes).
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
#define FASTATTN_FLASH_OPS 1
#include <ATen/ops/_efficient_attention_backward.h>
#include <ATen/ops/_efficient_attention_forward.h>
#include <ATen/ops/_flash_attention_backward.h>
#include <ATen/ops/_flash_attention_forward.h>
#endif

namespace fastattn::ops {
namespace {

using torch::Tensor;

constexpr const char* kOp = "fastattn dense attention";

// The block-sparse "window" pattern's [left, right] for a spec (unbounded:
// the largest offset, which the kernels cut to what the positions need).
std::vector<int64_t> window_params(const DenseAttentionSpec& spec) {
  constexpr int64_t kUnbounded = std::numeric_limits<int64_t>::max();
  return {spec.window_left < 0 ? kUnbounded : spec.window_left,
          spec.window_right < 0 ? kUnbounded : spec.window_right};
}

void check_spec(const DenseAttentionSpec& spec) {
  TORCH_CHECK(std::isfinite(spec.scale), kOp, ": scale must be finite, got ", spec.scale);
  TORCH_CHECK(spec.window_left >= -1 && spec.window_right >= -1, kOp,
              ": window_left and window_right must be >= 0, or -1 for no bound, got ",
              spec.window_left, " and ", spec.window_right);
  TORCH_CHECK(spec.cu_seqlens_q.has_value() == spec.cu_seqlens_k.has_value(), kOp,
              ": cu_seqlens_q and cu_seqlens_k come together (the packed layout)");
  TORCH_CHECK(!spec.packed() || !spec.key_lengths, kOp,
              ": key_lengths apply to the padded layout; packed sequences have their lengths");
}

std::tuple<Tensor, Tensor> padded_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                          const DenseAttentionSpec& spec) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("fastattn::block_sparse_attention_forward", "")
          .typed<std::tuple<Tensor, Tensor>(
              const Tensor&, const Tensor&, const Tensor&, c10::string_view, c10::IntArrayRef,
              const c10::optional<Tensor>&, bool, double, double, int64_t)>();
  return op.call(q, k, v, "window", window_params(spec), spec.key_lengths, spec.causal, spec.scale,
                 /*dropout_p=*/0.0, /*dropout_seed=*/0);
}

std::tuple<Tensor, Tensor, Tensor> padded_backward(const Tensor& grad_out, const Tensor& q,
                                                   const Tensor& k, const Tensor& v,
                                                   const Tensor& out, const Tensor& lse,
                                                   const DenseAttentionSpec& spec) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("fastattn::block_sparse_attention_backward", "")
                       .typed<std::tuple<Tensor, Tensor, Tensor>(
                           const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                           const Tensor&, const Tensor&, c10::string_view, c10::IntArrayRef,
                           const c10::optional<Tensor>&, bool, double, double, int64_t)>();
  return op.call(grad_out, q, k, v, out, lse, "window", window_params(spec), spec.key_lengths,
                 spec.causal, spec.scale, /*dropout_p=*/0.0, /*dropout_seed=*/0);
}

// The packed layout's offsets on the host, checked against the row counts.
std::vector<int64_t> offsets(const Tensor& cu, const char* name, int64_t rows) {
  TORCH_CHECK(cu.dim() == 1 && cu.numel() >= 1 && !cu.is_floating_point(), kOp, ": ", name,
              " must be a 1-d integer tensor of B + 1 offsets, got ", cu.scalar_type(), " ",
              cu.sizes());
  auto c = cu.to(torch::kCPU, torch::kLong).contiguous();
  std::vector<int64_t> o(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
  TORCH_CHECK(o.front() == 0 && o.back() == rows, kOp, ": ", name,
              " must start at 0 and end at the number of rows (", rows, "), got ", o.front(),
              " ... ", o.back());
  for (size_t b = 1; b < o.size(); ++b)
    TORCH_CHECK(o[b] >= o[b - 1], kOp, ": ", name, " must not decrease, got ", o[b - 1], " then ",
                o[b], " at ", b);
  return o;
}

// Sequence b of a packed (T, H, D) tensor as a (1, H, rows, D) view.
Tensor sequence(const Tensor& x, int64_t begin, int64_t end) {
  return x.narrow(0, begin, end - begin).transpose(0, 1).unsqueeze(0);
}

struct Packed {
  std::vector<int64_t> cq, ck;
};

Packed check_packed(const Tensor& q, const Tensor& k, const Tensor& v,
                    const DenseAttentionSpec& spec) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, kOp,
              ": packed sequences take q (Tq, H, E), k (Tk, H, E), v (Tk, H, M), got q ", q.sizes(),
              ", k ", k.sizes(), ", v ", v.sizes());
  Packed p{offsets(*spec.cu_seqlens_q, "cu_seqlens_q", q.size(0)),
           offsets(*spec.cu_seqlens_k, "cu_seqlens_k", k.size(0))};
  TORCH_CHECK(p.cq.size() == p.ck.size(), kOp,
              ": cu_seqlens_q and cu_seqlens_k must hold as many sequences, got ", p.cq.size() - 1,
              " and ", p.ck.size() - 1);
  return p;
}

// ---- PyTorch's flash attention (CUDA; meta tensors check the plumbing) -------
//
// Flash attention has the engine's semantics (bottom-right alignment, windows
// with -1 for no bound, packed sequences with int32 offsets and an (H, Tq)
// lse) in the layouts (N, L, H, E) and (T, H, E). Two differences: a row
// without keys gets lse = +inf there (-inf here), and key lengths would align
// the causal diagonal on each item's own length (seqused_k), so padded calls
// with key_lengths keep fastattn's kernels.
bool flash_route(const Tensor& q, const Tensor& v, const DenseAttentionSpec& spec) {
#ifdef FASTATTN_FLASH_OPS
  const auto device = q.device().type();
  const int64_t E = q.size(-1);
  return (device == c10::DeviceType::CUDA || device == c10::DeviceType::Meta) &&
         (q.scalar_type() == torch::kHalf || q.scalar_type() == torch::kBFloat16) && E % 8 == 0 &&
         E <= 256 && v.size(-1) == E && !spec.key_lengths;
#else
  (void)q, (void)v, (void)spec;
  return false;
#endif
}

#ifdef FASTATTN_FLASH_OPS
struct FlashArgs {
  c10::optional<Tensor> cu_q, cu_k;
  int64_t max_q = 0, max_k = 0;
  int64_t left = -1, right = -1;  // windows past every offset: -1 (flash's ints)
};

FlashArgs flash_args(const Tensor& q, const Tensor& k, const DenseAttentionSpec& spec) {
  FlashArgs a;
  const auto windows = [&](FlashArgs& f) {
    const int64_t far = f.max_q + f.max_k;
    f.left = spec.window_left >= far ? -1 : spec.window_left;
    f.right = spec.window_right >= far ? -1 : spec.window_right;
  };
  if (!spec.packed()) {
    a.max_q = q.size(2);
    a.max_k = k.size(2);
    windows(a);
    return a;
  }
  a.cu_q = spec.cu_seqlens_q->to(q.device(), torch::kInt);
  a.cu_k = spec.cu_seqlens_k->to(q.device(), torch::kInt);
  if (spec.max_seqlen_q >= 0 && spec.max_seqlen_k >= 0) {
    a.max_q = spec.max_seqlen_q;
    a.max_k = spec.max_seqlen_k;
  } else if (q.device().is_meta()) {  // no values: the bound of the rows
    a.max_q = q.size(0);
    a.max_k = k.size(0);
  } else {
    a.max_q = spec.cu_seqlens_q->diff().max().item<int64_t>();
    a.max_k = spec.cu_seqlens_k->diff().max().item<int64_t>();
  }
  windows(a);
  return a;
}

// (N, H, L, D) <-> flash's (N, L, H, D); packed tensors as they are.
Tensor to_flash(const Tensor& x, const DenseAttentionSpec& spec) {
  return spec.packed() ? x : x.transpose(1, 2);
}

std::tuple<Tensor, Tensor> flash_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                         const DenseAttentionSpec& spec) {
  const auto a = flash_args(q, k, spec);
  auto r = at::_flash_attention_forward(
      to_flash(q, spec), to_flash(k, spec), to_flash(v, spec), a.cu_q, a.cu_k, a.max_q, a.max_k,
      /*dropout_p=*/0.0, spec.causal, /*return_debug_mask=*/false, spec.scale, a.left, a.right);
  auto lse = std::get<1>(r);
  lse = lse.masked_fill(torch::isposinf(lse), -std::numeric_limits<double>::infinity());
  return {to_flash(std::get<0>(r), spec), lse};
}

std::tuple<Tensor, Tensor, Tensor> flash_backward(const Tensor& grad_out, const Tensor& q,
                                                  const Tensor& k, const Tensor& v,
                                                  const Tensor& out, const Tensor& lse,
                                                  const DenseAttentionSpec& spec) {
  const auto a = flash_args(q, k, spec);
  // Rows without keys back to flash's +inf (exp(s - lse) = 0 for them).
  auto l = lse.to(torch::kFloat)
               .masked_fill(torch::isneginf(lse), std::numeric_limits<double>::infinity());
  // No dropout: the random state is not read.
  const auto none = torch::empty({0}, q.options().dtype(torch::kLong));
  const auto empty_cu = torch::empty({0}, q.options().dtype(torch::kInt));
  auto [dq, dk, dv] = at::_flash_attention_backward(
      to_flash(grad_out, spec), to_flash(q, spec), to_flash(k, spec), to_flash(v, spec),
      to_flash(out, spec), l, a.cu_q.value_or(empty_cu), a.cu_k.value_or(empty_cu), a.max_q,
      a.max_k, /*dropout_p=*/0.0, spec.causal, none, none, spec.scale, a.left, a.right);
  return {to_flash(dq, spec), to_flash(dk, spec), to_flash(dv, spec)};
}

// ---- PyTorch's memory-efficient attention (CUDA; meta tensors) --------------
//
// Where flash does not apply: float32 (and 16-bit inputs flash refuses, e.g.
// v narrower than q), padded calls without windows or key lengths; causal
// aligned bottom-right (custom_mask_type 2). Its lse is (N, H, L rounded up
// to a multiple of 32) in float32, -inf for rows without keys.
bool efficient_route(const Tensor& q, const Tensor& k, const Tensor& v,
                     const DenseAttentionSpec& spec) {
  const auto device = q.device().type();
  const auto dtype = q.scalar_type();
  const int64_t align = dtype == torch::kFloat ? 4 : 8;
  const int64_t far = q.size(-2) + k.size(-2);
  const auto unbounded = [&](int64_t w) { return w < 0 || w >= far; };
  return (device == c10::DeviceType::CUDA || device == c10::DeviceType::Meta) &&
         (dtype == torch::kFloat || dtype == torch::kHalf || dtype == torch::kBFloat16) &&
         q.size(-1) % align == 0 && v.size(-1) % align == 0 && !spec.packed() &&
         !spec.key_lengths && unbounded(spec.window_left) && unbounded(spec.window_right);
}

int64_t efficient_mask_type(const DenseAttentionSpec& spec) { return spec.causal ? 2 : 0; }

std::tuple<Tensor, Tensor> efficient_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                             const DenseAttentionSpec& spec) {
  const int64_t L = q.size(2), S = k.size(2);
  auto r = at::_efficient_attention_forward(
      q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), /*bias=*/c10::nullopt,
      /*cu_seqlens_q=*/c10::nullopt, /*cu_seqlens_k=*/c10::nullopt, L, S, /*dropout_p=*/0.0,
      efficient_mask_type(spec), /*compute_log_sumexp=*/true, spec.scale);
  return {std::get<0>(r).transpose(1, 2), std::get<1>(r).narrow(2, 0, L)};
}

std::tuple<Tensor, Tensor, Tensor> efficient_backward(const Tensor& grad_out, const Tensor& q,
                                                      const Tensor& k, const Tensor& v,
                                                      const Tensor& out, const Tensor& lse,
                                                      const DenseAttentionSpec& spec) {
  const int64_t L = q.size(2), S = k.size(2), padded = (L + 31) / 32 * 32;
  // The lse back in the forward's padded shape (the rows past L are not read).
  auto l = torch::zeros({lse.size(0), lse.size(1), padded}, lse.options().dtype(torch::kFloat));
  l.narrow(2, 0, L).copy_(lse);
  const auto none = torch::empty({0}, q.options().dtype(torch::kLong));
  auto r = at::_efficient_attention_backward(
      grad_out.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
      /*bias=*/c10::nullopt, out.transpose(1, 2), /*cu_seqlens_q=*/c10::nullopt,
      /*cu_seqlens_k=*/c10::nullopt, L, S, l, /*dropout_p=*/0.0, none, none,
      efficient_mask_type(spec), /*bias_requires_grad=*/false, spec.scale);
  return {std::get<0>(r).transpose(1, 2), std::get<1>(r).transpose(1, 2),
          std::get<2>(r).transpose(1, 2)};
}
#endif

}  // namespace

std::tuple<Tensor, Tensor> dense_attention_forward(const Tensor& q, const Tensor& k,
                                                   const Tensor& v,
                                                   const DenseAttentionSpec& spec) {
  check_spec(spec);
#ifdef FASTATTN_FLASH_OPS
  if (flash_route(q, v, spec)) return flash_forward(q, k, v, spec);
  if (efficient_route(q, k, v, spec)) return efficient_forward(q, k, v, spec);
#endif
  if (!spec.packed()) return padded_forward(q, k, v, spec);
  const auto p = check_packed(q, k, v, spec);
  const int64_t H = q.size(1);
  // Rows of sequences without keys: out 0, lse -inf.
  auto out = torch::zeros({q.size(0), H, v.size(2)}, q.options());
  auto lse = torch::full({H, q.size(0)}, -INFINITY, q.options().dtype(stats_dtype(q)));
  for (size_t b = 0; b + 1 < p.cq.size(); ++b) {
    if (p.cq[b + 1] == p.cq[b] || p.ck[b + 1] == p.ck[b]) continue;
    auto [o, l] =
        padded_forward(sequence(q, p.cq[b], p.cq[b + 1]), sequence(k, p.ck[b], p.ck[b + 1]),
                       sequence(v, p.ck[b], p.ck[b + 1]), spec);
    sequence(out, p.cq[b], p.cq[b + 1]).copy_(o);
    lse.narrow(1, p.cq[b], p.cq[b + 1] - p.cq[b]).copy_(l[0]);
  }
  return {out, lse};
}

std::tuple<Tensor, Tensor, Tensor> dense_attention_backward(const Tensor& grad_out, const Tensor& q,
                                                            const Tensor& k, const Tensor& v,
                                                            const Tensor& out, const Tensor& lse,
                                                            const DenseAttentionSpec& spec) {
  check_spec(spec);
#ifdef FASTATTN_FLASH_OPS
  if (flash_route(q, v, spec)) return flash_backward(grad_out, q, k, v, out, lse, spec);
  if (efficient_route(q, k, v, spec)) return efficient_backward(grad_out, q, k, v, out, lse, spec);
#endif
  if (!spec.packed()) return padded_backward(grad_out, q, k, v, out, lse, spec);
  const auto p = check_packed(q, k, v, spec);
  TORCH_CHECK(grad_out.sizes() == out.sizes() && out.dim() == 3 && out.size(0) == q.size(0) &&
                  lse.dim() == 2 && lse.size(1) == q.size(0),
              kOp, ": packed grad_out and out must be (Tq, H, M) and lse (H, Tq), got grad_out ",
              grad_out.sizes(), ", out ", out.sizes(), ", lse ", lse.sizes());
  auto dq = torch::zeros_like(q), dk = torch::zeros_like(k), dv = torch::zeros_like(v);
  for (size_t b = 0; b + 1 < p.cq.size(); ++b) {
    // no query: no gradient reaches its keys; no key: none reaches its queries
    if (p.cq[b + 1] == p.cq[b] || p.ck[b + 1] == p.ck[b]) continue;
    const int64_t q0 = p.cq[b], q1 = p.cq[b + 1], k0 = p.ck[b], k1 = p.ck[b + 1];
    auto [gq, gk, gv] = padded_backward(
        sequence(grad_out, q0, q1), sequence(q, q0, q1), sequence(k, k0, k1), sequence(v, k0, k1),
        sequence(out, q0, q1), lse.narrow(1, q0, q1 - q0).unsqueeze(0), spec);
    sequence(dq, q0, q1).copy_(gq);
    sequence(dk, k0, k1).copy_(gk);
    sequence(dv, k0, k1).copy_(gv);
  }
  return {dq, dk, dv};
}

std::tuple<Tensor, Tensor> merge_by_lse(const std::vector<Tensor>& outs,
                                        const std::vector<Tensor>& lses) {
  TORCH_CHECK(!outs.empty() && outs.size() == lses.size(), kOp,
              ": merge_by_lse takes one lse per output, got ", outs.size(), " outputs and ",
              lses.size(), " lses");
  auto lse = torch::stack(lses).logsumexp(0);  // all -inf: -inf
  // exp(lse_p - lse), 0 where lse is -inf (-inf - -inf would be NaN).
  const auto none = torch::isinf(lse) & lse.lt(0);
  Tensor out;
  for (size_t i = 0; i < outs.size(); ++i) {
    auto w = (lses[i] - lse).exp().masked_fill(none, 0.0);
    // lse (N, H, L) against out (N, H, L, M); packed: lse (H, T), out (T, H, M).
    w = outs[i].dim() == 3 ? w.t().unsqueeze(-1) : w.unsqueeze(-1);
    auto term = outs[i].to(w.scalar_type()) * w;  // summed in lse's precision
    out = out.defined() ? out + term : term;
  }
  return {out.to(outs[0].scalar_type()), lse};
}

// ---- with autograd, and the types' route ------------------------------------

namespace {

struct DenseOp {
  struct Saved {
    Tensor q, k, v, out, lse;
    DenseAttentionSpec spec;
    auto tensors() { return std::tie(q, k, v, out, lse); }
  };

  static Tensor forward(Saved* saved, const Tensor& q, const Tensor& k, const Tensor& v,
                        const DenseAttentionSpec& spec) {
    auto [out, lse] = dense_attention_forward(q, k, v, spec);
    if (saved) *saved = {q, k, v, out, lse, spec};
    return out;
  }

  static torch::autograd::variable_list backward(const Saved& s,
                                                 const torch::autograd::variable_list& grads) {
    auto [dq, dk, dv] = dense_attention_backward(grads[0].to(s.out.scalar_type()), s.q, s.k, s.v,
                                                 s.out, s.lse, s.spec);
    return {dq, dk, dv};
  }
};

DenseEngineRoute route_from_environment() {
  const char* env = std::getenv("FASTATTN_DENSE_ENGINE");
  const std::string value = env ? env : "auto";
  if (value == "always") return DenseEngineRoute::Always;
  if (value == "never" || value == "0") return DenseEngineRoute::Never;
  TORCH_CHECK(value == "auto" || value == "1" || value.empty(),
              "FASTATTN_DENSE_ENGINE must be auto, always or never, got '", value, "'");
  return DenseEngineRoute::Auto;
}

std::atomic<int>& route_setting() {
  static std::atomic<int> route{static_cast<int>(route_from_environment())};
  return route;
}

}  // namespace

Tensor dense_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                       const DenseAttentionSpec& spec) {
  return Shell<DenseOp>::autograd(q, k, v, spec);
}

DenseEngineRoute dense_engine_route() {
  return static_cast<DenseEngineRoute>(route_setting().load());
}

void set_dense_engine_route(DenseEngineRoute route) {
  route_setting().store(static_cast<int>(route));
}

bool types_use_dense_engine(const Tensor& q, const Tensor& v, const DenseAttentionSpec& spec,
                            bool pieces) {
  switch (dense_engine_route()) {
    case DenseEngineRoute::Always:
      return true;
    case DenseEngineRoute::Never:
      return false;
    default:
#ifdef FASTATTN_FLASH_OPS
      // Memory-efficient attention takes plain calls only (no windows, no
      // packed sequences): compositions of pieces need flash.
      return flash_route(q, v, spec) || (!pieces && efficient_route(q, q, v, spec));
#else
      (void)pieces;
      return flash_route(q, v, spec);
#endif
  }
}

namespace {

DenseAttentionSpec spec_of(double scale, bool causal, int64_t window_left, int64_t window_right,
                           const c10::optional<Tensor>& key_lengths,
                           const c10::optional<Tensor>& cu_seqlens_q,
                           const c10::optional<Tensor>& cu_seqlens_k) {
  DenseAttentionSpec spec;
  spec.scale = scale;
  spec.causal = causal;
  spec.window_left = window_left;
  spec.window_right = window_right;
  spec.key_lengths = key_lengths;
  spec.cu_seqlens_q = cu_seqlens_q;
  spec.cu_seqlens_k = cu_seqlens_k;
  return spec;
}

// The engine as internal operators (torch.ops.fastattn._dense_attention_*),
// for the Python tests: on meta tensors of float16 / bfloat16 they run
// PyTorch's flash route's shape functions (torch >= 2.4).
std::tuple<Tensor, Tensor> forward_op(const Tensor& q, const Tensor& k, const Tensor& v,
                                      double scale, bool causal, int64_t window_left,
                                      int64_t window_right,
                                      const c10::optional<Tensor>& key_lengths,
                                      const c10::optional<Tensor>& cu_seqlens_q,
                                      const c10::optional<Tensor>& cu_seqlens_k) {
  return dense_attention_forward(
      q, k, v,
      spec_of(scale, causal, window_left, window_right, key_lengths, cu_seqlens_q, cu_seqlens_k));
}

std::tuple<Tensor, Tensor, Tensor> backward_op(const Tensor& grad_out, const Tensor& q,
                                               const Tensor& k, const Tensor& v, const Tensor& out,
                                               const Tensor& lse, double scale, bool causal,
                                               int64_t window_left, int64_t window_right,
                                               const c10::optional<Tensor>& key_lengths,
                                               const c10::optional<Tensor>& cu_seqlens_q,
                                               const c10::optional<Tensor>& cu_seqlens_k) {
  return dense_attention_backward(
      grad_out, q, k, v, out, lse,
      spec_of(scale, causal, window_left, window_right, key_lengths, cu_seqlens_q, cu_seqlens_k));
}

}  // namespace

}  // namespace fastattn::ops

TORCH_LIBRARY_IMPL(fastattn, CompositeExplicitAutograd, m) {
  m.impl("_dense_attention_forward", fastattn::ops::forward_op);
  m.impl("_dense_attention_backward", fastattn::ops::backward_op);
}

namespace fastattn::reference {

namespace {

// (out, lse) of one padded batch in float64.
std::tuple<torch::Tensor, torch::Tensor> padded(const torch::Tensor& q, const torch::Tensor& k,
                                                const torch::Tensor& v,
                                                const ops::DenseAttentionSpec& spec) {
  const int64_t N = q.size(0), L = q.size(2), S = k.size(2);
  auto q64 = q.to(torch::kDouble), k64 = k.to(torch::kDouble), v64 = v.to(torch::kDouble);
  auto opts = torch::TensorOptions().dtype(torch::kLong);
  auto p = torch::arange(L, opts).view({L, 1}) + (S - L);
  auto j = torch::arange(S, opts).view({1, S});
  auto keep = torch::ones({L, S}, torch::kBool);
  if (spec.causal) keep = keep & (j <= p);
  if (spec.window_left >= 0) keep = keep & (j >= p - spec.window_left);
  if (spec.window_right >= 0) keep = keep & (j <= p + spec.window_right);
  auto keep4 = keep.view({1, 1, L, S}).expand({N, 1, L, S});
  if (spec.key_lengths)
    keep4 = keep4 & (j.view({1, 1, 1, S}) < spec.key_lengths->to(torch::kLong).view({N, 1, 1, 1}));
  auto s = torch::matmul(q64, k64.transpose(-1, -2)) * spec.scale;
  s = s.masked_fill(keep4.logical_not(), -std::numeric_limits<double>::infinity());
  auto lse = s.logsumexp(-1);  // -inf for a row without keys
  auto w = (s - lse.unsqueeze(-1)).exp().nan_to_num(0.0);
  return {torch::matmul(w, v64), lse};
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor> dense_attention(const torch::Tensor& q,
                                                         const torch::Tensor& k,
                                                         const torch::Tensor& v,
                                                         const ops::DenseAttentionSpec& spec) {
  if (!spec.packed()) return padded(q, k, v, spec);
  auto cq = spec.cu_seqlens_q->to(torch::kLong), ck = spec.cu_seqlens_k->to(torch::kLong);
  std::vector<torch::Tensor> outs, lses;
  for (int64_t b = 0; b + 1 < cq.numel(); ++b) {
    const int64_t q0 = cq[b].item<int64_t>(), q1 = cq[b + 1].item<int64_t>();
    const int64_t k0 = ck[b].item<int64_t>(), k1 = ck[b + 1].item<int64_t>();
    auto view = [](const torch::Tensor& x, int64_t a, int64_t e) {
      return x.narrow(0, a, e - a).transpose(0, 1).unsqueeze(0);
    };
    auto [o, l] = padded(view(q, q0, q1), view(k, k0, k1), view(v, k0, k1), spec);
    outs.push_back(o[0].transpose(0, 1));  // (Lb, H, M)
    lses.push_back(l[0]);                  // (H, Lb)
  }
  return {torch::cat(outs, 0), torch::cat(lses, 1)};
}

}  // namespace fastattn::reference
