// An unmodified CUDA program for the attach tests: no dc code, only the CUDA runtime.
//   dc_cupti_test_program              3 kernels, 2 copies, 1 memset
//   dc_cupti_test_program --range      the same, then 2 more kernels between
//                                      cudaProfilerStart and cudaProfilerStop
// Exits 1 with a message when a CUDA call fails.
#include <cuda_profiler_api.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <vector>

namespace {

constexpr int kElements = 1 << 16;
constexpr int kThreadsPerBlock = 256;

__global__ void add_one(float* data, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) data[i] += 1.0f;
}

bool Check(cudaError_t error, const char* call) {
  if (error == cudaSuccess) return true;
  std::fprintf(stderr, "dc_cupti_test_program: %s failed: %s\n", call, cudaGetErrorString(error));
  return false;
}

bool Launch(float* data, int count) {
  for (int i = 0; i < count; ++i) {
    add_one<<<(kElements + kThreadsPerBlock - 1) / kThreadsPerBlock, kThreadsPerBlock>>>(data,
                                                                                         kElements);
    if (!Check(cudaGetLastError(), "add_one<<<>>>")) return false;
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  const bool range = argc > 1 && std::strcmp(argv[1], "--range") == 0;
  std::vector<float> host(kElements, 1.0f);
  float* device = nullptr;
  const size_t bytes = host.size() * sizeof(float);
  if (!Check(cudaMalloc(&device, bytes), "cudaMalloc")) return 1;
  if (!Check(cudaMemcpy(device, host.data(), bytes, cudaMemcpyHostToDevice), "cudaMemcpy")) {
    return 1;
  }
  if (!Launch(device, 3)) return 1;
  if (!Check(cudaMemset(device, 0, bytes), "cudaMemset")) return 1;
  if (!Check(cudaMemcpy(host.data(), device, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy")) {
    return 1;
  }
  if (range) {
    if (!Check(cudaProfilerStart(), "cudaProfilerStart")) return 1;
    if (!Launch(device, 2)) return 1;
    if (!Check(cudaDeviceSynchronize(), "cudaDeviceSynchronize")) return 1;
    if (!Check(cudaProfilerStop(), "cudaProfilerStop")) return 1;
  }
  if (!Check(cudaFree(device), "cudaFree")) return 1;
  return 0;
}
