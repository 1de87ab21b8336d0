// Plans the tiny model on two simulated cpu ranks through the installed dc libraries.
#include <cstdio>

#include "machine/estimate.h"
#include "machine/hardware.h"
#include "models/model.h"
#include "rewriter/planner.h"

int main() {
  auto config = dc::MakeConfig("tiny", {});
  auto program = dc::BuildProgram(*config);
  auto hw = dc::FindHardware("cpu");
  auto cluster = dc::MakeCluster(2, 2);
  if (!program.ok() || !hw.ok() || !cluster.ok()) return 1;
  dc::PlanRequest request;
  request.program = *program;
  request.world_size = 2;
  request.costs = dc::EstimateCostModel(*program, *hw, *cluster);
  auto plan = dc::MakePlan(request);
  if (!plan.ok()) {
    std::fprintf(stderr, "%s\n", plan.status().message().c_str());
    return 1;
  }
  std::printf("planned %d instructions\n", plan->instructions_size());
  return 0;
}
