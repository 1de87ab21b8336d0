#include "executor/cuda/cuda_executor.h"

#include <algorithm>
#include <array>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <vector>

#include "collector/cupti/execution_tracer.h"
#include "executor/cuda/cuda_device.h"
#include "executor/cuda/cuda_kernels.h"
#include "executor/interpreter.h"
#include "executor/layout.h"
#include "schemas/effects.h"
#include "schemas/units.h"

namespace dc {
namespace {

void* At(void* base, int64_t offset_bytes) { return static_cast<char*>(base) + offset_bytes; }

DeviceTensor MakeTensor(void* data, proto::DType dtype, std::vector<int64_t> shape) {
  DeviceTensor t;
  t.data = data;
  t.dtype = dtype;
  t.shape = std::move(shape);
  return t;
}

class PinnedBuffer : public HostBuffer {
 public:
  explicit PinnedBuffer(PinnedHostBuffer buffer) : buffer_(std::move(buffer)) {}
  void* data() override { return buffer_.data(); }
  int64_t size_bytes() const override { return buffer_.size_bytes(); }

 private:
  PinnedHostBuffer buffer_;
};

// One rank's GPU as the interpreter drives it. Each call is enqueued on the CUDA stream of the
// schedule stream it names (STREAM_HOST: synchronous, or the legacy default stream for
// allocations); cross-stream order comes from one CUDA event per instruction that another
// stream waits for (ScheduleLayout::records_event). Buffers live in one DeviceArena at the
// memory plan's offsets, or come from the stream-ordered pool (cudaMallocAsync on the
// allocating instruction's stream, cudaFreeAsync on the releasing one). The loss is summed on
// the device and read once per step.
class CudaDevice : public RankDevice {
 public:
  CudaDevice(const CudaRunOptions& cuda, NcclCommunicator* comm, CuptiCollector* collector)
      : cuda_(cuda), comm_(comm), collector_(collector), rank_(comm->rank()) {}

  proto::DType StorageDType(proto::DType dtype) const override { return dtype; }

  Status Prepare(const proto::Schedule& schedule, const ScheduleLayout& layout) override;

  Status CreateArena(int64_t bytes) override {
    DC_ASSIGN_OR_RETURN(DeviceArena arena, DeviceArena::Create(bytes));
    arena_ = std::move(arena);
    return Status::Ok();
  }

  StatusOr<void*> Allocate(int64_t arena_offset_bytes, int64_t bytes, proto::Stream stream,
                           const std::string& what, const std::string& tensor) override {
    if (arena_offset_bytes >= 0) {
      if (!arena_) return Status::Error(what + ": " + tensor + " placed in an arena never made");
      StatusOr<void*> placed = arena_->Buffer(arena_offset_bytes, bytes, what);
      if (placed.ok()) return placed;
      return Status::Error(placed.status().message() + " (" + tensor + ")");
    }
    void* data = nullptr;
    if (bytes <= 0) return data;
    const cudaError_t error = cudaMallocAsync(&data, static_cast<size_t>(bytes), StreamOf(stream));
    if (error != cudaSuccess) {
      return CudaStatus(error, what + ": cudaMallocAsync of " + FormatBytes(bytes) + " for " +
                                   tensor + " (plan with a lower --budget)");
    }
    return data;
  }

  Status Free(void* data, proto::Stream stream, const std::string& what,
              const std::string& tensor) override {
    if (data == nullptr) return Status::Ok();
    const cudaError_t error =
        stream == proto::STREAM_HOST ? cudaFree(data) : cudaFreeAsync(data, StreamOf(stream));
    if (error == cudaSuccess) return Status::Ok();
    return CudaStatus(error, what + ": freeing " + tensor);
  }

  StatusOr<std::unique_ptr<HostBuffer>> AllocateHost(int64_t bytes,
                                                     const std::string& what) override {
    DC_ASSIGN_OR_RETURN(PinnedHostBuffer buffer, PinnedHostBuffer::Create(bytes, what));
    return std::unique_ptr<HostBuffer>(new PinnedBuffer(std::move(buffer)));
  }

