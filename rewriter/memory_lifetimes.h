// The device buffers of a schedule and their lifetimes, as the static memory plan packs them
// (rewriter/memory_packer.h). The buffer effects come from schemas/effects.h's BufferReplay;
// sizes are as schemas/program.h accounts them:
// - persistent fp32 shards of params, grads and optimizer state: instruction -1, micro-step -1,
//   alive the whole step; an offloaded shard from the start to its OFFLOAD, a reloaded one from
//   its RELOAD (instruction = the RELOAD, micro-step -1) to the end or its next OFFLOAD;
// - a gathered param from its ALL_GATHER (micro-step -2) to its RELEASE;
// - an activation, grad or input from the COMPUTE that first writes it (an input: the first
//   compute that reads it in the micro-step) to its RELEASE or OFFLOAD; a reloaded one from its
//   RELOAD. Anything never freed lives to the end of the step.
//
// Lifetimes are in instruction-index order (the executor issues instructions in index order): a
// buffer is held from the instruction that allocates it to the one that frees it, both
// inclusive, and two buffers share bytes only if one is freed at a smaller index than the other
// is allocated (no instruction both frees and allocates). ToSimulatedTimeAxis moves them onto
// an axis that also orders them in simulated time. Thread-safe (pure functions).
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "machine/simulator.h"
#include "schemas/program.h"
#include "schemas/status.h"

namespace dc {

// One device buffer and its lifetime in instruction-index order.
struct BufferLifetime {
  int instruction = -1;  // the instruction that allocates it; -1: persistent from start-up
  int tensor = -1;
  int micro_step = -1;   // -2 gathered param, -1 persistent / optimizer phase, -3 compute shard
  int alloc_index = -1;  // -1: before the first instruction
  int free_index = 0;    // the instruction count: after the last instruction
  int64_t size_bytes = 0;
};

// Every device buffer of `schedule`, in the order their allocations are replayed. Errors name
// the instruction and tensor when the stream is inconsistent (a release of something not live,
// a read of an activation that was never written, ...).
StatusOr<std::vector<BufferLifetime>> BufferLifetimes(const proto::Schedule& schedule);

// Moves lifetimes onto an axis that orders events by simulated time, then instruction index.
// A buffer is freed when its freeing instruction ends, and allocated when its allocating
// instruction starts or, if sooner, when any instruction issued after it frees something (so a
// buffer freed later in issue order never hands its bytes to one allocated earlier: that wait
// would point forwards). Two buffers then share bytes only if one is freed, in time and in issue
// order, before the other is allocated. Positions are ranks of those keys (-1 and the axis
// length keep meaning start-up and end of step); `instruction_at` maps a rank back. `sim` is
// the schedule's simulation.
Status ToSimulatedTimeAxis(const proto::Schedule& schedule, const SimResult& sim,
                           std::vector<BufferLifetime>* buffers, int* axis_length,
                           std::vector<int>* instruction_at);

// Most bytes live at once over `buffers` on an axis of `num_instructions` positions (instruction
// order, or ToSimulatedTimeAxis's ranks), and the first position where that happens (-1: before the
// first).
std::pair<int64_t, int> LivePeak(const std::vector<BufferLifetime>& buffers, int num_instructions);

}  // namespace dc
