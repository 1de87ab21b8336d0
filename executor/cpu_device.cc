#include "executor/cpu_device.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <random>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "executor/cpu_kernels.h"
#include "executor/executor.h"
#include "executor/layout.h"

namespace dc {
namespace {

class CpuHostBuffer : public HostBuffer {
 public:
  explicit CpuHostBuffer(int64_t bytes) : bytes_(static_cast<size_t>(bytes)) {}
  void* data() override { return bytes_.data(); }
  int64_t size_bytes() const override { return static_cast<int64_t>(bytes_.size()); }

 private:
  std::vector<std::byte> bytes_;
};

TensorRef RefOf(const DeviceTensor& tensor) {
  TensorRef ref;
  ref.shape = tensor.shape;
  if (tensor.dtype == proto::DTYPE_I32) {
    ref.i32 = static_cast<int32_t*>(tensor.data);
  } else {
    ref.f32 = static_cast<float*>(tensor.data);
  }
  return ref;
}

float* Floats(const DeviceTensor& tensor) { return static_cast<float*>(tensor.data); }

void Copy(void* to, const void* from, int64_t bytes) {
  if (bytes > 0) std::memmove(to, from, static_cast<size_t>(bytes));
}

void Fill0(void* to, int64_t bytes) {
  if (bytes > 0) std::memset(to, 0, static_cast<size_t>(bytes));
}

// All-ones bytes: a quiet NaN in every fp32 element (and -1 in every int32 one).
void FillNaN(void* to, int64_t bytes) {
  if (bytes > 0) std::memset(to, 0xff, static_cast<size_t>(bytes));
}

// Whether a device with `options` on `comm` runs its streams in issue order (CpuStreams).
bool RunsSerially(const CpuDeviceOptions& options, const Communicator* comm) {
  const int world = comm->world_size();
  // Streams need a channel each when collectives cross ranks; without, issue order it is.
  if (world > 1 && comm->channels() < kCpuDeviceChannels) return true;
  switch (options.streams) {
    case CpuStreams::kSerial:
      return true;
    case CpuStreams::kThreads:
      return false;
    case CpuStreams::kAuto:
      return world == 1 && options.jitter_seed == 0;
  }
  return false;
}

// The grouped collectives' math. The shards are packed side by side into the posted all-gather's
// input, gathered once, and each rank's chunk unpacked into the whole params; a world of one
// copies (shard = whole, unpadded) and has no collective.
Status AllGatherNow(PostedCollective* gather, int world, const std::vector<GatherItem>& items) {
  if (world == 1) {
    for (const GatherItem& item : items) {
      const int64_t count = std::min(item.shard_elements, item.whole.NumElements());
      std::copy(Floats(item.shard), Floats(item.shard) + count, Floats(item.whole));
    }
    return Status::Ok();
  }
  float* packed = gather->input();
  int64_t packed_elements = 0;
  for (const GatherItem& item : items) {
    const float* shard = Floats(item.shard);
    std::copy(shard, shard + item.shard_elements, packed + packed_elements);
    packed_elements += item.shard_elements;
  }
  DC_RETURN_IF_ERROR(gather->Run());
  const float* gathered = gather->output();
  int64_t offset = 0;
  for (const GatherItem& item : items) {
    const int64_t shard = item.shard_elements, numel = item.whole.NumElements();
    float* whole = Floats(item.whole);
    for (int r = 0; r < world; ++r) {
      const int64_t begin = r * shard;
      const int64_t count = std::max<int64_t>(0, std::min(shard, numel - begin));
      const float* chunk = gathered + r * packed_elements + offset;
      std::copy(chunk, chunk + count, whole + begin);
    }
    offset += shard;
  }
  return Status::Ok();
}

// Rank r's chunk of the packed buffer holds rank r's slice of every grad, side by side. A world
// of one adds the grad to the accumulator directly (the same sums, in the same order).
Status ReduceScatterAddNow(PostedCollective* reduce, int world,
                           const std::vector<ReduceScatterItem>& items) {
  if (world == 1) {
    for (const ReduceScatterItem& item : items) {
      float* accumulator = Floats(item.shard);
      const float* grad = Floats(item.grad);
      const int64_t count = std::min(item.shard_elements, item.grad.NumElements());
      for (int64_t i = 0; i < count; ++i) accumulator[i] += grad[i];
      // Padding past the grad's end adds zeros: nothing to do.
    }
    return Status::Ok();
  }
  int64_t packed_elements = 0;
  for (const ReduceScatterItem& item : items) packed_elements += item.shard_elements;
  float* packed = reduce->input();
  int64_t offset = 0;
  for (const ReduceScatterItem& item : items) {
    const float* grad = Floats(item.grad);
    const int64_t shard = item.shard_elements, numel = item.grad.NumElements();
    for (int r = 0; r < world; ++r) {
      const int64_t begin = r * shard;
      const int64_t count = std::max<int64_t>(0, std::min(shard, numel - begin));
      float* chunk = packed + r * packed_elements + offset;
      std::copy(grad + begin, grad + begin + count, chunk);
      std::fill(chunk + count, chunk + shard, 0.0f);  // the padding past the grad's end
    }
    offset += shard;
  }
  DC_RETURN_IF_ERROR(reduce->Run());
  const float* reduced = reduce->output();
  offset = 0;
  for (const ReduceScatterItem& item : items) {
    float* accumulator = Floats(item.shard);
    for (int64_t i = 0; i < item.shard_elements; ++i) accumulator[i] += reduced[offset + i];
    offset += item.shard_elements;
  }
  return Status::Ok();
}

// Summed in double over the ranks (Gloo's order, the same on every rank), then rounded once.
Status AllReduceSumNow(Communicator* comm, float* values, int64_t count) {
  std::vector<double> sums(values, values + count);
  DC_RETURN_IF_ERROR(comm->AllReduceSum(sums.data(), count));
  for (int64_t i = 0; i < count; ++i) values[i] = static_cast<float>(sums[i]);
  return Status::Ok();
}

int64_t SteadyNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// One rank's host as a device with streams. The issuing thread (the interpreter's) enqueues work
// on a stream's FIFO and returns; the stream's worker thread runs it in order. Cross-stream order
// comes from events: Record enqueues "signal event i of this step", Wait enqueues "block until
// event d of this step is signalled" (STREAM_HOST: the issuing thread blocks). An event is the
// generation (1 + finished steps) it was last signalled in, so step s's signal never satisfies
// step s + 1's wait. The first error of any stream is kept: later work is dropped, waits end,
// and every later call (or the step's end) returns it. Abort ends everything queued and closes
// the streams' communicator channels, which wakes a collective waiting on a peer.
//
// Threads: the RankDevice calls come from one thread (the interpreter's); everything the
// workers share with it is under `mu_`, or is a buffer the plan's order keeps from being used
// by two streams at once.
class CpuDevice : public RankDevice {
 public:
  CpuDevice(Communicator* comm, int num_threads, const CpuDeviceOptions& options,
            ExecutionTracer* tracer)
      : comm_(comm),
        world_(comm->world_size()),
        num_threads_(num_threads),
        options_(options),
        tracer_(tracer),
        serial_(RunsSerially(options, comm)) {
    if (serial_) return;
    for (int s = 0; s < kNumDeviceStreams; ++s) {
      streams_[s].jitter.seed(options_.jitter_seed * kNumDeviceStreams + s);
      try {
        streams_[s].thread = std::thread([this, s] { Loop(s); });
      } catch (const std::system_error& e) {  // a process or thread limit
        started_ =
            Status::Error("rank " + Rank() + ": could not start the cpu device's stream threads (" +
                          e.what() + "); raise the process limit or set DC_CPU_STREAMS=serial");
        return;
      }
    }
  }

