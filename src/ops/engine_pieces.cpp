// Attention types composed on the dense-attention engine
// (src/ops/engine_pieces.h): the pieces' gathers, engine calls, logsumexp
// merge and backward, and the block-sparse patterns as pieces.
#include "ops/engine_pieces.h"

#include <torch/library.h>

#include <algorithm>
#include <functional>
#include <limits>
#include <list>
#include <mutex>
#include <numeric>
#include <sstream>

#include "kernels/reformer/reformer.h"
#include "ops/block_sparse_pattern.h"
#include "ops/dense_attention.h"
#include "ops/op_shell.h"
#include "ops/op_util.h"

namespace fastattn::ops {

void EnginePiece::add_sequence(const int64_t* queries, int64_t nq, const int64_t* keys,
                               int64_t nk) {
  q_rows.insert(q_rows.end(), queries, queries + nq);
  k_rows.insert(k_rows.end(), keys, keys + nk);
  cu_q.push_back(static_cast<int64_t>(q_rows.size()));
  cu_k.push_back(static_cast<int64_t>(k_rows.size()));
}

void add_prefix_sequences(const std::vector<int64_t>& queries, const std::vector<int64_t>& keys,
                          const std::vector<int64_t>& visible, EnginePiece& causal,
                          EnginePiece& full) {
  const size_t n = queries.size();
  size_t i = 0;
  while (i < n) {
    if (visible[i] <= 0) {
      ++i;
      continue;
    }
    size_t j = i + 1;
    const bool flat = j < n && visible[j] == visible[i];
    if (flat)
      while (j < n && visible[j] == visible[i]) ++j;
    else
      while (j < n && visible[j] == visible[j - 1] + 1) ++j;
    (flat ? full : causal)
        .add_sequence(&queries[i], static_cast<int64_t>(j - i), keys.data(), visible[j - 1]);
    i = j;
  }
}

namespace {

using torch::Tensor;

// A piece's index tensors on the inputs' device (sequence offsets stay on the
// host: the engine reads their maxima there), for N batch items.
// Rows are (T) positions shared by every (n, h), or (N, H', T) per (n, h)
// (a piece through a row map).
struct PieceIndex {
  Tensor heads, q_rows, k_rows;  // undefined: all heads / padded
  DenseAttentionSpec spec;
  bool self = false;  // out_i = v_i with lse self_lse (no engine call)
  double self_lse = 0.0;
};

Tensor index_tensor(const std::vector<int64_t>& x, const torch::Device& device) {
  if (x.empty()) return Tensor();
  return torch::tensor(x, torch::kLong).to(device);
}

// The one batch item's offsets repeated for N items.
Tensor repeated_offsets(const std::vector<int64_t>& cu, int64_t N) {
  const int64_t B = static_cast<int64_t>(cu.size()) - 1, total = cu.back();
  std::vector<int64_t> out;
  out.reserve(N * B + 1);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t b = 0; b < B; ++b) out.push_back(cu[b] + n * total);
  out.push_back(N * total);
  return torch::tensor(out, torch::kLong);
}

PieceIndex index_of(const EnginePiece& p, double scale, int64_t N, const torch::Device& device) {
  PieceIndex x;
  x.heads = index_tensor(p.heads, device);
  if (p.self) {
    x.self = true;
    x.self_lse = p.self_score + std::log(static_cast<double>(p.self_count));
    return x;
  }
  x.spec.scale = scale;
  x.spec.causal = p.causal;
  if (p.padded) {
    x.spec.window_left = p.window_left;
    x.spec.window_right = p.window_right;
    return x;
  }
  x.q_rows = index_tensor(p.q_rows, device);
  x.k_rows = index_tensor(p.k_rows, device);
  x.spec.cu_seqlens_q = repeated_offsets(p.cu_q, N);
  x.spec.cu_seqlens_k = repeated_offsets(p.cu_k, N);
  return x;
}

// Per-(n, h) rows (N, H', T) as the index of a gather along dim 2 of x.
Tensor row_index(const Tensor& rows, const Tensor& x) {
  if (x.dim() == 3) return rows;
  return rows.unsqueeze(-1).expand({rows.size(0), rows.size(1), rows.size(2), x.size(3)});
}

// (N, H, R, D) -> the piece's layout: padded (N, H', R, D), packed (N·T, H', D).
Tensor to_piece(const Tensor& x, const Tensor& heads, const Tensor& rows) {
  auto y = heads.defined() ? x.index_select(1, heads) : x;
  if (!rows.defined()) return y;
  const int64_t N = y.size(0), T = rows.size(-1);
  y = rows.dim() == 1 ? y.transpose(1, 2).index_select(1, rows)
                      : y.gather(2, row_index(rows, y)).transpose(1, 2);
  return y.reshape({N * T, y.size(2), y.size(3)});
}

// lse (N, H, L) -> padded (N, H', L), packed (H', N·T).
Tensor lse_to_piece(const Tensor& lse, const Tensor& heads, const Tensor& rows) {
  auto y = heads.defined() ? lse.index_select(1, heads) : lse;
  if (!rows.defined()) return y;
  y = rows.dim() == 1 ? y.index_select(2, rows) : y.gather(2, rows);
  return y.transpose(0, 1).reshape({y.size(1), -1});
}

// A piece's (N, H', ...) result into `full` (N, H, R, ...): rows and heads
// by index (added: keys repeat across sequences; copied for out and lse).
void from_piece(Tensor& full, Tensor piece, const Tensor& heads, const Tensor& rows, bool add) {
  if (rows.defined()) {
    const int64_t N = full.size(0), T = rows.size(-1);
    if (piece.dim() == 3 && full.dim() == 4) {  // (N·T, H', D) -> (N, H', T, D)
      piece = piece.view({N, T, piece.size(1), piece.size(2)}).transpose(1, 2);
    } else {  // lse (H', N·T) -> (N, H', T)
      piece = piece.view({piece.size(0), N, T}).transpose(0, 1);
    }
    auto sizes = full.sizes().vec();
    sizes[1] = piece.size(1);
    auto spread = add ? torch::zeros(sizes, full.options())
                      : torch::full(sizes, full.dim() == 3 ? -INFINITY : 0.0, full.options());
    piece = piece.to(full.scalar_type());
    if (rows.dim() == 3)
      add ? spread.scatter_add_(2, row_index(rows, spread), piece)
          : spread.scatter_(2, row_index(rows, spread), piece);
    else
      add ? spread.index_add_(2, rows, piece) : spread.index_copy_(2, rows, piece);
    piece = spread;
  }
  if (!heads.defined()) {
    add ? full.add_(piece) : full.copy_(piece);
  } else {
    add ? full.index_add_(1, heads, piece.to(full.scalar_type()))
        : full.index_copy_(1, heads, piece.to(full.scalar_type()));
  }
}

std::tuple<Tensor, Tensor> pieces_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                          const std::vector<PieceIndex>& pieces) {
  const int64_t N = q.size(0), H = q.size(1), L = q.size(2), M = v.size(3);
  Tensor out, lse;
  for (const auto& p : pieces) {
    Tensor o, l;
    if (p.self) {
      o = v, l = torch::full({N, H, L}, p.self_lse, q.options().dtype(stats_dtype(q)));
    } else {
      std::tie(o, l) =
          dense_attention_forward(to_piece(q, p.heads, p.q_rows), to_piece(k, p.heads, p.k_rows),
                                  to_piece(v, p.heads, p.k_rows), p.spec);
    }
    o = o.to(l.scalar_type());  // merged in lse's precision (float32 for 16-bit inputs)
    if (p.heads.defined() || p.q_rows.defined()) {
      auto o_full = torch::zeros({N, H, L, M}, o.options());
      auto l_full = torch::full({N, H, L}, -INFINITY, l.options());
      from_piece(o_full, o, p.heads, p.q_rows, false);
      from_piece(l_full, l, p.heads, p.q_rows, false);
      o = o_full, l = l_full;
    }
    if (!out.defined()) {
      out = o, lse = l;
    } else {
      std::tie(out, lse) = merge_by_lse({out, o}, {lse, l});
    }
  }
  if (!out.defined())
    return {torch::zeros({N, H, L, M}, q.options()),
            torch::full({N, H, L}, -INFINITY, q.options().dtype(stats_dtype(q)))};
  return {out.to(q.scalar_type()), lse};
}

