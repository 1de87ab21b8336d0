// dc-run --export, --init-from and --dump-grads end to end: byte-exact round trips over world
// sizes, and bad directories refused in one line.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "tests/run_command.h"

namespace dc {
namespace {

namespace fs = std::filesystem;
using testing::FreshDir;
using testing::RunCommand;
using testing::Tool;
using json = nlohmann::json;

std::string Bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// The files of a model directory, by name.
std::map<std::string, std::string> Files(const std::string& dir) {
  std::map<std::string, std::string> files;
  for (const auto& entry : fs::directory_iterator(dir)) {
    files[entry.path().filename().string()] = Bytes(entry.path().string());
  }
  return files;
}

// Nothing beside `dir`'s entries but the names given (no temporary directories left).
std::set<std::string> Entries(const std::string& dir) {
  std::set<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) names.insert(entry.path().filename());
  return names;
}

std::string Plan(const std::string& dir, const std::string& model, int world,
                 const std::string& extra = "") {
  const std::string plan = dir + "/" + model + "-" + std::to_string(world) +
                           (extra.empty() ? "" : "-custom") + ".dcplan";
  auto planned =
      RunCommand(Tool("dc-plan") + " --synthetic --hardware cpu --model " + model + " --world " +
                 std::to_string(world) + " " + extra + " --no-cache --quiet -o " + plan);
  EXPECT_EQ(planned.exit_code, 0) << planned.err;
  return plan;
}

std::string DcRun(const std::string& plan, const std::string& flags) {
  auto run = RunCommand(Tool("dc-run") + " --backend cpu " + plan + " --quiet " + flags);
  EXPECT_EQ(run.exit_code, 0) << run.err;
  return run.out;
}

// Export, import on 1 and on 2 ranks, export again: the same bytes (each rank reads its slices
// of each tensor, the gather puts them back in place).
TEST(WeightsIo, ExportInitFromExportIsByteIdenticalOnAnyWorldSize) {
  for (const std::string model : {"tiny", "mixtral-tiny"}) {
    const std::string dir = FreshDir("weights-io-roundtrip-" + model);
    const std::string one = Plan(dir, model, 1), two = Plan(dir, model, 2);
    DcRun(one, "--steps 2 --export " + dir + "/a");
    DcRun(one, "--steps 0 --init-from " + dir + "/a --export " + dir + "/b");
    DcRun(two, "--steps 0 --init-from " + dir + "/a --export " + dir + "/c");
    const auto a = Files(dir + "/a");
    EXPECT_EQ((std::set<std::string>{"config.json", "model.safetensors"}), Entries(dir + "/a"));
    EXPECT_TRUE(a == Files(dir + "/b")) << model;
    EXPECT_TRUE(a == Files(dir + "/c")) << model;
    EXPECT_EQ(Entries(dir),
              (std::set<std::string>{"a", "b", "c", model + "-1.dcplan", model + "-2.dcplan"}));
  }
}

// The same training (the same global batch) on 1 rank and on 2 exports the same bytes, at the
// same BLAS threads per rank (the default divides the cores by the ranks, and OpenBLAS's
// threaded sgemm rounds differently from its one-thread sgemm).
TEST(WeightsIo, TwoRanksExportWhatOneRankDoes) {
  const std::string dir = FreshDir("weights-io-world");
  const std::string one = Plan(dir, "tiny", 1, "--gas 2"), two = Plan(dir, "tiny", 2);
  DcRun(one, "--steps 3 --threads-per-rank 1 --export " + dir + "/one");
  DcRun(two, "--steps 3 --threads-per-rank 1 --export " + dir + "/two");
  EXPECT_TRUE(Files(dir + "/one") == Files(dir + "/two"));
}

TEST(WeightsIo, InitFromStartsTrainingThere) {
  const std::string dir = FreshDir("weights-io-start");
  const std::string plan = Plan(dir, "tiny", 1);
  DcRun(plan, "--steps 4 --export " + dir + "/trained");
  const json seeded = json::parse(DcRun(plan, "--steps 1 --json"));
  const json imported =
      json::parse(DcRun(plan, "--steps 1 --json --init-from " + dir + "/trained"));
  // The trained weights fit the data better than the seeded ones.
  EXPECT_LT(imported["losses"][0].get<double>(), seeded["losses"][0].get<double>() - 0.1);
}

TEST(WeightsIo, DumpGradsWritesEveryParamsGradient) {
  const std::string dir = FreshDir("weights-io-grads");
  const std::string plan = Plan(dir, "mixtral-tiny", 2);
  DcRun(plan, "--steps 1 --dump-grads " + dir + "/g");
  EXPECT_EQ((std::set<std::string>{"dc_run.json", "grads.safetensors"}), Entries(dir + "/g"));
  const json run = json::parse(Bytes(dir + "/g/dc_run.json"));
  EXPECT_EQ(run["world_size"], 2);
  EXPECT_EQ(run["step"], 0);
  const std::string grads = Bytes(dir + "/g/grads.safetensors");
  EXPECT_NE(grads.find("model.layers.1.block_sparse_moe.experts.7.w2.weight"), std::string::npos);
}

// Bad directories: one line naming the flag and the directory, a non-zero exit, nothing written.
TEST(WeightsIo, RefusesBadDirectoriesInOneLine) {
  const std::string dir = FreshDir("weights-io-bad");
  const std::string tiny = Plan(dir, "tiny", 1), mixtral = Plan(dir, "mixtral-tiny", 1);
  DcRun(mixtral, "--steps 1 --export " + dir + "/mixtral");
  auto fails = [&](const std::string& plan, const std::string& flags) {
    auto run = RunCommand(Tool("dc-run") + " --backend cpu " + plan + " --quiet " + flags);
    EXPECT_NE(run.exit_code, 0) << flags;
    EXPECT_EQ(std::count(run.err.begin(), run.err.end(), '\n'), 1) << run.err;
    return run.err;
  };
  EXPECT_NE(fails(tiny, "--export " + dir + "/mixtral")
                .find("--export " + dir + "/mixtral: already exists"),
            std::string::npos);
  EXPECT_NE(fails(tiny, "--export " + dir + "/no/such/out").find("does not exist"),
            std::string::npos);
  EXPECT_NE(fails(tiny, "--init-from " + dir + "/nothing").find(dir + "/nothing: not a directory"),
            std::string::npos);
  EXPECT_NE(fails(tiny, "--init-from " + dir + "/mixtral")
                .find("a MixtralForCausalLM, but the plan's model (tiny) is a LlamaForCausalLM"),
            std::string::npos);
  // Same architecture, other sizes: the tensor and both shapes.
  const std::string wide = Plan(dir, "mixtral-tiny", 1, "--ffn 96");
  EXPECT_NE(fails(wide, "--init-from " + dir + "/mixtral")
                .find("model.layers.0.block_sparse_moe.experts.0.w1.weight is [64, 64] there but "
                      "[96, 64] in the plan's model mixtral-tiny"),
            std::string::npos);
  fs::remove(dir + "/mixtral/model.safetensors");
  EXPECT_NE(fails(mixtral, "--init-from " + dir + "/mixtral").find("model.safetensors"),
            std::string::npos);
  std::ofstream(dir + "/mixtral/config.json") << "{";
  EXPECT_NE(fails(mixtral, "--init-from " + dir + "/mixtral").find("config.json: not a JSON"),
            std::string::npos);
  EXPECT_NE(fails(tiny, "--steps 0 --dump-grads " + dir + "/g").find("at least one step"),
            std::string::npos);
  EXPECT_EQ(Entries(dir),
            (std::set<std::string>{"mixtral", "tiny-1.dcplan", "mixtral-tiny-1.dcplan",
                                   "mixtral-tiny-1-custom.dcplan"}));
}

}  // namespace
}  // namespace dc
