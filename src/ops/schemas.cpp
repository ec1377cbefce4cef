// The one schema block of the fastattn operator library. Every operator is
// declared here; implementations register per dispatch key beside their
// kernels (CPU, CUDA, Autograd) in src/ops/<op>.cpp.
#include <torch/library.h>

TORCH_LIBRARY(fastattn, m) {
  // ---- fused softmax attention ---------------------------------------------
  // q (N,H,L,E), k (N,H,S,E), v (N,H,S,M) -> (N,H,L,M).
  m.def(
      "full_attention(Tensor q, Tensor k, Tensor v, Tensor? attn_mask=None, "
      "Tensor? key_lengths=None, bool causal=False, float? softmax_temp=None) -> Tensor");
  // Forward kernel: output and the row log-sum-exp (N,H,L) of the scaled scores.
  m.def(
      "full_attention_forward(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, "
      "Tensor? key_lengths, bool causal, float softmax_temp) -> (Tensor, Tensor)");
  // Backward kernel: recomputes the scores per tile from the saved lse.
  m.def(
      "full_attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, "
      "Tensor lse, Tensor? attn_mask, Tensor? key_lengths, bool causal, float softmax_temp) "
      "-> (Tensor, Tensor, Tensor)");

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

  // elu(x) + 1 elementwise (linear attention's default feature map), any shape.
  m.def("elu_feature_map(Tensor x) -> Tensor");
  m.def("elu_feature_map_backward(Tensor grad_out, Tensor x) -> Tensor");

  // ---- clustered attention ---------------------------------------------------
  // Sign-of-random-projection codes: x (N,H,L,E), planes (B,E+1) with
  // 1 <= B <= 64 (last column: biases) -> (N,H,L) int64, bit b = x·w_b + bias_b > 0.
  m.def("hash_queries(Tensor x, Tensor planes) -> Tensor");
  // Hamming K-means per (n, h): codes (N,H,L) int64, lengths (N,) of valid
  // queries -> assignments (N,H,L) int64 (-1 for padding), counts (N,H,C) int64.
  m.def(
      "cluster_codes(Tensor codes, Tensor? lengths, int clusters, int iterations, int seed) "
      "-> (Tensor, Tensor)");

  // Per-query attention on each cluster's top-k keys (improved clustered,
  // eq. 10): q (N,H,L,E), k (N,H,S,E), v (N,H,S,M), topk (N,H,C,K) int64,
  // mass (N,H,C), assignments (N,H,L) int64 -> (N,H,L,M).
  m.def(
      "clustered_topk_attention(Tensor q, Tensor k, Tensor v, Tensor topk, Tensor mass, "
      "Tensor assignments, Tensor? key_lengths, float softmax_temp) -> Tensor");
  // Backward kernel: gradients of q, k, v and mass.
  m.def(
      "clustered_topk_attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, "
      "Tensor topk, Tensor mass, Tensor assignments, Tensor? key_lengths, float softmax_temp) "
      "-> (Tensor, Tensor, Tensor, Tensor)");

  // ---- ClusterFormer (Wang et al. 2022) ---------------------------------------
  // Token gather (sort / unsort by cluster): x (N,H,L,E), index (N,T) int64 in
  // [-1, L) -> (N,H,T,E), out[n,h,t] = x[n,h,index[n,t]], zeros where index = -1.
  m.def("gather_tokens(Tensor x, Tensor index) -> Tensor");
  // Backward kernel: scatter-add of grad_out (N,H,T,E) into (N,H,length,E).
  m.def("gather_tokens_backward(Tensor grad_out, Tensor index, int length) -> Tensor");

  // ---- registry access (Python mirrors the C++ registry through these) -----
  // Any registered attention type by name; params_json is a JSON object of the
  // type's parameters.
  m.def(
      "attention(str type, Tensor q, Tensor k, Tensor v, bool causal=False, "
      "Tensor? key_lengths=None, Tensor? attn_mask=None, str params_json='{}') -> Tensor");
  // JSON description of every registered type and its parameters.
  m.def("attention_types() -> str");
}
