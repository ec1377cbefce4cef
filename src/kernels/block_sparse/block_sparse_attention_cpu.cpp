// CPU kernels of block-sparse softmax attention (see block_sparse_attention.h).
//
// Forward, per part, per work item (n, h, tile of kBq queries in the part's
// query order): the rows' kept key intervals give the tile's key-block range;
// per chunk of up to kChunk keys: S = Q·K^T per key tile of kBk keys (K
// ordered and packed in panels) for the rows that reach it, scale and cut
// each row to its intervals, one online softmax update per row, O += P·V per
// key tile. The first part of a head starts from nothing, the last one
// normalises and writes lse; between them the state (O, max, sum) waits in
// out / lse / a buffer.
//
// Backward, per part: when the heads share out evenly between the threads,
// one pass per head (per key tile, over the query tiles that may see it: P
// from the saved lse, dP = dO·V^T, dS = P ∘ (dP - delta)·scale,
// dV += P^T·dO, dK += dS^T·Q, dQ += dS·K). Otherwise finer items in two
// passes: a dQ pass per query tile and a dK/dV pass per key tile, each
// computing P and dS. Query tiles stay gathered in a few slots per thread
// while consecutive key tiles see them. Every item writes rows no other item
// writes, so no thread keeps a private copy of a gradient.
#include "kernels/block_sparse/block_sparse_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <numeric>
#include <vector>

#include "kernels/common/isa_target.h"
#include "kernels/common/dropout_rows.h"
#include "kernels/common/gemm.h"
#include "kernels/common/parallel.h"
#include "kernels/common/scratch.h"
#include "kernels/common/simd.h"
#include "kernels/common/softmax_rows.h"

FASTATTN_ISA_BEGIN

// ---- patterns -> parts --------------------------------------------------------

// Offsets and strides beyond any distance between two positions act alike
// (every key in the band; one key per residue class): they are cut to kFar so
// that the kernels' position arithmetic (p + hi, j + l) cannot overflow int64
// (a stride of 2^63 - 1 wrapped around in the backward's plans and crashed
// it). Positions stay below 2^62 (tensor sizes).
constexpr int64_t kFar = int64_t{1} << 62;

std::vector<SparsePart> make_sparse_parts(int pattern, const std::vector<int64_t>& params,
                                          bool causal, int64_t H) {
  std::vector<SparsePart> parts;
  if (pattern == kLocalPattern || pattern == kWindowPattern) {
    SparsePart p;
    p.kind = SparsePartKind::Band;
    if (pattern == kLocalPattern) {
      const int64_t w = params.at(0);
      p.lo = std::max(-kFar, causal ? -(w - 1) : -(w / 2));
      p.hi = std::min(kFar, causal ? 0 : w - 1 - w / 2);
    } else {  // keys p - left .. p + right (causal: .. p)
      p.lo = -std::min(params.at(0), kFar);
      p.hi = std::min(causal ? int64_t{0} : kFar, params.at(1));
    }
    p.head_end = H;
    parts.push_back(p);
    return parts;
  }
  const bool fixed = pattern == kFixedPattern;
  // fixed: the stride also places the summary positions (the last c of each
  // block), so it is kept; its arithmetic stays in range (l - c·g >= 0).
  const int64_t l = fixed ? params.at(0) : std::min(params.at(0), kFar);
  const int64_t which = fixed ? params.at(2) : params.at(1);
  SparsePart a1, a2;
  if (fixed) {
    a1.kind = SparsePartKind::SameBlock;
    a2.kind = SparsePartKind::Summary;
    a2.summary = params.at(1);
    a2.per_head = params.at(3) != 0;
  } else {
    a1.kind = SparsePartKind::Band;
    a1.lo = -l;
    a1.hi = causal ? 0 : l;
    a2.kind = SparsePartKind::Residue;
  }
  a1.stride = a2.stride = l;
  a1.causal = a2.causal = causal;
  a1.head_end = a2.head_end = H;
  if (which == 0) {  // merged: A1 ∪ A2, A2 without what A1 has
    a2.exclude = true;
    parts = {a1, a2};
  } else if (which == 1) {
    parts = {a1};
  } else if (which == 2) {
    parts = {a2};
  } else {  // split heads
    a1.head_end = (H + 1) / 2;
    a2.head_begin = a1.head_end;
    parts = {a1, a2};
  }
  return parts;
}

namespace {

constexpr int64_t kBq = 64;      // queries per tile
constexpr int64_t kBk = 32;      // keys per tile
constexpr int64_t kChunk = 256;  // forward: keys per softmax update

int64_t floor_div(int64_t a, int64_t b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }
int64_t floor_mod(int64_t a, int64_t b) { return a - floor_div(a, b) * b; }

// Kept ordered keys of one query: [a, b] minus [x, y] (x > y: nothing removed).
struct Range {
  int64_t a = 0, b = -1, x = 0, y = -1;
  bool empty() const { return a > b; }
};

// One part's orders for one head (heads share it unless per-head summaries).
struct Geometry {
  const SparsePart* part = nullptr;
  int64_t L = 0, S = 0, off = 0;
  int64_t Sp = 0;                     // keys in the part's order
  std::vector<int64_t> q_order;       // ordered query -> query index; empty: identity
  std::vector<int64_t> k_order;       // ordered key -> key index; empty: identity
  std::vector<int64_t> kstart;        // Residue: first ordered key of class r, r <= min(l, S)
  int64_t s_lo = 0, s_hi = 0;         // Summary: kept residues [s_lo, s_hi)
  std::vector<int64_t> kt_ptr, kt_q;  // backward: query tiles that may see key tile t (CSR)

  // Summary positions <= x (x < S).
  int64_t summary_count(int64_t x) const {
    if (x < 0) return 0;
    const int64_t l = part->stride, blk = floor_div(x, l), rem = x - blk * l;
    return blk * (s_hi - s_lo) + std::clamp<int64_t>(rem - s_lo + 1, 0, s_hi - s_lo);
  }

