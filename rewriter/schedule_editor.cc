#include "rewriter/schedule_editor.h"

#include <google/protobuf/field_mask.pb.h>
#include <google/protobuf/util/field_mask_util.h>

#include <algorithm>
#include <array>
#include <functional>
#include <string>

namespace dc::rewriter_internal {

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

void ScheduleEditor::Resolve(int old, std::vector<int>* out) const {
  if (new_of_old_[old] >= 0) {
    out->push_back(new_of_old_[old]);
  } else if (drop_of_old_[old] >= 0) {
    const std::vector<int>& waits = drop_waits_[drop_of_old_[old]];
    out->insert(out->end(), waits.begin(), waits.end());
  }
}

void ScheduleEditor::LatestPerStream(std::vector<int>* deps) const {
  std::sort(deps->begin(), deps->end(), std::greater<int>());
  deps->erase(std::unique(deps->begin(), deps->end()), deps->end());
  std::array<bool, proto::Stream_ARRAYSIZE> seen{};
  size_t kept = 0;
  for (int d : *deps) {
    const int stream = d < out_->size() ? out_->Get(d).stream() : 0;
    const bool known = stream >= 0 && stream < proto::Stream_ARRAYSIZE;
    if (known && seen[stream]) continue;  // a later instruction of its stream is kept already
    if (known) seen[stream] = true;
    (*deps)[kept++] = d;
  }
  deps->resize(kept);
  std::reverse(deps->begin(), deps->end());
}

Status ScheduleEditor::Finish() {
  for (int old = 0; old < static_cast<int>(new_of_old_.size()); ++old) {
    if (new_of_old_[old] < 0 && drop_of_old_[old] < 0) {
      return Status::Error("internal: instruction " + std::to_string(old) +
                           " was neither kept nor dropped by the pass");
    }
  }
  // Each drop's waits, in index order: its targets are earlier, so already resolved. Waiting
  // for an instruction also meant waiting for everything before it on its stream: a dependent of
  // a dropped one waits for the dropped one's predecessor on that stream too (a compute that
  // waited for the second of two gathers on the gather stream and reads the first one's params
  // must still wait for the first when the second is dropped).
  drop_waits_.assign(drop_targets_.size(), {});
  std::array<int, proto::Stream_ARRAYSIZE> last_on_stream;
  last_on_stream.fill(-1);
  for (int old = 0; old < static_cast<int>(drop_of_old_.size()); ++old) {
    const int stream = in_.instructions(old).stream();
    const bool known = stream >= 0 && stream < proto::Stream_ARRAYSIZE;
    const int before_on_stream = known ? last_on_stream[stream] : -1;
    if (known) last_on_stream[stream] = old;
    const int drop = drop_of_old_[old];
    if (drop < 0 || new_of_old_[old] >= 0) continue;
    std::vector<int>& waits = drop_waits_[drop];
    for (int target : drop_targets_[drop]) {
      if (target >= 0 && target < old) Resolve(target, &waits);
    }
    if (before_on_stream >= 0) Resolve(before_on_stream, &waits);
    LatestPerStream(&waits);
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
    deps.erase(std::remove(deps.begin(), deps.end(), i), deps.end());  // merged with its wait
    for (int d : deps) {
      if (d > i) {
        return Status::Error("internal: new instruction " + std::to_string(i) +
                             " would depend on the later instruction " + std::to_string(d));
      }
    }
    LatestPerStream(&deps);
    instr.clear_deps();
    for (int d : deps) instr.add_deps(d);
  }
  return Status::Ok();
}

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
}  // namespace dc::rewriter_internal
