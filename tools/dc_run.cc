// dc-run: train by a plan with the lean executor.
#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>

#include "executor/backends.h"
#include "executor/checkpoint.h"
#include "executor/cpu_kernels.h"
#include "executor/cpu_simd.h"
#include "executor/data.h"
#include "executor/launch.h"
#include "executor/layout.h"
#include "executor/session.h"
#include "executor/weights_io.h"
#include "schemas/digest.h"
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
  std::string plan_path, trace_out, rendezvous, backend = "auto", save_dir, resume_dir, data_path;
  int steps = 20, warmup = 0, nproc = 0, timeout_s = 60, save_every = 0, keep = 2;
  EvalOptions eval;
  int64_t device_memory = 0;
  bool json = false, quiet = false, save_blocking = false;
  app.add_option("plan", plan_path, "plan file written by dc-plan")
      ->required()
      ->check(cli::NonEmptyPath());
  app.add_option("--steps", steps,
                 "optimizer steps to train (0: none, e.g. --init-from DIR --export OUT)")
      ->check(CLI::Range(0, 100000000))
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
  app.add_option("--save", save_dir,
                 "write checkpoints (params and Adam states, each rank its shard) into this "
                 "directory: at the end, and every --save-every steps. A save copies the rank's "
                 "state into host memory (the size of its shards, kept for the run) and writes "
                 "it in the background while the next steps train; the checkpoint appears once "
                 "every rank's file is written (a next save or the end waits for it)")
      ->check(cli::NonEmptyPath());
  app.add_option("--save-every", save_every, "also save every this many steps (0: at the end only)")
      ->check(CLI::Range(0, 100000000))
      ->capture_default_str();
  app.add_flag("--save-blocking", save_blocking,
               "write each checkpoint between steps instead, shard by shard, with no host copy "
               "of the state (for a host without the memory for one)");
  app.add_option("--keep", keep, "complete checkpoints to keep in --save, newest first")
      ->check(CLI::Range(1, 1000000))
      ->capture_default_str();
  app.add_option("--resume", resume_dir,
                 "go on from the newest complete checkpoint in this directory (any world size "
                 "or plan of the same model and global batch); --steps counts from step 0, so "
                 "the run trains the steps the checkpoint has not done")
      ->check(cli::NonEmptyPath());
  app.add_option("--data", data_path,
                 "train on this token file instead of the one the plan names (which must be "
                 "unchanged since the plan was made: its SHA-256 is checked)")
      ->check(cli::NonEmptyPath());
  auto* eval_data =
      app.add_option(
             "--eval-data", eval.data_path,
             "held-out token file (uint16, as --data): after the last step (and every --eval-every "
             "steps) print and record the mean loss over --eval-batches of its global batches, "
             "forward only; training is unchanged by it")
          ->check(cli::NonEmptyPath());
  auto* eval_every = app.add_option("--eval-every", eval.every_steps,
                                    "also evaluate after every this many optimizer steps "
                                    "(default: after the last step only)")
                         ->check(CLI::Range(int64_t{1}, int64_t{100000000}));
  auto* eval_batches = app.add_option("--eval-batches", eval.batches,
                                      "global batches of --eval-data per evaluation (each the "
                                      "plan's global batch of sequences)")
                           ->check(CLI::Range(int64_t{1}, int64_t{1000000}))
                           ->capture_default_str();
  app.add_flag("--json", json,
               "print one JSON object (losses, step_seconds_median, tokens_per_second, ...)");
  app.add_flag("--quiet", quiet, "no per-step lines, only the summary");
  cli::ThreadsPerRankFlag threads_per_rank;
  threads_per_rank.Add(app);
  WeightsIoOptions weights;
  app.add_option("--init-from", weights.init_from_dir,
                 "start from this model directory (config.json + safetensors, as --export or "
                 "Hugging Face write them; sharded and bf16 too) instead of the seeded init")
      ->check(cli::NonEmptyPath());
  app.add_option("--export", weights.export_dir,
                 "at the end, write the model to this new directory as model.safetensors + "
                 "config.json (Hugging Face's Llama/Mixtral names and layout, fp32)")
      ->check(cli::NonEmptyPath());
  app.add_option("--dump-grads", weights.dump_grads_dir,
                 "debugging: write the first step's full gradients (Hugging Face names) and "
                 "its settings to this new directory, for comparing with another framework")
      ->check(cli::NonEmptyPath());
  if (std::optional<int> exit_code = cli::Parse(app, argc, argv)) return *exit_code;
  if (Status distinct = CheckOutputIsNotAnInput(trace_out, {plan_path, data_path, eval.data_path});
      !distinct.ok()) {
    return cli::Fail("dc-run", distinct);
  }
  if (!trace_out.empty() && !IsRankProcess()) {
    if (Status writable = CheckOutputWritable(trace_out); !writable.ok()) {
      return cli::Fail("dc-run", writable);
    }
  }
  if (!resume_dir.empty() && !weights.init_from_dir.empty()) {
    return cli::Fail("dc-run", Status::Error("--resume " + resume_dir + " and --init-from " +
                                             weights.init_from_dir +
                                             " both give the starting weights; use one"));
  }
  if (save_blocking && save_dir.empty()) {
    return cli::Fail("dc-run", Status::Error("--save-blocking needs --save DIR, the directory to "
                                             "save into"));
  }
  if (save_every > 0 && save_dir.empty()) {
    return cli::Fail("dc-run", Status::Error("--save-every " + std::to_string(save_every) +
                                             " needs --save DIR, the directory to save into"));
  }

  for (const CLI::Option* needs_file : {eval_every, eval_batches}) {
    if (needs_file->count() > 0 && eval_data->count() == 0) {
      return cli::Fail("dc-run", Status::Error(needs_file->get_name() +
                                               " needs --eval-data FILE, the held-out tokens "
                                               "to evaluate on"));
    }
  }

  if (IsRankProcess()) {  // the launcher's variables are read, and checked, before anything else
    // --nproc against WORLD_SIZE first: the rendezvous matters only once that is settled.
    if (Status s = CheckNprocAgainstEnvironment(nproc); !s.ok()) return cli::Fail("dc-run", s);
    auto env = RankEnvFromEnvironment(rendezvous);
    if (!env.ok()) return cli::Fail("dc-run", env.status());
  }
  auto plan = LoadPlan(plan_path);
  if (!plan.ok()) return cli::Fail("dc-run", plan.status());
  // The token file: the plan's, unchanged (checked once, before any rank starts), or --data
  // (any file whose tokens fit the vocabulary: the plan depends on shapes, not on data).
  proto::ModelConfig* config = plan->mutable_program()->mutable_config();
  if (!data_path.empty()) {
    config->set_data_path(std::filesystem::absolute(data_path).lexically_normal().string());
    config->clear_data_sha256();
    if (auto data = TokenSource::Open(*config); !data.ok()) {
      return cli::Fail("dc-run", data.status());
    }
  } else if (!IsRankProcess()) {
    if (Status data = CheckDataFile(*config); !data.ok()) return cli::Fail("dc-run", data);
  }
  // Held-out tokens and the plan's forward prefix, checked once before any rank starts.
  if (!eval.data_path.empty()) {
    eval.data_path = std::filesystem::absolute(eval.data_path).lexically_normal().string();
    const int64_t batch_sequences = TokensPerStep(*config, plan->world_size()) / config->seq();
    if (auto data = OpenEvalData(*config, eval.data_path, eval.batches, batch_sequences);
        !data.ok()) {
      return cli::Fail("dc-run", data.status());
    }
    if (auto prefix = EvaluationPrefix(*plan); !prefix.ok()) {
      return cli::Fail("dc-run", prefix.status().Prefixed(plan_path + ": --eval-data: "));
    }
  }
  if (Status s = CheckWeightsIo(weights, plan->program()); !s.ok()) return cli::Fail("dc-run", s);
  // Decided before any rank starts, so a plan for the other backend is one line, not N.
  const BackendAvailability available = AvailableBackends();
  auto chosen = ResolveBackend(backend, available, "dc-run");
  if (!chosen.ok()) return cli::Fail("dc-run", chosen.status());
  const Status matches = CheckPlanBackend(plan_path, *plan, *chosen, backend, available);
  if (!matches.ok()) return cli::Fail("dc-run", matches);
  const StatusOr<int> blas_threads =
      threads_per_rank.Resolve(nproc > 0 ? nproc : plan->world_size());
  if (!blas_threads.ok()) return cli::Fail("dc-run", blas_threads.status());
  const int64_t total_steps = static_cast<int64_t>(warmup) + steps;
  // Checked before any rank starts, so what cannot be resumed is one line, not N.
  std::string resumed_from;
  RunOptions resume;
  resume.steps = steps;
  resume.warmup_steps = warmup;
  if (!resume_dir.empty()) {
    auto checkpoint = Checkpoint::OpenNewest(resume_dir, plan->program(), plan->world_size());
    if (!checkpoint.ok()) return cli::Fail("dc-run", checkpoint.status());
    const int64_t done = (*checkpoint)->step();
    // At --steps itself only to export it (--steps N --resume DIR --export OUT).
    if (done > total_steps || (done == total_steps && weights.export_dir.empty())) {
      return cli::Fail("dc-run",
                       Status::Error((*checkpoint)->path() + " is at step " + std::to_string(done) +
                                     ", not before --steps " + std::to_string(total_steps) +
                                     "; raise --steps to train further (or add --export to "
                                     "export it)"));
    }
    resumed_from = (*checkpoint)->path();
    resume.first_step = done;
    resume.warmup_steps = static_cast<int>(std::max<int64_t>(0, warmup - done));
    resume.steps = static_cast<int>(total_steps - done - resume.warmup_steps);
    std::shared_ptr<Checkpoint> state = std::move(*checkpoint);
    resume.initial_values = [state](const proto::Tensor& t, int64_t offset, int64_t count,
                                    float* out) { return state->Read(t, offset, count, out); };
  }
  if (!save_dir.empty() && !IsRankProcess()) {
    if (Status ready = PrepareCheckpointDir(save_dir); !ready.ok()) {
      return cli::Fail("dc-run", ready);
    }
  }
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
      if (!trace_out.empty()) {
        // Stopped ranks finish their step and write the trace before they exit.
        launch.stop_grace = kTracedStopGrace;
        launch.salvage = [&](const std::string& rendezvous_dir, const std::string& run_id,
                             const std::vector<int>& rank_pids) {
          return SalvageRankTraces(rendezvous_dir, run_id, world, trace_out, rank_pids);
        };
      }
      return LaunchLocal(launch, cli::Args(argc, argv));
    }
  }
  // A file size limit (ulimit -f) fails a checkpoint's write with an error naming the file,
  // instead of killing the rank.
  std::signal(SIGXFSZ, SIG_IGN);
  auto rank_backend = MakeBackend(*chosen);
  if (!rank_backend.ok()) return cli::Fail("dc-run", rank_backend.status());
  SessionOptions session;
  session.backend = rank_backend->get();
  session.run = resume;
  nlohmann::json saves = nlohmann::json::array();  // rank 0's published checkpoints
  if (!save_dir.empty()) {
    CheckpointOptions saving;
    saving.dir = save_dir;
    saving.every_steps = save_every;
    saving.final_step = total_steps;
    saving.keep = keep;
    saving.plan_digest = DigestOf(*plan);
    saving.background = !save_blocking;
    // Tests: hold every background write half-way until this file exists.
    if (const char* gate = std::getenv("DC_TEST_CHECKPOINT_GATE")) {
      saving.writer_gate_for_tests = gate;
    }
    saving.on_saved = [&, quiet_saves = json || quiet](const SavedCheckpoint& saved) {
      saves.push_back({{"step", saved.step},
                       {"path", saved.path},
                       {"bytes", saved.bytes},
                       {"seconds", saved.seconds},
                       {"blocking_seconds", saved.blocking_seconds},
                       {"background_seconds", saved.background_seconds}});
      if (!quiet_saves) {
        std::printf("saved %s: %s in %.3f s (%.3f s of it blocking training)\n", saved.path.c_str(),
                    FormatBytes(saved.bytes).c_str(), saved.seconds, saved.blocking_seconds);
        std::fflush(stdout);
      }
    };
    AttachCheckpointSaver(saving, &session.run);
  }
  session.run.eval = eval;
  if (!json) {  // --quiet too: an evaluation is a result, not progress
    session.run.on_eval = [&](const EvalRecord& e) {
      std::printf("eval step %lld: loss %.5f (%lld batch(es), %.3f s)\n",
                  static_cast<long long>(e.step), e.loss, static_cast<long long>(eval.batches),
                  e.seconds);
      std::fflush(stdout);
    };
  }
  session.run.device_memory_bytes = device_memory;
  session.run.num_threads = *blas_threads;
  session.trace_path = trace_out;
  session.rendezvous_flag = rendezvous;
  session.timeout = std::chrono::seconds(timeout_s);
  if (!json && !quiet) {
    session.run.on_step = [&](int step, double loss, double seconds) {
      std::printf("step %3d  loss %.5f  lr %.3g  %.3f s\n", step + 1, loss,
                  LearningRate(plan->program().config(), step), seconds);
      std::fflush(stdout);
    };
  }
  if (Status s = AttachWeightsIo(weights, plan->program(), &session.run); !s.ok()) {
    return cli::Fail("dc-run", s);
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
    j["startup_seconds"] = run.startup_seconds;
    j["peak_device_bytes"] = run.peak_device_bytes;
    j["peak_live_bytes"] = run.peak_live_bytes;
    j["arena_bytes"] = run.arena_bytes;
    j["params_digest"] = run.params_digest;
    if (!eval.data_path.empty()) {
      nlohmann::json evals = nlohmann::json::array();
      for (const EvalRecord& e : run.evals) {
        evals.push_back({{"step", e.step}, {"loss", e.loss}, {"seconds", e.seconds}});
      }
      j["eval_data"] = eval.data_path;
      j["eval_batches"] = eval.batches;
      j["evals"] = evals;
    }
    j["predicted_step_seconds"] = plan->prediction().step_seconds();
    j["predicted_peak_device_bytes"] = plan->prediction().peak_device_bytes();
    j["world_size"] = run.world_size;
    j["backend"] = *chosen;
    if (*chosen == "cpu") {
      j["cpu_kernels"] = simd::SimdKernels().name;  // the build the start-up chose
      j["blas_core"] = BlasCore();
      j["threads_per_rank"] = *blas_threads;
      j["transport"] = result->transport;
      if (!result->transport_note.empty()) j["transport_note"] = result->transport_note;
    }
    j["first_step"] = session.run.first_step;
    if (!resumed_from.empty()) j["resumed_from"] = resumed_from;
    if (!save_dir.empty() && run.stop_signal == 0) {
      j["saved"] = save_dir + "/" + CheckpointDirName(total_steps);
    }
    if (!save_dir.empty()) j["saves"] = saves;
    if (result->trace) j["trace"] = trace_out;
    if (result->trace && !result->trace->incomplete.empty()) {
      j["incomplete"] = result->trace->incomplete;
    }
    std::cout << j.dump() << "\n";
  } else {
    std::printf(
        "%d step(s) on %d %s rank(s): median %.4f s/step, %.0f tokens/s, peak %s per rank "
        "(predicted %.4f s, %s)\n",
        session.run.steps, run.world_size, chosen->c_str(), run.step_seconds_median,
        run.tokens_per_second, FormatBytes(run.peak_device_bytes).c_str(),
        plan->prediction().step_seconds(),
        FormatBytes(plan->prediction().peak_device_bytes()).c_str());
    if (*chosen == "cpu") {
      // One rank has no collectives to name.
      std::string collectives;
      if (result->transport != "none") {
        collectives = ", collectives over " + result->transport;
        if (!result->transport_note.empty()) collectives += " (" + result->transport_note + ")";
      }
      std::printf("cpu kernels: %s, OpenBLAS %s, %d BLAS thread(s) per rank%s\n",
                  simd::SimdKernels().name, BlasCore().c_str(), *blas_threads, collectives.c_str());
    }
    if (!resumed_from.empty()) {
      std::printf("resumed from %s (step %lld)\n", resumed_from.c_str(),
                  static_cast<long long>(session.run.first_step));
    }
  }
  if (const std::string blas = *chosen == "cpu" ? BlasCoreWarning() : ""; !blas.empty()) {
    std::fprintf(stderr, "dc-run: warning: %s\n", blas.c_str());
  }
  if (run.stop_signal != 0) {
    std::fprintf(stderr, "dc-run: %s; %s keeps the steps done (marked incomplete)\n",
                 result->trace ? result->trace->incomplete.c_str() : "stopped", trace_out.c_str());
    return 128 + run.stop_signal;
  }
  return 0;
}
