#include "kernels/linear_attention/elu_linear_attention_cuda.cu"
