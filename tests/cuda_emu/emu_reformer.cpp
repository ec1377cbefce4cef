// The Reformer CUDA kernels compiled by the host compiler for the emulator
// (tests/cuda_emu/test_reformer.cpp runs them).
#include "kernels/reformer/reformer_forward_cuda.cu"
#include "kernels/reformer/reformer_backward_cuda.cu"
