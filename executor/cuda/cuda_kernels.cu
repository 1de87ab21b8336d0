// nvcc's translation unit for every kernel but attention's (kernels.cuh): the launchers of
// kernel_launch.h, with their kernels.
#include "executor/cuda/kernels.cuh"
