#include "tracetools/perfetto.h"

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string_view>
#include <tuple>

#include "schemas/files.h"

namespace dc {
namespace {

constexpr char kMemoryCounter[] = "device memory (bytes)";

// `text` as a JSON string, quotes included. Bytes >= 0x80 pass through (UTF-8 stays UTF-8).
void AppendString(std::string* out, std::string_view text) {
  out->push_back('"');
  for (char c : text) {
    switch (c) {
      case '"':
        *out += "\\\"";
        break;
      case '\\':
        *out += "\\\\";
        break;
      case '\n':
        *out += "\\n";
        break;
      case '\t':
        *out += "\\t";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char escaped[8];
          std::snprintf(escaped, sizeof(escaped), "\\u%04x", static_cast<unsigned char>(c));
          *out += escaped;
        } else {
          out->push_back(c);
        }
    }
  }
  out->push_back('"');
}

// Nanoseconds as microseconds with exactly three decimals, from integers (no rounding drift).
std::string Micros(int64_t ns) {
  const bool negative = ns < 0;
  const uint64_t magnitude = negative ? 0 - static_cast<uint64_t>(ns) : static_cast<uint64_t>(ns);
  char text[40];
  std::snprintf(text, sizeof(text), "%s%" PRIu64 ".%03" PRIu64, negative ? "-" : "",
                magnitude / 1000, magnitude % 1000);
  return text;
}

// The events, comma-separated, one per line.
class EventWriter {
 public:
  explicit EventWriter(std::ostream& out) : out_(out) {}
  void Begin(const Timeline& timeline) {
    std::string head = "{\"displayTimeUnit\":\"ns\",\"otherData\":{\"source\":";
    AppendString(&head, timeline.path());
    head += ",\"format\":";
    AppendString(&head, TimelineFormatName(timeline.format()));
    head += ",\"producer\":\"dc-trace\"},\"traceEvents\":[\n";
    out_ << head;
  }
  void Event(const std::string& event) {
    if (!first_) out_ << ",\n";
    first_ = false;
    out_ << event;
  }
  void End() { out_ << "\n]}\n"; }

