#include "executor/checkpoint.h"

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>
#include <utility>

#include "executor/data.h"
#include "schemas/digest.h"
#include "schemas/effects.h"
#include "schemas/files.h"
#include "schemas/units.h"

namespace dc {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr char kFormat[] = "dc-checkpoint";
constexpr int kVersion = 1;
constexpr char kManifest[] = "manifest.json";
constexpr char kStepPrefix[] = "step-";
constexpr char kPartialPrefix[] = ".partial-step-";

// The tensors a checkpoint holds: params and their Adam states (grads are empty between steps).
bool IsSaved(const proto::Tensor& t) {
  return t.role() == proto::ROLE_PARAM || t.role() == proto::ROLE_OPTIMIZER_STATE;
}

std::string ShardFileName(int rank, int world) {
  char name[64];
  std::snprintf(name, sizeof(name), "rank-%05d-of-%05d.safetensors", rank, world);
  return name;
}

int64_t GlobalBatchSequences(const proto::ModelConfig& c, int world) {
  return static_cast<int64_t>(world) * c.micro_batch() * c.gas();
}

// The model settings that decide what the saved tensors mean beyond their shapes.
json ModelOf(const proto::ModelConfig& c) {
  return {{"family", c.family()}, {"layers", c.layers()},         {"hidden", c.hidden()},
          {"heads", c.heads()},   {"kv_heads", c.kv_heads()},     {"ffn", c.ffn()},
          {"vocab", c.vocab()},   {"experts", c.experts()},       {"top_k", c.top_k()},
          {"seq", c.seq()},       {"rope_theta", c.rope_theta()}, {"norm_eps", c.norm_eps()}};
}

// What each rank tells the others after writing its file: whether it did, the file's size and
// its SHA-256, as exact doubles (the communicator reduces doubles): 12 hex digits (48 bits) per
// double.
constexpr int kDigestChunks = 6;
constexpr int kDigestChunkHexDigits = 12;
constexpr int kSlotsPerRank = 2 + kDigestChunks;

struct RankFile {
  bool ok = false;
  int64_t bytes = 0;
  std::string sha256;
};

StatusOr<std::vector<RankFile>> Exchange(Communicator* comm, const RankFile& mine) {
  const int world = comm->world_size();
  std::vector<double> slots(static_cast<size_t>(world) * kSlotsPerRank, 0.0);
  double* own = slots.data() + static_cast<size_t>(comm->rank()) * kSlotsPerRank;
  own[0] = mine.ok ? 1.0 : 0.0;
  own[1] = static_cast<double>(mine.bytes);
  for (int c = 0; c < kDigestChunks && mine.ok; ++c) {
    const std::string chunk = mine.sha256.substr(c * kDigestChunkHexDigits, kDigestChunkHexDigits);
    own[2 + c] = static_cast<double>(std::stoull(chunk, nullptr, 16));
  }
  DC_RETURN_IF_ERROR(comm->AllReduceSum(slots.data(), static_cast<int64_t>(slots.size())));
  std::vector<RankFile> files(world);
  for (int r = 0; r < world; ++r) {
    const double* s = slots.data() + static_cast<size_t>(r) * kSlotsPerRank;
    files[r].ok = s[0] == 1.0;
    files[r].bytes = static_cast<int64_t>(s[1]);
    for (int c = 0; c < kDigestChunks; ++c) {
      const int digits =
          c + 1 < kDigestChunks ? kDigestChunkHexDigits : 64 - c * kDigestChunkHexDigits;
      char hex[32];
      std::snprintf(hex, sizeof(hex), "%0*" PRIx64, digits, static_cast<uint64_t>(s[2 + c]));
      files[r].sha256 += hex;
    }
  }
  return files;
}

// Every rank learns whether `ok` holds on all of them.
StatusOr<bool> AllOk(Communicator* comm, bool ok) {
  double failures = ok ? 0.0 : 1.0;
  DC_RETURN_IF_ERROR(comm->AllReduceSum(&failures, 1));
  return failures == 0.0;
}

// One saved tensor's shard, as a rank's file holds it.
struct ShardEntry {
  int tensor = 0;  // id
  std::string name;
  int64_t elements = 0;
};

std::vector<ShardEntry> ShardEntries(const proto::Program& program, int world) {
  std::vector<ShardEntry> entries;
  for (const proto::Tensor& t : program.tensors()) {
    if (IsSaved(t)) entries.push_back({t.id(), t.name(), ShardElements(NumElements(t), world)});
  }
  return entries;
}

// Fills `bytes` of entry `index`'s shard into `out`.
using ShardReader = std::function<Status(size_t index, char* out, int64_t bytes)>;

// Waits until `gate` exists (CheckpointOptions::writer_gate_for_tests); empty: at once.
void WaitForGate(const std::string& gate) {
  constexpr auto kGatePoll = std::chrono::milliseconds(10);
  std::error_code error;
  while (!gate.empty() && !fs::exists(gate, error)) std::this_thread::sleep_for(kGatePoll);
}

// A rank's shard file at `path`, one tensor at a time from `read`, then its size and SHA-256.
StatusOr<RankFile> WriteRankFile(const std::string& path, const std::vector<ShardEntry>& entries,
                                 const ShardReader& read, int rank, int world, int64_t step,
                                 const std::string& gate) {
  std::vector<safetensors::TensorToWrite> tensors;
  bool gated = false;
  for (size_t i = 0; i < entries.size(); ++i) {
    safetensors::TensorToWrite w;
    w.name = entries[i].name;
    w.dtype = proto::DTYPE_F32;
    w.shape = {entries[i].elements};
    w.fill = [&, i](char* out, int64_t bytes) {
      if (!gated) WaitForGate(gate);  // after the header: the file is half-written
      gated = true;
      return read(i, out, bytes);
    };
    tensors.push_back(std::move(w));
  }
  DC_RETURN_IF_ERROR(safetensors::Write(path, std::move(tensors),
                                        {{"format", "dc-checkpoint-shard"},
                                         {"rank", std::to_string(rank)},
                                         {"world_size", std::to_string(world)},
                                         {"step", std::to_string(step)}}));
  RankFile file;
  DC_ASSIGN_OR_RETURN(file.sha256, Sha256OfFile(path));
  std::error_code error;
  file.bytes = static_cast<int64_t>(fs::file_size(path, error));
  if (error) return Status::Error(path + ": cannot read its size (" + error.message() + ")");
  file.ok = true;
  return file;
}

// The outcome of one rank's shard file.
struct Written {
  StatusOr<RankFile> file = Status::Error("not written");
  double seconds = 0;
};

// One thread that runs one job at a time: a rank's background writer.
class WriterThread {
 public:
  WriterThread() : thread_([this] { Loop(); }) {}
  ~WriterThread() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      quit_ = true;
    }
    changed_.notify_all();
    thread_.join();
  }
  WriterThread(const WriterThread&) = delete;
  WriterThread& operator=(const WriterThread&) = delete;

  // Precondition: no job, or the last one's Wait has returned.
  void Start(std::function<Written()> job) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job_ = std::move(job);
      done_.reset();
    }
    changed_.notify_all();
  }
  bool Done() {
    std::lock_guard<std::mutex> lock(mutex_);
    return done_.has_value();
  }
  Written Wait() {
    std::unique_lock<std::mutex> lock(mutex_);
    changed_.wait(lock, [&] { return done_.has_value(); });
    Written written = std::move(*done_);
    done_.reset();
    return written;
  }

 private:
  void Loop() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      changed_.wait(lock, [&] { return quit_ || job_ != nullptr; });
      if (job_ == nullptr) return;  // quit, nothing left to write
      std::function<Written()> job = std::move(job_);
      job_ = nullptr;
      lock.unlock();
      Written written = job();
      lock.lock();
      done_ = std::move(written);
      changed_.notify_all();
    }
  }

  std::mutex mutex_;
  std::condition_variable changed_;
  std::function<Written()> job_;
  std::optional<Written> done_;
  bool quit_ = false;
  std::thread thread_;  // last: starts once the rest is made
};