  Range row(int64_t i, int64_t len) const {
    const SparsePart& pt = *part;
    const int64_t p = i + off, l = pt.stride;
    Range r;
    switch (pt.kind) {
      case SparsePartKind::Band:
        r.a = std::max<int64_t>(0, p + pt.lo);
        r.b = std::min(len - 1, p + pt.hi);
        break;
      case SparsePartKind::SameBlock: {
        const int64_t start = floor_div(p, l) * l;
        r.a = std::max<int64_t>(0, start);
        r.b = std::min(len - 1, pt.causal ? p : start + l - 1);
        break;
      }
      case SparsePartKind::Residue: {
        const int64_t res = floor_mod(p, l), m = floor_div(p, l);
        if (res >= S || res >= len) return r;
        int64_t mhi = (len - 1 - res) / l;
        if (pt.causal) mhi = std::min(mhi, m);
        if (mhi < 0) return r;
        r.a = kstart[res];
        r.b = kstart[res] + mhi;
        if (pt.exclude) {
          r.x = std::max(r.a, kstart[res] + m - 1);
          r.y = std::min(r.b, kstart[res] + m + 1);
        }
        break;
      }
      case SparsePartKind::Summary: {
        r.a = 0;
        r.b = summary_count(std::min(len - 1, pt.causal ? p : len - 1)) - 1;
        if (pt.exclude) {
          const int64_t c = s_hi - s_lo, blk = floor_div(p, l);
          r.x = std::max(r.a, blk * c);
          r.y = std::min(r.b, blk * c + c - 1);
        }
        break;
      }
    }
    return r;
  }
};

Geometry make_geometry(const SparsePart& part, int64_t h, int64_t L, int64_t S,
                       bool with_transpose) {
  Geometry g;
  g.part = &part;
  g.L = L;
  g.S = S;
  g.off = S - L;
  g.Sp = S;
  const int64_t l = part.stride;
  if (part.kind == SparsePartKind::Residue) {
    const int64_t classes = std::min(l, S);
    g.kstart.assign(classes + 1, 0);
    g.k_order.reserve(S);
    for (int64_t r = 0; r < classes; ++r) {
      g.kstart[r] = static_cast<int64_t>(g.k_order.size());
      for (int64_t j = r; j < S; j += l) g.k_order.push_back(j);
    }
    g.kstart[classes] = S;
    // Queries by the residue of p = i + off, ascending i within a class.
    const int64_t off = g.off;
    if (l <= L) {
      g.q_order.reserve(L);
      for (int64_t r = 0; r < l; ++r)
        for (int64_t i = floor_mod(r - off, l); i < L; i += l) g.q_order.push_back(i);
    } else {  // at most one query per class
      g.q_order.resize(L);
      std::iota(g.q_order.begin(), g.q_order.end(), int64_t{0});
      std::stable_sort(g.q_order.begin(), g.q_order.end(), [&](int64_t a, int64_t b) {
        return floor_mod(a + off, l) < floor_mod(b + off, l);
      });
    }
  } else if (part.kind == SparsePartKind::Summary) {
    const int64_t c = part.summary;
    const int64_t grp = part.per_head ? h % std::max<int64_t>(1, l / c) : 0;
    g.s_hi = l - c * grp;
    g.s_lo = g.s_hi - c;
    for (int64_t j = 0; j < S; ++j) {
      const int64_t res = j % l;
      if (res >= g.s_lo && res < g.s_hi) g.k_order.push_back(j);
    }
    g.Sp = static_cast<int64_t>(g.k_order.size());
  }
  if (with_transpose) {
    const int64_t q_tiles = (L + kBq - 1) / kBq, k_tiles = (g.Sp + kBk - 1) / kBk;
    std::vector<std::pair<int64_t, int64_t>> ranges(q_tiles, {0, -1});
    g.kt_ptr.assign(k_tiles + 1, 0);
    for (int64_t t = 0; t < q_tiles; ++t) {
      int64_t lo = std::numeric_limits<int64_t>::max(), hi = -1;
      for (int64_t r = t * kBq; r < std::min(L, t * kBq + kBq); ++r) {
        const Range rr = g.row(g.q_order.empty() ? r : g.q_order[r], S);
        if (rr.empty()) continue;
        lo = std::min(lo, rr.a);
        hi = std::max(hi, rr.b);
      }
      if (hi < 0) continue;
      ranges[t] = {lo / kBk, hi / kBk};
      for (int64_t kb = lo / kBk; kb <= hi / kBk; ++kb) ++g.kt_ptr[kb + 1];
    }
    for (int64_t kb = 0; kb < k_tiles; ++kb) g.kt_ptr[kb + 1] += g.kt_ptr[kb];
    g.kt_q.resize(g.kt_ptr[k_tiles]);
    std::vector<int64_t> fill(g.kt_ptr.begin(), g.kt_ptr.end() - 1);
    for (int64_t t = 0; t < q_tiles; ++t)
      for (int64_t kb = ranges[t].first; kb <= ranges[t].second; ++kb) g.kt_q[fill[kb]++] = t;
  }
  return g;
}

// The geometries of one part: one per distinct head group; index[h] or -1.
struct PartGeometries {
  std::vector<Geometry> geos;
  std::vector<int64_t> index;
  const Geometry* of(int64_t h) const { return index[h] < 0 ? nullptr : &geos[index[h]]; }
};

PartGeometries make_part_geometries(const SparsePart& part, int64_t H, int64_t L, int64_t S,
                                    bool with_transpose) {
  PartGeometries pg;
  pg.index.assign(H, -1);
  const bool per_head = part.kind == SparsePartKind::Summary && part.per_head;
  // Head h uses group h mod (l / c): at most H of them exist (l / c can be 2^62).
  const int64_t groups =
      per_head ? std::min(H, std::max<int64_t>(1, part.stride / part.summary)) : 1;
  std::vector<int64_t> made(groups, -1);
  for (int64_t h = part.head_begin; h < part.head_end; ++h) {
    const int64_t grp = per_head ? h % groups : 0;
    if (made[grp] < 0) {
      made[grp] = static_cast<int64_t>(pg.geos.size());
      pg.geos.push_back(make_geometry(part, h, L, S, with_transpose));
    }
    pg.index[h] = made[grp];
  }
  for (auto& g : pg.geos) g.part = &part;
  return pg;
}

// Keys of every covered (n, h) in the part's order: packed panels (for Q·K^T)
// and, when the order is not the identity, row-major copies.
template <typename T>
struct OrderedKeys {
  int64_t S_pad = 0;
  ScratchArray<T> panels;  // (N·H, S_pad·D)
  ScratchArray<T> rows;    // (N·H, Sp·D) or null (identity: use the input)
};

template <typename T>
OrderedKeys<T> order_keys(const T* x, const RowStrides& xr, const PartGeometries& pg, int64_t N,
                          int64_t H, int64_t S, int64_t D, bool want_panels, bool want_rows,
                          int num_threads) {
  constexpr int64_t NR = panel_width<T>();
  int64_t Sp = 0;
  bool identity = true;
  for (const auto& g : pg.geos) {
    Sp = std::max(Sp, g.Sp);
    identity = identity && g.k_order.empty();
  }
  OrderedKeys<T> ok;
  ok.S_pad = round_up(std::max<int64_t>(Sp, 1), NR);
  if (want_panels) ok.panels.reset(static_cast<size_t>(N * H * ok.S_pad * D));
  if (want_rows && !identity) ok.rows.reset(static_cast<size_t>(N * H * Sp * D));
  struct Gather {
    std::vector<T> buf;
  };
  parallel_items<Gather>(
      N * H, num_threads, [](Gather&) {},
      [&](int64_t nh, Gather& w) {
        const Geometry* g = pg.of(nh % H);
        if (g == nullptr) return;
        const T* src = xr.head(x, nh, H);  // row j at src + j·sr
        const T* ordered = src;
        int64_t ld = xr.sr;
        if (!g->k_order.empty()) {
          T* dst = ok.rows ? ok.rows.get() + nh * Sp * D : nullptr;
          if (dst == nullptr) {
            w.buf.resize(g->Sp * D);
            dst = w.buf.data();
          }
          for (int64_t t = 0; t < g->Sp; ++t)
            copy_values(src + g->k_order[t] * xr.sr, dst + t * D, D);
          ordered = dst;
          ld = D;
        }
        if (ok.panels)
          pack_transposed_panels(ordered, g->Sp, D, ld, ok.S_pad,
                                 ok.panels.get() + nh * ok.S_pad * D);
      });
  return ok;
}

// Head nh's keys (or values) in the part's order, row t at rows + t·ld: the
// ordered copy, or the input in place when the order is the identity.
template <typename T>
struct Rows {
  const T* rows;
  int64_t ld;
};
template <typename T>
Rows<T> ordered_rows(const OrderedKeys<T>& ok, const T* x, const RowStrides& xr, int64_t nh,
                     int64_t H, int64_t Sp, int64_t D) {
  if (ok.rows) return {ok.rows.get() + nh * Sp * D, D};
  return {xr.head(x, nh, H), xr.sr};
}

int64_t max_sp(const PartGeometries& pg) {
  int64_t Sp = 0;
  for (const auto& g : pg.geos) Sp = std::max(Sp, g.Sp);
  return Sp;
}

// Scales a row of scores (key columns j0.., `cols` of them, `width` a
// multiple of the vector width) and cuts it to the range (ordered key
// coordinates). Returns the columns [v0, v1), rounded out to whole vectors,
// that hold what is kept; there the cut-off columns become -inf, and nothing
// outside is written (v0 == v1: nothing kept). The band of a local query
// tile keeps 128 of its 192 columns: the softmax then reads only those.
struct Kept {
  int64_t v0 = 0, v1 = 0;
};
template <typename T>
inline Kept prepare_row(T* row, const Range& rr, int64_t j0, int64_t cols, int64_t width, T scale) {
  constexpr int64_t W = Simd<T>::W;
  const int64_t c_lo = std::clamp<int64_t>(rr.a - j0, 0, cols);
  const int64_t c_hi = std::clamp<int64_t>(rr.b - j0 + 1, c_lo, cols);
  if (c_hi == c_lo) return {};
  const Kept k{c_lo / W * W, std::min(width, round_up(c_hi, W))};
  for (int64_t c = k.v0; c < c_lo; ++c) row[c] = neg_inf<T>();
  for (int64_t c = c_lo; c < c_hi; ++c) row[c] *= scale;
  for (int64_t c = c_hi; c < k.v1; ++c) row[c] = neg_inf<T>();
  if (rr.x <= rr.y) {
    const int64_t e_lo = std::clamp<int64_t>(rr.x - j0, c_lo, c_hi);
    const int64_t e_hi = std::clamp<int64_t>(rr.y - j0 + 1, e_lo, c_hi);
    for (int64_t c = e_lo; c < e_hi; ++c) row[c] = neg_inf<T>();
  }
  return k;
}

// P of a prepared row: exp(row - shift) on the kept vectors, zeros elsewhere
// up to width. Returns the sum.
template <typename T>
inline T exp_kept(T* row, const Kept& k, int64_t width, T shift) {
  std::fill(row, row + k.v0, T(0));
  std::fill(row + k.v1, row + width, T(0));
  return exp_shift_sum(row + k.v0, k.v1 - k.v0, shift);
}

// Attention dropout of query i's weights in ordered key columns [j0, j0 +
// cols) of a part (kernels/common/dropout.h, keyed by the original key
// indices): row's values kept and scaled or zeroed into out (out == row: in
// place).
template <typename T>
inline void drop_weights(const BlockSparseParams<T>& a, const Geometry& g, int64_t nh, int64_t i,
                         const T* row, int64_t j0, int64_t cols, T* out) {
  const uint64_t key = dropout_row_key(a.dropout_seed, nh, i);
  if (g.k_order.empty())
    dropped_copy(row, cols, key, j0, a.dropout_threshold, a.dropout_scale, out);
  else
    dropped_copy_at(row, cols, key, g.k_order.data() + j0, a.dropout_threshold, a.dropout_scale,
                    out);
}

// The rows of one query tile: their indices, ranges, and the key tiles
// [kb_lo, kb_hi] they reach (kb_hi < kb_lo: none).
struct TileRows {
  std::vector<int64_t> qidx;
  std::vector<Range> rr;
  int64_t rows = 0, kb_lo = 0, kb_hi = -1;
  bool identity = true;

