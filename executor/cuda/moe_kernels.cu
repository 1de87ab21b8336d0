// nvcc's translation unit for the mixture-of-experts kernels (moe.cuh), apart from the others so
// that the three compile in parallel.
#include "executor/cuda/moe.cuh"
