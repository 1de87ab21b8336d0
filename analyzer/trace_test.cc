#include "analyzer/trace.h"

#include <gtest/gtest.h>
#include <sqlite3.h>

#include <filesystem>
#include <fstream>
#include <map>

#include "analyzer/profile.h"
#include "machine/intervals.h"
#include "schemas/digest.h"
#include "tests/support/test_traces.h"

namespace dc {
namespace {

using testing::ExecSql;
using testing::TempDir;

const std::string kNsysSaxpy = DC_SOURCE_DIR "/../shared/data/nsys/saxpy-mpi-cuda.sqlite";

void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out << bytes;
}

std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Opening `path` fails with exactly one line that names the file and contains `want`.
void ExpectOpenError(const std::string& path, const std::string& want) {
  StatusOr<std::unique_ptr<Trace>> trace = Trace::Open(path);
  ASSERT_FALSE(trace.ok()) << path << " opened";
  const std::string message = trace.status().message();
  EXPECT_EQ(message.rfind(path + ": ", 0), 0u) << message;
  EXPECT_NE(message.find(want), std::string::npos) << message;
  EXPECT_EQ(message.find('\n'), std::string::npos) << message;
}

TEST(TraceOpenTest, MissingFile) {
  TempDir dir;
  ExpectOpenError(dir.File("trace.db"), "cannot open (No such file or directory)");
}

TEST(TraceOpenTest, EmptyFile) {
  TempDir dir;
  WriteBytes(dir.File("trace.db"), "");
  ExpectOpenError(dir.File("trace.db"), "empty file (0 bytes)");
}

TEST(TraceOpenTest, TextFile) {
  TempDir dir;
  WriteBytes(dir.File("trace.db"), "hello");
  ExpectOpenError(dir.File("trace.db"), "not a SQLite database");
}

TEST(TraceOpenTest, TruncatedDcTrace) {
  TempDir dir;
  const std::string trace = testing::WriteProfileTrace(dir);
  ASSERT_FALSE(trace.empty());
  WriteBytes(dir.File("cut.db"), ReadBytes(trace).substr(0, 1024));
  ExpectOpenError(dir.File("cut.db"),
                  "truncated or corrupt SQLite file (database disk image is malformed); "
                  "re-record it with dc-collect");
}

TEST(TraceOpenTest, TruncatedNsysExport) {
  if (!std::filesystem::exists(kNsysSaxpy)) GTEST_SKIP() << kNsysSaxpy << " is absent";
  TempDir dir;
  WriteBytes(dir.File("cut.sqlite"), ReadBytes(kNsysSaxpy).substr(0, 1024));
  ExpectOpenError(dir.File("cut.sqlite"), "truncated or corrupt SQLite file");
}

TEST(TraceOpenTest, UnrelatedSqliteDatabase) {
  TempDir dir;
  ExecSql(dir.File("other.db"),
          "CREATE TABLE recipes(name TEXT); INSERT INTO recipes "
          "VALUES ('soup');");
  ExpectOpenError(dir.File("other.db"),
                  "no table CUPTI_ACTIVITY_KIND_KERNEL; is this an nsys or dc trace?");
}

TEST(TraceOpenTest, EditedBlobDigest) {
  TempDir dir;
  const std::string trace = testing::WriteProfileTrace(dir);
  ASSERT_FALSE(trace.empty());
  ExecSql(trace,
          "UPDATE TC_BLOB SET digest = '0000' || substr(digest, 5) "
          "WHERE name = 'schedule'");
  ExpectOpenError(trace, "TC_BLOB 'schedule' does not match its digest");
}

TEST(TraceOpenTest, EditedBlobData) {
  TempDir dir;
  const std::string trace = testing::WriteProfileTrace(dir);
  ASSERT_FALSE(trace.empty());
  ExecSql(trace, "UPDATE TC_BLOB SET data = data || x'00' WHERE name = 'program'");
  ExpectOpenError(trace, "TC_BLOB 'program' does not match its digest");
}

// A trace of a foreign program captured with dc-collect --attach has no blobs: it opens for
// report-only analysis. Without that marker, missing blobs are an error.
TEST(TraceOpenTest, AttachCaptureWithoutBlobsIsReportOnly) {
  TempDir dir;
  const std::string trace = testing::WriteProfileTrace(dir);
  ASSERT_FALSE(trace.empty());
  ExecSql(trace, "DELETE FROM TC_BLOB");
  ExpectOpenError(trace, "without the schedule it ran");
  ExecSql(trace, "INSERT INTO META_DATA_EXPORT(name, value) VALUES ('dc.capture', 'attach')");
  auto opened = Trace::Open(trace);
  ASSERT_TRUE(opened.ok()) << opened.status().message();
  EXPECT_FALSE((*opened)->program().has_value());
  bool noted = false;
  for (const auto& note : (*opened)->notes())
    noted |= note.find("report-only") != std::string::npos;
  EXPECT_TRUE(noted);
}

TEST(TraceOpenTest, NewerSchemaVersion) {
  TempDir dir;
  const std::string trace = testing::WriteProfileTrace(dir);
  ASSERT_FALSE(trace.empty());
  ExecSql(trace,
          "UPDATE META_DATA_EXPORT SET value = '99' WHERE name = "
          "'dc.trace_schema_version'");
  ExpectOpenError(trace, "trace schema version 99 is newer than this build reads (1); update dc");
}

// Program format version 1 marked recompute ops only by their names: a trace of such a program
// that recomputes layers is refused; one that does not reads as before.
TEST(TraceOpenTest, OlderProgramThatRecomputesLayers) {
  TempDir dir;
  const std::string trace = testing::WriteProfileTrace(dir);
  ASSERT_FALSE(trace.empty());
  proto::Schedule schedule = testing::ProfileSchedule();
  schedule.set_format_version(1);
  schedule.mutable_program()->set_format_version(1);
  auto store = [&](const std::string& name, const google::protobuf::Message& message) {
    static constexpr char kHex[] = "0123456789abcdef";
    std::string hex;
    for (unsigned char c : CanonicalBytes(message)) {
      hex += kHex[c >> 4];
      hex += kHex[c & 15];
    }
    ExecSql(trace, "UPDATE TC_BLOB SET formatVersion = 1, digest = '" + DigestOf(message) +
                       "', data = x'" + hex + "' WHERE name = '" + name + "'");
  };
  store("schedule", schedule);
  store("program", schedule.program());
  StatusOr<std::unique_ptr<Trace>> opened = Trace::Open(trace);
  ASSERT_TRUE(opened.ok()) << opened.status().message();

  schedule.mutable_program()->mutable_config()->set_recompute_layers(true);
  store("schedule", schedule);
  store("program", schedule.program());
  ExpectOpenError(trace,
                  "the embedded program has format version 1 and recomputes layers, which this dc "
                  "reads only from version 2; re-record it with dc-collect");
}

TEST(TraceOpenTest, UnmergedRankFile) {
  TempDir dir;
  const std::string trace = testing::WriteProfileTrace(dir);
  ASSERT_FALSE(trace.empty());
  ExecSql(trace, "DELETE FROM META_DATA_EXPORT");
  ExpectOpenError(trace, "no dc.trace_schema_version in META_DATA_EXPORT");
}

TEST(TraceTest, ReadsADcTrace) {
  TempDir dir;
  const std::string path = testing::WriteProfileTrace(dir);
  ASSERT_FALSE(path.empty());
  StatusOr<std::unique_ptr<Trace>> opened = Trace::Open(path);
  ASSERT_TRUE(opened.ok()) << opened.status().message();
  const Trace& trace = **opened;
  EXPECT_EQ(trace.source(), TraceSource::kDc);
  ASSERT_EQ(trace.ranks().size(), 2u);
  EXPECT_EQ(trace.ranks()[1].rank, 1);
  EXPECT_EQ(trace.ranks()[1].world_size, 2);
  EXPECT_EQ(trace.ranks()[1].backend, "cpu");
  ASSERT_TRUE(trace.schedule().has_value());
  EXPECT_EQ(DigestOf(*trace.schedule()), DigestOf(testing::ProfileSchedule()));
  EXPECT_EQ(trace.program_digest(), DigestOf(testing::ProfileSchedule().program()));
  EXPECT_EQ(trace.Steps().size(), 8u);
  EXPECT_TRUE(trace.Steps()[0].warmup);
  EXPECT_EQ(trace.DroppedRecords(), 0);

  std::map<Activity::Type, int> by_type;
  int communication = 0;
  int64_t last_pid = -1, last_start = -1;
  bool ordered = true;
  ASSERT_TRUE(trace
                  .ForEachActivity([&](const Activity& a) {
                    ++by_type[a.type];
                    communication += a.communication ? 1 : 0;
                    if (a.global_pid == last_pid && a.start_ns < last_start) ordered = false;
                    if (a.global_pid < last_pid) ordered = false;
                    last_pid = a.global_pid;
                    last_start = a.start_ns;
                    if (a.type == Activity::Type::kCollective) {
                      EXPECT_TRUE(a.name == "all_gather" || a.name == "reduce_scatter");
                      EXPECT_GT(a.bytes, 0);
                    }
                    if (a.type == Activity::Type::kMemcpy) {
                      EXPECT_EQ(a.name, "[CUDA memcpy Device-to-Host]");
                    }
                  })
                  .ok());
  EXPECT_TRUE(ordered);
  // Per rank and step: 2 kernels, 2 collectives (each once), 1 copy.
  EXPECT_EQ(by_type[Activity::Type::kKernel], 16);
  EXPECT_EQ(by_type[Activity::Type::kCollective], 16);
  EXPECT_EQ(by_type[Activity::Type::kMemcpy], 8);
  EXPECT_EQ(communication, 16);

  int samples = 0;
  int64_t collective_bytes = 0;
  ASSERT_TRUE(trace
                  .ForEachInstructionSample([&](const Trace::InstructionSample& s) {
                    ++samples;
                    if (s.instruction == 0 || s.instruction == 3) collective_bytes += s.bytes;
                  })
                  .ok());
  EXPECT_EQ(samples, 40);
  // Gathers: 1000 (warm-up) + 1000 + 2000 + 3000 per rank; reduce-scatters 4 x 500 per rank.
  EXPECT_EQ(collective_bytes, 2 * (7000 + 2000));

  int memory_events = 0;
  ASSERT_TRUE(trace
                  .ForEachMemoryEvent([&](const MemoryEvent& e) {
                    ++memory_events;
                    if (e.address == 99) {
                      EXPECT_FALSE(e.alloc);
                      EXPECT_EQ(e.kind, "shard");
                      EXPECT_EQ(e.name, "w0.shard");
                    }
                  })
                  .ok());
  EXPECT_EQ(memory_events, 5);
}

// The real Nsight Systems 2022.2 export (MPI + CUDA saxpy on an A100). Expected numbers were
// read with the sqlite3 CLI, and are checked again here with SQL.
class NsysTraceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!std::filesystem::exists(kNsysSaxpy)) GTEST_SKIP() << kNsysSaxpy << " is absent";
  }
  static int64_t SqlInt(const std::string& sql) {
    sqlite3* db = nullptr;
    EXPECT_EQ(sqlite3_open_v2(kNsysSaxpy.c_str(), &db, SQLITE_OPEN_READONLY, nullptr), SQLITE_OK);
    sqlite3_stmt* stmt = nullptr;
    EXPECT_EQ(sqlite3_prepare_v2(db, sql.c_str(), -1, &stmt, nullptr), SQLITE_OK);
    int64_t value = -1;
    if (sqlite3_step(stmt) == SQLITE_ROW) value = sqlite3_column_int64(stmt, 0);
    sqlite3_finalize(stmt);
    sqlite3_close(db);
    return value;
  }
};

