#include "analyzer/kineto.h"

#include <zlib.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <istream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <streambuf>

#include "analyzer/limits.h"

namespace dc {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr double kNsPerMicrosecond = 1000.0;
constexpr int64_t kProgressEvery = 100000;  // events between progress calls
constexpr size_t kReadBufferBytes = 1 << 16;
constexpr int64_t kCpuDeviceType = 0;  // c10::DeviceType::CPU in "[memory]" events
constexpr char kStepPrefix[] = "ProfilerStep#";
constexpr char kKinetoHint[] = "is this a PyTorch profiler trace?";

// ----- reading plain and gzip files as one stream -----

// A streambuf over a gzFile that remembers why reading stopped early.
class GzStreamBuf : public std::streambuf {
 public:
  explicit GzStreamBuf(gzFile file) : file_(file), buffer_(kReadBufferBytes) {}
  ~GzStreamBuf() override { gzclose(file_); }
  GzStreamBuf(const GzStreamBuf&) = delete;
  GzStreamBuf& operator=(const GzStreamBuf&) = delete;

  // Empty while reading went well.
  const std::string& error() const { return error_; }

 protected:
  int_type underflow() override {
    if (gptr() < egptr()) return traits_type::to_int_type(*gptr());
    if (!error_.empty()) return traits_type::eof();
    const int n = gzread(file_, buffer_.data(), static_cast<unsigned>(buffer_.size()));
    int code = Z_OK;
    const char* message = gzerror(file_, &code);
    if (n <= 0 && (n < 0 || code != Z_OK)) {
      error_ = code == Z_BUF_ERROR
                   ? std::string(
                         "truncated gzip (unexpected end of file); the file was cut "
                         "off, copy or export it again")
                   : std::string("corrupt gzip data (") + (message ? message : "read error") +
                         "); export the trace again";
      return traits_type::eof();
    }
    if (n == 0) return traits_type::eof();
    setg(buffer_.data(), buffer_.data(), buffer_.data() + n);
    return traits_type::to_int_type(*gptr());
  }

 private:
  gzFile file_;
  std::vector<char> buffer_;
  std::string error_;
};

// ----- one file's events -----

std::optional<double> Number(const json& object, const char* key) {
  auto it = object.find(key);
  if (it == object.end()) return std::nullopt;
  if (it->is_number()) return it->get<double>();
  if (it->is_string()) {
    const std::string& text = it->get_ref<const std::string&>();
    char* end = nullptr;
    const double value = std::strtod(text.c_str(), &end);
    if (end != text.c_str() && *end == '\0') return value;
  }
  return std::nullopt;
}

std::string Text(const json& object, const char* key) {
  auto it = object.find(key);
  return it != object.end() && it->is_string() ? it->get<std::string>() : std::string();
}

std::string Lower(std::string text) {
  for (char& c : text) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return text;
}

// The range rules (analyzer/limits.h) for Kineto's numbers: each names what is wrong, and the
// reader prefixes the file and event index.
constexpr int64_t kMaxId = int64_t{1} << 62;  // pids, device ids, addresses, thread ids

std::string NumberText(double value) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.17g", value);
  return text;
}

// HTA's CommunicateKernelGroupingPattern for NCCL: ^nccl.* or .*ncclKernel.*.
bool IsNcclKernel(const std::string& name) {
  return name.starts_with("nccl") || name.find("ncclKernel") != std::string::npos ||
         name.find("ncclDevKernel") != std::string::npos;
}

struct RawActivity {
  TimelineActivity activity;  // rank_index filled later
  int64_t device = 0;         // the GPU "pid"
};

// What one file holds, times in ns on the file's own clock.
struct FileEvents {
  std::string path;
  std::optional<int> rank;
  std::vector<RawActivity> activities;
  std::vector<TimelineStep> cpu_steps, gpu_steps;
  std::vector<TimelineMemoryEvent> memory;
  std::map<std::pair<int64_t, int64_t>, std::string> thread_names;  // (pid, tid) -> name
  std::string device;
  int64_t device_memory_bytes = 0;
  int64_t skipped = 0;  // device events without a numeric ts
};

