#include "rewriter/prefetch_timeline.h"

#include <google/protobuf/field_mask.pb.h>
#include <google/protobuf/util/field_mask_util.h>

#include <algorithm>
#include <array>
#include <functional>
#include <limits>
#include <string>

#include "schemas/effects.h"

namespace dc::rewriter_internal {
namespace {

constexpr int kNumStreams = proto::Stream_MAX + 1;
// Padding leaves of the segment tree: below any real value.
constexpr int64_t kNoPoint = std::numeric_limits<int64_t>::min() / 4;

// The buffer effects (schemas/effects.h) reduced to one byte delta per instruction.
class Deltas : public BufferListener {
 public:
  explicit Deltas(int num_instructions) : delta_(num_instructions, 0) {}
  void Allocated(int instruction, const BufferKey& /*key*/, int64_t size_bytes, BufferKind /*kind*/,
                 bool /*at_end*/, int /*handle*/) override {
    if (instruction >= 0) delta_[instruction] += size_bytes;
  }
  void Freed(int instruction, const BufferKey& /*key*/, int64_t size_bytes, BufferKind /*kind*/,
             bool /*at_end*/, int /*handle*/) override {
    delta_[instruction] -= size_bytes;
  }
  int64_t delta(int instruction) const { return delta_[instruction]; }

