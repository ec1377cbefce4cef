// C++ entry points of the fastattn operators. Each one calls the operator
// through the PyTorch dispatcher (torch.ops.fastattn.<op> in Python), so
// autograd and every registered backend apply.
//
// Layout: queries (N, H, L, E), keys (N, H, S, E), values (N, H, S, M),
// outputs (N, H, L, M). Inputs may have any strides; full_attention and
// elu_linear_attention read views whose last dimension is contiguous in
// place, and when q's heads lie within its rows (a (N, L, H·E) projection
// viewed as (N, H, L, E): q.stride(1) < q.stride(2)) return the output in
// that (N, L, H, M) memory order and each gradient in its input's layout
// (reshape, not view, such outputs).
//
// Devices and dtypes: CPU tensors in float32 or float64, and float16 or
// bfloat16 computed in float32 (widened copies, results rounded once, saved
// statistics float32); CUDA tensors (when the library is built with CUDA,
// docs/cuda.md) in float32, float16 or bfloat16 with float32 arithmetic.
// Where a comment below says "float32 or float64", read "float32, float64,
// float16 or bfloat16" on the CPU and "float32, float16 or bfloat16" on CUDA. CUDA head-dimension
// limits: full attention E, M <= 128; block-sparse, hard-retrieval and
// Reformer E, M <= 256.
#pragma once

#include <torch/torch.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace fastattn {

// Exact softmax attention, fused: tiles of queries × keys with an online
// softmax, never an L×S matrix (extra memory O(N·H·L)).
//   attn_mask:   (L, S), (N, L, S) or (N, H, L, S); bool (true = keep) or additive.
//   key_lengths: (N,) integers in [0, S]; keys at positions >= length are ignored.
//   causal:      query i sees key j iff j <= i + (S - L).
//   softmax_temp: scale of the scores, default 1/sqrt(E).
//   dropout_p:   attention dropout in [0, 1), fused (CPU): each weight kept
//                with probability 1 - dropout_p and scaled by 1 / (1 - p);
//                the keep mask comes from a counter-based generator keyed by
//                dropout_seed (default: drawn from torch's CPU generator), so
//                the backward regenerates it and nothing L×S is stored.
// A query that sees no key outputs zeros. Gradients flow to q, k and v (not to
// an additive mask).
torch::Tensor full_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             const std::optional<torch::Tensor>& attn_mask = std::nullopt,
                             const std::optional<torch::Tensor>& key_lengths = std::nullopt,
                             bool causal = false, std::optional<double> softmax_temp = std::nullopt,
                             double dropout_p = 0.0,
                             std::optional<int64_t> dropout_seed = std::nullopt);

// full_attention (key lengths only, not causal) that also returns the row
// log-sum-exp of the scaled scores, lse (N, H, L) (-inf for a row that sees no
// key), and each row's topk key indices by descending score,
// top_idx (N, H, L, topk) int64 (ties: lower index first; a row with fewer
// than topk kept keys is completed with the lowest indices not in it).
// 0 <= topk <= S. Gradients flow to q, k and v from out and from lse; top_idx
// is not differentiable. The centroid step of improved clustered attention.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> full_attention_lse_topk(
    const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
    const std::optional<torch::Tensor>& key_lengths = std::nullopt,
    std::optional<double> softmax_temp = std::nullopt, int64_t topk = 0);

// Causal linear product (unnormalised causal linear attention, Katharopoulos
// et al. 2020): q, k already feature-mapped (N, H, L, F), v (N, H, L, M) ->
// (N, H, L, M) with out_i = sum_{j<=i} (q_i·k_j) v_j. Chunked kernels with a
// carried F×M state: O(N·H·L·F·M) time, O(L·(F+M)) memory, never L×F×M.
// Requires the same length L for q, k and v. Gradients flow to q, k and v.
torch::Tensor causal_linear_product(const torch::Tensor& q, const torch::Tensor& k,
                                    const torch::Tensor& v);
// Its rows per chunk C on the CPU (the C×C tiles stay in L1/L2; flop counts
// of benchmarks use it).
inline constexpr int64_t kCausalLinearProductChunk = 64;

