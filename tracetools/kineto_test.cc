#include "analyzer/kineto.h"

#include <gtest/gtest.h>
#include <zlib.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "tests/support/test_traces.h"
#include "tracetools/report.h"

namespace dc {
namespace {

constexpr double kTolerance = 1e-12;

// PyTorch profiler output for one rank, with the timeline of report_test.cc's HandTimeline
// moved to start at 1000 us: ProfilerStep#1 over [1000, 1100) us; compute [1000, 1030) on
// stream 7 and [1020, 1050) on stream 8; NCCL [1040, 1070) and [1095, 1110) on stream 9; a
// device-to-host copy [1080, 1090) on stream 10; a kernel at 1120 after the step; caching
// allocator events: 30 B freed at 1070 that were never seen allocated, 100 B from 1010 to 1060,
// 50 B from 1020; CPU ops, CPU memory and flow events that must be ignored.
std::string KinetoJson(int rank) {
  return R"json({"schemaVersion": 1,
  "deviceProperties": [{"id": 0, "name": "NVIDIA H100 80GB HBM3", "totalGlobalMem": 85031714816}],
  "distributedInfo": {"backend": "nccl", "rank": )json" +
         std::to_string(rank) + R"json(, "world_size": 2},
  "traceEvents": [
    {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 9, "tid": 9, "ts": 1000.0, "dur": 100.0},
    {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 9, "tid": 9, "ts": 1001.0, "dur": 500.0},
    {"ph": "X", "cat": "kernel", "name": "gemm", "pid": 0, "tid": 7, "ts": 1000.0, "dur": 30.0, "args": {"device": 0, "stream": 7}},
    {"ph": "X", "cat": "kernel", "name": "gemm", "pid": 0, "tid": 8, "ts": 1020.0, "dur": 30.0, "args": {"device": 0, "stream": 8}},
    {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllGather_RING_LL", "pid": 0, "tid": 9, "ts": 1040.0, "dur": 30.0, "args": {"device": 0, "stream": 9}},
    {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "pid": 0, "tid": 10, "ts": 1080.0, "dur": 10.0, "args": {"device": 0, "stream": 10, "bytes": 4096}},
    {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllGather_RING_LL", "pid": 0, "tid": 9, "ts": 1095.0, "dur": 15.0, "args": {"device": 0, "stream": 9}},
    {"ph": "X", "cat": "kernel", "name": "late", "pid": 0, "tid": 7, "ts": 1120.0, "dur": 10.0, "args": {"device": 0, "stream": 7}},
    {"ph": "i", "s": "t", "name": "[memory]", "pid": 9, "tid": 9, "ts": 1010.0, "args": {"Device Type": 1, "Device Id": 0, "Addr": 1, "Bytes": 100, "Total Allocated": 130}},
    {"ph": "i", "s": "t", "name": "[memory]", "pid": 9, "tid": 9, "ts": 1020.0, "args": {"Device Type": 1, "Device Id": 0, "Addr": 2, "Bytes": 50, "Total Allocated": 180}},
    {"ph": "i", "s": "t", "name": "[memory]", "pid": 9, "tid": 9, "ts": 1030.0, "args": {"Device Type": 0, "Device Id": -1, "Addr": 5, "Bytes": 999999, "Total Allocated": 999999}},
    {"ph": "i", "s": "t", "name": "[memory]", "pid": 9, "tid": 9, "ts": 1060.0, "args": {"Device Type": 1, "Device Id": 0, "Addr": 1, "Bytes": -100, "Total Allocated": 80}},
    {"ph": "i", "s": "t", "name": "[memory]", "pid": 9, "tid": 9, "ts": 1070.0, "args": {"Device Type": 1, "Device Id": 0, "Addr": 9, "Bytes": -30, "Total Allocated": 50}},
    {"ph": "M", "name": "thread_name", "pid": 0, "tid": 7, "args": {"name": "stream 7"}},
    {"ph": "s", "id": 1, "pid": 9, "tid": 9, "ts": 1001.0, "cat": "ac2g", "name": "ac2g"},
    {"ph": "f", "id": 1, "pid": 0, "tid": 7, "ts": 1000.0, "cat": "ac2g", "name": "ac2g", "bp": "e"}
  ],
  "traceName": "rank.json"})json";
}

void WriteText(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
}

void WriteGzip(const std::string& path, const std::string& text) {
  gzFile gz = gzopen(path.c_str(), "wb");
  gzwrite(gz, text.data(), static_cast<unsigned>(text.size()));
  gzclose(gz);
}

StatusOr<Summary> SummaryOf(const std::vector<std::string>& paths) {
  DC_ASSIGN_OR_RETURN(std::unique_ptr<Timeline> timeline, OpenKinetoTimeline(paths, nullptr));
  return Summarize(*timeline, {});
}

void ExpectHandValues(const Summary& summary) {
  EXPECT_EQ(summary.format, TimelineFormat::kKineto);
  EXPECT_TRUE(summary.report_only);
  const RankSummary& r = summary.ranks.at(0);
  EXPECT_EQ(r.rank.device, "NVIDIA H100 80GB HBM3");
  EXPECT_EQ(r.rank.device_memory_bytes, 85031714816);
  const StepSummary& s = r.steps.at(0);
  EXPECT_EQ(s.step, 1);
  EXPECT_EQ(s.start_ns, 0);  // the run's earliest event is the origin
  EXPECT_NEAR(s.step_seconds, 100e-6, kTolerance);
  EXPECT_NEAR(s.compute_seconds, 50e-6, kTolerance);
  EXPECT_NEAR(s.communication_seconds, 35e-6, kTolerance);
  EXPECT_NEAR(s.overlap_seconds, 10e-6, kTolerance);
  EXPECT_NEAR(s.overlap_ratio, 10.0 / 35.0, kTolerance);
  EXPECT_NEAR(s.exposed_communication_seconds, 25e-6, kTolerance);
  EXPECT_NEAR(s.copy_seconds, 10e-6, kTolerance);
  EXPECT_NEAR(s.idle_seconds, 15e-6, kTolerance);
  ASSERT_TRUE(s.peak_memory.has_value());
  EXPECT_EQ(s.peak_memory->bytes, 180);  // CPU allocations are not device memory
  EXPECT_EQ(s.peak_memory->at_ns, 20000);
  ASSERT_EQ(r.top_kernels.size(), 2u);
  EXPECT_EQ(r.top_kernels[0].name, "gemm");
  EXPECT_EQ(r.top_kernels[1].kind, ActivityClass::kCommunication);
  ASSERT_EQ(r.copies.size(), 1u);
  EXPECT_EQ(r.copies[0].bytes, 4096);
  ASSERT_EQ(r.streams.size(), 4u);
  EXPECT_EQ(r.streams[0].name, "stream 7");
}

TEST(Kineto, JsonGivesTheHandComputedSummary) {
  testing::TempDir dir;
  WriteText(dir.File("rank0.json"), KinetoJson(0));
  auto summary = SummaryOf({dir.File("rank0.json")});
  ASSERT_TRUE(summary.ok()) << summary.status().message();
  ExpectHandValues(*summary);
}

TEST(Kineto, GzipGivesTheSameSummary) {
  testing::TempDir dir;
  WriteText(dir.File("rank0.json"), KinetoJson(0));
  WriteGzip(dir.File("rank0.json.gz"), KinetoJson(0));
  auto plain = SummaryOf({dir.File("rank0.json")});
  auto gz = SummaryOf({dir.File("rank0.json.gz")});
  ASSERT_TRUE(gz.ok()) << gz.status().message();
  ExpectHandValues(*gz);
  nlohmann::json a = SummaryJson(*plain), b = SummaryJson(*gz);
  a.erase("path");
  b.erase("path");
  EXPECT_EQ(a.dump(), b.dump());
}

TEST(Kineto, OneFilePerRankOrderedByDistributedRank) {
  testing::TempDir dir;
  WriteText(dir.File("a.json"), KinetoJson(1));
  WriteGzip(dir.File("b.json.gz"), KinetoJson(0));
  auto data = ReadKinetoTraces({dir.File("a.json"), dir.File("b.json.gz")}, nullptr);
  ASSERT_TRUE(data.ok()) << data.status().message();
  ASSERT_EQ(data->ranks.size(), 2u);
  EXPECT_EQ(data->ranks[0].rank, 0);
  EXPECT_EQ(data->ranks[1].rank, 1);
  // A directory reads the same files.
  std::filesystem::create_directory(dir.File("run"));
  WriteText(dir.File("run/r1.json"), KinetoJson(1));
  WriteText(dir.File("run/r0.json"), KinetoJson(0));
  WriteText(dir.File("run/notes.txt"), "not a trace");
  auto summary = SummaryOf({dir.File("run")});
  ASSERT_TRUE(summary.ok()) << summary.status().message();
  ASSERT_EQ(summary->ranks.size(), 2u);
  EXPECT_EQ(summary->measured_windows, 2);
}

TEST(Kineto, WithoutStepMarkersOneWindowOverTheSpan) {
  testing::TempDir dir;
  std::string text = KinetoJson(0);
  text.replace(text.find("ProfilerStep#1"), 14, "forward");
  WriteText(dir.File("t.json"), text);
  auto summary = SummaryOf({dir.File("t.json")});
  ASSERT_TRUE(summary.ok()) << summary.status().message();
  const StepSummary& s = summary->ranks[0].steps.at(0);
  EXPECT_EQ(s.start_ns, 0);
  EXPECT_EQ(s.end_ns, 130000);
}

Status ReadError(const std::string& path) { return ReadKinetoTraces({path}, nullptr).status(); }

TEST(Kineto, BadInputNamesTheFileInOneLine) {
  testing::TempDir dir;
  struct Case {
    std::string name, content, expect;
    bool gzip = false;
  };
  const std::string full = KinetoJson(0);
  const std::vector<Case> cases = {
      {"other.json", R"({"name": "not a trace", "events": []})",
       "no traceEvents array; is this a PyTorch profiler trace?"},
      {"array.json", R"([{"ph": "X"}])", "no traceEvents array"},
      {"broken.json", R"({"traceEvents": [{"ph": "X", )", "invalid JSON (parse error at line 1"},
      {"cpu_only.json", R"({"traceEvents": [{"ph": "X", "cat": "cpu_op", "ts": 1, "dur": 2}]})",
       "no GPU kernels, copies or memsets"},
      {"empty.json", "", "invalid JSON"},
      // Numbers out of range (issue 13): no double holds 1e400; the rest break limits.h.
      {"huge.json", R"({"traceEvents": [{"ph": "X", "cat": "kernel", "ts": 1e400, "dur": 1}]})",
       "invalid JSON (number overflow"},
      {"far.json",
       R"({"traceEvents": [{"ph": "X", "cat": "kernel", "ts": 1, "dur": 1},
                           {"ph": "X", "cat": "kernel", "ts": 1e300, "dur": 1}]})",
       "traceEvents[1]: ts 1.0000000000000001e+300 is out of range"},
      {"nan.json", R"({"traceEvents": [{"ph": "X", "cat": "kernel", "ts": "nan", "dur": 1}]})",
       "traceEvents[0]: ts nan is out of range"},
      {"negative_dur.json",
       R"({"traceEvents": [{"ph": "X", "cat": "kernel", "ts": 1, "dur": -5}]})",
       "traceEvents[0]: dur -5 is out of range"},
      {"stream.json",
       R"({"traceEvents": [{"ph": "X", "cat": "kernel", "ts": 1, "dur": 1,
                            "args": {"stream": 1e30}}]})",
       "traceEvents[0]: stream 1e+30 is out of range"},
      {"bytes.json",
       R"({"traceEvents": [{"ph": "X", "cat": "gpu_memcpy", "ts": 1, "dur": 1,
                            "args": {"bytes": -9e18}}]})",
       "traceEvents[0]: bytes -9e+18 is out of range"},
      {"memory.json",
       R"({"traceEvents": [{"ph": "X", "cat": "kernel", "ts": 1, "dur": 1},
                           {"ph": "i", "name": "[memory]", "ts": 2,
                            "args": {"Bytes": -9.3e18, "Addr": 1, "Device Type": 1}}]})",
       "traceEvents[1]: Bytes -9.3e+18 is out of range"},
      {"step.json",
       R"({"traceEvents": [{"ph": "X", "cat": "kernel", "ts": 1, "dur": 1},
                           {"ph": "X", "cat": "user_annotation", "ts": 1, "dur": 1,
                            "name": "ProfilerStep#99999999999"}]})",
       "traceEvents[1]: step marker 'ProfilerStep#99999999999' has no step number in range"},
      {"rank.json",
       R"({"distributedInfo": {"rank": 1e12},
           "traceEvents": [{"ph": "X", "cat": "kernel", "ts": 1, "dur": 1}]})",
       "rank 1000000000000 is out of range"},
      {"span.json",
       R"({"traceEvents": [{"ph": "X", "cat": "kernel", "ts": -2e15, "dur": 1},
                           {"ph": "X", "cat": "kernel", "ts": 2e15, "dur": 1}]})",
       "events span more than 73 years"},
  };
  for (const Case& c : cases) {
    WriteText(dir.File(c.name), c.content);
    const Status status = ReadError(dir.File(c.name));
    ASSERT_FALSE(status.ok()) << c.name;
    EXPECT_EQ(status.message().find(dir.File(c.name) + ": "), 0u) << status.message();
    EXPECT_NE(status.message().find(c.expect), std::string::npos) << status.message();
    EXPECT_EQ(status.message().find('\n'), std::string::npos) << status.message();
  }
}

