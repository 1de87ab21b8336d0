// The CUPTI record writer on synthetic records: conversions, names, the rank file it writes and
// that the analyzer reads it after MergeRankTraces. Runs without a GPU.
#include "collector/cupti/activity_writer.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sqlite3.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "analyzer/trace.h"
#include "collector/cupti/test_records.h"
#include "collector/host_tracer.h"
#include "collector/trace_blobs.h"

namespace dc::cupti_internal {
namespace {

namespace fs = std::filesystem;
using namespace dc::cupti_testing;

class TempDir {
 public:
  TempDir() {
    std::string pattern = (fs::temp_directory_path() / "dc_cupti_test_XXXXXX").string();
    path_ = mkdtemp(pattern.data());
  }
  ~TempDir() { fs::remove_all(path_); }
  std::string File(const std::string& name) const { return (fs::path(path_) / name).string(); }

 private:
  std::string path_;
};

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
  std::string Text(const std::string& sql) const {
    sqlite3_stmt* stmt = nullptr;
    EXPECT_EQ(sqlite3_prepare_v2(db_, sql.c_str(), -1, &stmt, nullptr), SQLITE_OK) << sql;
    std::string value = "<no row>";
    if (stmt && sqlite3_step(stmt) == SQLITE_ROW) {
      const unsigned char* text = sqlite3_column_text(stmt, 0);
      value = text ? reinterpret_cast<const char*>(text) : "<null>";
    }
    sqlite3_finalize(stmt);
    return value;
  }

