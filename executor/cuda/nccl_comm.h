// Collectives between GPU ranks through NCCL: the Communicator interface on device pointers, plus
// grouped all-gathers and reduce-scatters of several tensors in any float dtype.
//
// One NCCL communicator per run, created non-blocking so that no call can hang the process: a
// rank whose peer died or hangs sees an NCCL async error or the timeout, the communicator is
// aborted (ncclCommAbort) and the call returns a Status naming the call and the rank. After that
// every call fails at once.
//
// Rendezvous: rank 0 makes the ncclUniqueId and writes it to `<store_dir>/nccl-id` atomically
// (a temporary file, then rename); the other ranks poll for it within the timeout; rank 0 removes
// it once all have joined. A rendezvous directory serves one run at a time (a run that died
// during the rendezvous can leave a stale nccl-id behind), as LaunchLocal's private directories
// do. Without a directory the id goes through the TCP store rank 0 serves at
// MASTER_ADDR:MASTER_PORT (executor/tcp_store.h) while the ranks join. NCCL picks its own network
// interface (NCCL_SOCKET_IFNAME); bind_host is not used.
//
// Not thread-safe; calls must be made in the same order on every rank.
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "executor/comm.h"
#include "schemas/program.h"
#include "schemas/status.h"

namespace dc {

// One tensor of a grouped all-gather: every rank's `shard` (shard_elements) into `out`
// (world_size * shard_elements; rank r's shard at r * shard_elements). Device pointers.
struct NcclGatherItem {
  const void* shard = nullptr;
  void* out = nullptr;
  int64_t shard_elements = 0;
  proto::DType dtype = proto::DTYPE_F32;
};

// One tensor of a grouped reduce-scatter: `full` (world_size * shard_elements) summed over the
// ranks; this rank's chunk into `shard`. Device pointers.
struct NcclReduceScatterItem {
  const void* full = nullptr;
  void* shard = nullptr;
  int64_t shard_elements = 0;
  proto::DType dtype = proto::DTYPE_F32;
};

class NcclCommunicator : public Communicator {
 public:
  ~NcclCommunicator() override;

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }

  // The Communicator calls. AllGather and ReduceScatterSum take fp32 DEVICE pointers; the
  // all-reduces and the broadcast take HOST values (staged through pinned memory and a device
  // scratch). All are blocking: enqueued on stream() and waited for, within the timeout.
  Status AllGather(const float* shard, int64_t shard_elements, float* out) override;
  Status ReduceScatterSum(float* full, int64_t shard_elements, float* shard) override;
  Status AllReduceSum(double* values, int64_t count) override;
  Status AllReduceMax(double* values, int64_t count) override;
  Status Broadcast(int64_t* value, int root) override;

  // Several tensors as one NCCL group (one launch). Enqueued on stream() and not waited for:
  // order later work after it with an event recorded on stream(), or call Synchronize().
  Status AllGatherGroup(std::span<const NcclGatherItem> items);
  Status ReduceScatterGroup(std::span<const NcclReduceScatterItem> items);
  // The same on another stream (the executor's gather or reduce stream). NCCL orders the
  // operations of one communicator by the order they are enqueued in, whatever their streams,
  // so every rank must enqueue them in the same order.
  Status AllGatherGroup(std::span<const NcclGatherItem> items, cudaStream_t stream);
  Status ReduceScatterGroup(std::span<const NcclReduceScatterItem> items, cudaStream_t stream);
  // `count` fp32 DEVICE values summed over the ranks in place, enqueued on `stream` and not
  // waited for (the grads' squared norm before a clipped optimizer step).
  Status AllReduceSumOnDevice(float* values, int64_t count, cudaStream_t stream);

  // Waits for everything enqueued on stream(), polling NCCL for a failed or vanished peer.
  // `what` names the wait in errors.
  Status Synchronize(const std::string& what = "synchronize");
  // The same for another stream: a rank waiting for its own streams must still notice a peer
  // that failed or hangs in a collective they wait for.
  Status Synchronize(cudaStream_t stream, const std::string& what);

  // Aborts the communicator (once) so that the other ranks' collectives fail instead of
  // waiting for this rank; every later call fails at once. For a rank that is giving up.
  void Abort() override;

  cudaStream_t stream() const { return stream_; }
  bool aborted() const { return aborted_; }

  struct State;  // NCCL and CUDA handles (nccl_comm.cc)

 private:
  friend StatusOr<std::unique_ptr<NcclCommunicator>> ConnectNcclCommunicator(
      const RendezvousOptions& options, cudaStream_t stream);
  NcclCommunicator(int rank, int world_size, cudaStream_t stream, std::chrono::milliseconds timeout,
                   std::unique_ptr<State> state);

  // Runs one NCCL call (or group), waiting out ncclInProgress; aborts on failure.
  template <typename Fn>
  Status Call(const std::string& what, Fn&& fn);
  Status WaitNotInProgress(const std::string& what);
  // Aborts the communicator and returns "rank R: <what>: <why>; communicator aborted".
  Status Fail(const std::string& what, const std::string& why);
  Status CheckUsable(const std::string& what) const;
  Status AllReduceHost(double* values, int64_t count, bool max, const std::string& what);

  int rank_;
  int world_size_;
  cudaStream_t stream_;
  std::chrono::milliseconds timeout_;
  bool aborted_ = false;
  std::unique_ptr<State> state_;
};

// The file through which the ranks share the NCCL unique id.
std::string NcclIdPath(const RendezvousOptions& options);

// Creates this rank's communicator on the current CUDA device (call cudaSetDevice / UseCudaDevice
// with the local rank first). `stream` carries every collective; null means the legacy default
// stream, which serializes with everything: pass the executor's gather or reduce stream.
StatusOr<std::unique_ptr<NcclCommunicator>> ConnectNcclCommunicator(
    const RendezvousOptions& options, cudaStream_t stream);
// The same, as the executor's Communicator interface.
StatusOr<std::unique_ptr<Communicator>> ConnectNccl(const RendezvousOptions& options,
                                                    cudaStream_t stream);

}  // namespace dc