TEST_F(NsysTraceTest, OpensAsAnNsysExport) {
  StatusOr<std::unique_ptr<Trace>> trace = Trace::Open(kNsysSaxpy);
  ASSERT_TRUE(trace.ok()) << trace.status().message();
  EXPECT_EQ((*trace)->source(), TraceSource::kNsys);
  EXPECT_FALSE((*trace)->program().has_value());
  ASSERT_EQ((*trace)->ranks().size(), 1u);
  EXPECT_EQ((*trace)->ranks()[0].global_pid, 302119223558144);
  EXPECT_EQ((*trace)->ranks()[0].global_pid >> 24 & 0xFFFFFF, 1230493);  // ./saxpy-mpi-cuda
  EXPECT_EQ((*trace)->ranks()[0].device, "NVIDIA A100-SXM4-40GB");
  EXPECT_TRUE((*trace)->Steps().empty());
}

TEST_F(NsysTraceTest, KernelsCopiesAndStreamBusyTime) {
  StatusOr<std::unique_ptr<Trace>> trace = Trace::Open(kNsysSaxpy);
  ASSERT_TRUE(trace.ok()) << trace.status().message();
  int kernels = 0, copies = 0;
  int64_t copy_bytes = 0;
  std::map<int64_t, std::vector<analyzer_internal::Interval<int64_t>>> by_stream;
  ASSERT_TRUE((*trace)
                  ->ForEachActivity([&](const Activity& a) {
                    if (a.type == Activity::Type::kKernel) {
                      ++kernels;
                      EXPECT_EQ(a.name, "saxpy");
                      EXPECT_FALSE(a.communication);
                    }
                    if (a.type == Activity::Type::kMemcpy) {
                      ++copies;
                      copy_bytes += a.bytes;
                    }
                    by_stream[a.stream_id].push_back({a.start_ns, a.end_ns});
                  })
                  .ok());
  EXPECT_EQ(kernels, 5);
  EXPECT_EQ(kernels, SqlInt("SELECT count(*) FROM CUPTI_ACTIVITY_KIND_KERNEL"));
  EXPECT_EQ(copies, 15);
  EXPECT_EQ(copy_bytes, 3'932'160'000);  // 15 copies of 250 MiB
  EXPECT_EQ(copy_bytes, SqlInt("SELECT SUM(bytes) FROM CUPTI_ACTIVITY_KIND_MEMCPY"));
  ASSERT_EQ(by_stream.size(), 1u);
  ASSERT_TRUE(by_stream.contains(7));
  const int64_t busy_ns = analyzer_internal::TotalLength(analyzer_internal::UnionOf(by_stream[7]));
  EXPECT_EQ(busy_ns, 373'273'080);
  // Nothing overlaps on the stream, so its busy time is the plain sum of durations.
  EXPECT_EQ(SqlInt("SELECT count(*) FROM (SELECT start s, end e FROM CUPTI_ACTIVITY_KIND_KERNEL "
                   "UNION ALL SELECT start, end FROM CUPTI_ACTIVITY_KIND_MEMCPY) a, (SELECT "
                   "start s, end e FROM CUPTI_ACTIVITY_KIND_KERNEL UNION ALL SELECT start, end "
                   "FROM CUPTI_ACTIVITY_KIND_MEMCPY) b WHERE a.s < b.e AND b.s < a.e AND "
                   "a.s <> b.s"),
            0);
  EXPECT_EQ(busy_ns, SqlInt("SELECT SUM(e - s) FROM (SELECT start s, end e FROM "
                            "CUPTI_ACTIVITY_KIND_KERNEL WHERE streamId = 7 UNION ALL SELECT "
                            "start, end FROM CUPTI_ACTIVITY_KIND_MEMCPY WHERE streamId = 7 UNION "
                            "ALL SELECT start, end FROM CUPTI_ACTIVITY_KIND_MEMSET WHERE "
                            "streamId = 7)"));
}

TEST_F(NsysTraceTest, NoInstructionSamplesOrMemoryEvents) {
  StatusOr<std::unique_ptr<Trace>> trace = Trace::Open(kNsysSaxpy);
  ASSERT_TRUE(trace.ok()) << trace.status().message();
  int samples = 0, events = 0;
  ASSERT_TRUE((*trace)->ForEachInstructionSample([&](const auto&) { ++samples; }).ok());
  ASSERT_TRUE((*trace)->ForEachMemoryEvent([&](const auto&) { ++events; }).ok());
  EXPECT_EQ(samples, 0);
  EXPECT_EQ(events, 0);  // the table exists but --cuda-memory-usage was off
}

TEST(NsysCompatTest, OldStyleExportWithoutOptionalTables) {
  // A minimal export: kernels with text names, no StringIds, no MEMCPY/MEMSET/memory tables.
  TempDir dir;
  const std::string path = dir.File("old.sqlite");
  ExecSql(path,
          "CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL(start INTEGER NOT NULL, end INTEGER NOT NULL, "
          "deviceId INTEGER, streamId INTEGER, globalPid INTEGER, shortName TEXT);"
          "INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (10, 20, 0, 7, 16777216, 'gemm'), "
          "(15, 30, 0, 8, 16777216, 'ncclDevKernel_AllGather_RING_LL'), "
          "(5, 25, 1, 7, 33554432, 'ncclKernel_AllReduce_RING_LL_Sum_float');");
  StatusOr<std::unique_ptr<Trace>> trace = Trace::Open(path);
  ASSERT_TRUE(trace.ok()) << trace.status().message();
  EXPECT_EQ((*trace)->ranks().size(), 2u);
  EXPECT_EQ((*trace)->notes().size(), 4u);
  std::vector<std::string> names;
  std::vector<bool> communication;
  ASSERT_TRUE((*trace)
                  ->ForEachActivity([&](const Activity& a) {
                    names.push_back(a.name);
                    communication.push_back(a.communication);
                  })
                  .ok());
  EXPECT_EQ(names, (std::vector<std::string>{"gemm", "ncclDevKernel_AllGather_RING_LL",
                                             "ncclKernel_AllReduce_RING_LL_Sum_float"}));
  EXPECT_EQ(communication, (std::vector<bool>{false, true, true}));
}

TEST(NsysCompatTest, MpiRanksTableNamesTheRanks) {
  TempDir dir;
  const std::string path = dir.File("mpi.sqlite");
  ExecSql(path,
          "CREATE TABLE StringIds(id INTEGER PRIMARY KEY, value TEXT NOT NULL);"
          "INSERT INTO StringIds VALUES (1, 'k');"
          "CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL(start INTEGER NOT NULL, end INTEGER NOT NULL, "
          "globalPid INTEGER, shortName INTEGER NOT NULL, demangledName INTEGER NOT NULL);"
          "INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (1, 2, 33554432, 1, 1), "
          "(1, 2, 16777216, 1, 1);"
          "CREATE TABLE MPI_RANKS(globalTid INTEGER, rank INTEGER);"
          "INSERT INTO MPI_RANKS VALUES (33554433, 0), (16777217, 1);");
  StatusOr<std::unique_ptr<Trace>> trace = Trace::Open(path);
  ASSERT_TRUE(trace.ok()) << trace.status().message();
  ASSERT_EQ((*trace)->ranks().size(), 2u);
  EXPECT_EQ((*trace)->ranks()[0].global_pid, 33554432);
  EXPECT_EQ((*trace)->ranks()[0].rank, 0);
  EXPECT_EQ((*trace)->ranks()[1].global_pid, 16777216);
  EXPECT_EQ((*trace)->ranks()[1].rank, 1);
}

// ----- corrupt rows (issue 13): left out and counted, or an error where nothing is usable -----

// `table` without its NOT NULL constraints (a hostile or broken writer's file).
std::string Loosen(const std::string& table) {
  return "CREATE TABLE loose AS SELECT * FROM " + table + "; DROP TABLE " + table +
         "; ALTER TABLE loose RENAME TO " + table + ";";
}

int64_t Skipped(const Trace& trace, const std::string& table, const std::string& problem) {
  int64_t count = 0;
  for (const SkippedRecords& s : trace.skipped()) {
    if (s.source == table && s.problem == problem) count += s.count;
  }
  return count;
}

int CountActivities(const Trace& trace) {
  int n = 0;
  EXPECT_TRUE(trace.ForEachActivity([&](const Activity&) { ++n; }).ok());
  return n;
}

int CountMemoryEvents(const Trace& trace) {
  int n = 0;
  EXPECT_TRUE(trace.ForEachMemoryEvent([&](const MemoryEvent&) { ++n; }).ok());
  return n;
}

class CorruptRowsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    trace_ = testing::WriteProfileTrace(dir_);
    ASSERT_FALSE(trace_.empty());
    auto good = Trace::Open(trace_);
    ASSERT_TRUE(good.ok()) << good.status().message();
    EXPECT_TRUE((*good)->skipped().empty());
    activities_ = CountActivities(**good);
    memory_events_ = CountMemoryEvents(**good);
  }
  std::unique_ptr<Trace> Open() {
    auto trace = Trace::Open(trace_);
    EXPECT_TRUE(trace.ok()) << trace.status().message();
    return trace.ok() ? std::move(*trace) : nullptr;
  }
  static constexpr char kKernel[] = "CUPTI_ACTIVITY_KIND_KERNEL";
  static constexpr char kFirstKernel[] =
      " WHERE rowid = (SELECT MIN(rowid) FROM CUPTI_ACTIVITY_KIND_KERNEL)";
  TempDir dir_;
  std::string trace_;
  int activities_ = 0, memory_events_ = 0;
};

