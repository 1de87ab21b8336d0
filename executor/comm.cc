#include "executor/comm.h"

#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <limits>
#include <mutex>
#include <vector>

#include "executor/shared_memory.h"
#include "executor/tcp_store.h"

namespace dc {
namespace {

class LocalCommunicator : public Communicator {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  Status AllGather(const float* shard, int64_t n, float* out) override {
    std::copy(shard, shard + n, out);
    return Status::Ok();
  }
  Status ReduceScatterSum(float* full, int64_t n, float* shard) override {
    std::copy(full, full + n, shard);
    return Status::Ok();
  }
  Status AllReduceSum(double*, int64_t) override { return Status::Ok(); }
  Status AllReduceMax(double*, int64_t) override { return Status::Ok(); }
  Status Broadcast(int64_t*, int) override { return Status::Ok(); }
  // A world of one has nothing to wait for: every channel is this one.
  int channels() const override { return std::numeric_limits<int>::max(); }
  Communicator* channel(int index) override { return index >= 0 ? this : nullptr; }
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

// The buffers of finished collectives, for the next ones to take: a fresh buffer per collective
// paid the page faults of its first touch (a thousand for a 4 MiB all-gather). Taken on the
// thread that makes collectives, given back on the one that ran them.
class BufferPool {
 public:
  struct Buffer {
    std::unique_ptr<float[]> data;
    size_t floats = 0;
  };
  // At least `floats`, contents unspecified.
  Buffer Take(size_t floats) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      // The smallest kept buffer that is large enough.
      auto best = free_.end();
      for (auto it = free_.begin(); it != free_.end(); ++it) {
        if (it->floats >= floats && (best == free_.end() || it->floats < best->floats)) best = it;
      }
      if (best != free_.end()) {
        Buffer taken = std::move(*best);
        free_.erase(best);
        return taken;
      }
    }
    return Buffer{std::unique_ptr<float[]>(new float[floats]), floats};  // not zero-filled
  }
  void Give(Buffer buffer) {
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(std::move(buffer));
    if (free_.size() > kKept) {  // the smallest goes
      free_.erase(
          std::min_element(free_.begin(), free_.end(),
                           [](const Buffer& a, const Buffer& b) { return a.floats < b.floats; }));
    }
  }

 private:
  // Each stream has its own channel (so its own pool), and the cpu device keeps up to 64 of a
  // stream's collectives alive, made or running (cpu_device.cc's kPostedAhead, within 256 MiB):
  // the largest eight freed are kept for the next ones, the rest go back to the allocator.
  static constexpr size_t kKept = 8;
  std::mutex mu_;
  std::vector<Buffer> free_;
};

class GlooRing;

// The rings running on one channel, for Abort to end their waits: Gloo's own waits end only at
// a peer's failure or at the timeout, not when this rank closes its connections.
class RunningRings {
 public:
  // False once aborted: the ring must not start.
  bool Enter(GlooRing* ring) {
    std::lock_guard<std::mutex> lock(mu_);
    if (aborted_) return false;
    running_.push_back(ring);
    return true;
  }
  void Leave(GlooRing* ring) {
    std::lock_guard<std::mutex> lock(mu_);
    running_.erase(std::find(running_.begin(), running_.end(), ring));
  }
  // Ends every running ring's waits (they fail) and refuses rings from now on.
  void Abort();

