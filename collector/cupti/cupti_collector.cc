#include "collector/cupti/cupti_collector.h"

#include <cupti.h>
#include <dlfcn.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <future>
#include <iterator>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <unordered_set>

#include "collector/cupti/activity_writer.h"

namespace dc {

using cupti_internal::ActivityWriter;

namespace {

constexpr int kRankShift = 48;
constexpr int kPidShift = 24;
constexpr int64_t kPidMask = 0xFFFFFF;
// CUPTI wants activity buffers aligned to 8 bytes.
constexpr size_t kBufferAlignment = 8;
constexpr char kSubscriberName[] = "dc";
// How long a step waits for the writer to commit it before streaming is given up.
constexpr std::chrono::seconds kCheckpointWait{60};

// Runtime and driver calls left out of the API trace: queries that frameworks issue around
// every launch (PyTorch calls cudaGetDevice and cudaGetLastError per op, cuBLAS and NCCL
// resolve entry points through cuGetProcAddress), which would outnumber the launches and only
// add overhead. The launches, copies, syncs and allocations stay.
constexpr CUpti_CallbackId kChattyRuntimeApis[] = {
    CUPTI_RUNTIME_TRACE_CBID_cudaGetLastError_v3020,
    CUPTI_RUNTIME_TRACE_CBID_cudaPeekAtLastError_v3020,
    CUPTI_RUNTIME_TRACE_CBID_cudaGetDevice_v3020,
    CUPTI_RUNTIME_TRACE_CBID_cudaGetDeviceCount_v3020,
    CUPTI_RUNTIME_TRACE_CBID_cudaDeviceGetAttribute_v5000,
    CUPTI_RUNTIME_TRACE_CBID_cudaGetDriverEntryPoint_v11030,
    CUPTI_RUNTIME_TRACE_CBID_cudaGetDriverEntryPoint_ptsz_v11030,
    CUPTI_RUNTIME_TRACE_CBID_cudaGetDriverEntryPointByVersion_v12050,
    CUPTI_RUNTIME_TRACE_CBID_cudaGetDriverEntryPointByVersion_ptsz_v12050,
    CUPTI_RUNTIME_TRACE_CBID_cudaStreamIsCapturing_v10000,
    CUPTI_RUNTIME_TRACE_CBID_cudaStreamIsCapturing_ptsz_v10000,
    CUPTI_RUNTIME_TRACE_CBID_cudaStreamGetCaptureInfo_v10010,
    CUPTI_RUNTIME_TRACE_CBID_cudaStreamGetCaptureInfo_ptsz_v10010,
    CUPTI_RUNTIME_TRACE_CBID_cudaStreamGetCaptureInfo_v2_v11030,
    CUPTI_RUNTIME_TRACE_CBID_cudaStreamGetCaptureInfo_v2_ptsz_v11030,
    CUPTI_RUNTIME_TRACE_CBID_cudaStreamGetCaptureInfo_v12030,
    CUPTI_RUNTIME_TRACE_CBID_cudaStreamGetCaptureInfo_ptsz_v12030,
    CUPTI_RUNTIME_TRACE_CBID_cudaThreadExchangeStreamCaptureMode_v10010,
    CUPTI_RUNTIME_TRACE_CBID_cudaPointerGetAttributes_v4000,
    CUPTI_RUNTIME_TRACE_CBID_cudaFuncGetAttributes_v3020,
    CUPTI_RUNTIME_TRACE_CBID_cudaRuntimeGetVersion_v3020,
    CUPTI_RUNTIME_TRACE_CBID_cudaDriverGetVersion_v3020,
};
constexpr CUpti_CallbackId kChattyDriverApis[] = {
    CUPTI_DRIVER_TRACE_CBID_cuGetProcAddress,
    CUPTI_DRIVER_TRACE_CBID_cuGetProcAddress_v2,
    CUPTI_DRIVER_TRACE_CBID_cuCtxGetCurrent,
    CUPTI_DRIVER_TRACE_CBID_cuCtxSetCurrent,
    CUPTI_DRIVER_TRACE_CBID_cuCtxGetDevice,
    CUPTI_DRIVER_TRACE_CBID_cuCtxGetId,
    CUPTI_DRIVER_TRACE_CBID_cuCtxGetFlags,
    CUPTI_DRIVER_TRACE_CBID_cuCtxPushCurrent,
    CUPTI_DRIVER_TRACE_CBID_cuCtxPopCurrent,
    CUPTI_DRIVER_TRACE_CBID_cuDeviceGet,
    CUPTI_DRIVER_TRACE_CBID_cuDeviceGetCount,
    CUPTI_DRIVER_TRACE_CBID_cuDeviceGetAttribute,
    CUPTI_DRIVER_TRACE_CBID_cuDevicePrimaryCtxGetState,
    CUPTI_DRIVER_TRACE_CBID_cuDriverGetVersion,
    CUPTI_DRIVER_TRACE_CBID_cuGetErrorName,
    CUPTI_DRIVER_TRACE_CBID_cuGetErrorString,
    CUPTI_DRIVER_TRACE_CBID_cuFuncGetAttribute,
    CUPTI_DRIVER_TRACE_CBID_cuFuncGetName,
    CUPTI_DRIVER_TRACE_CBID_cuKernelGetAttribute,
    CUPTI_DRIVER_TRACE_CBID_cuKernelGetName,
    CUPTI_DRIVER_TRACE_CBID_cuLibraryGetKernel,
    CUPTI_DRIVER_TRACE_CBID_cuModuleGetFunction,
    CUPTI_DRIVER_TRACE_CBID_cuPointerGetAttribute,
    CUPTI_DRIVER_TRACE_CBID_cuPointerGetAttributes,
    CUPTI_DRIVER_TRACE_CBID_cuStreamGetCtx,
    CUPTI_DRIVER_TRACE_CBID_cuStreamIsCapturing,
    CUPTI_DRIVER_TRACE_CBID_cuStreamGetCaptureInfo,
    CUPTI_DRIVER_TRACE_CBID_cuThreadExchangeStreamCaptureMode,
};

struct KindSpec {
  CUpti_ActivityKind kind;
  const char* name;
  bool required;  // collection fails without it; the others only warn
};

// Enabled while a capture window is open.
constexpr KindSpec kWindowKinds[] = {
    {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, "CONCURRENT_KERNEL", true},
    {CUPTI_ACTIVITY_KIND_MEMCPY, "MEMCPY", true},
    {CUPTI_ACTIVITY_KIND_MEMCPY2, "MEMCPY2", false},
    {CUPTI_ACTIVITY_KIND_MEMSET, "MEMSET", true},
    {CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION, "EXTERNAL_CORRELATION", true},
    {CUPTI_ACTIVITY_KIND_OVERHEAD, "OVERHEAD", false},
};
constexpr KindSpec kApiKinds[] = {
    {CUPTI_ACTIVITY_KIND_RUNTIME, "RUNTIME", false},
    {CUPTI_ACTIVITY_KIND_DRIVER, "DRIVER", false},
};
// Enabled from the first window (or from the start with kProfilerApi) to Finish: allocations
// made outside the windows are the live set inside them.
constexpr KindSpec kMemoryKinds[] = {
    {CUPTI_ACTIVITY_KIND_MEMORY2, "MEMORY2", false},
    {CUPTI_ACTIVITY_KIND_MEMORY_POOL, "MEMORY_POOL", false},
};

std::string CuptiError(const char* call, CUptiResult result) {
  const char* text = nullptr;
  if (cuptiGetResultString(result, &text) != CUPTI_SUCCESS || text == nullptr) {
    text = "unknown CUPTI error";
  }
  return std::string(call) + " failed: " + text + " (" + std::to_string(static_cast<int>(result)) +
         ")";
}

Status CuptiCall(const char* call, CUptiResult result) {
  return result == CUPTI_SUCCESS ? Status::Ok() : Status::Error(CuptiError(call, result));
}

int64_t ClockNs(clockid_t clock) {
  timespec ts{};
  clock_gettime(clock, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

std::string HostName() {
  char name[256] = "";
  if (gethostname(name, sizeof(name) - 1) != 0) return "";
  return name;
}

// The few driver calls the collector makes itself (context synchronization), looked up in the
// libcuda the process already loaded: the injection library must not link libcuda (the tests
// load it on machines without a driver) and the program brings its own.
class DriverApi {
 public:
  // Looks libcuda up again until the process has loaded it.
  static const DriverApi& Get() {
    static std::mutex mutex;
    static DriverApi api;
    std::lock_guard<std::mutex> lock(mutex);
    if (!api.loaded()) api.Load();
    return api;
  }
  bool loaded() const { return ctx_get_current_ != nullptr; }

  // Waits for `ctx` (nullptr: the calling thread's current context, if any).
  Status Synchronize(CUcontext ctx) const {
    if (!loaded()) return Status::Ok();  // libcuda not loaded: no device work to wait for
    if (ctx == nullptr) {
      const CUresult current = ctx_get_current_(&ctx);
      if (current == CUDA_ERROR_DEINITIALIZED) return Status::Ok();
      if (current != CUDA_SUCCESS) return DriverError("cuCtxGetCurrent", current);
      if (ctx == nullptr) return Status::Ok();
    }
    if (ctx_synchronize_v2_ != nullptr) {
      return Checked("cuCtxSynchronize_v2", ctx_synchronize_v2_(ctx));
    }
    // Drivers without cuCtxSynchronize_v2: make `ctx` current around the older call.
    if (ctx_push_ == nullptr || ctx_pop_ == nullptr || ctx_synchronize_ == nullptr) {
      return Status::Error("libcuda lacks cuCtxSynchronize_v2 and cuCtxSynchronize");
    }
    DC_RETURN_IF_ERROR(Checked("cuCtxPushCurrent_v2", ctx_push_(ctx)));
    Status synced = Checked("cuCtxSynchronize", ctx_synchronize_());
    CUcontext popped = nullptr;
    Status restored = Checked("cuCtxPopCurrent_v2", ctx_pop_(&popped));
    return synced.ok() ? restored : synced;
  }

  std::string Version() const {
    int version = 0;
    if (driver_get_version_ == nullptr || driver_get_version_(&version) != CUDA_SUCCESS) return "";
    return std::to_string(version);
  }

 private:
  DriverApi() = default;

  template <typename Fn>
  static Fn Symbol(void* lib, const char* name) {
    return reinterpret_cast<Fn>(dlsym(lib, name));
  }
  void Load() {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (lib == nullptr) return;
    // The ABI names: cuda.h maps cuCtxPushCurrent to cuCtxPushCurrent_v2 and so on.
    ctx_synchronize_v2_ = Symbol<CUresult (*)(CUcontext)>(lib, "cuCtxSynchronize_v2");
    ctx_synchronize_ = Symbol<CUresult (*)()>(lib, "cuCtxSynchronize");
    ctx_push_ = Symbol<CUresult (*)(CUcontext)>(lib, "cuCtxPushCurrent_v2");
    ctx_pop_ = Symbol<CUresult (*)(CUcontext*)>(lib, "cuCtxPopCurrent_v2");
    get_error_name_ = Symbol<CUresult (*)(CUresult, const char**)>(lib, "cuGetErrorName");
    driver_get_version_ = Symbol<CUresult (*)(int*)>(lib, "cuDriverGetVersion");
    ctx_get_current_ = Symbol<CUresult (*)(CUcontext*)>(lib, "cuCtxGetCurrent");
  }
  // A context already torn down at exit has nothing left to wait for.
  Status Checked(const char* call, CUresult result) const {
    if (result == CUDA_SUCCESS || result == CUDA_ERROR_DEINITIALIZED) return Status::Ok();
    return DriverError(call, result);
  }
  Status DriverError(const char* call, CUresult result) const {
    const char* name = nullptr;
    if (get_error_name_ == nullptr || get_error_name_(result, &name) != CUDA_SUCCESS) {
      name = "CUDA error";
    }
    return Status::Error(std::string(call) + " failed: " + name + " (" +
                         std::to_string(static_cast<int>(result)) + ")");
  }

  CUresult (*ctx_synchronize_v2_)(CUcontext) = nullptr;
  CUresult (*ctx_synchronize_)() = nullptr;
  CUresult (*ctx_push_)(CUcontext) = nullptr;
  CUresult (*ctx_pop_)(CUcontext*) = nullptr;
  CUresult (*ctx_get_current_)(CUcontext*) = nullptr;
  CUresult (*get_error_name_)(CUresult, const char**) = nullptr;
  CUresult (*driver_get_version_)(int*) = nullptr;
};

cupti_internal::ClockAnchorRow Anchor(const char* tag, int64_t realtime_ns, int64_t monotonic_ns,
                                      int64_t session_ns) {
  return {tag, realtime_ns, monotonic_ns, session_ns};
}

// CUPTI's clock and CLOCK_REALTIME sampled together.
struct ClockSample {
  int64_t realtime_ns = 0, monotonic_ns = 0;
  uint64_t cupti_ns = 0;
  static StatusOr<ClockSample> Take() {
    ClockSample s;
    const int64_t before = ClockNs(CLOCK_REALTIME);
    DC_RETURN_IF_ERROR(CuptiCall("cuptiGetTimestamp", cuptiGetTimestamp(&s.cupti_ns)));
    const int64_t after = ClockNs(CLOCK_REALTIME);
    s.realtime_ns = before + (after - before) / 2;
    s.monotonic_ns = ClockNs(CLOCK_MONOTONIC);
    return s;
  }
};

}  // namespace

bool IsAnotherProfilerError(const Status& status) {
  return !status.ok() && status.message().starts_with(kAnotherProfilerMessage);
}

// ----- the collector's state -----

struct CuptiCollector::Impl {
  // A CUPTI buffer on its way to the writer thread.
  struct Pending {
    uint8_t* buffer = nullptr;
    size_t dropped_records = 0;
    std::vector<const CUpti_Activity*> records;
    // Or, streamed, a checkpoint: after every buffer queued before it (FIFO).
    std::optional<cupti_internal::CheckpointInput> checkpoint;
    std::shared_ptr<std::promise<Status>> checkpointed;
  };

  CuptiCollectorOptions options;
  int64_t global_pid = 0;
  cupti_internal::SessionClock clock;
  ClockSample start_sample;
  CUpti_SubscriberHandle subscriber = nullptr;
  std::unique_ptr<ActivityWriter> writer;

  // Guarded by state_mutex: windows, instructions, steps, streams, contexts. Buffers can arrive
  // on the thread that holds it (a flush delivers them), so warnings have their own mutex.
  std::mutex state_mutex;
  bool running = false;
  bool finished = false;
  bool memory_enabled = false;
  bool seen_profiler_start = false;
  bool stream_failed = false;  // a checkpoint failed: the rest is written at Finish only
  uint64_t window_start_cupti_ns = 0;
  std::vector<std::pair<uint64_t, uint64_t>> windows;  // CUPTI ns
  std::map<int, cupti_internal::InstructionRow> instructions;
  std::vector<cupti_internal::StepRow> steps;
  std::vector<cupti_internal::EvalRow> evals;
  std::vector<std::pair<int64_t, std::string>> streams;
  std::set<std::string> disabled_kinds;
  std::mutex warnings_mutex;
  std::vector<std::string> warnings;
  std::set<CUcontext> contexts;

  // Guarded by queue_mutex.
  std::mutex queue_mutex;
  std::condition_variable queue_ready;
  std::deque<Pending> queue;
  bool writer_stop = false;
  std::thread writer_thread;

  // Kernel, allocation and device names copied out of CUPTI's memory (guarded by g_mutex).
  std::unordered_set<std::string> names;

  ~Impl();
  Status EnableKinds(const KindSpec* begin, const KindSpec* end);
  void DisableKinds(const KindSpec* begin, const KindSpec* end);
  Status EnableApiKinds();
  Status EnableMemoryKinds();
  Status StartLocked();
  Status StopLocked();
  Status SynchronizeContexts();
  std::vector<cupti_internal::ClockAnchorRow> StartAnchors() const;
  // Streamed: commits the steps so far (state_mutex held, released while the writer works).
  void CheckpointLocked(std::unique_lock<std::mutex>& lock);
  void Warn(std::string warning);
  void OnBuffer(uint8_t* buffer, size_t valid_bytes, size_t dropped_records);
  void WriterLoop();
  void StopWriter();
  const char* StableName(const char* name);
  void OnProfilerStart();
  void OnProfilerStop();
  void OnContextDestroy(CUcontext ctx);
};

namespace {

// The collector CUPTI's process-wide buffer callbacks deliver to; g_mutex serializes them with
// the collector's creation and end.
std::mutex g_mutex;
CuptiCollector::Impl* g_active = nullptr;
std::atomic<size_t> g_buffer_size_bytes{size_t{4} << 20};

void CUPTIAPI BufferRequested(uint8_t** buffer, size_t* size, size_t* max_num_records) {
  const size_t bytes = g_buffer_size_bytes.load();
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(kBufferAlignment, bytes));
  *size = *buffer != nullptr ? bytes : 0;  // a declined request makes CUPTI drop records
  *max_num_records = 0;                    // as many as fit
}

void CUPTIAPI BufferCompleted(CUcontext ctx, uint32_t stream_id, uint8_t* buffer, size_t size,
                              size_t valid_bytes) {
  (void)size;
  size_t dropped = 0;
  const CUptiResult result = cuptiActivityGetNumDroppedRecords(ctx, stream_id, &dropped);
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_active == nullptr) {
    std::free(buffer);
    return;
  }
  if (result != CUPTI_SUCCESS) {
    g_active->Warn(CuptiError("cuptiActivityGetNumDroppedRecords", result));
  }
  g_active->OnBuffer(buffer, valid_bytes, dropped);
}

void CUPTIAPI OnCallback(void* userdata, CUpti_CallbackDomain domain, CUpti_CallbackId cbid,
                         const void* data) {
  auto* impl = static_cast<CuptiCollector::Impl*>(userdata);
  if (impl == nullptr || data == nullptr) return;
  switch (domain) {
    case CUPTI_CB_DOMAIN_RESOURCE: {
      const auto* resource = static_cast<const CUpti_ResourceData*>(data);
      if (cbid == CUPTI_CBID_RESOURCE_CONTEXT_CREATED) {
        std::lock_guard<std::mutex> lock(impl->state_mutex);
        impl->contexts.insert(resource->context);
      } else if (cbid == CUPTI_CBID_RESOURCE_CONTEXT_DESTROY_STARTING) {
        impl->OnContextDestroy(resource->context);
      }
      break;
    }
    case CUPTI_CB_DOMAIN_RUNTIME_API:
    case CUPTI_CB_DOMAIN_DRIVER_API: {
      const auto* api = static_cast<const CUpti_CallbackData*>(data);
      const bool start = domain == CUPTI_CB_DOMAIN_RUNTIME_API
                             ? cbid == CUPTI_RUNTIME_TRACE_CBID_cudaProfilerStart_v4000
                             : cbid == CUPTI_DRIVER_TRACE_CBID_cuProfilerStart;
      const bool stop = domain == CUPTI_CB_DOMAIN_RUNTIME_API
                            ? cbid == CUPTI_RUNTIME_TRACE_CBID_cudaProfilerStop_v4000
                            : cbid == CUPTI_DRIVER_TRACE_CBID_cuProfilerStop;
      // The window opens after cudaProfilerStart returns and closes as cudaProfilerStop is
      // entered; the runtime's call reaches the driver's too, which then finds it done.
      if (start && api->callbackSite == CUPTI_API_EXIT) impl->OnProfilerStart();
      if (stop && api->callbackSite == CUPTI_API_ENTER) impl->OnProfilerStop();
      break;
    }
    case CUPTI_CB_DOMAIN_STATE: {
      const auto* state = static_cast<const CUpti_StateData*>(data);
      if (cbid == CUPTI_CBID_STATE_FATAL_ERROR || cbid == CUPTI_CBID_STATE_ERROR) {
        const char* message = state->notification.message;
        impl->Warn(std::string("CUPTI reported an error: ") +
                   (message != nullptr ? message : "no message") +
                   (cbid == CUPTI_CBID_STATE_FATAL_ERROR ? " (CUPTI stopped profiling)" : ""));
      }
      break;
    }
    default:
      break;
  }
}

std::string ApiName(bool driver, uint32_t cbid) {
  const char* name = nullptr;
  const CUpti_CallbackDomain domain =
      driver ? CUPTI_CB_DOMAIN_DRIVER_API : CUPTI_CB_DOMAIN_RUNTIME_API;
  if (cuptiGetCallbackName(domain, cbid, &name) != CUPTI_SUCCESS || name == nullptr) {
    return std::string(driver ? "driver_api_" : "runtime_api_") + std::to_string(cbid);
  }
  return name;
}

}  // namespace

CuptiCollector::Impl::~Impl() {
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (g_active == this) g_active = nullptr;
  }
  StopWriter();
  if (subscriber != nullptr) (void)cuptiUnsubscribe(subscriber);
}

