#include "executor/cpu_device.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <vector>

#include "executor/cpu_kernels.h"

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

class CpuDevice : public RankDevice {
 public:
  CpuDevice(Communicator* comm, int num_threads) : comm_(comm), num_threads_(num_threads) {}

  proto::DType StorageDType(proto::DType dtype) const override {
    return dtype == proto::DTYPE_I32 ? proto::DTYPE_I32 : proto::DTYPE_F32;
  }

  Status Prepare(const proto::Schedule& /*schedule*/, const ScheduleLayout& /*layout*/) override {
    return Status::Ok();
  }

  Status CreateArena(int64_t bytes) override {
    arena_.assign(static_cast<size_t>(bytes), std::byte{0});
    return Status::Ok();
  }

  StatusOr<void*> Allocate(int64_t arena_offset_bytes, int64_t bytes, proto::Stream /*stream*/,
                           const std::string& /*what*/, const std::string& /*tensor*/) override {
    if (arena_offset_bytes >= 0) {
      std::byte* place = arena_.data() + arena_offset_bytes;
      std::memset(place, 0, static_cast<size_t>(bytes));
      return static_cast<void*>(place);
    }
    auto storage = std::make_unique<std::byte[]>(static_cast<size_t>(std::max<int64_t>(bytes, 1)));
    void* data = storage.get();
    owned_.emplace(data, std::move(storage));
    return data;
  }

  Status Free(void* data, proto::Stream /*stream*/, const std::string& /*what*/,
              const std::string& /*tensor*/) override {
    owned_.erase(data);
    return Status::Ok();
  }

  StatusOr<std::unique_ptr<HostBuffer>> AllocateHost(int64_t bytes,
                                                     const std::string& /*what*/) override {
    return std::unique_ptr<HostBuffer>(new CpuHostBuffer(bytes));
  }

  Status CopyToDevice(void* device, const void* host, int64_t bytes, proto::Stream /*stream*/,
                      const std::string& /*what*/) override {
    Copy(device, host, bytes);
    return Status::Ok();
  }
  Status CopyToHost(void* host, const void* device, int64_t bytes, proto::Stream /*stream*/,
                    const std::string& /*what*/) override {
    Copy(host, device, bytes);
    return Status::Ok();
  }
  Status CopyOnDevice(void* to, const void* from, int64_t bytes, proto::Stream /*stream*/,
                      const std::string& /*what*/) override {
    Copy(to, from, bytes);
    return Status::Ok();
  }
  Status Zero(void* device, int64_t bytes, proto::Stream /*stream*/,
              const std::string& /*what*/) override {
    if (bytes > 0) std::memset(device, 0, static_cast<size_t>(bytes));
    return Status::Ok();
  }

  Status Cast(const DeviceTensor& from, const DeviceTensor& to, proto::Stream /*stream*/,
              const std::string& what) override {
    // Every float is stored in fp32 here, so a cast is a copy.
    if (from.dtype != to.dtype || from.NumElements() != to.NumElements()) {
      return Status::Error(what + ": the cpu backend casts only between equal fp32 buffers");
    }
    Copy(to.data, from.data, from.SizeBytes());
    return Status::Ok();
  }

  // The shards are packed side by side, gathered once, and each rank's chunk unpacked into the
  // whole params.
  Status AllGather(std::span<const GatherItem> items, proto::Stream /*stream*/,
                   const std::string& /*what*/) override {
    const int world = comm_->world_size();
    int64_t packed_elements = 0;
    for (const GatherItem& item : items) packed_elements += item.shard_elements;
    std::vector<float> packed(packed_elements), gathered(packed_elements * world);
    int64_t offset = 0;
    for (const GatherItem& item : items) {
      const float* shard = Floats(item.shard);
      std::copy(shard, shard + item.shard_elements, packed.begin() + offset);
      offset += item.shard_elements;
    }
    DC_RETURN_IF_ERROR(comm_->AllGather(packed.data(), packed_elements, gathered.data()));
    offset = 0;
    for (const GatherItem& item : items) {
      const int64_t shard = item.shard_elements, numel = item.whole.NumElements();
      float* whole = Floats(item.whole);
      for (int r = 0; r < world; ++r) {
        const int64_t begin = r * shard;
        const int64_t count = std::max<int64_t>(0, std::min(shard, numel - begin));
        const float* chunk = gathered.data() + r * packed_elements + offset;
        std::copy(chunk, chunk + count, whole + begin);
      }
      offset += shard;
    }
    return Status::Ok();
  }

