// The one schema block of the fastattn operator library. Every operator is
// declared here; implementations register per dispatch key beside their
// kernels (CPU, CUDA, Autograd) in src/ops/<op>.cpp.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

TORCH_LIBRARY(fastattn, m) {
  // ---- fused softmax attention ---------------------------------------------
  // q (N,H,L,E), k (N,H,S,E), v (N,H,S,M) -> (N,H,L,M).
  // dropout_p: attention dropout, fused (the weights' keep mask from a
  // counter-based generator keyed by dropout_seed, drawn from torch's
  // default generator when None; kernels/common/dropout.h), scaled by
  // 1 / (1 - dropout_p); the backward regenerates the same mask. CPU.
  m.def(
      "full_attention(Tensor q, Tensor k, Tensor v, Tensor? attn_mask=None, "
      "Tensor? key_lengths=None, bool causal=False, float? softmax_temp=None, "
      "float dropout_p=0.0, int? dropout_seed=None) -> Tensor");
  // Forward kernel: output and the row log-sum-exp (N,H,L) of the scaled
  // scores (undropped).
  m.def(
      "full_attention_forward(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, "
      "Tensor? key_lengths, bool causal, float softmax_temp, float dropout_p=0.0, "
      "int dropout_seed=0) -> (Tensor, Tensor)");
  // Backward kernel: recomputes the scores per tile from the saved lse.
  // grad_lse: the gradient with respect to lse where lse is an output too.
  m.def(
      "full_attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, "
      "Tensor lse, Tensor? attn_mask, Tensor? key_lengths, bool causal, float softmax_temp, "
      "Tensor? grad_lse=None, float dropout_p=0.0, int dropout_seed=0) "
      "-> (Tensor, Tensor, Tensor)");
  // Fused attention that also returns the row log-sum-exp (differentiable)
  // and each row's topk key indices by score (the centroid step of improved
  // clustered attention): -> (out (N,H,L,M), lse (N,H,L), top_idx (N,H,L,topk)).
  m.def(
      "full_attention_lse_topk(Tensor q, Tensor k, Tensor v, Tensor? key_lengths=None, "
      "float? softmax_temp=None, int topk=0) -> (Tensor, Tensor, Tensor)");
  m.def(
      "full_attention_lse_topk_forward(Tensor q, Tensor k, Tensor v, Tensor? key_lengths, "
      "float softmax_temp, int topk) -> (Tensor, Tensor, Tensor)");

  // ---- causal linear attention (Katharopoulos et al. 2020) -----------------
  // q, k feature-mapped (N,H,L,F), v (N,H,L,M) -> (N,H,L,M):
  // out_i = sum_{j<=i} (q_i·k_j) v_j, unnormalised; needs S == L.
  m.def("causal_linear_product(Tensor q, Tensor k, Tensor v) -> Tensor");
  // Forward kernel (chunked, carried F×M state).
  m.def("causal_linear_product_forward(Tensor q, Tensor k, Tensor v) -> Tensor");
  // Backward kernel: (grad_q, grad_k, grad_v).
  m.def(
      "causal_linear_product_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v) "
      "-> (Tensor, Tensor, Tensor)");

  // Normalised linear attention with phi = elu + 1, fused (feature map,
  // normaliser and causal masking inside the kernel): q (N,H,L,E), k (N,H,S,E),
  // v (N,H,S,M) -> (N,H,L,M); causal needs S == L.
  m.def(
      "elu_linear_attention(Tensor q, Tensor k, Tensor v, Tensor? key_lengths=None, "
      "bool causal=False, float eps=1e-6) -> Tensor");
  // Forward kernel: output, the normaliser den (N,H,L) (eps included) and the
  // key state [S | z] (N,H,E,M+1) of the non-causal CPU form (S = sum
  // phi(k_j) v_j^T, z = sum phi(k_j); den's dtype), which spares the backward
  // its recomputation; a 0-element tensor where there is none (causal, CUDA).
  m.def(
      "elu_linear_attention_forward(Tensor q, Tensor k, Tensor v, Tensor? key_lengths, "
      "bool causal, float eps) -> (Tensor, Tensor, Tensor)");
  // Backward kernel: (grad_q, grad_k, grad_v) from the saved output and den,
  // and the forward's state when given (None or 0 elements: recomputed).
  m.def(
      "elu_linear_attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, "
      "Tensor den, Tensor? key_lengths, bool causal, float eps, Tensor? state=None) "
      "-> (Tensor, Tensor, Tensor)");

  // elu(x) + 1 elementwise (linear attention's default feature map), any shape.
  m.def("elu_feature_map(Tensor x) -> Tensor");
  m.def("elu_feature_map_backward(Tensor grad_out, Tensor x) -> Tensor");

  // ---- clustered attention ---------------------------------------------------
  // Sign-of-random-projection codes: x (N,H,L,E), planes (B,E+1) with
  // 1 <= B <= 64 (last column: biases) -> (N,H,L) int64, bit b = x·w_b + bias_b > 0.
  m.def("hash_queries(Tensor x, Tensor planes) -> Tensor");
  // Hamming K-means per (n, h): codes (N,H,L) int64, lengths (N,) of valid
  // queries -> assignments (N,H,L) int64 (-1 for padding), counts (N,H,C) int64
  // with C = min(clusters, max(L, 1)).
  m.def(
      "cluster_codes(Tensor codes, Tensor? lengths, int clusters, int iterations, int seed) "
      "-> (Tensor, Tensor)");

  // Per-query attention on each cluster's top-k keys (improved clustered,
  // eq. 10): q (N,H,L,E), k (N,H,S,E), v (N,H,S,M), topk (N,H,C,K) int64,
  // mass (N,H,C), assignments (N,H,L) int64 -> (N,H,L,M).
  m.def(
      "clustered_topk_attention(Tensor q, Tensor k, Tensor v, Tensor topk, Tensor mass, "
      "Tensor assignments, Tensor? key_lengths, float softmax_temp, float dropout_p=0.0, "
      "int? dropout_seed=None) -> Tensor");
  // Backward kernel: gradients of q, k, v and mass. dropout_p, dropout_seed
  // (CPU): query l's weights drop by row l of full attention's mask.
  m.def(
      "clustered_topk_attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, "
      "Tensor topk, Tensor mass, Tensor assignments, Tensor? key_lengths, float softmax_temp, "
      "float dropout_p=0.0, int dropout_seed=0) -> (Tensor, Tensor, Tensor, Tensor)");
  // Improved clustered attention given the clusters, fused (Vyas et al.
  // eq. 9-11): centroids = mean of the members (assignments (N,H,L) in
  // [-1, C), counts (N,H,C)), one pass of the centroids over the keys
  // (full_attention_lse_topk), then per cluster its members' exact attention
  // on the topk keys scaled by the centroid's mass there, plus the centroid's
  // weights on the other keys. 1 <= topk <= S. Gradients to q (also through
  // the centroids), k and v.
  m.def(
      "improved_clustered_attention(Tensor q, Tensor k, Tensor v, Tensor assignments, "
      "Tensor counts, int topk, Tensor? key_lengths=None, float? softmax_temp=None, "
      "float dropout_p=0.0, int? dropout_seed=None) -> Tensor");
  // Forward kernel: (out, centroids, lse, centroid outputs, top_idx) for the
  // backward. dropout_p, dropout_seed (CPU): the members' top-k weights drop
  // by the query rows' mask, the centroid weights (its output, its rest) by
  // the centroid rows' (a second stream of the seed); masses stay undropped.
  m.def(
      "improved_clustered_attention_forward(Tensor q, Tensor k, Tensor v, Tensor assignments, "
      "Tensor counts, int topk, Tensor? key_lengths, float softmax_temp, float dropout_p=0.0, "
      "int dropout_seed=0) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "improved_clustered_attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, "
      "Tensor assignments, Tensor counts, Tensor centroids, Tensor lse, Tensor out_c, "
      "Tensor top_idx, Tensor? key_lengths, float softmax_temp, float dropout_p=0.0, "
      "int dropout_seed=0) -> (Tensor, Tensor, Tensor)");

  // ---- hard retrieval attention (Xu et al.) -----------------------------------
  // q (N,H,L,E), k (N,H,S,E), v (N,H,S,M) -> (out (N,H,L,M), index (N,H,L) int64):
  // each query retrieves one value row, argmax of q·k (sample=False) or a draw
  // from softmax(softmax_temp·q·k) keyed by seed (sample=True); attn_mask is a
  // bool keep mask. Straight-through gradients to q, k and v.
  m.def(
      "hard_retrieval_attention(Tensor q, Tensor k, Tensor v, Tensor? attn_mask=None, "
      "Tensor? key_lengths=None, bool causal=False, bool sample=False, "
      "float? softmax_temp=None, int seed=0) -> (Tensor, Tensor)");
  // Forward kernel: (out, index, lse, soft_out); lse (N,H,L) when sample or
  // need_lse, else empty; soft_out (N,H,L,M), the softmax output P V, when
  // need_lse on the CPU, else empty.
  m.def(
      "hard_retrieval_attention_forward(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, "
      "Tensor? key_lengths, bool causal, bool sample, float softmax_temp, int seed, "
      "bool need_lse) -> (Tensor, Tensor, Tensor, Tensor)");
  // Backward kernel (straight-through): (grad_q, grad_k, grad_v); soft_out
  // from the forward, or empty (then a pass recomputes what it gives).
  m.def(
      "hard_retrieval_attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, "
      "Tensor index, Tensor lse, Tensor soft_out, Tensor? attn_mask, Tensor? key_lengths, "
      "bool causal, float softmax_temp) -> (Tensor, Tensor, Tensor)");

  // ---- AFT (Zhai et al. 2021, "An Attention Free Transformer") ----------------
  // q, k, v (N,H,L|S,E), position_bias (L,S) or (H,L,S) or None (AFT-simple)
  // -> (N,H,L,E): sigmoid(q_t) ⊙ Σ_s exp(k_s + w_ts) v_s / Σ_s exp(k_s + w_ts),
  // channel by channel over the keys row t sees (causal: s <= t + S - L; s <
  // key_lengths[n]); zeros for a row without keys. Gradients to q, k, v and
  // position_bias.
  m.def(
      "aft_attention(Tensor q, Tensor k, Tensor v, Tensor? position_bias=None, "
      "Tensor? key_lengths=None, bool causal=False) -> Tensor");
  // Forward kernel: (out, a, lse); a = out before the gate, lse the log of the
  // denominator, both (N,H,L,E) float32 for 16-bit inputs, else q's dtype,
  // when need_stats (for the backward), else empty.
  m.def(
      "aft_attention_forward(Tensor q, Tensor k, Tensor v, Tensor? position_bias, "
      "Tensor? key_lengths, bool causal, bool need_stats) -> (Tensor, Tensor, Tensor)");
  // Backward kernel: (grad_q, grad_k, grad_v, grad_position_bias), the last
  // empty without a bias.
  m.def(
      "aft_attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, "
      "Tensor? position_bias, Tensor a, Tensor lse, Tensor? key_lengths, bool causal) "
      "-> (Tensor, Tensor, Tensor, Tensor)");

  // ---- block-sparse attention (local, Sparse Transformer, Child et al. 2019) --
  // pattern: "local" [window], "strided" [stride, which], "fixed" [stride,
  // summary, which, per_head_summary]; which: 0 merged, 1 A1, 2 A2, 3 split;
  // "window" [left, right]: keys at offsets [-left, right] from the query's
  // position (the dense-attention engine's windows, src/ops/dense_attention.h).
  m.def(
      "block_sparse_attention(Tensor q, Tensor k, Tensor v, str pattern, int[] params, "
      "Tensor? key_lengths=None, bool causal=False, float? softmax_temp=None, "
      "float dropout_p=0.0, int? dropout_seed=None) -> Tensor");
  // Forward kernel: output and the row log-sum-exp (N,H,L) of the kept scaled
  // scores (undropped). dropout_p, dropout_seed: as full_attention's (CPU).
  m.def(
      "block_sparse_attention_forward(Tensor q, Tensor k, Tensor v, str pattern, int[] params, "
      "Tensor? key_lengths, bool causal, float softmax_temp, float dropout_p=0.0, "
      "int dropout_seed=0) -> (Tensor, Tensor)");
  // Backward kernel: recomputes P per tile from the saved lse.
  m.def(
      "block_sparse_attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, "
      "Tensor out, Tensor lse, str pattern, int[] params, Tensor? key_lengths, bool causal, "
      "float softmax_temp, float dropout_p=0.0, int dropout_seed=0) "
      "-> (Tensor, Tensor, Tensor)");

  // ---- the dense-attention engine (src/ops/dense_attention.h), internal ------
  // q (N,H,L,E) or packed (Tq,H,E) with cu_seqlens_q / cu_seqlens_k (B + 1);
  // windows -1 for no bound -> (out, lse (N,H,L) or (H,Tq)). No autograd.
  m.def(
      "_dense_attention_forward(Tensor q, Tensor k, Tensor v, float scale, bool causal=False, "
      "int window_left=-1, int window_right=-1, Tensor? key_lengths=None, "
      "Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None) -> (Tensor, Tensor)");
  m.def(
      "_dense_attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, "
      "Tensor lse, float scale, bool causal=False, int window_left=-1, int window_right=-1, "
      "Tensor? key_lengths=None, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None) "
      "-> (Tensor, Tensor, Tensor)");
  // A block-sparse pattern ("strided", "fixed", "local", "window" with the
  // block_sparse_attention operator's params) composed on the engine:
  // disjoint pieces merged by logsumexp (src/ops/engine_pieces.h).
  // Differentiable; the Python tests run it on meta tensors.
  m.def(
      "_block_sparse_on_engine(Tensor q, Tensor k, Tensor v, float scale, str pattern, "
      "int[] params, bool causal=False) -> Tensor");

  // ---- Reformer LSH attention (Kitaev et al. 2020) ---------------------------
  // Buckets by argmax over [x·R_r ; -x·R_r]: x (N,H,L,E), rotations (R,E,B2)
  // -> (N,H,R,L) int64 in [0, 2·B2) (B2 = 0: one bucket, all 0).
  m.def("lsh_hash(Tensor x, Tensor rotations) -> Tensor");
  // Shared-QK attention within chunks of the (bucket, position) order of each
  // round, one chunk of look-back, rounds combined by their lse: q (N,H,L,E)
  // (also the keys, L2-normalised), v (N,H,L,M), buckets (N,H,R,L) int64
  // -> (N,H,L,M).
  m.def(
      "reformer_attention(Tensor q, Tensor v, Tensor buckets, Tensor? key_lengths=None, "
      "int chunk_size=32, bool causal=False, bool mask_self=True, float? softmax_temp=None, "
      "float dropout_p=0., int? dropout_seed=None) -> Tensor");
  // Forward kernel: output and float64 stats (N,H,L,2) = [max score, log of the
  // sum of exp(score - max)] over rounds and keys.
  m.def(
      "reformer_attention_forward(Tensor q, Tensor v, Tensor buckets, Tensor? key_lengths, "
      "int chunk_size, bool causal, bool mask_self, float softmax_temp, float dropout_p, "
      "int dropout_seed) -> (Tensor, Tensor)");
  // Backward kernel: (grad_q, grad_v), recomputing the chunk scores from the stats.
  m.def(
      "reformer_attention_backward(Tensor grad_out, Tensor q, Tensor v, Tensor buckets, "
      "Tensor out, Tensor stats, Tensor? key_lengths, int chunk_size, bool causal, bool mask_self, "
      "float softmax_temp, float dropout_p, int dropout_seed) -> (Tensor, Tensor)");

  // ---- ClusterFormer (Wang et al. 2022) ---------------------------------------
  // Token gather (sort / unsort by cluster): x (N,H,L,E), index (N,T) int64 in
  // [-1, L) -> (N,H,T,E), out[n,h,t] = x[n,h,index[n,t]], zeros where index = -1.
  m.def("gather_tokens(Tensor x, Tensor index) -> Tensor");
  // Backward kernel: scatter-add of grad_out (N,H,T,E) into (N,H,length,E).
  m.def("gather_tokens_backward(Tensor grad_out, Tensor index, int length) -> Tensor");

  // ---- registry access (Python mirrors the C++ registry through these) -----
  // Any registered attention type by name; params_json is a JSON object of the
  // type's parameters. One opaque operator with its own backward
  // (src/attention/attention_op.cpp).
  m.def(
      "attention(str type, Tensor q, Tensor k, Tensor v, bool causal=False, "
      "Tensor? key_lengths=None, Tensor? attn_mask=None, str params_json='{}', "
      "bool training=False) -> Tensor");
  // Its forward: the output and the generators' states before the type drew
  // anything (uint8: the default CPU generator's, then on CUDA the device's),
  // which the backward replays.
  m.def(
      "attention_forward(str type, Tensor q, Tensor k, Tensor v, bool causal, "
      "Tensor? key_lengths, Tensor? attn_mask, str params_json, bool training=False) "
      "-> (Tensor, Tensor)");
  // Its backward: the type's forward recomputed with autograd, differentiated
  // at grad_out -> (grad_q, grad_k, grad_v).
  m.def(
      "attention_backward(str type, Tensor grad_out, Tensor q, Tensor k, Tensor v, bool causal, "
      "Tensor? key_lengths, Tensor? attn_mask, str params_json, Tensor rng_state, "
      "bool training=False) "
      "-> (Tensor, Tensor, Tensor)");
  // One recurrent step of a type with a step form (causal-linear, full,
  // hard-retrieval): q, k (N,H,E), v (N,H,M) of the new position and the
  // state from the previous step (empty list at the start) -> (out (N,H,M),
  // the new state). The state is opaque: pass it back unchanged.
  m.def(
      "attention_step(str type, Tensor q, Tensor k, Tensor v, Tensor[] state, "
      "str params_json='{}') -> (Tensor, Tensor[])");
  // Fixed-size stepping: a zero state with room for `capacity` positions
  // (shapes as q (N,H,E), v (N,H,M)), and one step that updates it in place
  // -> out (N,H,M).
  m.def(
      "attention_step_state(str type, Tensor q, Tensor v, int capacity, "
      "str params_json='{}') -> Tensor[]");
  m.def(
      "attention_step_(str type, Tensor q, Tensor k, Tensor v, Tensor(a!)[] state, "
      "str params_json='{}') -> Tensor");
  // JSON: the tensors attention_step_state returns, for the fake kernels.
  m.def("attention_step_state_spec(str type, int E, int M, str params_json='{}') -> str");
  // JSON description of every registered type and its parameters.
  m.def("attention_types() -> str");
  // The CPU kernels' instruction set (cpu_capability.cpp).
  m.def("cpu_capability() -> str");
  m.def("supported_cpu_capabilities() -> str[]");
  m.def("set_cpu_capability(str level) -> ()");
  // The CPU output cache (op_util.cpp).
  m.def("empty_cpu_cache() -> ()");
  m.def("cpu_cache_bytes() -> int");
}

