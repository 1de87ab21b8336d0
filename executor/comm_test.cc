// The cpu backend's collectives (Gloo over loopback TCP), ranks as threads of this process:
// what they compute on worlds of 2-4 ranks, made ahead of their run or not, and that a rank
// reaching a collective long before its peer costs no CPU while it waits.
#include "executor/comm.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <ctime>
#include <filesystem>
#include <functional>
#include <string>
#include <thread>
#include <vector>

namespace dc {
namespace {

// Runs `body(rank, comm)` on every rank of a `world`-rank run, each on its own thread with its
// own connection; failures come back as test failures naming the rank.
void OnRanks(int world, const std::string& tag,
             const std::function<void(int, Communicator*)>& body) {
  const std::string store = ::testing::TempDir() + "/comm_test_" + std::to_string(::getpid()) +
                            "_" + tag + "_" + std::to_string(world);
  std::filesystem::remove_all(store);
  std::vector<std::thread> ranks;
  for (int r = 0; r < world; ++r) {
    ranks.emplace_back([&, r] {
      RendezvousOptions options;
      options.rank = r;
      options.world_size = world;
      options.store_dir = store;
      options.timeout = std::chrono::seconds(30);
      auto comm = Connect(options);
      ASSERT_TRUE(comm.ok()) << "rank " << r << ": " << comm.status().message();
      body(r, comm->get());
    });
  }
  for (std::thread& t : ranks) t.join();
  std::filesystem::remove_all(store);
}

// Element i of rank r's contribution: small integers, so every sum is exact in any order.
float Value(int rank, int64_t i) { return static_cast<float>((rank + 1) * 1000 + i % 997); }

TEST(Comm, AllGatherConcatenatesTheShardsInRankOrder) {
  for (int world : {2, 3, 4}) {
    for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{5000}}) {
      OnRanks(world, "gather" + std::to_string(n), [&](int rank, Communicator* comm) {
        std::vector<float> shard(n), out(n * world, -1.0f);
        for (int64_t i = 0; i < n; ++i) shard[i] = Value(rank, i);
        ASSERT_TRUE(comm->AllGather(shard.data(), n, out.data()).ok());
        for (int r = 0; r < world; ++r) {
          for (int64_t i = 0; i < n; ++i) {
            ASSERT_EQ(out[r * n + i], Value(r, i))
                << "world " << world << " rank " << rank << ": rank " << r << "'s element " << i;
          }
        }
      });
    }
  }
}

TEST(Comm, ReduceScatterSumsEachRanksChunk) {
  for (int world : {2, 3, 4}) {
    for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{5000}}) {
      OnRanks(world, "reduce" + std::to_string(n), [&](int rank, Communicator* comm) {
        std::vector<float> full(n * world), shard(n, -1.0f);
        for (int64_t i = 0; i < n * world; ++i) full[i] = Value(rank, i);
        ASSERT_TRUE(comm->ReduceScatterSum(full.data(), n, shard.data()).ok());
        for (int64_t i = 0; i < n; ++i) {
          float sum = 0;
          for (int r = 0; r < world; ++r) sum += Value(r, rank * n + i);
          ASSERT_EQ(shard[i], sum) << "world " << world << " rank " << rank << " element " << i;
        }
      });
    }
  }
}