// Normalised linear attention with phi(x) = elu(x) + 1 (the default map of the
// `linear` and `causal-linear` types), fused into one kernel per pass:
//   out_i = phi(q_i)^T sum_j phi(k_j) v_j^T / (phi(q_i)^T sum_j phi(k_j) + eps)
// over keys j < key_lengths[n] ((N,) integers in [0, S]), and j <= i when
// causal (which needs S == L). q (N, H, L, E), k (N, H, S, E), v (N, H, S, M)
// -> (N, H, L, M). O(N·H·(L+S)·E·M) time (plus L·C·(E+M) within chunks of
// C = 64 when causal); no L×S or L×E×M tensor. Gradients flow to q, k and v.
torch::Tensor elu_linear_attention(const torch::Tensor& q, const torch::Tensor& k,
                                   const torch::Tensor& v,
                                   const std::optional<torch::Tensor>& key_lengths = std::nullopt,
                                   bool causal = false, double eps = 1e-6);

// elu(x) + 1 elementwise, the default feature map of linear attention
// (vectorised CPU kernels; ATen's elu runs scalar in Debian's build).
// float32 / float64, any shape; gradients flow to x.
torch::Tensor elu_feature_map(const torch::Tensor& x);

// Clustered attention, step 1: sign-of-random-projection hashing. Bit b of a
// query's code is 1 iff x·planes[b, :E] + planes[b, E] > 0.
//   x:      (N, H, L, E) float32 or float64
//   planes: (B, E + 1), 1 <= B <= 64, x's dtype; draw them from a seeded
//           torch::Generator (last column zero for hashing without bias).
// Returns (N, H, L) int64 codes (bit 63 included: the uint64 bit pattern).
torch::Tensor hash_queries(const torch::Tensor& x, const torch::Tensor& planes);

// Bound on the Lloyd iterations of cluster_codes (and the clustered types'
// `iterations`): the majority-vote update can cycle instead of reaching a
// fixed point, and an unbounded count then never ends.
constexpr int64_t kMaxClusterIterations = 1000;

// Clustered attention, step 2: K-means in Hamming space, per (n, h).
//   codes:   (N, H, L) int64 from hash_queries
//   lengths: (N,) integers in [0, L]: queries at l >= lengths[n] are padding,
//            never assigned (-1) and never counted
//   clusters C >= 1, clamped per batch element to its valid queries (extra
//   clusters stay empty); iterations in [0, kMaxClusterIterations] Lloyd
//   updates (fewer once nothing changes); seed: the
//   initialisation (farthest-first over distinct valid queries), same seed same result.
// Returns assignments (N, H, L) int64 in [0, C) or -1, counts (N, H, C) int64
// with C = min(clusters, max(L, 1)): no buffer is sized by a `clusters`
// beyond the sequence.
// Every cluster below min(C, valid queries) has >= 1 member (empty clusters
// are re-seeded with the farthest query; see kernels/clustering/clustering.h).
std::tuple<torch::Tensor, torch::Tensor> cluster_codes(const torch::Tensor& codes,
                                                       const std::optional<torch::Tensor>& lengths,
                                                       int64_t clusters, int64_t iterations,
                                                       int64_t seed);

// Improved clustered attention, the per-query sparse part (eq. 10): query l
// of cluster j = assignments[l] outputs
//   mass[j] · Σ_t softmax_t(softmax_temp · q_l·k_{topk[j,t]}) v_{topk[j,t]}
// over the keys before key_lengths[n]; padded queries (-1) output zeros.
//   topk: (N, H, C, K) int64 key indices in [0, S), or -1 for an empty slot
//   (a set of fewer than K keys); mass: (N, H, C) (q's dtype);
//   assignments: (N, H, L) int64 in [-1, C).
// Reads keys and values in place: O(N·H·L·K·(E + M)). Gradients flow to q, k,
// v and mass. dropout_p, dropout_seed: attention dropout as full_attention's
// (CPU): query l's weight on key j drops as full attention's (l, j) would.
torch::Tensor clustered_topk_attention(const torch::Tensor& q, const torch::Tensor& k,
                                       const torch::Tensor& v, const torch::Tensor& topk,
                                       const torch::Tensor& mass, const torch::Tensor& assignments,
                                       const std::optional<torch::Tensor>& key_lengths,
                                       double softmax_temp, double dropout_p = 0.0,
                                       std::optional<int64_t> dropout_seed = std::nullopt);

