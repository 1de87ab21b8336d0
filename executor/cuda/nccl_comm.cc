#include "executor/cuda/nccl_comm.h"

#include <nccl.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>
#include <utility>
#include <vector>

#include "executor/cuda/cuda_device.h"
#include "executor/tcp_store.h"

namespace dc {

namespace {

using Clock = std::chrono::steady_clock;

// How often a waiting rank looks at the device and at NCCL's error state. Short: collectives
// are often sub-millisecond and the host thread has nothing else to do while it waits.
constexpr auto kCompletionPollInterval = std::chrono::microseconds(20);
// How often a rank > 0 looks for rank 0's id file.
constexpr auto kIdPollInterval = std::chrono::milliseconds(10);
// The id file's name inside the rendezvous directory.
constexpr char kIdFileName[] = "nccl-id";

std::string Seconds(std::chrono::milliseconds timeout) {
  const double s = static_cast<double>(timeout.count()) / 1000.0;
  std::string text = std::to_string(s);
  text.erase(text.find_last_not_of('0') + 1);
  if (!text.empty() && text.back() == '.') text.pop_back();
  return text + " s";
}

std::string RankPrefix(int rank) { return "rank " + std::to_string(rank) + ": "; }

bool ToNcclType(proto::DType dtype, ncclDataType_t* type) {
  switch (dtype) {
    case proto::DTYPE_F32:
      *type = ncclFloat32;
      return true;
    case proto::DTYPE_BF16:
      *type = ncclBfloat16;
      return true;
    case proto::DTYPE_F16:
      *type = ncclFloat16;
      return true;
    case proto::DTYPE_I32:
      *type = ncclInt32;
      return true;
    default:
      return false;
  }
}

Status WriteId(const std::string& path, const ncclUniqueId& id, int rank) {
  std::error_code ec;
  std::filesystem::create_directories(std::filesystem::path(path).parent_path(), ec);
  const std::string temp = path + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream out(temp, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(&id), sizeof(id));
    out.close();
    if (!out) {
      return Status::Error(RankPrefix(rank) + "cannot write the NCCL id to " + temp +
                           "; is the rendezvous directory writable?");
    }
  }
  std::filesystem::rename(temp, path, ec);
  if (ec) {
    return Status::Error(RankPrefix(rank) + "cannot rename " + temp + " to " + path + ": " +
                         ec.message());
  }
  return Status::Ok();
}

StatusOr<ncclUniqueId> ReadId(const std::string& path, int rank,
                              std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (true) {
    std::error_code ec;
    if (std::filesystem::file_size(path, ec) == sizeof(ncclUniqueId) && !ec) {
      ncclUniqueId id;
      std::ifstream in(path, std::ios::binary);
      in.read(reinterpret_cast<char*>(&id), sizeof(id));
      if (in.gcount() == static_cast<std::streamsize>(sizeof(id))) return id;
    }
    if (Clock::now() >= deadline) {
      return Status::Error(RankPrefix(rank) + "no NCCL id at " + path + " after " +
                           Seconds(timeout) +
                           "; is rank 0 running with the same rendezvous directory? (could not "
                           "meet rank 0)");
    }
    std::this_thread::sleep_for(kIdPollInterval);
  }
}

}  // namespace

struct NcclCommunicator::State {
  ncclComm_t comm = nullptr;
  cudaEvent_t done = nullptr;  // recorded on the stream by Synchronize
  DeviceBuffer scratch;        // device side of the host-value collectives
  PinnedHostBuffer staging;    // host side

  std::string LastError() const {
    const char* text = comm != nullptr ? ncclGetLastError(comm) : nullptr;
    return text != nullptr && *text != '\0' ? std::string(" (") + text + ")" : std::string();
  }
};

std::string NcclIdPath(const RendezvousOptions& options) {
  return (std::filesystem::path(options.store_dir) / kIdFileName).string();
}

NcclCommunicator::NcclCommunicator(int rank, int world_size, cudaStream_t stream,
                                   std::chrono::milliseconds timeout, std::unique_ptr<State> state)
    : rank_(rank),
      world_size_(world_size),
      stream_(stream),
      timeout_(timeout),
      state_(std::move(state)) {}

