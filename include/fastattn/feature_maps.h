// Feature maps phi for linear attention (Katharopoulos et al. 2020): the
// similarity of a query and a key is phi(q)·phi(k). Pluggable objects, all
// with forward(x (N, H, L, E)) -> (N, H, L, F):
//
//   elu            elu(x) + 1                         F = E   (the paper's default)
//   relu           relu(x)                            F = E
//   favor          Performer FAVOR+ positive orthogonal random features,
//                  phi(x) = exp(w_i·x' - |x'|²/2) / sqrt(m), x' = sqrt(temp)·x,
//                  E[phi(q)·phi(k)] = exp(temp·q·k) (the softmax kernel)   F = m
//   rff            random Fourier features [cos(W x'), sin(W x')]·sqrt(2/m),
//                  E[phi(x)·phi(y)] = exp(-temp·|x - y|²/2) (RBF kernel)   F = m (even)
//   smoothed-rff   rff plus one constant feature sqrt(smoothing): the kernel
//                  plus `smoothing`, which keeps the attention normaliser away
//                  from 0 (plain RFF products can be negative)            F = m + 1
//   generalized    Performer's generalized random features with a chosen
//                  kernel function f (kernel_fn: relu, exp, abs, softplus,
//                  elu = elu+1): phi(x)_i = (f(w_i·x') + 1e-3) / sqrt(m),
//                  x' = sqrt(temp)·x; phi(q)·phi(k) estimates
//                  E_w[f(w·q') f(w·k')] (plus a small positive floor that
//                  keeps the normaliser away from 0)                      F = m
//
// Random maps draw their matrix (a buffer "omega", E × m or E × m/2, saved
// with the model) from their own torch::Generator seeded by `seed`, in
// float64, so the same seed gives the same features in every dtype. With
// `orthogonal` the rows of each E-block of omega are orthogonal (QR of a
// Gaussian block) and rescaled by chi-distributed norms, as in the Performer.
//
// Redraw (maybe_redraw, called by the attention types before each forward):
// redraw = 0 never redraws after construction; redraw = n redraws every n-th
// forward in training mode (1: every forward). Evaluation mode never redraws,
// so evaluation is deterministic.
//
// Numerical stabilisation of FAVOR+ (as in the Performer code): queries
// subtract the max exponent of each row (per query, over the m features);
// keys subtract the max exponent c over all kept keys and features of each
// (n, h) (map_keys returns c as the keys' offset). The query's constant
// cancels between numerator and denominator; the keys' is shared by every key
// a query sees, and linear attention scales its eps by exp(-c) too, so the
// output is that of the unstabilised keys whatever c is: the recurrent form,
// which only knows the keys so far, carries a running c and gives the same
// numbers. The maxes are taken without gradient, so gradients are those of the
// unstabilised form. forward() itself is unstabilised (the plain kernel
// estimate); forward_queries / map_keys are what attention uses. The
// generalized map with kernel_fn exp is stabilised the same way.
//
// Tested by tests/cpp/test_linear_attention.cpp.
#pragma once

#include <ATen/core/Generator.h>
#include <torch/torch.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace fastattn {

class FeatureMap : public torch::nn::Module {
 public:
  // x (N, H, L, E) -> (N, H, L, output_dim()).
  virtual torch::Tensor forward(const torch::Tensor& x) = 0;
  // The forms attention applies to queries and keys (default: forward).
  // key_keep: optional (N, L) bool, true for real (not padded) keys; maps
  // whose key form depends on other keys (favor) look at kept keys only.
  virtual torch::Tensor forward_queries(const torch::Tensor& x) { return forward(x); }
  // Key features shifted by a per-(n, h) offset: features = forward(x) ·
  // exp(-offset), offset (N, H, 1, 1) taken without gradient (the
  // exponential maps' stabilisation, see the file comment), or undefined for
  // maps without one (features = forward(x)).
  struct KeyFeatures {
    torch::Tensor features, offset;
  };
  virtual KeyFeatures map_keys(const torch::Tensor& x,
                               const std::optional<torch::Tensor>& key_keep = std::nullopt) {
    return {forward(x), torch::Tensor()};
  }
  // Whether map_keys returns an offset (favor; generalized with kernel_fn exp).
  virtual bool shifts_keys() const { return false; }
  torch::Tensor forward_keys(const torch::Tensor& x,
                             const std::optional<torch::Tensor>& key_keep = std::nullopt) {
    return map_keys(x, key_keep).features;
  }
  virtual int64_t output_dim() const = 0;
  // The registry name of the map ("elu", "favor", ...).
  virtual std::string name() const = 0;
  virtual bool is_random() const { return false; }
  // Draws a new random matrix from `generator` (no-op for deterministic maps).
  virtual void new_feature_map(at::Generator& generator) {}

  // Redraw control (see the file comment). seed seeds the map's generator;
  // random maps draw their first matrix from it at construction.
  void set_redraw(int64_t every) { redraw_every_ = every; }
  int64_t redraw_every() const { return redraw_every_; }
  // Called once per attention forward: redraws when training and due.
  void maybe_redraw(bool training);
  at::Generator& generator() { return generator_; }

 protected:
  explicit FeatureMap(uint64_t seed);

 private:
  at::Generator generator_;
  int64_t redraw_every_ = 0;
  int64_t training_calls_ = 0;
};
using FeatureMapPtr = std::shared_ptr<FeatureMap>;

// Bound on a random map's n_features: the map's matrix (E × m, a model
// buffer) and every query's and key's features are sized by it, so it is a
// model size that no input clamps.
constexpr int64_t kMaxRandomFeatures = 65536;

struct FeatureMapOptions {
  std::string kind = "elu";  // elu, relu, favor, rff, smoothed-rff, generalized
  int64_t query_dim = 64;    // E
  // Random maps: m (favor: features; rff: cos + sin features, even).
  // Default: query_dim (rounded up to even for rff). At most kMaxRandomFeatures.
  std::optional<int64_t> n_features;
  std::optional<double> softmax_temp;  // favor / rff scale; default 1/sqrt(E)
  bool orthogonal = true;              // favor / rff: orthogonal blocks
  double smoothing = 1.0;              // smoothed-rff: the constant feature squared
  std::string kernel_fn = "relu";      // generalized: f (kernel_function_names())
  uint64_t seed = 0;
  int64_t redraw = 1;  // 0: never; n: every n-th forward in training
};

// The map names make_feature_map accepts.
const std::vector<std::string>& feature_map_names();
// The kernel functions of the generalized map: relu, exp, abs, softplus, elu.
const std::vector<std::string>& kernel_function_names();
// Builds a map; an unknown kind or a bad option gives an error naming it.
FeatureMapPtr make_feature_map(const FeatureMapOptions& options);

// Draws an m × E (m rows of dimension E) Gaussian matrix, with orthogonal rows
// within each block of E rows and chi(E)-distributed row norms when
// `orthogonal`; float64 (exposed for tests).
torch::Tensor random_projection(int64_t m, int64_t E, bool orthogonal, at::Generator& generator);

}  // namespace fastattn