class EventReader {
 public:
  explicit EventReader(FileEvents* file) : file_(file) {}

  // The first event that broke a range rule ends the reading: its error names it.
  const Status& status() const { return status_; }

  void Read(const json& event, int64_t index) {
    if (!status_.ok()) return;
    index_ = index;
    const std::string ph = Text(event, "ph");
    if (ph == "X") {
      Complete(event);
    } else if ((ph == "i" || ph == "I") && Text(event, "name") == "[memory]") {
      Memory(event);
    } else if (ph == "M" && Text(event, "name") == "thread_name") {
      ThreadName(event);
    }
  }

 private:
  // `key` of `object` as an integer in [lo, hi] after scaling by `scale`; `fallback` where it is
  // absent or not a number, nullopt (and the reader's error) where it is out of range.
  std::optional<int64_t> Get(const json& object, const char* key, double scale, int64_t lo,
                             int64_t hi, int64_t fallback) {
    const std::optional<double> value = Number(object, key);
    if (!value) return fallback;
    std::optional<int64_t> scaled = TraceLimits::Scaled(*value, scale, lo, hi);
    if (!scaled && status_.ok()) {
      status_ =
          Status::Error(file_->path + ": traceEvents[" + std::to_string(index_) + "]: " + key +
                        " " + NumberText(*value) + " is out of range (" + std::to_string(lo) +
                        " to " + std::to_string(hi) + (scale != 1 ? " after scaling" : "") +
                        "); the trace is corrupt, export it again");
    }
    return scaled;
  }
  std::optional<int64_t> TimeNs(const json& object, const char* key) {
    return Get(object, key, kNsPerMicrosecond, -TraceLimits::kMaxAbsTimeNs,
               TraceLimits::kMaxAbsTimeNs, 0);
  }
  std::optional<int64_t> DurationNs(const json& object) {
    return Get(object, "dur", kNsPerMicrosecond, 0, TraceLimits::kMaxAbsTimeNs, 0);
  }
  // An activity or step from ts and dur, both checked; nullopt after an error.
  std::optional<std::pair<int64_t, int64_t>> Span(const json& event) {
    const std::optional<int64_t> start = TimeNs(event, "ts"), duration = DurationNs(event);
    if (!start || !duration) return std::nullopt;
    if (*start + *duration > TraceLimits::kMaxAbsTimeNs) {  // both within 2^61: no overflow
      status_ = Status::Error(file_->path + ": traceEvents[" + std::to_string(index_) +
                              "]: ts + dur is out of range; the trace is corrupt, export it again");
      return std::nullopt;
    }
    return std::pair{*start, *start + *duration};
  }

  static const json& Args(const json& event) {
    static const json kEmpty = json::object();
    auto it = event.find("args");
    return it != event.end() && it->is_object() ? *it : kEmpty;
  }

