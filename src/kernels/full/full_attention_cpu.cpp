// CPU kernels of fused softmax attention (see full_attention.h).
//
// Forward, per work item (n, h, tile of kBr queries): for each tile of kBc
// keys, S = Q·K^T (register-blocked, K packed in panels), scale and mask, an
// online softmax update of the running row max m and sum l, O += P·V. At the
// end O /= l and lse = m + log l.
//
// Backward (FlashAttention-2 order), per work item (n, h, split of key tiles):
// for each key tile j, for each query tile i that can see it: recompute
// P = exp(S·scale + mask - lse), dV_j += P^T dO_i, dP = dO_i V_j^T,
// dS = P ∘ (dP - delta_i) · scale, dQ_i += dS K_j, dK_j += dS^T Q_i. When
// there are fewer heads than threads the key tiles of a head are split and
// each split accumulates its own dQ (O(L·E) each), summed at the end. Few
// queries without a mask (clustered attention's centroids) take every
// product of a key tile transposed instead (few_queries_tiles): no key tile
// packed, neither P nor dS transposed.
#include "kernels/full/full_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <utility>
#include <vector>

#include "kernels/common/dropout_rows.h"
#include "kernels/common/isa_target.h"
#include "kernels/common/gemm.h"
#include "kernels/common/parallel.h"
#include "kernels/common/scratch.h"
#include "kernels/common/simd.h"
#include "kernels/common/softmax_rows.h"

FASTATTN_ISA_BEGIN
namespace {

constexpr int64_t kFwdBr = kFullForwardQueryTile;  // a multiple of 6
constexpr int64_t kFwdBc = 128;                    // keys per forward tile
constexpr int64_t kFwdOneTileMax = 120;            // see full_attention_forward_cpu
constexpr int64_t kBwdBr = 48;                     // queries per backward tile
constexpr int64_t kBwdBc = 64;                     // keys per backward tile

// Number of keys query i may see within [j0, j0 + cols): causal cut-off.
inline int64_t visible_cols(bool causal, int64_t i, int64_t offset, int64_t j0, int64_t cols) {
  if (!causal) return cols;
  return std::clamp<int64_t>(i + offset + 1 - j0, 0, cols);
}

// Scales a row of scores, adds the mask row and cuts it at `limit` (the rest
// up to `width` becomes -inf).
template <typename T>
inline void prepare_scores(T* row, const T* mask_row, int64_t limit, int64_t width, T scale) {
  if (mask_row) {
    for (int64_t c = 0; c < limit; ++c) row[c] = row[c] * scale + mask_row[c];
  } else {
    for (int64_t c = 0; c < limit; ++c) row[c] = row[c] * scale;
  }
  for (int64_t c = limit; c < width; ++c) row[c] = neg_inf<T>();
}

template <typename T>
struct ForwardScratch {
  std::vector<T> kp, s, o, m, l;  // kp: the key tile(s) packed for gemm_packed
  // With several query tiles per head, kp holds every key tile of head
  // packed_nh packed so far (its first packed_keys keys), kept for the
  // thread's next tile of that head.
  int64_t packed_nh = -1, packed_keys = 0;
  // Top-k tracking: per row a min-heap of (score, -index) pairs.
  std::vector<std::vector<std::pair<T, int64_t>>> heaps;
};

// Heap order for the top-k: the root is the worst kept entry, i.e. the lowest
// score, and among equal scores the highest index (entries hold -index).
template <typename T>
inline bool worse_first(const std::pair<T, int64_t>& a, const std::pair<T, int64_t>& b) {
  return a > b;
}

// Offers the scaled, masked scores row[0, cols) of keys j0.. to a top-k heap;
// largest is the largest of them (or NaN). Once the heap is full, a tile row
// or a vector of scores none of which beats the worst kept one is skipped
// whole, as most are after the first tiles (improved-clustered's centroid
// pass: 100 centroids keeping 32 of 16384 keys).
template <typename T>
inline void offer_topk(const T* row, int64_t cols, int64_t j0, int64_t topk, T largest,
                       std::vector<std::pair<T, int64_t>>& heap) {
  using S = Simd<T>;
  for (int64_t c0 = 0; c0 < cols; c0 += S::W) {
    const int64_t c1 = std::min<int64_t>(cols, c0 + S::W);
    if (static_cast<int64_t>(heap.size()) == topk) {
      const T worst = heap.front().first;
      if (largest <= worst) return;
      if (c1 - c0 == S::W && S::hmax(S::load(row + c0)) <= worst) continue;
    }
    for (int64_t c = c0; c < c1; ++c) {
      const T x = row[c];
      if (!(x > neg_inf<T>())) continue;  // dropped key (or NaN)
      if (static_cast<int64_t>(heap.size()) < topk) {
        heap.emplace_back(x, -(j0 + c));
        std::push_heap(heap.begin(), heap.end(), worse_first<T>);
      } else if (x > heap.front().first) {
        std::pop_heap(heap.begin(), heap.end(), worse_first<T>);
        heap.back() = {x, -(j0 + c)};
        std::push_heap(heap.begin(), heap.end(), worse_first<T>);
      }
    }
  }
}

// Writes a row's top-k indices by descending score, completed with the
// lowest indices not in it; empties the heap.
template <typename T>
void write_topk(std::vector<std::pair<T, int64_t>>& heap, int64_t topk, int64_t* out) {
  std::sort_heap(heap.begin(), heap.end(), worse_first<T>);  // best first
  int64_t n = 0;
  for (const auto& e : heap) out[n++] = -e.second;
  std::vector<int64_t> taken(out, out + n);
  std::sort(taken.begin(), taken.end());
  for (int64_t j = 0; n < topk; ++j) {
    if (!std::binary_search(taken.begin(), taken.end(), j)) out[n++] = j;
  }
  heap.clear();
}

// The row layouts left at their defaults made explicit.
template <typename T>
FullAttentionForwardArgs<T> resolved(FullAttentionForwardArgs<T> a) {
  resolve_qkv_rows(a);
  a.out_rows = a.out_rows.resolved(a.H, a.L, a.M);
  return a;
}
template <typename T>
FullAttentionBackwardArgs<T> resolved(FullAttentionBackwardArgs<T> a) {
  resolve_qkv_rows(a);
  resolve_grad_rows(a);
  return a;
}

// dst (rows × cols, row stride ld) = src (rows × cols, contiguous), or += when add.
template <typename T>
void store_rows(const T* src, int64_t rows, int64_t cols, T* dst, int64_t ld, bool add) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* s = src + r * cols;
    T* d = dst + r * ld;
    if (add) {
      for (int64_t c = 0; c < cols; ++c) d[c] += s[c];
    } else {
      std::copy(s, s + cols, d);
    }
  }
}

