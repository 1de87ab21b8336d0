#include "executor/backends.h"

#include <cstdlib>
#include <cstring>

#if defined(DC_HAVE_CUDA_BACKEND)
#include "executor/cuda/cuda_backend.h"
#include "executor/cuda/cuda_device.h"
#endif

namespace dc {

BackendAvailability AvailableBackends() {
  BackendAvailability available;
#if defined(DC_HAVE_CUDA_BACKEND)
  available.cuda_compiled = true;
  available.cuda_devices = CudaDeviceCount();
#endif
  return available;
}

StatusOr<std::unique_ptr<RankBackend>> MakeBackend(const std::string& name) {
  if (name == kCpuBackend) return MakeCpuBackend();
#if defined(DC_HAVE_CUDA_BACKEND)
  if (name == kCudaBackend) {
    CudaRunOptions options;
    const char* blocking = std::getenv("CUDA_LAUNCH_BLOCKING");
    options.synchronous = blocking != nullptr && std::strcmp(blocking, "1") == 0;
    return MakeCudaBackend(options);
  }
#endif
  return Status::Error("this build has no '" + name + "' backend");
}

std::string BackendDevice(const std::string& backend, int local_rank) {
#if defined(DC_HAVE_CUDA_BACKEND)
  if (backend == kCudaBackend) {
    auto info = GetCudaDeviceInfo(local_rank);
    if (info.ok()) return info->name;
    return "cuda:" + std::to_string(local_rank);
  }
#else
  (void)local_rank;
#endif
  return backend;
}

}  // namespace dc
