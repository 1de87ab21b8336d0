// Held-out evaluation through the commands (dc-run --eval-data): training is bit-identical with
// and without it, its loss is the same under every plan and world size for the same batches
// (and is training's own forward loss on the same tokens), it stays inside the plan's memory,
// and what cannot be evaluated is refused in one line.
#include <gtest/gtest.h>
#include <sqlite3.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "tests/run_command.h"

namespace dc {
namespace {

using testing::FreshDir;
using testing::RunCommand;
using testing::Tool;

// tiny's plans on one token file, all with a global batch of 4 sequences of 32 tokens.
class Evaluation : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = FreshDir("eval");
    WriteTokens(dir_ + "/train.bin", 1 << 15, 0);
    WriteTokens(dir_ + "/heldout.bin", 1 << 14, 11);
    const std::string plan = Tool("dc-plan") +
                             " --synthetic --model tiny --hardware cpu --no-cache --data " + dir_ +
                             "/train.bin";
    for (const auto& [name, flags] : Plans()) {
      auto r = RunCommand(plan + " " + flags + " -o " + Plan(name));
      ASSERT_EQ(r.exit_code, 0) << name << ": " << r.err;
    }
    // Another model: Mixtral's balancing losses are terms of the loss too.
    auto moe = RunCommand(Tool("dc-plan") +
                          " --synthetic --model mixtral-tiny --world 2 --hardware cpu --no-cache "
                          "--data " +
                          dir_ + "/train.bin -o " + Plan("moe"));
    ASSERT_EQ(moe.exit_code, 0) << moe.err;
  }

  static std::vector<std::pair<std::string, std::string>> Plans() {
    return {
        {"baseline", "--world 2 --policy baseline"},
        {"dc", "--world 2 --policy dc"},
        // The optimizer's shards offloaded during the step (their bytes reused by the forward).
        {"dc-offload", "--world 2 --policy dc --budget 1400KiB"},
        // Masters and Adam's state on the host, Adam run there.
        {"zero3-offload", "--world 2 --policy zero3-offload"},
        {"deepcompile", "--world 2 --policy deepcompile"},
        {"one", "--world 1 --micro-batch 4"},
        {"one-gas", "--world 1 --micro-batch 2 --gas 2"},
        {"four", "--world 4 --micro-batch 1"},
    };
  }

  // Tokens below tiny's vocabulary, a different stretch of text per salt.
  static void WriteTokens(const std::string& path, int count, int salt) {
    std::ofstream out(path, std::ios::binary);
    uint32_t state = 12345u + static_cast<uint32_t>(salt);
    for (int i = 0; i < count; ++i) {
      state = state * 1664525u + 1013904223u;
      const auto token = static_cast<uint16_t>((state >> 16) % 256);
      out.write(reinterpret_cast<const char*>(&token), sizeof(token));
    }
  }

  static std::string Plan(const std::string& name) { return dir_ + "/" + name + ".dcplan"; }
  static std::string HeldOut() { return dir_ + "/heldout.bin"; }

  static nlohmann::json Run(const std::string& plan, const std::string& flags) {
    auto r = RunCommand(Tool("dc-run") + " " + Plan(plan) + " " + flags + " --json --quiet");
    EXPECT_EQ(r.exit_code, 0) << plan << ": " << r.err;
    return r.exit_code == 0 ? nlohmann::json::parse(r.out) : nlohmann::json::object();
  }

  static double EvalLoss(const nlohmann::json& run, size_t index = 0) {
    if (!run.contains("evals") || run["evals"].size() <= index) return -1;
    return run["evals"][index]["loss"].get<double>();
  }

  static std::string dir_;
};

std::string Evaluation::dir_;

