// Backends of the executor and how a run picks one. A backend turns a plan into one rank's run:
// it connects the rank's communicator, makes its tracer and runs the step loop. The `cpu`
// backend lives here; the `cuda` backend lives in executor/cuda/ and is reached only through
// this interface, so the executor core builds and runs without the CUDA toolkit.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "executor/comm.h"
#include "executor/executor.h"
#include "executor/launch.h"
#include "executor/tracer.h"
#include "schemas/program.h"
#include "schemas/status.h"

namespace dc {

inline constexpr char kCpuBackend[] = "cpu";
inline constexpr char kCudaBackend[] = "cuda";
inline constexpr char kAutoBackend[] = "auto";

// What this build and this host offer.
struct BackendAvailability {
  bool cuda_compiled = false;  // the binary was built with the CUDA backend
  int cuda_devices = 0;        // visible CUDA devices (0 without a driver)
};

// The backend a run uses for `requested` ("auto", "cpu" or "cuda"): auto is cuda when the
// backend is compiled in and a device is visible, else cpu. Errors (one line, what to do) for
// cuda without the backend or without a device, and for an unknown name. `program` names the
// command in messages.
StatusOr<std::string> ResolveBackend(const std::string& requested,
                                     const BackendAvailability& available,
                                     const std::string& program);

// Checks that the plan at `plan_path` was made for `backend` (what ResolveBackend chose for
// `requested`); the message names the file and says how to re-plan or which backend to ask for.
Status CheckPlanBackend(const std::string& plan_path, const proto::Schedule& plan,
                        const std::string& backend, const std::string& requested,
                        const BackendAvailability& available);

// One rank's trace as a backend records it: the cpu backend's HostTracer, the cuda backend's
// CUPTI collector.
class RankTracer {
 public:
  virtual ~RankTracer() = default;
  // What the interpreter records into.
  virtual ExecutionTracer* execution_tracer() = 0;
  // Writes this rank's file (the path given when the tracer was made) for MergeRankTraces.
  virtual Status WriteRankFile() = 0;
};

struct RankTraceOptions {
  RankIdentity identity;         // backend and device are filled in by the backend
  int64_t session_start_ns = 0;  // rank 0's CLOCK_REALTIME at start, shared by every rank
  std::string part_path;         // this rank's file
  // The plan being run, for tracers that write it into the rank's file from the start (the cpu
  // backend's streamed file, which a stopped run leaves mergeable); may be null.
  const proto::Schedule* schedule = nullptr;
};

// A backend as a session uses it, in this order: Connect, MakeTracer (when tracing), Run.
// One instance per rank process; not thread-safe.
class RankBackend {
 public:
  virtual ~RankBackend() = default;
  virtual std::string name() const = 0;
  // The communicator of this rank, met through `rendezvous` (the launcher's directory).
  virtual StatusOr<std::unique_ptr<Communicator>> Connect(const RendezvousOptions& rendezvous,
                                                          const RankEnv& env) = 0;
  virtual StatusOr<std::unique_ptr<RankTracer>> MakeTracer(const RankTraceOptions& options) = 0;
  // Runs the plan; `comm` is the one Connect returned, `tracer` the one MakeTracer made or null
  // (another backend's tracer is refused).
  virtual StatusOr<RunResult> Run(const proto::Schedule& schedule, const RunOptions& options,
                                  Communicator* comm, RankTracer* tracer) = 0;
};

// The cpu backend: Gloo collectives, real fp32 math, the host tracer.
std::unique_ptr<RankBackend> MakeCpuBackend();

}  // namespace dc
