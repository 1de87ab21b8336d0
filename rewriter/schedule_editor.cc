#include "rewriter/schedule_editor.h"

#include <google/protobuf/field_mask.pb.h>
#include <google/protobuf/util/field_mask_util.h>

#include <algorithm>
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