void CuptiCollector::Impl::Warn(std::string warning) {
  std::lock_guard<std::mutex> lock(warnings_mutex);
  // The same failure repeats per buffer or per call: keep one of each.
  for (const std::string& w : warnings) {
    if (w == warning) return;
  }
  warnings.push_back(std::move(warning));
}

Status CuptiCollector::Impl::EnableKinds(const KindSpec* begin, const KindSpec* end) {
  for (const KindSpec* spec = begin; spec != end; ++spec) {
    const CUptiResult result = cuptiActivityEnable(spec->kind);
    if (result == CUPTI_SUCCESS) continue;
    const std::string call = std::string("cuptiActivityEnable(") + spec->name + ")";
    if (spec->required) return Status::Error(CuptiError(call.c_str(), result));
    if (disabled_kinds.insert(spec->name).second) {
      Warn(CuptiError(call.c_str(), result) + "; recorded without it");
    }
  }
  return Status::Ok();
}

void CuptiCollector::Impl::DisableKinds(const KindSpec* begin, const KindSpec* end) {
  for (const KindSpec* spec = begin; spec != end; ++spec) {
    if (disabled_kinds.contains(spec->name)) continue;
    const CUptiResult result = cuptiActivityDisable(spec->kind);
    if (result != CUPTI_SUCCESS) {
      const std::string call = std::string("cuptiActivityDisable(") + spec->name + ")";
      Warn(CuptiError(call.c_str(), result));
    }
  }
}

