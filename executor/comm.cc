#include "executor/comm.h"

#include <gloo/allgather_ring.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/math.h>
#include <gloo/reduce_scatter.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/transport/tcp/device.h>

#include <cstring>
#include <exception>
#include <vector>

namespace dc {
namespace {

class LocalCommunicator : public Communicator {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  Status AllGather(const float* shard, int64_t n, float* out) override {
    std::memcpy(out, shard, n * sizeof(float));
    return Status::Ok();
  }
  Status ReduceScatterSum(float* full, int64_t n, float* shard) override {
    std::memcpy(shard, full, n * sizeof(float));
    return Status::Ok();
  }
  Status AllReduceSum(double*, int64_t) override { return Status::Ok(); }
  Status AllReduceMax(double*, int64_t) override { return Status::Ok(); }
  Status Broadcast(int64_t*, int) override { return Status::Ok(); }
};

// Runs a Gloo call, turning its exceptions (a peer gone, a timeout) into a Status.
template <typename Fn>
Status Guarded(const char* what, int rank, Fn&& fn) {
  try {
    fn();
    return Status::Ok();
  } catch (const std::exception& e) {
    std::string why = e.what();
    if (auto nl = why.find('\n'); nl != std::string::npos) why.resize(nl);
    return Status::Error(std::string(what) + " failed on rank " + std::to_string(rank) +
                         ": a peer rank is gone or timed out (" + why + ")");
  }
}

class GlooCommunicator : public Communicator {
 public:
  explicit GlooCommunicator(std::shared_ptr<gloo::rendezvous::Context> context)
      : context_(std::move(context)) {}
  int rank() const override { return context_->rank; }
  int world_size() const override { return context_->size; }

  Status AllGather(const float* shard, int64_t n, float* out) override {
    return Guarded("all-gather", rank(), [&] {
      gloo::AllgatherRing<float> algorithm(context_, std::vector<const float*>{shard}, out,
                                           static_cast<int>(n));
      algorithm.run();
    });
  }

  Status ReduceScatterSum(float* full, int64_t n, float* shard) override {
    return Guarded("reduce-scatter", rank(), [&] {
      std::vector<int> counts(world_size(), static_cast<int>(n));
      gloo::ReduceScatterHalvingDoubling<float> algorithm(
          context_, std::vector<float*>{full}, static_cast<int>(n * world_size()), counts);
      algorithm.run();
      // The algorithm leaves this rank's chunk at the front of the buffer.
      std::memcpy(shard, full, n * sizeof(float));
    });
  }

  Status AllReduceSum(double* values, int64_t count) override {
    return AllReduce(values, count, &gloo::sum<double>, "all-reduce");
  }
  Status AllReduceMax(double* values, int64_t count) override {
    return AllReduce(values, count, &gloo::max<double>, "all-reduce");
  }

  Status Broadcast(int64_t* value, int root) override {
    return Guarded("broadcast", rank(), [&] {
      gloo::BroadcastOptions opts(context_);
      opts.setOutput(value, 1);
      opts.setRoot(root);
      gloo::broadcast(opts);
    });
  }

 private:
  using ReduceFn = void (*)(void*, const void*, const void*, size_t);
  Status AllReduce(double* values, int64_t count, ReduceFn fn, const char* what) {
    return Guarded(what, rank(), [&] {
      gloo::AllreduceOptions opts(context_);
      opts.setOutput(values, count);
      opts.setReduceFunction(fn);
      gloo::allreduce(opts);
    });
  }

  std::shared_ptr<gloo::rendezvous::Context> context_;
};

}  // namespace

StatusOr<std::unique_ptr<Communicator>> Connect(const RendezvousOptions& options) {
  if (options.world_size <= 1) return std::unique_ptr<Communicator>(new LocalCommunicator());
  std::shared_ptr<gloo::rendezvous::Context> context;
  Status connected = Guarded("rendezvous", options.rank, [&] {
    gloo::transport::tcp::attr attr;
    attr.hostname = options.bind_host;
    auto device = gloo::transport::tcp::CreateDevice(attr);
    gloo::rendezvous::FileStore file_store(options.store_dir);
    gloo::rendezvous::PrefixStore store(options.run_id, file_store);
    context = std::make_shared<gloo::rendezvous::Context>(options.rank, options.world_size);
    context->setTimeout(options.timeout);
    context->connectFullMesh(store, device);
    // Every rank has finished connecting before any goes on: a rank that fails right after
    // (an out-of-memory at start-up) must not look like a failed rendezvous to the others.
    gloo::BarrierOptions barrier(context);
    gloo::barrier(barrier);
  });
  if (!connected.ok()) {
    return Status::Error("rank " + std::to_string(options.rank) + ": could not meet the other " +
                         std::to_string(options.world_size - 1) + " rank(s) through " +
                         options.store_dir + " within " +
                         std::to_string(options.timeout.count() / 1000) +
                         " s; are all ranks started with the same rendezvous directory? (" +
                         connected.message() + ")");
  }
  return std::unique_ptr<Communicator>(new GlooCommunicator(std::move(context)));
}

}  // namespace dc
