#include "analyzer/timeline.h"

#include <algorithm>
#include <map>
#include <tuple>

#include "analyzer/trace.h"

namespace dc {
namespace {

constexpr int64_t kProgressEvery = 100000;  // records between progress calls

}  // namespace

const char* ActivityClassName(ActivityClass kind) {
  switch (kind) {
    case ActivityClass::kCompute:
      return "compute";
    case ActivityClass::kCommunication:
      return "communication";
    case ActivityClass::kCopy:
      return "copy";
  }
  return "?";
}

const char* TimelineFormatName(TimelineFormat format) {
  switch (format) {
    case TimelineFormat::kDc:
      return "dc";
    case TimelineFormat::kNsys:
      return "nsys";
    case TimelineFormat::kKineto:
      return "kineto";
    case TimelineFormat::kPlan:
      return "plan";
  }
  return "?";
}

namespace {

std::string DefaultStreamName(int64_t stream_id) { return "stream " + std::to_string(stream_id); }

class InMemoryTimeline : public Timeline {
 public:
  explicit InMemoryTimeline(TimelineData data) : data_(std::move(data)) {
    auto by_time = [](const auto& a, const auto& b) {
      return std::tie(a.rank_index, a.start_ns) < std::tie(b.rank_index, b.start_ns);
    };
    std::stable_sort(data_.activities.begin(), data_.activities.end(), by_time);
    std::stable_sort(data_.steps.begin(), data_.steps.end(), by_time);
    std::stable_sort(data_.memory_events.begin(), data_.memory_events.end(),
                     [](const TimelineMemoryEvent& a, const TimelineMemoryEvent& b) {
                       return std::tie(a.rank_index, a.ts_ns) < std::tie(b.rank_index, b.ts_ns);
                     });
  }
  const std::string& path() const override { return data_.path; }
  TimelineFormat format() const override { return data_.format; }
  const std::vector<TimelineRank>& ranks() const override { return data_.ranks; }
  const std::vector<TimelineStep>& steps() const override { return data_.steps; }
  const proto::Schedule* schedule() const override {
    return data_.schedule ? &*data_.schedule : nullptr;
  }
  const std::vector<std::string>& notes() const override { return data_.notes; }
  const std::vector<SkippedRecords>& skipped() const override { return data_.skipped; }
  int64_t dropped_records() const override { return data_.dropped_records; }
  std::string StreamName(int rank_index, int64_t stream_id) const override {
    for (const TimelineData::StreamLabel& label : data_.stream_names) {
      if (label.rank_index == rank_index && label.stream_id == stream_id) return label.name;
    }
    return DefaultStreamName(stream_id);
  }
  Status ForEachActivity(const ActivityOptions& options,
                         const std::function<void(const TimelineActivity&)>& fn) const override {
    int64_t n = 0;
    for (const TimelineActivity& a : data_.activities) {
      fn(a);
      if (options.progress && ++n % kProgressEvery == 0) options.progress(data_.path, n);
    }
    return Status::Ok();
  }
  Status ForEachMemoryEvent(
      const std::function<void(const TimelineMemoryEvent&)>& fn) const override {
    for (const TimelineMemoryEvent& e : data_.memory_events) fn(e);
    return Status::Ok();
  }

 private:
  TimelineData data_;
};

// A dc trace or nsys export, streamed through Trace (stream names and activity -> instruction
// lookups included).
class TraceTimeline : public Timeline {
 public:
  static StatusOr<std::unique_ptr<Timeline>> Open(const std::string& path) {
    DC_ASSIGN_OR_RETURN(std::unique_ptr<Trace> trace, Trace::Open(path));
    // A dc trace's steps are its windows: without one, windows guessed from the activities would
    // be a different step time that looks like a measurement (dc-plan refuses it too).
    if (trace->source() == TraceSource::kDc && trace->schedule() && trace->Steps().empty()) {
      return Status::Error(path +
                           ": no usable step rows in TC_STEP: the recording did not finish a "
                           "step; re-record it with dc-collect");
    }
    std::unique_ptr<TraceTimeline> timeline(new TraceTimeline());
    timeline->trace_ = std::move(trace);
    DC_RETURN_IF_ERROR(timeline->Load());
    return std::unique_ptr<Timeline>(std::move(timeline));
  }

