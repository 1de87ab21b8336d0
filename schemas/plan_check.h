// What every reader of a plan may rely on, checked in one place: the plan file's reader
// (schemas/plan_file.h) runs it after the digest check, a backend's CheckRunnable
// (executor/executor.h) before it allocates anything, and the simulator may take a plan that
// passed it. A digest guards against accidents, not against a plan from another build or a
// hostile hand (anyone can recompute an unkeyed SHA-256): nothing in a plan is trusted before
// this passes.
#pragma once

#include <cstdint>

#include "schemas/program.h"
#include "schemas/status.h"

namespace dc {

// Every memory-plan offset is a multiple of this (cuBLASLt's fastest kernels and NCCL want 256-byte
// aligned buffers; the memory-plan pass places at this alignment).
inline constexpr int64_t kPlacementAlignmentBytes = 256;

struct PlanLimits {
  // Bytes one rank may hold (0: no bound): the memory plan's arena and the peak of the plan's
  // live buffers (schemas/effects.h's accounting) must fit. A run on the cpu backend passes this
  // host's physical memory, so a plan that cannot fit is refused in milliseconds, not by the
  // kernel's OOM killer.
  int64_t memory_bytes = 0;
};

// Checks, in this order, and stops at the first failure:
//  - the world size (at least 1) and the model config (ValidateConfig);
//  - the program (ValidateProgram) and its shapes against the config: every input tensor is
//    int32 [micro_batch, seq], every embedding table has `vocab` rows;
//  - every instruction's references (CheckReferences: kind, stream, deps, op and tensor ids) and
//    micro-step (-1 or below the config's gas);
//  - the memory plan: arena_bytes not negative; every placement's instruction, tensor and
//    micro-step known, its offset aligned and not negative, and its buffer inside the arena
//    (checked without overflow);
//  - every buffer effect (BufferReplay), the order of the grads' norm and its all-reduce
//    (CheckShardReductions), the order of every pair of effects on one buffer or arena range
//    across streams (CheckHappensBefore), and the arena and the peak of live bytes within
//    `limits`.
// The message says what is wrong, without a remedy: callers name the file and add
// "re-plan with dc-plan".
Status ValidatePlan(const proto::Schedule& schedule, const PlanLimits& limits = {});

// This host's physical memory in bytes (0 when unknown).
int64_t PhysicalMemoryBytes();

}  // namespace dc
