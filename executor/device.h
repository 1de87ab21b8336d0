// One rank's device as the schedule interpreter (executor/interpreter.h) drives it: the small
// interface every backend implements, and nothing of the schedule's meaning. The interpreter
// decides which buffer an instruction allocates, reads, frees and waits for
// (schemas/effects.h's rules); a device only places bytes, copies them, runs kernels and
// collectives in stream order, and keeps cross-stream order with events. The cpu backend
// (executor/cpu_device.h) enqueues each call on a host thread per stream; the cuda backend
// (executor/cuda/cuda_device_backend.h) enqueues it on the CUDA stream the call names.
//
// Streams: every call that takes a proto::Stream is ordered after the earlier calls on that
// stream. STREAM_HOST means "done when the call returns" (a synchronous copy or fill).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "executor/device_tensor.h"
#include "schemas/program.h"
#include "schemas/status.h"

namespace dc {

// What an op's kernels need beside their operands.
struct OpArgs {
  const proto::ModelConfig* config = nullptr;
  // Scale of the loss gradient: 1 / (tokens in the whole optimizer step over all ranks).
  double grad_scale = 1.0;
  int64_t adam_step = 1;  // 1-based optimizer step, for Adam's bias correction
  double lr_scale = 1.0;  // the schedule's factor on the AdamW ops' lr (LearningRateScale)
};

// One param of a grouped all-gather: this rank's shard (the fp32 master, or the compute-dtype
// shard where the plan keeps one) gathered over the ranks into `whole` (the param, stored in the
// compute dtype). Rank r's chunk is elements [r * shard_elements, (r + 1) * shard_elements) of
// the param padded to world * shard_elements.
struct GatherItem {
  const proto::Tensor* tensor = nullptr;
  DeviceTensor shard;  // 1-D, shard_elements
  DeviceTensor whole;  // the param's shape
  int64_t shard_elements = 0;
};

// One grad of a grouped reduce-scatter: `grad` (whole, its stored dtype) summed over the ranks,
// and this rank's chunk added to `shard` (the fp32 grad accumulator).
struct ReduceScatterItem {
  const proto::Tensor* tensor = nullptr;
  DeviceTensor grad;
  DeviceTensor shard;  // 1-D fp32, shard_elements
  int64_t shard_elements = 0;
};

// Host memory the device copies to and from (pinned on cuda).
class HostBuffer {
 public:
  virtual ~HostBuffer() = default;
  virtual void* data() = 0;
  virtual int64_t size_bytes() const = 0;
};

struct ScheduleLayout;

class RankDevice {
 public:
  virtual ~RankDevice() = default;

  // The dtype a buffer of `dtype` is stored in here (the cpu backend keeps every float in fp32).
  virtual proto::DType StorageDType(proto::DType dtype) const = 0;

  // Start-up, before any other call: what the device needs for this schedule (streams, events,
  // scratch, staging).
  virtual Status Prepare(const proto::Schedule& schedule, const ScheduleLayout& layout) = 0;

  // Memory. After CreateArena, Allocate places a buffer at `arena_offset_bytes` inside the arena
  // (the memory plan checked that it fits); without one it takes `bytes` from the device's
  // allocator, ordered on `stream`. Free returns what Allocate took.
  virtual Status CreateArena(int64_t bytes) = 0;
  // `what` names the instruction (or start-up) and `tensor` the buffer, for errors only.
  virtual StatusOr<void*> Allocate(int64_t arena_offset_bytes, int64_t bytes, proto::Stream stream,
                                   const std::string& what, const std::string& tensor) = 0;
  virtual Status Free(void* data, proto::Stream stream, const std::string& what,
                      const std::string& tensor) = 0;
  virtual StatusOr<std::unique_ptr<HostBuffer>> AllocateHost(int64_t bytes,
                                                             const std::string& what) = 0;