  // Rank r's chunk of the packed buffer holds rank r's slice of every grad, side by side.
  Status ReduceScatterAdd(std::span<const ReduceScatterItem> items, proto::Stream /*stream*/,
                          const std::string& /*what*/) override {
    const int world = comm_->world_size();
    int64_t packed_elements = 0;
    for (const ReduceScatterItem& item : items) packed_elements += item.shard_elements;
    std::vector<float> packed(packed_elements * world, 0.0f), reduced(packed_elements);
    int64_t offset = 0;
    for (const ReduceScatterItem& item : items) {
      const float* grad = Floats(item.grad);
      const int64_t shard = item.shard_elements, numel = item.grad.NumElements();
      for (int r = 0; r < world; ++r) {
        const int64_t begin = r * shard;
        const int64_t count = std::max<int64_t>(0, std::min(shard, numel - begin));
        std::copy(grad + begin, grad + begin + count,
                  packed.begin() + r * packed_elements + offset);
      }
      offset += shard;
    }
    DC_RETURN_IF_ERROR(comm_->ReduceScatterSum(packed.data(), packed_elements, reduced.data()));
    offset = 0;
    for (const ReduceScatterItem& item : items) {
      float* accumulator = Floats(item.shard);
      for (int64_t i = 0; i < item.shard_elements; ++i) accumulator[i] += reduced[offset + i];
      offset += item.shard_elements;
    }
    return Status::Ok();
  }

  Status RunOp(const proto::Op& op, std::span<DeviceTensor> inputs, std::span<DeviceTensor> outputs,
               const OpArgs& args) override {
    std::vector<TensorRef> in, out;
    for (const DeviceTensor& t : inputs) in.push_back(RefOf(t));
    for (const DeviceTensor& t : outputs) out.push_back(RefOf(t));
    return RunCpuOp(op, in, out, CpuKernelContext(args, num_threads_));
  }

  Status AddLoss(const DeviceTensor& term) override {
    loss_sum_ += Floats(term)[0];
    return Status::Ok();
  }

  Status Record(int /*index*/, proto::Stream /*stream*/) override { return Status::Ok(); }
  Status Wait(int /*index*/, int /*dep*/, proto::Stream /*stream*/) override {
    return Status::Ok();
  }
  Status AfterInstruction(int /*index*/, proto::Stream /*stream*/) override { return Status::Ok(); }
  Status JoinStreams(const std::string& /*what*/) override { return Status::Ok(); }

  StatusOr<double> FinishStep(int /*step*/) override {
    const double sum = loss_sum_;
    loss_sum_ = 0;
    return sum;
  }

  Status Synchronize(const std::string& /*what*/) override { return Status::Ok(); }
  // Nothing waits on the device: a rank that returns closes its Gloo pairs, which ends its
  // peers' collectives.
  void Abort() override {}

 private:
  Communicator* comm_;
  const int num_threads_;
  std::vector<std::byte> arena_;
  std::map<void*, std::unique_ptr<std::byte[]>> owned_;
  double loss_sum_ = 0;
};

}  // namespace

KernelContext CpuKernelContext(const OpArgs& args, int num_threads) {
  KernelContext context;
  context.config = args.config;
  context.grad_scale = args.grad_scale;
  context.adam_step = args.adam_step;
  context.lr_scale = args.lr_scale;
  context.num_threads = num_threads;
  return context;
}

std::unique_ptr<RankDevice> MakeCpuDevice(Communicator* comm, int num_threads) {
  return std::make_unique<CpuDevice>(comm, num_threads);
}

}  // namespace dc
