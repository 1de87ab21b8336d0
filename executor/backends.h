// The backends of this build, for the commands: which exist, which a host can use, and the
// backend object a session runs with. The cpu backend is always here; the cuda backend when dc
// was built with the CUDA toolkit and NCCL (DC_HAVE_CUDA_BACKEND). Only this file knows which.
#pragma once

#include <memory>
#include <string>

#include "executor/backend.h"
#include "schemas/status.h"

namespace dc {

// Whether the cuda backend is compiled in, and how many CUDA devices this process sees (the
// statically linked CUDA runtime loads the driver if there is one; without it the count is 0
// and the binary runs on cpu).
BackendAvailability AvailableBackends();

// The backend named `name` ("cpu" or "cuda", as ResolveBackend returns). For cuda,
// CUDA_LAUNCH_BLOCKING=1 in the environment makes the executor wait for and check every
// instruction, so an asynchronous device failure names the instruction that caused it.
StatusOr<std::unique_ptr<RankBackend>> MakeBackend(const std::string& name);

// What a plan made for `backend` records as its device: "cpu", or the name of the CUDA device
// of `local_rank` ("NVIDIA H100 80GB HBM3").
std::string BackendDevice(const std::string& backend, int local_rank);

}  // namespace dc