// store_rows for a key tile's dK or dV, which nothing reads again here: the
// rows written are streamed past the caches (stream_scaled).
template <typename T>
void store_key_rows(const T* src, int64_t rows, int64_t cols, T* dst, int64_t ld, bool add) {
  if (add) {
    store_rows(src, rows, cols, dst, ld, true);
    return;
  }
  for (int64_t r = 0; r < rows; ++r) stream_scaled(src + r * cols, T(1), dst + r * ld, cols);
  stream_fence();
}

// out[0, NV·W) = sum_{j < rows} p[j] · v[j·ld + (0, NV·W)], accumulated in
// NV vector registers.
template <typename T, int NV>
inline void weighted_rows(const T* p, const T* v, int64_t ld, int64_t rows, T* out) {
  using V = Simd<T>;
  typename V::V acc[NV];
  for (int r = 0; r < NV; ++r) acc[r] = V::zero();
  for (int64_t j = 0; j < rows; ++j) {
    const auto pj = V::set1(p[j]);
    const T* vj = v + j * ld;
    for (int r = 0; r < NV; ++r) acc[r] = V::fma(pj, V::load(vj + r * V::W), acc[r]);
  }
  for (int r = 0; r < NV; ++r) V::store(out + r * V::W, acc[r]);
}

// Rows per query tile: at most max_rows (a multiple of 6, the micro-kernels'
// row block), the L rows spread evenly over the fewest tiles, so that no tile
// is a sliver: 100 queries (clustered attention's centroids, when there are
// too few heads for one tile each) make tiles of 54 and 46, not 96 and 4. A
// sliver costs most of a full tile, since the forward packs every key tile
// for it. The backward keeps its 48-row tiles: balanced ones (36, 36, 28),
// or one of 100 rows, were no faster there, within the machine's noise
// (git show 5f604de:docs/benchmarks.md, "Smaller changes measured on the
// way").
inline int64_t balanced_rows(int64_t L, int64_t max_rows) {
  const int64_t tiles = (L + max_rows - 1) / max_rows;
  return std::min(max_rows, round_up((L + tiles - 1) / tiles, int64_t{6}));
}

