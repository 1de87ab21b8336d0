// dc-trace end to end: on a trace recorded by dc-collect, its plan, the real nsys export, and
// PyTorch profiler traces; bad input gives one line naming the file and a non-zero exit.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "tests/run_command.h"

namespace dc {
namespace {

using testing::FreshDir;
using testing::RunCommand;
using testing::Tool;
using json = nlohmann::json;

constexpr char kNsysExport[] = "/work/shared/data/nsys/saxpy-mpi-cuda.sqlite";

json ParseJson(const std::string& text) {
  json j = json::parse(text, nullptr, false);
  EXPECT_FALSE(j.is_discarded()) << "not JSON: " << text.substr(0, 500);
  return j;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << bytes;
}

int Lines(const std::string& text) {
  return static_cast<int>(std::count(text.begin(), text.end(), '\n'));
}

// A minimal Kineto trace: one step, a kernel, an NCCL kernel, a copy.
constexpr char kKineto[] = R"json({"distributedInfo": {"rank": 0},
  "traceEvents": [
    {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#0", "pid": 1, "tid": 1, "ts": 10, "dur": 100},
    {"ph": "X", "cat": "kernel", "name": "gemm", "pid": 0, "tid": 7, "ts": 10, "dur": 50, "args": {"stream": 7}},
    {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllGather_RING_LL", "pid": 0, "tid": 9, "ts": 40, "dur": 40, "args": {"stream": 9}},
    {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "pid": 0, "tid": 7, "ts": 90, "dur": 5, "args": {"stream": 7, "bytes": 1024}}
  ]})json";

class DcTrace : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = FreshDir("dc-trace");
    auto collect =
        RunCommand(Tool("dc-collect") +
                   " --backend cpu --model tiny --nproc 2 --steps 3 --warmup 1 -o " + Trace());
    ASSERT_EQ(collect.exit_code, 0) << collect.err;
    auto plan = RunCommand(Tool("dc-plan") + " " + Trace() + " --no-cache -o " + Plan());
    ASSERT_EQ(plan.exit_code, 0) << plan.err;
  }
  static std::string Trace() { return dir_ + "/trace.db"; }
  static std::string Plan() { return dir_ + "/plan.dcplan"; }
  static testing::CommandResult DcTraceRun(const std::string& args) {
    return RunCommand(Tool("dc-trace") + " " + args);
  }
  // dc-trace `args` must fail with one line naming `file` and containing `expect`.
  static void ExpectRefuses(const std::string& args, const std::string& file,
                            const std::string& expect) {
    auto r = DcTraceRun(args);
    EXPECT_EQ(r.exit_code, 1) << args << "\n" << r.err;
    EXPECT_EQ(Lines(r.err), 1) << r.err;
    EXPECT_EQ(r.err.find("dc-trace: " + file + ": "), 0u) << r.err;
    EXPECT_NE(r.err.find(expect), std::string::npos) << r.err;
  }
  static std::string dir_;
};
std::string DcTrace::dir_;

