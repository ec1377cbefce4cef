// Feature maps for linear attention (see include/fastattn/feature_maps.h):
// elu, relu, FAVOR+ (positive orthogonal random features), random Fourier
// features and their smoothed form. Cost of a random map: one (L × E)·(E × m)
// product per call, O(L·m) memory. Tested by tests/cpp/test_linear_attention.cpp.
#include "fastattn/feature_maps.h"

#include "fastattn/ops.h"

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <limits>
#include <string>
#include <utility>

namespace fastattn {

using torch::Tensor;

namespace {

std::string join_names(const std::vector<std::string>& names) {
  std::string s;
  for (const auto& n : names) s += (s.empty() ? "" : ", ") + n;
  return s;
}

void check_input(const char* map, const Tensor& x, int64_t E) {
  TORCH_CHECK(x.dim() == 4, "feature map '", map, "': x must have shape (N, H, L, E), got ",
              x.sizes());
  TORCH_CHECK(E < 0 || x.size(3) == E, "feature map '", map,
              "': x must have last dimension E = ", E, " (the query_dim it was built for), got ",
              x.sizes());
  TORCH_CHECK(x.is_floating_point(), "feature map '", map, "': x must be floating, got ",
              x.scalar_type());
}

class EluFeatureMap : public FeatureMap {
 public:
  explicit EluFeatureMap(int64_t E) : FeatureMap(0), E_(E) {}
  Tensor forward(const Tensor& x) override {
    check_input("elu", x, E_);
    // The vectorised operator on the CPU; the ATen composite elsewhere (the
    // operator has no CUDA kernel yet).
    if (x.device().is_cpu() &&
        (x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kDouble))
      return elu_feature_map(x);
    return torch::elu(x) + 1;
  }
  int64_t output_dim() const override { return E_; }
  std::string name() const override { return "elu"; }

 private:
  int64_t E_;
};

class ReluFeatureMap : public FeatureMap {
 public:
  explicit ReluFeatureMap(int64_t E) : FeatureMap(0), E_(E) {}
  Tensor forward(const Tensor& x) override {
    check_input("relu", x, E_);
    return torch::relu(x);
  }
  int64_t output_dim() const override { return E_; }
  std::string name() const override { return "relu"; }

 private:
  int64_t E_;
};

// Shared by the random maps: omega (E × cols) drawn in float64.
class RandomFeatureMap : public FeatureMap {
 public:
  RandomFeatureMap(const char* name, int64_t E, int64_t cols, double temp, bool orthogonal,
                   uint64_t seed)
      : FeatureMap(seed), name_(name), E_(E), cols_(cols), temp_(temp), orthogonal_(orthogonal) {
    omega_ = register_buffer("omega", random_projection(cols_, E_, orthogonal_, generator()).t());
  }
  bool is_random() const override { return true; }
  std::string name() const override { return name_; }
  void new_feature_map(at::Generator& gen) override {
    torch::NoGradGuard no_grad;
    omega_.copy_(random_projection(cols_, E_, orthogonal_, gen).t());
  }
  const Tensor& omega() const { return omega_; }  // (E, cols)

 protected:
  // x' = sqrt(temp)·x and u = x' omega: (N, H, L, E) and (N, H, L, cols).
  std::pair<Tensor, Tensor> project(const Tensor& x) const {
    check_input(name_.c_str(), x, E_);
    auto xs = x * std::sqrt(temp_);
    return {xs, torch::matmul(xs, omega_.to(x.scalar_type()))};
  }
  std::string name_;
  int64_t E_, cols_;
  double temp_;
  bool orthogonal_;
  Tensor omega_;
};

// FAVOR+: phi(x) = exp(w_i·x' - |x'|²/2) / sqrt(m).
class FavorFeatureMap : public RandomFeatureMap {
 public:
  FavorFeatureMap(int64_t E, int64_t m, double temp, bool orthogonal, uint64_t seed)
      : RandomFeatureMap("favor", E, m, temp, orthogonal, seed) {}
  int64_t output_dim() const override { return cols_; }

  Tensor forward(const Tensor& x) override { return finish(exponent(x)); }

  Tensor forward_queries(const Tensor& x) override {
    auto e = exponent(x);
    return finish(e - std::get<0>(e.detach().max(-1, /*keepdim=*/true)));  // per row
  }

  bool shifts_keys() const override { return true; }
  KeyFeatures map_keys(const Tensor& x, const std::optional<Tensor>& key_keep) override {
    auto e = exponent(x);  // (N, H, L, m)
    if (key_keep) {
      // Padded keys: exponent -inf, so phi = 0 and exp's gradient is 0 (not
      // 0·inf = NaN when a padded key's exponent would overflow).
      const auto keep = key_keep->reshape({x.size(0), 1, x.size(2), 1});
      e = e.masked_fill(keep.logical_not(), -std::numeric_limits<double>::infinity());
    }
    auto d = e.detach();
    // Max over the kept keys and features of each (n, h); 0 when none is kept.
    auto mx = std::get<0>(d.flatten(2).max(-1, /*keepdim=*/true)).unsqueeze(-1);
    mx = mx.masked_fill(torch::isinf(mx), 0.0);
    return {finish(e - mx), mx};
  }

