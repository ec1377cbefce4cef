// Shared input checks of the operators (see op_util.h).
#include "ops/op_util.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace fastattn::ops {

void check_qkv(const char* op, const torch::Tensor& q, const torch::Tensor& k,
               const torch::Tensor& v) {
  TORCH_CHECK(q.defined() && k.defined() && v.defined(), op,
              ": q, k and v must be defined tensors");
  TORCH_CHECK(q.dim() == 4, op, ": q must have shape (N, H, L, E), got ", q.dim(), " dimensions ",
              q.sizes());
  TORCH_CHECK(k.dim() == 4, op, ": k must have shape (N, H, S, E), got ", k.dim(), " dimensions ",
              k.sizes());
  TORCH_CHECK(v.dim() == 4, op, ": v must have shape (N, H, S, M), got ", v.dim(), " dimensions ",
              v.sizes());
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(1) == q.size(1) && k.size(3) == q.size(3), op,
              ": k must agree with q (N, H, L, E) = ", q.sizes(), " in N, H and E, got ",
              k.sizes());
  TORCH_CHECK(v.size(0) == k.size(0) && v.size(1) == k.size(1) && v.size(2) == k.size(2), op,
              ": v must agree with k (N, H, S, E) = ", k.sizes(), " in N, H and S, got ",
              v.sizes());
  TORCH_CHECK(q.size(3) >= 1, op, ": q's head dimension E must be >= 1, got ", q.size(3));
  check_float_dtype(op, "q", q);
  TORCH_CHECK(k.scalar_type() == q.scalar_type(), op,
              ": k must have q's dtype (one dtype for q, k and v) ", q.scalar_type(), ", got ",
              k.scalar_type());
  TORCH_CHECK(v.scalar_type() == q.scalar_type(), op,
              ": v must have q's dtype (one dtype for q, k and v) ", q.scalar_type(), ", got ",
              v.scalar_type());
  TORCH_CHECK(k.device() == q.device(), op, ": k must be on q's device ", q.device(), ", got ",
              k.device());
  TORCH_CHECK(v.device() == q.device(), op, ": v must be on q's device ", q.device(), ", got ",
              v.device());
}

bool is_reduced_float(const torch::Tensor& t) {
  const auto d = t.scalar_type();
  return d == torch::kHalf || d == torch::kBFloat16;
}

bool is_supported_float(const torch::Tensor& t) {
  const auto d = t.scalar_type();
  return d == torch::kFloat || is_reduced_float(t) || (d == torch::kDouble && !t.is_cuda());
}

torch::ScalarType stats_dtype(const torch::Tensor& q) {
  return is_reduced_float(q) ? torch::kFloat : q.scalar_type();
}

void check_float_dtype(const char* op, const char* name, const torch::Tensor& t) {
  TORCH_CHECK(is_supported_float(t), op, ": ", name,
              t.is_cuda() ? " must be float32, float16 or bfloat16 on CUDA, got "
                          : " must be float32, float64, float16 or bfloat16 on the CPU, got ",
              t.scalar_type());
}

void check_attention_dtype(const char* who, const char* name, const torch::Tensor& t) {
  TORCH_CHECK(is_supported_float(t) && (t.is_cuda() || t.scalar_type() != torch::kHalf), who, ": ",
              name,
              t.is_cuda() ? " must be float32, float16 or bfloat16 on CUDA, got "
                          : " must be float32, float64 or bfloat16 on the CPU, got ",
              t.scalar_type());
}

void check_defined(const char* op, std::initializer_list<const char*> names,
                   std::initializer_list<std::reference_wrapper<const torch::Tensor>> tensors) {
  auto name = names.begin();
  for (const auto& t : tensors) {
    TORCH_CHECK(t.get().defined(), op, ": ", *name,
                " must be a defined tensor, got an undefined one");
    ++name;
  }
}

double resolve_softmax_temp(const char* op, const torch::Tensor& q,
                            c10::optional<double> softmax_temp) {
  if (softmax_temp) {
    TORCH_CHECK(std::isfinite(*softmax_temp) && *softmax_temp > 0, op,
                ": softmax_temp must be a finite number > 0, got ", *softmax_temp);
    return *softmax_temp;
  }
  return 1.0 / std::sqrt(static_cast<double>(q.size(3)));
}

torch::Tensor additive_mask(const torch::Tensor& attn_mask, torch::ScalarType dtype) {
  if (attn_mask.scalar_type() == torch::kBool) {
    return torch::zeros(attn_mask.sizes(), attn_mask.options().dtype(dtype))
        .masked_fill(attn_mask.logical_not(), -std::numeric_limits<double>::infinity());
  }
  return attn_mask.to(dtype);
}

