// Whole plans on a real device through the cuda executor (label gpu; every test skips without a
// device): the tiny preset against the cpu backend, optimized plans (arena, buckets, unsharding,
// offload) against the baseline plan, the errors, a traced session, and two ranks through
// dc-run where the host has two GPUs, and checkpoints saved in the background.
#include "executor/cuda/cuda_executor.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "analyzer/trace.h"
#include "executor/cuda/cuda_backend.h"
#include "executor/cuda/cuda_device.h"
#include "executor/session.h"
#include "schemas/plan_file.h"
#include "tests/support/cuda_test_plans.h"

namespace dc {
namespace {

using testing::TinyPlan;
using testing::TinyPlanOptions;

constexpr int kSteps = 20;
// The cpu backend and the GPU in fp32 differ by summation order only; over 20 steps of training
// the losses stay within this (relative).
constexpr double kCpuTolerance = 2e-2;
// Two plans of one bf16 model on the GPU: the same math in another order and buffer placement.
constexpr double kBF16Tolerance = 2e-2;
// Two plans of one fp32 model on the GPU.
constexpr double kF32Tolerance = 1e-3;

#define DC_REQUIRE_DEVICE()                                       \
  do {                                                            \
    if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device"; \
  } while (0)

std::string TempDir(const std::string& name) {
  const auto dir =
      std::filesystem::temp_directory_path() /
      (name + "-" + std::to_string(std::chrono::steady_clock::now().time_since_epoch().count()));
  std::filesystem::create_directories(dir);
  return dir.string();
}

proto::Schedule Plan(const TinyPlanOptions& options) {
  auto plan = TinyPlan(options);
  EXPECT_TRUE(plan.ok()) << plan.status().message();
  return plan.ok() ? *plan : proto::Schedule();
}

// A world of one on device 0: the NCCL communicator and its stream.
struct OneRank {
  CudaStream stream;
  std::unique_ptr<NcclCommunicator> comm;
};

OneRank ConnectOneRank() {
  OneRank rank;
  EXPECT_TRUE(UseCudaDevice(0).ok());
  auto stream = CudaStream::Create();
  EXPECT_TRUE(stream.ok()) << stream.status().message();
  rank.stream = std::move(*stream);
  auto comm = ConnectNcclCommunicator(RendezvousOptions{}, rank.stream.get());
  EXPECT_TRUE(comm.ok()) << comm.status().message();
  if (comm.ok()) rank.comm = std::move(*comm);
  return rank;
}

StatusOr<RunResult> RunOnCuda(const proto::Schedule& plan, int steps = kSteps,
                              int64_t capacity = 0) {
  OneRank rank = ConnectOneRank();
  if (!rank.comm) return Status::Error("no NCCL communicator");
  RunOptions options;
  options.steps = steps;
  options.device_memory_bytes = capacity;
  return RunScheduleOnCuda(plan, options, CudaRunOptions{}, rank.comm.get(), nullptr);
}

std::vector<double> CudaLosses(const proto::Schedule& plan) {
  auto result = RunOnCuda(plan);
  EXPECT_TRUE(result.ok()) << result.status().message();
  return result.ok() ? result->losses : std::vector<double>();
}

std::vector<double> CpuLosses(const proto::Schedule& plan) {
  auto comm = Connect(RendezvousOptions{});
  EXPECT_TRUE(comm.ok());
  RunOptions options;
  options.steps = kSteps;
  auto result = RunSchedule(plan, options, comm->get(), nullptr);
  EXPECT_TRUE(result.ok()) << result.status().message();
  return result.ok() ? result->losses : std::vector<double>();
}

void ExpectClose(const std::vector<double>& got, const std::vector<double>& want, double relative,
                 const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t s = 0; s < want.size(); ++s) {
    EXPECT_NEAR(got[s], want[s], relative * std::fabs(want[s])) << what << ", step " << s;
  }
}

void ExpectLossFalls(const std::vector<double>& losses) {
  ASSERT_EQ(losses.size(), static_cast<size_t>(kSteps));
  EXPECT_LT(losses.back(), 0.8 * losses.front());
}

// Host only: the kernel scratch is sized before any buffer exists, from shapes alone, for every
// kind that needs scratch (cross-entropy, the norms', attention's and every MoE kind's backward).
TEST(CudaExecutor, KernelScratchIsSizedWithoutBuffers) {
  for (const char* preset : {"tiny", "mixtral-tiny"}) {
    for (proto::DType dtype : {proto::DTYPE_F32, proto::DTYPE_BF16}) {
      TinyPlanOptions options;
      options.preset = preset;
      options.compute_dtype = dtype;
      options.world_size = 2;
      const proto::Schedule plan = Plan(options);
      auto bytes = KernelScratchBytes(plan, 1);
      ASSERT_TRUE(bytes.ok()) << preset << ": " << bytes.status().message();
      // At least cross-entropy's per-row double.
      const proto::ModelConfig& c = plan.program().config();
      EXPECT_GE(*bytes, c.micro_batch() * c.seq() * static_cast<int64_t>(sizeof(double))) << preset;
    }
  }
}

TEST(CudaExecutor, TinyPresetMatchesTheCpuBackend) {
  DC_REQUIRE_DEVICE();
  TinyPlanOptions options;  // the tiny preset: fp32, one rank, gas 2
  options.backend = "cpu";
  const std::vector<double> cpu = CpuLosses(Plan(options));
  options.backend = "cuda";
  const std::vector<double> cuda = CudaLosses(Plan(options));
  ExpectClose(cuda, cpu, kCpuTolerance, "cuda against cpu");
  ExpectLossFalls(cuda);
}

TEST(CudaExecutor, DcPlanMatchesTheBaselineInBF16) {
  DC_REQUIRE_DEVICE();
  TinyPlanOptions options;
  options.compute_dtype = proto::DTYPE_BF16;
  const std::vector<double> baseline = CudaLosses(Plan(options));  // pooled buffers
  options.policy = "dc";
  const proto::Schedule dc = Plan(options);
  ASSERT_GT(dc.memory_plan().arena_bytes(), 0);  // buffers in the arena
  ExpectClose(CudaLosses(dc), baseline, kBF16Tolerance, "dc against baseline");
  ExpectLossFalls(baseline);
}

TEST(CudaExecutor, OffloadPlanMatchesTheBaseline) {
  DC_REQUIRE_DEVICE();
  TinyPlanOptions options;
  const std::vector<double> baseline = CudaLosses(Plan(options));
  options.passes = {"zero3", "offload-all", "memory-plan"};  // every state out and back
  const proto::Schedule offload = Plan(options);
  bool offloads = false;
  for (const auto& instr : offload.instructions()) offloads |= instr.kind() == proto::INSTR_OFFLOAD;
  ASSERT_TRUE(offloads);
  ExpectClose(CudaLosses(offload), baseline, kF32Tolerance, "offload-all against baseline");
}

// ZeRO-3 offload runs Adam on the host (the cpu backend's kernel on the pinned masters and
// states), the device holding only the bf16 shards it writes back.
TEST(CudaExecutor, HostOptimizerInBF16MatchesTheBaseline) {
  DC_REQUIRE_DEVICE();
  TinyPlanOptions options;
  options.compute_dtype = proto::DTYPE_BF16;
  const std::vector<double> baseline = CudaLosses(Plan(options));
  options.policy = "zero3-offload";
  const proto::Schedule host = Plan(options);
  int host_ops = 0;
  for (const auto& instr : host.instructions()) host_ops += instr.stream() == proto::STREAM_HOST;
  ASSERT_GT(host_ops, 0);
  ExpectClose(CudaLosses(host), baseline, kBF16Tolerance, "host optimizer against baseline");
}

// In bf16 offloading every state moves the fp32 masters too: the gathers read the bf16 shards the
// optimizer ops refresh, which hold what casting the masters at each gather would give.
TEST(CudaExecutor, MasterOffloadInBF16MatchesTheBaseline) {
  DC_REQUIRE_DEVICE();
  TinyPlanOptions options;
  options.compute_dtype = proto::DTYPE_BF16;
  const std::vector<double> baseline = CudaLosses(Plan(options));
  options.passes = {"zero3", "offload-all", "memory-plan"};
  const proto::Schedule offload = Plan(options);
  const std::vector<bool> compute_shard = ComputeShardParams(offload);
  ASSERT_GT(std::count(compute_shard.begin(), compute_shard.end(), true), 0);
  ExpectClose(CudaLosses(offload), baseline, kBF16Tolerance, "master offload against baseline");
}

// dc keeps the recomputed layers' activations (renames instead of recompute ops): the cuda
// executor re-keys the kept buffers and trains as the model without recompute does.
TEST(CudaExecutor, KeptActivationsMatchTheModelWithoutRecompute) {
  DC_REQUIRE_DEVICE();
  TinyPlanOptions options;
  const std::vector<double> plain = CudaLosses(Plan(options));
  options.recompute = true;
  options.policy = "dc";
  const proto::Schedule kept = Plan(options);
  int renames = 0;
  for (const auto& instr : kept.instructions()) renames += instr.kind() == proto::INSTR_RENAME;
  ASSERT_GT(renames, 0);
  ExpectClose(CudaLosses(kept), plain, kF32Tolerance, "kept activations against no recompute");
}

TEST(CudaExecutor, ArenaIsTheDeviceFootprintAndCapacityIsEnforced) {
  DC_REQUIRE_DEVICE();
  TinyPlanOptions options;
  options.policy = "dc";
  const proto::Schedule plan = Plan(options);
  auto run = RunOnCuda(plan, 2);
  ASSERT_TRUE(run.ok()) << run.status().message();
  EXPECT_EQ(run->arena_bytes, plan.memory_plan().arena_bytes());
  EXPECT_EQ(run->peak_device_bytes, std::max(run->arena_bytes, run->peak_live_bytes));
  EXPECT_GT(run->peak_live_bytes, 0);
  auto small = RunOnCuda(plan, 1, plan.memory_plan().arena_bytes() - 1);
  ASSERT_FALSE(small.ok());
  EXPECT_NE(small.status().message().find("out of device memory at start-up on rank 0"),
            std::string::npos)
      << small.status().message();
}

TEST(CudaExecutor, ErrorsNameTheInstructionAndTheRank) {
  DC_REQUIRE_DEVICE();
  proto::Schedule plan = Plan(TinyPlanOptions{});
  // Drop the first all-gather: its compute then reads a param that is not gathered.
  int gather = -1;
  for (int i = 0; i < plan.instructions_size(); ++i) {
    if (plan.instructions(i).kind() == proto::INSTR_ALL_GATHER) {
      gather = i;
      break;
    }
  }
  ASSERT_GE(gather, 0);
  plan.mutable_instructions(gather)->set_kind(proto::INSTR_RELEASE);
  plan.mutable_instructions(gather)->clear_tensors();
  auto run = RunOnCuda(plan, 1);
  ASSERT_FALSE(run.ok());
  // Refused before the device is touched, with the planner's own message.
  EXPECT_NE(run.status().message().find("the plan's schedule: instruction "), std::string::npos)
      << run.status().message();
  EXPECT_NE(run.status().message().find("which is not gathered; re-plan with dc-plan"),
            std::string::npos)
      << run.status().message();
}

TEST(CudaExecutor, TracedSessionWritesACuptiTrace) {
  DC_REQUIRE_DEVICE();
  const std::string dir = TempDir("dc-cuda-session");
  const proto::Schedule plan = Plan(TinyPlanOptions{});
  auto backend = MakeCudaBackend();
  SessionOptions session;
  session.backend = backend.get();
  session.run.steps = 2;
  session.run.warmup_steps = 1;
  session.trace_path = dir + "/trace.db";
  auto result = RunAsRank(plan, session);
  ASSERT_TRUE(result.ok()) << result.status().message();
  ASSERT_TRUE(result->trace.has_value());
  EXPECT_GT(result->trace->activities, 0);
  auto trace = Trace::Open(session.trace_path);
  ASSERT_TRUE(trace.ok()) << trace.status().message();
  ASSERT_EQ((*trace)->ranks().size(), 1u);
  EXPECT_EQ((*trace)->ranks()[0].backend, "cuda");
  EXPECT_EQ((*trace)->Steps().size(), 3u);
  int samples = 0;
  ASSERT_TRUE(
      (*trace)->ForEachInstructionSample([&](const Trace::InstructionSample&) { ++samples; }).ok());
  EXPECT_GT(samples, plan.instructions_size());  // every instruction's work, over the steps
  std::filesystem::remove_all(dir);
}

// Two ranks, one GPU each, through dc-run's own launcher (NCCL's id through the rendezvous
// directory), against the cpu backend on the same world-2 plan.
TEST(CudaExecutor, TwoRanksThroughDcRunMatchTheCpuBackend) {
  DC_REQUIRE_DEVICE();
  if (CudaDeviceCount() < 2) GTEST_SKIP() << "needs two CUDA devices";
  const std::string dir = TempDir("dc-cuda-two");
  TinyPlanOptions options;
  options.world_size = 2;
  options.policy = "dc";
  options.backend = "cpu";
  ASSERT_TRUE(SavePlan(dir + "/cpu.dcplan", Plan(options)).ok());
  options.backend = "cuda";
  ASSERT_TRUE(SavePlan(dir + "/cuda.dcplan", Plan(options)).ok());
  auto run = [&](const std::string& backend) {
    const std::string out = dir + "/" + backend + ".json";
    const std::string command = std::string(DC_BINARY_DIR) + "/tools/dc-run " + dir + "/" +
                                backend + ".dcplan --backend " + backend + " --steps " +
                                std::to_string(kSteps) + " --json > " + out;
    EXPECT_EQ(std::system(command.c_str()), 0) << command;
    std::ifstream in(out);
    const auto j = nlohmann::json::parse(in, nullptr, false);
    EXPECT_FALSE(j.is_discarded()) << out;
    EXPECT_EQ(j.value("backend", ""), backend);
    return j.is_discarded() ? std::vector<double>() : j["losses"].get<std::vector<double>>();
  };
  ExpectClose(run("cuda"), run("cpu"), kCpuTolerance, "two cuda ranks against two cpu ranks");
  std::filesystem::remove_all(dir);
}

// Checkpoints on the GPU through dc-run: a background save's snapshot is an asynchronous copy on
// the d2h stream (after an event on the compute stream) that the next step's optimizer and
// offloads wait for. Its files must hold the state of the step it names: resuming from them
// gives the uninterrupted run's losses, and where two runs of the plan agree bit for bit, the
// files are those --save-blocking writes between steps.
TEST(CudaExecutor, BackgroundCheckpointsHoldTheStepTheyName) {
  DC_REQUIRE_DEVICE();
  const std::string dir = TempDir("dc-cuda-checkpoint");
  TinyPlanOptions options;
  options.passes = {"zero3", "offload-all", "memory-plan"};  // shards freed after the snapshot
  ASSERT_TRUE(SavePlan(dir + "/p.dcplan", Plan(options)).ok());
  auto run = [&](const std::string& name, const std::string& flags) {
    const std::string out = dir + "/" + name + ".json";
    const std::string command = std::string(DC_BINARY_DIR) + "/tools/dc-run " + dir +
                                "/p.dcplan --backend cuda --json " + flags + " > " + out;
    EXPECT_EQ(std::system(command.c_str()), 0) << command;
    std::ifstream in(out);
    const auto j = nlohmann::json::parse(in, nullptr, false);
    EXPECT_FALSE(j.is_discarded()) << out;
    return j.is_discarded() ? nlohmann::json::object() : j;
  };
  const auto full = run("full", "--steps 6");
  const auto background = run("background", "--steps 3 --save " + dir + "/bg --save-every 1");
  const auto blocking =
      run("blocking", "--steps 3 --save " + dir + "/blk --save-every 1 --save-blocking");
  const auto resumed = run("resumed", "--steps 6 --resume " + dir + "/bg");
  ASSERT_TRUE(full.contains("losses") && resumed.contains("losses"));
  EXPECT_EQ(resumed.value("first_step", 0), 3);
  const auto losses = full["losses"].get<std::vector<double>>();
  ExpectClose(resumed["losses"].get<std::vector<double>>(), {losses.begin() + 3, losses.end()},
              kF32Tolerance, "resumed from a background checkpoint against the whole run");
  if (background.value("params_digest", "") != blocking.value("params_digest", "x")) {
    GTEST_SKIP() << "two runs of the plan differ on this device; the files cannot be compared";
  }
  for (const std::string step : {"/step-00000002", "/step-00000003"}) {
    for (const std::string file : {"manifest.json", "rank-00000-of-00001.safetensors"}) {
      auto bytes = [](const std::string& path) {
        std::ifstream in(path, std::ios::binary);
        return std::string(std::istreambuf_iterator<char>(in), {});
      };
      const std::string a = bytes(dir + "/bg" + step + "/" + file);
      EXPECT_FALSE(a.empty()) << step << "/" << file;
      EXPECT_EQ(a, bytes(dir + "/blk" + step + "/" + file)) << step << "/" << file;
    }
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace dc
