#include "tracetools/report.h"

#include <gtest/gtest.h>
#include <sqlite3.h>

#include <random>

#include "analyzer/profile.h"
#include "analyzer/trace.h"
#include "machine/estimate.h"
#include "machine/hardware.h"
#include "machine/intervals.h"
#include "models/model.h"
#include "rewriter/planner.h"
#include "schemas/digest.h"
#include "tests/support/test_traces.h"

namespace dc {
namespace {

constexpr int64_t kUs = 1000;  // ns per microsecond
constexpr double kTolerance = 1e-12;

TimelineActivity Act(ActivityClass kind, int64_t stream, const std::string& name, int64_t start_us,
                     int64_t end_us, int rank_index = 0) {
  TimelineActivity a;
  a.rank_index = rank_index;
  a.kind = kind;
  a.stream_id = stream;
  a.name = name;
  a.start_ns = start_us * kUs;
  a.end_ns = end_us * kUs;
  return a;
}

TimelineMemoryEvent Mem(int64_t ts_us, int64_t address, int64_t bytes, bool alloc,
                        const std::string& kind) {
  TimelineMemoryEvent e;
  e.ts_ns = ts_us * kUs;
  e.address = address;
  e.bytes = bytes;
  e.alloc = alloc;
  e.kind = kind;
  return e;
}

// One rank, step 1 over [0, 100) us:
//   compute  [0, 30) on stream 1 and [20, 50) on stream 2    C = [0, 50)
//   comm     [40, 70) and [95, 110) on stream 3              N in the window = [40, 70) + [95, 100)
//   copy     [80, 90) on stream 4                            M = [80, 90)
//   compute  [120, 130): outside every measured window; warm-up step 0 over [-100, 0)
// By hand: |C| 50, |N| 35, |C ∩ N| 10, ratio 10/35, exposed 25, |M| 10, union 85, idle 15.
// Memory: shard 30 B live before the capture (freed at 70), gathered 100 B (10..60),
// activation 50 B from 20: peak 180 B at 20 us.
TimelineData HandTimeline() {
  TimelineData data;
  data.path = "hand";
  data.format = TimelineFormat::kNsys;
  data.ranks.push_back({0, 42, "test device", 0});
  data.steps.push_back({0, 0, -100 * kUs, 0, true});
  data.steps.push_back({0, 1, 0, 100 * kUs, false});
  data.stream_names.push_back({0, 1, "compute"});
  data.activities = {Act(ActivityClass::kCompute, 1, "gemm", 0, 30),
                     Act(ActivityClass::kCompute, 2, "gemm", 20, 50),
                     Act(ActivityClass::kCommunication, 3, "ncclAllGather", 40, 70),
                     Act(ActivityClass::kCopy, 4, "[CUDA memcpy Device-to-Host]", 80, 90),
                     Act(ActivityClass::kCommunication, 3, "ncclAllGather", 95, 110),
                     Act(ActivityClass::kCompute, 1, "late", 120, 130)};
  data.activities[3].bytes = 4096;
  data.memory_events = {Mem(10, 1, 100, true, "gathered"), Mem(20, 2, 50, true, "activation"),
                        Mem(60, 1, 100, false, "gathered"), Mem(70, 9, 30, false, "shard")};
  return data;
}

TEST(Summarize, MatchesHandComputedHtaValues) {
  auto timeline = MakeTimeline(HandTimeline());
  auto summary = Summarize(*timeline, {});
  ASSERT_TRUE(summary.ok()) << summary.status().message();
  ASSERT_EQ(summary->ranks.size(), 1u);
  EXPECT_EQ(summary->warmup_steps_excluded, 1);
  const RankSummary& r = summary->ranks[0];
  ASSERT_EQ(r.steps.size(), 1u);
  const StepSummary& s = r.steps[0];
  EXPECT_EQ(s.step, 1);
  EXPECT_NEAR(s.step_seconds, 100e-6, kTolerance);
  EXPECT_NEAR(s.compute_seconds, 50e-6, kTolerance);
  EXPECT_NEAR(s.communication_seconds, 35e-6, kTolerance);
  EXPECT_NEAR(s.overlap_seconds, 10e-6, kTolerance);
  EXPECT_NEAR(s.overlap_ratio, 10.0 / 35.0, kTolerance);
  EXPECT_NEAR(s.exposed_communication_seconds, 25e-6, kTolerance);
  EXPECT_NEAR(s.copy_seconds, 10e-6, kTolerance);
  EXPECT_NEAR(s.idle_seconds, 15e-6, kTolerance);
  ASSERT_TRUE(s.peak_memory.has_value());
  EXPECT_EQ(s.peak_memory->bytes, 180);
  EXPECT_EQ(s.peak_memory->at_ns, 20 * kUs);
  const std::vector<std::pair<std::string, int64_t>> by_kind = {
      {"gathered", 100}, {"shard", 30}, {"activation", 50}};
  EXPECT_EQ(s.peak_memory->by_kind, by_kind);
  EXPECT_TRUE(summary->report_only);
}

TEST(Summarize, RankFiguresCountActivitiesStartingInMeasuredWindows) {
  auto summary = Summarize(*MakeTimeline(HandTimeline()), {});
  ASSERT_TRUE(summary.ok());
  const RankSummary& r = summary->ranks[0];
  EXPECT_EQ(r.activities, 5);  // "late" starts after the step
  ASSERT_EQ(r.top_kernels.size(), 2u);
  EXPECT_EQ(r.top_kernels[0].name, "gemm");
  EXPECT_EQ(r.top_kernels[0].count, 2);
  EXPECT_EQ(r.top_kernels[0].total_ns, 60 * kUs);
  EXPECT_EQ(r.top_kernels[1].name, "ncclAllGather");
  EXPECT_EQ(r.top_kernels[1].total_ns, 45 * kUs);  // whole durations, not clipped
  ASSERT_EQ(r.copies.size(), 1u);
  EXPECT_EQ(r.copies[0].bytes, 4096);
  ASSERT_EQ(r.streams.size(), 4u);
  EXPECT_EQ(r.streams[0].name, "compute");
  EXPECT_EQ(r.streams[1].name, "stream 2");
  EXPECT_EQ(r.streams[2].busy_ns, 45 * kUs);
}

TEST(Summarize, WithoutStepsOneWindowOverTheWholeSpan) {
  TimelineData data = HandTimeline();
  data.steps.clear();
  auto summary = Summarize(*MakeTimeline(std::move(data)), {});
  ASSERT_TRUE(summary.ok());
  const StepSummary& s = summary->ranks[0].steps.at(0);
  EXPECT_EQ(s.start_ns, 0);
  EXPECT_EQ(s.end_ns, 130 * kUs);
  // C = [0, 50) + [120, 130), N = [40, 70) + [95, 110), M = [80, 90).
  EXPECT_NEAR(s.compute_seconds, 60e-6, kTolerance);
  EXPECT_NEAR(s.communication_seconds, 45e-6, kTolerance);
  EXPECT_NEAR(s.exposed_communication_seconds, 35e-6, kTolerance);
  EXPECT_NEAR(s.idle_seconds, (130 - 105) * 1e-6, kTolerance);
  EXPECT_EQ(s.peak_memory->bytes, 180);
  bool noted = false;
  for (const std::string& note : summary->notes) noted = noted || note.find("no step") == 0;
  EXPECT_TRUE(noted);
}

// The streaming sweep flushes every few thousand intervals; compare it with whole-array unions
// on a long random timeline with several windows.
TEST(Summarize, StreamingMatchesWholeArrayUnions) {
  using analyzer_internal::IntersectionLength;
  using analyzer_internal::TotalLength;
  using analyzer_internal::UnionOf;
  using Interval = analyzer_internal::Interval<int64_t>;
  std::mt19937_64 random(7);
  TimelineData data;
  data.path = "random";
  data.ranks.push_back({0, 0, "", 0});
  std::vector<Interval> by_kind[3];
  int64_t t = 0;
  for (int i = 0; i < 50000; ++i) {
    t += static_cast<int64_t>(random() % 50);
    const int64_t duration = 1 + static_cast<int64_t>(random() % 400);
    const auto kind = static_cast<ActivityClass>(random() % 3);
    data.activities.push_back(Act(kind, static_cast<int>(kind), "k", 0, 0));
    data.activities.back().start_ns = t;
    data.activities.back().end_ns = t + duration;
    by_kind[static_cast<int>(kind)].push_back({t, t + duration});
  }
  const int64_t windows[][2] = {{1000, 300000}, {300000, 900000}, {950000, t / 2 + 7}};
  for (int w = 0; w < 3; ++w) data.steps.push_back({0, w, windows[w][0], windows[w][1], false});
  auto summary = Summarize(*MakeTimeline(std::move(data)), {});
  ASSERT_TRUE(summary.ok()) << summary.status().message();
  for (int w = 0; w < 3; ++w) {
    auto clip = [&](const std::vector<Interval>& v) {
      std::vector<Interval> out;
      for (const Interval& i : UnionOf(v)) {
        const int64_t a = std::max(i.start, windows[w][0]), b = std::min(i.end, windows[w][1]);
        if (b > a) out.push_back({a, b});
      }
      return out;
    };
    const auto c = clip(by_kind[0]), n = clip(by_kind[1]), m = clip(by_kind[2]);
    std::vector<Interval> all = c;
    all.insert(all.end(), n.begin(), n.end());
    all.insert(all.end(), m.begin(), m.end());
    const StepSummary& s = summary->ranks[0].steps.at(w);
    EXPECT_NEAR(s.compute_seconds, TotalLength(c) * 1e-9, kTolerance);
    EXPECT_NEAR(s.communication_seconds, TotalLength(n) * 1e-9, kTolerance);
    EXPECT_NEAR(s.overlap_seconds, IntersectionLength(c, n) * 1e-9, kTolerance);
    EXPECT_NEAR(s.copy_seconds, TotalLength(m) * 1e-9, kTolerance);
    EXPECT_NEAR(s.idle_seconds, (windows[w][1] - windows[w][0] - TotalLength(UnionOf(all))) * 1e-9,
                kTolerance);
  }
}

TEST(Summarize, OutOfOrderActivitiesAreAnError) {
  class Unordered : public Timeline {
   public:
    const std::string& path() const override { return path_; }
    TimelineFormat format() const override { return TimelineFormat::kKineto; }
    const std::vector<TimelineRank>& ranks() const override { return ranks_; }
    const std::vector<TimelineStep>& steps() const override { return steps_; }
    const proto::Schedule* schedule() const override { return nullptr; }
    const std::vector<std::string>& notes() const override { return notes_; }
    const std::vector<SkippedRecords>& skipped() const override { return skipped_; }
    int64_t dropped_records() const override { return 0; }
    std::string StreamName(int, int64_t) const override { return ""; }
    Status ForEachActivity(const ActivityOptions&,
                           const std::function<void(const TimelineActivity&)>& fn) const override {
      fn(Act(ActivityClass::kCompute, 1, "b", 50, 60));
      fn(Act(ActivityClass::kCompute, 1, "a", 10, 20));
      return Status::Ok();
    }
    Status ForEachMemoryEvent(
        const std::function<void(const TimelineMemoryEvent&)>&) const override {
      return Status::Ok();
    }

   private:
    std::string path_ = "unordered";
    std::vector<TimelineRank> ranks_{{0, 0, "", 0}};
    std::vector<TimelineStep> steps_;
    std::vector<std::string> notes_;
    std::vector<SkippedRecords> skipped_;
  };
  auto summary = Summarize(Unordered(), {});
  ASSERT_FALSE(summary.ok());
  EXPECT_NE(summary.status().message().find("unordered: "), std::string::npos);
}

TEST(Summarize, DcTraceAgreesWithTheProfile) {
  testing::TempDir dir;
  const std::string path = testing::WriteProfileTrace(dir);
  ASSERT_FALSE(path.empty());
  auto trace = Trace::Open(path);
  ASSERT_TRUE(trace.ok());
  auto profile = BuildProfile(**trace);
  ASSERT_TRUE(profile.ok());
  auto timeline = OpenTraceTimeline(path);
  ASSERT_TRUE(timeline.ok()) << timeline.status().message();
  auto summary = Summarize(**timeline, {});
  ASSERT_TRUE(summary.ok()) << summary.status().message();
  EXPECT_FALSE(summary->report_only);
  EXPECT_EQ(summary->warmup_steps_excluded, 2);
  std::vector<StepSummary> steps;
  for (const RankSummary& r : summary->ranks)
    steps.insert(steps.end(), r.steps.begin(), r.steps.end());
  ASSERT_EQ(steps.size(), profile->overlap.size());
  for (size_t i = 0; i < steps.size(); ++i) {
    const StepOverlap& o = profile->overlap[i];
    EXPECT_EQ(steps[i].step, o.step);
    EXPECT_NEAR(steps[i].compute_seconds, o.compute_seconds, kTolerance);
    EXPECT_NEAR(steps[i].communication_seconds, o.communication_seconds, kTolerance);
    EXPECT_NEAR(steps[i].exposed_communication_seconds, o.exposed_communication_seconds,
                kTolerance);
    EXPECT_NEAR(steps[i].copy_seconds, o.copy_seconds, kTolerance);
    EXPECT_NEAR(steps[i].idle_seconds, o.idle_seconds, kTolerance);
  }
  // Rank 0's memory (test_traces.h): 50 B shard live before the capture, 100 B gathered and
  // 30 B activation at 20 ns, all freed but a 10 B input by 40 ns; steps start at 10000 ns: 40 B.
  EXPECT_EQ(summary->ranks[0].steps[0].peak_memory->bytes, 40);
  EXPECT_EQ(timeline.value()->StreamName(0, proto::STREAM_GATHER), "gather");
}

// A corrupt row is left out and counted: a warning in the text and in the JSON (issue 13).
TEST(Summarize, SkippedRowsAreWarningsInTextAndJson) {
  testing::TempDir dir;
  const std::string path = testing::WriteProfileTrace(dir);
  ASSERT_FALSE(path.empty());
  sqlite3* db = nullptr;
  ASSERT_EQ(sqlite3_open(path.c_str(), &db), SQLITE_OK);
  ASSERT_EQ(sqlite3_exec(db,
                         "UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET end = start - 1 WHERE rowid IN "
                         "(1, 2); UPDATE CUDA_GPU_MEMORY_USAGE_EVENTS SET bytes = -8 WHERE "
                         "rowid = 1",
                         nullptr, nullptr, nullptr),
            SQLITE_OK);
  sqlite3_close(db);
  auto timeline = OpenTraceTimeline(path);
  ASSERT_TRUE(timeline.ok()) << timeline.status().message();
  auto summary = Summarize(**timeline, {});
  ASSERT_TRUE(summary.ok()) << summary.status().message();
  const nlohmann::json j = SummaryJson(*summary);
  EXPECT_EQ(j["skipped_records"], 3);
  ASSERT_EQ(j["skipped"].size(), 2u);
  EXPECT_EQ(j["skipped"][0]["source"], "CUPTI_ACTIVITY_KIND_KERNEL");
  EXPECT_EQ(j["skipped"][0]["problem"], "end before start");
  EXPECT_EQ(j["skipped"][0]["count"], 2);
  const std::string text = SummaryText(*summary);
  EXPECT_NE(text.find("warning: CUPTI_ACTIVITY_KIND_KERNEL: 2 record(s) skipped (end before "
                      "start)"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("warning: CUDA_GPU_MEMORY_USAGE_EVENTS: 1 record(s) skipped"),
            std::string::npos)
      << text;
}

// Sums over many records are checked: corrupt values give an error, never a wrapped number.
TEST(Summarize, SumsPastSixtyFourBitsAreAnError) {
  TimelineData data;
  data.path = "long";
  data.ranks.push_back({0, 0, "", 0});
  constexpr int64_t kLong = int64_t{1} << 61;
  for (int i = 0; i < 5; ++i) {
    TimelineActivity a;
    a.name = "forever";
    a.start_ns = -kLong + i;
    a.end_ns = kLong;
    data.activities.push_back(a);
  }
  auto summary = Summarize(*MakeTimeline(std::move(data)), {});
  ASSERT_FALSE(summary.ok());
  EXPECT_EQ(summary.status().message().rfind("long: the summed times or bytes of forever", 0), 0u)
      << summary.status().message();

  TimelineData memory = HandTimeline();
  memory.path = "huge";
  for (int i = 0; i < 5000; ++i) {
    memory.memory_events.push_back(Mem(1, 1000 + i, int64_t{1} << 50, true, "activation"));
  }
  summary = Summarize(*MakeTimeline(std::move(memory)), {});
  ASSERT_FALSE(summary.ok());
  EXPECT_EQ(summary.status().message(),
            "huge: live device memory passes 4 EiB; the trace's byte counts are corrupt, record "
            "it again");
}

TEST(Summarize, DcTraceInstructionsByName) {
  testing::TempDir dir;
  const std::string path = testing::WriteProfileTrace(dir);
  auto timeline = OpenTraceTimeline(path);
  ASSERT_TRUE(timeline.ok());
  SummaryOptions options;
  options.by_instruction = true;
  auto summary = Summarize(**timeline, options);
  ASSERT_TRUE(summary.ok());
  std::map<std::string, NameStat> by_name;
  for (const NameStat& s : summary->by_instruction) by_name[s.name] = s;
  // 2 ranks x 3 measured steps; fwd0 ran 100+300+200 and 400+500+600 ns.
  ASSERT_TRUE(by_name.contains("fwd0"));
  EXPECT_EQ(by_name["fwd0"].count, 6);
  EXPECT_EQ(by_name["fwd0"].total_ns, 2100);
  EXPECT_TRUE(by_name.contains("all_gather w0"));
  EXPECT_TRUE(by_name.contains("offload m0"));
}

// The real nsys export: one process, 5 saxpy kernels and 15 copies on stream 7.
class NsysExport : public ::testing::Test {
 protected:
  static constexpr char kPath[] = "/work/shared/data/nsys/saxpy-mpi-cuda.sqlite";
  void SetUp() override {
    if (FILE* f = std::fopen(kPath, "rb")) {
      std::fclose(f);
    } else {
      GTEST_SKIP() << kPath << " not present";
    }
  }
  static int64_t SqlInt(const std::string& sql) {
    sqlite3* db = nullptr;
    sqlite3_open_v2(kPath, &db, SQLITE_OPEN_READONLY, nullptr);
    sqlite3_stmt* stmt = nullptr;
    sqlite3_prepare_v2(db, sql.c_str(), -1, &stmt, nullptr);
    int64_t value = -1;
    if (sqlite3_step(stmt) == SQLITE_ROW) value = sqlite3_column_int64(stmt, 0);
    sqlite3_finalize(stmt);
    sqlite3_close(db);
    return value;
  }
};

TEST_F(NsysExport, SummaryMatchesSql) {
  auto timeline = OpenTraceTimeline(kPath);
  ASSERT_TRUE(timeline.ok()) << timeline.status().message();
  auto summary = Summarize(**timeline, {});
  ASSERT_TRUE(summary.ok()) << summary.status().message();
  EXPECT_TRUE(summary->report_only);
  ASSERT_EQ(summary->ranks.size(), 1u);
  const RankSummary& r = summary->ranks[0];
  ASSERT_EQ(r.top_kernels.size(), 1u);
  EXPECT_EQ(r.top_kernels[0].name, "saxpy");
  EXPECT_EQ(r.top_kernels[0].count, 5);
  EXPECT_EQ(r.top_kernels[0].total_ns,
            SqlInt("SELECT SUM(end - start) FROM CUPTI_ACTIVITY_KIND_KERNEL"));
  int64_t copy_bytes = 0;
  for (const NameStat& c : r.copies) copy_bytes += c.bytes;
  EXPECT_EQ(copy_bytes, 3932160000);
  EXPECT_EQ(copy_bytes, SqlInt("SELECT SUM(bytes) FROM CUPTI_ACTIVITY_KIND_MEMCPY"));
  // Per-stream busy time: the stream's records never overlap, so the union is their sum.
  ASSERT_EQ(r.streams.size(), 1u);
  EXPECT_EQ(r.streams[0].stream_id, 7);
  EXPECT_EQ(r.streams[0].activities, 20);
  EXPECT_EQ(r.streams[0].busy_ns,
            SqlInt("SELECT SUM(d) FROM (SELECT end - start AS d FROM CUPTI_ACTIVITY_KIND_KERNEL "
                   "WHERE streamId = 7 UNION ALL SELECT end - start FROM "
                   "CUPTI_ACTIVITY_KIND_MEMCPY WHERE streamId = 7)"));
  const StepSummary& s = r.steps.at(0);
  EXPECT_EQ(s.end_ns - s.start_ns,
            SqlInt("SELECT MAX(e) - MIN(s) FROM (SELECT start AS s, end AS e FROM "
                   "CUPTI_ACTIVITY_KIND_KERNEL UNION ALL SELECT start, end FROM "
                   "CUPTI_ACTIVITY_KIND_MEMCPY)"));
  EXPECT_EQ(s.communication_seconds, 0);
  EXPECT_FALSE(s.peak_memory.has_value());  // the export has no memory events
}

TEST(Diff, ATimelineWithItselfChangesNothing) {
  auto a = MakeTimeline(HandTimeline());
  auto diff = DiffTimelines(*a, *a, 10, nullptr);
  ASSERT_TRUE(diff.ok());
  EXPECT_EQ(diff->changed, 0);
  EXPECT_TRUE(diff->rows.empty());
  EXPECT_EQ(DiffJson(*diff)["change"]["step_seconds"], 0.0);
}

TEST(Diff, ListsTheLargestChangesFirst) {
  TimelineData slower = HandTimeline();
  slower.activities[0].end_ns += 10 * kUs;  // one gemm 10 us longer
  slower.activities[3].end_ns += 2 * kUs;   // the copy 2 us longer
  slower.activities.push_back(Act(ActivityClass::kCompute, 1, "new_kernel", 91, 92));
  auto a = MakeTimeline(HandTimeline());
  auto b = MakeTimeline(std::move(slower));
  auto diff = DiffTimelines(*a, *b, 2, nullptr);
  ASSERT_TRUE(diff.ok());
  EXPECT_EQ(diff->changed, 3);
  EXPECT_EQ(diff->only_b, 1);
  ASSERT_EQ(diff->rows.size(), 2u);
  EXPECT_EQ(diff->rows[0].name, "gemm");
  EXPECT_NEAR(diff->rows[0].change_seconds, 10e-6, kTolerance);
  EXPECT_EQ(diff->rows[1].name, "[CUDA memcpy Device-to-Host]");
}

TEST(Output, JsonAndTextAreDeterministic) {
  auto summary = Summarize(*MakeTimeline(HandTimeline()), {});
  ASSERT_TRUE(summary.ok());
  const nlohmann::json j = SummaryJson(*summary);
  EXPECT_EQ(j["format"], "nsys");
  EXPECT_EQ(j["ranks"][0]["steps"][0]["peak_memory"]["bytes"], 180);
  EXPECT_EQ(j["ranks"][0]["top_kernels"][0]["name"], "gemm");
  auto again = Summarize(*MakeTimeline(HandTimeline()), {});
  EXPECT_EQ(SummaryJson(*again).dump(), j.dump());
  EXPECT_EQ(SummaryText(*again), SummaryText(*summary));
}

TEST(InstructionName, NamesComputeByOpAndOthersByKindAndTensor) {
  const proto::Schedule schedule = testing::ProfileSchedule();
  EXPECT_EQ(InstructionName(schedule, 0), "all_gather w0");
  EXPECT_EQ(InstructionName(schedule, 1), "fwd0");
  EXPECT_EQ(InstructionName(schedule, 99), "instruction 99");
}

TEST(InstructionParts, ABucketedCollectiveIsSharedByItsTensorsBytes) {
  proto::Schedule schedule = testing::ProfileSchedule();
  schedule.mutable_program()->mutable_tensors(1)->set_shape(0, 768);  // a0: 3x w0's bytes
  proto::Instruction* bucket = schedule.add_instructions();
  bucket->set_kind(proto::INSTR_ALL_GATHER);
  bucket->add_tensors(0);
  bucket->add_tensors(1);
  const int index = schedule.instructions_size() - 1;
  EXPECT_EQ(InstructionName(schedule, index), "all_gather w0 +1");
  const std::vector<InstructionPart> parts = InstructionParts(schedule, index);
  ASSERT_EQ(parts.size(), 2u);
  EXPECT_EQ(parts[0].name, "all_gather w0");  // the name a single gather of w0 has
  EXPECT_NEAR(parts[0].share, 0.25, kTolerance);
  EXPECT_EQ(parts[1].name, "all_gather a0");
  EXPECT_NEAR(parts[1].share, 0.75, kTolerance);
  const std::vector<InstructionPart> compute = InstructionParts(schedule, 1);
  ASSERT_EQ(compute.size(), 1u);
  EXPECT_EQ(compute[0].name, "fwd0");
  EXPECT_EQ(compute[0].share, 1);
}

TEST(DetectInput, ByContent) {
  testing::TempDir dir;
  auto write = [&](const std::string& name, const std::string& bytes) {
    std::FILE* f = std::fopen(dir.File(name).c_str(), "wb");
    std::fwrite(bytes.data(), 1, bytes.size(), f);
    std::fclose(f);
    return dir.File(name);
  };
  EXPECT_EQ(*DetectInput(write("a.db", std::string("SQLite format 3\0", 16))), InputKind::kTrace);
  EXPECT_EQ(*DetectInput(write("plan", "DCPLAN\r\nxxxx")), InputKind::kPlan);
  EXPECT_EQ(*DetectInput(write("t", "  {\"traceEvents\": []}")), InputKind::kKineto);
  EXPECT_EQ(*DetectInput(write("t.gz", "\x1f\x8b\x08")), InputKind::kKineto);
  auto missing = DetectInput(dir.File("missing"));
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("missing: cannot open"), std::string::npos);
}

// A synthetic plan re-simulated with the hardware profile and cluster it was made with gives its
// own prediction, and says so; another cluster shape is named as not the plan's costs.
TEST(CostsForPlan, TheHardwareAPlanWasMadeWithGivesItsPrediction) {
  auto config = MakeConfig("tiny", {});
  ASSERT_TRUE(config.ok());
  auto program = BuildProgram(*config);
  ASSERT_TRUE(program.ok());
  auto hw = FindHardware("h100-sxm");
  auto cluster = MakeCluster(16, 8);
  ASSERT_TRUE(hw.ok() && cluster.ok());
  PlanRequest request;
  request.world_size = 16;
  request.costs = EstimateCostModel(*program, *hw, *cluster);
  request.profile_digest = Sha256Hex(CostModelText(request.costs));
  request.policy = "dc";
  request.program = *program;
  auto plan = MakePlan(request);
  ASSERT_TRUE(plan.ok()) << plan.status().message();

  auto source = [](const std::string& trace, const std::string& hardware, int gpus_per_node) {
    PlanCostSource source;
    source.profile_trace = trace;
    source.hardware = hardware;
    source.gpus_per_node = gpus_per_node;
    return source;
  };
  auto own = CostsForPlan(*plan, source("", "h100-sxm", 8));
  ASSERT_TRUE(own.ok()) << own.status().message();
  EXPECT_NE(own->note.find("the costs the plan was made with"), std::string::npos) << own->note;
  EXPECT_EQ(own->note.find("not the costs"), std::string::npos) << own->note;
  auto sim = Simulate(*plan, own->costs);
  ASSERT_TRUE(sim.ok());
  EXPECT_DOUBLE_EQ(sim->step_seconds, plan->prediction().step_seconds());

  auto other = CostsForPlan(*plan, source("", "h100-sxm", 4));
  ASSERT_TRUE(other.ok());
  EXPECT_NE(other->note.find("not the costs the plan was made with"), std::string::npos)
      << other->note;

  auto both = CostsForPlan(*plan, source("t.db", "h100-sxm", 8));
  ASSERT_FALSE(both.ok());
  EXPECT_NE(both.status().message().find("pass one"), std::string::npos);
  EXPECT_FALSE(CostsForPlan(*plan, source("", "no-such-gpu", 8)).ok());
  auto odd = CostsForPlan(*plan, source("", "h100-sxm", 3));
  EXPECT_FALSE(odd.ok());  // 16 ranks are not whole nodes of 3

  // Told nothing, the plan's profile digest finds the built-in profile and node shape it was
  // made with, whatever --gpus-per-node says.
  for (int per_node : {8, 2}) {
    auto found = CostsForPlan(*plan, source("", "", per_node));
    ASSERT_TRUE(found.ok()) << found.status().message();
    EXPECT_NE(found->note.find("h100-sxm on 2 node(s) of 8 rank(s): the costs the plan was made "
                               "with (found by its profile digest)"),
              std::string::npos)
        << found->note;
    auto resimulated = Simulate(*plan, found->costs);
    ASSERT_TRUE(resimulated.ok());
    EXPECT_DOUBLE_EQ(resimulated->step_seconds, plan->prediction().step_seconds());
  }
  // A plan whose costs no built-in profile gives is re-simulated with the default model, and
  // says so.
  proto::Schedule foreign = *plan;
  foreign.set_profile_digest(std::string(64, '0'));
  auto fallback = CostsForPlan(foreign, source("", "", 8));
  ASSERT_TRUE(fallback.ok());
  EXPECT_NE(fallback->note.find("default cost model"), std::string::npos) << fallback->note;
}
}  // namespace
}  // namespace dc
