#include "kernels/causal_product/causal_product_cuda.cu"