  Status CopyToDevice(void* device, const void* host, int64_t bytes, proto::Stream stream,
                      const std::string& what) override {
    return Copy(device, host, bytes, stream, what);
  }
  Status CopyToHost(void* host, const void* device, int64_t bytes, proto::Stream stream,
                    const std::string& what) override {
    return Copy(host, device, bytes, stream, what);
  }
  Status CopyOnDevice(void* to, const void* from, int64_t bytes, proto::Stream stream,
                      const std::string& what) override {
    return Copy(to, from, bytes, stream, what);
  }

  Status Zero(void* device, int64_t bytes, proto::Stream stream, const std::string& what) override {
    if (bytes <= 0) return Status::Ok();
    if (stream == proto::STREAM_HOST) {
      return CudaStatus(cudaMemset(device, 0, static_cast<size_t>(bytes)),
                        what + ": cudaMemset of " + FormatBytes(bytes));
    }
    return CudaStatus(cudaMemsetAsync(device, 0, static_cast<size_t>(bytes), StreamOf(stream)),
                      what + ": cudaMemsetAsync of " + FormatBytes(bytes));
  }

  Status Cast(const DeviceTensor& from, const DeviceTensor& to, proto::Stream stream,
              const std::string& what) override {
    return CudaCast(from, to, StreamOf(stream)).Prefixed(what + ": ");
  }

  // A snapshot's copies run on the d2h stream into pinned memory, after an event on the compute
  // stream (the step's optimizer); the host and the compute stream go on.
  Status SnapshotToHost(void* host, const void* device, int64_t bytes,
                        const std::string& what) override {
    const cudaStream_t d2h = StreamOf(proto::STREAM_D2H);
    if (!snapshot_open_) {
      DC_RETURN_IF_ERROR(snapshot_start_.Record(compute_stream()).Prefixed(what + ": "));
      DC_RETURN_IF_ERROR(snapshot_start_.MakeStreamWait(d2h).Prefixed(what + ": "));
      snapshot_open_ = true;
    }
    return CopyAsync(host, device, bytes, d2h, what);
  }
  StatusOr<std::function<Status()>> EndSnapshot(const std::string& what) override {
    DC_RETURN_IF_ERROR(snapshot_done_.Record(StreamOf(proto::STREAM_D2H)).Prefixed(what + ": "));
    snapshot_open_ = false;
    // The event is recorded again only when the next snapshot begins, after its saver has
    // waited for this one. The waiting thread makes this rank's device its own first, or the
    // runtime would open a context on device 0 for it.
    DC_ASSIGN_OR_RETURN(const int ordinal, CurrentCudaDevice());
    const CudaEvent* done = &snapshot_done_;
    return std::function<Status()>([done, ordinal, what]() -> Status {
      DC_RETURN_IF_ERROR(UseCudaDevice(ordinal).Prefixed(what + ": "));
      return done->Synchronize().Prefixed(what + ": waiting for the copies: ");
    });
  }
  Status WaitForSnapshot(proto::Stream stream, const std::string& what) override {
    const Status waited = stream == proto::STREAM_HOST
                              ? snapshot_done_.Synchronize()
                              : snapshot_done_.MakeStreamWait(StreamOf(stream));
    return waited.ok() ? waited : waited.Prefixed(what + ": waiting for the snapshot: ");
  }

  Status AllGather(std::span<const GatherItem> items, proto::Stream stream,
                   const std::string& what) override;
  Status ReduceScatterAdd(std::span<const ReduceScatterItem> items, proto::Stream stream,
                          const std::string& what) override;
  Status AllReduceSum(const DeviceTensor& values, proto::Stream stream,
                      const std::string& what) override {
    if (world_ == 1) return Status::Ok();
    if (values.dtype != proto::DTYPE_F32) {
      return Status::Error(what + ": the all-reduce takes fp32 values only");
    }
    return comm_->AllReduceSumOnDevice(static_cast<float*>(values.data), values.NumElements(),
                                       StreamOf(stream));
  }

  Status RunOp(const proto::Op& op, std::span<DeviceTensor> inputs, std::span<DeviceTensor> outputs,
               const OpArgs& args) override {
    CudaKernelContext context;
    context.resources = kernels_.get();
    context.stream = compute_stream();
    context.scratch = kernel_scratch_.data();
    context.scratch_bytes = kernel_scratch_.size_bytes();
    context.config = args.config;
    context.grad_scale = args.grad_scale;
    context.adam_step = args.adam_step;
    context.lr_scale = args.lr_scale;
    return RunCudaOp(op, inputs, outputs, context);
  }