 private:
  std::ostream& out_;
  bool first_ = true;
};

std::string Metadata(const char* name, int pid, std::optional<int64_t> tid, const char* key,
                     const std::string& value, bool numeric) {
  std::string e = "{\"name\":\"";
  e += name;
  e += "\",\"ph\":\"M\",\"pid\":" + std::to_string(pid);
  if (tid) e += ",\"tid\":" + std::to_string(*tid);
  e += ",\"args\":{\"";
  e += key;
  e += "\":";
  if (numeric) {
    e += value;
  } else {
    AppendString(&e, value);
  }
  return e + "}}";
}

std::string ProcessName(const Timeline& timeline, const TimelineRank& rank) {
  std::string name = timeline.format() == TimelineFormat::kPlan
                         ? "plan (predicted, every rank)"
                         : "rank " + std::to_string(rank.rank);
  if (!rank.device.empty()) name += " (" + rank.device + ")";
  return name;
}

std::string Slice(const TimelineActivity& a, int pid) {
  std::string e = "{\"name\":";
  AppendString(&e, a.name);
  e += ",\"cat\":\"";
  e += ActivityClassName(a.kind);
  e += "\",\"ph\":\"X\",\"pid\":" + std::to_string(pid) +
       ",\"tid\":" + std::to_string(a.stream_id) + ",\"ts\":" + Micros(a.start_ns) +
       ",\"dur\":" + Micros(std::max<int64_t>(0, a.end_ns - a.start_ns)) + ",\"args\":{";
  std::string args;
  if (a.bytes > 0) args += "\"bytes\":" + std::to_string(a.bytes);
  if (a.instruction >= 0) {
    args +=
        std::string(args.empty() ? "" : ",") + "\"instruction\":" + std::to_string(a.instruction);
  }
  if (a.step >= 0)
    args += std::string(args.empty() ? "" : ",") + "\"step\":" + std::to_string(a.step);
  return e + args + "}}";
}

// Where an instruction's first activity of a step ran.
struct Endpoint {
  int64_t start_ns = 0;
  int64_t stream_id = 0;
};
using EndpointKey = std::tuple<int, int, int>;  // rank_index, step, instruction

class FlowCollector {
 public:
  explicit FlowCollector(const proto::Schedule* schedule) {
    if (schedule == nullptr) return;
    pairs_ = GatherConsumers(*schedule);
    for (const auto& [gather, consumer] : pairs_) {
      wanted_.insert(gather);
      wanted_.insert(consumer);
    }
  }
  void See(const TimelineActivity& a) {
    if (a.step < 0 || !wanted_.contains(a.instruction)) return;
    auto [it, inserted] = endpoints_.try_emplace({a.rank_index, a.step, a.instruction},
                                                 Endpoint{a.start_ns, a.stream_id});
    if (!inserted && a.start_ns < it->second.start_ns) it->second = {a.start_ns, a.stream_id};
  }
  // Writes each (gather, consumer) pair seen in the same rank and step as an s/f pair.
  int64_t Write(const std::vector<int>& pids, EventWriter* writer) const {
    std::map<int, int> consumer_of(pairs_.begin(), pairs_.end());
    int64_t id = 0;
    for (const auto& [key, gather] : endpoints_) {
      const auto& [rank_index, step, instruction] = key;
      auto consumer = consumer_of.find(instruction);
      if (consumer == consumer_of.end()) continue;
      auto use = endpoints_.find({rank_index, step, consumer->second});
      if (use == endpoints_.end()) continue;
      ++id;
      const std::string pid = std::to_string(pids[rank_index]);
      const std::string common =
          "{\"name\":\"gather to use\",\"cat\":\"dependency\",\"id\":" + std::to_string(id) +
          ",\"pid\":" + pid;
      writer->Event(common + ",\"tid\":" + std::to_string(gather.stream_id) +
                    ",\"ph\":\"s\",\"ts\":" + Micros(gather.start_ns) + "}");
      writer->Event(common + ",\"tid\":" + std::to_string(use->second.stream_id) +
                    ",\"ph\":\"f\",\"bp\":\"e\",\"ts\":" + Micros(use->second.start_ns) + "}");
    }
    return id;
  }

 private:
  std::vector<std::pair<int, int>> pairs_;
  std::set<int> wanted_;
  std::map<EndpointKey, Endpoint> endpoints_;
};

StatusOr<int64_t> WriteMemory(const Timeline& timeline, const std::vector<int>& pids,
                              EventWriter* writer) {
  DC_ASSIGN_OR_RETURN(MemoryReplay replay, MemoryReplay::Prepare(timeline));
  int64_t counters = 0;
  DC_RETURN_IF_ERROR(replay.Run(timeline, [&](const MemoryLevel& level) {
    std::string e = "{\"name\":\"";
    e += kMemoryCounter;
    e += "\",\"ph\":\"C\",\"pid\":";
    e += std::to_string(pids[level.rank_index]);
    e += ",\"ts\":";
    e += Micros(level.ts_ns);
    e += ",\"args\":{";
    for (size_t k = 0; k < replay.kinds().size(); ++k) {
      if (k > 0) e += ",";
      AppendString(&e, replay.kinds()[k]);
      e += ':';
      e += std::to_string((*level.bytes_by_kind)[k]);
    }
    writer->Event(e + "}}");
    ++counters;
  }));
  return counters;
}

void WriteSteps(const Timeline& timeline, const std::vector<int>& pids, int64_t steps_tid,
                EventWriter* writer, PerfettoStats* stats) {
  std::set<int> with_steps;
  for (const TimelineStep& s : timeline.steps()) {
    const int pid = pids[s.rank_index];
    if (with_steps.insert(pid).second) {
      writer->Event(Metadata("thread_name", pid, steps_tid, "name", "steps", false));
      writer->Event(Metadata("thread_sort_index", pid, steps_tid, "sort_index", "-1", true));
      ++stats->threads;
    }
    writer->Event("{\"name\":\"step " + std::to_string(s.step) +
                  "\",\"cat\":\"step\",\"ph\":\"X\",\"pid\":" + std::to_string(pid) +
                  ",\"tid\":" + std::to_string(steps_tid) + ",\"ts\":" + Micros(s.start_ns) +
                  ",\"dur\":" + Micros(std::max<int64_t>(0, s.end_ns - s.start_ns)) +
                  ",\"args\":{\"warmup\":" + (s.warmup ? "true" : "false") + "}}");
    ++stats->slices;
  }
}

}  // namespace

