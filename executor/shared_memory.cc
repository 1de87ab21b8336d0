#include "executor/shared_memory.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <map>
#include <mutex>
#include <random>

namespace dc {
namespace {

constexpr uint64_t kMagic = 0x64632d73686d0002;  // "dc-shm", layout 2
// Published collectives a peer may still be reading the entry of: a rank publishes collective
// s + 2 only after finishing s + 1, which needs every peer to have published s + 1, which each
// does only after finishing s. Two would do.
constexpr int kMailbox = 8;
// Buffers start on a page: no two share a cache line, and the arena's touched pages are whole.
constexpr int64_t kBlockAlignment = 4096;
// A wait first checks this many times (a peer a few microseconds away), then polls with yields
// for kPollBeforeSleep, then sleeps on the futex in slices, between which it looks for aborts and
// gone peers.
constexpr int kSpinChecks = 64;
constexpr std::chrono::microseconds kPollBeforeSleep{1000};
constexpr std::chrono::milliseconds kWaitSlice{50};

using Kind = CollectiveKind;

// "an all-gather" or "a reduce-scatter" of a published entry's kind, for messages.
const char* EntryKindName(int32_t kind) {
  return kind == static_cast<int32_t>(Kind::kAllGather) ? "an all-gather" : "a reduce-scatter";
}

struct Entry {
  std::atomic<uint64_t> seq;
  int64_t offset;    // of the buffer in its owner's arena
  int64_t elements;  // per rank
  int32_t kind;      // CollectiveKind
};

struct alignas(64) Header {
  uint64_t magic;
  uint64_t token;  // random: the peer mapped this segment, not another of the same name
  int64_t pid;
  uint64_t pid_namespace;  // inode of /proc/self/ns/pid; 0 if unknown
  int64_t arena_bytes;
  alignas(64) std::atomic<uint64_t> ready;  // the last collective whose buffer is published
  std::atomic<uint64_t> done;               // the last collective this rank finished reading
  alignas(64) std::atomic<uint32_t> word;   // bumped after every change above: the futex
  std::atomic<uint32_t> waiters;            // threads asleep (or about to be) on `word`
  std::atomic<uint32_t> aborted;
  alignas(64) Entry mailbox[kMailbox];
};
static_assert(std::atomic<uint64_t>::is_always_lock_free &&
                  std::atomic<uint32_t>::is_always_lock_free,
              "the shared header's atomics must be lock-free to work across processes");

constexpr int64_t kHeaderBytes =
    (sizeof(Header) + kBlockAlignment - 1) / kBlockAlignment * kBlockAlignment;

int64_t AlignUp(int64_t bytes) {
  return (bytes + kBlockAlignment - 1) / kBlockAlignment * kBlockAlignment;
}

void FutexWake(std::atomic<uint32_t>* word) {
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, std::chrono::nanoseconds timeout) {
  timespec ts;
  ts.tv_sec = static_cast<time_t>(timeout.count() / 1000000000);
  ts.tv_nsec = static_cast<long>(timeout.count() % 1000000000);
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

// After a change of `header`'s ready, done or aborted: wakes whoever sleeps on it.
void Bump(Header* header) {
  header->word.fetch_add(1, std::memory_order_seq_cst);
  if (header->waiters.load(std::memory_order_seq_cst) > 0) FutexWake(&header->word);
}

// Whether process `pid` (of this pid namespace) has ended: gone, or a zombie its parent has not
// reaped yet (a launcher that waits for its ranks one by one leaves a killed one so).
bool ProcessEnded(int64_t pid) {
  if (::kill(static_cast<pid_t>(pid), 0) != 0) return errno == ESRCH;
  const std::string path = "/proc/" + std::to_string(pid) + "/stat";
  FILE* file = std::fopen(path.c_str(), "r");
  if (file == nullptr) return false;
  char text[512];
  const size_t length = std::fread(text, 1, sizeof(text) - 1, file);
  std::fclose(file);
  text[length] = '\0';
  // "pid (name) S ...": the state follows the last ')' (a name may hold one).
  const char* close = std::strrchr(text, ')');
  return close != nullptr && close[1] == ' ' && (close[2] == 'Z' || close[2] == 'X');
}

uint64_t PidNamespace() {
  struct stat info;
  return ::stat("/proc/self/ns/pid", &info) == 0 ? static_cast<uint64_t>(info.st_ino) : 0;
}

std::string Hex(uint64_t value) {
  char text[17];
  std::snprintf(text, sizeof(text), "%016llx", static_cast<unsigned long long>(value));
  return text;
}

// The characters of `run_id` a shared-memory name may hold, at most 40 of them.
std::string NamePart(const std::string& run_id) {
  std::string part;
  for (char c : run_id) {
    if (part.size() == 40) break;
    const bool plain = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                       c == '-' || c == '_';
    part += plain ? c : '_';
  }
  return part;
}

}  // namespace

struct SharedMemoryChannel::Segment {
  std::string name;
  int fd = -1;
  void* base = MAP_FAILED;
  int64_t bytes = 0;
  Header* header() const { return static_cast<Header*>(base); }
  char* arena() const { return static_cast<char*>(base) + kHeaderBytes; }
  ~Segment() {
    if (base != MAP_FAILED) ::munmap(base, static_cast<size_t>(bytes));
    if (fd >= 0) ::close(fd);
  }
};

// This rank's arena: free ranges (coalesced, by offset), buffers given back but perhaps still
// read by a peer, and how far memory has been reserved for it.
struct SharedMemoryChannel::Arena {
  std::mutex mu;
  std::condition_variable given_back;
  std::map<int64_t, int64_t> free;  // offset -> bytes
  std::vector<std::pair<Block, uint64_t>> retired;
  int64_t reserved_bytes = 0;
};

class SharedMemoryChannel::Collective : public PostedCollective {
 public:
  Collective(SharedMemoryChannel* channel, Kind kind, int64_t n, uint64_t seq, Block block)
      : channel_(channel), kind_(kind), n_(n), seq_(seq), block_(block) {}
  ~Collective() override { channel_->Retire(block_, seq_); }
  float* input() override {
    return kind_ == Kind::kAllGather ? data() + channel_->rank_ * n_ : data();
  }
  const float* output() const override {
    return kind_ == Kind::kAllGather ? data() : data() + channel_->world_ * n_;
  }
  Status Run() override { return channel_->Run(*this); }