TEST_F(CorruptRowsTest, KernelEndingBeforeItStartsIsLeftOutAndCounted) {
  ExecSql(trace_, std::string("UPDATE ") + kKernel + " SET end = start - 1" + kFirstKernel);
  auto trace = Open();
  ASSERT_TRUE(trace);
  EXPECT_EQ(Skipped(*trace, kKernel, "end before start"), 1);
  EXPECT_EQ(CountActivities(*trace), activities_ - 1);
}

TEST_F(CorruptRowsTest, NullTimesOwnersStreamsAndBytesAreLeftOutAndCounted) {
  ExecSql(trace_, Loosen(kKernel) + Loosen("CUPTI_ACTIVITY_KIND_MEMCPY") +
                      "UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET start = NULL WHERE rowid = 1;"
                      "UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET end = NULL WHERE rowid = 2;"
                      "UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET globalPid = NULL WHERE rowid = 3;"
                      "UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET streamId = NULL WHERE rowid = 4;"
                      "UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET start = 'soon' WHERE rowid = 5;"
                      "UPDATE CUPTI_ACTIVITY_KIND_MEMCPY SET bytes = NULL WHERE rowid = 1;");
  auto trace = Open();
  ASSERT_TRUE(trace);
  EXPECT_EQ(Skipped(*trace, kKernel, "NULL or non-integer start"), 2);
  EXPECT_EQ(Skipped(*trace, kKernel, "NULL or non-integer end"), 1);
  EXPECT_EQ(Skipped(*trace, kKernel, "NULL or non-integer globalPid"), 1);
  EXPECT_EQ(Skipped(*trace, kKernel, "NULL or non-integer streamId"), 1);
  EXPECT_EQ(Skipped(*trace, "CUPTI_ACTIVITY_KIND_MEMCPY", "NULL or non-integer bytes"), 1);
  EXPECT_EQ(CountActivities(*trace), activities_ - 6);
}

