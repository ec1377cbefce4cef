// Reusable checks for fastattn operators. An operator case says how to make
// its inputs and how to call the op and its reference; the harness checks
//  - forward against the reference in float64 (tight) and float32 (a stated
//    tolerance), the reference always evaluated in float64;
//  - gradients against autograd through the reference (float64), and the
//    op's float32 gradients against the same (a stated tolerance);
//  - gradients by central finite differences (float64, small shapes): the
//    directional derivative along random directions must match <grad, d>.
// A new op adds a case (see test_full_attention.cpp), not a harness.
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <string>
#include <vector>

namespace fastattn::testing {

using Inputs = std::vector<torch::Tensor>;

struct OpCase {
  std::string name;
  // Differentiable inputs in float64 for a seed (the harness casts copies).
  std::function<Inputs(uint64_t seed)> make_inputs;
  std::function<torch::Tensor(const Inputs&)> op;
  std::function<torch::Tensor(const Inputs&)> reference;
  // Which inputs get gradients checked (default: all).
  std::vector<size_t> grad_inputs;
  double f64_tol = 1e-10;  // max abs error, float64
  double f32_tol = 1e-5;   // max abs error, float32: state the reason in the case
  // Gradients in float32 against the reference's in float64: max abs error
  // over max(1, the largest reference gradient).
  double f32_grad_tol = 1e-4;
};

// Max |a - b|, treating matching NaN/inf as equal and reporting them otherwise.
double max_abs_diff(const torch::Tensor& a, const torch::Tensor& b);

void check_forward(const OpCase& c, uint64_t seed = 0);
void check_gradients_vs_reference(const OpCase& c, uint64_t seed = 0, double tol = 1e-9);
void check_finite_differences(const OpCase& c, uint64_t seed = 0, int directions = 3,
                              double tol = 1e-6);

// An op of (q, k, v) for check_row_layouts.
using QkvOp =
    std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&)>;

// For ops whose kernels read row layouts in place (kernels/common/rows.h):
// op on float64 inputs q (N, H, L, E), k (N, H, S, E), v (N, H, S, M) laid
// out as the layers lay them out and worse (q an (N, L, H, E) buffer viewed
// as (N, H, L, E); k the same with padded rows; v broadcast over the heads,
// stride 0) against the op on contiguous copies: outputs and the gradients of
// a random linear loss (whose gradient, grad_out, is in the (N, L, H, M)
// order too) within tol, the output and q's gradient in q's (N, L, H, ·)
// memory order, the contiguous call's output contiguous.
void check_row_layouts(const QkvOp& op, int64_t N, int64_t H, int64_t L, int64_t S, int64_t E,
                       int64_t M, double tol = 1e-12);

// While in scope, every output the operators allocate is filled with NaN
// first (ops::set_nan_fill_outputs): a kernel that leaves part of an output
// or gradient unwritten fails the comparisons instead of passing on memory
// that happened to hold zeros. Scopes nest: leaving one restores the
// setting it found.
class NanFilledOutputs {
 public:
  NanFilledOutputs();
  ~NanFilledOutputs();
  NanFilledOutputs(const NanFilledOutputs&) = delete;
  NanFilledOutputs& operator=(const NanFilledOutputs&) = delete;

 private:
  bool was_on_;
};

// Runs all three, on NaN-filled outputs.
inline void check_op(const OpCase& c, uint64_t seed = 0) {
  SCOPED_TRACE(c.name);
  NanFilledOutputs nan_filled;
  check_forward(c, seed);
  check_gradients_vs_reference(c, seed);
  check_finite_differences(c, seed);
}

}  // namespace fastattn::testing
