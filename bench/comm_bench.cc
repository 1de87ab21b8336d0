// comm_bench: the cpu backend's collectives (executor/comm.h: shared memory between ranks on
// one host, Gloo over loopback TCP with DC_CPU_TRANSPORT=tcp; the transport is printed first).
//
//   comm_bench
//     On two ranks, in the patterns a training step makes: an all-gather alone; after 20
//     reduce-scatters of grads (where Gloo's unbound-buffer all-gather once stalled for
//     40-260 ms behind the halving-doubling reduce-scatter); and beside a reduce-scatter stream
//     on a second channel, as the cpu device's gather and reduce streams run in the backward.
//     Each all-gather is timed as the device runs one: made (its receive posted), the shard
//     packed, run. Prints the median and the max of each case, in milliseconds (floats per
//     rank: 16384, 131072, 1048576).
//
//   comm_bench --nccl-tests all_gather|reduce_scatter [--ranks N] [--min-bytes B]
//              [--max-bytes B] [--iters K] [--warmup K]
//     A sweep of sizes (doubling from min to max), printed as nccl-tests' all_gather_perf or
//     reduce_scatter_perf prints it, for `dc-calibrate --nccl-tests`: the cpu backend's network
//     measured the way a GPU cluster's is. Size is the whole buffer (the gathered output, the
//     reduce-scatter's input), as in nccl-tests; time is the mean of K calls run back to back
//     after a barrier, the slowest rank's, and the median of three such rounds (this machine is
//     noisy); busbw = algbw x (N - 1) / N. In-place columns are N/A (one implementation).
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
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
  auto transport = dc::TransportFromEnvironment();
  if (!transport.ok()) {
    std::fprintf(stderr, "comm_bench: %s\n", transport.status().message().c_str());
    return 1;
  }
  options.transport = *transport;
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

// ----- the nccl-tests sweep -----

struct Sweep {
  std::string collective;  // all_gather or reduce_scatter
  int ranks = 2;
  int64_t min_bytes = 1024, max_bytes = int64_t{64} << 20;
  int iters = 10, warmup = 3;
};

constexpr int kSweepRounds = 3;

// Rank `rank` of the sweep; rank 0 prints each row.
int SweepRank(int rank, const std::string& store, const Sweep& sweep) {
  dc::RendezvousOptions options;
  options.rank = rank;
  options.world_size = sweep.ranks;
  options.store_dir = store;
  auto transport = dc::TransportFromEnvironment();
  if (!transport.ok()) {
    std::fprintf(stderr, "comm_bench: %s\n", transport.status().message().c_str());
    return 1;
  }
  options.transport = *transport;
  auto comm = dc::Connect(options);
  if (!comm.ok()) {
    std::fprintf(stderr, "comm_bench: rank %d: %s\n", rank, comm.status().message().c_str());
    return 1;
  }
  const bool gather = sweep.collective == "all_gather";
  const int64_t unit = 4 * static_cast<int64_t>(sweep.ranks);  // a float per rank
  for (int64_t size = sweep.min_bytes; size <= sweep.max_bytes; size *= 2) {
    const int64_t shard = std::max<int64_t>(1, size / unit);
    const int64_t bytes = shard * unit;
    std::vector<float> in(static_cast<size_t>(gather ? shard : shard * sweep.ranks), 1.0f);
    std::vector<float> out(static_cast<size_t>(gather ? shard * sweep.ranks : shard));
    auto call = [&] {
      return gather ? (*comm)->AllGather(in.data(), shard, out.data())
                    : (*comm)->ReduceScatterSum(in.data(), shard, out.data());
    };
    std::vector<double> rounds_us;
    for (int round = 0; round < kSweepRounds; ++round) {
      for (int i = 0; i < sweep.warmup; ++i) {
        if (!call().ok()) return 1;
      }
      double barrier = 0;
      if (!(*comm)->AllReduceSum(&barrier, 1).ok()) return 1;
      const auto start = std::chrono::steady_clock::now();
      for (int i = 0; i < sweep.iters; ++i) {
        if (!call().ok()) return 1;
      }
      double us = Millis(start) * 1000 / sweep.iters;
      if (!(*comm)->AllReduceMax(&us, 1).ok()) return 1;
      rounds_us.push_back(us);
    }
    std::sort(rounds_us.begin(), rounds_us.end());
    const double us = rounds_us[rounds_us.size() / 2];
    const double algbw = static_cast<double>(bytes) / (us * 1e3);  // GB/s
    const double busbw = algbw * (sweep.ranks - 1) / sweep.ranks;
    if (rank == 0) {
      std::printf(
          "%12lld  %12lld     float    %s      -1  %9.2f  %6.3f  %6.3f     N/A        N/A     N/A  "
          "   N/A     N/A\n",
          static_cast<long long>(bytes), static_cast<long long>(bytes / 4),
          gather ? "none" : " sum", us, algbw, busbw);
      std::fflush(stdout);
    }
  }
  return 0;
}

// A whole number in [lo, hi] from flag `name`'s value, or exits with a one-line error.
int64_t FlagNumber(const char* name, const char* text, int64_t lo, int64_t hi) {
  errno = 0;
  char* end = nullptr;
  const long long value = std::strtoll(text, &end, 10);
  if (errno != 0 || end == text || *end != '\0' || value < lo || value > hi) {
    std::fprintf(stderr, "comm_bench: %s '%s': expected a whole number in [%lld, %lld]\n", name,
                 text, static_cast<long long>(lo), static_cast<long long>(hi));
    std::exit(2);
  }
  return value;
}