NcclCommunicator::~NcclCommunicator() {
  if (state_->comm != nullptr) {
    bool clean = false;
    if (!aborted_) {
      // Finalize flushes outstanding work; on a non-blocking communicator it completes
      // asynchronously, so wait for it within the timeout before destroying.
      ncclResult_t r = ncclCommFinalize(state_->comm);
      if (r == ncclSuccess || r == ncclInProgress) clean = WaitNotInProgress("finalize").ok();
    }
    if (clean && !aborted_) {
      (void)ncclCommDestroy(state_->comm);
    } else if (!aborted_) {
      (void)ncclCommAbort(state_->comm);
    }
  }
  if (state_->done != nullptr) (void)cudaEventDestroy(state_->done);
}

Status NcclCommunicator::CheckUsable(const std::string& what) const {
  if (aborted_) {
    return Status::Error(RankPrefix(rank_) + what +
                         ": the NCCL communicator was aborted after an earlier failure");
  }
  return Status::Ok();
}

Status NcclCommunicator::Fail(const std::string& what, const std::string& why) {
  const std::string detail = state_->LastError();
  if (!aborted_ && state_->comm != nullptr) {
    (void)ncclCommAbort(state_->comm);
    aborted_ = true;
  }
  return Status::Error(RankPrefix(rank_) + what + ": " + why + detail +
                       "; NCCL communicator aborted");
}

Status NcclCommunicator::WaitNotInProgress(const std::string& what) {
  const auto deadline = Clock::now() + timeout_;
  while (true) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t r = ncclCommGetAsyncError(state_->comm, &state);
    if (r != ncclSuccess) {
      return Fail(what, std::string("ncclCommGetAsyncError failed: ") + ncclGetErrorString(r));
    }
    if (state == ncclSuccess) return Status::Ok();
    if (state != ncclInProgress) return Fail(what, ncclGetErrorString(state));
    if (Clock::now() >= deadline) {
      return Fail(what, "NCCL did not finish the call within " + Seconds(timeout_) +
                            "; a peer rank is gone or hung");
    }
    std::this_thread::sleep_for(kCompletionPollInterval);
  }
}

template <typename Fn>
Status NcclCommunicator::Call(const std::string& what, Fn&& fn) {
  DC_RETURN_IF_ERROR(CheckUsable(what));
  const ncclResult_t r = fn();
  if (r == ncclSuccess) return Status::Ok();
  if (r == ncclInProgress) return WaitNotInProgress(what);
  return Fail(what, ncclGetErrorString(r));
}

void NcclCommunicator::Abort() {
  if (!aborted_ && state_->comm != nullptr) {
    (void)ncclCommAbort(state_->comm);
    aborted_ = true;
  }
}

Status NcclCommunicator::Synchronize(const std::string& what) { return Synchronize(stream_, what); }

Status NcclCommunicator::Synchronize(cudaStream_t stream, const std::string& what) {
  DC_RETURN_IF_ERROR(CheckUsable(what));
  DC_RETURN_IF_ERROR(
      CudaStatus(cudaEventRecord(state_->done, stream), RankPrefix(rank_) + what + ": record"));
  const auto deadline = Clock::now() + timeout_;
  while (true) {
    const cudaError_t e = cudaEventQuery(state_->done);
    if (e == cudaSuccess) return Status::Ok();
    if (e != cudaErrorNotReady) {
      const Status error = CudaStatus(e, "the device failed");
      return Fail(what, error.message());
    }
    (void)cudaGetLastError();  // not ready is not an error
    ncclResult_t state = ncclSuccess;
    const ncclResult_t r = ncclCommGetAsyncError(state_->comm, &state);
    if (r != ncclSuccess) {
      return Fail(what, std::string("ncclCommGetAsyncError failed: ") + ncclGetErrorString(r));
    }
    if (state != ncclSuccess && state != ncclInProgress) {
      return Fail(what, std::string("a peer rank is gone or failed: ") + ncclGetErrorString(state));
    }
    if (Clock::now() >= deadline) {
      return Fail(what,
                  "did not finish within " + Seconds(timeout_) + "; a peer rank is gone or hung");
    }
    std::this_thread::sleep_for(kCompletionPollInterval);
  }
}