torch::Tensor rows_contiguous(const torch::Tensor& t) {
  return t.size(-1) <= 1 || t.stride(-1) == 1 ? t : t.contiguous();
}

kernels::RowStrides row_strides(const torch::Tensor& t) {
  return {t.stride(0), t.stride(1), t.stride(2)};
}

namespace {

// Fresh outputs of 4 MiB and more: first, where the kernel offers them
// (Linux, transparent huge pages in "madvise" mode, as on Debian), ask for
// 2 MiB pages over the buffer's 2 MiB-aligned interior. Large buffers come
// from mmap and go back with munmap, so every call took a page fault per
// 4 KiB of its output: at L = 16384 (a 32 MiB output) those faults took
// about as long as linear attention's arithmetic (forward 27-32 ms, 17.6-18.5
// ms with the faults taken out by keeping freed memory in malloc's heap).
// Then write one byte in each page, the pages split between the threads in
// contiguous ranges: a kernel that gives each thread a group of heads
// writes, in the (N, L, H, M) layout, a part of every row, and both threads
// would take their first writes' faults on the same pages and wait on each
// other. Faulting the pages in first, by address, costs no extra pass over
// the memory: the kernel would take the same faults.
void prepare_pages(const torch::Tensor& t) {
  constexpr int64_t kPage = 4096, kMinBytes = int64_t{1} << 22;
  const int64_t bytes = t.numel() * static_cast<int64_t>(t.element_size());
  if (!t.device().is_cpu() || bytes < kMinBytes) return;
  auto* base = static_cast<char*>(t.data_ptr());
#ifdef MADV_HUGEPAGE
  // FASTATTN_HUGE_PAGES=0 leaves the pages at 4 KiB: in a VM whose host takes
  // back free memory (free page reporting, as in Firecracker), 2 MiB pages
  // often come from memory the host must fault in again, and the first calls
  // of a process took up to twice as long as with 4 KiB pages.
  static const bool huge = [] {
    const char* e = std::getenv("FASTATTN_HUGE_PAGES");
    return !(e && std::string(e) == "0");
  }();
  constexpr uintptr_t kHuge = uintptr_t{1} << 21;
  const auto begin = reinterpret_cast<uintptr_t>(base);
  const uintptr_t from = (begin + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t to = (begin + static_cast<uintptr_t>(bytes)) & ~(kHuge - 1);
  // Advice only: where it is refused (THP off), the pages stay 4 KiB.
  if (huge && to > from) madvise(reinterpret_cast<void*>(from), to - from, MADV_HUGEPAGE);
#endif
  const int64_t pages = (bytes + kPage - 1) / kPage;
  at::parallel_for(0, pages, 64, [&](int64_t first, int64_t last) {
    for (int64_t p = first; p < last; ++p) base[p * kPage] = 0;
  });
  base[bytes - 1] = 0;
}

torch::Tensor empty_in_layout(bool heads_in_rows, int64_t N, int64_t H, int64_t rows, int64_t cols,
                              const torch::TensorOptions& options) {
  if (heads_in_rows) {
    auto t = torch::empty({N, rows, H, cols}, options);
    prepare_pages(t);
    return t.transpose(1, 2);
  }
  auto t = torch::empty({N, H, rows, cols}, options);
  prepare_pages(t);
  return t;
}

}  // namespace

bool heads_within_rows(const torch::Tensor& like) {
  return like.size(1) > 1 && like.size(2) > 1 && like.stride(1) < like.stride(2);
}

torch::Tensor empty_rows_like(const torch::Tensor& like, int64_t cols, int64_t rows) {
  return empty_in_layout(heads_within_rows(like), like.size(0), like.size(1),
                         rows < 0 ? like.size(2) : rows, cols, like.options());
}

torch::Tensor in_rows_layout_of(const torch::Tensor& t, const torch::Tensor& like) {
  const bool heads_in_rows = heads_within_rows(like);
  const auto shape = t.sizes();
  const auto laid = empty_in_layout(heads_in_rows, shape[0], shape[1], shape[2], shape[3],
                                    t.options().device(torch::kMeta));
  if (laid.strides() == t.strides()) return t;
  return empty_in_layout(heads_in_rows, shape[0], shape[1], shape[2], shape[3], t.options())
      .copy_(t);
}

}  // namespace fastattn::ops
