// overlap_bench: how much the cpu backend's compute and its Gloo collectives slow each other when
// they run at once, as the cpu device's stream threads run them. Two ranks (processes), each:
// a GEMM of dc's cpu kernels (matmul, one BLAS thread) timed alone; an all-gather and a
// reduce-scatter (executor/comm.h, Gloo over loopback TCP) timed alone; then each collective
// looped on a thread of its own while the main thread runs GEMMs, both timed. The ratios beside /
// alone are the cpu profile's overlap_compute_slowdown and overlap_collective_slowdown
// (machine/hardware_profiles.json). Rounds alternate alone and beside, so load that drifts over
// the run falls on both; rank 0 prints each round and the medians of the ratios.
//
//   overlap_bench         GEMM [1024 x 512] x [512 x 512]^T, collectives of 1 Mi floats per rank
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
#include "executor/cpu_kernels.h"

namespace {

constexpr int kRounds = 5;
constexpr int kGemmsAlone = 15;
constexpr int kCollectivesPerCase = 10;
constexpr int64_t kRows = 1024, kInner = 512, kCols = 512;
constexpr int64_t kShardElements = int64_t{1} << 20;

using Clock = std::chrono::steady_clock;

double Millis(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

class Gemm {
 public:
  Gemm() : x_(kRows * kInner, 0.5f), w_(kCols * kInner, 0.25f), y_(kRows * kCols) {
    op_.set_name("bench.matmul");
    op_.set_kind("matmul");
  }
  // Milliseconds of one y = x w^T.
  double Run() {
    dc::TensorRef in[2] = {{x_.data(), nullptr, {kRows, kInner}},
                           {w_.data(), nullptr, {kCols, kInner}}};
    dc::TensorRef out[1] = {{y_.data(), nullptr, {kRows, kCols}}};
    const auto start = Clock::now();
    const dc::Status status = dc::RunCpuOp(op_, in, out, context_);
    if (!status.ok()) {
      std::fprintf(stderr, "overlap_bench: %s\n", status.message().c_str());
      std::_Exit(1);
    }
    return Millis(start);
  }

 private:
  dc::proto::ModelConfig config_;
  dc::KernelContext context_{.config = &config_};
  dc::proto::Op op_;
  std::vector<float> x_, w_, y_;
};

enum class Kind { kAllGather, kReduceScatter };
const char* Name(Kind kind) { return kind == Kind::kAllGather ? "all-gather" : "reduce-scatter"; }

// Milliseconds of each of kCollectivesPerCase collectives of `kind`.
std::vector<double> Collectives(dc::Communicator* comm, Kind kind) {
  std::vector<float> shard(kShardElements, 1.0f), full(2 * kShardElements, 1.0f);
  std::vector<double> ms;
  for (int i = 0; i < kCollectivesPerCase; ++i) {
    const auto start = Clock::now();
    const dc::Status status =
        kind == Kind::kAllGather
            ? comm->AllGather(shard.data(), kShardElements, full.data())
            : comm->ReduceScatterSum(full.data(), kShardElements, shard.data());
    if (!status.ok()) {
      std::fprintf(stderr, "overlap_bench: %s\n", status.message().c_str());
      std::_Exit(1);
    }
    ms.push_back(Millis(start));
  }
  return ms;
}

int Rank(int rank, const std::string& store) {
  dc::RendezvousOptions options;
  options.rank = rank;
  options.world_size = 2;
  options.store_dir = store;
  auto comm = dc::Connect(options);
  if (!comm.ok()) {
    std::fprintf(stderr, "overlap_bench: rank %d: %s\n", rank, comm.status().message().c_str());
    return 1;
  }
  Gemm gemm;
  gemm.Run();  // warm-up
  std::vector<double> compute_ratios, collective_ratios[2];
  for (int round = 0; round < kRounds; ++round) {
    std::vector<double> alone;
    for (int i = 0; i < kGemmsAlone; ++i) alone.push_back(gemm.Run());
    const double gemm_alone_ms = Median(alone);
    for (const Kind kind : {Kind::kAllGather, Kind::kReduceScatter}) {
      const double collective_alone_ms = Median(Collectives(comm->get(), kind));
      std::atomic<bool> communicating{true};
      std::vector<double> collective_beside;
      std::thread thread([&] {
        collective_beside = Collectives(comm->get(), kind);
        communicating = false;
      });
      std::vector<double> gemm_beside;
      while (communicating) gemm_beside.push_back(gemm.Run());
      thread.join();
      gemm_beside.pop_back();  // the last may have outlived the collectives
      const double compute_ratio = Median(gemm_beside) / gemm_alone_ms;
      const double collective_ratio = Median(collective_beside) / collective_alone_ms;
      compute_ratios.push_back(compute_ratio);
      collective_ratios[static_cast<int>(kind)].push_back(collective_ratio);
      if (rank == 0) {
        std::printf("| %d | %s | %.2f | %.2f | %.3f | %.2f | %.2f | %.3f |\n", round, Name(kind),
                    gemm_alone_ms, Median(gemm_beside), compute_ratio, collective_alone_ms,
                    Median(collective_beside), collective_ratio);
        std::fflush(stdout);
      }
    }
  }
  if (rank == 0) {
    std::printf(
        "\nmedian ratios: compute beside a collective %.3f, all-gather beside compute %.3f, "
        "reduce-scatter beside compute %.3f\n",
        Median(compute_ratios), Median(collective_ratios[0]), Median(collective_ratios[1]));
    std::fflush(stdout);  // the rank ends in std::_Exit, which flushes nothing
  }
  return 0;
}

}  // namespace

int main() {
  const std::string store =
      (std::filesystem::temp_directory_path() / ("dc-overlap-bench-" + std::to_string(::getpid())))
          .string();
  std::filesystem::create_directories(store);
  std::printf(
      "| round | collective | GEMM alone ms | GEMM beside ms | compute ratio | collective alone ms "
      "| collective beside ms | collective ratio |\n"
      "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |\n");
  std::fflush(stdout);
  pid_t children[2];
  for (int rank = 0; rank < 2; ++rank) {
    children[rank] = ::fork();
    if (children[rank] == 0) std::_Exit(Rank(rank, store));
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
