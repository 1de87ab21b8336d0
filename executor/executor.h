// What every backend's run of a plan shares: the options and figures of a run, the checks a plan
// passes before a backend touches a device (CheckRunnable), how instructions are named in errors
// (DescribeInstruction), and the cpu backend's entry point. The schedule itself is run by the
// one interpreter (executor/interpreter.h) over a backend's device (executor/device.h);
// executor/backend.h is how a session picks a backend.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "executor/comm.h"
#include "executor/device.h"
#include "executor/tracer.h"
#include "schemas/program.h"
#include "schemas/status.h"

namespace dc {

// This rank's shards of some persistent tensors in host memory (pinned on cuda), as
// TrainingState::StartSnapshot copies them: tensor tensors[i]'s shard at bytes
// [offsets_bytes[i], offsets_bytes[i + 1]) of `host`. A checkpoint saver keeps one and its memory
// from one snapshot to the next.
struct ShardSnapshot {
  std::vector<int> tensors;
  std::vector<int64_t> offsets_bytes;  // tensors.size() + 1
  std::unique_ptr<HostBuffer> host;
  // Blocks, on any thread, until every copy is in `host`; the copies' error if one failed.
  // Valid until the next StartSnapshot.
  std::function<Status()> wait;
};

// One rank's training state between two steps, as checkpoints and exports read it: the fp32
// shard of each persistent tensor (param master, Adam m and v; grads are empty between steps),
// wherever the plan keeps it (device or host). Rank r's shard of a tensor is elements
// [r * S, (r + 1) * S) of the tensor flattened and zero-padded to world * S, S =
// ShardElements(elements, world). Valid only during the callback that receives it.
class TrainingState {
 public:
  virtual ~TrainingState() = default;
  virtual const proto::Program& program() const = 0;
  virtual Communicator* comm() = 0;
  // Optimizer steps done so far (the step the next one would be, 0-based).
  virtual int64_t steps_done() const = 0;
  // This rank's shard of persistent tensor `tensor` (by id), S elements.
  virtual StatusOr<std::vector<float>> ReadShard(int tensor) = 0;
  // Starts copying this rank's shard of each persistent tensor in `tensors` (by id) into
  // `snapshot` (its host memory allocated here the first time, or when the size changes, and
  // reused after). Returns once the copies are issued: where the device copies asynchronously
  // (cuda: the d2h stream) they overlap the next step, whose writes of the shards wait for
  // them; snapshot->wait() waits for them. The previous snapshot's wait() must have returned.
  virtual Status StartSnapshot(const std::vector<int>& tensors, ShardSnapshot* snapshot) = 0;
};

// Held-out evaluation (dc-run --eval-data): after every `every_steps`-th optimizer step (counted
// from 0 over resumes), after the run's last step, and once at start-up in a run of no steps,
// the mean loss over `batches` global batches of the token file `data_path`. Global batch k is
// samples [k * G, (k + 1) * G) of the file (G sequences: the plan's global batch), split over
// the ranks and micro-steps as a training step splits its batch (SampleIndex with step k), so
// any plan and world size with the same global batch evaluates the same tokens. Forward only:
// no grad, no optimizer, nothing of the training state changes.
struct EvalOptions {
  std::string data_path;    // empty: no evaluation
  int64_t every_steps = 0;  // 0: only after the last step
  int64_t batches = 1;
};

// One evaluation: after `step` optimizer steps, the mean loss (as a step's printed loss: the
// loss terms summed over the ranks, over the tokens) over the batches, and its wall seconds.
struct EvalRecord {
  int64_t step = 0;
  double loss = 0;
  double seconds = 0;
};

struct RunOptions {
  int steps = 20;                   // measured optimizer steps
  int warmup_steps = 0;             // run first, marked warm-up in the trace, not in the losses
  int64_t device_memory_bytes = 0;  // capacity; 0 = unlimited
  int num_threads = 1;
  // Called on rank 0 after every step (step index from 0, loss, seconds), e.g. for progress.
  std::function<void(int, double, double)> on_step;

