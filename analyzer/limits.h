// The range rules for numbers read from traces (dc traces, nsys exports, Kineto JSON): the one
// home of what a reader accepts, so that everything downstream (summaries, the profile, Perfetto,
// SVG) can subtract any two times and add a time to a duration without overflowing. The SQLite
// reader turns them into SQL (analyzer/trace.cc), the Kineto reader checks each event with them.
// Sums over many records (total kernel time, live bytes) can still leave 64 bits: the code that
// sums uses CheckedAdd. Thread-safe (constants and pure functions).
#pragma once

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>

namespace dc {

struct TraceLimits {
  // Timestamps in [-2^61, 2^61] ns (73 years either side of the trace's zero; nsys and dc times
  // count from the session's start, Kineto's from 1970): any difference fits in 62 bits.
  static constexpr int64_t kMaxAbsTimeNs = int64_t{1} << 61;
  // Bytes of one copy, collective or allocation in [0, 2^50] (1 PiB, beyond any device).
  static constexpr int64_t kMaxRecordBytes = int64_t{1} << 50;
  // Stream ids (CUDA stream numbers, Kineto tids) in [0, 2^48].
  static constexpr int64_t kMaxStreamId = int64_t{1} << 48;
  // Live bytes of one rank, summed over its buffers, within [-2^62, 2^62] (4 EiB): more means
  // corrupt byte counts, and keeps any difference of two levels inside 64 bits.
  static constexpr int64_t kMaxLiveBytes = int64_t{1} << 62;
  // Step and instruction numbers fit an int.
  static constexpr int64_t kMaxIndex = (int64_t{1} << 31) - 1;

  static constexpr bool TimeOk(int64_t ns) { return ns >= -kMaxAbsTimeNs && ns <= kMaxAbsTimeNs; }
  static constexpr bool BytesOk(int64_t bytes) { return bytes >= 0 && bytes <= kMaxRecordBytes; }
  static constexpr bool StreamOk(int64_t id) { return id >= 0 && id <= kMaxStreamId; }
  static constexpr bool IndexOk(int64_t index) { return index >= -1 && index <= kMaxIndex; }
  // A double (Kineto's microseconds, a JSON number) as an integer in [lo, hi] after scaling;
  // nullopt for NaN, infinities and anything outside.
  static std::optional<int64_t> Scaled(double value, double scale, int64_t lo, int64_t hi) {
    const double scaled = value * scale;
    if (!std::isfinite(scaled) || scaled < static_cast<double>(lo) ||
        scaled > static_cast<double>(hi)) {
      return std::nullopt;
    }
    return static_cast<int64_t>(std::llround(scaled));
  }
};

// Records a reader left out because they break the rules above, where the rest of the trace is
// usable: counted, and shown in dc-trace's summary (text and --json) and dc-plan's output.
struct SkippedRecords {
  std::string source;   // the table (SQLite) or file (Kineto)
  std::string problem;  // "end before start"
  int64_t count = 0;
  std::string Text() const {
    return source + ": " + std::to_string(count) + " record(s) skipped (" + problem + ")";
  }
};

// a + b into *sum; false (and *sum untouched) where it would overflow.
inline bool CheckedAdd(int64_t a, int64_t b, int64_t* sum) {
  int64_t result = 0;
  if (__builtin_add_overflow(a, b, &result)) return false;
  *sum = result;
  return true;
}

// *live += delta, for live-byte levels; false (and *live untouched) past kMaxLiveBytes.
inline bool AddLiveBytes(int64_t* live, int64_t delta) {
  int64_t sum = 0;
  if (!CheckedAdd(*live, delta, &sum) || sum > TraceLimits::kMaxLiveBytes ||
      sum < -TraceLimits::kMaxLiveBytes) {
    return false;
  }
  *live = sum;
  return true;
}

}  // namespace dc
