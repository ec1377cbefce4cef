// The decoder-only tasks' model (lm_tasks.cpp) and their sampling
// (sampling.cpp) take a torch::nn::Module that must be a CausalLanguageModel.
#pragma once

#include "fastattn/generation.h"

namespace fastattn::train {

inline CausalLanguageModelImpl& as_lm(torch::nn::Module& model, const char* who) {
  auto* m = dynamic_cast<CausalLanguageModelImpl*>(&model);
  TORCH_CHECK(m, who, ": the model is not a CausalLanguageModel");
  return *m;
}

}  // namespace fastattn::train