 private:
  std::mutex mu_;
  bool aborted_ = false;
  std::vector<GlooRing*> running_;  // under mu_
};

// Gloo's bound-buffer algorithms (AllgatherRing, ReduceScatterHalvingDoubling), made anew for
// each call, let a peer's bytes arrive before this rank has registered the buffer for them, and
// Gloo's device thread then spins on the socket until it has: on every collective one rank
// reached first, a core busy for nothing (on a 2-rank `tiny` step, most of the step's time). These
// rings use Gloo's unbound buffers instead, whose data moves once the receiver has posted its
// receive, and post every receive when the collective is made, ahead of its run: the sender then
// finds them posted and writes at once.
//
// All-gather: step s passes on the chunk received at step s - 1 (first this rank's own); the
// chunks land in place in the output. Reduce-scatter: chunk c starts at rank c + 1 and travels
// the ring, each rank adding its own part to what it receives, and ends summed at rank c: every
// chunk is summed in one fixed order, the same on every run.
class GlooRing : public PostedCollective {
 public:
  using Kind = CollectiveKind;
  // Throws Gloo's exceptions (a closed connection).
  GlooRing(const std::shared_ptr<gloo::rendezvous::Context>& context,
           std::shared_ptr<BufferPool> pool, std::shared_ptr<RunningRings> running, Kind kind,
           int64_t n)
      : context_(context),
        pool_(std::move(pool)),
        running_(std::move(running)),
        kind_(kind),
        world_(context->size),
        me_(context->rank),
        n_(n),
        chunk_bytes_(static_cast<size_t>(n) * sizeof(float)) {
    // All-gather: the output (world chunks). Reduce-scatter: the full buffer, then one received
    // chunk per step.
    const int64_t floats = kind == Kind::kAllGather ? world_ * n : (2 * world_ - 1) * n;
    buffer_ = pool_->Take(static_cast<size_t>(floats));
    float* data = buffer_.data.get();
    if (n == 0) return;
    slot_ = context->nextSlot();
    const size_t all_bytes = static_cast<size_t>(floats) * sizeof(float);
    for (int s = 0; s + 1 < world_; ++s) {
      receives_.push_back(context->createUnboundBuffer(data, all_bytes));
      sends_.push_back(context->createUnboundBuffer(data, all_bytes));
      const size_t into =
          kind == Kind::kAllGather ? Ring(me_ - s - 1) * chunk_bytes_ : (world_ + s) * chunk_bytes_;
      receives_.back()->recv(Ring(me_ - 1), slot_, into, chunk_bytes_);
    }
  }

  ~GlooRing() override {
    // Its Gloo buffers first: a receive still posted (a failed run) must not outlive the memory.
    receives_.clear();
    sends_.clear();
    pool_->Give(std::move(buffer_));
  }

  float* input() override {
    return kind_ == Kind::kAllGather ? buffer_.data.get() + me_ * n_ : buffer_.data.get();
  }
  const float* output() const override {
    return kind_ == Kind::kAllGather ? buffer_.data.get() : buffer_.data.get() + me_ * n_;
  }

  Status Run() override {
    if (n_ == 0) return Status::Ok();
    const char* what = CollectiveKindName(kind_);
    auto aborted_status = [&] {
      return Status::Error(std::string(what) + " on rank " + std::to_string(me_) +
                           ": the run was aborted");
    };
    if (!running_->Enter(this)) return aborted_status();
    // A wait that ends without completing was aborted (AbortWaits): said so, not as a peer's
    // failure.
    bool aborted = false;
    auto finished = [&aborted](bool completed) {
      if (completed) return;
      aborted = true;
      throw gloo::IoException("aborted");
    };
    Status status = Guarded(what, me_, [&] {
      const auto timeout = context_->getTimeout();
      for (int s = 0; s + 1 < world_; ++s) {
        const int send = kind_ == Kind::kAllGather ? Ring(me_ - s) : Ring(me_ - s - 1);
        sends_[s]->send(Ring(me_ + 1), slot_, send * chunk_bytes_, chunk_bytes_);
        finished(receives_[s]->waitRecv(timeout));
        if (kind_ == Kind::kReduceScatterSum) {
          // The chunk sent next: what arrived plus this rank's part.
          float* mine = buffer_.data.get() + Ring(me_ - s - 2) * n_;
          const float* received = buffer_.data.get() + (world_ + s) * n_;
          for (int64_t i = 0; i < n_; ++i) mine[i] += received[i];
        }
      }
      for (auto& send : sends_) finished(send->waitSend(timeout));
    });
    running_->Leave(this);
    return aborted ? aborted_status() : status;
  }

  // Ends its waits, now or when they start (Gloo keeps the abort until a wait takes it): for
  // RunningRings::Abort, while the ring runs.
  void AbortWaits() {
    for (auto& receive : receives_) receive->abortWaitRecv();
    for (auto& send : sends_) send->abortWaitSend();
  }

 private:
  int Ring(int position) const { return ((position % world_) + world_) % world_; }

  std::shared_ptr<gloo::rendezvous::Context> context_;
  std::shared_ptr<BufferPool> pool_;
  std::shared_ptr<RunningRings> running_;
  Kind kind_;
  int world_, me_;
  int64_t n_;
  size_t chunk_bytes_;
  uint64_t slot_ = 0;
  BufferPool::Buffer buffer_;
  // One buffer object per posted operation: Gloo's unbound buffers take one pending operation
  // each.
  std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> receives_, sends_;
};

void RunningRings::Abort() {
  std::lock_guard<std::mutex> lock(mu_);
  aborted_ = true;
  for (GlooRing* ring : running_) ring->AbortWaits();
}

class GlooCommunicator : public Communicator {
 public:
  explicit GlooCommunicator(std::shared_ptr<gloo::rendezvous::Context> context)
      : context_(std::move(context)) {}
  int rank() const override { return context_->rank; }
  int world_size() const override { return context_->size; }

