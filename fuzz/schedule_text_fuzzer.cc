// The schedule text form's parser (rewriter/schedule_text.h) against the tiny model's program with
// one layer: any text is parsed; what parses is printed and parsed again, which must give the same
// instructions, and is validated as a plan would be (schemas/plan_check.h). A refusal is fine; a
// crash, a sanitizer report or a round trip that changes the schedule is a finding.
#include <cstddef>
#include <cstdint>
#include <string>

#include "models/model.h"
#include "rewriter/schedule_text.h"
#include "schemas/plan_check.h"

namespace {

const dc::proto::Schedule& Empty() {
  static const dc::proto::Schedule schedule = [] {
    dc::ModelOverrides overrides;
    overrides.layers = 1;
    overrides.gas = 2;
    auto config = dc::MakeConfig("tiny", overrides);
    if (!config.ok()) __builtin_trap();
    auto program = dc::BuildProgram(*config);
    if (!program.ok()) __builtin_trap();
    dc::proto::Schedule s;
    s.set_world_size(2);
    s.set_backend("cpu");
    *s.mutable_program() = *program;
    return s;
  }();
  return schedule;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  dc::proto::Schedule schedule = Empty();
  if (!dc::ParseScheduleText(text, &schedule).ok()) return 0;
  dc::proto::Schedule again = Empty();
  if (!dc::ParseScheduleText(dc::ScheduleToText(schedule), &again).ok()) __builtin_trap();
  if (again.instructions_size() != schedule.instructions_size()) __builtin_trap();
  for (int i = 0; i < schedule.instructions_size(); ++i) {
    if (again.instructions(i).SerializeAsString() != schedule.instructions(i).SerializeAsString()) {
      __builtin_trap();
    }
  }
  (void)dc::ValidatePlan(schedule);
  return 0;
}
