// The kernels' shared helpers at the avx2 level (kernel_helpers_tests.h).
#define FASTATTN_ISA_LEVEL 1
#if FASTATTN_CPU_ISA_MAX >= 1
#include "kernel_helpers_tests.h"
#endif
