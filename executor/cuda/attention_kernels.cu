// nvcc's translation unit for the attention kernels (attention.cuh), apart from the others so
// that the two compile in parallel.
#include "executor/cuda/attention.cuh"