std::vector<PieceIndex> index_all(const std::vector<EnginePiece>& pieces, double scale, int64_t N,
                                  const torch::Device& device) {
  std::vector<PieceIndex> out;
  for (const auto& p : pieces)
    if (!p.empty()) out.push_back(index_of(p, scale, N, device));
  return out;
}

struct SavedPieces : torch::CustomClassHolder {
  std::vector<PieceIndex> pieces;
};

struct PiecesOp {
  struct Saved {
    Tensor q, k, v, out, lse;
    c10::intrusive_ptr<SavedPieces> pieces;
    auto tensors() { return std::tie(q, k, v, out, lse); }
  };

  static Tensor forward(Saved* saved, const Tensor& q, const Tensor& k, const Tensor& v,
                        const c10::intrusive_ptr<SavedPieces>& pieces) {
    auto [out, lse] = pieces_forward(q, k, v, pieces->pieces);
    if (saved) *saved = {q, k, v, out, lse, pieces};
    return out;
  }

  static torch::autograd::variable_list backward(const Saved& s,
                                                 const torch::autograd::variable_list& grads) {
    const auto& q = s.q;
    const auto& k = s.k;
    const auto& v = s.v;
    const auto& out = s.out;
    const auto& lse = s.lse;
    const auto acc = stats_dtype(q);  // gradients summed over pieces in float32 at least
    auto dq = torch::zeros(q.sizes(), q.options().dtype(acc));
    auto dk = torch::zeros(k.sizes(), k.options().dtype(acc));
    auto dv = torch::zeros(v.sizes(), v.options().dtype(acc));
    const auto grad_out = grads[0].to(out.scalar_type());
    for (const auto& p : s.pieces->pieces) {
      if (p.self) {  // dv_i += P_ii grad_out_i, P_ii = exp(self_lse - lse_i)
        dv.add_((p.self_lse - lse).exp().unsqueeze(-1).to(acc) * grad_out.to(acc));
        continue;
      }
      auto [gq, gk, gv] = dense_attention_backward(
          to_piece(grad_out, p.heads, p.q_rows), to_piece(q, p.heads, p.q_rows),
          to_piece(k, p.heads, p.k_rows), to_piece(v, p.heads, p.k_rows),
          to_piece(out, p.heads, p.q_rows), lse_to_piece(lse, p.heads, p.q_rows), p.spec);
      from_piece(dq, gq, p.heads, p.q_rows, true);
      from_piece(dk, gk, p.heads, p.k_rows, true);
      from_piece(dv, gv, p.heads, p.k_rows, true);
    }
    return {dq.to(q.scalar_type()), dk.to(k.scalar_type()), dv.to(v.scalar_type())};
  }
};

}  // namespace