// The rows of `sql` over a trace, each row's columns joined by ','.
std::vector<std::string> Rows(const std::string& path, const std::string& sql) {
  std::vector<std::string> rows;
  sqlite3* db = nullptr;
  EXPECT_EQ(sqlite3_open_v2(path.c_str(), &db, SQLITE_OPEN_READONLY, nullptr), SQLITE_OK) << path;
  auto add = [](void* out, int n, char** values, char**) {
    std::string row;
    for (int i = 0; i < n; ++i) row += std::string(i ? "," : "") + (values[i] ? values[i] : "");
    static_cast<std::vector<std::string>*>(out)->push_back(row);
    return 0;
  };
  EXPECT_EQ(sqlite3_exec(db, sql.c_str(), add, &rows, nullptr), SQLITE_OK) << sqlite3_errmsg(db);
  sqlite3_close(db);
  return rows;
}

TEST_F(Evaluation, TrainingIsBitIdenticalWithAndWithoutIt) {
  for (const std::string plan : {"dc", "dc-offload", "zero3-offload", "one-gas", "moe"}) {
    const auto plain = Run(plan, "--steps 4");
    const auto evaluated =
        Run(plan, "--steps 4 --eval-data " + HeldOut() + " --eval-every 2 --eval-batches 2");
    EXPECT_EQ(evaluated["losses"], plain["losses"]) << plan;
    EXPECT_EQ(evaluated["params_digest"], plain["params_digest"]) << plan;
    // Inside the plan's memory: no more than the step itself holds.
    EXPECT_EQ(evaluated["peak_device_bytes"], plain["peak_device_bytes"]) << plan;
    EXPECT_EQ(evaluated["peak_live_bytes"], plain["peak_live_bytes"]) << plan;
    ASSERT_EQ(evaluated["evals"].size(), 2u) << plan;
    EXPECT_EQ(evaluated["evals"][0]["step"], 2) << plan;
    EXPECT_EQ(evaluated["evals"][1]["step"], 4) << plan;
    // Training moved the weights, so the held-out loss moved.
    EXPECT_NE(EvalLoss(evaluated, 0), EvalLoss(evaluated, 1)) << plan;
  }
}

TEST_F(Evaluation, TheLossIsTheSameUnderEveryPlanAndWorldSize) {
  const std::string eval = "--eval-data " + HeldOut() + " --eval-batches 3";
  // At start-up (no steps): every plan starts from the same seeded weights.
  const double expected = EvalLoss(Run("baseline", "--steps 0 " + eval));
  ASSERT_GT(expected, 0);
  for (const auto& [plan, flags] : Plans()) {
    const double loss = EvalLoss(Run(plan, "--steps 0 " + eval));
    // Two ranks: the same sums in the same order, bit for bit; other world sizes differ only by
    // the order of the cross-rank sums.
    if (flags.find("--world 2") != std::string::npos) {
      EXPECT_EQ(loss, expected) << plan;
    } else {
      EXPECT_NEAR(loss, expected, 1e-6 * expected) << plan;
    }
  }
  // After training, under plans that train bit-identically (the same ranks).
  const double trained = EvalLoss(Run("baseline", "--steps 3 " + eval));
  EXPECT_NE(trained, expected);
  for (const std::string plan : {"dc", "dc-offload", "zero3-offload", "deepcompile"}) {
    EXPECT_EQ(EvalLoss(Run(plan, "--steps 3 " + eval)), trained) << plan;
  }
  EXPECT_NEAR(EvalLoss(Run("one", "--steps 3 " + eval)), trained, 1e-5 * trained);
}

TEST_F(Evaluation, OnTheTrainingTokensItIsTheFirstStepsLoss) {
  // Held-out batch 0 of the training file is the first step's batch, and the first step's loss
  // is its forward's, from the same weights: an evaluation is training's forward, exactly.
  for (const std::string plan : {"dc-offload", "one-gas", "four", "moe"}) {
    const auto trained = Run(plan, "--steps 1");
    const auto evaluated =
        Run(plan, "--steps 0 --eval-data " + dir_ + "/train.bin --eval-batches 1");
    EXPECT_EQ(EvalLoss(evaluated), trained["losses"][0].get<double>()) << plan;
  }
}

