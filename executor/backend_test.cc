// Picking a backend and matching it with the plan, on any machine; the cpu backend through the
// session seam trains exactly as RunSchedule does.
#include "executor/backend.h"

#include <gtest/gtest.h>

#include "executor/backends.h"
#include "executor/session.h"
#include "models/model.h"
#include "rewriter/zero3.h"

namespace dc {
namespace {

constexpr BackendAvailability kCpuOnlyBuild{false, 0};
constexpr BackendAvailability kNoDevice{true, 0};
constexpr BackendAvailability kOneDevice{true, 1};

std::string Resolve(const std::string& requested, const BackendAvailability& available) {
  auto backend = ResolveBackend(requested, available, "dc-run");
  return backend.ok() ? *backend : "error: " + backend.status().message();
}

bool OneLine(const std::string& text) { return text.find('\n') == std::string::npos; }

proto::Schedule TinyPlan(const std::string& backend) {
  auto config = MakeConfig("tiny", {});
  auto program = BuildProgram(*config);
  proto::Schedule s;
  s.set_world_size(1);
  s.set_backend(backend);
  *s.mutable_program() = *program;
  Zero3Pass pass;
  EXPECT_TRUE(pass.Run(&s, PassContext{}).ok());
  return s;
}

TEST(Backend, AutoIsCudaOnlyWithTheBackendAndADevice) {
  EXPECT_EQ(Resolve("auto", kCpuOnlyBuild), "cpu");
  EXPECT_EQ(Resolve("auto", kNoDevice), "cpu");
  EXPECT_EQ(Resolve("auto", BackendAvailability{false, 4}), "cpu");
  EXPECT_EQ(Resolve("auto", kOneDevice), "cuda");
  EXPECT_EQ(Resolve("cpu", kOneDevice), "cpu");
  EXPECT_EQ(Resolve("cuda", kOneDevice), "cuda");
}

TEST(Backend, CudaWithoutTheBackendOrADeviceSaysWhy) {
  const std::string not_built = Resolve("cuda", kCpuOnlyBuild);
  EXPECT_NE(not_built.find("--backend cuda: this dc-run was built without the CUDA toolkit"),
            std::string::npos)
      << not_built;
  EXPECT_TRUE(OneLine(not_built));
  const std::string no_device = Resolve("cuda", kNoDevice);
  EXPECT_NE(no_device.find("no CUDA device is visible"), std::string::npos) << no_device;
  EXPECT_NE(no_device.find("--backend cpu"), std::string::npos) << no_device;
  EXPECT_TRUE(OneLine(no_device));
  EXPECT_NE(Resolve("tpu", kOneDevice).find("use auto, cpu or cuda"), std::string::npos);
}

TEST(Backend, ThisHostWithoutADeviceRunsOnCpu) {
  const BackendAvailability here = AvailableBackends();
#if defined(DC_HAVE_CUDA_BACKEND)
  EXPECT_TRUE(here.cuda_compiled);
#else
  EXPECT_FALSE(here.cuda_compiled);
#endif
  if (here.cuda_devices > 0) GTEST_SKIP() << "this host has a CUDA device";
  EXPECT_EQ(Resolve("auto", here), "cpu");
}

TEST(Backend, APlanForTheOtherBackendNamesTheFileAndHowToReplan) {
  const proto::Schedule cuda_plan = TinyPlan("cuda");
  const proto::Schedule cpu_plan = TinyPlan("cpu");
  EXPECT_TRUE(CheckPlanBackend("p.dcplan", cuda_plan, "cuda", "auto", kOneDevice).ok());
  EXPECT_TRUE(CheckPlanBackend("p.dcplan", cpu_plan, "cpu", "auto", kNoDevice).ok());

  struct Case {
    const proto::Schedule* plan;
    std::string backend, requested;
    BackendAvailability available;
    std::vector<std::string> expect;
  };
  const Case cases[] = {
      {&cuda_plan,
       "cpu",
       "cpu",
       kOneDevice,
       {"cuda.dcplan: the plan is for the cuda backend", "--backend cpu", "re-plan for cpu",
        "--backend cuda"}},
      {&cuda_plan,
       "cpu",
       "auto",
       kNoDevice,
       {"this host has no CUDA device (--backend auto chose cpu)", "re-plan for cpu"}},
      {&cuda_plan,
       "cpu",
       "auto",
       kCpuOnlyBuild,
       {"this build has no CUDA backend", "re-plan for cpu"}},
      {&cpu_plan,
       "cuda",
       "auto",
       kOneDevice,
       {"cuda.dcplan: the plan is for the cpu backend", "this run uses cuda (--backend auto)",
        "re-plan for cuda", "--backend cpu"}},
  };
  for (const Case& c : cases) {
    const Status status =
        CheckPlanBackend("cuda.dcplan", *c.plan, c.backend, c.requested, c.available);
    ASSERT_FALSE(status.ok());
    EXPECT_TRUE(OneLine(status.message())) << status.message();
    for (const std::string& e : c.expect) {
      EXPECT_NE(status.message().find(e), std::string::npos)
          << status.message() << "\nlacks: " << e;
    }
  }
  proto::Schedule tpu_plan = cpu_plan;
  tpu_plan.set_backend("tpu");
  EXPECT_NE(CheckPlanBackend("t.dcplan", tpu_plan, "cpu", "cpu", kNoDevice).message().find("tpu"),
            std::string::npos);
}

TEST(Backend, CheckRunnableNamesBothBackends) {
  const Status status = CheckRunnable(TinyPlan("cpu"), 1, "cuda");
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.message().find("the plan is for the 'cpu' backend and this run uses 'cuda'"),
            std::string::npos)
      << status.message();
  EXPECT_TRUE(CheckRunnable(TinyPlan("cuda"), 1, "cuda").ok());
}

TEST(Backend, MakeBackendHasWhatThisBuildHas) {
  auto cpu = MakeBackend("cpu");
  ASSERT_TRUE(cpu.ok());
  EXPECT_EQ((*cpu)->name(), "cpu");
  auto cuda = MakeBackend("cuda");
#if defined(DC_HAVE_CUDA_BACKEND)
  ASSERT_TRUE(cuda.ok()) << cuda.status().message();  // made without touching a device
  EXPECT_EQ((*cuda)->name(), "cuda");
#else
  EXPECT_FALSE(cuda.ok());
#endif
  EXPECT_EQ(BackendDevice("cpu", 0), "cpu");
}

TEST(Backend, TheCpuBackendThroughTheSessionTrainsAsRunSchedule) {
  const proto::Schedule plan = TinyPlan("cpu");
  auto comm = Connect(RendezvousOptions{});
  ASSERT_TRUE(comm.ok());
  RunOptions run;
  run.steps = 3;
  auto direct = RunSchedule(plan, run, comm->get(), nullptr);
  ASSERT_TRUE(direct.ok()) << direct.status().message();

  auto backend = MakeBackend("cpu");
  ASSERT_TRUE(backend.ok());
  SessionOptions session;
  session.run = run;
  session.backend = backend->get();
  auto through = RunAsRank(plan, session);
  ASSERT_TRUE(through.ok()) << through.status().message();
  EXPECT_EQ(through->run.losses, direct->losses);
  EXPECT_EQ(through->run.params_digest, direct->params_digest);
  EXPECT_EQ(through->run.peak_device_bytes, direct->peak_device_bytes);
}

TEST(Backend, TheCudaBackendWithoutADeviceFailsInOneLine) {
  const BackendAvailability here = AvailableBackends();
  if (!here.cuda_compiled) GTEST_SKIP() << "this build has no cuda backend";
  if (here.cuda_devices > 0) GTEST_SKIP() << "this host has a CUDA device";
  auto backend = MakeBackend("cuda");
  ASSERT_TRUE(backend.ok());
  SessionOptions session;
  session.run.steps = 1;
  session.backend = backend->get();
  auto run = RunAsRank(TinyPlan("cuda"), session);
  ASSERT_FALSE(run.ok());
  EXPECT_NE(run.status().message().find("rank 0: the cuda backend needs a CUDA device"),
            std::string::npos)
      << run.status().message();
  EXPECT_TRUE(OneLine(run.status().message()));
}

}  // namespace
}  // namespace dc
