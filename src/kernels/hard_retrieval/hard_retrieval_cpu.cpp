// CPU kernels of hard retrieval attention (see hard_retrieval.h).
//
// Forward, per work item (n, h, tile of kBr queries): for each tile of kBc
// keys, scores = Q·K^T (register-blocked with K packed in panels; for fewer
// than kDirectRows queries, as in a decoding step, direct SIMD dot products
// without packing), then per query row either a running argmax over the kept
// raw scores or a reservoir step of the sampler (scale, mask, online max,
// exp, tile weight). At the end the chosen value row is copied (a gather).
//
// Delta (for the backward), per work item (n, h, tile of queries): recompute
// P = exp(scale·S - lse) per key tile, G = dO·V^T, delta += rowsum(P ∘ G).
#include "kernels/hard_retrieval/hard_retrieval.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include "kernels/common/isa_target.h"
#include "kernels/common/gemm.h"
#include "kernels/common/parallel.h"
#include "kernels/common/scratch.h"
#include "kernels/common/simd.h"
#include "kernels/common/softmax_rows.h"

FASTATTN_ISA_BEGIN
namespace {

constexpr int64_t kBr = 48;         // queries per tile (a multiple of 6)
constexpr int64_t kBc = 128;        // keys per tile (a multiple of every panel width)
constexpr int64_t kDirectRows = 6;  // below this many queries, no packing of K
constexpr int64_t kDeltaBr = 48;    // queries per delta tile
constexpr int64_t kDeltaBc = 64;    // keys per delta tile

// Number of keys query i may see within [j0, j0 + cols): causal cut-off.
inline int64_t visible_cols(bool causal, int64_t i, int64_t offset, int64_t j0, int64_t cols) {
  if (!causal) return cols;
  return std::clamp<int64_t>(i + offset + 1 - j0, 0, cols);
}

// Packs X (per (n, h): rows x D, laid out as xr) of every head into
// transposed panels for gemm_packed: out is (NH, rows_pad / NR panels, D, NR).
template <typename T>
ScratchArray<T> pack_heads(const T* x, const RowStrides& xr, int64_t NH, int64_t H, int64_t rows,
                           int64_t D, int64_t rows_pad, int num_threads) {
  ScratchArray<T> out(static_cast<size_t>(NH * rows_pad * D));
  T* o = out.get();
  parallel_for_items(NH, num_threads, [&](int64_t nh) {
    pack_transposed_panels(xr.head(x, nh, H), rows, D, xr.sr, rows_pad, o + nh * rows_pad * D);
  });
  return out;
}

// Scales a row of raw scores; dropped keys (past `limit`, or false in the keep
// row) become -inf up to `width`.
template <typename T>
inline void scale_and_mask(T* row, const bool* keep_row, int64_t limit, int64_t width, T scale) {
  for (int64_t c = 0; c < limit; ++c) {
    row[c] = (keep_row == nullptr || keep_row[c]) ? row[c] * scale : neg_inf<T>();
  }
  for (int64_t c = limit; c < width; ++c) row[c] = neg_inf<T>();
}

// Per query row of a tile: the online-softmax state and the current choice.
template <typename T>
struct RowState {
  T m;           // running max of the kept scaled scores
  T w;           // running sum of exp(s - m)
  int64_t best;  // current index (-1: none)
  T best_score;  // argmax mode: its raw score
};

template <typename T>
struct ForwardScratch {
  std::vector<T> s;
  std::vector<T> o;  // (kBr, M): the unnormalised P·V when soft_out is asked
  std::vector<RowState<T>> rows;
};

// Scores of `rows` queries against keys [j0, j0 + cols) into s (row stride
// kBc); columns up to `width` are written (garbage past cols is masked later).
// q's rows lq apart, kh's lk apart.
template <typename T>
inline void tile_scores(const T* q, int64_t lq, int64_t rows, int64_t E, const T* kh, int64_t lk,
                        const T* kph, int64_t j0, int64_t cols, int64_t width, T* s) {
  if (kph != nullptr) {
    gemm_packed(rows, width, E, q, lq, kph + j0 * E, s, kBc, false);
    return;
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) s[r * kBc + c] = simd_dot(q + r * lq, kh + (j0 + c) * lk, E);
}

}  // namespace

