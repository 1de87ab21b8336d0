#include "schemas/plan_check.h"

#include <unistd.h>

#include <algorithm>
#include <limits>
#include <string>
#include <string_view>

#include "schemas/effects.h"
#include "schemas/happens_before.h"
#include "schemas/op_kinds.h"
#include "schemas/units.h"

namespace dc {
namespace {

std::string Str(int64_t v) { return std::to_string(v); }

std::string ShapeText(const proto::Tensor& t) {
  std::string text = "[";
  for (int i = 0; i < t.shape_size(); ++i) text += (i ? ", " : "") + Str(t.shape(i));
  return text + "]";
}

// The shapes the executor derives from the config rather than from the program: token inputs are
// staged as micro_batch x seq int32 ids, and token ids (below `vocab`) index the embedding tables.
Status CheckShapesAgainstConfig(const proto::Program& program) {
  const proto::ModelConfig& config = program.config();
  for (const proto::Tensor& t : program.tensors()) {
    if (t.role() != proto::ROLE_INPUT) continue;
    if (t.dtype() != proto::DTYPE_I32 || t.shape_size() != 2 ||
        t.shape(0) != config.micro_batch() || t.shape(1) != config.seq()) {
      return Status::Error("input " + t.name() + " is " + DTypeName(t.dtype()) + " " +
                           ShapeText(t) + ", not i32 [" + Str(config.micro_batch()) + ", " +
                           Str(config.seq()) + "] as the model config's micro_batch and seq say");
    }
  }
  for (const proto::Op& op : program.ops()) {
    if (op.kind() != op_kind::kEmbedding) continue;
    if (op.inputs_size() < 2) return Status::Error("op " + op.name() + " has no embedding table");
    const proto::Tensor& table = program.tensors(op.inputs(1));
    if (table.shape_size() != 2 || table.shape(0) != config.vocab()) {
      return Status::Error("op " + op.name() + "'s table " + table.name() + " is " +
                           ShapeText(table) + ", not " + Str(config.vocab()) +
                           " rows as the model config's vocab says");
    }
  }
  return Status::Ok();
}

// The bytes a placement must hold: the buffer it names, as schemas/effects.h sizes it.
int64_t PlacedBytes(const proto::Schedule& schedule, const proto::BufferPlacement& p) {
  const proto::Program& program = schedule.program();
  const proto::Tensor& t = program.tensors(p.tensor());
  if (p.micro_step() == kComputeShardMicroStep) {
    return ComputeShardBytes(program, t, schedule.world_size());
  }
  const bool shard =
      IsPersistentRole(t.role()) && p.micro_step() != kGatheredMicroStep &&
      (p.instruction() < 0 || schedule.instructions(p.instruction()).kind() == proto::INSTR_RELOAD);
  return shard ? ShardBytes(t, schedule.world_size()) : TransientBytes(program, t);
}

Status CheckMemoryPlan(const proto::Schedule& schedule) {
  const proto::MemoryPlan& plan = schedule.memory_plan();
  const int64_t arena = plan.arena_bytes();
  if (arena < 0) return Status::Error("the memory plan's arena has " + Str(arena) + " bytes");
  if (arena == 0) return Status::Ok();  // no memory plan: the backend allocates each buffer
  const proto::Program& program = schedule.program();
  const int64_t gas = program.config().gas();
  for (const proto::BufferPlacement& p : plan.placements()) {
    if (p.tensor() < 0 || p.tensor() >= program.tensors_size()) {
      return Status::Error("the memory plan places tensor id " + Str(p.tensor()) +
                           ", which the program lacks");
    }
    const proto::Tensor& t = program.tensors(p.tensor());
    if (p.instruction() < -1 || p.instruction() >= schedule.instructions_size()) {
      return Status::Error("the memory plan places " + t.name() + " at instruction " +
                           Str(p.instruction()) + ", which the plan lacks");
    }
    if (p.micro_step() < kComputeShardMicroStep || p.micro_step() >= gas) {
      return Status::Error("the memory plan places " + t.name() + " in micro-step " +
                           Str(p.micro_step()) + ", outside the plan's " + Str(gas) + " (gas)");
    }
    const int64_t bytes = PlacedBytes(schedule, p);
    const int64_t offset = p.offset_bytes();
    // offset + bytes <= arena, written so that a hostile offset near INT64_MAX cannot overflow.
    if (offset < 0 || offset % kPlacementAlignmentBytes != 0 || p.size_bytes() < bytes ||
        bytes > arena || offset > arena - bytes) {
      return Status::Error("the memory plan's place for " + t.name() + " (offset " + Str(offset) +
                           ", " + Str(p.size_bytes()) + " bytes) does not hold its " + Str(bytes) +
                           " bytes " + Str(kPlacementAlignmentBytes) +
                           "-byte aligned inside the arena of " + Str(arena) + " bytes");
    }
  }
  return Status::Ok();
}

// The peak of live device bytes of a replay. A hostile plan's sizes may sum past int64: the
// count then sticks at the largest value (and is refused).
class PeakListener : public BufferListener {
 public:
  void Allocated(int, const BufferKey&, int64_t size_bytes, BufferKind, bool, int) override {
    if (saturated_ || __builtin_add_overflow(live_bytes_, size_bytes, &live_bytes_)) {
      saturated_ = true;
      live_bytes_ = std::numeric_limits<int64_t>::max();
    }
    peak_bytes_ = std::max(peak_bytes_, live_bytes_);
  }
  void Freed(int, const BufferKey&, int64_t size_bytes, BufferKind, bool, int) override {
    if (!saturated_) live_bytes_ -= size_bytes;
  }
  int64_t peak_bytes() const { return peak_bytes_; }