TEST(Kineto, TruncatedGzipIsSaidSo) {
  testing::TempDir dir;
  WriteGzip(dir.File("whole.json.gz"), KinetoJson(0));
  std::ifstream in(dir.File("whole.json.gz"), std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), {});
  for (size_t keep : {bytes.size() / 2, bytes.size() - 4}) {
    WriteText(dir.File("cut.json.gz"), bytes.substr(0, keep));
    const Status status = ReadError(dir.File("cut.json.gz"));
    ASSERT_FALSE(status.ok());
    EXPECT_NE(status.message().find("cut.json.gz: truncated gzip"), std::string::npos)
        << status.message();
  }
  std::string corrupt = bytes;
  for (size_t i = 20; i < 60 && i < corrupt.size(); ++i)
    corrupt[i] = static_cast<char>(~corrupt[i]);
  WriteText(dir.File("corrupt.json.gz"), corrupt);
  const Status status = ReadError(dir.File("corrupt.json.gz"));
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.message().find("corrupt.json.gz: "), std::string::npos) << status.message();
}

TEST(Kineto, TwoFilesOfOneRankAreRefused) {
  testing::TempDir dir;
  WriteText(dir.File("a.json"), KinetoJson(3));
  WriteText(dir.File("b.json"), KinetoJson(3));
  const Status status =
      ReadKinetoTraces({dir.File("a.json"), dir.File("b.json")}, nullptr).status();
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.message().find("rank 3 again"), std::string::npos) << status.message();
}

}  // namespace
}  // namespace dc