// One query per (n, h), no mask, no top-k (token-by-token decoding over a
// cache): the tiles would compute kFwdBr query rows for one, so each item
// takes a dot product per key, then the softmax-weighted sum of the value
// rows. The same results as the tiled path up to rounding (causal keeps
// every key when L = 1).
template <typename T>
void single_query_forward(const FullAttentionForwardArgs<T>& a) {
  using V = Simd<T>;
  constexpr int64_t W = V::W;
  const int64_t H = a.H, S = a.S, E = a.E, M = a.M;
  parallel_items<std::vector<T>>(
      a.N * H, a.num_threads, [&](std::vector<T>& s) { s.resize(round_up(S, W)); },
      [&](int64_t nh, std::vector<T>& s) {
        const T* q = a.q_rows.head(a.q, nh, H);
        const T* kh = a.k_rows.head(a.k, nh, H);
        const T* vh = a.v_rows.head(a.v, nh, H);
        T* out = a.out_rows.head(a.out, nh, H);
        const int64_t lk = a.k_rows.sr, lv = a.v_rows.sr;
        const int64_t kend = a.key_lengths ? a.key_lengths[nh / H] : S;
        if (kend == 0) {
          std::fill(out, out + M, T(0));
          if (a.lse) a.lse[nh] = neg_inf<T>();
          return;
        }
        // Scores, four keys at a time (four accumulators, one pass over q).
        int64_t j = 0;
        for (; j + 4 <= kend; j += 4) {
          const T* k0 = kh + j * lk;
          auto c0 = V::zero(), c1 = V::zero(), c2 = V::zero(), c3 = V::zero();
          int64_t c = 0;
          for (; c + W <= E; c += W) {
            const auto qc = V::load(q + c);
            c0 = V::fma(qc, V::load(k0 + c), c0);
            c1 = V::fma(qc, V::load(k0 + lk + c), c1);
            c2 = V::fma(qc, V::load(k0 + 2 * lk + c), c2);
            c3 = V::fma(qc, V::load(k0 + 3 * lk + c), c3);
          }
          T d[4] = {V::hsum(c0), V::hsum(c1), V::hsum(c2), V::hsum(c3)};
          for (; c < E; ++c) {
            for (int r = 0; r < 4; ++r) d[r] += q[c] * k0[r * lk + c];
          }
          for (int r = 0; r < 4; ++r) s[j + r] = a.scale * d[r];
        }
        for (; j < kend; ++j) s[j] = a.scale * simd_dot(q, kh + j * lk, E);
        const int64_t width = round_up(kend, W);
        std::fill(s.begin() + kend, s.begin() + width, neg_inf<T>());
        const T m = row_max(s.data(), width);
        const T l = exp_shift_sum(s.data(), width, m);  // s = exp(s - m)
        if (a.dropout_threshold)  // the weights of O only; l is the undropped sum
          apply_dropout(s.data(), kend, dropout_row_key(a.dropout_seed, nh, 0), 0,
                        a.dropout_threshold, T(a.dropout_scale));
        // out = sum_j p_j v_j, up to eight vectors of columns held in
        // registers over all keys (one pass over V for M <= 8 W).
        int64_t c = 0;
        for (; c + 8 * W <= M; c += 8 * W) weighted_rows<T, 8>(s.data(), vh + c, lv, kend, out + c);
        for (; c + 4 * W <= M; c += 4 * W) weighted_rows<T, 4>(s.data(), vh + c, lv, kend, out + c);
        for (; c + W <= M; c += W) weighted_rows<T, 1>(s.data(), vh + c, lv, kend, out + c);
        for (; c < M; ++c) {
          T o = 0;
          for (j = 0; j < kend; ++j) o += s[j] * vh[j * lv + c];
          out[c] = o;
        }
        for (c = 0; c < M; ++c) out[c] /= l;
        if (a.lse) a.lse[nh] = m + std::log(l);
      });
}

}  // namespace