StatusOr<PerfettoStats> WritePerfetto(const Timeline& timeline, std::ostream& out,
                                      const ProgressFn& progress) {
  PerfettoStats stats;
  EventWriter writer(out);
  writer.Begin(timeline);
  std::vector<int> pids;
  for (const TimelineRank& rank : timeline.ranks()) {
    pids.push_back(rank.rank);
    writer.Event(Metadata("process_name", rank.rank, std::nullopt, "name",
                          ProcessName(timeline, rank), false));
    writer.Event(Metadata("process_sort_index", rank.rank, std::nullopt, "sort_index",
                          std::to_string(rank.rank), true));
    ++stats.processes;
  }
  FlowCollector flows(timeline.schedule());
  std::set<std::pair<int, int64_t>> threads;
  int64_t max_stream = 0;
  ActivityOptions options;
  options.with_instructions = true;
  options.progress = progress;
  DC_RETURN_IF_ERROR(timeline.ForEachActivity(options, [&](const TimelineActivity& a) {
    const int pid = pids[a.rank_index];
    if (threads.insert({a.rank_index, a.stream_id}).second) {
      writer.Event(Metadata("thread_name", pid, a.stream_id, "name",
                            timeline.StreamName(a.rank_index, a.stream_id), false));
      writer.Event(Metadata("thread_sort_index", pid, a.stream_id, "sort_index",
                            std::to_string(a.stream_id), true));
      ++stats.threads;
    }
    max_stream = std::max(max_stream, a.stream_id);
    writer.Event(Slice(a, pid));
    ++stats.slices;
    flows.See(a);
  }));
  WriteSteps(timeline, pids, max_stream + 1, &writer, &stats);
  DC_ASSIGN_OR_RETURN(stats.counters, WriteMemory(timeline, pids, &writer));
  stats.flows = flows.Write(pids, &writer);
  writer.End();
  return stats;
}

StatusOr<PerfettoStats> WritePerfettoFile(const Timeline& timeline, const std::string& path,
                                          const ProgressFn& progress) {
  const std::string temp = TempPathBeside(path);
  std::ofstream out(temp, std::ios::binary | std::ios::trunc);
  if (!out) {
    return Status::Error(path + ": cannot write (" + std::strerror(errno) +
                         "); check the directory exists and is writable");
  }
  StatusOr<PerfettoStats> stats = WritePerfetto(timeline, out, progress);
  out.close();
  std::error_code error;
  if (!stats.ok() || !out) {
    std::filesystem::remove(temp, error);
    return stats.ok() ? Status::Error(path + ": write failed (disk full?)") : stats.status();
  }
  std::filesystem::rename(temp, path, error);
  if (error) {
    const std::string why = error.message();
    std::filesystem::remove(temp, error);
    return Status::Error(path + ": cannot write (" + why + ")");
  }
  return stats;
}

StatusOr<PerfettoStats> WritePlanPerfettoFile(const proto::Schedule& plan, const SimResult& sim,
                                              const std::string& path) {
  std::unique_ptr<Timeline> timeline = PlanTimeline("plan (" + plan.policy() + ")", plan, sim);
  return WritePerfettoFile(*timeline, path, nullptr);
}

}  // namespace dc