Status CuptiCollector::Impl::EnableApiKinds() {
  if (!options.trace_api_calls) return Status::Ok();
  DC_RETURN_IF_ERROR(EnableKinds(std::begin(kApiKinds), std::end(kApiKinds)));
  // Enabling a kind resets its per-call settings: filter after every enable.
  for (CUpti_CallbackId cbid : kChattyRuntimeApis) {
    const CUptiResult result = cuptiActivityEnableRuntimeApi(cbid, 0);
    if (result != CUPTI_SUCCESS && !disabled_kinds.contains("RUNTIME")) {
      Warn(CuptiError("cuptiActivityEnableRuntimeApi", result) + " for callback " +
           std::to_string(cbid));
    }
  }
  for (CUpti_CallbackId cbid : kChattyDriverApis) {
    const CUptiResult result = cuptiActivityEnableDriverApi(cbid, 0);
    if (result != CUPTI_SUCCESS && !disabled_kinds.contains("DRIVER")) {
      Warn(CuptiError("cuptiActivityEnableDriverApi", result) + " for callback " +
           std::to_string(cbid));
    }
  }
  return Status::Ok();
}

Status CuptiCollector::Impl::EnableMemoryKinds() {
  if (memory_enabled) return Status::Ok();
  DC_RETURN_IF_ERROR(EnableKinds(std::begin(kMemoryKinds), std::end(kMemoryKinds)));
  memory_enabled = true;
  return Status::Ok();
}

