// A tensor in a device's memory: what the interpreter hands a device (executor/device.h) and
// what the cuda kernels take (executor/cuda/cuda_kernels.h). Header only.
#pragma once

#include <cstdint>
#include <vector>

#include "schemas/program.h"

namespace dc {

// A tensor in a device's memory as a kernel sees it: row-major, `data` a device pointer (a host
// pointer on the cpu backend), `dtype` the dtype it is stored in.
struct DeviceTensor {
  void* data = nullptr;
  proto::DType dtype = proto::DTYPE_F32;  // F32, BF16, F16 or I32
  std::vector<int64_t> shape;

  int64_t NumElements() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
  int64_t SizeBytes() const { return NumElements() * DTypeSizeBytes(dtype); }
};

}  // namespace dc
