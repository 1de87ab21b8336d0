// The invariants every schedule keeps after every pass: it has instructions, dependencies point
// backwards, every forward and backward op runs exactly once per micro-step and every optimizer
// op once, every buffer effect holds (schemas/effects.h: every param gathered before use and not
// released before its last use, nothing used after its release, ...), the plan's deps order
// every pair of those effects across streams (schemas/happens_before.h), and the simulated peak
// stays within the budget. It recomputes all of it: it trusts no simulation it is handed.
#pragma once

#include <cstdint>
#include <optional>

#include "rewriter/pass.h"

namespace dc {

// What the verifier keeps between its checks in one pipeline run (PassContext::verifier_memo):
// its own last simulation and a fingerprint of the instructions it simulated. A check of a
// schedule whose instructions are identical (same fingerprint, same cost model) takes that
// simulation instead of simulating again; a simulation a pass made is never taken. One per run.
struct VerifierMemo {
  uint64_t fingerprint = 0;
  const CostModel* costs = nullptr;
  std::optional<SimResult> simulation;
};

// A 64-bit fingerprint of every field of every instruction of `schedule`.
uint64_t InstructionsFingerprint(const proto::Schedule& schedule);

// `simulated`, when given, receives the simulation the check made or took from the memo (no
// memory timeline).
Status VerifySchedule(const proto::Schedule& schedule, const PassContext& context,
                      SimResult* simulated = nullptr);

}  // namespace dc
