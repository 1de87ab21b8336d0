// The few device facilities the kernels in kernels.cuh use, spelled once so that the same kernel
// source compiles two ways: with nvcc for the GPU, and with the host C++ compiler against
// kernel_emulator.h, which runs each block's threads as host threads. The emulated build lets
// the kernels' indexing, tiling and barrier logic be checked against the CPU backend on machines
// without a GPU (kernel_emulation_test.cc).
//
// Rules for kernel code: 1-D blocks whose size is a multiple of 32; warp shuffles through
// ShflXor only, executed by all 32 lanes; shared memory through DC_SHARED and
// DC_DYNAMIC_SMEM (or DC_DYNAMIC_SMEM_BYTES); tensor-core tiles through the Mma* functions, with
// SyncWarp between lanes' shared-memory writes and the warp's loads of them; atomics through the
// wrappers below; no device-runtime calls.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <driver_types.h>
#include <vector_types.h>

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)

#include <mma.h>

#define DC_DEVICE __device__ __forceinline__
#define DC_HOST_DEVICE __host__ __device__ inline
#define DC_GLOBAL __global__
#define DC_SHARED __shared__
#define DC_LAUNCH_BOUNDS(threads) __launch_bounds__(threads)
#define DC_UNROLL _Pragma("unroll")
// Declares `name`, a `type*` to the block's dynamic shared memory (16-byte aligned).
#define DC_DYNAMIC_SMEM(type, name)                                 \
  extern __shared__ __align__(16) unsigned char dc_dynamic_smem_[]; \
  type* name = reinterpret_cast<type*>(dc_dynamic_smem_)

// Declares `name`, an `unsigned char*` to the block's dynamic shared memory, 128-byte aligned
// (tensor-core fragments load from 32-byte aligned addresses).
#define DC_DYNAMIC_SMEM_BYTES(name)                                        \
  extern __shared__ __align__(128) unsigned char dc_dynamic_smem_bytes_[]; \
  unsigned char* name = dc_dynamic_smem_bytes_