Status CuptiCollector::Impl::StartLocked() {
  if (finished) return Status::Error(options.output_path + ": the collector already finished");
  if (running) return Status::Ok();
  // The window opens before the kinds are enabled: no record can precede it.
  DC_RETURN_IF_ERROR(CuptiCall("cuptiGetTimestamp", cuptiGetTimestamp(&window_start_cupti_ns)));
  DC_RETURN_IF_ERROR(EnableMemoryKinds());
  DC_RETURN_IF_ERROR(EnableKinds(std::begin(kWindowKinds), std::end(kWindowKinds)));
  DC_RETURN_IF_ERROR(EnableApiKinds());
  running = true;
  return Status::Ok();
}

Status CuptiCollector::Impl::SynchronizeContexts() {
  const DriverApi& driver = DriverApi::Get();
  Status status = driver.Synchronize(nullptr);
  for (CUcontext ctx : contexts) {
    Status synced = driver.Synchronize(ctx);
    if (status.ok()) status = synced;
  }
  return status;
}

std::vector<cupti_internal::ClockAnchorRow> CuptiCollector::Impl::StartAnchors() const {
  const int64_t origin = clock.session_start_utc_ns;
  return {
      Anchor("start", start_sample.realtime_ns, start_sample.monotonic_ns,
             start_sample.realtime_ns - origin),
      // sessionNs of the cupti rows: CUPTI's clock at the same instant, on the session origin;
      // the difference to the row above is CUPTI's offset from CLOCK_REALTIME.
      Anchor("cupti_start", start_sample.realtime_ns, start_sample.monotonic_ns,
             static_cast<int64_t>(start_sample.cupti_ns) - origin),
  };
}

