// CPU kernels of Reformer LSH attention (see reformer.h).
//
// Per chunk, with C = chunk and up to 2C keys (chunks c-1 and c of the
// sorted order; work items are runs of consecutive chunks, which gather the
// rows two windows share once): gather the chunk's query rows and the
// window's key and value rows by the round's permutation, pack K^T in
// panels, S = Q·K^T by the register-blocked micro-kernel
// (kernels/common/gemm.h), scale and mask, softmax with the vector exp,
// O = P·V, then merge into the running output of
// the earlier rounds as an online softmax over rounds: running max m and
// sum l per position (float64), out' = out·exp(m - m') + O·exp(m_r - m')
// (O unnormalised, m_r its row max), normalised by l after the last round.
// Backward recomputes P = exp((S - m) - log l) per chunk with the final
// stats, dS = P ∘ (dO·V^T - delta)·scale, and scatters dQ = dS·K, dK = dS^T·Q,
// dV = P^T·dO into the original positions; dK reaches q through the
// normalisation at the end: dq += (dk - k (k·dk)) / |q|.
#include "kernels/reformer/reformer.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include "kernels/common/isa_target.h"
#include "kernels/common/dropout_rows.h"
#include "kernels/common/gemm.h"
#include "kernels/common/parallel.h"
#include "kernels/common/scratch.h"
#include "kernels/common/simd.h"
#include "kernels/common/softmax_rows.h"
#include "kernels/hashing/projections.h"

