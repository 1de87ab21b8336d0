// Device helpers shared by kernels.cuh and attention.cuh: storage-type conversions, warp and block
// reductions, grid shapes and the FloatType dispatch.
#pragma once

#include <algorithm>

#include "executor/cuda/kernel_compat.cuh"
#include "executor/cuda/kernel_launch.h"

namespace dc::cuda_kernels {

// ---------------------------------------------------------------------------------------------
// Storage types. Every kernel computes in fp32 and converts on load and store (round to nearest
// even on store).

DC_DEVICE float ToF32(float v) { return v; }
DC_DEVICE float ToF32(__nv_bfloat16 v) { return __bfloat162float(v); }
DC_DEVICE float ToF32(__half v) { return __half2float(v); }

template <typename T>
DC_DEVICE T FromF32(float v);
template <>
DC_DEVICE float FromF32<float>(float v) {
  return v;
}
template <>
DC_DEVICE __nv_bfloat16 FromF32<__nv_bfloat16>(float v) {
  return __float2bfloat16(v);
}
template <>
DC_DEVICE __half FromF32<__half>(float v) {
  return __float2half(v);
}

// Calls fn(T{}) with T the storage type of `type`.
template <typename Fn>
cudaError_t DispatchFloat(FloatType type, Fn&& fn) {
  switch (type) {
    case FloatType::kF32:
      return fn(float{});
    case FloatType::kBF16:
      return fn(__nv_bfloat16{});
    case FloatType::kF16:
      return fn(__half{});
  }
  return cudaErrorInvalidValue;
}

// ---------------------------------------------------------------------------------------------
// Indexing

DC_DEVICE int64_t GlobalThreadIndex() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
// Whether 16-byte vector accesses may start at `p` (a host-side check before a launch).
inline bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }
DC_DEVICE int64_t GridThreads() { return static_cast<int64_t>(gridDim.x) * blockDim.x; }
// std::min is a host function to nvcc.
DC_DEVICE int64_t Min64(int64_t a, int64_t b) { return a < b ? a : b; }

// Blocks for a grid-stride loop over n elements.
inline constexpr int64_t kMaxElementwiseBlocks = 65536;
inline dim3 ElementwiseGrid(int64_t n) {
  const int64_t blocks = (n + kThreadsPerBlock - 1) / kThreadsPerBlock;
  return dim3(static_cast<unsigned>(std::clamp<int64_t>(blocks, 1, kMaxElementwiseBlocks)));
}

// ---------------------------------------------------------------------------------------------
// Reductions. Fixed shapes and orders, so results are deterministic run to run.

template <typename T>
DC_DEVICE T WarpSum(T v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += ShflXor(v, offset);
  return v;
}

// The largest of the warp's values, on every lane.
DC_DEVICE float WarpMax(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, ShflXor(v, offset));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32); every thread gets the total. `scratch` is
// 32 T of shared memory; the trailing barrier lets the caller reuse it at once.
template <typename T>
DC_DEVICE T BlockSum(T v, T* scratch) {
  const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  v = WarpSum(v);
  if (lane == 0) scratch[warp] = v;
  SyncThreads();
  T total = lane < warps ? scratch[lane] : T(0);
  total = WarpSum(total);
  SyncThreads();
  return total;
}

// Running max and sum of exp(x - max), for a softmax in one pass over a row.
struct MaxSum {
  float max;
  float sum;
};
DC_DEVICE MaxSum EmptyMaxSum() { return {-INFINITY, 0.0f}; }
DC_DEVICE void AddToMaxSum(MaxSum& acc, float x) {
  if (x > acc.max) {
    acc.sum = acc.sum * expf(acc.max - x) + 1.0f;
    acc.max = x;
  } else {
    acc.sum += expf(x - acc.max);
  }
}
DC_DEVICE MaxSum MergeMaxSum(MaxSum a, MaxSum b) {
  if (a.max < b.max) {
    const MaxSum t = a;
    a = b;
    b = t;
  }
  if (b.max == -INFINITY) return a;  // also when both are empty
  return {a.max, a.sum + b.sum * expf(b.max - a.max)};
}
// Merges over the block; every thread gets the result. `scratch` is 32 MaxSum of shared memory.
DC_DEVICE MaxSum BlockMaxSum(MaxSum v, MaxSum* scratch) {
  const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  for (int offset = 16; offset > 0; offset >>= 1) {
    v = MergeMaxSum(v, MaxSum{ShflXor(v.max, offset), ShflXor(v.sum, offset)});
  }
  if (lane == 0) scratch[warp] = v;
  SyncThreads();
  MaxSum total = lane < warps ? scratch[lane] : EmptyMaxSum();
  for (int offset = 16; offset > 0; offset >>= 1) {
    total = MergeMaxSum(total, MaxSum{ShflXor(total.max, offset), ShflXor(total.sum, offset)});
  }
  SyncThreads();
  return total;
}

// Records a bad token id in the device error record unless an earlier error is there.
DC_DEVICE void RecordBadId(int32_t* device_error, DeviceErrorSource source, int64_t position,
                           int32_t id, int64_t bound) {
  if (AtomicCasI32(&device_error[0], kNoDeviceError, source) == kNoDeviceError) {
    device_error[1] = static_cast<int32_t>(position);
    device_error[2] = id;
    device_error[3] = static_cast<int32_t>(bound);
  }
}

}  // namespace dc::cuda_kernels