  void Complete(const json& event) {
    const std::string category = Lower(Text(event, "cat"));
    const std::string name = Text(event, "name");
    if (category == "user_annotation" || category == "gpu_user_annotation") {
      Step(event, name, category == "user_annotation" ? &file_->cpu_steps : &file_->gpu_steps);
      return;
    }
    const bool kernel = category == "kernel";
    const bool copy = category == "gpu_memcpy" || category == "gpu_memset" ||
                      category == "memcpy" || category == "memset";
    if (!kernel && !copy) return;
    if (!Number(event, "ts")) {
      ++file_->skipped;
      return;
    }
    const json& args = Args(event);
    const std::optional<std::pair<int64_t, int64_t>> span = Span(event);
    const std::optional<int64_t> tid = Get(event, "tid", 1, 0, TraceLimits::kMaxStreamId, 0);
    const std::optional<int64_t> pid = Get(event, "pid", 1, -kMaxId, kMaxId, 0);
    if (!span || !tid || !pid) return;
    const std::optional<int64_t> stream =
        Get(args, "stream", 1, 0, TraceLimits::kMaxStreamId, *tid);
    const std::optional<int64_t> bytes = Get(args, "bytes", 1, 0, TraceLimits::kMaxRecordBytes, 0);
    const std::optional<int64_t> device = Get(args, "device", 1, -kMaxId, kMaxId, *pid);
    if (!stream || !bytes || !device) return;
    RawActivity raw;
    TimelineActivity& a = raw.activity;
    a.kind = copy                 ? ActivityClass::kCopy
             : IsNcclKernel(name) ? ActivityClass::kCommunication
                                  : ActivityClass::kCompute;
    a.name = name;
    a.start_ns = span->first;
    a.end_ns = span->second;
    a.stream_id = *stream;
    a.bytes = *bytes;
    raw.device = *device;
    file_->activities.push_back(std::move(raw));
  }

  void Step(const json& event, const std::string& name, std::vector<TimelineStep>* steps) {
    if (!name.starts_with(kStepPrefix)) return;
    if (!Number(event, "ts")) return;
    const std::optional<std::pair<int64_t, int64_t>> span = Span(event);
    if (!span) return;
    const char* digits = name.c_str() + std::strlen(kStepPrefix);
    char* end = nullptr;
    errno = 0;
    const long long number = std::strtoll(digits, &end, 10);
    if (end == digits || *end != '\0' || errno == ERANGE || number < 0 ||
        number > TraceLimits::kMaxIndex) {
      status_ = Status::Error(file_->path + ": traceEvents[" + std::to_string(index_) +
                              "]: step marker '" + name +
                              "' has no step number in range; export the trace again");
      return;
    }
    TimelineStep step;
    step.step = static_cast<int>(number);
    step.start_ns = span->first;
    step.end_ns = span->second;
    steps->push_back(step);
  }

  void Memory(const json& event) {
    const json& args = Args(event);
    if (!Number(event, "ts") || !Number(args, "Bytes")) return;
    const std::optional<int64_t> device_type = Get(args, "Device Type", 1, -kMaxId, kMaxId, -1);
    if (!device_type || *device_type == kCpuDeviceType) return;
    const std::optional<int64_t> ts = TimeNs(event, "ts");
    // Negative bytes free what was allocated.
    const std::optional<int64_t> bytes =
        Get(args, "Bytes", 1, -TraceLimits::kMaxRecordBytes, TraceLimits::kMaxRecordBytes, 0);
    const std::optional<int64_t> address = Get(args, "Addr", 1, -kMaxId, kMaxId, 0);
    if (!ts || !bytes || !address) return;
    TimelineMemoryEvent e;
    e.ts_ns = *ts;
    e.address = *address;
    e.bytes = *bytes < 0 ? -*bytes : *bytes;
    e.alloc = *bytes >= 0;
    e.kind = "allocated";
    file_->memory.push_back(e);
  }

  void ThreadName(const json& event) {
    const std::string name = Text(Args(event), "name");
    if (name.empty() || !Number(event, "pid") || !Number(event, "tid")) return;
    const std::optional<int64_t> pid = Get(event, "pid", 1, -kMaxId, kMaxId, 0);
    const std::optional<int64_t> tid = Get(event, "tid", 1, -kMaxId, kMaxId, 0);
    if (!pid || !tid) return;
    file_->thread_names[{*pid, *tid}] = name;
  }

  FileEvents* file_;
  Status status_;
  int64_t index_ = 0;
};