TEST_F(Evaluation, PrintsBesideTheTrainingLosses) {
  auto r = RunCommand(Tool("dc-run") + " " + Plan("dc") + " --steps 3 --eval-data " + HeldOut() +
                      " --eval-every 2");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const size_t step2 = r.out.find("step   2  loss");
  const size_t eval2 = r.out.find("eval step 2: loss ");
  const size_t eval3 = r.out.find("eval step 3: loss ");
  EXPECT_NE(step2, std::string::npos) << r.out;
  EXPECT_NE(eval3, std::string::npos) << r.out;
  EXPECT_LT(step2, eval2) << r.out;
  EXPECT_EQ(r.out.find("eval step 1:"), std::string::npos) << r.out;
}

TEST_F(Evaluation, TheTraceRecordsEachEvaluationApartFromTheSteps) {
  const std::string traced = dir_ + "/traced.db", plain = dir_ + "/plain.db";
  const auto run =
      Run("dc", "--steps 3 --trace " + traced + " --eval-data " + HeldOut() + " --eval-every 2");
  Run("dc", "--steps 3 --trace " + plain);
  // One row per rank and evaluation, with the loss the run printed.
  const auto evals = Rows(traced, "SELECT step, loss FROM TC_EVAL ORDER BY step, globalPid");
  ASSERT_EQ(evals.size(), 4u);
  EXPECT_EQ(evals[0].substr(0, 2), "2,");
  EXPECT_EQ(evals[2].substr(0, 2), "3,");
  EXPECT_EQ(evals[0], evals[1]);  // the ranks agree
  const double loss = std::stod(evals[2].substr(2));
  EXPECT_NEAR(loss, EvalLoss(run, 1), 1e-12 * loss);
  // The steps and their instructions are the trace's as without evaluation.
  for (const std::string sql : {"SELECT count(*) FROM TC_STEP", "SELECT count(*) FROM TC_EVAL",
                                "SELECT count(*) FROM TC_INSTRUCTION_MAP"}) {
    if (sql.find("TC_EVAL") != std::string::npos) {
      EXPECT_EQ(Rows(plain, sql), std::vector<std::string>{"0"});
    } else {
      EXPECT_EQ(Rows(traced, sql), Rows(plain, sql)) << sql;
    }
  }
}

TEST_F(Evaluation, BadFilesAndFlagsAreRefusedInOneLine) {
  const std::string odd = dir_ + "/odd.bin", short_file = dir_ + "/short.bin";
  std::ofstream(odd, std::ios::binary) << "abc";
  // 3 global batches of 4 sequences of 32 tokens need 385 tokens.
  WriteTokens(short_file, 384, 3);
  const std::string run = Tool("dc-run") + " " + Plan("dc") + " --steps 1 ";
  for (const auto& [flags, expected] : std::vector<std::pair<std::string, std::string>>{
           {"--eval-data " + dir_ + "/none.bin", "none.bin: cannot open token file"},
           {"--eval-data " + odd, "odd.bin: 3 bytes is not a whole number of uint16 tokens"},
           {"--eval-data " + short_file + " --eval-batches 3",
            "short.bin: holds 384 tokens, fewer than the 3 x 4 x 32 + 1 that --eval-batches 3 "
            "needs"},
           {"--eval-data " + HeldOut() + " --eval-every 0", "--eval-every"},
           {"--eval-data " + HeldOut() + " --eval-batches 0", "--eval-batches"},
           {"--eval-every 2", "--eval-every needs --eval-data FILE"},
           {"--eval-batches 2", "--eval-batches needs --eval-data FILE"},
       }) {
    auto r = RunCommand(run + flags);
    EXPECT_NE(r.exit_code, 0) << flags;
    EXPECT_NE(r.err.find(expected), std::string::npos) << flags << ": " << r.err;
    // One line (CLI11's range errors add its usual hint, as for every flag of dc-run).
    std::string err = r.err;
    const std::string hint = "Run with --help for more information.\n";
    if (err.ends_with(hint)) err.resize(err.size() - hint.size());
    EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 1) << flags << ": " << r.err;
  }
  // The short file is enough for fewer batches.
  EXPECT_EQ(RunCommand(run + "--eval-data " + short_file + " --eval-batches 2").exit_code, 0);
}

}  // namespace
}  // namespace dc
