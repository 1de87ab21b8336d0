// The invariants every schedule keeps after every pass: it has instructions, dependencies point
// backwards, every forward and backward op runs exactly once per micro-step and every optimizer
// op once, every buffer effect holds (schemas/effects.h: every param gathered before use and not
// released before its last use, nothing used after its release, ...), and the simulated peak
// stays within the budget. It recomputes all of it: it trusts no simulation it is handed.
#pragma once

#include "rewriter/pass.h"

namespace dc {

// `simulated`, when given, receives the simulation the check made (no memory timeline).
Status VerifySchedule(const proto::Schedule& schedule, const PassContext& context,
                      SimResult* simulated = nullptr);

}  // namespace dc