  // The further channels, each over its own context (its own connections and slots).
  void AddChannel(std::unique_ptr<GlooCommunicator> channel) {
    channels_.push_back(std::move(channel));
  }
  int channels() const override { return 1 + static_cast<int>(channels_.size()); }
  Communicator* channel(int index) override {
    if (index == 0) return this;
    if (index < 0 || index > static_cast<int>(channels_.size())) return nullptr;
    return channels_[index - 1].get();
  }
  // All-gathers and reduce-scatters that fit its arena go through `shared` from now on.
  void UseSharedMemory(std::unique_ptr<SharedMemoryChannel> shared) { shared_ = std::move(shared); }
  // Why the ranks could not share memory, for transport_note.
  void NoSharedMemory(std::string why) { why_not_shared_ = std::move(why); }
  std::string transport() const override { return shared_ ? "shared-memory" : "tcp"; }
  std::string transport_note() const override { return why_not_shared_; }

  // This rank's rings in flight end their waits; closing the connections makes the peers see
  // their end close (their collectives with this rank fail).
  void Abort() override {
    bool expected = false;
    if (!aborted_.compare_exchange_strong(expected, true)) return;
    for (auto& c : channels_) c->Abort();
    if (shared_) shared_->Abort();
    running_->Abort();
    try {
      context_->closeConnections();
    } catch (const std::exception&) {
      // Already closed by a peer's failure: nothing left to wake.
    }
  }

  StatusOr<std::unique_ptr<PostedCollective>> PostAllGather(int64_t n) override {
    return Post(CollectiveKind::kAllGather, n);
  }
  StatusOr<std::unique_ptr<PostedCollective>> PostReduceScatterSum(int64_t n) override {
    return Post(CollectiveKind::kReduceScatterSum, n);
  }

  Status AllGather(const float* shard, int64_t n, float* out) override {
    DC_ASSIGN_OR_RETURN(std::unique_ptr<PostedCollective> ring, PostAllGather(n));
    std::copy(shard, shard + n, ring->input());
    DC_RETURN_IF_ERROR(ring->Run());
    std::copy(ring->output(), ring->output() + n * world_size(), out);
    return Status::Ok();
  }

