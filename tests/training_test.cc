// Training as people run it, through the commands: checkpoints (save, resume bit-identically,
// resume under another plan or world size, survive kill -9, refuse what cannot be resumed)
// and token files (recorded by path and SHA-256 in the plan, a changed file refused).
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <thread>

#include "tests/run_command.h"

namespace dc {
namespace {

namespace fs = std::filesystem;
using testing::FreshDir;
using testing::RunCommand;
using testing::Tool;

class Checkpoints : public ::testing::Test {
 protected:
  // Plans of tiny with a global batch of 4 sequences: 2 ranks (baseline and ZeRO-3 offload,
  // whose masters and Adam states live on the host), 4 ranks and 1 rank.
  static void SetUpTestSuite() {
    dir_ = FreshDir("checkpoint");
    const std::string plan =
        Tool("dc-plan") + " --synthetic --model tiny --hardware cpu --no-cache";
    for (const auto& [name, flags] : std::vector<std::pair<std::string, std::string>>{
             {"two", "--world 2"},
             {"two-offload", "--world 2 --policy zero3-offload"},
             {"four", "--world 4 --micro-batch 1"},
             {"one", "--world 1 --micro-batch 4"},
             {"four-big-batch", "--world 4 --micro-batch 2"},
             {"wide", "--world 2 --hidden 128"}}) {
      auto r = RunCommand(plan + " " + flags + " -o " + dir_ + "/" + name + ".dcplan");
      ASSERT_EQ(r.exit_code, 0) << name << ": " << r.err;
    }
    auto full = RunCommand(Tool("dc-run") + " " + Plan("two") + " --steps 6 --json --quiet");
    ASSERT_EQ(full.exit_code, 0) << full.err;
    full_ = new nlohmann::json(nlohmann::json::parse(full.out));
  }
  static void TearDownTestSuite() { delete full_; }

  static std::string Plan(const std::string& name) { return dir_ + "/" + name + ".dcplan"; }

  static nlohmann::json Run(const std::string& plan, const std::string& flags) {
    auto r = RunCommand(Tool("dc-run") + " " + Plan(plan) + " " + flags + " --json --quiet");
    EXPECT_EQ(r.exit_code, 0) << r.err;
    return r.exit_code == 0 ? nlohmann::json::parse(r.out) : nlohmann::json::object();
  }

  static std::vector<double> FullLossesFrom(int step) {
    const auto losses = (*full_)["losses"].get<std::vector<double>>();
    return {losses.begin() + step, losses.end()};
  }

  static std::vector<std::string> Entries(const std::string& dir) {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    return names;
  }

