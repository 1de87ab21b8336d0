// The cuda backend's run of a plan: the one interpreter (executor/interpreter.h) over this rank's
// GPU as a RankDevice (executor/device.h).
//
// Each instruction is enqueued on the CUDA stream its plan names, after waiting for the CUDA
// events of its dependencies on other streams (same-stream ones are kept by stream order); the
// host never waits inside a step except for the host optimizer's inputs, and at its end. Buffers
// live in one DeviceArena at the memory plan's offsets, or, without a memory plan, come from the
// stream-ordered pool (cudaMallocAsync on the allocating instruction's stream, cudaFreeAsync on
// the releasing one). Gathers and reduce-scatters are grouped NCCL calls, in place (through a
// per-stream staging buffer where a tensor's elements do not divide by the world size); offload
// and reload are asynchronous copies to pinned host memory on the d2h / h2d streams. The loss is
// summed on the device and read once per step.
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

// The kernel scratch one rank of `schedule` needs: the largest CudaScratchBytes of its compute
// instructions, sized from the operands' shapes before any buffer exists (host only). Errors name
// the instruction, as a run's would.
StatusOr<int64_t> KernelScratchBytes(const proto::Schedule& schedule, int rank);

}  // namespace dc