void CuptiCollector::Impl::CheckpointLocked(std::unique_lock<std::mutex>& lock) {
  if (!options.stream_blobs || finished || stream_failed) return;
  // The step's device work done and its records handed over before they are committed.
  Status ready = SynchronizeContexts();
  if (ready.ok()) {
    ready = CuptiCall("cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED)",
                      cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED));
  }
  Pending pending;
  if (ready.ok()) {
    cupti_internal::CheckpointInput& input = pending.checkpoint.emplace();
    input.rank = {global_pid,         options.rank,     options.local_rank,
                  options.world_size, options.hostname, options.device_id};
    input.anchors = StartAnchors();
    input.write_blobs = options.stream_blobs;
    for (const auto& [index, row] : instructions) input.instructions.push_back(row);
    input.steps = steps;
    input.evals = evals;
    input.streams = streams;
    pending.checkpointed = std::make_shared<std::promise<Status>>();
  }
  std::future<Status> done;
  if (ready.ok()) {
    done = pending.checkpointed->get_future();
    {
      std::lock_guard<std::mutex> queue_lock(queue_mutex);
      queue.push_back(std::move(pending));
    }
    queue_ready.notify_one();
    lock.unlock();  // CUPTI's context callbacks take the state while the writer works
    if (done.wait_for(kCheckpointWait) != std::future_status::ready) {
      ready =
          Status::Error("the writer took over " + std::to_string(kCheckpointWait.count()) + " s");
    } else {
      ready = done.get();
    }
    lock.lock();
  }
  if (!ready.ok()) {
    stream_failed = true;
    Warn("committing a step to " + options.output_path + " failed (" + ready.message() +
         "); the trace is written at the end only, and a killed run leaves none");
  }
}

Status CuptiCollector::Impl::StopLocked() {
  if (!running) return Status::Ok();
  running = false;
  // Work launched inside the window finishes inside it, and its records are complete when
  // the forced flush hands them over.
  Status synced = SynchronizeContexts();
  if (!synced.ok()) Warn(synced.message() + "; the last records may be incomplete");
  uint64_t end_ns = 0;
  DC_RETURN_IF_ERROR(CuptiCall("cuptiGetTimestamp", cuptiGetTimestamp(&end_ns)));
  windows.emplace_back(window_start_cupti_ns, end_ns);
  DisableKinds(std::begin(kWindowKinds), std::end(kWindowKinds));
  if (options.trace_api_calls) DisableKinds(std::begin(kApiKinds), std::end(kApiKinds));
  return CuptiCall("cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED)",
                   cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED));
}

void CuptiCollector::Impl::OnProfilerStart() {
  std::lock_guard<std::mutex> lock(state_mutex);
  if (finished || options.capture_range == CaptureRange::kExplicit) return;
  if (!seen_profiler_start) {
    seen_profiler_start = true;
    if (options.capture_range == CaptureRange::kAuto) {
      // The program chose its range: what ran before it is discarded.
      Status stopped = StopLocked();
      if (!stopped.ok()) Warn(stopped.message());
      windows.clear();
    }
  }
  Status started = StartLocked();
  if (!started.ok()) Warn("cudaProfilerStart: " + started.message());
}