  Status ReduceScatterSum(float* full, int64_t n, float* shard) override {
    DC_ASSIGN_OR_RETURN(std::unique_ptr<PostedCollective> ring, PostReduceScatterSum(n));
    std::copy(full, full + n * world_size(), ring->input());
    DC_RETURN_IF_ERROR(ring->Run());
    std::copy(ring->output(), ring->output() + n, shard);
    return Status::Ok();
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

  StatusOr<std::unique_ptr<PostedCollective>> Post(CollectiveKind kind, int64_t n) {
    if (shared_ && shared_->Takes(n)) return shared_->Post(kind, n);
    std::unique_ptr<PostedCollective> ring;
    DC_RETURN_IF_ERROR(Guarded(CollectiveKindName(kind), rank(), [&] {
      ring = std::make_unique<GlooRing>(context_, pool_, running_, kind, n);
    }));
    return ring;
  }

  std::shared_ptr<gloo::rendezvous::Context> context_;
  std::shared_ptr<BufferPool> pool_ = std::make_shared<BufferPool>();
  std::shared_ptr<RunningRings> running_ = std::make_shared<RunningRings>();
  std::vector<std::unique_ptr<GlooCommunicator>> channels_;
  std::unique_ptr<SharedMemoryChannel> shared_;  // null: everything over TCP
  std::string why_not_shared_;
  std::atomic<bool> aborted_{false};
};

// DC_CPU_TRANSPORT=auto takes shared memory only where /dev/shm has this much free.
constexpr int64_t kAutoSharedMemoryFreeBytes = int64_t{1} << 30;

// The meeting of a channel's shared-memory set-up, over its Gloo context: fixed-size records
// gathered, and a vote.
SharedMemoryMeeting GlooMeeting(const std::shared_ptr<gloo::rendezvous::Context>& context) {
  SharedMemoryMeeting meeting;
  meeting.exchange = [context](const std::string& mine) -> StatusOr<std::vector<std::string>> {
    constexpr size_t kRecord = 256;
    if (mine.size() >= kRecord) return Status::Error("shared memory set-up: a record too long");
    std::vector<char> in(kRecord, '\0'), out(kRecord * static_cast<size_t>(context->size), '\0');
    std::copy(mine.begin(), mine.end(), in.begin());
    DC_RETURN_IF_ERROR(Guarded("shared memory set-up", context->rank, [&] {
      gloo::AllgatherOptions opts(context);
      opts.setInput(in.data(), in.size());
      opts.setOutput(out.data(), out.size());
      gloo::allgather(opts);
    }));
    std::vector<std::string> records;
    for (int r = 0; r < context->size; ++r) {
      const char* record = out.data() + static_cast<size_t>(r) * kRecord;
      records.emplace_back(record, strnlen(record, kRecord));
    }
    return records;
  };
  meeting.all_agree = [context](bool mine) -> StatusOr<bool> {
    int64_t refusals = mine ? 0 : 1;
    DC_RETURN_IF_ERROR(Guarded("shared memory set-up", context->rank, [&] {
      gloo::AllreduceOptions opts(context);
      opts.setOutput(&refusals, 1);
      opts.setReduceFunction(
          static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::sum<int64_t>));
      gloo::allreduce(opts);
    }));
    return refusals == 0;
  };
  return meeting;
}

// Gloo's file store with this run's timeout on every wait (Gloo's own waits, in `get` and in
// the key checks of a full-mesh connect, use a fixed 30 s otherwise), and a key of an earlier
// run that died is replaced rather than refused ("File already exists").
class RunFileStore : public gloo::rendezvous::FileStore {
 public:
  RunFileStore(const std::string& path, std::chrono::milliseconds timeout)
      : FileStore(path), timeout_(timeout) {}
  void set(const std::string& key, const std::vector<char>& data) override {
    const std::string path = objectPath(key);
    ::unlink(path.c_str());
    own_paths_.push_back(path);
    FileStore::set(key, data);
  }
  std::vector<char> get(const std::string& key) override {
    FileStore::wait({key}, timeout_);
    return FileStore::get(key);
  }
  void wait(const std::vector<std::string>& keys) override { FileStore::wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    FileStore::wait(keys, timeout);
  }
  // Once every rank is connected no one reads the keys again, and after a failed rendezvous no
  // one should: this rank's keys go, so that only a killed run leaves any for the next to read.
  ~RunFileStore() override {
    for (const std::string& path : own_paths_) ::unlink(path.c_str());
  }

 private:
  std::chrono::milliseconds timeout_;
  std::vector<std::string> own_paths_;
};

// The TCP store (executor/tcp_store.h) as Gloo's store, with this run's timeout on every wait.
class GlooTcpStore : public gloo::rendezvous::Store {
 public:
  GlooTcpStore(TcpStore* store, std::chrono::milliseconds timeout)
      : store_(store), timeout_(timeout) {}
  void set(const std::string& key, const std::vector<char>& data) override {
    Check(store_->Set(key, data));
  }
  std::vector<char> get(const std::string& key) override {
    StatusOr<std::vector<char>> value = store_->Get(key, timeout_);
    Check(value.status());
    return *std::move(value);
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    for (const std::string& key : keys) Check(store_->Get(key, timeout).status());
  }

 private:
  static void Check(const Status& status) {
    if (!status.ok()) throw gloo::IoException(status.message());
  }
  TcpStore* store_;
  std::chrono::milliseconds timeout_;
};

// The rendezvous directory must exist and take files; said plainly instead of a failed
// rendezvous that blames the peers.
Status CheckStoreDir(const RendezvousOptions& options) {
  std::error_code ec;
  std::filesystem::create_directories(options.store_dir, ec);
  std::string probe = options.store_dir + "/.probe-XXXXXX";
  const int fd = ::mkstemp(probe.data());
  if (fd < 0) {
    return Status::Error("rank " + std::to_string(options.rank) + ": the rendezvous directory " +
                         options.store_dir + " is not writable (" + std::strerror(errno) +
                         "); pass --rendezvous a directory every rank can write");
  }
  ::close(fd);
  ::unlink(probe.c_str());
  return Status::Ok();
}

}  // namespace

StatusOr<RendezvousOptions::Transport> TransportFromEnvironment() {
  const char* value = std::getenv("DC_CPU_TRANSPORT");
  const std::string text = value ? value : "";
  if (text.empty() || text == "auto") return RendezvousOptions::Transport::kAuto;
  if (text == "shm") return RendezvousOptions::Transport::kSharedMemory;
  if (text == "tcp") return RendezvousOptions::Transport::kTcp;
  return Status::Error("DC_CPU_TRANSPORT=" + text +
                       ": takes auto (the default: shared memory between ranks that can map each "
                       "other's, else TCP), shm or tcp");
}

