// comm_bench: the cpu backend's collectives (executor/comm.h, Gloo over loopback TCP) on two
// ranks, in the patterns a training step makes: an all-gather alone; after 20 reduce-scatters of
// grads (where Gloo's unbound-buffer all-gather once stalled for 40-260 ms behind the
// halving-doubling reduce-scatter); and beside a reduce-scatter stream on a second channel, as
// the cpu device's gather and reduce streams run in the backward. Each all-gather is timed as
// the device runs one: made (its receive posted), the shard packed, run. Prints the median and
// the max of each case, in milliseconds.
//
//   comm_bench            floats per rank: 16384, 131072, 1048576
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "executor/comm.h"

namespace {

constexpr int kRepeats = 15;
constexpr int kReduceScattersBefore = 20;
constexpr int64_t kGradElements = 4096;

double Millis(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
      .count();
}

// Runs on one rank; rank 0 prints.
int Rank(int rank, const std::string& store, const std::vector<int64_t>& sizes) {
  dc::RendezvousOptions options;
  options.rank = rank;
  options.world_size = 2;
  options.store_dir = store;
  options.channels = 2;  // the second for the reduce-scatters beside the all-gathers
  auto comm = dc::Connect(options);
  if (!comm.ok()) {
    std::fprintf(stderr, "comm_bench: rank %d: %s\n", rank, comm.status().message().c_str());
    return 1;
  }
  for (int64_t n : sizes) {
    std::vector<float> shard(n, 1.0f);
    std::vector<float> grads(2 * kGradElements, 1.0f), grad_shard(kGradElements);
    for (const char* pattern : {"alone", "after 20 reduce-scatters", "beside reduce-scatters"}) {
      const std::string name = pattern;
      std::vector<double> ms;
      // The reduce-scatter stream beside the all-gathers: its own channel and thread, as the
      // cpu device's reduce stream.
      std::atomic<bool> rs_failed{false};
      std::thread beside;
      if (name == "beside reduce-scatters") {
        beside = std::thread([&, grads_copy = grads]() mutable {
          std::vector<float> out_shard(kGradElements);
          dc::Communicator* channel = (*comm)->channel(1);
          // Both ranks make the same number of calls: the count is fixed, not the time.
          for (int k = 0; k < kRepeats * kReduceScattersBefore; ++k) {
            if (!channel->ReduceScatterSum(grads_copy.data(), kGradElements, out_shard.data())
                     .ok()) {
              rs_failed = true;
              return;
            }
          }
        });
      }
      for (int i = 0; i < kRepeats; ++i) {
        if (name == "after 20 reduce-scatters") {
          for (int k = 0; k < kReduceScattersBefore; ++k) {
            if (!(*comm)->ReduceScatterSum(grads.data(), kGradElements, grad_shard.data()).ok())
              return 1;
          }
        }
        const auto start = std::chrono::steady_clock::now();
        // As the cpu device does: made, the shard packed into its input, run.
        auto gather = (*comm)->PostAllGather(n);
        if (!gather.ok()) return 1;
        std::copy(shard.begin(), shard.end(), (*gather)->input());
        if (!(*gather)->Run().ok()) return 1;
        ms.push_back(Millis(start));
      }
      if (beside.joinable()) beside.join();
      if (rs_failed) return 1;
      std::sort(ms.begin(), ms.end());
      if (rank == 0) {
        std::printf("| %lld | %s | %.3f | %.3f |\n", static_cast<long long>(n), pattern,
                    ms[ms.size() / 2], ms.back());
        std::fflush(stdout);
      }
    }
  }
  return 0;
}

}  // namespace

int main() {
  const std::vector<int64_t> sizes = {16384, 131072, 1048576};
  const std::string store =
      (std::filesystem::temp_directory_path() / ("dc-comm-bench-" + std::to_string(::getpid())))
          .string();
  std::filesystem::create_directories(store);
  std::printf(
      "| floats per rank | all-gather | median ms | max ms |\n| ---: | --- | ---: | ---: |\n");
  std::fflush(stdout);
  pid_t children[2];
  for (int rank = 0; rank < 2; ++rank) {
    children[rank] = ::fork();
    if (children[rank] == 0) std::_Exit(Rank(rank, store, sizes));
  }
  int failed = 0;
  for (pid_t child : children) {
    int status = 0;
    ::waitpid(child, &status, 0);
    failed += !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  std::filesystem::remove_all(store);
  return failed == 0 ? 0 : 1;
}
