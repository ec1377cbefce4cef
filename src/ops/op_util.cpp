// Shared input checks of the operators (see op_util.h).
#include "ops/op_util.h"

#include <ATen/Parallel.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/TensorImpl.h>
#include <torch/library.h>

#include "fastattn/ops.h"
#include "kernels/common/scratch.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <limits>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
// Cached buffers are poisoned while free: a use after free still fails.
#define FASTATTN_POISON(p, n) ASAN_POISON_MEMORY_REGION(p, n)
#define FASTATTN_UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION(p, n)
#else
#define FASTATTN_POISON(p, n) ((void)(p), (void)(n))
#define FASTATTN_UNPOISON(p, n) ((void)(p), (void)(n))
#endif

namespace fastattn::ops {

QKVInputs qkv_inputs(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                     const c10::optional<torch::Tensor>& key_lengths) {
  auto layout = [&](const torch::Tensor& t) {
    return q.is_cuda() ? t.contiguous() : rows_contiguous(t);
  };
  QKVInputs in{layout(q), layout(k), layout(v), {}};
  if (key_lengths) in.lengths = key_lengths->to(q.device(), torch::kLong).contiguous();
  return in;
}

kernels::DType kernel_dtype(const char* op, const char* name, const torch::Tensor& t) {
  switch (t.scalar_type()) {
    case torch::kFloat:
      return kernels::DType::kFloat32;
    case torch::kHalf:
      return kernels::DType::kFloat16;
    case torch::kBFloat16:
      return kernels::DType::kBFloat16;
    default:
      TORCH_CHECK(false, op, ": ", name, " must be float32, float16 or bfloat16 on CUDA, got ",
                  t.scalar_type());
  }
}

namespace {
thread_local bool saved_inputs_checked = false;
}  // namespace

SavedInputsChecked::SavedInputsChecked() : outer_(saved_inputs_checked) {
  saved_inputs_checked = true;
}
SavedInputsChecked::~SavedInputsChecked() { saved_inputs_checked = outer_; }
bool check_values() { return !saved_inputs_checked; }

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

void check_dropout(const char* op, double dropout_p) {
  TORCH_CHECK(dropout_p >= 0 && dropout_p < 1, op, ": dropout_p must be in [0, 1), got ",
              dropout_p);
}

int64_t resolve_dropout_seed(double dropout_p, c10::optional<int64_t> dropout_seed) {
  if (dropout_p == 0) return 0;
  if (dropout_seed) return *dropout_seed;
  torch::NoGradGuard no_grad;
  return torch::randint(0, int64_t{1} << 62, {1}, torch::TensorOptions().dtype(torch::kLong))
      .item<int64_t>();
}

torch::Tensor additive_mask(const torch::Tensor& attn_mask, torch::ScalarType dtype) {
  if (attn_mask.scalar_type() == torch::kBool) {
    return torch::zeros(attn_mask.sizes(), attn_mask.options().dtype(dtype))
        .masked_fill(attn_mask.logical_not(), -std::numeric_limits<double>::infinity());
  }
  return attn_mask.to(dtype);
}

torch::Tensor rows_contiguous(const torch::Tensor& t) {
  return t.size(-1) <= 1 || t.stride(-1) == 1 ? t : contiguous(t);
}

torch::Tensor contiguous(const torch::Tensor& t) {
  return t.is_contiguous() ? t : empty_output(t.sizes(), t.options()).copy_(t);
}

kernels::RowStrides row_strides(const torch::Tensor& t) {
  return {t.stride(0), t.stride(1), t.stride(2)};
}

namespace {

constexpr int64_t kPage = 4096, kCachedMinBytes = int64_t{1} << 22;
constexpr size_t kHugePage = size_t{1} << 21;

// Fresh buffers for outputs of 4 MiB and more: first, where the kernel offers
// them (Linux, transparent huge pages in "madvise" mode, as on Debian), ask
// for 2 MiB pages over the buffer's 2 MiB-aligned interior. Large buffers
// come from mmap and go back with munmap, so every call took a page fault per
// 4 KiB of its output, which for a memory-bound kernel such as linear
// attention cost about as much as its arithmetic (measured: git show
// 5f604de:docs/benchmarks.md, "Output pages and linear chunks"). Then
// write one byte in each page, the pages split between the threads in
// contiguous ranges: a kernel that gives each thread a group of heads
// writes, in the (N, L, H, M) layout, a part of every row, and both threads
// would take their first writes' faults on the same pages and wait on each
// other. Faulting the pages in first, by address, costs no extra pass over
// the memory: the kernel would take the same faults.
void prepare_pages(char* base, int64_t bytes) {
#ifdef MADV_HUGEPAGE
  // FASTATTN_HUGE_PAGES=0 leaves the pages at 4 KiB: in a VM whose host takes
  // back free memory (free page reporting, as in Firecracker), 2 MiB pages
  // often come from memory the host must fault in again, and the first calls
  // of a process took longer than with 4 KiB pages.
  static const bool huge = [] {
    const char* e = std::getenv("FASTATTN_HUGE_PAGES");
    return !(e && std::string(e) == "0");
  }();
  const auto begin = reinterpret_cast<uintptr_t>(base);
  const uintptr_t from = (begin + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t to = (begin + static_cast<uintptr_t>(bytes)) & ~(kHugePage - 1);
  // Advice only: where it is refused (THP off), the pages stay 4 KiB.
  if (huge && to > from) madvise(reinterpret_cast<void*>(from), to - from, MADV_HUGEPAGE);
#endif
  const int64_t pages = (bytes + kPage - 1) / kPage;
  at::parallel_for(0, pages, 64, [&](int64_t first, int64_t last) {
    for (int64_t p = first; p < last; ++p) base[p * kPage] = 0;
  });
  base[bytes - 1] = 0;
}

// Freed output buffers of 4 MiB and more, kept for the next output of the
// same rounded size (up to FASTATTN_CPU_CACHE_MB MiB held, default 1024; 0
// turns the cache off). Even with huge pages, a fresh buffer costs the
// kernel's clearing of every page on first touch (measured: git show
// 5f604de:docs/benchmarks.md, "Clustering, top-k offers and the output
// cache"); a cached buffer is already in memory. Sizes are rounded up to 2 MiB. Freed
// from any thread (the deleter of the tensors' storage); never destroyed, so
// tensors freed at exit still find it.
class OutputCache {
 public:
  static OutputCache& get() {
    static auto* cache = new OutputCache();
    return *cache;
  }
  size_t limit() const { return limit_; }
  // A buffer of `bytes` (a multiple of 2 MiB), 2 MiB-aligned; fresh: not from the cache.
  void* take(size_t bytes, bool* fresh) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      const auto it = free_.find(bytes);
      if (it != free_.end()) {
        void* p = it->second;
        free_.erase(it);
        held_ -= bytes;
        FASTATTN_UNPOISON(p, bytes);
        *fresh = false;
        return p;
      }
    }
    void* p = std::aligned_alloc(kHugePage, bytes);
    if (!p) {  // the cached buffers of other sizes back to the system, then once more
      release();
      p = std::aligned_alloc(kHugePage, bytes);
    }
    TORCH_CHECK(p, "fastattn: not enough memory for a CPU output of ", bytes, " bytes");
    *fresh = true;
    return p;
  }
  void give(void* p, size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (held_ + bytes <= limit_) {
        FASTATTN_POISON(p, bytes);
        free_.emplace(bytes, p);
        held_ += bytes;
        return;
      }
    }
    std::free(p);
  }
  void release() {
    std::multimap<size_t, void*> old;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      old.swap(free_);
      held_ = 0;
    }
    for (const auto& [bytes, p] : old) {
      FASTATTN_UNPOISON(p, bytes);
      std::free(p);
    }
  }
  size_t held() {
    std::lock_guard<std::mutex> lock(mutex_);
    return held_;
  }

 private:
  OutputCache() : limit_(limit_from_env()) {}
  static size_t limit_from_env() {
    const char* e = std::getenv("FASTATTN_CPU_CACHE_MB");
    if (!e) return size_t{1024} << 20;
    char* end = nullptr;
    const long long mib = std::strtoll(e, &end, 10);
    TORCH_CHECK(*e != '\0' && *end == '\0' && mib >= 0 && mib <= (int64_t{1} << 30),
                "FASTATTN_CPU_CACHE_MB must be a whole number of MiB >= 0 (0: no cache), got '", e,
                "'");
    return static_cast<size_t>(mib) << 20;
  }
  std::mutex mutex_;
  std::multimap<size_t, void*> free_;  // rounded size -> buffer
  size_t held_ = 0;
  const size_t limit_;
};

