#include "executor/interpreter.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <optional>
#include <set>
#include <tuple>
#include <utility>
#include <vector>

#include "executor/cpu_device.h"
#include "executor/cpu_kernels.h"
#include "executor/data.h"
#include "executor/device_memory.h"
#include "executor/layout.h"
#include "executor/rename.h"
#include "schemas/digest.h"
#include "schemas/effects.h"
#include "schemas/op_kinds.h"
#include "schemas/units.h"

namespace dc {
namespace {

constexpr int64_t kNoArenaOffset = -1;
// The step FinishStep is told at the end of an evaluation pass: none (a device's trace keeps
// nothing of it).
constexpr int kEvaluationPassStep = -1;

int64_t AlignUp(int64_t bytes, int64_t alignment) {
  return (bytes + alignment - 1) / alignment * alignment;
}

// A device buffer of the run: at its memory-plan place in the arena, or from the device's
// allocator (pooled).
struct Buffer {
  void* data = nullptr;
  proto::DType dtype = proto::DTYPE_F32;  // as stored on the device
  int64_t elements = 0;
  int64_t accounted_bytes = 0;  // as the planner counts it (the logical dtype's bytes)
  BufferKind kind = BufferKind::kActivation;
  bool pooled = false;
  int64_t storage_bytes() const { return elements * DTypeSizeBytes(dtype); }
  DeviceTensor View(std::vector<int64_t> shape) const { return {data, dtype, std::move(shape)}; }
  DeviceTensor Flat() const { return View({elements}); }
};

// By tensor id, whether the tensor is a term of the loss (op_kinds.h's IsLossTerm: the
// cross-entropy and every MoE layer's balancing loss), which the run sums. Errors when the
// program has no "loss" tensor.
StatusOr<std::vector<char>> LossTerms(const proto::Program& program) {
  std::vector<char> terms(program.tensors_size(), 0);
  bool has_loss = false;
  for (const auto& t : program.tensors()) {
    if (op_kind::IsLossTerm(t.name())) terms[t.id()] = 1;
    has_loss = has_loss || t.name() == op_kind::kLossName;
  }
  if (!has_loss) return Status::Error("the plan's program has no tensor named 'loss'");
  return terms;
}

// The memory plan's placements by (instruction, tensor, micro-step).
using PlacementKey = std::tuple<int, int, int>;

class Interpreter : public TrainingState {
 public:
  Interpreter(const proto::Schedule& schedule, const RunOptions& options, RankDevice* device,
              Communicator* comm, ExecutionTracer* tracer, std::unique_ptr<TokenSource> data,
              ScheduleLayout layout)
      : schedule_(schedule),
        program_(schedule.program()),
        options_(options),
        device_(device),
        comm_(comm),
        tracer_(tracer),
        data_(std::move(data)),
        layout_(std::move(layout)),
        memory_(options.device_memory_bytes),
        world_(comm->world_size()),
        rank_(comm->rank()),
        compute_dtype_(program_.config().compute_dtype()),
        steps_done_(options.first_step) {}
  ~Interpreter();

  Status Init();
  // Runs optimizer step `step` (0-based, counting warm-up); `loss` is the mean over the global
  // batch (every rank gets it), `seconds` the step's wall time on this rank.
  Status RunStep(int64_t step, bool warmup, double* loss, double* seconds);
  // Evaluates the state after `steps_done` steps as RunOptions::eval asks (every rank).
  Status Evaluate(int64_t steps_done, EvalRecord* record);
  int64_t peak_live_bytes() const { return memory_.peak_bytes(); }
  int64_t arena_bytes() const { return arena_bytes_; }
  std::vector<int64_t> peak_by_kind() const { return memory_.peak_by_kind(); }
  // SHA-256 (hex) of this rank's fp32 param shards in tensor order.
  StatusOr<std::string> ParamsDigest();

  // TrainingState, between steps.
  const proto::Program& program() const override { return program_; }
  Communicator* comm() override { return comm_; }
  int64_t steps_done() const override { return steps_done_; }
  StatusOr<std::vector<float>> ReadShard(int tensor) override;
  Status StartSnapshot(const std::vector<int>& tensors, ShardSnapshot* snapshot) override;

 private:
  struct PendingMemoryEvent {  // of the instruction being issued
    int64_t ts_ns, address, bytes;
    bool alloc;
    int tensor;
    BufferKind kind;
  };

  std::string Describe(int index) const { return DescribeInstruction(schedule_, index, rank_); }
  std::string Who() const { return "rank " + std::to_string(rank_); }
  int64_t Now() const { return tracer_ ? tracer_->NowNs() : 0; }
  int64_t ShardOf(int tensor) const {
    return ShardElements(NumElements(program_.tensors(tensor)), world_);
  }
  // What the kernels of step `step` take; made once per step (RunStep), not per op.
  OpArgs ArgsFor(int64_t step) const {
    OpArgs args;
    args.config = &program_.config();
    args.grad_scale = 1.0 / static_cast<double>(TokensPerStep(program_.config(), world_));
    args.adam_step = step + 1;
    args.lr_scale = LearningRateScale(program_.config(), step);
    return args;
  }

  Status InitArena();
  // Opens the held-out tokens and finds the plan's forward prefix, when the run evaluates.
  Status InitEvaluation();
  // Rank's start-up values of a persistent tensor's shard (`out` holds ShardOf elements): the
  // options' initial values where they give them, else seeded params and zero states.
  Status InitialShard(const proto::Tensor& t, float* out);
  Status InitHostBuffers();
  Status InitPersistentShards();

  // Creates the buffer `key` (of `dtype` as the program declares it) for instruction `index`
  // (-1 at start-up), on `stream`.
  StatusOr<Buffer*> Allocate(int index, const BufferKey& key, BufferKind kind,
                             int64_t accounted_bytes, proto::DType dtype, int64_t elements,
                             proto::Stream stream, const std::string& what);
  Status Release(const BufferKey& key, proto::Stream stream, const std::string& what);
  Buffer* Find(const BufferKey& key) {
    auto it = live_.find(key);
    return it == live_.end() ? nullptr : &it->second;
  }
  // The persistent shard of a param, grad or optimizer state; null while offloaded.
  Buffer* Shard(int tensor) { return Find(BufferKey::Persistent(tensor)); }
  // Casts a param's fp32 master on the device into its compute-dtype shard, if it has both.
  Status RefreshComputeShard(int param, proto::Stream stream, const std::string& what);
  // The same from the master's host copy (a host-resident param): cast on the host, one
  // synchronous copy to the device.
  Status RefreshComputeShardFromHost(int param, const std::string& what);