  Status AddLoss(const DeviceTensor& term) override {
    return CudaAccumulate(term, 1.0f, MakeTensor(loss_sum_.data(), proto::DTYPE_F32, {1}),
                          compute_stream());
  }

  Status Record(int index, proto::Stream stream) override {
    Status recorded = events_[index].Record(StreamOf(stream));
    return recorded.ok() ? recorded : recorded.Prefixed(Describe(index) + ": ");
  }

  Status Wait(int index, int dep, proto::Stream stream) override {
    Status waited = stream == proto::STREAM_HOST ? events_[dep].Synchronize()
                                                 : events_[dep].MakeStreamWait(StreamOf(stream));
    if (waited.ok()) return waited;
    return waited.Prefixed(Describe(index) + ": waiting for instruction " + std::to_string(dep) +
                           ": ");
  }

  Status AfterInstruction(int index, proto::Stream stream) override {
    if (!cuda_.synchronous || stream == proto::STREAM_HOST) return Status::Ok();
    DC_RETURN_IF_ERROR(comm_->Synchronize(StreamOf(stream), Describe(index)));
    return kernels_->CheckDeviceErrors(StreamOf(stream)).Prefixed(Describe(index) + ": ");
  }

  Status JoinStreams(const std::string& what) override {
    const cudaStream_t compute = compute_stream();
    for (int s = 0; s < kNumDeviceStreams; ++s) {
      const cudaStream_t stream = streams_.get(static_cast<proto::Stream>(s + 1));
      if (stream == compute) continue;
      DC_RETURN_IF_ERROR(stream_done_[s].Record(stream).Prefixed(what + ": "));
      DC_RETURN_IF_ERROR(stream_done_[s].MakeStreamWait(compute).Prefixed(what + ": "));
    }
    return Status::Ok();
  }

  StatusOr<double> FinishStep(int step) override {
    const std::string what =
        "the end of step " + std::to_string(step) + " on rank " + std::to_string(rank_);
    const cudaStream_t compute = compute_stream();
    DC_RETURN_IF_ERROR(CopyAsync(loss_host_.data(), loss_sum_.data(), sizeof(float), compute,
                                 what + ": reading the loss"));
    DC_RETURN_IF_ERROR(CudaStatus(cudaMemsetAsync(loss_sum_.data(), 0, sizeof(float), compute),
                                  what + ": cudaMemsetAsync of the loss sum"));
    // The communicator names the rank itself.
    DC_RETURN_IF_ERROR(
        comm_->Synchronize(compute, "waiting for the end of step " + std::to_string(step)));
    DC_RETURN_IF_ERROR(kernels_->CheckDeviceErrors(compute).Prefixed(what + ": "));
    return static_cast<double>(*static_cast<const float*>(loss_host_.data()));
  }

  Status Synchronize(const std::string& what) override {
    return CudaStatus(cudaDeviceSynchronize(), what + ": cudaDeviceSynchronize");
  }

  // NCCL kernels of an aborted communicator return; those still waiting for a peer might not.
  void Abort() override { comm_->Abort(); }

 private:
  std::string Describe(int index) const { return DescribeInstruction(*schedule_, index, rank_); }
  // STREAM_HOST maps to the legacy default stream, which waits for (and is waited for by) the
  // others.
  cudaStream_t StreamOf(proto::Stream stream) const {
    return stream == proto::STREAM_HOST ? nullptr : streams_.get(stream);
  }
  cudaStream_t compute_stream() const { return streams_.get(proto::STREAM_COMPUTE); }
  Status Copy(void* to, const void* from, int64_t bytes, proto::Stream stream,
              const std::string& what) {
    if (bytes <= 0) return Status::Ok();
    if (stream == proto::STREAM_HOST) {
      return CudaStatus(cudaMemcpy(to, from, static_cast<size_t>(bytes), cudaMemcpyDefault),
                        what + ": cudaMemcpy of " + FormatBytes(bytes));
    }
    return CopyAsync(to, from, bytes, StreamOf(stream), what);
  }
  Status InitKernelScratch(const proto::Schedule& schedule);
  // The next region of `stream`'s staging buffer for `tensor` in `dtype`.
  StatusOr<void*> StagingFor(proto::Stream stream, const proto::Tensor& tensor, proto::DType dtype,
                             int64_t* offset_bytes, const std::string& what);