struct CachedBuffer {
  void* data;
  size_t bytes;
};

void return_to_cache(void* context) {
  auto* b = static_cast<CachedBuffer*>(context);
  OutputCache::get().give(b->data, b->bytes);
  delete b;
}

// The CPU kernels' large scratch arrays (kernels/common/scratch.h) from the
// same cache as the outputs, by the same rule: from 4 MiB, rounded up to
// 2 MiB, fresh ones prepared; smaller ones, or with the cache off, from
// operator new as before.
bool scratch_cached(size_t bytes) {
  return static_cast<int64_t>(bytes) >= kCachedMinBytes && OutputCache::get().limit() > 0;
}
size_t rounded_bytes(size_t bytes) { return (bytes + kHugePage - 1) / kHugePage * kHugePage; }

// A cached buffer of `rounded` bytes, its pages prepared when it is fresh.
void* take_buffer(size_t rounded) {
  bool fresh = false;
  void* p = OutputCache::get().take(rounded, &fresh);
  if (fresh) prepare_pages(static_cast<char*>(p), static_cast<int64_t>(rounded));
  return p;
}

void* take_scratch_buffer(size_t bytes) {
  return scratch_cached(bytes) ? take_buffer(rounded_bytes(bytes)) : ::operator new(bytes);
}

void give_scratch_buffer(void* p, size_t bytes) {
  if (!scratch_cached(bytes)) {
    ::operator delete(p);
    return;
  }
  OutputCache::get().give(p, rounded_bytes(bytes));
}

