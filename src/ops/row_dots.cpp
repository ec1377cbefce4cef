// rowsum(a ∘ b) over the last dim (see row_dots.h).
#include "ops/row_dots.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include "ops/op_util.h"

namespace fastattn::ops {

torch::Tensor row_dots(const torch::Tensor& a_in, const torch::Tensor& b_in) {
  TORCH_INTERNAL_ASSERT(a_in.dim() == 4 && a_in.sizes() == b_in.sizes() &&
                        a_in.scalar_type() == b_in.scalar_type());
  const auto type = a_in.scalar_type();
  if (!a_in.device().is_cpu() || (type != torch::kFloat && type != torch::kDouble))
    return (a_in * b_in).sum(-1);
  const auto a = rows_contiguous(a_in), b = rows_contiguous(b_in);
  const int64_t N = a.size(0), H = a.size(1), L = a.size(2), M = a.size(3);
  auto out = torch::empty({N, H, L}, a.options());
  // Rows in a's memory order: (n, l, h) when its heads lie within its rows.
  const bool heads_inside = heads_within_rows(a);
  const auto ra = row_strides(a), rb = row_strides(b);
  AT_DISPATCH_FLOATING_TYPES(type, "row_dots", [&] {
    const scalar_t* pa = a.data_ptr<scalar_t>();
    const scalar_t* pb = b.data_ptr<scalar_t>();
    scalar_t* po = out.data_ptr<scalar_t>();
    at::parallel_for(0, N * H * L, 2048, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        int64_t n, h, l;
        if (heads_inside) {
          n = i / (L * H), l = i / H % L, h = i % H;
        } else {
          n = i / (H * L), h = i / L % H, l = i % L;
        }
        const int64_t nh = n * H + h;
        const scalar_t* x = ra.row(pa, nh, H, l);
        const scalar_t* y = rb.row(pb, nh, H, l);
        scalar_t s = 0;
        for (int64_t m = 0; m < M; ++m) s += x[m] * y[m];
        po[nh * L + l] = s;
      }
    });
  });
  return out;
}

}  // namespace fastattn::ops