 private:
  Tensor exponent(const Tensor& x) const {
    auto [xs, u] = project(x);
    return u - 0.5 * xs.pow(2).sum(-1, /*keepdim=*/true);
  }
  Tensor finish(const Tensor& e) const {
    return torch::exp(e) * (1.0 / std::sqrt(static_cast<double>(cols_)));
  }
};

// Random Fourier features: [cos(u), sin(u)] · sqrt(2/m), u = x' omega, m/2 columns.
class RffFeatureMap : public RandomFeatureMap {
 public:
  RffFeatureMap(const char* name, int64_t E, int64_t m, double temp, bool orthogonal, uint64_t seed,
                std::optional<double> smoothing)
      : RandomFeatureMap(name, E, m / 2, temp, orthogonal, seed), smoothing_(smoothing) {}
  int64_t output_dim() const override { return 2 * cols_ + (smoothing_ ? 1 : 0); }

  Tensor forward(const Tensor& x) override {
    auto u = project(x).second;
    auto phi = torch::cat({torch::cos(u), torch::sin(u)}, -1) *
               std::sqrt(1.0 / static_cast<double>(cols_));
    if (!smoothing_) return phi;
    auto ones =
        torch::full({x.size(0), x.size(1), x.size(2), 1}, std::sqrt(*smoothing_), phi.options());
    return torch::cat({phi, ones}, -1);
  }

 private:
  std::optional<double> smoothing_;
};

// Generalized random features: (f(x' omega) + floor) / sqrt(m).
class GeneralizedFeatureMap : public RandomFeatureMap {
 public:
  GeneralizedFeatureMap(int64_t E, int64_t m, double temp, bool orthogonal, uint64_t seed,
                        std::string kernel_fn)
      : RandomFeatureMap("generalized", E, m, temp, orthogonal, seed),
        kernel_fn_(std::move(kernel_fn)) {}
  int64_t output_dim() const override { return cols_; }

  Tensor forward(const Tensor& x) override {
    auto u = project(x).second;
    Tensor f;
    if (kernel_fn_ == "relu") {
      f = torch::relu(u);
    } else if (kernel_fn_ == "exp") {
      f = torch::exp(u);
    } else if (kernel_fn_ == "abs") {
      f = torch::abs(u);
    } else if (kernel_fn_ == "softplus") {
      f = torch::softplus(u);
    } else {  // elu (validated in make_feature_map)
      f = torch::elu(u) + 1;
    }
    return (f + kFloor) * (1.0 / std::sqrt(static_cast<double>(cols_)));
  }

  // kernel_fn exp overflows once w·x' passes ~88 in float32 (inputs with a
  // standard deviation of ~10 at the default temperature). As for FAVOR+,
  // attention uses the features times exp(-c), c >= 0 taken without gradient:
  // per query row, and per (n, h) over the kept keys, so that it cancels in
  // the normalised attention. The floor is scaled with them.
  Tensor forward_queries(const Tensor& x) override {
    if (kernel_fn_ != "exp") return forward(x);
    auto u = project(x).second;
    return shifted_exp(u, std::get<0>(u.detach().max(-1, /*keepdim=*/true)));
  }

  bool shifts_keys() const override { return kernel_fn_ == "exp"; }
  KeyFeatures map_keys(const Tensor& x, const std::optional<Tensor>& key_keep) override {
    if (kernel_fn_ != "exp") return {forward(x), Tensor()};
    auto u = project(x).second;  // (N, H, L, m)
    if (key_keep) {
      // Padded keys: -inf, so their features and gradients are 0 (not 0·inf).
      const auto keep = key_keep->reshape({x.size(0), 1, x.size(2), 1});
      u = u.masked_fill(keep.logical_not(), -std::numeric_limits<double>::infinity());
    }
    // max(the largest exponent, 0) of each (n, h); -inf (no key kept) gives 0.
    auto c =
        std::get<0>(u.detach().flatten(2).max(-1, /*keepdim=*/true)).unsqueeze(-1).clamp_min(0.0);
    return {shifted_exp(u, c), c};
  }

 private:
  // (exp(u - c) + floor·exp(-c)) / sqrt(m) with c = max(offset, 0): every
  // term <= 1 + floor, and a floor that never grows past its own size.
  Tensor shifted_exp(const Tensor& u, const Tensor& offset) const {
    auto c = offset.clamp_min(0.0);
    return (torch::exp(u - c) + kFloor * torch::exp(-c)) *
           (1.0 / std::sqrt(static_cast<double>(cols_)));
  }

