// The hashing CUDA kernels compiled by the host compiler for the emulator.
#include "kernels/hashing/hash_queries_cuda.cu"