FASTATTN_ISA_BEGIN
namespace {

constexpr double kNormEps = 1e-12;  // keys: q / max(|q|, eps)

// row = exp((row - hi) - lo) in place (hi: the max score, exact in T; lo:
// the log of the sum, small). width: a multiple of W.
template <typename T>
inline void exp_shift2(T* row, int64_t width, T hi, T lo) {
  using S = Simd<T>;
  const auto h = S::set1(hi), l = S::set1(lo);
  for (int64_t c = 0; c < width; c += S::W)
    S::store(row + c, S::exp(S::sub(S::sub(S::load(row + c), h), l)));
}

// What forward and backward share: the normalised keys and, per (n, h, r),
// the valid positions sorted by (bucket, position).
template <typename T>
struct Prepared {
  ScratchArray<T> keys;        // (N·H, L, E): q / max(|q|, eps)
  ScratchArray<int64_t> perm;  // (N·H, R, L): the first len entries are used
  int64_t NH = 0, max_chunks = 0;
};

// k = q / max(|q|, eps): the shared-QK key of a query row. The chunks
// compute their own keys from their gathered query rows with it, the same
// values prepare() stores.
template <typename T>
inline void normalized_row(const T* q, T* k, int64_t E) {
  const T ss = simd_dot(q, q, E);
  const T inv = T(1) / std::max<T>(std::sqrt(ss), T(kNormEps));
  for (int64_t e = 0; e < E; ++e) k[e] = q[e] * inv;
}

template <typename T>
int64_t valid_length(const ReformerParams<T>& a, int64_t nh) {
  return a.lengths ? a.lengths[nh / a.H] : a.L;
}

// Rows [len, L) of every head of x (D entries each, layout xr): the padded
// positions, which no round writes; every row when `all`.
template <typename T>
void zero_padded_rows(const ReformerParams<T>& a, T* x, const RowStrides& xr, int64_t D, bool all) {
  parallel_for_items(a.N * a.H, a.num_threads, [&](int64_t nh) {
    const int64_t len = all ? 0 : valid_length(a, nh);
    zero_rows(xr.row(x, nh, a.H, len), a.L - len, D, xr.sr);
  });
}

template <typename T>
Prepared<T> prepare(const ReformerParams<T>& a) {
  Prepared<T> p;
  const int64_t NH = a.N * a.H, L = a.L, E = a.E, R = a.R;
  p.NH = NH;
  p.keys.reset(static_cast<size_t>(NH * L * E));
  p.perm.reset(static_cast<size_t>(NH * R * L));
  parallel_for_items(NH, a.num_threads, [&](int64_t nh) {
    T* k = p.keys.get() + nh * L * E;
    for (int64_t i = 0; i < L; ++i) normalized_row(a.q_rows.row(a.q, nh, a.H, i), k + i * E, E);
  });
  // Counting sort per (n, h, r): stable, so ties in the bucket keep position order.
  parallel_items<std::vector<int64_t>>(
      NH * R, a.num_threads, [&](std::vector<int64_t>& count) { count.resize(a.n_buckets + 1); },
      [&](int64_t item, std::vector<int64_t>& count) {
        const int64_t len = valid_length(a, item / R);
        const int64_t* b = a.buckets + item * L;
        int64_t* out = p.perm.get() + item * L;
        std::fill(count.begin(), count.end(), 0);
        for (int64_t i = 0; i < len; ++i) ++count[b[i] + 1];
        for (int64_t x = 1; x <= a.n_buckets; ++x) count[x] += count[x - 1];
        for (int64_t i = 0; i < len; ++i) out[count[b[i]]++] = i;
      });
  int64_t max_len = 0;
  for (int64_t n = 0; n < a.N; ++n) max_len = std::max(max_len, a.lengths ? a.lengths[n] : L);
  p.max_chunks = (max_len + a.chunk - 1) / a.chunk;
  return p;
}

// The window of chunk c: queries at sorted positions [t0, t0 + rows), keys
// at [k0, k0 + cols).
struct Window {
  int64_t t0, rows, k0, cols;
};
inline Window window(int64_t c, int64_t chunk, int64_t len) {
  Window w;
  w.t0 = c * chunk;
  w.rows = std::min(chunk, len - w.t0);
  w.k0 = c > 0 ? w.t0 - chunk : 0;
  w.cols = w.t0 + w.rows - w.k0;
  return w;
}

// Scaled, masked scores of one query row (width a multiple of W; the
// columns past `cols` become -inf). self: the column of the query itself.
template <typename T>
inline void prepare_row(T* row, const int64_t* kpos, int64_t cols, int64_t width, int64_t i,
                        int64_t self, const ReformerParams<T>& a) {
  if (a.causal) {
    for (int64_t b = 0; b < cols; ++b) row[b] = kpos[b] > i ? neg_inf<T>() : row[b] * a.scale;
  } else {
    for (int64_t b = 0; b < cols; ++b) row[b] *= a.scale;
  }
  if (a.mask_self) row[self] = T(kReformerSelfScore);
  for (int64_t b = cols; b < width; ++b) row[b] = neg_inf<T>();
}

template <typename T>
struct Scratch {
  std::vector<T> qb, kb, kp, vb, vp, s, o, m, lr, dob, dp, t, dqb, dkb, dvb;
};

// Gathers rows idx[0..n) of x (rows of D values, sr apart) into out (n x D).
template <typename T>
inline void gather_rows(const T* x, int64_t sr, const int64_t* idx, int64_t n, int64_t D, T* out) {
  for (int64_t r = 0; r < n; ++r) copy_values(x + idx[r] * sr, out + r * D, D);
}

// Chunks per work item: a run of consecutive chunks of one (n, h, round)
// shares its windows' overlap (chunk c's rows are the second half of its
// window and the first half of chunk c + 1's): gathered once, and in the
// backward their dK and dV summed before one scatter. Per-chunk items
// gathered and scattered every key and value row twice (measured: git show
// 5f604de:docs/benchmarks.md, "Work items and first writes: the few-query
// backward, local, Reformer"); the row copies left (random rows, cache
// misses) are still a visible part of the forward.
constexpr int64_t kRunChunks = 8;

// The keys and values of win into kb (rows E apart) and vb (M apart). With
// `prev`, the window of the chunk just before in the same run, its own rows
// (the second half of its buffers) become this window's first half. The
// keys of the chunk's own positions are its query rows qb (gathered
// already) normalised, not rows of `keys` gathered again: fewer random rows
// read per chunk.
template <typename T>
void gather_window(const Window& win, const Window* prev, const int64_t* kpos, const T* keys,
                   const T* qb, const T* v, int64_t v_sr, int64_t E, int64_t M, T* kb, T* vb) {
  const int64_t own = win.t0 - win.k0;  // the first row of the chunk's own keys
  int64_t have = 0;
  if (prev != nullptr) {
    const int64_t off = prev->t0 - prev->k0;
    have = prev->rows;  // = own
    if (off > 0) {
      std::copy(kb + off * E, kb + (off + have) * E, kb);
      std::copy(vb + off * M, vb + (off + have) * M, vb);
    }
  }
  gather_rows(keys, E, kpos + have, own - have, E, kb + have * E);
  for (int64_t r = 0; r < win.rows; ++r) normalized_row(qb + r * E, kb + (own + r) * E, E);
  gather_rows(v, v_sr, kpos + have, win.cols - have, M, vb + have * M);
}

// Stores (or, when add, adds) the rows of x (n x D) into rows idx[0..n) of
// out (rows sr apart).
template <typename T>
inline void scatter_rows(const T* x, const int64_t* idx, int64_t n, int64_t D, T* out, int64_t sr,
                         bool add) {
  for (int64_t r = 0; r < n; ++r) {
    T* dst = out + idx[r] * sr;
    const T* src = x + r * D;
    if (add) {
      for (int64_t d = 0; d < D; ++d) dst[d] += src[d];
    } else {
      copy_values(src, dst, D);
    }
  }
}

// argmax over [p ; -p] of p (B2 values), the first maximum as torch.argmax
// (a NaN is passed over unless it is p[0], which gives B2).
template <typename T>
inline int64_t signed_argmax_scalar(const T* p, int64_t B2) {
  T hi = p[0], lo = p[0];
  int64_t imax = 0, imin = 0;
  for (int64_t b = 1; b < B2; ++b) {  // selects, not branches: the winners are random
    const T x = p[b];
    const bool up = x > hi, down = x < lo;
    imax = up ? b : imax;
    hi = up ? x : hi;
    imin = down ? b : imin;
    lo = down ? x : lo;
  }
  return hi >= -lo ? imax : B2 + imin;
}

// The same: the largest and smallest values by vectors, then the first
// position of the winner (the scalar form wherever a NaN is among them).
template <typename T>
inline int64_t signed_argmax(const T* p, int64_t B2) {
  using S = Simd<T>;
  if (B2 < S::W) return signed_argmax_scalar(p, B2);
  auto hi = S::load(p), neg = S::sub(S::zero(), hi), sum = hi;
  int64_t b = S::W;
  for (; b + S::W <= B2; b += S::W) {
    const auto v = S::load(p + b);
    hi = S::max(hi, v);
    neg = S::max(neg, S::sub(S::zero(), v));
    sum = S::add(sum, v);
  }
  T h = S::hmax(hi), l = -S::hmax(neg), total = S::hsum(sum);
  for (; b < B2; ++b) {
    h = std::max(h, p[b]);
    l = std::min(l, p[b]);
    total += p[b];
  }
  if (total != total) return signed_argmax_scalar(p, B2);  // a NaN (or inf - inf)
  const bool positive = h >= -l;
  const T want = positive ? h : l;
  int64_t i = 0;
  while (p[i] != want) ++i;
  return positive ? i : B2 + i;
}

// Up to this many rotation columns over all rounds (R·B2) a row's
// projections come from PackedDirections (projections.h), all rounds at
// once; more (many buckets) from gemm, a round at a time. Through gemm the
// compatibility layer's default (4 rounds of 8) used eight of the
// micro-kernel's 32 columns (git show 5f604de:docs/benchmarks.md,
// "Prefetch, cluster members, hashing, scratch buffers").
constexpr int64_t kPackedColumns = 256;

}  // namespace

