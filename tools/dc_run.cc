// dc-run: train by a plan with the lean executor.
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>

#include "executor/backends.h"
#include "executor/launch.h"
#include "executor/session.h"
#include "schemas/files.h"
#include "schemas/plan_file.h"
#include "schemas/units.h"
#include "tools/cli.h"

int main(int argc, char** argv) {
  using namespace dc;
  CLI::App app{
      "dc-run: train by a plan file with the lean executor (cpu: fp32 math and Gloo collectives; "
      "cuda: cuBLASLt, own kernels and NCCL on streams).\n"
      "Example: dc-run plan.dcplan --steps 20 --nproc 2 --json",
      "dc-run"};
  std::string plan_path, trace_out, rendezvous, backend = "auto";
  int steps = 20, warmup = 0, nproc = 0, timeout_s = 60;
  int64_t device_memory = 0;
  bool json = false, quiet = false;
  app.add_option("plan", plan_path, "plan file written by dc-plan")
      ->required()
      ->check(cli::NonEmptyPath());
  app.add_option("--steps", steps, "optimizer steps to train")
      ->check(CLI::Range(1, 100000000))
      ->capture_default_str();
  app.add_option("--warmup", warmup,
                 "steps run first and left out of the losses, timings and profile")
      ->check(CLI::Range(0, 1000000))
      ->capture_default_str();
  app.add_option("--nproc", nproc,
                 "ranks to start on this machine (default: the plan's world size)")
      ->check(CLI::Range(1, 256));
  app.add_option("--backend", backend,
                 "auto (cuda when a GPU is present, else cpu), cpu or cuda; "
                 "must match the plan's backend")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}))
      ->capture_default_str();
  cli::AddBytesOption(
      app, "--device-memory", &device_memory,
      "device memory capacity per rank, e.g. 1GiB (default: unlimited; on cuda, the "
      "device's own memory)");
  app.add_option("--trace", trace_out, "also record a trace of the run to this file")
      ->check(cli::NonEmptyPath());
  app.add_option("--rendezvous", rendezvous,
                 "shared directory for ranks started by an outside launcher");
  app.add_option("--timeout", timeout_s, "seconds to wait for other ranks")
      ->check(CLI::Range(1, cli::kMaxTimeoutSeconds))
      ->capture_default_str();
  app.add_flag("--json", json,
               "print one JSON object (losses, step_seconds_median, tokens_per_second, ...)");
  app.add_flag("--quiet", quiet, "no per-step lines, only the summary");
  if (std::optional<int> exit_code = cli::Parse(app, argc, argv)) return *exit_code;
  if (Status distinct = CheckOutputIsNotAnInput(trace_out, {plan_path}); !distinct.ok()) {
    return cli::Fail("dc-run", distinct);
  }

  if (IsRankProcess()) {  // the launcher's variables are read, and checked, before anything else
    auto env = RankEnvFromEnvironment(rendezvous);
    if (!env.ok()) return cli::Fail("dc-run", env.status());
    if (Status s = CheckNprocAgainstEnvironment(nproc, *env); !s.ok()) {
      return cli::Fail("dc-run", s);
    }
  }
  auto plan = LoadPlan(plan_path);
  if (!plan.ok()) return cli::Fail("dc-run", plan.status());
  // Decided before any rank starts, so a plan for the other backend is one line, not N.
  const BackendAvailability available = AvailableBackends();
  auto chosen = ResolveBackend(backend, available, "dc-run");
  if (!chosen.ok()) return cli::Fail("dc-run", chosen.status());
  const Status matches = CheckPlanBackend(plan_path, *plan, *chosen, backend, available);
  if (!matches.ok()) return cli::Fail("dc-run", matches);
  if (!IsRankProcess()) {
    const int world = nproc > 0 ? nproc : plan->world_size();
    if (world != plan->world_size()) {
      return cli::Fail("dc-run", Status::Error(plan_path + ": planned for " +
                                               std::to_string(plan->world_size()) +
                                               " rank(s), not --nproc " + std::to_string(world) +
                                               "; re-plan with dc-plan or drop --nproc"));
    }
    if (world > 1) {
      LaunchOptions launch;
      launch.nproc = world;
      launch.program = "dc-run";
      return LaunchLocal(launch, cli::Args(argc, argv));
    }
  }
  auto rank_backend = MakeBackend(*chosen);
  if (!rank_backend.ok()) return cli::Fail("dc-run", rank_backend.status());
  SessionOptions session;
  session.backend = rank_backend->get();
  session.run.steps = steps;
  session.run.warmup_steps = warmup;
  session.run.device_memory_bytes = device_memory;
  session.trace_path = trace_out;
  session.rendezvous_flag = rendezvous;
  session.timeout = std::chrono::seconds(timeout_s);
  if (!json && !quiet) {
    session.run.on_step = [&](int step, double loss, double seconds) {
      std::printf("step %3d  loss %.5f  %.3f s\n", step + 1, loss, seconds);
      std::fflush(stdout);
    };
  }
  auto result = RunAsRank(*plan, session);
  if (!result.ok()) return cli::Fail("dc-run", result.status().Prefixed(plan_path + ": "));
  if (result->env.rank != 0) return 0;
  const RunResult& run = result->run;
  if (json) {
    nlohmann::json j;
    j["plan"] = plan_path;
    j["losses"] = run.losses;
    j["step_seconds"] = run.step_seconds;
    j["step_seconds_median"] = run.step_seconds_median;
    j["tokens_per_second"] = run.tokens_per_second;
    j["peak_device_bytes"] = run.peak_device_bytes;
    j["peak_live_bytes"] = run.peak_live_bytes;
    j["arena_bytes"] = run.arena_bytes;
    j["params_digest"] = run.params_digest;
    j["predicted_step_seconds"] = plan->prediction().step_seconds();
    j["predicted_peak_device_bytes"] = plan->prediction().peak_device_bytes();
    j["world_size"] = run.world_size;
    j["backend"] = *chosen;
    if (result->trace) j["trace"] = trace_out;
    std::cout << j.dump() << "\n";
  } else {
    std::printf(
        "%d step(s) on %d %s rank(s): median %.4f s/step, %.0f tokens/s, peak %s per rank "
        "(predicted %.4f s, %s)\n",
        steps, run.world_size, chosen->c_str(), run.step_seconds_median, run.tokens_per_second,
        FormatBytes(run.peak_device_bytes).c_str(), plan->prediction().step_seconds(),
        FormatBytes(plan->prediction().peak_device_bytes()).c_str());
  }
  return 0;
}
