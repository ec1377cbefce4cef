// The block-sparse attention CUDA kernels compiled for the emulator.
#include "kernels/block_sparse/block_sparse_attention_cuda.cu"
