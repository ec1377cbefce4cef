// CUDA kernels of block-sparse softmax attention (local, Sparse Transformer
// strided / fixed patterns): block_sparse_attention_forward_cuda.cu and
// block_sparse_attention_backward_cuda.cu, their design and shared parts in
// block_sparse_attention_cuda_common.cuh.
//
// A pattern reaches the kernels as at most two *parts*, each a plan of plain
// int64 arrays made on the host by kernels::make_sparse_plans /
// flatten_sparse_plans (block_sparse_attention.h) and copied to the device:
// per head group, the part's query and key orders and per ordered query the
// kept ordered keys [a, b] minus [x, y]. Every plan pointer may be null, which
// means "dense": identity orders, every key in [0, S) (causal: j <= i + S - L),
// every key tile. The dense form with a bool keep mask is what hard retrieval
// attention's backward uses.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/common/kernel_args.h"

namespace fastattn::cuda {

// Query and key tile sizes of the kernels (the plans are made with them).
constexpr int64_t kBlockSparseCudaBq = 32;
constexpr int64_t kBlockSparseCudaBk = 32;
// Largest head dims E and M the kernels take.
constexpr int64_t kBlockSparseCudaMaxDim = 256;

// One part's plan on the device (offsets of a SparsePlanLayout applied to the
// flattened buffer). Null pointers: dense (see above).
struct BlockSparsePartCuda {
  int64_t max_sp = 0;                   // largest group_sp (host value; S when dense)
  const int64_t* head_group = nullptr;  // (H) group of head h, -1: the part skips h; null: 0
  const int64_t* head_flags = nullptr;  // (H) bit 0 first part of h, bit 1 last; null: both
  const int64_t* group_sp = nullptr;    // (G) ordered keys per group; null: S
  const int64_t* q_order = nullptr;     // (G, L) ordered query -> query; null: identity
  const int64_t* k_order = nullptr;     // (G, S) ordered key -> key; null: identity
  const int64_t* ranges = nullptr;      // (G, L, 4) a, b, x, y per ordered query; null: dense
  const int64_t* q_tile_kb = nullptr;   // (G, ceil(L/32), 2) key tiles [lo, hi]; null: all
  const int64_t* kt_ptr = nullptr;      // (G, ceil(S/32) + 1) into kt_q; null: all q tiles
  const int64_t* kt_q = nullptr;        // query tiles of each key tile
};

// The q, k, v operands and sizes are those of every kernel
// (kernels/common/kernel_args.h), T = void: contiguous of `dtype`, E, M <=
// kBlockSparseCudaMaxDim.
struct BlockSparseCudaParams : kernels::QKVParams<void> {
  // Bool keep mask or nullptr: element (n, h, i, j) at
  // keep[n·keep_sn + h·keep_sh + i·keep_sl + j] (stride 0 on broadcast dims).
  const bool* keep = nullptr;
  int64_t keep_sn = 0, keep_sh = 0, keep_sl = 0;
  bool causal = false;  // dense parts (ranges null) only: keep j <= i + S - L
  float scale = 1.f;    // softmax temperature applied to q·k
  BlockSparsePartCuda parts[2];
  int num_parts = 1;
};

struct BlockSparseForwardCudaArgs : BlockSparseCudaParams {
  void* out = nullptr;         // (N, H, L, M) dtype, written (or nullptr if out_float)
  float* out_float = nullptr;  // (N, H, L, M) float32 instead of out, or nullptr
  float* lse = nullptr;  // (N, H, L) float32: log-sum-exp of the kept scaled scores, -inf if none
  // Two parts: the running state between them, (N, H, L, M) and 2 × (N, H, L) floats.
  float* ws_acc = nullptr;
  float* ws_ml = nullptr;
};

struct BlockSparseBackwardCudaArgs : BlockSparseCudaParams {
  const void* grad_out = nullptr;  // (N, H, L, M) dtype, contiguous
  const float* lse = nullptr;      // (N, H, L) from the forward
  const float* delta = nullptr;    // (N, H, L): rowsum(grad_out ∘ out)
  // float32, zero-initialised by the caller; the kernels add into them.
  float* grad_q = nullptr;  // (N, H, L, E)
  float* grad_k = nullptr;  // (N, H, S, E)
  float* grad_v = nullptr;  // (N, H, S, M), or nullptr: dV not computed
};

void block_sparse_attention_forward_cuda(const BlockSparseForwardCudaArgs& a, cudaStream_t stream);
void block_sparse_attention_backward_cuda(const BlockSparseBackwardCudaArgs& a,
                                          cudaStream_t stream);

}  // namespace fastattn::cuda
