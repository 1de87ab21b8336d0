// The cpu backend's collectives, over Gloo's loopback TCP and through shared memory, ranks as
// threads of this process (and one test's as a second process): what they compute on worlds of
// 2-4 ranks, made ahead of their run or not, the same bits on both transports, that a rank
// reaching a collective long before its peer costs no CPU while it waits, and what a wait says
// when the peer aborts, dies or made another collective.
#include "executor/comm.h"

#include <gtest/gtest.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace dc {
namespace {

// Runs `body(rank, comm)` on every rank of a `world`-rank run, each on its own thread with its
// own connection; failures come back as test failures naming the rank.
using Transport = RendezvousOptions::Transport;

RendezvousOptions RankOptions(int rank, int world, const std::string& store, Transport transport) {
  RendezvousOptions options;
  options.rank = rank;
  options.world_size = world;
  options.store_dir = store;
  options.timeout = std::chrono::seconds(30);
  options.transport = transport;
  return options;
}

void OnRanks(int world, const std::string& tag, Transport transport,
             const std::function<void(int, Communicator*)>& body) {
  const std::string store = ::testing::TempDir() + "/comm_test_" + std::to_string(::getpid()) +
                            "_" + tag + "_" + std::to_string(world);
  std::filesystem::remove_all(store);
  std::vector<std::thread> ranks;
  for (int r = 0; r < world; ++r) {
    ranks.emplace_back([&, r] {
      auto comm = Connect(RankOptions(r, world, store, transport));
      ASSERT_TRUE(comm.ok()) << "rank " << r << ": " << comm.status().message();
      EXPECT_EQ((*comm)->transport(), transport == Transport::kTcp ? "tcp" : "shared-memory");
      body(r, comm->get());
    });
  }
  for (std::thread& t : ranks) t.join();
  std::filesystem::remove_all(store);
}

// Every test runs on both transports.
class Comm : public ::testing::TestWithParam<Transport> {
 protected:
  void OnRanks(int world, const std::string& tag,
               const std::function<void(int, Communicator*)>& body) {
    dc::OnRanks(world, tag + (GetParam() == Transport::kTcp ? "_tcp" : "_shm"), GetParam(), body);
  }
};

INSTANTIATE_TEST_SUITE_P(Transports, Comm,
                         ::testing::Values(Transport::kTcp, Transport::kSharedMemory),
                         [](const ::testing::TestParamInfo<Transport>& info) {
                           return info.param == Transport::kTcp ? "tcp" : "shm";
                         });

// Element i of rank r's contribution: small integers, so every sum is exact in any order.
float Value(int rank, int64_t i) { return static_cast<float>((rank + 1) * 1000 + i % 997); }

TEST_P(Comm, AllGatherConcatenatesTheShardsInRankOrder) {
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

TEST_P(Comm, ReduceScatterSumsEachRanksChunk) {
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
TEST_P(Comm, CollectivesMadeAheadRunInTheirOrder) {
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
TEST_P(Comm, ARankWaitingForItsPeerCostsNoCpu) {
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
TEST_P(Comm, AbortEndsACollectiveWaitingForItsPeer) {
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

// A peer's abort (its run failed elsewhere) ends this rank's wait at once, as a consequence of the
// peer's failure ("a peer rank is gone"): the launcher then reports the peer's own error, not
// this rank's.
TEST_P(Comm, APeersAbortEndsTheWaitAsThePeersFailure) {
  constexpr int64_t kN = 1024;
  OnRanks(2, "peer_abort", [&](int rank, Communicator* comm) {
    int64_t token = 0;
    ASSERT_TRUE(comm->Broadcast(&token, 0).ok());
    if (rank == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      comm->Abort();
      return;
    }
    auto gather = comm->PostAllGather(kN);
    ASSERT_TRUE(gather.ok());
    const auto start = std::chrono::steady_clock::now();
    const Status status = (*gather)->Run();
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_FALSE(status.ok());
    EXPECT_NE(status.message().find("a peer rank is gone"), std::string::npos) << status.message();
    EXPECT_LT(seconds, 5.0) << "the wait took " << seconds << " s (timeout 30 s)";
  });
}

// Sums that round: the shared-memory reduce-scatter adds each chunk in the order of Gloo's ring
// (the owner's next rank first, the owner last), so the two transports give the same bits, and
// so do losses whichever transport a run gets.
TEST(CommTransports, AReduceScatterGivesTheSameBitsOnBothTransports) {
  constexpr int64_t kN = 3001;
  for (int world : {2, 3, 4}) {
    std::vector<std::vector<float>> shards[2];
    std::vector<float> inputs[4];
    for (int t = 0; t < 2; ++t) {
      const Transport transport = t == 0 ? Transport::kTcp : Transport::kSharedMemory;
      shards[t].assign(world, {});
      OnRanks(world, "bits" + std::to_string(t), transport, [&](int rank, Communicator* comm) {
        std::mt19937 random(1234 + rank);
        std::uniform_real_distribution<float> mantissa(-1.0f, 1.0f);
        std::uniform_int_distribution<int> exponent(-20, 20);
        std::vector<float> full(kN * world), shard(kN);
        for (float& x : full) x = std::ldexp(mantissa(random), exponent(random));
        if (t == 0) inputs[rank] = full;
        ASSERT_TRUE(comm->ReduceScatterSum(full.data(), kN, shard.data()).ok());
        shards[t][rank] = shard;
      });
    }
    for (int rank = 0; rank < world; ++rank) {
      ASSERT_EQ(shards[0][rank].size(), static_cast<size_t>(kN));
      ASSERT_EQ(shards[1][rank].size(), static_cast<size_t>(kN));
      EXPECT_EQ(std::memcmp(shards[0][rank].data(), shards[1][rank].data(), kN * sizeof(float)), 0)
          << "world " << world << " rank " << rank;
    }
    // The test can tell orders apart: rank 0's chunk summed in rank order differs somewhere.
    if (world >= 3) {
      int differ = 0;
      for (int64_t i = 0; i < kN; ++i) {
        float in_rank_order = 0;
        for (int r = 0; r < world; ++r) in_rank_order += inputs[r][i];
        differ += in_rank_order != shards[1][0][i];
      }
      EXPECT_GT(differ, 0) << "world " << world;
    }
  }
}

// Ranks that made different collectives (another plan, another build) hear so at once, instead
// of reading past each other's buffers or waiting for the timeout.
TEST(CommSharedMemory, RanksThatMadeDifferentCollectivesAreToldSo) {
  OnRanks(2, "mismatch", Transport::kSharedMemory, [&](int rank, Communicator* comm) {
    auto gather = comm->PostAllGather(rank == 0 ? 100 : 101);
    ASSERT_TRUE(gather.ok());
    const auto start = std::chrono::steady_clock::now();
    const Status status = (*gather)->Run();
    EXPECT_FALSE(status.ok());
    EXPECT_NE(status.message().find("the ranks run different plans"), std::string::npos)
        << status.message();
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 5.0);
  });
}

// A peer process that dies (killed, crashed) ends the waits for it well before the timeout: the
// wait looks for the process between its sleeps.
TEST(CommSharedMemory, AWaitEndsWhenThePeersProcessIsGone) {
  const std::string store =
      ::testing::TempDir() + "/comm_test_" + std::to_string(::getpid()) + "_gone";
  std::filesystem::remove_all(store);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // Rank 1: meets rank 0, then dies without joining its all-gather.
    auto comm = Connect(RankOptions(1, 2, store, Transport::kSharedMemory));
    int64_t token = 0;
    const bool ok = comm.ok() && (*comm)->Broadcast(&token, 0).ok();
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    ::_exit(ok ? 0 : 3);
  }
  int child_status = -1;
  std::thread reaper([&] { ::waitpid(child, &child_status, 0); });
  auto comm = Connect(RankOptions(0, 2, store, Transport::kSharedMemory));
  int64_t token = 0;
  const bool met = comm.ok() && (*comm)->Broadcast(&token, 0).ok();
  if (!met) ::kill(child, SIGKILL);
  Status status = Status::Ok();
  double seconds = -1;
  if (met) {
    auto gather = (*comm)->PostAllGather(1024);
    const auto start = std::chrono::steady_clock::now();
    status = gather.ok() ? (*gather)->Run() : gather.status();
    seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  reaper.join();
  ASSERT_TRUE(met) << (comm.ok() ? "the broadcast failed" : comm.status().message());
  EXPECT_TRUE(WIFEXITED(child_status) && WEXITSTATUS(child_status) == 0);
  EXPECT_FALSE(status.ok());
  EXPECT_NE(status.message().find("a peer rank is gone (rank 1"), std::string::npos)
      << status.message();
  EXPECT_LT(seconds, 5.0) << "the wait took " << seconds << " s (timeout 30 s)";
  std::filesystem::remove_all(store);
}

// Every segment is unlinked once the ranks have mapped it: a run leaves nothing in /dev/shm,
// even one that is killed.
TEST(CommSharedMemory, NothingIsLeftInDevShm) {
  auto ours = [] {
    int count = 0;
    std::error_code ec;
    const std::string mine = "-" + std::to_string(::getpid()) + "-";
    for (const auto& entry : std::filesystem::directory_iterator("/dev/shm", ec)) {
      count += entry.path().filename().string().find(mine) != std::string::npos;
    }
    return count;
  };
  OnRanks(2, "unlinked", Transport::kSharedMemory, [&](int rank, Communicator* comm) {
    std::vector<float> shard(10, static_cast<float>(rank)), out(20);
    ASSERT_TRUE(comm->AllGather(shard.data(), 10, out.data()).ok());
    int64_t token = 0;
    ASSERT_TRUE(comm->Broadcast(&token, 0).ok());  // both past the all-gather
    EXPECT_EQ(ours(), 0);
  });
}

// A container's /dev/shm is small (Docker's default: 64 MiB), and a run whose buffers outgrow it
// would fail at that collective: there DC_CPU_TRANSPORT=auto keeps every rank on TCP and says
// why. Tried as a user meets it: in a mount namespace of its own whose /dev/shm is an 8 MiB tmpfs.
TEST(CommSharedMemory, ASmallDevShmKeepsTheRanksOnTcpAndSaysWhy) {
  const std::string store =
      ::testing::TempDir() + "/comm_test_" + std::to_string(::getpid()) + "_small_shm";
  std::filesystem::remove_all(store);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // 77: the namespace cannot be had here (no privilege); 0: as expected; else a failure.
    if (::unshare(CLONE_NEWNS) != 0 ||
        ::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0 ||
        ::mount("tmpfs", "/dev/shm", "tmpfs", 0, "size=8m") != 0) {
      ::_exit(77);
    }
    int code = 0;
    std::vector<std::thread> ranks;
    for (int r = 0; r < 2; ++r) {
      ranks.emplace_back([&, r] {
        auto comm = Connect(RankOptions(r, 2, store, Transport::kAuto));
        if (!comm.ok() || (*comm)->transport() != "tcp" ||
            (*comm)->transport_note().find("MiB free, under the 1024 MiB") == std::string::npos) {
          code = 1;
          return;
        }
        std::vector<float> shard(10, static_cast<float>(r)), out(20);
        if (!(*comm)->AllGather(shard.data(), 10, out.data()).ok() || out[10] != 1.0f) code = 2;
      });
    }
    for (std::thread& t : ranks) t.join();
    ::_exit(code);
  }
  int status = -1;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  if (WEXITSTATUS(status) == 77) GTEST_SKIP() << "no mount namespace here (needs CAP_SYS_ADMIN)";
  EXPECT_EQ(WEXITSTATUS(status), 0) << "1: not on TCP, or the note does not say why; 2: the "
                                       "all-gather over TCP failed";
  std::filesystem::remove_all(store);
}

}  // namespace
}  // namespace dc
