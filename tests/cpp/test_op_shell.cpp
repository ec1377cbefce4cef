// The operator shell (src/ops/op_shell.h): an autograd function made from a
// declaration (typed saved state, gradients in argument order, integer
// outputs non-differentiable, saved tensors version-checked, the no-grad
// entry), and the scope in which a backward skips the value checks its
// forward made.
//   build/fastattn_tests --gtest_filter='OpShell.*'
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <optional>
#include <tuple>

#include "ops/mask_util.h"
#include "ops/op_shell.h"
#include "ops/op_util.h"

namespace fastattn {
namespace {

using torch::Tensor;
using torch::autograd::variable_list;

// y = scale * x^2 and the argmax of each row.
struct ScaledSquare {
  struct Saved {
    Tensor x;
    double scale = 0.0;
    auto tensors() { return std::tie(x); }
  };
  static std::tuple<Tensor, Tensor> forward(Saved* saved, const Tensor& x, double scale) {
    if (saved) *saved = {x, scale};
    return {x * x * scale, x.argmax(-1)};
  }
  static variable_list backward(const Saved& s, const variable_list& grads) {
    EXPECT_FALSE(ops::check_values()) << "a shell backward runs in a SavedInputsChecked scope";
    return {grads[0] * 2 * s.x * s.scale};
  }
};
using Shell = ops::Shell<ScaledSquare>;

TEST(OpShell, MakesTheAutogradFunctionFromADeclaration) {
  torch::manual_seed(0);
  auto x = torch::randn({3, 5}, torch::kDouble).requires_grad_();
  auto [y, index] = Shell::autograd(x, 1.5);
  EXPECT_TRUE(y.requires_grad());
  EXPECT_FALSE(index.requires_grad());  // integer output: non-differentiable
  EXPECT_TRUE(torch::equal(index, x.detach().argmax(-1)));
  auto g = torch::randn({3, 5}, torch::kDouble);
  y.backward(g);
  // The saved tensor and the saved scalar both reached the backward.
  EXPECT_TRUE(torch::allclose(x.grad(), 3.0 * x.detach() * g));
  // The no-grad entry: the same outputs, no graph.
  auto [y0, index0] = Shell::no_grad(x.detach(), 1.5);
  EXPECT_TRUE(torch::equal(y0, y.detach()));
  EXPECT_TRUE(torch::equal(index0, index));
  EXPECT_TRUE(ops::check_values());  // the scope closed with the backward
}

TEST(OpShell, SavedTensorsAreVersionChecked) {
  auto leaf = torch::randn({2, 4}, torch::kDouble).requires_grad_();
  auto x = leaf * 1.0;
  auto y = std::get<0>(Shell::autograd(x, 2.0));
  x.add_(1.0);  // modifies what the backward would read
  EXPECT_THROW(y.sum().backward(), c10::Error);
}

TEST(OpShell, SavedInputsCheckedSkipsValueChecksOnly) {
  const auto q = torch::randn({2, 1, 3, 4});
  const auto out_of_range = torch::tensor({1, 9});  // S = 5
  EXPECT_THROW(ops::check_masks("t", q, 5, std::nullopt, out_of_range), c10::Error);
  {
    ops::SavedInputsChecked outer;
    { ops::SavedInputsChecked inner; }
    EXPECT_FALSE(ops::check_values());  // the inner scope restored the outer one
    EXPECT_NO_THROW(ops::check_masks("t", q, 5, std::nullopt, out_of_range));
    // Shapes are checked always.
    EXPECT_THROW(ops::check_masks("t", q, 5, std::nullopt, torch::tensor({1, 2, 3})), c10::Error);
  }
  EXPECT_TRUE(ops::check_values());
  EXPECT_THROW(ops::check_masks("t", q, 5, std::nullopt, out_of_range), c10::Error);
}

}  // namespace
}  // namespace fastattn