namespace dc::cuda_kernels {

DC_DEVICE void SyncThreads() { __syncthreads(); }
DC_DEVICE void SyncWarp() { __syncwarp(); }

// Copies 16 bytes between 16-byte aligned addresses.
DC_DEVICE void Copy16(void* dst, const void* src) {
  *static_cast<uint4*>(dst) = *static_cast<const uint4*>(src);
}

// Tensor-core tiles (nvcuda::wmma): a warp multiplies 16 x 16 tiles of a 16-bit type (__half,
// __nv_bfloat16) into a 16 x 16 fp32 accumulator. Operands load from shared memory (32-byte
// aligned tile starts, leading dimensions a multiple of 8 elements; 4 for fp32). Every lane
// of the warp calls each of these with the same arguments.
template <typename T>
using MmaA = nvcuda::wmma::fragment<nvcuda::wmma::matrix_a, 16, 16, 16, T, nvcuda::wmma::row_major>;
template <typename T>  // element (k, n) at p[k * ld + n]
using MmaBRow =
    nvcuda::wmma::fragment<nvcuda::wmma::matrix_b, 16, 16, 16, T, nvcuda::wmma::row_major>;
template <typename T>  // element (k, n) at p[n * ld + k]: the transpose of a row-major tile
using MmaBCol =
    nvcuda::wmma::fragment<nvcuda::wmma::matrix_b, 16, 16, 16, T, nvcuda::wmma::col_major>;
using MmaAcc = nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 16, float>;

template <typename Fragment, typename T>
DC_DEVICE void MmaLoad(Fragment& fragment, const T* p, int ld) {
  nvcuda::wmma::load_matrix_sync(fragment, p, static_cast<unsigned>(ld));
}
DC_DEVICE void MmaLoadAcc(MmaAcc& acc, const float* p, int ld) {
  nvcuda::wmma::load_matrix_sync(acc, p, static_cast<unsigned>(ld), nvcuda::wmma::mem_row_major);
}
DC_DEVICE void MmaStoreAcc(float* p, const MmaAcc& acc, int ld) {
  nvcuda::wmma::store_matrix_sync(p, acc, static_cast<unsigned>(ld), nvcuda::wmma::mem_row_major);
}
DC_DEVICE void MmaZero(MmaAcc& acc) { nvcuda::wmma::fill_fragment(acc, 0.0f); }
// acc += a * b
template <typename A, typename B>
DC_DEVICE void Mma(MmaAcc& acc, const A& a, const B& b) {
  nvcuda::wmma::mma_sync(acc, a, b, acc);
}

template <typename T>
DC_DEVICE T ShflXor(T value, int lane_mask) {
  return __shfl_xor_sync(0xffffffffu, value, lane_mask);
}

DC_DEVICE int32_t AtomicCasI32(int32_t* address, int32_t compare, int32_t value) {
  return atomicCAS(reinterpret_cast<int*>(address), compare, value);
}

// Double arithmetic that is never contracted into fused multiply-adds, so that it rounds exactly
// as the CPU backend's plain C++ does.
DC_DEVICE double DMul(double a, double b) { return __dmul_rn(a, b); }
DC_DEVICE double DAdd(double a, double b) { return __dadd_rn(a, b); }
DC_DEVICE double DDiv(double a, double b) { return __ddiv_rn(a, b); }
DC_DEVICE double DSqrt(double a) { return __dsqrt_rn(a); }
// The same for fp32, and the fused multiply-add where the CPU backend's vector code fuses one.
DC_DEVICE float FMul(float a, float b) { return __fmul_rn(a, b); }
DC_DEVICE float FAdd(float a, float b) { return __fadd_rn(a, b); }
DC_DEVICE float FDiv(float a, float b) { return __fdiv_rn(a, b); }
DC_DEVICE float FSqrt(float a) { return __fsqrt_rn(a); }
DC_DEVICE float FFma(float a, float b, float c) { return __fmaf_rn(a, b, c); }

// Launches `kernel` on `stream` and returns the launch's error (bad configuration, no device).
template <typename... KernelArgs, typename... Args>
cudaError_t LaunchKernel(void (*kernel)(KernelArgs...), dim3 grid, dim3 block,
                         size_t dynamic_smem_bytes, cudaStream_t stream, Args... args) {
  kernel<<<grid, block, dynamic_smem_bytes, stream>>>(static_cast<KernelArgs>(args)...);
  return cudaGetLastError();
}

// Allows `kernel` up to `bytes` of dynamic shared memory (needed above 48 KiB).
template <typename... KernelArgs>
cudaError_t AllowDynamicSmem(void (*kernel)(KernelArgs...), int64_t bytes) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              static_cast<int>(bytes));
}

inline cudaError_t MemsetZeroAsync(void* data, int64_t bytes, cudaStream_t stream) {
  return cudaMemsetAsync(data, 0, static_cast<size_t>(bytes), stream);
}

}  // namespace dc::cuda_kernels

#else  // host emulation

#include "executor/cuda/kernel_emulator.h"

#define DC_DEVICE inline
#define DC_HOST_DEVICE inline
#define DC_GLOBAL
#define DC_SHARED static
#define DC_LAUNCH_BOUNDS(threads)
#define DC_UNROLL
#define DC_DYNAMIC_SMEM(type, name) type* name = reinterpret_cast<type*>(::dc::emu::DynamicSmem())

#define threadIdx (::dc::emu::thread_idx)
#define blockIdx (::dc::emu::block_idx)
#define blockDim (::dc::emu::block_dim)
#define gridDim (::dc::emu::grid_dim)

#define DC_DYNAMIC_SMEM_BYTES(name) unsigned char* name = ::dc::emu::DynamicSmem()