 private:
  std::vector<int64_t> delta_;
};

}  // namespace

// ----- LiveCurve -----

StatusOr<LiveCurve> LiveCurve::Build(const proto::Schedule& schedule, const SimResult& sim) {
  const int n = schedule.instructions_size();
  if (static_cast<int>(sim.start_seconds.size()) != n ||
      static_cast<int>(sim.end_seconds.size()) != n) {
    return Status::Error("the simulation does not belong to this schedule (" +
                         std::to_string(sim.start_seconds.size()) + " instructions simulated, " +
                         std::to_string(n) + " in the schedule)");
  }
  LiveCurve curve;
  for (int64_t bytes : PersistentBytesByKind(schedule)) {
    curve.persistent_bytes_ += bytes;
  }
  DC_RETURN_IF_ERROR(CheckReferences(schedule));
  Deltas deltas(n);
  DC_RETURN_IF_ERROR(BufferReplay(schedule, &deltas).Run());
  std::vector<int64_t> delta(n);
  std::vector<double> time(n);
  std::array<std::vector<int>, kNumStreams> by_stream;
  for (int i = 0; i < n; ++i) {
    const proto::Instruction& instr = schedule.instructions(i);
    delta[i] = deltas.delta(i);
    time[i] = EffectsAtEnd(instr.kind()) ? sim.end_seconds[i] : sim.start_seconds[i];
    const int stream = instr.stream() >= 0 && instr.stream() < kNumStreams ? instr.stream() : 0;
    by_stream[stream].push_back(i);
  }
  // Each stream's events are in time order already: merge the streams (time, then index).
  std::array<size_t, kNumStreams> next{};
  curve.point_of_.assign(n, 0);
  curve.times_.reserve(n);
  std::vector<int64_t> values;
  values.reserve(n);
  int64_t now = curve.persistent_bytes_;
  for (int p = 0; p < n; ++p) {
    int best = -1;
    for (int s = 0; s < kNumStreams; ++s) {
      if (next[s] == by_stream[s].size()) continue;
      const int i = by_stream[s][next[s]];
      if (best < 0) {
        best = s;
        continue;
      }
      const int b = by_stream[best][next[best]];
      if (time[i] < time[b] || (time[i] == time[b] && i < b)) best = s;
    }
    const int i = by_stream[best][next[best]++];
    now += delta[i];
    curve.point_of_[i] = p;
    curve.times_.push_back(time[i]);
    values.push_back(now);
  }
  curve.BuildTree(values);
  return curve;
}

void LiveCurve::BuildTree(const std::vector<int64_t>& values) {
  leaves_ = 1;
  while (leaves_ < static_cast<int>(values.size())) leaves_ *= 2;
  max_.assign(2 * leaves_, kNoPoint);
  added_.assign(2 * leaves_, 0);
  for (size_t i = 0; i < values.size(); ++i) max_[leaves_ + i] = values[i];
  for (int node = leaves_ - 1; node >= 1; --node) {
    max_[node] = std::max(max_[2 * node], max_[2 * node + 1]);
  }
}

LiveCurve LiveCurve::Flat(int64_t bytes) const {
  LiveCurve flat;
  flat.times_ = times_;
  flat.point_of_ = point_of_;
  flat.persistent_bytes_ = bytes;
  flat.BuildTree(std::vector<int64_t>(times_.size(), bytes));
  return flat;
}

int LiveCurve::FirstPointAtOrAfter(double time_seconds) const {
  return static_cast<int>(std::lower_bound(times_.begin(), times_.end(), time_seconds) -
                          times_.begin());
}

void LiveCurve::AddToNode(int node, int64_t bytes) {
  max_[node] += bytes;
  added_[node] += bytes;
}

void LiveCurve::Recompute(int first, int last) {
  auto recompute = [this](int node) {
    max_[node] = std::max(max_[2 * node], max_[2 * node + 1]) + added_[node];
  };
  // Both leaves are at the same depth: up in step until the paths meet, then once.
  for (first /= 2, last /= 2; first != last; first /= 2, last /= 2) {
    recompute(first);
    recompute(last);
  }
  for (; first >= 1; first /= 2) recompute(first);
}

void LiveCurve::Add(int begin, int end, int64_t bytes) {
  begin = std::max(begin, 0);
  end = std::min(end, size());
  if (begin >= end || bytes == 0) return;
  // The canonical cover of the leaves [lo, hi) takes the bytes; the ancestors of its two ends
  // are all the nodes whose maximum can change.
  const int first = begin + leaves_, last = end - 1 + leaves_;
  for (int lo = first, hi = end + leaves_; lo < hi; lo /= 2, hi /= 2) {
    if (lo & 1) AddToNode(lo++, bytes);
    if (hi & 1) AddToNode(--hi, bytes);
  }
  Recompute(first, last);
}

int64_t LiveCurve::Max(int begin, int end) const {
  begin = std::max(begin, 0);
  end = std::min(end, size());
  if (begin >= end) return persistent_bytes_;
  // Bottom-up over the canonical cover of [lo, hi). A node's maximum leaves out what was added
  // at its ancestors: once a level up, lo - 1 is an ancestor of every left cover node taken so
  // far and hi of every right one, so their additions join the running maxima level by level.
  int64_t left = kNoPoint, right = kNoPoint;
  int lo = begin + leaves_, hi = end + leaves_;
  for (; lo < hi; lo /= 2, hi /= 2) {
    if (lo & 1) left = std::max(left, max_[lo++]);
    if (hi & 1) right = std::max(right, max_[--hi]);
    left += added_[(lo - 1) / 2];
    right += added_[hi / 2];
  }
  for (int node = (lo - 1) / 2; node >= 1; node /= 2) left += added_[node];
  for (int node = hi / 2; node >= 1; node /= 2) right += added_[node];
  return std::max(left, right);
}

int LiveCurve::LeftmostFitting(int lo, int end, int64_t limit) const {
  // Max(p, end) does not grow with p: binary search for the first p that fits.
  int a = std::max(lo, 0), b = std::max(end, a);
  while (a < b) {
    const int mid = a + (b - a) / 2;
    if (Max(mid, end) <= limit) {
      b = mid;
    } else {
      a = mid + 1;
    }
  }
  return a;
}

// ----- GatherIndex -----

int GatherIndex::FirstUse(int gather) const {
  int first = -1;
  for (const auto& [param, span] : opened[gather]) {
    const int use = spans_by_param[param][span].first_use;
    if (use >= 0 && (first < 0 || use < first)) first = use;
  }
  return first;
}

GatherIndex IndexGathers(const proto::Schedule& schedule) {
  const proto::Program& program = schedule.program();
  const int n = schedule.instructions_size();
  GatherIndex index;
  index.spans_by_param.resize(program.tensors_size());
  index.compute_stream_before.resize(n);
  index.opened.resize(n);
  std::vector<int> open(program.tensors_size(), -1);  // span index of a live gathered param
  for (int i = 0; i < n; ++i) {
    const proto::Instruction& instr = schedule.instructions(i);
    index.compute_stream_before[i] = static_cast<int>(index.compute_stream.size());
    if (instr.stream() == proto::STREAM_COMPUTE) index.compute_stream.push_back(i);
    switch (instr.kind()) {
      case proto::INSTR_ALL_GATHER:
        for (int t : instr.tensors()) {
          auto& spans = index.spans_by_param[t];
          spans.push_back({i, -1, -1});
          open[t] = static_cast<int>(spans.size()) - 1;
          index.opened[i].emplace_back(t, open[t]);
        }
        break;
      case proto::INSTR_COMPUTE: {
        const proto::Op& op = program.ops(instr.op());
        if (op.phase() == proto::PHASE_OPTIMIZER) break;
        for (int t : op.inputs()) {
          if (program.tensors(t).role() != proto::ROLE_PARAM || open[t] < 0) continue;
          GatheredSpan& span = index.spans_by_param[t][open[t]];
          if (span.first_use < 0) span.first_use = i;
        }
        break;
      }
      case proto::INSTR_RELEASE:
        for (int t : instr.tensors()) {
          if (program.tensors(t).role() != proto::ROLE_PARAM || open[t] < 0) continue;
          index.spans_by_param[t][open[t]].release = i;
          open[t] = -1;
        }
        break;
      default:
        break;
    }
  }
  return index;
}

std::vector<int64_t> TensorBytes(const proto::Program& program) {
  std::vector<int64_t> bytes;
  bytes.reserve(program.tensors_size());
  for (const proto::Tensor& t : program.tensors()) bytes.push_back(TransientBytes(program, t));
  return bytes;
}

// ----- ScheduleEditor -----

ScheduleEditor::ScheduleEditor(const proto::Schedule& in, proto::Schedule* out)
    : in_(in),
      out_(out->mutable_instructions()),
      new_of_old_(in.instructions_size(), -1),
      drop_of_old_(in.instructions_size(), -1) {
  out_->Clear();
  out_->Reserve(in.instructions_size());
}

proto::Instruction* ScheduleEditor::Keep(int old) {
  proto::Instruction* instr = out_->Add();
  *instr = in_.instructions(old);
  new_of_old_[old] = out_->size() - 1;
  return instr;
}

proto::Instruction* ScheduleEditor::AddMerged(const std::vector<int>& olds) {
  proto::Instruction* instr = out_->Add();
  for (int old : olds) new_of_old_[old] = out_->size() - 1;
  return instr;
}

void ScheduleEditor::Drop(int old, std::vector<int> targets) {
  drop_of_old_[old] = static_cast<int>(drop_targets_.size());
  drop_targets_.push_back(std::move(targets));
}

void ScheduleEditor::Resolve(int old, std::vector<int>* out) {
  if (new_of_old_[old] >= 0) {
    out->push_back(new_of_old_[old]);
    return;
  }
  if (drop_of_old_[old] < 0) return;
  // Targets of a drop point to earlier instructions, so this terminates.
  for (int target : drop_targets_[drop_of_old_[old]]) {
    if (target < old) Resolve(target, out);
  }
}

Status ScheduleEditor::Finish() {
  for (int old = 0; old < static_cast<int>(new_of_old_.size()); ++old) {
    if (new_of_old_[old] < 0 && drop_of_old_[old] < 0) {
      return Status::Error("internal: instruction " + std::to_string(old) +
                           " was neither kept nor dropped by the pass");
    }
  }
  std::vector<int> deps;
  for (int i = 0; i < out_->size(); ++i) {
    proto::Instruction& instr = *out_->Mutable(i);
    deps.clear();
    for (int d : instr.deps()) {
      if (d >= 0 && d < static_cast<int>(new_of_old_.size())) Resolve(d, &deps);
    }
    // Most instructions keep their deps in order, one for one: renumber them in place.
    if (deps.size() == static_cast<size_t>(instr.deps_size()) &&
        std::adjacent_find(deps.begin(), deps.end(), std::greater_equal<int>()) == deps.end() &&
        (deps.empty() || deps.back() < i)) {
      for (int k = 0; k < instr.deps_size(); ++k) instr.set_deps(k, deps[k]);
      continue;
    }
    std::sort(deps.begin(), deps.end());
    deps.erase(std::unique(deps.begin(), deps.end()), deps.end());
    instr.clear_deps();
    for (int d : deps) {
      if (d == i) continue;  // merged with what it waited for
      if (d > i) {
        return Status::Error("internal: new instruction " + std::to_string(i) +
                             " would depend on the later instruction " + std::to_string(d));
      }
      instr.add_deps(d);
    }
  }
  return Status::Ok();
}

// ----- shared helpers -----

proto::Schedule* ScheduleShell(proto::Schedule* schedule, google::protobuf::Arena* arena) {
  google::protobuf::RepeatedPtrField<proto::Instruction> saved;
  saved.Swap(schedule->mutable_instructions());
  proto::Program* program = schedule->unsafe_arena_release_program();
  proto::Schedule* shell = google::protobuf::Arena::CreateMessage<proto::Schedule>(arena);
  *shell = *schedule;
  schedule->unsafe_arena_set_allocated_program(program);
  // An arena message never deletes what it points to, so the shell can point at the program.
  shell->unsafe_arena_set_allocated_program(program);
  saved.Swap(schedule->mutable_instructions());
  return shell;
}

std::vector<int> EndOfBackward(const proto::Schedule& schedule, int first_optimizer) {
  std::vector<int> last(proto::Stream_MAX + 1, -1);
  for (int i = 0; i < first_optimizer; ++i) {
    const int stream = schedule.instructions(i).stream();
    if (stream >= 0 && stream <= proto::Stream_MAX) last[stream] = i;
  }
  std::vector<int> deps;
  for (int i : last) {
    if (i >= 0) deps.push_back(i);
  }
  std::sort(deps.begin(), deps.end());
  return deps;
}

void CopyAllButInstructions(const proto::Schedule& from, proto::Schedule* to) {
  // Every field of the message type but the instructions, read off its descriptor, so a field
  // added to Schedule is copied too.
  static const google::protobuf::FieldMask* const kMask = [] {
    auto* mask = new google::protobuf::FieldMask;
    const google::protobuf::Descriptor* descriptor = proto::Schedule::descriptor();
    for (int i = 0; i < descriptor->field_count(); ++i) {
      const google::protobuf::FieldDescriptor* field = descriptor->field(i);
      if (field->number() != proto::Schedule::kInstructionsFieldNumber) {
        mask->add_paths(field->name());
      }
    }
    return mask;
  }();
  to->Clear();
  google::protobuf::util::FieldMaskUtil::MergeMessageTo(
      from, *kMask, google::protobuf::util::FieldMaskUtil::MergeOptions(), to);
}

bool SameInstructions(const proto::Schedule& a, const proto::Schedule& b) {
  if (a.instructions_size() != b.instructions_size()) return false;
  for (int i = 0; i < a.instructions_size(); ++i) {
    const proto::Instruction& x = a.instructions(i);
    const proto::Instruction& y = b.instructions(i);
    if (x.kind() != y.kind() || x.stream() != y.stream() || x.micro_step() != y.micro_step() ||
        x.op() != y.op() || x.bucket() != y.bucket() || x.tensors_size() != y.tensors_size() ||
        x.deps_size() != y.deps_size()) {
      return false;
    }
    if (!std::equal(x.tensors().begin(), x.tensors().end(), y.tensors().begin()) ||
        !std::equal(x.deps().begin(), x.deps().end(), y.deps().begin())) {
      return false;
    }
  }
  return true;
}

bool OrderGathersAfterReleases(const GatherIndex& index, proto::Schedule* schedule) {
  bool added = false;
  for (const auto& spans : index.spans_by_param) {
    for (size_t s = 1; s < spans.size(); ++s) {
      const int release = spans[s - 1].release;
      const int gather = spans[s].gather;
      if (release < 0 || gather < 0) continue;
      const bool release_on_compute =
          schedule->instructions(release).stream() == proto::STREAM_COMPUTE;
      bool ordered = false;
      for (int d : schedule->instructions(gather).deps()) {
        // A compute-stream dep at or after a compute-stream release implies the release.
        ordered |= d == release || (release_on_compute && d > release &&
                                    schedule->instructions(d).stream() == proto::STREAM_COMPUTE);
      }
      if (ordered) continue;
      schedule->mutable_instructions(gather)->add_deps(release);
      added = true;
    }
  }
  return added;
}

bool Acceptable(const SimResult& input, const SimResult& output, int64_t budget_bytes,
                double slowdown_tolerance) {
  const bool fits = budget_bytes <= 0 || output.peak_device_bytes <= budget_bytes;
  if (!fits) return false;
  const bool input_fits = budget_bytes <= 0 || input.peak_device_bytes <= budget_bytes;
  if (!input_fits) return true;  // a schedule that fits beats one that does not
  return output.step_seconds <= input.step_seconds * (1 + slowdown_tolerance);
}

Status ApplyBridges(const proto::Schedule& in, const GatherIndex& index,
                    const std::vector<Bridge>& bridges, proto::Schedule* out) {
  const int n = in.instructions_size();
  // Per instruction: the params it loses.
  std::vector<std::vector<int>> lose(n);
  // The gather that keeps each bridged param live, by the gather instruction it replaces.
  std::vector<std::vector<std::pair<int, int>>> kept_by(n);  // removed gather -> (param, keeper)
  std::vector<std::vector<char>> bridged(index.spans_by_param.size());
  for (const Bridge& b : bridges) {
    auto& flags = bridged[b.param];
    if (flags.empty()) flags.assign(index.spans_by_param[b.param].size(), 0);
    flags[b.span] = 1;
  }
  for (size_t param = 0; param < bridged.size(); ++param) {
    const auto& flags = bridged[param];
    if (flags.empty()) continue;
    const auto& spans = index.spans_by_param[param];
    int keeper = spans[0].gather;
    for (size_t s = 0; s + 1 < spans.size(); ++s) {
      if (!flags[s]) {
        keeper = spans[s + 1].gather;
        continue;
      }
      if (spans[s].release < 0) {
        return Status::Error("internal: bridging a span of tensor " + std::to_string(param) +
                             " that is never released");
      }
      lose[spans[s].release].push_back(static_cast<int>(param));
      lose[spans[s + 1].gather].push_back(static_cast<int>(param));
      kept_by[spans[s + 1].gather].emplace_back(static_cast<int>(param), keeper);
    }
  }
  ScheduleEditor editor(in, out);
  for (int i = 0; i < n; ++i) {
    const proto::Instruction& instr = in.instructions(i);
    if (lose[i].empty()) {
      editor.Keep(i);
      continue;
    }
    std::vector<int> remaining;
    for (int t : instr.tensors()) {
      if (std::find(lose[i].begin(), lose[i].end(), t) == lose[i].end()) remaining.push_back(t);
    }
    // Dependents of a removed gather wait for the gathers that keep its params instead (and
    // for what the gather waited for); of a removed release, for what the release waited for.
    std::vector<int> targets(instr.deps().begin(), instr.deps().end());
    for (const auto& [param, keeper] : kept_by[i]) targets.push_back(keeper);
    if (remaining.empty()) {
      editor.Drop(i, std::move(targets));
      continue;
    }
    // A gather that keeps other params still runs after its keepers (same stream, earlier),
    // so computes that wait for it wait for them too.
    proto::Instruction* kept = editor.Keep(i);
    kept->clear_tensors();
    for (int t : remaining) kept->add_tensors(t);
  }
  return editor.Finish();
}

}  // namespace dc::rewriter_internal