// A top-level number (distributedInfo, deviceProperties) as an integer in [lo, hi]; `fallback`
// where absent, an error naming the file where out of range.
StatusOr<int64_t> TopLevelInteger(const std::string& path, const json& object, const char* key,
                                  int64_t lo, int64_t hi, int64_t fallback) {
  const std::optional<double> value = Number(object, key);
  if (!value) return fallback;
  std::optional<int64_t> integer = TraceLimits::Scaled(*value, 1, lo, hi);
  if (!integer) {
    return Status::Error(path + ": " + key + " " + NumberText(*value) + " is out of range (" +
                         std::to_string(lo) + " to " + std::to_string(hi) +
                         "); the trace is corrupt, export it again");
  }
  return *integer;
}

// The top-level fields besides traceEvents (kept, they are small).
Status ReadMetadata(const json& document, FileEvents* file) {
  if (auto info = document.find("distributedInfo"); info != document.end() && info->is_object()) {
    if (Number(*info, "rank")) {
      DC_ASSIGN_OR_RETURN(int64_t rank,
                          TopLevelInteger(file->path, *info, "rank", 0, TraceLimits::kMaxIndex, 0));
      file->rank = static_cast<int>(rank);
    }
  }
  auto devices = document.find("deviceProperties");
  if (devices == document.end() || !devices->is_array() || devices->empty()) return Status::Ok();
  const int64_t wanted = file->activities.empty() ? -1 : file->activities.front().device;
  const json* chosen = &devices->front();
  for (const json& d : *devices) {
    if (!d.is_object()) continue;
    DC_ASSIGN_OR_RETURN(int64_t id, TopLevelInteger(file->path, d, "id", -kMaxId, kMaxId, -2));
    if (id == wanted) chosen = &d;
  }
  if (!chosen->is_object()) return Status::Ok();
  file->device = Text(*chosen, "name");
  DC_ASSIGN_OR_RETURN(
      file->device_memory_bytes,
      TopLevelInteger(file->path, *chosen, "totalGlobalMem", 0, TraceLimits::kMaxLiveBytes, 0));
  return Status::Ok();
}

// One line from nlohmann's message: "parse error at line 1, column 5: ...".
std::string ParseErrorText(const json::exception& e) {
  std::string text = e.what();
  if (const size_t close = text.find("] ");
      text.starts_with("[json.exception") && close != std::string::npos) {
    text = text.substr(close + 2);
  }
  std::replace(text.begin(), text.end(), '\n', ' ');
  return text;
}

Status ParseStream(std::istream& in, const ProgressFn& progress, FileEvents* file) {
  EventReader reader(file);
  bool in_events = false, saw_events = false;
  std::string key;  // the latest top-level key
  int64_t events = 0;
  auto callback = [&](int depth, json::parse_event_t event, json& parsed) {
    if (depth == 1 && event == json::parse_event_t::key) key = parsed.get<std::string>();
    if (depth == 1 && event == json::parse_event_t::array_start && key == "traceEvents") {
      in_events = true;
    } else if (depth == 1 && event == json::parse_event_t::array_end && in_events) {
      in_events = false;
      saw_events = true;
    } else if (in_events && depth == 2 &&
               (event == json::parse_event_t::object_end || event == json::parse_event_t::value)) {
      if (parsed.is_object()) reader.Read(parsed, events);
      ++events;
      if (progress && events % kProgressEvery == 0) progress(file->path, events);
      return false;  // drop it: the document never holds the events
    }
    return true;
  };
  json document;
  try {
    document = json::parse(in, callback);
  } catch (const json::parse_error& e) {
    return Status::Error(file->path + ": invalid JSON (" + ParseErrorText(e) + "); " + kKinetoHint);
  } catch (const json::exception& e) {
    // out_of_range (a number such as 1e400 that no double holds) and the rest.
    return Status::Error(file->path + ": invalid JSON (" + ParseErrorText(e) + "); " + kKinetoHint);
  }
  DC_RETURN_IF_ERROR(reader.status());
  if (!document.is_object() || !saw_events) {
    return Status::Error(file->path + ": no traceEvents array; " + kKinetoHint);
  }
  return ReadMetadata(document, file);
}

