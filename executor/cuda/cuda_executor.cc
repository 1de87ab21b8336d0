#include "executor/cuda/cuda_executor.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <tuple>
#include <vector>

#include "executor/cpu_kernels.h"
#include "executor/cuda/cuda_device.h"
#include "executor/cuda/cuda_kernels.h"
#include "executor/cuda/cuda_layout.h"
#include "executor/device_memory.h"
#include "executor/rename.h"
#include "models/data.h"
#include "models/model.h"
#include "schemas/digest.h"
#include "schemas/effects.h"
#include "schemas/units.h"

namespace dc {
namespace {

// The memory plan's placements by (instruction, tensor, micro-step).
using PlacementKey = std::tuple<int, int, int>;

void* At(void* base, int64_t offset_bytes) { return static_cast<char*>(base) + offset_bytes; }

DeviceTensor MakeTensor(void* data, proto::DType dtype, std::vector<int64_t> shape) {
  DeviceTensor t;
  t.data = data;
  t.dtype = dtype;
  t.shape = std::move(shape);
  return t;
}

BufferKind ShardKind(const proto::Tensor& t) {
  return t.role() == proto::ROLE_PARAM  ? BufferKind::kShard
         : t.role() == proto::ROLE_GRAD ? BufferKind::kGradShard
                                        : BufferKind::kOptimizerState;
}

// A device buffer of the run: in the arena (pooled = false) or from the stream-ordered pool.
struct Buffer {
  void* data = nullptr;
  CudaBufferShape shape;
  BufferKind kind = BufferKind::kActivation;
  bool pooled = false;
};

class CudaRankRunner : public RankStepper {
 public:
  CudaRankRunner(const proto::Schedule& schedule, const RunOptions& options,
                 const CudaRunOptions& cuda, NcclCommunicator* comm, CuptiCollector* tracer,
                 std::unique_ptr<TokenSource> data, CudaLayout layout)
      : schedule_(schedule),
        program_(schedule.program()),
        options_(options),
        cuda_(cuda),
        comm_(comm),
        tracer_(tracer),
        data_(std::move(data)),
        layout_(std::move(layout)),
        memory_(options.device_memory_bytes),
        world_(comm->world_size()),
        rank_(comm->rank()),
        compute_dtype_(program_.config().compute_dtype()) {}

  ~CudaRankRunner() override;

  Status Init();
  Status RunStep(int step, bool warmup, double* loss, double* seconds) override;
  int64_t peak_live_bytes() const override { return memory_.peak_bytes(); }
  int64_t arena_bytes() const override { return arena_ ? arena_->size_bytes() : 0; }
  std::vector<int64_t> peak_by_kind() const override { return memory_.peak_by_kind(); }
  StatusOr<std::string> ParamsDigest() override;

 private:
  std::string Describe(int index) const { return DescribeInstruction(schedule_, index, rank_); }
  cudaStream_t StreamOf(const proto::Instruction& instr) const {
    return streams_.get(instr.stream());
  }
  cudaStream_t compute_stream() const { return streams_.get(proto::STREAM_COMPUTE); }
  int64_t ShardOf(int tensor) const {
    return ShardElements(NumElements(program_.tensors(tensor)), world_);
  }

  Status InitArena();
  Status InitPersistentShards();
  Status InitKernelScratch();
  Status InitHostBuffers();
  void DescribeToTracer();

  // Creates the buffer `key` for instruction `index` (-1 at start-up) on `stream`.
  StatusOr<Buffer*> Allocate(int index, const BufferKey& key, BufferKind kind,
                             const CudaBufferShape& shape, cudaStream_t stream,
                             const std::string& what);
  Status Release(const BufferKey& key, cudaStream_t stream, const std::string& what);
  Buffer* Find(const BufferKey& key) {
    auto it = live_.find(key);
    return it == live_.end() ? nullptr : &it->second;
  }
  Buffer* Shard(int tensor) { return Find(BufferKey::Persistent(tensor)); }
  // Casts a param's fp32 master into its compute-dtype shard, if it has one, on `stream`.
  Status RefreshComputeShard(int param, cudaStream_t stream, const std::string& what);
  // The same from the master's host copy (a host-resident param): cast on the host, one
  // synchronous copy to the device.
  Status RefreshComputeShardFromHost(int param, const std::string& what);
  // An optimizer op on the host (STREAM_HOST): waits for its deps, copies its grad shards to
  // the host, runs the cpu backend's kernel on the host-resident master and states, and writes
  // the params' compute-dtype shards back. Synchronous: done when it returns.
  Status HostOptimizerStep(const proto::Instruction& instr, int index, int step);
  Status Rename(const proto::Instruction& instr, int index);

  Status Execute(int index, int step);
  Status Dispatch(const proto::Instruction& instr, int index, int step, cudaStream_t stream);
  Status Compute(const proto::Instruction& instr, int index, int step, cudaStream_t stream);
  Status LoadInput(int index, int tensor, int micro, int step, cudaStream_t stream,
                   const std::string& what);
  // The next region of the instruction's stream's staging buffer for `tensor` in `dtype`.
  StatusOr<void*> StagingFor(const proto::Instruction& instr, const proto::Tensor& tensor,
                             proto::DType dtype, int64_t* offset_bytes, const std::string& what);
  Status Gather(const proto::Instruction& instr, int index, cudaStream_t stream);
  Status ReduceScatter(const proto::Instruction& instr, int index, cudaStream_t stream);
  Status Offload(const proto::Instruction& instr, int index, cudaStream_t stream);
  Status Reload(const proto::Instruction& instr, int index, cudaStream_t stream);
  Status ReleaseInstruction(const proto::Instruction& instr, int index, cudaStream_t stream);
  // Makes the compute stream wait for every other stream, then zeroes the grad accumulators,
  // reads the loss, waits for the device (polling NCCL for failed peers) and checks the
  // kernels' device error record.
  Status FinishStep(int step, float* loss_sum);
  // With an arena, moves every reloaded shard from its reload's place back to its start-up
  // place, where the memory plan expects it at the start of the next step.
  Status ReturnReloadedShards(cudaStream_t stream, const std::string& what);