void CuptiCollector::Impl::OnProfilerStop() {
  std::lock_guard<std::mutex> lock(state_mutex);
  if (finished || options.capture_range == CaptureRange::kExplicit || !seen_profiler_start) return;
  Status stopped = StopLocked();
  if (!stopped.ok()) Warn("cudaProfilerStop: " + stopped.message());
}

void CuptiCollector::Impl::OnContextDestroy(CUcontext ctx) {
  std::lock_guard<std::mutex> lock(state_mutex);
  contexts.erase(ctx);
  if (finished) return;
  // The context's records must leave CUPTI while it still exists. No synchronization here:
  // re-entering CUDA inside its own teardown risks a deadlock, and the driver drains the
  // context before destroying it anyway.
  const CUptiResult result = cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
  if (result != CUPTI_SUCCESS) {
    Warn(CuptiError("cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED)", result) +
         " at context destruction");
  }
}

const char* CuptiCollector::Impl::StableName(const char* name) {
  if (name == nullptr) return nullptr;
  return names.emplace(name).first->c_str();
}

void CuptiCollector::Impl::OnBuffer(uint8_t* buffer, size_t valid_bytes, size_t dropped_records) {
  if (buffer == nullptr) return;
  Pending pending;
  pending.buffer = buffer;
  pending.dropped_records = dropped_records;
  CUpti_Activity* record = nullptr;
  while (true) {
    const CUptiResult result = cuptiActivityGetNextRecord(buffer, valid_bytes, &record);
    if (result == CUPTI_ERROR_MAX_LIMIT_REACHED) break;
    if (result != CUPTI_SUCCESS) {
      Warn(CuptiError("cuptiActivityGetNextRecord", result) + "; the rest of a buffer was lost");
      break;
    }
    // Names point into CUPTI's memory, valid while the buffer is processed: the records keep
    // copies (the buffer is ours now, so the pointer fields may change).
    switch (record->kind) {
      case CUPTI_ACTIVITY_KIND_KERNEL:
      case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
        auto* kernel = reinterpret_cast<CUpti_ActivityKernel10*>(record);
        kernel->name = StableName(kernel->name);
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMORY2: {
        auto* memory = reinterpret_cast<CUpti_ActivityMemory4*>(record);
        memory->name = StableName(memory->name);
        memory->source = nullptr;  // not enabled; never read
        break;
      }
      case CUPTI_ACTIVITY_KIND_DEVICE: {
        auto* device = reinterpret_cast<CUpti_ActivityDevice5*>(record);
        device->name = StableName(device->name);
        break;
      }
      default:
        break;
    }
    pending.records.push_back(record);
  }
  {
    std::lock_guard<std::mutex> lock(queue_mutex);
    queue.push_back(std::move(pending));
  }
  queue_ready.notify_one();
}

void CuptiCollector::Impl::WriterLoop() {
  while (true) {
    std::deque<Pending> batch;
    {
      std::unique_lock<std::mutex> lock(queue_mutex);
      queue_ready.wait(lock, [&] { return writer_stop || !queue.empty(); });
      if (queue.empty() && writer_stop) return;
      batch.swap(queue);
    }
    for (Pending& pending : batch) {
      if (pending.checkpoint) {
        pending.checkpointed->set_value(writer->Checkpoint(*pending.checkpoint));
        continue;
      }
      (void)writer->BeginBatch();
      for (const CUpti_Activity* record : pending.records) writer->Add(record);
      writer->AddBuffer(pending.dropped_records);
      (void)writer->EndBatch();  // a write error sticks in the writer; Finish returns it
      std::free(pending.buffer);
    }
  }
}

void CuptiCollector::Impl::StopWriter() {
  {
    std::lock_guard<std::mutex> lock(queue_mutex);
    writer_stop = true;
  }
  queue_ready.notify_one();
  if (writer_thread.joinable()) writer_thread.join();
  for (Pending& pending : queue) {
    std::free(pending.buffer);
    if (pending.checkpointed) pending.checkpointed->set_value(Status::Error("the trace ended"));
  }
  queue.clear();
}

// ----- CuptiCollector -----

