// The cpu device's streams: a plan run on the stream threads, with their timing shaken by seeded
// random sleeps, gives bit for bit the losses, params and peak memory of the same plan run
// serially in issue order (the plan's dependencies, kept by events, leave no other order to
// the math). Tiny and mixtral-tiny, one and two ranks (two ranks as two threads of this process,
// over Gloo), the baseline, dc (unlimited and with a tight budget) and zero3-offload policies.
#include "executor/cpu_device.h"

#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <thread>

#include "executor/executor.h"
#include "executor/interpreter.h"
#include "executor/layout.h"
#include "machine/estimate.h"
#include "machine/hardware.h"
#include "models/model.h"
#include "rewriter/planner.h"
#include "schemas/units.h"

namespace dc {
namespace {

struct Case {
  Case(std::string m, int w, std::string p, double b = 0, int64_t g = 1,
       std::vector<std::string> ps = {})
      : model(std::move(m)),
        world(w),
        policy(std::move(p)),
        budget_fraction(b),
        gas(g),
        passes(std::move(ps)) {}
  std::string model;
  int world = 1;
  std::string policy = "dc";
  double budget_fraction = 0;  // of the unlimited plan's peak; 0 = unlimited
  int64_t gas = 1;
  std::vector<std::string> passes;  // instead of the policy's
};

std::string Name(const Case& c) {
  return c.model + " x" + std::to_string(c.world) + " " + c.policy +
         (c.budget_fraction > 0 ? " budget " + std::to_string(c.budget_fraction) : "") + " gas " +
         std::to_string(c.gas) + (c.passes.empty() ? "" : " passes " + Join(c.passes, ","));
}

void PrintTo(const Case& c, std::ostream* os) { *os << Name(c); }

StatusOr<proto::Schedule> Plan(const Case& c, int64_t budget_bytes) {
  ModelOverrides overrides;
  overrides.gas = c.gas;
  DC_ASSIGN_OR_RETURN(proto::ModelConfig config, MakeConfig(c.model, overrides));
  DC_ASSIGN_OR_RETURN(proto::Program program, BuildProgram(config));
  DC_ASSIGN_OR_RETURN(HardwareProfile hw, FindHardware("cpu"));
  DC_ASSIGN_OR_RETURN(ClusterShape cluster, MakeCluster(c.world, 1));
  PlanRequest request;
  request.world_size = c.world;
  request.costs = EstimateCostModel(program, hw, cluster);
  request.budget_bytes = budget_bytes;
  request.policy = c.policy;
  request.passes = c.passes;
  request.program = std::move(program);
  return MakePlan(request);
}

struct Outcome {
  std::vector<double> losses;
  std::string params_digest;
  int64_t peak_device_bytes = 0;
};

StatusOr<Outcome> RunRank(const proto::Schedule& plan, int rank, const std::string& store,
                          const CpuDeviceOptions& streams) {
  RendezvousOptions rendezvous;
  rendezvous.rank = rank;
  rendezvous.world_size = plan.world_size();
  rendezvous.store_dir = store;
  rendezvous.channels = kCpuDeviceChannels;
  rendezvous.timeout = std::chrono::seconds(60);
  DC_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> comm, Connect(rendezvous));
  DC_RETURN_IF_ERROR(CheckRunnable(plan, comm->world_size()));
  RunOptions options;
  options.steps = 3;
  DC_ASSIGN_OR_RETURN(std::unique_ptr<RankDevice> device, MakeCpuDevice(comm.get(), 1, streams));
  DC_ASSIGN_OR_RETURN(RunResult result,
                      Interpret(plan, options, device.get(), comm.get(), nullptr));
  return Outcome{result.losses, result.params_digest, result.peak_device_bytes};
}

// Every rank of `plan` as a thread of this process; rank 0's outcome (the figures are agreed
// over the ranks).
Outcome RunPlan(const proto::Schedule& plan, const CpuDeviceOptions& streams,
                const std::string& tag) {
  static int runs = 0;
  const std::string store = ::testing::TempDir() + "/cpu_device_test_" +
                            std::to_string(::getpid()) + "_" + std::to_string(runs++) + "_" + tag;
  std::filesystem::remove_all(store);
  const int world = plan.world_size();
  std::vector<StatusOr<Outcome>> outcomes(world, Status::Error("not run"));
  std::vector<std::thread> ranks;
  for (int r = 0; r < world; ++r) {
    ranks.emplace_back([&, r] { outcomes[r] = RunRank(plan, r, store, streams); });
  }
  for (std::thread& t : ranks) t.join();
  std::filesystem::remove_all(store);
  for (int r = 0; r < world; ++r) {
    EXPECT_TRUE(outcomes[r].ok()) << tag << " rank " << r << ": " << outcomes[r].status().message();
  }
  return outcomes[0].ok() ? *outcomes[0] : Outcome{};
}

class Streams : public ::testing::TestWithParam<Case> {};

TEST_P(Streams, ShakenThreadsGiveTheSerialResultsBitForBit) {
  const Case& c = GetParam();
  int64_t budget = 0;
  if (c.budget_fraction > 0) {
    auto unlimited = Plan(c, 0);
    ASSERT_TRUE(unlimited.ok()) << unlimited.status().message();
    budget = static_cast<int64_t>(c.budget_fraction *
                                  static_cast<double>(unlimited->prediction().peak_device_bytes()));
  }
  auto plan = Plan(c, budget);
  ASSERT_TRUE(plan.ok()) << Name(c) << ": " << plan.status().message();
  if (!c.passes.empty()) {  // the offloading case: reloads on their own stream
    bool reloads = false;
    for (const auto& instr : plan->instructions()) reloads |= instr.kind() == proto::INSTR_RELOAD;
    ASSERT_TRUE(reloads) << Name(c) << ": the budget leaves nothing to offload";
  }

  CpuDeviceOptions serial;
  serial.streams = CpuStreams::kSerial;
  const Outcome reference = RunPlan(*plan, serial, "serial");
  ASSERT_EQ(reference.losses.size(), 3u) << Name(c);
  for (uint64_t seed : {0, 1, 2, 3}) {
    CpuDeviceOptions threads;
    threads.streams = CpuStreams::kThreads;  // one rank too, and seed 0 unshaken
    threads.jitter_seed = seed;
    // New buffers full of NaNs: no kernel may read what it did not write, nothing may
    // accumulate into a buffer the interpreter did not zero.
    threads.poison_new_buffers = true;
    const Outcome shaken = RunPlan(*plan, threads, "seed" + std::to_string(seed));
    const std::string what = Name(c) + ", jitter seed " + std::to_string(seed);
    ASSERT_EQ(shaken.losses.size(), reference.losses.size()) << what;
    for (size_t i = 0; i < reference.losses.size(); ++i) {
      // Bit for bit: the same sums in the same order.
      EXPECT_EQ(shaken.losses[i], reference.losses[i]) << what << ", step " << i;
    }
    EXPECT_EQ(shaken.params_digest, reference.params_digest) << what;
    EXPECT_EQ(shaken.peak_device_bytes, reference.peak_device_bytes) << what;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Plans, Streams,
    ::testing::Values(
        Case{"tiny", 1, "baseline"}, Case{"tiny", 1, "dc"}, Case{"tiny", 2, "baseline"},
        Case{"tiny", 2, "dc"}, Case{"tiny", 2, "dc", 0.0, 2}, Case{"tiny", 2, "dc", 0.75},
        // Offloads and reloads on the host-copy streams, in the arena.
        Case{"tiny", 2, "dc", 1.15, 1, {"zero3", "prefetch", "offload-all", "memory-plan"}},
        Case{"tiny", 2, "zero3-offload"}, Case{"mixtral-tiny", 1, "dc"},
        Case{"mixtral-tiny", 2, "baseline"}, Case{"mixtral-tiny", 2, "dc"}));

// A kernel that fails on the compute stream's thread: the call that enqueued it returns at once,
// the failure comes back at the next synchronization, naming the instruction, and every later
// call refuses.
// A one-rank device prepared for tiny's baseline plan, with the given options (threads by
// default: these tests drive the stream threads call by call).
class OneDevice : public ::testing::Test {
 protected:
  void Make(CpuDeviceOptions options = Threads()) {
    device_.reset();  // before the communicator it uses
    auto made = Plan(Case("tiny", 1, "baseline"), 0);
    ASSERT_TRUE(made.ok()) << made.status().message();
    plan_ = std::move(*made);
    auto layout = MakeScheduleLayout(plan_);
    ASSERT_TRUE(layout.ok());
    layout_ = std::move(*layout);
    auto comm = Connect(RendezvousOptions{});
    ASSERT_TRUE(comm.ok());
    comm_ = std::move(*comm);
    auto device = MakeCpuDevice(comm_.get(), 1, options);
    ASSERT_TRUE(device.ok()) << device.status().message();
    device_ = std::move(*device);
    ASSERT_TRUE(device_->Prepare(plan_, layout_).ok());
  }
  static CpuDeviceOptions Threads() {
    CpuDeviceOptions threads;
    threads.streams = CpuStreams::kThreads;
    return threads;
  }
  proto::Schedule plan_;
  ScheduleLayout layout_;
  std::unique_ptr<Communicator> comm_;
  std::unique_ptr<RankDevice> device_;
};

TEST_F(OneDevice, AWorkerErrorComesBackNamingTheInstruction) {
  Make();
  ASSERT_FALSE(HasFatalFailure());
  RankDevice& d = *device_;
  ASSERT_TRUE(d.AfterInstruction(2, proto::STREAM_COMPUTE).ok());  // issuing instruction 3 now
  proto::Op op;
  op.set_name("broken");
  op.set_kind("no-such-kind");
  EXPECT_TRUE(d.RunOp(op, {}, {}, OpArgs{}).ok());  // enqueued, not run yet
  const Status synced = d.Synchronize("checking");
  ASSERT_FALSE(synced.ok());
  EXPECT_NE(synced.message().find("checking on rank 0: " + DescribeInstruction(plan_, 3, 0)),
            std::string::npos)
      << synced.message();
  EXPECT_NE(synced.message().find("no-such-kind"), std::string::npos) << synced.message();
  const Status later = d.Zero(nullptr, 0, proto::STREAM_GATHER, "later");
  ASSERT_FALSE(later.ok());
  EXPECT_NE(later.message().find("earlier work failed"), std::string::npos) << later.message();
}

// A wait for an event that will never be recorded (here: the host waiting) ends with Abort.
TEST_F(OneDevice, AbortEndsAWaitForAnEventNeverRecorded) {
  Make();
  ASSERT_FALSE(HasFatalFailure());
  RankDevice& d = *device_;
  // A stream waiting too: Abort drops it and the drain ends.
  ASSERT_TRUE(d.Wait(1, 0, proto::STREAM_GATHER).ok());
  Status waited;
  std::thread host([&] { waited = d.Wait(1, 0, proto::STREAM_HOST); });
  d.Abort();
  host.join();
  EXPECT_FALSE(waited.ok());
  EXPECT_FALSE(d.Synchronize("after the abort").ok());
}

// An event recorded in one step does not satisfy the same wait in the next: the wait holds the
// stream until the next step's record, in stream order, so work queued behind it sees the
// record's stream's work of that step.
TEST_F(OneDevice, EventsBelongToTheirStep) {
  CpuDeviceOptions shaken;
  shaken.jitter_seed = 5;
  Make(shaken);
  ASSERT_FALSE(HasFatalFailure());
  RankDevice& d = *device_;
  std::vector<float> a(1), b(1);
  for (int step = 0; step < 20; ++step) {
    // The gather stream writes a, records 0; the reduce stream waits for 0 and copies a to b.
    const float value = static_cast<float>(step + 1);
    ASSERT_TRUE(d.Zero(a.data(), sizeof(float), proto::STREAM_GATHER, "zero").ok());
    ASSERT_TRUE(d.CopyToDevice(a.data(), &value, sizeof(float), proto::STREAM_GATHER, "w").ok());
    ASSERT_TRUE(d.Record(0, proto::STREAM_GATHER).ok());
    ASSERT_TRUE(d.Wait(1, 0, proto::STREAM_REDUCE).ok());
    ASSERT_TRUE(d.CopyOnDevice(b.data(), a.data(), sizeof(float), proto::STREAM_REDUCE, "r").ok());
    ASSERT_TRUE(d.JoinStreams("join").ok());
    ASSERT_TRUE(d.FinishStep(step).ok());
    EXPECT_EQ(b[0], value) << "step " << step;
  }
}

TEST(CpuDeviceOptions, ComeFromTheEnvironment) {
  ::setenv("DC_CPU_STREAMS", "serial", 1);
  auto serial = CpuDeviceOptionsFromEnv();
  ASSERT_TRUE(serial.ok());
  EXPECT_EQ(serial->streams, CpuStreams::kSerial);
  ::setenv("DC_CPU_STREAMS", "threads", 1);
  auto threads = CpuDeviceOptionsFromEnv();
  ASSERT_TRUE(threads.ok());
  EXPECT_EQ(threads->streams, CpuStreams::kThreads);
  ::setenv("DC_CPU_STREAMS", "jitter:42", 1);
  auto jitter = CpuDeviceOptionsFromEnv();
  ASSERT_TRUE(jitter.ok());
  EXPECT_EQ(jitter->streams, CpuStreams::kThreads);
  EXPECT_EQ(jitter->jitter_seed, 42u);
  ::setenv("DC_CPU_STREAMS", "fast", 1);
  auto bad = CpuDeviceOptionsFromEnv();
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("DC_CPU_STREAMS=fast"), std::string::npos);
  ::unsetenv("DC_CPU_STREAMS");
  auto unset = CpuDeviceOptionsFromEnv();
  ASSERT_TRUE(unset.ok());
  EXPECT_EQ(unset->streams, CpuStreams::kAuto);
  EXPECT_EQ(unset->jitter_seed, 0u);
  ::setenv("DC_CPU_POISON", "1", 1);
  auto poison = CpuDeviceOptionsFromEnv();
  ASSERT_TRUE(poison.ok());
  EXPECT_TRUE(poison->poison_new_buffers);
  ::setenv("DC_CPU_POISON", "yes", 1);
  auto bad_poison = CpuDeviceOptionsFromEnv();
  ASSERT_FALSE(bad_poison.ok());
  EXPECT_NE(bad_poison.status().message().find("DC_CPU_POISON=yes"), std::string::npos);
  ::setenv("DC_CPU_POISON", "0", 1);
  auto no_poison = CpuDeviceOptionsFromEnv();
  ASSERT_TRUE(no_poison.ok());
  EXPECT_FALSE(no_poison->poison_new_buffers);
  ::unsetenv("DC_CPU_POISON");
}

// Counts what the device tells a tracer of the work its stream threads ran.
class RanCounter : public ExecutionTracer {
 public:
  int64_t NowNs() const override { return 0; }
  void DescribeInstruction(int, const TracedInstruction&) override {}
  Status BeginInstruction(const InstructionRef&) override { return Status::Ok(); }
  StatusOr<int64_t> EndInstruction(const InstructionRef&, int64_t, int64_t) override { return 0; }
  void InstructionRan(const InstructionRef&, int64_t, int64_t) override { ++ran; }
  void Memory(int64_t, int64_t, int64_t, bool, const std::string&, BufferKind, int64_t) override {}
  void Step(int, int64_t, int64_t, double, bool) override {}
  int ran = 0;
};

// One rank has no peer to wait for: by default its streams run in issue order on the calling
// thread (no work is handed to a stream thread, so none is reported as run there), with the
// same losses as a thread per stream.
TEST(CpuDevice, OneRankRunsInIssueOrderByDefault) {
  auto plan = Plan(Case("tiny", 1, "dc"), 0);
  ASSERT_TRUE(plan.ok()) << plan.status().message();
  std::vector<double> losses[2];
  int ran[2] = {0, 0};
  for (int i = 0; i < 2; ++i) {
    CpuDeviceOptions options;
    if (i == 1) options.streams = CpuStreams::kThreads;
    auto comm = Connect(RendezvousOptions{});
    ASSERT_TRUE(comm.ok());
    RanCounter tracer;
    auto device = MakeCpuDevice(comm->get(), 1, options, &tracer);
    ASSERT_TRUE(device.ok()) << device.status().message();
    RunOptions run;
    run.steps = 2;
    auto result = Interpret(*plan, run, device->get(), comm->get(), &tracer);
    ASSERT_TRUE(result.ok()) << result.status().message();
    losses[i] = result->losses;
    ran[i] = tracer.ran;
  }
  EXPECT_EQ(ran[0], 0);
  EXPECT_GT(ran[1], 0);
  EXPECT_EQ(losses[0], losses[1]);
}

// New buffers are not zeroed (a step would pay a memset per buffer); in the test mode they are
// NaNs, in the arena (in stream order) and from the pool alike.
TEST_F(OneDevice, PoisonsNewBuffersOnlyWhenAsked) {
  for (bool poison : {false, true}) {
    CpuDeviceOptions options;
    options.poison_new_buffers = poison;
    Make(options);
    ASSERT_FALSE(HasFatalFailure());
    RankDevice& d = *device_;
    ASSERT_TRUE(d.CreateArena(64).ok());
    auto placed = d.Allocate(16, 32, proto::STREAM_GATHER, "placed", "t");
    ASSERT_TRUE(placed.ok()) << placed.status().message();
    auto pooled = d.Allocate(-1, 32, proto::STREAM_COMPUTE, "pooled", "t");
    ASSERT_TRUE(pooled.ok()) << pooled.status().message();
    ASSERT_TRUE(d.JoinStreams("join").ok());
    const float* floats[] = {static_cast<const float*>(*placed),
                             static_cast<const float*>(*pooled)};
    if (poison) {
      for (const float* f : floats) {
        for (int i = 0; i < 8; ++i) EXPECT_TRUE(std::isnan(f[i])) << i;
      }
    } else {
      // The arena starts zeroed and nothing overwrote it.
      for (int i = 0; i < 8; ++i) EXPECT_EQ(floats[0][i], 0.0f) << i;
    }
    ASSERT_TRUE(d.Free(*pooled, proto::STREAM_COMPUTE, "free", "t").ok());
    ASSERT_TRUE(d.JoinStreams("join").ok());
  }
}

}  // namespace
}  // namespace dc