// Hard retrieval attention (Xu et al., "Learning Hard Retrieval Decoder
// Attention for Transformers"): each query (per head) retrieves one value row.
//   sample = false: index_i = argmax_j q_i·k_j over the kept keys, on the raw
//     scores (no scale, no softmax); ties go to the lowest j.
//   sample = true: index_i drawn from softmax_j(softmax_temp·q_i·k_j) over the
//     kept keys; the draws are a pure function of `seed` (same seed, same
//     indices, for any thread count).
//   out_i = v_{index_i}: a gather, not a matmul. A query that keeps no key
//   gets index -1, zeros and zero gradients.
//   attn_mask: bool keep mask (L, S), (N, L, S) or (N, H, L, S) (additive masks
//   are rejected); key_lengths (N,) and causal (j <= i + S - L) as for
//   full_attention; softmax_temp default 1/sqrt(E).
// Returns (out (N, H, L, M), index (N, H, L) int64). Gradients (straight-
// through): v gets an index-add of grad_out; q and k get the softmax gradient
// with dP_ij = grad_out_i·v_j (the gradient soft attention would get). Streams
// over key tiles: no L×S matrix in forward or backward.
std::tuple<torch::Tensor, torch::Tensor> hard_retrieval_attention(
    const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
    const std::optional<torch::Tensor>& attn_mask = std::nullopt,
    const std::optional<torch::Tensor>& key_lengths = std::nullopt, bool causal = false,
    bool sample = false, std::optional<double> softmax_temp = std::nullopt, int64_t seed = 0);

// AFT (Zhai et al. 2021, "An Attention Free Transformer"), element-wise in the
// channels: q, k, v (N,H,L|S,E), position_bias (L,S) shared by the heads or
// (H,L,S), none for AFT-simple:
//   out_t = sigmoid(q_t) ⊙ Σ_s exp(k_s + w_ts) ⊙ v_s / Σ_s exp(k_s + w_ts)
// over the keys row t sees (causal: s <= t + S - L; s < key_lengths[n]);
// zeros for a row without keys. AFT-simple on the CPU is one scan over the
// keys; with a bias, two matrix products (src/ops/aft_attention.cpp).
// Gradients to q, k, v and position_bias.
torch::Tensor aft_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                            const std::optional<torch::Tensor>& position_bias = std::nullopt,
                            const std::optional<torch::Tensor>& key_lengths = std::nullopt,
                            bool causal = false);

// Block-sparse softmax attention (local attention and the Sparse Transformer
// patterns of Child et al. 2019), fused like full_attention (online softmax,
// saved log-sum-exp, recomputation in backward). Query i sits at key position
// p = i + (S - L); keys at positions >= key_lengths[n] are ignored.
//   pattern "local",   params {window}: causal offsets j - p in [-(w-1), 0],
//                      otherwise [-floor(w/2), w - 1 - floor(w/2)].
//   pattern "strided", params {stride l, which}: A1 = {j : p - l <= j <= p}
//                      (causal) or |j - p| <= l; A2 = {j : (p - j) mod l = 0}
//                      (causal: j <= p).
//   pattern "fixed",   params {stride l, summary c, which, per_head_summary}:
//                      A1 = p's block of l (causal: j <= p); A2 = {j : j mod l
//                      in [l - c, l)} (per_head_summary: head h uses
//                      [l - c·(g+1), l - c·g), g = h mod (l / c)); causal: j <= p.
//   which: 0 merged (A1 ∪ A2), 1 only A1, 2 only A2, 3 split (heads
//   [0, ceil(H/2)) use A1, the others A2).
// A query that keeps no key outputs zeros. Gradients flow to q, k and v.
// dropout_p, dropout_seed: attention dropout as full_attention's (CPU; the
// same mask full attention draws for the kept weights).
torch::Tensor block_sparse_attention(const torch::Tensor& q, const torch::Tensor& k,
                                     const torch::Tensor& v, const std::string& pattern,
                                     const std::vector<int64_t>& params,
                                     const std::optional<torch::Tensor>& key_lengths = std::nullopt,
                                     bool causal = false,
                                     std::optional<double> softmax_temp = std::nullopt,
                                     double dropout_p = 0.0,
                                     std::optional<int64_t> dropout_seed = std::nullopt);

// Reformer (Kitaev et al. 2020), step 1: LSH buckets by random rotations.
// Bucket of x in round r = argmax over the 2·B2 values [x·R_r ; -x·R_r].
//   x:         (N, H, L, E) float32 or float64 (CUDA: float32, float16, bfloat16)
//   rotations: (R, E, B2), x's dtype; draw them from a seeded generator.
//              B2 = 0 gives one bucket (all 0).
// Returns (N, H, R, L) int64 in [0, max(1, 2·B2)). Not differentiable.
torch::Tensor lsh_hash(const torch::Tensor& x, const torch::Tensor& rotations);

