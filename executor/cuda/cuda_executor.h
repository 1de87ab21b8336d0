// The cuda backend's schedule interpreter: one rank's run of a plan on its GPU.
//
// Each instruction is enqueued on the CUDA stream its plan names (instr.stream()), after waiting
// for the CUDA events of its dependencies on other streams (same-stream ones are kept by stream
// order); the host never waits inside a step, only at its end. Buffers live in one DeviceArena
// at the memory plan's offsets, or, without a memory plan, come from the stream-ordered pool
// (cudaMallocAsync on the allocating instruction's stream, cudaFreeAsync on the releasing one).
//
// Mixed precision as DeepSpeed's ZeRO-3 with bf16: params, grads and Adam states are fp32
// shards; an all-gather casts the shard to the compute dtype and gathers it (NCCL, in place);
// a reduce-scatter sums the compute-dtype grad over ranks (NCCL, in place) and accumulates this
// rank's chunk into the fp32 grad shard; AdamW runs on the fp32 shards. Offload and reload are
// asynchronous copies between a shard and its pinned host buffer on the d2h / h2d streams. The
// loss is summed on the device and read once per step. Tokens come from the same TokenSource and
// SampleIndex as the cpu backend, so the two backends' losses are comparable.
//
// Errors name the call, the instruction (DescribeInstruction) and the rank. A device failure
// that surfaces only at the step's end is reported there; with CudaRunOptions::synchronous
// (CUDA_LAUNCH_BLOCKING=1 for dc-run) every instruction is waited for and checked, so the one
// that failed is named. Not thread-safe: one host thread per rank.
#pragma once

#include "collector/cupti/cupti_collector.h"
#include "executor/cuda/nccl_comm.h"
#include "executor/executor.h"
#include "schemas/program.h"
#include "schemas/status.h"

namespace dc {

struct CudaRunOptions {
  // Wait for and check every instruction (slow; for finding the instruction that failed).
  bool synchronous = false;
};

// Runs `schedule` on the current CUDA device (UseCudaDevice first) with `comm` (created on the
// same device) and, when `tracer` is set and started, tags every launch with its instruction.
// The plan must be for the cuda backend and this world size (CheckRunnable). On any failure
// `comm` is aborted (NcclCommunicator::Abort), so the other ranks' collectives fail at once.
StatusOr<RunResult> RunScheduleOnCuda(const proto::Schedule& schedule, const RunOptions& options,
                                      const CudaRunOptions& cuda, NcclCommunicator* comm,
                                      CuptiCollector* tracer);

}  // namespace dc