template <typename T>
void hard_retrieval_forward_cpu(const HardRetrievalForwardArgs<T>& args) {
  HardRetrievalForwardArgs<T> a = args;
  resolve_qkv_rows(a);
  a.out_rows = a.out_rows.resolved(a.H, a.L, a.M);
  const int64_t N = a.N, H = a.H, L = a.L, S = a.S, E = a.E, M = a.M;
  const int64_t NH = N * H;
  if (NH == 0 || L == 0) return;
  constexpr int64_t NR = panel_width<T>();
  const bool direct = L < kDirectRows;
  const int64_t S_pad = round_up(std::max<int64_t>(S, 1), NR);
  ScratchArray<T> kp;
  if (!direct) kp = pack_heads(a.k, a.k_rows, NH, H, S, E, S_pad, a.num_threads);
  const int64_t q_tiles = (L + kBr - 1) / kBr;
  const int64_t offset = S - L;
  const bool need_softmax = a.sample || a.lse != nullptr;
  const bool soft = a.soft_out != nullptr && a.lse != nullptr;

  parallel_items<ForwardScratch<T>>(
      NH * q_tiles, a.num_threads,
      [&](ForwardScratch<T>& w) {
        w.s.resize(kBr * kBc);
        w.rows.resize(kBr);
        if (soft) w.o.resize(kBr * M);
      },
      [&](int64_t item, ForwardScratch<T>& w) {
        const int64_t nh = item / q_tiles, n = nh / H, h = nh % H;
        const int64_t i0 = (item % q_tiles) * kBr;
        const int64_t rows = std::min(kBr, L - i0);
        const int64_t lq = a.q_rows.sr, lk = a.k_rows.sr, lv = a.v_rows.sr;
        const T* q = a.q_rows.row(a.q, nh, H, i0);
        const T* kh = a.k_rows.head(a.k, nh, H);
        const T* kph = direct ? nullptr : kp.get() + nh * S_pad * E;
        int64_t kend = a.key_lengths ? a.key_lengths[n] : S;
        if (a.causal) kend = std::min(kend, i0 + rows + offset);
        for (int64_t r = 0; r < rows; ++r) w.rows[r] = {neg_inf<T>(), T(0), -1, neg_inf<T>()};
        const T* vh = a.v_rows.head(a.v, nh, H);
        if (soft) std::fill(w.o.begin(), w.o.begin() + rows * M, T(0));
        for (int64_t j0 = 0; j0 < kend; j0 += kBc) {
          const int64_t cols = std::min(kBc, kend - j0);
          const int64_t width = round_up(cols, NR);
          const uint64_t tile = static_cast<uint64_t>(j0 / kBc);
          tile_scores(q, lq, rows, E, kh, lk, kph, j0, cols, width, w.s.data());
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t i = i0 + r;
            RowState<T>& st = w.rows[r];
            T* row = w.s.data() + r * kBc;
            const bool* krow =
                a.keep ? a.keep + n * a.keep_sn + h * a.keep_sh + i * a.keep_sl + j0 : nullptr;
            const int64_t limit = visible_cols(a.causal, i, offset, j0, cols);
            if (!a.sample) {
              // Strict > in increasing j: ties keep the lowest index; NaN never wins.
              for (int64_t c = 0; c < limit; ++c) {
                if (krow && !krow[c]) continue;
                if (st.best < 0 || row[c] > st.best_score) {
                  st.best_score = row[c];
                  st.best = j0 + c;
                }
              }
            }
            if (!need_softmax) continue;
            scale_and_mask(row, krow, limit, width, a.scale);
            const T m_new = std::max(st.m, row_max(row, width));
            if (m_new == neg_inf<T>()) {                    // nothing kept so far
              if (soft) std::fill(row, row + width, T(0));  // adds nothing to P·V
              continue;
            }
            const T alpha = std::exp(st.m - m_new);  // 0 while m was -inf
            const T wt = exp_shift_sum(row, width, m_new);
            if (soft && alpha != T(1)) {
              T* orow = w.o.data() + r * M;
              for (int64_t x = 0; x < M; ++x) orow[x] *= alpha;
            }
            const T w_old = st.w * alpha;
            st.w = w_old + wt;
            st.m = m_new;
            if (!a.sample || !(wt > T(0))) continue;
            const uint64_t row_id = static_cast<uint64_t>(nh * L + i);
            // Reservoir step: this tile takes over with probability wt / (w_old + wt).
            const double u1 = hard_retrieval_uniform(a.seed, row_id, tile, 0);
            if (!(u1 * static_cast<double>(st.w) < static_cast<double>(wt))) continue;
            // Inverse CDF inside the tile; rounding falls back to the last kept key.
            const double target = hard_retrieval_uniform(a.seed, row_id, tile, 1) * wt;
            double cum = 0;
            int64_t pick = -1;
            for (int64_t c = 0; c < limit; ++c) {
              if (!(row[c] > T(0))) continue;
              pick = c;
              cum += static_cast<double>(row[c]);
              if (cum > target) break;
            }
            if (pick >= 0) st.best = j0 + pick;
          }
          // The tile's exp(s - m) rows (zeros where nothing is kept) times its values.
          if (soft) gemm(rows, M, cols, w.s.data(), kBc, vh + j0 * lv, lv, w.o.data(), M, true);
        }
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t idx = w.rows[r].best;
          a.index[nh * L + i0 + r] = idx;
          T* out = a.out_rows.row(a.out, nh, H, i0 + r);
          if (idx >= 0) {
            std::copy(vh + idx * lv, vh + idx * lv + M, out);
          } else {
            std::fill(out, out + M, T(0));
          }
          if (a.lse) {
            const T wsum = w.rows[r].w;
            a.lse[nh * L + i0 + r] = wsum > T(0) ? w.rows[r].m + std::log(wsum) : neg_inf<T>();
            if (soft) {
              const T inv = wsum > T(0) ? T(1) / wsum : T(0);
              T* so = a.soft_out + (nh * L + i0 + r) * M;
              for (int64_t x = 0; x < M; ++x) so[x] = w.o[r * M + x] * inv;
            }
          }
        }
      });
}

