#include "executor/cuda/cuda_device.h"

#include <utility>

#include "schemas/units.h"

namespace dc {

int CudaDeviceCount() {
  static const int count = [] {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
      (void)cudaGetLastError();  // no driver or no device: not an error here
      return 0;
    }
    return n;
  }();
  return count;
}

Status CudaStatus(cudaError_t error, const std::string& what) {
  if (error == cudaSuccess) return Status::Ok();
  (void)cudaGetLastError();
  return Status::Error(what + ": " + cudaGetErrorName(error) + " (" + cudaGetErrorString(error) +
                       ")");
}

StatusOr<CudaDeviceInfo> GetCudaDeviceInfo(int ordinal) {
  const int count = CudaDeviceCount();
  if (ordinal < 0 || ordinal >= count) {
    return Status::Error("CUDA device " + std::to_string(ordinal) +
                         " does not exist; this host has " + std::to_string(count) +
                         " (is CUDA_VISIBLE_DEVICES set?)");
  }
  cudaDeviceProp prop{};
  DC_RETURN_IF_ERROR(CudaStatus(cudaGetDeviceProperties(&prop, ordinal),
                                "cudaGetDeviceProperties(" + std::to_string(ordinal) + ")"));
  CudaDeviceInfo info;
  info.ordinal = ordinal;
  info.name = prop.name;
  info.compute_capability_major = prop.major;
  info.compute_capability_minor = prop.minor;
  info.multiprocessors = prop.multiProcessorCount;
  info.memory_bytes = static_cast<int64_t>(prop.totalGlobalMem);
  info.l2_cache_bytes = prop.l2CacheSize;
  info.shared_memory_per_block_optin_bytes = static_cast<int64_t>(prop.sharedMemPerBlockOptin);
  DC_RETURN_IF_ERROR(
      CudaStatus(cudaDriverGetVersion(&info.driver_version), "cudaDriverGetVersion"));
  DC_RETURN_IF_ERROR(
      CudaStatus(cudaRuntimeGetVersion(&info.runtime_version), "cudaRuntimeGetVersion"));
  return info;
}

Status UseCudaDevice(int ordinal) {
  const int count = CudaDeviceCount();
  if (ordinal < 0 || ordinal >= count) {
    return Status::Error("CUDA device " + std::to_string(ordinal) +
                         " does not exist; this host has " + std::to_string(count) +
                         " (is CUDA_VISIBLE_DEVICES set?)");
  }
  return CudaStatus(cudaSetDevice(ordinal), "cudaSetDevice(" + std::to_string(ordinal) + ")");
}

StatusOr<int> CurrentCudaDevice() {
  int device = -1;
  DC_RETURN_IF_ERROR(CudaStatus(cudaGetDevice(&device), "cudaGetDevice"));
  return device;
}

// ---------------------------------------------------------------------------------------------
// CudaStream

StatusOr<CudaStream> CudaStream::Create(int priority) {
  cudaStream_t stream = nullptr;
  DC_RETURN_IF_ERROR(
      CudaStatus(cudaStreamCreateWithPriority(&stream, cudaStreamNonBlocking, priority),
                 "cudaStreamCreateWithPriority"));
  return CudaStream(stream);
}

CudaStream::~CudaStream() {
  if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
}

CudaStream::CudaStream(CudaStream&& other) noexcept
    : stream_(std::exchange(other.stream_, nullptr)) {}

CudaStream& CudaStream::operator=(CudaStream&& other) noexcept {
  if (this != &other) {
    if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
    stream_ = std::exchange(other.stream_, nullptr);
  }
  return *this;
}

Status CudaStream::Synchronize(const std::string& what) const {
  return CudaStatus(cudaStreamSynchronize(stream_), what);
}

// ---------------------------------------------------------------------------------------------
// CudaEvent

StatusOr<CudaEvent> CudaEvent::Create(bool timing) {
  cudaEvent_t event = nullptr;
  DC_RETURN_IF_ERROR(CudaStatus(
      cudaEventCreateWithFlags(&event, timing ? cudaEventDefault : cudaEventDisableTiming),
      "cudaEventCreateWithFlags"));
  return CudaEvent(event);
}

CudaEvent::~CudaEvent() {
  if (event_ != nullptr) (void)cudaEventDestroy(event_);
}

CudaEvent::CudaEvent(CudaEvent&& other) noexcept : event_(std::exchange(other.event_, nullptr)) {}

CudaEvent& CudaEvent::operator=(CudaEvent&& other) noexcept {
  if (this != &other) {
    if (event_ != nullptr) (void)cudaEventDestroy(event_);
    event_ = std::exchange(other.event_, nullptr);
  }
  return *this;
}

Status CudaEvent::Record(cudaStream_t stream) {
  return CudaStatus(cudaEventRecord(event_, stream), "cudaEventRecord");
}

Status CudaEvent::MakeStreamWait(cudaStream_t stream) const {
  return CudaStatus(cudaStreamWaitEvent(stream, event_, 0), "cudaStreamWaitEvent");
}

StatusOr<bool> CudaEvent::Done() const {
  const cudaError_t e = cudaEventQuery(event_);
  if (e == cudaErrorNotReady) {
    (void)cudaGetLastError();  // not ready is not an error
    return false;
  }
  DC_RETURN_IF_ERROR(CudaStatus(e, "cudaEventQuery"));
  return true;
}

Status CudaEvent::Synchronize() const {
  return CudaStatus(cudaEventSynchronize(event_), "cudaEventSynchronize");
}