template <typename T>
void lsh_hash_cpu(const LshHashArgs<T>& args) {
  LshHashArgs<T> a = args;
  a.x_rows = a.x_rows.resolved(a.H, a.L, a.E);
  const int64_t NH = a.N * a.H, L = a.L, E = a.E, R = a.R, B2 = a.B2;
  if (NH == 0 || L == 0 || R == 0) return;
  if (B2 == 0) {  // one bucket
    std::fill(a.buckets, a.buckets + NH * R * L, int64_t(0));
    return;
  }
  constexpr int64_t kRows = 96;
  const int64_t blocks = (L + kRows - 1) / kRows;
  if (R * B2 <= kPackedColumns) {
    PackedDirections<T> dirs(E, R * B2);  // column r·B2 + b: rotation r's column b
    for (int64_t r = 0; r < R; ++r)
      for (int64_t e = 0; e < E; ++e)
        for (int64_t b = 0; b < B2; ++b) dirs.set(r * B2 + b, e, a.rotations[(r * E + e) * B2 + b]);
    const int64_t G = dirs.rows(), ld = dirs.stride();
    parallel_items<std::vector<T>>(
        NH * blocks, a.num_threads, [&](std::vector<T>& w) { w.resize(G * ld); },
        [&](int64_t item, std::vector<T>& w) {
          const int64_t nh = item / blocks, l0 = (item % blocks) * kRows;
          const int64_t l1 = std::min(L, l0 + kRows);
          for (int64_t l = l0; l < l1; l += G) {
            const T* x[8];  // the last group repeats its final row
            for (int64_t j = 0; j < G; ++j)
              x[j] = a.x_rows.row(a.x, nh, a.H, std::min(l + j, l1 - 1));
            dirs.project(x, w.data());
            for (int64_t j = 0; j < G && l + j < l1; ++j)
              for (int64_t r = 0; r < R; ++r)
                a.buckets[(nh * R + r) * L + l + j] = signed_argmax(w.data() + j * ld + r * B2, B2);
          }
        });
    return;
  }
  parallel_items<std::vector<T>>(
      NH * blocks, a.num_threads, [&](std::vector<T>& w) { w.resize(kRows * B2); },
      [&](int64_t item, std::vector<T>& w) {
        const int64_t nh = item / blocks, l0 = (item % blocks) * kRows;
        const int64_t rows = std::min(kRows, L - l0);
        const T* x = a.x_rows.row(a.x, nh, a.H, l0);
        for (int64_t r = 0; r < R; ++r) {
          gemm(rows, B2, E, x, a.x_rows.sr, a.rotations + r * E * B2, B2, w.data(), B2, false);
          int64_t* out = a.buckets + (nh * R + r) * L + l0;
          for (int64_t i = 0; i < rows; ++i) out[i] = signed_argmax(w.data() + i * B2, B2);
        }
      });
}

