#include <cuda_runtime.h>

#include "collector/cupti/test_kernels.h"

namespace {

constexpr int kThreadsPerBlock = 128;

__global__ void scale(float* data, int n, float factor) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) data[i] *= factor;
}

int Blocks(int n) { return (n + kThreadsPerBlock - 1) / kThreadsPerBlock; }

}  // namespace

extern "C" __global__ void ncclDevKernel_AllGather_RING_LL(const float* in, float* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = in[i];
}

namespace dc::cupti_testing {

int LaunchScale(float* data, int n, float factor, CUstream_st* stream) {
  scale<<<Blocks(n), kThreadsPerBlock, 0, stream>>>(data, n, factor);
  return static_cast<int>(cudaGetLastError());
}

int LaunchFakeNcclAllGather(const float* in, float* out, int n, CUstream_st* stream) {
  ncclDevKernel_AllGather_RING_LL<<<Blocks(n), kThreadsPerBlock, 0, stream>>>(in, out, n);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace dc::cupti_testing