TEST_F(DcTrace, SummaryOfADcTrace) {
  auto r = DcTraceRun("summary " + Trace() + " --json --top 3");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json j = ParseJson(r.out);
  EXPECT_EQ(j["format"], "dc");
  EXPECT_EQ(j["report_only"], false);
  EXPECT_EQ(j["dropped_records"], 0);
  EXPECT_EQ(j["warmup_steps_excluded"], 2);
  ASSERT_EQ(j["ranks"].size(), 2u);
  for (const json& rank : j["ranks"]) {
    ASSERT_EQ(rank["steps"].size(), 3u);
    EXPECT_EQ(rank["top_kernels"].size(), 3u);
    for (const json& step : rank["steps"]) {
      EXPECT_GT(step["step_seconds"].get<double>(), 0);
      EXPECT_GT(step["compute_seconds"].get<double>(), 0);
      EXPECT_GT(step["communication_seconds"].get<double>(), 0);
      EXPECT_GE(step["idle_seconds"].get<double>(), -1e-12);
      EXPECT_GT(step["peak_memory"]["bytes"].get<int64_t>(), 0);
      EXPECT_LE(step["exposed_communication_seconds"].get<double>(),
                step["communication_seconds"].get<double>() + 1e-12);
    }
    std::set<std::string> streams;
    for (const json& s : rank["streams"]) streams.insert(s["name"]);
    EXPECT_TRUE(streams.contains("compute") && streams.contains("gather")) << rank["streams"];
  }
  auto text = DcTraceRun("summary " + Trace());
  ASSERT_EQ(text.exit_code, 0);
  EXPECT_NE(text.out.find("rank 1 (cpu)"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("top kernels"), std::string::npos);
}

TEST_F(DcTrace, SummaryOfTheNsysExportIsReportOnly) {
  if (!std::filesystem::exists(kNsysExport)) GTEST_SKIP() << kNsysExport << " not present";
  auto r = DcTraceRun(std::string("summary ") + kNsysExport + " --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json j = ParseJson(r.out);
  EXPECT_EQ(j["format"], "nsys");
  EXPECT_EQ(j["report_only"], true);
  const json& rank = j["ranks"][0];
  EXPECT_EQ(rank["top_kernels"][0]["name"], "saxpy");
  EXPECT_EQ(rank["top_kernels"][0]["count"], 5);
  int64_t bytes = 0;
  for (const json& c : rank["copies"]) bytes += c["bytes"].get<int64_t>();
  EXPECT_EQ(bytes, 3932160000);
  bool noted = false;
  for (const json& note : j["notes"])
    noted = noted || note.get<std::string>().find("report-only") != std::string::npos;
  EXPECT_TRUE(noted) << j["notes"];
}

void ExpectPerfetto(const json& j, size_t processes, bool flows) {
  std::set<int> pids;
  std::set<std::string> thread_names;
  std::map<int64_t, std::vector<std::string>> flow_phases;
  int counters = 0;
  for (const json& e : j["traceEvents"]) {
    if (e["ph"] == "M" && e["name"] == "process_name") pids.insert(e["pid"].get<int>());
    if (e["ph"] == "M" && e["name"] == "thread_name") thread_names.insert(e["args"]["name"]);
    if (e["ph"] == "C") ++counters;
    if (e["ph"] == "s" || e["ph"] == "f") flow_phases[e["id"]].push_back(e["ph"]);
  }
  EXPECT_EQ(pids.size(), processes);
  EXPECT_TRUE(thread_names.contains("compute") && thread_names.contains("gather"));
  EXPECT_GT(counters, 0);
  EXPECT_EQ(!flow_phases.empty(), flows);
  for (const auto& [id, phases] : flow_phases) {
    EXPECT_EQ(phases, (std::vector<std::string>{"s", "f"})) << id;
  }
}

TEST_F(DcTrace, PerfettoOfATraceAndOfAPlan) {
  const std::string out = dir_ + "/trace.json";
  auto r = DcTraceRun("perfetto " + Trace() + " -o " + out + " --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(ParseJson(r.out)["processes"], 2);
  ExpectPerfetto(ParseJson(ReadFile(out)), 2, true);
  const std::string predicted = dir_ + "/plan.json";
  auto p = DcTraceRun("perfetto " + Plan() + " -o " + predicted + " --profile " + Trace());
  ASSERT_EQ(p.exit_code, 0) << p.err;
  ExpectPerfetto(ParseJson(ReadFile(predicted)), 1, true);
}

TEST_F(DcTrace, MemorySvgOfATraceAndOfAPlan) {
  const std::string svg = dir_ + "/trace.svg";
  auto r = DcTraceRun("memory " + Trace() + " -o " + svg + " --budget 4MiB --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json j = ParseJson(r.out);
  EXPECT_GT(j["peak"]["bytes"].get<int64_t>(), 0);
  EXPECT_GT(j["gathers"].get<int>(), 0);
  const std::string text = ReadFile(svg);
  EXPECT_TRUE(text.starts_with("<?xml"));
  EXPECT_TRUE(text.ends_with("</svg>\n"));
  EXPECT_NE(text.find("class=\"budget\""), std::string::npos);
  EXPECT_NE(text.find(">peak "), std::string::npos);
  EXPECT_EQ(static_cast<size_t>(std::count(text.begin(), text.end(), '<') -
                                std::count(text.begin(), text.end(), '>')),
            0u);
  const std::string plan_svg = dir_ + "/plan.svg";
  auto p = DcTraceRun("memory " + Plan() + " -o " + plan_svg);
  ASSERT_EQ(p.exit_code, 0) << p.err;
  EXPECT_NE(ReadFile(plan_svg).find("the predicted step"), std::string::npos);
}

TEST_F(DcTrace, DiffOfATraceWithItselfShowsNoChange) {
  auto r = DcTraceRun("diff " + Trace() + " " + Trace() + " --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json j = ParseJson(r.out);
  EXPECT_EQ(j["changed"], 0);
  EXPECT_TRUE(j["instructions"].empty());
  EXPECT_EQ(j["change"]["step_seconds"], 0.0);
  EXPECT_EQ(j["change"]["peak_memory_bytes"], 0);
}

TEST_F(DcTrace, DiffOfATraceAndItsPlan) {
  auto r =
      DcTraceRun("diff " + Trace() + " " + Plan() + " --profile " + Trace() + " --json --top 5");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json j = ParseJson(r.out);
  EXPECT_EQ(j["b"]["format"], "plan");
  EXPECT_EQ(j["instructions"].size(), 5u);
  // Bucketed collectives are matched per tensor: every name of one side is in the other.
  EXPECT_EQ(j["only_a"], 0);
  EXPECT_EQ(j["only_b"], 0);
  auto text = DcTraceRun("diff " + Trace() + " " + Plan());
  ASSERT_EQ(text.exit_code, 0) << text.err;
  EXPECT_NE(text.out.find("default cost model"), std::string::npos) << text.out;
}

TEST_F(DcTrace, KinetoJsonAndGzip) {
  WriteFile(dir_ + "/rank0.json", kKineto);
  auto gzip = RunCommand("gzip -kf " + dir_ + "/rank0.json");
  ASSERT_EQ(gzip.exit_code, 0) << gzip.err;
  auto plain = DcTraceRun("summary " + dir_ + "/rank0.json --json");
  auto gz = DcTraceRun("summary " + dir_ + "/rank0.json.gz --json");
  ASSERT_EQ(plain.exit_code, 0) << plain.err;
  ASSERT_EQ(gz.exit_code, 0) << gz.err;
  json a = ParseJson(plain.out), b = ParseJson(gz.out);
  EXPECT_EQ(a["format"], "kineto");
  const json& step = a["ranks"][0]["steps"][0];
  EXPECT_NEAR(step["overlap_seconds"].get<double>(), 20e-6, 1e-12);
  EXPECT_NEAR(step["exposed_communication_seconds"].get<double>(), 20e-6, 1e-12);
  for (const char* key : {"path", "notes"}) {  // they name the file
    a.erase(key);
    b.erase(key);
  }
  EXPECT_EQ(a, b);
}

TEST_F(DcTrace, BadInputsGiveOneLineAndNonZeroExit) {
  WriteFile(dir_ + "/other.json", R"({"name": "a config file"})");
  ExpectRefuses("summary " + dir_ + "/other.json", dir_ + "/other.json",
                "no traceEvents array; is this a PyTorch profiler trace?");
  WriteFile(dir_ + "/broken.json", R"({"traceEvents": [)");
  ExpectRefuses("summary " + dir_ + "/broken.json", dir_ + "/broken.json", "invalid JSON");
  WriteFile(dir_ + "/cut.json", kKineto);
  ASSERT_EQ(RunCommand("gzip -f " + dir_ + "/cut.json && head -c 120 " + dir_ + "/cut.json.gz > " +
                       dir_ + "/cut2.json.gz")
                .exit_code,
            0);
  ExpectRefuses("summary " + dir_ + "/cut2.json.gz", dir_ + "/cut2.json.gz", "truncated gzip");
  ASSERT_EQ(RunCommand("sqlite3 " + dir_ +
                       "/nokernels.sqlite 'CREATE TABLE StringIds(id "
                       "INTEGER PRIMARY KEY, value TEXT)' || python3 -c \"import sqlite3; "
                       "sqlite3.connect('" +
                       dir_ +
                       "/nokernels.sqlite').execute('CREATE TABLE "
                       "StringIds(id INTEGER PRIMARY KEY, value TEXT)')\"")
                .exit_code,
            0);
  ExpectRefuses("summary " + dir_ + "/nokernels.sqlite", dir_ + "/nokernels.sqlite",
                "no table CUPTI_ACTIVITY_KIND_KERNEL");
  ExpectRefuses("perfetto " + dir_ + "/missing.db -o " + dir_ + "/x.json", dir_ + "/missing.db",
                "cannot open");
  EXPECT_FALSE(std::filesystem::exists(dir_ + "/x.json"));
  ExpectRefuses("memory " + Trace() + " -o " + dir_ + "/y.svg --step 99", Trace(),
                "has no step 99");
}

TEST_F(DcTrace, HelpHasAnExampleForEachCommand) {
  for (const char* command : {"summary", "perfetto", "memory", "diff"}) {
    auto r = DcTraceRun(std::string(command) + " --help");
    EXPECT_EQ(r.exit_code, 0) << command;
    EXPECT_NE(r.out.find(std::string("Example: dc-trace ") + command), std::string::npos) << r.out;
  }
  auto none = DcTraceRun("");
  EXPECT_NE(none.exit_code, 0);
}

}  // namespace
}  // namespace dc
