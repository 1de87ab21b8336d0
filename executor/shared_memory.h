// All-gathers and reduce-scatters through shared memory, for the cpu backend's ranks on one host
// (executor/comm.h picks it where every rank can map every other's memory). Over loopback TCP
// every byte is copied into the kernel and out again, and those copies take the cores the ranks
// compute on; here each rank reads its peers' buffers where they lie: an all-gather copies each
// peer's shard once, a reduce-scatter adds the peers' chunks straight from their buffers.
//
// Each rank of a channel owns one segment: a header (what it has published, what it has
// finished reading, a futex word to wait on) and an arena its collectives' buffers are carved
// from. Segments are POSIX shared memory, unlinked as soon as every rank has mapped them, so a
// run that dies leaves nothing in /dev/shm. A collective is made on one thread and run on
// another, in the same order on every rank (as PostedCollective says); run, it publishes its
// buffer, waits for every peer's, reads them and says it is done. A buffer is given back only
// once every peer is done with it. Waits sleep on a futex (no core is spun), end at once when
// any rank aborts, when a peer's process is gone, or at the timeout.
//
// The reduce-scatter adds each chunk in the order Gloo's ring does (the rank after its owner
// first, around the ring, its owner last), so the two transports give the same bits.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "executor/comm.h"
#include "schemas/status.h"

namespace dc {

struct SharedMemoryOptions {
  // Each rank's arena per channel: address space, backed by memory only where buffers have
  // been (the lowest free bytes are taken first).
  int64_t arena_bytes = int64_t{640} << 20;
  // A collective whose buffer is larger than this goes over TCP instead (the same choice on
  // every rank: it depends on the sizes alone). The cpu device keeps at most 256 MiB of a
  // stream's collectives in flight, plus one larger one.
  int64_t largest_buffer_bytes = int64_t{320} << 20;
  // A rank takes part only where /dev/shm has at least this much free when the run starts (0:
  // no check): a run whose buffers outgrow /dev/shm fails at that collective, so where it is
  // small (a container's default 64 MiB) every rank stays on TCP instead. dc-run asks 1 GiB
  // under DC_CPU_TRANSPORT=auto and nothing under shm.
  int64_t min_free_bytes = 0;
  std::chrono::milliseconds timeout{60000};  // each wait for a peer
  std::string run_id = "dc";                 // part of the segments' names
};

// What the ranks of a channel say to each other while they set up, over the channel's other
// transport: every rank's record, in rank order; and whether every rank answered yes.
struct SharedMemoryMeeting {
  std::function<StatusOr<std::vector<std::string>>(const std::string& mine)> exchange;
  std::function<StatusOr<bool>(bool mine)> all_agree;
};

class SharedMemoryChannel {
 public:
  ~SharedMemoryChannel();
  SharedMemoryChannel(const SharedMemoryChannel&) = delete;
  SharedMemoryChannel& operator=(const SharedMemoryChannel&) = delete;

  // Every rank calls it at once. A channel where every rank mapped every other's segment; null
  // (and `why_not` says why) where some rank could not, so that all ranks take TCP together.
  // Errors: the meeting itself failed.
  static StatusOr<std::unique_ptr<SharedMemoryChannel>> Join(int rank, int world_size, int channel,
                                                             const SharedMemoryOptions& options,
                                                             const SharedMemoryMeeting& meeting,
                                                             std::string* why_not);

  // Whether a collective of `shard_elements` per rank goes through this channel (the same on
  // every rank).
  bool Takes(int64_t shard_elements) const;
  // Made on the channel's making thread; they take an arena buffer (waiting for one if the
  // arena is full). A collective must not outlive its channel.
  StatusOr<std::unique_ptr<PostedCollective>> Post(CollectiveKind kind, int64_t shard_elements);
  // Ends every wait, here and on the peers; nothing succeeds afterwards. Any thread.
  void Abort();

  class Collective;

 private:
  struct Segment;
  struct Block {
    int64_t offset = 0, bytes = 0;
  };
  SharedMemoryChannel() = default;

  Status Run(Collective& collective);
  StatusOr<Block> Allocate(int64_t bytes);
  void Retire(Block block, uint64_t seq);
  // Waits until `ready()` holds for `peer`'s header; `what` names the collective, for the error.
  Status WaitFor(int peer, const std::function<bool()>& ready, const char* what);
  std::string Name() const;   // "shared-memory channel 1"
  std::string Where() const;  // "rank 0's shared-memory channel 1", for errors

  int rank_ = 0, world_ = 1, channel_ = 0;
  SharedMemoryOptions options_;
  std::vector<std::unique_ptr<Segment>> segments_;  // per rank; this rank's is its own
  uint64_t next_seq_ = 1;                           // on the making thread
  struct Arena;
  std::unique_ptr<Arena> arena_;
};

}  // namespace dc
