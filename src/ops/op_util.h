// Small helpers shared by the operators' entry points (internal).
#pragma once

#include <torch/torch.h>

#include <functional>
#include <initializer_list>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>

#include "kernels/common/dropout.h"
#include "kernels/common/kernel_args.h"

namespace fastattn {

// std::optional <-> c10::optional (distinct types in LibTorch 1.13).
template <typename T>
c10::optional<T> to_c10(const std::optional<T>& x) {
  return x ? c10::optional<T>(*x) : c10::nullopt;
}
template <typename T>
std::optional<T> to_std(const c10::optional<T>& x) {
  return x ? std::optional<T>(*x) : std::nullopt;
}

namespace ops {

// Checks q (N,H,L,E), k (N,H,S,E), v (N,H,S,M): ranks, agreement of N, H, E
// and S, floating dtype (one for all three, see check_float_dtype), device;
// messages name `op`.
void check_qkv(const char* op, const torch::Tensor& q, const torch::Tensor& k,
               const torch::Tensor& v);

// Checks of tensor values (index and key-length ranges, the clusters'
// histogram) read the tensors on the host: on CUDA a synchronisation each.
// A backward through the operator shell runs on the tensors its forward
// checked (saved, and autograd refuses them if modified since), so the
// shell's backward opens a SavedInputsChecked scope and the value checks
// skip while it is open on this thread (check_values() is false). Shapes,
// dtypes and devices are checked always; a direct call of a backward
// operator checks everything.
class SavedInputsChecked {
 public:
  SavedInputsChecked();
  ~SavedInputsChecked();
  SavedInputsChecked(const SavedInputsChecked&) = delete;
  SavedInputsChecked& operator=(const SavedInputsChecked&) = delete;

