// The CUDA elu feature map kernels (src/kernels/feature_maps/
// elu_feature_map_cuda.cu) run by the emulator, against the plain reference
// (elu_feature_map_reference.h) in float64 on the same rounded inputs: every dtype, lengths around
// the block size, large and small values, NaN. Tolerances in emu_test_util.h.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "emu_test_util.h"
#include "kernels/feature_maps/elu_feature_map_reference.h"
#include "kernels/feature_maps/elu_feature_map_cuda.h"

namespace {

using namespace fastattn::cuda;
using namespace fastattn::emu_test;

template <typename T>
void check(int64_t n, uint32_t seed) {
  SCOPED_TRACE(testing::Message() << dtype_name<T>() << " n=" << n);
  std::mt19937 gen(seed);
  auto x = random_buffer<T>(n, gen, 3.0), g = random_buffer<T>(n, gen);
  const DType dt = std::is_same<T, float>::value    ? DType::kFloat32
                   : std::is_same<T, __half>::value ? DType::kFloat16
                                                    : DType::kBFloat16;
  std::vector<T> out = filled<T>(n, NAN), gout = filled<T>(n, NAN);
  EluFeatureMapCudaArgs a;
  a.x = x.dev.data();
  a.grad_out = g.dev.data();
  a.dtype = dt;
  a.n = n;
  a.out = out.data();
  elu_feature_map_forward_cuda(a, nullptr);
  a.out = gout.data();
  elu_feature_map_backward_cuda(a, nullptr);

  std::vector<double> rout(n), rg(n);
  fastattn::kernels::EluFeatureMapArgs<double> r;
  r.x = x.ref.data();
  r.grad_out = g.ref.data();
  r.n = n;
  r.out = rout.data();
  fastattn::kernels::elu_feature_map_forward_reference(r);
  r.out = rg.data();
  fastattn::kernels::elu_feature_map_backward_reference(r);
  // Elementwise: relative to each element (plus a tiny absolute floor).
  for (int64_t i = 0; i < n; ++i) {
    const double tol = rel_tol<T>() * std::fabs(rout[i]) + 1e-30;
    EXPECT_NEAR(to_float(out[i]), rout[i], tol) << "phi, element " << i << " x=" << x.ref[i];
    EXPECT_NEAR(to_float(gout[i]), rg[i], rel_tol<T>() * std::fabs(rg[i]) + 1e-30)
        << "phi', element " << i;
  }
}

TEST(CudaEmuEluFeatureMap, AllDtypes) {
  for (int64_t n : {1, 255, 257, 1000}) {
    check<float>(n, 10 + n);
    check<__half>(n, 20 + n);
    check<__nv_bfloat16>(n, 30 + n);
  }
}

TEST(CudaEmuEluFeatureMap, SpecialValues) {
  std::vector<float> x = {0.f, -0.f, 1e-30f, -80.f, 50.f, NAN, -INFINITY, INFINITY};
  std::vector<float> g(x.size(), 2.f), out(x.size()), gout(x.size());
  EluFeatureMapCudaArgs a;
  a.x = x.data();
  a.grad_out = g.data();
  a.n = static_cast<int64_t>(x.size());
  a.out = out.data();
  elu_feature_map_forward_cuda(a, nullptr);
  a.out = gout.data();
  elu_feature_map_backward_cuda(a, nullptr);
  EXPECT_EQ(out[0], 1.f);
  EXPECT_EQ(out[1], 1.f);
  EXPECT_EQ(out[2], 1.f);
  EXPECT_FLOAT_EQ(out[3], std::exp(-80.f));
  EXPECT_EQ(out[4], 51.f);
  EXPECT_TRUE(std::isnan(out[5]));
  EXPECT_EQ(out[6], 0.f);
  EXPECT_EQ(out[7], INFINITY);
  EXPECT_EQ(gout[0], 2.f);
  EXPECT_EQ(gout[4], 2.f);
  EXPECT_TRUE(std::isnan(gout[5]));
  EXPECT_EQ(gout[6], 0.f);
  EXPECT_EQ(gout[7], 2.f);
}

}  // namespace