  // In the step after a snapshot, before the first write or free of a persistent shard on
  // `stream`: the stream waits for the snapshot's copies (RankDevice::WaitForSnapshot).
  Status AfterSnapshot(proto::Stream stream, const std::string& what);
  Status Execute(int index, int64_t step);
  Status Dispatch(const proto::Instruction& instr, int index, int64_t step);
  Status Compute(const proto::Instruction& instr, int index, int64_t step);
  // An optimizer op on the host (STREAM_HOST): copies its grad shards to the host, runs the cpu
  // kernel on the host-resident master and states, and writes the params' compute-dtype shards
  // back. Done when it returns.
  Status HostOptimizerStep(const proto::Instruction& instr, int index, int64_t step);
  // RunOptions::on_first_grads for an optimizer op's grads in the run's first step.
  Status HandOverGrads(const proto::Op& op, proto::Stream stream, int64_t step,
                       const std::string& what);
  Status LoadInput(int index, int tensor, int micro, int64_t step, proto::Stream stream,
                   const std::string& what);
  Status Gather(const proto::Instruction& instr, int index);
  Status ReduceScatter(const proto::Instruction& instr, int index);
  Status AllReduce(const proto::Instruction& instr, int index);
  Status Offload(const proto::Instruction& instr, int index);
  Status Reload(const proto::Instruction& instr, int index);
  Status ReleaseInstruction(const proto::Instruction& instr, int index);
  // With an arena, moves every reloaded shard from its reload's place back to its start-up
  // place, where the memory plan expects it at the start of the next step.
  Status ReturnReloadedShards(const std::string& what);
  void FlushMemoryEvents(int64_t correlation_id);
  // One forward pass of held-out micro-batch `pass` of global batch `batch`: the plan's prefix
  // (EvaluationPrefix), then everything it left is undone. Adds the pass's loss sum to `sum`.
  Status EvaluationPass(int64_t steps_done, int64_t batch, int pass, double* sum);

  const proto::Schedule& schedule_;
  const proto::Program& program_;
  const RunOptions& options_;
  RankDevice* device_;
  Communicator* comm_;
  ExecutionTracer* tracer_;
  std::unique_ptr<TokenSource> data_;
  const ScheduleLayout layout_;
  DeviceMemory memory_;
  const int world_;
  const int rank_;
  const proto::DType compute_dtype_;

  int64_t arena_bytes_ = 0;  // 0 without an arena
  std::map<PlacementKey, int64_t> placements_;
  // With an arena: where each persistent shard lives at the start of a step (the plan's
  // instruction -1 placement).
  std::map<int, void*> startup_place_;
  // Every device buffer, by the key schemas/effects.h names it with, and its trace address.
  std::map<BufferKey, Buffer> live_;
  std::map<BufferKey, int64_t> addresses_;
  int64_t next_address_ = 1;
  std::vector<PendingMemoryEvent> pending_;
  // Host copies of offloaded and host-resident shards, by tensor.
  std::map<int, std::unique_ptr<HostBuffer>> host_shards_;
  std::set<int> offloaded_;                    // tensors whose shard is on the host now
  std::unique_ptr<HostBuffer> input_staging_;  // token ids of every (micro-step, input)
  std::map<std::pair<int, int>, int64_t> input_offsets_;
  std::unique_ptr<HostBuffer> host_optimizer_staging_;  // a host optimizer op's grads and casts
  std::vector<char> is_loss_term_;  // by tensor id: the cross-entropy and the MoE aux losses
  int64_t steps_done_;
  OpArgs step_args_;  // ArgsFor the step being run
  // A snapshot was taken after the last step: the streams that already wait for its copies.
  bool snapshot_pending_ = false;
  std::set<proto::Stream> snapshot_waited_;

