// Collectives between the ranks of a run. The cpu backend's implementation is Gloo over TCP
// (rendezvous through a TCP store at MASTER_ADDR:MASTER_PORT or a file store in a shared
// directory), with all-gathers and reduce-scatters through shared memory where every rank can
// map every other's (executor/shared_memory.h); a world of one needs no transport. Calls are
// blocking and must be made in the same order on every rank. Not thread-safe: threads that need
// collectives at the same time (the cpu device's streams) each take a channel of their own.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "schemas/status.h"

namespace dc {

// The two collectives a plan's streams make ahead of their run.
enum class CollectiveKind { kAllGather, kReduceScatterSum };
// "all-gather" or "reduce-scatter", for messages.
inline const char* CollectiveKindName(CollectiveKind kind) {
  return kind == CollectiveKind::kAllGather ? "all-gather" : "reduce-scatter";
}

// A collective made ahead of its run. Made, its receives are posted: a peer that reaches the
// collective first finds where its data goes instead of waiting for this rank to get there. Run,
// it sends, receives and finishes. Made in the same order on every rank of its channel, and run
// in that order; it may be made on one thread and run on another.
class PostedCollective {
 public:
  virtual ~PostedCollective() = default;
  // Filled before Run: an all-gather's shard (shard_elements floats); a reduce-scatter's full
  // buffer (world_size * shard_elements), which Run uses as scratch.
  virtual float* input() = 0;
  // After Run: an all-gather's world_size * shard_elements (rank r's shard at r *
  // shard_elements); a reduce-scatter's summed chunk of this rank (shard_elements).
  virtual const float* output() const = 0;
  virtual Status Run() = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  // out[r * shard_elements ...] = rank r's `shard`.
  virtual Status AllGather(const float* shard, int64_t shard_elements, float* out) = 0;
  // Sums `full` (world_size * shard_elements) over ranks; writes this rank's chunk to `shard`.
  // `full` is used as scratch.
  virtual Status ReduceScatterSum(float* full, int64_t shard_elements, float* shard) = 0;
  virtual Status AllReduceSum(double* values, int64_t count) = 0;
  virtual Status AllReduceMax(double* values, int64_t count) = 0;
  virtual Status Broadcast(int64_t* value, int root) = 0;
  // The same two collectives made ahead of their run, on buffers of their own. The default
  // posts nothing and runs the blocking call.
  virtual StatusOr<std::unique_ptr<PostedCollective>> PostAllGather(int64_t shard_elements);
  virtual StatusOr<std::unique_ptr<PostedCollective>> PostReduceScatterSum(int64_t shard_elements);

  // Independent channels to the same ranks, made at connect (RendezvousOptions::channels):
  // collectives on different channels may run at the same time from different threads; on one
  // channel they are made by one thread at a time, in the same order on every rank. Channel 0
  // is this communicator. Null for an index past channels().
  virtual int channels() const { return 1; }
  virtual Communicator* channel(int index) { return index == 0 ? this : nullptr; }
  // A rank's failure: makes the collectives in flight on every channel, here and (through the
  // closed connections) on the peers, fail at once instead of waiting for the timeout. Callable
  // from any thread; no collective succeeds afterwards.
  virtual void Abort() {}
  // How the all-gathers and reduce-scatters move: "shared-memory", "tcp", or "none" (one rank);
  // and why not through shared memory where the ranks could not have it ("" otherwise).
  virtual std::string transport() const { return "none"; }
  virtual std::string transport_note() const { return ""; }
};

struct RendezvousOptions {
  int rank = 0;
  int world_size = 1;
  // Where the ranks meet: a shared directory for the file store, this run's own (created here),
  // or, when empty, the TCP store that rank 0 serves at master_addr:master_port
  // (executor/tcp_store.h).
  std::string store_dir;
  std::string master_addr;
  int master_port = 0;
  std::string bind_host = "127.0.0.1";  // address this rank listens on
  std::string run_id = "dc";            // prefix of the store's keys; the TCP store's run identity
  std::chrono::milliseconds timeout{60000};  // rendezvous and each collective
  int channels = 1;                          // Communicator::channels(): one Gloo context each
  // The all-gathers' and reduce-scatters' transport. kAuto: shared memory where every rank of
  // the run can map every other's, else TCP; kSharedMemory: shared memory or an error (why not);
  // kTcp: Gloo's TCP alone.
  enum class Transport { kAuto, kSharedMemory, kTcp };
  Transport transport = Transport::kAuto;
};

// DC_CPU_TRANSPORT (auto, shm, tcp; unset: auto) as a transport; an error names the variable.
StatusOr<RendezvousOptions::Transport> TransportFromEnvironment();

// A collective that posts nothing ahead: Run makes the communicator's blocking call.
class BlockingCollective : public PostedCollective {
 public:
  using Kind = CollectiveKind;
  BlockingCollective(Communicator* comm, Kind kind, int64_t n)
      : comm_(comm),
        kind_(kind),
        n_(n),
        input_(static_cast<size_t>(kind == Kind::kAllGather ? n : n * comm->world_size())),
        output_(static_cast<size_t>(kind == Kind::kAllGather ? n * comm->world_size() : n)) {}
  float* input() override { return input_.data(); }
  const float* output() const override { return output_.data(); }
  Status Run() override {
    return kind_ == Kind::kAllGather ? comm_->AllGather(input_.data(), n_, output_.data())
                                     : comm_->ReduceScatterSum(input_.data(), n_, output_.data());
  }

 private:
  Communicator* comm_;
  Kind kind_;
  int64_t n_;
  std::vector<float> input_, output_;
};

inline StatusOr<std::unique_ptr<PostedCollective>> Communicator::PostAllGather(
    int64_t shard_elements) {
  return std::unique_ptr<PostedCollective>(
      new BlockingCollective(this, CollectiveKind::kAllGather, shard_elements));
}

inline StatusOr<std::unique_ptr<PostedCollective>> Communicator::PostReduceScatterSum(
    int64_t shard_elements) {
  return std::unique_ptr<PostedCollective>(
      new BlockingCollective(this, CollectiveKind::kReduceScatterSum, shard_elements));
}

// A world of one (no transport) or Gloo's full mesh over TCP.
StatusOr<std::unique_ptr<Communicator>> Connect(const RendezvousOptions& options);

}  // namespace dc
