// The C++ face of the program and schedule formats: the generated protobuf types plus the
// facts every stage needs about them (sizes, shards, roles, versions, validation).
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "schemas/program.pb.h"
#include "schemas/schedule.pb.h"
#include "schemas/status.h"

namespace dc {

// Format versions written by this build; readers refuse newer ones, and plan files of an older
// version (schemas/plan_file.h). Version 2: a recompute op says so in Op.recompute_of (version 1
// marked it only by its name).
inline constexpr uint32_t kProgramFormatVersion = 2;
inline constexpr uint32_t kScheduleFormatVersion = 2;

int64_t DTypeSizeBytes(proto::DType dtype);
const char* DTypeName(proto::DType dtype);
const char* RoleName(proto::Role role);
const char* PhaseName(proto::Phase phase);
const char* InstrKindName(proto::InstrKind kind);
// All-gather, reduce-scatter and all-reduce: the kinds that talk to the other ranks.
bool IsCollective(proto::InstrKind kind);
const char* StreamName(proto::Stream stream);

int64_t NumElements(const proto::Tensor& tensor);
// Bytes of the whole tensor in its own dtype.
int64_t SizeBytes(const proto::Tensor& tensor);

// Even sharding over `world_size` ranks: every param is flattened and padded to a multiple of
// the world size; rank r owns elements [r * shard, (r + 1) * shard).
int64_t ShardElements(int64_t num_elements, int world_size);

// Attribute lookup on an op; `fallback` when absent.
int64_t AttrInt(const proto::Op& op, const std::string& name, int64_t fallback);
double AttrFloat(const proto::Op& op, const std::string& name, double fallback);
void SetAttr(proto::Op* op, const std::string& name, int64_t value);
void SetAttrFloat(proto::Op* op, const std::string& name, double value);

// Optimizer-phase ops are of two sorts. A shard reduction writes an activation: the rank's
// partial over its shards (grad_norm_squared); the schedule all-reduces each such output
// (INSTR_ALL_REDUCE) before any op reads it, and it runs on the device. A step is any other
// optimizer op: it updates the rank's shards in place (adamw), and the host optimizer may run it.
inline bool IsShardReduction(const proto::Program& program, const proto::Op& op) {
  if (op.phase() != proto::PHASE_OPTIMIZER) return false;
  for (int t : op.outputs()) {
    if (t >= 0 && t < program.tensors_size() &&
        program.tensors(t).role() == proto::ROLE_ACTIVATION) {
      return true;
    }
  }
  return false;
}
inline bool IsOptimizerStep(const proto::Program& program, const proto::Op& op) {
  return op.phase() == proto::PHASE_OPTIMIZER && !IsShardReduction(program, op);
}

// The model families a config names (ModelConfig.family).
inline constexpr char kFamilyLlama[] = "llama";      // dense
inline constexpr char kFamilyMixtral[] = "mixtral";  // mixture-of-experts MLP
// Every size in a config (layers, hidden, vocab, seq, seq * micro_batch, ...) is at most this, so
// that products of two of them fit int64; and a vocabulary has at least two tokens (with one,
// every target is that token and the loss is 0 from the first step).
inline constexpr int64_t kMaxConfigDimension = std::numeric_limits<int32_t>::max();
inline constexpr int64_t kMinVocab = 2;

// Checks a model config (built from flags or read back from a plan): sizes in range and
// consistent, a float compute dtype, finite and sane optimizer settings. Messages name the
// command-line flag.
Status ValidateConfig(const proto::ModelConfig& config);

// The most elements a program's tensor may have (2^48: 1 PiB of fp32), so that byte counts and
// their sums over a program fit int64.
inline constexpr int64_t kMaxTensorElements = int64_t{1} << 48;

// Checks ids, references and the invariants the rewriter relies on (sizes under
// kMaxTensorElements, ops in phase order, every tensor produced at most once, every grad produced
// by exactly one backward op, every input of an op produced earlier or a param / input /
// optimizer state, a recompute a backward op naming a forward op of its kind). The message names
// the tensor or op.
Status ValidateProgram(const proto::Program& program);

// Device buffers, one accounting shared by the executor (which enforces a capacity) and the
// simulator (which predicts the peak), so predicted and measured bytes mean the same thing.
// Persistent for the whole run, per rank: fp32 param shards, fp32 grad-shard accumulators and
// the fp32 optimizer-state shards. Transient: a gathered param (whole, compute dtype) from its
// all-gather to its release; an activation, grad or input from the compute that first writes or
// reads it to its release.
enum class BufferKind {
  kGathered,
  kShard,
  kGrad,
  kGradShard,
  kOptimizerState,
  kActivation,
  kInput
};
inline constexpr int kNumBufferKinds = 7;
const char* BufferKindName(BufferKind kind);
BufferKind TransientKind(const proto::Tensor& tensor);
int64_t TransientBytes(const proto::Program& program, const proto::Tensor& tensor);
// Bytes of the persistent buffers of one rank, by kind (index = BufferKind).
std::vector<int64_t> PersistentBytesByKind(const proto::Program& program, int world_size);

// Tensors that live in host memory for the whole run, never on the device: the optimizer states
// and fp32 master of every param whose optimizer op the schedule runs on the host (an
// optimizer-phase COMPUTE on STREAM_HOST: ZeRO-Offload's CPU Adam). By tensor id.
std::vector<bool> HostResidentTensors(const proto::Schedule& schedule);

// A param whose fp32 master shard a schedule offloads (or keeps on the host) keeps its shard in the
// compute dtype on the device as well (the param partition ZeRO-3 keeps beside an offloaded
// master): its gathers read that copy, so they never wait for the master. The copy is persistent
// (made at start-up, kind kShard) and refreshed by the param's optimizer op; the memory plan places
// it under micro-step kComputeShardMicroStep. By tensor id: whether the schedule offloads the
// tensor's master (a ROLE_PARAM tensor named by an OFFLOAD instruction) or keeps it on the host
// (HostResidentTensors); a host optimizer op writes the copy from the host.
std::vector<bool> ComputeShardParams(const proto::Schedule& schedule);
// Both of the above from one scan of the instructions, by tensor id.
struct ScheduleResidency {
  std::vector<bool> host_resident;  // HostResidentTensors
  std::vector<bool> compute_shard;  // ComputeShardParams
};
ScheduleResidency ResidencyOf(const proto::Schedule& schedule);
inline constexpr int kComputeShardMicroStep = -3;
// Bytes of one rank's compute-dtype shard of `param`.
int64_t ComputeShardBytes(const proto::Program& program, const proto::Tensor& param,
                          int world_size);
// PersistentBytesByKind of the schedule's program plus its compute-dtype shards, less its
// host-resident tensors.
std::vector<int64_t> PersistentBytesByKind(const proto::Schedule& schedule);

// Tokens processed by all ranks in one optimizer step.
int64_t TokensPerStep(const proto::ModelConfig& config, int world_size);

// The learning rate of optimizer step `step` (0-based, absolute: a resumed run goes on with
// it): lr * (step + 1) / lr_warmup_steps during the warm-up, then the decay from lr to min_lr
// over lr_decay_steps, then min_lr (ModelConfig's fields).
double LearningRate(const proto::ModelConfig& config, int64_t step);
// LearningRate / lr: what the AdamW ops' lr attr (the peak) is scaled by in step `step`; 1
// where lr is 0.
double LearningRateScale(const proto::ModelConfig& config, int64_t step);

}  // namespace dc
