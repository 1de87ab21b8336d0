// The schedule interpreter. It runs a plan's instruction stream step after step on one rank:
// compute instructions through the backend's kernels, all-gathers and reduce-scatters through
// the communicator, every buffer through DeviceMemory, every instruction into the tracer when
// one is given. The `cpu` backend does real fp32 math; instructions run in stream order on one
// thread (the dependency edges are honoured by that order). The `cuda` backend
// (executor/cuda/cuda_executor.h) shares the step loop (RunSteps) and the way instructions are
// named in errors (DescribeInstruction); executor/backend.h is how a session picks one.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "collector/host_tracer.h"
#include "executor/comm.h"
#include "schemas/program.h"
#include "schemas/status.h"

namespace dc {

struct RunOptions {
  int steps = 20;                   // measured optimizer steps
  int warmup_steps = 0;             // run first, marked warm-up in the trace, not in the losses
  int64_t device_memory_bytes = 0;  // capacity; 0 = unlimited
  int num_threads = 1;
  // Called on rank 0 after every step (step index from 0, loss, seconds), e.g. for progress.
  std::function<void(int, double, double)> on_step;
};

struct RunResult {
  std::vector<double> losses;        // measured steps, mean loss over the global batch
  std::vector<double> step_seconds;  // measured steps
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
};

// Checks that a plan can run here: made for `backend`, world size matching the communicator,
// the program valid, every instruction's buffer effects consistent (schemas/effects.h). The
// message names what differs and what to do.
Status CheckRunnable(const proto::Schedule& schedule, int world_size,
                     const std::string& backend = "cpu");

// How every backend names an instruction in its errors:
// "instruction 37 (all_gather layers.0.wq +2) on rank 1".
std::string DescribeInstruction(const proto::Schedule& schedule, int index, int rank);

// One rank's runner of a backend, as the shared step loop (RunSteps) drives it.
class RankStepper {
 public:
  virtual ~RankStepper() = default;
  // Runs optimizer step `step` (0-based, counting warm-up); `loss` is the mean over the global
  // batch (every rank gets it), `seconds` the step's wall time on this rank.
  virtual Status RunStep(int step, bool warmup, double* loss, double* seconds) = 0;
  virtual int64_t peak_live_bytes() const = 0;
  virtual int64_t arena_bytes() const = 0;  // 0 without a memory plan
  virtual std::vector<int64_t> peak_by_kind() const = 0;
  // SHA-256 (hex) of this rank's fp32 param shards in tensor order.
  virtual StatusOr<std::string> ParamsDigest() = 0;
};

// The step loop every backend shares: warm-up and measured steps, the loss checks, progress,
// then the run's figures agreed over the ranks (peaks, the joined params digest).
StatusOr<RunResult> RunSteps(RankStepper* runner, const proto::Schedule& schedule,
                             const RunOptions& options, Communicator* comm);

StatusOr<RunResult> RunSchedule(const proto::Schedule& schedule, const RunOptions& options,
                                Communicator* comm, HostTracer* tracer);

double Median(std::vector<double> values);

}  // namespace dc
