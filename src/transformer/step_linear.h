// A linear layer applied to the one position of a token-by-token step.
//
// With a single row, x (1, in) -> (1, out) goes through a matrix-vector
// product (BLAS gemv), which streams the weight once. ATen's linear takes a
// matrix product for it, and the BLAS packs the whole weight into panels
// first, which makes one row much slower than a gemv (git show
// 5f604de:docs/benchmarks.md, "Token-by-token generation"). More rows (a
// batch of sequences) keep the matrix product, which then pays off.
// Same values either way (up to summation order); autograd works on both.
#pragma once

#include <torch/torch.h>

namespace fastattn::detail {

inline torch::Tensor step_linear(const torch::nn::Linear& layer, const torch::Tensor& x) {
  if (x.dim() != 2 || x.size(0) != 1)
    return torch::nn::functional::linear(x, layer->weight, layer->bias);
  const auto& w = layer->weight;
  const auto& b = layer->bias;
  auto y = b.defined() ? torch::addmv(b, w, x[0]) : torch::mv(w, x[0]);
  return y.unsqueeze(0);
}

}  // namespace fastattn::detail