  void init(const Geometry& g, int64_t t, int64_t len) {
    rows = std::min(kBq, g.L - t * kBq);
    identity = g.q_order.empty();
    qidx.resize(kBq);
    rr.resize(kBq);
    int64_t lo = std::numeric_limits<int64_t>::max(), hi = -1;
    for (int64_t r = 0; r < rows; ++r) {
      qidx[r] = identity ? t * kBq + r : g.q_order[t * kBq + r];
      rr[r] = g.row(qidx[r], len);
      if (rr[r].empty()) continue;
      lo = std::min(lo, rr[r].a);
      hi = std::max(hi, rr[r].b);
    }
    kb_lo = hi < 0 ? 0 : lo / kBk;
    kb_hi = hi < 0 ? -1 : hi / kBk;
  }

  // Rows of x (nh's L rows of D entries, sr apart) for this tile, D apart: in
  // place when the order is the identity and the rows follow one another,
  // else gathered into buf.
  template <typename T>
  const T* gather(const T* x, int64_t sr, int64_t D, std::vector<T>& buf) const {
    if (identity && sr == D) return x + qidx[0] * D;
    buf.resize(kBq * D);
    for (int64_t r = 0; r < rows; ++r) copy_values(x + qidx[r] * sr, buf.data() + r * D, D);
    return buf.data();
  }

