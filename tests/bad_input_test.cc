// Bad input to the commands: one clear line naming the file, a non-zero exit, nothing
// half-written left behind.
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>

#include "tests/run_command.h"

namespace dc {
namespace {

using testing::FreshDir;
using testing::RunCommand;
using testing::Tool;

void WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << bytes;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

int Lines(const std::string& text) { return static_cast<int>(std::count(text.begin(), text.end(), '\n')); }

class BadInput : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = FreshDir("bad");
    auto collect = RunCommand(Tool("dc-collect") + " --model tiny --steps 1 --warmup 0 -o " + dir_ + "/good.db");
    ASSERT_EQ(collect.exit_code, 0) << collect.err;
    auto plan = RunCommand(Tool("dc-plan") + " " + dir_ + "/good.db --no-cache -o " + dir_ + "/good.dcplan");
    ASSERT_EQ(plan.exit_code, 0) << plan.err;
    // A two-rank plan for the tests that kill a rank.
    auto two = RunCommand(Tool("dc-collect") + " --model tiny --nproc 2 --steps 1 --warmup 0 -o " + dir_ + "/two.db");
    ASSERT_EQ(two.exit_code, 0) << two.err;
    auto two_plan = RunCommand(Tool("dc-plan") + " " + dir_ + "/two.db --no-cache -o " + dir_ + "/two.dcplan");
    ASSERT_EQ(two_plan.exit_code, 0) << two_plan.err;
  }

  // dc-plan on `trace` must fail with one line naming it and containing `expect`.
  void ExpectPlanRefuses(const std::string& trace, const std::string& expect) {
    const std::string out = dir_ + "/never.dcplan";
    auto r = RunCommand(Tool("dc-plan") + " " + trace + " --no-cache -o " + out);
    EXPECT_EQ(r.exit_code, 1) << r.err;
    EXPECT_EQ(Lines(r.err), 1) << r.err;
    EXPECT_NE(r.err.find(trace), std::string::npos) << r.err;
    EXPECT_NE(r.err.find(expect), std::string::npos) << r.err;
    EXPECT_FALSE(std::filesystem::exists(out));
  }

  void ExpectRunRefuses(const std::string& plan, const std::string& expect) {
    auto r = RunCommand(Tool("dc-run") + " " + plan + " --steps 1");
    EXPECT_EQ(r.exit_code, 1) << r.err;
    EXPECT_EQ(Lines(r.err), 1) << r.err;
    EXPECT_NE(r.err.find(plan), std::string::npos) << r.err;
    EXPECT_NE(r.err.find(expect), std::string::npos) << r.err;
  }

  static std::string dir_;
};
std::string BadInput::dir_;

TEST_F(BadInput, MissingTrace) { ExpectPlanRefuses(dir_ + "/nope.db", "cannot open"); }

TEST_F(BadInput, EmptyTrace) {
  WriteFile(dir_ + "/empty.db", "");
  ExpectPlanRefuses(dir_ + "/empty.db", "empty");
}

TEST_F(BadInput, NonSqliteTrace) {
  WriteFile(dir_ + "/text.db", "hello, this is not a database\n");
  ExpectPlanRefuses(dir_ + "/text.db", "not a SQLite");
}

TEST_F(BadInput, TruncatedTrace) {
  const std::string good = ReadFile(dir_ + "/good.db");
  WriteFile(dir_ + "/truncated.db", good.substr(0, good.size() / 3));
  ExpectPlanRefuses(dir_ + "/truncated.db", "corrupt");
}

TEST_F(BadInput, TruncatedPlan) {
  const std::string good = ReadFile(dir_ + "/good.dcplan");
  WriteFile(dir_ + "/truncated.dcplan", good.substr(0, good.size() - 10));
  ExpectRunRefuses(dir_ + "/truncated.dcplan", "truncated");
}

TEST_F(BadInput, CorruptPlan) {
  std::string bytes = ReadFile(dir_ + "/good.dcplan");
  bytes[bytes.size() / 2] ^= 0x11;
  WriteFile(dir_ + "/corrupt.dcplan", bytes);
  ExpectRunRefuses(dir_ + "/corrupt.dcplan", "corrupt");
}

TEST_F(BadInput, PlanOfANewerFormat) {
  std::string bytes = ReadFile(dir_ + "/good.dcplan");
  bytes[8] = 42;  // the format version follows the 8-byte magic
  WriteFile(dir_ + "/newer.dcplan", bytes);
  ExpectRunRefuses(dir_ + "/newer.dcplan", "newer");
}

TEST_F(BadInput, PlanForAnotherWorldSize) {
  auto r = RunCommand(Tool("dc-run") + " " + dir_ + "/good.dcplan --steps 1 --nproc 2");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("planned for 1 rank"), std::string::npos) << r.err;
}

// Ranks started as an outside launcher would (torchrun's variables and a shared rendezvous
// directory); one is killed mid-run and the other must exit non-zero on its own, promptly.
TEST_F(BadInput, ARankThatDiesStopsTheOthers) {
  const std::string rdzv = FreshDir("rdzv");
  std::vector<pid_t> pids;
  for (int rank = 0; rank < 2; ++rank) {
    pid_t pid = ::fork();
    if (pid == 0) {
      ::setenv("RANK", std::to_string(rank).c_str(), 1);
      ::setenv("WORLD_SIZE", "2", 1);
      ::setenv("LOCAL_RANK", std::to_string(rank).c_str(), 1);
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", "29500", 1);
      std::freopen("/dev/null", "w", stdout);
      std::freopen((dir_ + "/rank" + std::to_string(rank) + ".err").c_str(), "w", stderr);
      const std::string tool = Tool("dc-run");
      const std::string plan_path = dir_ + "/two.dcplan";
      ::execl(tool.c_str(), tool.c_str(), plan_path.c_str(), "--steps", "100000", "--rendezvous", rdzv.c_str(),
              "--quiet", static_cast<char*>(nullptr));
      std::_Exit(127);
    }
    pids.push_back(pid);
  }
  std::this_thread::sleep_for(std::chrono::seconds(3));
  ASSERT_EQ(::kill(pids[1], SIGKILL), 0);
  const auto killed_at = std::chrono::steady_clock::now();
  int status = 0;
  pid_t done = 0;
  while ((done = ::waitpid(pids[0], &status, WNOHANG)) == 0 &&
         std::chrono::steady_clock::now() - killed_at < std::chrono::seconds(30)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  if (done == 0) ::kill(pids[0], SIGKILL);
  ::waitpid(pids[1], nullptr, 0);
  ASSERT_EQ(done, pids[0]) << "rank 0 still running 30 s after rank 1 died";
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) != 0);
  const std::string err = ReadFile(dir_ + "/rank0.err");
  EXPECT_NE(err.find("peer rank is gone"), std::string::npos) << err;
}

TEST_F(BadInput, ARankThatDiesUnderTheLocalLauncher) {
  // The launcher reports the first rank that failed, in one line, and stops the rest.
  auto r = RunCommand("( " + Tool("dc-run") + " " + dir_ + "/two.dcplan --steps 100000 --quiet & "
                      "L=$!; sleep 3; pkill -KILL -P $L -f 'dc-run' -n; wait $L )");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("rank"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("the other ranks were stopped"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace dc