Status ReadFile(const std::string& path, const ProgressFn& progress, FileEvents* file) {
  file->path = path;
  gzFile gz = gzopen(path.c_str(), "rb");  // reads plain files as they are
  if (gz == nullptr) {
    return Status::Error(path + ": cannot open (" + std::strerror(errno) + ")");
  }
  gzbuffer(gz, kReadBufferBytes);
  GzStreamBuf buffer(gz);
  std::istream in(&buffer);
  Status parsed = ParseStream(in, progress, file);
  // A cut-off gzip shows up as a JSON error; say what really happened.
  if (!buffer.error().empty()) return Status::Error(path + ": " + buffer.error());
  return parsed;
}

// ----- the run -----

StatusOr<std::vector<std::string>> ExpandPaths(const std::vector<std::string>& paths) {
  std::vector<std::string> files;
  for (const std::string& path : paths) {
    std::error_code error;
    if (!fs::is_directory(path, error)) {
      files.push_back(path);
      continue;
    }
    std::vector<std::string> found;
    for (const fs::directory_entry& entry : fs::directory_iterator(path, error)) {
      const std::string name = entry.path().string();
      if (entry.is_regular_file() && (name.ends_with(".json") || name.ends_with(".json.gz"))) {
        found.push_back(name);
      }
    }
    if (error) return Status::Error(path + ": cannot list (" + error.message() + ")");
    if (found.empty()) {
      return Status::Error(path + ": no .json or .json.gz files; pass PyTorch profiler traces");
    }
    std::sort(found.begin(), found.end());
    files.insert(files.end(), found.begin(), found.end());
  }
  return files;
}

// Files in rank order: distributedInfo.rank where every file has it, else the given order.
StatusOr<std::vector<FileEvents*>> RankOrder(std::vector<FileEvents>& files) {
  std::vector<FileEvents*> order;
  for (FileEvents& f : files) order.push_back(&f);
  const bool all_ranked =
      std::all_of(files.begin(), files.end(), [](const FileEvents& f) { return f.rank; });
  if (!all_ranked) {
    for (size_t i = 0; i < order.size(); ++i) order[i]->rank = static_cast<int>(i);
    return order;
  }
  std::stable_sort(order.begin(), order.end(),
                   [](const FileEvents* a, const FileEvents* b) { return *a->rank < *b->rank; });
  for (size_t i = 1; i < order.size(); ++i) {
    if (*order[i]->rank == *order[i - 1]->rank) {
      return Status::Error(order[i]->path + ": rank " + std::to_string(*order[i]->rank) +
                           " again (also " + order[i - 1]->path + "); pass one trace per rank");
    }
  }
  return order;
}

int64_t EarliestNs(const std::vector<FileEvents>& files) {
  int64_t earliest = std::numeric_limits<int64_t>::max();
  for (const FileEvents& f : files) {
    for (const RawActivity& a : f.activities) earliest = std::min(earliest, a.activity.start_ns);
    for (const TimelineStep& s : f.cpu_steps) earliest = std::min(earliest, s.start_ns);
    for (const TimelineStep& s : f.gpu_steps) earliest = std::min(earliest, s.start_ns);
    for (const TimelineMemoryEvent& e : f.memory) earliest = std::min(earliest, e.ts_ns);
  }
  return earliest == std::numeric_limits<int64_t>::max() ? 0 : earliest;
}

// The file with the latest time, and that time (ends included).
std::pair<const FileEvents*, int64_t> Latest(const std::vector<FileEvents>& files) {
  std::pair<const FileEvents*, int64_t> latest{nullptr, std::numeric_limits<int64_t>::min()};
  auto see = [&](const FileEvents& f, int64_t ns) {
    if (ns > latest.second) latest = {&f, ns};
  };
  for (const FileEvents& f : files) {
    for (const RawActivity& a : f.activities) see(f, a.activity.end_ns);
    for (const TimelineStep& s : f.cpu_steps) see(f, s.end_ns);
    for (const TimelineStep& s : f.gpu_steps) see(f, s.end_ns);
    for (const TimelineMemoryEvent& e : f.memory) see(f, e.ts_ns);
  }
  return latest;
}