namespace {

// The Autograd kernel of the internal halves (the X_forward / X_backward
// operators the differentiable operators call): they are not differentiable,
// so they run below autograd and with grad mode off (the registry's halves
// run types whose helpers would otherwise record a graph), and their outputs
// carry no gradient history.
// Without it a direct call with inputs that require grad took the autograd
// fallback, whose outputs warn at backward and give no gradient.
void not_differentiable(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                        torch::jit::Stack* stack) {
  at::AutoDispatchBelowADInplaceOrView guard;
  at::NoGradGuard no_grad;
  op.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
}

}  // namespace

TORCH_LIBRARY_IMPL(fastattn, Autograd, m) {
  for (const char* name : {"full_attention_forward",
                           "full_attention_backward",
                           "full_attention_lse_topk_forward",
                           "causal_linear_product_forward",
                           "causal_linear_product_backward",
                           "elu_linear_attention_forward",
                           "elu_linear_attention_backward",
                           "elu_feature_map_backward",
                           "clustered_topk_attention_backward",
                           "improved_clustered_attention_forward",
                           "improved_clustered_attention_backward",
                           "hard_retrieval_attention_forward",
                           "hard_retrieval_attention_backward",
                           "aft_attention_forward",
                           "aft_attention_backward",
                           "block_sparse_attention_forward",
                           "block_sparse_attention_backward",
                           "_dense_attention_forward",
                           "_dense_attention_backward",
                           "reformer_attention_forward",
                           "reformer_attention_backward",
                           "gather_tokens_backward",
                           "attention_forward",
                           "attention_backward"})
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&not_differentiable>());
}
