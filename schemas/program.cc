#include "schemas/program.h"

#include <algorithm>
#include <cmath>
#include <sstream>
#include <utility>

#include "schemas/effects.h"

namespace dc {

int64_t DTypeSizeBytes(proto::DType dtype) {
  switch (dtype) {
    case proto::DTYPE_F32:
      return 4;
    case proto::DTYPE_BF16:
      return 2;
    case proto::DTYPE_F16:
      return 2;
    case proto::DTYPE_I32:
      return 4;
    default:
      return 0;
  }
}

const char* DTypeName(proto::DType dtype) {
  switch (dtype) {
    case proto::DTYPE_F32:
      return "f32";
    case proto::DTYPE_BF16:
      return "bf16";
    case proto::DTYPE_F16:
      return "f16";
    case proto::DTYPE_I32:
      return "i32";
    default:
      return "?";
  }
}

const char* RoleName(proto::Role role) {
  switch (role) {
    case proto::ROLE_PARAM:
      return "param";
    case proto::ROLE_GRAD:
      return "grad";
    case proto::ROLE_OPTIMIZER_STATE:
      return "optimizer_state";
    case proto::ROLE_ACTIVATION:
      return "activation";
    case proto::ROLE_INPUT:
      return "input";
    default:
      return "?";
  }
}

const char* PhaseName(proto::Phase phase) {
  switch (phase) {
    case proto::PHASE_FORWARD:
      return "forward";
    case proto::PHASE_BACKWARD:
      return "backward";
    case proto::PHASE_OPTIMIZER:
      return "optimizer";
    default:
      return "?";
  }
}

bool IsCollective(proto::InstrKind kind) {
  return kind == proto::INSTR_ALL_GATHER || kind == proto::INSTR_REDUCE_SCATTER ||
         kind == proto::INSTR_ALL_REDUCE;
}

const char* InstrKindName(proto::InstrKind kind) {
  switch (kind) {
    case proto::INSTR_COMPUTE:
      return "compute";
    case proto::INSTR_ALL_GATHER:
      return "all_gather";
    case proto::INSTR_RELEASE:
      return "release";
    case proto::INSTR_REDUCE_SCATTER:
      return "reduce_scatter";
    case proto::INSTR_OFFLOAD:
      return "offload";
    case proto::INSTR_RELOAD:
      return "reload";
    case proto::INSTR_RENAME:
      return "rename";
    case proto::INSTR_ALL_REDUCE:
      return "all_reduce";
    default:
      return "?";
  }
}

const char* StreamName(proto::Stream stream) {
  switch (stream) {
    case proto::STREAM_COMPUTE:
      return "compute";
    case proto::STREAM_GATHER:
      return "gather";
    case proto::STREAM_REDUCE:
      return "reduce";
    case proto::STREAM_H2D:
      return "h2d";
    case proto::STREAM_D2H:
      return "d2h";
    case proto::STREAM_HOST:
      return "host";
    default:
      return "?";
  }
}

int64_t NumElements(const proto::Tensor& tensor) {
  int64_t n = 1;
  for (int64_t d : tensor.shape()) n *= d;
  return n;
}

int64_t SizeBytes(const proto::Tensor& tensor) {
  return NumElements(tensor) * DTypeSizeBytes(tensor.dtype());
}

int64_t ShardElements(int64_t num_elements, int world_size) {
  return (num_elements + world_size - 1) / world_size;
}

namespace {
const proto::AttrValue* FindAttr(const proto::Op& op, const std::string& name) {
  for (const auto& attr : op.attrs()) {
    if (attr.name() == name) return &attr.value();
  }
  return nullptr;
}

proto::AttrValue* MutableAttr(proto::Op* op, const std::string& name) {
  for (auto& attr : *op->mutable_attrs()) {
    if (attr.name() == name) return attr.mutable_value();
  }
  auto* attr = op->add_attrs();
  attr->set_name(name);
  // Keep attrs sorted by name so equal ops serialize equally.
  std::sort(op->mutable_attrs()->begin(), op->mutable_attrs()->end(),
            [](const proto::Attr& a, const proto::Attr& b) { return a.name() < b.name(); });
  for (auto& a : *op->mutable_attrs()) {
    if (a.name() == name) return a.mutable_value();
  }
  return nullptr;  // unreachable
}
}  // namespace

int64_t AttrInt(const proto::Op& op, const std::string& name, int64_t fallback) {
  const proto::AttrValue* v = FindAttr(op, name);
  return v && v->has_i() ? v->i() : fallback;
}

double AttrFloat(const proto::Op& op, const std::string& name, double fallback) {
  const proto::AttrValue* v = FindAttr(op, name);
  if (!v) return fallback;
  if (v->has_f()) return v->f();
  if (v->has_i()) return static_cast<double>(v->i());
  return fallback;
}

void SetAttr(proto::Op* op, const std::string& name, int64_t value) {
  MutableAttr(op, name)->set_i(value);
}

void SetAttrFloat(proto::Op* op, const std::string& name, double value) {
  MutableAttr(op, name)->set_f(value);
}

namespace {

// Micro-steps per optimizer step: a schedule unrolls every one, so this bounds its size.
constexpr int64_t kMaxGas = 65536;
// Decoder layers times micro-steps: a schedule has about 70 instructions per pair (Llama 3 405B
// at GAS 16: 2016 pairs, 140k instructions), and planning's memory grows with the square of the
// instruction count (1000 pairs of a small model: 1.4 GB; 2000: 5.5 GB). Past this, planning
// would need hundreds of GB and hours, so the config is refused before anything is built.
constexpr int64_t kMaxLayerMicroSteps = 8192;
// Experts times decoder layers times micro-steps (mixtral presets): each expert adds its own
// matmuls to every layer, so a million experts built a program for minutes and then ran out of
// memory (issue 13). Building takes about 3 ms per expert layer micro-step (2 layers of 4096
// experts: 27 s); this bound keeps it under a minute and still holds DeepSeek-V3's 256 experts
// times 61 layers.
constexpr int64_t kMaxExpertLayerMicroSteps = 16384;

std::string Str(int64_t v) { return std::to_string(v); }

// "-1", "0.5", "nan", "inf": shortest round-trip form.
std::string Real(double v) {
  std::ostringstream text;
  text << v;
  return text.str();
}

Status CheckSize(const char* flag, int64_t value, int64_t min = 1) {
  if (value < min) {
    return Status::Error(std::string(flag) + " must be at least " + Str(min) + " (got " +
                         Str(value) + ")");
  }
  if (value > kMaxConfigDimension) {
    return Status::Error(std::string(flag) + " " + Str(value) + " is over dc's limit of " +
                         Str(kMaxConfigDimension));
  }
  return Status::Ok();
}

Status CheckPositiveReal(const char* field, double value) {
  if (std::isfinite(value) && value > 0) return Status::Ok();
  return Status::Error(std::string("model config: ") + field + " must be a positive number (got " +
                       Real(value) + ")");
}

// A finite number >= 0; `name` is the flag or field.
Status CheckNonNegativeReal(const std::string& name, double value) {
  if (!std::isfinite(value)) {
    return Status::Error(name + " must be a finite number (got " + Real(value) + ")");
  }
  if (value < 0) {
    return Status::Error(name + " must not be negative (got " + Real(value) + ")");
  }
  return Status::Ok();
}

// The learning-rate schedule's fields (LearningRate): a peak and a floor below it, step counts,
// and a decay that has steps to decay over.
Status CheckLearningRateSchedule(const proto::ModelConfig& c) {
  DC_RETURN_IF_ERROR(CheckNonNegativeReal("--lr", c.lr()));
  DC_RETURN_IF_ERROR(CheckNonNegativeReal("--min-lr", c.min_lr()));
  if (c.min_lr() > c.lr()) {
    return Status::Error("--min-lr " + Real(c.min_lr()) + " is above --lr " + Real(c.lr()) +
                         "; the schedule decays from --lr down to --min-lr");
  }
  if (c.lr_warmup_steps() < 0 || c.lr_decay_steps() < 0) {
    return Status::Error("--warmup-steps and --decay-steps must not be negative");
  }
  if (!proto::LrDecay_IsValid(c.lr_decay())) {
    return Status::Error("model config: lr_decay " + Str(c.lr_decay()) +
                         " is unknown; re-plan with this dc");
  }
  if (c.lr_decay() != proto::LR_DECAY_CONSTANT && c.lr_decay_steps() == 0) {
    return Status::Error("--lr-decay " +
                         std::string(c.lr_decay() == proto::LR_DECAY_LINEAR ? "linear" : "cosine") +
                         " needs --decay-steps, the steps it takes from --lr to --min-lr");
  }
  return Status::Ok();
}

}  // namespace

Status ValidateConfig(const proto::ModelConfig& c) {
  if (c.family() != kFamilyLlama && c.family() != kFamilyMixtral) {
    return Status::Error("model config: family '" + c.family() + "' is not supported ('" +
                         kFamilyLlama + "' or '" + kFamilyMixtral + "')");
  }
  if (c.family() == kFamilyLlama && (c.experts() != 0 || c.top_k() != 0)) {
    return Status::Error("--experts and --top-k apply to the mixtral presets only (this is '" +
                         c.preset() + "', a dense llama)");
  }
  if (c.family() == kFamilyMixtral) {
    DC_RETURN_IF_ERROR(CheckSize("--experts", c.experts()));
    DC_RETURN_IF_ERROR(CheckSize("--top-k", c.top_k()));
    if (c.top_k() > c.experts()) {
      return Status::Error("--top-k " + Str(c.top_k()) + " is more than --experts " +
                           Str(c.experts()));
    }
    DC_RETURN_IF_ERROR(CheckNonNegativeReal("--router-aux-coef", c.router_aux_coef()));
  }
  DC_RETURN_IF_ERROR(CheckSize("--layers", c.layers()));
  DC_RETURN_IF_ERROR(CheckSize("--hidden", c.hidden()));
  DC_RETURN_IF_ERROR(CheckSize("--heads", c.heads()));
  DC_RETURN_IF_ERROR(CheckSize("--kv-heads", c.kv_heads()));
  DC_RETURN_IF_ERROR(CheckSize("--ffn", c.ffn()));
  // One token: every target is that token and the loss is 0 from the first step; nothing learns.
  DC_RETURN_IF_ERROR(CheckSize("--vocab", c.vocab(), kMinVocab));
  DC_RETURN_IF_ERROR(CheckSize("--seq", c.seq()));
  DC_RETURN_IF_ERROR(CheckSize("--micro-batch", c.micro_batch()));
  DC_RETURN_IF_ERROR(CheckSize("--gas", c.gas()));
  if (c.gas() > kMaxGas) {
    return Status::Error("--gas " + Str(c.gas()) + " is over dc's limit of " + Str(kMaxGas) +
                         " micro-steps");
  }
  if (c.layers() * c.gas() > kMaxLayerMicroSteps) {
    return Status::Error("--layers " + Str(c.layers()) + " times --gas " + Str(c.gas()) + " is " +
                         Str(c.layers() * c.gas()) + " layer micro-steps, over dc's limit of " +
                         Str(kMaxLayerMicroSteps) +
                         " for one schedule; use fewer layers or micro-steps (a larger "
                         "--micro-batch)");
  }
  if (c.family() == kFamilyMixtral &&
      c.experts() * c.layers() * c.gas() > kMaxExpertLayerMicroSteps) {
    return Status::Error(
        "--experts " + Str(c.experts()) + " times --layers " + Str(c.layers()) + " times --gas " +
        Str(c.gas()) + " is " + Str(c.experts() * c.layers() * c.gas()) +
        " expert layer micro-steps, over dc's limit of " + Str(kMaxExpertLayerMicroSteps) +
        " for one schedule; use fewer experts, layers or micro-steps");
  }
  if (c.seq() * c.micro_batch() > kMaxConfigDimension) {
    return Status::Error("--seq " + Str(c.seq()) + " times --micro-batch " + Str(c.micro_batch()) +
                         " is over dc's limit of " + Str(kMaxConfigDimension) +
                         " tokens per micro-batch");
  }
  // The largest weights, checked here so that the message names the flags (a program's own check
  // can only name the tensor).
  const struct {
    const char* flags;
    int64_t a, b;
  } weights[] = {{"--hidden times --hidden", c.hidden(), c.hidden()},
                 {"--hidden times --ffn", c.hidden(), c.ffn()},
                 {"--vocab times --hidden", c.vocab(), c.hidden()}};
  for (const auto& w : weights) {
    if (w.a * w.b > kMaxTensorElements) {
      return Status::Error(std::string(w.flags) + " is " + Str(w.a * w.b) +
                           " elements for one weight, over dc's limit of " +
                           Str(kMaxTensorElements) + "; give smaller sizes");
    }
  }
  if (c.hidden() % c.heads() != 0) {
    return Status::Error("--heads " + Str(c.heads()) + " does not divide --hidden " +
                         Str(c.hidden()));
  }
  if (c.heads() % c.kv_heads() != 0) {
    return Status::Error("--kv-heads " + Str(c.kv_heads()) + " does not divide --heads " +
                         Str(c.heads()));
  }
  const int64_t head_dim = c.hidden() / c.heads();
  if (head_dim % 2 != 0) {
    return Status::Error("head dim " + Str(head_dim) + " (--hidden " + Str(c.hidden()) +
                         " / --heads " + Str(c.heads()) + ") must be even for RoPE");
  }
  if (c.compute_dtype() != proto::DTYPE_F32 && c.compute_dtype() != proto::DTYPE_BF16 &&
      c.compute_dtype() != proto::DTYPE_F16) {
    return Status::Error(std::string("model config: compute dtype ") +
                         DTypeName(c.compute_dtype()) + " is not a float type (f32, bf16, f16)");
  }
  DC_RETURN_IF_ERROR(CheckPositiveReal("rope_theta", c.rope_theta()));
  DC_RETURN_IF_ERROR(CheckPositiveReal("norm_eps", c.norm_eps()));
  DC_RETURN_IF_ERROR(CheckPositiveReal("init_std", c.init_std()));
  DC_RETURN_IF_ERROR(CheckPositiveReal("adam_eps", c.adam_eps()));
  DC_RETURN_IF_ERROR(CheckNonNegativeReal("model config: weight_decay", c.weight_decay()));
  DC_RETURN_IF_ERROR(CheckNonNegativeReal("--clip-grad-norm", c.clip_grad_norm()));
  if (!(c.beta1() >= 0 && c.beta1() < 1 && c.beta2() >= 0 && c.beta2() < 1)) {
    return Status::Error("model config: beta1 and beta2 must lie in [0, 1)");
  }
  return CheckLearningRateSchedule(c);
}

Status ValidateProgram(const proto::Program& program) {
  const int num_tensors = program.tensors_size();
  for (int i = 0; i < num_tensors; ++i) {
    const auto& t = program.tensors(i);
    if (t.id() != i) {
      return Status::Error("tensor " + t.name() + " has id " + std::to_string(t.id()) +
                           " at index " + std::to_string(i));
    }
    if (DTypeSizeBytes(t.dtype()) == 0)
      return Status::Error("tensor " + t.name() + " has no dtype");
    int64_t elements = 1;
    for (int64_t d : t.shape()) {
      if (d <= 0) return Status::Error("tensor " + t.name() + " has a non-positive dimension");
      if (__builtin_mul_overflow(elements, d, &elements) || elements > kMaxTensorElements) {
        return Status::Error("tensor " + t.name() + " has more than " + Str(kMaxTensorElements) +
                             " elements");
      }
    }
    if (t.role() == proto::ROLE_GRAD || t.role() == proto::ROLE_OPTIMIZER_STATE) {
      if (t.param() < 0 || t.param() >= num_tensors ||
          program.tensors(t.param()).role() != proto::ROLE_PARAM) {
        return Status::Error("tensor " + t.name() + " does not name its param");
      }
    }
  }
  std::vector<int> producer(num_tensors, -1);
  std::vector<int> grad_producers(num_tensors, 0);
  proto::Phase last_phase = proto::PHASE_FORWARD;
  for (int i = 0; i < program.ops_size(); ++i) {
    const auto& op = program.ops(i);
    if (op.id() != i) return Status::Error("op " + op.name() + " has a wrong id");
    if (op.phase() < last_phase) return Status::Error("op " + op.name() + " is out of phase order");
    last_phase = op.phase();
    if (op.has_recompute_of()) {
      const int of = op.recompute_of();
      if (op.phase() != proto::PHASE_BACKWARD || of < 0 || of >= i ||
          program.ops(of).phase() != proto::PHASE_FORWARD || program.ops(of).kind() != op.kind()) {
        return Status::Error("op " + op.name() + " is a recompute of op " + std::to_string(of) +
                             ", which is not an earlier forward op of its kind");
      }
    }
    for (int in : op.inputs()) {
      if (in < 0 || in >= num_tensors)
        return Status::Error("op " + op.name() + " reads a bad tensor id");
      const auto& t = program.tensors(in);
      const bool external = t.role() == proto::ROLE_PARAM || t.role() == proto::ROLE_INPUT ||
                            t.role() == proto::ROLE_OPTIMIZER_STATE ||
                            (t.role() == proto::ROLE_GRAD && op.phase() == proto::PHASE_OPTIMIZER);
      if (!external && producer[in] < 0) {
        return Status::Error("op " + op.name() + " reads " + t.name() + " before it is produced");
      }
    }
    for (int out : op.outputs()) {
      if (out < 0 || out >= num_tensors)
        return Status::Error("op " + op.name() + " writes a bad tensor id");
      if (producer[out] >= 0) {
        return Status::Error("tensor " + program.tensors(out).name() + " is produced twice");
      }
      producer[out] = i;
      const auto& t = program.tensors(out);
      if (t.role() == proto::ROLE_GRAD) {
        if (op.phase() != proto::PHASE_BACKWARD) {
          return Status::Error("grad " + t.name() + " is produced outside backward");
        }
        ++grad_producers[out];
      }
      if (t.role() == proto::ROLE_PARAM || t.role() == proto::ROLE_INPUT) {
        return Status::Error("op " + op.name() + " writes " + t.name() + ", which it may not");
      }
    }
  }
  for (int i = 0; i < num_tensors; ++i) {
    if (program.tensors(i).role() == proto::ROLE_GRAD && grad_producers[i] != 1) {
      return Status::Error("grad " + program.tensors(i).name() +
                           " has no backward op producing it");
    }
  }
  return Status::Ok();
}

const char* BufferKindName(BufferKind kind) {
  switch (kind) {
    case BufferKind::kGathered:
      return "gathered";
    case BufferKind::kShard:
      return "shard";
    case BufferKind::kGrad:
      return "grad";
    case BufferKind::kGradShard:
      return "grad_shard";
    case BufferKind::kOptimizerState:
      return "optimizer_state";
    case BufferKind::kActivation:
      return "activation";
    case BufferKind::kInput:
      return "input";
  }
  return "?";
}

BufferKind TransientKind(const proto::Tensor& tensor) {
  switch (tensor.role()) {
    case proto::ROLE_PARAM:
      return BufferKind::kGathered;
    case proto::ROLE_GRAD:
      return BufferKind::kGrad;
    case proto::ROLE_INPUT:
      return BufferKind::kInput;
    case proto::ROLE_OPTIMIZER_STATE:
      return BufferKind::kOptimizerState;
    default:
      return BufferKind::kActivation;
  }
}

int64_t TransientBytes(const proto::Program& program, const proto::Tensor& tensor) {
  if (tensor.role() == proto::ROLE_PARAM) {
    return NumElements(tensor) * DTypeSizeBytes(program.config().compute_dtype());
  }
  return SizeBytes(tensor);
}

std::vector<int64_t> PersistentBytesByKind(const proto::Program& program, int world_size) {
  std::vector<int64_t> bytes(kNumBufferKinds, 0);
  for (const auto& t : program.tensors()) {
    if (!IsPersistentRole(t.role())) continue;
    bytes[static_cast<int>(PersistentKind(t.role()))] += ShardBytes(t, world_size);
  }
  return bytes;
}

namespace {

// One scan of the instructions: the params whose masters an OFFLOAD names, and the tensors the
// host optimizer ops keep on the host.
struct Residency {
  std::vector<bool> offloaded_params;
  std::vector<bool> host;
};

Residency ScanResidency(const proto::Schedule& schedule) {
  const proto::Program& program = schedule.program();
  const int num_tensors = program.tensors_size();
  Residency r{std::vector<bool>(num_tensors, false), std::vector<bool>(num_tensors, false)};
  for (const proto::Instruction& instr : schedule.instructions()) {
    if (instr.kind() == proto::INSTR_OFFLOAD) {
      for (int t : instr.tensors()) {
        if (t >= 0 && t < num_tensors && program.tensors(t).role() == proto::ROLE_PARAM) {
          r.offloaded_params[t] = true;
        }
      }
      continue;
    }
    if (instr.kind() != proto::INSTR_COMPUTE || instr.stream() != proto::STREAM_HOST) continue;
    if (instr.op() < 0 || instr.op() >= program.ops_size()) continue;
    const proto::Op& op = program.ops(instr.op());
    if (op.phase() != proto::PHASE_OPTIMIZER) continue;
    for (int t : op.inputs()) {
      if (t < 0 || t >= num_tensors) continue;
      const proto::Role role = program.tensors(t).role();
      if (role == proto::ROLE_PARAM || role == proto::ROLE_OPTIMIZER_STATE) r.host[t] = true;
    }
  }
  return r;
}

std::vector<bool> ComputeShardParamsOf(const proto::Program& program, const Residency& r) {
  std::vector<bool> has = r.offloaded_params;
  for (int t = 0; t < program.tensors_size(); ++t) {
    if (r.host[t] && program.tensors(t).role() == proto::ROLE_PARAM) has[t] = true;
  }
  return has;
}

}  // namespace

ScheduleResidency ResidencyOf(const proto::Schedule& schedule) {
  Residency r = ScanResidency(schedule);
  std::vector<bool> compute_shard = ComputeShardParamsOf(schedule.program(), r);
  return {std::move(r.host), std::move(compute_shard)};
}

std::vector<bool> HostResidentTensors(const proto::Schedule& schedule) {
  return ScanResidency(schedule).host;
}

std::vector<bool> ComputeShardParams(const proto::Schedule& schedule) {
  return ComputeShardParamsOf(schedule.program(), ScanResidency(schedule));
}

int64_t ComputeShardBytes(const proto::Program& program, const proto::Tensor& param,
                          int world_size) {
  return ShardElements(NumElements(param), world_size) *
         DTypeSizeBytes(program.config().compute_dtype());
}

std::vector<int64_t> PersistentBytesByKind(const proto::Schedule& schedule) {
  const proto::Program& program = schedule.program();
  const int world_size = std::max(1, schedule.world_size());
  std::vector<int64_t> bytes = PersistentBytesByKind(program, world_size);
  const ScheduleResidency residency = ResidencyOf(schedule);
  for (int t = 0; t < program.tensors_size(); ++t) {
    const proto::Tensor& tensor = program.tensors(t);
    if (residency.compute_shard[t]) {
      bytes[static_cast<int>(BufferKind::kShard)] += ComputeShardBytes(program, tensor, world_size);
    }
    if (residency.host_resident[t]) {  // host-resident tensors are params and optimizer states
      bytes[static_cast<int>(PersistentKind(tensor.role()))] -= ShardBytes(tensor, world_size);
    }
  }
  return bytes;
}

int64_t TokensPerStep(const proto::ModelConfig& config, int world_size) {
  return config.seq() * config.micro_batch() * config.gas() * world_size;
}

double LearningRate(const proto::ModelConfig& config, int64_t step) {
  const double peak = config.lr();
  const int64_t warmup = config.lr_warmup_steps();
  if (step < warmup) return peak * static_cast<double>(step + 1) / static_cast<double>(warmup);
  if (config.lr_decay() == proto::LR_DECAY_CONSTANT || config.lr_decay_steps() <= 0) return peak;
  const double progress = std::min(
      1.0, static_cast<double>(step - warmup) / static_cast<double>(config.lr_decay_steps()));
  const double floor = config.min_lr();
  if (progress >= 1.0) return floor;  // exactly: no rounding of peak - (peak - floor)
  if (config.lr_decay() == proto::LR_DECAY_LINEAR) return peak - progress * (peak - floor);
  return floor + 0.5 * (1.0 + std::cos(M_PI * progress)) * (peak - floor);
}

double LearningRateScale(const proto::ModelConfig& config, int64_t step) {
  return config.lr() > 0 ? LearningRate(config, step) / config.lr() : 1.0;
}

}  // namespace dc