template <typename T>
void full_attention_forward_cpu(const FullAttentionForwardArgs<T>& args) {
  const auto a = resolved(args);
  const int64_t N = a.N, H = a.H, L = a.L, S = a.S, E = a.E, M = a.M;
  const int64_t NH = N * H;
  if (NH == 0 || L == 0) return;
  if (L == 1 && !a.mask && a.topk == 0) {
    single_query_forward(a);
    return;
  }
  constexpr int64_t NR = panel_width<T, kWideBlock>();
  // Up to kFwdOneTileMax queries in one tile when the heads keep the threads
  // busy: K and V are then read and packed once per head (clustered
  // attention's 100 centroids over 16384 keys), not once per balanced tile.
  const int64_t br = L <= kFwdOneTileMax && NH >= 2 * a.num_threads ? round_up(L, int64_t{6})
                                                                    : balanced_rows(L, kFwdBr);
  const int64_t q_tiles = (L + br - 1) / br;
  const int64_t offset = S - L;
  // Each thread packs a head's keys once for all its query tiles of that head
  // (S·E values per thread) instead of once per tile, whose repeated
  // transposes were a measurable part of the forward.
  const bool keep_keys = q_tiles > 1;

  parallel_items<ForwardScratch<T>>(
      NH * q_tiles, a.num_threads,
      [&](ForwardScratch<T>& w) {
        w.kp.resize((keep_keys ? round_up(S, kFwdBc) : kFwdBc) * E);
        w.s.resize(br * kFwdBc);
        w.o.resize(br * M);
        w.m.resize(br);
        w.l.resize(br);
        if (a.topk > 0) {
          w.heaps.resize(br);
          for (auto& h : w.heaps) h.reserve(a.topk);
        }
      },
      [&](int64_t item, ForwardScratch<T>& w) {
        const int64_t nh = item / q_tiles, n = nh / H, h = nh % H;
        const int64_t i0 = (item % q_tiles) * br;
        const int64_t rows = std::min(br, L - i0);
        const int64_t lq = a.q_rows.sr, lk = a.k_rows.sr, lv = a.v_rows.sr, lo = a.out_rows.sr;
        const T* q = a.q_rows.head(a.q, nh, H) + i0 * lq;
        const T* kh = a.k_rows.head(a.k, nh, H);
        const T* vh = a.v_rows.head(a.v, nh, H);
        int64_t kend = a.key_lengths ? a.key_lengths[n] : S;
        if (a.causal) kend = std::min(kend, i0 + rows + offset);
        std::fill(w.o.begin(), w.o.end(), T(0));
        std::fill(w.m.begin(), w.m.end(), neg_inf<T>());
        std::fill(w.l.begin(), w.l.end(), T(0));
        if (keep_keys && w.packed_nh != nh) {
          w.packed_nh = nh;
          w.packed_keys = 0;
        }
        for (int64_t j0 = 0; j0 < kend; j0 += kFwdBc) {
          const int64_t cols = std::min(kFwdBc, kend - j0);
          const int64_t width = round_up(cols, NR);
          T* kp = keep_keys ? w.kp.data() + j0 * E : w.kp.data();
          // One query tile per head reads K and V once: the next key tile's
          // rows while this one computes, a few per score row (strided rows,
          // which the hardware prefetcher does not follow; 100 centroids
          // over 16384 keys).
          const int64_t next = keep_keys ? 0 : std::min(kFwdBc, kend - j0 - kFwdBc);
          const int64_t per_row = (next + rows - 1) / rows;
          // A tile packed shorter (a causal tile's cut) is packed again.
          if (!keep_keys || j0 + cols > w.packed_keys) {
            pack_transposed_panels<T, kWideBlock>(kh + j0 * lk, cols, E, lk, width, kp);
            if (keep_keys) w.packed_keys = j0 + cols;
          }
          gemm_packed<T, kWideBlock>(rows, width, E, q, lq, kp, w.s.data(), kFwdBc, false);
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t i = i0 + r;
            T* row = w.s.data() + r * kFwdBc;
            if (r * per_row < next) {
              const int64_t j = r * per_row, n_rows = std::min(per_row, next - j);
              prefetch_rows(kh + (j0 + kFwdBc + j) * lk, n_rows, E, lk);
              prefetch_rows(vh + (j0 + kFwdBc + j) * lv, n_rows, M, lv);
            }
            const int64_t limit = visible_cols(a.causal, i, offset, j0, cols);
            // A whole row of unmasked scores without top-k: the scale goes
            // into the exponent (exp(x·scale - m), one pass less over the row;
            // scale > 0, so the max of the raw row scales to the tile's max).
            const bool plain = !a.mask && a.topk == 0 && limit == width;
            T tile_max;
            if (plain) {
              tile_max = row_max(row, width) * a.scale;
            } else {
              const T* mrow =
                  a.mask ? a.mask + n * a.mask_sn + h * a.mask_sh + i * a.mask_sl + j0 : nullptr;
              prepare_scores(row, mrow, limit, width, a.scale);
              tile_max = row_max(row, width);
              if (a.topk > 0) offer_topk(row, cols, j0, a.topk, tile_max, w.heaps[r]);
            }
            const T m_new = std::max(w.m[r], tile_max);
            if (m_new == neg_inf<T>()) {  // nothing kept so far in this row
              std::fill(row, row + width, T(0));
              continue;
            }
            // 0 when m was -inf; 1 without a call when the max held (most
            // tiles after the first few).
            const T alpha = m_new == w.m[r] ? T(1) : std::exp(w.m[r] - m_new);
            const T sum = exp_shift_sum(row, width, m_new, plain ? a.scale : T(1));
            w.l[r] = w.l[r] * alpha + sum;
            w.m[r] = m_new;
            if (alpha != T(1)) {
              T* orow = w.o.data() + r * M;
              for (int64_t c = 0; c < M; ++c) orow[c] *= alpha;
            }
            if (a.dropout_threshold)  // the weights of O only; l is the undropped sum
              apply_dropout(row, cols, dropout_row_key(a.dropout_seed, nh, i), j0,
                            a.dropout_threshold, T(a.dropout_scale));
          }
          gemm(rows, M, cols, w.s.data(), kFwdBc, vh + j0 * lv, lv, w.o.data(), M, true);
        }
        T* out = a.out_rows.head(a.out, nh, H) + i0 * lo;
        T* lse = a.lse + nh * L + i0;
        for (int64_t r = 0; r < rows; ++r) {
          const T l = w.l[r];
          const T inv = l > T(0) ? T(1) / l : T(0);
          for (int64_t c = 0; c < M; ++c) out[r * lo + c] = w.o[r * M + c] * inv;
          lse[r] = l > T(0) ? w.m[r] + std::log(l) : neg_inf<T>();
          if (a.topk > 0) write_topk(w.heaps[r], a.topk, a.top_idx + (nh * L + i0 + r) * a.topk);
        }
      });
}