  const proto::Schedule& schedule_;
  const proto::Program& program_;
  const RunOptions& options_;
  const CudaRunOptions cuda_;
  NcclCommunicator* comm_;
  CuptiCollector* tracer_;
  std::unique_ptr<TokenSource> data_;
  const CudaLayout layout_;
  DeviceMemory memory_;
  const int world_;
  const int rank_;
  const proto::DType compute_dtype_;

  CudaStreamSet streams_;
  std::unique_ptr<CudaKernelResources> kernels_;
  DeviceBuffer kernel_scratch_;
  std::vector<CudaEvent> events_;  // by instruction; only where layout_.records_event
  std::array<CudaEvent, kNumCudaStreams> stream_done_;  // joins the streams at a step's end
  std::array<DeviceBuffer, kNumCudaStreams> staging_;   // collective padding, by stream
  std::optional<DeviceArena> arena_;
  std::map<PlacementKey, int64_t> placements_;
  // With an arena: where each persistent shard lives at the start of a step (the plan's
  // instruction -1 placement).
  std::map<int, void*> startup_place_;
  std::map<BufferKey, Buffer> live_;
  std::map<int, PinnedHostBuffer> host_shards_;  // offloaded shards' host copies, by tensor
  std::set<int> offloaded_;                      // tensors whose shard is on the host now
  PinnedHostBuffer input_staging_;               // token ids of every (micro-step, input)
  PinnedHostBuffer host_optimizer_staging_;      // a host optimizer op's grads and casts
  std::map<std::pair<int, int>, int64_t> input_offsets_;
  DeviceBuffer loss_sum_;  // fp32 [1]: the step's summed loss on the device
  PinnedHostBuffer loss_host_;
  std::vector<char> is_loss_term_;  // by tensor id
};

CudaRankRunner::~CudaRankRunner() {
  // Enqueued work may still use the buffers freed below (after a failure); wait for it, and
  // return pool buffers so a later run on this device starts clean.
  (void)cudaDeviceSynchronize();
  for (auto& [key, buffer] : live_) {
    if (buffer.pooled && buffer.data != nullptr) (void)cudaFree(buffer.data);
  }
  (void)cudaGetLastError();
}

// ---------------------------------------------------------------------------------------------
// Start-up

Status CudaRankRunner::Init() {
  // The loss is the cross-entropy plus every MoE layer's balancing term.
  DC_ASSIGN_OR_RETURN(is_loss_term_, LossTerms(program_));
  const std::string who = "rank " + std::to_string(rank_) + ": ";
  auto streams = CudaStreamSet::Create();
  if (!streams.ok()) return streams.status().Prefixed(who + "creating the streams: ");
  streams_ = std::move(*streams);
  auto kernels = CudaKernelResources::Create();
  if (!kernels.ok()) return kernels.status().Prefixed(who + "creating the kernel resources: ");
  kernels_ = std::move(*kernels);
  events_.resize(schedule_.instructions_size());
  for (int i = 0; i < schedule_.instructions_size(); ++i) {
    if (!layout_.records_event[i]) continue;
    auto event = CudaEvent::Create();
    if (!event.ok()) return event.status().Prefixed(Describe(i) + ": creating its event: ");
    events_[i] = std::move(*event);
  }
  for (auto& event : stream_done_) {
    auto created = CudaEvent::Create();
    if (!created.ok()) return created.status().Prefixed(who + "creating the step-end events: ");
    event = std::move(*created);
  }
  for (int s = 0; s < kNumCudaStreams; ++s) {
    DC_ASSIGN_OR_RETURN(staging_[s],
                        DeviceBuffer::Create(layout_.staging_bytes[s], who + "collective staging"));
  }
  DC_RETURN_IF_ERROR(InitArena());
  DC_RETURN_IF_ERROR(InitHostBuffers());  // first: the compute shards of host masters read them
  DC_RETURN_IF_ERROR(InitPersistentShards());
  DC_RETURN_IF_ERROR(InitKernelScratch());
  DC_ASSIGN_OR_RETURN(loss_sum_, DeviceBuffer::Create(sizeof(float), who + "loss sum"));
  DC_ASSIGN_OR_RETURN(loss_host_, PinnedHostBuffer::Create(sizeof(float), who + "loss sum"));
  DC_RETURN_IF_ERROR(CudaStatus(cudaMemset(loss_sum_.data(), 0, sizeof(float)),
                                who + "cudaMemset of the loss sum"));
  DC_RETURN_IF_ERROR(
      CudaStatus(cudaDeviceSynchronize(), who + "cudaDeviceSynchronize after start-up"));
  if (tracer_ != nullptr) DescribeToTracer();
  return Status::Ok();
}

Status CudaRankRunner::InitArena() {
  const proto::MemoryPlan& plan = schedule_.memory_plan();
  if (plan.arena_bytes() <= 0) {
    // Without a memory plan, buffers come from the device's stream-ordered pool. Keep what it
    // holds between steps instead of returning it to the driver at every synchronization.
    auto current = CurrentCudaDevice();
    if (!current.ok()) return current.status().Prefixed("rank " + std::to_string(rank_) + ": ");
    const int device = *current;
    cudaMemPool_t pool = nullptr;
    DC_RETURN_IF_ERROR(
        CudaStatus(cudaDeviceGetDefaultMemPool(&pool, device),
                   "rank " + std::to_string(rank_) + ": cudaDeviceGetDefaultMemPool"));
    uint64_t keep_all = std::numeric_limits<uint64_t>::max();
    return CudaStatus(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep_all),
                      "rank " + std::to_string(rank_) + ": cudaMemPoolSetAttribute");
  }
  // The arena is the one device allocation: it must fit the capacity, and then every buffer
  // placed inside it does too.
  const int64_t capacity = memory_.capacity_bytes();
  if (capacity > 0 && plan.arena_bytes() > capacity) {
    return Status::Error("out of device memory at start-up on rank " + std::to_string(rank_) +
                         ": the memory plan's arena of " + FormatBytes(plan.arena_bytes()) +
                         " is over the capacity of " + FormatBytes(capacity) +
                         "; raise --device-memory or plan with a lower --budget");
  }
  auto arena = DeviceArena::Create(plan.arena_bytes());
  if (!arena.ok()) {
    return arena.status().Prefixed("out of device memory at start-up on rank " +
                                   std::to_string(rank_) + " (plan with a lower --budget): ");
  }
  arena_ = std::move(*arena);
  memory_ = DeviceMemory(0);
  for (const auto& p : plan.placements()) {
    placements_[{p.instruction(), p.tensor(), p.micro_step()}] = p.offset_bytes();
  }
  return Status::Ok();
}

Status CudaRankRunner::InitPersistentShards() {
  const proto::ModelConfig& config = program_.config();
  std::vector<float> host;
  for (const auto& t : program_.tensors()) {
    if (t.role() != proto::ROLE_PARAM && t.role() != proto::ROLE_GRAD &&
        t.role() != proto::ROLE_OPTIMIZER_STATE) {
      continue;
    }
    if (layout_.host_resident[t.id()]) continue;  // InitHostBuffers made it on the host
    const CudaBufferShape shape = ShardShape(t, world_);
    const std::string what =
        "start-up (persistent shard of " + t.name() + ") on rank " + std::to_string(rank_);
    DC_ASSIGN_OR_RETURN(Buffer * shard, Allocate(-1, BufferKey::Persistent(t.id()), ShardKind(t),
                                                 shape, nullptr, what));
    if (arena_) startup_place_[t.id()] = shard->data;
    if (t.role() == proto::ROLE_PARAM) {
      host.assign(shape.elements, 0.0f);
      InitParamSlice(config, t, rank_ * shape.elements, shape.elements, host.data());
      DC_RETURN_IF_ERROR(
          CudaStatus(cudaMemcpy(shard->data, host.data(), shape.size_bytes, cudaMemcpyHostToDevice),
                     what + ": cudaMemcpy of " + FormatBytes(shape.size_bytes)));
    } else {
      DC_RETURN_IF_ERROR(CudaStatus(cudaMemset(shard->data, 0, shape.size_bytes),
                                    what + ": cudaMemset of " + FormatBytes(shape.size_bytes)));
    }
  }
  const std::vector<bool> compute_shard = ComputeShardParams(schedule_);
  const cudaStream_t stream = compute_stream();
  for (const auto& t : program_.tensors()) {
    if (!compute_shard[t.id()]) continue;
    const int64_t elements = ShardShape(t, world_).elements;
    const CudaBufferShape shape{compute_dtype_, elements, ComputeShardBytes(program_, t, world_)};
    const std::string what =
        "start-up (compute-dtype shard of " + t.name() + ") on rank " + std::to_string(rank_);
    DC_RETURN_IF_ERROR(
        Allocate(-1, BufferKey::ComputeShard(t.id()), BufferKind::kShard, shape, nullptr, what)
            .status());
    if (layout_.host_resident[t.id()]) {
      DC_RETURN_IF_ERROR(RefreshComputeShardFromHost(t.id(), what));
    } else {
      DC_RETURN_IF_ERROR(RefreshComputeShard(t.id(), stream, what));
    }
  }
  return CudaStatus(
      cudaStreamSynchronize(stream),
      "rank " + std::to_string(rank_) + ": start-up casts of the compute-dtype shards");
}

Status CudaRankRunner::RefreshComputeShard(int param, cudaStream_t stream,
                                           const std::string& what) {
  Buffer* compute = Find(BufferKey::ComputeShard(param));
  const Buffer* master = Shard(param);
  if (compute == nullptr || master == nullptr) return Status::Ok();
  const int64_t elements = master->shape.elements;
  return CudaCast(MakeTensor(master->data, proto::DTYPE_F32, {elements}),
                  MakeTensor(compute->data, compute->shape.dtype, {elements}), stream)
      .Prefixed(what + ": " + program_.tensors(param).name() + "'s compute-dtype shard: ");
}

Status CudaRankRunner::RefreshComputeShardFromHost(int param, const std::string& what) {
  Buffer* compute = Find(BufferKey::ComputeShard(param));
  auto master = host_shards_.find(param);
  if (compute == nullptr || master == host_shards_.end()) return Status::Ok();
  const int64_t elements = compute->shape.elements;
  if (host_optimizer_staging_.size_bytes() < compute->shape.size_bytes) {
    return Status::Error(what + ": the host optimizer's staging of " +
                         FormatBytes(host_optimizer_staging_.size_bytes()) + " cannot hold " +
                         program_.tensors(param).name() +
                         "'s compute-dtype shard (an executor bug; please report it)");
  }
  CastOnHost(static_cast<const float*>(master->second.data()), elements, compute->shape.dtype,
             host_optimizer_staging_.data());
  return CudaStatus(
      cudaMemcpy(compute->data, host_optimizer_staging_.data(), compute->shape.size_bytes,
                 cudaMemcpyHostToDevice),
      what + ": " + program_.tensors(param).name() + "'s compute-dtype shard from the host");
}

Status CudaRankRunner::HostOptimizerStep(const proto::Instruction& instr, int index, int step) {
  const proto::Op& op = program_.ops(instr.op());
  const std::string what = Describe(index) + " on the host";
  for (int d : layout_.waits[index]) {
    DC_RETURN_IF_ERROR(events_[d].Synchronize().Prefixed(what + ": waiting for instruction " +
                                                         std::to_string(d) + ": "));
  }
  // Grad shards first, side by side in the staging; the casts reuse it afterwards.
  std::vector<TensorRef> inputs;
  int64_t offset = 0;
  for (int tensor : op.inputs()) {
    const proto::Tensor& t = program_.tensors(tensor);
    TensorRef ref;
    if (t.role() == proto::ROLE_GRAD) {
      const Buffer* grad = Shard(tensor);
      if (grad == nullptr) return Status::Error(what + ": " + t.name() + " has no shard");
      if (offset + grad->shape.size_bytes > host_optimizer_staging_.size_bytes()) {
        return Status::Error(what + ": the host optimizer's staging cannot hold " + t.name() +
                             " (an executor bug; please report it)");
      }
      void* host = static_cast<char*>(host_optimizer_staging_.data()) + offset;
      DC_RETURN_IF_ERROR(
          CudaStatus(cudaMemcpy(host, grad->data, grad->shape.size_bytes, cudaMemcpyDeviceToHost),
                     what + ": copying " + t.name() + " to the host"));
      constexpr int64_t kAlign = kCudaStagingAlignmentBytes;
      offset += (grad->shape.size_bytes + kAlign - 1) / kAlign * kAlign;
      ref.f32 = static_cast<float*>(host);
      ref.shape = {grad->shape.elements};
    } else {
      auto host = host_shards_.find(tensor);
      if (host == host_shards_.end() || !layout_.host_resident[tensor]) {
        return Status::Error(what + ": " + t.name() + " is not in host memory; re-plan it");
      }
      ref.f32 = static_cast<float*>(host->second.data());
      ref.shape = {ShardOf(tensor)};
    }
    inputs.push_back(ref);
  }
  if (op.outputs_size() > 0) {
    return Status::Error(what + ": " + op.name() +
                         " writes tensors besides its shards; the host "
                         "runs in-place optimizer ops only");
  }
  KernelContext context;
  context.config = &program_.config();
  context.grad_scale = 1.0 / static_cast<double>(TokensPerStep(program_.config(), world_));
  context.adam_step = step + 1;
  context.num_threads = options_.num_threads;
  DC_RETURN_IF_ERROR(RunCpuOp(op, inputs, {}, context).Prefixed(what + ": "));
  for (int tensor : op.inputs()) {
    if (program_.tensors(tensor).role() != proto::ROLE_PARAM) continue;
    DC_RETURN_IF_ERROR(RefreshComputeShardFromHost(tensor, what));
  }
  if (layout_.records_event[index]) {
    // Recorded on the compute stream: a waiter also waits for the compute queued before it,
    // which is never less than the host op's own completion (done by now).
    DC_RETURN_IF_ERROR(events_[index].Record(compute_stream()).Prefixed(what + ": "));
  }
  return Status::Ok();
}

// One scratch buffer for every compute op: ops run in order on the compute stream, so the
// largest need is enough, and nothing grows (which would wait for the device) during a step.
Status CudaRankRunner::InitKernelScratch() {
  int64_t most = 0;
  for (int i = 0; i < schedule_.instructions_size(); ++i) {
    const proto::Instruction& instr = schedule_.instructions(i);
    if (instr.kind() != proto::INSTR_COMPUTE) continue;
    const proto::Op& op = program_.ops(instr.op());
    const bool optimizer = op.phase() == proto::PHASE_OPTIMIZER;
    std::vector<DeviceTensor> inputs, outputs;
    for (int t : op.inputs()) {
      const proto::Tensor& tensor = program_.tensors(t);
      if (optimizer) {
        const CudaBufferShape shape = ShardShape(tensor, world_);
        inputs.push_back(MakeTensor(nullptr, shape.dtype, {shape.elements}));
      } else {
        inputs.push_back(MakeTensor(nullptr, TransientShape(program_, tensor).dtype,
                                    {tensor.shape().begin(), tensor.shape().end()}));
      }
    }
    for (int t : op.outputs()) {
      const proto::Tensor& tensor = program_.tensors(t);
      outputs.push_back(MakeTensor(nullptr, TransientShape(program_, tensor).dtype,
                                   {tensor.shape().begin(), tensor.shape().end()}));
    }
    auto bytes = CudaScratchBytes(op, inputs, outputs);
    if (!bytes.ok()) return bytes.status().Prefixed(Describe(i) + ": ");
    most = std::max(most, *bytes);
  }
  DC_ASSIGN_OR_RETURN(kernel_scratch_, DeviceBuffer::Create(most, "rank " + std::to_string(rank_) +
                                                                      ": kernel scratch"));
  return Status::Ok();
}

// Pinned host memory is made once: cudaHostAlloc is slow and may synchronize the device.
Status CudaRankRunner::InitHostBuffers() {
  const std::string who = "rank " + std::to_string(rank_) + ": ";
  for (const auto& [tensor, bytes] : layout_.pinned_shard_bytes) {
    DC_ASSIGN_OR_RETURN(
        host_shards_[tensor],
        PinnedHostBuffer::Create(bytes, who + "host copy of " + program_.tensors(tensor).name()));
  }
  int64_t offset = 0;
  for (int micro = 0; micro < layout_.gas; ++micro) {
    for (const auto& [tensor, bytes] : layout_.input_bytes) {
      input_offsets_[{micro, tensor}] = offset;
      offset += bytes;
    }
  }
  DC_ASSIGN_OR_RETURN(input_staging_, PinnedHostBuffer::Create(offset, who + "token staging"));
  DC_ASSIGN_OR_RETURN(host_optimizer_staging_,
                      PinnedHostBuffer::Create(layout_.host_optimizer_staging_bytes,
                                               who + "host optimizer staging"));
  // The host optimizer's masters and states start in host memory, as the device's would.
  const proto::ModelConfig& config = program_.config();
  for (const auto& t : program_.tensors()) {
    if (!layout_.host_resident[t.id()]) continue;
    const int64_t elements = ShardOf(t.id());
    auto* values = static_cast<float*>(host_shards_.at(t.id()).data());
    std::fill(values, values + elements, 0.0f);
    if (t.role() == proto::ROLE_PARAM) {
      InitParamSlice(config, t, rank_ * elements, elements, values);
    }
  }
  return Status::Ok();
}

void CudaRankRunner::DescribeToTracer() {
  for (int i = 0; i < schedule_.instructions_size(); ++i) {
    const proto::Instruction& instr = schedule_.instructions(i);
    InstructionInfo info;
    info.kind = InstrKindName(instr.kind());
    info.micro_step = instr.micro_step();
    info.tensors = instr.tensors_size();
    info.bucket = instr.bucket();
    for (int t : instr.tensors()) {
      if (instr.kind() == proto::INSTR_ALL_GATHER || instr.kind() == proto::INSTR_REDUCE_SCATTER) {
        info.bytes += TransientBytes(program_, program_.tensors(t));
      } else if (instr.kind() == proto::INSTR_OFFLOAD || instr.kind() == proto::INSTR_RELOAD) {
        info.bytes += ShardOf(t) * kShardElementBytes;
      }
    }
    tracer_->DescribeInstruction(i, std::move(info));
  }
  for (int s = 0; s < kNumCudaStreams; ++s) {
    const auto stream = static_cast<proto::Stream>(s + 1);
    (void)tracer_->NameStream(streams_.get(stream), StreamName(stream));
  }
}

// ---------------------------------------------------------------------------------------------
// Buffers

StatusOr<Buffer*> CudaRankRunner::Allocate(int index, const BufferKey& key, BufferKind kind,
                                           const CudaBufferShape& shape, cudaStream_t stream,
                                           const std::string& what) {
  DC_RETURN_IF_ERROR(memory_.Allocate(kind, shape.size_bytes, what));
  Buffer buffer;
  buffer.shape = shape;
  buffer.kind = kind;
  const proto::Tensor& t = program_.tensors(key.tensor);
  if (arena_) {
    auto it = placements_.find({index, key.tensor, key.placement_micro_step()});
    if (it == placements_.end()) {
      return Status::Error(what + ": the memory plan has no place for " + t.name() +
                           " at instruction " + std::to_string(index) + "; re-plan it");
    }
    DC_ASSIGN_OR_RETURN(buffer.data,
                        arena_->Buffer(it->second, shape.size_bytes, what + ": " + t.name()));
  } else if (shape.size_bytes > 0) {
    DC_RETURN_IF_ERROR(
        CudaStatus(cudaMallocAsync(&buffer.data, static_cast<size_t>(shape.size_bytes), stream),
                   what + ": cudaMallocAsync of " + FormatBytes(shape.size_bytes) + " for " +
                       t.name() + " (plan with a lower --budget)"));
    buffer.pooled = true;
  }
  auto [it, inserted] = live_.emplace(key, buffer);
  if (!inserted) return Status::Error(what + ": " + t.name() + " is already live");
  return &it->second;
}

Status CudaRankRunner::Release(const BufferKey& key, cudaStream_t stream, const std::string& what) {
  auto it = live_.find(key);
  memory_.Free(it->second.kind, it->second.shape.size_bytes);
  const Buffer buffer = it->second;
  live_.erase(it);
  // Arena bytes need nothing: the plan's reuse dependencies order their next user after this.
  if (!buffer.pooled) return Status::Ok();
  return CudaStatus(cudaFreeAsync(buffer.data, stream),
                    what + ": cudaFreeAsync of " + program_.tensors(key.tensor).name());
}

// ---------------------------------------------------------------------------------------------
// Instructions

Status CudaRankRunner::Execute(int index, int step) {
  const proto::Instruction& instr = schedule_.instructions(index);
  if (instr.stream() == proto::STREAM_HOST) return HostOptimizerStep(instr, index, step);
  const cudaStream_t stream = StreamOf(instr);
  for (int d : layout_.waits[index]) {
    DC_RETURN_IF_ERROR(events_[d].MakeStreamWait(stream).Prefixed(
        Describe(index) + ": waiting for instruction " + std::to_string(d) + ": "));
  }
  if (tracer_ != nullptr) DC_RETURN_IF_ERROR(tracer_->PushInstruction(step, index));
  const Status status = Dispatch(instr, index, step, stream);
  if (tracer_ != nullptr) {
    const Status popped = tracer_->PopInstruction();
    DC_RETURN_IF_ERROR(status);
    DC_RETURN_IF_ERROR(popped);
  }
  DC_RETURN_IF_ERROR(status);
  if (layout_.records_event[index]) {
    DC_RETURN_IF_ERROR(events_[index].Record(stream).Prefixed(Describe(index) + ": "));
  }
  if (cuda_.synchronous) {
    DC_RETURN_IF_ERROR(comm_->Synchronize(stream, Describe(index)));
    DC_RETURN_IF_ERROR(kernels_->CheckDeviceErrors(stream).Prefixed(Describe(index) + ": "));
  }
  return Status::Ok();
}

Status CudaRankRunner::Dispatch(const proto::Instruction& instr, int index, int step,
                                cudaStream_t stream) {
  switch (instr.kind()) {
    case proto::INSTR_COMPUTE:
      return Compute(instr, index, step, stream);
    case proto::INSTR_ALL_GATHER:
      return Gather(instr, index, stream);
    case proto::INSTR_REDUCE_SCATTER:
      return ReduceScatter(instr, index, stream);
    case proto::INSTR_OFFLOAD:
      return Offload(instr, index, stream);
    case proto::INSTR_RELOAD:
      return Reload(instr, index, stream);
    case proto::INSTR_RELEASE:
      return ReleaseInstruction(instr, index, stream);
    case proto::INSTR_RENAME:
      return Rename(instr, index);
    default:
      return Status::Error(Describe(index) + ": the cuda backend does not run " +
                           InstrKindName(instr.kind()) + " instructions");
  }
}

Status CudaRankRunner::LoadInput(int index, int tensor, int micro, int step, cudaStream_t stream,
                                 const std::string& what) {
  const proto::ModelConfig& config = program_.config();
  const proto::Tensor& t = program_.tensors(tensor);
  DC_ASSIGN_OR_RETURN(Buffer * tokens,
                      Allocate(index, BufferKey::Transient(tensor, micro), BufferKind::kInput,
                               TransientShape(program_, t), stream, what));
  auto offset = input_offsets_.find({micro, tensor});
  if (offset == input_offsets_.end()) {
    return Status::Error(what + ": reads " + t.name() + " in micro-step " + std::to_string(micro) +
                         ", outside the plan's " + std::to_string(layout_.gas) +
                         " micro-step(s); re-plan it");
  }
  // Each (micro-step, input) has its own pinned region, written once per step: the copy of the
  // previous step has finished (the step's end waits for the device). A plan that loads the same
  // input twice in a micro-step rewrites the region with the same sample.
  auto* staged = static_cast<int32_t*>(At(input_staging_.data(), offset->second));
  const int64_t seq = config.seq();
  std::vector<int32_t> inputs(seq), targets(seq);
  for (int64_t b = 0; b < config.micro_batch(); ++b) {
    data_->Sample(SampleIndex(config, world_, step, micro, rank_, b), inputs.data(),
                  targets.data());
    const auto& source = t.name() == "targets" ? targets : inputs;
    std::copy(source.begin(), source.end(), staged + b * seq);
  }
  return CopyAsync(tokens->data, staged, tokens->shape.size_bytes, stream, what + ": " + t.name());
}

Status CudaRankRunner::Compute(const proto::Instruction& instr, int index, int step,
                               cudaStream_t stream) {
  const proto::Op& op = program_.ops(instr.op());
  const bool optimizer = op.phase() == proto::PHASE_OPTIMIZER;
  const int micro = instr.micro_step();
  const std::string what = Describe(index);
  auto view_of = [](const Buffer& b, const proto::Tensor& t) {
    return MakeTensor(b.data, b.shape.dtype, {t.shape().begin(), t.shape().end()});
  };
  std::vector<DeviceTensor> inputs, outputs;
  for (int tensor : op.inputs()) {
    const proto::Tensor& t = program_.tensors(tensor);
    if (optimizer) {
      Buffer* shard = Shard(tensor);
      if (!shard) {
        return Status::Error(what + ": " + t.name() +
                             (offloaded_.count(tensor)
                                  ? "'s shard is offloaded; the plan must reload it first"
                                  : " has no shard"));
      }
      inputs.push_back(MakeTensor(shard->data, shard->shape.dtype, {shard->shape.elements}));
      continue;
    }
    const BufferKey key = BufferKey::OfOperand(tensor, t.role(), micro);
    if (t.role() == proto::ROLE_INPUT && !Find(BufferKey::Transient(tensor, micro))) {
      DC_RETURN_IF_ERROR(LoadInput(index, tensor, micro, step, stream, what));
    }
    Buffer* buffer = Find(key);
    if (!buffer) {
      return Status::Error(
          what + ": reads " + t.name() +
          (t.role() == proto::ROLE_PARAM ? ", which is not gathered" : ", which is not live"));
    }
    inputs.push_back(view_of(*buffer, t));
  }
  for (int tensor : op.outputs()) {
    const proto::Tensor& t = program_.tensors(tensor);
    if (Find(BufferKey::Transient(tensor, micro)))
      return Status::Error(what + ": " + t.name() + " is already live");
    DC_ASSIGN_OR_RETURN(Buffer * buffer,
                        Allocate(index, BufferKey::Transient(tensor, micro), TransientKind(t),
                                 TransientShape(program_, t), stream, what));
    outputs.push_back(view_of(*buffer, t));
  }
  CudaKernelContext context;
  context.resources = kernels_.get();
  context.stream = stream;
  context.scratch = kernel_scratch_.data();
  context.scratch_bytes = kernel_scratch_.size_bytes();
  context.config = &program_.config();
  context.grad_scale = 1.0 / static_cast<double>(TokensPerStep(program_.config(), world_));
  context.adam_step = step + 1;
  DC_RETURN_IF_ERROR(RunCudaOp(op, inputs, outputs, context).Prefixed(what + ": "));
  if (optimizer) {
    for (int tensor : op.inputs()) {
      if (program_.tensors(tensor).role() != proto::ROLE_PARAM) continue;
      DC_RETURN_IF_ERROR(RefreshComputeShard(tensor, stream, what));
    }
  }
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (!is_loss_term_[op.outputs(i)]) continue;
    DC_RETURN_IF_ERROR(CudaAccumulate(outputs[i], 1.0f,
                                      MakeTensor(loss_sum_.data(), proto::DTYPE_F32, {1}), stream)
                           .Prefixed(what + ": summing the loss: "));
  }
  return Status::Ok();
}

