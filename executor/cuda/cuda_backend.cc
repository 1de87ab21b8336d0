#include "executor/cuda/cuda_backend.h"

#include <string>

#include "collector/cupti/cupti_collector.h"
#include "collector/cupti/execution_tracer.h"
#include "executor/cuda/cuda_device.h"
#include "executor/cuda/nccl_comm.h"

namespace dc {
namespace {

class CuptiRankTracer : public RankTracer {
 public:
  explicit CuptiRankTracer(std::unique_ptr<CuptiCollector> collector)
      : collector_(std::move(collector)), tracer_(collector_.get()) {}
  ExecutionTracer* execution_tracer() override { return &tracer_; }
  Status WriteRankFile() override {
    DC_ASSIGN_OR_RETURN(CuptiTraceCounts counts, collector_->Finish());
    (void)counts;
    return Status::Ok();
  }
  CuptiCollector* collector() { return collector_.get(); }

 private:
  std::unique_ptr<CuptiCollector> collector_;
  CuptiExecutionTracer tracer_;
};

class CudaBackend : public RankBackend {
 public:
  explicit CudaBackend(const CudaRunOptions& options) : options_(options) {}

  std::string name() const override { return "cuda"; }

  StatusOr<std::unique_ptr<Communicator>> Connect(const RendezvousOptions& rendezvous,
                                                  const RankEnv& env) override {
    const std::string who = "rank " + std::to_string(env.rank) + ": ";
    const int devices = CudaDeviceCount();
    if (devices == 0) {
      return Status::Error(who + "the cuda backend needs a CUDA device; none is visible");
    }
    if (env.local_rank >= devices) {
      return Status::Error(who + "local rank " + std::to_string(env.local_rank) +
                           " has no GPU of its own: this host shows " + std::to_string(devices) +
                           " CUDA device(s); start at most " + std::to_string(devices) +
                           " rank(s) per host");
    }
    device_ = env.local_rank;
    DC_RETURN_IF_ERROR(UseCudaDevice(device_).Prefixed(who));
    // The communicator's own stream carries its blocking host-value calls (loss, peaks); the
    // executor enqueues its gathers and reduce-scatters on its own streams.
    DC_ASSIGN_OR_RETURN(comm_stream_, CudaStream::Create());
    DC_ASSIGN_OR_RETURN(std::unique_ptr<NcclCommunicator> comm,
                        ConnectNcclCommunicator(rendezvous, comm_stream_.get()));
    nccl_ = comm.get();
    return std::unique_ptr<Communicator>(std::move(comm));
  }

  StatusOr<std::unique_ptr<RankTracer>> MakeTracer(const RankTraceOptions& options) override {
    CuptiCollectorOptions cupti;
    cupti.output_path = options.part_path;
    cupti.rank = options.identity.rank;
    cupti.local_rank = options.identity.local_rank;
    cupti.world_size = options.identity.world_size;
    cupti.hostname = options.identity.hostname;
    cupti.session_start_utc_ns = options.session_start_ns;
    cupti.device_id = device_;
    // The rank file is committed step by step: a killed run leaves the steps it completed.
    if (options.schedule != nullptr) cupti.stream_blobs = StreamScheduleBlobs(*options.schedule);
    DC_ASSIGN_OR_RETURN(std::unique_ptr<CuptiCollector> collector, CuptiCollector::Create(cupti));
    DC_RETURN_IF_ERROR(collector->Start());
    auto tracer = std::make_unique<CuptiRankTracer>(std::move(collector));
    made_ = tracer.get();
    return std::unique_ptr<RankTracer>(std::move(tracer));
  }

  StatusOr<RunResult> Run(const proto::Schedule& schedule, const RunOptions& options,
                          Communicator* comm, RankTracer* tracer) override {
    if (comm == nullptr || comm != static_cast<Communicator*>(nccl_)) {
      return Status::Error("the cuda backend runs with the NCCL communicator it connected");
    }
    if (tracer != nullptr && tracer != made_) {
      return Status::Error("the cuda backend was given another backend's tracer");
    }
    CuptiCollector* collector = tracer != nullptr ? made_->collector() : nullptr;
    // Aborts the communicator itself when it fails.
    return RunScheduleOnCuda(schedule, options, options_, nccl_, collector);
  }

 private:
  const CudaRunOptions options_;
  int device_ = 0;
  CudaStream comm_stream_;  // outlives the communicator, which the session destroys first
  NcclCommunicator* nccl_ = nullptr;
  CuptiRankTracer* made_ = nullptr;  // the tracer MakeTracer made
};

}  // namespace

std::unique_ptr<RankBackend> MakeCudaBackend(const CudaRunOptions& options) {
  return std::make_unique<CudaBackend>(options);
}

}  // namespace dc