namespace {
template <typename T>
struct BackwardScratch {
  // kp, vp: the key tile's K and V packed; pd: P with dropout applied
  std::vector<T> kp, vp, p, pd, pt, dp, dst, dk, dv;
  // few_queries_tiles: the head's Q^T and dO^T (query columns padded to a
  // vector), Q and dO rows, -lse and delta per column, S^T / P^T and dP^T /
  // dS^T, the key tile's K and V rows.
  std::vector<T> qt, dot, qc, doc, neg_lse, delta, st, dpt, kc, vc;
};

// Whether the backward takes few_queries_tiles: at most kFwdOneTileMax
// queries, no mask and not causal (clustered attention's centroid pass).
template <typename T>
bool few_queries(const FullAttentionBackwardArgs<T>& a) {
  return a.L <= kFwdOneTileMax && !a.mask && !a.causal && !a.dropout_threshold;
}

// rows x cols values ld apart -> contiguous.
template <typename T>
void gather_rows(const T* x, int64_t rows, int64_t cols, int64_t ld, T* out) {
  for (int64_t r = 0; r < rows; ++r) std::copy(x + r * ld, x + r * ld + cols, out + r * cols);
}

// X^T (cols x ldo) for X rows x cols (rows ld apart), the columns past rows zero.
template <typename T>
void transpose_padded(const T* X, int64_t rows, int64_t cols, int64_t ld, int64_t ldo, T* out) {
  transpose(X, rows, cols, ld, out, ldo);
  for (int64_t c = 0; c < cols; ++c) std::fill(out + c * ldo + rows, out + c * ldo + ldo, T(0));
}

// The key rows [jn, jn + next) of head nh, and the gradient rows they add
// to, while the tile before them computes: strided rows are not prefetched by
// the hardware (100 queries over 16384 keys in the layers' views).
template <typename T>
void prefetch_key_tile(const FullAttentionBackwardArgs<T>& a, int64_t nh, int64_t jn,
                       int64_t next) {
  if (next <= 0) return;
  prefetch_rows(a.k_rows.head(a.k, nh, a.H) + jn * a.k_rows.sr, next, a.E, a.k_rows.sr);
  prefetch_rows(a.v_rows.head(a.v, nh, a.H) + jn * a.v_rows.sr, next, a.M, a.v_rows.sr);
  if (!a.accumulate) return;
  prefetch_rows(a.grad_k_rows.head(a.grad_k, nh, a.H) + jn * a.grad_k_rows.sr, next, a.E,
                a.grad_k_rows.sr, /*write=*/true);
  if (a.grad_v)
    prefetch_rows(a.grad_v_rows.head(a.grad_v, nh, a.H) + jn * a.grad_v_rows.sr, next, a.M,
                  a.grad_v_rows.sr, /*write=*/true);
}

// The key tiles t = split, split + splits, ... of head nh below len, for few
// queries over many keys (100 centroids over 16384 keys): the products are
// taken transposed, S^T = K_j Q^T and dP^T = V_j dO^T, the tile's K and V
// rows against the head's Q^T and dO^T packed once, so that dV_j = P^T dO and
// dK_j = dS^T Q are plain products and dQ += dS K_j one with A transposed.
// The general loop packs every key tile's K and V and transposes P and dS
// for 48-query tiles, a large part of this backward. The tile's K and V
// rows are copied to contiguous ones first: the products read each row
// several times (from L2, the layers' 2 KiB row stride aliasing in L1), and
// the copy's independent loads take the tile's first reads from memory;
// read in place the rows made this path no faster than the general loop at
// 16384 keys (git show 5f604de:docs/benchmarks.md, "Few-query backward with
// transposed products; the overflow check on centroid values").
template <typename T>
void few_queries_tiles(const FullAttentionBackwardArgs<T>& a, BackwardScratch<T>& w, int64_t nh,
                       int64_t split, int64_t splits, int64_t len, T* dq, int64_t ldq) {
  using V = Simd<T>;
  const int64_t H = a.H, L = a.L, E = a.E, M = a.M, Lp = round_up(L, V::W);
  const int64_t lk = a.k_rows.sr, lv = a.v_rows.sr;
  const T* kh = a.k_rows.head(a.k, nh, H);
  const T* vh = a.v_rows.head(a.v, nh, H);
  const T* qh = a.q_rows.head(a.q, nh, H);
  const T* doh = a.grad_out_rows.head(a.grad_out, nh, H);
  transpose_padded(qh, L, E, a.q_rows.sr, Lp, w.qt.data());
  transpose_padded(doh, L, M, a.grad_out_rows.sr, Lp, w.dot.data());
  gather_rows(qh, L, E, a.q_rows.sr, w.qc.data());
  gather_rows(doh, L, M, a.grad_out_rows.sr, w.doc.data());
  // P^T = exp(S^T·scale - lse) is 0 in the padding columns and in a row
  // without keys (lse -inf; the general loop's rule): -lse = -inf there.
  for (int64_t i = 0; i < Lp; ++i) {
    const T lse = i < L ? a.lse[nh * L + i] : neg_inf<T>();
    w.neg_lse[i] = lse == neg_inf<T>() ? neg_inf<T>() : -lse;
    w.delta[i] = i < L ? a.delta[nh * L + i] : T(0);
  }
  const auto scale = V::set1(a.scale);
  for (int64_t t = split; t * kBwdBc < len; t += splits) {
    const int64_t j0 = t * kBwdBc, cols = std::min(kBwdBc, len - j0);
    gather_rows(kh + j0 * lk, cols, E, lk, w.kc.data());  // see above
    gather_rows(vh + j0 * lv, cols, M, lv, w.vc.data());
    const T* kj = w.kc.data();
    const T* vj = w.vc.data();
    const int64_t jn = j0 + splits * kBwdBc;
    prefetch_key_tile(a, nh, jn, std::min(kBwdBc, len - jn));
    T* st = w.st.data();
    T* dpt = w.dpt.data();
    gemm(cols, Lp, E, kj, E, w.qt.data(), Lp, st, Lp, false);
    gemm(cols, Lp, M, vj, M, w.dot.data(), Lp, dpt, Lp, false);
    // P^T in st, dS^T = P^T ∘ (dP^T - delta) · scale in dpt.
    for (int64_t r = 0; r < cols; ++r) {
      for (int64_t c = 0; c < Lp; c += V::W) {
        T* sp = st + r * Lp + c;
        T* dsp = dpt + r * Lp + c;
        const auto p = V::exp(V::fma(V::load(sp), scale, V::load(w.neg_lse.data() + c)));
        V::store(sp, p);
        V::store(dsp, V::mul(V::mul(p, V::sub(V::load(dsp), V::load(w.delta.data() + c))), scale));
      }
    }
    if (a.grad_v) {
      gemm(cols, M, L, st, Lp, w.doc.data(), M, w.dv.data(), M, false);
      store_key_rows(w.dv.data(), cols, M,
                     a.grad_v_rows.head(a.grad_v, nh, H) + j0 * a.grad_v_rows.sr, a.grad_v_rows.sr,
                     a.accumulate);
    }
    gemm(cols, E, L, dpt, Lp, w.qc.data(), E, w.dk.data(), E, false);
    store_key_rows(w.dk.data(), cols, E,
                   a.grad_k_rows.head(a.grad_k, nh, H) + j0 * a.grad_k_rows.sr, a.grad_k_rows.sr,
                   a.accumulate);
    gemm_tn(L, E, cols, dpt, Lp, kj, E, dq, ldq, true);
  }
}
}  // namespace

