#include "kernels/feature_maps/elu_feature_map_cuda.cu"