Tensor attention_over_pieces(const Tensor& q, const Tensor& k, const Tensor& v, double scale,
                             std::vector<EnginePiece> pieces) {
  auto saved = c10::make_intrusive<SavedPieces>();
  saved->pieces = index_all(pieces, scale, q.size(0), q.device());
  return Shell<PiecesOp>::autograd(q, k, v, saved);
}

// ---- the block-sparse patterns as pieces -----------------------------------
//
// Positions as the block-sparse operator's: query i at p = i + S - L (negative
// when L > S), key j at j; d = j - p. Planned in positions; query rows are
// p - (S - L) at the end.

namespace {

int64_t floor_div(int64_t a, int64_t b) { return a / b - ((a % b != 0) && ((a < 0) != (b < 0))); }
int64_t floor_mod(int64_t a, int64_t b) { return a - floor_div(a, b) * b; }

std::vector<int64_t> range_of(int64_t begin, int64_t end) {
  std::vector<int64_t> x(std::max<int64_t>(0, end - begin));
  std::iota(x.begin(), x.end(), begin);
  return x;
}

// Which heads see which sub-pattern: merged and A1 / A2 alone every head,
// split the first ceil(H/2) A1 and the others A2 ({} = all heads).
struct HeadSplit {
  bool a1 = true, a2 = true;
  std::vector<int64_t> a1_heads, a2_heads;
};

HeadSplit split_heads(int64_t which, int64_t H) {
  HeadSplit s;
  s.a1 = which != 2;
  s.a2 = which != 1;
  if (which == 3) {
    s.a1_heads = range_of(0, (H + 1) / 2);
    s.a2_heads = range_of((H + 1) / 2, H);
    s.a2 = !s.a2_heads.empty();
  }
  return s;
}

EnginePiece packed_piece(bool causal, std::vector<int64_t> heads) {
  EnginePiece p;
  p.causal = causal;
  p.heads = std::move(heads);
  return p;
}

EnginePiece window_piece(int64_t left, int64_t right, bool causal, std::vector<int64_t> heads) {
  EnginePiece p = packed_piece(causal, std::move(heads));
  p.padded = true;
  p.window_left = left;
  p.window_right = right;
  return p;
}

// sparse-strided: A1 the window |d| <= l (causal -l <= d <= 0), one padded
// piece; A2 the residue class d ≡ 0 (mod l). Position r + t·l of class r has
// index t there; merged with A1 the class keeps only |t_k - t_q| >= 2
// (|d| > l), which is a causal sequence per class over the class's keys in
// order (t_k <= t_q - 2) and, without causal, another over them in reverse
// (t_k >= t_q + 2).
void strided_pieces(int64_t l, int64_t which, bool causal, int64_t H, int64_t L, int64_t S,
                    std::vector<EnginePiece>& pieces) {
  l = std::min(l, L + S);  // any longer stride gives the same keys (|d| < L + S)
  const auto heads = split_heads(which, H);
  if (heads.a1) pieces.push_back(window_piece(l, causal ? 0 : l, causal, heads.a1_heads));
  if (!heads.a2) return;
  const int64_t g = which == 0 ? 2 : 0;
  std::vector<int64_t> order = range_of(S - L, S);  // query positions, grouped by class
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return floor_mod(a, l) < floor_mod(b, l); });
  EnginePiece fwd_causal = packed_piece(true, heads.a2_heads),
              fwd_full = packed_piece(false, heads.a2_heads);
  EnginePiece rev_causal = packed_piece(true, heads.a2_heads),
              rev_full = packed_piece(false, heads.a2_heads);
  for (size_t i = 0; i < order.size();) {
    const int64_t r = floor_mod(order[i], l);
    size_t e = i;
    while (e < order.size() && floor_mod(order[e], l) == r) ++e;
    std::vector<int64_t> qs(order.begin() + i, order.begin() + e);
    i = e;
    const int64_t K = r < S ? (S - 1 - r) / l + 1 : 0;  // the class's keys r + t·l < S
    if (K == 0) continue;
    std::vector<int64_t> ks(K);
    for (int64_t t = 0; t < K; ++t) ks[t] = r + t * l;
    std::vector<int64_t> f(qs.size());
    const auto tq = [&](int64_t p) { return floor_div(p - r, l); };
    for (size_t a = 0; a < qs.size(); ++a) {
      // causal: t_k <= t_q - g; without causal, alone: all; merged: t_k <= t_q - 2
      f[a] = causal || g ? std::clamp<int64_t>(tq(qs[a]) - g + 1, 0, K) : K;
    }
    add_prefix_sequences(qs, ks, f, fwd_causal, fwd_full);
    if (causal || !g) continue;
    std::reverse(qs.begin(), qs.end());
    std::reverse(ks.begin(), ks.end());
    for (size_t a = 0; a < qs.size(); ++a)
      f[a] = K - std::clamp<int64_t>(tq(qs[a]) + 2, 0, K);  // t_k >= t_q + 2
    add_prefix_sequences(qs, ks, f, rev_causal, rev_full);
  }
  for (auto* p : {&fwd_causal, &fwd_full, &rev_causal, &rev_full}) pieces.push_back(std::move(*p));
}