std::optional<int64_t> StepOfName(const std::string& name, const std::string& prefix) {
  if (name.rfind(prefix, 0) != 0 || name.size() == prefix.size() ||
      name.size() > prefix.size() + 18) {
    return std::nullopt;
  }
  int64_t step = 0;
  for (size_t i = prefix.size(); i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return std::nullopt;
    step = step * 10 + (name[i] - '0');
  }
  return step;
}

// Complete checkpoints (by step) in `dir`, newest first.
std::vector<std::pair<int64_t, fs::path>> CompleteCheckpoints(const std::string& dir) {
  std::vector<std::pair<int64_t, fs::path>> found;
  std::error_code error;
  for (const auto& entry : fs::directory_iterator(dir, error)) {
    const std::optional<int64_t> step = StepOfName(entry.path().filename().string(), kStepPrefix);
    if (step && fs::exists(entry.path() / kManifest, error)) found.push_back({*step, entry.path()});
  }
  std::sort(found.begin(), found.end(),
            [](const auto& a, const auto& b) { return a.first > b.first; });
  return found;
}

// Rank 0, once every rank's file is in `partial`: the manifest, then the rename that makes the
// checkpoint complete (Prune removes the old ones).
Status Publish(const CheckpointOptions& options, const proto::Program& program, int world,
               int64_t step, const fs::path& partial, const std::vector<RankFile>& files) {
  json manifest;
  manifest["format"] = kFormat;
  manifest["version"] = kVersion;
  manifest["step"] = step;
  manifest["world_size"] = world;
  manifest["global_batch_sequences"] = GlobalBatchSequences(program.config(), world);
  manifest["plan_digest"] = options.plan_digest;
  manifest["program_digest"] = DigestOf(program);
  manifest["model"] = ModelOf(program.config());
  manifest["state"] =
      "dc's initial values and data are counter-based (seed, element, sample index): the step "
      "is the whole generator and data state";
  json tensors = json::object();
  for (const proto::Tensor& t : program.tensors()) {
    if (IsSaved(t)) tensors[t.name()] = std::vector<int64_t>(t.shape().begin(), t.shape().end());
  }
  manifest["tensors"] = tensors;
  json shards = json::array();
  for (int r = 0; r < world; ++r) {
    shards.push_back({{"file", ShardFileName(r, world)},
                      {"bytes", files[r].bytes},
                      {"sha256", files[r].sha256}});
  }
  manifest["shards"] = shards;
  DC_RETURN_IF_ERROR(WriteFileAtomic((partial / kManifest).string(), manifest.dump(1) + "\n"));
  const fs::path final_dir = fs::path(options.dir) / CheckpointDirName(step);
  std::error_code error;
  fs::remove_all(final_dir, error);
  fs::rename(partial, final_dir, error);
  if (error) {
    return Status::Error(final_dir.string() + ": cannot publish the checkpoint (" +
                         error.message() + "); is the directory writable?");
  }
  return Status::Ok();
}

