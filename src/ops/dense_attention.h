// The dense-attention engine (issue 62, library-internal): the one place
// where attention types compute softmax attention over a set of keys.
//
//   dense_attention_forward(q, k, v, spec)                     -> (out, lse)
//   dense_attention_backward(grad_out, q, k, v, out, lse, spec) -> (dq, dk, dv)
//
// No autograd: a composition calls each piece's backward itself. A key set
// split into disjoint pieces, each computed by the engine and merged by
// merge_by_lse, has the gradients of the whole when every piece's backward is
// given the merged out and lse (its probabilities exp(s - lse) and the
// softmax backward's rowsum(grad_out ∘ out) are then the whole's). This is
// how the sparse and clustered types are composed (src/ops/engine_pieces.h).
// Routes: on CUDA, PyTorch's flash attention (float16 / bfloat16) and, for
// plain padded calls flash refuses (float32 among them), its
// memory-efficient attention (torch >= 2.4; both return the float32
// logsumexp); otherwise, and on the CPU, fastattn's block-sparse kernels
// (their "window" pattern).
//
// Layouts. Padded: q (N, H, L, E), k (N, H, S, E), v (N, H, S, M) -> out
// (N, H, L, M), lse (N, H, L). Packed variable-length sequences (spec.cu_seqlens_q
// and cu_seqlens_k, int64 (B + 1) offsets): q (Tq, H, E), k (Tk, H, E),
// v (Tk, H, M) -> out (Tq, H, M), lse (H, Tq); sequence b is rows
// [cu_q[b], cu_q[b + 1]) of q and [cu_k[b], cu_k[b + 1]) of k and v.
//
// Which keys a query sees (the semantics of flash attention): query i of a
// sequence of L queries over S keys sits at key position p = i + S - L (the
// last query lines up with the last key, "bottom-right"); it sees key j when
//   causal:                 j <= p
//   window_left  >= 0:      j >= p - window_left      (-1: no bound)
//   window_right >= 0:      j <= p + window_right     (-1: no bound)
//   key_lengths (padded):   j < key_lengths[n]        (the alignment still uses S)
// and its scores are scale · q·k. A query that sees no key gets out = 0 and
// lse = -inf. lse is float32 for float16 / bfloat16 inputs, q's dtype
// otherwise (ops::stats_dtype).
// Tested by tests/cpp/test_dense_attention.cpp against
// reference::dense_attention (float64, a dense masked softmax).
#pragma once

#include <torch/torch.h>

#include <tuple>
#include <vector>

namespace fastattn::ops {

struct DenseAttentionSpec {
  double scale = 1.0;
  bool causal = false;
  int64_t window_left = -1, window_right = -1;              // -1: unbounded
  c10::optional<torch::Tensor> key_lengths;                 // (N,) int64, padded layout only
  c10::optional<torch::Tensor> cu_seqlens_q, cu_seqlens_k;  // (B + 1,) int64: packed layout
  // Packed: bounds of the sequences' lengths when known (flash takes them
  // from the host; without them it reads the offsets there, a device sync).
  int64_t max_seqlen_q = -1, max_seqlen_k = -1;

  bool packed() const { return cu_seqlens_q.has_value(); }
};

std::tuple<torch::Tensor, torch::Tensor> dense_attention_forward(const torch::Tensor& q,
                                                                 const torch::Tensor& k,
                                                                 const torch::Tensor& v,
                                                                 const DenseAttentionSpec& spec);

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> dense_attention_backward(
    const torch::Tensor& grad_out, const torch::Tensor& q, const torch::Tensor& k,
    const torch::Tensor& v, const torch::Tensor& out, const torch::Tensor& lse,
    const DenseAttentionSpec& spec);

// Softmax attention over the union of disjoint key sets from each set's
// (out, lse): lse = log Σ_p exp(lse_p), out = Σ_p exp(lse_p - lse) out_p
// (rows no piece has keys for: out 0, lse -inf). outs of one shape, lses of
// one shape matching outs without the last dimension (either layout).
std::tuple<torch::Tensor, torch::Tensor> merge_by_lse(const std::vector<torch::Tensor>& outs,
                                                      const std::vector<torch::Tensor>& lses);

// With autograd: the engine's forward, and its backward from the saved out
// and lse. What the types call.
torch::Tensor dense_attention(const torch::Tensor& q, const torch::Tensor& k,
                              const torch::Tensor& v, const DenseAttentionSpec& spec);

// Where the attention types compute on the engine instead of their own
// kernels. Auto (the default): where the engine runs on PyTorch's fused
// kernels (CUDA, torch >= 2.4: flash for float16 / bfloat16; memory-efficient
// attention for float32 and what flash refuses, only for plain calls: spec
// without windows or key lengths, and `pieces` false, i.e. not a composition
// of windowed or packed calls); Always: everywhere (on the
// CPU the engine's block-sparse route: how the compositions are tested
// without a GPU); Never: the types' own kernels. FASTATTN_DENSE_ENGINE=auto |
// always | never sets it for the process; set_dense_engine_route changes it.
enum class DenseEngineRoute { Auto, Always, Never };
DenseEngineRoute dense_engine_route();
void set_dense_engine_route(DenseEngineRoute route);
bool types_use_dense_engine(const torch::Tensor& q, const torch::Tensor& v,
                            const DenseAttentionSpec& spec, bool pieces = false);

}  // namespace fastattn::ops

namespace fastattn::reference {

// The engine's semantics in plain ATen, computed in float64 (O(L·S) memory):
// (out, lse) in float64, either layout. Tests only.
std::tuple<torch::Tensor, torch::Tensor> dense_attention(const torch::Tensor& q,
                                                         const torch::Tensor& k,
                                                         const torch::Tensor& v,
                                                         const ops::DenseAttentionSpec& spec);

}  // namespace fastattn::reference