  // Whether the constructor started every stream's thread.
  const Status& started() const { return started_; }

  ~CpuDevice() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    for (StreamState& s : streams_) s.ready.notify_all();
    for (StreamState& s : streams_) {
      if (s.thread.joinable()) s.thread.join();
    }
    // Work left queued (a failed run) holds posted collectives, which report to this device.
    for (StreamState& s : streams_) s.queue.clear();
  }

  proto::DType StorageDType(proto::DType dtype) const override {
    return dtype == proto::DTYPE_I32 ? proto::DTYPE_I32 : proto::DTYPE_F32;
  }

  Status Prepare(const proto::Schedule& schedule, const ScheduleLayout& /*layout*/) override {
    schedule_ = &schedule;
    std::lock_guard<std::mutex> lock(mu_);
    signalled_.assign(schedule.instructions_size(), 0);
    ran_.assign(schedule.instructions_size(), {-1, -1});
    return Status::Ok();
  }

  Status CreateArena(int64_t bytes) override {
    arena_.assign(static_cast<size_t>(bytes), std::byte{0});
    return Status::Ok();
  }

  // New buffers are not zeroed (see the header); poisoned in a test, in stream order for the
  // arena's bytes, which another stream's earlier user may still read until the plan's waits on
  // `stream` are met.
  StatusOr<void*> Allocate(int64_t arena_offset_bytes, int64_t bytes, proto::Stream stream,
                           const std::string& what, const std::string& /*tensor*/) override {
    DC_RETURN_IF_ERROR(Failed());
    if (arena_offset_bytes >= 0) {
      std::byte* place = arena_.data() + arena_offset_bytes;
      if (options_.poison_new_buffers) {
        DC_RETURN_IF_ERROR(Enqueue(stream, what, [place, bytes] {
          FillNaN(place, bytes);
          return Status::Ok();
        }));
      }
      return static_cast<void*>(place);
    }
    auto storage = std::make_unique_for_overwrite<std::byte[]>(
        static_cast<size_t>(std::max<int64_t>(bytes, 1)));
    void* data = storage.get();
    if (options_.poison_new_buffers) FillNaN(data, bytes);
    std::lock_guard<std::mutex> lock(owned_mu_);
    owned_.emplace(data, std::move(storage));
    return data;
  }