// Rank 0, after a publish: the complete checkpoints past `keep` and what killed saves left,
// except the partial directory of the save in flight (`writing`, when one is). Unlinking a
// checkpoint's files (tens of MiB just written) takes longer than the publish itself, so a
// background saver does it on its writer thread.
void Prune(const std::string& dir, int keep, std::optional<int64_t> writing) {
  std::error_code error;
  const auto complete = CompleteCheckpoints(dir);
  for (size_t i = static_cast<size_t>(std::max(keep, 1)); i < complete.size(); ++i) {
    fs::remove_all(complete[i].second, error);
  }
  for (const auto& entry : fs::directory_iterator(dir, error)) {
    const std::optional<int64_t> step =
        StepOfName(entry.path().filename().string(), kPartialPrefix);
    if (step && step != writing) fs::remove_all(entry.path(), error);
  }
}

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// One rank's checkpoint saving over a run (AttachCheckpointSaver).
class Saver {
 public:
  explicit Saver(CheckpointOptions options) : options_(std::move(options)) {}

  Status AfterStep(TrainingState& state) {
    const int64_t step = state.steps_done();
    const bool due = step == options_.final_step ||
                     (options_.every_steps > 0 && step % options_.every_steps == 0);
    if (in_flight_ && !due) {
      // Published as soon as every rank's writer is done, not at the next save point: a run
      // killed before that still has this checkpoint.
      const auto start = std::chrono::steady_clock::now();
      double busy = written_ || writer_->Done() ? 0.0 : 1.0;
      DC_RETURN_IF_ERROR(state.comm()->AllReduceSum(&busy, 1));
      in_flight_->blocking_seconds += SecondsSince(start);
      return busy == 0.0 ? Finish(state) : Status::Ok();
    }
    if (!due) return Status::Ok();
    if (in_flight_) DC_RETURN_IF_ERROR(Finish(state));
    DC_RETURN_IF_ERROR(Begin(state, step));
    return options_.background ? Status::Ok() : Finish(state);
  }

