// delta = rowsum(grad_out ∘ out), the softmax backward's per-row term, for
// the attention backwards (full, block-sparse, Reformer). Tested through
// their gradients (tests/cpp/test_full_attention.cpp, test_sparse_attention.cpp,
// test_reformer_attention.cpp) and by RowDots.* in test_full_attention.cpp.
#pragma once

#include <torch/types.h>

namespace fastattn::ops {

// (N, H, L) contiguous: out[n, h, l] = sum_m a[n, h, l, m] · b[n, h, l, m]
// for a, b (N, H, L, M) of one shape and dtype. On the CPU (float32 /
// float64) the rows are read in place in any row layout (the layers'
// (N, L, H, M) views: in memory order), with no (N, H, L, M) product
// (ATen's (a * b).sum(-1) faulted in a fresh 32 MiB buffer at L = 16384);
// elsewhere that ATen expression.
torch::Tensor row_dots(const torch::Tensor& a, const torch::Tensor& b);

}  // namespace fastattn::ops