  bool reaches(int64_t r, int64_t j0, int64_t cols) const {
    return !rr[r].empty() && rr[r].a < j0 + cols && rr[r].b >= j0;
  }

  // Rows [lo, hi) from the first to the last that reach key columns
  // [j0, j0 + cols); false if none does. A band's tile edges are triangles:
  // with key tiles of half a query tile, skipping the rows outside them
  // computes 160 scores per query of a 128-wide band instead of 192.
  bool span(int64_t j0, int64_t cols, int64_t* lo, int64_t* hi) const {
    int64_t r = 0;
    while (r < rows && !reaches(r, j0, cols)) ++r;
    if (r == rows) return false;
    int64_t e = rows;
    while (!reaches(e - 1, j0, cols)) --e;
    *lo = r;
    *hi = e;
    return true;
  }
};

// First / last part covering head h.
bool first_for(const SparsePart* parts, int k, int64_t h) {
  for (int j = 0; j < k; ++j)
    if (h >= parts[j].head_begin && h < parts[j].head_end) return false;
  return true;
}
bool last_for(const SparsePart* parts, int n, int k, int64_t h) {
  for (int j = k + 1; j < n; ++j)
    if (h >= parts[j].head_begin && h < parts[j].head_end) return false;
  return true;
}

template <typename T>
struct ForwardScratch {
  std::vector<T> s, o, m, l, qbuf;
  TileRows tile;
};

}  // namespace

std::vector<SparsePartPlan> make_sparse_plans(const std::vector<SparsePart>& parts, int64_t H,
                                              int64_t L, int64_t S, int64_t bq, int64_t bk) {
  std::vector<SparsePartPlan> plans(parts.size());
  const int64_t q_tiles = (L + bq - 1) / bq, k_tiles = (S + bk - 1) / bk;
  const int n = static_cast<int>(parts.size());
  for (int k = 0; k < n; ++k) {
    SparsePartPlan& plan = plans[k];
    const auto pg = make_part_geometries(parts[k], H, L, S, false);
    plan.head_group = pg.index;
    plan.head_flags.assign(H, 0);
    for (int64_t h = 0; h < H; ++h)
      plan.head_flags[h] =
          (first_for(parts.data(), k, h) ? 1 : 0) | (last_for(parts.data(), n, k, h) ? 2 : 0);
    for (const Geometry& g : pg.geos) {
      SparsePartPlan::Group gr;
      gr.Sp = g.Sp;
      gr.q_order.resize(L);
      gr.k_order.resize(g.Sp);
      for (int64_t t = 0; t < L; ++t) gr.q_order[t] = g.q_order.empty() ? t : g.q_order[t];
      for (int64_t t = 0; t < g.Sp; ++t) gr.k_order[t] = g.k_order.empty() ? t : g.k_order[t];
      gr.ranges.resize(L * 4);
      gr.q_tile_kb.assign(q_tiles * 2, 0);
      std::vector<int64_t> count(k_tiles + 1, 0);
      for (int64_t t = 0; t < q_tiles; ++t) {
        int64_t lo = std::numeric_limits<int64_t>::max(), hi = -1;
        for (int64_t r = t * bq; r < std::min(L, t * bq + bq); ++r) {
          const Range rr = g.row(gr.q_order[r], S);
          gr.ranges[r * 4 + 0] = rr.a;
          gr.ranges[r * 4 + 1] = rr.b;
          gr.ranges[r * 4 + 2] = rr.x;
          gr.ranges[r * 4 + 3] = rr.y;
          if (rr.empty()) continue;
          lo = std::min(lo, rr.a);
          hi = std::max(hi, rr.b);
        }
        gr.q_tile_kb[t * 2] = hi < 0 ? 0 : lo / bk;
        gr.q_tile_kb[t * 2 + 1] = hi < 0 ? -1 : hi / bk;
        for (int64_t kb = gr.q_tile_kb[t * 2]; kb <= gr.q_tile_kb[t * 2 + 1]; ++kb) ++count[kb + 1];
      }
      gr.kt_ptr.assign(k_tiles + 1, 0);
      for (int64_t kb = 0; kb < k_tiles; ++kb) gr.kt_ptr[kb + 1] = gr.kt_ptr[kb] + count[kb + 1];
      gr.kt_q.resize(gr.kt_ptr[k_tiles]);
      std::vector<int64_t> fill(gr.kt_ptr.begin(), gr.kt_ptr.end() - 1);
      for (int64_t t = 0; t < q_tiles; ++t)
        for (int64_t kb = gr.q_tile_kb[t * 2]; kb <= gr.q_tile_kb[t * 2 + 1]; ++kb)
          gr.kt_q[fill[kb]++] = t;
      plan.groups.push_back(std::move(gr));
    }
  }
  return plans;
}

std::vector<int64_t> flatten_sparse_plans(const std::vector<SparsePartPlan>& plans, int64_t H,
                                          int64_t L, int64_t S, int64_t bq, int64_t bk,
                                          std::vector<SparsePlanLayout>* layouts) {
  const int64_t q_tiles = (L + bq - 1) / bq, k_tiles = (S + bk - 1) / bk;
  std::vector<int64_t> buf;
  layouts->clear();
  auto append = [&](const std::vector<int64_t>& x, int64_t size) {
    const int64_t at = static_cast<int64_t>(buf.size());
    buf.insert(buf.end(), x.begin(), x.end());
    buf.resize(at + size, 0);
  };
  for (const SparsePartPlan& plan : plans) {
    SparsePlanLayout lay;
    const int64_t G = static_cast<int64_t>(plan.groups.size());
    lay.num_groups = G;
    lay.head_group = static_cast<int64_t>(buf.size());
    append(plan.head_group, H);
    lay.head_flags = static_cast<int64_t>(buf.size());
    append(plan.head_flags, H);
    lay.group_sp = static_cast<int64_t>(buf.size());
    for (const auto& g : plan.groups) {
      buf.push_back(g.Sp);
      lay.max_sp = std::max(lay.max_sp, g.Sp);
    }
    lay.q_order = static_cast<int64_t>(buf.size());
    for (const auto& g : plan.groups) append(g.q_order, L);
    lay.k_order = static_cast<int64_t>(buf.size());
    for (const auto& g : plan.groups) append(g.k_order, S);
    lay.ranges = static_cast<int64_t>(buf.size());
    for (const auto& g : plan.groups) append(g.ranges, L * 4);
    lay.q_tile_kb = static_cast<int64_t>(buf.size());
    for (const auto& g : plan.groups) append(g.q_tile_kb, q_tiles * 2);
    lay.kt_ptr = static_cast<int64_t>(buf.size());
    int64_t total = 0;
    for (const auto& g : plan.groups) {
      for (int64_t kb = 0; kb <= k_tiles; ++kb) buf.push_back(total + g.kt_ptr[kb]);
      total += g.kt_ptr[k_tiles];
    }
    lay.kt_q = static_cast<int64_t>(buf.size());
    for (const auto& g : plan.groups) buf.insert(buf.end(), g.kt_q.begin(), g.kt_q.end());
    layouts->push_back(lay);
  }
  if (buf.empty()) buf.push_back(0);
  return buf;
}