  // Stream-ordered, as cudaFreeAsync: the stream's earlier work (and what it waited for) may
  // still read the buffer.
  Status Free(void* data, proto::Stream stream, const std::string& what,
              const std::string& /*tensor*/) override {
    return Enqueue(stream, what, [this, data] {
      std::lock_guard<std::mutex> lock(owned_mu_);
      owned_.erase(data);
      return Status::Ok();
    });
  }

  StatusOr<std::unique_ptr<HostBuffer>> AllocateHost(int64_t bytes,
                                                     const std::string& /*what*/) override {
    return std::unique_ptr<HostBuffer>(new CpuHostBuffer(bytes));
  }

  Status CopyToDevice(void* device, const void* host, int64_t bytes, proto::Stream stream,
                      const std::string& what) override {
    return CopyOn(device, host, bytes, stream, what);
  }
  Status CopyToHost(void* host, const void* device, int64_t bytes, proto::Stream stream,
                    const std::string& what) override {
    return CopyOn(host, device, bytes, stream, what);
  }
  Status CopyOnDevice(void* to, const void* from, int64_t bytes, proto::Stream stream,
                      const std::string& what) override {
    return CopyOn(to, from, bytes, stream, what);
  }
  // The shards are host memory already, and every stream is idle between steps: a snapshot is
  // a memcpy on the calling thread, done when it returns.
  Status SnapshotToHost(void* host, const void* device, int64_t bytes,
                        const std::string& what) override {
    return CopyOn(host, device, bytes, proto::STREAM_HOST, what);
  }
  StatusOr<std::function<Status()>> EndSnapshot(const std::string&) override {
    return std::function<Status()>([] { return Status::Ok(); });
  }
  Status WaitForSnapshot(proto::Stream, const std::string&) override { return Status::Ok(); }
  Status Zero(void* device, int64_t bytes, proto::Stream stream, const std::string& what) override {
    return Enqueue(stream, what, [device, bytes] {
      Fill0(device, bytes);
      return Status::Ok();
    });
  }

  Status Cast(const DeviceTensor& from, const DeviceTensor& to, proto::Stream stream,
              const std::string& what) override {
    // Every float is stored in fp32 here, so a cast is a copy.
    if (from.dtype != to.dtype || from.NumElements() != to.NumElements()) {
      return Status::Error(what + ": the cpu backend casts only between equal fp32 buffers");
    }
    return CopyOn(to.data, from.data, from.SizeBytes(), stream, what);
  }

  Status AllGather(std::span<const GatherItem> items, proto::Stream stream,
                   const std::string& what) override {
    int64_t packed_elements = 0;
    for (const GatherItem& item : items) packed_elements += item.shard_elements;
    Communicator* comm = ChannelOf(stream);
    DC_ASSIGN_OR_RETURN(std::shared_ptr<Posted> posted, Post(stream, packed_elements, [&] {
                          return comm->PostAllGather(packed_elements);
                        }));
    return Enqueue(
        stream, what,
        [posted, world = world_, items = std::vector<GatherItem>(items.begin(), items.end())] {
          return AllGatherNow(posted ? posted->collective.get() : nullptr, world, items);
        });
  }