  // Resuming: the optimizer steps already done before this run (the data position, Adam's
  // bias correction and the learning rate's schedule go on from there).
  int64_t first_step = 0;
  // Start-up values of persistent shards (a checkpoint or imported weights): fills `count`
  // elements of `tensor` (flattened) from element `offset`, padding past its end included as
  // zeros, and returns true; false keeps dc's own start (seeded params, zero Adam states).
  std::function<StatusOr<bool>(const proto::Tensor& tensor, int64_t offset, int64_t count,
                               float* out)>
      initial_values;
  // Called on every rank after every step (warm-up included) with the state at its end, or
  // once with the start-up state when the run has no steps; an error stops the run.
  // Checkpoints are written here.
  std::function<Status(TrainingState& state)> after_step;
  // Called on every rank once after the run's last step (or the step a stop signal ended it
  // after, or at start-up in a run of no steps), after after_step, with `run_failed` false: what
  // after_step left running finishes here (a checkpoint's background write, its agreement and
  // its publishing); an error fails the run. When the run fails (here or before), called again
  // with `run_failed` true before the device goes away: stop what after_step started, without
  // the other ranks (the error is the run's already).
  std::function<Status(TrainingState& state, bool run_failed)> at_end;
  // Called on every rank in the run's first step with each grad's reduced fp32 shard (the
  // gradient of the step's mean loss over the global batch, this rank's chunk), just before
  // the optimizer reads it: what parity tests compare with another framework's gradients.
  std::function<Status(const proto::Tensor& grad, const std::vector<float>& shard)> on_first_grads;
  // Asked on every rank after every step: a signal number when this rank was asked to stop (0:
  // go on). The ranks agree (the largest wins), so all of them stop after the same step; the
  // run then ends early with RunResult::stop_signal set and its figures over the steps done.
  std::function<int()> stop_requested;
  EvalOptions eval;
  // Called on rank 0 after each evaluation.
  std::function<void(const EvalRecord&)> on_eval;
};

struct RunResult {
  std::vector<double> losses;        // measured steps, mean loss over the global batch
  std::vector<double> step_seconds;  // measured steps
  std::vector<EvalRecord> evals;     // in step order (RunOptions::eval)
  // Max over ranks of the device memory the run held at its peak: the arena's size when the
  // plan has a memory plan (one allocation), else the peak of live buffers.
  int64_t peak_device_bytes = 0;
  int64_t peak_live_bytes = 0;  // max over ranks of the peak of live buffers
  int64_t arena_bytes = 0;      // 0 when the plan has no memory plan
  // SHA-256 over every rank's fp32 param shards after the run: equal digests, equal params.
  std::string params_digest;
  std::vector<int64_t> peak_by_kind;  // this rank, at its peak, index = BufferKind
  int world_size = 1;
  int64_t tokens_per_step = 0;
  double step_seconds_median = 0;
  double tokens_per_second = 0;
  int steps_done = 0;   // steps run, warm-up included: fewer than asked only when stopped
  int stop_signal = 0;  // the signal that stopped the run after steps_done steps; 0: ran them all
  // This rank's start-up before the first step: the arena, host buffers and every persistent
  // shard's first value (from a checkpoint when resuming: its reads and SHA-256 checks).
  double startup_seconds = 0;
};

// Checks that a plan can run here: made for `backend`, world size matching the communicator,
// and the plan valid (schemas/plan_check.h's ValidatePlan; on cpu within this host's memory).
// The message names what differs and what to do.
Status CheckRunnable(const proto::Schedule& schedule, int world_size,
                     const std::string& backend = "cpu");

// How every backend names an instruction in its errors:
// "instruction 37 (all_gather layers.0.wq +2) on rank 1".
std::string DescribeInstruction(const proto::Schedule& schedule, int index, int rank);

// Runs `schedule` on the cpu backend (executor/cpu_device.h) through the interpreter, tracing
// into `tracer` when given.
StatusOr<RunResult> RunSchedule(const proto::Schedule& schedule, const RunOptions& options,
                                Communicator* comm, ExecutionTracer* tracer);

double Median(std::vector<double> values);

}  // namespace dc
