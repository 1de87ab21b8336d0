// The three commands end to end on the tiny model, as a user runs them.
#include <gtest/gtest.h>
#include <sqlite3.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <tuple>

#include "schemas/files.h"
#include "tests/run_command.h"

namespace dc {
namespace {

using testing::FreshDir;
using testing::RunCommand;
using testing::Tool;
using json = nlohmann::json;

// dc-collect with the cpu backend's streams serial (DC_CPU_STREAMS=serial), so that the plans made
// from its trace are simulated serially. The tests that hold a run's live peak equal to the plan's
// predicted peak need that: the executor counts live bytes in issue order, and so does the
// simulator only when no two streams overlap; with concurrent streams it counts them in simulated
// time, where a gather may start before the compute issued ahead of it has freed its buffers.
std::string SerialCollect() { return "DC_CPU_STREAMS=serial " + Tool("dc-collect"); }

json ParseJson(const std::string& text) {
  json j = json::parse(text, nullptr, false);
  EXPECT_FALSE(j.is_discarded()) << "not JSON: " << text;
  return j;
}

class EndToEnd : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = FreshDir("e2e");
    auto collect = RunCommand(Tool("dc-collect") +
                              " --backend cpu --model tiny --nproc 2 --steps 3 --warmup 1 -o " +
                              dir_ + "/trace.db --json");
    ASSERT_EQ(collect.exit_code, 0) << collect.err;
    collect_ = ParseJson(collect.out);
  }
  static std::string dir_;
  static json collect_;
};
std::string EndToEnd::dir_;
json EndToEnd::collect_;

TEST_F(EndToEnd, CollectReportsWhatItRecorded) {
  EXPECT_EQ(collect_["trace"], dir_ + "/trace.db");
  EXPECT_EQ(collect_["ranks"], 2);
  EXPECT_EQ(collect_["steps"], 3);
  EXPECT_GT(collect_["activities"].get<int64_t>(), 100);
  EXPECT_GT(collect_["memory_events"].get<int64_t>(), 100);
  EXPECT_EQ(collect_["dropped_records"], 0);
  EXPECT_TRUE(std::filesystem::exists(dir_ + "/trace.db"));
  // Nothing half-written or temporary is left beside it.
  for (const auto& entry : std::filesystem::directory_iterator(dir_)) {
    EXPECT_EQ(entry.path().filename(), "trace.db");
  }
}

TEST_F(EndToEnd, TraceHasNsysColumnNames) {
  sqlite3* db = nullptr;
  ASSERT_EQ(sqlite3_open_v2((dir_ + "/trace.db").c_str(), &db, SQLITE_OPEN_READONLY, nullptr),
            SQLITE_OK);
  auto columns = [&](const std::string& table) {
    std::set<std::string> names;
    sqlite3_stmt* stmt = nullptr;
    sqlite3_prepare_v2(db, ("PRAGMA table_info(" + table + ")").c_str(), -1, &stmt, nullptr);
    while (sqlite3_step(stmt) == SQLITE_ROW)
      names.insert(reinterpret_cast<const char*>(sqlite3_column_text(stmt, 1)));
    sqlite3_finalize(stmt);
    return names;
  };
  for (const char* c : {"start", "end", "deviceId", "contextId", "streamId", "correlationId",
                        "globalPid", "demangledName", "shortName", "gridX", "blockX"}) {
    EXPECT_TRUE(columns("CUPTI_ACTIVITY_KIND_KERNEL").count(c)) << c;
  }
  for (const char* c :
       {"start", "globalPid", "deviceId", "address", "bytes", "memKind", "memoryOperationType"}) {
    EXPECT_TRUE(columns("CUDA_GPU_MEMORY_USAGE_EVENTS").count(c)) << c;
  }
  EXPECT_TRUE(columns("StringIds").count("value"));
  // Kernel names resolve through StringIds, as nsys recipes join them.
  sqlite3_stmt* stmt = nullptr;
  sqlite3_prepare_v2(
      db,
      "SELECT COUNT(*) FROM CUPTI_ACTIVITY_KIND_KERNEL k JOIN StringIds s ON s.id = k.shortName "
      "WHERE s.value LIKE 'layers.0.%'",
      -1, &stmt, nullptr);
  ASSERT_EQ(sqlite3_step(stmt), SQLITE_ROW);
  EXPECT_GT(sqlite3_column_int64(stmt, 0), 0);
  sqlite3_finalize(stmt);
  sqlite3_close(db);
}

TEST_F(EndToEnd, PlanThenCacheHitThenRunWithFallingLoss) {
  const std::string cache = dir_ + "/cache";
  const std::string plan_cmd = Tool("dc-plan") + " " + dir_ + "/trace.db --cache-dir " + cache +
                               " -o " + dir_ + "/plan.dcplan --json";
  auto first = RunCommand(plan_cmd);
  ASSERT_EQ(first.exit_code, 0) << first.err;
  json plan = ParseJson(first.out);
  EXPECT_EQ(plan["cache"], "miss");
  EXPECT_GT(plan["predicted"]["step_seconds"].get<double>(), 0);
  EXPECT_GT(plan["predicted"]["peak_device_bytes"].get<int64_t>(), 0);
  EXPECT_GT(plan["baseline"]["peak_device_bytes"].get<int64_t>(), 0);
  ASSERT_FALSE(plan["passes"].empty());
  EXPECT_EQ(plan["passes"][0]["name"], "zero3");
  EXPECT_EQ(plan["budget_bytes"], 0);

  auto second = RunCommand(plan_cmd);
  ASSERT_EQ(second.exit_code, 0) << second.err;
  EXPECT_EQ(ParseJson(second.out)["cache"], "hit");

  // The simulated timeline opens in Perfetto beside the measured one.
  auto perfetto = RunCommand(plan_cmd + " --perfetto " + dir_ + "/plan.perfetto.json");
  ASSERT_EQ(perfetto.exit_code, 0) << perfetto.err;
  json timeline = json::parse(std::ifstream(dir_ + "/plan.perfetto.json"), nullptr, false);
  ASSERT_FALSE(timeline.is_discarded());
  EXPECT_GT(timeline["traceEvents"].size(), 100u);
  std::filesystem::remove(dir_ + "/plan.perfetto.json");

  auto run =
      RunCommand(Tool("dc-run") + " --backend cpu " + dir_ + "/plan.dcplan --steps 20 --json");
  ASSERT_EQ(run.exit_code, 0) << run.err;
  json r = ParseJson(run.out);
  ASSERT_EQ(r["losses"].size(), 20u);
  EXPECT_EQ(r["world_size"], 2);
  EXPECT_EQ(r["backend"], "cpu");
  EXPECT_GT(r["tokens_per_second"].get<double>(), 0);
  EXPECT_GT(r["step_seconds_median"].get<double>(), 0);
  // The trace ran the default (threaded) streams, so the predicted peak is the larger of the
  // issue-order and the time-resolved one (see ThreadedTrace.PredictedPeakBoundsTheRun; the
  // serially collected tests below hold the two equal): the run never holds more live bytes than
  // the plan promised, and the device held exactly the memory plan's arena.
  EXPECT_LE(r["peak_live_bytes"].get<int64_t>(),
            plan["predicted"]["peak_device_bytes"].get<int64_t>());
  EXPECT_GT(r["peak_live_bytes"].get<int64_t>(), 0);
  EXPECT_GT(plan["arena_bytes"].get<int64_t>(), 0);
  EXPECT_EQ(r["peak_device_bytes"], plan["arena_bytes"]);
  const double first_loss = r["losses"][0], last_loss = r["losses"][19];
  EXPECT_LT(last_loss, 0.8 * first_loss) << "the loss did not fall: " << r["losses"].dump();
}

