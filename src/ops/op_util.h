// Small helpers shared by the operators' entry points (internal).
#pragma once

#include <torch/torch.h>

#include <functional>
#include <initializer_list>
#include <optional>

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

// The floating dtypes of the kernels: float32 and float64 on the CPU;
// float32, float16 and bfloat16 on CUDA. check_float_dtype names `name`.
bool is_supported_float(const torch::Tensor& t);
void check_float_dtype(const char* op, const char* name, const torch::Tensor& t);

// Checks that every tensor argument of a public entry point is defined (the
// dispatcher would otherwise fail with "tensor does not have a device");
// names[i] is the argument name of tensors[i].
void check_defined(const char* op, std::initializer_list<const char*> names,
                   std::initializer_list<std::reference_wrapper<const torch::Tensor>> tensors);

// The score scale of an op: softmax_temp when given (checked finite and > 0,
// the message naming `op`), otherwise 1/sqrt(E) for q (N, H, L, E).
double resolve_softmax_temp(const char* op, const torch::Tensor& q,
                            c10::optional<double> softmax_temp);

// A bool mask (true = keep) as 0 / -inf of `dtype`; a floating mask cast.
torch::Tensor additive_mask(const torch::Tensor& attn_mask, torch::ScalarType dtype);

}  // namespace ops
}  // namespace fastattn
