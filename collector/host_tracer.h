// The CPU backend's host tracer: one per rank. It records every executed instruction as an
// activity (compute ops as kernels on the rank's `cpu` device, collectives with their bytes,
// every allocation and free as a memory event, each mapped to its schedule instruction) into
// that rank's own SQLite file: streamed step by step (StreamTo), or all at the end
// (WriteRankFile alone). MergeRankTraces then joins the ranks' files into the run's one trace.
// Not thread-safe: one thread per tracer.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "executor/tracer.h"
#include "schemas/program.h"
#include "schemas/status.h"

namespace dc {

class HostTracer : public ExecutionTracer {
 public:
  // `session_start_utc_ns`: the run's common time origin (rank 0's CLOCK_REALTIME at start,
  // shared with every rank), so all ranks' timestamps are on one clock.
  HostTracer(RankIdentity identity, int64_t session_start_utc_ns);
  ~HostTracer() override;
  HostTracer(HostTracer&&) noexcept;
  HostTracer& operator=(HostTracer&&) noexcept;

  // Nanoseconds since the session start on CLOCK_REALTIME.
  int64_t NowNs() const override;

  // The interpreter's face (executor/tracer.h): each ended instruction is recorded as the
  // activity its kind makes (a kernel, a collective or a copy, below) from start_ns to end_ns.
  void DescribeInstruction(int index, const TracedInstruction& instruction) override;
  Status BeginInstruction(const InstructionRef& ref) override;
  StatusOr<int64_t> EndInstruction(const InstructionRef& ref, int64_t start_ns,
                                   int64_t end_ns) override;
  // Moves the activity EndInstruction recorded for `ref` (the latest of its instruction, in the
  // same step) to the times its work ran.
  void InstructionRan(const InstructionRef& ref, int64_t start_ns, int64_t end_ns) override;

  // Each returns the activity's correlation id (unique within the rank).
  int64_t Kernel(const std::string& name, proto::Stream stream, int64_t start_ns, int64_t end_ns,
                 const InstructionRef& ref);
  // A collective (INSTR_ALL_GATHER, INSTR_REDUCE_SCATTER or INSTR_ALL_REDUCE) moving `bytes` (the
  // whole gathered params or the whole grads, as InstructionBytes counts them). Recorded twice
  // under one correlation id: in TC_COLLECTIVE with its bytes, and as a kernel named as NCCL would
  // name it ("gloo:AllGather") so nsys-literate SQL sees it on its stream.
  int64_t Collective(proto::InstrKind kind, proto::Stream stream, int64_t start_ns, int64_t end_ns,
                     int64_t bytes, int num_tensors, int bucket, const InstructionRef& ref);
  // A host <-> device copy of `bytes`: INSTR_OFFLOAD (device to pinned host) or INSTR_RELOAD
  // (pinned host to device), as a CUPTI_ACTIVITY_KIND_MEMCPY row.
  int64_t Copy(proto::InstrKind kind, proto::Stream stream, int64_t start_ns, int64_t end_ns,
               int64_t bytes, const InstructionRef& ref);
  // An allocation (alloc = true) or free of `bytes` at `address` (a stable id of the buffer),
  // `name` the tensor, `kind` a BufferKindName; `correlation_id` the activity that caused it
  // (0 when none, e.g. persistent buffers made at start-up).
  void Memory(int64_t ts_ns, int64_t address, int64_t bytes, bool alloc, const std::string& name,
              BufferKind kind, int64_t correlation_id) override;
  void Step(int step, int64_t start_ns, int64_t end_ns, double loss, bool warmup) override;
  void Evaluation(int64_t step, int64_t start_ns, int64_t end_ns, double loss) override;

  int64_t global_pid() const { return global_pid_; }
  int64_t activities() const;  // kernels + collectives + copies
  int64_t memory_events() const;

  // From now on, writes this rank's records to a fresh SQLite file at `path` (WAL) as they come:
  // the rank's own rows at once, then each step's records and its TC_STEP row in one transaction
  // when the step ends. A run killed mid-way leaves a file of its complete steps, which
  // MergeRankTraces can still join (marked incomplete); memory holds one step's records. An error
  // writing a step stops the streaming and is returned by WriteRankFile.
  // `schedule`, when given, is written into the file as TC_BLOB rows, so the file can be merged
  // without the plan.
  Status StreamTo(const std::string& path, const proto::Schedule* schedule = nullptr);

  // Finishes this rank's file at `path` (with TC_RANK, clock anchors, record stats, stream names;
  // the schema of schemas/trace_schema.sql): the one StreamTo writes, or a fresh file written
  // whole (temporary file, then renamed) when the tracer was not streaming.
  Status WriteRankFile(const std::string& path);

 private:
  struct Records;
  struct Stream;
  // Writes and forgets the records held (and the strings not yet written), in one transaction.
  Status Flush();
  RankIdentity identity_;
  int64_t session_start_utc_ns_;
  int64_t global_pid_;  // (rank << 48) | (pid << 24), nsys's packing
  std::unique_ptr<Records> records_;
  std::vector<TracedInstruction> described_;  // by instruction index
  // By instruction index: the step and the records of its latest EndInstruction.
  struct Recorded {
    int step = -1;
    size_t kernels_begin = 0, kernels_end = 0, collectives_begin = 0, collectives_end = 0,
           copies_begin = 0, copies_end = 0;
  };
  std::vector<Recorded> recorded_;
  std::unique_ptr<Stream> stream_;  // set by StreamTo
};

struct MergeSummary {
  int ranks = 0;
  int64_t activities = 0;  // kernels + collectives over all ranks
  int64_t memory_events = 0;
  int64_t dropped_records = 0;
  std::string incomplete;  // MergeOptions::incomplete
  int64_t last_step = -1;  // the last step in the trace (with `incomplete`: every rank's last)
};

struct MergeOptions {
  // Why the run ended before its last step ("stopped by SIGINT after step 3 of 10"); empty for a
  // run that did all its steps. When set, the rank files may end at different steps: every rank
  // is cut to the last step all of them completed, and the trace says it is incomplete
  // (META_DATA_EXPORT's dc.incomplete, read back as Trace::incomplete()).
  std::string incomplete;
};

// Joins the rank files into `out_path` (written to a temp file and renamed), adds the program
// and schedule as TC_BLOB rows with their digests and format versions, metadata
// (META_DATA_EXPORT: producer, trace schema version), ANALYSIS_DETAILS and indexes, then
// deletes the rank files. Strings are merged by value. On any error nothing is left at
// `out_path` (nor its temp file, even when a stop signal ends the process mid-merge), the rank
// files are left untouched for the caller to keep or remove, and the message names `out_path`.
StatusOr<MergeSummary> MergeRankTraces(const std::vector<std::string>& rank_paths,
                                       const proto::Schedule& schedule, const std::string& out_path,
                                       const MergeOptions& options = {});
// The same with the schedule the rank files carry (a streamed file has it from its start): how
// the rank files a killed run left behind become a trace (dc-trace merge).
StatusOr<MergeSummary> MergeRankTraces(const std::vector<std::string>& rank_paths,
                                       const std::string& out_path, const MergeOptions& options);

}  // namespace dc