 private:
  int64_t live_bytes_ = 0;
  int64_t peak_bytes_ = 0;
  bool saturated_ = false;
};

}  // namespace

Status ValidatePlan(const proto::Schedule& schedule, const PlanLimits& limits) {
  if (schedule.world_size() < 1) {
    return Status::Error("the plan has world size " + Str(schedule.world_size()));
  }
  const proto::Program& program = schedule.program();
  if (Status config = ValidateConfig(program.config()); !config.ok()) {
    std::string message = config.message();
    constexpr std::string_view kConfigPrefix = "model config: ";
    if (message.starts_with(kConfigPrefix)) message.erase(0, kConfigPrefix.size());
    return Status::Error("the plan's model config: " + message);
  }
  DC_RETURN_IF_ERROR(ValidateProgram(program).Prefixed("the plan's program: "));
  DC_RETURN_IF_ERROR(CheckShapesAgainstConfig(program).Prefixed("the plan's program: "));
  // Indices, streams and micro-steps (within gas): effects.h's rules, one home.
  DC_RETURN_IF_ERROR(CheckReferences(schedule).Prefixed("the plan's schedule: "));
  DC_RETURN_IF_ERROR(CheckMemoryPlan(schedule));
  PeakListener peak;
  DC_RETURN_IF_ERROR(BufferReplay(schedule, &peak).Run().Prefixed("the plan's schedule: "));
  DC_RETURN_IF_ERROR(CheckShardReductions(schedule).Prefixed("the plan's schedule: "));
  DC_RETURN_IF_ERROR(CheckHappensBefore(schedule).Prefixed("the plan's schedule: "));
  if (limits.memory_bytes > 0) {
    // Device bytes, and the token ids of every micro-step staged in host memory beside them;
    // a sum past int64 saturates (and is refused).
    int64_t needed = std::max(schedule.memory_plan().arena_bytes(), peak.peak_bytes());
    for (const proto::Tensor& t : program.tensors()) {
      if (t.role() != proto::ROLE_INPUT) continue;
      int64_t staged = 0;
      if (__builtin_mul_overflow(SizeBytes(t), program.config().gas(), &staged) ||
          __builtin_add_overflow(needed, staged, &needed)) {
        needed = std::numeric_limits<int64_t>::max();
        break;
      }
    }
    if (needed > limits.memory_bytes) {
      return Status::Error("the plan needs " + FormatBytes(needed) + " per rank (" + Str(needed) +
                           " bytes), more than the " + FormatBytes(limits.memory_bytes) +
                           " this host has");
    }
  }
  return Status::Ok();
}

int64_t PhysicalMemoryBytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES);
  const long page_bytes = ::sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page_bytes <= 0) return 0;
  return static_cast<int64_t>(pages) * page_bytes;
}

}  // namespace dc