  Status AtEnd(TrainingState& state, bool run_failed) {
    Status finished = Status::Ok();
    if (in_flight_ && run_failed) {
      if (!written_) (void)writer_->Wait();
      in_flight_.reset();
      written_.reset();
    } else if (in_flight_) {
      finished = Finish(state);
    }
    if (finished.ok() && !run_failed && prune_due_) Prune(options_.dir, options_.keep, {});
    prune_due_ = false;
    snapshot_.host.reset();  // while the device that made it is there (pinned on cuda)
    return finished;
  }

 private:
  struct InFlight {
    int64_t step = 0;
    fs::path partial;
    std::chrono::steady_clock::time_point start;
    double blocking_seconds = 0;
  };

  // Step `step`'s save: its partial directory, then the rank's file written here
  // (!background) or the state's snapshot handed to the writer.
  Status Begin(TrainingState& state, int64_t step) {
    const auto start = std::chrono::steady_clock::now();
    Communicator* comm = state.comm();
    const int rank = comm->rank(), world = comm->world_size();
    const fs::path partial = fs::path(options_.dir) / (kPartialPrefix + std::to_string(step));
    // A killed save of this step may have left files: rank 0 clears them before anyone writes.
    std::error_code error;
    if (rank == 0) fs::remove_all(partial, error);
    DC_RETURN_IF_ERROR(AllOk(comm, true).status());
    fs::create_directories(partial, error);
    const std::string path = (partial / ShardFileName(rank, world)).string();
    in_flight_ = InFlight{step, partial, start, 0};
    const std::vector<ShardEntry> entries = ShardEntries(state.program(), world);
    if (error) {
      written_ = Written{Status::Error(partial.string() + ": cannot create (" + error.message() +
                                       "); is --save writable?"),
                         0};
    } else if (!options_.background) {
      // Read when the writer reaches it: one shard in host memory at a time.
      const ShardReader read = [&](size_t i, char* out, int64_t bytes) -> Status {
        DC_ASSIGN_OR_RETURN(const std::vector<float> shard, state.ReadShard(entries[i].tensor));
        if (static_cast<int64_t>(shard.size() * sizeof(float)) != bytes) {
          return Status::Error("its shard has " + std::to_string(shard.size()) +
                               " elements, not the expected " +
                               std::to_string(bytes / sizeof(float)));
        }
        std::memcpy(out, shard.data(), static_cast<size_t>(bytes));
        return Status::Ok();
      };
      const auto write_start = std::chrono::steady_clock::now();
      written_ = Written{WriteRankFile(path, entries, read, rank, world, step, ""), 0};
      written_->seconds = SecondsSince(write_start);
    } else {
      std::vector<int> tensors;
      for (const ShardEntry& e : entries) tensors.push_back(e.tensor);
      if (Status snapped = state.StartSnapshot(tensors, &snapshot_); !snapped.ok()) {
        written_ = Written{snapped, 0};
      } else {
        if (writer_ == nullptr) writer_ = std::make_unique<WriterThread>();
        const bool prune = prune_due_;
        prune_due_ = false;
        writer_->Start([this, path, entries, rank, world, step, prune] {
          const auto write_start = std::chrono::steady_clock::now();
          if (prune) Prune(options_.dir, options_.keep, step);
          Written written;
          const Status copied = snapshot_.wait();
          const char* host =
              static_cast<const char*>(copied.ok() ? snapshot_.host->data() : nullptr);
          const ShardReader read = [&](size_t i, char* out, int64_t bytes) -> Status {
            if (snapshot_.offsets_bytes[i + 1] - snapshot_.offsets_bytes[i] != bytes) {
              return Status::Error("its snapshot is not the expected " + FormatBytes(bytes));
            }
            std::memcpy(out, host + snapshot_.offsets_bytes[i], static_cast<size_t>(bytes));
            return Status::Ok();
          };
          written.file = copied.ok() ? WriteRankFile(path, entries, read, rank, world, step,
                                                     options_.writer_gate_for_tests)
                                     : StatusOr<RankFile>(copied);
          written.seconds = SecondsSince(write_start);
          return written;
        });
      }
    }
    in_flight_->blocking_seconds = SecondsSince(start);
    return Status::Ok();
  }

