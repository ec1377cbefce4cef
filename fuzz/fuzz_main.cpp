// libFuzzer entry point of the operator fuzzer (built with clang when
// FASTATTN_FUZZ=ON; see docs/reliability.md and `make fuzz`). The decoding and
// the checks live in fuzz_ops.cpp, shared with the corpus replay test.
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>

#include "fuzz_ops.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  at::set_num_threads(1);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string failure = fastattn::fuzz::check_fuzz_input(data, size);
  if (!failure.empty()) {
    std::fprintf(stderr, "fastattn fuzz failure: %s\n", failure.c_str());
    std::abort();
  }
  return 0;
}