// sparse-fixed: A1 the query's block of l positions, A2 the summary positions
// j mod l in [lo, hi) of head group h mod groups. Merged without causal: the
// block minus its summaries and all summaries; merged with causal: the block
// up to the query and the summaries of earlier blocks; A2 alone: the
// summaries (causal: those <= p, a prefix of them in order).
void fixed_pieces(int64_t l, int64_t c, int64_t which, bool per_head, bool causal, int64_t H,
                  int64_t L, int64_t S, std::vector<EnginePiece>& pieces) {
  const auto heads = split_heads(which, H);
  const int64_t groups = per_head ? std::min<int64_t>(H, std::max<int64_t>(1, l / c)) : 1;
  const auto block = [&](int64_t p) { return floor_div(p, l); };
  const std::vector<int64_t> queries = range_of(S - L, S);
  // The queries of each block, and the block's keys (optionally minus summaries).
  const auto block_families = [&](EnginePiece& with_causal, EnginePiece& full,
                                  const std::function<bool(int64_t)>& key_kept) {
    for (size_t i = 0; i < queries.size();) {
      const int64_t b = block(queries[i]);
      size_t e = i;
      while (e < queries.size() && block(queries[e]) == b) ++e;
      std::vector<int64_t> qs(queries.begin() + i, queries.begin() + e), ks, f;
      i = e;
      if (b < 0) continue;  // positions before the first key: no block keys
      const int64_t k0 = b * l, k1 = std::min(S, l > S ? S : k0 + l);
      for (int64_t j = k0; j < k1; ++j)
        if (key_kept(j)) ks.push_back(j);
      for (int64_t p : qs) f.push_back(causal ? p - k0 + 1 : static_cast<int64_t>(ks.size()));
      add_prefix_sequences(qs, ks, f, with_causal, full);
    }
  };
  // The heads of group g among hs ({} = all heads): none is {-1}.
  const std::vector<int64_t> kNone{-1};
  const auto heads_of_group = [&](const std::vector<int64_t>& hs, int64_t g) {
    if (groups == 1) return hs;
    std::vector<int64_t> out;
    for (int64_t h = 0; h < H; ++h)
      if (h % groups == g && (hs.empty() || std::count(hs.begin(), hs.end(), h))) out.push_back(h);
    return out.empty() ? std::vector<int64_t>{-1} : out;
  };
  const bool minus_summaries = which == 0 && !causal;
  if (heads.a1 && !minus_summaries) {
    EnginePiece a = packed_piece(true, heads.a1_heads), b = packed_piece(false, heads.a1_heads);
    block_families(a, b, [](int64_t) { return true; });
    pieces.push_back(std::move(a));
    pieces.push_back(std::move(b));
  }
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t hi = l - c * g, lo = hi - c;
    const auto summary = [&](int64_t j) {
      const int64_t m = floor_mod(j, l);
      return m >= lo && m < hi;
    };
    const auto a1_heads = heads_of_group(heads.a1_heads, g);
    const auto a2_heads = heads_of_group(heads.a2_heads, g);
    if (heads.a1 && minus_summaries && a1_heads != kNone) {
      EnginePiece a = packed_piece(true, a1_heads), b = packed_piece(false, a1_heads);
      block_families(a, b, [&](int64_t j) { return !summary(j); });
      pieces.push_back(std::move(a));
      pieces.push_back(std::move(b));
    }
    if (!heads.a2 || a2_heads == kNone) continue;
    std::vector<int64_t> ks, f;
    for (int64_t j = 0; j < S; ++j)
      if (summary(j)) ks.push_back(j);
    for (int64_t p : queries) {
      // without causal all summaries; merged with causal those of earlier
      // blocks; alone with causal those <= p
      const int64_t bound = !causal ? S : which == 0 ? block(p) * l : p + 1;
      f.push_back(std::lower_bound(ks.begin(), ks.end(), bound) - ks.begin());
    }
    EnginePiece a = packed_piece(true, a2_heads), b = packed_piece(false, a2_heads);
    add_prefix_sequences(queries, ks, f, a, b);
    pieces.push_back(std::move(a));
    pieces.push_back(std::move(b));
  }
}

}  // namespace

