#include "collector/host_tracer.h"

#include <gtest/gtest.h>
#include <sqlite3.h>
#include <stdlib.h>
#include <time.h>

#include <filesystem>
#include <string>
#include <vector>

#include "schemas/digest.h"
#include "schemas/trace_schema.h"

namespace dc {
namespace {

namespace fs = std::filesystem;

class TempDir {
 public:
  TempDir() {
    std::string pattern = (fs::temp_directory_path() / "dc_collector_test_XXXXXX").string();
    path_ = mkdtemp(pattern.data());
  }
  ~TempDir() { fs::remove_all(path_); }
  std::string File(const std::string& name) const { return (fs::path(path_) / name).string(); }
  std::vector<std::string> Entries() const {
    std::vector<std::string> names;
    for (const auto& entry : fs::directory_iterator(path_)) {
      names.push_back(entry.path().filename().string());
    }
    std::sort(names.begin(), names.end());
    return names;
  }

 private:
  std::string path_;
};

// Read-only SQL access for the assertions.
class Db {
 public:
  explicit Db(const std::string& path) {
    EXPECT_EQ(sqlite3_open_v2(path.c_str(), &db_, SQLITE_OPEN_READONLY, nullptr), SQLITE_OK);
  }
  ~Db() { sqlite3_close(db_); }
  int64_t Int(const std::string& sql) const {
    sqlite3_stmt* stmt = nullptr;
    EXPECT_EQ(sqlite3_prepare_v2(db_, sql.c_str(), -1, &stmt, nullptr), SQLITE_OK) << sql;
    int64_t value = -1;
    if (stmt && sqlite3_step(stmt) == SQLITE_ROW) value = sqlite3_column_int64(stmt, 0);
    sqlite3_finalize(stmt);
    return value;
  }
  std::vector<std::string> Texts(const std::string& sql) const {
    sqlite3_stmt* stmt = nullptr;
    EXPECT_EQ(sqlite3_prepare_v2(db_, sql.c_str(), -1, &stmt, nullptr), SQLITE_OK) << sql;
    std::vector<std::string> values;
    while (stmt && sqlite3_step(stmt) == SQLITE_ROW) {
      const unsigned char* text = sqlite3_column_text(stmt, 0);
      values.push_back(text ? reinterpret_cast<const char*>(text) : "");
    }
    sqlite3_finalize(stmt);
    return values;
  }
  std::string Blob(const std::string& sql) const {
    sqlite3_stmt* stmt = nullptr;
    EXPECT_EQ(sqlite3_prepare_v2(db_, sql.c_str(), -1, &stmt, nullptr), SQLITE_OK) << sql;
    std::string bytes;
    if (stmt && sqlite3_step(stmt) == SQLITE_ROW) {
      bytes.assign(static_cast<const char*>(sqlite3_column_blob(stmt, 0)),
                   static_cast<size_t>(sqlite3_column_bytes(stmt, 0)));
    }
    sqlite3_finalize(stmt);
    return bytes;
  }

