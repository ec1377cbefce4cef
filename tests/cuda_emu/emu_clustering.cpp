// The clustering CUDA kernels compiled by the host compiler for the emulator.
#include "kernels/clustering/cluster_codes_cuda.cu"
