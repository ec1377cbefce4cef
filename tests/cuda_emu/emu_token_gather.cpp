// The token_gather CUDA kernels compiled by the host compiler for the emulator.
#include "kernels/token_gather/token_gather_cuda.cu"