TEST_F(EndToEnd, ProfileGuidedRoundsReportPredictedAndMeasured) {
  const std::string rounds_dir = FreshDir("rounds");
  auto plan = RunCommand(Tool("dc-plan") + " " + dir_ +
                         "/trace.db --rounds 2 --round-steps 2 --no-cache --json -o " + rounds_dir +
                         "/best.dcplan");
  ASSERT_EQ(plan.exit_code, 0) << plan.err;
  json j = ParseJson(plan.out);
  // Two rounds, and where their plans differ and measured within 3% of each other, each
  // measured once more (rounds 3 and 4, the later round's plan first).
  const size_t measurements = j["rounds"].size();
  ASSERT_TRUE(measurements == 2 || measurements == 4) << j["rounds"].dump();
  std::map<int, std::vector<double>> of_plan;  // by the round that planned it
  for (size_t i = 0; i < measurements; ++i) {
    const json& round = j["rounds"][i];
    EXPECT_GT(round["measured_step_seconds"].get<double>(), 0);
    EXPECT_GT(round["predicted_step_seconds"].get<double>(), 0);
    const std::string source = round["source"];
    int planned_in = static_cast<int>(i) + 1;
    if (i >= 2) {
      ASSERT_EQ(source.find(" plan again: rounds 1 and 2 measured within 3%"), 9u) << source;
      planned_in = source[6] - '0';
      EXPECT_EQ(planned_in, i == 2 ? 2 : 1);
    }
    of_plan[planned_in].push_back(round["measured_step_seconds"].get<double>());
  }
  // The kept round is the one whose measurements' mean is the fastest.
  auto mean = [](const std::vector<double>& v) {
    double sum = 0;
    for (double x : v) sum += x;
    return sum / static_cast<double>(v.size());
  };
  const int kept = j["kept_round"];
  ASSERT_TRUE(kept == 1 || kept == 2) << j.dump();
  EXPECT_LE(mean(of_plan[kept]), mean(of_plan[3 - kept]));
  EXPECT_DOUBLE_EQ(j["kept_step_seconds"].get<double>(), mean(of_plan[kept]));
  // Only the chosen plan remains: the rounds' plans and traces are cleaned up.
  int files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(rounds_dir)) {
    EXPECT_EQ(entry.path().filename(), "best.dcplan");
    ++files;
  }
  EXPECT_EQ(files, 1);
}

// A rule's plan kept over dc's own by a trace's prediction comes with the way to check it by
// measuring (--rounds 2). With its own gather-moving passes disabled (prefetch, bucket,
// unshard, ramp, optimizer-order: DeepCompile's passes are others; ramp and optimizer-order left
// on won it 1 trace in 4), dc keeps DeepCompile's plan on any trace; DeepCompile's policy has no
// rivals, so nothing is kept and nothing hinted. The trace is the checked-in one (kept: 0.0217 s
// against dc's 0.0278 s): on a trace taken beside other work, dc's own plan sometimes came out
// no faster than the baseline's, and the rule's plan no faster than its fallback.
TEST(Rounds, AKeptRulePlanPointsToRounds) {
  const std::string dir = FreshDir("rounds-hint");
  const std::string trace = std::string(DC_SOURCE_DIR) + "/tests/data/tiny-2rank.db";
  for (const std::string flags :
       {"--policy dc --disable bucket prefetch unshard ramp optimizer-order",
        "--policy deepcompile"}) {
    auto plan = RunCommand(Tool("dc-plan") + " " + trace + " --no-cache --json " + flags + " -o " +
                           dir + "/p.dcplan");
    ASSERT_EQ(plan.exit_code, 0) << plan.err;
    bool kept_rule = false, hinted = false;
    const json out = ParseJson(plan.out);
    const json notes = out["notes"];
    for (const auto& note : notes) {
      const std::string text = note.get<std::string>();
      kept_rule = kept_rule || text.rfind("kept deepcompile's plan: ", 0) == 0;
      hinted =
          hinted || text.find("tiny-2rank.db --rounds 2 measures this plan") != std::string::npos;
    }
    const bool rivals = flags.find("--policy dc") == 0;
    EXPECT_EQ(kept_rule, rivals) << flags << ": " << notes.dump();
    EXPECT_EQ(hinted, rivals) << flags << ": " << notes.dump();
    // The same in fields: the rival kept and dc's own step it beat.
    EXPECT_EQ(out.contains("kept_rival"), rivals) << out.dump();
    if (rivals) {
      EXPECT_EQ(out["kept_rival"], "deepcompile");
      EXPECT_GT(out["own_step_seconds"].get<double>(),
                out["predicted"]["step_seconds"].get<double>());
    }
  }
}

// A round runs as the trace it starts from ran: with its BLAS threads per rank (1 here, where
// dc-run's default, the cores over the ranks, is 2 on CI's two cores), so the rounds'
// measurements compare with the trace's.
TEST_F(EndToEnd, ProfileGuidedRoundsRunWithTheTracesThreadsPerRank) {
  const std::string dir = FreshDir("rounds-threads");
  auto collect = RunCommand(Tool("dc-collect") + " --model tiny --nproc 1 --steps 2 --warmup 1 " +
                            "--threads-per-rank 1 --quiet -o " + dir + "/t.db");
  ASSERT_EQ(collect.exit_code, 0) << collect.err;
  auto plan =
      RunCommand(Tool("dc-plan") + " " + dir +
                 "/t.db --rounds 1 --round-steps 2 --no-cache --json -o " + dir + "/best.dcplan");
  ASSERT_EQ(plan.exit_code, 0) << plan.err;
  json j = ParseJson(plan.out);
  ASSERT_EQ(j["rounds"].size(), 1u);
  EXPECT_EQ(j["rounds"][0]["threads_per_rank"], 1) << j["rounds"].dump();
}

// A cache that cannot be written (here a file where the directory should be) costs the next run
// a re-plan, never this run its plan: a warning, exit 0, the -o plan written.
TEST_F(EndToEnd, UnwritablePlanCacheWarnsAndStillWritesThePlan) {
  const std::string dir = FreshDir("cache-file");
  ASSERT_TRUE(WriteFileAtomic(dir + "/cache", "not a directory").ok());
  auto plan = RunCommand(Tool("dc-plan") + " " + dir_ + "/trace.db --cache-dir " + dir +
                         "/cache --json -o " + dir + "/plan.dcplan");
  ASSERT_EQ(plan.exit_code, 0) << plan.err;
  EXPECT_TRUE(std::filesystem::exists(dir + "/plan.dcplan"));
  EXPECT_NE(plan.err.find("dc-plan: warning: the plan is written but not cached: " + dir +
                          "/cache: cannot create the plan cache"),
            std::string::npos)
      << plan.err;
  EXPECT_EQ(ParseJson(plan.out)["warnings"].size(), 1u);
}

// --report without a trace reports the simulated step instead of nothing.
TEST_F(EndToEnd, SyntheticReportIsThePrediction) {
  const std::string dir = FreshDir("synthetic-report");
  auto plan = RunCommand(Tool("dc-plan") +
                         " --synthetic --model tiny --world 2 --hardware cpu --no-cache --report "
                         "-o " +
                         dir + "/plan.dcplan");
  ASSERT_EQ(plan.exit_code, 0) << plan.err;
  EXPECT_NE(plan.out.find("the report is the simulator's prediction"), std::string::npos)
      << plan.out;
  EXPECT_NE(plan.out.find("median step"), std::string::npos) << plan.out;
}

