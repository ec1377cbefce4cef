// The hard retrieval attention CUDA kernels compiled for the emulator.
#include "kernels/hard_retrieval/hard_retrieval_cuda.cu"