  Status ReduceScatterAdd(std::span<const ReduceScatterItem> items, proto::Stream stream,
                          const std::string& what) override {
    int64_t packed_elements = 0;
    for (const ReduceScatterItem& item : items) packed_elements += item.shard_elements;
    Communicator* comm = ChannelOf(stream);
    DC_ASSIGN_OR_RETURN(std::shared_ptr<Posted> posted, Post(stream, packed_elements, [&] {
                          return comm->PostReduceScatterSum(packed_elements);
                        }));
    return Enqueue(stream, what,
                   [posted, world = world_,
                    items = std::vector<ReduceScatterItem>(items.begin(), items.end())] {
                     return ReduceScatterAddNow(posted ? posted->collective.get() : nullptr, world,
                                                items);
                   });
  }

  Status AllReduceSum(const DeviceTensor& values, proto::Stream stream,
                      const std::string& what) override {
    if (world_ == 1) return Status::Ok();
    Communicator* comm = ChannelOf(stream);
    return Enqueue(stream, what, [comm, data = Floats(values), count = values.NumElements()] {
      return AllReduceSumNow(comm, data, count);
    });
  }

  Status RunOp(const proto::Op& op, std::span<DeviceTensor> inputs, std::span<DeviceTensor> outputs,
               const OpArgs& args) override {
    std::vector<TensorRef> in, out;
    for (const DeviceTensor& t : inputs) in.push_back(RefOf(t));
    for (const DeviceTensor& t : outputs) out.push_back(RefOf(t));
    // Named by instruction only on failure: the message is made then.
    return Enqueue(proto::STREAM_COMPUTE, "",
                   [&op, in = std::move(in), out = std::move(out),
                    context = CpuKernelContext(args, num_threads_)]() mutable {
                     return RunCpuOp(op, in, out, context);
                   });
  }

  Status AddLoss(const DeviceTensor& term) override {
    const float* value = Floats(term);
    return Enqueue(proto::STREAM_COMPUTE, "summing the loss", [this, value] {
      loss_sum_ += value[0];  // the compute stream's alone until the step's end
      return Status::Ok();
    });
  }

  Status Record(int index, proto::Stream stream) override {
    if (serial_) return Failed();
    return Push(stream, {Work::kSignal, index, generation_, {}, {}});
  }

  Status Wait(int index, int dep, proto::Stream stream) override {
    issuing_ = index;
    if (serial_) return Failed();
    if (stream != proto::STREAM_HOST) return Push(stream, {Work::kWait, dep, generation_, {}, {}});
    std::unique_lock<std::mutex> lock(mu_);
    signal_.wait(lock, [&] { return failed_ || signalled_[dep] >= generation_; });
    return Kept();
  }

  // Closes the instruction's span of work on its stream, for the trace.
  Status AfterInstruction(int index, proto::Stream stream) override {
    issuing_ = index + 1;
    if (serial_ || tracer_ == nullptr || stream == proto::STREAM_HOST) return Failed();
    return Push(stream, {Work::kEnd, index, generation_, {}, {}});
  }

  // The step's end is the only join the interpreter asks for: the issuing thread waits.
  Status JoinStreams(const std::string& what) override { return Drain(what); }

  StatusOr<double> FinishStep(int step) override {
    DC_RETURN_IF_ERROR(Drain("the end of step " + std::to_string(step)));
    std::vector<std::pair<int64_t, int64_t>> ran;
    {
      std::lock_guard<std::mutex> lock(mu_);
      ran.swap(ran_);
      ran_.assign(ran.size(), {-1, -1});
      for (StreamState& s : streams_) s.open_ns = -1;  // the step's end's own work
    }
    if (tracer_ != nullptr) {
      // The tracer's clock, from the steady clock the workers read.
      const int64_t offset_ns = tracer_->NowNs() - SteadyNs();
      for (size_t i = 0; i < ran.size(); ++i) {
        if (ran[i].first < 0) continue;
        const InstructionRef ref{step, schedule_->instructions(static_cast<int>(i)).micro_step(),
                                 static_cast<int>(i)};
        tracer_->InstructionRan(ref, ran[i].first + offset_ns, ran[i].second + offset_ns);
      }
    }
    ++generation_;
    issuing_ = 0;
    const double sum = loss_sum_;
    loss_sum_ = 0;
    return sum;
  }

