// Block-sparse attention types: `local` and the Sparse Transformer factorized
// patterns `sparse-strided` and `sparse-fixed` (Child et al. 2019), all through
// the fused operator fastattn::block_sparse_attention (ops.h). Build them by
// name through the registry; see docs/sparse-attention.md.
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "fastattn/attention.h"

namespace fastattn {

// local: query i (at key position p = i + S - L) attends the keys j with
// j - p in [-(window-1), 0] under a causal mask, else in
// [-floor(window/2), window - 1 - floor(window/2)] (window keys).
class LocalAttention : public AttentionBase {
 public:
  // attention_dropout: dropout on the attention weights in training mode,
  // fused in the CPU kernels (the CUDA kernels refuse it by name so far).
  explicit LocalAttention(int64_t window, std::optional<double> softmax_temp = std::nullopt,
                          double attention_dropout = 0.0);
  torch::Tensor forward(const torch::Tensor& queries, const torch::Tensor& keys,
                        const torch::Tensor& values, const Mask& mask) override;
  std::string type_name() const override { return "local"; }

 private:
  int64_t window_;
  std::optional<double> softmax_temp_;
  double attention_dropout_;
};

// How a layer uses the two halves A1, A2 of a factorized pattern.
enum class SparseMode { Merged, Split, Interleaved };

struct SparseTransformerOptions {
  std::optional<int64_t> stride;   // l; default round(sqrt(L)), at least 1
  std::optional<int64_t> summary;  // fixed: c in [1, l]; default min(8, l)
  bool per_head_summary = false;   // fixed: head h uses its own c positions of each block
  SparseMode mode = SparseMode::Merged;
  int64_t part = 1;  // Interleaved: 1 (A1) or 2 (A2)
  std::optional<double> softmax_temp;
  double attention_dropout = 0.0;  // in training mode, fused (CPU)
};

// sparse-strided (fixed = false) and sparse-fixed (fixed = true).
class SparseTransformerAttention : public AttentionBase {
 public:
  SparseTransformerAttention(bool fixed, SparseTransformerOptions options);
  torch::Tensor forward(const torch::Tensor& queries, const torch::Tensor& keys,
                        const torch::Tensor& values, const Mask& mask) override;
  std::string type_name() const override { return fixed_ ? "sparse-fixed" : "sparse-strided"; }
  // The operator's pattern and params for a query length L.
  std::pair<std::string, std::vector<int64_t>> pattern(int64_t L) const;

 private:
  bool fixed_;
  SparseTransformerOptions options_;
};

}  // namespace fastattn
