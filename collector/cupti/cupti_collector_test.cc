// The CUPTI collector on a real device (label gpu): every test skips where there is none.
#include "collector/cupti/cupti_collector.h"

#include <cuda_runtime.h>
#include <cupti.h>
#include <gtest/gtest.h>
#include <sqlite3.h>
#include <stdlib.h>

#include <filesystem>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "analyzer/trace.h"
#include "collector/cupti/attach.h"
#include "collector/cupti/test_kernels.h"
#include "collector/host_tracer.h"

namespace dc {
namespace {

namespace fs = std::filesystem;

// Skips the test unless a CUDA device can be used.
#define DC_REQUIRE_DEVICE()                                              \
  do {                                                                   \
    int devices = 0;                                                     \
    const cudaError_t error = cudaGetDeviceCount(&devices);              \
    if (error != cudaSuccess || devices == 0) {                          \
      GTEST_SKIP() << "no CUDA device ("                                 \
                   << (error != cudaSuccess ? cudaGetErrorString(error)  \
                                            : "cudaGetDeviceCount is 0") \
                   << ")";                                               \
    }                                                                    \
  } while (0)

#define ASSERT_CUDA(call) ASSERT_EQ((call), cudaSuccess) << #call

class TempDir {
 public:
  TempDir() {
    std::string pattern = (fs::temp_directory_path() / "dc_cupti_gpu_test_XXXXXX").string();
    path_ = mkdtemp(pattern.data());
  }
  ~TempDir() { fs::remove_all(path_); }
  std::string File(const std::string& name) const { return (fs::path(path_) / name).string(); }