std::vector<EnginePiece> block_sparse_pieces(const std::string& pattern,
                                             const std::vector<int64_t>& params, bool causal,
                                             int64_t H, int64_t L, int64_t S) {
  const int kind = check_sparse_pattern("block_sparse_pieces", pattern, params, H);
  std::vector<EnginePiece> pieces;
  switch (kind) {
    case 0: {  // local
      const int64_t w = params[0];
      pieces.push_back(
          window_piece(causal ? w - 1 : w / 2, causal ? 0 : w - 1 - w / 2, causal, {}));
      return pieces;
    }
    case 3:
      pieces.push_back(window_piece(params[0], params[1], causal, {}));
      return pieces;
    case 1:
      strided_pieces(params[0], params[1], causal, H, L, S, pieces);
      break;
    default:
      fixed_pieces(params[0], params[1], params[2], params[3] != 0, causal, H, L, S, pieces);
  }
  for (auto& p : pieces)
    for (auto& row : p.q_rows) row -= S - L;
  pieces.erase(
      std::remove_if(pieces.begin(), pieces.end(), [](const EnginePiece& p) { return p.empty(); }),
      pieces.end());
  return pieces;
}

// ---- compositions with cached plans ---------------------------------------

namespace {

// Plans that depend only on a pattern and a shape, indexed on a device: the
// 16 latest by key (planning walks every position on the host and uploads
// index tensors: once per shape, not once per call).
std::vector<PieceIndex> cached_plan(const std::string& key,
                                    const std::function<std::vector<EnginePiece>()>& plan,
                                    int64_t N, const torch::Device& device) {
  static std::mutex mutex;
  static std::list<std::pair<std::string, std::vector<PieceIndex>>> cache;
  {
    std::lock_guard<std::mutex> lock(mutex);
    for (auto it = cache.begin(); it != cache.end(); ++it)
      if (it->first == key) {
        cache.splice(cache.begin(), cache, it);
        return it->second;
      }
  }
  auto indexed = index_all(plan(), 1.0, N, device);
  std::lock_guard<std::mutex> lock(mutex);
  cache.emplace_front(key, indexed);
  if (cache.size() > 16) cache.pop_back();
  return indexed;
}

// The window of Reformer and ClusterFormer in sorted order: the chunk of c
// slots holding a query and the chunk before it. With mask_self the query's own slot is left out
// of the engine's pieces (the slots before it, a causal sequence per chunk;
// those after it, one over the chunk in reverse) and comes back as a piece
// of its own with score kReformerSelfScore.
std::vector<EnginePiece> sorted_chunk_pieces(int64_t L, int64_t c, bool mask_self) {
  EnginePiece before = packed_piece(true, {}), after = packed_piece(true, {}),
              window = packed_piece(false, {});
  for (int64_t m0 = 0; m0 < L; m0 += c) {
    const int64_t nq = std::min(c, L - m0), k0 = std::max<int64_t>(0, m0 - c);
    std::vector<int64_t> qs = range_of(m0, m0 + nq), ks = range_of(k0, m0 + nq), f(nq);
    for (int64_t t = 0; t < nq; ++t) f[t] = mask_self ? m0 - k0 + t : m0 - k0 + nq;
    add_prefix_sequences(qs, ks, f, before, window);
    if (!mask_self) continue;
    std::reverse(qs.begin(), qs.end());
    ks = range_of(m0, m0 + nq);
    std::reverse(ks.begin(), ks.end());
    for (int64_t t = 0; t < nq; ++t) f[t] = t;
    add_prefix_sequences(qs, ks, f, after, window);
  }
  return {before, after, window};
}

}  // namespace