Status NcclCommunicator::AllGather(const float* shard, int64_t shard_elements, float* out) {
  const NcclGatherItem item{shard, out, shard_elements, proto::DTYPE_F32};
  DC_RETURN_IF_ERROR(AllGatherGroup({&item, 1}));
  return Synchronize("all-gather");
}

Status NcclCommunicator::ReduceScatterSum(float* full, int64_t shard_elements, float* shard) {
  const NcclReduceScatterItem item{full, shard, shard_elements, proto::DTYPE_F32};
  DC_RETURN_IF_ERROR(ReduceScatterGroup({&item, 1}));
  return Synchronize("reduce-scatter");
}

namespace {

// Checks the items of a grouped call; `what` names the call.
template <typename Item>
Status CheckItems(std::span<const Item> items, int rank, const char* what,
                  std::vector<ncclDataType_t>* types) {
  for (size_t i = 0; i < items.size(); ++i) {
    const Item& item = items[i];
    ncclDataType_t type{};
    if (!ToNcclType(item.dtype, &type)) {
      return Status::Error(RankPrefix(rank) + what + ": tensor " + std::to_string(i) +
                           " has dtype " + DTypeName(item.dtype) + ", which NCCL cannot carry");
    }
    if (item.shard_elements < 0) {
      return Status::Error(RankPrefix(rank) + what + ": tensor " + std::to_string(i) +
                           " has a negative element count");
    }
    types->push_back(type);
  }
  return Status::Ok();
}

}  // namespace

Status NcclCommunicator::AllGatherGroup(std::span<const NcclGatherItem> items) {
  return AllGatherGroup(items, stream_);
}

Status NcclCommunicator::ReduceScatterGroup(std::span<const NcclReduceScatterItem> items) {
  return ReduceScatterGroup(items, stream_);
}

Status NcclCommunicator::AllGatherGroup(std::span<const NcclGatherItem> items,
                                        cudaStream_t stream) {
  const std::string what = "all-gather of " + std::to_string(items.size()) + " tensor(s)";
  std::vector<ncclDataType_t> types;
  DC_RETURN_IF_ERROR(CheckItems(items, rank_, "all-gather", &types));
  return Call(what, [&] {
    ncclResult_t r = ncclGroupStart();
    if (r != ncclSuccess) return r;
    for (size_t i = 0; i < items.size() && r == ncclSuccess; ++i) {
      r = ncclAllGather(items[i].shard, items[i].out, static_cast<size_t>(items[i].shard_elements),
                        types[i], state_->comm, stream);
    }
    // The group must be closed even when a call in it failed.
    const ncclResult_t end = ncclGroupEnd();
    return r != ncclSuccess ? r : end;
  });
}

Status NcclCommunicator::ReduceScatterGroup(std::span<const NcclReduceScatterItem> items,
                                            cudaStream_t stream) {
  const std::string what = "reduce-scatter of " + std::to_string(items.size()) + " tensor(s)";
  std::vector<ncclDataType_t> types;
  DC_RETURN_IF_ERROR(CheckItems(items, rank_, "reduce-scatter", &types));
  return Call(what, [&] {
    ncclResult_t r = ncclGroupStart();
    if (r != ncclSuccess) return r;
    for (size_t i = 0; i < items.size() && r == ncclSuccess; ++i) {
      r = ncclReduceScatter(items[i].full, items[i].shard,
                            static_cast<size_t>(items[i].shard_elements), types[i], ncclSum,
                            state_->comm, stream);
    }
    const ncclResult_t end = ncclGroupEnd();
    return r != ncclSuccess ? r : end;
  });
}