  const CudaRunOptions cuda_;
  NcclCommunicator* comm_;
  CuptiCollector* collector_;  // null when not tracing
  const int rank_;
  int world_ = 1;
  const proto::Schedule* schedule_ = nullptr;  // from Prepare, for naming instructions

  CudaStreamSet streams_;
  std::unique_ptr<CudaKernelResources> kernels_;
  DeviceBuffer kernel_scratch_;
  std::vector<CudaEvent> events_;  // by instruction; only where the layout records one
  std::array<CudaEvent, kNumDeviceStreams> stream_done_;  // joins the streams at a step's end
  CudaEvent snapshot_start_;  // on the compute stream: the d2h stream's snapshot copies wait
  CudaEvent snapshot_done_;   // on the d2h stream after a snapshot's last copy
  bool snapshot_open_ = false;
  std::array<DeviceBuffer, kNumDeviceStreams> staging_;  // collective padding, by stream
  std::optional<DeviceArena> arena_;
  DeviceBuffer loss_sum_;  // fp32 [1]: the step's summed loss on the device
  PinnedHostBuffer loss_host_;
};

Status CudaDevice::Prepare(const proto::Schedule& schedule, const ScheduleLayout& layout) {
  world_ = schedule.world_size();
  schedule_ = &schedule;
  DC_ASSIGN_OR_RETURN(streams_, CudaStreamSet::Create());
  auto kernels = CudaKernelResources::Create();
  if (!kernels.ok()) return kernels.status().Prefixed("creating the kernel resources: ");
  kernels_ = std::move(*kernels);
  events_.resize(schedule.instructions_size());
  for (int i = 0; i < schedule.instructions_size(); ++i) {
    if (!layout.records_event[i]) continue;
    auto event = CudaEvent::Create();
    if (!event.ok()) {
      return event.status().Prefixed(DescribeInstruction(schedule, i, rank_) +
                                     ": creating its event: ");
    }
    events_[i] = std::move(*event);
  }
  for (auto& event : stream_done_) {
    auto created = CudaEvent::Create();
    if (!created.ok()) return created.status().Prefixed("creating the step-end events: ");
    event = std::move(*created);
  }
  for (CudaEvent* event : {&snapshot_start_, &snapshot_done_}) {
    auto created = CudaEvent::Create();
    if (!created.ok()) return created.status().Prefixed("creating the snapshot events: ");
    *event = std::move(*created);
  }
  for (int s = 0; s < kNumDeviceStreams; ++s) {
    DC_ASSIGN_OR_RETURN(staging_[s],
                        DeviceBuffer::Create(layout.staging_bytes[s], "collective staging"));
  }
  if (schedule.memory_plan().arena_bytes() <= 0) {
    // Buffers come from the device's stream-ordered pool. Keep what it holds between steps
    // instead of returning it to the driver at every synchronization.
    DC_ASSIGN_OR_RETURN(const int device, CurrentCudaDevice());
    cudaMemPool_t pool = nullptr;
    DC_RETURN_IF_ERROR(
        CudaStatus(cudaDeviceGetDefaultMemPool(&pool, device), "cudaDeviceGetDefaultMemPool"));
    uint64_t keep_all = std::numeric_limits<uint64_t>::max();
    DC_RETURN_IF_ERROR(
        CudaStatus(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep_all),
                   "cudaMemPoolSetAttribute"));
  }
  DC_RETURN_IF_ERROR(InitKernelScratch(schedule));
  DC_ASSIGN_OR_RETURN(loss_sum_, DeviceBuffer::Create(sizeof(float), "loss sum"));
  DC_ASSIGN_OR_RETURN(loss_host_, PinnedHostBuffer::Create(sizeof(float), "loss sum"));
  DC_RETURN_IF_ERROR(
      CudaStatus(cudaMemset(loss_sum_.data(), 0, sizeof(float)), "cudaMemset of the loss sum"));
  if (collector_ != nullptr) {
    for (int s = 0; s < kNumDeviceStreams; ++s) {
      const auto stream = static_cast<proto::Stream>(s + 1);
      (void)collector_->NameStream(streams_.get(stream), StreamName(stream));
    }
  }
  return Status::Ok();
}

Status CudaDevice::InitKernelScratch(const proto::Schedule& schedule) {
  DC_ASSIGN_OR_RETURN(const int64_t bytes, KernelScratchBytes(schedule, rank_));
  DC_ASSIGN_OR_RETURN(kernel_scratch_, DeviceBuffer::Create(bytes, "kernel scratch"));
  return Status::Ok();
}

StatusOr<void*> CudaDevice::StagingFor(proto::Stream stream, const proto::Tensor& tensor,
                                       proto::DType dtype, int64_t* offset_bytes,
                                       const std::string& what) {
  const DeviceBuffer& staging = staging_[DeviceStreamIndex(stream)];
  const int64_t bytes = StagingBytes(tensor, world_, dtype);
  if (*offset_bytes + bytes > staging.size_bytes()) {
    return Status::Error(what + ": the " + StreamName(stream) + " stream's staging of " +
                         FormatBytes(staging.size_bytes()) + " cannot hold " + tensor.name() +
                         " padded to the world size (an executor bug; please report it)");
  }
  void* region = At(staging.data(), *offset_bytes);
  *offset_bytes += bytes;
  return region;
}

// One grouped NCCL call for all the params. Each rank puts its shard, cast to the compute dtype
// where it is the fp32 master, into its own chunk of the gathered buffer and gathers in place; a
// param whose elements do not divide by the world size is gathered in the stream's staging
// buffer (the padded size) and copied out.
Status CudaDevice::AllGather(std::span<const GatherItem> items, proto::Stream stream,
                             const std::string& what) {
  const cudaStream_t cuda_stream = StreamOf(stream);
  std::vector<NcclGatherItem> gathers;
  struct Staged {
    void* from;
    void* to;
    int64_t bytes;
  };
  std::vector<Staged> staged;
  int64_t staging_offset = 0;
  for (const GatherItem& item : items) {
    const proto::DType dtype = item.whole.dtype;
    void* out = item.whole.data;
    if (NeedsStaging(*item.tensor, world_)) {
      DC_ASSIGN_OR_RETURN(out, StagingFor(stream, *item.tensor, dtype, &staging_offset, what));
      staged.push_back({out, item.whole.data, item.whole.SizeBytes()});
    }
    void* mine = At(out, rank_ * item.shard_elements * DTypeSizeBytes(dtype));
    if (item.shard.dtype == dtype) {
      DC_RETURN_IF_ERROR(CopyAsync(mine, item.shard.data, item.shard.SizeBytes(), cuda_stream,
                                   item.tensor->name() + "'s shard"));
    } else {
      DC_RETURN_IF_ERROR(
          CudaCast(item.shard, MakeTensor(mine, dtype, {item.shard_elements}), cuda_stream)
              .Prefixed(item.tensor->name() + ": "));
    }
    gathers.push_back({mine, out, item.shard_elements, dtype});
  }
  DC_RETURN_IF_ERROR(comm_->AllGatherGroup(gathers, cuda_stream));
  for (const Staged& s : staged) {
    DC_RETURN_IF_ERROR(CopyAsync(s.to, s.from, s.bytes, cuda_stream, "unpadding"));
  }
  return Status::Ok();
}

// One grouped NCCL call for all the grads: each grad (its dtype) is summed over the ranks in
// place, and this rank's chunk is added to its fp32 grad shard.
Status CudaDevice::ReduceScatterAdd(std::span<const ReduceScatterItem> items, proto::Stream stream,
                                    const std::string& what) {
  const cudaStream_t cuda_stream = StreamOf(stream);
  std::vector<NcclReduceScatterItem> reductions;
  std::vector<std::pair<DeviceTensor, DeviceTensor>> accumulate;  // (reduced chunk, fp32 shard)
  int64_t staging_offset = 0;
  for (const ReduceScatterItem& item : items) {
    const proto::DType dtype = item.grad.dtype;
    const int64_t element_bytes = DTypeSizeBytes(dtype);
    const int64_t grad_bytes = item.grad.SizeBytes();
    void* full = item.grad.data;
    if (NeedsStaging(*item.tensor, world_)) {
      DC_ASSIGN_OR_RETURN(full, StagingFor(stream, *item.tensor, dtype, &staging_offset, what));
      const int64_t padded_bytes = item.shard_elements * world_ * element_bytes;
      DC_RETURN_IF_ERROR(CopyAsync(full, item.grad.data, grad_bytes, cuda_stream, "padding"));
      DC_RETURN_IF_ERROR(CudaStatus(
          cudaMemsetAsync(At(full, grad_bytes), 0, padded_bytes - grad_bytes, cuda_stream),
          "cudaMemsetAsync of the padding of " + item.tensor->name()));
    }
    void* mine = At(full, rank_ * item.shard_elements * element_bytes);
    reductions.push_back({full, mine, item.shard_elements, dtype});
    accumulate.emplace_back(MakeTensor(mine, dtype, {item.shard_elements}), item.shard);
  }
  DC_RETURN_IF_ERROR(comm_->ReduceScatterGroup(reductions, cuda_stream));
  for (const auto& [chunk, shard] : accumulate) {
    DC_RETURN_IF_ERROR(CudaAccumulate(chunk, 1.0f, shard, cuda_stream));
  }
  return Status::Ok();
}

}  // namespace

