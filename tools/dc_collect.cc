// dc-collect: run training steps of a model under the backend's tracer (the host tracer on
// cpu, the in-process CUPTI collector on cuda) and write one trace.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <nlohmann/json.hpp>

#ifdef DC_HAVE_CUPTI_ATTACH
#include "collector/cupti/attach.h"
#endif
#include "executor/backends.h"
#include "executor/cpu_kernels.h"
#include "executor/cpu_simd.h"
#include "executor/data.h"
#include "executor/launch.h"
#include "executor/session.h"
#include "rewriter/planner.h"
#include "schemas/files.h"
#include "schemas/plan_check.h"
#include "tools/cli.h"

int main(int argc, char** argv) {
  using namespace dc;
  CLI::App app{
      "dc-collect: run training steps of a model under a profiler and record kernels, "
      "collectives and every allocation into one SQLite trace (Nsight Systems' schema).\n"
      "Example: dc-collect --model tiny --nproc 2 --steps 5 --warmup 1 -o trace.db",
      "dc-collect"};
  cli::ModelFlags model;
  model.Add(app);
  int nproc = 1, steps = 5, warmup = 1, timeout_s = 60;
  std::string backend = "auto", out, rendezvous;
  int64_t device_memory = 0;
  bool json = false, quiet = false;
  cli::ThreadsPerRankFlag threads_per_rank;
  threads_per_rank.Add(app);
  app.add_option("--nproc", nproc, "ranks to start on this machine")
      ->check(CLI::Range(1, 256))
      ->capture_default_str();
  app.add_option("--backend", backend,
                 "auto (cuda when a GPU is present, else cpu), cpu (host tracer) "
                 "or cuda (CUPTI)")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}))
      ->capture_default_str();
  app.add_option("--steps", steps, "measured optimizer steps")
      ->check(CLI::Range(1, 1000000))
      ->capture_default_str();
  app.add_option("--warmup", warmup, "warm-up steps run first and excluded from the profile")
      ->check(CLI::Range(0, 1000000))
      ->capture_default_str();
  cli::AddBytesOption(
      app, "--device-memory", &device_memory,
      "device memory capacity per rank, e.g. 1GiB (default: unlimited; on cuda, the "
      "device's own memory)");
  app.add_option("-o,--output", out, "trace file to write (SQLite)")
      ->required()
      ->check(cli::NonEmptyPath());
  app.add_option("--rendezvous", rendezvous,
                 "shared directory for ranks started by an outside launcher");
  app.add_option("--timeout", timeout_s, "seconds to wait for other ranks")
      ->check(CLI::Range(1, cli::kMaxTimeoutSeconds))
      ->capture_default_str();
  app.add_flag("--json", json, "print one JSON object instead of text");
  app.add_flag("--quiet", quiet, "no progress on stderr");
  bool attach = false;
  std::string capture_range = "auto";
  std::vector<std::string> command;
  app.add_flag("--attach", attach,
               "trace an unmodified CUDA program given after --, e.g. dc-collect --attach -o t.db "
               "-- python train.py");
  app.add_option("--capture-range", capture_range,
                 "with --attach: auto (cudaProfilerStart/Stop if used), "
                 "cudaProfilerApi or all")
      ->check(CLI::IsMember({"auto", "cudaProfilerApi", "all"}))
      ->capture_default_str();
  app.add_option("command", command, "with --attach: the program and its arguments, after --");
  if (std::optional<int> exit_code = cli::Parse(app, argc, argv)) return *exit_code;
  if (attach) {
#ifdef DC_HAVE_CUPTI_ATTACH
    AttachOptions options;
    options.output_path = out;
    options.capture_range = capture_range;
    options.json = json;
    options.quiet = quiet;
    return RunAttached(options, command);
#else
    return cli::Fail("dc-collect",
                     Status::Error("--attach needs dc built with the CUDA toolkit (CUPTI)"));
#endif
  }
  if (!command.empty()) {
    // A usage error (exit 2): a word the command line does not take, or a command without
    // --attach.
    const bool after_dashes = std::find(argv + 1, argv + argc, std::string("--")) != argv + argc;
    std::cerr << "dc-collect: "
              << (after_dashes ? "a command after -- needs --attach"
                               : "unexpected argument '" + command.front() +
                                     "'; dc-collect takes no file to read (the trace to write "
                                     "is -o FILE; a program to trace goes after --attach --)")
              << "\n";
    return cli::kUsageExitCode;
  }

  // The launcher's variables are read, and checked, before anything else: --nproc against
  // WORLD_SIZE first, as the rendezvous matters only once that is settled.
  if (Status s = CheckNprocAgainstEnvironment(app.count("--nproc") > 0 ? nproc : 0); !s.ok()) {
    return cli::Fail("dc-collect", s);
  }
  auto env = RankEnvFromEnvironment(rendezvous);
  if (!env.ok()) return cli::Fail("dc-collect", env.status());
  const StatusOr<int> blas_threads =
      threads_per_rank.Resolve(env->world_size > 1 ? env->world_size : nproc);
  if (!blas_threads.ok()) return cli::Fail("dc-collect", blas_threads.status());
  const BackendAvailability available = AvailableBackends();
  auto chosen = ResolveBackend(backend, available, "dc-collect");
  if (!chosen.ok()) return cli::Fail("dc-collect", chosen.status());
  // Before any step: a trace that cannot be written is one line now, not after the whole run.
  if (Status distinct = CheckOutputIsNotAnInput(out, {model.overrides.data_path.value_or("")});
      !distinct.ok()) {
    return cli::Fail("dc-collect", distinct);
  }
  if (env->rank == 0) {
    if (Status writable = CheckOutputWritable(out); !writable.ok()) {
      return cli::Fail("dc-collect", writable);
    }
  }
  auto config = MakeConfig(model.preset, model.overrides);
  if (!config.ok()) return cli::Fail("dc-collect", config.status());
  if (Status data = RecordDataFile(&*config); !data.ok()) return cli::Fail("dc-collect", data);
  if (nproc > 1 && !IsRankProcess()) {
    // The token file is hashed once, here, for every rank.
    if (const std::string note = DataDigestNote(*config); !note.empty()) {
      ::setenv(kDataDigestVar, note.c_str(), 1);
    }
    LaunchOptions launch;
    launch.nproc = nproc;
    launch.program = "dc-collect";
    // Stopped ranks finish their step and write the trace before they exit.
    launch.stop_grace = kTracedStopGrace;
    launch.salvage = [&](const std::string& rendezvous_dir, const std::string& run_id,
                         const std::vector<int>& rank_pids) {
      return SalvageRankTraces(rendezvous_dir, run_id, nproc, out, rank_pids);
    };
    return LaunchLocal(launch, cli::Args(argc, argv));
  }
  auto program = BuildProgram(*config);
  if (!program.ok()) return cli::Fail("dc-collect", program.status());

  // The baseline schedule is what gets recorded; dc-plan improves on it.
  PlanRequest request;
  request.program = *program;
  request.world_size = env->world_size;
  request.backend = *chosen;
  request.device = BackendDevice(*chosen, env->local_rank);
  request.policy = "baseline";
  auto schedule = MakePlan(request);
  if (!schedule.ok()) return cli::Fail("dc-collect", schedule.status());
  if (*chosen == "cpu") {
    // The run would refuse the schedule with "re-plan with dc-plan", which is no advice here:
    // dc-collect made it from the model flags.
    PlanLimits limits;
    limits.memory_bytes = PhysicalMemoryBytes();
    if (Status fits = ValidatePlan(*schedule, limits); !fits.ok()) {
      return cli::Fail(
          "dc-collect",
          Status::Error(fits.message() + "; collect a smaller model (--hidden, --ffn, --layers, "
                                         "--vocab) or fewer tokens (--seq, --micro-batch)"));
    }
  }

  auto rank_backend = MakeBackend(*chosen);
  if (!rank_backend.ok()) return cli::Fail("dc-collect", rank_backend.status());
  SessionOptions session;
  session.backend = rank_backend->get();
  session.run.steps = steps;
  session.run.warmup_steps = warmup;
  session.run.device_memory_bytes = device_memory;
  session.run.num_threads = *blas_threads;
  session.trace_path = out;
  session.rendezvous_flag = rendezvous;
  session.timeout = std::chrono::seconds(timeout_s);
  // Rank 0 under --nproc writes to the launcher's terminal, not its own stderr file.
  const int progress_fd = ProgressFd();
  const bool progress = !quiet && !json && progress_fd >= 0 && ::isatty(progress_fd);
  if (progress) {
    session.run.on_step = [&, progress_fd](int step, double loss, double seconds) {
      ::dprintf(progress_fd, "\rdc-collect: step %d/%d loss %.4f (%.3f s)%s", step + 1,
                steps + warmup, loss, seconds, step + 1 == steps + warmup ? "\n" : "");
    };
  }
  auto result = RunAsRank(*schedule, session);
  if (!result.ok()) return cli::Fail("dc-collect", result.status());
  if (result->env.rank != 0) return 0;
  const MergeSummary& trace = *result->trace;
  if (json) {
    nlohmann::json j;
    j["trace"] = out;
    j["steps"] = steps;
    j["warmup_steps"] = warmup;
    j["ranks"] = trace.ranks;
    j["activities"] = trace.activities;
    j["memory_events"] = trace.memory_events;
    j["dropped_records"] = trace.dropped_records;
    if (!trace.incomplete.empty()) {
      j["incomplete"] = trace.incomplete;
      j["last_step"] = trace.last_step;
    }
    j["losses"] = result->run.losses;
    j["step_seconds_median"] = result->run.step_seconds_median;
    j["peak_device_bytes"] = result->run.peak_device_bytes;
    j["backend"] = *chosen;
    if (*chosen == "cpu") {
      j["cpu_kernels"] = simd::SimdKernels().name;
      j["blas_core"] = BlasCore();
      j["threads_per_rank"] = *blas_threads;
      j["transport"] = result->transport;
    }
    std::cout << j.dump() << "\n";
  } else {
    std::printf(
        "wrote %s: %d rank(s), %d step(s) + %d warm-up, %lld activities, %lld memory events, "
        "%lld dropped\n",
        out.c_str(), trace.ranks, std::max(0, result->run.steps_done - warmup),
        std::min(warmup, result->run.steps_done), static_cast<long long>(trace.activities),
        static_cast<long long>(trace.memory_events), static_cast<long long>(trace.dropped_records));
  }
  if (const std::string blas = *chosen == "cpu" ? BlasCoreWarning() : ""; !blas.empty()) {
    std::fprintf(stderr, "dc-collect: warning: %s\n", blas.c_str());
  }
  if (result->run.stop_signal != 0) {
    std::fprintf(stderr, "dc-collect: %s; %s keeps them (marked incomplete)\n",
                 trace.incomplete.c_str(), out.c_str());
    return 128 + result->run.stop_signal;
  }
  return 0;
}