TEST_F(EndToEnd, TooSmallDeviceMemoryFailsLikeAnOom) {
  // Without a memory plan, the instruction that goes over names itself and the bytes.
  auto plan = RunCommand(Tool("dc-plan") + " " + dir_ +
                         "/trace.db --policy baseline --no-cache -o " + dir_ + "/oom.dcplan");
  ASSERT_EQ(plan.exit_code, 0) << plan.err;
  auto run = RunCommand(Tool("dc-run") + " --backend cpu " + dir_ +
                        "/oom.dcplan --steps 1 --device-memory 64KiB");
  EXPECT_NE(run.exit_code, 0);
  EXPECT_NE(run.err.find("out of device memory at"), std::string::npos) << run.err;
  EXPECT_NE(run.err.find("asked for"), std::string::npos) << run.err;
  // With one, the arena that does not fit is refused before the first step.
  auto arena_plan = RunCommand(Tool("dc-plan") + " " + dir_ + "/trace.db --no-cache -o " + dir_ +
                               "/arena.dcplan");
  ASSERT_EQ(arena_plan.exit_code, 0) << arena_plan.err;
  auto arena_run = RunCommand(Tool("dc-run") + " --backend cpu " + dir_ +
                              "/arena.dcplan --steps 1 --device-memory 64KiB");
  EXPECT_NE(arena_run.exit_code, 0);
  EXPECT_NE(arena_run.err.find("arena of"), std::string::npos) << arena_run.err;
}

TEST_F(EndToEnd, BudgetBelowTheBaselineIsRefused) {
  auto plan = RunCommand(Tool("dc-plan") + " " + dir_ + "/trace.db --no-cache --budget 4KiB -o " +
                         dir_ + "/small.dcplan");
  EXPECT_EQ(plan.exit_code, 1);
  EXPECT_NE(plan.err.find("over the budget"), std::string::npos) << plan.err;
  EXPECT_EQ(std::count(plan.err.begin(), plan.err.end(), '\n'), 1) << plan.err;
  EXPECT_FALSE(std::filesystem::exists(dir_ + "/small.dcplan"));
}

TEST_F(EndToEnd, ReplanFromATraceOfAnotherProgramIsRefused) {
  const std::string other = dir_ + "/other.db";
  auto collect =
      RunCommand(Tool("dc-collect") +
                 " --backend cpu --model tiny --layers 1 --steps 1 --warmup 0 -o " + other);
  ASSERT_EQ(collect.exit_code, 0) << collect.err;
  auto base =
      RunCommand(Tool("dc-plan") + " " + dir_ + "/trace.db --no-cache -o " + dir_ + "/base.dcplan");
  ASSERT_EQ(base.exit_code, 0) << base.err;
  auto replan = RunCommand(Tool("dc-plan") + " " + other + " --from-plan " + dir_ +
                           "/base.dcplan --no-cache -o " + dir_ + "/mixed.dcplan");
  EXPECT_EQ(replan.exit_code, 1);
  EXPECT_NE(replan.err.find("another program"), std::string::npos) << replan.err;
  EXPECT_FALSE(std::filesystem::exists(dir_ + "/mixed.dcplan"));
}

TEST_F(EndToEnd, ReplanForAnotherWorldSizeSaysTheTraceMeasuredAnother) {
  // The fixture's trace is of tiny on 2 ranks; a 4-rank plan of the same program re-planned
  // with it takes 2-rank collective costs, and says so.
  auto four = RunCommand(Tool("dc-plan") + " --synthetic --model tiny --world 4 --no-cache -o " +
                         dir_ + "/four.dcplan");
  ASSERT_EQ(four.exit_code, 0) << four.err;
  auto replan = RunCommand(Tool("dc-plan") + " " + dir_ + "/trace.db --from-plan " + dir_ +
                           "/four.dcplan --no-cache -o " + dir_ + "/replanned.dcplan");
  ASSERT_EQ(replan.exit_code, 0) << replan.err;
  EXPECT_NE(replan.err.find("measured 2 rank(s) and " + dir_ + "/four.dcplan is for 4"),
            std::string::npos)
      << replan.err;
  EXPECT_NE(replan.out.find("for 4 rank(s)"), std::string::npos) << replan.out;
  // The same world size says nothing of it.
  auto two =
      RunCommand(Tool("dc-plan") + " " + dir_ + "/trace.db --no-cache -o " + dir_ + "/two.dcplan");
  ASSERT_EQ(two.exit_code, 0) << two.err;
  auto same = RunCommand(Tool("dc-plan") + " " + dir_ + "/trace.db --from-plan " + dir_ +
                         "/two.dcplan --no-cache -o " + dir_ + "/same.dcplan");
  ASSERT_EQ(same.exit_code, 0) << same.err;
  EXPECT_EQ(same.err.find("measured"), std::string::npos) << same.err;
  for (const char* f : {"/four.dcplan", "/replanned.dcplan", "/two.dcplan", "/same.dcplan"}) {
    std::filesystem::remove(dir_ + f);
  }
}

// Candidate plans made at once on several threads give the plan made one by one, to the byte; a
// thread count of 0 is refused.
TEST_F(EndToEnd, PlanningThreadsChangeNothingButTheTime) {
  const std::string flags =
      " --synthetic --model llama-1b --layers 2 --hidden 512 --heads 8 --kv-heads 2 --ffn 1536 "
      "--vocab 4096 --seq 256 --gas 2 --recompute --world 8 --hardware h100-sxm --no-cache";
  std::string plans[2];
  int i = 0;
  for (const char* threads : {"1", "4"}) {
    const std::string out = dir_ + "/threads-" + threads + ".dcplan";
    auto r =
        RunCommand(Tool("dc-plan") + flags + " --budget 35MiB --threads " + threads + " -o " + out);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    auto bytes = ReadFileBytes(out);
    ASSERT_TRUE(bytes.ok()) << bytes.status().message();
    plans[i++] = *bytes;
    std::filesystem::remove(out);
  }
  EXPECT_FALSE(plans[0].empty());
  EXPECT_EQ(plans[0], plans[1]) << "the plan made on 4 threads differs from the one made on 1";
  auto zero = RunCommand(Tool("dc-plan") + flags + " --threads 0 -o " + dir_ + "/zero.dcplan");
  EXPECT_NE(zero.exit_code, 0);
  EXPECT_NE(zero.err.find("--threads"), std::string::npos) << zero.err;
  EXPECT_FALSE(std::filesystem::exists(dir_ + "/zero.dcplan"));
}

class Losses : public ::testing::TestWithParam<std::string> {};
INSTANTIATE_TEST_SUITE_P(DenseAndMoe, Losses, ::testing::Values("tiny", "mixtral-tiny"),
                         [](const auto& info) {
                           return info.param == "tiny" ? std::string("Tiny")
                                                       : std::string("MixtralTiny");
                         });

TEST_P(Losses, AgreeAcrossOneTwoAndFourRanks) {
  // The same global batch of 8 sequences split over 1, 2 and 4 ranks. The dense model splits
  // micro-batches too; the MoE balancing loss is a statistic of each micro-batch (as where every
  // rank computes it on its own micro-batch), so there the micro-batches stay whole and the
  // accumulation steps are split.
  // With --clip-grad-norm 0.1 (every step clips) each rank sums its shards' squares and the
  // all-reduce the ranks' partials: the same global norm, so the same agreement.
  const bool moe = GetParam() != "tiny";
  for (const std::string clip : {"", " --clip-grad-norm 0.1"}) {
    SCOPED_TRACE(clip);
    std::vector<std::vector<double>> losses;
    for (int ranks : {1, 2, 4}) {
      const std::string dir =
          FreshDir("agree-" + GetParam() + std::to_string(ranks) + (clip.empty() ? "" : "-clip"));
      const std::string batch = moe ? " --micro-batch 2 --gas " + std::to_string(4 / ranks)
                                    : " --micro-batch " + std::to_string(4 / ranks) + " --gas 2";
      auto run = RunCommand(Tool("dc-collect") + " --backend cpu --model " + GetParam() +
                            " --nproc " + std::to_string(ranks) + batch + clip +
                            " --steps 6 --warmup 0 -o " + dir + "/t.db --json");
      ASSERT_EQ(run.exit_code, 0) << run.err;
      losses.push_back(ParseJson(run.out)["losses"].get<std::vector<double>>());
    }
    for (size_t r = 1; r < losses.size(); ++r) {
      ASSERT_EQ(losses[r].size(), losses[0].size());
      for (size_t s = 0; s < losses[0].size(); ++s) {
        EXPECT_NEAR(losses[r][s], losses[0][s], 1e-5 * std::fabs(losses[0][s]))
            << "ranks index " << r << " step " << s;
      }
    }
  }
}