 private:
  sqlite3* db_ = nullptr;
};

proto::Schedule SmallSchedule() {
  proto::Schedule schedule;
  schedule.set_format_version(kScheduleFormatVersion);
  schedule.set_world_size(2);
  schedule.set_backend("cpu");
  proto::Program* program = schedule.mutable_program();
  program->set_format_version(kProgramFormatVersion);
  program->mutable_config()->set_compute_dtype(proto::DTYPE_F32);
  auto* w = program->add_tensors();
  w->set_id(0);
  w->set_name("w");
  w->add_shape(4);
  w->set_dtype(proto::DTYPE_F32);
  w->set_role(proto::ROLE_PARAM);
  auto* op = program->add_ops();
  op->set_id(0);
  op->set_name("matmul.0");
  op->set_kind("matmul");
  op->add_inputs(0);
  auto* gather = schedule.add_instructions();
  gather->set_kind(proto::INSTR_ALL_GATHER);
  gather->set_stream(proto::STREAM_GATHER);
  gather->add_tensors(0);
  auto* compute = schedule.add_instructions();
  compute->set_kind(proto::INSTR_COMPUTE);
  compute->set_stream(proto::STREAM_COMPUTE);
  compute->set_op(0);
  compute->add_deps(0);
  return schedule;
}

int64_t NowUtcNs() {
  timespec ts{};
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

// Each rank: 2 compute kernels, 1 all-gather, 1 reduce-scatter, 1 offload copy, 3 memory events
// and 2 steps (the first warm-up).
HostTracer RecordRank(int rank, int64_t session_start_ns) {
  RankIdentity identity;
  identity.rank = rank;
  identity.local_rank = rank;
  identity.world_size = 2;
  identity.hostname = "host";
  identity.device_memory_bytes = 1 << 20;
  HostTracer tracer(identity, session_start_ns);
  const int64_t t0 = 1000 * (rank + 1);
  const int64_t gather = tracer.Collective(proto::INSTR_ALL_GATHER, proto::STREAM_GATHER, t0,
                                           t0 + 50, 16, 1, 0, {0, 0, 0});
  tracer.Memory(t0, 7, 16, true, "w", BufferKind::kGathered, gather);
  tracer.Kernel("matmul.0", proto::STREAM_COMPUTE, t0 + 50, t0 + 150, {0, 0, 1});
  tracer.Kernel("matmul.0", proto::STREAM_COMPUTE, t0 + 150, t0 + 250, {1, 0, 1});
  tracer.Memory(t0 + 250, 7, 16, false, "w", BufferKind::kGathered, 0);
  tracer.Collective(proto::INSTR_REDUCE_SCATTER, proto::STREAM_REDUCE, t0 + 250, t0 + 300, 16, 1, 0,
                    {1, 0, 2});
  tracer.Copy(proto::INSTR_OFFLOAD, proto::STREAM_D2H, t0 + 300, t0 + 320, 8, {1, -1, 3});
  tracer.Memory(0, 9, 8, true, "w.shard", BufferKind::kShard, 0);  // a zero timestamp
  tracer.Step(0, t0, t0 + 150, 2.5, true);
  tracer.Step(1, t0 + 150, t0 + 320, 2.0, false);
  return tracer;
}

struct Merged {
  TempDir dir;
  std::string out;
  StatusOr<MergeSummary> summary = Status::Error("not merged");
};

void MergeTwoRanks(Merged* merged, const proto::Schedule& schedule) {
  const int64_t start = NowUtcNs();
  std::vector<std::string> paths;
  for (int rank = 0; rank < 2; ++rank) {
    HostTracer tracer = RecordRank(rank, start);
    EXPECT_EQ(tracer.activities(), 5);
    EXPECT_EQ(tracer.memory_events(), 3);
    paths.push_back(merged->dir.File("rank" + std::to_string(rank) + ".db"));
    ASSERT_TRUE(tracer.WriteRankFile(paths.back()).ok());
  }
  merged->out = merged->dir.File("trace.db");
  merged->summary = MergeRankTraces(paths, schedule, merged->out);
}

TEST(HostTracerTest, MergedTraceHasEveryRowOfBothRanks) {
  Merged merged;
  MergeTwoRanks(&merged, SmallSchedule());
  ASSERT_TRUE(merged.summary.ok()) << merged.summary.status().message();
  EXPECT_EQ(merged.summary->ranks, 2);
  EXPECT_EQ(merged.summary->activities, 10);
  EXPECT_EQ(merged.summary->memory_events, 6);
  EXPECT_EQ(merged.summary->dropped_records, 0);

  Db db(merged.out);
  EXPECT_EQ(db.Int("SELECT count(*) FROM CUPTI_ACTIVITY_KIND_KERNEL"), 8);
  EXPECT_EQ(db.Int("SELECT count(*) FROM TC_COLLECTIVE"), 4);
  EXPECT_EQ(db.Int("SELECT count(*) FROM CUPTI_ACTIVITY_KIND_MEMCPY"), 2);
  EXPECT_EQ(db.Int("SELECT count(*) FROM TC_INSTRUCTION_MAP"), 10);
  EXPECT_EQ(db.Int("SELECT count(*) FROM CUDA_GPU_MEMORY_USAGE_EVENTS"), 6);
  EXPECT_EQ(db.Int("SELECT count(*) FROM TC_STEP"), 4);
  EXPECT_EQ(db.Int("SELECT count(*) FROM TC_RANK"), 2);
  EXPECT_EQ(db.Int("SELECT count(*) FROM TC_CLOCK_ANCHOR"), 4);
  EXPECT_EQ(db.Int("SELECT count(*) FROM TARGET_INFO_GPU WHERE name = 'cpu'"), 2);
  EXPECT_EQ(db.Int("SELECT count(*) FROM TARGET_INFO_SESSION_START_TIME"), 1);
  EXPECT_EQ(db.Int("SELECT count(*) FROM TC_STREAM"), 6);  // every schedule stream, host's too
  EXPECT_EQ(db.Int("SELECT count(*) FROM ANALYSIS_DETAILS WHERE duration > 0"), 1);
  // Strings merged by value: each name once.
  EXPECT_EQ(db.Texts("SELECT value FROM StringIds ORDER BY value"),
            (std::vector<std::string>{"gloo:AllGather", "gloo:ReduceScatter", "matmul.0", "w",
                                      "w.shard"}));
  EXPECT_EQ(db.Int("SELECT count(*) FROM CUPTI_ACTIVITY_KIND_KERNEL k JOIN StringIds s "
                   "ON s.id = k.shortName WHERE s.value = 'matmul.0'"),
            4);
}

TEST(HostTracerTest, KernelTableHasNsysColumns) {
  Merged merged;
  MergeTwoRanks(&merged, SmallSchedule());
  ASSERT_TRUE(merged.summary.ok()) << merged.summary.status().message();
  Db db(merged.out);
  const std::vector<std::string> columns =
      db.Texts("SELECT name FROM pragma_table_info('CUPTI_ACTIVITY_KIND_KERNEL')");
  for (const char* want : {"start", "end", "deviceId", "contextId", "streamId", "correlationId",
                           "globalPid", "demangledName", "shortName", "gridX", "blockX"}) {
    EXPECT_NE(std::find(columns.begin(), columns.end(), want), columns.end()) << want;
  }
  // Compute kernels on the compute stream of device = local rank, context 1, grid/block 1.
  EXPECT_EQ(db.Int("SELECT count(*) FROM CUPTI_ACTIVITY_KIND_KERNEL WHERE streamId = 1 AND "
                   "contextId = 1 AND gridX = 1 AND blockZ = 1 AND registersPerThread = 0"),
            4);
  EXPECT_EQ(db.Int("SELECT count(DISTINCT deviceId) FROM CUPTI_ACTIVITY_KIND_KERNEL"), 2);
  // globalPid = rank << 48 | pid << 24.
  EXPECT_EQ(db.Int("SELECT count(*) FROM TC_RANK WHERE (globalPid >> 48) = rank AND "
                   "(globalPid >> 24) & 16777215 > 0 AND (globalPid & 16777215) = 0"),
            2);
  EXPECT_EQ(db.Int("SELECT count(DISTINCT k.globalPid) FROM CUPTI_ACTIVITY_KIND_KERNEL k "
                   "JOIN TC_RANK r ON r.globalPid = k.globalPid"),
            2);
}

TEST(HostTracerTest, CollectivesAreKernelsWithTheSameCorrelationId) {
  Merged merged;
  MergeTwoRanks(&merged, SmallSchedule());
  ASSERT_TRUE(merged.summary.ok()) << merged.summary.status().message();
  Db db(merged.out);
  EXPECT_EQ(db.Int("SELECT count(*) FROM TC_COLLECTIVE c JOIN CUPTI_ACTIVITY_KIND_KERNEL k "
                   "ON k.globalPid = c.globalPid AND k.correlationId = c.correlationId "
                   "JOIN StringIds s ON s.id = k.shortName WHERE c.kind = 'all_gather' AND "
                   "s.value = 'gloo:AllGather' AND k.start = c.start AND k.streamId = 2"),
            2);
  EXPECT_EQ(db.Int("SELECT count(*) FROM TC_COLLECTIVE c JOIN StringIds s JOIN "
                   "CUPTI_ACTIVITY_KIND_KERNEL k ON k.globalPid = c.globalPid AND "
                   "k.correlationId = c.correlationId AND s.id = k.shortName WHERE "
                   "c.kind = 'reduce_scatter' AND s.value = 'gloo:ReduceScatter' AND "
                   "c.bytes = 16"),
            2);
  EXPECT_EQ(db.Int("SELECT count(*) FROM TC_INSTRUCTION_MAP m JOIN TC_COLLECTIVE c ON "
                   "c.globalPid = m.globalPid AND c.correlationId = m.correlationId "
                   "WHERE m.kind = c.kind"),
            4);
  EXPECT_EQ(db.Int("SELECT count(*) FROM TC_INSTRUCTION_MAP WHERE kind = 'compute' AND "
                   "instruction = 1"),
            4);
}

TEST(HostTracerTest, EnumsUseNsysNumbering) {
  Merged merged;
  MergeTwoRanks(&merged, SmallSchedule());
  ASSERT_TRUE(merged.summary.ok()) << merged.summary.status().message();
  Db db(merged.out);
  EXPECT_EQ(db.Int("SELECT count(*) FROM CUDA_GPU_MEMORY_USAGE_EVENTS WHERE memKind = 2"), 6);
  EXPECT_EQ(db.Int("SELECT count(*) FROM CUDA_GPU_MEMORY_USAGE_EVENTS e JOIN "
                   "ENUM_CUDA_DEV_MEM_EVENT_OPER o ON o.id = e.memoryOperationType WHERE "
                   "o.label = 'Allocation' AND e.memoryOperationType = 0"),
            4);
  EXPECT_EQ(db.Int("SELECT count(*) FROM CUDA_GPU_MEMORY_USAGE_EVENTS WHERE "
                   "memoryOperationType = 1 AND name = 'w' AND tcKind = 'gathered'"),
            2);
  EXPECT_EQ(db.Int("SELECT count(*) FROM CUDA_GPU_MEMORY_USAGE_EVENTS WHERE tcKind = 'shard'"), 2);
  // Offload: device to pinned host.
  EXPECT_EQ(db.Int("SELECT count(*) FROM CUPTI_ACTIVITY_KIND_MEMCPY WHERE copyKind = 2 AND "
                   "srcKind = 2 AND dstKind = 1 AND bytes = 8 AND streamId = 5"),
            2);
}

TEST(HostTracerTest, RecordStatsCountRecordsAndZeroTimestamps) {
  Merged merged;
  MergeTwoRanks(&merged, SmallSchedule());
  ASSERT_TRUE(merged.summary.ok()) << merged.summary.status().message();
  Db db(merged.out);
  EXPECT_EQ(db.Int("SELECT SUM(records) FROM TC_RECORD_STATS WHERE kind = 'kernel'"), 4);
  EXPECT_EQ(db.Int("SELECT SUM(records) FROM TC_RECORD_STATS WHERE kind = 'collective'"), 4);
  EXPECT_EQ(db.Int("SELECT SUM(records) FROM TC_RECORD_STATS WHERE kind = 'memcpy'"), 2);
  EXPECT_EQ(db.Int("SELECT SUM(records) FROM TC_RECORD_STATS WHERE kind = 'memory'"), 6);
  EXPECT_EQ(db.Int("SELECT SUM(zeroTimestamp) FROM TC_RECORD_STATS WHERE kind = 'memory'"), 2);
  EXPECT_EQ(db.Int("SELECT SUM(zeroTimestamp) FROM TC_RECORD_STATS WHERE kind != 'memory'"), 0);
  EXPECT_EQ(db.Int("SELECT SUM(dropped) FROM TC_RECORD_STATS"), 0);
}

TEST(HostTracerTest, BlobsAndMetadataCarryDigests) {
  const proto::Schedule schedule = SmallSchedule();
  Merged merged;
  MergeTwoRanks(&merged, schedule);
  ASSERT_TRUE(merged.summary.ok()) << merged.summary.status().message();
  Db db(merged.out);
  EXPECT_EQ(db.Blob("SELECT data FROM TC_BLOB WHERE name = 'program'"),
            CanonicalBytes(schedule.program()));
  EXPECT_EQ(db.Blob("SELECT data FROM TC_BLOB WHERE name = 'schedule'"), CanonicalBytes(schedule));
  EXPECT_EQ(db.Texts("SELECT digest FROM TC_BLOB WHERE name = 'program'"),
            std::vector<std::string>{DigestOf(schedule.program())});
  EXPECT_EQ(db.Texts("SELECT digest FROM TC_BLOB WHERE name = 'schedule'"),
            std::vector<std::string>{DigestOf(schedule)});
  EXPECT_EQ(db.Int("SELECT formatVersion FROM TC_BLOB WHERE name = 'schedule'"),
            kScheduleFormatVersion);
  EXPECT_EQ(db.Texts("SELECT value FROM META_DATA_EXPORT WHERE name = 'producer'"),
            std::vector<std::string>{"dc"});
  EXPECT_EQ(db.Texts("SELECT value FROM META_DATA_EXPORT WHERE name = 'dc.trace_schema_version'"),
            std::vector<std::string>{std::to_string(kTraceSchemaVersion)});
  // Indexes are in place, the merge's own helper index is gone.
  EXPECT_EQ(db.Int("SELECT count(*) FROM sqlite_master WHERE type = 'index' AND name = "
                   "'ix_kernel_corr'"),
            1);
  EXPECT_EQ(db.Int("SELECT count(*) FROM sqlite_master WHERE name = 'dc_merge_string_value'"), 0);
}

TEST(HostTracerTest, MergeLeavesOnlyTheTrace) {
  Merged merged;
  MergeTwoRanks(&merged, SmallSchedule());
  ASSERT_TRUE(merged.summary.ok()) << merged.summary.status().message();
  EXPECT_EQ(merged.dir.Entries(), std::vector<std::string>{"trace.db"});
}

TEST(HostTracerTest, FailedMergeLeavesNoOutput) {
  TempDir dir;
  HostTracer tracer = RecordRank(0, NowUtcNs());
  const std::string rank0 = dir.File("rank0.db");
  ASSERT_TRUE(tracer.WriteRankFile(rank0).ok());
  const std::string out = dir.File("trace.db");
  StatusOr<MergeSummary> summary =
      MergeRankTraces({rank0, dir.File("rank1.db")}, SmallSchedule(), out);
  ASSERT_FALSE(summary.ok());
  EXPECT_NE(summary.status().message().find(out), std::string::npos) << summary.status().message();
  EXPECT_NE(summary.status().message().find("rank1.db is missing"), std::string::npos)
      << summary.status().message();
  // No output, no temp file; the rank file that was there is kept for a retry.
  EXPECT_EQ(dir.Entries(), std::vector<std::string>{"rank0.db"});
}

TEST(HostTracerTest, MergeRefusesARepeatedRank) {
  TempDir dir;
  const int64_t start = NowUtcNs();
  const std::string a = dir.File("a.db"), b = dir.File("b.db");
  ASSERT_TRUE(RecordRank(0, start).WriteRankFile(a).ok());
  ASSERT_TRUE(RecordRank(0, start).WriteRankFile(b).ok());
  StatusOr<MergeSummary> summary = MergeRankTraces({a, b}, SmallSchedule(), dir.File("t.db"));
  ASSERT_FALSE(summary.ok());
  EXPECT_NE(summary.status().message().find("repeats a rank"), std::string::npos);
  EXPECT_EQ(dir.Entries(), (std::vector<std::string>{"a.db", "b.db"}));
}

TEST(HostTracerTest, MergeRefusesAFileThatIsNotARankTrace) {
  TempDir dir;
  const std::string bogus = dir.File("bogus.db");
  FILE* f = fopen(bogus.c_str(), "w");
  ASSERT_NE(f, nullptr);
  fputs("hello", f);
  fclose(f);
  StatusOr<MergeSummary> summary = MergeRankTraces({bogus}, SmallSchedule(), dir.File("t.db"));
  ASSERT_FALSE(summary.ok());
  EXPECT_EQ(dir.Entries(), std::vector<std::string>{"bogus.db"});
}

}  // namespace
}  // namespace dc

namespace dc {
namespace {

RankIdentity StreamRank(int rank) {
  RankIdentity identity;
  identity.rank = rank;
  identity.local_rank = rank;
  identity.world_size = 2;
  identity.hostname = "host";
  return identity;
}

// One step of one rank: a gather, a kernel, an allocation, then the step's end.
void RecordStep(HostTracer& tracer, int step) {
  const int64_t t0 = 1000 * (step + 1);
  tracer.Collective(proto::INSTR_ALL_GATHER, proto::STREAM_GATHER, t0, t0 + 50, 16, 1, 0,
                    {step, 0, 0});
  tracer.Kernel("matmul.0", proto::STREAM_COMPUTE, t0 + 50, t0 + 150, {step, 0, 1});
  tracer.Memory(t0 + 60, 7, 16, true, "w", BufferKind::kGathered, 0);
  tracer.Step(step, t0, t0 + 200, 2.0, step == 0);
}

TEST(HostTracerStreamTest, EachEndedStepIsInTheFileBeforeTheRunEnds) {
  TempDir dir;
  const std::string part = dir.File("t.db.rank0.part");
  HostTracer tracer(StreamRank(0), NowUtcNs());
  const proto::Schedule schedule = SmallSchedule();
  ASSERT_TRUE(tracer.StreamTo(part, &schedule).ok());
  RecordStep(tracer, 0);
  RecordStep(tracer, 1);
  // Step 2 is under way: its kernel is held, not written.
  tracer.Kernel("matmul.0", proto::STREAM_COMPUTE, 5000, 5100, {2, 0, 1});
  {
    Db db(part);
    EXPECT_EQ(db.Int("SELECT count(*) FROM TC_STEP"), 2);
    EXPECT_EQ(db.Int("SELECT count(*) FROM CUPTI_ACTIVITY_KIND_KERNEL"), 4);  // 2 kernels + 2
    EXPECT_EQ(db.Int("SELECT count(*) FROM CUDA_GPU_MEMORY_USAGE_EVENTS"), 2);
    EXPECT_EQ(db.Int("SELECT count(*) FROM TC_RANK"), 1);
    EXPECT_EQ(db.Int("SELECT count(*) FROM TC_BLOB"), 2);  // mergeable without the plan
    EXPECT_EQ(db.Int("SELECT count(*) FROM TC_CLOCK_ANCHOR WHERE tag = 'end'"), 0);
  }
  // The run is killed here: the file as it stands merges into a trace of its complete steps.
  const std::string out = dir.File("t.db");
  auto merged = MergeRankTraces({part}, out, MergeOptions{});
  ASSERT_TRUE(merged.ok()) << merged.status().message();
  EXPECT_EQ(merged->last_step, 1);
  EXPECT_NE(merged->incomplete.find("did not finish"), std::string::npos) << merged->incomplete;
  Db db(out);
  EXPECT_EQ(db.Int("SELECT count(*) FROM TC_STEP"), 2);
  EXPECT_EQ(db.Texts("SELECT value FROM META_DATA_EXPORT WHERE name = 'dc.incomplete'").size(), 1u);
  EXPECT_EQ(db.Blob("SELECT data FROM TC_BLOB WHERE name = 'schedule'"), CanonicalBytes(schedule));
}

TEST(HostTracerStreamTest, AFinishedStreamIsTheSameTraceAsOneWrittenWhole) {
  TempDir dir;
  const int64_t start = NowUtcNs();
  HostTracer streamed(StreamRank(0), start), whole(StreamRank(0), start);
  ASSERT_TRUE(streamed.StreamTo(dir.File("streamed.part")).ok());
  for (HostTracer* tracer : {&streamed, &whole}) {
    RecordStep(*tracer, 0);
    RecordStep(*tracer, 1);
    tracer->Memory(9000, 7, 16, false, "w", BufferKind::kGathered, 0);  // after the last step
  }
  ASSERT_TRUE(streamed.WriteRankFile(dir.File("streamed.part")).ok());
  ASSERT_TRUE(whole.WriteRankFile(dir.File("whole.part")).ok());
  EXPECT_FALSE(fs::exists(dir.File("streamed.part-wal")));  // folded in: one file
  for (const char* sql :
       {"SELECT count(*) FROM CUPTI_ACTIVITY_KIND_KERNEL", "SELECT count(*) FROM TC_STEP",
        "SELECT count(*) FROM CUDA_GPU_MEMORY_USAGE_EVENTS", "SELECT count(*) FROM StringIds",
        "SELECT sum(records) FROM TC_RECORD_STATS", "SELECT sum(start) FROM TC_COLLECTIVE"}) {
    EXPECT_EQ(Db(dir.File("streamed.part")).Int(sql), Db(dir.File("whole.part")).Int(sql)) << sql;
  }
  EXPECT_EQ(Db(dir.File("streamed.part")).Int("SELECT sum(records) FROM TC_RECORD_STATS"), 7);
}

TEST(HostTracerStreamTest, AnIncompleteMergeKeepsTheStepsEveryRankCompleted) {
  TempDir dir;
  const int64_t start = NowUtcNs();
  std::vector<std::string> parts;
  for (int rank = 0; rank < 2; ++rank) {
    parts.push_back(dir.File("t.db.rank" + std::to_string(rank) + ".part"));
    HostTracer tracer(StreamRank(rank), start);
    ASSERT_TRUE(tracer.StreamTo(parts.back(), nullptr).ok());
    for (int step = 0; step < (rank == 0 ? 3 : 2); ++step) RecordStep(tracer, step);
    ASSERT_TRUE(tracer.WriteRankFile(parts.back()).ok());
  }
  MergeOptions options;
  options.incomplete = "stopped by SIGTERM after 2 of 10 step(s)";
  const std::string out = dir.File("t.db");
  auto merged = MergeRankTraces(parts, SmallSchedule(), out, options);
  ASSERT_TRUE(merged.ok()) << merged.status().message();
  EXPECT_EQ(merged->last_step, 1);
  Db db(out);
  EXPECT_EQ(db.Int("SELECT max(step) FROM TC_STEP"), 1);
  EXPECT_EQ(db.Int("SELECT count(*) FROM TC_STEP"), 4);
  // Rank 0's third step is gone, records and all.
  EXPECT_EQ(db.Int("SELECT count(*) FROM CUPTI_ACTIVITY_KIND_KERNEL"), 8);
  EXPECT_EQ(db.Int("SELECT count(*) FROM TC_COLLECTIVE"), 4);
  EXPECT_EQ(db.Int("SELECT count(*) FROM CUDA_GPU_MEMORY_USAGE_EVENTS"), 4);
  EXPECT_EQ(db.Int("SELECT max(step) FROM TC_INSTRUCTION_MAP"), 1);
  EXPECT_EQ(db.Texts("SELECT value FROM META_DATA_EXPORT WHERE name = 'dc.incomplete'"),
            std::vector<std::string>{options.incomplete});
  for (const std::string& part : parts) EXPECT_FALSE(fs::exists(part)) << part;
}

TEST(HostTracerStreamTest, NoStepCompletedByEveryRankIsAClearError) {
  TempDir dir;
  const int64_t start = NowUtcNs();
  std::vector<std::string> parts;
  for (int rank = 0; rank < 2; ++rank) {
    parts.push_back(dir.File("rank" + std::to_string(rank) + ".part"));
    HostTracer tracer(StreamRank(rank), start);
    ASSERT_TRUE(tracer.StreamTo(parts.back(), nullptr).ok());
    if (rank == 0) RecordStep(tracer, 0);
  }
  MergeOptions options;
  options.incomplete = "stopped";
  auto merged = MergeRankTraces(parts, SmallSchedule(), dir.File("t.db"), options);
  ASSERT_FALSE(merged.ok());
  EXPECT_NE(merged.status().message().find("no step was completed by every rank"),
            std::string::npos)
      << merged.status().message();
  EXPECT_FALSE(fs::exists(dir.File("t.db")));
  // A part without the schedule cannot be merged on its own, and says so.
  auto alone = MergeRankTraces({parts[1]}, dir.File("u.db"), MergeOptions{});
  ASSERT_FALSE(alone.ok());
  EXPECT_NE(alone.status().message().find("does not carry the schedule"), std::string::npos)
      << alone.status().message();
}

}  // namespace
}  // namespace dc