 private:
  bool outer_;
};
bool check_values();

// The floating dtypes of the operators: float32, float64, float16 and
// bfloat16 on the CPU (the last two computed in float32, see in_float32);
// float32, float16 and bfloat16 on CUDA. check_float_dtype names `name`.
bool is_supported_float(const torch::Tensor& t);
void check_float_dtype(const char* op, const char* name, const torch::Tensor& t);

// The dtypes of the attention types and layers (src/attention/): float32,
// float64 and bfloat16 on the CPU (float16 is not: LibTorch 1.13's CPU
// matmul and elu, which composite types use, lack it); float32, float16 and
// bfloat16 on CUDA. The message names `who` and `name`.
void check_attention_dtype(const char* who, const char* name, const torch::Tensor& t);

// float16 or bfloat16 (either device).
bool is_reduced_float(const torch::Tensor& t);

// The dtype of the softmax statistics an operator saves for its backward
// (lse, normalisers): float32 for float16 and bfloat16 inputs, on both
// devices (a bfloat16 lse of ~10 is off by up to 0.03, and exp() turns that
// into errors of up to 3% in the recomputed probabilities); q's dtype
// otherwise.
torch::ScalarType stats_dtype(const torch::Tensor& q);

// t.to(dtype) in t's strides; on the CPU a dense t's copy has its buffer from
// empty_output_strided (bfloat16 inputs widened for the float32 kernels, and
// their results rounded back: a fresh buffer's page faults cost far more than
// the conversion itself; measured: git show 5f604de:docs/benchmarks.md,
// "bfloat16 through the float32 kernels without fresh copies").
torch::Tensor converted(const torch::Tensor& t, torch::ScalarType dtype);

namespace detail {
inline torch::Tensor widen(const torch::Tensor& t) {
  return t.defined() && is_reduced_float(t) ? converted(t, torch::kFloat) : t;
}
inline c10::optional<torch::Tensor> widen(const c10::optional<torch::Tensor>& t) {
  return t ? c10::optional<torch::Tensor>(widen(*t)) : c10::nullopt;
}
template <typename T, typename = std::enable_if_t<!std::is_same_v<std::decay_t<T>, torch::Tensor>>>
const T& widen(const T& x) {
  return x;
}
template <typename T>
T narrow(T x, torch::ScalarType, bool) {
  return x;
}
inline torch::Tensor narrow(torch::Tensor t, torch::ScalarType dtype, bool keep) {
  return keep || !t.defined() || t.scalar_type() != torch::kFloat ? t : converted(t, dtype);
}
template <size_t... Stats>
constexpr bool is_stat(size_t i) {
  return ((i == Stats) || ...);
}
template <size_t... Stats, typename... T, size_t... I>
std::tuple<T...> narrow_all(std::tuple<T...> r, torch::ScalarType dtype,
                            std::index_sequence<I...>) {
  return std::tuple<T...>(narrow(std::get<I>(std::move(r)), dtype, is_stat<Stats...>(I))...);
}
}  // namespace detail

// A CPU operator on float16 / bfloat16 inputs: `fn` (the same operator) on
// float32 copies of every float16 / bfloat16 tensor argument, its float32
// results rounded back to `dtype` except the outputs at the indices `Stats`
// (saved statistics, float32 as stats_dtype says). Integer and float64
// results pass through. Call it after the operator's own checks, so that
// messages name the caller's dtypes.
template <size_t... Stats, typename Fn, typename... Args>
auto in_float32(torch::ScalarType dtype, Fn&& fn, const Args&... args) {
  auto r = fn(detail::widen(args)...);
  if constexpr (std::is_same_v<decltype(r), torch::Tensor>) {
    return detail::narrow(std::move(r), dtype, false);
  } else {
    return detail::narrow_all<Stats...>(std::move(r), dtype,
                                        std::make_index_sequence<std::tuple_size_v<decltype(r)>>());
  }
}

// A fresh tensor for an operator's output, contiguous, contents undefined
// (torch::empty's contract). On the CPU from 4 MiB its buffer comes from
// the output cache (op_util.cpp: freed outputs kept for the next one of the
// same size, FASTATTN_CPU_CACHE_MB, fastattn::empty_cpu_cache) or, fresh,
// with huge-page advice and its pages faulted in by all threads.
torch::Tensor empty_output(at::IntArrayRef sizes, const torch::TensorOptions& options);
// empty_output with the given strides (those of a dense, non-overlapping
// tensor of `sizes`: its elements fill [0, numel)).
torch::Tensor empty_output_strided(at::IntArrayRef sizes, at::IntArrayRef strides,
                                   const torch::TensorOptions& options);
// For tests: while on, every floating-point output empty_output(_strided)
// hands out is filled with NaN first, so that a kernel that leaves part of
// an output unwritten fails its reference comparison rather than passing on
// memory that happened to hold zeros. Process-wide; off by default.
// Returns the previous setting.
bool set_nan_fill_outputs(bool on);
// t.contiguous(), a copy's buffer from empty_output.
torch::Tensor contiguous(const torch::Tensor& t);

// Row layouts (kernels/common/rows.h) for the kernels that read and write
// (N, H, rows, cols) tensors in place.
// t itself when its last dim is contiguous (any strides elsewhere), else a
// contiguous copy.
torch::Tensor rows_contiguous(const torch::Tensor& t);
// The row strides of such a tensor (N, H, rows, cols).
kernels::RowStrides row_strides(const torch::Tensor& t);
// Whether `like` (N, H, R, C) has its heads within its rows: the layout of
// the layers' (N, L, H, E) projections viewed as (N, H, L, E), in which
// like.transpose(1, 2) lists the rows in memory order. empty_rows_like's
// rule, which python/fastattn/_fake.py's _rows_like repeats.
bool heads_within_rows(const torch::Tensor& like);
// An uninitialised (N, H, rows, cols) tensor of like's dtype and device, for
// N, H of like and `rows` (default: like's): laid out (N, rows, H, cols) when
// like's heads lie within its rows (the layers' projections viewed as
// (N, H, L, E)), so that the caller's transpose back is a view; contiguous
// otherwise.
torch::Tensor empty_rows_like(const torch::Tensor& like, int64_t cols, int64_t rows = -1);
// t (N, H, rows, cols) in the layout empty_rows_like(like, cols, rows) gives:
// t itself when it has it, else a copy. The operators whose kernels write
// that layout return it whatever path computed the result (float16 widened
// to float32, CUDA), because their fake implementations promise it
// (python/fastattn/_fake.py, `_rows_like`).
torch::Tensor in_rows_layout_of(const torch::Tensor& t, const torch::Tensor& like);
// Gradients (gq, gk, gv) each in its input's layout (in_rows_layout_of): the
// paths that compute them another way (float16 / bfloat16 widened, CUDA).
inline std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> in_rows_layouts_of(
    const std::tuple<torch::Tensor, torch::Tensor, torch::Tensor>& g, const torch::Tensor& q,
    const torch::Tensor& k, const torch::Tensor& v) {
  return {in_rows_layout_of(std::get<0>(g), q), in_rows_layout_of(std::get<1>(g), k),
          in_rows_layout_of(std::get<2>(g), v)};
}
// A backward kernel's grad_out_rows, grad_q_rows, grad_k_rows, grad_v_rows.
template <typename Args>
void set_grad_rows(Args& a, const torch::Tensor& grad_out, const torch::Tensor& gq,
                   const torch::Tensor& gk, const torch::Tensor& gv) {
  a.grad_out_rows = row_strides(grad_out);
  a.grad_q_rows = row_strides(gq);
  a.grad_k_rows = row_strides(gk);
  a.grad_v_rows = row_strides(gv);
}

// ---- kernel argument structs (kernels/common/kernel_args.h) ----------------

// t's data for a kernel struct of element type T: typed on the CPU (T =
// float, double), untyped for the CUDA launchers (T = void).
template <typename T>
auto kernel_data(const torch::Tensor& t) {
  if constexpr (std::is_void_v<T>) {
    return t.data_ptr();
  } else if constexpr (std::is_same_v<T, kernels::Bf16>) {  // bfloat16's bits
    return reinterpret_cast<kernels::Bf16*>(t.data_ptr<at::BFloat16>());
  } else {
    return t.data_ptr<T>();
  }
}
// A q, k, v backward's gradient outputs in its argument struct (element
// type T as kernel_data's).
template <typename T, typename Args>
void set_qkv_grads(Args& a, const torch::Tensor& gq, const torch::Tensor& gk,
                   const torch::Tensor& gv) {
  a.grad_q = kernel_data<T>(gq);
  a.grad_k = kernel_data<T>(gk);
  a.grad_v = kernel_data<T>(gv);
}
// The CUDA kernels' element type of t: float32, float16 or bfloat16 (other
// dtypes: an error naming `op` and the argument `name`).
kernels::DType kernel_dtype(const char* op, const char* name, const torch::Tensor& t);
// fn(KernelType<T>{}) for the CPU kernels' element type T of dtype: float or
// double, or kernels::Bf16 for bfloat16 (kernels instantiated for it read and
// write bfloat16 as it is, the arithmetic in float32). Callers have checked
// the dtype (check_float_dtype).
template <typename T>
struct KernelType {
  using type = T;
};
template <typename Fn>
void dispatch_cpu_kernel_type(torch::ScalarType dtype, Fn&& fn) {
  if (dtype == torch::kBFloat16) {
    fn(KernelType<kernels::Bf16>{});
    return;
  }
  AT_DISPATCH_FLOATING_TYPES(dtype, "fastattn CPU kernel", [&] { fn(KernelType<scalar_t>{}); });
}

// q, k, v as an op's kernels read them (the CPU ones: rows contiguous, any
// other strides, so the layers' (N, L, H, E) views are read in place; the
// CUDA ones: contiguous) and key_lengths as int64 on q's device (undefined:
// none).
struct QKVInputs {
  torch::Tensor q, k, v, lengths;
};
QKVInputs qkv_inputs(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                     const c10::optional<torch::Tensor>& key_lengths);

// A kernel struct's kernels::QKVParams from its inputs: the data and sizes,
// its dtype for the CUDA launchers (T = void), the row layouts of q, k, v
// and the thread count for the CPU kernels; `op` names q's dtype in errors.
template <typename T>
void set_qkv_args(kernels::QKVParams<T>& a, const char* op, const QKVInputs& in) {
  a.q = kernel_data<T>(in.q);
  a.k = kernel_data<T>(in.k);
  a.v = kernel_data<T>(in.v);
  a.key_lengths = in.lengths.defined() ? in.lengths.data_ptr<int64_t>() : nullptr;
  a.N = in.q.size(0);
  a.H = in.q.size(1);
  a.L = in.q.size(2);
  a.E = in.q.size(3);
  a.S = in.k.size(2);
  a.M = in.v.size(3);
  if constexpr (std::is_void_v<T>) {
    a.dtype = kernel_dtype(op, "q", in.q);
  } else {
    a.q_rows = row_strides(in.q);
    a.k_rows = row_strides(in.k);
    a.v_rows = row_strides(in.v);
    a.num_threads = at::get_num_threads();
  }
}

// Checks that every tensor argument of a public entry point is defined (the
// dispatcher would otherwise fail with "tensor does not have a device");
// names[i] is the argument name of tensors[i].
void check_defined(const char* op, std::initializer_list<const char*> names,
                   std::initializer_list<std::reference_wrapper<const torch::Tensor>> tensors);

// The score scale of an op: softmax_temp when given (checked finite and > 0,
// the message naming `op`), otherwise 1/sqrt(E) for q (N, H, L, E).
double resolve_softmax_temp(const char* op, const torch::Tensor& q,
                            c10::optional<double> softmax_temp);

// Attention dropout: dropout_p must be in [0, 1) (the message naming `op`).
void check_dropout(const char* op, double dropout_p);

// The seed of a call's dropout mask: dropout_seed when given, else one drawn
// from torch's default CPU generator (torch.manual_seed makes it
// reproducible); 0 without dropout.
int64_t resolve_dropout_seed(double dropout_p, c10::optional<int64_t> dropout_seed);

// A kernel argument struct's dropout fields (kernels/common/dropout.h).
template <typename Args>
void set_dropout_args(Args& a, double dropout_p, int64_t dropout_seed) {
  a.dropout_threshold = kernels::dropout_threshold(dropout_p);
  a.dropout_seed = static_cast<uint64_t>(dropout_seed);
  a.dropout_scale = static_cast<decltype(a.dropout_scale)>(1.0 / (1.0 - dropout_p));
}

// A bool mask (true = keep) as 0 / -inf of `dtype`; a floating mask cast.
torch::Tensor additive_mask(const torch::Tensor& attn_mask, torch::ScalarType dtype);

}  // namespace ops
}  // namespace fastattn
