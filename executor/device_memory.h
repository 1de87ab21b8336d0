// Device memory accounting for a backend with a capacity: every buffer is allocated and freed
// through here, by kind, so a run knows its live and peak bytes and fails like an
// out-of-memory error when it would go over. Not thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "schemas/program.h"
#include "schemas/status.h"

namespace dc {

class DeviceMemory {
 public:
  explicit DeviceMemory(int64_t capacity_bytes) : capacity_bytes_(capacity_bytes) {}

  // `what` names the instruction for the error ("instruction 37 (all_gather layers.0.wq)").
  Status Allocate(BufferKind kind, int64_t bytes, const std::string& what);
  void Free(BufferKind kind, int64_t bytes);

  int64_t capacity_bytes() const { return capacity_bytes_; }
  int64_t live_bytes() const { return live_bytes_; }
  int64_t peak_bytes() const { return peak_bytes_; }
  const std::vector<int64_t>& live_by_kind() const { return live_by_kind_; }
  const std::vector<int64_t>& peak_by_kind() const { return peak_by_kind_; }

 private:
  int64_t capacity_bytes_;  // 0 = unlimited
  int64_t live_bytes_ = 0;
  int64_t peak_bytes_ = 0;
  std::vector<int64_t> live_by_kind_ = std::vector<int64_t>(kNumBufferKinds, 0);
  std::vector<int64_t> peak_by_kind_ = std::vector<int64_t>(kNumBufferKinds, 0);
};

}  // namespace dc