  // The save in flight: waits for this rank's file, agrees with the other ranks, and rank 0
  // publishes the checkpoint.
  Status Finish(TrainingState& state) {
    const auto start = std::chrono::steady_clock::now();
    Written written = written_ ? std::move(*written_) : writer_->Wait();
    written_.reset();
    const InFlight saving = *in_flight_;
    in_flight_.reset();
    Communicator* comm = state.comm();
    const int rank = comm->rank(), world = comm->world_size();
    const std::string what = "saving the checkpoint of step " + std::to_string(saving.step) + ": ";
    const RankFile mine = written.file.ok() ? *written.file : RankFile{};
    DC_ASSIGN_OR_RETURN(const std::vector<RankFile> files, Exchange(comm, mine));
    if (!written.file.ok()) {
      return Status::Error(what + written.file.status().message() +
                           "; the run stops here and the newest complete checkpoint in " +
                           options_.dir + " is kept: make room, then --resume it");
    }
    for (int r = 0; r < world; ++r) {
      if (!files[r].ok) {
        return Status::Error(what + "rank " + std::to_string(r) +
                             " could not write its shard (see its error)");
      }
    }
    const Status published =
        rank == 0 ? Publish(options_, state.program(), world, saving.step, saving.partial, files)
                  : Status::Ok();
    DC_ASSIGN_OR_RETURN(const bool all, AllOk(comm, published.ok()));
    if (!published.ok()) return published;
    if (!all) {
      return Status::Error("rank 0 could not publish the checkpoint of step " +
                           std::to_string(saving.step));
    }
    // Rank 0 prunes between steps when it writes between steps, else on its writer thread
    // before the next save's file (or at the end).
    if (rank == 0 && !options_.background) Prune(options_.dir, options_.keep, {});
    prune_due_ = rank == 0 && options_.background;
    if (rank == 0 && options_.on_saved) {
      SavedCheckpoint saved;
      saved.step = saving.step;
      saved.path = (fs::path(options_.dir) / CheckpointDirName(saving.step)).string();
      for (const RankFile& f : files) saved.bytes += f.bytes;
      saved.blocking_seconds = saving.blocking_seconds + SecondsSince(start);
      saved.background_seconds = written.seconds;
      saved.seconds = SecondsSince(saving.start);
      options_.on_saved(saved);
    }
    return Status::Ok();
  }

  const CheckpointOptions options_;
  std::optional<InFlight> in_flight_;
  std::optional<Written> written_;  // the save in flight's file, when written here
  bool prune_due_ = false;          // rank 0: a publish since the last Prune
  ShardSnapshot snapshot_;
  std::unique_ptr<WriterThread> writer_;  // after snapshot_: stops before it goes
};