  static constexpr double kFloor = 1e-3;
  std::string kernel_fn_;
};

}  // namespace

FeatureMap::FeatureMap(uint64_t seed) : generator_(at::detail::createCPUGenerator(seed)) {}

void FeatureMap::maybe_redraw(bool training) {
  if (!training || redraw_every_ <= 0 || !is_random()) return;
  ++training_calls_;
  if (training_calls_ % redraw_every_ == 0) new_feature_map(generator_);
}

const std::vector<std::string>& feature_map_names() {
  static const std::vector<std::string> names{"elu", "relu",         "favor",
                                              "rff", "smoothed-rff", "generalized"};
  return names;
}

const std::vector<std::string>& kernel_function_names() {
  static const std::vector<std::string> names{"relu", "exp", "abs", "softplus", "elu"};
  return names;
}

torch::Tensor random_projection(int64_t m, int64_t E, bool orthogonal, at::Generator& generator) {
  TORCH_CHECK(m >= 1 && E >= 1, "random_projection: m and E must be >= 1, got m = ", m,
              ", E = ", E);
  const auto opts = torch::TensorOptions().dtype(torch::kDouble);
  if (!orthogonal) return torch::randn({m, E}, generator, opts);
  // One batched QR over ceil(m / E) Gaussian blocks; rows of each Q are orthonormal.
  const int64_t blocks = (m + E - 1) / E;
  auto [q, r] = torch::linalg_qr(torch::randn({blocks, E, E}, generator, opts));
  // Householder QR fixes the signs of R's diagonal by convention, which
  // biases Q's directions (its first column always points against e_1);
  // scaling Q's columns by sign(diag R) makes Q Haar-distributed, so every
  // row is a uniformly random direction and the feature estimates unbiased.
  q = q * torch::sign(torch::diagonal(r, 0, -2, -1)).unsqueeze(-2);
  auto rows = q.reshape({blocks * E, E}).narrow(0, 0, m);
  // Rows with the norms of Gaussian vectors: each row is then marginally
  // N(0, I) like the unstructured draw, but rows in a block stay orthogonal.
  auto norms = torch::randn({m, E}, generator, opts).norm(2, {1}, /*keepdim=*/true);
  return rows * norms;
}

FeatureMapPtr make_feature_map(const FeatureMapOptions& o) {
  const auto& names = feature_map_names();
  TORCH_CHECK(std::find(names.begin(), names.end(), o.kind) != names.end(),
              "feature_map: unknown feature map '", o.kind, "'; valid: ", join_names(names));
  TORCH_CHECK(o.query_dim >= 1, "feature_map: query_dim must be >= 1, got ", o.query_dim);
  TORCH_CHECK(o.redraw >= 0, "feature_map: redraw must be >= 0 (0: never), got ", o.redraw);
  const bool random = o.kind != "elu" && o.kind != "relu";
  TORCH_CHECK(random || !o.n_features, "n_features applies to random feature maps (favor, rff, ",
              "smoothed-rff, generalized) only, got n_features = ", o.n_features.value_or(0),
              " with feature_map '", o.kind, "'");
  FeatureMapPtr map;
  if (o.kind == "elu") {
    map = std::make_shared<EluFeatureMap>(o.query_dim);
  } else if (o.kind == "relu") {
    map = std::make_shared<ReluFeatureMap>(o.query_dim);
  } else {
    const double temp = o.softmax_temp.value_or(1.0 / std::sqrt(static_cast<double>(o.query_dim)));
    TORCH_CHECK(std::isfinite(temp) && temp > 0, "feature_map '", o.kind,
                "': softmax_temp must be a finite number > 0, got ", temp);
    int64_t m = o.n_features.value_or(o.query_dim);
    TORCH_CHECK(m >= 1 && m <= kMaxRandomFeatures, "feature_map '", o.kind,
                "': n_features must be in [1, ", kMaxRandomFeatures, "], got ", m);
    if (o.kind == "favor") {
      map = std::make_shared<FavorFeatureMap>(o.query_dim, m, temp, o.orthogonal, o.seed);
    } else if (o.kind == "generalized") {
      const auto& fns = kernel_function_names();
      TORCH_CHECK(std::find(fns.begin(), fns.end(), o.kernel_fn) != fns.end(),
                  "feature_map 'generalized': unknown kernel_fn '", o.kernel_fn,
                  "'; valid: ", join_names(fns));
      map = std::make_shared<GeneralizedFeatureMap>(o.query_dim, m, temp, o.orthogonal, o.seed,
                                                    o.kernel_fn);
    } else {
      if (!o.n_features && m % 2) ++m;
      TORCH_CHECK(m % 2 == 0, "feature_map '", o.kind,
                  "': n_features must be even (cos and sin features), got ", m);
      std::optional<double> smoothing;
      if (o.kind == "smoothed-rff") {
        TORCH_CHECK(std::isfinite(o.smoothing) && o.smoothing > 0, "feature_map '", o.kind,
                    "': smoothing must be a finite number > 0, got ", o.smoothing);
        smoothing = o.smoothing;
      }
      map = std::make_shared<RffFeatureMap>(o.kind == "rff" ? "rff" : "smoothed-rff", o.query_dim,
                                            m, temp, o.orthogonal, o.seed, smoothing);
    }
  }
  map->set_redraw(o.redraw);
  return map;
}

}  // namespace fastattn
