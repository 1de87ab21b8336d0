// A stand-in for a CUDA program traced by libdc_inject.so, for attach_test on machines without
// a GPU: reads the same environment as the injection library and writes its per-process file
// from synthetic records (two kernels, a memcpy, an allocation).
//   dc_fake_traced_process write [exit-code]   write the file, then exit
//   dc_fake_traced_process none [exit-code]    write nothing (a program that never used CUDA)
#include <time.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string_view>

#include "collector/cupti/activity_writer.h"
#include "collector/cupti/injection_env.h"
#include "collector/cupti/test_records.h"

int main(int argc, char** argv) {
  using namespace dc;
  using namespace dc::cupti_testing;
  const std::string_view mode = argc > 1 ? argv[1] : "write";
  const int exit_code = argc > 2 ? std::atoi(argv[2]) : 0;
  if (mode == "none") return exit_code;
  auto config = cupti_internal::InjectionConfigFromEnvironment();
  if (!config.ok()) {
    std::fprintf(stderr, "fake process: %s\n", config.status().message().c_str());
    return 2;
  }
  const CuptiCollectorOptions& o = config->options;
  timespec now{};
  clock_gettime(CLOCK_REALTIME, &now);
  const uint64_t t0 = static_cast<uint64_t>(now.tv_sec) * 1'000'000'000 + now.tv_nsec;
  cupti_internal::SessionClock clock;
  clock.session_start_utc_ns =
      o.session_start_utc_ns != 0 ? o.session_start_utc_ns : static_cast<int64_t>(t0);
  const int64_t global_pid = (static_cast<int64_t>(::getpid()) & 0xFFFFFF) << 24;
  auto writer = cupti_internal::ActivityWriter::Open(
      o.output_path, global_pid, clock,
      [](bool driver, uint32_t cbid) { return (driver ? "cu" : "cuda") + std::to_string(cbid); });
  if (!writer.ok()) {
    std::fprintf(stderr, "fake process: %s\n", writer.status().message().c_str());
    return 2;
  }
  const auto k1 = Kernel("_Z5scalePfif", t0 + 1000, t0 + 2000, 1);
  const auto k2 = Kernel("ncclDevKernel_AllGather_RING_LL", t0 + 3000, t0 + 5000, 2);
  const auto copy = Memcpy(CUPTI_ACTIVITY_MEMCPY_KIND_HTOD, 4096, t0 + 500, t0 + 900, 3);
  const auto alloc = Memory(true, 0x7f0000000000, 1 << 20, t0 + 100, 4);
  (void)(*writer)->BeginBatch();
  for (const void* record : {static_cast<const void*>(&k1), static_cast<const void*>(&k2),
                             static_cast<const void*>(&copy), static_cast<const void*>(&alloc)}) {
    (*writer)->Add(AsRecord(record));
  }
  (*writer)->AddBuffer(0);
  cupti_internal::FinishInput input;
  input.rank = {global_pid, o.rank, o.local_rank, o.world_size, "fake-host", 0};
  input.metadata = o.metadata;
  auto counts = (*writer)->Finish(input);
  if (!counts.ok()) {
    std::fprintf(stderr, "fake process: %s\n", counts.status().message().c_str());
    return 2;
  }
  return exit_code;
}
