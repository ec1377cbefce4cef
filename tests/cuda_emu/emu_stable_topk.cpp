// The stable top-k selection CUDA kernel compiled by the host compiler for the emulator.
#include "kernels/clustered_topk/stable_topk_cuda.cu"
