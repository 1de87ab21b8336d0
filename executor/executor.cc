#include "executor/executor.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <span>
#include <tuple>

#include "executor/cpu_kernels.h"
#include "executor/device_memory.h"
#include "executor/rename.h"
#include "models/data.h"
#include "models/model.h"
#include "schemas/digest.h"
#include "schemas/effects.h"
#include "schemas/units.h"

namespace dc {

double Median(std::vector<double> values) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

std::string DescribeInstruction(const proto::Schedule& schedule, int index, int rank) {
  const proto::Program& program = schedule.program();
  const auto& instr = schedule.instructions(index);
  std::string text = "instruction " + std::to_string(index) + " (" + InstrKindName(instr.kind());
  if (instr.kind() == proto::INSTR_COMPUTE) {
    text += " " + program.ops(instr.op()).name();
  } else if (instr.tensors_size() > 0) {
    text += " " + program.tensors(instr.tensors(0)).name();
    if (instr.tensors_size() > 1) text += " +" + std::to_string(instr.tensors_size() - 1);
  }
  return text + ") on rank " + std::to_string(rank);
}

Status CheckRunnable(const proto::Schedule& schedule, int world_size, const std::string& backend) {
  if (schedule.backend() != backend) {
    return Status::Error("the plan is for the '" + schedule.backend() +
                         "' backend and this run uses '" + backend +
                         "'; re-plan with dc-plan for " + backend);
  }
  if (schedule.world_size() != world_size) {
    return Status::Error("the plan is for " + std::to_string(schedule.world_size()) +
                         " rank(s) and this run has " + std::to_string(world_size) +
                         "; pass --nproc " + std::to_string(schedule.world_size()) + " or re-plan");
  }
  DC_RETURN_IF_ERROR(
      ValidateProgram(schedule.program()).Prefixed("the plan's program is invalid: "));
  // Every buffer effect (schemas/effects.h) holds before a backend touches a device: a plan
  // edited by hand fails here with the planner's own message, not halfway through a step.
  Status effects = CheckReferences(schedule);
  if (effects.ok()) effects = BufferReplay(schedule, nullptr).Run();
  if (!effects.ok()) {
    return Status::Error("the plan's schedule is inconsistent: " + effects.message() +
                         "; re-plan it");
  }
  return Status::Ok();
}

namespace {

// A buffer on the (simulated) device: fp32 storage, or int32 for token tensors. It lives in the
// plan's arena at its planned offset when the plan has a memory plan, else in its own storage.
struct Buffer {
  float* f32 = nullptr;
  int32_t* i32 = nullptr;
  int64_t elements = 0;
  int64_t accounted_bytes = 0;
  BufferKind kind = BufferKind::kActivation;
  std::vector<float> owned_f32;
  std::vector<int32_t> owned_i32;
  std::span<float> floats() { return {f32, static_cast<size_t>(elements)}; }
};

// The memory plan's placements by (instruction, tensor, micro-step).
using PlacementKey = std::tuple<int, int, int>;

class RankRunner : public RankStepper {
 public:
  RankRunner(const proto::Schedule& schedule, const RunOptions& options, Communicator* comm,
             HostTracer* tracer, std::unique_ptr<TokenSource> data)
      : schedule_(schedule),
        program_(schedule.program()),
        options_(options),
        comm_(comm),
        tracer_(tracer),
        data_(std::move(data)),
        memory_(options.device_memory_bytes),
        world_(comm->world_size()),
        rank_(comm->rank()) {}

  Status Init();
  int64_t arena_bytes() const override { return static_cast<int64_t>(arena_.size()); }
  int64_t peak_live_bytes() const override { return memory_.peak_bytes(); }
  std::vector<int64_t> peak_by_kind() const override { return memory_.peak_by_kind(); }
  StatusOr<std::string> ParamsDigest() override;
  Status RunStep(int step, bool warmup, double* loss, double* seconds) override;

 private:
  struct Pending {  // memory events of the instruction being executed
    int64_t ts_ns, address, bytes;
    bool alloc;
    int tensor;
    BufferKind kind;
  };