StatusOr<std::unique_ptr<Communicator>> Connect(const RendezvousOptions& options) {
  if (options.world_size <= 1) return std::unique_ptr<Communicator>(new LocalCommunicator());
  const bool tcp = options.store_dir.empty();
  // Rank 0 serves the TCP rendezvous until every rank has connected (the barrier below).
  TcpRendezvous meeting;
  if (tcp) {
    DC_ASSIGN_OR_RETURN(
        meeting, TcpRendezvous::Join(options.master_addr, options.master_port, options.run_id,
                                     options.world_size, options.rank, options.timeout));
  } else {
    DC_RETURN_IF_ERROR(CheckStoreDir(options));
  }
  std::vector<std::shared_ptr<gloo::rendezvous::Context>> contexts;
  Status connected = Guarded("rendezvous", options.rank, [&] {
    gloo::transport::tcp::attr attr;
    attr.hostname = options.bind_host;
    auto device = gloo::transport::tcp::CreateDevice(attr);
    std::unique_ptr<gloo::rendezvous::Store> base;
    if (tcp) {
      base = std::make_unique<GlooTcpStore>(meeting.store.get(), options.timeout);
    } else {
      base = std::make_unique<RunFileStore>(options.store_dir, options.timeout);
    }
    for (int c = 0; c < std::max(1, options.channels); ++c) {
      // Channel 0 keeps the run's own prefix; the others' keys are their own.
      gloo::rendezvous::PrefixStore store(
          c == 0 ? options.run_id : options.run_id + "/channel" + std::to_string(c), *base);
      auto context = std::make_shared<gloo::rendezvous::Context>(options.rank, options.world_size);
      context->setTimeout(options.timeout);
      context->connectFullMesh(store, device);
      contexts.push_back(std::move(context));
    }
    // Every rank has finished connecting before any goes on: a rank that fails right after
    // (an out-of-memory at start-up) must not look like a failed rendezvous to the others.
    gloo::BarrierOptions barrier(contexts.front());
    gloo::barrier(barrier);
  });
  if (!connected.ok()) {
    const std::string through =
        tcp ? options.master_addr + ":" + std::to_string(options.master_port) : options.store_dir;
    return Status::Error("rank " + std::to_string(options.rank) + ": could not meet the other " +
                         std::to_string(options.world_size - 1) + " rank(s) through " + through +
                         " within " + std::to_string(options.timeout.count() / 1000) +
                         " s; are all ranks started with the same " +
                         (tcp ? "MASTER_ADDR and MASTER_PORT" : "rendezvous directory") + "? (" +
                         connected.message() + ")");
  }
  std::vector<std::unique_ptr<GlooCommunicator>> channels;
  for (const auto& context : contexts) {
    channels.push_back(std::make_unique<GlooCommunicator>(context));
  }
  if (options.transport != RendezvousOptions::Transport::kTcp) {
    SharedMemoryOptions shared;
    shared.timeout = options.timeout;
    if (options.transport == RendezvousOptions::Transport::kAuto) {
      shared.min_free_bytes = kAutoSharedMemoryFreeBytes;
    }
    shared.run_id = options.run_id;
    for (size_t c = 0; c < contexts.size(); ++c) {
      std::string why_not;
      DC_ASSIGN_OR_RETURN(
          std::unique_ptr<SharedMemoryChannel> channel,
          SharedMemoryChannel::Join(options.rank, options.world_size, static_cast<int>(c), shared,
                                    GlooMeeting(contexts[c]), &why_not));
      if (!channel) {
        if (options.transport == RendezvousOptions::Transport::kSharedMemory) {
          return Status::Error("rank " + std::to_string(options.rank) +
                               ": DC_CPU_TRANSPORT=shm, but the ranks cannot share memory: " +
                               why_not + "; unset it to fall back to TCP");
        }
        channels.front()->NoSharedMemory(why_not);
        break;  // every rank saw the same vote: all of them stay on TCP
      }
      channels[c]->UseSharedMemory(std::move(channel));
    }
  }
  std::unique_ptr<GlooCommunicator> comm = std::move(channels.front());
  for (size_t c = 1; c < channels.size(); ++c) comm->AddChannel(std::move(channels[c]));
  return std::unique_ptr<Communicator>(std::move(comm));
}

}  // namespace dc