StatusOr<void*> CudaRankRunner::StagingFor(const proto::Instruction& instr,
                                           const proto::Tensor& tensor, proto::DType dtype,
                                           int64_t* offset_bytes, const std::string& what) {
  const DeviceBuffer& staging = staging_[CudaStreamIndex(instr.stream())];
  const int64_t bytes = StagingBytes(tensor, world_, dtype);
  if (*offset_bytes + bytes > staging.size_bytes()) {
    return Status::Error(what + ": the " + StreamName(instr.stream()) + " stream's staging of " +
                         FormatBytes(staging.size_bytes()) + " cannot hold " + tensor.name() +
                         " padded to the world size (an executor bug; please report it)");
  }
  void* region = At(staging.data(), *offset_bytes);
  *offset_bytes += bytes;
  return region;
}

// One grouped NCCL call for all the instruction's params. Each rank casts its fp32 shard to the
// compute dtype into its own chunk of the gathered buffer and gathers in place; a param whose
// elements do not divide by the world size is gathered in the stream's staging buffer (the
// padded size) and copied out.
Status CudaRankRunner::Gather(const proto::Instruction& instr, int index, cudaStream_t stream) {
  const std::string what = Describe(index);
  const int64_t element_bytes = DTypeSizeBytes(compute_dtype_);
  std::vector<NcclGatherItem> items;
  struct Staged {
    void* from;
    void* to;
    int64_t bytes;
  };
  std::vector<Staged> staged;
  int64_t staging_offset = 0;
  for (int tensor : instr.tensors()) {
    const proto::Tensor& t = program_.tensors(tensor);
    if (t.role() != proto::ROLE_PARAM) {
      return Status::Error(what + ": " + t.name() + " is not a param");
    }
    if (Find(BufferKey::Gathered(tensor))) {
      return Status::Error(what + ": " + t.name() + " is already gathered");
    }
    Buffer* shard = Shard(tensor);
    const Buffer* compute = Find(BufferKey::ComputeShard(tensor));
    if (!shard && !compute) return Status::Error(what + ": " + t.name() + "'s shard is offloaded");
    DC_ASSIGN_OR_RETURN(Buffer * whole,
                        Allocate(index, BufferKey::Gathered(tensor), BufferKind::kGathered,
                                 TransientShape(program_, t), stream, what));
    const int64_t shard_elements = ShardShape(t, world_).elements;
    void* out = whole->data;
    if (NeedsStaging(t, world_)) {
      DC_ASSIGN_OR_RETURN(out, StagingFor(instr, t, compute_dtype_, &staging_offset, what));
      staged.push_back({out, whole->data, whole->shape.size_bytes});
    }
    void* mine = At(out, rank_ * shard_elements * element_bytes);
    if (compute != nullptr) {
      // The master may be on the host: the compute-dtype shard is this rank's chunk as it is.
      DC_RETURN_IF_ERROR(CopyAsync(mine, compute->data, compute->shape.size_bytes, stream,
                                   what + ": " + t.name() + "'s compute-dtype shard"));
    } else {
      DC_RETURN_IF_ERROR(CudaCast(MakeTensor(shard->data, proto::DTYPE_F32, {shard_elements}),
                                  MakeTensor(mine, compute_dtype_, {shard_elements}), stream)
                             .Prefixed(what + ": " + t.name() + ": "));
    }
    items.push_back({mine, out, shard_elements, compute_dtype_});
  }
  DC_RETURN_IF_ERROR(comm_->AllGatherGroup(items, stream).Prefixed(what + ": "));
  for (const Staged& s : staged) {
    DC_RETURN_IF_ERROR(CopyAsync(s.to, s.from, s.bytes, stream, what + ": unpadding"));
  }
  return Status::Ok();
}

