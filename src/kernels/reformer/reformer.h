// Reformer LSH attention kernels (Kitaev et al. 2020) on the CPU.
//
//  - lsh_hash: bucket of every position and round, argmax over the 2·B2
//    values [x·R_r ; -x·R_r] (R_r: E x B2 random rotation of round r). B2 = 0
//    means one bucket (every bucket is 0). O(N·H·L·R·E·B2).
//  - reformer forward/backward: shared-QK attention. Keys are the queries
//    L2-normalised (k_j = q_j / max(|q_j|, 1e-12)). Per round the valid
//    positions (before the length) are stably sorted by bucket (counting sort:
//    (bucket, position) order), cut into chunks of `chunk` sorted positions
//    (the last one partial), and the queries of chunk c attend to the keys of
//    chunks c-1 and c (chunk 0: itself only). Scores are scale·q_i·k_j; the
//    self score is replaced by -1e5 when mask_self; with causal, keys at
//    later positions are dropped. Rounds are combined by their log-sum-exp
//    (a softmax over the rounds' lse), i.e. a softmax over the multiset of
//    (round, key) pairs. Padded positions (>= length) output 0.
//    Cost per round: O(N·H·L·2·chunk·(E + M)) flops; memory O(N·H·L·(E + R))
//    extra (normalised keys, the sort permutations), never L x L.
//
// Forward work items: (n, h, chunk) per round, rounds in sequence, each item
// merging its queries' results into the running (max, sum, unnormalised
// out) of the rounds before (a query is in exactly one chunk per round: no two items write the
// same row). Backward: the FlashAttention-2 recomputation from the final lse;
// per round two passes (even chunks, odd chunks) so that no two items of a
// pass touch the same key rows (chunk c writes key rows of c-1 and c).
//
// Tested by tests/cpp/test_reformer_attention.cpp; timed by
// bench/bench_reformer_attention.cpp.
#pragma once

#include <cstdint>

#include "kernels/common/dropout.h"
#include "kernels/common/kernel_args.h"

namespace fastattn::kernels {

// The arguments of both backends (kernels/common/kernel_args.h): T = float or
// double for the CPU kernels below, void for the CUDA launchers
// (reformer_cuda.h: contiguous operands, E and M <= kReformerCudaMaxHeadDim).
template <typename T>
struct LshHashArgs {
  const T* x = nullptr;          // (N, H, L, E), rows at x_rows
  RowStrides x_rows;             // CPU (kernels/common/rows.h); default: contiguous
  const T* rotations = nullptr;  // (R, E, B2) contiguous
  int64_t* buckets = nullptr;    // (N, H, R, L), written: values in [0, max(1, 2·B2))
  int64_t N = 0, H = 0, L = 0, E = 0, R = 0, B2 = 0;
  int num_threads = 1;            // CPU
  DType dtype = DType::kFloat32;  // CUDA: the element type of the void pointers
};

template <typename T>
void lsh_hash_cpu(const LshHashArgs<T>& args);

template <typename T>
struct ReformerParams {
  const T* q = nullptr;       // (N, H, L, E), rows at q_rows: queries and (normalised) keys
  const T* v = nullptr;       // (N, H, L, M), rows at v_rows
  RowStrides q_rows, v_rows;  // CPU; default: contiguous
  // CPU: the buckets (N, H, R, L) in [0, n_buckets), sorted by the kernels.
  const int64_t* buckets = nullptr;
  int64_t n_buckets = 1;  // bound of the bucket values (counting sort)
  // CUDA: per round the valid positions [0, len) sorted by (bucket,
  // position) in entries [0, len) of (N, H, R, L); the rest unused.
  const int64_t* perm = nullptr;
  const int64_t* lengths = nullptr;  // (N,) in [0, L], or nullptr for L
  int64_t N = 0, H = 0, L = 0, E = 0, M = 0, R = 0;
  int64_t chunk = 32;         // chunk size in sorted positions, >= 1
  bool causal = false;        // drop keys j > i
  bool mask_self = true;      // self score -> -1e5
  KernelScalar<T> scale = 1;  // softmax temperature
  // Attention dropout, fused (CPU): the weight of key j in round r for query
  // i (original positions) is kept when its bits under row key
  // dropout_row_key(reformer_round_seed(seed, r), nh, i) reach the
  // threshold (kernels/common/dropout.h; 0: no dropout), each (round, key)
  // pair on its own, as the softmax is over those pairs. The stats stay the
  // undropped softmax's.
  uint32_t dropout_threshold = 0;
  uint64_t dropout_seed = 0;
  KernelScalar<T> dropout_scale = 1;
  int num_threads = 1;            // CPU
  DType dtype = DType::kFloat32;  // CUDA: the element type of the void pointers
};

// The dropout seed of round r (a stream of the call's seed per round).
inline uint64_t reformer_round_seed(uint64_t seed, int64_t r) {
  return dropout_stream_seed(seed, dropout_mix64(0x5265666f726d6572ull + static_cast<uint64_t>(r)));
}

template <typename T>
struct ReformerForwardArgs : ReformerParams<T> {
  T* out = nullptr;     // (N, H, L, M), rows at out_rows, written (0 at padded positions)
  RowStrides out_rows;  // CPU
  // (N, H, L, 2), written: the log-sum-exp over rounds and keys as two parts,
  // [max score, log(sum of exp(score - max))] ([-inf, 0] at padding). Kept
  // apart because a position that sees only itself has a max of -1e5, where
  // max + log(sum) would lose the sum's precision.
  double* stats = nullptr;
  float* workspace = nullptr;  // CUDA: N·H·L·M floats (the running unnormalised output)
};

template <typename T>
struct ReformerBackwardArgs : ReformerParams<T> {
  const T* grad_out = nullptr;                         // (N, H, L, M), rows at grad_out_rows
  const double* stats = nullptr;                       // (N, H, L, 2) from the forward
  const KernelScalar<T>* delta = nullptr;              // (N, H, L): rowsum(grad_out ∘ out)
  T* grad_q = nullptr;                                 // (N, H, L, E), written (both roles of q)
  T* grad_v = nullptr;                                 // (N, H, L, M), written
  RowStrides grad_out_rows, grad_q_rows, grad_v_rows;  // CPU; default: contiguous
  float* workspace = nullptr;  // CUDA: N·H·L·(2·E + M) floats (dq, dk, dv accumulators)
};

template <typename T>
void reformer_forward_cpu(const ReformerForwardArgs<T>& args);
template <typename T>
void reformer_backward_cpu(const ReformerBackwardArgs<T>& args);

// The score a position gives itself when mask_self (as in Reformer).
constexpr double kReformerSelfScore = -1e5;

}  // namespace fastattn::kernels
