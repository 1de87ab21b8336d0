// The CUDA backend's device layer: discovery, errors as Status, RAII owners of streams, events,
// device and pinned host memory, the executor's stream set and its arena. Plain C++ over the CUDA
// runtime (linked statically, so binaries need only the driver on the GPU host).
//
// Every owner is move-only and frees what it holds in its destructor, ignoring errors there (a
// destructor cannot report them; the calls that can fail are the ones that return Status).
// Thread-safety: as the CUDA runtime's; the objects hold no host-side shared state.
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <cstdint>
#include <string>

#include "schemas/program.h"
#include "schemas/status.h"

namespace dc {

// Number of CUDA devices visible to this process: 0 when there is no driver, no device or any
// other failure, never an error. Computed once.
int CudaDeviceCount();

// Ok for cudaSuccess, else "<what>: cudaErrorMemoryAllocation (out of memory)". Clears the
// runtime's last-error slot so a later check does not report the same error again.
Status CudaStatus(cudaError_t error, const std::string& what);

struct CudaDeviceInfo {
  int ordinal = 0;
  std::string name;
  int compute_capability_major = 0;
  int compute_capability_minor = 0;
  int multiprocessors = 0;
  int64_t memory_bytes = 0;
  int64_t l2_cache_bytes = 0;
  int64_t shared_memory_per_block_optin_bytes = 0;  // most dynamic shared memory of one block
  int driver_version = 0;                           // e.g. 13000 for CUDA 13.0
  int runtime_version = 0;
};

StatusOr<CudaDeviceInfo> GetCudaDeviceInfo(int ordinal);
// Makes device `ordinal` current for the calling thread (checked against CudaDeviceCount).
Status UseCudaDevice(int ordinal);
// The calling thread's current device.
StatusOr<int> CurrentCudaDevice();

class CudaStream {
 public:
  // A non-blocking stream (no implicit sync with the legacy default stream). Lower `priority`
  // numbers run first (cudaDeviceGetStreamPriorityRange); 0 is the default.
  static StatusOr<CudaStream> Create(int priority = 0);
  CudaStream() = default;
  ~CudaStream();
  CudaStream(CudaStream&& other) noexcept;
  CudaStream& operator=(CudaStream&& other) noexcept;
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;

  cudaStream_t get() const { return stream_; }
  Status Synchronize(const std::string& what) const;

 private:
  explicit CudaStream(cudaStream_t stream) : stream_(stream) {}
  cudaStream_t stream_ = nullptr;
};

class CudaEvent {
 public:
  // Timing events cost more to record; dependency-only events are created without timing.
  static StatusOr<CudaEvent> Create(bool timing = false);
  CudaEvent() = default;
  ~CudaEvent();
  CudaEvent(CudaEvent&& other) noexcept;
  CudaEvent& operator=(CudaEvent&& other) noexcept;
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;

  cudaEvent_t get() const { return event_; }
  Status Record(cudaStream_t stream);
  // Work enqueued on `stream` after this call waits for the recorded work.
  Status MakeStreamWait(cudaStream_t stream) const;
  // True when the recorded work is done, false while it runs.
  StatusOr<bool> Done() const;
  Status Synchronize() const;
  // Milliseconds between two recorded timing events.
  static StatusOr<float> ElapsedMs(const CudaEvent& start, const CudaEvent& end);

 private:
  explicit CudaEvent(cudaEvent_t event) : event_(event) {}
  cudaEvent_t event_ = nullptr;
};

// The executor's streams, one per schedule stream (schedule.proto: compute, gather, reduce, h2d,
// d2h). The collective streams get the device's highest priority so that a gather or
// reduce-scatter kernel is not queued behind a long compute kernel.
class CudaStreamSet {
 public:
  static StatusOr<CudaStreamSet> Create();
  // Null for STREAM_UNSPECIFIED or an unknown value.
  cudaStream_t get(proto::Stream stream) const;
  Status SynchronizeAll() const;

 private:
  static constexpr int kNumStreams = 5;
  std::array<CudaStream, kNumStreams> streams_;  // index = proto::Stream - 1
};

// Device memory from one cudaMalloc.
class DeviceBuffer {
 public:
  static StatusOr<DeviceBuffer> Create(int64_t size_bytes, const std::string& what);
  DeviceBuffer() = default;
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* data() const { return data_; }
  int64_t size_bytes() const { return size_bytes_; }

 private:
  DeviceBuffer(void* data, int64_t size_bytes) : data_(data), size_bytes_(size_bytes) {}
  void* data_ = nullptr;
  int64_t size_bytes_ = 0;
};

// The executor's device memory: one allocation of the memory plan's size, every planned buffer
// at its planned offset, so nothing fragments and the peak is known before the run.
class DeviceArena {
 public:
  // Offsets must be multiples of this (cuBLASLt and vector loads want 256-byte alignment).
  static constexpr int64_t kAlignmentBytes = 256;

  static StatusOr<DeviceArena> Create(int64_t size_bytes);
  void* base() const { return buffer_.data(); }
  int64_t size_bytes() const { return buffer_.size_bytes(); }
  // The buffer [offset_bytes, offset_bytes + size_bytes), checked to lie inside the arena and to
  // be aligned; `what` names it in the error.
  StatusOr<void*> Buffer(int64_t offset_bytes, int64_t size_bytes, const std::string& what) const;

 private:
  explicit DeviceArena(DeviceBuffer buffer) : buffer_(std::move(buffer)) {}
  DeviceBuffer buffer_;
};

// Page-locked host memory (cudaHostAlloc, portable to every device), for offloaded fragments
// and staging: copies from and to it are truly asynchronous.
class PinnedHostBuffer {
 public:
  static StatusOr<PinnedHostBuffer> Create(int64_t size_bytes, const std::string& what);
  PinnedHostBuffer() = default;
  ~PinnedHostBuffer();
  PinnedHostBuffer(PinnedHostBuffer&& other) noexcept;
  PinnedHostBuffer& operator=(PinnedHostBuffer&& other) noexcept;
  PinnedHostBuffer(const PinnedHostBuffer&) = delete;
  PinnedHostBuffer& operator=(const PinnedHostBuffer&) = delete;

  void* data() const { return data_; }
  int64_t size_bytes() const { return size_bytes_; }

 private:
  PinnedHostBuffer(void* data, int64_t size_bytes) : data_(data), size_bytes_(size_bytes) {}
  void* data_ = nullptr;
  int64_t size_bytes_ = 0;
};

// cudaMemcpyAsync with the direction inferred from the pointers (unified addressing).
Status CopyAsync(void* dst, const void* src, int64_t size_bytes, cudaStream_t stream,
                 const std::string& what);

}  // namespace dc
