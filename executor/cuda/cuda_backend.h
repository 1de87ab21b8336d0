// The cuda backend as a session runs it (executor/backend.h): each rank takes the GPU of its
// local rank, meets the other ranks in one NCCL communicator (its unique id shared through the
// launcher's rendezvous directory, as the cpu backend's Gloo store), records its trace with the
// in-process CUPTI collector, and runs the plan with RunScheduleOnCuda. A rank that fails aborts
// the communicator, so the other ranks' collectives fail instead of waiting for it.
#pragma once

#include <memory>

#include "executor/backend.h"
#include "executor/cuda/cuda_executor.h"

namespace dc {

std::unique_ptr<RankBackend> MakeCudaBackend(const CudaRunOptions& options = {});

}  // namespace dc
