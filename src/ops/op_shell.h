// The operator shell (internal): the autograd function, the no-grad entry
// and the dispatcher lookups of a differentiable operator, made from one
// declaration. An operator declares
//
//   struct AftOp {
//     struct Saved {                      // what its backward needs
//       Tensor q, k, v, a, lse;           // tensors: saved by the shell
//       bool causal = false;              // anything else: kept as is
//       auto tensors() { return std::tie(q, k, v, a, lse); }
//     };
//     // The forward: `saved` is null when no gradient is wanted (the no-grad
//     // entry), else the state to fill. Returns the operator's result.
//     // It calls the internal halves through the dispatcher by name:
//     //   call_op<kForwardOp, aft_attention_forward_cpu_op>(...)
//     static Tensor forward(Saved* saved, const Tensor& q, ...);
//     // Gradients of the differentiable inputs, in argument order (a list
//     // or a tuple of tensors; the shell pads the rest with undefined ones).
//     static variable_list backward(const Saved& saved, const variable_list& grads);
//   };
//
// and registers itself with its CPU halves in one line,
//
//   TORCH_LIBRARY_FRAGMENT(fastattn, m) {
//     ops::impl_shell<AftOp>(m, "aft_attention", aft_attention_forward_cpu_op,
//                            aft_attention_backward_cpu_op);
//   }
//
// (Shell<AftOp>::no_grad under CPU and CUDA, Shell<AftOp>::autograd under
// Autograd); a CUDA build adds its CUDA halves with impl_halves. The shell
// saves Saved's tensors with save_for_backward (version checks; no reference
// cycle through a saved output), keeps the rest of Saved in the autograd
// context, marks the outputs that are not floating point non-differentiable,
// and runs the forward below autograd (an Op that records its own graph in
// its forward declares `static constexpr bool kRecordsGraph = true;` and runs
// with autograd's dispatch keys on). Internal halves (X_forward, X_backward) are not
// differentiable: schemas.cpp registers an explicit Autograd kernel for them
// that returns outputs without a gradient history.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>
#include <torch/torch.h>

#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "ops/op_util.h"

namespace fastattn::ops {

// The typed handle of operator `Name` (a constexpr char array), looked up
// once.
template <const char* Name, typename Sig>
const c10::TypedOperatorHandle<Sig>& op_handle() {
  static const auto handle =
      c10::Dispatcher::singleton().findSchemaOrThrow(Name, "").template typed<Sig>();
  return handle;
}

// Calls operator `Name`, whose C++ signature is that of `Impl` (one of its
// kernels), through the dispatcher.
template <const char* Name, auto Impl, typename... A>
decltype(auto) call_op(A&&... args) {
  using Sig = std::remove_pointer_t<decltype(Impl)>;
  return op_handle<Name, Sig>().call(std::forward<A>(args)...);
}

// An undefined tensor as none, for the optional arguments of a backward.
inline c10::optional<torch::Tensor> opt(const torch::Tensor& t) {
  return t.defined() ? c10::optional<torch::Tensor>(t) : c10::nullopt;
}
// None as an undefined tensor, for Saved.
inline torch::Tensor or_undefined(const c10::optional<torch::Tensor>& t) {
  return t ? *t : torch::Tensor();
}

namespace shell_detail {

template <typename R>
torch::autograd::variable_list to_list(R&& r) {
  if constexpr (std::is_same_v<std::decay_t<R>, torch::Tensor>) {
    return {std::forward<R>(r)};
  } else if constexpr (std::is_same_v<std::decay_t<R>, torch::autograd::variable_list>) {
    return std::forward<R>(r);
  } else {
    return std::apply([](auto&&... t) { return torch::autograd::variable_list{t...}; }, r);
  }
}

template <typename R, size_t... I>
R from_list_impl(const torch::autograd::variable_list& v, std::index_sequence<I...>) {
  return R(v[I]...);
}
template <typename R>
R from_list(const torch::autograd::variable_list& v) {
  if constexpr (std::is_same_v<R, torch::Tensor>) {
    return v[0];
  } else {
    return from_list_impl<R>(v, std::make_index_sequence<std::tuple_size_v<R>>());
  }
}

// Op::kRecordsGraph, false when the Op does not declare it.
template <typename Op, typename = void>
struct records_graph : std::false_type {};
template <typename Op>
struct records_graph<Op, std::void_t<decltype(Op::kRecordsGraph)>>
    : std::bool_constant<Op::kRecordsGraph> {};

// Saved's state without its tensors, held by the autograd context.
template <typename T>
struct Holder : torch::CustomClassHolder {
  explicit Holder(T v) : value(std::move(v)) {}
  T value;
};

}  // namespace shell_detail

template <typename Op, typename Fn = decltype(&Op::forward)>
struct Shell;

template <typename Op, typename R, typename... A>
struct Shell<Op, R (*)(typename Op::Saved*, A...)> {
  using Saved = typename Op::Saved;

