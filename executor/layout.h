// What the schedule interpreter (executor/interpreter.h) derives from a plan before it touches a
// device: the streams' cross-stream waits, the size and dtype of every device buffer, the
// collective staging each stream needs, and the host memory for offloaded shards, the host
// optimizer and token inputs. Plain host code, checked and tested on any machine.
//
// Buffers as schemas/program.h accounts them, so sizes agree with the planner's memory plan:
// persistent fp32 shards of params, grads and optimizer state; a gathered param whole in the
// compute dtype; activations, grads and inputs in their own dtype.
//
// Sharding pads every tensor to world_size * shard elements. A backend that gathers and
// reduce-scatters in place (the cuda backend's NCCL calls) uses the whole tensor as the padded
// buffer when the element count divides by the world size (every real model's params);
// otherwise the collective goes through a staging buffer of the padded size, one per stream,
// sized here for the largest instruction.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <vector>

#include "schemas/float16.h"
#include "schemas/program.h"
#include "schemas/status.h"

namespace dc {

inline constexpr int kNumDeviceStreams = 5;  // proto::Stream values 1..5 (STREAM_HOST is 6)
// Index of a device stream (not STREAM_HOST) into per-stream arrays.
inline int DeviceStreamIndex(proto::Stream stream) { return static_cast<int>(stream) - 1; }

// Every staging region starts at a multiple of this (NCCL and the cuda vector kernels want
// aligned buffers; cuBLASLt's fastest kernels want 256 bytes, as the memory plan's offsets).
inline constexpr int64_t kStagingAlignmentBytes = 256;

struct BufferShape {
  proto::DType dtype = proto::DTYPE_F32;
  int64_t elements = 0;
  int64_t size_bytes = 0;
};

struct ScheduleLayout {
  int world_size = 1;
  // Per instruction: the earlier instructions on other streams it must wait for (its deps, plus
  // a reload's wait for the offload that filled its host copy). Same-stream deps are kept by
  // stream order and left out.
  std::vector<std::vector<int>> waits;
  // Per instruction: whether another stream waits for it (it records an event).
  std::vector<bool> records_event;
  // Per stream: bytes of collective staging (0 for most plans).
  std::array<int64_t, kNumDeviceStreams> staging_bytes{};
  // Offloaded and host-resident shards by tensor: bytes of host memory (pinned on cuda) each
  // needs.
  std::map<int, int64_t> host_shard_bytes;
  // By tensor: HostResidentTensors, kept in host memory for the whole run.
  std::vector<bool> host_resident;
  // Host bytes the largest host optimizer op needs for its grad shards (fp32) and, beside
  // them, its params' compute-dtype shards on their way back to the device.
  int64_t host_optimizer_staging_bytes = 0;
  // Input tensors (token ids) by tensor: bytes of one micro-batch.
  std::map<int, int64_t> input_bytes;
  int gas = 1;  // micro-steps per step
};

// Writes `elements` fp32 values as `dtype` (f32, bf16 or f16) into `out` (schemas/float16.h's
// rounding: the host optimizer's compute-dtype shards hold what the device's cast would).
void CastOnHost(const float* in, int64_t elements, proto::DType dtype, void* out);

// The fp32 shard of `tensor` (param, grad or optimizer state).
BufferShape ShardShape(const proto::Tensor& tensor, int world_size);
// A transient buffer of `tensor`: a gathered param in the compute dtype, else its own dtype.
BufferShape TransientShape(const proto::Program& program, const proto::Tensor& tensor);
// True when `tensor`'s collectives need staging (elements not a multiple of the world size).
bool NeedsStaging(const proto::Tensor& tensor, int world_size);
// Bytes of the staging region of one tensor in a collective: world * shard elements in `dtype`,
// aligned.
int64_t StagingBytes(const proto::Tensor& tensor, int world_size, proto::DType dtype);

// Derives the layout and checks what the interpreter relies on: every instruction on a known
// stream and compute instructions on the compute stream (the kernels of one step share one
// workspace and scratch) or, for an optimizer op, on the host, deps pointing to earlier
// instructions, and every reload preceded by an offload of the same tensor. The memory plan's
// placements are the plan validator's (schemas/plan_check.h), run before this. Messages name the
// instruction and say re-plan.
StatusOr<ScheduleLayout> MakeScheduleLayout(const proto::Schedule& schedule);

// What an evaluation pass (RunOptions::eval) runs: instructions [0, the returned count), the
// schedule's prefix up to and including micro-step 0's forward op that writes the loss. Running
// the plan's own instructions keeps an evaluation inside the plan's memory: every buffer goes to
// the place the memory plan gave it and the prefix's live bytes are the step's own at the same
// point. The prefix may gather, release, offload, reload and rename (the interpreter undoes what
// is left at its end); a backward or optimizer op, a reduce-scatter or another micro-step's
// forward op before the loss is refused (the prefix would not be micro-step 0's forward alone),
// naming the instruction. `schedule` must have passed MakeScheduleLayout.
StatusOr<int> EvaluationPrefix(const proto::Schedule& schedule);

}  // namespace dc