  Status Synchronize(const std::string& what) override { return Drain(what); }

  void Abort() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!failed_) error_ = Status::Error("the run was aborted on rank " + Rank());
      failed_ = true;
      for (StreamState& s : streams_) s.queue.clear();
    }
    FailPosting();
    signal_.notify_all();
    if (world_ > 1) {
      for (int c = 1; c < std::min(comm_->channels(), kCpuDeviceChannels); ++c) {
        comm_->channel(c)->Abort();
      }
    }
  }

 private:
  struct Work {
    enum Kind { kRun, kSignal, kWait, kEnd };
    Kind kind = kRun;
    int instruction = -1;  // kRun: the one being issued; kSignal, kEnd: its own; kWait: the dep
    int64_t generation = 0;
    std::string what;  // kRun: names the work in an error ("" = by its instruction)
    std::function<Status()> run;
  };
  struct StreamState {
    std::thread thread;
    std::deque<Work> queue;  // under mu_
    bool busy = false;       // under mu_: an item taken and not finished
    std::condition_variable ready;
    std::mt19937_64 jitter;  // the worker's own
    int64_t open_ns = -1;    // under mu_: start of the current instruction's work
  };

  // A collective made (its receives posted) on the issuing thread ahead of its stream's run;
  // gone, it lets the issuing thread make the next. A peer then reaches a collective after
  // this rank posted it (unless this rank's issuing thread is itself behind). Each stream keeps
  // at most kPostedAhead, and at most kPostedAheadBytes of their payload (one larger than that
  // is made when nothing else is): the buffers in flight stay bounded. While the issuing thread
  // waits for a place, no later instruction of any stream is issued, so the limits are wide:
  // with two places, `small` on two ranks issued its compute behind the reduce-scatters and the
  // compute stream sat idle 12-14 ms a step, its work not yet issued (the step 1.5-6% slower).
  // (16 places were not enough for DeepCompile's plan there: 53 collectives a step.) Waiting
  // for a place cannot deadlock: a plan's waits point to earlier instructions, so a
  // stream's oldest collective depends only on work every rank has issued already; it runs, and
  // its place frees.
  static constexpr int kPostedAhead = 64;
  static constexpr int64_t kPostedAheadBytes = int64_t{256} << 20;
  struct Posted {
    Posted(CpuDevice* device, int slot, int64_t bytes) : device(device), slot(slot), bytes(bytes) {}
    ~Posted() { device->PostedDone(slot, bytes); }
    CpuDevice* device;
    int slot;
    int64_t bytes;
    std::unique_ptr<PostedCollective> collective;
  };

  // `packed_elements`: a rank's share of the collective. Its payload, for kPostedAheadBytes, is
  // what the ring's buffers hold: a share and the whole (an all-gather's input and output, a
  // reduce-scatter's output and input).
  template <typename Make>
  StatusOr<std::shared_ptr<Posted>> Post(proto::Stream stream, int64_t packed_elements,
                                         Make&& make) {
    if (world_ == 1) return std::shared_ptr<Posted>();  // copies, no collective (AllGatherNow)
    const int64_t bytes = packed_elements * (world_ + 1) * static_cast<int64_t>(sizeof(float));
    // The host's collectives run on the issuing thread, each before the next is made.
    const int slot = stream == proto::STREAM_HOST
                         ? kNumDeviceStreams
                         : std::clamp(DeviceStreamIndex(stream), 0, kNumDeviceStreams - 1);
    {
      std::unique_lock<std::mutex> lock(posted_mu_);
      posted_cv_.wait(lock, [&] {
        return posted_failed_ || posted_[slot] == 0 ||
               (posted_[slot] < kPostedAhead && posted_bytes_[slot] + bytes <= kPostedAheadBytes);
      });
      if (posted_failed_) {
        Status kept = Failed();
        return kept.ok() ? Status::Error("the run was aborted on rank " + Rank()) : kept;
      }
      ++posted_[slot];
      posted_bytes_[slot] += bytes;
    }
    auto posted = std::make_shared<Posted>(this, slot, bytes);
    DC_ASSIGN_OR_RETURN(posted->collective, make());
    return posted;
  }
  void PostedDone(int slot, int64_t bytes) {
    {
      std::lock_guard<std::mutex> lock(posted_mu_);
      --posted_[slot];
      posted_bytes_[slot] -= bytes;
    }
    posted_cv_.notify_all();
  }
  // Wakes an issuing thread waiting to post: the run has failed.
  void FailPosting() {
    {
      std::lock_guard<std::mutex> lock(posted_mu_);
      posted_failed_ = true;
    }
    posted_cv_.notify_all();
  }

  std::string Rank() const { return std::to_string(comm_->rank()); }

  Communicator* ChannelOf(proto::Stream stream) {
    if (world_ == 1 || stream == proto::STREAM_HOST) return comm_;
    const int c = 1 + DeviceStreamIndex(stream);
    return comm_->channels() > c ? comm_->channel(c) : comm_;
  }

  // The kept error, for a call of the issuing thread (which names its own instruction first).
  Status Failed() {
    if (serial_) return Status::Ok();
    std::lock_guard<std::mutex> lock(mu_);
    return Kept();
  }
  Status Kept() const {  // under mu_
    if (!failed_) return Status::Ok();
    return Status::Error("earlier work failed on another thread: " + error_.message());
  }

  Status CopyOn(void* to, const void* from, int64_t bytes, proto::Stream stream,
                const std::string& what) {
    return Enqueue(stream, what, [to, from, bytes] {
      Copy(to, from, bytes);
      return Status::Ok();
    });
  }

  // Runs `run` on `stream` after the stream's earlier work, or at once in serial mode or on the
  // host.
  Status Enqueue(proto::Stream stream, const std::string& what, std::function<Status()> run) {
    if (serial_ || stream == proto::STREAM_HOST) {
      DC_RETURN_IF_ERROR(Failed());
      return run();  // the caller names its instruction
    }
    return Push(stream, {Work::kRun, issuing_, generation_, what, std::move(run)});
  }

  Status Push(proto::Stream stream, Work work) {
    const int s = DeviceStreamIndex(stream);
    if (s < 0 || s >= kNumDeviceStreams) {
      return Status::Error(Describe(issuing_) + ": the cpu device has no stream " +
                           std::to_string(static_cast<int>(stream)) + " (an executor bug)");
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (failed_) return Kept();
      streams_[s].queue.push_back(std::move(work));
    }
    streams_[s].ready.notify_one();
    return Status::Ok();
  }

  std::string Describe(int index) const {
    if (schedule_ == nullptr || index < 0 || index >= schedule_->instructions_size()) {
      return "rank " + Rank() + " outside any instruction";
    }
    return DescribeInstruction(*schedule_, index, comm_->rank());
  }

  // Waits until every stream has run all it was given (or the run failed).
  Status Drain(const std::string& what) {
    if (serial_) return Status::Ok();
    std::unique_lock<std::mutex> lock(mu_);
    signal_.wait(lock, [&] {
      for (const StreamState& s : streams_) {
        if (s.busy || (!s.queue.empty() && !failed_)) return false;
      }
      return true;
    });
    if (!failed_) return Status::Ok();
    return Status::Error(what + " on rank " + Rank() + ": " + error_.message());
  }

  void Loop(int index) {
    StreamState& stream = streams_[index];
    std::uniform_int_distribution<int64_t> jitter_ns(0,
                                                     std::max<int64_t>(options_.jitter_max_ns, 0));
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      stream.ready.wait(lock, [&] { return stop_ || !stream.queue.empty(); });
      if (stream.queue.empty()) return;  // stopped with nothing left
      Work work = std::move(stream.queue.front());
      stream.queue.pop_front();
      stream.busy = true;
      if (options_.jitter_seed != 0) {
        lock.unlock();
        std::this_thread::sleep_for(std::chrono::nanoseconds(jitter_ns(stream.jitter)));
        lock.lock();
      }
      Status status;
      if (failed_) {
        // Dropped: the run has failed.
      } else if (work.kind == Work::kSignal) {
        signalled_[work.instruction] = work.generation;
      } else if (work.kind == Work::kWait) {
        signal_.wait(lock,
                     [&] { return failed_ || signalled_[work.instruction] >= work.generation; });
      } else if (work.kind == Work::kEnd) {
        if (stream.open_ns >= 0) ran_[work.instruction] = {stream.open_ns, SteadyNs()};
        stream.open_ns = -1;
      } else {
        if (stream.open_ns < 0) stream.open_ns = SteadyNs();
        lock.unlock();
        status = work.run();
        if (!status.ok()) {
          status = work.what.empty() ? status.Prefixed(Describe(work.instruction) + ": ")
                                     : status.Prefixed(work.what + ": ");
        }
        work.run = nullptr;  // its captures go before the stream reads as idle
        lock.lock();
      }
      bool wake = work.kind == Work::kSignal;  // an event another thread may wait on
      if (!status.ok() && !failed_) {
        error_ = status;
        failed_ = true;
        wake = true;
        FailPosting();
      }
      stream.busy = false;
      // Only an event, a failure or an idle stream (what Drain waits for) can end a wait: each
      // needless wake-up of the other streams costs a context switch per item.
      if (wake || stream.queue.empty()) signal_.notify_all();
    }
  }

  Communicator* comm_;
  const int world_;
  const int num_threads_;
  const CpuDeviceOptions options_;
  ExecutionTracer* tracer_;
  const bool serial_;
  const proto::Schedule* schedule_ = nullptr;
  Status started_;

  std::vector<std::byte> arena_;
  std::mutex owned_mu_;
  std::map<void*, std::unique_ptr<std::byte[]>> owned_;  // under owned_mu_
  double loss_sum_ = 0;

  // The issuing thread's own.
  int issuing_ = 0;         // the instruction being issued (for naming errors)
  int64_t generation_ = 1;  // 1 + the steps finished
  std::mutex posted_mu_;    // after mu_ where both are taken
  std::condition_variable posted_cv_;
  std::array<int, kNumDeviceStreams + 1> posted_{};  // under posted_mu_: by stream, then the host
  std::array<int64_t, kNumDeviceStreams + 1> posted_bytes_{};  // under posted_mu_: their payload
  bool posted_failed_ = false;                                 // under posted_mu_
  std::mutex mu_;
  std::condition_variable signal_;  // an event signalled, an item done, a failure
  std::array<StreamState, kNumDeviceStreams> streams_;
  std::vector<int64_t> signalled_;  // by instruction: the generation of its last signal
  // By instruction: when its work ran this step (steady clock), for the tracer.
  std::vector<std::pair<int64_t, int64_t>> ran_;
  Status error_;
  bool failed_ = false;
  bool stop_ = false;
};

}  // namespace