TEST(Commands, HelpExplainsEveryFlagWithAnExample) {
  for (const char* tool : {"dc-collect", "dc-plan", "dc-run"}) {
    auto help = RunCommand(Tool(tool) + " --help");
    EXPECT_EQ(help.exit_code, 0) << tool;
    EXPECT_NE(help.out.find("Example:"), std::string::npos) << tool;
  }
}

TEST(Commands, UnknownPresetIsOneClearLine) {
  const std::string dir = FreshDir("preset");
  auto run = RunCommand(Tool("dc-collect") + " --model gpt5 -o " + dir + "/t.db");
  EXPECT_EQ(run.exit_code, 1);
  EXPECT_NE(run.err.find("gpt5"), std::string::npos) << run.err;
  EXPECT_NE(run.err.find("tiny"), std::string::npos) << run.err;
  EXPECT_EQ(std::count(run.err.begin(), run.err.end(), '\n'), 1) << run.err;
  EXPECT_FALSE(std::filesystem::exists(dir + "/t.db"));
}

}  // namespace
}  // namespace dc

namespace dc {
namespace {

TEST(Synthetic, PlansLlama3_70bOn32H100sWithoutATrace) {
  const std::string dir = FreshDir("synthetic");
  auto plan = RunCommand(
      Tool("dc-plan") +
      " --synthetic --model llama3-70b --world 32 --hardware h100-sxm --gpus-per-node 8 --gas 1 "
      "--micro-batch 1 --seq 1024 --no-cache --explain --json -o " +
      dir + "/70b.dcplan");
  ASSERT_EQ(plan.exit_code, 0) << plan.err;
  json j = ParseJson(plan.out);
  EXPECT_EQ(j["world_size"], 32);
  EXPECT_NE(j["device"].get<std::string>().find("h100"), std::string::npos);
  // The default budget is the GPU's memory; the plan fits it.
  EXPECT_GT(j["budget_bytes"].get<int64_t>(), 79LL << 30);
  EXPECT_LE(j["predicted"]["peak_device_bytes"].get<int64_t>(), j["budget_bytes"].get<int64_t>());
  // Forward + backward of 70B at 1024 tokens per rank takes a fraction of a second or more.
  EXPECT_GT(j["baseline"]["step_seconds"].get<double>(), 0.3);
  for (const auto& pass : j["passes"]) {
    EXPECT_GT(pass["instructions"].get<int>(), 0);
    EXPECT_GT(pass["predicted_step_seconds"].get<double>(), 0);
  }
  // The lower bound stands beside the prediction (machine/lower_bound.h).
  const double bound = j["bound"]["step_seconds"].get<double>();
  EXPECT_GT(bound, 0.3);
  EXPECT_LE(bound, j["predicted"]["step_seconds"].get<double>());
  EXPECT_NEAR(j["bound"]["gap"].get<double>(),
              j["predicted"]["step_seconds"].get<double>() / bound - 1, 1e-9);
  EXPECT_FALSE(j["bound"]["binding"].get<std::string>().empty());
  // The range over h100-sxm's five assumed constants holds the prediction.
  EXPECT_EQ(j["range"]["assumed"].size(), 5u) << j["range"].dump();
  const double step = j["predicted"]["step_seconds"].get<double>();
  EXPECT_LE(j["range"]["step_seconds"]["min"].get<double>(), step);
  EXPECT_GE(j["range"]["step_seconds"]["max"].get<double>(), step);
  EXPECT_LT(j["range"]["step_seconds"]["min"].get<double>(),
            j["range"]["step_seconds"]["max"].get<double>());
  const double speedup = j["baseline"]["step_seconds"].get<double>() / step;
  EXPECT_LE(j["range"]["speedup_over_baseline"]["min"].get<double>(), speedup);
  EXPECT_GE(j["range"]["speedup_over_baseline"]["max"].get<double>(), speedup);
}

// Where DeepCompile's rules plan a faster step than dc's own pipelines (0.0198 s against 0.0228
// s: a case of the never-worse test's, DC_NEVER_WORSE_CASES=200 DC_NEVER_WORSE_SEED=7; the case
// this test had before, 0.0430 s against 0.0499 s, dc's own pipeline wins since the bucket pass
// tries caps below a small model's size), dc keeps the rules' plan, and the summary and
// --explain say so beside the bound.
TEST(Synthetic, DcKeepsARulesPlanWhereItIsFaster) {
  const std::string dir = FreshDir("synthetic-rival");
  auto plan = RunCommand(
      Tool("dc-plan") +
      " --synthetic --model llama-1b --layers 3 --hidden 1024 --heads 32 --kv-heads 2 --ffn 4096 "
      "--vocab 128256 --seq 512 --micro-batch 3 --gas 1 --world 32 --gpus-per-node 8 --hardware "
      "a100-80gb --budget 1268853715 --no-cache --explain -o " +
      dir + "/p.dcplan");
  ASSERT_EQ(plan.exit_code, 0) << plan.err;
  EXPECT_NE(plan.out.find("predicted step 0.0198 s (bound "), std::string::npos) << plan.out;
  EXPECT_NE(plan.out.find("chosen: kept deepcompile's plan: 0.0198 s < dc's 0.0226 s"),
            std::string::npos)
      << plan.out;
}

// Mixtral 8x7B on 32 H100s at GAS 16 (DeepCompile's own setting): dc keeps expert weights
// gathered across micro-steps where memory allows and beats DeepCompile's rules, inside the
// GPU's memory. (Its unshard pass once gave up here: its first choice overshot the budget
// several times over and lowering the limit by the overshoot left nothing.)
TEST(Synthetic, MixtralAtGas16BeatsDeepCompileInsideTheGpu) {
  const std::string dir = FreshDir("synthetic-mixtral");
  std::map<std::string, json> plans;
  for (const std::string policy : {"deepcompile", "dc"}) {
    auto plan = RunCommand(
        Tool("dc-plan") +
        " --synthetic --model mixtral-8x7b --world 32 --hardware h100-sxm --gpus-per-node 8 "
        "--gas 16 --micro-batch 1 --seq 1024 --no-cache --json --policy " +
        policy + " -o " + dir + "/" + policy + ".dcplan");
    ASSERT_EQ(plan.exit_code, 0) << plan.err;
    plans[policy] = ParseJson(plan.out);
  }
  const json& dc = plans["dc"];
  EXPECT_LT(dc["predicted"]["step_seconds"].get<double>(),
            0.95 * plans["deepcompile"]["predicted"]["step_seconds"].get<double>());
  EXPECT_LE(dc["predicted"]["peak_device_bytes"].get<int64_t>(), dc["budget_bytes"].get<int64_t>());
  bool unsharded = false;
  for (const auto& pass : dc["passes"])
    unsharded = unsharded || (pass["name"] == "unshard" && pass["changed"] == true);
  EXPECT_TRUE(unsharded) << dc["passes"].dump();
}

// A profile printed to a file and planned with gives the plan the built-in profile gives, byte
// for byte; a bad constant in the file is one line naming the file and the constant.
TEST(Synthetic, HardwareProfileFromAFile) {
  const std::string dir = FreshDir("synthetic-hardware-file");
  auto printed = RunCommand(Tool("dc-plan") + " --hardware a100-80gb --print-hardware");
  ASSERT_EQ(printed.exit_code, 0) << printed.err;
  const std::string file = dir + "/a100.json";
  std::ofstream(file) << printed.out;
  const std::string flags =
      " --synthetic --model llama-1b --layers 2 --world 16 --gpus-per-node 8 --no-cache -o ";
  auto builtin = RunCommand(Tool("dc-plan") + flags + dir + "/builtin.dcplan --hardware a100-80gb");
  ASSERT_EQ(builtin.exit_code, 0) << builtin.err;
  auto from_file = RunCommand(Tool("dc-plan") + flags + dir + "/file.dcplan --hardware " + file);
  ASSERT_EQ(from_file.exit_code, 0) << from_file.err;
  std::ifstream a(dir + "/builtin.dcplan", std::ios::binary),
      b(dir + "/file.dcplan", std::ios::binary);
  const std::string plan_a{std::istreambuf_iterator<char>(a), {}};
  const std::string plan_b{std::istreambuf_iterator<char>(b), {}};
  EXPECT_FALSE(plan_a.empty());
  EXPECT_EQ(plan_a, plan_b);

  std::string bad = printed.out;
  const std::string unit = "\"unit\": \"bytes/s\"";
  bad.replace(bad.find(unit), unit.size(), "\"unit\": \"GB/s\"");
  std::ofstream(dir + "/bad.json") << bad;
  auto refused =
      RunCommand(Tool("dc-plan") + flags + dir + "/bad.dcplan --hardware " + dir + "/bad.json");
  EXPECT_EQ(refused.exit_code, 1);
  EXPECT_EQ(std::count(refused.err.begin(), refused.err.end(), '\n'), 1) << refused.err;
  EXPECT_NE(refused.err.find("bad.json"), std::string::npos) << refused.err;
  EXPECT_NE(refused.err.find("memory_bandwidth_bytes_per_s"), std::string::npos) << refused.err;
}

// A profile's measured step error (dc-calibrate's step_error_fraction) widens the step's range
// by that fraction both ways, beside its assumed constants', and the text says so; the speed-up
// keeps the constants' range (the baseline is the same model's).
TEST(Synthetic, TheMeasuredStepErrorWidensTheRange) {
  const std::string dir = FreshDir("synthetic-step-error");
  auto printed = RunCommand(Tool("dc-plan") + " --hardware cpu --print-hardware");
  ASSERT_EQ(printed.exit_code, 0) << printed.err;
  json profile = ParseJson(printed.out);
  profile["profiles"][0]["constants"]["step_error_fraction"] = {
      {"value", 0.25}, {"unit", "fraction"}, {"source", "measured: four steps"}};
  std::ofstream(dir + "/cpu.json") << profile.dump(2);
  const std::string flags = " --synthetic --model tiny --world 2 --no-cache -o ";
  auto plain = RunCommand(Tool("dc-plan") + flags + dir + "/a.dcplan --json --hardware cpu");
  ASSERT_EQ(plain.exit_code, 0) << plain.err;
  const std::string file = " --hardware " + dir + "/cpu.json";
  auto wide = RunCommand(Tool("dc-plan") + flags + dir + "/b.dcplan --json" + file);
  ASSERT_EQ(wide.exit_code, 0) << wide.err;
  const json a = ParseJson(plain.out), b = ParseJson(wide.out);
  EXPECT_EQ(a["predicted"]["step_seconds"], b["predicted"]["step_seconds"]);
  EXPECT_EQ(a["range"]["step_error_fraction"], 0.0);
  EXPECT_EQ(b["range"]["step_error_fraction"], 0.25);
  EXPECT_NEAR(b["range"]["step_seconds"]["min"].get<double>(),
              0.75 * a["range"]["step_seconds"]["min"].get<double>(), 1e-12);
  EXPECT_NEAR(b["range"]["step_seconds"]["max"].get<double>(),
              1.25 * a["range"]["step_seconds"]["max"].get<double>(), 1e-12);
  EXPECT_EQ(a["range"]["speedup_over_baseline"], b["range"]["speedup_over_baseline"]);
  // With nothing assumed, the range is the measured error alone around the prediction.
  for (auto& [key, constant] : profile["profiles"][0]["constants"].items()) {
    constant["source"] = "measured: " + key;
  }
  std::ofstream(dir + "/measured.json") << profile.dump(2);
  auto measured = RunCommand(Tool("dc-plan") + flags + dir + "/d.dcplan --json --hardware " + dir +
                             "/measured.json");
  ASSERT_EQ(measured.exit_code, 0) << measured.err;
  const json m = ParseJson(measured.out);
  const double step = m["predicted"]["step_seconds"].get<double>();
  EXPECT_TRUE(m["range"]["assumed"].empty());
  EXPECT_NEAR(m["range"]["step_seconds"]["min"].get<double>(), 0.75 * step, 1e-12);
  EXPECT_NEAR(m["range"]["step_seconds"]["max"].get<double>(), 1.25 * step, 1e-12);
  auto explained = RunCommand(Tool("dc-plan") + flags + dir + "/c.dcplan --explain" + file);
  ASSERT_EQ(explained.exit_code, 0) << explained.err;
  EXPECT_NE(explained.out.find("its measured steps' median error (+-25%, step_error_fraction)"),
            std::string::npos)
      << explained.out;
}

TEST(Synthetic, BadHardwareAndClusterAreOneClearLine) {
  auto hw = RunCommand(Tool("dc-plan") +
                       " --synthetic --model tiny --hardware tpu-v9 --no-cache -o /dev/null");
  EXPECT_EQ(hw.exit_code, 1);
  EXPECT_NE(hw.err.find("h100-sxm"), std::string::npos) << hw.err;
  auto cluster =
      RunCommand(Tool("dc-plan") +
                 " --synthetic --model tiny --world 12 --gpus-per-node 8 --no-cache -o /dev/null");
  EXPECT_EQ(cluster.exit_code, 1);
  EXPECT_EQ(std::count(cluster.err.begin(), cluster.err.end(), '\n'), 1) << cluster.err;
  // Neither a trace nor --synthetic: a missing argument, so a usage error (README, "Exit codes").
  auto neither = RunCommand(Tool("dc-plan") + " --no-cache");
  EXPECT_EQ(neither.exit_code, 2);
  EXPECT_NE(neither.err.find("--synthetic"), std::string::npos) << neither.err;
}

TEST(DumpAfter, WritesTheScheduleTextOfThePass) {
  const std::string dir = FreshDir("dump");
  auto plan = RunCommand(Tool("dc-plan") +
                         " --synthetic --model tiny --world 2 --hardware cpu --gpus-per-node 2 "
                         "--budget 1GiB --no-cache --dump-after zero3 -o " +
                         dir + "/p.dcplan");
  ASSERT_EQ(plan.exit_code, 0) << plan.err;
  std::ifstream dump(dir + "/p.dcplan.zero3.txt");
  std::string first;
  std::getline(dump, first);
  EXPECT_EQ(first.rfind("0: all_gather gather m0 [embed]", 0), 0u) << first;
}

}  // namespace
}  // namespace dc