// One grouped NCCL call for all the instruction's grads: each grad (compute dtype) is summed
// over the ranks in place, and this rank's chunk is added to its fp32 grad shard.
Status CudaRankRunner::ReduceScatter(const proto::Instruction& instr, int index,
                                     cudaStream_t stream) {
  const std::string what = Describe(index);
  std::vector<NcclReduceScatterItem> items;
  std::vector<std::pair<DeviceTensor, DeviceTensor>> accumulate;  // (reduced chunk, fp32 shard)
  int64_t staging_offset = 0;
  for (int tensor : instr.tensors()) {
    const proto::Tensor& t = program_.tensors(tensor);
    Buffer* grad = Find(BufferKey::Transient(tensor, instr.micro_step()));
    if (!grad) {
      return Status::Error(what + ": reduce-scatter of " + t.name() + ", which is not live");
    }
    Buffer* shard = Shard(tensor);
    if (!shard) {
      return Status::Error(what + ": reduce-scatter into " + t.name() + "'s offloaded shard");
    }
    const proto::DType dtype = grad->shape.dtype;
    const int64_t element_bytes = DTypeSizeBytes(dtype);
    const int64_t shard_elements = shard->shape.elements;
    void* full = grad->data;
    if (NeedsStaging(t, world_)) {
      DC_ASSIGN_OR_RETURN(full, StagingFor(instr, t, dtype, &staging_offset, what));
      const int64_t padded_bytes = shard_elements * world_ * element_bytes;
      DC_RETURN_IF_ERROR(
          CopyAsync(full, grad->data, grad->shape.size_bytes, stream, what + ": padding"));
      DC_RETURN_IF_ERROR(CudaStatus(cudaMemsetAsync(At(full, grad->shape.size_bytes), 0,
                                                    padded_bytes - grad->shape.size_bytes, stream),
                                    what + ": cudaMemsetAsync of the padding of " + t.name()));
    }
    void* mine = At(full, rank_ * shard_elements * element_bytes);
    items.push_back({full, mine, shard_elements, dtype});
    accumulate.emplace_back(MakeTensor(mine, dtype, {shard_elements}),
                            MakeTensor(shard->data, proto::DTYPE_F32, {shard_elements}));
  }
  DC_RETURN_IF_ERROR(comm_->ReduceScatterGroup(items, stream).Prefixed(what + ": "));
  for (const auto& [chunk, shard] : accumulate) {
    DC_RETURN_IF_ERROR(CudaAccumulate(chunk, 1.0f, shard, stream).Prefixed(what + ": "));
  }
  return Status::Ok();
}