namespace {
template <typename T>
struct DeltaScratch {
  std::vector<T> p, g, acc;
};
}  // namespace

template <typename T>
void hard_retrieval_delta_cpu(const HardRetrievalDeltaArgs<T>& args) {
  HardRetrievalDeltaArgs<T> a = args;
  resolve_qkv_rows(a);
  a.grad_out_rows = a.grad_out_rows.resolved(a.H, a.L, a.M);
  const int64_t N = a.N, H = a.H, L = a.L, S = a.S, E = a.E, M = a.M;
  const int64_t NH = N * H;
  std::fill(a.delta, a.delta + NH * L, T(0));
  if (NH == 0 || L == 0 || S == 0) return;
  constexpr int64_t NR = panel_width<T>();
  const int64_t S_pad = round_up(S, NR);
  const auto kp = pack_heads(a.k, a.k_rows, NH, H, S, E, S_pad, a.num_threads);
  const auto vp = pack_heads(a.v, a.v_rows, NH, H, S, M, S_pad, a.num_threads);
  const int64_t q_tiles = (L + kDeltaBr - 1) / kDeltaBr;
  const int64_t offset = S - L;

  parallel_items<DeltaScratch<T>>(
      NH * q_tiles, a.num_threads,
      [&](DeltaScratch<T>& w) {
        w.p.resize(kDeltaBr * kDeltaBc);
        w.g.resize(kDeltaBr * kDeltaBc);
        w.acc.resize(kDeltaBr);
      },
      [&](int64_t item, DeltaScratch<T>& w) {
        const int64_t nh = item / q_tiles, n = nh / H, h = nh % H;
        const int64_t i0 = (item % q_tiles) * kDeltaBr;
        const int64_t rows = std::min(kDeltaBr, L - i0);
        const T* q = a.q_rows.row(a.q, nh, H, i0);
        const T* dout = a.grad_out_rows.row(a.grad_out, nh, H, i0);
        const T* lse = a.lse + nh * L + i0;
        int64_t kend = a.key_lengths ? a.key_lengths[n] : S;
        if (a.causal) kend = std::min(kend, i0 + rows + offset);
        std::fill(w.acc.begin(), w.acc.end(), T(0));
        for (int64_t j0 = 0; j0 < kend; j0 += kDeltaBc) {
          const int64_t cols = std::min(kDeltaBc, kend - j0);
          const int64_t width = round_up(cols, NR);
          gemm_packed(rows, width, E, q, a.q_rows.sr, kp.get() + nh * S_pad * E + j0 * E,
                      w.p.data(), kDeltaBc, false);
          gemm_packed(rows, width, M, dout, a.grad_out_rows.sr, vp.get() + nh * S_pad * M + j0 * M,
                      w.g.data(), kDeltaBc, false);
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t i = i0 + r;
            if (lse[r] == neg_inf<T>()) continue;
            T* prow = w.p.data() + r * kDeltaBc;
            const T* grow = w.g.data() + r * kDeltaBc;
            const bool* krow =
                a.keep ? a.keep + n * a.keep_sn + h * a.keep_sh + i * a.keep_sl + j0 : nullptr;
            scale_and_mask(prow, krow, visible_cols(a.causal, i, offset, j0, cols), width, a.scale);
            exp_shift_sum(prow, width, lse[r]);
            T s = 0;
            for (int64_t c = 0; c < cols; ++c) s += prow[c] * grow[c];
            w.acc[r] += s;
          }
        }
        std::copy(w.acc.begin(), w.acc.begin() + rows, a.delta + nh * L + i0);
      });
}

