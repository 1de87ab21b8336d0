// The one interpreter of a plan's schedule: one rank's run of every instruction, step after
// step, over a RankDevice (executor/device.h). It owns what an instruction means: which buffer
// each instruction allocates, reads, frees and renames (keyed as schemas/effects.h keys them),
// where the memory plan places it, the memory accounting against the capacity, the shards'
// host copies, the host optimizer, token inputs, the loss, the end-of-step checks and the params
// digest. A device only moves bytes and runs kernels; the cpu and cuda backends differ in
// nothing else.
//
// Each instruction is issued on the stream its plan names after waiting for its dependencies on
// other streams (ScheduleLayout::waits); the host waits inside a step only for the host
// optimizer's inputs, and at the step's end. Mixed precision as DeepSpeed's ZeRO-3: params,
// grads and Adam states are fp32 shards; a gather moves the param in the compute dtype (from a
// compute-dtype shard where the plan keeps one); a reduce-scatter sums the grad in its dtype
// and adds this rank's chunk to the fp32 grad shard. Errors name the instruction and the rank
// (DescribeInstruction). Not thread-safe: one host thread per rank.
#pragma once

#include <memory>

#include "executor/comm.h"
#include "executor/device.h"
#include "executor/executor.h"
#include "executor/tracer.h"
#include "schemas/program.h"
#include "schemas/status.h"

namespace dc {

// Runs `schedule` on `device` (the rank of `comm`), tracing into `tracer` when given. The plan
// must pass CheckRunnable for the device's backend first.
StatusOr<RunResult> Interpret(const proto::Schedule& schedule, const RunOptions& options,
                              RankDevice* device, Communicator* comm, ExecutionTracer* tracer);

}  // namespace dc
