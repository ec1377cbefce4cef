// Precompiled header for the LibTorch-facing translation units: parsing
// torch/torch.h costs ~25 s per file otherwise.
#pragma once
#include <torch/torch.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