  // Evaluation (RunOptions::eval): the held-out tokens, the plan's forward prefix, and while a
  // pass runs, which held-out micro-batch LoadInput reads (else the training data's).
  struct EvalFeed {
    int64_t batch = 0;  // global batch, in the place of the step
    int pass = 0;       // in the place of the micro-step
  };
  std::unique_ptr<TokenSource> eval_data_;
  int eval_prefix_ = 0;
  std::optional<EvalFeed> eval_feed_;
};

Interpreter::~Interpreter() {
  // After a failure enqueued work may still use the buffers: wait, then return the pooled ones.
  (void)device_->Synchronize("shutting down");
  for (auto& [key, buffer] : live_) {
    if (buffer.pooled) {
      (void)device_->Free(buffer.data, proto::STREAM_HOST, "shutting down",
                          program_.tensors(key.tensor).name());
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Start-up

Status Interpreter::Init() {
  DC_ASSIGN_OR_RETURN(is_loss_term_, LossTerms(program_));
  DC_RETURN_IF_ERROR(InitEvaluation());
  DC_RETURN_IF_ERROR(device_->Prepare(schedule_, layout_).Prefixed(Who() + ": "));
  DC_RETURN_IF_ERROR(InitArena());
  DC_RETURN_IF_ERROR(InitHostBuffers());  // first: the compute shards of host masters read them
  DC_RETURN_IF_ERROR(InitPersistentShards());
  DC_RETURN_IF_ERROR(device_->Synchronize(Who() + ": start-up"));
  FlushMemoryEvents(0);
  if (tracer_ != nullptr) {
    for (int i = 0; i < schedule_.instructions_size(); ++i) {
      tracer_->DescribeInstruction(i, TraceOf(schedule_, i));
    }
  }
  return Status::Ok();
}

Status Interpreter::InitArena() {
  const proto::MemoryPlan& plan = schedule_.memory_plan();
  // The arena holds the buffers at the planner's sizes: a device that stores the compute dtype
  // wider (the cpu backend's fp32) keeps one allocation per buffer instead.
  if (plan.arena_bytes() <= 0 || device_->StorageDType(compute_dtype_) != compute_dtype_) {
    return Status::Ok();
  }
  // The arena is the one device allocation: it must fit the capacity, and then every buffer
  // placed inside it does too.
  const int64_t capacity = memory_.capacity_bytes();
  if (capacity > 0 && plan.arena_bytes() > capacity) {
    return Status::Error("out of device memory at start-up on " + Who() +
                         ": the memory plan's arena of " + FormatBytes(plan.arena_bytes()) +
                         " is over the capacity of " + FormatBytes(capacity) +
                         "; raise --device-memory or plan with a lower --budget");
  }
  DC_RETURN_IF_ERROR(device_->CreateArena(plan.arena_bytes())
                         .Prefixed("out of device memory at start-up on " + Who() +
                                   " (plan with a lower --budget): "));
  arena_bytes_ = plan.arena_bytes();
  memory_ = DeviceMemory(0);
  for (const auto& p : plan.placements()) {
    placements_[{p.instruction(), p.tensor(), p.micro_step()}] = p.offset_bytes();
  }
  return Status::Ok();
}

Status Interpreter::InitEvaluation() {
  const EvalOptions& eval = options_.eval;
  if (eval.data_path.empty()) return Status::Ok();
  const proto::ModelConfig& config = program_.config();
  DC_ASSIGN_OR_RETURN(eval_data_, OpenEvalData(config, eval.data_path, eval.batches,
                                               TokensPerStep(config, world_) / config.seq()));
  DC_ASSIGN_OR_RETURN(eval_prefix_, EvaluationPrefix(schedule_));
  return Status::Ok();
}

// Host memory is made once (pinned memory is slow to make and may synchronize the device).
Status Interpreter::InitHostBuffers() {
  const std::string who = Who() + ": ";
  for (const auto& [tensor, bytes] : layout_.host_shard_bytes) {
    DC_ASSIGN_OR_RETURN(
        host_shards_[tensor],
        device_->AllocateHost(bytes, who + "host copy of " + program_.tensors(tensor).name()));
  }
  int64_t offset = 0;
  for (int micro = 0; micro < layout_.gas; ++micro) {
    for (const auto& [tensor, bytes] : layout_.input_bytes) {
      input_offsets_[{micro, tensor}] = offset;
      offset += bytes;
    }
  }
  DC_ASSIGN_OR_RETURN(input_staging_, device_->AllocateHost(offset, who + "token staging"));
  DC_ASSIGN_OR_RETURN(
      host_optimizer_staging_,
      device_->AllocateHost(layout_.host_optimizer_staging_bytes, who + "host optimizer staging"));
  // The host optimizer's masters and states start in host memory, as the device's would.
  for (const auto& t : program_.tensors()) {
    if (!layout_.host_resident[t.id()]) continue;
    DC_RETURN_IF_ERROR(InitialShard(t, static_cast<float*>(host_shards_.at(t.id())->data())));
  }
  return Status::Ok();
}

Status Interpreter::InitialShard(const proto::Tensor& t, float* out) {
  const int64_t elements = ShardOf(t.id());
  const int64_t offset = rank_ * elements;
  std::fill(out, out + elements, 0.0f);
  if (options_.initial_values) {
    DC_ASSIGN_OR_RETURN(const bool given, options_.initial_values(t, offset, elements, out));
    if (given) return Status::Ok();
  }
  if (t.role() == proto::ROLE_PARAM) InitParamSlice(program_.config(), t, offset, elements, out);
  return Status::Ok();
}

Status Interpreter::InitPersistentShards() {
  std::vector<float> values;
  for (const auto& t : program_.tensors()) {
    if (!IsPersistentRole(t.role()) || layout_.host_resident[t.id()]) continue;
    const int64_t elements = ShardOf(t.id());
    const std::string what = "start-up (persistent shard of " + t.name() + ") on " + Who();
    DC_ASSIGN_OR_RETURN(Buffer * shard,
                        Allocate(-1, BufferKey::Persistent(t.id()), PersistentKind(t.role()),
                                 elements * kShardElementBytes, proto::DTYPE_F32, elements,
                                 proto::STREAM_HOST, what));
    if (arena_bytes_ > 0) startup_place_[t.id()] = shard->data;
    // Grads start at zero, and so do optimizer states unless the options may give them (a
    // resumed run): zeroed where they live rather than copied from zeros on the host.
    if (t.role() == proto::ROLE_GRAD ||
        (t.role() == proto::ROLE_OPTIMIZER_STATE && !options_.initial_values)) {
      DC_RETURN_IF_ERROR(
          device_->Zero(shard->data, shard->storage_bytes(), proto::STREAM_HOST, what));
      continue;
    }
    values.resize(elements);
    DC_RETURN_IF_ERROR(InitialShard(t, values.data()).Prefixed(what + ": "));
    DC_RETURN_IF_ERROR(device_->CopyToDevice(shard->data, values.data(), shard->storage_bytes(),
                                             proto::STREAM_HOST, what));
  }
  const std::vector<bool> compute_shard = ComputeShardParams(schedule_);
  for (const auto& t : program_.tensors()) {
    if (!compute_shard[t.id()]) continue;
    const std::string what = "start-up (compute-dtype shard of " + t.name() + ") on " + Who();
    DC_RETURN_IF_ERROR(Allocate(-1, BufferKey::ComputeShard(t.id()), BufferKind::kShard,
                                ComputeShardBytes(program_, t, world_), compute_dtype_,
                                ShardOf(t.id()), proto::STREAM_HOST, what)
                           .status());
    if (layout_.host_resident[t.id()]) {
      DC_RETURN_IF_ERROR(RefreshComputeShardFromHost(t.id(), what));
    } else {
      DC_RETURN_IF_ERROR(RefreshComputeShard(t.id(), proto::STREAM_COMPUTE, what));
    }
  }
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------------
// Buffers

StatusOr<Buffer*> Interpreter::Allocate(int index, const BufferKey& key, BufferKind kind,
                                        int64_t accounted_bytes, proto::DType dtype,
                                        int64_t elements, proto::Stream stream,
                                        const std::string& what) {
  const proto::Tensor& t = program_.tensors(key.tensor);
  if (live_.count(key)) return Status::Error(what + ": " + t.name() + " is already live");
  DC_RETURN_IF_ERROR(memory_.Allocate(kind, accounted_bytes, what));
  Buffer buffer;
  buffer.dtype = device_->StorageDType(dtype);
  buffer.elements = elements;
  buffer.accounted_bytes = accounted_bytes;
  buffer.kind = kind;
  int64_t offset = kNoArenaOffset;
  if (arena_bytes_ > 0) {
    auto it = placements_.find({index, key.tensor, key.placement_micro_step()});
    if (it == placements_.end()) {
      return Status::Error(what + ": the memory plan has no place for " + t.name() +
                           " at instruction " + std::to_string(index) + "; re-plan it");
    }
    offset = it->second;
    if (offset < 0 || offset > arena_bytes_ - buffer.storage_bytes()) {  // cannot overflow
      return Status::Error(what + ": the memory plan places " + t.name() +
                           " past the end of the arena; re-plan it");
    }
  }
  DC_ASSIGN_OR_RETURN(buffer.data,
                      device_->Allocate(offset, buffer.storage_bytes(), stream, what, t.name()));
  buffer.pooled = offset == kNoArenaOffset;
  Buffer* placed = &live_.emplace(key, buffer).first->second;
  const int64_t address = next_address_++;
  addresses_[key] = address;
  pending_.push_back({Now(), address, accounted_bytes, true, key.tensor, kind});
  return placed;
}

Status Interpreter::Release(const BufferKey& key, proto::Stream stream, const std::string& what) {
  auto it = live_.find(key);
  const Buffer buffer = it->second;
  memory_.Free(buffer.kind, buffer.accounted_bytes);
  pending_.push_back(
      {Now(), addresses_[key], buffer.accounted_bytes, false, key.tensor, buffer.kind});
  addresses_.erase(key);
  live_.erase(it);
  // Arena bytes need nothing: the plan's reuse dependencies order their next user after this.
  if (!buffer.pooled) return Status::Ok();
  return device_->Free(buffer.data, stream, what, program_.tensors(key.tensor).name());
}

void Interpreter::FlushMemoryEvents(int64_t correlation_id) {
  if (tracer_ != nullptr) {
    for (const PendingMemoryEvent& e : pending_) {
      tracer_->Memory(e.ts_ns, e.address, e.bytes, e.alloc, program_.tensors(e.tensor).name(),
                      e.kind, correlation_id);
    }
  }
  pending_.clear();
}

Status Interpreter::RefreshComputeShard(int param, proto::Stream stream, const std::string& what) {
  const Buffer* compute = Find(BufferKey::ComputeShard(param));
  const Buffer* master = Shard(param);
  if (compute == nullptr || master == nullptr) return Status::Ok();
  return device_->Cast(master->Flat(), compute->Flat(), stream,
                       what + ": " + program_.tensors(param).name() + "'s compute-dtype shard");
}

Status Interpreter::RefreshComputeShardFromHost(int param, const std::string& what) {
  const Buffer* compute = Find(BufferKey::ComputeShard(param));
  auto master = host_shards_.find(param);
  if (compute == nullptr || master == host_shards_.end()) return Status::Ok();
  if (host_optimizer_staging_->size_bytes() < compute->storage_bytes()) {
    return Status::Error(what + ": the host optimizer's staging of " +
                         FormatBytes(host_optimizer_staging_->size_bytes()) + " cannot hold " +
                         program_.tensors(param).name() +
                         "'s compute-dtype shard (an executor bug; please report it)");
  }
  CastOnHost(static_cast<const float*>(master->second->data()), compute->elements, compute->dtype,
             host_optimizer_staging_->data());
  return device_->CopyToDevice(
      compute->data, host_optimizer_staging_->data(), compute->storage_bytes(), proto::STREAM_HOST,
      what + ": " + program_.tensors(param).name() + "'s compute-dtype shard from the host");
}

// ---------------------------------------------------------------------------------------------
// Instructions

Status Interpreter::Execute(int index, int64_t step) {
  const proto::Instruction& instr = schedule_.instructions(index);
  for (int d : layout_.waits[index]) DC_RETURN_IF_ERROR(device_->Wait(index, d, instr.stream()));
  const InstructionRef ref{static_cast<int>(step), instr.micro_step(), index};
  const int64_t start_ns = Now();
  // An evaluation's instructions are not the step's: the trace shows the evaluation as a whole
  // (its memory events at correlation 0), so a profile of the trace sees training steps only.
  ExecutionTracer* tracer = eval_feed_ ? nullptr : tracer_;
  if (tracer != nullptr) DC_RETURN_IF_ERROR(tracer->BeginInstruction(ref));
  const Status status = Dispatch(instr, index, step);
  int64_t correlation = 0;
  if (tracer != nullptr) {
    StatusOr<int64_t> ended = tracer->EndInstruction(ref, start_ns, Now());
    DC_RETURN_IF_ERROR(status);
    if (!ended.ok()) return ended.status();
    correlation = *ended;
  }
  DC_RETURN_IF_ERROR(status);
  FlushMemoryEvents(correlation);
  // A host instruction is done when it returns: its waiters wait for the compute stream, which
  // is never behind it.
  const proto::Stream stream =
      instr.stream() == proto::STREAM_HOST ? proto::STREAM_COMPUTE : instr.stream();
  if (layout_.records_event[index]) {
    DC_RETURN_IF_ERROR(device_->Record(index, stream));
  }
  return device_->AfterInstruction(index, instr.stream());
}

// The one switch on the instruction kind of the run (the effects themselves are
// schemas/effects.h's).
Status Interpreter::Dispatch(const proto::Instruction& instr, int index, int64_t step) {
  switch (instr.kind()) {
    case proto::INSTR_COMPUTE:
      if (instr.stream() == proto::STREAM_HOST) return HostOptimizerStep(instr, index, step);
      return Compute(instr, index, step);
    case proto::INSTR_ALL_GATHER:
      return Gather(instr, index);
    case proto::INSTR_REDUCE_SCATTER:
      return ReduceScatter(instr, index);
    case proto::INSTR_OFFLOAD:
      return Offload(instr, index);
    case proto::INSTR_RELOAD:
      return Reload(instr, index);
    case proto::INSTR_RELEASE:
      return ReleaseInstruction(instr, index);
    case proto::INSTR_RENAME:
      // The kept buffers go on under the op's output names: no copy, no allocation.
      return RenameLiveBuffers(program_, instr, Describe(index), &live_, &addresses_);
    case proto::INSTR_ALL_REDUCE:
      return AllReduce(instr, index);
    default:
      return Status::Error(Describe(index) + ": dc does not run " + InstrKindName(instr.kind()) +
                           " instructions");
  }
}

Status Interpreter::LoadInput(int index, int tensor, int micro, int64_t step, proto::Stream stream,
                              const std::string& what) {
  const proto::ModelConfig& config = program_.config();
  const proto::Tensor& t = program_.tensors(tensor);
  auto offset = input_offsets_.find({micro, tensor});
  if (offset == input_offsets_.end()) {
    return Status::Error(what + ": reads " + t.name() + " in micro-step " + std::to_string(micro) +
                         ", outside the plan's " + std::to_string(layout_.gas) +
                         " micro-step(s); re-plan it");
  }
  DC_ASSIGN_OR_RETURN(Buffer * tokens, Allocate(index, BufferKey::Transient(tensor, micro),
                                                BufferKind::kInput, TransientBytes(program_, t),
                                                t.dtype(), NumElements(t), stream, what));
  // Each (micro-step, input) has its own host region, written once per step: the copy of the
  // previous step has finished (the step's end waits for the device). A plan that loads the same
  // input twice in a micro-step rewrites the region with the same sample.
  auto* staged =
      reinterpret_cast<int32_t*>(static_cast<char*>(input_staging_->data()) + offset->second);
  const int64_t seq = config.seq();
  std::vector<int32_t> inputs(seq), targets(seq);
  // An evaluation pass reads held-out global batch `batch` as a step reads its own.
  const TokenSource* samples = eval_feed_ ? eval_data_.get() : data_.get();
  const int64_t sample_step = eval_feed_ ? eval_feed_->batch : step;
  const int sample_micro = eval_feed_ ? eval_feed_->pass : micro;
  for (int64_t b = 0; b < config.micro_batch(); ++b) {
    samples->Sample(SampleIndex(config, world_, sample_step, sample_micro, rank_, b), inputs.data(),
                    targets.data());
    const auto& source = t.name() == "targets" ? targets : inputs;
    std::copy(source.begin(), source.end(), staged + b * seq);
  }
  return device_->CopyToDevice(tokens->data, staged, tokens->storage_bytes(), stream,
                               what + ": " + t.name());
}

Status Interpreter::Compute(const proto::Instruction& instr, int index, int64_t step) {
  const proto::Op& op = program_.ops(instr.op());
  const bool optimizer = op.phase() == proto::PHASE_OPTIMIZER;
  const int micro = instr.micro_step();
  const proto::Stream stream = instr.stream();
  const std::string what = Describe(index);
  std::vector<DeviceTensor> inputs, outputs;
  for (int tensor : op.inputs()) {
    const proto::Tensor& t = program_.tensors(tensor);
    // The optimizer phase reads the rank's persistent shards, and the grads' norm (a transient).
    if (optimizer && IsPersistentRole(t.role())) {
      const Buffer* shard = Shard(tensor);
      if (shard == nullptr) {
        return Status::Error(what + ": " + t.name() +
                             (offloaded_.count(tensor)
                                  ? "'s shard is offloaded; the plan must reload it first"
                                  : " has no shard"));
      }
      inputs.push_back(shard->Flat());
      continue;
    }
    const BufferKey key = BufferKey::OfOperand(tensor, t.role(), micro);
    if (t.role() == proto::ROLE_INPUT && !Find(key)) {
      DC_RETURN_IF_ERROR(LoadInput(index, tensor, micro, step, stream, what));
    }
    const Buffer* buffer = Find(key);
    if (buffer == nullptr) {
      return Status::Error(
          what + ": reads " + t.name() +
          (t.role() == proto::ROLE_PARAM ? ", which is not gathered" : ", which is not live"));
    }
    inputs.push_back(buffer->View({t.shape().begin(), t.shape().end()}));
  }
  for (int tensor : op.outputs()) {
    const proto::Tensor& t = program_.tensors(tensor);
    const BufferShape shape = TransientShape(program_, t);
    DC_ASSIGN_OR_RETURN(Buffer * buffer,
                        Allocate(index, BufferKey::Transient(tensor, micro), TransientKind(t),
                                 shape.size_bytes, shape.dtype, shape.elements, stream, what));
    outputs.push_back(buffer->View({t.shape().begin(), t.shape().end()}));
  }
  // Each grad once, by its step (the grads' norm reads them all too).
  if (IsOptimizerStep(program_, op)) {
    DC_RETURN_IF_ERROR(HandOverGrads(op, stream, step, what));
    DC_RETURN_IF_ERROR(AfterSnapshot(stream, what));  // the step updates the shards in place
  }
  DC_RETURN_IF_ERROR(device_->RunOp(op, inputs, outputs, step_args_).Prefixed(what + ": "));
  if (optimizer) {
    for (int tensor : op.inputs()) {
      if (program_.tensors(tensor).role() != proto::ROLE_PARAM) continue;
      DC_RETURN_IF_ERROR(RefreshComputeShard(tensor, stream, what));
    }
  }
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (!is_loss_term_[op.outputs(i)]) continue;
    DC_RETURN_IF_ERROR(device_->AddLoss(outputs[i]).Prefixed(what + ": summing the loss: "));
  }
  return Status::Ok();
}

Status Interpreter::HandOverGrads(const proto::Op& op, proto::Stream stream, int64_t step,
                                  const std::string& what) {
  if (!options_.on_first_grads || step != options_.first_step) return Status::Ok();
  for (int tensor : op.inputs()) {
    const proto::Tensor& t = program_.tensors(tensor);
    if (t.role() != proto::ROLE_GRAD) continue;
    const Buffer* grad = Shard(tensor);
    if (grad == nullptr) return Status::Error(what + ": " + t.name() + " has no shard");
    std::vector<float> values(grad->elements);
    // On the op's stream, after its waits for the reduce-scatters; a test's path, so it waits.
    DC_RETURN_IF_ERROR(device_->CopyToHost(values.data(), grad->data, grad->storage_bytes(), stream,
                                           what + ": reading " + t.name()));
    DC_RETURN_IF_ERROR(device_->Synchronize(what + ": reading " + t.name()));
    DC_RETURN_IF_ERROR(options_.on_first_grads(t, values));
  }
  return Status::Ok();
}

Status Interpreter::HostOptimizerStep(const proto::Instruction& instr, int index, int64_t step) {
  const proto::Op& op = program_.ops(instr.op());
  const std::string what = Describe(index) + " on the host";
  DC_RETURN_IF_ERROR(HandOverGrads(op, proto::STREAM_COMPUTE, step, what));
  if (!IsOptimizerStep(program_, op) || op.outputs_size() > 0) {
    return Status::Error(what + ": " + op.name() +
                         " is not an in-place optimizer op; the host runs those only");
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
      if (offset + grad->storage_bytes() > host_optimizer_staging_->size_bytes()) {
        return Status::Error(what + ": the host optimizer's staging cannot hold " + t.name() +
                             " (an executor bug; please report it)");
      }
      void* host = static_cast<char*>(host_optimizer_staging_->data()) + offset;
      DC_RETURN_IF_ERROR(device_->CopyToHost(host, grad->data, grad->storage_bytes(),
                                             proto::STREAM_HOST,
                                             what + ": copying " + t.name() + " to the host"));
      offset += AlignUp(grad->storage_bytes(), kStagingAlignmentBytes);
      ref.f32 = static_cast<float*>(host);
      ref.shape = {grad->elements};
    } else if (!IsPersistentRole(t.role())) {
      // The grads' squared norm, all-reduced on the device: copied beside the grads.
      const Buffer* values = Find(BufferKey::Transient(tensor, instr.micro_step()));
      if (values == nullptr || values->dtype != proto::DTYPE_F32) {
        return Status::Error(what + ": " + t.name() + " is not a live fp32 buffer; re-plan it");
      }
      if (offset + values->storage_bytes() > host_optimizer_staging_->size_bytes()) {
        return Status::Error(what + ": the host optimizer's staging cannot hold " + t.name() +
                             " (an executor bug; please report it)");
      }
      void* host = static_cast<char*>(host_optimizer_staging_->data()) + offset;
      DC_RETURN_IF_ERROR(device_->CopyToHost(host, values->data, values->storage_bytes(),
                                             proto::STREAM_HOST,
                                             what + ": copying " + t.name() + " to the host"));
      offset += AlignUp(values->storage_bytes(), kStagingAlignmentBytes);
      ref.f32 = static_cast<float*>(host);
      ref.shape = {values->elements};
    } else {
      auto host = host_shards_.find(tensor);
      if (host == host_shards_.end() || !layout_.host_resident[tensor]) {
        return Status::Error(what + ": " + t.name() + " is not in host memory; re-plan it");
      }
      ref.f32 = static_cast<float*>(host->second->data());
      ref.shape = {ShardOf(tensor)};
    }
    inputs.push_back(ref);
  }
  DC_RETURN_IF_ERROR(RunCpuOp(op, inputs, {}, CpuKernelContext(step_args_, options_.num_threads))
                         .Prefixed(what + ": "));
  for (int tensor : op.inputs()) {
    if (program_.tensors(tensor).role() != proto::ROLE_PARAM) continue;
    DC_RETURN_IF_ERROR(RefreshComputeShardFromHost(tensor, what));
  }
  return Status::Ok();
}

// One grouped all-gather for all the instruction's params.
Status Interpreter::Gather(const proto::Instruction& instr, int index) {
  const std::string what = Describe(index);
  std::vector<GatherItem> items;
  for (int tensor : instr.tensors()) {
    const proto::Tensor& t = program_.tensors(tensor);
    if (t.role() != proto::ROLE_PARAM) {
      return Status::Error(what + ": " + t.name() + " is not a param");
    }
    if (Find(BufferKey::Gathered(tensor))) {
      return Status::Error(what + ": " + t.name() + " is already gathered");
    }
    // What the gather sends: the compute-dtype shard where the plan keeps one (the master may be
    // on the host), else the master.
    const Buffer* compute = Find(BufferKey::ComputeShard(tensor));
    const Buffer* source = compute != nullptr ? compute : Shard(tensor);
    if (source == nullptr) return Status::Error(what + ": " + t.name() + "'s shard is offloaded");
    const BufferShape shape = TransientShape(program_, t);
    DC_ASSIGN_OR_RETURN(
        Buffer * whole,
        Allocate(index, BufferKey::Gathered(tensor), BufferKind::kGathered, shape.size_bytes,
                 shape.dtype, shape.elements, instr.stream(), what));
    items.push_back(
        {&t, source->Flat(), whole->View({t.shape().begin(), t.shape().end()}), ShardOf(tensor)});
  }
  return device_->AllGather(items, instr.stream(), what).Prefixed(what + ": ");
}

// One grouped reduce-scatter for all the instruction's grads.
Status Interpreter::ReduceScatter(const proto::Instruction& instr, int index) {
  const std::string what = Describe(index);
  std::vector<ReduceScatterItem> items;
  for (int tensor : instr.tensors()) {
    const proto::Tensor& t = program_.tensors(tensor);
    const Buffer* grad = Find(BufferKey::Transient(tensor, instr.micro_step()));
    if (grad == nullptr) {
      return Status::Error(what + ": reduce-scatter of " + t.name() + ", which is not live");
    }
    const Buffer* shard = Shard(tensor);
    if (shard == nullptr) {
      return Status::Error(what + ": reduce-scatter into " + t.name() + "'s offloaded shard");
    }
    items.push_back(
        {&t, grad->View({t.shape().begin(), t.shape().end()}), shard->Flat(), shard->elements});
  }
  return device_->ReduceScatterAdd(items, instr.stream(), what).Prefixed(what + ": ");
}

// Each tensor summed over the ranks in place (the grads' squared norm).
Status Interpreter::AllReduce(const proto::Instruction& instr, int index) {
  const std::string what = Describe(index);
  for (int tensor : instr.tensors()) {
    const proto::Tensor& t = program_.tensors(tensor);
    const Buffer* values = Find(BufferKey::Transient(tensor, instr.micro_step()));
    if (values == nullptr) {
      return Status::Error(what + ": all-reduce of " + t.name() + ", which is not live");
    }
    if (values->dtype != proto::DTYPE_F32) {
      return Status::Error(what + ": all-reduce of " + t.name() + ", which is not fp32");
    }
    DC_RETURN_IF_ERROR(
        device_->AllReduceSum(values->Flat(), instr.stream(), what).Prefixed(what + ": "));
  }
  return Status::Ok();
}

// Offload copies a persistent shard to its host copy and frees it on the device; reload
// allocates it again and copies it back (after the offload's copy: ScheduleLayout's wait).
Status Interpreter::Offload(const proto::Instruction& instr, int index) {
  const std::string what = Describe(index);
  for (int tensor : instr.tensors()) {
    const proto::Tensor& t = program_.tensors(tensor);
    const Buffer* shard = Shard(tensor);
    auto host = host_shards_.find(tensor);
    if (shard == nullptr || host == host_shards_.end()) {
      return Status::Error(what + ": " + t.name() +
                           " is not a persistent shard on the device (dc offloads shards only)");
    }
    DC_RETURN_IF_ERROR(device_->CopyToHost(host->second->data(), shard->data,
                                           shard->storage_bytes(), instr.stream(),
                                           what + ": " + t.name()));
    // The shard's bytes may go to another buffer once it is freed.
    DC_RETURN_IF_ERROR(AfterSnapshot(instr.stream(), what));
    DC_RETURN_IF_ERROR(Release(BufferKey::Persistent(tensor), instr.stream(), what));
    offloaded_.insert(tensor);
  }
  return Status::Ok();
}

Status Interpreter::Reload(const proto::Instruction& instr, int index) {
  const std::string what = Describe(index);
  for (int tensor : instr.tensors()) {
    const proto::Tensor& t = program_.tensors(tensor);
    if (!offloaded_.count(tensor))
      return Status::Error(what + ": " + t.name() + " is not offloaded");
    const int64_t elements = ShardOf(tensor);
    DC_ASSIGN_OR_RETURN(
        Buffer * shard,
        Allocate(index, BufferKey::Persistent(tensor), PersistentKind(t.role()),
                 elements * kShardElementBytes, proto::DTYPE_F32, elements, instr.stream(), what));
    DC_RETURN_IF_ERROR(device_->CopyToDevice(shard->data, host_shards_.at(tensor)->data(),
                                             shard->storage_bytes(), instr.stream(),
                                             what + ": " + t.name()));
    offloaded_.erase(tensor);
  }
  return Status::Ok();
}

Status Interpreter::ReleaseInstruction(const proto::Instruction& instr, int index) {
  const std::string what = Describe(index);
  for (int tensor : instr.tensors()) {
    const BufferKey key =
        BufferKey::OfOperand(tensor, program_.tensors(tensor).role(), instr.micro_step());
    if (!Find(key)) {
      return Status::Error(what + ": releases " + program_.tensors(tensor).name() +
                           ", which is not live");
    }
    DC_RETURN_IF_ERROR(Release(key, instr.stream(), what));
  }
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------------
// Steps

// The plan's next step may offload the shard from its start-up place at once, on another
// stream, while the other streams already reuse the reload's bytes: so the shard must be back
// first. The start-up places are free here (every transient buffer is released at the step's
// end), but one shard's start-up place may hold another shard still at its reload's place: such
// moves go through the shards' host copies, after every other move has read its source.
Status Interpreter::ReturnReloadedShards(const std::string& what) {
  struct Move {
    int tensor;
    Buffer* shard;
    void* place;
    bool through_host;
  };
  std::vector<Move> moves;
  for (auto& [tensor, place] : startup_place_) {
    Buffer* shard = Shard(tensor);
    if (shard != nullptr && shard->data != place) moves.push_back({tensor, shard, place, false});
  }
  auto overlaps = [](const void* a, const void* b, int64_t a_bytes, int64_t b_bytes) {
    const auto* x = static_cast<const char*>(a);
    const auto* y = static_cast<const char*>(b);
    return x < y + b_bytes && y < x + a_bytes;
  };
  for (Move& m : moves) {
    for (const Move& other : moves) {
      m.through_host =
          m.through_host || overlaps(m.place, other.shard->data, m.shard->storage_bytes(),
                                     other.shard->storage_bytes());
    }
  }
  auto copy_what = [&](const Move& m) {
    return what + ": returning " + program_.tensors(m.tensor).name() + " to its place";
  };
  for (const Move& m : moves) {
    const int64_t bytes = m.shard->storage_bytes();
    if (m.through_host) {
      DC_RETURN_IF_ERROR(device_->CopyToHost(host_shards_.at(m.tensor)->data(), m.shard->data,
                                             bytes, proto::STREAM_COMPUTE, copy_what(m)));
    } else {
      DC_RETURN_IF_ERROR(device_->CopyOnDevice(m.place, m.shard->data, bytes, proto::STREAM_COMPUTE,
                                               copy_what(m)));
    }
  }
  for (const Move& m : moves) {
    if (m.through_host) {
      DC_RETURN_IF_ERROR(device_->CopyToDevice(m.place, host_shards_.at(m.tensor)->data(),
                                               m.shard->storage_bytes(), proto::STREAM_COMPUTE,
                                               copy_what(m)));
    }
    m.shard->data = m.place;
  }
  return Status::Ok();
}

Status Interpreter::RunStep(int64_t step, bool warmup, double* loss, double* seconds) {
  const auto wall_start = std::chrono::steady_clock::now();
  const int64_t start_ns = Now();
  step_args_ = ArgsFor(step);
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
  const std::string what = "the end of step " + std::to_string(step) + " on " + Who();
  DC_RETURN_IF_ERROR(device_->JoinStreams(what));
  DC_RETURN_IF_ERROR(ReturnReloadedShards(what));
  // The grad accumulators start the next step empty; every stream's work is done before these
  // run, the optimizer's reads included.
  for (const auto& [key, buffer] : live_) {
    if (program_.tensors(key.tensor).role() != proto::ROLE_GRAD) continue;
    DC_RETURN_IF_ERROR(device_->Zero(buffer.data, buffer.storage_bytes(), proto::STREAM_COMPUTE,
                                     what + ": zeroing " + program_.tensors(key.tensor).name()));
  }
  DC_ASSIGN_OR_RETURN(double sum, device_->FinishStep(static_cast<int>(step)));
  // The step's end joined every stream, the snapshot's copies included.
  snapshot_pending_ = false;
  snapshot_waited_.clear();
  DC_RETURN_IF_ERROR(comm_->AllReduceSum(&sum, 1));
  *loss = sum / static_cast<double>(TokensPerStep(program_.config(), world_));
  *seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall_start).count();
  if (tracer_ != nullptr) tracer_->Step(static_cast<int>(step), start_ns, Now(), *loss, warmup);
  steps_done_ = step + 1;
  return Status::Ok();
}

// An evaluation pass runs the plan's own instructions (the forward prefix), so its buffers take
// the places the memory plan gave them (in the arena, or within the capacity the allocator is
// held to) and its live bytes are, instruction by instruction, those of the step's own start:
// within the plan's budget with no allocator path of its own. What the prefix leaves (gathered
// params, activations, inputs, shards it offloaded or reloaded) is undone here, so the next step
// starts from the state the last one ended in.
Status Interpreter::EvaluationPass(int64_t steps_done, int64_t batch, int pass, double* sum) {
  const std::string what = "evaluation pass " + std::to_string(batch * layout_.gas + pass) +
                           " after step " + std::to_string(steps_done) + " on " + Who();
  eval_feed_ = EvalFeed{batch, pass};
  Status ran = Status::Ok();
  for (int i = 0; i < eval_prefix_ && ran.ok(); ++i) ran = Execute(i, steps_done);
  eval_feed_.reset();
  DC_RETURN_IF_ERROR(ran);
  DC_RETURN_IF_ERROR(device_->JoinStreams(what));
  std::vector<BufferKey> left;
  for (const auto& [key, buffer] : live_) {
    if (key.slot != BufferSlot::kPersistent && key.slot != BufferSlot::kComputeShard) {
      left.push_back(key);
    }
  }
  for (const BufferKey& key : left) DC_RETURN_IF_ERROR(Release(key, proto::STREAM_COMPUTE, what));
  DC_RETURN_IF_ERROR(ReturnReloadedShards(what));
  // A shard the prefix offloaded goes back to its start-up place from its host copy.
  for (int tensor : offloaded_) {
    const proto::Tensor& t = program_.tensors(tensor);
    const int64_t elements = ShardOf(tensor);
    DC_ASSIGN_OR_RETURN(Buffer * shard,
                        Allocate(-1, BufferKey::Persistent(tensor), PersistentKind(t.role()),
                                 elements * kShardElementBytes, proto::DTYPE_F32, elements,
                                 proto::STREAM_COMPUTE, what));
    DC_RETURN_IF_ERROR(device_->CopyToDevice(shard->data, host_shards_.at(tensor)->data(),
                                             shard->storage_bytes(), proto::STREAM_COMPUTE,
                                             what + ": " + t.name() + " back from the host"));
  }
  offloaded_.clear();
  FlushMemoryEvents(0);
  DC_ASSIGN_OR_RETURN(const double pass_sum, device_->FinishStep(kEvaluationPassStep));
  *sum += pass_sum;
  return Status::Ok();
}

Status Interpreter::Evaluate(int64_t steps_done, EvalRecord* record) {
  const auto wall_start = std::chrono::steady_clock::now();
  const int64_t start_ns = Now();
  double sum = 0;
  for (int64_t batch = 0; batch < options_.eval.batches; ++batch) {
    for (int pass = 0; pass < layout_.gas; ++pass) {
      DC_RETURN_IF_ERROR(EvaluationPass(steps_done, batch, pass, &sum));
    }
  }
  DC_RETURN_IF_ERROR(comm_->AllReduceSum(&sum, 1));
  record->step = steps_done;
  record->loss =
      sum / static_cast<double>(options_.eval.batches * TokensPerStep(program_.config(), world_));
  record->seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - wall_start).count();
  if (tracer_ != nullptr) tracer_->Evaluation(steps_done, start_ns, Now(), record->loss);
  return Status::Ok();
}

StatusOr<std::vector<float>> Interpreter::ReadShard(int tensor) {
  if (tensor < 0 || tensor >= program_.tensors_size() ||
      !IsPersistentRole(program_.tensors(tensor).role())) {
    return Status::Error("reading the shard of tensor " + std::to_string(tensor) +
                         ", which is not a persistent tensor (a dc bug)");
  }
  const proto::Tensor& t = program_.tensors(tensor);
  std::vector<float> values(ShardOf(tensor));
  const int64_t bytes = static_cast<int64_t>(values.size() * sizeof(float));
  if (layout_.host_resident[tensor]) {
    std::memcpy(values.data(), host_shards_.at(tensor)->data(), bytes);
    return values;
  }
  const Buffer* shard = Shard(tensor);
  if (shard == nullptr || shard->storage_bytes() != bytes) {
    return Status::Error(Who() + ": " + t.name() +
                         " has no fp32 shard on the device between steps");
  }
  DC_RETURN_IF_ERROR(device_->CopyToHost(values.data(), shard->data, bytes, proto::STREAM_HOST,
                                         Who() + ": reading the shard of " + t.name()));
  return values;
}

Status Interpreter::StartSnapshot(const std::vector<int>& tensors, ShardSnapshot* snapshot) {
  const std::string what =
      Who() + ": the checkpoint's snapshot after step " + std::to_string(steps_done_);
  snapshot->tensors = tensors;
  snapshot->offsets_bytes.assign(1, 0);
  for (int tensor : tensors) {
    if (tensor < 0 || tensor >= program_.tensors_size() ||
        !IsPersistentRole(program_.tensors(tensor).role())) {
      return Status::Error(what + ": tensor " + std::to_string(tensor) +
                           " is not a persistent tensor (a dc bug)");
    }
    snapshot->offsets_bytes.push_back(snapshot->offsets_bytes.back() +
                                      ShardOf(tensor) * static_cast<int64_t>(sizeof(float)));
  }
  const int64_t total_bytes = snapshot->offsets_bytes.back();
  if (snapshot->host == nullptr || snapshot->host->size_bytes() != total_bytes) {
    snapshot->host.reset();
    DC_ASSIGN_OR_RETURN(snapshot->host, device_->AllocateHost(total_bytes, what));
  }
  char* host = static_cast<char*>(snapshot->host->data());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const int tensor = tensors[i];
    const proto::Tensor& t = program_.tensors(tensor);
    char* to = host + snapshot->offsets_bytes[i];
    const int64_t bytes = snapshot->offsets_bytes[i + 1] - snapshot->offsets_bytes[i];
    if (layout_.host_resident[tensor]) {
      std::memcpy(to, host_shards_.at(tensor)->data(), static_cast<size_t>(bytes));
      continue;
    }
    const Buffer* shard = Shard(tensor);
    if (shard == nullptr || shard->storage_bytes() != bytes) {
      return Status::Error(what + ": " + t.name() +
                           " has no fp32 shard on the device between steps");
    }
    DC_RETURN_IF_ERROR(device_->SnapshotToHost(to, shard->data, bytes, what + ": " + t.name()));
  }
  DC_ASSIGN_OR_RETURN(snapshot->wait, device_->EndSnapshot(what));
  snapshot_pending_ = true;
  snapshot_waited_.clear();
  return Status::Ok();
}

Status Interpreter::AfterSnapshot(proto::Stream stream, const std::string& what) {
  if (!snapshot_pending_ || !snapshot_waited_.insert(stream).second) return Status::Ok();
  return device_->WaitForSnapshot(stream, what);
}

StatusOr<std::string> Interpreter::ParamsDigest() {
  std::string bytes;
  for (const auto& t : program_.tensors()) {
    if (t.role() != proto::ROLE_PARAM) continue;
    const size_t offset = bytes.size();
    if (layout_.host_resident[t.id()]) {
      const auto* master = static_cast<const char*>(host_shards_.at(t.id())->data());
      bytes.append(master, static_cast<size_t>(ShardOf(t.id())) * sizeof(float));
      continue;
    }
    const Buffer* shard = Shard(t.id());
    if (shard == nullptr) continue;
    bytes.resize(offset + shard->storage_bytes());
    DC_RETURN_IF_ERROR(device_->CopyToHost(bytes.data() + offset, shard->data,
                                           shard->storage_bytes(), proto::STREAM_HOST,
                                           Who() + ": reading the param shard of " + t.name()));
  }
  return Sha256Hex(bytes);
}

// The step loop: warm-up and measured steps, the loss checks, progress, then the run's figures
// agreed over the ranks (peaks, the joined params digest).
StatusOr<RunResult> RunSteps(Interpreter* runner, const proto::Schedule& schedule,
                             const RunOptions& options, Communicator* comm) {
  RunResult result;
  result.world_size = comm->world_size();
  result.tokens_per_step = TokensPerStep(schedule.program().config(), comm->world_size());
  const int total = options.warmup_steps + options.steps;
  auto evaluate = [&](int64_t steps_done) -> Status {
    EvalRecord record;
    DC_RETURN_IF_ERROR(runner->Evaluate(steps_done, &record));
    result.evals.push_back(record);
    if (options.on_eval && comm->rank() == 0) options.on_eval(record);
    return Status::Ok();
  };
  const bool evaluating = !options.eval.data_path.empty();
  // A run of no steps still shows its state once (an import exported again, unchanged).
  if (total == 0 && evaluating) DC_RETURN_IF_ERROR(evaluate(options.first_step));
  if (total == 0 && options.after_step) DC_RETURN_IF_ERROR(options.after_step(*runner));
  for (int i = 0; i < total; ++i) {
    const bool warmup = i < options.warmup_steps;
    const int64_t step = options.first_step + i;
    double loss = 0, seconds = 0;
    DC_RETURN_IF_ERROR(runner->RunStep(step, warmup, &loss, &seconds));
    if (!std::isfinite(loss)) {
      return Status::Error("the loss is " + std::to_string(loss) + " at step " +
                           std::to_string(step) + "; lower the learning rate or check the data");
    }
    if (!warmup) {
      result.losses.push_back(loss);
      result.step_seconds.push_back(seconds);
    }
    if (options.on_step && comm->rank() == 0) options.on_step(step, loss, seconds);
    const int64_t done = step + 1;
    if (evaluating && (i == total - 1 ||
                       (options.eval.every_steps > 0 && done % options.eval.every_steps == 0))) {
      DC_RETURN_IF_ERROR(evaluate(done));
    }
    if (options.after_step) DC_RETURN_IF_ERROR(options.after_step(*runner));
    result.steps_done = i + 1;
    if (options.stop_requested) {
      double stop = options.stop_requested();
      DC_RETURN_IF_ERROR(comm->AllReduceMax(&stop, 1));
      if (stop > 0 && i + 1 < total) {
        result.stop_signal = static_cast<int>(stop);
        break;
      }
    }
  }
  if (options.at_end) DC_RETURN_IF_ERROR(options.at_end(*runner, /*run_failed=*/false));
  double peaks[2] = {static_cast<double>(runner->peak_live_bytes()),
                     static_cast<double>(runner->arena_bytes())};
  DC_RETURN_IF_ERROR(comm->AllReduceMax(peaks, 2));
  result.peak_live_bytes = static_cast<int64_t>(peaks[0]);
  result.arena_bytes = static_cast<int64_t>(peaks[1]);
  result.peak_device_bytes = std::max(result.peak_live_bytes, result.arena_bytes);
  // Every rank's shard digest, 48 bits each (exact in a double), joined into one digest.
  constexpr int kDigestHexDigits = 12;
  DC_ASSIGN_OR_RETURN(const std::string rank_digest, runner->ParamsDigest());
  std::vector<double> rank_digests(comm->world_size(), 0.0);
  rank_digests[comm->rank()] =
      static_cast<double>(std::stoull(rank_digest.substr(0, kDigestHexDigits), nullptr, 16));
  DC_RETURN_IF_ERROR(comm->AllReduceSum(rank_digests.data(), comm->world_size()));
  std::string joined;
  for (double d : rank_digests) joined += std::to_string(static_cast<uint64_t>(d)) + ";";
  result.params_digest = Sha256Hex(joined);
  result.peak_by_kind = runner->peak_by_kind();
  result.step_seconds_median = Median(result.step_seconds);
  if (result.step_seconds_median > 0) {
    result.tokens_per_second =
        static_cast<double>(result.tokens_per_step) / result.step_seconds_median;
  }
  return result;
}

}  // namespace

StatusOr<RunResult> Interpret(const proto::Schedule& schedule, const RunOptions& options,
                              RankDevice* device, Communicator* comm, ExecutionTracer* tracer) {
  StatusOr<ScheduleLayout> layout = MakeScheduleLayout(schedule);
  StatusOr<std::unique_ptr<TokenSource>> data =
      layout.ok() ? TokenSource::Open(schedule.program().config())
                  : StatusOr<std::unique_ptr<TokenSource>>(layout.status());
  if (!data.ok()) {
    device->Abort();
    return data.status();
  }
  Interpreter runner(schedule, options, device, comm, tracer, std::move(*data), std::move(*layout));
  const auto startup = std::chrono::steady_clock::now();
  const Status started = runner.Init();
  const double startup_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - startup).count();
  StatusOr<RunResult> result =
      started.ok() ? RunSteps(&runner, schedule, options, comm) : StatusOr<RunResult>(started);
  if (result.ok()) result->startup_seconds = startup_seconds;
  // Before the runner's destructor waits for the device.
  if (!result.ok()) device->Abort();
  if (!result.ok() && options.at_end) (void)options.at_end(runner, /*run_failed=*/true);
  return result;
}

}  // namespace dc