namespace dc::cuda_kernels {

inline void SyncThreads() { ::dc::emu::SyncThreads(); }
inline void SyncWarp() { ::dc::emu::Yield(::dc::emu::FiberState::kAtWarpBarrier); }

inline void Copy16(void* dst, const void* src) { std::memcpy(dst, src, 16); }

// The tensor-core tiles, each lane holding the whole 16 x 16 tile in fp32: the same products
// (16-bit operands are exact in fp32) with the layouts the GPU's loads and stores use. Loads and
// stores are the warp's collective operations, as on the GPU: a load reads what every lane
// wrote before it, and no lane writes until every lane has loaded (a warp barrier on each side).
struct EmuTile {
  float v[16][16];
};
template <typename T>
struct MmaA : EmuTile {};
template <typename T>
struct MmaBRow : EmuTile {};
template <typename T>
struct MmaBCol : EmuTile {};
struct MmaAcc : EmuTile {};

inline float EmuToF32(__nv_bfloat16 v) { return __bfloat162float(v); }
inline float EmuToF32(__half v) { return __half2float(v); }

// Element (r, c) of the tile from p[r * ld + c], or from p[c * ld + r] (`transposed`).
template <typename T>
void EmuLoadTile(EmuTile& tile, const T* p, int ld, bool transposed) {
  SyncWarp();
  for (int r = 0; r < 16; ++r) {
    for (int c = 0; c < 16; ++c)
      tile.v[r][c] = EmuToF32(transposed ? p[c * ld + r] : p[r * ld + c]);
  }
  SyncWarp();
}
template <typename T>
void MmaLoad(MmaA<T>& a, const T* p, int ld) {
  EmuLoadTile(a, p, ld, false);
}
template <typename T>
void MmaLoad(MmaBRow<T>& b, const T* p, int ld) {
  EmuLoadTile(b, p, ld, false);
}
template <typename T>
void MmaLoad(MmaBCol<T>& b, const T* p, int ld) {
  EmuLoadTile(b, p, ld, true);
}
inline void MmaLoadAcc(MmaAcc& acc, const float* p, int ld) {
  SyncWarp();
  for (int r = 0; r < 16; ++r) {
    for (int c = 0; c < 16; ++c) acc.v[r][c] = p[r * ld + c];
  }
  SyncWarp();
}
inline void MmaStoreAcc(float* p, const MmaAcc& acc, int ld) {
  SyncWarp();
  for (int r = 0; r < 16; ++r) {
    for (int c = 0; c < 16; ++c) p[r * ld + c] = acc.v[r][c];
  }
}
inline void MmaZero(MmaAcc& acc) { acc = MmaAcc{}; }
template <typename A, typename B>
void Mma(MmaAcc& acc, const A& a, const B& b) {
  for (int r = 0; r < 16; ++r) {
    for (int n = 0; n < 16; ++n) {
      float sum = acc.v[r][n];
      for (int k = 0; k < 16; ++k) sum += a.v[r][k] * b.v[k][n];
      acc.v[r][n] = sum;
    }
  }
}

template <typename T>
T ShflXor(T value, int lane_mask) {
  return ::dc::emu::WarpExchange(value, static_cast<int>(threadIdx.x % 32) ^ lane_mask);
}

inline int32_t AtomicCasI32(int32_t* address, int32_t compare, int32_t value) {
  std::atomic_ref<int32_t> ref(*address);
  ref.compare_exchange_strong(compare, value);
  return compare;
}

inline double DMul(double a, double b) { return a * b; }
inline double DAdd(double a, double b) { return a + b; }
inline double DDiv(double a, double b) { return a / b; }
inline double DSqrt(double a) { return std::sqrt(a); }
inline float FMul(float a, float b) { return a * b; }
inline float FAdd(float a, float b) { return a + b; }
inline float FDiv(float a, float b) { return a / b; }
inline float FSqrt(float a) { return std::sqrt(a); }
inline float FFma(float a, float b, float c) { return std::fma(a, b, c); }

template <typename... KernelArgs, typename... Args>
cudaError_t LaunchKernel(void (*kernel)(KernelArgs...), dim3 grid, dim3 block,
                         size_t dynamic_smem_bytes, cudaStream_t, Args... args) {
  return ::dc::emu::Launch(kernel, grid, block, dynamic_smem_bytes,
                           static_cast<KernelArgs>(args)...);
}

template <typename... KernelArgs>
cudaError_t AllowDynamicSmem(void (*)(KernelArgs...), int64_t) {
  return cudaSuccess;
}

inline cudaError_t MemsetZeroAsync(void* data, int64_t bytes, cudaStream_t) {
  std::memset(data, 0, static_cast<size_t>(bytes));
  return cudaSuccess;
}

}  // namespace dc::cuda_kernels

#endif
