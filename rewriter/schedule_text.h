// A compact text form of a schedule's instruction stream, one instruction a line, for
// --dump-after and for tests that write small schedules inline:
//
//   12: all_gather gather m0 [layers.0.attn.wq, layers.0.attn.wk] bucket=3
//   13: compute compute m0 layers.0.attn.q_proj deps=12
//   14: release compute m0 [layers.0.attn.wq] deps=13
//   90: compute compute opt adamw.layers.0.attn.wq deps=77
//
// Ops and tensors are named as in the program; `m<k>` is the micro-step, `opt` the optimizer
// phase. The leading index is optional when parsing and must match the position if present.
#pragma once

#include <string>

#include "schemas/program.h"
#include "schemas/status.h"

namespace dc {

std::string ScheduleToText(const proto::Schedule& schedule);

// Parses `text` against `schedule->program()` into schedule->instructions (replacing them).
// Errors name the line.
Status ParseScheduleText(const std::string& text, proto::Schedule* schedule);

}  // namespace dc
