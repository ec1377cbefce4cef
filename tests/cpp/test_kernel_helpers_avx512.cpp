// The kernels' shared helpers at the avx512 level (kernel_helpers_tests.h).
#define FASTATTN_ISA_LEVEL 2
#if FASTATTN_CPU_ISA_MAX >= 2
#include "kernel_helpers_tests.h"
#endif
