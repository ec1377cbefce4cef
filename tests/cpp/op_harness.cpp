// Implementation of the operator test harness (see op_harness.h).
#include "op_harness.h"

#include "ops/op_util.h"

namespace fastattn::testing {

NanFilledOutputs::NanFilledOutputs() : was_on_(ops::set_nan_fill_outputs(true)) {}
NanFilledOutputs::~NanFilledOutputs() { ops::set_nan_fill_outputs(was_on_); }

namespace {

Inputs cast_detached(const Inputs& in, torch::ScalarType dtype, bool requires_grad) {
  Inputs out;
  for (const auto& t : in) {
    auto c = t.detach().clone();
    if (c.is_floating_point()) c = c.to(dtype).requires_grad_(requires_grad);
    out.push_back(c);
  }
  return out;
}

std::vector<size_t> grad_indices(const OpCase& c, const Inputs& in) {
  if (!c.grad_inputs.empty()) return c.grad_inputs;
  std::vector<size_t> idx;
  for (size_t i = 0; i < in.size(); ++i)
    if (in[i].is_floating_point()) idx.push_back(i);
  return idx;
}

// Gradients of sum(op(x) * w) with respect to the chosen inputs.
std::vector<torch::Tensor> grads_of(const std::function<torch::Tensor(const Inputs&)>& f,
                                    const Inputs& x, const torch::Tensor& w,
                                    const std::vector<size_t>& idx) {
  auto out = f(x);
  auto loss = (out * w.to(out.scalar_type())).sum();
  std::vector<torch::Tensor> wrt;
  for (auto i : idx) wrt.push_back(x[i]);
  return torch::autograd::grad({loss}, wrt, {}, false, false, /*allow_unused=*/true);
}

}  // namespace

double max_abs_diff(const torch::Tensor& a, const torch::Tensor& b) {
  EXPECT_EQ(a.sizes(), b.sizes());
  if (a.sizes() != b.sizes()) return std::numeric_limits<double>::infinity();
  if (a.numel() == 0) return 0.0;
  auto x = a.detach().to(torch::kDouble), y = b.detach().to(torch::kDouble);
  auto nan_mismatch = (x.isnan() != y.isnan()).any().item<bool>();
  if (nan_mismatch) return std::numeric_limits<double>::infinity();
  auto both_nan = x.isnan() & y.isnan();
  auto same = (x == y) | both_nan;  // equal infinities included
  auto d = (x - y).abs().masked_fill(same, 0.0);
  return d.max().item<double>();
}

void check_forward(const OpCase& c, uint64_t seed) {
  const auto in = c.make_inputs(seed);
  const auto ref = c.reference(cast_detached(in, torch::kDouble, false));
  EXPECT_TRUE(torch::isfinite(ref).all().item<bool>()) << c.name << ": reference not finite";
  const auto out64 = c.op(cast_detached(in, torch::kDouble, false));
  EXPECT_EQ(out64.scalar_type(), torch::kDouble);
  EXPECT_LE(max_abs_diff(out64, ref), c.f64_tol) << c.name << " float64 forward";
  const auto out32 = c.op(cast_detached(in, torch::kFloat, false));
  EXPECT_EQ(out32.scalar_type(), torch::kFloat);
  EXPECT_LE(max_abs_diff(out32, ref), c.f32_tol) << c.name << " float32 forward";
}

void check_gradients_vs_reference(const OpCase& c, uint64_t seed, double tol) {
  const auto in = c.make_inputs(seed);
  auto x_op = cast_detached(in, torch::kDouble, true);
  auto x_ref = cast_detached(in, torch::kDouble, true);
  const auto idx = grad_indices(c, in);
  auto w = torch::randn(c.reference(x_ref).sizes(), torch::kDouble);
  auto g_op = grads_of(c.op, x_op, w, idx);
  auto g_ref = grads_of(c.reference, x_ref, w, idx);
  for (size_t j = 0; j < idx.size(); ++j) {
    ASSERT_TRUE(g_ref[j].defined())
        << c.name << ": reference gives no gradient for input " << idx[j];
    ASSERT_TRUE(g_op[j].defined()) << c.name << ": op gives no gradient for input " << idx[j];
    EXPECT_LE(max_abs_diff(g_op[j], g_ref[j]), tol) << c.name << " gradient of input " << idx[j];
  }
  // The float32 kernels' gradients (the production path) against the same.
  auto x32 = cast_detached(in, torch::kFloat, true);
  auto g32 = grads_of(c.op, x32, w.to(torch::kFloat), idx);
  for (size_t j = 0; j < idx.size(); ++j) {
    ASSERT_TRUE(g32[j].defined()) << c.name << ": no float32 gradient for input " << idx[j];
    EXPECT_EQ(g32[j].scalar_type(), torch::kFloat);
    const double scale = std::max(1.0, g_ref[j].abs().max().item<double>());
    EXPECT_LE(max_abs_diff(g32[j], g_ref[j]) / scale, c.f32_grad_tol)
        << c.name << " float32 gradient of input " << idx[j];
  }
}

void check_finite_differences(const OpCase& c, uint64_t seed, int directions, double tol) {
  const auto in = c.make_inputs(seed);
  auto x = cast_detached(in, torch::kDouble, true);
  const auto idx = grad_indices(c, in);
  auto w = torch::randn(c.op(x).sizes(), torch::kDouble);
  auto g = grads_of(c.op, x, w, idx);
  const double eps = 1e-6;
  for (int d = 0; d < directions; ++d) {
    auto plus = cast_detached(in, torch::kDouble, false);
    auto minus = cast_detached(in, torch::kDouble, false);
    double predicted = 0;
    for (size_t j = 0; j < idx.size(); ++j) {
      auto dir = torch::randn(in[idx[j]].sizes(), torch::kDouble);
      plus[idx[j]] = plus[idx[j]] + eps * dir;
      minus[idx[j]] = minus[idx[j]] - eps * dir;
      if (g[j].defined()) predicted += (g[j] * dir).sum().item<double>();
    }
    torch::NoGradGuard ng;
    const double fd =
        ((c.op(plus) * w).sum().item<double>() - (c.op(minus) * w).sum().item<double>()) /
        (2 * eps);
    EXPECT_NEAR(fd, predicted, tol * std::max(1.0, std::abs(fd)))
        << c.name << " finite differences, direction " << d;
  }
}

void check_row_layouts(const QkvOp& op, int64_t N, int64_t H, int64_t L, int64_t S, int64_t E,
                       int64_t M, double tol) {
  NanFilledOutputs nan_filled;
  const auto f64 = torch::kDouble;
  auto q = torch::randn({N, L, H, E}, f64).transpose(1, 2).requires_grad_();
  auto k = torch::randn({N, S, H, E + 3}, f64).narrow(3, 0, E).transpose(1, 2);
  k = k.detach().requires_grad_();
  auto v = torch::randn({N, 1, S, M}, f64).expand({N, H, S, M}).detach().requires_grad_();
  const bool interleaved = H > 1 && L > 1;  // else there is nothing to interleave
  if (interleaved) {
    EXPECT_FALSE(q.is_contiguous());
  }
  auto qc = q.detach().contiguous().requires_grad_();
  auto kc = k.detach().contiguous().requires_grad_();
  auto vc = v.detach().contiguous().requires_grad_();
  auto out = op(q, k, v), ref = op(qc, kc, vc);
  EXPECT_LE(max_abs_diff(out, ref), tol) << "forward";
  if (interleaved) {
    EXPECT_TRUE(out.transpose(1, 2).is_contiguous()) << out.strides();
  }
  EXPECT_TRUE(ref.is_contiguous()) << ref.strides();
  // The loss's gradient in the layers' layout too: grad_out read in place.
  auto w = interleaved ? torch::randn({N, L, H, M}, f64).transpose(1, 2)
                       : torch::randn({N, H, L, M}, f64);
  // An input the op does not read (Reformer's keys are its queries) has no
  // gradient in either call.
  auto g = torch::autograd::grad({(out * w).sum()}, {q, k, v}, {}, false, false, true);
  auto gc = torch::autograd::grad({(ref * w).sum()}, {qc, kc, vc}, {}, false, false, true);
  const char* names[] = {"grad q", "grad k", "grad v"};
  for (int i = 0; i < 3; ++i) {
    ASSERT_EQ(g[i].defined(), gc[i].defined()) << names[i];
    if (g[i].defined()) {
      EXPECT_LE(max_abs_diff(g[i], gc[i]), tol) << names[i];
    }
  }
  if (interleaved) {
    EXPECT_TRUE(g[0].transpose(1, 2).is_contiguous()) << g[0].strides();
  }
}

}  // namespace fastattn::testing