Sweep ParseSweep(int argc, char** argv) {
  Sweep sweep;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) {
      std::fprintf(stderr, "comm_bench: %s needs a value\n", flag.c_str());
      std::exit(2);
    }
    const char* value = argv[++i];
    if (flag == "--nccl-tests") {
      sweep.collective = value;
      if (sweep.collective != "all_gather" && sweep.collective != "reduce_scatter") {
        std::fprintf(stderr, "comm_bench: --nccl-tests '%s': all_gather or reduce_scatter\n",
                     value);
        std::exit(2);
      }
    } else if (flag == "--ranks") {
      sweep.ranks = static_cast<int>(FlagNumber("--ranks", value, 2, 64));
    } else if (flag == "--min-bytes") {
      sweep.min_bytes = FlagNumber("--min-bytes", value, 1, int64_t{1} << 34);
    } else if (flag == "--max-bytes") {
      sweep.max_bytes = FlagNumber("--max-bytes", value, 1, int64_t{1} << 34);
    } else if (flag == "--iters") {
      sweep.iters = static_cast<int>(FlagNumber("--iters", value, 1, 100000));
    } else if (flag == "--warmup") {
      sweep.warmup = static_cast<int>(FlagNumber("--warmup", value, 0, 100000));
    } else {
      std::fprintf(stderr,
                   "comm_bench: unknown flag '%s'; usage: comm_bench [--nccl-tests "
                   "all_gather|reduce_scatter [--ranks N] [--min-bytes B] [--max-bytes B] "
                   "[--iters K] [--warmup K]]\n",
                   flag.c_str());
      std::exit(2);
    }
  }
  if (sweep.collective.empty()) {
    std::fprintf(stderr,
                 "comm_bench: the sweep's flags need --nccl-tests all_gather|reduce_scatter\n");
    std::exit(2);
  }
  if (sweep.min_bytes > sweep.max_bytes) {
    std::fprintf(stderr, "comm_bench: --min-bytes %lld is above --max-bytes %lld\n",
                 static_cast<long long>(sweep.min_bytes), static_cast<long long>(sweep.max_bytes));
    std::exit(2);
  }
  return sweep;
}

// Forks `ranks` processes running fn(rank); whether every one exited 0.
template <typename Fn>
bool RunRanks(int ranks, Fn fn) {
  std::vector<pid_t> children;
  for (int rank = 0; rank < ranks; ++rank) {
    const pid_t child = ::fork();
    if (child < 0) {
      std::fprintf(stderr, "comm_bench: fork: %s\n", std::strerror(errno));
      break;
    }
    if (child == 0) std::_Exit(fn(rank));
    children.push_back(child);
  }
  int failed = static_cast<int>(ranks - children.size());
  for (pid_t child : children) {
    int status = 0;
    ::waitpid(child, &status, 0);
    failed += !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  return failed == 0;
}

std::string StoreDir() {
  const std::string store =
      (std::filesystem::temp_directory_path() / ("dc-comm-bench-" + std::to_string(::getpid())))
          .string();
  std::filesystem::create_directories(store);
  return store;
}

int NcclTestsSweep(const Sweep& sweep) {
  char host[HOST_NAME_MAX + 1] = {};
  if (::gethostname(host, sizeof(host) - 1) != 0) std::strcpy(host, "localhost");
  std::printf("# Collective test starting: %s_perf\n", sweep.collective.c_str());
  std::printf(
      "# nThread 1 nGpus 1 minBytes %lld maxBytes %lld step: 2(factor) warmup iters: %d iters: %d "
      "agg iters: 1 validation: 0 graph: 0\n#\n# Using devices\n",
      static_cast<long long>(sweep.min_bytes), static_cast<long long>(sweep.max_bytes),
      sweep.warmup, sweep.iters);
  for (int rank = 0; rank < sweep.ranks; ++rank) {
    std::printf("#  Rank %2d Group  0 Pid %6d on %s device %2d [cpu] gloo (dc comm_bench)\n", rank,
                static_cast<int>(::getpid()), host, rank);
  }
  std::printf(
      "#\n#                                                              out-of-place              "
      "         in-place\n"
      "#       size         count      type   redop    root     time   algbw   busbw #wrong     "
      "time   algbw   busbw #wrong\n"
      "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            "
      "(us)  (GB/s)  (GB/s)\n");
  std::fflush(stdout);
  const std::string store = StoreDir();
  const bool ok = RunRanks(sweep.ranks, [&](int rank) { return SweepRank(rank, store, sweep); });
  std::filesystem::remove_all(store);
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1) return NcclTestsSweep(ParseSweep(argc, argv));

  const std::vector<int64_t> sizes = {16384, 131072, 1048576};
  std::printf(
      "| floats per rank | all-gather | median ms | max ms |\n| ---: | --- | ---: | ---: |\n");
  std::fflush(stdout);
  const std::string store = StoreDir();
  const bool ok = RunRanks(2, [&](int rank) { return Rank(rank, store, sizes); });
  std::filesystem::remove_all(store);
  return ok ? 0 : 1;
}