TEST_F(CorruptRowsTest, TimesBytesAndOwnersOutOfRangeAreLeftOutAndCounted) {
  ExecSql(trace_,
          "UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET start = -4611686018427387904 WHERE rowid = 1;"
          "UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET globalPid = 4242 WHERE rowid = 2;"
          "UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET streamId = -3 WHERE rowid = 3;"
          "UPDATE CUPTI_ACTIVITY_KIND_MEMCPY SET bytes = -8 WHERE rowid = 1;"
          "UPDATE CUDA_GPU_MEMORY_USAGE_EVENTS SET bytes = -8388608 WHERE rowid = 1;"
          "UPDATE CUDA_GPU_MEMORY_USAGE_EVENTS SET bytes = 9223372036854775807 WHERE rowid = 2;");
  auto trace = Open();
  ASSERT_TRUE(trace);
  EXPECT_EQ(
      Skipped(*trace, kKernel, "start out of range (more than 73 years from the trace's start)"),
      1);
  EXPECT_EQ(Skipped(*trace, kKernel, "globalPid of no rank"), 1);
  EXPECT_EQ(Skipped(*trace, kKernel, "streamId out of range (negative or over 2^48)"), 1);
  EXPECT_EQ(
      Skipped(*trace, "CUPTI_ACTIVITY_KIND_MEMCPY", "bytes out of range (negative or over 1 PiB)"),
      1);
  EXPECT_EQ(Skipped(*trace, "CUDA_GPU_MEMORY_USAGE_EVENTS",
                    "bytes out of range (negative or over 1 PiB)"),
            2);
  EXPECT_EQ(CountActivities(*trace), activities_ - 4);
  EXPECT_EQ(CountMemoryEvents(*trace), memory_events_ - 2);
}

