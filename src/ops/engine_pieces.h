// Attention types composed on the dense-attention engine (issue 62,
// library-internal): a type's key set for every query, split into disjoint
// pieces that the engine computes (src/ops/dense_attention.h), merged by
// logsumexp; the backward gives every piece the merged out and lse, so each
// piece's gradients are the whole's restricted to its keys.
//
// A piece is one engine call over some of the heads, either
//   padded: all L queries over all S keys with a window (and causal), or
//   packed: variable-length sequences, each some queries over some keys,
//           gathered by position (the same rows for every batch item, or,
//           through a sort order, rows per (n, h): sorted_chunks_on_engine),
//           with or without causal (bottom-right aligned per sequence), or
//   self:   each query its own key at a fixed score (no engine call).
// Within one piece a query appears at most once; across pieces a query's key
// sets must not overlap (the merge adds them).
//
// Prefix sequences are how a pattern becomes packed sequences: when the keys
// a run of queries sees are a prefix of one ordered key list, growing by one
// key per query (a causal sequence over the prefix of the run's last query)
// or the same for all of them (a sequence without causal), one sequence
// holds the run. Queries that see no key are left out: out 0, lse -inf.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

namespace fastattn::ops {

struct EnginePiece {
  bool causal = false;
  bool padded = false;
  int64_t window_left = -1, window_right = -1;  // padded pieces: -1 unbounded
  std::vector<int64_t> heads;                   // the heads it covers; empty: all
  std::vector<int64_t> q_rows, k_rows;          // packed: positions in [0, L) / [0, S)
  std::vector<int64_t> cu_q{0}, cu_k{0};        // packed: sequence offsets into the rows

  // A self piece: query i sees key i alone with the fixed score self_score,
  // self_count times (L == S; no engine call): Reformer's masked self.
  bool self = false;
  double self_score = 0.0;
  int64_t self_count = 1;

  bool empty() const { return !padded && !self && q_rows.empty(); }
  void add_sequence(const int64_t* queries, int64_t nq, const int64_t* keys, int64_t nk);
};

// Queries `queries` (in order) over the ordered `keys`, query i seeing
// keys[0, visible[i]): runs growing by one key per query go to `causal`
// (a piece with causal set), runs seeing the same prefix to `full`.
void add_prefix_sequences(const std::vector<int64_t>& queries, const std::vector<int64_t>& keys,
                          const std::vector<int64_t>& visible, EnginePiece& causal,
                          EnginePiece& full);

// Softmax attention of q (N, H, L, E) over the union of the pieces' key sets
// in k (N, H, S, E), v (N, H, S, M), scores scale · q·k; differentiable.
// A query no piece gives a key outputs 0.
torch::Tensor attention_over_pieces(const torch::Tensor& q, const torch::Tensor& k,
                                    const torch::Tensor& v, double scale,
                                    std::vector<EnginePiece> pieces);

// A block-sparse pattern on the engine: attention_over_pieces over
// block_sparse_pieces, planned once per pattern, shape and device.
torch::Tensor block_sparse_on_engine(const torch::Tensor& q, const torch::Tensor& k,
                                     const torch::Tensor& v, double scale,
                                     const std::string& pattern, const std::vector<int64_t>& params,
                                     bool causal);

// Attention in sorted chunks: for each order (N, H, L), slot t of (n, h)
// holding position order[n][h][t], every chunk of chunk_size slots attends
// itself and the chunk before (the last may be shorter); mask_self gives a
// query's own key the score kReformerSelfScore (L == S); the orders merged
// by logsumexp. ClusterFormer's blocks (one order), Reformer's rounds.
torch::Tensor sorted_chunks_on_engine(const torch::Tensor& q, const torch::Tensor& k,
                                      const torch::Tensor& v,
                                      const std::vector<torch::Tensor>& orders, int64_t chunk_size,
                                      bool mask_self, double scale);

// Reformer's LSH attention without causal and key lengths on the engine
// (shared QK: keys are q normalised; buckets (N, H, R, L) from lsh_hash):
// per round the positions sorted by (bucket, position), each chunk of
// chunk_size sorted slots attending itself and the chunk before; mask_self
// gives the query's own key the score kReformerSelfScore; the rounds merged
// by logsumexp, as the reformer_attention operator.
torch::Tensor reformer_on_engine(const torch::Tensor& q, const torch::Tensor& v,
                                 const torch::Tensor& buckets, int64_t chunk_size, bool mask_self,
                                 double scale);

// The block-sparse patterns ("strided", "fixed"; "local" and "window" are
// one padded piece) as pieces, for H heads, L queries and S keys
// (bottom-right aligned as the block-sparse operator).
std::vector<EnginePiece> block_sparse_pieces(const std::string& pattern,
                                             const std::vector<int64_t>& params, bool causal,
                                             int64_t H, int64_t L, int64_t S);

}  // namespace fastattn::ops
