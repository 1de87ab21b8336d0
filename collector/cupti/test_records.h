// Synthetic CUPTI activity records (CUDA 13 structs) for tests that run without a GPU: what
// CUPTI would hand the collector, built field by field.
#pragma once

#include <cupti_activity.h>

#include <cstdint>
#include <cstring>

namespace dc::cupti_testing {

// Zero-filled `Record` with its kind set.
template <typename Record>
Record Blank(CUpti_ActivityKind kind) {
  Record r;
  std::memset(&r, 0, sizeof(r));
  r.kind = kind;
  return r;
}

inline CUpti_ActivityKernel10 Kernel(const char* name, uint64_t start_ns, uint64_t end_ns,
                                     uint32_t correlation_id, uint32_t stream_id = 7) {
  auto r = Blank<CUpti_ActivityKernel10>(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
  r.name = name;
  r.start = start_ns;
  r.end = end_ns;
  r.deviceId = 0;
  r.contextId = 1;
  r.streamId = stream_id;
  r.correlationId = correlation_id;
  r.gridX = r.gridY = r.gridZ = 1;
  r.blockX = 128;
  r.blockY = r.blockZ = 1;
  r.registersPerThread = 32;
  r.gridId = correlation_id;
  return r;
}

inline CUpti_ActivityMemcpy6 Memcpy(uint8_t copy_kind, uint64_t bytes, uint64_t start_ns,
                                    uint64_t end_ns, uint32_t correlation_id) {
  auto r = Blank<CUpti_ActivityMemcpy6>(CUPTI_ACTIVITY_KIND_MEMCPY);
  r.copyKind = copy_kind;
  r.srcKind = copy_kind == CUPTI_ACTIVITY_MEMCPY_KIND_HTOD ? CUPTI_ACTIVITY_MEMORY_KIND_PINNED
                                                           : CUPTI_ACTIVITY_MEMORY_KIND_DEVICE;
  r.dstKind = copy_kind == CUPTI_ACTIVITY_MEMCPY_KIND_HTOD ? CUPTI_ACTIVITY_MEMORY_KIND_DEVICE
                                                           : CUPTI_ACTIVITY_MEMORY_KIND_PINNED;
  r.bytes = bytes;
  r.start = start_ns;
  r.end = end_ns;
  r.contextId = 1;
  r.streamId = 7;
  r.correlationId = correlation_id;
  return r;
}

inline CUpti_ActivityMemset4 Memset(uint64_t bytes, uint64_t start_ns, uint64_t end_ns,
                                    uint32_t correlation_id) {
  auto r = Blank<CUpti_ActivityMemset4>(CUPTI_ACTIVITY_KIND_MEMSET);
  r.value = 0;
  r.bytes = bytes;
  r.start = start_ns;
  r.end = end_ns;
  r.contextId = 1;
  r.streamId = 7;
  r.correlationId = correlation_id;
  r.memoryKind = CUPTI_ACTIVITY_MEMORY_KIND_DEVICE;
  return r;
}

inline CUpti_ActivityMemory4 Memory(bool alloc, uint64_t address, uint64_t bytes,
                                    uint64_t timestamp_ns, uint32_t correlation_id) {
  auto r = Blank<CUpti_ActivityMemory4>(CUPTI_ACTIVITY_KIND_MEMORY2);
  r.memoryOperationType = alloc ? CUPTI_ACTIVITY_MEMORY_OPERATION_TYPE_ALLOCATION
                                : CUPTI_ACTIVITY_MEMORY_OPERATION_TYPE_RELEASE;
  r.memoryKind = CUPTI_ACTIVITY_MEMORY_KIND_DEVICE;
  r.correlationId = correlation_id;
  r.address = address;
  r.bytes = bytes;
  r.timestamp = timestamp_ns;
  r.contextId = 1;
  return r;
}

inline CUpti_ActivityAPI Api(bool driver, CUpti_CallbackId cbid, uint64_t start_ns, uint64_t end_ns,
                             uint32_t correlation_id, uint32_t thread_id = 4242) {
  auto r =
      Blank<CUpti_ActivityAPI>(driver ? CUPTI_ACTIVITY_KIND_DRIVER : CUPTI_ACTIVITY_KIND_RUNTIME);
  r.cbid = cbid;
  r.start = start_ns;
  r.end = end_ns;
  r.threadId = thread_id;
  r.correlationId = correlation_id;
  return r;
}

inline CUpti_ActivityExternalCorrelation External(uint32_t correlation_id, int step,
                                                  int instruction) {
  auto r = Blank<CUpti_ActivityExternalCorrelation>(CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION);
  r.externalKind = CUPTI_EXTERNAL_CORRELATION_KIND_CUSTOM0;
  r.externalId = (static_cast<uint64_t>(step) << 32) | static_cast<uint32_t>(instruction);
  r.correlationId = correlation_id;
  return r;
}

inline const CUpti_Activity* AsRecord(const void* record) {
  return static_cast<const CUpti_Activity*>(record);
}

}  // namespace dc::cupti_testing