TEST_F(CorruptRowsTest, BadStepRowsAreLeftOutAndCounted) {
  ExecSql(trace_,
          "UPDATE TC_STEP SET end = start - 5 WHERE rowid = 1;"
          "UPDATE TC_STEP SET step = -2 WHERE rowid = 2;");
  auto trace = Open();
  ASSERT_TRUE(trace);
  EXPECT_EQ(Skipped(*trace, "TC_STEP", "end before start"), 1);
  EXPECT_EQ(Skipped(*trace, "TC_STEP", "step out of range (negative or over 2^31)"), 1);
}

TEST_F(CorruptRowsTest, BadInstructionMapRowsAreLeftOutAndCounted) {
  ExecSql(trace_, "UPDATE TC_INSTRUCTION_MAP SET instruction = 4294967297 WHERE rowid = 1;");
  auto trace = Open();
  ASSERT_TRUE(trace);
  EXPECT_EQ(
      Skipped(*trace, "TC_INSTRUCTION_MAP", "instruction out of range (negative or over 2^31)"), 1);
  int samples = 0;
  ASSERT_TRUE(trace
                  ->ForEachInstructionSample([&](const auto& s) {
                    ++samples;
                    EXPECT_LT(s.instruction, 6);
                  })
                  .ok());
  EXPECT_GT(samples, 0);
}

