// What the encoder and decoder stacks (batch and recurrent) share: their
// layers registered as the module list "layers" (a null layer refused with
// a message naming `who`) and an optional final norm registered as "norm".
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/normalization.h>

#include <vector>

namespace fastattn::transformer_detail {

// Registers `layers` and `norm` (when not empty) on `stack`; returns the norm
// as registered.
template <typename Layer>
torch::nn::LayerNorm register_stack(torch::nn::Module& stack, const char* who,
                                    const std::vector<Layer>& layers, torch::nn::LayerNorm norm) {
  auto list = torch::nn::ModuleList();
  for (const auto& layer : layers) {
    TORCH_CHECK(!layer.is_empty(), who, ": layers must not hold a null layer");
    list->push_back(layer);
  }
  stack.register_module("layers", list);
  if (norm.is_empty()) return norm;
  return torch::nn::LayerNorm(stack.register_module("norm", norm));
}

}  // namespace fastattn::transformer_detail
