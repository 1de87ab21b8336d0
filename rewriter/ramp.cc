#include "rewriter/ramp.h"

#include <algorithm>
#include <cstdio>
#include <limits>
#include <vector>

#include "rewriter/gather_index.h"
#include "rewriter/schedule_editor.h"
#include "rewriter/simulation_cache.h"

namespace dc {
namespace {

using rewriter_internal::ScheduleEditor;

// `gather`'s tensors in order, cut into pieces for a lead of `lead_bytes`: piece r holds at
// most lead_bytes x 2^r bytes, and at least one tensor.
std::vector<std::vector<int>> Pieces(const proto::Instruction& gather,
                                     const std::vector<int64_t>& bytes, int64_t lead_bytes) {
  std::vector<std::vector<int>> pieces(1);
  int64_t cap = std::max<int64_t>(1, lead_bytes), held = 0;
  for (int t : gather.tensors()) {
    if (!pieces.back().empty() && held + bytes[t] > cap) {
      pieces.emplace_back();
      held = 0;
      if (cap <= std::numeric_limits<int64_t>::max() / 2) cap *= 2;
    }
    pieces.back().push_back(t);
    held += bytes[t];
  }
  return pieces;
}

// Marks in `touched` (by tensor) what `instr` reads or writes: a compute's op's inputs and
// outputs, any other instruction's own tensors.
void MarkTouched(const proto::Program& program, const proto::Instruction& instr,
                 std::vector<char>* touched) {
  if (instr.kind() == proto::INSTR_COMPUTE && instr.op() >= 0 && instr.op() < program.ops_size()) {
    const proto::Op& op = program.ops(instr.op());
    for (int t : op.inputs()) (*touched)[t] = 1;
    for (int t : op.outputs()) (*touched)[t] = 1;
  }
  for (int t : instr.tensors()) (*touched)[t] = 1;
}

// `in` with its instruction `first` (an all-gather) replaced by `pieces`, issued one after the
// other where it was, each with its deps; a dependent of `first` waits for the last piece
// holding a tensor it touches (the last piece where it touches none).
Status Emit(const proto::Schedule& in, int first, const std::vector<std::vector<int>>& pieces,
            proto::Schedule* out) {
  const proto::Instruction& gather = in.instructions(first);
  int next_bucket = 1;
  for (const proto::Instruction& instr : in.instructions()) {
    next_bucket = std::max(next_bucket, instr.bucket() + 1);
  }
  ScheduleEditor editor(in, out);
  const int pieces_count = static_cast<int>(pieces.size());
  for (int i = 0; i < in.instructions_size(); ++i) {
    if (i != first) {
      editor.Keep(i);
      continue;
    }
    for (int p = 0; p < pieces_count; ++p) {
      // The last piece stands for the gather: whatever waited for it waits for that piece.
      proto::Instruction* piece = p + 1 < pieces_count ? editor.AddMerged({}) : editor.Keep(first);
      *piece = gather;
      piece->clear_tensors();
      for (int t : pieces[p]) piece->add_tensors(t);
      const bool grouped = pieces[p].size() > 1;
      piece->set_bucket(!grouped                        ? 0
                        : p == 0 && gather.bucket() > 0 ? gather.bucket()
                                                        : next_bucket++);
    }
  }
  DC_RETURN_IF_ERROR(editor.Finish());

  // Dependents of the last piece (new index `last`) that touch none of its tensors wait for the
  // last earlier piece whose tensors they touch.
  const proto::Program& program = in.program();
  const int last = first + pieces_count - 1;
  std::vector<int> piece_of(program.tensors_size(), -1);
  for (int p = 0; p < pieces_count; ++p) {
    for (int t : pieces[p]) piece_of[t] = p;
  }
  std::vector<char> touched(program.tensors_size(), 0);
  for (int i = last + 1; i < out->instructions_size(); ++i) {
    proto::Instruction* instr = out->mutable_instructions(i);
    auto dep = std::find(instr->deps().begin(), instr->deps().end(), last);
    if (dep == instr->deps().end()) continue;
    std::fill(touched.begin(), touched.end(), 0);
    MarkTouched(program, *instr, &touched);
    int wait_for = -1;
    for (int p = 0; p < pieces_count; ++p) {
      for (int t : pieces[p]) {
        if (touched[t]) wait_for = std::max(wait_for, p);
      }
    }
    if (wait_for < 0 || wait_for == pieces_count - 1) continue;
    *instr->mutable_deps()->Mutable(static_cast<int>(dep - instr->deps().begin())) =
        first + wait_for;
    std::sort(instr->mutable_deps()->begin(), instr->mutable_deps()->end());
    instr->mutable_deps()->erase(
        std::unique(instr->mutable_deps()->begin(), instr->mutable_deps()->end()),
        instr->mutable_deps()->end());
  }
  return Status::Ok();
}

}  // namespace

std::string RampPass::OptionsText() const {
  return "halvings=" + std::to_string(options_.halvings);
}

StatusOr<bool> RampPass::Run(proto::Schedule* schedule, const PassContext& context) {
  summary_.clear();
  if (!context.costs) return Status::Error("ramp needs a cost model");
  int first = -1;
  for (int i = 0; i < schedule->instructions_size(); ++i) {
    if (schedule->instructions(i).kind() == proto::INSTR_ALL_GATHER) {
      first = i;
      break;
    }
  }
  if (first < 0 || schedule->instructions(first).tensors_size() < 2 || options_.halvings <= 0) {
    summary_ = "the step's first gather holds one param at most: nothing to split";
    return false;
  }
  const std::vector<int64_t> bytes = rewriter_internal::TensorBytes(schedule->program());
  const proto::Instruction& gather = schedule->instructions(first);
  int64_t gather_bytes = 0;
  for (int t : gather.tensors()) gather_bytes += bytes[t];

  SimOptions quick;
  quick.memory_timeline = false;
  DC_ASSIGN_OR_RETURN(const SimResult input, InputSimulation(context, *schedule));
  const int64_t budget = context.budget_bytes;
  google::protobuf::Arena arena;
  proto::Schedule* best = nullptr;
  proto::Schedule* candidate = rewriter_internal::ScheduleShell(schedule, &arena);
  proto::Schedule* spare = rewriter_internal::ScheduleShell(schedule, &arena);
  double best_seconds = input.step_seconds;
  int best_pieces = 1;
  int64_t best_lead = 0;
  size_t previous_pieces = 1;
  for (int h = 1; h <= options_.halvings; ++h) {
    const int64_t lead = gather_bytes >> h;
    const std::vector<std::vector<int>> pieces = Pieces(gather, bytes, lead);
    if (pieces.size() == previous_pieces) continue;  // the same cut as the lead before
    previous_pieces = pieces.size();
    DC_RETURN_IF_ERROR(Emit(*schedule, first, pieces, candidate));
    DC_ASSIGN_OR_RETURN(SimResult output, SimulateIn(context, *candidate, quick));
    const bool fits = budget <= 0 || output.peak_device_bytes <= budget;
    if (!fits || output.step_seconds >= best_seconds) {
      if (best) break;  // past the best lead, smaller ones only get slower
      continue;
    }
    if (!best) {
      best = candidate;
      candidate = spare;
    } else {
      std::swap(best, candidate);
    }
    best_seconds = output.step_seconds;
    best_pieces = static_cast<int>(pieces.size());
    best_lead = 0;
    for (int t : pieces.front()) best_lead += bytes[t];
  }
  char text[200];
  if (!best) {
    std::snprintf(text, sizeof(text),
                  "kept the step's first gather whole (%d params): no ramp of %d lead(s) was "
                  "faster",
                  gather.tensors_size(), options_.halvings);
    summary_ = text;
    return false;
  }
  std::snprintf(text, sizeof(text),
                "split the step's first gather (%d params, %.2f MiB) into %d, the first %.2f MiB; "
                "step %.6f s -> %.6f s",
                gather.tensors_size(), static_cast<double>(gather_bytes) / (1 << 20), best_pieces,
                static_cast<double>(best_lead) / (1 << 20), input.step_seconds, best_seconds);
  summary_ = text;
  *schedule->mutable_instructions() = best->instructions();
  return true;
}

}  // namespace dc