StatusOr<float> CudaEvent::ElapsedMs(const CudaEvent& start, const CudaEvent& end) {
  float ms = 0;
  DC_RETURN_IF_ERROR(
      CudaStatus(cudaEventElapsedTime(&ms, start.event_, end.event_), "cudaEventElapsedTime"));
  return ms;
}

// ---------------------------------------------------------------------------------------------
// CudaStreamSet

StatusOr<CudaStreamSet> CudaStreamSet::Create() {
  int least = 0, greatest = 0;  // greatest is the numerically lowest, highest priority
  DC_RETURN_IF_ERROR(CudaStatus(cudaDeviceGetStreamPriorityRange(&least, &greatest),
                                "cudaDeviceGetStreamPriorityRange"));
  CudaStreamSet set;
  for (int i = 0; i < kNumStreams; ++i) {
    const auto stream = static_cast<proto::Stream>(i + 1);
    const bool collective = stream == proto::STREAM_GATHER || stream == proto::STREAM_REDUCE;
    DC_ASSIGN_OR_RETURN(set.streams_[i], CudaStream::Create(collective ? greatest : least));
  }
  return set;
}

cudaStream_t CudaStreamSet::get(proto::Stream stream) const {
  const int index = static_cast<int>(stream) - 1;
  if (index < 0 || index >= kNumStreams) return nullptr;
  return streams_[index].get();
}

Status CudaStreamSet::SynchronizeAll() const {
  for (int i = 0; i < kNumStreams; ++i) {
    DC_RETURN_IF_ERROR(streams_[i].Synchronize(std::string("synchronizing the ") +
                                               StreamName(static_cast<proto::Stream>(i + 1)) +
                                               " stream"));
  }
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------------
// Memory

StatusOr<DeviceBuffer> DeviceBuffer::Create(int64_t size_bytes, const std::string& what) {
  if (size_bytes < 0) return Status::Error(what + ": negative size " + std::to_string(size_bytes));
  if (size_bytes == 0) return DeviceBuffer();
  void* data = nullptr;
  DC_RETURN_IF_ERROR(CudaStatus(cudaMalloc(&data, static_cast<size_t>(size_bytes)),
                                what + ": cudaMalloc of " + FormatBytes(size_bytes)));
  return DeviceBuffer(data, size_bytes);
}

DeviceBuffer::~DeviceBuffer() {
  if (data_ != nullptr) (void)cudaFree(data_);
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_bytes_(std::exchange(other.size_bytes_, 0)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    if (data_ != nullptr) (void)cudaFree(data_);
    data_ = std::exchange(other.data_, nullptr);
    size_bytes_ = std::exchange(other.size_bytes_, 0);
  }
  return *this;
}

StatusOr<DeviceArena> DeviceArena::Create(int64_t size_bytes) {
  DC_ASSIGN_OR_RETURN(DeviceBuffer buffer, DeviceBuffer::Create(size_bytes, "device arena"));
  return DeviceArena(std::move(buffer));
}

StatusOr<void*> DeviceArena::Buffer(int64_t offset_bytes, int64_t size_bytes,
                                    const std::string& what) const {
  if (offset_bytes < 0 || size_bytes < 0 || offset_bytes > buffer_.size_bytes() ||
      size_bytes > buffer_.size_bytes() - offset_bytes) {
    return Status::Error(what + ": buffer at offset " + std::to_string(offset_bytes) + " of " +
                         std::to_string(size_bytes) + " bytes lies outside the arena of " +
                         std::to_string(buffer_.size_bytes()) +
                         " bytes; is the memory plan stale?");
  }
  if (offset_bytes % kAlignmentBytes != 0) {
    return Status::Error(what + ": buffer offset " + std::to_string(offset_bytes) +
                         " is not a multiple of " + std::to_string(kAlignmentBytes) + " bytes");
  }
  return static_cast<void*>(static_cast<char*>(buffer_.data()) + offset_bytes);
}

StatusOr<PinnedHostBuffer> PinnedHostBuffer::Create(int64_t size_bytes, const std::string& what) {
  if (size_bytes < 0) return Status::Error(what + ": negative size " + std::to_string(size_bytes));
  if (size_bytes == 0) return PinnedHostBuffer();
  void* data = nullptr;
  DC_RETURN_IF_ERROR(
      CudaStatus(cudaHostAlloc(&data, static_cast<size_t>(size_bytes), cudaHostAllocPortable),
                 what + ": cudaHostAlloc of " + FormatBytes(size_bytes) + " of pinned memory"));
  return PinnedHostBuffer(data, size_bytes);
}

PinnedHostBuffer::~PinnedHostBuffer() {
  if (data_ != nullptr) (void)cudaFreeHost(data_);
}

PinnedHostBuffer::PinnedHostBuffer(PinnedHostBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_bytes_(std::exchange(other.size_bytes_, 0)) {}

PinnedHostBuffer& PinnedHostBuffer::operator=(PinnedHostBuffer&& other) noexcept {
  if (this != &other) {
    if (data_ != nullptr) (void)cudaFreeHost(data_);
    data_ = std::exchange(other.data_, nullptr);
    size_bytes_ = std::exchange(other.size_bytes_, 0);
  }
  return *this;
}

Status CopyAsync(void* dst, const void* src, int64_t size_bytes, cudaStream_t stream,
                 const std::string& what) {
  if (size_bytes == 0) return Status::Ok();
  return CudaStatus(
      cudaMemcpyAsync(dst, src, static_cast<size_t>(size_bytes), cudaMemcpyDefault, stream),
      what + ": cudaMemcpyAsync of " + FormatBytes(size_bytes));
}

}  // namespace dc