template <typename T>
void block_sparse_attention_forward_cpu(const BlockSparseForwardArgs<T>& args) {
  BlockSparseForwardArgs<T> a = args;
  resolve_qkv_rows(a);
  a.out_rows = a.out_rows.resolved(a.H, a.L, a.M);
  const int64_t N = a.N, H = a.H, L = a.L, S = a.S, E = a.E, M = a.M, NH = N * H;
  if (NH == 0 || L == 0) return;
  constexpr int64_t NR = panel_width<T>();
  const int64_t q_tiles = (L + kBq - 1) / kBq;
  const int64_t osr = a.out_rows.sr;
  // Heads that no part covers (none today) output zeros.
  for (int64_t h = 0; h < H; ++h)
    if (first_for(a.parts, a.num_parts, h)) {
      zero_all_rows_parallel(a.out, a.out_rows, NH, H, L, M, a.num_threads);
      break;
    }
  std::fill(a.lse, a.lse + NH * L, neg_inf<T>());
  std::vector<T> lsum(a.num_parts > 1 ? NH * L : 0);

  for (int k = 0; k < a.num_parts; ++k) {
    const SparsePart& part = a.parts[k];
    const auto pg = make_part_geometries(part, H, L, S, false);
    const int64_t Sp = max_sp(pg);
    const auto kk = order_keys(a.k, a.k_rows, pg, N, H, S, E, true, false, a.num_threads);
    const auto vv = order_keys(a.v, a.v_rows, pg, N, H, S, M, false, true, a.num_threads);
    parallel_items<ForwardScratch<T>>(
        NH * q_tiles, a.num_threads,
        [&](ForwardScratch<T>& w) {
          w.s.resize(kBq * kChunk);
          w.o.resize(kBq * M);
          w.m.resize(kBq);
          w.l.resize(kBq);
        },
        [&](int64_t item, ForwardScratch<T>& w) {
          const int64_t nh = item / q_tiles, t = item % q_tiles, n = nh / H, h = nh % H;
          const Geometry* g = pg.of(h);
          if (g == nullptr) return;
          const int64_t len = a.key_lengths ? a.key_lengths[n] : S;
          auto& tile = w.tile;
          tile.init(*g, t, len);
          const int64_t rows = tile.rows;
          const bool first = first_for(a.parts, k, h), last = last_for(a.parts, a.num_parts, k, h);
          T* out = a.out_rows.head(a.out, nh, H);  // row i at out + i·osr
          T* lse = a.lse + nh * L;
          T* ls = lsum.empty() ? nullptr : lsum.data() + nh * L;
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t i = tile.qidx[r];
            if (first) {
              std::fill(w.o.begin() + r * M, w.o.begin() + r * M + M, T(0));
              w.m[r] = neg_inf<T>();
              w.l[r] = T(0);
            } else {
              copy_values(out + i * osr, w.o.data() + r * M, M);
              w.m[r] = lse[i];
              w.l[r] = ls[i];
            }
          }
          if (tile.kb_hi >= tile.kb_lo) {
            const T* q = tile.gather(a.q_rows.head(a.q, nh, H), a.q_rows.sr, E, w.qbuf);
            const T* kp = kk.panels.get() + nh * kk.S_pad * E;
            const Rows<T> vo = ordered_rows(vv, a.v, a.v_rows, nh, H, Sp, M);
            // Up to kChunk keys at a time: scores of each key tile for the rows
            // that reach it, one softmax update per row, then O += P·V per key
            // tile for those rows.
            constexpr int64_t per_chunk = kChunk / kBk;
            int64_t r0[per_chunk], r1[per_chunk];
            for (int64_t kc = tile.kb_lo; kc <= tile.kb_hi; kc += per_chunk) {
              const int64_t J0 = kc * kBk;
              const int64_t tiles = std::min(per_chunk, tile.kb_hi + 1 - kc);
              const int64_t chunk_cols = std::min(tiles * kBk, g->Sp - J0);
              if (chunk_cols <= 0) break;
              int64_t u0 = rows, u1 = 0;  // rows reaching any tile of the chunk
              for (int64_t b = 0; b < tiles; ++b) {
                const int64_t j0 = J0 + b * kBk, cols = std::min(kBk, g->Sp - j0);
                if (cols <= 0 || !tile.span(j0, cols, &r0[b], &r1[b])) {
                  r0[b] = r1[b] = 0;
                  continue;
                }
                u0 = std::min(u0, r0[b]);
                u1 = std::max(u1, r1[b]);
                gemm_packed(r1[b] - r0[b], round_up(cols, NR), E, q + r0[b] * E, E, kp + j0 * E,
                            w.s.data() + r0[b] * kChunk + b * kBk, kChunk, false);
              }
              const int64_t width = round_up(chunk_cols, NR);
              // A row's scores in tiles it does not reach are unset: they lie
              // outside its range, which exp_kept sets to 0.
              for (int64_t r = u0; r < u1; ++r) {
                T* row = w.s.data() + r * kChunk;
                const Kept kept = prepare_row(row, tile.rr[r], J0, chunk_cols, width, a.scale);
                const T m_new = std::max(w.m[r], row_max(row + kept.v0, kept.v1 - kept.v0));
                if (m_new == neg_inf<T>()) {  // nothing kept so far in this row
                  std::fill(row, row + width, T(0));
                  continue;
                }
                const T alpha = std::exp(w.m[r] - m_new);  // 0 when m was -inf
                const T sum = exp_kept(row, kept, width, m_new);
                w.l[r] = w.l[r] * alpha + sum;
                w.m[r] = m_new;
                if (a.dropout_threshold) {  // the weights of O only; l is the undropped sum
                  const int64_t c1 = std::min(kept.v1, chunk_cols);
                  if (c1 > kept.v0)
                    drop_weights(a, *g, nh, tile.qidx[r], row + kept.v0, J0 + kept.v0, c1 - kept.v0,
                                 row + kept.v0);
                }
                if (alpha != T(1)) {
                  T* orow = w.o.data() + r * M;
                  for (int64_t c = 0; c < M; ++c) orow[c] *= alpha;
                }
              }
              for (int64_t b = 0; b < tiles; ++b) {
                if (r1[b] <= r0[b]) continue;
                const int64_t j0 = J0 + b * kBk, cols = std::min(kBk, g->Sp - j0);
                gemm(r1[b] - r0[b], M, cols, w.s.data() + r0[b] * kChunk + b * kBk, kChunk,
                     vo.rows + j0 * vo.ld, vo.ld, w.o.data() + r0[b] * M, M, true);
              }
            }
          }
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t i = tile.qidx[r];
            if (last) {
              const T l = w.l[r];
              const T inv = l > T(0) ? T(1) / l : T(0);
              for (int64_t c = 0; c < M; ++c) out[i * osr + c] = w.o[r * M + c] * inv;
              lse[i] = l > T(0) ? w.m[r] + std::log(l) : neg_inf<T>();
            } else {
              copy_values(w.o.data() + r * M, out + i * osr, M);
              lse[i] = w.m[r];
              ls[i] = w.l[r];
            }
          }
        });
  }
}