  class Function : public torch::autograd::Function<Function> {
   public:
    static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                  A... args) {
      std::optional<at::AutoDispatchBelowADInplaceOrView> below;
      if constexpr (!shell_detail::records_graph<Op>::value) below.emplace();
      Saved saved;
      auto outputs = shell_detail::to_list(Op::forward(&saved, args...));
      std::vector<torch::Tensor> tensors;
      std::apply([&](auto&... t) { (tensors.push_back(std::exchange(t, torch::Tensor())), ...); },
                 saved.tensors());
      ctx->save_for_backward(tensors);
      ctx->saved_data["state"] = c10::IValue::make_capsule(
          c10::make_intrusive<shell_detail::Holder<Saved>>(std::move(saved)));
      std::vector<torch::Tensor> integral;
      for (const auto& o : outputs)
        if (o.defined() && !o.is_floating_point()) integral.push_back(o);
      if (!integral.empty()) ctx->mark_non_differentiable(integral);
      return outputs;
    }

    static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                   torch::autograd::variable_list grads) {
      auto holder = c10::static_intrusive_pointer_cast<shell_detail::Holder<Saved>>(
          ctx->saved_data["state"].toCapsule());
      Saved saved = holder->value;
      const auto tensors = ctx->get_saved_variables();
      size_t i = 0;
      std::apply([&](auto&... t) { ((t = tensors[i++]), ...); }, saved.tensors());
      // The saved inputs were checked by the forward: no value checks again.
      SavedInputsChecked checked;
      auto g = shell_detail::to_list(Op::backward(saved, grads));
      g.resize(sizeof...(A));
      return g;
    }
  };

  // The Autograd kernel.
  static R autograd(A... args) { return shell_detail::from_list<R>(Function::apply(args...)); }
  // The backends' kernel: the forward without saving anything.
  static R no_grad(A... args) { return Op::forward(nullptr, args...); }
};

// Registers an operator's halves `<name>_forward` and `<name>_backward` (when
// `backward` is not null) for one dispatch key. In a block without a key
// (TORCH_LIBRARY_FRAGMENT) or one with the same key.
template <typename Forward, typename Backward = std::nullptr_t>
void impl_halves(torch::Library& m, c10::DispatchKey key, const std::string& name, Forward* forward,
                 Backward* backward = nullptr) {
  m.impl((name + "_forward").c_str(), torch::dispatch(key, forward));
  if constexpr (!std::is_same_v<Backward, std::nullptr_t>)
    m.impl((name + "_backward").c_str(), torch::dispatch(key, backward));
}

// Registers operator `name` made by the shell from `Op`: its no-grad entry
// under CPU and CUDA (it reaches the device's halves through the dispatcher,
// so one entry serves both), its Autograd kernel, and its CPU halves. Called
// in a TORCH_LIBRARY_FRAGMENT block (one without a dispatch key).
template <typename Op, typename Forward, typename Backward = std::nullptr_t>
void impl_shell(torch::Library& m, const std::string& name, Forward* forward_cpu,
                Backward* backward_cpu = nullptr) {
  using S = Shell<Op>;
  m.impl(name.c_str(), torch::dispatch(c10::DispatchKey::CPU, S::no_grad));
  m.impl(name.c_str(), torch::dispatch(c10::DispatchKey::CUDA, S::no_grad));
  m.impl(name.c_str(), torch::dispatch(c10::DispatchKey::Autograd, S::autograd));
  impl_halves(m, c10::DispatchKey::CPU, name, forward_cpu, backward_cpu);
}

}  // namespace fastattn::ops