void AddRank(FileEvents& file, int rank_index, int64_t origin_ns, TimelineData* data) {
  data->ranks.push_back({*file.rank, *file.rank, file.device, file.device_memory_bytes});
  std::set<std::pair<int64_t, int64_t>> streams;  // (device, stream)
  for (RawActivity& raw : file.activities) {
    TimelineActivity& a = raw.activity;
    a.rank_index = rank_index;
    a.start_ns -= origin_ns;
    a.end_ns -= origin_ns;
    streams.insert({raw.device, a.stream_id});
    data->activities.push_back(std::move(a));
  }
  for (const auto& [device, stream] : streams) {
    auto name = file.thread_names.find({device, stream});
    if (name != file.thread_names.end())
      data->stream_names.push_back({rank_index, stream, name->second});
  }
  for (TimelineStep s : file.cpu_steps.empty() ? file.gpu_steps : file.cpu_steps) {
    s.rank_index = rank_index;
    s.start_ns -= origin_ns;
    s.end_ns -= origin_ns;
    data->steps.push_back(s);
  }
  for (TimelineMemoryEvent e : file.memory) {
    e.rank_index = rank_index;
    e.ts_ns -= origin_ns;
    data->memory_events.push_back(std::move(e));
  }
  if (file.skipped > 0) {
    data->notes.push_back(file.path + ": " + std::to_string(file.skipped) +
                          " device event(s) without a numeric ts skipped");
  }
  if (file.memory.empty()) {
    data->notes.push_back(file.path +
                          ": no [memory] events (profile with profile_memory=True for a memory "
                          "timeline)");
  }
}

}  // namespace

StatusOr<TimelineData> ReadKinetoTraces(const std::vector<std::string>& paths,
                                        const ProgressFn& progress) {
  DC_ASSIGN_OR_RETURN(std::vector<std::string> names, ExpandPaths(paths));
  std::vector<FileEvents> files(names.size());
  bool any_activity = false;
  for (size_t i = 0; i < names.size(); ++i) {
    DC_RETURN_IF_ERROR(ReadFile(names[i], progress, &files[i]));
    any_activity = any_activity || !files[i].activities.empty();
  }
  if (!any_activity) {
    return Status::Error(names.front() +
                         ": no GPU kernels, copies or memsets in traceEvents; profile with "
                         "ProfilerActivity.CUDA");
  }
  DC_ASSIGN_OR_RETURN(std::vector<FileEvents*> order, RankOrder(files));
  TimelineData data;
  data.path = paths.size() == 1 ? paths.front()
                                : names.front() + " (+" + std::to_string(names.size() - 1) + ")";
  data.format = TimelineFormat::kKineto;
  const int64_t origin_ns = EarliestNs(files);
  // Times move so the earliest is 0: the rest must stay within the range rules.
  if (const auto [file, latest_ns] = Latest(files);
      file && latest_ns - origin_ns > TraceLimits::kMaxAbsTimeNs) {
    return Status::Error(file->path +
                         ": events span more than 73 years from the run's earliest; the "
                         "timestamps are corrupt, export the traces again");
  }
  for (size_t r = 0; r < order.size(); ++r) {
    AddRank(*order[r], static_cast<int>(r), origin_ns, &data);
  }
  return data;
}

StatusOr<std::unique_ptr<Timeline>> OpenKinetoTimeline(const std::vector<std::string>& paths,
                                                       const ProgressFn& progress) {
  DC_ASSIGN_OR_RETURN(TimelineData data, ReadKinetoTraces(paths, progress));
  return MakeTimeline(std::move(data));
}

}  // namespace dc
