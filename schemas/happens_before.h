// The happens-before check of a schedule. A plan's streams run concurrently (CUDA streams on a
// GPU, a thread per stream on the cpu backend), so issue order orders nothing across streams:
// every pair of buffer effects (schemas/effects.h) that must not overlap must be ordered by the
// plan itself. BufferReplay checks the effects as if the schedule ran serially; this checks that
// the plan's dependencies make the run keep that order.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "schemas/effects.h"
#include "schemas/program.h"
#include "schemas/status.h"

namespace dc {

// Which instructions end before which start, from the orderings the executor honours: an
// instruction waits for its deps, for the instruction before it on its stream (a stream runs its
// instructions one after another, in issue order), and a RELOAD for the latest earlier OFFLOAD
// of each of its tensors (the host copy it reads back; executor/layout.cc waits for it).
// Transitive. One vector clock per instruction (instructions x streams integers), built in one
// pass. Call CheckReferences (schemas/effects.h) first: it trusts deps and streams. Immutable
// once built; safe to share between threads.
class HappensBefore {
 public:
  explicit HappensBefore(const proto::Schedule& schedule);

  // Whether instruction `before` ends before instruction `after` starts. `before` -1 stands for
  // start-up, which every instruction follows; an instruction does not end before it starts.
  bool Ordered(int before, int after) const {
    if (before < 0) return true;
    if (before >= after) return false;
    return clock_[static_cast<size_t>(after) * kStreams + stream_[before]] >= position_[before];
  }

 private:
  // Stream values 0 .. Stream_MAX (CheckReferences bounds them).
  static constexpr int kStreams = proto::Stream_MAX + 1;
  std::vector<uint8_t> stream_;
  // Per instruction: its place on its stream, from 1.
  std::vector<int32_t> position_;
  // [instruction * kStreams + s]: how many of stream s's first instructions end before the
  // instruction starts.
  std::unique_ptr<int32_t[]> clock_;
};

// Every pair of effects on one device buffer that must be ordered is ordered (HappensBefore):
// the write of a buffer (its allocation: a gather, the compute of an output, a reload, an input's
// staging; an update in place) before every later use of it; every read before the next write
// and before its release; and, where the plan has a memory plan, the release of the buffer that
// last held an arena byte range before the allocation of the next buffer placed there (a
// buffer placed over one that is still live is refused). The message names both instructions
// (index, kind, stream, micro-step, op or tensors), the buffer, and the dependency that is
// missing. Call CheckReferences first; it replays the effects (BufferReplay) itself and returns
// their errors too. Linear in the schedule's effects (times the streams), plus a logarithm for
// the memory plan's byte ranges.
Status CheckHappensBefore(const proto::Schedule& schedule);

// CheckHappensBefore as a listener of a replay the caller runs (the simulator's: one replay for
// both, SimOptions::also_listening): told every effect of `schedule`, in order, it keeps the
// first that is not ordered. It builds its order when told the first effect: a replay runs on
// checked references only. Errors of the replay itself are the replay's to return.
class HappensBeforeCheck final : public BufferListener {
 public:
  explicit HappensBeforeCheck(const proto::Schedule& schedule);
  ~HappensBeforeCheck() override;
  HappensBeforeCheck(const HappensBeforeCheck&) = delete;
  HappensBeforeCheck& operator=(const HappensBeforeCheck&) = delete;

  // Ok, or the first effect found unordered (CheckHappensBefore's message).
  const Status& status() const;

  void Allocated(int instruction, const BufferKey& key, int64_t size_bytes, BufferKind kind,
                 bool at_end, int handle) override;
  void Freed(int instruction, const BufferKey& key, int64_t size_bytes, BufferKind kind,
             bool at_end, int handle) override;
  void Renamed(int instruction, const BufferKey& from, const BufferKey& to, int handle) override;
  void Accessed(int instruction, const BufferKey& key, BufferAccess access, int handle) override;

 private:
  class Checker;
  Checker& checker();

  const proto::Schedule& schedule_;
  std::unique_ptr<HappensBefore> order_;
  std::unique_ptr<Checker> checker_;
  Status ok_;
};

}  // namespace dc