// Offload copies a persistent shard to its pinned host buffer and frees it on the device; reload
// allocates it again and copies it back (after the offload's copy: MakeCudaLayout's wait).
Status CudaRankRunner::Offload(const proto::Instruction& instr, int index, cudaStream_t stream) {
  const std::string what = Describe(index);
  for (int tensor : instr.tensors()) {
    const proto::Tensor& t = program_.tensors(tensor);
    Buffer* shard = Shard(tensor);
    if (!shard) {
      return Status::Error(
          what + ": " + t.name() +
          " is not a persistent shard on the device (the cuda backend offloads shards only)");
    }
    DC_RETURN_IF_ERROR(CopyAsync(host_shards_.at(tensor).data(), shard->data,
                                 shard->shape.size_bytes, stream, what + ": " + t.name()));
    DC_RETURN_IF_ERROR(Release(BufferKey::Persistent(tensor), stream, what));
    offloaded_.insert(tensor);
  }
  return Status::Ok();
}

Status CudaRankRunner::Reload(const proto::Instruction& instr, int index, cudaStream_t stream) {
  const std::string what = Describe(index);
  for (int tensor : instr.tensors()) {
    const proto::Tensor& t = program_.tensors(tensor);
    if (!offloaded_.count(tensor)) {
      return Status::Error(what + ": " + t.name() + " is not offloaded");
    }
    DC_ASSIGN_OR_RETURN(Buffer * shard, Allocate(index, BufferKey::Persistent(tensor), ShardKind(t),
                                                 ShardShape(t, world_), stream, what));
    DC_RETURN_IF_ERROR(CopyAsync(shard->data, host_shards_.at(tensor).data(),
                                 shard->shape.size_bytes, stream, what + ": " + t.name()));
    offloaded_.erase(tensor);
  }
  return Status::Ok();
}

