// Kernels for the GPU tests (test_kernels.cu, compiled by nvcc). Each launch returns its
// cudaError_t as an int (0: success).
#pragma once

struct CUstream_st;

namespace dc::cupti_testing {

// data[i] *= factor for i < n: a kernel named "scale".
int LaunchScale(float* data, int n, float factor, CUstream_st* stream);
// An extern "C" kernel named as NCCL 2.19+ names its all-gather ("ncclDevKernel_AllGather_RING_LL")
// that copies `n` floats: stands in for NCCL in tests on one GPU.
int LaunchFakeNcclAllGather(const float* in, float* out, int n, CUstream_st* stream);

}  // namespace dc::cupti_testing
