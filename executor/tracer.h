// What the schedule interpreter tells a tracer, and nothing more: the executor's one face to the
// collectors. The cpu backend's HostTracer (collector/host_tracer.h) and the cuda backend's
// CUPTI tracer (collector/cupti/execution_tracer.h) implement it; the interpreter never knows
// which one it has. Header only, free of any collector, so the collectors depend on the executor's
// interface and not the other way round.
#pragma once

#include <cstdint>
#include <string>

#include "schemas/program.h"
#include "schemas/status.h"

namespace dc {

// Who a rank's trace belongs to.
struct RankIdentity {
  int rank = 0;
  int local_rank = 0;
  int world_size = 1;
  std::string hostname;
  std::string backend = "cpu";
  std::string device = "cpu";
  int64_t device_memory_bytes = 0;  // capacity given to the backend; 0 = unlimited
  // The cores the rank's process may run on (its affinity mask: the host's, shared with the other
  // ranks there) and its kernels' BLAS threads (the cpu backend); 0 = not known.
  int host_cores = 0;
  int threads_per_rank = 0;
};

// Where an activity belongs in the schedule.
struct InstructionRef {
  int step = 0;          // optimizer step, 0-based, counting warm-up steps
  int micro_step = -1;   // -1 in the optimizer phase
  int instruction = -1;  // index into Schedule.instructions
};

// What a schedule instruction is, as a trace shows it; told once per instruction at start-up.
struct TracedInstruction {
  proto::InstrKind kind = proto::INSTR_UNSPECIFIED;
  proto::Stream stream = proto::STREAM_UNSPECIFIED;
  std::string op_name;  // compute instructions: the op's name
  int micro_step = -1;
  // Collectives: the payload (the whole gathered params or grads); copies: the shards' bytes.
  int64_t bytes = 0;
  int tensors = 0;
  int bucket = -1;
};

// The facts of a schedule instruction for a trace, from the plan alone: one home for what the
// cpu and cuda traces say an instruction moved.
TracedInstruction TraceOf(const proto::Schedule& schedule, int index);

class ExecutionTracer {
 public:
  virtual ~ExecutionTracer() = default;

  // Nanoseconds since the session start on CLOCK_REALTIME: the trace's clock.
  virtual int64_t NowNs() const = 0;
  // Once per instruction, before the first step.
  virtual void DescribeInstruction(int index, const TracedInstruction& instruction) = 0;
  // Bracket the issue of one instruction (the device work it enqueues belongs to it). `start_ns`
  // and `end_ns` are NowNs() before Begin and after the issue. End returns the correlation id the
  // instruction's memory events are recorded under (0: none).
  virtual Status BeginInstruction(const InstructionRef& ref) = 0;
  virtual StatusOr<int64_t> EndInstruction(const InstructionRef& ref, int64_t start_ns,
                                           int64_t end_ns) = 0;
  // A device whose streams run an instruction's work after its issue, on threads of its own
  // (the cpu device), tells when that work ran, once the step's work is done (after
  // EndInstruction of `ref`): the trace shows these times for the instruction's activity
  // instead of the issue's. Devices whose tracer sees the work itself (CUPTI) never call it.
  virtual void InstructionRan(const InstructionRef& /*ref*/, int64_t /*start_ns*/,
                              int64_t /*end_ns*/) {}
  // An allocation (alloc = true) or free of `bytes` at `address` (a stable id of the buffer),
  // `name` the tensor; `correlation_id` the activity that caused it (0 at start-up).
  virtual void Memory(int64_t ts_ns, int64_t address, int64_t bytes, bool alloc,
                      const std::string& name, BufferKind kind, int64_t correlation_id) = 0;
  // An optimizer step as executed, times from NowNs().
  virtual void Step(int step, int64_t start_ns, int64_t end_ns, double loss, bool warmup) = 0;
  // A held-out evaluation after `step` optimizer steps (RunOptions::eval) with its loss, times
  // from NowNs(); its instructions are not traced one by one. A tracer may keep none.
  virtual void Evaluation(int64_t /*step*/, int64_t /*start_ns*/, int64_t /*end_ns*/,
                          double /*loss*/) {}
};

}  // namespace dc