namespace {
// A query tile of the backward with its rows' q and dO (D apart), lse and
// delta at hand, and its dQ summed until the tile leaves its slot. Each key
// tile of a band sees four or five query tiles, and each query tile is seen
// by as many key tiles in a row: a few slots keep them gathered once, and
// dQ goes to the strided gradient rows once.
template <typename T>
struct QueryTile {
  int64_t nh = -1, t = -1;  // which one (none yet)
  TileRows tile;
  std::vector<T> qbuf, dobuf, lse, delta, dq;
  const T* q = nullptr;
  const T* dO = nullptr;
  bool has_dq = false;  // dq holds sums not yet added to the gradient
};
constexpr int64_t kQuerySlots = 8;

template <typename T>
struct BackwardScratch {
  std::vector<T> p, pd, dp, acc1, acc2, kp, vp;  // pd: P with dropout applied
  QueryTile<T> slots[kQuerySlots];
};

// dst row qidx[r] (rows sr apart) = src row r (D apart), or += when add,
// for the tile's rows.
template <typename T>
void write_tile_rows(const TileRows& tile, const T* src, int64_t D, T* dst, int64_t sr, bool add) {
  for (int64_t r = 0; r < tile.rows; ++r) {
    T* d = dst + tile.qidx[r] * sr;
    const T* x = src + r * D;
    if (add) {
      for (int64_t c = 0; c < D; ++c) d[c] += x[c];
    } else {
      copy_values(x, d, D);
    }
  }
}

// The part that first writes head h's gradients, or -1 (no part covers it).
int first_part_of(const SparsePart* parts, int num_parts, int64_t h) {
  for (int k = 0; k < num_parts; ++k)
    if (h >= parts[k].head_begin && h < parts[k].head_end) return k;
  return -1;
}

// P = exp(S·scale - lse) cut to the rows' ranges, for the tile's rows
// [r0, r1) against key tile [j0, j0 + cols) (its keys and values packed in
// panels at kp, vp); dS = P ∘ (dO·V^T - delta)·scale in w.dp (row r of both
// at r·kBk). With dropout, Pd = P ∘ Z / (1 - p) (Z the forward's keep mask,
// regenerated) in w.pd and dS = (Pd ∘ dP - P ∘ delta)·scale, as in full
// attention's backward. Returns the weights of O: P, or Pd.
template <typename T>
const T* tile_p_ds(const BlockSparseBackwardArgs<T>& a, BackwardScratch<T>& w,
                   const QueryTile<T>& qt, const Geometry& g, const T* kp, const T* vp, int64_t j0,
                   int64_t cols, int64_t r0, int64_t r1) {
  constexpr int64_t NR = panel_width<T>();
  const int64_t width = round_up(cols, NR);
  gemm_packed(r1 - r0, width, a.E, qt.q + r0 * a.E, a.E, kp, w.p.data() + r0 * kBk, kBk, false);
  for (int64_t r = r0; r < r1; ++r) {
    T* row = w.p.data() + r * kBk;
    if (qt.lse[r] == neg_inf<T>()) {
      std::fill(row, row + width, T(0));
      continue;
    }
    exp_kept(row, prepare_row(row, qt.tile.rr[r], j0, cols, width, a.scale), width, qt.lse[r]);
  }
  gemm_packed(r1 - r0, width, a.M, qt.dO + r0 * a.M, a.M, vp, w.dp.data() + r0 * kBk, kBk, false);
  if (a.dropout_threshold) {
    const int64_t nh = qt.nh;
    for (int64_t r = r0; r < r1; ++r) {
      const T d = qt.delta[r];
      const T* prow = w.p.data() + r * kBk;
      T* pdrow = w.pd.data() + r * kBk;
      T* dprow = w.dp.data() + r * kBk;
      drop_weights<T>(a, g, nh, qt.tile.qidx[r], prow, j0, cols, pdrow);
      for (int64_t c = 0; c < cols; ++c) dprow[c] = (pdrow[c] * dprow[c] - prow[c] * d) * a.scale;
    }
    return w.pd.data();
  }
  for (int64_t r = r0; r < r1; ++r) {
    const T d = qt.delta[r];
    const T* prow = w.p.data() + r * kBk;
    T* dprow = w.dp.data() + r * kBk;
    for (int64_t c = 0; c < cols; ++c) dprow[c] = prow[c] * (dprow[c] - d) * a.scale;
  }
  return w.p.data();
}
}  // namespace