  int64_t ShardOf(int tensor) const {
    return ShardElements(NumElements(program_.tensors(tensor)), world_);
  }
  std::string Describe(int index) const;
  int64_t Now() const { return tracer_ ? tracer_->NowNs() : 0; }

  // Creates the buffer `key` for instruction `index` (-1 at start-up).
  Status Allocate(int index, const BufferKey& key, BufferKind kind, int64_t bytes, int64_t elements,
                  bool ints, const std::string& what);
  Status Place(int index, const BufferKey& key, Buffer* buffer, bool ints);
  void Release(const BufferKey& key);
  Buffer* Find(const BufferKey& key) {
    auto it = live_.find(key);
    return it == live_.end() ? nullptr : &it->second;
  }
  // The persistent shard of a param, grad or optimizer state; null while offloaded.
  Buffer* Shard(int tensor) { return Find(BufferKey::Persistent(tensor)); }
  // What a gather of `param` sends: its compute-dtype shard where the plan offloads its master,
  // else the master; null when neither is on the device.
  Buffer* GatherSource(int param) {
    Buffer* compute = Find(BufferKey::ComputeShard(param));
    return compute ? compute : Shard(param);
  }
  Status Execute(int index, int step, const InstructionRef& ref);
  Status Compute(const proto::Instruction& instr, int index, int step);
  Status Gather(const proto::Instruction& instr, int index);
  Status ReduceScatter(const proto::Instruction& instr);
  Status Offload(const proto::Instruction& instr, int index);
  Status Reload(const proto::Instruction& instr, int index);
  Status Rename(const proto::Instruction& instr, int index);
  Status LoadInput(int index, int tensor, int micro, int step, const std::string& what);
  // Copies a param's master (on the device or the host) into its compute-dtype shard, if it has
  // one.
  void RefreshComputeShard(int param);
  // The fp32 master of `param`: its device shard, or its host copy; null if it has neither.
  const float* Master(int param) const;
  void FlushMemoryEvents(int64_t correlation_id);

  const proto::Schedule& schedule_;
  const proto::Program& program_;
  const RunOptions& options_;
  Communicator* comm_;
  HostTracer* tracer_;
  std::unique_ptr<TokenSource> data_;
  DeviceMemory memory_;
  const int world_;
  const int rank_;