// One scratch buffer for every compute op: ops run in order on the compute stream, so the
// largest need is enough, and nothing grows (which would wait for the device) during a step.
StatusOr<int64_t> KernelScratchBytes(const proto::Schedule& schedule, int rank) {
  const int world = schedule.world_size();
  const proto::Program& program = schedule.program();
  int64_t most = 0;
  for (int i = 0; i < schedule.instructions_size(); ++i) {
    const proto::Instruction& instr = schedule.instructions(i);
    if (instr.kind() != proto::INSTR_COMPUTE) continue;
    const proto::Op& op = program.ops(instr.op());
    const bool optimizer = op.phase() == proto::PHASE_OPTIMIZER;
    std::vector<DeviceTensor> inputs, outputs;
    for (int t : op.inputs()) {
      const proto::Tensor& tensor = program.tensors(t);
      if (optimizer && IsPersistentRole(tensor.role())) {
        const BufferShape shape = ShardShape(tensor, world);
        inputs.push_back(MakeTensor(nullptr, shape.dtype, {shape.elements}));
      } else {
        inputs.push_back(MakeTensor(nullptr, TransientShape(program, tensor).dtype,
                                    {tensor.shape().begin(), tensor.shape().end()}));
      }
    }
    for (int t : op.outputs()) {
      const proto::Tensor& tensor = program.tensors(t);
      outputs.push_back(MakeTensor(nullptr, TransientShape(program, tensor).dtype,
                                   {tensor.shape().begin(), tensor.shape().end()}));
    }
    auto bytes = CudaScratchBytes(op, inputs, outputs);
    if (!bytes.ok()) return bytes.status().Prefixed(DescribeInstruction(schedule, i, rank) + ": ");
    most = std::max(most, *bytes);
  }
  return most;
}

StatusOr<RunResult> RunScheduleOnCuda(const proto::Schedule& schedule, const RunOptions& options,
                                      const CudaRunOptions& cuda, NcclCommunicator* comm,
                                      CuptiCollector* collector) {
  // Whatever fails, the other ranks may be waiting in a collective for this one: abort the
  // communicator so they fail at once rather than at their timeout.
  auto failed = [comm](Status status) {
    comm->Abort();
    return status;
  };
  if (Status s = CheckRunnable(schedule, comm->world_size(), "cuda"); !s.ok()) return failed(s);
  std::optional<CuptiExecutionTracer> tracer;
  if (collector != nullptr) tracer.emplace(collector);
  // On a failure the interpreter aborts the communicator (CudaDevice::Abort) before it waits for
  // the device.
  CudaDevice device(cuda, comm, collector);
  return Interpret(schedule, options, &device, comm, tracer ? &*tracer : nullptr);
}

}  // namespace dc