// The kept buffers go on under the op's output names (same dtype and shape): nothing runs on
// the device, so no stream is involved.
Status CudaRankRunner::Rename(const proto::Instruction& instr, int index) {
  return RenameLiveBuffers(program_, instr, Describe(index), &live_);
}

Status CudaRankRunner::ReleaseInstruction(const proto::Instruction& instr, int index,
                                          cudaStream_t stream) {
  for (int tensor : instr.tensors()) {
    const BufferKey key =
        BufferKey::OfOperand(tensor, program_.tensors(tensor).role(), instr.micro_step());
    if (!Find(key)) {
      return Status::Error(Describe(index) + ": releases " + program_.tensors(tensor).name() +
                           ", which is not live");
    }
    DC_RETURN_IF_ERROR(Release(key, stream, Describe(index)));
  }
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------------
// Steps

Status CudaRankRunner::FinishStep(int step, float* loss_sum) {
  const std::string what =
      "the end of step " + std::to_string(step) + " on rank " + std::to_string(rank_);
  const cudaStream_t compute = compute_stream();
  for (int s = 0; s < kNumCudaStreams; ++s) {
    const cudaStream_t stream = streams_.get(static_cast<proto::Stream>(s + 1));
    if (stream == compute) continue;
    DC_RETURN_IF_ERROR(stream_done_[s].Record(stream).Prefixed(what + ": "));
    DC_RETURN_IF_ERROR(stream_done_[s].MakeStreamWait(compute).Prefixed(what + ": "));
  }
  DC_RETURN_IF_ERROR(ReturnReloadedShards(compute, what));
  // The grad accumulators start the next step empty; every stream's work is done before these
  // run, the optimizer's reads included.
  for (auto& [key, buffer] : live_) {
    if (program_.tensors(key.tensor).role() != proto::ROLE_GRAD) continue;
    DC_RETURN_IF_ERROR(
        CudaStatus(cudaMemsetAsync(buffer.data, 0, buffer.shape.size_bytes, compute),
                   what + ": cudaMemsetAsync of " + program_.tensors(key.tensor).name()));
  }
  DC_RETURN_IF_ERROR(CopyAsync(loss_host_.data(), loss_sum_.data(), sizeof(float), compute,
                               what + ": reading the loss"));
  DC_RETURN_IF_ERROR(CudaStatus(cudaMemsetAsync(loss_sum_.data(), 0, sizeof(float), compute),
                                what + ": cudaMemsetAsync of the loss sum"));
  // The communicator names the rank itself.
  DC_RETURN_IF_ERROR(
      comm_->Synchronize(compute, "waiting for the end of step " + std::to_string(step)));
  DC_RETURN_IF_ERROR(kernels_->CheckDeviceErrors(compute).Prefixed(what + ": "));
  *loss_sum = *static_cast<const float*>(loss_host_.data());
  return Status::Ok();
}

// The plan's next step offloads the shard from its start-up place at once, on the d2h stream,
// while the other streams may already reuse the reload's bytes: so the shard must be back first.
// The start-up place is free here (every transient buffer is released at the step's end).
Status CudaRankRunner::ReturnReloadedShards(cudaStream_t stream, const std::string& what) {
  for (auto& [tensor, place] : startup_place_) {
    Buffer* shard = Shard(tensor);
    if (shard == nullptr || shard->data == place) continue;
    const int64_t bytes = shard->shape.size_bytes;
    const auto* from = static_cast<const char*>(shard->data);
    const auto* to = static_cast<const char*>(place);
    const std::string copy =
        what + ": returning " + program_.tensors(tensor).name() + " to its place";
    if (from < to + bytes && to < from + bytes) {
      // Overlapping places: through the shard's host copy (cudaMemcpy must not overlap).
      void* host = host_shards_.at(tensor).data();
      DC_RETURN_IF_ERROR(CopyAsync(host, shard->data, bytes, stream, copy));
      DC_RETURN_IF_ERROR(CopyAsync(place, host, bytes, stream, copy));
    } else {
      DC_RETURN_IF_ERROR(CopyAsync(place, shard->data, bytes, stream, copy));
    }
    shard->data = place;
  }
  return Status::Ok();
}

Status CudaRankRunner::RunStep(int step, bool warmup, double* loss, double* seconds) {
  const auto wall_start = std::chrono::steady_clock::now();
  const int64_t start_ns = tracer_ ? tracer_->NowNs() : 0;
  for (int i = 0; i < schedule_.instructions_size(); ++i) DC_RETURN_IF_ERROR(Execute(i, step));
  for (const auto& [key, buffer] : live_) {
    if (key.slot != BufferSlot::kPersistent && key.slot != BufferSlot::kComputeShard) {
      return Status::Error("the plan leaves " + program_.tensors(key.tensor).name() +
                           " live at the end of the step; re-plan it");
    }
  }
  if (!offloaded_.empty()) {
    return Status::Error("the plan leaves " + program_.tensors(*offloaded_.begin()).name() +
                         " offloaded at the end of the step; re-plan it");
  }
  float loss_sum = 0;
  DC_RETURN_IF_ERROR(FinishStep(step, &loss_sum));
  double sum = loss_sum;
  DC_RETURN_IF_ERROR(comm_->AllReduceSum(&sum, 1));
  *loss = sum / static_cast<double>(TokensPerStep(program_.config(), world_));
  *seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall_start).count();
  if (tracer_) tracer_->Step(step, start_ns, tracer_->NowNs(), *loss, warmup);
  return Status::Ok();
}

