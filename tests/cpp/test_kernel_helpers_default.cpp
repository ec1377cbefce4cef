// The kernels' shared helpers at the default level (kernel_helpers_tests.h).
#define FASTATTN_ISA_LEVEL 0
#include "kernel_helpers_tests.h"