StatusOr<CpuDeviceOptions> CpuDeviceOptionsFromEnv() {
  CpuDeviceOptions options;
  if (const char* poison = std::getenv("DC_CPU_POISON"); poison != nullptr) {
    const std::string text = poison;
    if (text != "0" && text != "1" && !text.empty()) {
      return Status::Error("DC_CPU_POISON=" + text + ": takes 1 (poison new buffers) or 0");
    }
    options.poison_new_buffers = text == "1";
  }
  const char* value = std::getenv("DC_CPU_STREAMS");
  if (value == nullptr) return options;
  const std::string text = value;
  const std::string jitter = "jitter:";
  if (text.empty() || text == "auto") return options;
  if (text == "threads") {
    options.streams = CpuStreams::kThreads;
    return options;
  }
  if (text == "serial") {
    options.streams = CpuStreams::kSerial;
    return options;
  }
  if (text.rfind(jitter, 0) == 0) {
    char* end = nullptr;
    options.jitter_seed = std::strtoull(text.c_str() + jitter.size(), &end, 10);
    options.streams = CpuStreams::kThreads;
    if (end != nullptr && *end == '\0' && options.jitter_seed != 0) return options;
  }
  return Status::Error("DC_CPU_STREAMS=" + text +
                       ": takes auto (the default: threads when there are peers), threads, "
                       "serial, or jitter:<seed> (a seed > 0)");
}

KernelContext CpuKernelContext(const OpArgs& args, int num_threads) {
  KernelContext context;
  context.config = args.config;
  context.grad_scale = args.grad_scale;
  context.adam_step = args.adam_step;
  context.lr_scale = args.lr_scale;
  context.num_threads = num_threads;
  return context;
}

StatusOr<std::unique_ptr<RankDevice>> MakeCpuDevice(Communicator* comm, int num_threads,
                                                    const CpuDeviceOptions& options,
                                                    ExecutionTracer* tracer) {
  auto device = std::make_unique<CpuDevice>(comm, num_threads, options, tracer);
  if (!device->started().ok()) return device->started();
  return std::unique_ptr<RankDevice>(std::move(device));
}

}  // namespace dc
