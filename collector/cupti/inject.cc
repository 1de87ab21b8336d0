// libdc_inject.so: the CUPTI collector for unmodified CUDA programs. CUDA's driver loads the
// library named by CUDA_INJECTION64_PATH when it initializes and calls InitializeInjection;
// from then on the collector records the process (the whole run, or its cudaProfilerStart/Stop
// ranges, per DC_CAPTURE_RANGE) and writes its SQLite file at exit. Configured by the
// environment `dc-collect --attach` sets (collector/cupti/injection_env.h). When another CUPTI
// client already holds the process it says so in one line and lets the program run untraced.
// Links CUPTI; never cudart (the program brings it) nor protobuf.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>

#include "collector/cupti/cupti_collector.h"
#include "collector/cupti/injection_env.h"

namespace {

std::mutex g_mutex;
bool g_initialized = false;
// Lives until the process ends: CUPTI may call back while the process tears CUDA down.
dc::CuptiCollector* g_collector = nullptr;
pid_t g_pid = 0;

void Say(const std::string& line) { std::fprintf(stderr, "dc: %s\n", line.c_str()); }

void FinishAtExit() {
  std::lock_guard<std::mutex> lock(g_mutex);
  // A forked child inherits the collector but not its threads; the parent writes the trace.
  if (g_collector == nullptr || ::getpid() != g_pid) return;
  auto counts = g_collector->Finish();
  if (!counts.ok()) {
    Say("trace " + g_collector->output_path() + " not written: " + counts.status().message());
  }
}

}  // namespace

extern "C" __attribute__((visibility("default"))) int InitializeInjection(void) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_initialized) return 1;
  g_initialized = true;
  auto config = dc::cupti_internal::InjectionConfigFromEnvironment();
  if (!config.ok()) {
    Say(config.status().message() + "; running untraced");
    return 1;
  }
  auto collector = dc::CuptiCollector::Create(config->options);
  if (!collector.ok()) {
    if (dc::IsAnotherProfilerError(collector.status())) {
      Say(std::string(dc::kAnotherProfilerMessage) + "; running untraced");
    } else {
      Say(collector.status().message() + "; running untraced");
    }
    return 1;
  }
  if (config->start_now) {
    dc::Status started = (*collector)->Start();
    if (!started.ok()) {
      Say(started.message() + "; running untraced");
      return 1;
    }
  }
  g_collector = collector->release();
  g_pid = ::getpid();
  if (std::atexit(FinishAtExit) != 0) {
    Say("cannot register the exit handler; the trace of this process will not be written");
  }
  return 1;
}