  // Every device buffer, by the key schemas/effects.h names it with.
  std::map<BufferKey, Buffer> live_;
  std::map<int, std::vector<float>> host_;  // offloaded shards, by tensor
  std::vector<bool> host_resident_;         // HostResidentTensors: in host_ for the whole run
  std::vector<std::byte> arena_;
  std::map<PlacementKey, int64_t> placements_;
  std::vector<Pending> pending_;
  double loss_sum_ = 0;
  std::vector<char> is_loss_term_;  // by tensor id: the cross-entropy and the MoE aux losses
  int64_t next_address_ = 1;
  std::map<BufferKey, int64_t> addresses_;
};

std::string RankRunner::Describe(int index) const {
  return DescribeInstruction(schedule_, index, rank_);
}

Status RankRunner::Place(int index, const BufferKey& key, Buffer* buffer, bool ints) {
  const int tensor = key.tensor;
  if (arena_.empty()) {
    if (ints) {
      buffer->owned_i32.assign(buffer->elements, 0);
      buffer->i32 = buffer->owned_i32.data();
    } else {
      buffer->owned_f32.assign(buffer->elements, 0.0f);
      buffer->f32 = buffer->owned_f32.data();
    }
    return Status::Ok();
  }
  auto it = placements_.find({index, tensor, key.placement_micro_step()});
  if (it == placements_.end()) {
    return Status::Error("the memory plan has no place for " + program_.tensors(tensor).name() +
                         " at instruction " + std::to_string(index) + "; re-plan it");
  }
  constexpr int64_t kElementBytes = 4;
  if (it->second + buffer->elements * kElementBytes > static_cast<int64_t>(arena_.size())) {
    return Status::Error("the memory plan places " + program_.tensors(tensor).name() +
                         " past the end of the arena; re-plan it");
  }
  std::byte* base = arena_.data() + it->second;
  std::memset(base, 0, buffer->elements * kElementBytes);
  if (ints) {
    buffer->i32 = reinterpret_cast<int32_t*>(base);
  } else {
    buffer->f32 = reinterpret_cast<float*>(base);
  }
  return Status::Ok();
}

Status RankRunner::Allocate(int index, const BufferKey& key, BufferKind kind, int64_t bytes,
                            int64_t elements, bool ints, const std::string& what) {
  DC_RETURN_IF_ERROR(memory_.Allocate(kind, bytes, what));
  Buffer& buffer = live_[key];
  buffer.elements = elements;
  buffer.accounted_bytes = bytes;
  buffer.kind = kind;
  DC_RETURN_IF_ERROR(Place(index, key, &buffer, ints));
  const int64_t address = next_address_++;
  addresses_[key] = address;
  pending_.push_back({Now(), address, bytes, true, key.tensor, kind});
  return Status::Ok();
}

void RankRunner::Release(const BufferKey& key) {
  auto it = live_.find(key);
  memory_.Free(it->second.kind, it->second.accounted_bytes);
  pending_.push_back(
      {Now(), addresses_[key], it->second.accounted_bytes, false, key.tensor, it->second.kind});
  addresses_.erase(key);
  live_.erase(it);
}

void RankRunner::FlushMemoryEvents(int64_t correlation_id) {
  if (tracer_) {
    for (const Pending& e : pending_) {
      tracer_->Memory(e.ts_ns, e.address, e.bytes, e.alloc, program_.tensors(e.tensor).name(),
                      e.kind, correlation_id);
    }
  }
  pending_.clear();
}

Status RankRunner::Init() {
  const proto::ModelConfig& config = program_.config();
  const proto::MemoryPlan& plan = schedule_.memory_plan();
  // The arena holds fp32 storage at the accounted sizes, which match only for fp32 programs;
  // other programs on this backend keep one allocation per buffer.
  if (plan.arena_bytes() > 0 && config.compute_dtype() == proto::DTYPE_F32) {
    // The arena is the one device allocation: it must fit the capacity, and then every buffer
    // placed inside it does too.
    const int64_t capacity = memory_.capacity_bytes();
    if (capacity > 0 && plan.arena_bytes() > capacity) {
      return Status::Error("out of device memory at start-up: the memory plan's arena of " +
                           FormatBytes(plan.arena_bytes()) + " is over the capacity of " +
                           FormatBytes(capacity) +
                           "; raise --device-memory or plan with a lower --budget");
    }
    memory_ = DeviceMemory(0);
    arena_.assign(plan.arena_bytes(), std::byte{0});
    for (const auto& p : plan.placements()) {
      placements_[{p.instruction(), p.tensor(), p.micro_step()}] = p.offset_bytes();
    }
  }
  DC_ASSIGN_OR_RETURN(is_loss_term_, LossTerms(program_));
  host_resident_ = HostResidentTensors(schedule_);
  for (const auto& t : program_.tensors()) {
    if (!IsPersistentRole(t.role())) continue;
    const BufferKind kind = PersistentKind(t.role());
    const int64_t shard = ShardOf(t.id());
    if (host_resident_[t.id()]) {  // the host optimizer's: in host memory from the start
      std::vector<float>& host = host_[t.id()];
      host.assign(shard, 0.0f);
      if (t.role() == proto::ROLE_PARAM) {
        InitParamSlice(config, t, rank_ * shard, shard, host.data());
      }
      continue;
    }
    DC_RETURN_IF_ERROR(Allocate(-1, BufferKey::Persistent(t.id()), kind, shard * kShardElementBytes,
                                shard, false, "start-up (persistent shard of " + t.name() + ")"));
    if (t.role() == proto::ROLE_PARAM)
      InitParamSlice(config, t, rank_ * shard, shard, Shard(t.id())->f32);
  }
  // This backend keeps every buffer in fp32, so a compute-dtype shard holds the master's values
  // (as the gathers from the master do); its accounted bytes are the compute dtype's.
  const std::vector<bool> compute_shard = ComputeShardParams(schedule_);
  for (const auto& t : program_.tensors()) {
    if (!compute_shard[t.id()]) continue;
    const int64_t shard = ShardOf(t.id());
    DC_RETURN_IF_ERROR(Allocate(-1, BufferKey::ComputeShard(t.id()), BufferKind::kShard,
                                ComputeShardBytes(program_, t, world_), shard, false,
                                "start-up (compute-dtype shard of " + t.name() + ")"));
    RefreshComputeShard(t.id());
  }
  FlushMemoryEvents(0);
  return Status::Ok();
}

StatusOr<std::string> RankRunner::ParamsDigest() {
  std::string bytes;
  for (const auto& t : program_.tensors()) {
    if (t.role() != proto::ROLE_PARAM) continue;
    const float* master = Master(t.id());
    if (master) {
      bytes.append(reinterpret_cast<const char*>(master), ShardOf(t.id()) * sizeof(float));
    }
  }
  return Sha256Hex(bytes);
}

Status RankRunner::LoadInput(int index, int tensor, int micro, int step, const std::string& what) {
  const proto::ModelConfig& config = program_.config();
  const proto::Tensor& t = program_.tensors(tensor);
  DC_RETURN_IF_ERROR(Allocate(index, BufferKey::Transient(tensor, micro), BufferKind::kInput,
                              TransientBytes(program_, t), NumElements(t), true, what));
  Buffer* tokens = Find(BufferKey::Transient(tensor, micro));
  const int64_t seq = config.seq();
  std::vector<int32_t> inputs(seq), targets(seq);
  for (int64_t b = 0; b < config.micro_batch(); ++b) {
    data_->Sample(SampleIndex(config, world_, step, micro, rank_, b), inputs.data(),
                  targets.data());
    const auto& source = t.name() == "targets" ? targets : inputs;
    std::copy(source.begin(), source.end(), tokens->i32 + b * seq);
  }
  return Status::Ok();
}

const float* RankRunner::Master(int param) const {
  auto device = live_.find(BufferKey::Persistent(param));
  if (device != live_.end()) return device->second.f32;
  auto host = host_.find(param);
  return host == host_.end() ? nullptr : host->second.data();
}

void RankRunner::RefreshComputeShard(int param) {
  Buffer* compute = Find(BufferKey::ComputeShard(param));
  const float* master = Master(param);
  if (compute && master) std::copy(master, master + compute->elements, compute->f32);
}

Status RankRunner::Compute(const proto::Instruction& instr, int index, int step) {
  const proto::Op& op = program_.ops(instr.op());
  const bool optimizer = op.phase() == proto::PHASE_OPTIMIZER;
  // On the host: the master and states from their host copies (this backend's device is the
  // host, so the grad shard is read where it is and the math is the same).
  const bool on_host = optimizer && instr.stream() == proto::STREAM_HOST;
  const int micro = instr.micro_step();
  const std::string what = Describe(index);
  std::vector<TensorRef> inputs, outputs;
  auto view_of = [](Buffer& b, const proto::Tensor& t) {
    TensorRef ref;
    ref.shape.assign(t.shape().begin(), t.shape().end());
    ref.i32 = b.i32;
    ref.f32 = b.f32;
    return ref;
  };
  for (int tensor : op.inputs()) {
    const proto::Tensor& t = program_.tensors(tensor);
    if (on_host && t.role() != proto::ROLE_GRAD) {
      auto host = host_.find(tensor);
      if (host == host_.end()) {
        return Status::Error(what + ": runs on the host but " + t.name() + " is on the device");
      }
      TensorRef ref;
      ref.f32 = host->second.data();
      ref.shape = {static_cast<int64_t>(host->second.size())};
      inputs.push_back(ref);
      continue;
    }
    if (optimizer) {
      Buffer* shard = Shard(tensor);
      if (!shard) {
        return Status::Error(what + ": " + t.name() +
                             (host_.count(tensor)
                                  ? "'s shard is offloaded; the plan must reload it first"
                                  : " has no shard"));
      }
      TensorRef ref;
      ref.f32 = shard->f32;
      ref.shape = {shard->elements};
      inputs.push_back(ref);
      continue;
    }
    const BufferKey key = BufferKey::OfOperand(tensor, t.role(), micro);
    if (t.role() == proto::ROLE_INPUT && !Find(BufferKey::Transient(tensor, micro))) {
      DC_RETURN_IF_ERROR(LoadInput(index, tensor, micro, step, what));
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
    DC_RETURN_IF_ERROR(Allocate(index, BufferKey::Transient(tensor, micro), TransientKind(t),
                                TransientBytes(program_, t), NumElements(t),
                                t.dtype() == proto::DTYPE_I32, what));
    outputs.push_back(view_of(*Find(BufferKey::Transient(tensor, micro)), t));
  }
  KernelContext context;
  context.config = &program_.config();
  context.grad_scale = 1.0 / static_cast<double>(TokensPerStep(program_.config(), world_));
  context.adam_step = step + 1;
  context.num_threads = options_.num_threads;
  DC_RETURN_IF_ERROR(RunCpuOp(op, inputs, outputs, context).Prefixed(what + ": "));
  if (optimizer) {
    for (int tensor : op.inputs()) {
      if (program_.tensors(tensor).role() == proto::ROLE_PARAM) RefreshComputeShard(tensor);
    }
  }
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (is_loss_term_[op.outputs(i)]) loss_sum_ += outputs[i].f32[0];
  }
  return Status::Ok();
}

// A multi-tensor all-gather is one grouped call: the shards are packed side by side, gathered
// once, and each rank's chunk unpacked into the whole params.
Status RankRunner::Gather(const proto::Instruction& instr, int index) {
  int64_t packed_elements = 0;
  for (int tensor : instr.tensors()) {
    const proto::Tensor& t = program_.tensors(tensor);
    if (t.role() != proto::ROLE_PARAM) {
      return Status::Error(Describe(index) + ": " + t.name() + " is not a param");
    }
    if (Find(BufferKey::Gathered(tensor))) {
      return Status::Error(Describe(index) + ": " + t.name() + " is already gathered");
    }
    if (!GatherSource(tensor)) {
      return Status::Error(Describe(index) + ": " + t.name() + "'s shard is offloaded");
    }
    packed_elements += ShardOf(tensor);
  }
  std::vector<float> packed(packed_elements), gathered(packed_elements * world_);
  int64_t offset = 0;
  for (int tensor : instr.tensors()) {
    const Buffer* shard = GatherSource(tensor);
    std::copy(shard->f32, shard->f32 + shard->elements, packed.begin() + offset);
    offset += shard->elements;
  }
  DC_RETURN_IF_ERROR(comm_->AllGather(packed.data(), packed_elements, gathered.data()));
  offset = 0;
  for (int tensor : instr.tensors()) {
    const proto::Tensor& t = program_.tensors(tensor);
    const int64_t shard = ShardOf(tensor), numel = NumElements(t);
    DC_RETURN_IF_ERROR(Allocate(index, BufferKey::Gathered(tensor), BufferKind::kGathered,
                                TransientBytes(program_, t), numel, false, Describe(index)));
    float* whole = Find(BufferKey::Gathered(tensor))->f32;
    for (int r = 0; r < world_; ++r) {
      const int64_t begin = r * shard;
      const int64_t count = std::max<int64_t>(0, std::min(shard, numel - begin));
      const float* chunk = gathered.data() + r * packed_elements + offset;
      std::copy(chunk, chunk + count, whole + begin);
    }
    offset += shard;
  }
  return Status::Ok();
}

// A multi-tensor reduce-scatter is one grouped call: rank r's chunk of the packed buffer holds
// rank r's slice of every grad, side by side.
Status RankRunner::ReduceScatter(const proto::Instruction& instr) {
  int64_t packed_elements = 0;
  for (int tensor : instr.tensors()) {
    if (!Find(BufferKey::Transient(tensor, instr.micro_step()))) {
      return Status::Error("reduce-scatter of " + program_.tensors(tensor).name() +
                           ", which is not live");
    }
    if (!Shard(tensor)) {
      return Status::Error("reduce-scatter into " + program_.tensors(tensor).name() +
                           "'s offloaded shard");
    }
    packed_elements += ShardOf(tensor);
  }
  std::vector<float> packed(packed_elements * world_, 0.0f), reduced(packed_elements);
  int64_t offset = 0;
  for (int tensor : instr.tensors()) {
    const Buffer* grad = Find(BufferKey::Transient(tensor, instr.micro_step()));
    const int64_t shard = ShardOf(tensor);
    for (int r = 0; r < world_; ++r) {
      const int64_t begin = r * shard;
      const int64_t count = std::max<int64_t>(0, std::min(shard, grad->elements - begin));
      std::copy(grad->f32 + begin, grad->f32 + begin + count,
                packed.begin() + r * packed_elements + offset);
    }
    offset += shard;
  }
  DC_RETURN_IF_ERROR(comm_->ReduceScatterSum(packed.data(), packed_elements, reduced.data()));
  offset = 0;
  for (int tensor : instr.tensors()) {
    Buffer* accumulator = Shard(tensor);
    for (int64_t i = 0; i < accumulator->elements; ++i) accumulator->f32[i] += reduced[offset + i];
    offset += accumulator->elements;
  }
  return Status::Ok();
}

// Offload copies a persistent shard to host memory and frees it on the device; reload brings
// it back. Both are real copies.
Status RankRunner::Offload(const proto::Instruction& instr, int index) {
  for (int tensor : instr.tensors()) {
    Buffer* shard = Shard(tensor);
    if (!shard) {
      return Status::Error(
          Describe(index) + ": " + program_.tensors(tensor).name() +
          " is not a persistent shard on the device (the cpu backend offloads shards only)");
    }
    host_[tensor].assign(shard->f32, shard->f32 + shard->elements);
    Release(BufferKey::Persistent(tensor));
  }
  return Status::Ok();
}

Status RankRunner::Reload(const proto::Instruction& instr, int index) {
  for (int tensor : instr.tensors()) {
    auto it = host_.find(tensor);
    if (it == host_.end()) {
      return Status::Error(Describe(index) + ": " + program_.tensors(tensor).name() +
                           " is not offloaded");
    }
    const proto::Tensor& t = program_.tensors(tensor);
    const BufferKind kind = PersistentKind(t.role());
    const int64_t elements = static_cast<int64_t>(it->second.size());
    DC_RETURN_IF_ERROR(Allocate(index, BufferKey::Persistent(tensor), kind,
                                elements * kShardElementBytes, elements, false, Describe(index)));
    std::copy(it->second.begin(), it->second.end(), Shard(tensor)->f32);
    host_.erase(it);
  }
  return Status::Ok();
}

// The kept buffers go on under the op's output names: no copy, no allocation.
Status RankRunner::Rename(const proto::Instruction& instr, int index) {
  return RenameLiveBuffers(program_, instr, Describe(index), &live_, &addresses_);
}

Status RankRunner::Execute(int index, int step, const InstructionRef& ref) {
  const proto::Instruction& instr = schedule_.instructions(index);
  const int64_t start_ns = Now();
  Status status;
  switch (instr.kind()) {
    case proto::INSTR_COMPUTE:
      status = Compute(instr, index, step);
      break;
    case proto::INSTR_ALL_GATHER:
      status = Gather(instr, index);
      break;
    case proto::INSTR_REDUCE_SCATTER:
      status = ReduceScatter(instr).Prefixed(Describe(index) + ": ");
      break;
    case proto::INSTR_OFFLOAD:
      status = Offload(instr, index);
      break;
    case proto::INSTR_RELOAD:
      status = Reload(instr, index);
      break;
    case proto::INSTR_RENAME:
      status = Rename(instr, index);
      break;
    case proto::INSTR_RELEASE:
      for (int tensor : instr.tensors()) {
        const BufferKey key =
            BufferKey::OfOperand(tensor, program_.tensors(tensor).role(), instr.micro_step());
        if (!Find(key)) {
          return Status::Error(Describe(index) + ": releases " + program_.tensors(tensor).name() +
                               ", which is not live");
        }
        Release(key);
      }
      break;
    default:
      return Status::Error(Describe(index) + ": the cpu backend does not run " +
                           InstrKindName(instr.kind()) + " instructions yet");
  }
  DC_RETURN_IF_ERROR(status);
  if (tracer_) {
    const int64_t end_ns = Now();
    int64_t correlation = 0;
    if (instr.kind() == proto::INSTR_COMPUTE) {
      correlation =
          tracer_->Kernel(program_.ops(instr.op()).name(), instr.stream(), start_ns, end_ns, ref);
    } else if (instr.kind() == proto::INSTR_OFFLOAD || instr.kind() == proto::INSTR_RELOAD) {
      int64_t bytes = 0;
      for (int tensor : instr.tensors()) bytes += ShardOf(tensor) * kShardElementBytes;
      correlation = tracer_->Copy(instr.kind(), instr.stream(), start_ns, end_ns, bytes, ref);
    } else if (instr.kind() == proto::INSTR_ALL_GATHER ||
               instr.kind() == proto::INSTR_REDUCE_SCATTER) {
      int64_t bytes = 0;
      for (int tensor : instr.tensors())
        bytes += TransientBytes(program_, program_.tensors(tensor));
      correlation = tracer_->Collective(instr.kind(), instr.stream(), start_ns, end_ns, bytes,
                                        instr.tensors_size(), instr.bucket(), ref);
    }
    FlushMemoryEvents(correlation);
  } else {
    pending_.clear();
  }
  return Status::Ok();
}

Status RankRunner::RunStep(int step, bool warmup, double* loss, double* seconds) {
  const auto wall_start = std::chrono::steady_clock::now();
  const int64_t start_ns = Now();
  loss_sum_ = 0;
  for (int i = 0; i < schedule_.instructions_size(); ++i) {
    InstructionRef ref{step, schedule_.instructions(i).micro_step(), i};
    DC_RETURN_IF_ERROR(Execute(i, step, ref));
  }
  for (auto& [key, buffer] : live_) {
    if (key.slot != BufferSlot::kPersistent && key.slot != BufferSlot::kComputeShard) {
      return Status::Error("the plan leaves " + program_.tensors(key.tensor).name() +
                           " live at the end of the step; re-plan it");
    }
    // The grad accumulators start the next step empty.
    if (program_.tensors(key.tensor).role() == proto::ROLE_GRAD) {
      std::fill(buffer.f32, buffer.f32 + buffer.elements, 0.0f);
    }
  }
  for (const auto& [tensor, values] : host_) {
    if (host_resident_[tensor]) continue;
    return Status::Error("the plan leaves " + program_.tensors(tensor).name() +
                         " offloaded at the end of the step; re-plan it");
  }
  double sum = loss_sum_;
  DC_RETURN_IF_ERROR(comm_->AllReduceSum(&sum, 1));
  *loss = sum / static_cast<double>(TokensPerStep(program_.config(), world_));
  *seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall_start).count();
  if (tracer_) tracer_->Step(step, start_ns, Now(), *loss, warmup);
  return Status::Ok();
}

}  // namespace

StatusOr<RunResult> RunSteps(RankStepper* runner, const proto::Schedule& schedule,
                             const RunOptions& options, Communicator* comm) {
  RunResult result;
  result.world_size = comm->world_size();
  result.tokens_per_step = TokensPerStep(schedule.program().config(), comm->world_size());
  const int total = options.warmup_steps + options.steps;
  for (int step = 0; step < total; ++step) {
    const bool warmup = step < options.warmup_steps;
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
  }
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

StatusOr<RunResult> RunSchedule(const proto::Schedule& schedule, const RunOptions& options,
                                Communicator* comm, HostTracer* tracer) {
  DC_RETURN_IF_ERROR(CheckRunnable(schedule, comm->world_size()));
  DC_ASSIGN_OR_RETURN(auto data, TokenSource::Open(schedule.program().config()));
  RankRunner runner(schedule, options, comm, tracer, std::move(data));
  DC_RETURN_IF_ERROR(runner.Init());
  return RunSteps(&runner, schedule, options, comm);
}

}  // namespace dc
