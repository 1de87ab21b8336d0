// The cpu backend's device: host memory, the cpu kernels (executor/cpu_kernels.h, real fp32
// math) and the communicator's Gloo collectives. Every call runs at once, in the caller's thread,
// so the plan's streams are kept by issue order and events have nothing to do. Every float buffer
// is stored in fp32 whatever the compute dtype; new buffers are zeroed.
#pragma once

#include <memory>

#include "executor/comm.h"
#include "executor/cpu_kernels.h"
#include "executor/device.h"

namespace dc {

// The cpu kernels' context for an op's arguments, with `num_threads` BLAS threads: the cpu
// device's ops and, on every backend, the host optimizer's.
KernelContext CpuKernelContext(const OpArgs& args, int num_threads);

// `comm` is the rank's communicator; `num_threads` the kernels' BLAS threads.
std::unique_ptr<RankDevice> MakeCpuDevice(Communicator* comm, int num_threads);

}  // namespace dc