  static std::string dir_;
  static nlohmann::json* full_;  // 6 steps on 2 ranks, uninterrupted
};

std::string Checkpoints::dir_;
nlohmann::json* Checkpoints::full_ = nullptr;

TEST_F(Checkpoints, ResumingGivesBitIdenticalLossesAndWeights) {
  const std::string save = dir_ + "/bit";
  const auto first = Run("two", "--steps 3 --save " + save + " --save-every 1 --keep 2");
  EXPECT_EQ(first["saved"], save + "/step-00000003");
  // Every step saved, the newest two kept, nothing partial left.
  EXPECT_EQ(Entries(save), (std::vector<std::string>{"step-00000002", "step-00000003"}));
  EXPECT_EQ(Entries(save + "/step-00000003"),
            (std::vector<std::string>{"manifest.json", "rank-00000-of-00002.safetensors",
                                      "rank-00001-of-00002.safetensors"}));
  const auto resumed = Run("two", "--steps 6 --resume " + save);
  EXPECT_EQ(resumed["first_step"], 3);
  EXPECT_EQ(resumed["losses"].get<std::vector<double>>(), FullLossesFrom(3));
  EXPECT_EQ(resumed["params_digest"], (*full_)["params_digest"]);
}

TEST_F(Checkpoints, ResumesUnderAnotherPlanAndWorldSize) {
  const std::string save = dir_ + "/other";
  Run("two", "--steps 3 --save " + save);
  // The same ranks under ZeRO-3 offload (the state goes to host memory): the same math, bit
  // for bit.
  const auto offload = Run("two-offload", "--steps 6 --resume " + save);
  EXPECT_EQ(offload["losses"].get<std::vector<double>>(), FullLossesFrom(3));
  EXPECT_EQ(offload["params_digest"], (*full_)["params_digest"]);
  // 4 ranks and 1 rank with the same global batch: the state is re-sharded exactly; the losses
  // differ only by the order of the cross-rank sums.
  for (const std::string plan : {"four", "one"}) {
    const auto other = Run(plan, "--steps 6 --resume " + save);
    const auto losses = other["losses"].get<std::vector<double>>();
    const auto expected = FullLossesFrom(3);
    ASSERT_EQ(losses.size(), expected.size()) << plan;
    for (size_t i = 0; i < losses.size(); ++i) {
      EXPECT_NEAR(losses[i], expected[i], 1e-6 * expected[i]) << plan << " step " << i + 3;
    }
  }
}

TEST_F(Checkpoints, AKilledRunLeavesItsLastCompleteCheckpointUsable) {
  const std::string save = dir_ + "/killed";
  // Kill -9 a run that saves every step, at several moments, then resume from what is left.
  for (int attempt = 0; attempt < 3; ++attempt) {
    const std::string pid_file = dir_ + "/pid";
    auto started =
        RunCommand("(" + Tool("dc-run") + " " + Plan("one") + " --steps 100000 " +
                   (attempt == 0 ? "" : "--resume " + save + " ") + "--save " + save +
                   " --save-every 1 --quiet >/dev/null 2>&1 & echo $! > " + pid_file + ")");
    ASSERT_EQ(started.exit_code, 0);
    std::ifstream pid_in(pid_file);
    int pid = 0;
    pid_in >> pid;
    ASSERT_GT(pid, 0);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (std::chrono::steady_clock::now() < deadline &&
           (!fs::exists(save) || Entries(save).size() < 2)) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(37 * attempt));
    ASSERT_EQ(::kill(pid, SIGKILL), 0);
    RunCommand("while kill -0 " + std::to_string(pid) + " 2>/dev/null; do sleep 0.01; done");
  }
  // What a save killed half-way leaves: a partial directory with some of the rank files.
  fs::create_directories(save + "/.partial-step-99999");
  std::ofstream(save + "/.partial-step-99999/rank-00000-of-00001.safetensors.tmp.1") << "half";
  std::vector<std::string> complete;
  for (const auto& name : Entries(save)) {
    if (name.rfind("step-", 0) == 0) complete.push_back(name);
  }
  ASSERT_FALSE(complete.empty());
  const int done = std::stoi(complete.back().substr(5));
  const auto resumed =
      Run("one", "--steps " + std::to_string(done + 2) + " --resume " + save + " --save " + save);
  EXPECT_EQ(resumed["first_step"], done);
  EXPECT_EQ(resumed["losses"].size(), 2u);
  for (const auto& name : Entries(save)) {
    EXPECT_EQ(name.rfind(".partial", 0), std::string::npos) << name << " was left behind";
  }
}

// A checkpoint exports as the run that wrote it would have: the same bytes.
TEST_F(Checkpoints, ACheckpointExportsTheModelItHolds) {
  const std::string save = dir_ + "/export";
  Run("two", "--steps 2 --save " + save + " --export " + dir_ + "/export-direct");
  Run("two", "--steps 2 --resume " + save + " --export " + dir_ + "/export-from-checkpoint");
  const auto bytes = [](const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  const std::string direct = bytes(dir_ + "/export-direct/model.safetensors");
  ASSERT_GT(direct.size(), 1000u);
  EXPECT_EQ(direct, bytes(dir_ + "/export-from-checkpoint/model.safetensors"));
}

TEST_F(Checkpoints, WhatCannotBeResumedIsRefusedInOneLine) {
  const std::string save = dir_ + "/refused";
  Run("two", "--steps 2 --save " + save);
  struct Case {
    std::string flags, expect;
  };
  const std::vector<Case> cases = {
      {Plan("wide") + " --steps 4 --resume " + save, "but the plan's is"},
      {Plan("four-big-batch") + " --steps 4 --resume " + save, "global batch"},
      {Plan("two") + " --steps 2 --resume " + save, "raise --steps"},
      {Plan("two") + " --steps 4 --resume " + dir_ + "/nothing-here", "not a checkpoint directory"},
      {Plan("two") + " --steps 4 --resume " + dir_, "no complete checkpoint"},
      {Plan("two") + " --steps 4 --save-every 2", "needs --save"},
      {Plan("two") + " --steps 4 --resume " + save + " --init-from " + save, "use one"},
      {Plan("two") + " --steps 1 --save /proc/dc-cannot-write", "cannot create the checkpoint"},
  };
  for (const Case& c : cases) {
    auto r = RunCommand(Tool("dc-run") + " " + c.flags + " --quiet");
    EXPECT_EQ(r.exit_code, 1) << c.flags << ": " << r.err;
    EXPECT_NE(r.err.find(c.expect), std::string::npos) << c.flags << ": " << r.err;
    EXPECT_LE(std::count(r.err.begin(), r.err.end(), '\n'), 1) << c.flags << ": " << r.err;
  }
  // A damaged shard file: its SHA-256 no longer matches the manifest.
  const std::string shard = save + "/step-00000002/rank-00001-of-00002.safetensors";
  {
    std::fstream f(shard, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-3, std::ios::end);
    f.put('\x7f');
  }
  auto damaged =
      RunCommand(Tool("dc-run") + " " + Plan("two") + " --steps 4 --resume " + save + " --quiet");
  EXPECT_EQ(damaged.exit_code, 1);
  EXPECT_NE(damaged.err.find("SHA-256"), std::string::npos) << damaged.err;
}

// Background saving (the default) and --save-blocking write the same checkpoints, byte for
// byte: from shards on the device (baseline) and from host-resident ones (ZeRO-3 offload).
TEST_F(Checkpoints, BackgroundAndBlockingSavesWriteTheSameBytes) {
  const auto bytes = [](const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  for (const std::string plan : {"two", "two-offload"}) {
    const std::string background = dir_ + "/background-" + plan,
                      blocking = dir_ + "/blocking-" + plan;
    const auto overlapped = Run(plan, "--steps 3 --save " + background + " --save-every 1");
    const auto between =
        Run(plan, "--steps 3 --save " + blocking + " --save-every 1 --save-blocking");
    EXPECT_EQ(overlapped["losses"], between["losses"]) << plan;
    EXPECT_EQ(overlapped["params_digest"], between["params_digest"]) << plan;
    ASSERT_EQ(overlapped["saves"].size(), 3u) << plan;
    for (const auto& save : overlapped["saves"]) {
      EXPECT_GE(save["blocking_seconds"].get<double>(), 0.0) << plan;
      EXPECT_GT(save["background_seconds"].get<double>(), 0.0) << plan;
    }
    ASSERT_EQ(Entries(background), Entries(blocking)) << plan;
    for (const std::string step : {"/step-00000002", "/step-00000003"}) {
      ASSERT_EQ(Entries(background + step), Entries(blocking + step)) << plan;
      for (const std::string& file : Entries(background + step)) {
        const std::string a = bytes(background + step + "/" + file);
        ASSERT_GT(a.size(), 100u) << plan << ": " << file;
        EXPECT_EQ(a, bytes(blocking + step + "/" + file)) << plan << ": " << step << "/" << file;
      }
    }
  }
}

// Runs dc-run in the background with its writers held half-way until `gate` exists; its stdout
// and stderr go to `out`, its exit code to `out`.rc when it ends. Returns its pid.
int StartGated(const std::string& command, const std::string& gate, const std::string& out) {
  const std::string pid_file = out + ".pid";
  auto started = RunCommand("((env DC_TEST_CHECKPOINT_GATE=" + gate + " " + command + " > " + out +
                            " 2>&1 & echo $! > " + pid_file + ".new; mv " + pid_file + ".new " +
                            pid_file + "; wait $!; echo $? > " + out + ".rc) > /dev/null 2>&1 &)");
  EXPECT_EQ(started.exit_code, 0);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (std::chrono::steady_clock::now() < deadline && !fs::exists(pid_file)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  std::ifstream pid_in(pid_file);
  int pid = 0;
  pid_in >> pid;
  return pid;
}

std::string Contents(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Waits (up to a minute) until `path` holds `text`.
bool WaitForText(const std::string& path, const std::string& text) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (std::chrono::steady_clock::now() < deadline) {
    if (Contents(path).find(text) != std::string::npos) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

// The steps after a save point train while the save is written: with the writers held
// half-way, steps 3 and 4 finish before the checkpoint of step 2 can exist.
TEST_F(Checkpoints, StepsTrainWhileASaveIsWritten) {
  const std::string save = dir_ + "/overlap", gate = dir_ + "/overlap-gate",
                    out = dir_ + "/overlap.out";
  StartGated(Tool("dc-run") + " " + Plan("two") + " --steps 4 --save " + save + " --save-every 2",
             gate, out);
  ASSERT_TRUE(WaitForText(out, "step   4  loss")) << Contents(out);
  EXPECT_FALSE(fs::exists(save + "/step-00000002")) << Contents(out);
  EXPECT_EQ(Contents(out).find("saved"), std::string::npos) << Contents(out);
  std::ofstream(gate) << "open";
  ASSERT_TRUE(WaitForText(out + ".rc", "\n")) << Contents(out);
  EXPECT_EQ(Contents(out + ".rc"), "0\n") << Contents(out);
  const std::string text = Contents(out);
  const size_t saved = text.find("saved " + save + "/step-00000002");
  ASSERT_NE(saved, std::string::npos) << text;
  EXPECT_LT(text.find("step   4  loss"), saved) << text;
  EXPECT_EQ(Entries(save), (std::vector<std::string>{"step-00000002", "step-00000004"}));
  const auto resumed = Run("two", "--steps 6 --resume " + save);
  EXPECT_EQ(resumed["first_step"], 4);
  EXPECT_EQ(resumed["losses"].get<std::vector<double>>(), FullLossesFrom(4));
  EXPECT_EQ(resumed["params_digest"], (*full_)["params_digest"]);
}

// kill -9 while a background write is half-way (the gate never opens): the checkpoint before it
// resumes, and the next save clears the partial one.
TEST_F(Checkpoints, AKillDuringABackgroundWriteLeavesThePreviousCheckpoint) {
  const std::string save = dir_ + "/killed-writing", out = dir_ + "/killed-writing.out";
  Run("two", "--steps 2 --save " + save);
  const int pid = StartGated(Tool("dc-run") + " " + Plan("two") + " --steps 100000 --resume " +
                                 save + " --save " + save + " --save-every 1",
                             dir_ + "/never-opened", out);
  ASSERT_GT(pid, 0);
  // Step 3's save is in flight, its files half-written, and step 4 trained meanwhile.
  ASSERT_TRUE(WaitForText(out, "step   4  loss")) << Contents(out);
  const std::string partial = save + "/.partial-step-3";
  ASSERT_TRUE(fs::exists(partial)) << Contents(out);
  // Both ranks' files are open, their headers written (the writers wait after them).
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (std::chrono::steady_clock::now() < deadline && Entries(partial).size() < 2) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_EQ(Entries(partial).size(), 2u);
  for (const std::string& name : Entries(partial)) {
    EXPECT_NE(name.find(".safetensors.tmp"), std::string::npos) << name;
    EXPECT_GT(fs::file_size(partial + "/" + name), 0u) << name;
  }
  // The launcher dies, and its ranks with it (PR_SET_PDEATHSIG).
  ASSERT_EQ(::kill(pid, SIGKILL), 0);
  RunCommand("while kill -0 " + std::to_string(pid) + " 2>/dev/null; do sleep 0.01; done");
  EXPECT_EQ(Entries(save), (std::vector<std::string>{".partial-step-3", "step-00000002"}));
  const auto resumed = Run("two", "--steps 6 --resume " + save + " --save " + save);
  EXPECT_EQ(resumed["first_step"], 2);
  EXPECT_EQ(resumed["losses"].get<std::vector<double>>(), FullLossesFrom(2));
  EXPECT_EQ(resumed["params_digest"], (*full_)["params_digest"]);
  EXPECT_EQ(Entries(save), (std::vector<std::string>{"step-00000002", "step-00000006"}));
}

// A run asked to stop (SIGTERM; a traced run stops after its step) while a save is in flight
// waits for it and publishes it before it ends. Tiny's steps take about a millisecond: by the
// time the signal lands the run may have reached step 20, where it waits for step 10's writer
// before saving again; it then stops after step 20 with both saves published. Either way it
// stops at the first step boundary after the signal and publishes every save due up to it.
TEST_F(Checkpoints, AStoppedRunPublishesTheSaveInFlight) {
  const std::string save = dir_ + "/stopped", gate = dir_ + "/stopped-gate",
                    out = dir_ + "/stopped.out";
  const int pid = StartGated(Tool("dc-run") + " " + Plan("one") + " --steps 100000 --save " + save +
                                 " --save-every 10 --trace " + dir_ + "/stopped.db",
                             gate, out);
  ASSERT_GT(pid, 0);
  // The save of step 10 is held half-way; steps 11 to 19 train meanwhile.
  ASSERT_TRUE(WaitForText(out, "step  11  loss")) << Contents(out);
  ASSERT_EQ(::kill(pid, SIGTERM), 0);
  // The run stops after its step and waits for the writer; then the writer may finish.
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  std::ofstream(gate) << "open";
  ASSERT_TRUE(WaitForText(out + ".rc", "\n")) << Contents(out);
  EXPECT_EQ(Contents(out + ".rc"), std::to_string(128 + SIGTERM) + "\n") << Contents(out);
  EXPECT_NE(Contents(out).find("saved " + save + "/step-00000010"), std::string::npos)
      << Contents(out);
  std::smatch stopped;
  const std::string text = Contents(out);
  ASSERT_TRUE(std::regex_search(text, stopped, std::regex("stopped by SIGTERM after (\\d+) of")))
      << text;
  const int last_step = std::stoi(stopped[1]);
  // Signalled after step 11 was printed; step 20's save waits on the gate, opened only after
  // the signal, so the run cannot pass step 20.
  EXPECT_GE(last_step, 11);
  EXPECT_LE(last_step, 20);
  std::vector<std::string> published = {"step-00000010"};
  if (last_step == 20) published.push_back("step-00000020");
  EXPECT_EQ(Entries(save), published) << text;
  EXPECT_EQ(Entries(save + "/step-00000010"),
            (std::vector<std::string>{"manifest.json", "rank-00000-of-00001.safetensors"}));
}

// A writer's error (here a file size limit, as a full disk) stops the run at the next step
// with one line naming the file; no checkpoint of that step appears.
TEST_F(Checkpoints, AWriterErrorStopsTheRunInOneLine) {
  // Far below a shard file of tiny (hundreds of KiB), far above anything else a run writes.
  const int limit_kib = 4;
  for (const std::string plan : {"one", "two"}) {
    const std::string save = dir_ + "/too-large-" + plan;
    auto r = RunCommand("bash -c 'ulimit -f " + std::to_string(limit_kib) + " && exec " +
                        Tool("dc-run") + " " + Plan(plan) + " --steps 4 --save " + save +
                        " --save-every 1 --quiet'");
    EXPECT_EQ(r.exit_code, 1) << plan << ": " << r.out << r.err;
    // On two ranks, the launcher names the first rank that failed.
    EXPECT_NE(r.err.find("saving the checkpoint of step 1: " + save + "/.partial-step-1/rank-0000"),
              std::string::npos)
        << plan << ": " << r.err;
    EXPECT_NE(r.err.find(".safetensors: write failed (File too large)"), std::string::npos)
        << plan << ": " << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << plan << ": " << r.err;
    for (const auto& name : Entries(save)) {
      EXPECT_NE(name.rfind("step-", 0), 0u) << plan << ": " << name << " should not exist";
    }
  }
}

TEST(TokenFile, ThePlanRecordsItAndAChangedFileIsRefused) {
  const std::string dir = FreshDir("token-file");
  auto write_tokens = [](const std::string& path, uint16_t salt) {
    std::ofstream out(path, std::ios::binary);
    for (int i = 0; i < 4096; ++i) {
      const uint16_t token = static_cast<uint16_t>((i * 31 + salt) % 256);
      out.write(reinterpret_cast<const char*>(&token), sizeof(token));
    }
  };
  write_tokens(dir + "/tokens.bin", 0);
  write_tokens(dir + "/other.bin", 7);
  // A relative path: the plan keeps it absolute, so the run works from any directory.
  auto plan = RunCommand("cd " + dir + " && " + Tool("dc-plan") +
                         " --synthetic --model tiny --world 1 --hardware cpu --no-cache "
                         "--data tokens.bin -o p.dcplan");
  ASSERT_EQ(plan.exit_code, 0) << plan.err;
  const std::string run = "cd / && " + Tool("dc-run") + " " + dir + "/p.dcplan --steps 2 --json";
  auto first = RunCommand(run);
  ASSERT_EQ(first.exit_code, 0) << first.err;
  const auto losses = nlohmann::json::parse(first.out)["losses"];

  write_tokens(dir + "/tokens.bin", 3);  // the same size, other tokens
  auto changed = RunCommand(run);
  EXPECT_EQ(changed.exit_code, 1);
  EXPECT_NE(changed.err.find("/tokens.bin: the token file changed since the plan was made"),
            std::string::npos)
      << changed.err;
  EXPECT_EQ(std::count(changed.err.begin(), changed.err.end(), '\n'), 1) << changed.err;

  // --data trains on a file as it is: the changed one, or another.
  auto overridden = RunCommand(run + " --data " + dir + "/tokens.bin");
  ASSERT_EQ(overridden.exit_code, 0) << overridden.err;
  EXPECT_NE(nlohmann::json::parse(overridden.out)["losses"], losses);
  write_tokens(dir + "/tokens.bin", 0);  // restored: the plan's file again
  auto restored = RunCommand(run);
  ASSERT_EQ(restored.exit_code, 0) << restored.err;
  EXPECT_EQ(nlohmann::json::parse(restored.out)["losses"], losses);
  EXPECT_EQ(RunCommand(run + " --data " + dir + "/other.bin").exit_code, 0);
  auto missing = RunCommand(run + " --data " + dir + "/none.bin");
  EXPECT_EQ(missing.exit_code, 1);
  EXPECT_NE(missing.err.find("none.bin"), std::string::npos) << missing.err;
}

}  // namespace
}  // namespace dc
