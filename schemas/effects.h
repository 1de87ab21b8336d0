// What each instruction does to device buffers, written once: which buffer it allocates, frees,
// renames, reads and writes, when (at its start or at its end), how large, and the checks that a
// schedule keeps them right, with their messages. The simulator, the memory plan, the live curve,
// the verifier and the backends' layouts use these rules and keep no switch of their own on the
// instruction kind for them.
//
// The accounting (schemas/program.h's BufferKind): persistent fp32 shards of params, grads and
// optimizer states from start-up (less the host-resident ones), with a compute-dtype shard beside
// every param whose master the schedule offloads or keeps on the host; a gathered param whole in
// the compute dtype from its all-gather to its release; an activation, grad or input of one
// micro-step from the compute that first writes (or, for an input, reads) it to its release.
//
// Per instruction kind:
//   ALL_GATHER      allocates each param's gathered buffer (at its start); the param must not be
//                   gathered already.
//   COMPUTE         reads its inputs (a param gathered; an optimizer-phase op, or any op reading
//                   an optimizer state, the persistent shard, on the device, or on the host for
//                   a host op; a transient live, an input allocated on first read) and allocates
//                   its outputs (an optimizer op updates persistent outputs in place).
//   RELEASE         frees gathered params and transients (at its start).
//   REDUCE_SCATTER  reads live grads into their shards on the device; allocates nothing.
//   OFFLOAD         frees persistent shards or transients (at its end) and keeps them on the host.
//   RELOAD          allocates them again (at its start) from the host.
//   RENAME          the op's outputs take over the live buffers named in `tensors`, one for one.
//   ALL_REDUCE      reads and writes live activations of its micro-step in place (the grads'
//                   squared norm); allocates nothing.
#pragma once

#include <compare>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "schemas/program.h"
#include "schemas/status.h"

namespace dc {

// Every persistent shard (param master, grad accumulator, optimizer state) is fp32.
inline constexpr int64_t kShardElementBytes = 4;
// A byte count that stands for "no limit" and still adds without overflow.
inline constexpr int64_t kUnlimitedBytes = std::numeric_limits<int64_t>::max() / 4;

// Params, grads and optimizer states: the roles with a persistent shard on every rank.
bool IsPersistentRole(proto::Role role);
// The BufferKind of a persistent shard of `role` (kShard, kGradShard, kOptimizerState).
BufferKind PersistentKind(proto::Role role);
// Bytes of one rank's persistent fp32 shard of `tensor`.
int64_t ShardBytes(const proto::Tensor& tensor, int world_size);

// Bytes an instruction moves over the network: an all-gather the whole params (compute dtype),
// a reduce-scatter the whole grads, an all-reduce its tensors; 0 for others. What the cost model
// prices and the traces record.
int64_t InstructionBytes(const proto::Program& program, const proto::Instruction& instruction);

// Bytes an offload or reload copies: the rank's fp32 shard of a param, grad or optimizer state
// (the persistent buffers), the whole buffer of anything else; 0 for other instructions.
int64_t CopyBytes(const proto::Program& program, int world_size,
                  const proto::Instruction& instruction);

// BufferPlacement::micro_step of a gathered param (schedule.proto); persistent shards and the
// optimizer phase use -1, compute-dtype shards kComputeShardMicroStep.
inline constexpr int kGatheredMicroStep = -2;

// Where a buffer of a tensor lives, and so how it is named.
enum class BufferSlot : uint8_t {
  kPersistent,    // the fp32 shard (param master, grad accumulator, optimizer state)
  kComputeShard,  // the compute-dtype shard beside an offloaded or host-kept master
  kGathered,      // the whole param, gathered
  kTransient,     // an activation, grad or input of one micro-step
};

// The one name of a device buffer, shared by the planner and both backends.
struct BufferKey {
  int tensor = -1;
  BufferSlot slot = BufferSlot::kTransient;
  int micro_step = -1;  // kTransient only (-1: the optimizer phase); -1 otherwise