TEST_F(CorruptRowsTest, NoKernelRowsIsAnError) {
  ExecSql(trace_, "DELETE FROM CUPTI_ACTIVITY_KIND_KERNEL");
  ExpectOpenError(trace_, "no kernel rows in CUPTI_ACTIVITY_KIND_KERNEL");
  ExpectOpenError(trace_, "re-record it");
}

TEST_F(CorruptRowsTest, NoUsableKernelRowIsAnError) {
  ExecSql(trace_, "UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET end = start - 1");
  ExpectOpenError(trace_, "none of the kernel rows is usable");
}

TEST_F(CorruptRowsTest, NoMeasuredStepIsAnErrorForTheProfile) {
  ExecSql(trace_, "DELETE FROM TC_STEP");
  auto trace = Open();
  ASSERT_TRUE(trace);
  StatusOr<Profile> profile = BuildProfile(*trace);
  ASSERT_FALSE(profile.ok());
  EXPECT_EQ(profile.status().message().rfind(trace_ + ": no measured step in TC_STEP", 0), 0u)
      << profile.status().message();
  EXPECT_NE(profile.status().message().find("re-record it"), std::string::npos);
}

TEST_F(CorruptRowsTest, DuplicateRankIsAnError) {
  ExecSql(trace_, "UPDATE TC_RANK SET rank = 0");
  ExpectOpenError(trace_, "TC_RANK lists rank 0 twice");
}