const bool kScratchHooksInstalled = [] {
  kernels::set_scratch_hooks({&take_scratch_buffer, &give_scratch_buffer});
  return true;
}();

torch::Tensor empty_in_layout(bool heads_in_rows, int64_t N, int64_t H, int64_t rows, int64_t cols,
                              const torch::TensorOptions& options) {
  const std::vector<int64_t> sizes = heads_in_rows ? std::vector<int64_t>{N, rows, H, cols}
                                                   : std::vector<int64_t>{N, H, rows, cols};
  auto t = empty_output(sizes, options);
  return heads_in_rows ? t.transpose(1, 2) : t;
}

}  // namespace

torch::Tensor empty_output(at::IntArrayRef sizes, const torch::TensorOptions& options) {
  std::vector<int64_t> strides(sizes.size());
  int64_t stride = 1;
  for (size_t d = sizes.size(); d-- > 0;) {
    strides[d] = stride;
    stride *= std::max<int64_t>(sizes[d], 1);
  }
  return empty_output_strided(sizes, strides, options);
}

namespace {

torch::Tensor empty_output_unfilled(at::IntArrayRef sizes, at::IntArrayRef strides,
                                    const torch::TensorOptions& options) {
  int64_t numel = 1;
  for (int64_t s : sizes) numel *= s;
  const int64_t bytes =
      numel * static_cast<int64_t>(c10::elementSize(options.dtype().toScalarType()));
  if (!options.device().is_cpu() || bytes < kCachedMinBytes)
    return torch::empty_strided(sizes, strides, options);
  auto& cache = OutputCache::get();
  if (cache.limit() == 0) {
    auto t = torch::empty_strided(sizes, strides, options);
    prepare_pages(static_cast<char*>(t.data_ptr()), bytes);
    return t;
  }
  const size_t rounded = rounded_bytes(static_cast<size_t>(bytes));
  void* data = take_buffer(rounded);
  c10::DataPtr ptr(data, new CachedBuffer{data, rounded}, &return_to_cache,
                   c10::Device(c10::DeviceType::CPU));
  // Resizable: a resize_ past the buffer takes memory from the CPU allocator
  // and hands this buffer back through its deleter.
  c10::Storage storage(c10::Storage::use_byte_size_t(), static_cast<size_t>(bytes), std::move(ptr),
                       c10::GetCPUAllocator(), /*resizable=*/true);
  auto impl = c10::make_intrusive<c10::TensorImpl>(
      std::move(storage), c10::DispatchKeySet(c10::DispatchKey::CPU), options.dtype());
  impl->set_sizes_and_strides(sizes, strides);
  return torch::Tensor(std::move(impl));
}

std::atomic<bool> nan_fill_outputs{false};

torch::Tensor nan_filled(torch::Tensor t) {
  if (nan_fill_outputs.load(std::memory_order_relaxed) && t.is_floating_point())
    t.fill_(std::numeric_limits<double>::quiet_NaN());
  return t;
}

}  // namespace

bool set_nan_fill_outputs(bool on) { return nan_fill_outputs.exchange(on); }

torch::Tensor empty_output_strided(at::IntArrayRef sizes, at::IntArrayRef strides,
                                   const torch::TensorOptions& options) {
  return nan_filled(empty_output_unfilled(sizes, strides, options));
}

torch::Tensor converted(const torch::Tensor& t, torch::ScalarType dtype) {
  if (!t.device().is_cpu() || !t.is_non_overlapping_and_dense()) return t.to(dtype);
  return empty_output_strided(t.sizes(), t.strides(), t.options().dtype(dtype)).copy_(t);
}

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
  // The strides empty_in_layout gives: (N, H, rows, cols) contiguous, or
  // (N, rows, H, cols) contiguous seen as (N, H, rows, cols). Computed here
  // rather than read from an empty tensor: this runs on every call.
  const int64_t cols = std::max<int64_t>(shape[3], 1);
  const int64_t inner = cols * std::max<int64_t>(heads_in_rows ? shape[1] : shape[2], 1);
  const int64_t batch = inner * std::max<int64_t>(heads_in_rows ? shape[2] : shape[1], 1);
  const std::array<int64_t, 4> laid = heads_in_rows ? std::array<int64_t, 4>{batch, cols, inner, 1}
                                                    : std::array<int64_t, 4>{batch, inner, cols, 1};
  if (t.strides() == at::IntArrayRef(laid)) return t;
  return empty_in_layout(heads_in_rows, shape[0], shape[1], shape[2], shape[3], t.options())
      .copy_(t);
}

}  // namespace fastattn::ops

namespace fastattn {

void empty_cpu_cache() { ops::OutputCache::get().release(); }

int64_t cpu_cache_bytes() { return static_cast<int64_t>(ops::OutputCache::get().held()); }

}  // namespace fastattn

// Schemas in schemas.cpp; no tensor arguments (see cpu_capability.cpp).
TORCH_LIBRARY_IMPL(fastattn, CompositeImplicitAutograd, m) {
  m.impl("empty_cpu_cache", [] { fastattn::empty_cpu_cache(); });
  m.impl("cpu_cache_bytes", [] { return fastattn::cpu_cache_bytes(); });
}
