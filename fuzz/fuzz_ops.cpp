// Decoding and checking of the operator fuzzer (see fuzz_ops.h).
#include "fuzz_ops.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <optional>
#include <sstream>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

#include "../tests/cpp/attention_cases.h"
#include "fastattn/ops.h"
#include "fastattn/recurrent.h"
#include "fastattn/registry.h"

namespace fastattn::fuzz {
namespace {

using torch::Tensor;

// Bytes as a stream of small choices; reads past the end give zeros.
class Bytes {
 public:
  Bytes(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  uint8_t byte() { return pos_ < size_ ? data_[pos_++] : 0; }
  // An integer in [lo, hi] (hi - lo < 256).
  int64_t range(int64_t lo, int64_t hi) { return lo + byte() % (hi - lo + 1); }
  bool flag() { return byte() & 1; }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

// A check that failed: unwinds to check_fuzz_input with a description.
struct Failure {
  std::string what;
};

// A valid input that raised, as opposed to a corrupted one.
struct Rejected {
  std::string what;
};

#define FUZZ_CHECK(cond, ...)                           \
  do {                                                  \
    if (!(cond)) {                                      \
      std::ostringstream os_;                           \
      os_ << "check failed: " #cond " " << __VA_ARGS__; \
      throw Failure{os_.str()};                         \
    }                                                   \
  } while (0)

// Decoded common shapes and options.
struct Setup {
  int64_t N, H, L, S, E, M;
  torch::ScalarType dtype;
  double scale;
  bool strided;  // hand the operator non-contiguous views
};

Setup decode_setup(Bytes& b) {
  Setup s;
  s.N = b.range(0, 2);
  s.H = b.range(1, 3);
  s.L = b.range(0, 9);
  s.S = b.range(0, 9);
  s.E = b.range(1, 5);
  s.M = b.range(1, 4);
  s.dtype = b.flag() ? torch::kDouble : torch::kFloat;
  static const double kScales[] = {1.0, 0.01, 4.0, 30.0, 1e3};
  s.scale = kScales[b.range(0, 4)];
  s.strided = b.flag();
  return s;
}

// A tensor of `shape` whose values come from the bytes: (b - 128) / 32 · scale
// (integers and halves: ties happen on purpose).
Tensor values(Bytes& b, std::vector<int64_t> shape, torch::ScalarType dtype, double scale,
              bool strided) {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  std::vector<double> data(n);
  for (auto& x : data) x = (static_cast<int>(b.byte()) - 128) / 32.0 * scale;
  auto t = torch::tensor(data, torch::kDouble).view(shape).to(dtype);
  if (strided && shape.size() >= 2) {
    // Same values, transposed storage of the last two dimensions.
    t = t.transpose(-1, -2).contiguous().transpose(-1, -2);
  }
  return t;
}

// (N,) key lengths in [0, S], or none.
std::optional<Tensor> key_lengths(Bytes& b, int64_t N, int64_t S) {
  if (!b.flag()) return std::nullopt;
  std::vector<int64_t> kl(N);
  for (auto& x : kl) x = b.range(0, S);
  return torch::tensor(kl, torch::kLong);
}

// A bool keep mask of shape (L, S), (N, L, S) or (N, H, L, S), or an additive
// one (0 / -inf / small finite values), or none.
std::optional<Tensor> attn_mask(Bytes& b, const Setup& s, bool allow_additive) {
  const int kind = b.range(0, 3);
  if (kind == 0) return std::nullopt;
  std::vector<int64_t> shape = kind == 1   ? std::vector<int64_t>{s.L, s.S}
                               : kind == 2 ? std::vector<int64_t>{s.N, s.L, s.S}
                                           : std::vector<int64_t>{s.N, s.H, s.L, s.S};
  const uint8_t density = b.byte();
  int64_t n = 1;
  for (auto d : shape) n *= d;
  std::vector<uint8_t> keep(n);
  for (auto& x : keep) x = b.byte() >= density / 2;
  auto mask = torch::tensor(std::vector<int64_t>(keep.begin(), keep.end()), torch::kLong)
                  .view(shape)
                  .to(torch::kBool);
  if (allow_additive && b.flag()) {
    auto add = torch::zeros(shape, s.dtype).masked_fill(mask.logical_not(), -INFINITY);
    return add +
           torch::where(mask, values(b, shape, s.dtype, 0.5, false), torch::zeros(shape, s.dtype));
  }
  return mask;
}

std::optional<double> softmax_temp(Bytes& b) {
  const int k = b.range(0, 3);
  if (k == 0) return std::nullopt;
  return k == 1 ? 0.125 : k == 2 ? 1.0 : 3.0;
}

bool finite(const Tensor& t) { return torch::isfinite(t).all().item<bool>(); }

void check_shape(const Tensor& t, std::vector<int64_t> shape, const char* what) {
  FUZZ_CHECK(t.sizes() == c10::IntArrayRef(shape),
             what << " has shape " << t.sizes() << ", expected " << c10::IntArrayRef(shape));
}

void check_close(const Tensor& got, const Tensor& want, const char* what) {
  check_shape(got, want.sizes().vec(), what);
  if (got.scalar_type() != torch::kDouble || got.numel() == 0) return;  // float32: finiteness only
  const double tol = 1e-7 * (1.0 + want.abs().max().item<double>());
  const double err = (got - want).abs().max().item<double>();
  FUZZ_CHECK(err <= tol, what << ": max |op - reference| = " << err << " > " << tol);
}

// Backward through `out` with a fixed weight; every defined grad finite.
void check_backward(const Tensor& out, std::vector<Tensor> leaves, const char* what) {
  if (!out.requires_grad() || out.numel() == 0) return;
  (out * torch::linspace(-1, 1, out.numel(), out.options()).view(out.sizes())).sum().backward();
  for (auto& t : leaves) {
    if (t.grad().defined()) FUZZ_CHECK(finite(t.grad()), what << ": gradient not finite");
  }
}

// Runs `call`, which must raise (corrupted input) or not (valid input).
// Returns false when it raised (the caller stops there).
bool run_expecting(bool corrupt, const std::string& corruption, const std::function<void()>& call) {
  try {
    call();
  } catch (const c10::Error& e) {
    if (corrupt) return false;
    throw Rejected{e.what_without_backtrace()};
  }
  FUZZ_CHECK(!corrupt, "a corrupted input was accepted: " << corruption);
  return true;
}

struct Qkv {
  Tensor q, k, v;
};

Qkv make_qkv(Bytes& b, const Setup& s, bool grad) {
  Qkv t{values(b, {s.N, s.H, s.L, s.E}, s.dtype, s.scale, s.strided),
        values(b, {s.N, s.H, s.S, s.E}, s.dtype, s.scale, s.strided),
        values(b, {s.N, s.H, s.S, s.M}, s.dtype, 1.0, s.strided)};
  if (grad) {
    for (auto* x : {&t.q, &t.k, &t.v}) *x = x->detach().requires_grad_(true);
  }
  return t;
}

// One corruption of q / k / v / key_lengths (index `which`), described.
std::string corrupt_qkv(int which, Qkv& t, std::optional<Tensor>& kl, const Setup& s) {
  switch (which) {
    case 0:
      t.k = torch::cat({t.k, t.k}, 3);
      return "k with E doubled";
    case 1:
      t.v = torch::zeros({s.N, s.H, s.S + 1, s.M}, t.v.options());
      return "v with S + 1 rows";
    case 2:
      t.q = t.q.select(0, 0 * 0).unsqueeze(0).expand({s.N + 1, s.H, s.L, s.E});
      return "q with N + 1";
    case 3:
      t.v = t.v.to(s.dtype == torch::kDouble ? torch::kFloat : torch::kDouble);
      return "v of the other dtype";
    case 4:
      kl = torch::full({s.N}, s.S + 1, torch::kLong);
      return "key_lengths > S";
    default:
      t.q = t.q.flatten(0, 1);
      return "q of rank 3";
  }
}

// ---- the operators -----------------------------------------------------------

void fuzz_full(Bytes& b, Setup s) {
  auto t = make_qkv(b, s, true);
  auto kl = key_lengths(b, s.N, s.S);
  auto mask = attn_mask(b, s, true);
  const bool causal = b.flag();
  const auto temp = softmax_temp(b);
  const int c = b.range(0, 15);
  const bool corrupt = c < 6 && s.N > 0;
  std::string what;
  if (corrupt) what = corrupt_qkv(c, t, kl, s);
  Tensor out;
  if (!run_expecting(corrupt, what,
                     [&] { out = full_attention(t.q, t.k, t.v, mask, kl, causal, temp); }))
    return;
  check_shape(out, {s.N, s.H, s.L, s.M}, "full_attention");
  FUZZ_CHECK(finite(out), "full_attention output not finite");
  check_close(out, reference::full_attention(t.q, t.k, t.v, mask, kl, causal, temp),
              "full_attention");
  check_backward(out, {t.q, t.k, t.v}, "full_attention");
}

void fuzz_elu_linear(Bytes& b, Setup s) {
  const bool causal = b.flag();
  if (causal) s.S = s.L;
  auto t = make_qkv(b, s, true);
  auto kl = key_lengths(b, s.N, s.S);
  static const double kEps[] = {1e-6, 1e-3, 1.0};
  const double eps = kEps[b.range(0, 2)];
  const int c = b.range(0, 15);
  const bool corrupt = c < 6 && s.N > 0;
  std::string what;
  if (corrupt) what = corrupt_qkv(c, t, kl, s);
  Tensor out;
  if (!run_expecting(corrupt, what,
                     [&] { out = elu_linear_attention(t.q, t.k, t.v, kl, causal, eps); }))
    return;
  check_shape(out, {s.N, s.H, s.L, s.M}, "elu_linear_attention");
  FUZZ_CHECK(finite(out), "elu_linear_attention output not finite");
  check_close(out, reference::elu_linear_attention(t.q, t.k, t.v, kl, causal, eps),
              "elu_linear_attention");
  check_backward(out, {t.q, t.k, t.v}, "elu_linear_attention");
}

void fuzz_causal_linear_product(Bytes& b, Setup s) {
  s.S = s.L;
  s.scale = std::min(s.scale, 4.0);  // unnormalised: keep the products moderate
  auto t = make_qkv(b, s, true);
  const int c = b.range(0, 15);
  const bool corrupt = c < 4 && s.N > 0;
  std::optional<Tensor> unused;
  std::string what;
  if (corrupt) what = corrupt_qkv(c, t, unused, s);
  Tensor out;
  if (!run_expecting(corrupt, what, [&] { out = causal_linear_product(t.q, t.k, t.v); })) return;
  check_shape(out, {s.N, s.H, s.L, s.M}, "causal_linear_product");
  FUZZ_CHECK(finite(out), "causal_linear_product output not finite");
  check_close(out, reference::causal_linear_product(t.q, t.k, t.v), "causal_linear_product");
  check_backward(out, {t.q, t.k, t.v}, "causal_linear_product");
}

void fuzz_hard_retrieval(Bytes& b, Setup s) {
  auto t = make_qkv(b, s, true);
  auto kl = key_lengths(b, s.N, s.S);
  auto mask = attn_mask(b, s, false);
  const bool causal = b.flag();
  const bool sample = b.flag();
  const auto temp = softmax_temp(b);
  const int64_t seed = b.byte();
  const int c = b.range(0, 15);
  const bool corrupt = c < 6 && s.N > 0;
  std::string what;
  if (corrupt) what = corrupt_qkv(c, t, kl, s);
  Tensor out, index;
  if (!run_expecting(corrupt, what, [&] {
        std::tie(out, index) =
            hard_retrieval_attention(t.q, t.k, t.v, mask, kl, causal, sample, temp, seed);
      }))
    return;
  check_shape(out, {s.N, s.H, s.L, s.M}, "hard_retrieval_attention");
  check_shape(index, {s.N, s.H, s.L}, "hard_retrieval_attention index");
  FUZZ_CHECK(finite(out), "hard_retrieval_attention output not finite");
  // The chosen key is kept (or -1 when none is), and out is its value row.
  Mask m = Mask().with_causal(causal);
  if (mask) m = m.with_attn_mask(*mask);
  if (kl) m = m.with_key_lengths(*kl);
  auto keep = m.dense_bool(s.N, s.H, s.L, s.S);
  auto any = keep.any(-1);
  FUZZ_CHECK(torch::equal(index.ge(0), any), "hard_retrieval_attention: index -1 iff no key kept");
  auto safe = index.clamp_min(0);
  if (s.S > 0) {
    auto chosen_kept = keep.gather(-1, safe.unsqueeze(-1)).squeeze(-1) | index.lt(0);
    FUZZ_CHECK(chosen_kept.all().item<bool>(), "hard_retrieval_attention chose a masked key");
    auto rows = t.v.detach()
                    .unsqueeze(2)
                    .expand({s.N, s.H, s.L, s.S, s.M})
                    .gather(3, safe.view({s.N, s.H, s.L, 1, 1}).expand({s.N, s.H, s.L, 1, s.M}))
                    .squeeze(3)
                    .masked_fill(index.lt(0).unsqueeze(-1), 0);
    check_close(out.detach(), rows, "hard_retrieval_attention gather");
    if (!sample && s.dtype == torch::kDouble && index.numel() > 0) {
      // argmax of the raw scores over the kept keys (up to rounding on ties).
      auto scores = torch::matmul(t.q.detach(), t.k.detach().transpose(-1, -2))
                        .masked_fill(keep.logical_not(), -INFINITY);
      auto best = std::get<0>(scores.max(-1));
      auto got = scores.gather(-1, safe.unsqueeze(-1)).squeeze(-1);
      auto gap = (best - got).masked_fill(index.lt(0), 0);
      const double tol = 1e-9 * (1.0 + best.masked_fill(index.lt(0), 0).abs().max().item<double>());
      FUZZ_CHECK(gap.max().item<double>() <= tol, "hard_retrieval_attention: not the argmax");
    }
  }
  check_backward(out, {t.q, t.k, t.v}, "hard_retrieval_attention");
}

void fuzz_block_sparse(Bytes& b, Setup s) {
  auto t = make_qkv(b, s, true);
  auto kl = key_lengths(b, s.N, s.S);
  const bool causal = b.flag();
  const auto temp = softmax_temp(b);
  const int p = b.range(0, 2);
  std::string pattern = p == 0 ? "local" : p == 1 ? "strided" : "fixed";
  std::vector<int64_t> params;
  const int64_t which = b.range(0, s.H >= 2 ? 3 : 2);
  if (p == 0) params = {b.range(1, 10)};
  if (p == 1) params = {b.range(1, 6), which};
  if (p == 2) {
    const int64_t stride = b.range(1, 6);
    params = {stride, b.range(1, stride), which, 0};
    params[3] = stride % params[1] == 0 ? b.range(0, 1) : 0;
  }
  const int c = b.range(0, 15);
  bool corrupt = c < 7 && s.N > 0;
  std::string what;
  if (corrupt && c == 6) {
    params[0] = 0;
    what = "first pattern parameter 0";
  } else if (corrupt) {
    what = corrupt_qkv(c, t, kl, s);
  }
  Tensor out;
  if (!run_expecting(corrupt, what, [&] {
        out = block_sparse_attention(t.q, t.k, t.v, pattern, params, kl, causal, temp);
      }))
    return;
  check_shape(out, {s.N, s.H, s.L, s.M}, "block_sparse_attention");
  FUZZ_CHECK(finite(out), "block_sparse_attention output not finite");
  check_close(out,
              reference::block_sparse_attention(t.q, t.k, t.v, pattern, params, kl, causal, temp),
              "block_sparse_attention");
  check_backward(out, {t.q, t.k, t.v}, "block_sparse_attention");
}

void fuzz_clustered_topk(Bytes& b, Setup s) {
  auto t = make_qkv(b, s, true);
  auto kl = key_lengths(b, s.N, s.S);
  const int64_t C = b.range(1, 4), K = s.S > 0 ? b.range(1, s.S) : 0;
  std::vector<int64_t> tk(s.N * s.H * C * K), asg(s.N * s.H * s.L);
  for (auto& x : tk) x = b.range(0, std::max<int64_t>(s.S - 1, 0));
  for (auto& x : asg) x = b.range(-1, C - 1);
  auto topk = torch::tensor(tk, torch::kLong).view({s.N, s.H, C, K});
  auto assignments = torch::tensor(asg, torch::kLong).view({s.N, s.H, s.L});
  auto mass = values(b, {s.N, s.H, C}, s.dtype, 0.01, false)
                  .abs()
                  .detach()
                  .requires_grad_(s.dtype == torch::kDouble);
  const double temp = softmax_temp(b).value_or(0.5);
  const int c = b.range(0, 15);
  bool corrupt = c < 8 && s.N > 0;
  std::string what;
  if (corrupt && c == 6) {
    topk = topk + s.S;
    what = "topk index >= S";
    corrupt = topk.numel() > 0;
  } else if (corrupt && c == 7) {
    // Every entry below -1 (a shift of 2 would leave entries >= 1 valid).
    assignments = assignments - (C + 1);
    what = "assignments < -1";
    corrupt = assignments.numel() > 0;
  } else if (corrupt) {
    what = corrupt_qkv(c, t, kl, s);
  }
  Tensor out;
  if (!run_expecting(corrupt, what, [&] {
        out = clustered_topk_attention(t.q, t.k, t.v, topk, mass, assignments, kl, temp);
      }))
    return;
  check_shape(out, {s.N, s.H, s.L, s.M}, "clustered_topk_attention");
  FUZZ_CHECK(finite(out), "clustered_topk_attention output not finite");
  // Padded queries (-1) output zeros.
  FUZZ_CHECK(out.detach().masked_select(assignments.lt(0).unsqueeze(-1)).eq(0).all().item<bool>(),
             "clustered_topk_attention: a padded query has a nonzero output");
  check_backward(out, {t.q, t.k, t.v, mass}, "clustered_topk_attention");
}

void fuzz_clustering(Bytes& b, Setup s) {
  // Inputs that require grad: the codes are integers, nothing to
  // differentiate, and the call must neither refuse nor record anything.
  auto x = values(b, {s.N, s.H, s.L, s.E}, s.dtype, s.scale, s.strided).requires_grad_(true);
  const int64_t B = b.range(1, 64);
  auto planes = values(b, {B, s.E + 1}, s.dtype, 1.0, s.strided);
  auto lengths = key_lengths(b, s.N, s.L);
  const int64_t C = b.range(1, 6), iters = b.range(0, 4), seed = b.byte();
  const int c = b.range(0, 15);
  const bool corrupt = c < 3;
  std::string what;
  int64_t clusters = C;
  if (c == 0) {
    planes = torch::zeros({65, s.E + 1}, planes.options());
    what = "65 planes";
  } else if (c == 1) {
    clusters = 0;
    what = "clusters 0";
  } else if (c == 2) {
    planes = planes.narrow(1, 0, s.E);
    what = "planes without the bias column";
  }
  Tensor codes, asg, counts;
  if (!run_expecting(corrupt, what, [&] {
        codes = hash_queries(x, planes);
        std::tie(asg, counts) = cluster_codes(codes, lengths, clusters, iters, seed);
      }))
    return;
  check_shape(codes, {s.N, s.H, s.L}, "hash_queries");
  FUZZ_CHECK(!codes.requires_grad() && !asg.requires_grad() && !counts.requires_grad(),
             "hash_queries / cluster_codes: an integer output records a gradient");
  // Codes agree with the reference wherever no projection is within rounding of 0.
  auto proj = torch::matmul(x.to(torch::kDouble), planes.to(torch::kDouble).narrow(1, 0, s.E).t()) +
              planes.to(torch::kDouble).select(1, s.E);
  auto clear = (proj.abs() > 1e-4 * (1.0 + proj.abs())).all(-1);
  auto ref = reference::hash_queries(x, planes);
  FUZZ_CHECK(torch::equal(codes.masked_select(clear), ref.masked_select(clear)),
             "hash_queries disagrees with the reference");
  check_shape(asg, {s.N, s.H, s.L}, "cluster_codes assignments");
  // The count columns: C clamped to L (at least one).
  const int64_t Ce = std::min(C, std::max<int64_t>(s.L, 1));
  check_shape(counts, {s.N, s.H, Ce}, "cluster_codes counts");
  auto valid = lengths ? torch::arange(s.L).view({1, 1, s.L}) < lengths->view({s.N, 1, 1})
                       : torch::ones({s.N, 1, s.L}, torch::kBool);
  valid = valid.expand({s.N, s.H, s.L});
  FUZZ_CHECK(torch::equal(asg.ge(0), valid), "cluster_codes: -1 iff padding");
  FUZZ_CHECK(asg.lt(C).all().item<bool>(), "cluster_codes: assignment >= clusters");
  auto onehot = torch::zeros({s.N, s.H, Ce + 1}, torch::kLong)
                    .scatter_add_(2, (asg + 1).clamp_min(0), torch::ones_like(asg));
  FUZZ_CHECK(torch::equal(onehot.narrow(2, 1, Ce), counts), "cluster_codes: counts disagree");
}

void fuzz_reformer(Bytes& b, Setup s) {
  s.S = s.L;
  auto q = values(b, {s.N, s.H, s.L, s.E}, s.dtype, s.scale, s.strided);
  auto v = values(b, {s.N, s.H, s.L, s.M}, s.dtype, 1.0, s.strided);
  const int64_t R = b.range(1, 3), B2 = b.range(0, 4);
  auto rot = values(b, {R, s.E, B2}, s.dtype, 1.0, false);
  auto kl = key_lengths(b, s.N, s.L);
  const int64_t chunk = b.range(1, 5);
  const bool causal = b.flag(), mask_self = b.flag();
  const auto temp = softmax_temp(b);
  const int c = b.range(0, 15);
  const bool corrupt = c < 3 && s.N > 0;
  std::string what;
  int64_t chunk_size = chunk;
  if (!corrupt) {
  } else if (c == 0) {
    chunk_size = 0;
    what = "chunk_size 0";
  } else if (c == 1) {
    v = torch::zeros({s.N, s.H, s.L + 1, s.M}, v.options());
    what = "v of length L + 1";
  } else if (c == 2) {
    kl = torch::full({s.N}, s.L + 1, torch::kLong);
    what = "key_lengths > L";
  }
  if (s.dtype == torch::kDouble) {
    q = q.detach().requires_grad_(true);
    v = v.detach().requires_grad_(true);
  }
  Tensor buckets, out;
  if (!run_expecting(corrupt, what, [&] {
        buckets = lsh_hash(q.detach(), rot);
        out = reformer_attention(q, v, buckets, kl, chunk_size, causal, mask_self, temp);
      }))
    return;
  check_shape(buckets, {s.N, s.H, R, s.L}, "lsh_hash");
  FUZZ_CHECK(buckets.ge(0).all().item<bool>() &&
                 buckets.lt(std::max<int64_t>(1, 2 * B2)).all().item<bool>(),
             "lsh_hash: bucket out of range");
  check_shape(out, {s.N, s.H, s.L, s.M}, "reformer_attention");
  FUZZ_CHECK(finite(out), "reformer_attention output not finite");
  check_close(out,
              reference::reformer_attention(q, v, buckets, kl, chunk_size, causal, mask_self, temp),
              "reformer_attention");
  check_backward(out, {q, v}, "reformer_attention");
}

void fuzz_gather(Bytes& b, Setup s) {
  auto x = values(b, {s.N, s.H, s.L, s.E}, s.dtype, s.scale, s.strided);
  if (s.dtype == torch::kDouble) x = x.detach().requires_grad_(true);
  const int64_t T = b.range(0, 9);
  std::vector<int64_t> idx(s.N * T);
  for (auto& i : idx) i = b.range(-1, s.L - 1);
  auto index = torch::tensor(idx, torch::kLong).view({s.N, T});
  const int c = b.range(0, 15);
  const bool corrupt = c < 2 && index.numel() > 0;
  std::string what;
  if (corrupt && c == 0) {
    index = index + s.L + 1;
    what = "index >= L";
  } else if (corrupt) {
    index = index - s.L - 2;
    what = "index < -1";
  }
  Tensor out, fm;
  if (!run_expecting(corrupt, what, [&] {
        out = gather_tokens(x, index);
        fm = elu_feature_map(x);
      }))
    return;
  check_close(out, reference::gather_tokens(x, index), "gather_tokens");
  check_close(fm, reference::elu_feature_map(x), "elu_feature_map");
  check_backward(out, {x}, "gather_tokens");
}

// Any registered attention type with its default parameters (seeded).
void fuzz_type(Bytes& b, Setup s) {
  const auto names = cases::registered_types();
  const auto& name = names[b.range(0, static_cast<int64_t>(names.size()) - 1)];
  s.M = cases::value_width(name, s.E, s.M);  // AFT: values as wide as the keys
  const bool causal = b.flag();
  if (causal || b.flag()) s.S = s.L;
  auto t = make_qkv(b, s, true);
  auto kl = key_lengths(b, s.N, s.S);
  // The seed parameter's byte (types that take one), then the init seed's.
  const int64_t seed = cases::has_param(name, "seed") ? int64_t{b.byte()} : 0;
  const uint64_t init_seed = b.byte();
  auto attention = cases::build_type(name, cases::dims(s.H, s.E, s.M), {}, seed, init_seed);
  Mask mask = Mask().with_causal(causal);
  if (kl) mask = mask.with_key_lengths(*kl);
  Tensor out;
  try {
    out = attention->forward(t.q, t.k, t.v, mask);
  } catch (const c10::Error& e) {
    // Types refuse masks they do not support (causal / non-causal, S != L):
    // the refusal must name the type.
    const std::string msg = e.what_without_backtrace();
    FUZZ_CHECK(msg.find(name) != std::string::npos || msg.find("attention") != std::string::npos,
               "type " << name << " raised without naming itself: " << msg);
    return;
  }
  check_shape(out, {s.N, s.H, s.L, s.M}, name.c_str());
  FUZZ_CHECK(finite(out), "type " << name << ": output not finite");
  if (kl && s.N > 0) {
    auto dead = kl->eq(0);
    FUZZ_CHECK(out.detach().masked_select(dead.view({s.N, 1, 1, 1})).eq(0).all().item<bool>(),
               "type " << name << ": a batch element without keys has nonzero output");
  }
  if (name == "full" && s.dtype == torch::kDouble) {
    check_close(out, reference::full_attention(t.q, t.k, t.v, std::nullopt, kl, causal), "full");
  }
  check_backward(out, {t.q, t.k, t.v}, name.c_str());
}

// ---- parameters at and past their ranges, inputs at large scales -----------

// One value for a numeric parameter spec, chosen by `kind`: at the range's
// ends, just past them, huge, tiny, negative or ordinary. `in_range` says
// whether the spec admits it (the registry must reject it otherwise).
ParamValue edge_value(const ParamSpec& spec, int kind, bool& in_range) {
  const bool is_int = spec.type == ParamType::Int;
  double x = 0;
  switch (kind) {
    case 0:
      x = spec.min.value_or(1.0);
      break;
    case 1:
      x = spec.max.value_or(is_int ? double(int64_t(1) << 40) : 1e30);
      break;
    case 2:
      x = spec.min ? *spec.min - (is_int ? 1.0 : 1e-9) : -1.0;
      break;
    case 3:
      x = spec.max ? *spec.max + (is_int ? 1.0 : 1e-9) : 1e300;
      break;
    case 4:
      x = is_int ? double(int64_t(1) << 62) : 1e300;
      break;
    case 5:
      x = is_int ? 1.0 : 1e-300;
      break;
    case 6:
      x = -1.0;
      break;
    default:
      x = is_int ? 2.0 : 0.5;
      break;
  }
  // An integer without a maximum gets 2^62 for "past the maximum" (1e300
  // does not convert to int64: it came out as INT64_MIN, below the minimum
  // while counted in range).
  if (is_int) x = std::min(x, double(int64_t(1) << 62));
  in_range = true;
  if (spec.min) in_range = in_range && (spec.min_exclusive ? x > *spec.min : x >= *spec.min);
  if (spec.max) in_range = in_range && (spec.max_exclusive ? x < *spec.max : x <= *spec.max);
  if (is_int) return static_cast<int64_t>(x);
  return x;
}

// The registry operator (torch.ops.fastattn.attention) with one or two
// parameters at or past their ranges and inputs scaled by up to 1e20. It
// must return a finite (N, H, L, M) output or raise a c10::Error: one that
// names the parameter when its value is out of range, and otherwise the type
// or the parameter (a refused combination, or a size this machine cannot
// hold); an "overflowed" refusal only for inputs or parameters near the
// dtype's range. Nothing else may escape: no std::bad_alloc, no abort, no
// allocation sized by a parameter rather than the inputs (libFuzzer's
// -rss_limit_mb catches those).
void fuzz_type_params(Bytes& b, Setup s) {
  const auto names = cases::registered_types();
  const auto& name = names[b.range(0, static_cast<int64_t>(names.size()) - 1)];
  const auto type = AttentionRegistry::global().get(name);
  s.M = cases::value_width(name, s.E, s.M);
  const bool causal = b.flag();
  if (causal || b.flag()) s.S = s.L;
  static const double kFactors[] = {1.0, 1.0, 1e3, 1e7, 1e20};
  const double factor = kFactors[b.range(0, 4)];
  s.scale *= factor;
  bool extreme = factor >= 1e20;
  auto t = make_qkv(b, s, true);
  nlohmann::json params = nlohmann::json::object();
  std::vector<std::string> out_of_range;  // parameters given a value their spec refuses
  // (A type without parameters, such as aft-simple, runs with none.)
  for (int n = type.params.empty() ? 0 : b.range(1, 2); n > 0; --n) {
    const auto& spec = type.params[b.range(0, static_cast<int64_t>(type.params.size()) - 1)];
    if (spec.type == ParamType::Int || spec.type == ParamType::Float) {
      bool in_range = true;
      const int kind = b.range(0, 7);
      const ParamValue v = edge_value(spec, kind, in_range);
      if (std::holds_alternative<int64_t>(v)) {
        params[spec.name] = std::get<int64_t>(v);
      } else {
        params[spec.name] = std::get<double>(v);
        extreme = extreme || std::abs(std::get<double>(v)) >= 1e10;
      }
      if (!in_range) out_of_range.push_back(spec.name);
    } else if (spec.type == ParamType::Choice) {
      const int64_t c = b.range(0, static_cast<int64_t>(spec.choices.size()));
      if (c == static_cast<int64_t>(spec.choices.size())) {
        params[spec.name] = "no-such-" + spec.name;
        out_of_range.push_back(spec.name);
      } else {
        params[spec.name] = spec.choices[c];
      }
    } else if (spec.type == ParamType::Bool) {
      params[spec.name] = b.flag();
    }
  }
  // The byte of the seed of the global generator (types without their own).
  torch::manual_seed(b.byte());
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("fastattn::attention", "")
                       .typed<Tensor(std::string, const Tensor&, const Tensor&, const Tensor&, bool,
                                     const c10::optional<Tensor>&, const c10::optional<Tensor>&,
                                     std::string, bool)>();
  const std::string json = params.dump();
  Tensor out;
  try {
    out = op.call(name, t.q, t.k, t.v, causal, c10::nullopt, c10::nullopt, json, false);
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    if (!out_of_range.empty()) {
      const bool named =
          std::any_of(out_of_range.begin(), out_of_range.end(),
                      [&](const std::string& p) { return msg.find(p) != std::string::npos; });
      FUZZ_CHECK(named, name << " " << json << ": the out-of-range " << out_of_range.front()
                             << " was refused without naming it: " << msg);
      return;
    }
    bool named = msg.find(name) != std::string::npos;
    for (const auto& [key, value] : params.items())
      named = named || msg.find(key) != std::string::npos;
    FUZZ_CHECK(named,
               name << " " << json << ": refused without naming the type or a parameter: " << msg);
    FUZZ_CHECK(extreme || msg.find("overflowed") == std::string::npos,
               name << " " << json << " at input scale " << s.scale
                    << ": overflowed at an ordinary scale: " << msg);
    return;
  }
  FUZZ_CHECK(out_of_range.empty(),
             name << " " << json << ": accepted the out-of-range " << out_of_range.front());
  check_shape(out, {s.N, s.H, s.L, s.M}, name.c_str());
  FUZZ_CHECK(finite(out), name << " " << json << ": output not finite");
  // Gradients (issue 66): finite, or the backward's overflow error naming the
  // type and its parameters (only where the forward could overflow too).
  try {
    check_backward(out, {t.q, t.k, t.v}, (name + " " + json).c_str());
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    FUZZ_CHECK(
        msg.find("overflowed") != std::string::npos && msg.find(name) != std::string::npos,
        name << " " << json << ": the backward raised without saying it overflowed: " << msg);
    FUZZ_CHECK(extreme, name << " " << json << " at input scale " << s.scale
                             << ": the backward overflowed at an ordinary scale: " << msg);
  }
}

// full_attention_lse_topk: out as full attention (key lengths, not causal), lse
// the log-sum-exp of the kept scaled scores (-inf without keys), top_idx each
// row's topk kept keys by descending score, completed by the lowest unused
// indices.
void fuzz_full_lse_topk(Bytes& b, Setup s) {
  auto t = make_qkv(b, s, true);
  auto kl = key_lengths(b, s.N, s.S);
  const auto temp = softmax_temp(b);
  int64_t topk = b.range(0, s.S);
  const int c = b.range(0, 15);
  bool corrupt = c < 8 && s.N > 0;
  std::string what;
  if (corrupt && c == 6) {
    topk = s.S + 1;
    what = "topk > S";
  } else if (corrupt && c == 7) {
    topk = -1;
    what = "topk < 0";
  } else if (corrupt) {
    what = corrupt_qkv(c, t, kl, s);
  }
  Tensor out, lse, idx;
  if (!run_expecting(corrupt, what, [&] {
        std::tie(out, lse, idx) = full_attention_lse_topk(t.q, t.k, t.v, kl, temp, topk);
      }))
    return;
  const char* op = "full_attention_lse_topk";
  check_shape(out, {s.N, s.H, s.L, s.M}, op);
  check_shape(lse, {s.N, s.H, s.L}, "full_attention_lse_topk lse");
  check_shape(idx, {s.N, s.H, s.L, topk}, "full_attention_lse_topk top_idx");
  FUZZ_CHECK(idx.scalar_type() == torch::kLong, "top_idx is not int64");
  FUZZ_CHECK(finite(out), "full_attention_lse_topk output not finite");
  // Kept keys per row (the same for every query and head of a batch element).
  std::vector<int64_t> kept(s.N, s.S);
  if (kl) {
    for (int64_t n = 0; n < s.N; ++n) kept[n] = (*kl)[n].item<int64_t>();
  }
  // lse: -inf exactly for the elements without keys, finite elsewhere.
  for (int64_t n = 0; n < s.N; ++n) {
    auto row = lse.detach()[n];
    if (kept[n] == 0) {
      FUZZ_CHECK(row.numel() == 0 || (torch::isinf(row) & row.lt(0)).all().item<bool>(),
                 "lse of an element without keys is not -inf");
    } else {
      FUZZ_CHECK(finite(row), "lse not finite for an element with keys");
    }
  }
  // top_idx: distinct indices in [0, S); the first min(topk, kept) are kept
  // keys, the rest the lowest indices not already chosen (kept, kept + 1, ...).
  const auto ia = idx.accessor<int64_t, 4>();
  for (int64_t n = 0; n < s.N; ++n) {
    for (int64_t h = 0; h < s.H; ++h) {
      for (int64_t l = 0; l < s.L; ++l) {
        std::vector<bool> used(s.S, false);
        const int64_t first = std::min(topk, kept[n]);
        for (int64_t j = 0; j < topk; ++j) {
          const int64_t i = ia[n][h][l][j];
          FUZZ_CHECK(i >= 0 && i < s.S, "top_idx " << i << " outside [0, " << s.S << ")");
          FUZZ_CHECK(!used[i], "top_idx repeats " << i);
          used[i] = true;
          if (j < first) {
            FUZZ_CHECK(i < kept[n], "top_idx " << i << " is a masked key (" << kept[n] << " kept)");
          } else {
            // All kept keys came first, so the lowest unused index is j.
            FUZZ_CHECK(i == j, "top_idx completion at " << j << " is " << i);
          }
        }
      }
    }
  }
  if (s.dtype == torch::kDouble) {
    const double tmp = temp.value_or(1.0 / std::sqrt(static_cast<double>(s.E)));
    check_close(out, reference::full_attention(t.q, t.k, t.v, std::nullopt, kl, false, tmp), op);
    auto scores = torch::matmul(t.q.detach(), t.k.detach().transpose(-1, -2)) * tmp;
    if (kl) {
      auto drop = torch::arange(s.S).view({1, 1, 1, s.S}).ge(kl->view({s.N, 1, 1, 1}));
      scores = scores.masked_fill(drop, -INFINITY);
    }
    if (s.S > 0) {
      auto ref_lse = torch::logsumexp(scores, -1);
      auto dead = torch::isinf(ref_lse);
      FUZZ_CHECK(torch::equal(dead, torch::isinf(lse.detach())), "lse -inf at the wrong rows");
      check_close(lse.detach().masked_fill(dead, 0), ref_lse.masked_fill(dead, 0),
                  "full_attention_lse_topk lse");
    }
    // top_idx against the float64 top-k: the chosen kept keys' scores are the
    // top scores (ties in any order), and the indices are exactly torch's
    // top-k on rows without near-ties among the first topk + 1 scores.
    const auto sa = scores.accessor<double, 4>();
    for (int64_t n = 0; n < s.N; ++n) {
      const int64_t first = std::min(topk, kept[n]);
      if (first == 0) continue;
      for (int64_t h = 0; h < s.H; ++h) {
        for (int64_t l = 0; l < s.L; ++l) {
          std::vector<std::pair<double, int64_t>> order;
          for (int64_t j = 0; j < kept[n]; ++j) order.push_back({sa[n][h][l][j], j});
          std::stable_sort(order.begin(), order.end(),
                           [](const auto& a, const auto& b) { return a.first > b.first; });
          const double tol = 1e-9 * (1.0 + std::abs(order[0].first));
          bool near_tie = false;
          for (int64_t j = 0; j < first; ++j) {
            const double got = sa[n][h][l][ia[n][h][l][j]];
            FUZZ_CHECK(std::abs(got - order[j].first) <= tol,
                       "top_idx rank " << j << " has score " << got << ", the top-k has "
                                       << order[j].first);
            if (j + 1 < static_cast<int64_t>(order.size()) &&
                order[j].first - order[j + 1].first <= tol)
              near_tie = true;
          }
          if (near_tie) continue;
          for (int64_t j = 0; j < first; ++j) {
            FUZZ_CHECK(ia[n][h][l][j] == order[j].second, "top_idx rank "
                                                              << j << " is " << ia[n][h][l][j]
                                                              << ", expected " << order[j].second);
          }
        }
      }
    }
  }
  // Backward through out and lse together (lse's gradient on rows without
  // keys is ignored: zero weight there would hide nothing, so use nonzero).
  if (out.requires_grad() && out.numel() > 0) {
    auto w_out = torch::linspace(-1, 1, out.numel(), out.options()).view(out.sizes());
    auto w_lse = torch::linspace(0.5, 1.5, lse.numel(), lse.options()).view(lse.sizes());
    torch::autograd::backward({out, lse}, {w_out, w_lse});
    for (auto* x : {&t.q, &t.k, &t.v}) {
      if (x->grad().defined()) FUZZ_CHECK(finite(x->grad()), op << ": gradient not finite");
    }
  }
}

// improved_clustered_attention (the fused op, given the clusters): random
// assignments in [-1, C) with their counts. Output against the dense
// definition (attention_cases.h) wherever the top-k set is unambiguous (no
// near-tie between the k-th and (k+1)-th kept centroid scores), and against
// full attention when topk = S; padded queries output zeros.
void fuzz_improved_clustered(Bytes& b, Setup s) {
  auto t = make_qkv(b, s, true);
  auto kl = key_lengths(b, s.N, s.S);
  const int64_t C = b.range(1, 4);
  std::vector<int64_t> asg(s.N * s.H * s.L);
  for (auto& x : asg) x = b.range(-1, C - 1);
  auto assignments = torch::tensor(asg, torch::kLong).view({s.N, s.H, s.L});
  auto counts = torch::zeros({s.N, s.H, C + 1}, torch::kLong)
                    .scatter_add_(2, assignments + 1, torch::ones_like(assignments))
                    .narrow(2, 1, C)
                    .contiguous();
  int64_t topk = s.S > 0 ? b.range(1, s.S) : 1;
  const auto temp = softmax_temp(b);
  const int c = b.range(0, 15);
  // S = 0 leaves no valid topk: the op must refuse it.
  bool corrupt = (c < 10 && s.N > 0) || s.S == 0;
  std::string what = s.S == 0 ? "S = 0 (topk must be in [1, S])" : "";
  if (s.S == 0 || !corrupt) {
  } else if (c == 6) {
    topk = s.S + 1;
    what = "topk > S";
  } else if (c == 7) {
    assignments = assignments - (C + 1);
    what = "assignments < -1";
    corrupt = assignments.numel() > 0;
  } else if (c == 8) {
    counts = counts.narrow(1, 0, s.H - 1);
    what = "counts with H - 1 heads";
  } else if (c == 9) {
    // One member moved into the counts of another cluster.
    counts = counts.clone();
    counts.view(-1)[0] += 1;
    what = "counts that disagree with the assignments";
  } else {
    what = corrupt_qkv(c, t, kl, s);
  }
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("fastattn::improved_clustered_attention", "")
                       .typed<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                     const Tensor&, int64_t, const c10::optional<Tensor>&,
                                     c10::optional<double>, double, c10::optional<int64_t>)>();
  Tensor out;
  const c10::optional<Tensor> klc = kl ? c10::optional<Tensor>(*kl) : c10::nullopt;
  const c10::optional<double> tempc = temp ? c10::optional<double>(*temp) : c10::nullopt;
  if (!run_expecting(corrupt, what, [&] {
        out = op.call(t.q, t.k, t.v, assignments, counts, topk, klc, tempc, 0.0, c10::nullopt);
      }))
    return;
  const char* name = "improved_clustered_attention";
  check_shape(out, {s.N, s.H, s.L, s.M}, name);
  FUZZ_CHECK(finite(out), name << " output not finite");
  FUZZ_CHECK(out.detach().masked_select(assignments.lt(0).unsqueeze(-1)).eq(0).all().item<bool>(),
             name << ": a padded query has a nonzero output");
  if (s.dtype == torch::kDouble) {
    auto q = t.q.detach(), k = t.k.detach(), v = t.v.detach();
    if (topk == s.S) {
      auto full = reference::full_attention(q, k, v, std::nullopt, kl, false, temp) *
                  assignments.ge(0).unsqueeze(-1);
      check_close(out.detach(), full, "improved_clustered_attention (topk = S)");
    }
    auto rows = cases::clustered_rows(q, k, assignments, counts, topk, kl, temp);
    const auto& scores = rows.centroid_scores;  // (N, H, C, S): near-ties at the k-th key?
    bool ambiguous = false;
    for (int64_t n = 0; n < s.N && !ambiguous; ++n) {
      const int64_t kept = kl ? (*kl)[n].item<int64_t>() : s.S;
      if (topk >= kept) continue;  // every kept key is in the set
      auto sorted = std::get<0>(scores[n].narrow(-1, 0, kept).sort(-1, /*descending=*/true));
      auto gap = sorted.select(-1, topk - 1) - sorted.select(-1, topk);
      const double tol = 1e-9 * (1.0 + sorted.abs().max().item<double>());
      // Empty clusters (zero centroid, all scores tied) have no members to compare.
      ambiguous = (gap.le(tol) & counts[n].gt(0)).any().item<bool>();
    }
    if (!ambiguous) {
      check_close(out.detach(), torch::matmul(rows.improved, v), "improved_clustered_attention");
    }
  }
  check_backward(out, {t.q, t.k, t.v}, name);
}

// attention_step (the dispatcher op behind Python's fastattn.attention_step):
// a type with a recurrent form stepped through L tokens, sometimes stepping
// twice from the same state (a state is an input that a step must not
// change), against the batch type under a causal mask (fastattn::attention);
// hard-retrieval against the argmax of the raw scores (near-ties may pick
// either key). Corruptions: a bad type, bad parameters, q of rank 2, v of
// another N, a state with a tensor too many or of another dtype.
void fuzz_attention_step(Bytes& b, Setup s) {
  const auto& names = recurrent_attention_names();
  const std::string type = names[b.range(0, static_cast<int64_t>(names.size()) - 1)];
  s.S = s.L;
  s.M = cases::value_width(type, s.E, s.M);  // aft-simple: values as wide as the keys
  auto t = make_qkv(b, s, true);
  std::string params = "{}";
  if (type == "full" && b.flag()) params = R"({"softmax_temp": 0.25})";
  if (type == "causal-linear") {
    // favor: its state carries the running key offset (issue 66).
    static const char* const kMaps[] = {
        R"({"feature_map": "elu"})", R"({"feature_map": "relu", "eps": 0.001})",
        R"({"feature_map": "favor", "n_features": 6, "seed": 1})", R"({"feature_map": "elu"})"};
    params = kMaps[b.range(0, 3)];
  }
  const bool branch = b.flag();
  const int c = b.range(0, 15);
  const bool corrupt = c < 6 && s.N > 0 && s.L > 0;
  const int64_t bad_step = s.L > 0 ? b.range(0, s.L - 1) : 0;
  static auto step = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("fastattn::attention_step", "")
                         .typed<std::tuple<Tensor, std::vector<Tensor>>(
                             std::string, const Tensor&, const Tensor&, const Tensor&,
                             at::TensorList, std::string)>();
  static auto batch = c10::Dispatcher::singleton()
                          .findSchemaOrThrow("fastattn::attention", "")
                          .typed<Tensor(std::string, const Tensor&, const Tensor&, const Tensor&,
                                        bool, const c10::optional<Tensor>&,
                                        const c10::optional<Tensor>&, std::string, bool)>();
  std::vector<Tensor> state, outs;
  for (int64_t i = 0; i < s.L; ++i) {
    Tensor q = t.q.select(2, i), k = t.k.select(2, i), v = t.v.select(2, i);
    std::string ty = type, pj = params, what;
    std::vector<Tensor> st = state;
    const bool bad = corrupt && i == bad_step;
    if (bad) {
      switch (c) {
        case 0:
          ty = "no-such-type";
          what = "an unknown type";
          break;
        case 1:
          pj = R"({"no_such_param": 1})";
          what = "an unknown parameter";
          break;
        case 2:
          q = q.select(0, 0);
          what = "q of rank 2";
          break;
        case 3:
          v = torch::cat({v, v}, 0);
          what = "v with 2N";
          break;
        case 4:
          st.push_back(q);
          what = "a state with a tensor too many";
          break;
        default:
          if (st.empty()) {
            st.push_back(q);
            what = "a first state with one tensor";
          } else {
            st[0] = st[0].to(s.dtype == torch::kDouble ? torch::kFloat : torch::kDouble);
            what = "a state tensor of the other dtype";
          }
      }
    }
    Tensor out;
    std::vector<Tensor> next;
    if (!run_expecting(bad, what, [&] { std::tie(out, next) = step.call(ty, q, k, v, st, pj); }))
      return;
    check_shape(out, {s.N, s.H, s.M}, "attention_step output");
    FUZZ_CHECK(finite(out), "attention_step(" << type << ") output not finite");
    if (branch) {
      // A second step from the same state: the same output.
      auto again = std::get<0>(step.call(ty, q, k, v, st, pj));
      FUZZ_CHECK(torch::equal(again, out),
                 "attention_step(" << type << "): a second step from the same state differs");
    }
    outs.push_back(out);
    state = next;
  }
  if (s.L == 0) return;
  auto got = torch::stack(outs, 2);  // (N, H, L, M)
  // Gradients through the steps (the functional step is differentiable).
  check_backward(got, {t.q, t.k, t.v}, ("attention_step(" + type + ")").c_str());
  if (s.dtype != torch::kDouble) return;
  got = got.detach();
  if (type != "hard-retrieval") {
    auto want = batch.call(type, t.q, t.k, t.v, true, c10::nullopt, c10::nullopt, params, false);
    check_close(got, want, "attention_step vs the causal batch type");
    return;
  }
  // hard-retrieval: the value row of a key j <= i whose raw score is the
  // maximum (up to rounding).
  auto scores = torch::matmul(t.q, t.k.transpose(-1, -2))
                    .masked_fill(torch::ones({s.L, s.L}, torch::kBool).triu(1), -INFINITY);
  auto best = std::get<0>(scores.max(-1, /*keepdim=*/true));
  const double tol = 1e-9 * (1.0 + (best.numel() ? best.abs().max().item<double>() : 0.0));
  auto near = scores.ge(best - tol);  // (N, H, L, L): candidates
  // got row i equals v_j for some candidate j.
  auto eq = (got.unsqueeze(3) - t.v.unsqueeze(2)).abs().amax(-1).eq(0);  // (N, H, L, S)
  FUZZ_CHECK((eq & near).any(-1).all().item<bool>(),
             "attention_step(hard-retrieval): an output is not the value of a best key");
}

struct OpEntry {
  const char* name;
  void (*fn)(Bytes&, Setup);
};

const OpEntry kOps[] = {
    {"full_attention", fuzz_full},
    {"elu_linear_attention", fuzz_elu_linear},
    {"causal_linear_product", fuzz_causal_linear_product},
    {"hard_retrieval_attention", fuzz_hard_retrieval},
    {"block_sparse_attention", fuzz_block_sparse},
    {"clustered_topk_attention", fuzz_clustered_topk},
    {"hash_queries+cluster_codes", fuzz_clustering},
    {"lsh_hash+reformer_attention", fuzz_reformer},
    {"gather_tokens+elu_feature_map", fuzz_gather},
    {"attention types (registry)", fuzz_type},
    {"full_attention_lse_topk", fuzz_full_lse_topk},
    {"improved_clustered_attention", fuzz_improved_clustered},
    {"attention_step", fuzz_attention_step},
    {"attention types, parameters at their limits", fuzz_type_params},
};
constexpr int kOpCount = sizeof(kOps) / sizeof(kOps[0]);
// Stable operator ids: the first byte modulo kIdSpace is the index into kOps
// (append new operators only), and an id past the list skips the input. An
// operator added later takes a free id, so every corpus file keeps the
// operator it was found with (with byte % kOpCount they all moved whenever an
// operator was added).
constexpr int kIdSpace = 32;
static_assert(kOpCount <= kIdSpace, "fuzz operator ids: raise kIdSpace (and keep the corpus ids)");

}  // namespace

int fuzz_op_count() { return kOpCount; }
const char* fuzz_op_name(int op) {
  return op >= 0 && op < kOpCount ? kOps[op].name : "(no operator)";
}

std::string check_fuzz_input(const uint8_t* data, size_t size) {
  Bytes b(data, size);
  const int op = b.byte() % kIdSpace;
  if (op >= kOpCount) return "";  // a free id: no operator yet
  try {
    Setup s = decode_setup(b);
    kOps[op].fn(b, s);
  } catch (const Failure& f) {
    return std::string(kOps[op].name) + ": " + f.what;
  } catch (const Rejected& r) {
    return std::string(kOps[op].name) + ": a valid input was rejected: " + r.what;
  } catch (const c10::Error& e) {
    return std::string(kOps[op].name) +
           ": unexpected c10::Error in the checks: " + e.what_without_backtrace();
  } catch (const std::exception& e) {
    return std::string(kOps[op].name) + ": unexpected exception: " + e.what();
  }
  return "";
}

}  // namespace fastattn::fuzz
