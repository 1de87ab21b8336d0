// Reading traces: dc's own (every table of schemas/trace_schema.sql) and real Nsight Systems
// SQLite exports of any version since 2022 (tables and columns found by name; missing optional
// tables noted, not fatal). Reads stream through SQLite; nothing loads a whole table at once
// unless asked to. The file is opened read-only. A Trace is not thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "analyzer/limits.h"
#include "schemas/program.h"
#include "schemas/status.h"

struct sqlite3;

namespace dc {

enum class TraceSource { kDc, kNsys };

struct TraceRank {
  int64_t global_pid = 0;
  int rank = 0;
  int world_size = 1;
  std::string backend, device, hostname;
  int64_t device_memory_bytes = 0;
  // The cores the rank's process could run on (shared with the other ranks of its host) and its
  // BLAS threads; 0: not recorded (GPU ranks, nsys exports, traces before dc recorded them).
  int host_cores = 0;
  int threads_per_rank = 0;
};

// One device activity: a kernel, a memcpy, a memset or (dc traces) a collective.
struct Activity {
  enum class Type { kKernel, kMemcpy, kMemset, kCollective };
  Type type = Type::kKernel;
  int64_t global_pid = 0;
  int64_t device_id = 0;
  int64_t stream_id = 0;
  int64_t start_ns = 0, end_ns = 0;
  int64_t correlation_id = 0;
  int64_t bytes = 0;  // memcpy / memset / collective
  // Kernel name (shortName), collective kind ("all_gather"), "[CUDA memcpy Host-to-Device]",
  // "[CUDA memset]".
  std::string name;
  bool communication = false;  // a collective, or an NCCL kernel recognized by name
};

struct MemoryEvent {
  int64_t global_pid = 0, device_id = 0;
  int64_t ts_ns = 0;
  int64_t address = 0;
  int64_t bytes = 0;
  bool alloc = true;
  std::string name, kind;  // kind: a BufferKindName for dc traces, the memKind label for nsys
  int64_t correlation_id = 0;
};

class Trace {
 public:
  // Opens and checks `path`: exists, non-empty, a SQLite database, a dc trace (schema version
  // not newer than this build, TC_BLOB digests match, ranks distinct) or an nsys export, with at
  // least one usable kernel row. Rows that break analyzer/limits.h's rules (NULL or non-integer
  // times, ids or bytes; end before start; times, bytes or ids out of range) are left out of
  // every read and counted in skipped(). Errors name the file and say what to do.
  static StatusOr<std::unique_ptr<Trace>> Open(const std::string& path);
  ~Trace();

  const std::string& path() const { return path_; }
  TraceSource source() const { return source_; }
  const std::vector<TraceRank>& ranks() const { return ranks_; }
  // Present for dc traces: the program and schedule the trace was taken under.
  const std::optional<proto::Program>& program() const { return program_; }
  const std::optional<proto::Schedule>& schedule() const { return schedule_; }
  std::string program_digest() const;
  // Notes for the user (e.g. "no CUDA_GPU_MEMORY_USAGE_EVENTS table: no memory timeline").
  const std::vector<std::string>& notes() const { return notes_; }
  // Rows left out, by table and problem (in table order, then problem).
  const std::vector<SkippedRecords>& skipped() const { return skipped_; }
  // Why the run stopped before its last step (META_DATA_EXPORT's dc.incomplete: the trace holds
  // the steps every rank completed); empty for a run that did all its steps.
  const std::string& incomplete() const { return incomplete_; }

  // Streams every activity ordered by (global_pid, start). A dc collective comes once, as
  // kCollective (its kernel row is folded into it).
  Status ForEachActivity(const std::function<void(const Activity&)>& fn) const;
  Status ForEachMemoryEvent(const std::function<void(const MemoryEvent&)>& fn) const;

  struct InstructionSample {
    int64_t global_pid = 0;
    int step = 0, micro_step = 0, instruction = 0;
    int64_t start_ns = 0, end_ns = 0;
    int64_t bytes = 0;  // collectives
  };
  // dc traces only: every activity joined with its schedule instruction (TC_INSTRUCTION_MAP).
  Status ForEachInstructionSample(const std::function<void(const InstructionSample&)>& fn) const;

  // dc traces: an activity's (step, instruction) by (global_pid, correlation id), from
  // TC_INSTRUCTION_MAP, one lookup at a time on the trace's own connection (usable while
  // ForEachActivity streams).
  class InstructionLookup {
   public:
    virtual ~InstructionLookup() = default;
    virtual StatusOr<std::optional<std::pair<int, int>>> Find(int64_t global_pid,
                                                              int64_t correlation_id) = 0;
  };
  StatusOr<std::unique_ptr<InstructionLookup>> LookupInstructions() const;
  // Stream names by stream id (TC_STREAM; empty for nsys exports).
  const std::map<int64_t, std::string>& stream_names() const { return stream_names_; }

  struct StepRow {
    int64_t global_pid = 0;
    int step = 0;
    int64_t start_ns = 0, end_ns = 0;
    double loss = 0;
    bool warmup = false;
  };
  // Ordered by (global_pid, step). dc traces; empty for nsys.
  const std::vector<StepRow>& Steps() const { return steps_; }
  // Records the collector counted as dropped (TC_RECORD_STATS); 0 for nsys exports.
  int64_t DroppedRecords() const { return dropped_records_; }

 private:
  Trace() = default;
  Status Load();
  Status LoadDc(const std::set<std::string>& tables);
  Status LoadDcBlobs();
  bool IsAttachCapture() const;
  Status LoadNsys(const std::set<std::string>& tables);
  Status LoadNsysRanks(const std::set<std::string>& tables);
  Status BuildQueries(const std::set<std::string>& tables);
  // Counts the rows of `table` for which `problem_sql` (a CASE naming the broken rule) is not
  // NULL into skipped_; returns the number of rows left.
  StatusOr<int64_t> CountSkipped(const std::string& table, const std::string& alias,
                                 const std::string& problem_sql);
  Status CheckKernelNames(const std::set<std::string>& tables);

  std::string path_;
  TraceSource source_ = TraceSource::kDc;
  sqlite3* db_ = nullptr;
  std::vector<TraceRank> ranks_;
  std::optional<proto::Program> program_;
  std::optional<proto::Schedule> schedule_;
  std::vector<std::string> notes_;
  std::string incomplete_;
  std::vector<SkippedRecords> skipped_;
  std::vector<StepRow> steps_;
  int64_t dropped_records_ = 0;
  std::map<int64_t, std::string> stream_names_;
  // Built at Open from the columns the file has.
  std::string activity_sql_, memory_sql_, samples_sql_, lookup_sql_;
  // The ranks' globalPids as SQL, where rows of other processes can exist (dc traces, nsys
  // exports with MPI_RANKS); empty where every process with activity is a rank.
  std::string owners_sql_;
};

}  // namespace dc