StatusOr<std::string> CudaRankRunner::ParamsDigest() {
  std::string bytes;
  for (const auto& t : program_.tensors()) {
    if (t.role() != proto::ROLE_PARAM) continue;
    if (layout_.host_resident[t.id()]) {
      const auto* master = static_cast<const char*>(host_shards_.at(t.id()).data());
      bytes.append(master, static_cast<size_t>(ShardOf(t.id())) * sizeof(float));
      continue;
    }
    const Buffer* shard = Shard(t.id());
    if (!shard) continue;
    const size_t offset = bytes.size();
    bytes.resize(offset + shard->shape.size_bytes);
    DC_RETURN_IF_ERROR(
        CudaStatus(cudaMemcpy(bytes.data() + offset, shard->data, shard->shape.size_bytes,
                              cudaMemcpyDeviceToHost),
                   "rank " + std::to_string(rank_) + ": reading the param shard of " + t.name()));
  }
  return Sha256Hex(bytes);
}

}  // namespace

StatusOr<RunResult> RunScheduleOnCuda(const proto::Schedule& schedule, const RunOptions& options,
                                      const CudaRunOptions& cuda, NcclCommunicator* comm,
                                      CuptiCollector* tracer) {
  // Whatever fails, the other ranks may be waiting in a collective for this one: abort the
  // communicator so they fail at once rather than at their timeout.
  auto failed = [comm](Status status) {
    comm->Abort();
    return status;
  };
  if (Status s = CheckRunnable(schedule, comm->world_size(), "cuda"); !s.ok()) return failed(s);
  StatusOr<CudaLayout> layout = MakeCudaLayout(schedule);
  if (!layout.ok()) return failed(layout.status());
  auto data = TokenSource::Open(schedule.program().config());
  if (!data.ok()) return failed(data.status());
  CudaRankRunner runner(schedule, options, cuda, comm, tracer, std::move(*data),
                        std::move(*layout));
  Status started = runner.Init();
  StatusOr<RunResult> result =
      started.ok() ? RunSteps(&runner, schedule, options, comm) : StatusOr<RunResult>(started);
  // Before the runner's destructor waits for the device: NCCL kernels of an aborted
  // communicator return, those still waiting for a peer might not.
  if (!result.ok()) return failed(result.status());
  return result;
}

}  // namespace dc
