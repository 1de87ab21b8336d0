// verifier_bench: what the happens-before check (schemas/happens_before.h) adds to the verifier
// that runs after every pass, and to a plan's validation on load, on one plan file.
//
//   verifier_bench PLAN [ROUNDS]
//
// Each round times, one after another (so a busy machine slows all alike): the verifier
// (VerifySchedule, simulating, no memo: as after a pass that changed instructions), the
// happens-before check alone (and on the plan without its memory plan, as every pass before
// memory-plan sees it), the issue-order buffer replay alone (what the check replays on top
// of), and ValidatePlan (dc-run's check on load), in the thread's CPU seconds. Prints each step's
// median and the check's share.
// Make a big plan with e.g. `dc-plan --synthetic --model llama3-405b --world 64 --hardware
// h100-sxm --gpus-per-node 8 --gas 4 -o big.dcplan`.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <functional>
#include <string>
#include <vector>

#include "rewriter/verifier.h"
#include "schemas/effects.h"
#include "schemas/happens_before.h"
#include "schemas/plan_check.h"
#include "schemas/plan_file.h"

namespace {

constexpr int kDefaultRounds = 5;

// CPU seconds of this thread: on a shared machine, the time others' processes hold the core is
// left out (cache contention is not).
double ThreadSeconds() {
  timespec now{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &now);
  return static_cast<double>(now.tv_sec) + 1e-9 * static_cast<double>(now.tv_nsec);
}

double Seconds(const std::function<dc::Status()>& step, bool* ok) {
  const double start = ThreadSeconds();
  const dc::Status status = step();
  const double seconds = ThreadSeconds() - start;
  if (!status.ok()) {
    std::fprintf(stderr, "verifier_bench: %s\n", status.message().c_str());
    *ok = false;
  }
  return seconds;
}

double Median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: verifier_bench PLAN [ROUNDS]\n");
    return 2;
  }
  const int rounds = argc > 2 ? std::max(1, std::atoi(argv[2])) : kDefaultRounds;
  auto plan = dc::LoadPlan(argv[1]);
  if (!plan.ok()) {
    std::fprintf(stderr, "verifier_bench: %s: %s\n", argv[1], plan.status().message().c_str());
    return 1;
  }
  const dc::PassContext context{};
  // The passes before memory-plan see no memory plan: the check without its arena part.
  dc::proto::Schedule unplaced = *plan;
  unplaced.clear_memory_plan();
  std::vector<double> verify, order, order_unplaced, replay, validate;
  bool ok = true;
  for (int r = 0; r < rounds && ok; ++r) {
    verify.push_back(Seconds([&] { return dc::VerifySchedule(*plan, context); }, &ok));
    order.push_back(Seconds([&] { return dc::CheckHappensBefore(*plan); }, &ok));
    order_unplaced.push_back(Seconds([&] { return dc::CheckHappensBefore(unplaced); }, &ok));
    replay.push_back(Seconds([&] { return dc::BufferReplay(*plan, nullptr).Run(); }, &ok));
    validate.push_back(Seconds([&] { return dc::ValidatePlan(*plan); }, &ok));
  }
  if (!ok) return 1;
  const double v = Median(verify), o = Median(order), b = Median(replay), p = Median(validate);
  std::printf("plan %s: %d instructions, %d rounds (medians)\n", argv[1], plan->instructions_size(),
              rounds);
  std::printf("verifier (with the check)      %.4f s\n", v);
  std::printf("happens-before check alone     %.4f s\n", o);
  std::printf("verifier without it (diff)     %.4f s; the check adds %.1f%%\n", v - o,
              100.0 * o / std::max(1e-9, v - o));
  std::printf("the check without the memory plan %.4f s (%d placements in the plan)\n",
              Median(order_unplaced), plan->memory_plan().placements_size());
  std::printf("issue-order replay alone       %.4f s\n", b);
  std::printf("ValidatePlan (with the check)  %.4f s; the check is %.1f%% of it\n", p,
              100.0 * o / std::max(1e-9, p));
  return 0;
}
