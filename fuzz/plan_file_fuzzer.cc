// The plan-file reader (schemas/plan_file.h) and everything a plan reaches after it. The first
// byte picks the mode:
//   0  the rest is a plan file as written: the header checks (magic, sizes, digest) come first;
//   1  the rest is a Schedule's payload: it is framed with its digests recomputed (as anyone can),
//      so every mutation gets past the digest into validation (schemas/plan_check.h), and a plan
//      that passes and is small runs one step on the cpu backend (world of one, a capped device
//      memory): where a plan's bad indices, offsets and shapes once wrote out of bounds.
// A refusal is fine; a crash, a sanitizer report or a hang is a finding.
#include <google/protobuf/stubs/logging.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "executor/executor.h"
#include "schemas/plan_file.h"

namespace {

// What one run may use, so that a plan that passes validation cannot make the run slow.
constexpr int kMaxInstructions = 4000;
constexpr int64_t kDeviceMemoryBytes = 64 << 20;

dc::Communicator* WorldOfOne() {
  static std::unique_ptr<dc::Communicator> comm = [] {
    auto made = dc::Connect(dc::RendezvousOptions{});
    if (!made.ok()) __builtin_trap();
    return std::move(*made);
  }();
  return comm.get();
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // Mutated strings are often not UTF-8: protobuf's log line for each is noise here.
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const std::string rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (data[0] % 2 == 0) {
    (void)dc::ParsePlan(rest, "fuzz.dcplan");
    return 0;
  }
  dc::proto::Schedule schedule;
  if (!schedule.ParseFromString(rest)) return 0;
  schedule.set_world_size(1);
  schedule.set_backend("cpu");
  auto plan = dc::ParsePlan(dc::SerializePlan(schedule), "fuzz.dcplan");
  if (!plan.ok() || plan->instructions_size() > kMaxInstructions) return 0;
  dc::RunOptions options;
  options.steps = 1;
  options.device_memory_bytes = kDeviceMemoryBytes;
  (void)dc::RunSchedule(*plan, options, WorldOfOne(), nullptr);
  return 0;
}
