// Hard retrieval attention on the CPU (Xu et al., "Learning Hard Retrieval
// Decoder Attention for Transformers"): every query (per head) retrieves
// exactly one value row.
//
//   argmax mode:  index_i = argmax_j q_i·k_j over the kept keys (raw scores:
//                 no scale, no softmax; ties go to the lowest j).
//   sample mode:  index_i ~ softmax_j(scale·q_i·k_j) over the kept keys, one
//                 draw per query from a counter-based generator keyed by
//                 (seed, n, h, i): same seed, same indices, for any number of
//                 threads.
//   out_i = v_{index_i}, or zeros and index -1 when query i keeps no key.
//
// Both modes stream over tiles of keys and never hold more than one tile of
// scores per query tile (no L×S matrix). Sampling is one pass: a weighted
// reservoir over key tiles. After tiles 1..t the current choice is
// distributed as softmax restricted to those tiles; tile t+1 (weight W_{t+1}
// = sum of its exp(s - m), rescaled with the running max m like an online
// softmax) replaces it with probability W_{t+1} / (W_1..t + W_{t+1}), and
// the replacement is drawn inside the tile by inverse CDF. Two uniforms per
// query and key tile; exact sampling from the softmax (up to rounding).
//
// The backward (straight-through, see src/ops/hard_retrieval_attention.cpp)
// needs delta_i = sum_j P_ij (dout_i·v_j) = dout_i·(P V)_i, computed here by
// recomputing P per tile from the saved log-sum-exp; the rest of the softmax
// backward is the fused full-attention backward kernel.
//
// Cost: forward 2·N·H·L·S·E flops (+ the exp of every score in sample mode
// or with lse; + 2·N·H·L·S·M with soft_out) plus an O(M) copy per query;
// delta 2·N·H·L·S·(E+M).
// Tested by tests/cpp/test_hard_retrieval.cpp; timed by bench/bench_hard_retrieval.cpp.
#pragma once

#include <cstdint>

#include "kernels/common/kernel_args.h"

namespace fastattn::kernels {

// The arguments of both backends (kernels/common/kernel_args.h): T = float or
// double for the CPU kernels below, void for the CUDA launchers
// (hard_retrieval_cuda.h), which take contiguous operands only.
template <typename T>
struct HardRetrievalParams : QKVParams<T> {
  // Boolean keep mask or nullptr: element (n, h, l, s) at
  // keep[n·keep_sn + h·keep_sh + l·keep_sl + s] (stride 0 on broadcast dims).
  const bool* keep = nullptr;
  int64_t keep_sn = 0, keep_sh = 0, keep_sl = 0;
  bool causal = false;        // query i keeps key j iff j <= i + (S - L)
  KernelScalar<T> scale = 1;  // softmax temperature (sample mode and lse)
};

template <typename T>
struct HardRetrievalForwardArgs : HardRetrievalParams<T> {
  bool sample = false;  // true: sample from the softmax; false: argmax of raw scores
  uint64_t seed = 0;    // sample mode: the draws are a pure function of (seed, n, h, i)
  T* out = nullptr;     // (N, H, L, M), rows at out_rows: the retrieved value rows
  RowStrides out_rows;
  int64_t* index = nullptr;  // (N, H, L): the retrieved key, -1 when none is kept
  // (N, H, L) or nullptr: log-sum-exp of the kept scaled scores, -inf if none
  // (what the backward needs; computed in either mode when given).
  KernelScalar<T>* lse = nullptr;
  // (N, H, L, M) contiguous or nullptr (needs lse): the softmax output P V, zeros for a
  // query that keeps no key; the backward's delta_i is dout_i·soft_out_i, with
  // no pass of its own. The tile's P·V product rides on the scores already
  // computed for the argmax or the sampler.
  T* soft_out = nullptr;  // CPU
};

template <typename T>
struct HardRetrievalDeltaArgs : HardRetrievalParams<T> {
  const T* lse = nullptr;       // (N, H, L) from the forward
  const T* grad_out = nullptr;  // (N, H, L, M), rows at grad_out_rows
  RowStrides grad_out_rows;
  T* delta = nullptr;  // (N, H, L): sum_j P_ij (grad_out_i·v_j), 0 for empty rows
};

template <typename T>
void hard_retrieval_forward_cpu(const HardRetrievalForwardArgs<T>& args);
template <typename T>
void hard_retrieval_delta_cpu(const HardRetrievalDeltaArgs<T>& args);
// grad_v (N, H, S, M), overwritten: grad_v[n, h, index[n,h,i]] += grad_out[n, h, i] for every
// i with index >= 0 (the straight-through gradient of V: an index-add).
template <typename T>
struct HardRetrievalGradVArgs {
  const T* grad_out = nullptr;     // (NH, L, M), rows at grad_out_rows
  const int64_t* index = nullptr;  // (NH, L): the retrieved key, -1 for none
  T* grad_v = nullptr;             // (NH, S, M), rows at grad_v_rows, written
  int64_t NH = 0, L = 0, S = 0, M = 0;
  int num_threads = 1;
  RowStrides grad_out_rows, grad_v_rows;  // of H heads (NH = N·H); default: contiguous
  int64_t H = 1;
};
template <typename T>
void hard_retrieval_grad_v_cpu(const HardRetrievalGradVArgs<T>& args);

// The sampler's uniform in [0, 1) for (seed, query row, key tile, draw):
// SplitMix64 mixing of the counters (the CUDA kernel's is tested against it).
inline uint64_t hard_retrieval_splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
inline double hard_retrieval_uniform(uint64_t seed, uint64_t row, uint64_t tile, uint64_t draw) {
  const auto mix = hard_retrieval_splitmix64;
  const uint64_t h = mix(mix(mix(seed) ^ row) ^ (tile * 2 + draw));
  return static_cast<double>(h >> 11) * 0x1.0p-53;
}

}  // namespace fastattn::kernels
