// A host emulator for the kernels of kernels.cuh and attention.cuh (see kernel_compat.cuh). A
// launch runs the grid's blocks one after another; a block's threads are fibers (ucontext) on
// the calling thread, each running until it reaches a barrier: __syncthreads (all the block's
// live threads) or a warp exchange (all the warp's live threads). A scheduler resumes the threads
// in index order and releases a barrier once every live thread it waits for has arrived, as the
// GPU does for threads that have exited. A barrier that can never be released (one reached by
// only part of a block or warp) fails the launch instead of hanging.
//
// Shared memory is function-local statics (one block runs at a time) and one dynamic buffer,
// filled with NaN bytes at each launch so that reads of unwritten shared memory show up in
// results. This checks kernels' logic (indexing, tiling, masking, reductions, barrier placement),
// not speed or the memory model. Only test binaries include it; it is single-threaded.
#pragma once

#include <driver_types.h>
#include <ucontext.h>
#include <vector_types.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

namespace dc::emu {

inline uint3 thread_idx;
inline uint3 block_idx;
inline dim3 block_dim;
inline dim3 grid_dim;

// The limits the emulator enforces, as a Hopper GPU would.
inline constexpr unsigned kMaxThreadsPerBlock = 1024;
inline constexpr size_t kMaxDynamicSmemBytes = 227 * 1024;
inline constexpr unsigned kWarpSize = 32;
// Stack of each emulated thread; kernels keep small register arrays only.
inline constexpr size_t kFiberStackBytes = 256 * 1024;

enum class FiberState { kRunnable, kAtBlockBarrier, kAtWarpBarrier, kDone };

struct Fiber {
  ucontext_t context{};
  FiberState state = FiberState::kRunnable;
  std::unique_ptr<char[]> stack;
};

struct Block {
  std::vector<Fiber> fibers;  // reused across blocks and launches; sized to the largest block
  unsigned threads = 0;
  unsigned current = 0;
  ucontext_t scheduler{};
  std::vector<std::array<uint64_t, kWarpSize>> slots;  // per warp, for exchanges
  const std::function<void()>* body = nullptr;
};

inline Block& TheBlock() {
  static Block block;
  return block;
}

inline std::vector<unsigned char>& DynamicSmemBuffer() {
  static std::vector<unsigned char> buffer;
  return buffer;
}
inline unsigned char* DynamicSmem() { return DynamicSmemBuffer().data(); }

inline void Yield(FiberState state) {
  Block& block = TheBlock();
  Fiber& fiber = block.fibers[block.current];
  fiber.state = state;
  swapcontext(&fiber.context, &block.scheduler);
}

inline void SyncThreads() { Yield(FiberState::kAtBlockBarrier); }

// Every lane of the warp publishes `value`; returns the value lane `source_lane` published.
template <typename T>
T WarpExchange(T value, int source_lane) {
  static_assert(sizeof(T) <= sizeof(uint64_t));
  Block& block = TheBlock();
  const unsigned lane = thread_idx.x % kWarpSize, warp = thread_idx.x / kWarpSize;
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  block.slots[warp][lane] = bits;
  Yield(FiberState::kAtWarpBarrier);
  T out;
  std::memcpy(&out, &block.slots[warp][static_cast<unsigned>(source_lane) % kWarpSize], sizeof(T));
  Yield(FiberState::kAtWarpBarrier);  // nobody overwrites a slot before everyone has read it
  return out;
}

inline void FiberMain() {
  Block& block = TheBlock();
  (*block.body)();
  block.fibers[block.current].state = FiberState::kDone;
  // Returning resumes uc_link, the scheduler.
}

// Releases the barriers that every live thread they wait for has reached. False when none can be
// released although some threads wait: a deadlock.
inline bool ReleaseBarriers(Block& block) {
  bool released = false;
  const unsigned warps = block.threads / kWarpSize;
  for (unsigned w = 0; w < warps; ++w) {
    bool all_at_warp = true, any_at_warp = false;
    for (unsigned t = w * kWarpSize; t < (w + 1) * kWarpSize; ++t) {
      const FiberState s = block.fibers[t].state;
      if (s == FiberState::kAtWarpBarrier) any_at_warp = true;
      if (s != FiberState::kAtWarpBarrier && s != FiberState::kDone) all_at_warp = false;
    }
    if (any_at_warp && all_at_warp) {
      for (unsigned t = w * kWarpSize; t < (w + 1) * kWarpSize; ++t) {
        if (block.fibers[t].state == FiberState::kAtWarpBarrier) {
          block.fibers[t].state = FiberState::kRunnable;
        }
      }
      released = true;
    }
  }
  if (released) return true;
  bool all_at_block = true, any_at_block = false;
  for (unsigned t = 0; t < block.threads; ++t) {
    const FiberState s = block.fibers[t].state;
    if (s == FiberState::kAtBlockBarrier) any_at_block = true;
    if (s != FiberState::kAtBlockBarrier && s != FiberState::kDone) all_at_block = false;
  }
  if (any_at_block && all_at_block) {
    for (unsigned t = 0; t < block.threads; ++t) {
      if (block.fibers[t].state == FiberState::kAtBlockBarrier) {
        block.fibers[t].state = FiberState::kRunnable;
      }
    }
    return true;
  }
  return false;
}

// Runs `body` as `threads` threads of one block. False on a barrier deadlock.
inline bool RunBlock(unsigned threads, const std::function<void()>& body) {
  Block& block = TheBlock();
  if (block.fibers.size() < threads) block.fibers.resize(threads);
  block.threads = threads;
  block.body = &body;
  block.slots.assign(threads / kWarpSize, {});
  for (unsigned t = 0; t < threads; ++t) {
    Fiber& fiber = block.fibers[t];
    if (!fiber.stack) fiber.stack.reset(new char[kFiberStackBytes]);
    getcontext(&fiber.context);
    fiber.context.uc_stack.ss_sp = fiber.stack.get();
    fiber.context.uc_stack.ss_size = kFiberStackBytes;
    fiber.context.uc_link = &block.scheduler;
    makecontext(&fiber.context, FiberMain, 0);
    fiber.state = FiberState::kRunnable;
  }
  while (true) {
    for (unsigned t = 0; t < threads; ++t) {
      if (block.fibers[t].state != FiberState::kRunnable) continue;
      block.current = t;
      thread_idx = uint3{t, 0, 0};
      swapcontext(&block.scheduler, &block.fibers[t].context);
    }
    bool all_done = true;
    for (unsigned t = 0; t < threads; ++t) {
      if (block.fibers[t].state != FiberState::kDone) all_done = false;
    }
    if (all_done) return true;
    if (!ReleaseBarriers(block)) return false;
  }
}

template <typename... KernelArgs>
cudaError_t Launch(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem_bytes,
                   KernelArgs... args) {
  if (block.y != 1 || block.z != 1 || block.x == 0 || block.x % kWarpSize != 0 ||
      block.x > kMaxThreadsPerBlock || grid.x == 0 || grid.y == 0 || grid.z == 0) {
    return cudaErrorInvalidConfiguration;
  }
  if (smem_bytes > kMaxDynamicSmemBytes) return cudaErrorInvalidValue;
  grid_dim = grid;
  block_dim = block;
  const std::function<void()> body = [&] { kernel(args...); };
  for (unsigned z = 0; z < grid.z; ++z) {
    for (unsigned y = 0; y < grid.y; ++y) {
      for (unsigned x = 0; x < grid.x; ++x) {
        DynamicSmemBuffer().assign(smem_bytes, 0xFF);  // NaN in every float
        block_idx = uint3{x, y, z};
        if (!RunBlock(block.x, body)) return cudaErrorLaunchFailure;  // barrier deadlock
      }
    }
  }
  return cudaSuccess;
}

}  // namespace dc::emu
