// The stable top-k selection CUDA kernel compiled by the host compiler for the emulator.
#include "kernels/sparse_product/stable_topk_cuda.cu"