 private:
  std::string path_;
};

int64_t QueryInt(const std::string& path, const std::string& sql) {
  sqlite3* db = nullptr;
  EXPECT_EQ(sqlite3_open_v2(path.c_str(), &db, SQLITE_OPEN_READONLY, nullptr), SQLITE_OK);
  sqlite3_stmt* stmt = nullptr;
  EXPECT_EQ(sqlite3_prepare_v2(db, sql.c_str(), -1, &stmt, nullptr), SQLITE_OK) << sql;
  int64_t value = -1;
  if (stmt && sqlite3_step(stmt) == SQLITE_ROW) value = sqlite3_column_int64(stmt, 0);
  sqlite3_finalize(stmt);
  sqlite3_close(db);
  return value;
}

constexpr int kElements = 1 << 20;
constexpr int64_t kBytes = int64_t{kElements} * sizeof(float);
constexpr int64_t kGatherBytes = 4096;

TEST(CuptiCollector, RecordsKernelsCopiesAllocationsAndInstructions) {
  DC_REQUIRE_DEVICE();
  TempDir dir;
  CuptiCollectorOptions options;
  options.output_path = dir.File("rank0.db");
  options.device_id = 0;
  auto created = CuptiCollector::Create(options);
  ASSERT_TRUE(created.ok()) << created.status().message();
  CuptiCollector& collector = **created;
  ASSERT_TRUE(collector.Start().ok());
  collector.DescribeInstruction(0, {"compute", 0, 0, 1, -1});
  collector.DescribeInstruction(1, {"all_gather", 0, kGatherBytes, 2, 5});

  const int64_t step_start_ns = collector.NowNs();
  cudaStream_t stream = nullptr;
  ASSERT_CUDA(cudaStreamCreate(&stream));
  ASSERT_TRUE(collector.NameStream(stream, "compute").ok());
  std::vector<float> host(kElements, 1.0f);
  float *a = nullptr, *b = nullptr;
  ASSERT_CUDA(cudaMalloc(&a, kBytes));
  ASSERT_CUDA(cudaMalloc(&b, kBytes));
  ASSERT_CUDA(cudaMemcpyAsync(a, host.data(), kBytes, cudaMemcpyHostToDevice, stream));
  ASSERT_TRUE(collector.PushInstruction(0, 0).ok());
  for (int i = 0; i < 3; ++i) {
    ASSERT_EQ(cupti_testing::LaunchScale(a, kElements, 2.0f, stream), 0);
  }
  ASSERT_TRUE(collector.PopInstruction().ok());
  ASSERT_TRUE(collector.PushInstruction(0, 1).ok());
  ASSERT_EQ(cupti_testing::LaunchFakeNcclAllGather(a, b, kElements, stream), 0);
  ASSERT_TRUE(collector.PopInstruction().ok());
  ASSERT_CUDA(cudaMemsetAsync(b, 0, kBytes, stream));
  ASSERT_CUDA(cudaMemcpyAsync(host.data(), a, kBytes, cudaMemcpyDeviceToHost, stream));
  ASSERT_CUDA(cudaStreamSynchronize(stream));
  EXPECT_EQ(host[0], 8.0f);
  ASSERT_CUDA(cudaFree(a));
  ASSERT_CUDA(cudaFree(b));
  ASSERT_CUDA(cudaStreamDestroy(stream));
  const int64_t step_end_ns = collector.NowNs();
  collector.Step(0, step_start_ns, step_end_ns, 0.0, false);

  auto counts = collector.Finish();
  ASSERT_TRUE(counts.ok()) << counts.status().message();
  // Warnings leave a usable trace; shown for the record of the first runs on new hardware.
  for (const std::string& warning : counts->warnings) {
    std::cout << "[ warning  ] " << warning << "\n";
  }
  EXPECT_EQ(counts->kernels, 3);
  EXPECT_EQ(counts->collectives, 1);
  EXPECT_GE(counts->memcpys, 2);  // a pageable copy may come in pieces; the bytes add up
  EXPECT_EQ(counts->memsets, 1);
  EXPECT_GE(counts->memory_events, 4);  // 2 cudaMalloc + 2 cudaFree (+ CUPTI's own, if any)
  EXPECT_EQ(counts->dropped_records, 0);
  EXPECT_EQ(counts->zero_timestamp_records, 0);
  EXPECT_EQ(counts->mapped_activities, 4);
  EXPECT_GT(counts->api_calls, 0);

  const std::string& rank_path = options.output_path;
  EXPECT_EQ(QueryInt(rank_path, "SELECT count(*) FROM TC_STREAM WHERE name = 'compute'"), 1);
  EXPECT_EQ(QueryInt(rank_path,
                     "SELECT count(*) FROM TARGET_INFO_GPU WHERE name IS NOT NULL "
                     "AND totalMemory > 0 AND smCount > 0"),
            1);
  EXPECT_GT(QueryInt(rank_path, "SELECT deviceMemoryBytes FROM TC_RANK"), 0);
  EXPECT_EQ(QueryInt(rank_path, "SELECT count(*) FROM TC_CLOCK_ANCHOR"), 4);

  proto::Schedule schedule;
  schedule.set_world_size(1);
  schedule.set_backend("cuda");
  const std::string out = dir.File("trace.db");
  auto merged = MergeRankTraces({rank_path}, schedule, out);
  ASSERT_TRUE(merged.ok()) << merged.status().message();
  auto trace = Trace::Open(out);
  ASSERT_TRUE(trace.ok()) << trace.status().message();
  const Trace& t = **trace;
  EXPECT_EQ(t.DroppedRecords(), 0);
  std::map<std::string, int> names;
  int64_t copied_bytes = 0;
  ASSERT_TRUE(t.ForEachActivity([&](const Activity& a) {
                 ++names[a.name];
                 EXPECT_GE(a.start_ns, step_start_ns) << a.name;
                 EXPECT_LE(a.end_ns, step_end_ns) << a.name;
                 EXPECT_LE(a.start_ns, a.end_ns) << a.name;
                 if (a.type == Activity::Type::kMemcpy) copied_bytes += a.bytes;
                 if (a.type == Activity::Type::kCollective) {
                   EXPECT_EQ(a.bytes, kGatherBytes);
                   EXPECT_TRUE(a.communication);
                 }
               }).ok());
  EXPECT_EQ(names["scale"], 3);
  EXPECT_EQ(names["all_gather"], 1);
  EXPECT_EQ(names["[CUDA memset]"], 1);
  EXPECT_EQ(copied_bytes, 2 * kBytes);
  int64_t allocated = 0, freed = 0;
  ASSERT_TRUE(t.ForEachMemoryEvent([&](const MemoryEvent& e) {
                 if (e.bytes != kBytes) return;
                 (e.alloc ? allocated : freed) += e.bytes;
               }).ok());
  EXPECT_EQ(allocated, 2 * kBytes);
  EXPECT_EQ(freed, 2 * kBytes);
  std::map<int, int> samples;
  int64_t gather_bytes = 0;
  ASSERT_TRUE(t.ForEachInstructionSample([&](const Trace::InstructionSample& s) {
                 ++samples[s.instruction];
                 if (s.instruction == 1) gather_bytes += s.bytes;
               }).ok());
  EXPECT_EQ(samples[0], 3);
  EXPECT_EQ(samples[1], 1);
  EXPECT_EQ(gather_bytes, kGatherBytes);
}

TEST(CuptiCollector, StepsAsideForAnotherProfiler) {
  DC_REQUIRE_DEVICE();
  CUpti_SubscriberHandle other = nullptr;
  ASSERT_EQ(cuptiSubscribe(
                &other, [](void*, CUpti_CallbackDomain, CUpti_CallbackId, const void*) {}, nullptr),
            CUPTI_SUCCESS);
  TempDir dir;
  CuptiCollectorOptions options;
  options.output_path = dir.File("rank0.db");
  auto created = CuptiCollector::Create(options);
  EXPECT_FALSE(created.ok());
  EXPECT_TRUE(IsAnotherProfilerError(created.status())) << created.status().message();
  EXPECT_EQ(cuptiUnsubscribe(other), CUPTI_SUCCESS);
  EXPECT_TRUE(fs::is_empty(fs::path(options.output_path).parent_path()));
}

// The unmodified program under libdc_inject.so.
TEST(Attach, TracesAnUnmodifiedProgram) {
  DC_REQUIRE_DEVICE();
  TempDir dir;
  AttachOptions options;
  options.output_path = dir.File("trace.db");
  options.inject_library = DC_INJECT_LIBRARY;
  testing::internal::CaptureStderr();
  const int status = RunAttached(options, {DC_CUPTI_TEST_PROGRAM});
  const std::string err = testing::internal::GetCapturedStderr();
  ASSERT_EQ(status, 0) << err;
  const std::string& out = options.output_path;
  EXPECT_EQ(QueryInt(out,
                     "SELECT count(*) FROM CUPTI_ACTIVITY_KIND_KERNEL k JOIN StringIds s "
                     "ON s.id = k.shortName WHERE s.value = 'add_one'"),
            3);
  EXPECT_GE(QueryInt(out, "SELECT count(*) FROM CUPTI_ACTIVITY_KIND_MEMCPY"), 2);
  EXPECT_EQ(QueryInt(out, "SELECT COALESCE(SUM(bytes), 0) FROM CUPTI_ACTIVITY_KIND_MEMCPY"),
            2 * (int64_t{1} << 16) * 4);
  EXPECT_EQ(QueryInt(out, "SELECT count(*) FROM CUPTI_ACTIVITY_KIND_MEMSET"), 1);
  EXPECT_GE(QueryInt(out, "SELECT count(*) FROM CUDA_GPU_MEMORY_USAGE_EVENTS"), 2);
  EXPECT_GT(QueryInt(out, "SELECT count(*) FROM CUPTI_ACTIVITY_KIND_RUNTIME"), 0);
  EXPECT_EQ(QueryInt(out, "SELECT COALESCE(SUM(dropped), 0) FROM TC_RECORD_STATS"), 0);
  EXPECT_EQ(QueryInt(out, "SELECT count(*) FROM TC_RANK"), 1);
  std::cout << err;  // the traced program's output and dc's warnings, if any
}

TEST(Attach, FollowsTheProgramsCudaProfilerRange) {
  DC_REQUIRE_DEVICE();
  TempDir dir;
  AttachOptions options;
  options.output_path = dir.File("trace.db");
  options.inject_library = DC_INJECT_LIBRARY;
  options.quiet = true;
  testing::internal::CaptureStderr();
  const int status = RunAttached(options, {DC_CUPTI_TEST_PROGRAM, "--range"});
  const std::string err = testing::internal::GetCapturedStderr();
  ASSERT_EQ(status, 0) << err;
  const std::string& out = options.output_path;
  // Only the two kernels inside cudaProfilerStart/Stop; allocations from before are kept.
  EXPECT_EQ(QueryInt(out, "SELECT count(*) FROM CUPTI_ACTIVITY_KIND_KERNEL"), 2);
  EXPECT_EQ(QueryInt(out, "SELECT count(*) FROM CUPTI_ACTIVITY_KIND_MEMCPY"), 0);
  EXPECT_GE(QueryInt(out,
                     "SELECT count(*) FROM CUDA_GPU_MEMORY_USAGE_EVENTS WHERE "
                     "memoryOperationType = 0"),
            1);
}

}  // namespace
}  // namespace dc