// The checkpoint at `dir` (a step-N directory) against the program it would resume.
Status CheckManifest(const json& m, const proto::Program& program, int world_size) {
  if (!m.is_object() || m.value("format", "") != kFormat) {
    return Status::Error("not a dc checkpoint manifest");
  }
  if (!m.contains("version") || !m["version"].is_number_integer() || m["version"] != kVersion) {
    return Status::Error("checkpoint format version " + m.value("version", json()).dump() +
                         " is not this dc's " + std::to_string(kVersion));
  }
  for (const char* key : {"step", "world_size", "global_batch_sequences"}) {
    if (!m.contains(key) || !m[key].is_number_integer() || m[key].get<int64_t>() < 0) {
      return Status::Error(std::string("the manifest's \"") + key + "\" is not a count");
    }
  }
  const int64_t world = m["world_size"].get<int64_t>();
  if (world < 1 || world > 1 << 20)
    return Status::Error("the manifest's world size is out of range");
  if (!m.contains("shards") || !m["shards"].is_array() ||
      static_cast<int64_t>(m["shards"].size()) != world) {
    return Status::Error("the manifest does not list one shard file per rank");
  }
  const int64_t batch = GlobalBatchSequences(program.config(), world_size);
  const int64_t saved_batch = m["global_batch_sequences"].get<int64_t>();
  if (saved_batch != batch) {
    return Status::Error("the checkpoint trained with a global batch of " +
                         std::to_string(saved_batch) + " sequences per step, this plan has " +
                         std::to_string(batch) +
                         " (ranks x micro-batch x gas); re-plan so that "
                         "they match, or the data would not go on where it stopped");
  }
  const json& tensors = m.value("tensors", json::object());
  if (!tensors.is_object()) return Status::Error("the manifest's tensors are not an object");
  size_t saved = 0;
  for (const proto::Tensor& t : program.tensors()) {
    if (!IsSaved(t)) continue;
    ++saved;
    const std::vector<int64_t> shape(t.shape().begin(), t.shape().end());
    if (!tensors.contains(t.name())) {
      return Status::Error("the checkpoint has no " + t.name() +
                           "; resume with a plan of the same model");
    }
    if (tensors[t.name()] != json(shape)) {
      return Status::Error("the checkpoint's " + t.name() + " is " + tensors[t.name()].dump() +
                           " but the plan's is " + json(shape).dump() +
                           "; resume with a plan of the same model");
    }
  }
  if (tensors.size() != saved) {
    return Status::Error("the checkpoint holds " + std::to_string(tensors.size()) +
                         " tensors, the plan's model " + std::to_string(saved) +
                         "; resume with a plan of the same model");
  }
  const json model = ModelOf(program.config());
  if (!m.contains("model") || !m["model"].is_object())
    return Status::Error("the manifest has no model");
  for (const auto& [key, value] : model.items()) {
    const json saved = m["model"].value(key, json());
    if (saved != value) {
      return Status::Error("the checkpoint's model has " + key + " " + saved.dump() +
                           " but the plan's has " + value.dump() +
                           "; resume with a plan of the same model");
    }
  }
  return Status::Ok();
}

}  // namespace

std::string CheckpointDirName(int64_t step) {
  char name[32];
  std::snprintf(name, sizeof(name), "%s%08" PRId64, kStepPrefix, step);
  return name;
}

Status PrepareCheckpointDir(const std::string& dir) {
  std::error_code error;
  fs::create_directories(dir, error);
  if (error || !fs::is_directory(dir)) {
    return Status::Error(dir + ": cannot create the checkpoint directory (" +
                         (error ? error.message() : "not a directory") +
                         "); give --save a writable directory");
  }
  const std::string probe = (fs::path(dir) / ".dc-write-probe").string();
  DC_RETURN_IF_ERROR(
      WriteFileAtomic(probe, "").Prefixed(dir + ": cannot write checkpoints here: "));
  fs::remove(probe, error);
  return Status::Ok();
}

void AttachCheckpointSaver(CheckpointOptions options, RunOptions* run) {
  auto saver = std::make_shared<Saver>(std::move(options));
  run->after_step = [saver](TrainingState& state) { return saver->AfterStep(state); };
  run->at_end = [saver](TrainingState& state, bool run_failed) {
    return saver->AtEnd(state, run_failed);
  };
}

