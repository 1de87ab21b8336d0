// The invariants every schedule keeps after every pass: it has instructions, dependencies point
// backwards, every forward and backward op runs exactly once per micro-step and every optimizer
// op once, every buffer effect holds (schemas/effects.h: every param gathered before use and not
// released before its last use, nothing used after its release, ...), the plan's deps order
// every pair of those effects across streams (schemas/happens_before.h), and the simulated peak
// stays within the budget. It recomputes all of it: it trusts no simulation it is handed (the
// plan's SimulationCache, which it may take one from, is the simulator's own: no pass puts a
// result into it).
#pragma once

#include <cstdint>

#include "rewriter/pass.h"

namespace dc {

// A 64-bit fingerprint of every field of every instruction of `schedule`.
uint64_t InstructionsFingerprint(const proto::Schedule& schedule);

// `simulated`, when given, receives the simulation the check made or took from
// context.simulations (no memory timeline).
Status VerifySchedule(const proto::Schedule& schedule, const PassContext& context,
                      SimResult* simulated = nullptr);

}  // namespace dc
