// The sparse_product CUDA kernels compiled by the host compiler for the emulator.
#include "kernels/sparse_product/clustered_topk_cuda.cu"