template <typename T>
void block_sparse_attention_backward_cpu(const BlockSparseBackwardArgs<T>& args) {
  BlockSparseBackwardArgs<T> a = args;
  resolve_qkv_rows(a);
  resolve_grad_rows(a);
  const int64_t N = a.N, H = a.H, L = a.L, S = a.S, E = a.E, M = a.M, NH = N * H;
  if (NH == 0 || L == 0 || S == 0) {
    zero_all_rows_parallel(a.grad_q, a.grad_q_rows, NH, H, L, E, a.num_threads);
    zero_all_rows_parallel(a.grad_k, a.grad_k_rows, NH, H, S, E, a.num_threads);
    zero_all_rows_parallel(a.grad_v, a.grad_v_rows, NH, H, S, M, a.num_threads);
    return;
  }
  const int64_t q_tiles = (L + kBq - 1) / kBq;
  // The gradients are written, not cleared first and added to (clearing the
  // three first was a pass over fresh memory; git show
  // 5f604de:docs/benchmarks.md, "Gradients written, not cleared and added;
  // Reformer's own keys from its queries"): a
  // head's first part stores its dQ tiles (each query is in one tile of a
  // part; the tiles it never flushes are cleared after it) and, when its key
  // order holds all S keys (each key in one key tile), its dK and dV tiles;
  // later parts add. Only the heads whose first part holds fewer keys (the
  // summary part alone) have their dK and dV cleared first, and heads no
  // part covers all three.
  std::vector<PartGeometries> geometries;
  for (int k = 0; k < a.num_parts; ++k)
    geometries.push_back(make_part_geometries(a.parts[k], H, L, S, true));
  std::vector<int> first_part(H);
  std::vector<uint8_t> kv_stored(H);
  for (int64_t h = 0; h < H; ++h) {
    first_part[h] = first_part_of(a.parts, a.num_parts, h);
    const Geometry* g = first_part[h] < 0 ? nullptr : geometries[first_part[h]].of(h);
    kv_stored[h] = g != nullptr && g->Sp == S;
  }
  {
    parallel_for_items(NH, a.num_threads, [&](int64_t nh) {
      const int64_t h = nh % H;
      if (first_part[h] < 0) zero_rows(a.grad_q_rows.head(a.grad_q, nh, H), L, E, a.grad_q_rows.sr);
      if (kv_stored[h]) return;
      zero_rows(a.grad_k_rows.head(a.grad_k, nh, H), S, E, a.grad_k_rows.sr);
      zero_rows(a.grad_v_rows.head(a.grad_v, nh, H), S, M, a.grad_v_rows.sr);
    });
  }
  // Per (nh, query tile) of the current part: its dQ rows written.
  std::vector<uint8_t> dq_written(static_cast<size_t>(NH * q_tiles));
  // One pass per head (FlashAttention-2 order: per key tile, the query tiles
  // that see it, dQ, dK and dV from one P and dS: 5 tile products) when the
  // heads alone share out evenly between the threads; otherwise a dQ pass per
  // query tile and a dK/dV pass per key tile (7 products: P and dS twice),
  // whose finer items keep every thread busy. One pass is the faster where
  // both fit (measured: git show 5f604de:docs/benchmarks.md, "Work items and
  // first writes: the few-query backward, local, Reformer").
  const bool one_pass = NH % a.num_threads == 0 || NH >= 4 * a.num_threads;
  auto init = [&](BackwardScratch<T>& w) {
    w.p.resize(kBq * kBk);
    if (a.dropout_threshold) w.pd.resize(kBq * kBk);
    w.dp.resize(kBq * kBk);
    w.acc1.resize(kBk * E);
    w.acc2.resize(kBk * M);
    w.kp.resize(round_up(kBk, panel_width<T>()) * E);
    w.vp.resize(round_up(kBk, panel_width<T>()) * M);
  };

  for (int k = 0; k < a.num_parts; ++k) {
    const PartGeometries& pg = geometries[k];
    const int64_t Sp = max_sp(pg);
    std::fill(dq_written.begin(), dq_written.end(), uint8_t{0});
    // Panels of every key tile for the dQ pass; the dK/dV items pack their
    // own tile.
    const auto kk = order_keys(a.k, a.k_rows, pg, N, H, S, E, !one_pass, true, a.num_threads);
    const auto vv = order_keys(a.v, a.v_rows, pg, N, H, S, M, !one_pass, true, a.num_threads);
    auto flush_dq = [&](QueryTile<T>& qt) {
      if (!qt.has_dq) return;
      uint8_t& written = dq_written[qt.nh * q_tiles + qt.t];
      const bool add = written || first_part[qt.nh % H] != k;
      write_tile_rows(qt.tile, qt.dq.data(), E, a.grad_q_rows.head(a.grad_q, qt.nh, H),
                      a.grad_q_rows.sr, add);
      written = 1;
      qt.has_dq = false;
    };
    // dQ rows [r0, r1) of the tile += dS · K for key tile [j0, j0 + cols).
    auto add_dq = [&](BackwardScratch<T>& w, QueryTile<T>& qt, const Rows<T>& ko, int64_t j0,
                      int64_t cols, int64_t r0, int64_t r1) {
      if (!qt.has_dq) {
        qt.dq.assign(kBq * E, T(0));
        qt.has_dq = true;
      }
      gemm(r1 - r0, E, cols, w.dp.data() + r0 * kBk, kBk, ko.rows + j0 * ko.ld, ko.ld,
           qt.dq.data() + r0 * E, E, true);
    };
    // Query tile t of head nh, from its slot or gathered into it.
    auto query_rows = [&](BackwardScratch<T>& w, const Geometry& g, int64_t nh, int64_t t,
                          int64_t len) -> QueryTile<T>& {
      QueryTile<T>& qt = w.slots[t % kQuerySlots];
      if (qt.nh == nh && qt.t == t) return qt;
      flush_dq(qt);
      qt.nh = nh;
      qt.t = t;
      qt.tile.init(g, t, len);
      qt.lse.resize(kBq);
      qt.delta.resize(kBq);
      for (int64_t r = 0; r < qt.tile.rows; ++r) {
        qt.lse[r] = a.lse[nh * L + qt.tile.qidx[r]];
        qt.delta[r] = a.delta[nh * L + qt.tile.qidx[r]];
      }
      qt.q = qt.tile.gather(a.q_rows.head(a.q, nh, H), a.q_rows.sr, E, qt.qbuf);
      qt.dO =
          qt.tile.gather(a.grad_out_rows.head(a.grad_out, nh, H), a.grad_out_rows.sr, M, qt.dobuf);
      return qt;
    };

    // dQ of query tile item % q_tiles of head item / q_tiles.
    auto query_tile = [&](int64_t item, BackwardScratch<T>& w) {
      const int64_t nh = item / q_tiles, t = item % q_tiles, n = nh / H, h = nh % H;
      const Geometry* g = pg.of(h);
      if (g == nullptr) return;
      const int64_t len = a.key_lengths ? a.key_lengths[n] : S;
      QueryTile<T>& qt = query_rows(w, *g, nh, t, len);
      const T* kp = kk.panels.get() + nh * kk.S_pad * E;
      const T* vp = vv.panels.get() + nh * vv.S_pad * M;
      const Rows<T> ko = ordered_rows(kk, a.k, a.k_rows, nh, H, Sp, E);
      for (int64_t kb = qt.tile.kb_lo; kb <= qt.tile.kb_hi; ++kb) {
        const int64_t j0 = kb * kBk, cols = std::min(kBk, g->Sp - j0);
        int64_t r0 = 0, r1 = 0;
        if (cols <= 0 || !qt.tile.span(j0, cols, &r0, &r1)) continue;
        tile_p_ds(a, w, qt, *g, kp + j0 * E, vp + j0 * M, j0, cols, r0, r1);
        add_dq(w, qt, ko, j0, cols, r0, r1);
      }
      flush_dq(qt);
    };

    // dK, dV (and dQ when with_dq) of key tile kb of head nh, over the query
    // tiles that may see it.
    const int64_t k_tiles = (Sp + kBk - 1) / kBk;
    auto key_tile = [&](BackwardScratch<T>& w, int64_t nh, int64_t kb, bool with_dq) {
      const int64_t n = nh / H, h = nh % H;
      const Geometry* g = pg.of(h);
      if (g == nullptr) return;
      const int64_t j0 = kb * kBk, cols = std::min(kBk, g->Sp - j0);
      if (cols <= 0) return;
      const int64_t len = a.key_lengths ? a.key_lengths[n] : S;
      // This key tile's keys and values packed in panels, once.
      const Rows<T> ko = ordered_rows(kk, a.k, a.k_rows, nh, H, Sp, E);
      const Rows<T> vo = ordered_rows(vv, a.v, a.v_rows, nh, H, Sp, M);
      const int64_t width = round_up(cols, panel_width<T>());
      pack_transposed_panels(ko.rows + j0 * ko.ld, cols, E, ko.ld, width, w.kp.data());
      pack_transposed_panels(vo.rows + j0 * vo.ld, cols, M, vo.ld, width, w.vp.data());
      std::fill(w.acc1.begin(), w.acc1.end(), T(0));  // dK tile
      std::fill(w.acc2.begin(), w.acc2.end(), T(0));  // dV tile
      bool any = false;
      for (int64_t e = g->kt_ptr[kb]; e < g->kt_ptr[kb + 1]; ++e) {
        QueryTile<T>& qt = query_rows(w, *g, nh, g->kt_q[e], len);
        int64_t r0 = 0, r1 = 0;
        if (!qt.tile.span(j0, cols, &r0, &r1)) continue;
        any = true;
        const int64_t rows = r1 - r0;
        const T* pw = tile_p_ds(a, w, qt, *g, w.kp.data(), w.vp.data(), j0, cols, r0, r1);
        gemm_tn(cols, M, rows, pw + r0 * kBk, kBk, qt.dO + r0 * M, M, w.acc2.data(), M, true);
        gemm_tn(cols, E, rows, w.dp.data() + r0 * kBk, kBk, qt.q + r0 * E, E, w.acc1.data(), E,
                true);
        if (with_dq) add_dq(w, qt, ko, j0, cols, r0, r1);
      }
      // The head's first part stores every key row of its tiles (zeros
      // where no query reaches them); later parts add.
      const bool store = kv_stored[h] && first_part[h] == k;
      if (!any && !store) return;
      T* gk = a.grad_k_rows.head(a.grad_k, nh, H);
      T* gv = a.grad_v_rows.head(a.grad_v, nh, H);
      for (int64_t c = 0; c < cols; ++c) {
        const int64_t j = g->k_order.empty() ? j0 + c : g->k_order[j0 + c];
        T* dk = gk + j * a.grad_k_rows.sr;
        T* dv = gv + j * a.grad_v_rows.sr;
        if (store) {
          copy_values(w.acc1.data() + c * E, dk, E);
          copy_values(w.acc2.data() + c * M, dv, M);
          continue;
        }
        for (int64_t x = 0; x < E; ++x) dk[x] += w.acc1[c * E + x];
        for (int64_t x = 0; x < M; ++x) dv[x] += w.acc2[c * M + x];
      }
    };
    if (k_tiles == 0) {
      // No key in this part's order: nothing computed.
    } else if (one_pass) {
      parallel_items<BackwardScratch<T>>(NH, a.num_threads, init,
                                         [&](int64_t nh, BackwardScratch<T>& w) {
                                           for (int64_t kb = 0; kb < k_tiles; ++kb)
                                             key_tile(w, nh, kb, /*with_dq=*/true);
                                           for (auto& qt : w.slots) flush_dq(qt);
                                         });
    } else {
      parallel_items<BackwardScratch<T>>(NH * q_tiles, a.num_threads, init, query_tile);
      parallel_items<BackwardScratch<T>>(
          NH * k_tiles, a.num_threads, init, [&](int64_t item, BackwardScratch<T>& w) {
            key_tile(w, item / k_tiles, item % k_tiles, /*with_dq=*/false);
          });
    }
    // The dQ rows of the query tiles this part, their heads' first, did not
    // write (no key reaches them): zeros, before any later part adds.
    parallel_items<TileRows>(
        NH, a.num_threads, [](TileRows&) {},
        [&](int64_t nh, TileRows& tile) {
          const int64_t h = nh % H;
          const Geometry* g = pg.of(h);
          if (g == nullptr || first_part[h] != k) return;
          const int64_t len = a.key_lengths ? a.key_lengths[nh / H] : S;
          T* gq = a.grad_q_rows.head(a.grad_q, nh, H);
          for (int64_t t = 0; t < q_tiles; ++t) {
            if (dq_written[nh * q_tiles + t]) continue;
            tile.init(*g, t, len);
            for (int64_t r = 0; r < tile.rows; ++r)
              std::fill_n(gq + tile.qidx[r] * a.grad_q_rows.sr, E, T(0));
          }
        });
  }
}