namespace dc {
namespace {

// Every pass alone and every policy trains to bit-identical losses and final params as the
// baseline (tiny and mixtral-tiny, 2 ranks, GAS 4, 10 steps), inside a budget the baseline does
// not fit where the pass frees memory; a plan run with --device-memory equal to its budget does
// not run out, and its measured peak is the memory plan's arena.
class OptimizedPlans : public ::testing::TestWithParam<std::string> {
 protected:
  struct Baseline {
    std::string dir;
    json plan, run;
    int64_t budget = 0;
  };
  // The model's trace and baseline, made by the first test of each model.
  void SetUp() override {
    Baseline& b = baselines_[GetParam()];
    base_ = &b;
    if (!b.dir.empty()) return;
    b.dir = FreshDir("optimized-" + GetParam());
    auto collect = RunCommand(SerialCollect() + " --backend cpu --model " + GetParam() +
                              " --nproc 2 --gas 4 --steps 2 --warmup 1 -o " + b.dir + "/t.db");
    ASSERT_EQ(collect.exit_code, 0) << collect.err;
    std::tie(b.plan, b.run) = PlanAndRun("--policy baseline", "", "baseline");
    b.budget = b.plan["predicted"]["peak_device_bytes"].get<int64_t>() * 87 / 100;
  }
  // Plans with `flags` (and --budget if given), runs 10 steps with --device-memory = budget.
  std::pair<json, json> PlanAndRun(const std::string& flags, const std::string& budget,
                                   const std::string& name) {
    const std::string plan = base_->dir + "/" + name + ".dcplan";
    auto planned = RunCommand(Tool("dc-plan") + " " + base_->dir + "/t.db --no-cache " + flags +
                              (budget.empty() ? "" : " --budget " + budget) + " --json -o " + plan);
    EXPECT_EQ(planned.exit_code, 0) << name << ": " << planned.err;
    auto run = RunCommand(Tool("dc-run") + " --backend cpu " + plan + " --steps 10 --json" +
                          (budget.empty() ? "" : " --device-memory " + budget));
    EXPECT_EQ(run.exit_code, 0) << name << ": " << run.err;
    return {ParseJson(planned.out), ParseJson(run.out)};
  }
  void ExpectSameTraining(const json& run, const std::string& name) {
    EXPECT_EQ(run["losses"], base_->run["losses"]) << name;
    EXPECT_EQ(run["params_digest"], base_->run["params_digest"]) << name;
  }
  const std::string& dir() const { return base_->dir; }
  int64_t budget() const { return base_->budget; }