  float* data() const {
    return reinterpret_cast<float*>(channel_->segments_[channel_->rank_]->arena() + block_.offset);
  }

  SharedMemoryChannel* channel_;
  Kind kind_;
  int64_t n_;
  uint64_t seq_;
  Block block_;
};

SharedMemoryChannel::~SharedMemoryChannel() = default;

std::string SharedMemoryChannel::Name() const {
  return "shared-memory channel " + std::to_string(channel_);
}

std::string SharedMemoryChannel::Where() const {
  return "rank " + std::to_string(rank_) + "'s " + Name();
}

StatusOr<std::unique_ptr<SharedMemoryChannel>> SharedMemoryChannel::Join(
    int rank, int world_size, int channel, const SharedMemoryOptions& options,
    const SharedMemoryMeeting& meeting, std::string* why_not) {
  std::unique_ptr<SharedMemoryChannel> made(new SharedMemoryChannel());
  made->rank_ = rank;
  made->world_ = world_size;
  made->channel_ = channel;
  made->options_ = options;
  made->arena_ = std::make_unique<Arena>();
  made->segments_.resize(world_size);
  std::string failed;  // this rank's reason, if it cannot take part
  const int64_t segment_bytes = kHeaderBytes + AlignUp(options.arena_bytes);

  // This rank's segment.
  auto own = std::make_unique<Segment>();
  std::random_device entropy;
  const uint64_t token = (static_cast<uint64_t>(entropy()) << 32) ^ entropy();
  own->name = "/" + NamePart(options.run_id) + "-c" + std::to_string(channel) + "-r" +
              std::to_string(rank) + "-" + std::to_string(::getpid()) + "-" + Hex(token);
  own->bytes = segment_bytes;
  own->fd = ::shm_open(own->name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  if (own->fd < 0) {
    failed = "could not create shared memory " + own->name + " (" + std::strerror(errno) + ")";
  } else if (::ftruncate(own->fd, segment_bytes) != 0) {
    failed = "could not size shared memory " + own->name + " (" + std::strerror(errno) + ")";
  } else {
    own->base = ::mmap(nullptr, static_cast<size_t>(segment_bytes), PROT_READ | PROT_WRITE,
                       MAP_SHARED, own->fd, 0);
    if (own->base == MAP_FAILED) {
      failed = "could not map shared memory " + own->name + " (" + std::strerror(errno) + ")";
    } else if (::posix_fallocate(own->fd, 0, kHeaderBytes) != 0) {
      failed = "/dev/shm has no room for a page";
    } else {
      Header* header = new (own->base) Header();
      header->magic = kMagic;
      header->token = token;
      header->pid = ::getpid();
      header->pid_namespace = PidNamespace();
      header->arena_bytes = options.arena_bytes;
    }
  }
  if (failed.empty() && options.min_free_bytes > 0) {
    struct statvfs shm;
    if (::statvfs("/dev/shm", &shm) == 0) {
      const int64_t free_bytes =
          static_cast<int64_t>(shm.f_bavail) * static_cast<int64_t>(shm.f_frsize);
      if (free_bytes < options.min_free_bytes) {
        failed = "/dev/shm has " + std::to_string(free_bytes >> 20) + " MiB free, under the " +
                 std::to_string(options.min_free_bytes >> 20) +
                 " MiB the shared-memory transport asks for; a container's is 64 MiB unless it "
                 "is started with more (docker run --shm-size=1g)";
      }
    }
  }
  const std::string record = failed.empty() ? own->name + " " + Hex(token) : std::string();

  // Once every rank has opened it (after the vote below) or the meeting failed, the name goes:
  // the mappings keep the memory, and a run that dies later leaves nothing behind.
  struct Unlink {
    std::string name;
    ~Unlink() {
      if (!name.empty()) ::shm_unlink(name.c_str());
    }
  } unlink{own->fd >= 0 ? own->name : std::string()};
  StatusOr<std::vector<std::string>> records = meeting.exchange(record);
  DC_RETURN_IF_ERROR(records.status());
  if (static_cast<int>(records->size()) != world_size) {
    return Status::Error("shared memory set-up: " + std::to_string(records->size()) +
                         " records for " + std::to_string(world_size) + " ranks");
  }
  made->segments_[rank] = std::move(own);
  for (int peer = 0; peer < world_size && failed.empty(); ++peer) {
    if (peer == rank) continue;
    const std::string& theirs = (*records)[peer];
    const size_t space = theirs.find(' ');
    if (space == std::string::npos) {
      failed = "rank " + std::to_string(peer) + " has no shared memory to offer";
      break;
    }
    auto segment = std::make_unique<Segment>();
    segment->name = theirs.substr(0, space);
    segment->bytes = segment_bytes;
    segment->fd = ::shm_open(segment->name.c_str(), O_RDWR, 0600);
    struct stat info;
    if (segment->fd < 0 || ::fstat(segment->fd, &info) != 0 || info.st_size != segment_bytes) {
      failed = "could not open rank " + std::to_string(peer) + "'s shared memory " + segment->name +
               " (another host, or another /dev/shm)";
      break;
    }
    segment->base = ::mmap(nullptr, static_cast<size_t>(segment_bytes), PROT_READ | PROT_WRITE,
                           MAP_SHARED, segment->fd, 0);
    ::close(segment->fd);
    segment->fd = -1;
    if (segment->base == MAP_FAILED || segment->header()->magic != kMagic ||
        Hex(segment->header()->token) != theirs.substr(space + 1) ||
        segment->header()->arena_bytes != options.arena_bytes) {
      failed = "mapped rank " + std::to_string(peer) + "'s shared memory " + segment->name +
               " but it is not that rank's";
      break;
    }
    made->segments_[peer] = std::move(segment);
  }
  DC_ASSIGN_OR_RETURN(const bool everyone, meeting.all_agree(failed.empty()));
  if (!everyone) {
    if (why_not) {
      *why_not = failed.empty() ? "another rank could not share memory with every peer" : failed;
    }
    return std::unique_ptr<SharedMemoryChannel>();
  }
  made->arena_->free[0] = AlignUp(options.arena_bytes);
  return made;
}

bool SharedMemoryChannel::Takes(int64_t shard_elements) const {
  return shard_elements >= 0 &&
         shard_elements <=
             options_.largest_buffer_bytes / (static_cast<int64_t>(sizeof(float)) * (world_ + 1));
}

StatusOr<std::unique_ptr<PostedCollective>> SharedMemoryChannel::Post(Kind kind, int64_t n) {
  // An all-gather's buffer is its output (its input inside it); a reduce-scatter's, its input
  // and then its output.
  const int64_t floats = kind == Kind::kAllGather ? n * world_ : n * (world_ + 1);
  DC_ASSIGN_OR_RETURN(Block block, Allocate(floats * static_cast<int64_t>(sizeof(float))));
  return std::unique_ptr<PostedCollective>(new Collective(this, kind, n, next_seq_++, block));
}

StatusOr<SharedMemoryChannel::Block> SharedMemoryChannel::Allocate(int64_t bytes) {
  if (bytes == 0) return Block{};  // nothing to place; given back at once
  const int64_t need = AlignUp(bytes);
  if (need > AlignUp(options_.arena_bytes)) {
    return Status::Error(Where() + ": a buffer of " + std::to_string(bytes) +
                         " bytes is larger than the arena");
  }
  const auto deadline = std::chrono::steady_clock::now() + options_.timeout;
  Arena& arena = *arena_;
  std::unique_lock<std::mutex> lock(arena.mu);
  for (;;) {
    // What every peer has finished reading comes back first.
    uint64_t read_by_all = UINT64_MAX;
    for (int peer = 0; peer < world_; ++peer) {
      if (peer != rank_) {
        read_by_all =
            std::min(read_by_all, segments_[peer]->header()->done.load(std::memory_order_acquire));
      }
    }
    for (size_t i = 0; i < arena.retired.size();) {
      if (arena.retired[i].second > read_by_all) {
        ++i;
        continue;
      }
      Block given = arena.retired[i].first;
      arena.retired.erase(arena.retired.begin() + static_cast<std::ptrdiff_t>(i));
      auto next = arena.free.lower_bound(given.offset);
      if (next != arena.free.end() && given.offset + given.bytes == next->first) {
        given.bytes += next->second;
        next = arena.free.erase(next);
      }
      if (next != arena.free.begin()) {
        auto before = std::prev(next);
        if (before->first + before->second == given.offset) {
          before->second += given.bytes;
          continue;
        }
      }
      arena.free[given.offset] = given.bytes;
    }
    // The lowest range that holds it: the arena's memory stays what is in use at once.
    for (auto it = arena.free.begin(); it != arena.free.end(); ++it) {
      if (it->second < need) continue;
      Block block{it->first, need};
      const int64_t left = it->second - need;
      arena.free.erase(it);
      if (left > 0) arena.free[block.offset + need] = left;
      const int64_t end = block.offset + need;
      if (end > arena.reserved_bytes) {
        // Reserved now, so that a full /dev/shm fails here with a message, not with SIGBUS in
        // the middle of a copy.
        const int error = ::posix_fallocate(
            segments_[rank_]->fd, kHeaderBytes + arena.reserved_bytes, end - arena.reserved_bytes);
        if (error != 0) {
          arena.free[block.offset] = need;  // coalesced again at the next reclaim
          return Status::Error(
              Where() + ": /dev/shm has no room for " + std::to_string(end >> 20) +
              " MiB of collective buffers (" + std::strerror(error) +
              "); give it more (docker run --shm-size) or set DC_CPU_TRANSPORT=tcp");
        }
        arena.reserved_bytes = end;
      }
      return block;
    }
    if (segments_[rank_]->header()->aborted.load(std::memory_order_acquire) != 0) {
      return Status::Error(Where() + ": the run was aborted");
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      return Status::Error(Where() + ": no room for a buffer of " + std::to_string(bytes) +
                           " bytes within the timeout (the peers have not read the earlier ones)");
    }
    // Buffers come back when their collective is done here (given_back) and read by every
    // peer (polled: rare, the arena is far larger than what is in flight).
    arena.given_back.wait_for(lock, std::chrono::milliseconds(1));
  }
}

void SharedMemoryChannel::Retire(Block block, uint64_t seq) {
  if (block.bytes == 0) return;
  {
    std::lock_guard<std::mutex> lock(arena_->mu);
    arena_->retired.push_back({block, seq});
  }
  arena_->given_back.notify_all();
}

Status SharedMemoryChannel::WaitFor(int peer, const std::function<bool()>& ready,
                                    const char* what) {
  for (int i = 0; i < kSpinChecks; ++i) {
    if (ready()) return Status::Ok();
  }
  // Then polling with yields: a peer's thread woken from the futex waits for a core, which on a
  // host whose cores the ranks fill takes longer than most collectives (tiny on 2 ranks of 2
  // cores stepped in 20-49 ms sleeping at once, 13-33 ms polling for 1 ms first; 4 ranks
  // 46-72 ms against 27 ms). A yield gives the core to whichever thread has work meanwhile.
  const auto poll_until = std::chrono::steady_clock::now() + kPollBeforeSleep;
  while (std::chrono::steady_clock::now() < poll_until) {
    if (ready()) return Status::Ok();
    ::sched_yield();
  }
  Header* theirs = segments_[peer]->header();
  const Header* mine = segments_[rank_]->header();
  const bool same_pids = mine->pid_namespace != 0 && mine->pid_namespace == theirs->pid_namespace;
  const auto deadline = std::chrono::steady_clock::now() + options_.timeout;
  const std::string failed_here =
      std::string(what) + " failed on rank " + std::to_string(rank_) + ": ";
  for (;;) {
    theirs->waiters.fetch_add(1, std::memory_order_seq_cst);
    const uint32_t seen = theirs->word.load(std::memory_order_seq_cst);
    Status failed;
    if (ready()) {
      theirs->waiters.fetch_sub(1, std::memory_order_seq_cst);
      return Status::Ok();
    }
    // This rank's own abort (another of its streams failed), or a peer's: that one is a
    // consequence of the peer's failure and says so as TCP's closed connections do (the launcher
    // reports the rank whose failure is not "a peer rank is gone").
    if (mine->aborted.load(std::memory_order_acquire) != 0) {
      failed = Status::Error(failed_here + "the run was aborted (" + Name() + ")");
    }
    for (int other = 0; other < world_ && failed.ok(); ++other) {
      if (other != rank_ &&
          segments_[other]->header()->aborted.load(std::memory_order_acquire) != 0) {
        failed = Status::Error(failed_here + "a peer rank is gone (rank " + std::to_string(other) +
                               " stopped the run after a failure of its own; " + Name() + ")");
      }
    }
    if (failed.ok() && same_pids && ProcessEnded(theirs->pid)) {
      failed = Status::Error(failed_here + "a peer rank is gone (rank " + std::to_string(peer) +
                             ", process " + std::to_string(theirs->pid) + ", has ended; " + Name() +
                             ")");
    }
    const auto now = std::chrono::steady_clock::now();
    if (failed.ok() && now >= deadline) {
      failed =
          Status::Error(failed_here + "a peer rank timed out (rank " + std::to_string(peer) +
                        " did not reach it within " +
                        std::to_string(options_.timeout.count() / 1000) + " s; " + Name() + ")");
    }
    if (!failed.ok()) {
      theirs->waiters.fetch_sub(1, std::memory_order_seq_cst);
      return failed;
    }
    FutexWait(&theirs->word, seen, std::min<std::chrono::nanoseconds>(kWaitSlice, deadline - now));
    theirs->waiters.fetch_sub(1, std::memory_order_seq_cst);
  }
}

Status SharedMemoryChannel::Run(Collective& collective) {
  const int64_t n = collective.n_;
  if (n == 0) return Status::Ok();  // every rank skips it alike
  const uint64_t seq = collective.seq_;
  Header* mine = segments_[rank_]->header();
  Entry& entry = mine->mailbox[seq % kMailbox];
  entry.offset = collective.block_.offset;
  entry.elements = n;
  entry.kind = static_cast<int32_t>(collective.kind_);
  entry.seq.store(seq, std::memory_order_release);
  mine->ready.store(seq, std::memory_order_release);
  Bump(mine);

  const char* what = CollectiveKindName(collective.kind_);
  // Each peer's buffer, where this rank maps it.
  std::vector<const float*> buffers(world_, nullptr);
  buffers[rank_] = collective.data();
  for (int peer = 0; peer < world_; ++peer) {
    if (peer == rank_) continue;
    const Header* theirs = segments_[peer]->header();
    DC_RETURN_IF_ERROR(WaitFor(
        peer, [&] { return theirs->ready.load(std::memory_order_acquire) >= seq; }, what));
    const Entry& their_entry = theirs->mailbox[seq % kMailbox];
    if (their_entry.seq.load(std::memory_order_acquire) != seq ||
        their_entry.kind != static_cast<int32_t>(collective.kind_) || their_entry.elements != n) {
      return Status::Error(Where() + ": rank " + std::to_string(peer) + "'s collective " +
                           std::to_string(seq) + " is " + EntryKindName(their_entry.kind) + " of " +
                           std::to_string(their_entry.elements) +
                           " floats per rank where this rank's is " + EntryKindName(entry.kind) +
                           " of " + std::to_string(n) +
                           ": the ranks run different plans; start every rank with the same "
                           "plan file and build");
    }
    if (their_entry.offset < 0 || their_entry.offset % kBlockAlignment != 0 ||
        their_entry.offset + n * (world_ + 1) * static_cast<int64_t>(sizeof(float)) >
            AlignUp(options_.arena_bytes)) {
      return Status::Error(Where() + ": rank " + std::to_string(peer) +
                           " published a buffer outside its arena");
    }
    buffers[peer] = reinterpret_cast<const float*>(segments_[peer]->arena() + their_entry.offset);
  }

  if (collective.kind_ == Kind::kAllGather) {
    float* out = collective.data();
    for (int peer = 0; peer < world_; ++peer) {
      if (peer != rank_) std::memcpy(out + peer * n, buffers[peer] + peer * n, n * sizeof(float));
    }
  } else {
    // This rank's chunk, summed as Gloo's ring sums it: the next rank's part first, around the
    // ring, this rank's last.
    float* out = collective.data() + world_ * n;
    auto chunk = [&](int k) { return buffers[(rank_ + k) % world_] + rank_ * n; };
    const float* first = chunk(1);
    const float* second = chunk(2);
    for (int64_t i = 0; i < n; ++i) out[i] = first[i] + second[i];
    for (int k = 3; k <= world_; ++k) {
      const float* part = chunk(k);
      for (int64_t i = 0; i < n; ++i) out[i] += part[i];
    }
  }
  mine->done.store(seq, std::memory_order_release);
  Bump(mine);
  return Status::Ok();
}

void SharedMemoryChannel::Abort() {
  Header* mine = segments_[rank_]->header();
  mine->aborted.store(1, std::memory_order_release);
  Bump(mine);
  // This rank's own waits sleep on the peers' words.
  for (int peer = 0; peer < world_; ++peer) {
    if (peer != rank_) FutexWake(&segments_[peer]->header()->word);
  }
  arena_->given_back.notify_all();
}

}  // namespace dc
