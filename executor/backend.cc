#include "executor/backend.h"

#include <algorithm>

#include "collector/host_tracer.h"
#include "executor/cpu_device.h"

namespace dc {
namespace {

// How to get a plan for each backend, for the messages below.
constexpr char kReplanForCpu[] =
    "re-plan for cpu (dc-plan --synthetic --hardware cpu, or dc-plan on a trace recorded by "
    "dc-collect --backend cpu)";
constexpr char kReplanForCuda[] =
    "re-plan for cuda (dc-plan on a trace recorded by dc-collect --backend cuda, or dc-plan "
    "--synthetic --hardware h100-sxm)";

}  // namespace

StatusOr<std::string> ResolveBackend(const std::string& requested,
                                     const BackendAvailability& available,
                                     const std::string& program) {
  if (requested == kCpuBackend) return std::string(kCpuBackend);
  if (requested == kAutoBackend) {
    return std::string(available.cuda_compiled && available.cuda_devices > 0 ? kCudaBackend
                                                                             : kCpuBackend);
  }
  if (requested == kCudaBackend) {
    if (!available.cuda_compiled) {
      return Status::Error("--backend cuda: this " + program +
                           " was built without the CUDA toolkit; build dc where CMake finds "
                           "nvcc (it reports 'dc: CUDA toolkit ON'), or use --backend cpu");
    }
    if (available.cuda_devices == 0) {
      return Status::Error("--backend cuda: no CUDA device is visible to " + program +
                           " (no GPU, no driver, or CUDA_VISIBLE_DEVICES hides them); run on a "
                           "GPU host or use --backend cpu");
    }
    return std::string(kCudaBackend);
  }
  return Status::Error("unknown backend '" + requested + "'; use auto, cpu or cuda");
}

Status CheckPlanBackend(const std::string& plan_path, const proto::Schedule& plan,
                        const std::string& backend, const std::string& requested,
                        const BackendAvailability& available) {
  const std::string& planned = plan.backend();
  if (planned == backend) return Status::Ok();
  const std::string prefix = plan_path + ": the plan is for the " + planned + " backend";
  if (planned == kCudaBackend) {
    if (requested == kAutoBackend && !available.cuda_compiled) {
      return Status::Error(prefix +
                           " and this build has no CUDA backend; run it with dc built "
                           "with the CUDA toolkit on a GPU host, or " +
                           kReplanForCpu);
    }
    if (requested == kAutoBackend) {
      return Status::Error(prefix +
                           " and this host has no CUDA device (--backend auto chose "
                           "cpu); run it on a GPU host, or " +
                           kReplanForCpu);
    }
    return Status::Error(prefix + " and --backend " + requested +
                         " runs on cpu; run it with --backend cuda on a GPU host, or " +
                         kReplanForCpu);
  }
  if (planned == kCpuBackend) {
    return Status::Error(prefix + " and this run uses cuda (--backend " + requested + "); " +
                         kReplanForCuda + ", or run it with --backend cpu");
  }
  return Status::Error(prefix +
                       ", which dc does not have; re-plan it with dc-plan for cpu or cuda");
}

namespace {

class HostRankTracer : public RankTracer {
 public:
  explicit HostRankTracer(const RankTraceOptions& options)
      : tracer_(options.identity, options.session_start_ns),
        path_(options.part_path),
        schedule_(options.schedule) {}
  // The rank's file is written step by step from here on.
  Status Start() { return tracer_.StreamTo(path_, schedule_); }
  Status WriteRankFile() override { return tracer_.WriteRankFile(path_); }
  ExecutionTracer* execution_tracer() override { return &tracer_; }

 private:
  HostTracer tracer_;
  std::string path_;
  const proto::Schedule* schedule_;
};

class CpuBackend : public RankBackend {
 public:
  std::string name() const override { return kCpuBackend; }

  StatusOr<std::unique_ptr<Communicator>> Connect(const RendezvousOptions& rendezvous,
                                                  const RankEnv& /*env*/) override {
    RendezvousOptions channels = rendezvous;  // one for each of the device's streams
    channels.channels = std::max(channels.channels, kCpuDeviceChannels);
    DC_ASSIGN_OR_RETURN(channels.transport, TransportFromEnvironment());
    return dc::Connect(channels);
  }

  StatusOr<std::unique_ptr<RankTracer>> MakeTracer(const RankTraceOptions& options) override {
    RankTraceOptions cpu = options;
    cpu.identity.backend = kCpuBackend;
    cpu.identity.device = "cpu";
    auto tracer = std::make_unique<HostRankTracer>(cpu);
    DC_RETURN_IF_ERROR(tracer->Start());
    made_ = tracer.get();
    return std::unique_ptr<RankTracer>(std::move(tracer));
  }

  StatusOr<RunResult> Run(const proto::Schedule& schedule, const RunOptions& options,
                          Communicator* comm, RankTracer* tracer) override {
    if (tracer != nullptr && tracer != made_) {
      return Status::Error("the cpu backend was given another backend's tracer");
    }
    return RunSchedule(schedule, options, comm,
                       tracer != nullptr ? tracer->execution_tracer() : nullptr);
  }

 private:
  const RankTracer* made_ = nullptr;  // the tracer MakeTracer made
};

}  // namespace

std::unique_ptr<RankBackend> MakeCpuBackend() { return std::make_unique<CpuBackend>(); }

}  // namespace dc
