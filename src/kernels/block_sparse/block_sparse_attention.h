// Block-sparse softmax attention on the CPU: the kernel behind `local`,
// `sparse-strided` and `sparse-fixed` (Child et al. 2019).
//
// Layout. A pattern is a union of at most two disjoint *parts*. Each part has
// an order of the queries and an order of the keys (identity, residue-major
// "all positions ≡ r mod l, ascending", or a gather of the summary positions)
// chosen so that, in those orders, every query keeps the keys of one interval
// [a, b] minus at most one interval [x, y]. A query block's key blocks are
// therefore a contiguous range (the block CSR row, computed per tile), and the
// element mask inside a tile is two column intervals per row, resolved once
// per tile row (a tile fully inside the interval gets no mask at all). The
// parts of one head share one online softmax: part 1 leaves its running
// (max, sum, unnormalised output) per query, part 2 continues from it.
//
// Positions: query i sits at key position p = i + (S - L) (the last query
// lines up with the last key). Keys at positions >= key_lengths[n] are
// dropped in every part.
//
// Cost: forward 4·E·(kept-or-tile-padded keys) flops per query; backward
// (a dQ pass per query tile and a dK/dV pass per key tile, both recomputing P
// from the saved log-sum-exp) about 3.5× the forward. Extra memory: ordered
// and packed copies of K and V (O(N·H·S·(E+M)) per part), O(N·H·L) state.
// Tested by tests/cpp/test_sparse_attention.cpp; timed by
// bench/bench_sparse_attention.cpp.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/common/kernel_args.h"

