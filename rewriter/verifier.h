// The invariants every schedule keeps after every pass: dependencies point backwards, every
// forward and backward op runs exactly once per micro-step and every optimizer op once, every
// param is gathered before use and not released before its last use, nothing is used after its
// release, and the simulated peak stays within the budget.
#pragma once

#include "rewriter/pass.h"

namespace dc {

// `simulated`, when given, receives the simulation the check made (peak only, no timeline), or
// PassContext::input_simulation when the caller gave one (then it is not simulated again).
Status VerifySchedule(const proto::Schedule& schedule, const PassContext& context,
                      SimResult* simulated = nullptr);

}  // namespace dc