StatusOr<std::unique_ptr<Checkpoint>> Checkpoint::OpenNewest(const std::string& dir,
                                                             const proto::Program& program,
                                                             int world_size) {
  std::error_code error;
  if (!fs::is_directory(dir, error)) {
    return Status::Error(dir +
                         ": not a checkpoint directory (it does not exist); give --resume "
                         "the directory dc-run --save wrote");
  }
  const auto complete = CompleteCheckpoints(dir);
  if (complete.empty()) {
    return Status::Error(dir + ": holds no complete checkpoint (a step-N directory with " +
                         kManifest + "); give --resume the directory dc-run --save wrote");
  }
  const fs::path path = complete.front().second;
  const std::string manifest_path = (path / kManifest).string();
  auto fail = [&](const std::string& what) { return Status::Error(manifest_path + ": " + what); };
  DC_ASSIGN_OR_RETURN(const std::string text, ReadFileBytes(manifest_path));
  const json m = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (m.is_discarded()) {
    return fail("not valid JSON (damaged?); remove " + path.string() +
                " to resume from the checkpoint before it");
  }
  if (Status ok = CheckManifest(m, program, world_size); !ok.ok()) return fail(ok.message());
  auto checkpoint = std::make_unique<Checkpoint>();
  checkpoint->path_ = path.string();
  checkpoint->step_ = m["step"].get<int64_t>();
  checkpoint->world_size_ = m["world_size"].get<int>();
  if (checkpoint->step_ != complete.front().first) {
    return fail("says step " + std::to_string(checkpoint->step_) + " in the directory of step " +
                std::to_string(complete.front().first));
  }
  for (int r = 0; r < checkpoint->world_size_; ++r) {
    const json& shard = m["shards"][r];
    if (!shard.is_object() ||
        shard.value("file", "") != ShardFileName(r, checkpoint->world_size_) ||
        !shard.contains("sha256") || !shard["sha256"].is_string()) {
      return fail("shard " + std::to_string(r) + " is not listed as rank " + std::to_string(r) +
                  "'s file");
    }
    DC_ASSIGN_OR_RETURN(
        safetensors::File file,
        safetensors::File::Open((path / shard["file"].get<std::string>()).string()));
    for (const proto::Tensor& t : program.tensors()) {
      if (!IsSaved(t)) continue;
      const safetensors::TensorInfo* info = file.Find(t.name());
      const int64_t elements = ShardElements(NumElements(t), checkpoint->world_size_);
      if (info == nullptr || info->dtype != proto::DTYPE_F32 ||
          info->shape != std::vector<int64_t>{elements}) {
        return Status::Error(file.path() + ": has no fp32 shard of " + t.name() + " of " +
                             std::to_string(elements) + " elements; the checkpoint is damaged");
      }
    }
    checkpoint->shards_.push_back(std::move(file));
    checkpoint->shard_sha256_.push_back(shard["sha256"].get<std::string>());
  }
  checkpoint->verified_.assign(checkpoint->world_size_, false);
  return checkpoint;
}

StatusOr<bool> Checkpoint::Read(const proto::Tensor& tensor, int64_t offset, int64_t count,
                                float* out) {
  if (!IsSaved(tensor)) return false;
  const int64_t elements = NumElements(tensor);
  const int64_t shard = ShardElements(elements, world_size_);
  std::fill(out, out + count, 0.0f);
  // Elements past the tensor's end are the new layout's padding: zeros.
  for (int64_t at = offset; at < std::min(offset + count, elements);) {
    const int64_t rank = at / shard;
    const int64_t within = at - rank * shard;
    const int64_t n = std::min({shard - within, offset + count - at, elements - at});
    if (rank >= world_size_) break;
    safetensors::File& file = shards_[rank];
    if (!verified_[rank]) {
      DC_ASSIGN_OR_RETURN(const std::string sha, Sha256OfFile(file.path()));
      if (sha != shard_sha256_[rank]) {
        return Status::Error(file.path() +
                             ": its SHA-256 is not the manifest's; the checkpoint "
                             "is damaged (remove " +
                             path_ + " to resume from the one before)");
      }
      verified_[rank] = true;
    }
    DC_RETURN_IF_ERROR(file.ReadF32(*file.Find(tensor.name()), within, n, out + (at - offset)));
    at += n;
  }
  return true;
}

}  // namespace dc