template <typename T>
void full_attention_backward_cpu(const FullAttentionBackwardArgs<T>& args) {
  const auto a = resolved(args);
  const int64_t N = a.N, H = a.H, L = a.L, S = a.S, E = a.E, M = a.M;
  const int64_t NH = N * H;
  if (NH == 0 || L == 0 || S == 0) {
    if (!a.accumulate) {
      zero_all_rows(a.grad_q, a.grad_q_rows, NH, H, L, E);
      zero_all_rows(a.grad_k, a.grad_k_rows, NH, H, S, E);
      if (a.grad_v) zero_all_rows(a.grad_v, a.grad_v_rows, NH, H, S, M);
    }
    return;
  }
  constexpr int64_t NR = panel_width<T, kWideBlock>();
  const int64_t k_tiles = (S + kBwdBc - 1) / kBwdBc;
  const int64_t offset = S - L;
  // Split each head's key tiles when there are fewer heads than threads.
  const int64_t splits =
      std::min<int64_t>(k_tiles, std::max<int64_t>(1, (2 * a.num_threads + NH - 1) / NH));
  // dQ is accumulated over every key tile: into contiguous parts (one per
  // split) summed at the end when the splits share a head or grad_q's rows
  // are strided (re-reading strided rows per key tile was slower).
  // Each item zeroes what it owns (its dQ part or the head's dQ rows, and
  // its key tiles past the key length, which it does not visit) instead of
  // one thread zeroing every gradient first: that serial pass, the first
  // touch of dK and dV's fresh pages, took a large part of the backward with
  // 100 queries over 16384 keys while the other threads waited.
  const bool parts = splits > 1 || a.grad_q_rows.sr != E;
  ScratchArray<T> dq_parts;
  if (parts) dq_parts.reset(static_cast<size_t>(NH * splits * L * E));

  const bool few = few_queries(a);
  parallel_items<BackwardScratch<T>>(
      NH * splits, a.num_threads,
      [&](BackwardScratch<T>& w) {
        if (few) {
          const int64_t Lp = round_up(L, Simd<T>::W);
          w.qt.resize(E * Lp);
          w.dot.resize(M * Lp);
          w.qc.resize(L * E);
          w.doc.resize(L * M);
          w.neg_lse.resize(Lp);
          w.delta.resize(Lp);
          w.st.resize(kBwdBc * Lp);
          w.dpt.resize(kBwdBc * Lp);
          w.dk.resize(kBwdBc * E);
          w.dv.resize(kBwdBc * M);
          w.kc.resize(kBwdBc * E);
          w.vc.resize(kBwdBc * M);
          return;
        }
        w.kp.resize(kBwdBc * E);
        w.vp.resize(kBwdBc * M);
        w.p.resize(kBwdBr * kBwdBc);
        if (a.dropout_threshold) w.pd.resize(kBwdBr * kBwdBc);
        w.pt.resize(kBwdBc * kBwdBr);
        w.dp.resize(kBwdBr * kBwdBc);
        w.dst.resize(kBwdBc * kBwdBr);
        w.dk.resize(kBwdBc * E);
        w.dv.resize(kBwdBc * M);
      },
      [&](int64_t item, BackwardScratch<T>& w) {
        const int64_t nh = item / splits, split = item % splits, n = nh / H, h = nh % H;
        const int64_t len = a.key_lengths ? a.key_lengths[n] : S;
        const int64_t lq = a.q_rows.sr, lk = a.k_rows.sr, lv = a.v_rows.sr, lg = a.grad_out_rows.sr;
        const T* qh = a.q_rows.head(a.q, nh, H);
        const T* kh = a.k_rows.head(a.k, nh, H);
        const T* vh = a.v_rows.head(a.v, nh, H);
        const T* doh = a.grad_out_rows.head(a.grad_out, nh, H);
        const T* lse = a.lse + nh * L;
        const T* delta = a.delta + nh * L;
        // dQ: this split's contiguous part, or grad_q's rows of the head.
        T* dq = parts ? dq_parts.get() + (nh * splits + split) * L * E
                      : a.grad_q_rows.head(a.grad_q, nh, H);
        const int64_t ldq = parts ? E : a.grad_q_rows.sr;
        if (parts || !a.accumulate) zero_rows(dq, L, E, ldq);
        if (!a.accumulate) zero_key_grads_past(a, nh, len, kBwdBc, split, splits);
        if (few) {
          few_queries_tiles(a, w, nh, split, splits, len, dq, ldq);
          return;
        }
        for (int64_t t = split; t * kBwdBc < len; t += splits) {
          const int64_t j0 = t * kBwdBc;
          const int64_t cols = std::min(kBwdBc, len - j0);
          const int64_t width = round_up(cols, NR);
          std::fill(w.dk.begin(), w.dk.end(), T(0));
          std::fill(w.dv.begin(), w.dv.end(), T(0));
          pack_transposed_panels<T, kWideBlock>(kh + j0 * lk, cols, E, lk, width, w.kp.data());
          pack_transposed_panels<T, kWideBlock>(vh + j0 * lv, cols, M, lv, width, w.vp.data());
          const int64_t jn = j0 + splits * kBwdBc;
          prefetch_key_tile(a, nh, jn, std::min(kBwdBc, len - jn));
          // Queries that may see this tile: i >= j0 - offset when causal.
          int64_t i_start = a.causal ? std::max<int64_t>(0, j0 - offset) : 0;
          i_start = i_start / kBwdBr * kBwdBr;
          for (int64_t i0 = i_start; i0 < L; i0 += kBwdBr) {
            const int64_t rows = std::min(kBwdBr, L - i0);
            const T* qi = qh + i0 * lq;
            const T* doi = doh + i0 * lg;
            // P = exp(S·scale + mask - lse), zero where dropped.
            gemm_packed<T, kWideBlock>(rows, width, E, qi, lq, w.kp.data(), w.p.data(), kBwdBc,
                                       false);
            for (int64_t r = 0; r < rows; ++r) {
              const int64_t i = i0 + r;
              T* row = w.p.data() + r * kBwdBc;
              if (lse[i] == neg_inf<T>()) {
                std::fill(row, row + width, T(0));
                continue;
              }
              const T* mrow =
                  a.mask ? a.mask + n * a.mask_sn + h * a.mask_sh + i * a.mask_sl + j0 : nullptr;
              prepare_scores(row, mrow, visible_cols(a.causal, i, offset, j0, cols), width,
                             a.scale);
              exp_shift_sum(row, width, lse[i]);
            }
            // With dropout, Pd = P ∘ Z / (1 - p), Z the forward's keep mask
            // regenerated: O used Pd, so dV = Pd^T dO and dS = P ∘ (dP ∘ Z /
            // (1 - p) - delta) = Pd ∘ dP - P ∘ delta (delta from the dropped O).
            const T* pd = w.p.data();
            if (a.dropout_threshold) {
              for (int64_t r = 0; r < rows; ++r)
                dropped_copy(w.p.data() + r * kBwdBc, cols,
                             dropout_row_key(a.dropout_seed, nh, i0 + r), j0, a.dropout_threshold,
                             T(a.dropout_scale), w.pd.data() + r * kBwdBc);
              pd = w.pd.data();
            }
            // dV_j += Pd^T dO_i
            if (a.grad_v) {
              transpose(pd, rows, cols, kBwdBc, w.pt.data(), kBwdBr);
              gemm(cols, M, rows, w.pt.data(), kBwdBr, doi, lg, w.dv.data(), M, true);
            }
            // dP = dO_i V_j^T, then dS = P ∘ (dP - delta) · scale (in w.dp)
            gemm_packed<T, kWideBlock>(rows, width, M, doi, lg, w.vp.data(), w.dp.data(), kBwdBc,
                                       false);
            for (int64_t r = 0; r < rows; ++r) {
              const T d = delta[i0 + r];
              const T* prow = w.p.data() + r * kBwdBc;
              T* dprow = w.dp.data() + r * kBwdBc;
              if (a.dropout_threshold) {
                const T* pdrow = pd + r * kBwdBc;
                for (int64_t c = 0; c < cols; ++c)
                  dprow[c] = (pdrow[c] * dprow[c] - prow[c] * d) * a.scale;
              } else {
                for (int64_t c = 0; c < cols; ++c) dprow[c] = prow[c] * (dprow[c] - d) * a.scale;
              }
            }
            // dQ_i += dS K_j ; dK_j += dS^T Q_i
            gemm(rows, E, cols, w.dp.data(), kBwdBc, kh + j0 * lk, lk, dq + i0 * ldq, ldq, true);
            transpose(w.dp.data(), rows, cols, kBwdBc, w.dst.data(), kBwdBr);
            gemm(cols, E, rows, w.dst.data(), kBwdBr, qi, lq, w.dk.data(), E, true);
          }
          store_key_rows(w.dk.data(), cols, E,
                         a.grad_k_rows.head(a.grad_k, nh, H) + j0 * a.grad_k_rows.sr,
                         a.grad_k_rows.sr, a.accumulate);
          if (a.grad_v)
            store_key_rows(w.dv.data(), cols, M,
                           a.grad_v_rows.head(a.grad_v, nh, H) + j0 * a.grad_v_rows.sr,
                           a.grad_v_rows.sr, a.accumulate);
        }
      });

  if (parts) {
    parallel_for_items(NH, a.num_threads, [&](int64_t nh) {
      T* dst = a.grad_q_rows.head(a.grad_q, nh, H);
      for (int64_t s = 0; s < splits; ++s) {
        const T* src = dq_parts.get() + (nh * splits + s) * L * E;
        store_rows(src, L, E, dst, a.grad_q_rows.sr, /*add=*/s > 0 || a.accumulate);
      }
    });
  }
}

FASTATTN_ISA_END

FASTATTN_CPU_KERNEL(full_attention_forward_cpu, FullAttentionForwardArgs)
FASTATTN_CPU_KERNEL(full_attention_backward_cpu, FullAttentionBackwardArgs)