// Reformer LSH attention over given buckets (shared QK). The keys are the
// queries L2-normalised, k_j = q_j / max(|q_j|, 1e-12). Per round r the valid
// positions are sorted by (buckets[r], position) and cut into chunks of
// chunk_size (the last one partial); chunk c's queries attend to the keys of
// chunks c-1 and c with scores softmax_temp·q_i·k_j (default temp
// 1/sqrt(E)). mask_self: the self score becomes -1e5 (a position attends to
// itself only when it sees nothing else). causal: keys j > i are dropped.
// The rounds are combined with weights softmax_r(lse_r(i)).
//   q (N, H, L, E), v (N, H, L, M), buckets (N, H, R, L) int64 >= 0
//   key_lengths (N,): positions >= length are padding: they join no chunk,
//   output zeros and get zero gradients.
// O(N·H·R·L·chunk·(E + M)) time, O(N·H·L·(E + M + R)) memory, never L x L.
// Gradients flow to q (both roles) and v. CUDA: float32, float16, bfloat16
// (float32 arithmetic), E and M <= 256.
// dropout_p: attention dropout (CPU), each (round, key) weight of a query
// on its own (the softmax is over those pairs); dropout_seed: the mask's
// seed (default: drawn from torch's CPU generator).
torch::Tensor reformer_attention(
    const torch::Tensor& q, const torch::Tensor& v, const torch::Tensor& buckets,
    const std::optional<torch::Tensor>& key_lengths = std::nullopt, int64_t chunk_size = 32,
    bool causal = false, bool mask_self = true, std::optional<double> softmax_temp = std::nullopt,
    double dropout_p = 0.0, std::optional<int64_t> dropout_seed = std::nullopt);

namespace reference {
// Plain-ATen hashing: (x·W^T + b > 0) packed into int64.
torch::Tensor hash_queries(const torch::Tensor& x, const torch::Tensor& planes);

// elu(x) + 1, as x + 1 for x > 0 and exp(x) otherwise (no cancellation for
// very negative x): for tests and benchmarks only.
torch::Tensor elu_feature_map(const torch::Tensor& x);

// (elu(q) + 1)(elu(k) + 1)^T masked, times v, over its row sums + eps, in
// plain ATen (O(L·S) memory): for tests and benchmarks only.
torch::Tensor elu_linear_attention(const torch::Tensor& q, const torch::Tensor& k,
                                   const torch::Tensor& v,
                                   const std::optional<torch::Tensor>& key_lengths = std::nullopt,
                                   bool causal = false, double eps = 1e-6);

// tril(q k^T) v in plain ATen (O(L²) memory): for tests and benchmarks only.
torch::Tensor causal_linear_product(const torch::Tensor& q, const torch::Tensor& k,
                                    const torch::Tensor& v);

// Plain-ATen oracle with the same contract (materialises L×S): for tests and
// benchmarks only. dropout_keep (N, H, L, S): the softmax weights are
// multiplied by it (attention_dropout_keep: dropout with a given mask).
torch::Tensor full_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             const std::optional<torch::Tensor>& attn_mask = std::nullopt,
                             const std::optional<torch::Tensor>& key_lengths = std::nullopt,
                             bool causal = false, std::optional<double> softmax_temp = std::nullopt,
                             const std::optional<torch::Tensor>& dropout_keep = std::nullopt);

// The fused kernels' attention-dropout mask for a seed, float64 (N, H, L, S):
// 1 / (1 - dropout_p) where weight (i, j) of head (n, h) is kept, 0 where
// dropped (kernels/common/dropout.h).
torch::Tensor attention_dropout_keep(int64_t seed, double dropout_p, int64_t N, int64_t H,
                                     int64_t L, int64_t S);

// Dense oracle of hard_retrieval_attention's contract (materialises L×S).
// Without `index`: the argmax indices (ties: lowest). With `index`: the given
// indices (e.g. the op's sampled ones). out = A V with A = P + (onehot - P)
// detached, so autograd through it gives the straight-through gradients.
std::tuple<torch::Tensor, torch::Tensor> hard_retrieval_attention(
    const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
    const std::optional<torch::Tensor>& attn_mask, const std::optional<torch::Tensor>& key_lengths,
    bool causal, std::optional<double> softmax_temp,
    const std::optional<torch::Tensor>& index = std::nullopt);