// The row layouts of a kernel's arguments made explicit.
template <typename Args>
void resolve_rows(Args& a) {
  a.q_rows = a.q_rows.resolved(a.H, a.L, a.E);
  a.v_rows = a.v_rows.resolved(a.H, a.L, a.M);
}

template <typename T>
void reformer_forward_cpu(const ReformerForwardArgs<T>& args) {
  ReformerForwardArgs<T> a = args;
  resolve_rows(a);
  a.out_rows = a.out_rows.resolved(a.H, a.L, a.M);
  const int64_t NH = a.N * a.H, H = a.H, L = a.L, E = a.E, M = a.M, R = a.R, C = a.chunk;
  for (int64_t x = 0; x < NH * L; ++x) {
    a.stats[2 * x] = neg_inf<double>();
    a.stats[2 * x + 1] = 0;
  }
  if (NH == 0 || L == 0) return;
  // Round 0 writes every valid position's row (its first merge below is a
  // copy): only padded positions, or all when there is no round, are cleared.
  zero_padded_rows(a, a.out, a.out_rows, M, R == 0);
  const auto p = prepare(a);
  constexpr int64_t NR = panel_width<T>();
  const int64_t Wd = round_up(2 * C, NR);  // score row stride
  const int64_t runs = (p.max_chunks + kRunChunks - 1) / kRunChunks;
  for (int64_t r = 0; r < R; ++r) {
    parallel_items<Scratch<T>>(
        NH * runs, a.num_threads,
        [&](Scratch<T>& w) {
          w.qb.resize(C * E);
          w.kb.resize(2 * C * E);
          w.kp.resize(Wd * E);
          w.vb.resize(2 * C * M);
          w.s.resize(C * Wd);
          w.o.resize(C * M);
          w.m.resize(C);
          w.lr.resize(C);
        },
        [&](int64_t item, Scratch<T>& w) {
          const int64_t nh = item / runs, c0 = item % runs * kRunChunks;
          const int64_t len = valid_length(a, nh);
          const int64_t* perm = p.perm.get() + (nh * R + r) * L;
          Window prev{};
          for (int64_t c = c0; c < c0 + kRunChunks && c * C < len; ++c) {
            const Window win = window(c, C, len);
            const int64_t width = round_up(win.cols, NR);
            const int64_t* qpos = perm + win.t0;
            const int64_t* kpos = perm + win.k0;
            gather_rows(a.q_rows.head(a.q, nh, H), a.q_rows.sr, qpos, win.rows, E, w.qb.data());
            gather_window(win, c > c0 ? &prev : nullptr, kpos, p.keys.get() + nh * L * E,
                          w.qb.data(), a.v_rows.head(a.v, nh, H), a.v_rows.sr, E, M, w.kb.data(),
                          w.vb.data());
            prev = win;
            if (c + 1 < c0 + kRunChunks && (c + 1) * C < len) {
              // The next chunk's queries (also the new half of its window's
              // keys and values) and their outputs, while this one computes.
              const Window next = window(c + 1, C, len);
              const int64_t* npos = perm + next.t0;
              prefetch_indexed_rows(a.q_rows.head(a.q, nh, H), a.q_rows.sr, npos, next.rows, E);
              prefetch_indexed_rows(a.v_rows.head(a.v, nh, H), a.v_rows.sr, npos, next.rows, M);
              prefetch_indexed_rows(a.out_rows.head(a.out, nh, H), a.out_rows.sr, npos, next.rows,
                                    M, true);
              prefetch_indexed_rows(a.stats + 2 * nh * L, 2, npos, next.rows, 2, true);
            }
            pack_transposed_panels(w.kb.data(), win.cols, E, E, width, w.kp.data());
            gemm_packed(win.rows, width, E, w.qb.data(), E, w.kp.data(), w.s.data(), Wd, false);
            T* m_row = w.m.data();     // row max of this round's scores
            T* sum_row = w.lr.data();  // sum of exp(score - max)
            const uint64_t round_seed = reformer_round_seed(a.dropout_seed, r);
            for (int64_t i = 0; i < win.rows; ++i) {
              T* row = w.s.data() + i * Wd;
              prepare_row(row, kpos, win.cols, width, qpos[i], win.t0 - win.k0 + i, a);
              m_row[i] = row_max(row, width);  // finite: the query itself is kept
              sum_row[i] = exp_shift_sum(row, width, m_row[i]);
              if (a.dropout_threshold) {  // the sum above is the undropped one
                dropped_copy_at(row, win.cols, dropout_row_key(round_seed, nh, qpos[i]), kpos,
                                a.dropout_threshold, a.dropout_scale, row);
              }
            }
            gemm(win.rows, M, win.cols, w.s.data(), Wd, w.vb.data(), M, w.o.data(), M, false);
            // Online softmax across rounds: stats hold the running max and sum,
            // out the unnormalised sum (normalised after the last round).
            for (int64_t i = 0; i < win.rows; ++i) {
              const int64_t pos = nh * L + qpos[i];
              T* out = a.out_rows.row(a.out, nh, H, qpos[i]);
              double* st = a.stats + 2 * pos;
              const T* o = w.o.data() + i * M;
              const double m = m_row[i];
              if (st[0] == neg_inf<double>()) {
                st[0] = m;
                st[1] = sum_row[i];
                std::copy(o, o + M, out);
              } else if (m <= st[0]) {
                const double f = std::exp(m - st[0]);
                st[1] += f * sum_row[i];
                const T ft = static_cast<T>(f);
                for (int64_t d = 0; d < M; ++d) out[d] += o[d] * ft;
              } else {
                const double f = std::exp(st[0] - m);
                st[0] = m;
                st[1] = st[1] * f + sum_row[i];
                const T ft = static_cast<T>(f);
                for (int64_t d = 0; d < M; ++d) out[d] = out[d] * ft + o[d];
              }
            }
          }
        });
  }
  parallel_for_items(NH, a.num_threads, [&](int64_t nh) {
    for (int64_t i = 0; i < L; ++i) {
      double* st = a.stats + 2 * (nh * L + i);
      if (st[0] == neg_inf<double>()) continue;  // padding
      const T inv = static_cast<T>(1.0 / st[1]);
      T* out = a.out_rows.row(a.out, nh, H, i);
      for (int64_t d = 0; d < M; ++d) out[d] *= inv;
      st[1] = std::log(st[1]);
    }
  });
}