StatusOr<std::unique_ptr<CuptiCollector>> CuptiCollector::Create(CuptiCollectorOptions options) {
  if (options.output_path.empty()) return Status::Error("CUPTI collector: no output path given");
  if (options.buffer_size_bytes < (size_t{64} << 10) ||
      options.buffer_size_bytes % kBufferAlignment != 0) {
    return Status::Error(
        "CUPTI collector: buffer_size_bytes must be a multiple of 8 and at "
        "least 64 KiB (CUPTI recommends 1 to 10 MB)");
  }
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (g_active != nullptr) {
      return Status::Error(options.output_path +
                           ": another CUPTI collector is running in this "
                           "process; finish it first");
    }
  }
  auto impl = std::make_unique<Impl>();
  Impl& s = *impl;
  s.options = std::move(options);
  if (s.options.hostname.empty()) s.options.hostname = HostName();
  const int64_t pid_bits = (static_cast<int64_t>(::getpid()) & kPidMask) << kPidShift;
  s.global_pid = s.options.rank >= 0
                     ? (static_cast<int64_t>(s.options.rank) << kRankShift) | pid_bits
                     : pid_bits;

  // The first CUPTI client to subscribe owns the process; everyone else is refused.
  CUpti_SubscriberParams params{};
  params.structSize = CUpti_SubscriberParams_STRUCT_SIZE;
  params.subscriberName = kSubscriberName;
  char holder[CUPTI_OLD_SUBSCRIBER_NAME_MIN_LEN + 1] = "";
  params.oldSubscriberName = holder;
  params.oldSubscriberSize = sizeof(holder) - 1;
  const CUptiResult subscribed = cuptiSubscribe_v2(&s.subscriber, OnCallback, &s, &params);
  if (subscribed == CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED) {
    s.subscriber = nullptr;
    return Status::Error(std::string(kAnotherProfilerMessage) +
                         (holder[0] != '\0' ? std::string(" (") + holder + ")" : "") +
                         "; run dc without it, or it without dc");
  }
  if (subscribed != CUPTI_SUCCESS) {
    s.subscriber = nullptr;
    return Status::Error(CuptiError("cuptiSubscribe_v2", subscribed));
  }
  DC_RETURN_IF_ERROR(CuptiCall("cuptiSetThreadIdType(SYSTEM)",
                               cuptiSetThreadIdType(CUPTI_ACTIVITY_THREAD_ID_TYPE_SYSTEM)));
  g_buffer_size_bytes.store(s.options.buffer_size_bytes);
  DC_RETURN_IF_ERROR(CuptiCall("cuptiActivityRegisterCallbacks",
                               cuptiActivityRegisterCallbacks(BufferRequested, BufferCompleted)));
  // Contexts, to synchronize them at the end and flush before they go; not the rest of the
  // resource domain (modules, streams, graph nodes), which would only cost.
  for (CUpti_CallbackId cbid :
       {CUPTI_CBID_RESOURCE_CONTEXT_CREATED, CUPTI_CBID_RESOURCE_CONTEXT_DESTROY_STARTING}) {
    DC_RETURN_IF_ERROR(
        CuptiCall("cuptiEnableCallback(RESOURCE_CONTEXT_*)",
                  cuptiEnableCallback(1, s.subscriber, CUPTI_CB_DOMAIN_RESOURCE, cbid)));
  }
  const CUptiResult state = cuptiEnableDomain(1, s.subscriber, CUPTI_CB_DOMAIN_STATE);
  if (state != CUPTI_SUCCESS) {
    s.Warn(CuptiError("cuptiEnableDomain(STATE)", state) + "; CUPTI's own errors go unreported");
  }
  if (s.options.capture_range != CaptureRange::kExplicit) {
    const std::pair<CUpti_CallbackDomain, CUpti_CallbackId> range_calls[] = {
        {CUPTI_CB_DOMAIN_RUNTIME_API, CUPTI_RUNTIME_TRACE_CBID_cudaProfilerStart_v4000},
        {CUPTI_CB_DOMAIN_RUNTIME_API, CUPTI_RUNTIME_TRACE_CBID_cudaProfilerStop_v4000},
        {CUPTI_CB_DOMAIN_DRIVER_API, CUPTI_DRIVER_TRACE_CBID_cuProfilerStart},
        {CUPTI_CB_DOMAIN_DRIVER_API, CUPTI_DRIVER_TRACE_CBID_cuProfilerStop},
    };
    for (const auto& [domain, cbid] : range_calls) {
      DC_RETURN_IF_ERROR(CuptiCall("cuptiEnableCallback(cudaProfilerStart/Stop)",
                                   cuptiEnableCallback(1, s.subscriber, domain, cbid)));
    }
  }

  DC_ASSIGN_OR_RETURN(s.start_sample, ClockSample::Take());
  s.clock.session_start_utc_ns = s.options.session_start_utc_ns != 0
                                     ? s.options.session_start_utc_ns
                                     : s.start_sample.realtime_ns;
  s.clock.cupti_to_realtime_ns =
      s.start_sample.realtime_ns - static_cast<int64_t>(s.start_sample.cupti_ns);
  DC_ASSIGN_OR_RETURN(s.writer,
                      ActivityWriter::Open(s.options.output_path, s.global_pid, s.clock, ApiName,
                                           /*streamed=*/!!s.options.stream_blobs));
  s.writer_thread = std::thread([&s] { s.WriterLoop(); });
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    g_active = &s;
  }

  std::unique_ptr<CuptiCollector> collector(new CuptiCollector(std::move(impl)));
  std::lock_guard<std::mutex> lock(s.state_mutex);
  // Device records exist for CUDA initializations CUPTI saw; EnableAndDump also hands over
  // the devices of a CUDA that is already running.
  const CUptiResult device = cuptiActivityEnableAndDump(CUPTI_ACTIVITY_KIND_DEVICE);
  if (device != CUPTI_SUCCESS) {
    s.disabled_kinds.insert("DEVICE");
    s.Warn(CuptiError("cuptiActivityEnableAndDump(DEVICE)", device) +
           "; TARGET_INFO_GPU has device ids only");
  }
  if (s.options.capture_range == CaptureRange::kAuto) DC_RETURN_IF_ERROR(s.StartLocked());
  if (s.options.capture_range == CaptureRange::kProfilerApi) {
    DC_RETURN_IF_ERROR(s.EnableMemoryKinds());
  }
  return collector;
}

