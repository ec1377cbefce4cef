// The full-attention CUDA kernels compiled by the host compiler for the emulator.
#include "kernels/full/full_attention_forward_cuda.cu"
#include "kernels/full/full_attention_backward_cuda.cu"