 private:
  sqlite3* db_ = nullptr;
};

TEST(NsysEnums, MemKindIsCuptiMinusOneWithUnknownLast) {
  EXPECT_EQ(NsysMemKind(CUPTI_ACTIVITY_MEMORY_KIND_UNKNOWN), 7);
  EXPECT_EQ(NsysMemKind(CUPTI_ACTIVITY_MEMORY_KIND_PAGEABLE), 0);
  EXPECT_EQ(NsysMemKind(CUPTI_ACTIVITY_MEMORY_KIND_PINNED), 1);
  EXPECT_EQ(NsysMemKind(CUPTI_ACTIVITY_MEMORY_KIND_DEVICE), 2);
  EXPECT_EQ(NsysMemKind(CUPTI_ACTIVITY_MEMORY_KIND_MANAGED_STATIC), 6);
  EXPECT_EQ(NsysMemKind(99), 7);
  EXPECT_EQ(NsysMemoryOperation(CUPTI_ACTIVITY_MEMORY_OPERATION_TYPE_ALLOCATION), 0);
  EXPECT_EQ(NsysMemoryOperation(CUPTI_ACTIVITY_MEMORY_OPERATION_TYPE_RELEASE), 1);
  EXPECT_FALSE(NsysMemoryOperation(CUPTI_ACTIVITY_MEMORY_OPERATION_TYPE_INVALID).has_value());
}

TEST(KernelNames, DemanglesAndShortensLikeNsys) {
  EXPECT_EQ(DemangleKernelName("_Z5scalePfif"), "scale(float*, int, float)");
  EXPECT_EQ(DemangleKernelName("ncclDevKernel_Generic"), "ncclDevKernel_Generic");
  EXPECT_EQ(DemangleKernelName(nullptr), "<unknown kernel>");
  const std::map<std::string, std::string> cases = {
      {"scale(float*, int, float)", "scale"},
      {"scale", "scale"},
      {"void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, "
       "at::detail::Array<char*, 1> >(int, at::native::FillFunctor<float>, "
       "at::detail::Array<char*, 1>)",
       "vectorized_elementwise_kernel"},
      {"void (anonymous namespace)::softmax_warp_forward<float, float, float, 10>(float*, "
       "float const*, int, int, int)",
       "softmax_warp_forward"},
      {"void cutlass::Kernel2<cutlass_80_tensorop_s1688gemm_128x128_32x3_nn_align4>("
       "cutlass_80_tensorop_s1688gemm_128x128_32x3_nn_align4::Params)",
       "Kernel2"},
      {"ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
       "ncclDevKernel_AllGather_RING_LL"},
  };
  for (const auto& [demangled, short_name] : cases) {
    EXPECT_EQ(ShortKernelName(demangled), short_name) << demangled;
  }
}

TEST(KernelNames, RecognizesNcclCollectives) {
  EXPECT_EQ(NcclCollectiveKind("ncclDevKernel_AllGather_RING_LL"), "all_gather");
  EXPECT_EQ(NcclCollectiveKind("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL"), "reduce_scatter");
  EXPECT_EQ(NcclCollectiveKind("ncclDevKernel_AllReduce_Sum_f32_TREE_LL"), "all_reduce");
  EXPECT_EQ(NcclCollectiveKind("ncclSymkDevKernel_AllGather_LL"), "all_gather");
  EXPECT_EQ(NcclCollectiveKind("ncclKernel_Broadcast_RING_LL_Sum_int8_t"), "broadcast");
  EXPECT_EQ(NcclCollectiveKind("ncclDevKernel_SendRecv"), "send_recv");
  EXPECT_EQ(NcclCollectiveKind("ncclDevKernel_Generic_1"), "nccl");
  EXPECT_FALSE(NcclCollectiveKind("vectorized_elementwise_kernel").has_value());
  EXPECT_FALSE(NcclCollectiveKind("nccl_helper").has_value());
}

// CUPTI timestamps of the synthetic records: the session starts at kOrigin on CUPTI's clock.
constexpr uint64_t kOrigin = 1'700'000'000'000'000'000;
constexpr int64_t kGlobalPid = (int64_t{0} << 48) | (int64_t{1234} << 24);

std::unique_ptr<ActivityWriter> OpenWriter(const std::string& path, bool streamed = false) {
  SessionClock clock;
  clock.session_start_utc_ns = static_cast<int64_t>(kOrigin);
  clock.cupti_to_realtime_ns = 0;
  auto writer = ActivityWriter::Open(
      path, kGlobalPid, clock,
      [](bool driver, uint32_t cbid) {
        return std::string(driver ? "cuDriverCall_" : "cudaRuntimeCall_") + std::to_string(cbid);
      },
      streamed);
  EXPECT_TRUE(writer.ok()) << writer.status().message();
  return writer.ok() ? std::move(writer).value() : nullptr;
}

// One step on one rank: instruction 0 (compute: two kernels), 1 (all_gather: an NCCL kernel),
// 2 (reload: a copy); a memset, an allocation and its free, API calls, a kernel without
// timestamps.
void AddStep(ActivityWriter& writer) {
  const auto k1 = Kernel("_Z5scalePfif", kOrigin + 1000, kOrigin + 2000, 11);
  const auto k2 = Kernel("_Z5scalePfif", kOrigin + 2100, kOrigin + 2600, 12);
  const auto nccl = Kernel("_Z31ncclDevKernel_AllGather_RING_LL24ncclDevKernelArgsStorageILm4096EE",
                           kOrigin + 3000, kOrigin + 9000, 13, /*stream_id=*/9);
  const auto lost = Kernel("_Z5scalePfif", 0, 0, 14);
  const auto copy =
      Memcpy(CUPTI_ACTIVITY_MEMCPY_KIND_HTOD, 1 << 20, kOrigin + 500, kOrigin + 900, 15);
  const auto set = Memset(256, kOrigin + 950, kOrigin + 960, 16);
  const auto alloc = Memory(true, 0x7f0000001000, 1 << 20, kOrigin + 100, 17);
  const auto release = Memory(false, 0x7f0000001000, 1 << 20, kOrigin + 9500, 18);
  const auto launch = Api(false, 211, kOrigin + 990, kOrigin + 995, 11);
  const auto driver = Api(true, 442, kOrigin + 2990, kOrigin + 2995, 13);
  const auto x11 = External(11, 0, 0), x12 = External(12, 0, 0), x13 = External(13, 0, 1),
             x15 = External(15, 0, 2);
  ASSERT_TRUE(writer.BeginBatch().ok());
  for (const void* r : {static_cast<const void*>(&x11), static_cast<const void*>(&x12),
                        static_cast<const void*>(&x13), static_cast<const void*>(&x15),
                        static_cast<const void*>(&k1), static_cast<const void*>(&k2),
                        static_cast<const void*>(&nccl), static_cast<const void*>(&lost),
                        static_cast<const void*>(&copy), static_cast<const void*>(&set),
                        static_cast<const void*>(&alloc), static_cast<const void*>(&release),
                        static_cast<const void*>(&launch), static_cast<const void*>(&driver)}) {
    writer.Add(AsRecord(r));
  }
  writer.AddBuffer(/*dropped_records=*/0);
  ASSERT_TRUE(writer.EndBatch().ok());
}

FinishInput StepInput() {
  FinishInput input;
  input.rank = {kGlobalPid, 0, 0, 1, "host-a", 0};
  input.anchors = {{"start", static_cast<int64_t>(kOrigin), 5, 0},
                   {"cupti_start", static_cast<int64_t>(kOrigin), 5, 0}};
  input.instructions = {
      {0, "compute", 0, 0, 1, -1}, {1, "all_gather", 0, 4096, 2, 3}, {2, "reload", 0, 0, 1, -1}};
  input.steps = {{0, 0, 10000, 1.5, false}};
  input.streams = {{7, "compute"}, {9, "gather"}};
  input.metadata = {{"dc.capture", "test"}};
  return input;
}

TEST(ActivityWriter, WritesOneRankInTheTraceSchema) {
  TempDir dir;
  const std::string path = dir.File("rank0.db");
  auto writer = OpenWriter(path);
  ASSERT_NE(writer, nullptr);
  AddStep(*writer);
  auto counts = writer->Finish(StepInput());
  ASSERT_TRUE(counts.ok()) << counts.status().message();
  EXPECT_EQ(counts->kernels, 2);
  EXPECT_EQ(counts->collectives, 1);
  EXPECT_EQ(counts->memcpys, 1);
  EXPECT_EQ(counts->memsets, 1);
  EXPECT_EQ(counts->memory_events, 2);
  EXPECT_EQ(counts->api_calls, 2);
  EXPECT_EQ(counts->zero_timestamp_records, 1);
  EXPECT_EQ(counts->dropped_records, 0);
  EXPECT_EQ(counts->mapped_activities, 4);
  EXPECT_FALSE(fs::exists(path + ".tmp." + std::to_string(getpid())));

  Db db(path);
  EXPECT_EQ(db.Text("SELECT s.value FROM CUPTI_ACTIVITY_KIND_KERNEL k JOIN StringIds s ON "
                    "s.id = k.shortName WHERE k.correlationId = 11"),
            "scale");
  EXPECT_EQ(db.Text("SELECT s.value FROM CUPTI_ACTIVITY_KIND_KERNEL k JOIN StringIds s ON "
                    "s.id = k.demangledName WHERE k.correlationId = 11"),
            "scale(float*, int, float)");
  EXPECT_EQ(db.Text("SELECT s.value FROM CUPTI_ACTIVITY_KIND_KERNEL k JOIN StringIds s ON "
                    "s.id = k.mangledName WHERE k.correlationId = 11"),
            "_Z5scalePfif");
  EXPECT_EQ(db.Int("SELECT start FROM CUPTI_ACTIVITY_KIND_KERNEL WHERE correlationId = 11"), 1000);
  EXPECT_EQ(db.Int("SELECT globalPid FROM CUPTI_ACTIVITY_KIND_KERNEL WHERE correlationId = 11"),
            kGlobalPid);
  // nsys numbering: pinned host -> device is srcKind 1, dstKind 2.
  EXPECT_EQ(db.Int("SELECT srcKind FROM CUPTI_ACTIVITY_KIND_MEMCPY"), 1);
  EXPECT_EQ(db.Int("SELECT dstKind FROM CUPTI_ACTIVITY_KIND_MEMCPY"), 2);
  EXPECT_EQ(db.Int("SELECT copyKind FROM CUPTI_ACTIVITY_KIND_MEMCPY"), 1);
  EXPECT_EQ(db.Int("SELECT memKind FROM CUPTI_ACTIVITY_KIND_MEMSET"), 2);
  EXPECT_EQ(db.Int("SELECT memoryOperationType FROM CUDA_GPU_MEMORY_USAGE_EVENTS WHERE "
                   "correlationId = 17"),
            0);
  EXPECT_EQ(db.Int("SELECT memoryOperationType FROM CUDA_GPU_MEMORY_USAGE_EVENTS WHERE "
                   "correlationId = 18"),
            1);
  EXPECT_EQ(db.Int("SELECT memKind FROM CUDA_GPU_MEMORY_USAGE_EVENTS LIMIT 1"), 2);
  // The NCCL kernel is a collective with the instruction's payload.
  EXPECT_EQ(db.Text("SELECT kind FROM TC_COLLECTIVE"), "all_gather");
  EXPECT_EQ(db.Int("SELECT bytes FROM TC_COLLECTIVE"), 4096);
  EXPECT_EQ(db.Int("SELECT bucket FROM TC_COLLECTIVE"), 3);
  EXPECT_EQ(db.Int("SELECT correlationId FROM TC_COLLECTIVE"), 13);
  EXPECT_EQ(db.Text("SELECT group_concat(correlationId || ':' || instruction || ':' || kind, ' ') "
                    "FROM (SELECT * FROM TC_INSTRUCTION_MAP ORDER BY correlationId)"),
            "11:0:compute 12:0:compute 13:1:all_gather 15:2:reload");
  EXPECT_EQ(db.Int("SELECT count(*) FROM CUPTI_ACTIVITY_KIND_RUNTIME WHERE eventClass = 1"), 1);
  EXPECT_EQ(db.Int("SELECT globalTid FROM CUPTI_ACTIVITY_KIND_RUNTIME WHERE eventClass = 0"),
            kGlobalPid | 4242);
  EXPECT_EQ(db.Text("SELECT s.value FROM CUPTI_ACTIVITY_KIND_RUNTIME r JOIN StringIds s ON "
                    "s.id = r.nameId WHERE r.eventClass = 0"),
            "cudaRuntimeCall_211");
  EXPECT_EQ(db.Int("SELECT zeroTimestamp FROM TC_RECORD_STATS WHERE kind = 'kernel'"), 1);
  EXPECT_EQ(db.Int("SELECT records FROM TC_RECORD_STATS WHERE kind = 'collective'"), 1);
  EXPECT_EQ(db.Int("SELECT records FROM TC_RECORD_STATS WHERE kind = 'buffers'"), 1);
  EXPECT_EQ(db.Text("SELECT backend FROM TC_RANK"), "cuda");
  EXPECT_EQ(db.Int("SELECT count(*) FROM TC_CLOCK_ANCHOR"), 2);
  EXPECT_EQ(db.Text("SELECT name FROM TC_STREAM WHERE streamId = 9"), "gather");
  EXPECT_EQ(db.Int("SELECT utcEpochNs FROM TARGET_INFO_SESSION_START_TIME"),
            static_cast<int64_t>(kOrigin));
  EXPECT_EQ(db.Text("SELECT value FROM META_DATA_CAPTURE WHERE name = 'dc.capture'"), "test");
}

TEST(ActivityWriter, TheAnalyzerReadsTheMergedTrace) {
  TempDir dir;
  const std::string rank_path = dir.File("rank0.db");
  auto writer = OpenWriter(rank_path);
  ASSERT_NE(writer, nullptr);
  AddStep(*writer);
  ASSERT_TRUE(writer->Finish(StepInput()).ok());
  proto::Schedule schedule;
  schedule.set_world_size(1);
  schedule.set_backend("cuda");
  const std::string out = dir.File("trace.db");
  auto merged = MergeRankTraces({rank_path}, schedule, out);
  ASSERT_TRUE(merged.ok()) << merged.status().message();
  EXPECT_EQ(merged->ranks, 1);

  auto trace = Trace::Open(out);
  ASSERT_TRUE(trace.ok()) << trace.status().message();
  const Trace& t = **trace;
  ASSERT_EQ(t.ranks().size(), 1u);
  EXPECT_EQ(t.ranks()[0].backend, "cuda");
  EXPECT_EQ(t.DroppedRecords(), 0);
  std::vector<Activity> activities;
  ASSERT_TRUE(t.ForEachActivity([&](const Activity& a) { activities.push_back(a); }).ok());
  ASSERT_EQ(activities.size(), 5u);  // 2 kernels, 1 collective, 1 memcpy, 1 memset
  int kernels = 0, collectives = 0;
  for (const Activity& a : activities) {
    if (a.type == Activity::Type::kKernel) {
      EXPECT_EQ(a.name, "scale");
      ++kernels;
    }
    if (a.type == Activity::Type::kCollective) {
      EXPECT_EQ(a.name, "all_gather");
      EXPECT_EQ(a.bytes, 4096);
      EXPECT_TRUE(a.communication);
      ++collectives;
    }
    if (a.type == Activity::Type::kMemcpy) {
      EXPECT_EQ(a.bytes, 1 << 20);
    }
  }
  EXPECT_EQ(kernels, 2);
  EXPECT_EQ(collectives, 1);
  std::vector<Trace::InstructionSample> samples;
  ASSERT_TRUE(t.ForEachInstructionSample([&](const auto& s) { samples.push_back(s); }).ok());
  ASSERT_EQ(samples.size(), 4u);
  EXPECT_EQ(samples[2].instruction, 1);
  EXPECT_EQ(samples[2].bytes, 4096);
  EXPECT_EQ(samples[2].end_ns - samples[2].start_ns, 6000);
  int memory_events = 0;
  ASSERT_TRUE(t.ForEachMemoryEvent([&](const MemoryEvent& e) {
                 EXPECT_EQ(e.bytes, 1 << 20);
                 ++memory_events;
               }).ok());
  EXPECT_EQ(memory_events, 2);
  ASSERT_EQ(t.Steps().size(), 1u);
}

TEST(ActivityWriter, KeepsOnlyTheCaptureWindowsButEveryMemoryEvent) {
  TempDir dir;
  const std::string path = dir.File("rank0.db");
  auto writer = OpenWriter(path);
  ASSERT_NE(writer, nullptr);
  AddStep(*writer);
  FinishInput input = StepInput();
  input.windows = std::vector<WindowRow>{{2000, 9999}};  // drops k1, the copy, memset, 1 API
  auto counts = writer->Finish(input);
  ASSERT_TRUE(counts.ok()) << counts.status().message();
  EXPECT_EQ(counts->kernels, 1);
  EXPECT_EQ(counts->collectives, 1);
  EXPECT_EQ(counts->memcpys, 0);
  EXPECT_EQ(counts->memsets, 0);
  EXPECT_EQ(counts->memory_events, 2);
  EXPECT_EQ(counts->out_of_window_records, 4);
  Db db(path);
  EXPECT_EQ(db.Int("SELECT count(*) FROM TC_INSTRUCTION_MAP"), 2);
  EXPECT_EQ(db.Text("SELECT value FROM META_DATA_CAPTURE WHERE name LIKE "
                    "'dc.out_of_window_records.%'"),
            "4");
}

TEST(ActivityWriter, LeavesNothingBehindWithoutFinish) {
  TempDir dir;
  const std::string path = dir.File("rank0.db");
  {
    auto writer = OpenWriter(path);
    ASSERT_NE(writer, nullptr);
    AddStep(*writer);
  }
  EXPECT_FALSE(fs::exists(path));
  EXPECT_TRUE(fs::is_empty(fs::path(path).parent_path()));
}

// Step `step` of a streamed run: a compute kernel (instruction 0) and an NCCL all-gather
// (instruction 1), 10 us apart per step. Returns false if the writer refused them.
bool AddStreamedStep(ActivityWriter& writer, int step) {
  const uint64_t at = kOrigin + static_cast<uint64_t>(step) * 10000;
  const uint32_t id = 100 * static_cast<uint32_t>(step + 1);
  const auto kernel = Kernel("_Z5scalePfif", at + 1000, at + 2000, id + 1);
  const auto nccl = Kernel("_Z31ncclDevKernel_AllGather_RING_LL24ncclDevKernelArgsStorageILm4096EE",
                           at + 3000, at + 8000, id + 2, /*stream_id=*/9);
  const auto x1 = External(id + 1, step, 0), x2 = External(id + 2, step, 1);
  if (!writer.BeginBatch().ok()) return false;
  for (const void* r : {static_cast<const void*>(&x1), static_cast<const void*>(&x2),
                        static_cast<const void*>(&kernel), static_cast<const void*>(&nccl)}) {
    writer.Add(AsRecord(r));
  }
  writer.AddBuffer(0);
  return writer.EndBatch().ok();
}

proto::Schedule StreamedSchedule() {
  proto::Schedule schedule;
  schedule.set_world_size(1);
  schedule.set_backend("cuda");
  return schedule;
}

CheckpointInput StreamedInput(const proto::Schedule& schedule) {
  CheckpointInput input;
  input.rank = {kGlobalPid, 0, 0, 1, "host-a", 0};
  input.anchors = {{"start", static_cast<int64_t>(kOrigin), 5, 0},
                   {"cupti_start", static_cast<int64_t>(kOrigin), 5, 0}};
  input.write_blobs = [&schedule](collector_internal::Database* db) {
    return collector_internal::WriteScheduleBlobs(db, schedule);
  };
  input.instructions = {{0, "compute", 0, 0, 1, -1}, {1, "all_gather", 0, 4096, 2, 3}};
  input.streams = {{7, "compute"}};
  return input;
}

// Writes steps 0 .. steps - 1, each committed by a checkpoint, then step `steps` without one.
bool StreamSteps(ActivityWriter& writer, CheckpointInput& input, int steps) {
  for (int step = 0; step <= steps; ++step) {
    if (!AddStreamedStep(writer, step)) return false;
    if (step == steps) break;
    input.steps.push_back({step, step * 10000, step * 10000 + 9000, 2.0 - 0.1 * step, false});
    if (step == 1) input.streams.emplace_back(9, "gather");  // named after the first commit
    if (!writer.Checkpoint(input).ok()) return false;
  }
  return true;
}

// A run killed (SIGKILL, no destructor, no Finish) after two committed steps and during a third
// leaves a rank file that merges into a trace of the two, marked incomplete, that the analyzer
// reads with every activity of those steps mapped to its instruction.
TEST(ActivityWriter, AKilledStreamedRunLeavesTheStepsItCommitted) {
  TempDir dir;
  const std::string path = dir.File("trace.db.rank0.part");
  const proto::Schedule schedule = StreamedSchedule();
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    auto writer = OpenWriter(path, /*streamed=*/true);
    CheckpointInput input = StreamedInput(schedule);
    if (writer == nullptr || !StreamSteps(*writer, input, 2)) _exit(1);
    ::kill(::getpid(), SIGKILL);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFSIGNALED(status))
      << "the writing process failed (exit " << WEXITSTATUS(status) << ")";
  {
    Db db(path);  // the WAL's committed frames are read with it
    EXPECT_EQ(db.Int("SELECT count(*) FROM TC_STEP"), 2);
    EXPECT_EQ(db.Int("SELECT count(*) FROM TC_RANK"), 1);
    EXPECT_EQ(db.Int("SELECT count(*) FROM TC_CLOCK_ANCHOR WHERE tag = 'end'"), 0);
    EXPECT_EQ(db.Int("SELECT count(*) FROM TC_BLOB WHERE name = 'schedule'"), 1);
    EXPECT_EQ(db.Text("SELECT group_concat(step || ':' || instruction, ' ') FROM (SELECT * FROM "
                      "TC_INSTRUCTION_MAP ORDER BY step, instruction)"),
              "0:0 0:1 1:0 1:1");
    EXPECT_EQ(db.Int("SELECT bytes FROM TC_COLLECTIVE WHERE correlationId = 102"), 4096);
    EXPECT_EQ(db.Int("SELECT count(*) FROM TC_STREAM"), 2);
  }
  const std::string out = dir.File("trace.db");
  auto merged = MergeRankTraces({path}, out, MergeOptions{});
  ASSERT_TRUE(merged.ok()) << merged.status().message();
  EXPECT_EQ(merged->last_step, 1);
  EXPECT_NE(merged->incomplete.find("did not finish"), std::string::npos) << merged->incomplete;
  auto trace = Trace::Open(out);
  ASSERT_TRUE(trace.ok()) << trace.status().message();
  EXPECT_FALSE((*trace)->incomplete().empty());
  EXPECT_EQ((*trace)->Steps().size(), 2u);
  std::vector<Trace::InstructionSample> samples;
  ASSERT_TRUE(
      (*trace)->ForEachInstructionSample([&](const auto& s) { samples.push_back(s); }).ok());
  EXPECT_EQ(samples.size(), 4u);  // step 2's kernels were cut with it
}