Status NcclCommunicator::AllReduceSumOnDevice(float* values, int64_t count, cudaStream_t stream) {
  const std::string what = "all-reduce (sum) of " + std::to_string(count) + " value(s)";
  DC_RETURN_IF_ERROR(CheckUsable(what));
  if (count <= 0) return Status::Ok();
  return Call(what, [&] {
    return ncclAllReduce(values, values, static_cast<size_t>(count), ncclFloat32, ncclSum,
                         state_->comm, stream);
  });
}

Status NcclCommunicator::AllReduceHost(double* values, int64_t count, bool max,
                                       const std::string& what) {
  DC_RETURN_IF_ERROR(CheckUsable(what));
  if (count <= 0) return Status::Ok();
  const int64_t bytes = count * static_cast<int64_t>(sizeof(double));
  if (state_->scratch.size_bytes() < bytes) {
    DC_RETURN_IF_ERROR(Synchronize(what));  // the old buffers may be in use
    DC_ASSIGN_OR_RETURN(state_->scratch, DeviceBuffer::Create(bytes, RankPrefix(rank_) + what));
    DC_ASSIGN_OR_RETURN(state_->staging, PinnedHostBuffer::Create(bytes, RankPrefix(rank_) + what));
  }
  std::memcpy(state_->staging.data(), values, static_cast<size_t>(bytes));
  DC_RETURN_IF_ERROR(
      CopyAsync(state_->scratch.data(), state_->staging.data(), bytes, stream_, what));
  DC_RETURN_IF_ERROR(Call(what, [&] {
    return ncclAllReduce(state_->scratch.data(), state_->scratch.data(), static_cast<size_t>(count),
                         ncclFloat64, max ? ncclMax : ncclSum, state_->comm, stream_);
  }));
  DC_RETURN_IF_ERROR(
      CopyAsync(state_->staging.data(), state_->scratch.data(), bytes, stream_, what));
  DC_RETURN_IF_ERROR(Synchronize(what));
  std::memcpy(values, state_->staging.data(), static_cast<size_t>(bytes));
  return Status::Ok();
}

Status NcclCommunicator::AllReduceSum(double* values, int64_t count) {
  return AllReduceHost(values, count, false, "all-reduce (sum)");
}

Status NcclCommunicator::AllReduceMax(double* values, int64_t count) {
  return AllReduceHost(values, count, true, "all-reduce (max)");
}

Status NcclCommunicator::Broadcast(int64_t* value, int root) {
  const std::string what = "broadcast from rank " + std::to_string(root);
  DC_RETURN_IF_ERROR(CheckUsable(what));
  if (root < 0 || root >= world_size_) {
    return Status::Error(RankPrefix(rank_) + what + ": no such rank in a world of " +
                         std::to_string(world_size_));
  }
  constexpr int64_t kBytes = sizeof(int64_t);
  if (state_->scratch.size_bytes() < kBytes) {
    DC_RETURN_IF_ERROR(Synchronize(what));
    DC_ASSIGN_OR_RETURN(state_->scratch, DeviceBuffer::Create(kBytes, RankPrefix(rank_) + what));
    DC_ASSIGN_OR_RETURN(state_->staging,
                        PinnedHostBuffer::Create(kBytes, RankPrefix(rank_) + what));
  }
  std::memcpy(state_->staging.data(), value, kBytes);
  DC_RETURN_IF_ERROR(
      CopyAsync(state_->scratch.data(), state_->staging.data(), kBytes, stream_, what));
  DC_RETURN_IF_ERROR(Call(what, [&] {
    return ncclBroadcast(state_->scratch.data(), state_->scratch.data(), 1, ncclInt64, root,
                         state_->comm, stream_);
  }));
  DC_RETURN_IF_ERROR(
      CopyAsync(state_->staging.data(), state_->scratch.data(), kBytes, stream_, what));
  DC_RETURN_IF_ERROR(Synchronize(what));
  std::memcpy(value, state_->staging.data(), kBytes);
  return Status::Ok();
}