CuptiCollector::CuptiCollector(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

CuptiCollector::~CuptiCollector() {
  if (impl_ == nullptr) return;
  std::lock_guard<std::mutex> lock(impl_->state_mutex);
  if (impl_->finished) return;
  impl_->finished = true;
  (void)impl_->StopLocked();
  if (impl_->memory_enabled) {
    impl_->DisableKinds(std::begin(kMemoryKinds), std::end(kMemoryKinds));
  }
  if (!impl_->disabled_kinds.contains("DEVICE")) {
    (void)cuptiActivityDisable(CUPTI_ACTIVITY_KIND_DEVICE);
  }
  (void)cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
}

Status CuptiCollector::Start() {
  std::lock_guard<std::mutex> lock(impl_->state_mutex);
  return impl_->StartLocked();
}

Status CuptiCollector::Stop() {
  std::lock_guard<std::mutex> lock(impl_->state_mutex);
  return impl_->StopLocked();
}

StatusOr<CuptiTraceCounts> CuptiCollector::Finish() {
  Impl& s = *impl_;
  cupti_internal::FinishInput input;
  {
    std::lock_guard<std::mutex> lock(s.state_mutex);
    if (s.finished)
      return Status::Error(s.options.output_path + ": the trace was already finished");
    Status stopped = s.StopLocked();
    s.finished = true;
    if (!stopped.ok()) s.Warn(stopped.message());
    if (s.memory_enabled) s.DisableKinds(std::begin(kMemoryKinds), std::end(kMemoryKinds));
    if (!s.disabled_kinds.contains("DEVICE")) {
      const CUptiResult result = cuptiActivityDisable(CUPTI_ACTIVITY_KIND_DEVICE);
      if (result != CUPTI_SUCCESS) {
        s.Warn(CuptiError("cuptiActivityDisable(DEVICE)", result));
      }
    }
    const CUptiResult flushed = cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
    if (flushed != CUPTI_SUCCESS) {
      s.Warn(CuptiError("cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED)", flushed) +
             "; the last records may be missing");
    }
  }
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (g_active == &s) g_active = nullptr;
  }
  s.StopWriter();
  if (s.subscriber != nullptr) {
    const CUptiResult result = cuptiUnsubscribe(s.subscriber);
    s.subscriber = nullptr;
    if (result != CUPTI_SUCCESS) s.Warn(CuptiError("cuptiUnsubscribe", result));
  }

  DC_ASSIGN_OR_RETURN(ClockSample end, ClockSample::Take());
  const int64_t origin = s.clock.session_start_utc_ns;
  input.anchors = s.StartAnchors();
  input.anchors.push_back(
      Anchor("end", end.realtime_ns, end.monotonic_ns, end.realtime_ns - origin));
  input.anchors.push_back(Anchor("cupti_end", end.realtime_ns, end.monotonic_ns,
                                 static_cast<int64_t>(end.cupti_ns) - origin));
  input.rank = {s.global_pid,         s.options.rank,     s.options.local_rank,
                s.options.world_size, s.options.hostname, s.options.device_id};
  std::vector<cupti_internal::WindowRow> windows;
  for (const auto& [begin_ns, end_ns] : s.windows) {
    windows.push_back({s.clock.ToSessionNs(begin_ns), s.clock.ToSessionNs(end_ns)});
  }
  input.windows = std::move(windows);
  for (const auto& [index, row] : s.instructions) input.instructions.push_back(row);
  input.steps = s.steps;
  input.evals = s.evals;
  input.streams = s.streams;
  input.metadata = s.options.metadata;
  input.metadata.emplace_back("dc.capture", s.options.capture_label);
  uint32_t cupti_version = 0;
  if (cuptiGetVersion(&cupti_version) == CUPTI_SUCCESS) {
    input.metadata.emplace_back("dc.cupti_api_version", std::to_string(cupti_version));
  }
  const std::string driver_version = DriverApi::Get().Version();
  if (!driver_version.empty())
    input.metadata.emplace_back("dc.cuda_driver_version", driver_version);
  std::vector<std::string> warnings;
  {
    std::lock_guard<std::mutex> lock(s.warnings_mutex);
    warnings = s.warnings;
  }
  for (const std::string& warning : warnings) {
    input.metadata.emplace_back("dc.warning." + std::to_string(s.global_pid), warning);
  }
  DC_ASSIGN_OR_RETURN(CuptiTraceCounts counts, s.writer->Finish(input));
  counts.warnings = std::move(warnings);
  return counts;
}

int64_t CuptiCollector::NowNs() const {
  return ClockNs(CLOCK_REALTIME) - impl_->clock.session_start_utc_ns;
}

Status CuptiCollector::PushInstruction(int step, int instruction) {
  const uint64_t id = (static_cast<uint64_t>(static_cast<uint32_t>(step)) << 32) |
                      static_cast<uint32_t>(instruction);
  return CuptiCall(
      "cuptiActivityPushExternalCorrelationId",
      cuptiActivityPushExternalCorrelationId(CUPTI_EXTERNAL_CORRELATION_KIND_CUSTOM0, id));
}

Status CuptiCollector::PopInstruction() {
  uint64_t id = 0;
  return CuptiCall(
      "cuptiActivityPopExternalCorrelationId",
      cuptiActivityPopExternalCorrelationId(CUPTI_EXTERNAL_CORRELATION_KIND_CUSTOM0, &id));
}

void CuptiCollector::DescribeInstruction(int instruction, InstructionInfo info) {
  std::lock_guard<std::mutex> lock(impl_->state_mutex);
  impl_->instructions[instruction] = {instruction, std::move(info.kind), info.micro_step,
                                      info.bytes,  info.tensors,         info.bucket};
}

Status CuptiCollector::NameStream(CUstream_st* stream, const std::string& name) {
  uint32_t stream_id = 0;
  DC_RETURN_IF_ERROR(
      CuptiCall("cuptiGetStreamIdEx",
                cuptiGetStreamIdEx(nullptr, stream, /*perThreadStream=*/0, &stream_id)));
  std::lock_guard<std::mutex> lock(impl_->state_mutex);
  impl_->streams.emplace_back(static_cast<int64_t>(stream_id), name);
  return Status::Ok();
}

void CuptiCollector::Step(int step, int64_t start_ns, int64_t end_ns, double loss, bool warmup) {
  std::unique_lock<std::mutex> lock(impl_->state_mutex);
  impl_->steps.push_back({step, start_ns, end_ns, loss, warmup});
  impl_->CheckpointLocked(lock);
}

void CuptiCollector::Evaluation(int64_t step, int64_t start_ns, int64_t end_ns, double loss) {
  std::lock_guard<std::mutex> lock(impl_->state_mutex);
  impl_->evals.push_back({step, start_ns, end_ns, loss});
}

const std::string& CuptiCollector::output_path() const { return impl_->options.output_path; }

int64_t CuptiCollector::global_pid() const { return impl_->global_pid; }

}  // namespace dc