  const std::string& path() const override { return trace_->path(); }
  TimelineFormat format() const override {
    return trace_->source() == TraceSource::kDc ? TimelineFormat::kDc : TimelineFormat::kNsys;
  }
  const std::vector<TimelineRank>& ranks() const override { return ranks_; }
  const std::vector<TimelineStep>& steps() const override { return steps_; }
  const proto::Schedule* schedule() const override {
    return trace_->schedule() ? &*trace_->schedule() : nullptr;
  }
  const std::vector<std::string>& notes() const override { return trace_->notes(); }
  std::string incomplete() const override { return trace_->incomplete(); }
  const std::vector<SkippedRecords>& skipped() const override { return trace_->skipped(); }
  int64_t dropped_records() const override { return trace_->DroppedRecords(); }
  std::string StreamName(int, int64_t stream_id) const override {
    auto it = trace_->stream_names().find(stream_id);
    return it == trace_->stream_names().end() ? DefaultStreamName(stream_id) : it->second;
  }

  Status ForEachActivity(const ActivityOptions& options,
                         const std::function<void(const TimelineActivity&)>& fn) const override {
    std::unique_ptr<Trace::InstructionLookup> lookup;
    if (options.with_instructions && format() == TimelineFormat::kDc) {
      DC_ASSIGN_OR_RETURN(lookup, trace_->LookupInstructions());
    }
    int64_t n = 0;
    Status lookup_status;
    DC_RETURN_IF_ERROR(trace_->ForEachActivity([&](const Activity& a) {
      if (options.progress && ++n % kProgressEvery == 0) options.progress(path(), n);
      auto rank = rank_of_pid_.find(a.global_pid);
      if (rank == rank_of_pid_.end()) return;
      TimelineActivity t;
      t.rank_index = rank->second;
      t.stream_id = a.stream_id;
      t.kind = a.type == Activity::Type::kMemcpy || a.type == Activity::Type::kMemset
                   ? ActivityClass::kCopy
               : a.communication ? ActivityClass::kCommunication
                                 : ActivityClass::kCompute;
      t.name = a.name;
      t.start_ns = a.start_ns;
      t.end_ns = a.end_ns;
      t.bytes = a.bytes;
      if (lookup && lookup_status.ok()) {
        StatusOr<std::optional<std::pair<int, int>>> found =
            lookup->Find(a.global_pid, a.correlation_id);
        if (!found.ok()) {
          lookup_status = found.status();
        } else if (*found) {
          t.step = (*found)->first;
          t.instruction = (*found)->second;
        }
      }
      fn(t);
    }));
    return lookup_status;
  }

  Status ForEachMemoryEvent(
      const std::function<void(const TimelineMemoryEvent&)>& fn) const override {
    return trace_->ForEachMemoryEvent([&](const MemoryEvent& e) {
      auto rank = rank_of_pid_.find(e.global_pid);
      if (rank == rank_of_pid_.end()) return;
      TimelineMemoryEvent t;
      t.rank_index = rank->second;
      t.ts_ns = e.ts_ns;
      t.address = e.address;
      t.bytes = e.bytes;
      t.alloc = e.alloc;
      t.kind = e.kind;
      fn(t);
    });
  }

 private:
  TraceTimeline() = default;

  Status Load() {
    for (const TraceRank& r : trace_->ranks()) {
      rank_of_pid_[r.global_pid] = static_cast<int>(ranks_.size());
      ranks_.push_back({r.rank, r.global_pid, r.device, r.device_memory_bytes});
    }
    for (const Trace::StepRow& s : trace_->Steps()) {
      auto rank = rank_of_pid_.find(s.global_pid);
      if (rank == rank_of_pid_.end()) continue;
      steps_.push_back({rank->second, s.step, s.start_ns, s.end_ns, s.warmup});
    }
    std::stable_sort(
        steps_.begin(), steps_.end(), [](const TimelineStep& a, const TimelineStep& b) {
          return std::tie(a.rank_index, a.start_ns) < std::tie(b.rank_index, b.start_ns);
        });
    return Status::Ok();
  }

  std::unique_ptr<Trace> trace_;
  std::vector<TimelineRank> ranks_;
  std::map<int64_t, int> rank_of_pid_;
  std::vector<TimelineStep> steps_;
};

}  // namespace

std::unique_ptr<Timeline> MakeTimeline(TimelineData data) {
  return std::make_unique<InMemoryTimeline>(std::move(data));
}

StatusOr<std::unique_ptr<Timeline>> OpenTraceTimeline(const std::string& path) {
  return TraceTimeline::Open(path);
}

}  // namespace dc
