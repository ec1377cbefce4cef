// The mma_m16n8k16 probe kernel compiled by the host compiler for the emulator.
#include "kernels/common/mma_probe_cuda.cu"