  static std::map<std::string, Baseline> baselines_;
  Baseline* base_ = nullptr;
};
std::map<std::string, OptimizedPlans::Baseline> OptimizedPlans::baselines_;
INSTANTIATE_TEST_SUITE_P(DenseAndMoe, OptimizedPlans, ::testing::Values("tiny", "mixtral-tiny"),
                         [](const auto& info) {
                           return info.param == "tiny" ? std::string("Tiny")
                                                       : std::string("MixtralTiny");
                         });

TEST_P(OptimizedPlans, EveryPassAloneTrainsBitIdentically) {
  for (const std::string pass :
       {"bucket", "prefetch", "unshard", "dc-prefetch", "dc-selective-gather"}) {
    auto [plan, run] = PlanAndRun("--passes zero3," + pass, "", pass);
    ExpectSameTraining(run, pass);
  }
  // The memory passes act under a budget the baseline exceeds.
  for (const std::string passes :
       {"offload,memory-plan", "offload-all", "dc-offload", "memory-plan"}) {
    const bool frees = passes != "memory-plan";
    auto [plan, run] =
        PlanAndRun("--passes zero3," + passes, frees ? std::to_string(budget()) : "", passes);
    ExpectSameTraining(run, passes);
  }
}

TEST_P(OptimizedPlans, EveryPolicyTrainsBitIdenticallyInsideABudgetTheBaselineExceeds) {
  auto refused =
      RunCommand(Tool("dc-plan") + " " + dir() + "/t.db --no-cache --policy baseline --budget " +
                 std::to_string(budget()) + " -o " + dir() + "/refused.dcplan");
  EXPECT_EQ(refused.exit_code, 1) << "the baseline was expected not to fit";
  EXPECT_NE(refused.err.find("the smallest budget the baseline policy meets is"), std::string::npos)
      << refused.err;
  for (const std::string policy : {"zero3-offload", "deepcompile", "dc"}) {
    auto [plan, run] = PlanAndRun("--policy " + policy, std::to_string(budget()), policy);
    ExpectSameTraining(run, policy);
    EXPECT_GT(plan["arena_bytes"].get<int64_t>(), 0) << policy;
    EXPECT_LE(plan["arena_bytes"].get<int64_t>(), budget()) << policy;
    EXPECT_EQ(run["peak_device_bytes"], plan["arena_bytes"]) << policy;
    EXPECT_EQ(run["peak_live_bytes"], plan["predicted"]["peak_device_bytes"]) << policy;
  }
}

// Activation checkpointing recomputes each layer's forward in its backward from the same
// inputs with the same kernels: training is bit-identical, and the baseline's peak falls (four
// layers, so the activations the checkpoints save outweigh the params the recomputes gather).
// A trace taken with the cpu backend's streams on threads (the default) gives plans simulated
// with overlapping streams, whose time-resolved peak can fall below what the executor holds in
// issue order; the prediction is the larger of the two, so a run capped at the plan's
// predicted peak (or its arena, where it has one) never runs out and holds no more than that.
TEST(ThreadedTrace, PredictedPeakBoundsTheRun) {
  const std::string dir = FreshDir("threaded-peak");
  auto collect = RunCommand(Tool("dc-collect") +
                            " --backend cpu --model tiny --nproc 2 --gas 4 --steps 2 --warmup 1 "
                            "-o " +
                            dir + "/t.db");
  ASSERT_EQ(collect.exit_code, 0) << collect.err;
  for (const std::string flags : {"--policy baseline", "--policy dc --disable memory-plan",
                                  "--policy deepcompile", "--policy dc"}) {
    const std::string plan_path = dir + "/p.dcplan";
    auto planned = RunCommand(Tool("dc-plan") + " " + dir + "/t.db --no-cache " + flags +
                              " --json -o " + plan_path);
    ASSERT_EQ(planned.exit_code, 0) << flags << ": " << planned.err;
    const json plan = ParseJson(planned.out);
    const int64_t predicted = plan["predicted"]["peak_device_bytes"].get<int64_t>();
    const int64_t capacity = std::max(predicted, plan.value("arena_bytes", int64_t{0}));
    auto run = RunCommand(Tool("dc-run") + " --backend cpu " + plan_path +
                          " --steps 3 --json --device-memory " + std::to_string(capacity));
    ASSERT_EQ(run.exit_code, 0) << flags << ": " << run.err;
    const json ran = ParseJson(run.out);
    EXPECT_LE(ran["peak_live_bytes"].get<int64_t>(), predicted) << flags;
    EXPECT_LE(ran["peak_device_bytes"].get<int64_t>(), capacity) << flags;
  }
}

TEST(Recompute, TrainsBitIdenticallyInLessMemory) {
  for (const std::string model : {"tiny", "mixtral-tiny"}) {
    const std::string dir = FreshDir("recompute-" + model);
    json plans[2], runs[2];
    for (int recompute = 0; recompute < 2; ++recompute) {
      const std::string name = dir + "/" + (recompute ? "recompute" : "plain");
      auto collect = RunCommand(SerialCollect() + " --backend cpu --model " + model +
                                " --layers 4" + (recompute ? " --recompute" : "") +
                                " --nproc 2 --gas 2 --steps 2 --warmup 1 -o " + name + ".db");
      ASSERT_EQ(collect.exit_code, 0) << collect.err;
      auto planned = RunCommand(Tool("dc-plan") + " " + name +
                                ".db --no-cache --policy baseline --json -o " + name + ".dcplan");
      ASSERT_EQ(planned.exit_code, 0) << planned.err;
      auto run =
          RunCommand(Tool("dc-run") + " --backend cpu " + name + ".dcplan --steps 10 --json");
      ASSERT_EQ(run.exit_code, 0) << run.err;
      plans[recompute] = ParseJson(planned.out);
      runs[recompute] = ParseJson(run.out);
    }
    EXPECT_EQ(runs[1]["losses"], runs[0]["losses"]) << model;
    EXPECT_EQ(runs[1]["params_digest"], runs[0]["params_digest"]) << model;
    EXPECT_LT(plans[1]["predicted"]["peak_device_bytes"].get<int64_t>(),
              plans[0]["predicted"]["peak_device_bytes"].get<int64_t>() * 95 / 100)
        << model;
    EXPECT_EQ(runs[1]["peak_live_bytes"], plans[1]["predicted"]["peak_device_bytes"]) << model;
  }
}

// dc keeps the activations of recomputed layers where memory allows: each recompute op is
// replaced by a rename of its forward twin's outputs, which the executor keeps live. Training
// is bit-identical to the model without recompute; the measured peak is the predicted one.
TEST(KeepActivations, SkippedRecomputesTrainBitIdentically) {
  for (const std::string model : {"tiny", "mixtral-tiny"}) {
    const std::string dir = FreshDir("keep-" + model);
    auto plan_and_run = [&](const std::string& name, const std::string& collect_flags,
                            const std::string& plan_flags) {
      auto collect = RunCommand(SerialCollect() + " --backend cpu --model " + model +
                                " --layers 4 --nproc 2 --gas 2 --steps 2 --warmup 1 " +
                                collect_flags + " -o " + dir + "/" + name + ".db");
      EXPECT_EQ(collect.exit_code, 0) << collect.err;
      auto planned = RunCommand(Tool("dc-plan") + " " + dir + "/" + name + ".db --no-cache " +
                                plan_flags + " --json -o " + dir + "/" + name + ".dcplan");
      EXPECT_EQ(planned.exit_code, 0) << name << ": " << planned.err;
      auto run = RunCommand(Tool("dc-run") + " --backend cpu " + dir + "/" + name +
                            ".dcplan --steps 10 --json");
      EXPECT_EQ(run.exit_code, 0) << name << ": " << run.err;
      return std::make_pair(ParseJson(planned.out), ParseJson(run.out));
    };
    auto [plain_plan, plain] = plan_and_run("plain", "", "--policy baseline");
    auto [recompute_plan, recompute] =
        plan_and_run("recompute", "--recompute", "--policy baseline");
    auto [kept_plan, kept] =
        plan_and_run("kept", "--recompute", "--passes zero3,keep-activations,memory-plan");
    for (const json* run : {&recompute, &kept}) {
      EXPECT_EQ((*run)["losses"], plain["losses"]) << model;
      EXPECT_EQ((*run)["params_digest"], plain["params_digest"]) << model;
    }
    EXPECT_EQ(kept["peak_live_bytes"], kept_plan["predicted"]["peak_device_bytes"]) << model;
    // Every layer kept (no budget): the peak is back above the recomputing one.
    std::string summary;
    for (const json& pass : kept_plan["passes"]) {
      if (pass["name"] == "keep-activations") summary = pass["summary"].get<std::string>();
    }
    EXPECT_NE(summary.find("kept 8 of 8"), std::string::npos) << model << ": " << summary;
    EXPECT_GT(kept_plan["predicted"]["peak_device_bytes"].get<int64_t>(),
              recompute_plan["predicted"]["peak_device_bytes"].get<int64_t>())
        << model;
  }
}

// In bf16 a master weight on the host frees half its bytes (its bf16 shard stays for the
// gathers). Past what Adam's m and v free, offload moves masters too, and the plan trains
// exactly as the baseline does, inside the budget it was planned for.
TEST(MasterOffload, Bf16MastersOnTheHostTrainBitIdentically) {
  const std::string dir = FreshDir("master-offload");
  auto collect = RunCommand(SerialCollect() +
                            " --backend cpu --model tiny --dtype bf16 --micro-batch 8 "
                            "--nproc 2 --gas 2 --steps 2 --warmup 1 -o " +
                            dir + "/t.db");
  ASSERT_EQ(collect.exit_code, 0) << collect.err;
  // Plans (writing the schedule after `pass` as text) and runs 10 steps with --device-memory.
  auto plan_and_run = [&](const std::string& flags, const std::string& pass, int64_t budget) {
    const std::string plan = dir + "/" + pass + ".dcplan";
    const std::string memory = budget > 0 ? " --budget " + std::to_string(budget) : "";
    auto planned = RunCommand(Tool("dc-plan") + " " + dir + "/t.db --no-cache " + flags + memory +
                              " --json --dump-after " + pass + " -o " + plan);
    EXPECT_EQ(planned.exit_code, 0) << pass << ": " << planned.err;
    auto run = RunCommand(Tool("dc-run") + " --backend cpu " + plan + " --steps 10 --json" +
                          (budget > 0 ? " --device-memory " + std::to_string(budget) : ""));
    EXPECT_EQ(run.exit_code, 0) << pass << ": " << run.err;
    return std::make_pair(ParseJson(planned.out), ParseJson(run.out));
  };
  auto [base_plan, base_run] = plan_and_run("--policy baseline", "zero3", 0);
  const json& kinds = base_plan["predicted"]["peak_by_kind"];
  const int64_t states = kinds["optimizer_state"].get<int64_t>();
  const int64_t masters = kinds["shard"].get<int64_t>();  // fp32: moving them frees half
  const int64_t budget =
      base_plan["predicted"]["peak_device_bytes"].get<int64_t>() - states - masters / 4;

  for (const auto& [flags, pass] :
       {std::pair<std::string, std::string>{"--passes zero3,offload", "offload"},
        {"--passes zero3,offload-all,memory-plan", "offload-all"}}) {
    auto [plan, run] = plan_and_run(flags, pass, budget);
    EXPECT_LE(plan["predicted"]["peak_device_bytes"].get<int64_t>(), budget) << flags;
    EXPECT_EQ(run["losses"], base_run["losses"]) << flags;
    EXPECT_EQ(run["params_digest"], base_run["params_digest"]) << flags;
    EXPECT_EQ(run["peak_live_bytes"], plan["predicted"]["peak_device_bytes"]) << flags;
    // At least one master moved: an offload of a param, not of one of its Adam states.
    std::ifstream after(dir + "/" + pass + ".dcplan." + pass + ".txt");
    int moved_masters = 0;
    for (std::string line; std::getline(after, line);) {
      moved_masters += line.find(": offload d2h") != std::string::npos &&
                       line.find(".adam_") == std::string::npos;
    }
    EXPECT_GT(moved_masters, 0) << flags;
  }
}

// ZeRO-3 offload runs Adam on the host: the masters and Adam's states never take device memory,
// the device keeps the compute-dtype shards the host writes back, and training is exactly the
// baseline's (the cpu backend's host is its device; the math is the same kernel).
TEST(HostOptimizer, ZeroOffloadKeepsNoStateOnTheDeviceAndTrainsBitIdentically) {
  for (const std::string dtype : {"f32", "bf16"}) {
    const std::string dir = FreshDir("host-optimizer-" + dtype);
    auto collect = RunCommand(SerialCollect() + " --backend cpu --model tiny --dtype " + dtype +
                              " --nproc 2 --gas 2 --steps 2 --warmup 1 -o " + dir + "/t.db");
    ASSERT_EQ(collect.exit_code, 0) << collect.err;
    auto plan_and_run = [&](const std::string& policy) {
      const std::string plan = dir + "/" + policy + ".dcplan";
      auto planned = RunCommand(Tool("dc-plan") + " " + dir + "/t.db --no-cache --policy " +
                                policy + " --json -o " + plan);
      EXPECT_EQ(planned.exit_code, 0) << policy << ": " << planned.err;
      const json plan_json = ParseJson(planned.out);
      // The capacity the plan needs: its arena, or its live peak without one.
      const int64_t capacity = std::max(
          plan_json["predicted"]["peak_device_bytes"].get<int64_t>(),
          plan_json.contains("arena_bytes") ? plan_json["arena_bytes"].get<int64_t>() : int64_t{0});
      auto run = RunCommand(Tool("dc-run") + " --backend cpu " + plan + " --steps 10 --json" +
                            " --device-memory " + std::to_string(capacity));
      EXPECT_EQ(run.exit_code, 0) << policy << ": " << run.err;
      return std::make_pair(plan_json, ParseJson(run.out));
    };
    auto [base_plan, base_run] = plan_and_run("baseline");
    auto [host_plan, host_run] = plan_and_run("zero3-offload");
    EXPECT_EQ(host_run["losses"], base_run["losses"]) << dtype;
    EXPECT_EQ(host_run["params_digest"], base_run["params_digest"]) << dtype;
    EXPECT_EQ(host_run["peak_live_bytes"], host_plan["predicted"]["peak_device_bytes"]) << dtype;
    const json& base_kinds = base_plan["predicted"]["peak_by_kind"];
    const json& host_kinds = host_plan["predicted"]["peak_by_kind"];
    EXPECT_GT(base_kinds["optimizer_state"].get<int64_t>(), 0) << dtype;
    EXPECT_FALSE(host_kinds.contains("optimizer_state")) << dtype;  // kinds at 0 are left out
    // The device's param shards are the compute dtype's: half the fp32 masters' bytes in bf16.
    const int64_t masters = base_kinds["shard"].get<int64_t>();
    EXPECT_EQ(host_kinds["shard"].get<int64_t>(), dtype == "bf16" ? masters / 2 : masters) << dtype;
    EXPECT_LT(host_plan["predicted"]["peak_device_bytes"].get<int64_t>(),
              base_plan["predicted"]["peak_device_bytes"].get<int64_t>() -
                  base_kinds["optimizer_state"].get<int64_t>() + 1)
        << dtype;
  }
}

// Adam on the host for the largest params only, the rest on the device with their state
// offloaded as it must be: both kinds of step in one plan train exactly as the baseline does.
TEST(HostOptimizer, PartOnTheHostPartOnTheDeviceTrainsBitIdentically) {
  const std::string dir = FreshDir("host-optimizer-part");
  auto collect = RunCommand(SerialCollect() + " --backend cpu --model tiny --dtype bf16 " +
                            "--nproc 2 --gas 2 --steps 2 --warmup 1 -o " + dir + "/t.db");
  ASSERT_EQ(collect.exit_code, 0) << collect.err;
  auto base_plan =
      RunCommand(Tool("dc-plan") + " " + dir + "/t.db --no-cache --policy baseline --json -o " +
                 dir + "/base.dcplan");
  ASSERT_EQ(base_plan.exit_code, 0) << base_plan.err;
  // The budget of the persistent shards alone: the device cannot hold them and the forward's
  // buffers, so some steps go to the host and offload moves the other params' state.
  const json base_json = ParseJson(base_plan.out);
  const json& kinds = base_json["predicted"]["peak_by_kind"];
  const int64_t budget = kinds["shard"].get<int64_t>() + kinds["grad_shard"].get<int64_t>() +
                         kinds["optimizer_state"].get<int64_t>();
  auto planned = RunCommand(Tool("dc-plan") + " " + dir + "/t.db --no-cache --budget " +
                            std::to_string(budget) +
                            " --passes zero3,host-optimizer-part,offload,memory-plan --json "
                            "--dump-after memory-plan -o " +
                            dir + "/part.dcplan");
  ASSERT_EQ(planned.exit_code, 0) << planned.err;
  const json plan = ParseJson(planned.out);
  std::ifstream text(dir + "/part.dcplan.memory-plan.txt");
  int host_ops = 0, device_steps = 0;
  for (std::string line; std::getline(text, line);) {
    if (line.find(": compute host opt ") != std::string::npos) ++host_ops;
    if (line.find(": compute compute opt ") != std::string::npos) ++device_steps;
  }
  EXPECT_GT(host_ops, 0);
  EXPECT_GT(device_steps, 0);
  const int64_t capacity =
      std::max(plan["predicted"]["peak_device_bytes"].get<int64_t>(),
               plan.contains("arena_bytes") ? plan["arena_bytes"].get<int64_t>() : int64_t{0});
  EXPECT_LE(plan["predicted"]["peak_device_bytes"].get<int64_t>(), budget);
  auto base =
      RunCommand(Tool("dc-run") + " --backend cpu " + dir + "/base.dcplan --steps 10 --json");
  ASSERT_EQ(base.exit_code, 0) << base.err;
  auto part =
      RunCommand(Tool("dc-run") + " --backend cpu " + dir + "/part.dcplan --steps 10 --json" +
                 " --device-memory " + std::to_string(capacity));
  ASSERT_EQ(part.exit_code, 0) << part.err;
  const json base_run = ParseJson(base.out), part_run = ParseJson(part.out);
  EXPECT_EQ(part_run["losses"], base_run["losses"]);
  EXPECT_EQ(part_run["params_digest"], base_run["params_digest"]);
  EXPECT_EQ(part_run["peak_live_bytes"], plan["predicted"]["peak_device_bytes"]);
}

// Gradient clipping by the global norm: every policy (the baseline, dc inside a budget the
// baseline exceeds, ZeRO-3 offload with Adam on the host) trains to the same bits, and clipping
// changes training; a max no norm reaches is no clipping, bit for bit.
TEST(Clipping, EveryPlanTrainsBitIdenticallyAndAHugeMaxIsNoClipping) {
  const std::string dir = FreshDir("clip");
  auto collect = [&](const std::string& name, const std::string& flags) {
    auto run = RunCommand(SerialCollect() + " --backend cpu --model tiny --dtype bf16 " +
                          "--nproc 2 --gas 2 --steps 3 --warmup 0 " + flags + " -o " + dir + "/" +
                          name + ".db --json");
    EXPECT_EQ(run.exit_code, 0) << name << ": " << run.err;
    return ParseJson(run.out);
  };
  const json clipped = collect("clipped", "--clip-grad-norm 0.1");
  const json plain = collect("plain", "");
  const json huge = collect("huge", "--clip-grad-norm 1e30");
  EXPECT_EQ(huge["losses"], plain["losses"]);
  EXPECT_NE(clipped["losses"], plain["losses"]);
  EXPECT_EQ(clipped["losses"][0], plain["losses"][0]);  // the first step's loss is before any

  auto plan_and_run = [&](const std::string& name, const std::string& flags) {
    const std::string plan = dir + "/" + name + ".dcplan";
    auto planned = RunCommand(Tool("dc-plan") + " " + dir + "/clipped.db --no-cache " + flags +
                              " --json -o " + plan);
    EXPECT_EQ(planned.exit_code, 0) << name << ": " << planned.err;
    const json plan_json = ParseJson(planned.out);
    const int64_t capacity = std::max(
        plan_json["predicted"]["peak_device_bytes"].get<int64_t>(),
        plan_json.contains("arena_bytes") ? plan_json["arena_bytes"].get<int64_t>() : int64_t{0});
    auto run = RunCommand(Tool("dc-run") + " --backend cpu " + plan + " --steps 6 --json" +
                          " --device-memory " + std::to_string(capacity));
    EXPECT_EQ(run.exit_code, 0) << name << ": " << run.err;
    return std::make_pair(plan_json, ParseJson(run.out));
  };
  auto [base_plan, base_run] = plan_and_run("baseline", "--policy baseline");
  const int64_t budget = base_plan["predicted"]["peak_device_bytes"].get<int64_t>() * 87 / 100;
  for (const std::string& flags :
       {"--policy dc --budget " + std::to_string(budget), std::string("--policy zero3-offload"),
        "--passes zero3,offload,memory-plan --budget " + std::to_string(budget),
        std::string("--passes zero3,bucket,prefetch")}) {
    auto [plan, run] = plan_and_run("p" + std::to_string(flags.size()), flags);
    EXPECT_EQ(run["losses"], base_run["losses"]) << flags;
    EXPECT_EQ(run["params_digest"], base_run["params_digest"]) << flags;
  }
}

TEST_P(OptimizedPlans, SameInputsGiveAByteIdenticalPlanFile) {
  std::string bytes[2];
  for (int i = 0; i < 2; ++i) {
    const std::string path = dir() + "/same" + std::to_string(i) + ".dcplan";
    auto planned = RunCommand(Tool("dc-plan") + " " + dir() + "/t.db --no-cache --budget " +
                              std::to_string(budget()) + " -o " + path);
    ASSERT_EQ(planned.exit_code, 0) << planned.err;
    std::ifstream in(path, std::ios::binary);
    bytes[i] = std::string(std::istreambuf_iterator<char>(in), {});
  }
  EXPECT_FALSE(bytes[0].empty());
  EXPECT_TRUE(bytes[0] == bytes[1]);
}

}  // namespace
}  // namespace dc