FASTATTN_ISA_END

FASTATTN_CPU_KERNEL(block_sparse_attention_forward_cpu, BlockSparseForwardArgs)
FASTATTN_CPU_KERNEL(block_sparse_attention_backward_cpu, BlockSparseBackwardArgs)

// Planning is not vector code: the public functions are the default level's.
#if FASTATTN_ISA_LEVEL == 0
namespace fastattn::kernels {
std::vector<SparsePart> make_sparse_parts(int pattern, const std::vector<int64_t>& params,
                                          bool causal, int64_t H) {
  return isa_default::make_sparse_parts(pattern, params, causal, H);
}
std::vector<SparsePartPlan> make_sparse_plans(const std::vector<SparsePart>& parts, int64_t H,
                                              int64_t L, int64_t S, int64_t bq, int64_t bk) {
  return isa_default::make_sparse_plans(parts, H, L, S, bq, bk);
}
std::vector<int64_t> flatten_sparse_plans(const std::vector<SparsePartPlan>& plans, int64_t H,
                                          int64_t L, int64_t S, int64_t bq, int64_t bk,
                                          std::vector<SparsePlanLayout>* layouts) {
  return isa_default::flatten_sparse_plans(plans, H, L, S, bq, bk, layouts);
}
}  // namespace fastattn::kernels
#endif