  // Copies and fills of `bytes`.
  virtual Status CopyToDevice(void* device, const void* host, int64_t bytes, proto::Stream stream,
                              const std::string& what) = 0;
  virtual Status CopyToHost(void* host, const void* device, int64_t bytes, proto::Stream stream,
                            const std::string& what) = 0;
  virtual Status CopyOnDevice(void* to, const void* from, int64_t bytes, proto::Stream stream,
                              const std::string& what) = 0;
  virtual Status Zero(void* device, int64_t bytes, proto::Stream stream,
                      const std::string& what) = 0;
  // `to` = `from` elementwise in `to`'s dtype (same element count).
  virtual Status Cast(const DeviceTensor& from, const DeviceTensor& to, proto::Stream stream,
                      const std::string& what) = 0;

  // Checkpoint snapshots (TrainingState::StartSnapshot), between steps. SnapshotToHost copies
  // `bytes` of a persistent shard into `host` (AllocateHost's memory) after all the work issued
  // so far; a device that can copies asynchronously (cuda: on the d2h stream, after an event on
  // the compute stream), so neither the host nor the compute stream waits for it. EndSnapshot,
  // after a snapshot's last copy, gives a function that blocks, on any thread, until every copy
  // is in host memory (and says if one failed); it may be called until the next snapshot
  // begins. WaitForSnapshot orders the next work on `stream` after the last snapshot's copies:
  // the interpreter calls it before the next step writes or frees a persistent shard (the
  // optimizer's in-place update, an offload). The cpu device's copies are done when
  // SnapshotToHost returns.
  virtual Status SnapshotToHost(void* host, const void* device, int64_t bytes,
                                const std::string& what) = 0;
  virtual StatusOr<std::function<Status()>> EndSnapshot(const std::string& what) = 0;
  virtual Status WaitForSnapshot(proto::Stream stream, const std::string& what) = 0;

  // Grouped collectives over the ranks, one call for all items.
  virtual Status AllGather(std::span<const GatherItem> items, proto::Stream stream,
                           const std::string& what) = 0;
  virtual Status ReduceScatterAdd(std::span<const ReduceScatterItem> items, proto::Stream stream,
                                  const std::string& what) = 0;
  // `values` (fp32, small: the grads' squared norm) summed over the ranks in place; nothing to do
  // in a world of one.
  virtual Status AllReduceSum(const DeviceTensor& values, proto::Stream stream,
                              const std::string& what) = 0;

  // Runs `op` on the compute stream with operands in the op's own order (schemas/op_kinds.h).
  // Outputs are allocated and overwritten; optimizer ops update their inputs in place.
  virtual Status RunOp(const proto::Op& op, std::span<DeviceTensor> inputs,
                       std::span<DeviceTensor> outputs, const OpArgs& args) = 0;
  // Adds a loss term (an fp32 [1] tensor) to the step's loss sum, on the compute stream.
  virtual Status AddLoss(const DeviceTensor& term) = 0;

  // Cross-stream order: instruction `index` records its event on `stream` for later waiters;
  // before instruction `index`, `stream` (or, with STREAM_HOST, the host) waits for the event of
  // instruction `dep`. These run for every instruction, so they take indices, not messages: a
  // device names the instruction (DescribeInstruction) only when something fails.
  virtual Status Record(int index, proto::Stream stream) = 0;
  virtual Status Wait(int index, int dep, proto::Stream stream) = 0;
  // After each instruction's issue (a debugging mode may wait for it and check it there).
  virtual Status AfterInstruction(int index, proto::Stream stream) = 0;
  // Makes the compute stream wait for every other stream.
  virtual Status JoinStreams(const std::string& what) = 0;
  // The end of a step, after JoinStreams: waits for the device, checks what only the device
  // saw, and returns the step's loss sum (then zero). `step` -1: the end of an evaluation pass
  // (executor.h's EvalOptions), of which a device's trace keeps nothing.
  virtual StatusOr<double> FinishStep(int step) = 0;
  // Waits for every stream (start-up, shut-down).
  virtual Status Synchronize(const std::string& what) = 0;
  // After a failure, before the interpreter waits for the device: makes the other ranks'
  // collectives fail at once and this device's work waiting on them end.
  virtual void Abort() = 0;
};

}  // namespace dc
