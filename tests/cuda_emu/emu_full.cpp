// The full-attention CUDA kernels compiled by the host compiler for the emulator.
#include "kernels/full/full_attention_cuda.cu"