// Dense oracle of aft_attention (materialises N·H·L·S·E).
torch::Tensor aft_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                            const std::optional<torch::Tensor>& position_bias,
                            const std::optional<torch::Tensor>& key_lengths, bool causal);

// The block-sparse pattern as a dense (H, L, S) bool mask (true = keep), and
// the plain-ATen oracle of block_sparse_attention built on it (O(L·S) memory):
// for tests and benchmarks only.
torch::Tensor block_sparse_mask(const std::string& pattern, const std::vector<int64_t>& params,
                                bool causal, int64_t H, int64_t L, int64_t S);
torch::Tensor block_sparse_attention(
    const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
    const std::string& pattern, const std::vector<int64_t>& params,
    const std::optional<torch::Tensor>& key_lengths = std::nullopt, bool causal = false,
    std::optional<double> softmax_temp = std::nullopt,
    const std::optional<torch::Tensor>& dropout_keep = std::nullopt);

// Plain-ATen LSH hashing (matmul, cat, argmax): for tests only.
torch::Tensor lsh_hash(const torch::Tensor& x, const torch::Tensor& rotations);

// Plain-ATen Reformer oracle: materialises (N, H, R, L, L) chunk visibility
// and one softmax over scores + log(rounds in which i sees j): for tests only.
// dropout (seed, p): the kernels' mask of each round (attention_dropout_keep
// of the round's seed), applied to that round's share of each weight.
torch::Tensor reformer_attention(const torch::Tensor& q, const torch::Tensor& v,
                                 const torch::Tensor& buckets,
                                 const std::optional<torch::Tensor>& key_lengths,
                                 int64_t chunk_size, bool causal, bool mask_self,
                                 std::optional<double> softmax_temp,
                                 std::optional<std::pair<int64_t, double>> dropout = std::nullopt);
}  // namespace reference

// ClusterFormer's sort / unsort: every (n, h) slice of x takes its rows in the
// order of a per-batch index shared by the heads.
//   x: (N, H, L, E) float32 / float64; index: (N, T) int64 in [-1, L)
// Returns (N, H, T, E): out[n, h, t] = x[n, h, index[n, t]], zero rows where
// index = -1. Indices may repeat; the gradient to x is a scatter-add.
// O(N·H·T·E).
torch::Tensor gather_tokens(const torch::Tensor& x, const torch::Tensor& index);

namespace reference {
// Plain-ATen gather_tokens (torch::gather): for tests only.
torch::Tensor gather_tokens(const torch::Tensor& x, const torch::Tensor& index);
}  // namespace reference

// ---- CPU instruction set ---------------------------------------------------
// The CPU kernels are compiled for several instruction-set levels and pick the
// best one this CPU runs: "default" (portable, scalar), "avx2" (AVX2 + FMA),
// "avx512" (AVX-512 F/BW/DQ/VL), "avx512_bf16" (avx512 with bfloat16 full
// attention on AVX512-BF16 dot products; chosen by default on AMD CPUs
// only), "amx" (the same on AMX tiles). The environment variable
// FASTATTN_CPU_CAPABILITY, read at the first kernel call, or
// set_cpu_capability() choose a lower one (for tests and for reproducing
// figures). torch.ops.fastattn.cpu_capability / set_cpu_capability in Python.

// The level in use (an unknown or unsupported FASTATTN_CPU_CAPABILITY throws,
// naming the variable and the supported levels).
std::string cpu_capability();
// The levels this CPU and build support, lowest first.
std::vector<std::string> supported_cpu_capabilities();
// Uses `level` from now on, process-wide; an unknown or unsupported level
// throws, naming the supported ones.
void set_cpu_capability(const std::string& level);

// ---- CPU output cache ------------------------------------------------------
// Outputs of 4 MiB and more that fastattn's CPU operators allocate come from a
// cache of freed ones of the same size (rounded up to 2 MiB), so that a
// training or inference loop does not fault in and clear fresh pages on
// every call. The cache holds at most FASTATTN_CPU_CACHE_MB MiB of free
// buffers (read at the first such output; default 1024, 0 turns it off);
// what does not fit goes back to the system. torch.ops.fastattn.empty_cpu_cache
// / cpu_cache_bytes in Python (fastattn.empty_cpu_cache()).

// Gives every free cached buffer back to the system (buffers in use are not
// affected: they return to the cache when freed).
void empty_cpu_cache();
// Bytes of free buffers the cache holds now.
int64_t cpu_cache_bytes();

}  // namespace fastattn