// Checkpoints then Finish give the file an unstreamed writer gives: the same rows in every
// per-rank table (none twice), the WAL folded in.
TEST(ActivityWriter, AStreamedFileFinishesAsAnUnstreamedOne) {
  TempDir dir;
  const proto::Schedule schedule = StreamedSchedule();
  const std::string streamed = dir.File("streamed.db"), whole = dir.File("whole.db");
  FinishInput finish;
  {
    auto writer = OpenWriter(streamed, /*streamed=*/true);
    ASSERT_NE(writer, nullptr);
    CheckpointInput input = StreamedInput(schedule);
    ASSERT_TRUE(StreamSteps(*writer, input, 2));
    input.steps.push_back({2, 20000, 29000, 1.8, false});
    finish.rank = input.rank;
    finish.anchors = input.anchors;
    finish.anchors.push_back({"end", static_cast<int64_t>(kOrigin) + 30000, 6, 30000});
    finish.instructions = input.instructions;
    finish.steps = input.steps;
    finish.streams = input.streams;
    finish.windows = std::vector<WindowRow>{{0, 30000}};
    ASSERT_TRUE(writer->Finish(finish).ok());
  }
  {
    auto writer = OpenWriter(whole);
    ASSERT_NE(writer, nullptr);
    for (int step = 0; step <= 2; ++step) ASSERT_TRUE(AddStreamedStep(*writer, step));
    ASSERT_TRUE(writer->Finish(finish).ok());
  }
  EXPECT_FALSE(fs::exists(streamed + "-wal"));
  Db a(streamed), b(whole);
  for (const char* table :
       {"TC_STEP", "TC_RANK", "TC_CLOCK_ANCHOR", "TC_STREAM", "TC_INSTRUCTION_MAP", "TC_COLLECTIVE",
        "TARGET_INFO_GPU", "TARGET_INFO_SESSION_START_TIME", "TC_RECORD_STATS",
        "CUPTI_ACTIVITY_KIND_KERNEL", "META_DATA_CAPTURE"}) {
    const std::string count = std::string("SELECT count(*) FROM ") + table;
    EXPECT_EQ(a.Int(count), b.Int(count)) << table;
  }
  EXPECT_EQ(a.Int("SELECT count(*) FROM TC_INSTRUCTION_MAP"), 6);
  EXPECT_EQ(a.Int("SELECT sum(bytes) FROM TC_COLLECTIVE"), 3 * 4096);
  EXPECT_EQ(a.Text("PRAGMA journal_mode"), "delete");
  // Only the streamed file carries the plan (the merge adds it to an unstreamed run's).
  EXPECT_EQ(a.Int("SELECT count(*) FROM TC_BLOB WHERE name = 'schedule'"), 1);
}

// A checkpoint needs a streamed writer.
TEST(ActivityWriter, AnUnstreamedWriterRefusesCheckpoints) {
  TempDir dir;
  auto writer = OpenWriter(dir.File("rank0.db"));
  ASSERT_NE(writer, nullptr);
  const proto::Schedule schedule = StreamedSchedule();
  EXPECT_FALSE(writer->Checkpoint(StreamedInput(schedule)).ok());
}

}  // namespace
}  // namespace dc::cupti_internal