TEST_F(CorruptRowsTest, RankBeyondItsWorldIsAnError) {
  ExecSql(trace_, "UPDATE TC_RANK SET rank = rank + 7");
  ExpectOpenError(trace_, "TC_RANK has a bad row");
}

TEST_F(CorruptRowsTest, MissingStringIdsIsAnError) {
  ExecSql(trace_, "DROP TABLE StringIds");
  ExpectOpenError(trace_, "dc trace without table StringIds");
}

TEST_F(CorruptRowsTest, TheProfileCarriesTheCounts) {
  ExecSql(trace_, std::string("UPDATE ") + kKernel + " SET end = start - 1" + kFirstKernel);
  auto trace = Open();
  ASSERT_TRUE(trace);
  StatusOr<Profile> profile = BuildProfile(*trace);
  ASSERT_TRUE(profile.ok()) << profile.status().message();
  ASSERT_EQ(profile->skipped.size(), 1u);
  EXPECT_EQ(profile->skipped[0].Text(),
            "CUPTI_ACTIVITY_KIND_KERNEL: 1 record(s) skipped (end before start)");
}

TEST(NsysCompatTest, IntegerNamesWithoutStringIdsAreAnError) {
  TempDir dir;
  const std::string path = dir.File("ids.sqlite");
  ExecSql(path,
          "CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL(start INTEGER, end INTEGER, globalPid INTEGER, "
          "shortName INTEGER);"
          "INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (1, 2, 16777216, 7);");
  ExpectOpenError(path, "kernel names are ids into StringIds, which the file lacks");
}

