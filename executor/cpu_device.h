// The cpu backend's device: host memory, the cpu kernels (executor/cpu_kernels.h, real fp32
// math) and the communicator's Gloo collectives. Each of the plan's device streams (compute,
// gather, reduce, host-to-device, device-to-host) is a worker thread with a FIFO of work: a call
// naming a stream enqueues its work there and returns, events order the streams as CUDA events
// do, and Gloo collectives run on their stream's thread (each stream its own communicator
// channel) while compute goes on (CpuStreams: when the rank has peers). STREAM_HOST work runs
// at once on the calling thread. Every float buffer is stored in fp32 whatever the compute
// dtype. New buffers hold whatever was there before, as cudaMallocAsync's do: every kernel
// writes all of its outputs, and the interpreter zeroes what it accumulates into
// (CpuDeviceOptions::poison_new_buffers checks both).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "executor/comm.h"
#include "executor/cpu_kernels.h"
#include "executor/device.h"
#include "executor/layout.h"
#include "executor/tracer.h"
#include "schemas/status.h"

namespace dc {

// The communicator channels the cpu device's streams use: channel 1 + DeviceStreamIndex(s) for
// stream s, channel 0 staying the interpreter's. A communicator with fewer channels (and more
// than one rank) makes the device run its streams serially.
inline constexpr int kCpuDeviceChannels = 1 + kNumDeviceStreams;

// Where the device's streams run. A stream thread pays for itself only where its work can wait
// on something other than this process's cores: a peer's collective. One rank has none (its
// "collectives" are local copies), so by default it runs in issue order, sparing a thread
// hand-off per instruction (a tenth of a small step on one core).
enum class CpuStreams {
  kAuto,     // threads when the rank has peers, issue order when it is alone
  kThreads,  // a thread per stream even for one rank
  // Every call at once on the calling thread, in issue order (the order the plan's streams and
  // events allow, one of many): the reference the threaded streams must match bit for bit.
  kSerial,
};

struct CpuDeviceOptions {
  CpuStreams streams = CpuStreams::kAuto;
  // Test-only: when non-zero, each stream sleeps a random time of up to `jitter_max_ns` before
  // each item of work (seeded by this and the stream), to shake out missing cross-stream order.
  // Implies threads (unless kSerial).
  uint64_t jitter_seed = 0;
  int64_t jitter_max_ns = 200'000;
  // Test-only: fill every new buffer (arena placement or pool) with NaNs (in stream order), so
  // that a kernel reading an output before writing it, or an accumulator nobody zeroed, turns
  // the loss into NaN instead of depending on what the memory held.
  bool poison_new_buffers = false;
};

// The options from the environment: DC_CPU_STREAMS=auto (the default), threads, serial, or
// jitter:<seed> (threads, shaken); DC_CPU_POISON=1 (or 0, the default) sets poison_new_buffers.
// Errors name the variable and what it takes.
StatusOr<CpuDeviceOptions> CpuDeviceOptionsFromEnv();

// The cpu kernels' context for an op's arguments, with `num_threads` BLAS threads: the cpu
// device's ops and, on every backend, the host optimizer's.
KernelContext CpuKernelContext(const OpArgs& args, int num_threads);

// `comm` is the rank's communicator; `num_threads` the kernels' BLAS threads; `tracer` (may be
// null) is told when each instruction's work ran on its stream (ExecutionTracer::InstructionRan).
// Fails when the streams' threads cannot be started.
StatusOr<std::unique_ptr<RankDevice>> MakeCpuDevice(Communicator* comm, int num_threads,
                                                    const CpuDeviceOptions& options = {},
                                                    ExecutionTracer* tracer = nullptr);

}  // namespace dc