template <typename T>
void hard_retrieval_grad_v_cpu(const HardRetrievalGradVArgs<T>& args) {
  HardRetrievalGradVArgs<T> a = args;
  a.grad_out_rows = a.grad_out_rows.resolved(a.H, a.L, a.M);
  a.grad_v_rows = a.grad_v_rows.resolved(a.H, a.S, a.M);
  const int64_t L = a.L, S = a.S, M = a.M;
  // One head per work item: no two items write the same rows; each zeroes
  // its own head first (in parallel, unlike one pass over every head).
  parallel_for_items(a.NH, a.num_threads, [&](int64_t nh) {
    zero_rows(a.grad_v_rows.head(a.grad_v, nh, a.H), S, M, a.grad_v_rows.sr);
    for (int64_t i = 0; i < L; ++i) {
      const int64_t idx = a.index[nh * L + i];
      if (idx < 0) continue;
      const T* src = a.grad_out_rows.row(a.grad_out, nh, a.H, i);
      T* dst = a.grad_v_rows.row(a.grad_v, nh, a.H, idx);
      for (int64_t c = 0; c < M; ++c) dst[c] += src[c];
    }
  });
}

FASTATTN_ISA_END

FASTATTN_CPU_KERNEL(hard_retrieval_forward_cpu, HardRetrievalForwardArgs)
FASTATTN_CPU_KERNEL(hard_retrieval_delta_cpu, HardRetrievalDeltaArgs)
FASTATTN_CPU_KERNEL(hard_retrieval_grad_v_cpu, HardRetrievalGradVArgs)
