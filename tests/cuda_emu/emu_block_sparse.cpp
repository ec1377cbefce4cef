// The block-sparse attention CUDA kernels compiled for the emulator.
#include "kernels/block_sparse/block_sparse_attention_forward_cuda.cu"
#include "kernels/block_sparse/block_sparse_attention_backward_cuda.cu"