Tensor block_sparse_on_engine(const Tensor& q, const Tensor& k, const Tensor& v, double scale,
                              const std::string& pattern, const std::vector<int64_t>& params,
                              bool causal) {
  const int64_t N = q.size(0), H = q.size(1), L = q.size(2), S = k.size(2);
  std::ostringstream key;
  key << pattern << c10::IntArrayRef(params) << causal << ' ' << N << ' ' << H << ' ' << L << ' '
      << S << ' ' << q.device();
  auto saved = c10::make_intrusive<SavedPieces>();
  saved->pieces = cached_plan(
      key.str(), [&] { return block_sparse_pieces(pattern, params, causal, H, L, S); }, N,
      q.device());
  for (auto& p : saved->pieces) p.spec.scale = scale;
  return Shell<PiecesOp>::autograd(q, k, v, saved);
}

Tensor sorted_chunks_on_engine(const Tensor& q, const Tensor& k, const Tensor& v,
                               const std::vector<Tensor>& orders, int64_t chunk_size,
                               bool mask_self, double scale) {
  const int64_t N = q.size(0), L = q.size(2);
  const int64_t c = chunk_size < L ? chunk_size : std::max<int64_t>(L, 1);
  std::ostringstream key;
  key << "sorted chunks " << c << ' ' << mask_self << ' ' << N << ' ' << L << ' ' << q.device();
  const auto plan = cached_plan(
      key.str(), [&] { return sorted_chunk_pieces(L, c, mask_self); }, N, q.device());
  // Each order's pieces through it: slot t of (n, h) holds position order[n][h][t].
  auto saved = c10::make_intrusive<SavedPieces>();
  for (const auto& order : orders) {
    for (auto p : plan) {
      p.q_rows = order.index_select(2, p.q_rows);
      p.k_rows = order.index_select(2, p.k_rows);
      p.spec.scale = scale;
      saved->pieces.push_back(std::move(p));
    }
  }
  if (mask_self) {  // every order's window holds the query itself once
    PieceIndex self;
    self.self = true;
    self.self_lse = kernels::kReformerSelfScore + std::log(static_cast<double>(orders.size()));
    saved->pieces.push_back(self);
  }
  return Shell<PiecesOp>::autograd(q, k, v, saved);
}

Tensor reformer_on_engine(const Tensor& q, const Tensor& v, const Tensor& buckets,
                          int64_t chunk_size, bool mask_self, double scale) {
  const int64_t L = q.size(2);
  // Per round the positions by bucket, then position (as the operator).
  auto order = (buckets * L + torch::arange(L, buckets.options())).argsort(int64_t{-1});
  std::vector<Tensor> orders;
  for (int64_t r = 0; r < buckets.size(2); ++r) orders.push_back(order.select(2, r));
  // Shared QK: the keys are the normalised queries (gradients to q through both).
  auto keys = q / q.norm(2, -1, true).clamp_min(1e-12);
  return sorted_chunks_on_engine(q, keys, v, orders, chunk_size, mask_self, scale);
}

}  // namespace fastattn::ops

namespace {

at::Tensor block_sparse_on_engine_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     double scale, c10::string_view pattern,
                                     c10::IntArrayRef params, bool causal) {
  return fastattn::ops::block_sparse_on_engine(q, k, v, scale, std::string(pattern), params.vec(),
                                               causal);
}

}  // namespace

TORCH_LIBRARY_IMPL(fastattn, CompositeImplicitAutograd, m) {
  m.impl("_block_sparse_on_engine", block_sparse_on_engine_op);
}
