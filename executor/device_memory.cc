#include "executor/device_memory.h"

#include "schemas/units.h"

namespace dc {

Status DeviceMemory::Allocate(BufferKind kind, int64_t bytes, const std::string& what) {
  if (capacity_bytes_ > 0 && live_bytes_ + bytes > capacity_bytes_) {
    std::string by_kind;
    for (int k = 0; k < kNumBufferKinds; ++k) {
      if (live_by_kind_[k] == 0) continue;
      by_kind += (by_kind.empty() ? "" : ", ") +
                 std::string(BufferKindName(static_cast<BufferKind>(k))) + " " +
                 FormatBytes(live_by_kind_[k]);
    }
    return Status::Error("out of device memory at " + what + ": asked for " + FormatBytes(bytes) +
                         " with " + FormatBytes(live_bytes_) + " of " +
                         FormatBytes(capacity_bytes_) + " in use (" + by_kind +
                         "); raise --device-memory or plan with a lower --budget");
  }
  live_bytes_ += bytes;
  live_by_kind_[static_cast<int>(kind)] += bytes;
  if (live_bytes_ > peak_bytes_) {
    peak_bytes_ = live_bytes_;
    peak_by_kind_ = live_by_kind_;
  }
  return Status::Ok();
}

void DeviceMemory::Free(BufferKind kind, int64_t bytes) {
  live_bytes_ -= bytes;
  live_by_kind_[static_cast<int>(kind)] -= bytes;
}

}  // namespace dc
