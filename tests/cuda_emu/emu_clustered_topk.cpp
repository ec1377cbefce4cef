// The clustered top-k CUDA kernels compiled by the host compiler for the emulator.
#include "kernels/clustered_topk/clustered_topk_cuda.cu"
