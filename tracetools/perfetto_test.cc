#include "tracetools/perfetto.h"

#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "tests/support/test_traces.h"

namespace dc {
namespace {

using json = nlohmann::json;

void AddInstruction(proto::Schedule* schedule, proto::InstrKind kind, proto::Stream stream, int op,
                    std::vector<int> deps) {
  proto::Instruction* instr = schedule->add_instructions();
  instr->set_kind(kind);
  instr->set_stream(stream);
  instr->set_op(op);
  for (int d : deps) instr->add_deps(d);
}

// Two ranks running: 0 all_gather | 1 compute fwd0 (deps 0) | 2 compute fwd1 (deps 0, 1), in
// steps 0 and 1, with memory on rank 0.
TimelineData TwoRanks() {
  TimelineData data;
  data.path = "two-ranks";
  data.format = TimelineFormat::kDc;
  proto::Schedule schedule = testing::ProfileSchedule();
  schedule.clear_instructions();
  AddInstruction(&schedule, proto::INSTR_ALL_GATHER, proto::STREAM_GATHER, -1, {});
  AddInstruction(&schedule, proto::INSTR_COMPUTE, proto::STREAM_COMPUTE, 0, {0});
  AddInstruction(&schedule, proto::INSTR_COMPUTE, proto::STREAM_COMPUTE, 1, {0, 1});
  data.schedule = schedule;
  for (int r = 0; r < 2; ++r) {
    data.ranks.push_back({r, 100 + r, "cpu", 0});
    for (int s : {proto::STREAM_COMPUTE, proto::STREAM_GATHER}) {
      data.stream_names.push_back({r, s, StreamName(static_cast<proto::Stream>(s))});
    }
    for (int step = 0; step < 2; ++step) {
      const int64_t w = step * 10000;
      data.steps.push_back({r, step, w, w + 10000, step == 0});
      auto add = [&](int instruction, ActivityClass kind, int64_t stream, const char* name,
                     int64_t start, int64_t end) {
        TimelineActivity a;
        a.rank_index = r;
        a.stream_id = stream;
        a.kind = kind;
        a.name = name;
        a.start_ns = w + start;
        a.end_ns = w + end;
        a.instruction = instruction;
        a.step = step;
        a.bytes = kind == ActivityClass::kCommunication ? 1024 : 0;
        data.activities.push_back(a);
      };
      add(0, ActivityClass::kCommunication, proto::STREAM_GATHER, "all_gather", 0, 1000);
      add(1, ActivityClass::kCompute, proto::STREAM_COMPUTE, "fwd0", 1500, 2500);
      add(2, ActivityClass::kCompute, proto::STREAM_COMPUTE, "fwd1 \"quoted\"", 2500, 4000);
    }
  }
  for (const auto& [ts, address, bytes, alloc, kind] :
       std::vector<std::tuple<int64_t, int64_t, int64_t, bool, const char*>>{
           {0, 1, 1024, true, "gathered"},
           {1500, 2, 64, true, "activation"},
           {4000, 1, 1024, false, "gathered"}}) {
    TimelineMemoryEvent e;
    e.ts_ns = ts;
    e.address = address;
    e.bytes = bytes;
    e.alloc = alloc;
    e.kind = kind;
    data.memory_events.push_back(e);
  }
  return data;
}

json Written(const Timeline& timeline, PerfettoStats* stats) {
  std::ostringstream out;
  auto written = WritePerfetto(timeline, out, nullptr);
  EXPECT_TRUE(written.ok()) << written.status().message();
  if (written.ok()) *stats = *written;
  json j = json::parse(out.str(), nullptr, false);
  EXPECT_FALSE(j.is_discarded()) << out.str().substr(0, 2000);
  return j;
}

TEST(Perfetto, ProcessesThreadsSlicesCountersAndFlows) {
  auto timeline = MakeTimeline(TwoRanks());
  PerfettoStats stats;
  const json j = Written(*timeline, &stats);
  ASSERT_TRUE(j.contains("traceEvents"));
  std::map<int, std::string> processes;
  std::map<std::pair<int, int>, std::string> threads;
  std::map<int64_t, std::vector<json>> flows;
  int slices = 0, counters = 0;
  for (const json& e : j["traceEvents"]) {
    const std::string ph = e["ph"];
    if (ph == "M" && e["name"] == "process_name") processes[e["pid"]] = e["args"]["name"];
    if (ph == "M" && e["name"] == "thread_name") threads[{e["pid"], e["tid"]}] = e["args"]["name"];
    if (ph == "X") {
      ++slices;
      EXPECT_TRUE(e["ts"].is_number() && e["dur"].is_number());
    }
    if (ph == "C") {
      ++counters;
      EXPECT_EQ(e["args"].size(), 2u);  // every kind on every counter event
    }
    if (ph == "s" || ph == "f") flows[e["id"]].push_back(e);
  }
  EXPECT_EQ(processes.size(), 2u);
  EXPECT_EQ(processes[0], "rank 0 (cpu)");
  EXPECT_EQ((threads[{0, proto::STREAM_COMPUTE}]), "compute");
  EXPECT_EQ((threads[{1, proto::STREAM_GATHER}]), "gather");
  EXPECT_EQ((threads[{1, proto::STREAM_GATHER + 1}]), "steps");
  EXPECT_EQ(slices, 2 * 2 * 3 + 4);  // activities and step windows
  EXPECT_EQ(stats.slices, slices);
  EXPECT_EQ(counters, 3);  // rank 0's three level changes
  // One arrow per rank and step, from the gather to fwd0 (its first consumer), not fwd1.
  EXPECT_EQ(flows.size(), 4u);
  EXPECT_EQ(stats.flows, 4);
  for (const auto& [id, pair] : flows) {
    ASSERT_EQ(pair.size(), 2u) << id;
    EXPECT_EQ(pair[0]["ph"], "s");
    EXPECT_EQ(pair[1]["ph"], "f");
    EXPECT_EQ(pair[1]["bp"], "e");
    EXPECT_EQ(pair[0]["tid"], proto::STREAM_GATHER);
    EXPECT_EQ(pair[1]["tid"], proto::STREAM_COMPUTE);
    EXPECT_LT(pair[0]["ts"].get<double>(), pair[1]["ts"].get<double>());
  }
}

TEST(Perfetto, MicrosecondsAreExactAndOutputIsDeterministic) {
  TimelineData data = TwoRanks();
  data.activities[0].start_ns = -1500;  // nsys times may be negative
  data.activities[0].end_ns = 123456789;
  auto timeline = MakeTimeline(std::move(data));
  std::ostringstream a, b;
  ASSERT_TRUE(WritePerfetto(*timeline, a, nullptr).ok());
  ASSERT_TRUE(WritePerfetto(*timeline, b, nullptr).ok());
  EXPECT_EQ(a.str(), b.str());
  EXPECT_NE(a.str().find("\"ts\":-1.500,\"dur\":123458.289"), std::string::npos);
  EXPECT_NE(a.str().find("fwd1 \\\"quoted\\\""), std::string::npos);
}

TEST(Perfetto, FileIsWrittenWholeOrNotAtAll) {
  testing::TempDir dir;
  auto timeline = MakeTimeline(TwoRanks());
  auto stats = WritePerfettoFile(*timeline, dir.File("out.json"), nullptr);
  ASSERT_TRUE(stats.ok());
  std::ifstream in(dir.File("out.json"));
  EXPECT_FALSE(json::parse(in, nullptr, false).is_discarded());
  auto bad = WritePerfettoFile(*timeline, dir.File("no/such/dir/out.json"), nullptr);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("out.json: cannot write"), std::string::npos);
}

TEST(Perfetto, DcTraceThroughTheTraceReader) {
  testing::TempDir dir;
  const std::string path = testing::WriteProfileTrace(dir);
  auto timeline = OpenTraceTimeline(path);
  ASSERT_TRUE(timeline.ok());
  PerfettoStats stats;
  const json j = Written(**timeline, &stats);
  EXPECT_EQ(stats.processes, 2);
  int with_instruction = 0;
  for (const json& e : j["traceEvents"]) {
    if (e["ph"] == "X" && e["args"].contains("instruction")) ++with_instruction;
  }
  EXPECT_EQ(with_instruction, 2 * 4 * 5);  // every activity of 2 ranks x 4 steps
}

}  // namespace
}  // namespace dc
