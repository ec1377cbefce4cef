// Attention types: one class per type, all with the same call
//   forward(queries (N,H,L,E), keys (N,H,S,E), values (N,H,S,M), mask) -> (N,H,L,M).
// Types are torch::nn::Modules so that types with parameters or buffers
// (learned centroids, random feature matrices) save and load with the model.
// Build them by name through the registry (registry.h).
#pragma once

#include <torch/torch.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "fastattn/mask.h"

namespace fastattn {

class FeatureMap;  // fastattn/feature_maps.h

// What a type may need to know of the layer it sits in.
struct AttentionDims {
  int64_t heads = 1;
  int64_t query_dim = 64;  // E, per head
  int64_t value_dim = 64;  // M, per head
};

class AttentionBase : public torch::nn::Module {
 public:
  virtual torch::Tensor forward(const torch::Tensor& queries, const torch::Tensor& keys,
                                const torch::Tensor& values, const Mask& mask) = 0;
  // The registry name this instance was built as (e.g. "full").
  virtual std::string type_name() const = 0;
  // Auxiliary training losses of the last forward call, already weighted and
  // summed into one scalar (e.g. ClusterFormer's clustering and sorting
  // losses); an undefined tensor for types that have none. Taking them clears
  // them, so each is added to a loss once.
  virtual torch::Tensor take_auxiliary_loss() { return {}; }
  // A tensor of the last forward call whose values are all finite only if
  // its output's are (clustered attention: the centroids' values, which the
  // output rows copy; the linear types' fused kernel: its sums of |out| per
  // head), so that the registry operator's overflow check reads it instead
  // of the whole output; an undefined tensor (the default): the output is
  // checked. Taking it clears it.
  virtual torch::Tensor take_finite_witness() { return {}; }
};
using AttentionPtr = std::shared_ptr<AttentionBase>;

// The sum of take_auxiliary_loss() over every attention type in `model`
// (itself included), or an undefined tensor when none has a loss. Training
// adds it to the task loss after each forward.
torch::Tensor take_auxiliary_losses(torch::nn::Module& model);

// Checks the common shape contract (ranks, N/H/E agreement, S agreement,
// dtype and device agreement) and the mask; throws naming the argument.
void check_attention_inputs(const torch::Tensor& queries, const torch::Tensor& keys,
                            const torch::Tensor& values, const Mask& mask);
// The same, then the refusals of what the global registry declares for
// `type` (check_declared in fastattn/registry.h): what every registered type's
// forward calls with its type_name(). A name without a declaration gets the
// common checks only.
void check_attention_inputs(const std::string& type, const torch::Tensor& queries,
                            const torch::Tensor& keys, const torch::Tensor& values,
                            const Mask& mask);

// Exact softmax attention through the fused operator.
class FullAttention : public AttentionBase {
 public:
  explicit FullAttention(std::optional<double> softmax_temp = std::nullopt,
                         double attention_dropout = 0.0);
  torch::Tensor forward(const torch::Tensor& queries, const torch::Tensor& keys,
                        const torch::Tensor& values, const Mask& mask) override;
  std::string type_name() const override { return "full"; }

 private:
  std::optional<double> softmax_temp_;
  double attention_dropout_;
};

// linear (Katharopoulos et al. 2020): out_i = phi(q_i)^T (sum_j phi(k_j) v_j^T)
// / (phi(q_i)^T sum_j phi(k_j) + eps), in O(N·H·(L+S)·F·M) time and
// O((L+S)·F + F·M) memory per head; keys past key_lengths contribute nothing.
// Takes no attn_mask and no causal mask (see causal-linear). The feature map
// is a submodule named "feature_map" (fast-transformers' name).
class LinearAttention : public AttentionBase {
 public:
  explicit LinearAttention(std::shared_ptr<FeatureMap> feature_map, double eps = 1e-6);
  torch::Tensor forward(const torch::Tensor& queries, const torch::Tensor& keys,
                        const torch::Tensor& values, const Mask& mask) override;
  std::string type_name() const override { return "linear"; }
  const std::shared_ptr<FeatureMap>& feature_map() const { return feature_map_; }
  // The fused elu kernel's sums of |out| per head (N, H) (CPU, float32 / float64).
  torch::Tensor take_finite_witness() override { return std::exchange(finite_witness_, {}); }

 private:
  std::shared_ptr<FeatureMap> feature_map_;
  double eps_;
  torch::Tensor finite_witness_;
};

// causal-linear: out_i = phi(q_i)^T (sum_{j<=i} phi(k_j) v_j^T)
// / (phi(q_i)^T sum_{j<=i} phi(k_j) + eps) through the chunked operator
// causal_linear_product (never an L×F×M tensor). Needs a causal mask, S == L
// and no attn_mask; keys past key_lengths contribute nothing.
class CausalLinearAttention : public AttentionBase {
 public:
  explicit CausalLinearAttention(std::shared_ptr<FeatureMap> feature_map, double eps = 1e-6);
  torch::Tensor forward(const torch::Tensor& queries, const torch::Tensor& keys,
                        const torch::Tensor& values, const Mask& mask) override;
  std::string type_name() const override { return "causal-linear"; }
  const std::shared_ptr<FeatureMap>& feature_map() const { return feature_map_; }
  // The fused elu kernel's sums of |out| per head (N, H) (CPU, float32 / float64).
  torch::Tensor take_finite_witness() override { return std::exchange(finite_witness_, {}); }

 private:
  std::shared_ptr<FeatureMap> feature_map_;
  double eps_;
  torch::Tensor finite_witness_;
};

// conditional-full:<type>: full attention while max(L, S) <= length_limit, the inner
// type beyond it.
class ConditionalFullAttention : public AttentionBase {
 public:
  ConditionalFullAttention(AttentionPtr inner, std::shared_ptr<FullAttention> full,
                           int64_t length_limit);
  torch::Tensor forward(const torch::Tensor& queries, const torch::Tensor& keys,
                        const torch::Tensor& values, const Mask& mask) override;
  std::string type_name() const override;

 private:
  AttentionPtr inner_;
  std::shared_ptr<FullAttention> full_;
  int64_t length_limit_;
};

}  // namespace fastattn