TEST(NsysCompatTest, TwoProcessesOfOneMpiRankAreAnError) {
  TempDir dir;
  const std::string path = dir.File("mpi.sqlite");
  ExecSql(path,
          "CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL(start INTEGER, end INTEGER, globalPid INTEGER, "
          "shortName TEXT);"
          "INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (1, 2, 33554432, 'k');"
          "CREATE TABLE MPI_RANKS(globalTid INTEGER, rank INTEGER);"
          "INSERT INTO MPI_RANKS VALUES (33554433, 0), (16777217, 0);");
  ExpectOpenError(path, "MPI_RANKS lists rank 0 for two processes");
}

TEST(NsysCompatTest, ActivityOfAProcessOutsideMpiRanksIsCounted) {
  TempDir dir;
  const std::string path = dir.File("mpi.sqlite");
  ExecSql(path,
          "CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL(start INTEGER, end INTEGER, globalPid INTEGER, "
          "shortName TEXT);"
          "INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (1, 2, 33554432, 'k'), "
          "(1, 2, 50331648, 'stray');"
          "CREATE TABLE MPI_RANKS(globalTid INTEGER, rank INTEGER);"
          "INSERT INTO MPI_RANKS VALUES (33554433, 0);");
  auto trace = Trace::Open(path);
  ASSERT_TRUE(trace.ok()) << trace.status().message();
  EXPECT_EQ(Skipped(**trace, "CUPTI_ACTIVITY_KIND_KERNEL", "globalPid of no rank"), 1);
  EXPECT_EQ(CountActivities(**trace), 1);
}

TEST(NsysCompatTest, EmptyKernelTableIsAnError) {
  TempDir dir;
  const std::string path = dir.File("empty.sqlite");
  ExecSql(path,
          "CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL(start INTEGER, end INTEGER, globalPid INTEGER, "
          "shortName TEXT);");
  ExpectOpenError(path, "no kernel rows in CUPTI_ACTIVITY_KIND_KERNEL");
}

}  // namespace
}  // namespace dc