namespace fastattn::kernels {

enum class SparsePartKind : int {
  Band = 0,       // keys j with lo <= j - p <= hi (local, strided A1)
  SameBlock = 1,  // keys in p's block of length `stride` (fixed A1); causal: j <= p
  Residue = 2,    // keys j ≡ p (mod stride) (strided A2); causal: j <= p
  Summary = 3,    // keys j with j mod stride in the summary window (fixed A2); causal: j <= p
};

struct SparsePart {
  SparsePartKind kind = SparsePartKind::Band;
  int64_t lo = 0, hi = 0;  // Band: kept offsets j - p
  int64_t stride = 1;      // l (SameBlock, Residue, Summary)
  int64_t summary = 1;     // c (Summary): the last c positions of every block
  bool per_head = false;   // Summary: head h uses the group g = h mod (l / c) of c positions,
                           // residues [l - c·(g+1), l - c·g)
  bool causal = false;     // SameBlock, Residue, Summary: keep only j <= p
  bool exclude = false;    // merged mode: Residue drops |p - j| <= l, Summary drops p's own
                           // block (those keys belong to the A1 part)
  int64_t head_begin = 0;  // the heads [head_begin, head_end) use this part
  int64_t head_end = 0;
};

// The parts of a named pattern (parameters already validated by the op):
//   "local":   {window}                          one Band part
//   "window":  {left, right}                     one Band part: offsets [-left, right]
//                                                (causal: [-left, min(right, 0)])
//   "strided": {stride, which}                   which: 0 merged, 1 A1, 2 A2, 3 split heads
//   "fixed":   {stride, summary, which, per_head_summary}
// Split: heads [0, ceil(H/2)) use A1, the others A2. Local offsets: causal
// [-(w-1), 0]; otherwise [-floor(w/2), w - 1 - floor(w/2)] (w keys).
std::vector<SparsePart> make_sparse_parts(int pattern, const std::vector<int64_t>& params,
                                          bool causal, int64_t H);
enum SparsePattern : int {
  kLocalPattern = 0,
  kStridedPattern = 1,
  kFixedPattern = 2,
  kWindowPattern = 3
};

// The CPU kernels' arguments: the operands of every kernel (QKVParams of
// kernels/common/kernel_args.h, T = float or double) and the pattern's parts.
// The CUDA launchers take BlockSparseCudaParams (block_sparse_attention_cuda.h):
// the same operands (T = void) and the parts' plans on the device.
template <typename T>
struct BlockSparseParams : QKVParams<T> {
  T scale = 1;  // softmax temperature applied to q·k
  const SparsePart* parts = nullptr;
  int num_parts = 0;
  // Attention dropout, fused (CPU): as FullAttentionParams' (kernel weight
  // (i, j) of head nh by the original query and key indices, so every part
  // and tiling gives full attention's mask; 0: no dropout). lse stays the
  // undropped softmax's.
  uint32_t dropout_threshold = 0;
  uint64_t dropout_seed = 0;
  T dropout_scale = 1;
};

template <typename T>
struct BlockSparseForwardArgs : BlockSparseParams<T> {
  T* out = nullptr;  // (N, H, L, M), rows at out_rows
  T* lse = nullptr;  // (N, H, L) contiguous: log-sum-exp of the kept scaled scores, -inf if none
  RowStrides out_rows;
};

template <typename T>
struct BlockSparseBackwardArgs : BlockSparseParams<T> {
  const T* grad_out = nullptr;  // (N, H, L, M), rows at grad_out_rows
  const T* lse = nullptr;       // (N, H, L) contiguous, from the forward
  const T* delta = nullptr;     // (N, H, L) contiguous: rowsum(grad_out ∘ out)
  T* grad_q = nullptr;          // (N, H, L, E), written
  T* grad_k = nullptr;          // (N, H, S, E), written
  T* grad_v = nullptr;          // (N, H, S, M), written
  RowStrides grad_out_rows, grad_q_rows, grad_k_rows, grad_v_rows;  // default: contiguous
};

// ---- the parts as plain arrays (what the CUDA kernels read) --------------------
// One part's plan: per head group its query and key orders and, per ordered
// query, the kept ordered keys [a, b] minus [x, y] (computed with every key
// present: key_lengths are applied by the kernels as a mask on the original key
// index), the key tiles each query tile reaches and, transposed, the query tiles
// that reach each key tile (tiles of bq queries / bk keys in the part's orders).
struct SparsePartPlan {
  struct Group {
    int64_t Sp = 0;                     // keys in the part's order
    std::vector<int64_t> q_order;       // (L) ordered query -> query index
    std::vector<int64_t> k_order;       // (Sp) ordered key -> key index
    std::vector<int64_t> ranges;        // (L, 4) per ordered query: a, b, x, y
    std::vector<int64_t> q_tile_kb;     // (ceil(L/bq), 2): key tiles [lo, hi] (hi < lo: none)
    std::vector<int64_t> kt_ptr, kt_q;  // (ceil(S/bk) + 1), CSR of query tiles per key tile
  };
  std::vector<int64_t> head_group;  // (H) group of each head, -1 where the part is not used
  std::vector<int64_t> head_flags;  // (H) bit 0: first part of the head, bit 1: last part
  std::vector<Group> groups;
};
std::vector<SparsePartPlan> make_sparse_plans(const std::vector<SparsePart>& parts, int64_t H,
                                              int64_t L, int64_t S, int64_t bq, int64_t bk);

// The plans in one int64 buffer; per part, the offsets of its arrays in it.
struct SparsePlanLayout {
  int64_t num_groups = 0, max_sp = 0;
  int64_t head_group = 0, head_flags = 0;  // (H) each
  int64_t group_sp = 0;                    // (G)
  int64_t q_order = 0;                     // (G, L)
  int64_t k_order = 0;                     // (G, S): row g holds Sp_g entries
  int64_t ranges = 0;                      // (G, L, 4)
  int64_t q_tile_kb = 0;                   // (G, ceil(L/bq), 2)
  int64_t kt_ptr = 0;                      // (G, ceil(S/bk) + 1), absolute offsets into kt_q
  int64_t kt_q = 0;                        // all groups' lists
};
std::vector<int64_t> flatten_sparse_plans(const std::vector<SparsePartPlan>& plans, int64_t H,
                                          int64_t L, int64_t S, int64_t bq, int64_t bk,
                                          std::vector<SparsePlanLayout>* layouts);

template <typename T>
void block_sparse_attention_forward_cpu(const BlockSparseForwardArgs<T>& args);
template <typename T>
void block_sparse_attention_backward_cpu(const BlockSparseBackwardArgs<T>& args);

}  // namespace fastattn::kernels