StatusOr<std::unique_ptr<NcclCommunicator>> ConnectNcclCommunicator(
    const RendezvousOptions& options, cudaStream_t stream) {
  const int rank = options.rank;
  if (options.world_size < 1 || rank < 0 || rank >= options.world_size) {
    return Status::Error(RankPrefix(rank) + "not a rank of a world of " +
                         std::to_string(options.world_size));
  }
  const bool tcp = options.world_size > 1 && options.store_dir.empty();
  // The id exchange comes first: it needs no device, and a missing rank 0 is the common failure.
  // Over TCP, rank 0 serves the store until every rank has joined the communicator, so every
  // rank has read the id by then.
  TcpRendezvous meeting;
  if (tcp) {
    DC_ASSIGN_OR_RETURN(
        meeting, TcpRendezvous::Join(options.master_addr, options.master_port, options.run_id,
                                     options.world_size, rank, options.timeout));
  }
  ncclUniqueId id{};
  if (rank == 0) {
    const ncclResult_t r = ncclGetUniqueId(&id);
    if (r != ncclSuccess) {
      return Status::Error(RankPrefix(rank) + "ncclGetUniqueId: " + ncclGetErrorString(r));
    }
    if (tcp) {
      const char* bytes = reinterpret_cast<const char*>(&id);
      DC_RETURN_IF_ERROR(
          meeting.store->Set(kIdFileName, std::vector<char>(bytes, bytes + sizeof(id)))
              .Prefixed(RankPrefix(rank)));
    } else if (!options.store_dir.empty()) {
      DC_RETURN_IF_ERROR(WriteId(NcclIdPath(options), id, rank));
    }
  } else if (tcp) {
    auto bytes = meeting.store->Get(kIdFileName, options.timeout);
    if (!bytes.ok()) return bytes.status().Prefixed(RankPrefix(rank));
    if (bytes->size() != sizeof(id)) {
      return Status::Error(RankPrefix(rank) + "the rendezvous's NCCL id has " +
                           std::to_string(bytes->size()) + " bytes, not " +
                           std::to_string(sizeof(id)));
    }
    std::memcpy(&id, bytes->data(), sizeof(id));
  } else {
    DC_ASSIGN_OR_RETURN(id, ReadId(NcclIdPath(options), rank, options.timeout));
  }
  if (CudaDeviceCount() == 0) {
    return Status::Error(RankPrefix(rank) + "NCCL needs a CUDA device; none found");
  }

  auto state = std::make_unique<NcclCommunicator::State>();
  DC_RETURN_IF_ERROR(CudaStatus(cudaEventCreateWithFlags(&state->done, cudaEventDisableTiming),
                                RankPrefix(rank) + "cudaEventCreateWithFlags"));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // every call returns; we poll, so a dead peer cannot hang us
  const ncclResult_t r =
      ncclCommInitRankConfig(&state->comm, options.world_size, id, rank, &config);
  if (r != ncclSuccess && r != ncclInProgress) {
    if (state->comm != nullptr) (void)ncclCommAbort(state->comm);
    state->comm = nullptr;
    return Status::Error(RankPrefix(rank) + "ncclCommInitRankConfig: " + ncclGetErrorString(r));
  }
  std::unique_ptr<NcclCommunicator> comm(
      new NcclCommunicator(rank, options.world_size, stream, options.timeout, std::move(state)));
  const Status ready = comm->WaitNotInProgress("joining the NCCL communicator of " +
                                               std::to_string(options.world_size) + " rank(s)");
  if (!ready.ok()) return ready;
  if (rank == 0 && !options.store_dir.empty()) {
    // Every rank has joined, so every rank has read the id: remove it, so that a later run in
    // the same directory cannot read a stale one.
    std::error_code ec;
    std::filesystem::remove(NcclIdPath(options), ec);
  }
  return comm;
}

StatusOr<std::unique_ptr<Communicator>> ConnectNccl(const RendezvousOptions& options,
                                                    cudaStream_t stream) {
  DC_ASSIGN_OR_RETURN(std::unique_ptr<NcclCommunicator> comm,
                      ConnectNcclCommunicator(options, stream));
  return std::unique_ptr<Communicator>(std::move(comm));
}

}  // namespace dc
