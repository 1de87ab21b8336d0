#include "schemas/effects.h"

#include <algorithm>
#include <utility>

namespace dc {

bool IsPersistentRole(proto::Role role) {
  return role == proto::ROLE_PARAM || role == proto::ROLE_GRAD ||
         role == proto::ROLE_OPTIMIZER_STATE;
}

BufferKind PersistentKind(proto::Role role) {
  switch (role) {
    case proto::ROLE_PARAM:
      return BufferKind::kShard;
    case proto::ROLE_GRAD:
      return BufferKind::kGradShard;
    default:
      return BufferKind::kOptimizerState;
  }
}

int64_t ShardBytes(const proto::Tensor& tensor, int world_size) {
  return ShardElements(NumElements(tensor), world_size) * kShardElementBytes;
}

namespace {

const proto::Tensor* FindTensor(const proto::Program& program, int id) {
  return id >= 0 && id < program.tensors_size() ? &program.tensors(id) : nullptr;
}

}  // namespace

int64_t InstructionBytes(const proto::Program& program, const proto::Instruction& instruction) {
  const proto::InstrKind kind = instruction.kind();
  if (kind != proto::INSTR_ALL_GATHER && kind != proto::INSTR_REDUCE_SCATTER &&
      kind != proto::INSTR_ALL_REDUCE) {
    return 0;
  }
  int64_t bytes = 0;
  for (int id : instruction.tensors()) {
    if (const proto::Tensor* t = FindTensor(program, id)) bytes += TransientBytes(program, *t);
  }
  return bytes;
}

int64_t CopyBytes(const proto::Program& program, int world_size,
                  const proto::Instruction& instruction) {
  if (instruction.kind() != proto::INSTR_OFFLOAD && instruction.kind() != proto::INSTR_RELOAD) {
    return 0;
  }
  int64_t bytes = 0;
  for (int id : instruction.tensors()) {
    const proto::Tensor* t = FindTensor(program, id);
    if (!t) continue;
    bytes += IsPersistentRole(t->role()) ? ShardBytes(*t, std::max(1, world_size))
                                         : TransientBytes(program, *t);
  }
  return bytes;
}

int BufferKey::placement_micro_step() const {
  switch (slot) {
    case BufferSlot::kPersistent:
      return -1;
    case BufferSlot::kComputeShard:
      return kComputeShardMicroStep;
    case BufferSlot::kGathered:
      return kGatheredMicroStep;
    case BufferSlot::kTransient:
      return micro_step;
  }
  return micro_step;
}

std::string InstructionWhere(int index, const proto::Instruction& instruction) {
  return "instruction " + std::to_string(index) + " (" + InstrKindName(instruction.kind()) + ")";
}

namespace {

// Bounds that keep every size and sum a reader of the schedule computes inside 64 bits: the
// whole program's tensors within 1 PiB in the widest dtype, and at most 4096 micro-steps (live
// bytes are at most the program's bytes once per micro-step, under 2^62).
constexpr int64_t kMaxProgramBytes = int64_t{1} << 50;
constexpr int64_t kWidestDTypeBytes = 8;
constexpr int kMaxMicroSteps = 4096;
constexpr int kMaxWorldSize = 1 << 24;

Status CheckSizes(const proto::Schedule& schedule) {
  const proto::Program& program = schedule.program();
  if (schedule.world_size() < 0 || schedule.world_size() > kMaxWorldSize) {
    return Status::Error("the schedule's world size " + std::to_string(schedule.world_size()) +
                         " is out of range");
  }
  int64_t total_bytes = 0;
  for (int t = 0; t < program.tensors_size(); ++t) {
    const proto::Tensor& tensor = program.tensors(t);
    int64_t bytes = kWidestDTypeBytes;
    for (int64_t d : tensor.shape()) {
      if (d <= 0 || __builtin_mul_overflow(bytes, d, &bytes) || bytes > kMaxProgramBytes) {
        return Status::Error("tensor " + std::to_string(t) + " (" + tensor.name() +
                             ") has a non-positive or too large shape");
      }
    }
    total_bytes += bytes;  // each is at most 2^50, and so is the sum so far
    if (total_bytes > kMaxProgramBytes) {
      return Status::Error("the program's tensors add up to more than 1 PiB");
    }
  }
  for (int o = 0; o < program.ops_size(); ++o) {
    const proto::Op& op = program.ops(o);
    for (const auto* ids : {&op.inputs(), &op.outputs()}) {
      for (int t : *ids) {
        if (t < 0 || t >= program.tensors_size()) {
          return Status::Error("op " + std::to_string(o) + " (" + op.name() +
                               ") names a bad tensor id " + std::to_string(t));
        }
      }
    }
  }
  return Status::Ok();
}

}  // namespace

Status CheckReferences(const proto::Schedule& schedule) {
  const proto::Program& program = schedule.program();
  DC_RETURN_IF_ERROR(CheckSizes(schedule));
  // Micro-steps index per-(tensor, micro-step) tables: bounded by the program's accumulation
  // steps where it says (as the verifier has them), and by kMaxMicroSteps always.
  const int64_t gas = program.config().gas();
  const int64_t micro_steps = gas > 0 ? std::min<int64_t>(gas, kMaxMicroSteps) : kMaxMicroSteps;
  for (int i = 0; i < schedule.instructions_size(); ++i) {
    const proto::Instruction& instr = schedule.instructions(i);
    if (instr.kind() == proto::INSTR_UNSPECIFIED || !proto::InstrKind_IsValid(instr.kind())) {
      return Status::Error("instruction " + std::to_string(i) + " has no valid kind");
    }
    if (instr.stream() < 0 || instr.stream() > proto::Stream_MAX) {
      return Status::Error(InstructionWhere(i, instr) + " has a bad stream");
    }
    if (instr.micro_step() < -1 || instr.micro_step() >= micro_steps) {
      return Status::Error(InstructionWhere(i, instr) + " is in micro-step " +
                           std::to_string(instr.micro_step()) + ", outside the plan's " +
                           std::to_string(micro_steps) +
                           (gas > 0 ? " (gas)" : " (dc's limit without a gas)"));
    }
    for (int d : instr.deps()) {
      if (d < 0 || d >= i) {
        return Status::Error(InstructionWhere(i, instr) + " depends on instruction " +
                             std::to_string(d) + ", which does not come before it");
      }
    }
    if ((instr.kind() == proto::INSTR_COMPUTE || instr.kind() == proto::INSTR_RENAME) &&
        (instr.op() < 0 || instr.op() >= program.ops_size())) {
      return Status::Error(InstructionWhere(i, instr) + " computes a bad op id " +
                           std::to_string(instr.op()));
    }
    for (int t : instr.tensors()) {
      if (t < 0 || t >= program.tensors_size()) {
        return Status::Error(InstructionWhere(i, instr) + " names a bad tensor id " +
                             std::to_string(t));
      }
    }
    if (instr.kind() == proto::INSTR_RENAME) {
      const proto::Op& op = program.ops(instr.op());
      bool same = op.outputs_size() == instr.tensors_size();
      for (int k = 0; same && k < op.outputs_size(); ++k) {
        const int from = instr.tensors(k), to = op.outputs(k);
        same = TransientBytes(program, program.tensors(from)) ==
                   TransientBytes(program, program.tensors(to)) &&
               program.tensors(from).role() == proto::ROLE_ACTIVATION &&
               program.tensors(to).role() == proto::ROLE_ACTIVATION;
      }
      if (!same) {
        return Status::Error(InstructionWhere(i, instr) + " renames tensors that are not, one " +
                             "for one, activations of the size of " + op.name() + "'s outputs");
      }
    }
  }
  return Status::Ok();
}

namespace {

// Which instructions run after instruction `from` ends (through deps and stream order).
std::vector<char> RunsAfter(const proto::Schedule& schedule, int from) {
  const int n = schedule.instructions_size();
  std::vector<char> after(n, 0);
  std::vector<char> stream_after(proto::Stream_MAX + 1, 0);  // the stream's latest is after
  for (int i = from + 1; i < n; ++i) {
    const proto::Instruction& instr = schedule.instructions(i);
    bool is_after = stream_after[instr.stream()] != 0 ||
                    (i > from && schedule.instructions(from).stream() == instr.stream());
    for (int d : instr.deps()) is_after = is_after || d == from || after[d];
    after[i] = is_after;
    if (is_after) stream_after[instr.stream()] = 1;
  }
  return after;
}

}  // namespace

Status CheckShardReductions(const proto::Schedule& schedule) {
  const proto::Program& program = schedule.program();
  std::vector<int> writer(program.tensors_size(), -1);  // a partial's compute instruction
  bool any = false;
  for (const proto::Op& op : program.ops()) {
    if (!IsShardReduction(program, op)) continue;
    any = true;
    for (int t : op.outputs()) writer[t] = -2;  // a partial, not yet computed
  }
  if (!any) return Status::Ok();
  std::vector<int> reduced(program.tensors_size(), -1);
  for (int i = 0; i < schedule.instructions_size(); ++i) {
    const proto::Instruction& instr = schedule.instructions(i);
    if (instr.kind() == proto::INSTR_COMPUTE) {
      for (int t : program.ops(instr.op()).outputs()) {
        if (writer[t] == -2) writer[t] = i;
      }
    }
    if (instr.kind() != proto::INSTR_ALL_REDUCE) continue;
    for (int t : instr.tensors()) {
      if (writer[t] == -1) {
        return Status::Error(InstructionWhere(i, instr) + " all-reduces " +
                             program.tensors(t).name() + ", which no shard reduction writes");
      }
      if (reduced[t] >= 0) {
        return Status::Error(InstructionWhere(i, instr) + " all-reduces " +
                             program.tensors(t).name() + " a second time (instruction " +
                             std::to_string(reduced[t]) + " did)");
      }
      reduced[t] = i;
    }
  }
  for (int t = 0; t < program.tensors_size(); ++t) {
    if (writer[t] == -1) continue;
    const std::string name = program.tensors(t).name();
    if (reduced[t] < 0) {
      return Status::Error("no instruction all-reduces " + name + ", each rank's partial sum");
    }
    if (writer[t] < 0 || !RunsAfter(schedule, writer[t])[reduced[t]]) {
      return Status::Error(InstructionWhere(reduced[t], schedule.instructions(reduced[t])) +
                           " all-reduces " + name + " without waiting for the compute of it");
    }
    const std::vector<char> after = RunsAfter(schedule, reduced[t]);
    for (int i = 0; i < schedule.instructions_size(); ++i) {
      const proto::Instruction& instr = schedule.instructions(i);
      if (instr.kind() != proto::INSTR_COMPUTE || i == writer[t]) continue;
      const auto& inputs = program.ops(instr.op()).inputs();
      if (std::find(inputs.begin(), inputs.end(), t) == inputs.end() || after[i]) continue;
      return Status::Error(InstructionWhere(i, instr) + " reads " + name +
                           " without waiting for its all-reduce (instruction " +
                           std::to_string(reduced[t]) + ")");
    }
  }
  return Status::Ok();
}

// ----- BufferReplay -----

BufferReplay::BufferReplay(const proto::Schedule& schedule, BufferListener* listener)
    : schedule_(schedule),
      program_(schedule.program()),
      listener_(listener),
      world_(std::max(1, schedule.world_size())) {
  int max_micro_step = 0;
  for (const proto::Instruction& instr : schedule.instructions()) {
    max_micro_step = std::max(max_micro_step, instr.micro_step());
  }
  stride_ = static_cast<size_t>(max_micro_step) + 2;
  const int n = program_.tensors_size();
  role_.reserve(n);
  transient_bytes_.reserve(n);
  shard_bytes_.reserve(n);
  transient_kind_.reserve(n);
  for (const proto::Tensor& t : program_.tensors()) {
    role_.push_back(t.role());
    transient_bytes_.push_back(TransientBytes(program_, t));
    shard_bytes_.push_back(ShardBytes(t, world_));
    transient_kind_.push_back(TransientKind(t));
  }
  ScheduleResidency residency = ResidencyOf(schedule);
  host_resident_ = std::move(residency.host_resident);
  compute_shard_ = std::move(residency.compute_shard);
  persistent_.assign(n, -1);
  gathered_.assign(n, -1);
  compute_shard_handle_.assign(n, -1);
  transient_.assign(static_cast<size_t>(n) * stride_, -1);
  transient_on_host_.assign(static_cast<size_t>(n) * stride_, 0);
}

std::string BufferReplay::Name(int tensor) const { return program_.tensors(tensor).name(); }

bool BufferReplay::AtEnd(int index) const {
  return index >= 0 && EffectsAtEnd(schedule_.instructions(index).kind());
}

void BufferReplay::Open(int index, const BufferKey& key, int64_t bytes, BufferKind kind,
                        int* handle) {
  *handle = next_handle_++;
  if (listener_) listener_->Allocated(index, key, bytes, kind, AtEnd(index), *handle);
}

void BufferReplay::Use(int index, const BufferKey& key, BufferAccess access, int handle) {
  if (listener_ && handle >= 0) listener_->Accessed(index, key, access, handle);
}

void BufferReplay::Close(int index, const BufferKey& key, int64_t bytes, BufferKind kind,
                         int* handle) {
  if (listener_) listener_->Freed(index, key, bytes, kind, AtEnd(index), *handle);
  *handle = -1;
}

void BufferReplay::Start() {
  for (int t = 0; t < program_.tensors_size(); ++t) {
    if (!IsPersistentRole(role_[t]) || host_resident_[t]) continue;
    Open(-1, BufferKey::Persistent(t), shard_bytes_[t], PersistentKind(role_[t]), &persistent_[t]);
  }
  for (int t = 0; t < program_.tensors_size(); ++t) {
    if (!compute_shard_[t]) continue;
    // Lives for the whole run: never freed; gathers read it, optimizer ops write it.
    Open(-1, BufferKey::ComputeShard(t), ComputeShardBytes(program_, program_.tensors(t), world_),
         BufferKind::kShard, &compute_shard_handle_[t]);
  }
}

Status BufferReplay::Run() {
  Start();
  for (int i = 0; i < schedule_.instructions_size(); ++i) DC_RETURN_IF_ERROR(Apply(i));
  return Status::Ok();
}

Status BufferReplay::Apply(int index) {
  const proto::Instruction& instr = schedule_.instructions(index);
  switch (instr.kind()) {
    case proto::INSTR_ALL_GATHER:
      return Gather(index, instr);
    case proto::INSTR_COMPUTE:
      return Compute(index, instr);
    case proto::INSTR_RELEASE:
      return Release(index, instr);
    case proto::INSTR_REDUCE_SCATTER:
      return ReduceScatter(index, instr);
    case proto::INSTR_OFFLOAD:
      return Offload(index, instr);
    case proto::INSTR_RELOAD:
      return Reload(index, instr);
    case proto::INSTR_RENAME:
      return Rename(index, instr);
    case proto::INSTR_ALL_REDUCE:
      return AllReduce(index, instr);
    default:
      return Status::Error("instruction " + std::to_string(index) + " has no valid kind");
  }
}

Status BufferReplay::Gather(int i, const proto::Instruction& instr) {
  for (int t : instr.tensors()) {
    if (role_[t] != proto::ROLE_PARAM) {
      return Status::Error(InstructionWhere(i, instr) + " gathers " + Name(t) +
                           ", which is not a param");
    }
    if (gathered_[t] >= 0) {
      return Status::Error(InstructionWhere(i, instr) + " gathers " + Name(t) +
                           ", which is already gathered and not released");
    }
    // What the gather sends: the compute-dtype shard where there is one, else the master.
    if (compute_shard_handle_[t] >= 0) {
      Use(i, BufferKey::ComputeShard(t), BufferAccess::kRead, compute_shard_handle_[t]);
    } else {
      Use(i, BufferKey::Persistent(t), BufferAccess::kRead, persistent_[t]);
    }
    Open(i, BufferKey::Gathered(t), transient_bytes_[t], BufferKind::kGathered, &gathered_[t]);
    Use(i, BufferKey::Gathered(t), BufferAccess::kWrite, gathered_[t]);
  }
  return Status::Ok();
}

Status BufferReplay::ReadInput(int i, const proto::Instruction& instr, bool optimizer, int tensor) {
  const proto::Role role = role_[tensor];
  const int micro = instr.micro_step();
  // The optimizer phase works on the rank's persistent shards, never on gathered buffers.
  if (IsPersistentRole(role) && (optimizer || role == proto::ROLE_OPTIMIZER_STATE)) {
    const bool on_device = persistent_[tensor] >= 0;
    // A host optimizer op works on the host copies of the param's master and states (its grad
    // shard it copies from the device).
    if (instr.stream() == proto::STREAM_HOST && role != proto::ROLE_GRAD) {
      if (on_device) {
        return Status::Error(InstructionWhere(i, instr) + " runs on the host but reads " +
                             Name(tensor) + ", which is on the device");
      }
      return Status::Ok();
    }
    if (!on_device) {
      return Status::Error(InstructionWhere(i, instr) + " reads " + Name(tensor) +
                           ", which is offloaded to the host; reload it first");
    }
    Use(i, BufferKey::Persistent(tensor), BufferAccess::kRead, persistent_[tensor]);
    return Status::Ok();
  }
  if (role == proto::ROLE_PARAM) {
    if (gathered_[tensor] < 0) {
      return Status::Error(InstructionWhere(i, instr) + " reads param " + Name(tensor) +
                           ", which is not gathered");
    }
    Use(i, BufferKey::Gathered(tensor), BufferAccess::kRead, gathered_[tensor]);
    return Status::Ok();
  }
  const BufferKey key = BufferKey::Transient(tensor, micro);
  int& handle = TransientHandle(tensor, micro);
  if (handle >= 0) {
    Use(i, key, BufferAccess::kRead, handle);
    return Status::Ok();
  }
  if (role == proto::ROLE_INPUT) {  // inputs arrive with the first compute that reads them
    Open(i, key, transient_bytes_[tensor], BufferKind::kInput, &handle);
    Use(i, key, BufferAccess::kWrite, handle);
    Use(i, key, BufferAccess::kRead, handle);
    return Status::Ok();
  }
  return Status::Error(InstructionWhere(i, instr) + " reads " + Name(tensor) + " (micro-step " +
                       std::to_string(micro) + "), which is not live");
}

Status BufferReplay::Compute(int i, const proto::Instruction& instr) {
  const proto::Op& op = program_.ops(instr.op());
  const bool optimizer = op.phase() == proto::PHASE_OPTIMIZER;
  const int micro = instr.micro_step();
  for (int t : op.inputs()) DC_RETURN_IF_ERROR(ReadInput(i, instr, optimizer, t));
  for (int t : op.outputs()) {
    if (optimizer && IsPersistentRole(role_[t])) {  // updated in place (on the host: no buffer)
      Use(i, BufferKey::Persistent(t), BufferAccess::kWrite, persistent_[t]);
      continue;
    }
    int& handle = TransientHandle(t, micro);
    if (handle >= 0) {
      return Status::Error(InstructionWhere(i, instr) + " writes " + Name(t) +
                           ", which is still live from an earlier write");
    }
    Open(i, BufferKey::Transient(t, micro), transient_bytes_[t], transient_kind_[t], &handle);
    Use(i, BufferKey::Transient(t, micro), BufferAccess::kWrite, handle);
  }
  // An optimizer op refreshes the compute-dtype shard of each param it updates.
  if (optimizer) {
    for (int t : op.inputs()) {
      if (role_[t] != proto::ROLE_PARAM) continue;
      Use(i, BufferKey::ComputeShard(t), BufferAccess::kWrite, compute_shard_handle_[t]);
    }
  }
  return Status::Ok();
}

Status BufferReplay::Release(int i, const proto::Instruction& instr) {
  const int micro = instr.micro_step();
  for (int t : instr.tensors()) {
    if (role_[t] == proto::ROLE_PARAM) {
      if (gathered_[t] < 0) {
        return Status::Error(InstructionWhere(i, instr) + " releases param " + Name(t) +
                             ", which is not gathered");
      }
      Close(i, BufferKey::Gathered(t), transient_bytes_[t], BufferKind::kGathered, &gathered_[t]);
      continue;
    }
    int& handle = TransientHandle(t, micro);
    if (handle < 0) {
      return Status::Error(InstructionWhere(i, instr) + " releases " + Name(t) + " (micro-step " +
                           std::to_string(micro) + "), which is not live");
    }
    Close(i, BufferKey::Transient(t, micro), transient_bytes_[t], transient_kind_[t], &handle);
  }
  return Status::Ok();
}

Status BufferReplay::ReduceScatter(int i, const proto::Instruction& instr) {
  const int micro = instr.micro_step();
  for (int t : instr.tensors()) {
    if (role_[t] != proto::ROLE_GRAD) {
      return Status::Error(InstructionWhere(i, instr) + " reduce-scatters " + Name(t) +
                           ", which is not a grad");
    }
    if (TransientHandle(t, micro) < 0) {
      return Status::Error(InstructionWhere(i, instr) + " reduce-scatters " + Name(t) +
                           " (micro-step " + std::to_string(micro) + "), which is not live");
    }
    if (persistent_[t] < 0) {
      return Status::Error(InstructionWhere(i, instr) + " reduce-scatters " + Name(t) +
                           " into its shard, which is offloaded to the host; reload it first");
    }
    Use(i, BufferKey::Transient(t, micro), BufferAccess::kRead, TransientHandle(t, micro));
    Use(i, BufferKey::Persistent(t), BufferAccess::kWrite, persistent_[t]);
  }
  return Status::Ok();
}

// A small sum over ranks in place: of activations live in its micro-step (the grads' squared
// norm in the optimizer phase).
Status BufferReplay::AllReduce(int i, const proto::Instruction& instr) {
  const int micro = instr.micro_step();
  for (int t : instr.tensors()) {
    if (role_[t] != proto::ROLE_ACTIVATION) {
      return Status::Error(InstructionWhere(i, instr) + " all-reduces " + Name(t) +
                           ", which is not an activation");
    }
    if (TransientHandle(t, micro) < 0) {
      return Status::Error(InstructionWhere(i, instr) + " all-reduces " + Name(t) +
                           " (micro-step " + std::to_string(micro) + "), which is not live");
    }
    Use(i, BufferKey::Transient(t, micro), BufferAccess::kWrite, TransientHandle(t, micro));
  }
  return Status::Ok();
}

// Persistent shards leave the device when their copy ends; transients likewise.
Status BufferReplay::Offload(int i, const proto::Instruction& instr) {
  const int micro = instr.micro_step();
  for (int t : instr.tensors()) {
    const proto::Role role = role_[t];
    if (IsPersistentRole(role)) {
      if (persistent_[t] < 0) {
        return Status::Error(InstructionWhere(i, instr) + " offloads " + Name(t) +
                             ", which is already offloaded");
      }
      Use(i, BufferKey::Persistent(t), BufferAccess::kRead, persistent_[t]);
      Close(i, BufferKey::Persistent(t), shard_bytes_[t], PersistentKind(role), &persistent_[t]);
      continue;
    }
    int& handle = TransientHandle(t, micro);
    if (handle < 0) {
      return Status::Error(InstructionWhere(i, instr) + " offloads " + Name(t) +
                           ", which is not live");
    }
    Use(i, BufferKey::Transient(t, micro), BufferAccess::kRead, handle);
    Close(i, BufferKey::Transient(t, micro), transient_bytes_[t], transient_kind_[t], &handle);
    transient_on_host_[static_cast<size_t>(t) * stride_ + (micro + 1)] = 1;
  }
  return Status::Ok();
}

// Reloaded buffers take device memory from the copy's start.
Status BufferReplay::Reload(int i, const proto::Instruction& instr) {
  const int micro = instr.micro_step();
  for (int t : instr.tensors()) {
    const proto::Role role = role_[t];
    if (IsPersistentRole(role)) {
      if (persistent_[t] >= 0) {
        return Status::Error(InstructionWhere(i, instr) + " reloads " + Name(t) +
                             ", which is not offloaded");
      }
      Open(i, BufferKey::Persistent(t), shard_bytes_[t], PersistentKind(role), &persistent_[t]);
      Use(i, BufferKey::Persistent(t), BufferAccess::kWrite, persistent_[t]);
      continue;
    }
    uint8_t& on_host = transient_on_host_[static_cast<size_t>(t) * stride_ + (micro + 1)];
    if (!on_host) {
      return Status::Error(InstructionWhere(i, instr) + " reloads " + Name(t) +
                           ", which is not offloaded");
    }
    on_host = 0;
    Open(i, BufferKey::Transient(t, micro), transient_bytes_[t], transient_kind_[t],
         &TransientHandle(t, micro));
    Use(i, BufferKey::Transient(t, micro), BufferAccess::kWrite, TransientHandle(t, micro));
  }
  return Status::Ok();
}

// The kept buffers change name, not size: no allocation, no free.
Status BufferReplay::Rename(int i, const proto::Instruction& instr) {
  const proto::Op& op = program_.ops(instr.op());
  const int micro = instr.micro_step();
  for (int k = 0; k < instr.tensors_size(); ++k) {
    const int from = instr.tensors(k), to = op.outputs(k);
    int& from_handle = TransientHandle(from, micro);
    int& to_handle = TransientHandle(to, micro);
    if (from_handle < 0) {
      return Status::Error(InstructionWhere(i, instr) + " renames " + Name(from) + " (micro-step " +
                           std::to_string(micro) + "), which is not live");
    }
    if (to_handle >= 0) {
      return Status::Error(InstructionWhere(i, instr) + " renames into " + Name(to) +
                           ", which is still live from an earlier write");
    }
    to_handle = from_handle;
    from_handle = -1;
    if (listener_) {
      listener_->Renamed(i, BufferKey::Transient(from, micro), BufferKey::Transient(to, micro),
                         to_handle);
    }
  }
  return Status::Ok();
}

}  // namespace dc