// The cpu device's pattern: the next collectives are made (their receives posted) while an
// earlier one has not run yet; runs go in the order they were made.
TEST(Comm, CollectivesMadeAheadRunInTheirOrder) {
  constexpr int kWorld = 3;
  constexpr int64_t kN = 777;
  OnRanks(kWorld, "ahead", [&](int rank, Communicator* comm) {
    auto gather = comm->PostAllGather(kN);
    auto reduce = comm->PostReduceScatterSum(kN);
    auto gather_again = comm->PostAllGather(kN);
    ASSERT_TRUE(gather.ok() && reduce.ok() && gather_again.ok());
    for (int64_t i = 0; i < kN; ++i) (*gather)->input()[i] = Value(rank, i);
    for (int64_t i = 0; i < kN * kWorld; ++i) (*reduce)->input()[i] = Value(rank, i);
    for (int64_t i = 0; i < kN; ++i) (*gather_again)->input()[i] = -Value(rank, i);
    ASSERT_TRUE((*gather)->Run().ok());
    ASSERT_TRUE((*reduce)->Run().ok());
    ASSERT_TRUE((*gather_again)->Run().ok());
    for (int r = 0; r < kWorld; ++r) {
      for (int64_t i = 0; i < kN; ++i) {
        ASSERT_EQ((*gather)->output()[r * kN + i], Value(r, i));
        ASSERT_EQ((*gather_again)->output()[r * kN + i], -Value(r, i));
      }
    }
    for (int64_t i = 0; i < kN; ++i) {
      float sum = 0;
      for (int r = 0; r < kWorld; ++r) sum += Value(r, rank * kN + i);
      ASSERT_EQ((*reduce)->output()[i], sum);
    }
  });
}

double ProcessCpuSeconds() {
  timespec t{};
  ::clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

// Rank 0 reaches an all-gather and sends; rank 1 gets there half a second later. Nothing may
// burn a core meanwhile: Gloo's bound-buffer algorithms left the late rank's device thread
// spinning on the early bytes until its buffer was registered (about the whole half second of
// CPU here), which on a machine with as many ranks as cores starved the ranks' own threads.
TEST(Comm, ARankWaitingForItsPeerCostsNoCpu) {
  constexpr auto kLate = std::chrono::milliseconds(500);
  constexpr int64_t kN = 4096;
  double cpu_seconds = -1;
  OnRanks(2, "late", [&](int rank, Communicator* comm) {
    // Both connected and idle before the clock starts.
    int64_t token = 0;
    ASSERT_TRUE(comm->Broadcast(&token, 0).ok());
    const double cpu_before = ProcessCpuSeconds();
    if (rank == 1) std::this_thread::sleep_for(kLate);
    std::vector<float> shard(kN, static_cast<float>(rank)), out(2 * kN);
    ASSERT_TRUE(comm->AllGather(shard.data(), kN, out.data()).ok());
    if (rank == 1) cpu_seconds = ProcessCpuSeconds() - cpu_before;
    EXPECT_EQ(out[0], 0.0f);
    EXPECT_EQ(out[kN], 1.0f);
  });
  // Both ranks' threads, this process's whole CPU time over the half second.
  EXPECT_GE(cpu_seconds, 0);
  EXPECT_LT(cpu_seconds, 0.15) << "the process spent " << cpu_seconds
                               << " s of CPU while one rank slept half a second";
}

// Abort ends a collective waiting for a peer that will never come, on this rank at once, not
// at the timeout: the cpu device aborts its channels when one of its streams fails.
TEST(Comm, AbortEndsACollectiveWaitingForItsPeer) {
  constexpr int64_t kN = 1024;
  std::atomic<bool> done{false};
  OnRanks(2, "abort", [&](int rank, Communicator* comm) {
    int64_t token = 0;
    ASSERT_TRUE(comm->Broadcast(&token, 0).ok());
    if (rank == 1) {
      // Never joins the all-gather; stays connected until rank 0 is done.
      while (!done) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      return;
    }
    auto gather = comm->PostAllGather(kN);
    ASSERT_TRUE(gather.ok());
    std::thread aborter([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      comm->Abort();
    });
    const auto start = std::chrono::steady_clock::now();
    const Status status = (*gather)->Run();
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    aborter.join();
    done = true;
    EXPECT_FALSE(status.ok());
    // This rank's abort, not a peer's failure.
    EXPECT_NE(status.message().find("the run was aborted"), std::string::npos) << status.message();
    EXPECT_EQ(status.message().find("peer"), std::string::npos) << status.message();
    EXPECT_LT(seconds, 5.0) << "the aborted all-gather took " << seconds << " s (timeout 30 s)";
  });
}
}  // namespace
}  // namespace dc