  static BufferKey Persistent(int tensor) { return {tensor, BufferSlot::kPersistent, -1}; }
  static BufferKey ComputeShard(int tensor) { return {tensor, BufferSlot::kComputeShard, -1}; }
  static BufferKey Gathered(int tensor) { return {tensor, BufferSlot::kGathered, -1}; }
  static BufferKey Transient(int tensor, int micro_step) {
    return {tensor, BufferSlot::kTransient, micro_step};
  }
  // The buffer a compute outside the optimizer phase reads or writes for `tensor` of `role`: the
  // gathered copy of a param, else the micro-step's transient.
  static BufferKey OfOperand(int tensor, proto::Role role, int micro_step) {
    return role == proto::ROLE_PARAM ? Gathered(tensor) : Transient(tensor, micro_step);
  }
  // BufferPlacement::micro_step of this buffer in the memory plan.
  int placement_micro_step() const;

  auto operator<=>(const BufferKey&) const = default;
};

// Whether an instruction's buffer effects happen at its end (an offload frees what it copies once
// the copy is done) rather than at its start (everything else).
inline bool EffectsAtEnd(proto::InstrKind kind) { return kind == proto::INSTR_OFFLOAD; }

// "instruction 12 (release)": how the planner's checks name an instruction.
std::string InstructionWhere(int index, const proto::Instruction& instruction);

// The ids, references and sizes every reader of a schedule relies on: a valid kind and stream,
// a micro-step below the program's gas where set (and below 4096), deps on earlier
// instructions, op ids in range for computes and renames, tensor ids in range (instructions' and
// ops'), a rename's tensors activations of the sizes of its op's outputs, one for one; positive
// shapes, the program's tensors within 1 PiB, a world size within 2^24. Untrusted schedules (a
// plan file) are safe to simulate and replay once it passes.
Status CheckReferences(const proto::Schedule& schedule);

// The order a shard reduction's outputs need (schemas/program.h's IsShardReduction: the grads'
// squared norm): each is all-reduced by exactly one INSTR_ALL_REDUCE, which runs after the
// compute of the op that writes it, and every compute that reads it runs after the all-reduce.
// "After" is through deps or issue order on one stream (a stream runs its instructions in
// order). Call CheckReferences first. Cheap where the program has no shard reduction.
Status CheckShardReductions(const proto::Schedule& schedule);

// How an instruction uses the contents of a live buffer (BufferListener::Accessed).
enum class BufferAccess : uint8_t {
  kRead,   // reads them
  kWrite,  // writes them (an update in place, a sum into them, also reads them)
};

// What BufferReplay tells its listener. Handles number the allocations in the order they are
// made (start-up's first), so a listener can keep per-buffer records in a vector.
class BufferListener {
 public:
  virtual ~BufferListener() = default;
  // `instruction` is -1 for the persistent buffers made at start-up.
  virtual void Allocated(int instruction, const BufferKey& key, int64_t size_bytes, BufferKind kind,
                         bool at_end, int handle) = 0;
  virtual void Freed(int instruction, const BufferKey& key, int64_t size_bytes, BufferKind kind,
                     bool at_end, int handle) = 0;
  // The buffer `handle` goes on under `to` (a rename): no allocation, no free.
  virtual void Renamed(int /*instruction*/, const BufferKey& /*from*/, const BufferKey& /*to*/,
                       int /*handle*/) {}
  // Instruction `instruction` reads or writes the live buffer `handle` (told after its
  // Allocated, before its Freed, by the same instruction). Every use of every device buffer's
  // contents: a gather reads the param's shard (the compute-dtype one where there is one) and
  // writes the gathered param; a compute reads its inputs (an input it stages: writes, then
  // reads), writes its outputs (an optimizer op its persistent shards in place, and each param's
  // compute-dtype shard); a reduce-scatter reads the grad and writes its shard; an all-reduce
  // writes its tensors; an offload reads what it copies. Releases and renames use no contents.
  virtual void Accessed(int /*instruction*/, const BufferKey& /*key*/, BufferAccess /*access*/,
                        int /*handle*/) {}
};

// Tells `first`, then `second`, of every effect: one replay for two listeners (the simulator's
// memory events and the verifier's order check).
class BothListeners final : public BufferListener {
 public:
  BothListeners(BufferListener* first, BufferListener* second) : first_(first), second_(second) {}
  void Allocated(int instruction, const BufferKey& key, int64_t size_bytes, BufferKind kind,
                 bool at_end, int handle) override {
    first_->Allocated(instruction, key, size_bytes, kind, at_end, handle);
    second_->Allocated(instruction, key, size_bytes, kind, at_end, handle);
  }
  void Freed(int instruction, const BufferKey& key, int64_t size_bytes, BufferKind kind,
             bool at_end, int handle) override {
    first_->Freed(instruction, key, size_bytes, kind, at_end, handle);
    second_->Freed(instruction, key, size_bytes, kind, at_end, handle);
  }
  void Renamed(int instruction, const BufferKey& from, const BufferKey& to, int handle) override {
    first_->Renamed(instruction, from, to, handle);
    second_->Renamed(instruction, from, to, handle);
  }
  void Accessed(int instruction, const BufferKey& key, BufferAccess access, int handle) override {
    first_->Accessed(instruction, key, access, handle);
    second_->Accessed(instruction, key, access, handle);
  }