template <typename T>
void reformer_backward_cpu(const ReformerBackwardArgs<T>& args) {
  ReformerBackwardArgs<T> a = args;
  resolve_rows(a);
  a.grad_out_rows = a.grad_out_rows.resolved(a.H, a.L, a.M);
  a.grad_q_rows = a.grad_q_rows.resolved(a.H, a.L, a.E);
  a.grad_v_rows = a.grad_v_rows.resolved(a.H, a.L, a.M);
  const int64_t NH = a.N * a.H, H = a.H, L = a.L, E = a.E, M = a.M, R = a.R, C = a.chunk;
  if (NH == 0 || L == 0) return;
  // The gradients are written, not cleared first and added to (clearing
  // dQ, dK and dV first was a pass over fresh memory): round 0 stores what it
  // scatters first, later writes add. In round 0 every valid position is a
  // query once (dQ stored) and a key of the two windows that overlap on its
  // chunk; where those windows belong to two runs, the even run's (the first
  // pass) stores and the odd run's adds. Padded positions are cleared here
  // (every position when there are no rounds).
  zero_padded_rows(a, a.grad_q, a.grad_q_rows, E, R == 0);
  zero_padded_rows(a, a.grad_v, a.grad_v_rows, M, R == 0);
  if (R == 0) return;
  const auto p = prepare(a);
  ScratchArray<T> grad_k(static_cast<size_t>(NH * L * E));  // d loss / d keys
  constexpr int64_t NR = panel_width<T>();
  const int64_t Wd = round_up(2 * C, NR);
  // Runs of kRunChunks chunks, even runs then odd ones: the key rows a run
  // writes (its chunks and the one before its first) are no other same-parity
  // run's.
  const int64_t runs = (p.max_chunks + kRunChunks - 1) / kRunChunks;
  const int64_t half = (runs + 1) / 2;
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t parity = 0; parity < 2; ++parity) {
      parallel_items<Scratch<T>>(
          NH * half, a.num_threads,
          [&](Scratch<T>& w) {
            w.qb.resize(C * E);
            w.kb.resize(2 * C * E);
            w.kp.resize(Wd * E);
            w.vb.resize(2 * C * M);
            w.vp.resize(Wd * M);
            w.s.resize(C * Wd);
            w.dp.resize(C * Wd);
            w.dob.resize(C * M);
            w.t.resize(Wd * C);
            w.dqb.resize(C * E);
            w.dkb.resize(2 * C * E);
            w.dvb.resize(2 * C * M);
          },
          [&](int64_t item, Scratch<T>& w) {
            const int64_t nh = item / half, run = 2 * (item % half) + parity;
            const int64_t len = valid_length(a, nh);
            const int64_t* perm = p.perm.get() + (nh * R + r) * L;
            const int64_t chunks = (len + C - 1) / C;
            const int64_t c0 = run * kRunChunks, c1 = std::min(c0 + kRunChunks, chunks);
            T* gv = a.grad_v_rows.head(a.grad_v, nh, H);
            T* gk = grad_k.get() + nh * L * E;
            Window prev{};
            for (int64_t c = c0; c < c1; ++c) {
              const Window win = window(c, C, len);
              const int64_t width = round_up(win.cols, NR);
              const int64_t* qpos = perm + win.t0;
              const int64_t* kpos = perm + win.k0;
              const int64_t own = win.t0 - win.k0;  // first row of the chunk's own keys
              gather_rows(a.q_rows.head(a.q, nh, H), a.q_rows.sr, qpos, win.rows, E, w.qb.data());
              gather_rows(a.grad_out_rows.head(a.grad_out, nh, H), a.grad_out_rows.sr, qpos,
                          win.rows, M, w.dob.data());
              gather_window(win, c > c0 ? &prev : nullptr, kpos, p.keys.get() + nh * L * E,
                            w.qb.data(), a.v_rows.head(a.v, nh, H), a.v_rows.sr, E, M, w.kb.data(),
                            w.vb.data());
              // dK and dV of the window: the first half carries the previous
              // chunk's sums for its own rows (zero for a run's first chunk).
              if (c > c0) {
                const int64_t off = prev.t0 - prev.k0;
                if (off > 0) {
                  std::copy(w.dkb.begin() + off * E, w.dkb.begin() + (off + own) * E,
                            w.dkb.begin());
                  std::copy(w.dvb.begin() + off * M, w.dvb.begin() + (off + own) * M,
                            w.dvb.begin());
                }
                std::fill(w.dkb.begin() + own * E, w.dkb.end(), T(0));
                std::fill(w.dvb.begin() + own * M, w.dvb.end(), T(0));
              } else {
                std::fill(w.dkb.begin(), w.dkb.end(), T(0));
                std::fill(w.dvb.begin(), w.dvb.end(), T(0));
              }
              prev = win;
              if (c + 1 < c1) {  // the next chunk's rows, as in the forward
                const Window next = window(c + 1, C, len);
                const int64_t* npos = perm + next.t0;
                prefetch_indexed_rows(a.q_rows.head(a.q, nh, H), a.q_rows.sr, npos, next.rows, E);
                prefetch_indexed_rows(a.grad_out_rows.head(a.grad_out, nh, H), a.grad_out_rows.sr,
                                      npos, next.rows, M);
                prefetch_indexed_rows(a.v_rows.head(a.v, nh, H), a.v_rows.sr, npos, next.rows, M);
                prefetch_indexed_rows(a.grad_q_rows.head(a.grad_q, nh, H), a.grad_q_rows.sr, npos,
                                      next.rows, E, true);
                prefetch_indexed_rows(a.stats + 2 * nh * L, 2, npos, next.rows, 2);
                prefetch_indexed_rows(a.delta + nh * L, 1, npos, next.rows, 1);
              }
              // The rows whose dK and dV this chunk completes (see the end).
              const int64_t done = c + 1 < c1 ? own : win.cols;
              prefetch_indexed_rows(gv, a.grad_v_rows.sr, kpos, done, M, true);
              prefetch_indexed_rows(gk, E, kpos, done, E, true);
              pack_transposed_panels(w.kb.data(), win.cols, E, E, width, w.kp.data());
              pack_transposed_panels(w.vb.data(), win.cols, M, M, width, w.vp.data());
              // P = exp(S - lse) with the final (all-round) lse.
              gemm_packed(win.rows, width, E, w.qb.data(), E, w.kp.data(), w.s.data(), Wd, false);
              for (int64_t i = 0; i < win.rows; ++i) {
                T* row = w.s.data() + i * Wd;
                prepare_row(row, kpos, win.cols, width, qpos[i], win.t0 - win.k0 + i, a);
                const double* st = a.stats + 2 * (nh * L + qpos[i]);
                exp_shift2(row, width, static_cast<T>(st[0]), static_cast<T>(st[1]));
              }
              // dS = P ∘ (dO·V^T - delta)·scale; the replaced self score is a
              // constant and passes no gradient. With dropout, dO·V^T is of
              // the dropped weights (dropped by the forward's mask) and dV
              // is Pd^T dO with Pd the dropped P.
              gemm_packed(win.rows, width, M, w.dob.data(), M, w.vp.data(), w.dp.data(), Wd, false);
              const uint64_t round_seed = reformer_round_seed(a.dropout_seed, r);
              for (int64_t i = 0; i < win.rows; ++i) {
                const T d = a.delta[nh * L + qpos[i]];
                T* prow = w.s.data() + i * Wd;
                T* drow = w.dp.data() + i * Wd;
                const uint64_t key = dropout_row_key(round_seed, nh, qpos[i]);
                if (a.dropout_threshold) {
                  dropped_copy_at(drow, win.cols, key, kpos, a.dropout_threshold, a.dropout_scale,
                                  drow);
                }
                for (int64_t b = 0; b < win.cols; ++b) drow[b] = prow[b] * (drow[b] - d) * a.scale;
                if (a.mask_self) drow[win.t0 - win.k0 + i] = T(0);
                if (a.dropout_threshold) {
                  dropped_copy_at(prow, win.cols, key, kpos, a.dropout_threshold, a.dropout_scale,
                                  prow);
                }
              }
              // dV = P^T dO (Pd with dropout)
              transpose(w.s.data(), win.rows, win.cols, Wd, w.t.data(), C);
              gemm(win.cols, M, win.rows, w.t.data(), C, w.dob.data(), M, w.dvb.data(), M, true);
              // dQ = dS K (as queries)
              gemm(win.rows, E, win.cols, w.dp.data(), Wd, w.kb.data(), E, w.dqb.data(), E, false);
              scatter_rows(w.dqb.data(), qpos, win.rows, E, a.grad_q_rows.head(a.grad_q, nh, H),
                           a.grad_q_rows.sr, /*add=*/r > 0);
              // dK = dS^T Q (as normalised keys)
              transpose(w.dp.data(), win.rows, win.cols, Wd, w.t.data(), C);
              gemm(win.cols, E, win.rows, w.t.data(), C, w.qb.data(), E, w.dkb.data(), E, true);
              // The previous chunk's rows are complete; the chunk's own rows
              // wait for the next chunk of the run, if there is one.
              // Round 0: the previous chunk's rows were stored already when
              // they are the last chunk of the even run before this odd one;
              // the chunk's own rows (at a run's end) will be, by the even
              // run after this odd one, when there is one.
              const bool add_prev = r > 0 || (c == c0 && parity == 1);
              const bool add_own = r > 0 || (parity == 1 && c1 < chunks);
              const int64_t first = std::min(own, done);
              scatter_rows(w.dvb.data(), kpos, first, M, gv, a.grad_v_rows.sr, add_prev);
              scatter_rows(w.dkb.data(), kpos, first, E, gk, E, add_prev);
              scatter_rows(w.dvb.data() + first * M, kpos + first, done - first, M, gv,
                           a.grad_v_rows.sr, add_own);
              scatter_rows(w.dkb.data() + first * E, kpos + first, done - first, E, gk, E, add_own);
            }
          });
    }
  }
  // Through k = q / max(|q|, eps): dq += (dk - k (k·dk)) / |q|, or dk / eps
  // where the norm is clamped.
  parallel_for_items(NH, a.num_threads, [&](int64_t nh) {
    const int64_t len = valid_length(a, nh);
    for (int64_t i = 0; i < len; ++i) {
      const T* q = a.q_rows.row(a.q, nh, H, i);
      const T* k = p.keys.get() + (nh * L + i) * E;
      const T* g = grad_k.get() + (nh * L + i) * E;
      T* dq = a.grad_q_rows.row(a.grad_q, nh, H, i);
      const T ss = simd_dot(q, q, E), dot = simd_dot(k, g, E);
      const T norm = std::sqrt(ss);
      if (norm > T(kNormEps)) {
        const T inv = T(1) / norm;
        for (int64_t e = 0; e < E; ++e) dq[e] += (g[e] - k[e] * dot) * inv;
      } else {
        const T inv = T(1) / T(kNormEps);
        for (int64_t e = 0; e < E; ++e) dq[e] += g[e] * inv;
      }
    }
  });
}

FASTATTN_ISA_END

FASTATTN_CPU_KERNEL(lsh_hash_cpu, LshHashArgs)
FASTATTN_CPU_KERNEL(reformer_forward_cpu, ReformerForwardArgs)
FASTATTN_CPU_KERNEL(reformer_backward_cpu, ReformerBackwardArgs)