 private:
  BufferListener* first_;
  BufferListener* second_;
};

// Replays the buffer effects of a schedule's instructions in issue order, checking every use
// against what is live, and tells `listener` (optional) of every allocation and free. Errors
// name the instruction and the tensor. Call CheckReferences first: the replay trusts ids.
// Not thread-safe; one per replay.
class BufferReplay {
 public:
  BufferReplay(const proto::Schedule& schedule, BufferListener* listener);

  // The persistent buffers made at start-up (instruction -1): every persistent shard not kept on
  // the host, in tensor order, then the compute-dtype shards, in tensor order.
  void Start();
  // Instruction `index`'s effects; instructions must come in order, after Start.
  Status Apply(int index);
  // Start, then every instruction.
  Status Run();

 private:
  int& TransientHandle(int tensor, int micro_step) {
    return transient_[static_cast<size_t>(tensor) * stride_ + (micro_step + 1)];
  }
  void Open(int index, const BufferKey& key, int64_t bytes, BufferKind kind, int* handle);
  void Close(int index, const BufferKey& key, int64_t bytes, BufferKind kind, int* handle);
  bool AtEnd(int index) const;
  void Use(int index, const BufferKey& key, BufferAccess access, int handle);
  std::string Name(int tensor) const;

  Status Gather(int index, const proto::Instruction& instr);
  Status Compute(int index, const proto::Instruction& instr);
  Status ReadInput(int index, const proto::Instruction& instr, bool optimizer, int tensor);
  Status Release(int index, const proto::Instruction& instr);
  Status ReduceScatter(int index, const proto::Instruction& instr);
  Status Offload(int index, const proto::Instruction& instr);
  Status Reload(int index, const proto::Instruction& instr);
  Status Rename(int index, const proto::Instruction& instr);
  Status AllReduce(int index, const proto::Instruction& instr);

  const proto::Schedule& schedule_;
  const proto::Program& program_;
  BufferListener* listener_;
  const int world_;
  size_t stride_ = 1;
  std::vector<proto::Role> role_;
  std::vector<int64_t> transient_bytes_, shard_bytes_;
  std::vector<BufferKind> transient_kind_;
  std::vector<bool> host_resident_, compute_shard_;
  // Open buffers' handles (-1: none): persistent shards on the device, gathered params, and
  // transients by (tensor, micro-step); transients kept on the host by an offload.
  std::vector<int> persistent_, gathered_, transient_;
  std::vector<int> compute_shard_handle_;  // the compute-dtype shards' (-1: none)
  std::vector<uint8_t> transient_on_host_;
  int next_handle_ = 0;
};

}  // namespace dc
