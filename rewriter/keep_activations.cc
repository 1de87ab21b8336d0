#include "rewriter/keep_activations.h"

#include <algorithm>
#include <cstdio>
#include <limits>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "machine/simulator.h"
#include "rewriter/live_curve.h"
#include "rewriter/schedule_editor.h"
#include "rewriter/simulation_cache.h"
#include "schemas/effects.h"

namespace dc {
namespace {

using rewriter_internal::LiveCurve;
using rewriter_internal::ScheduleEditor;

// Each recompute op's forward twin, by op id (-1: none, or not one whose outputs can stand in).
std::vector<int> TwinsOf(const proto::Program& program) {
  std::vector<int> twin(program.ops_size(), -1);
  for (const proto::Op& op : program.ops()) {
    if (!op.has_recompute_of()) continue;
    if (op.recompute_of() < 0 || op.recompute_of() >= program.ops_size()) continue;
    const proto::Op& forward = program.ops(op.recompute_of());
    bool same = forward.phase() == proto::PHASE_FORWARD && op.phase() == proto::PHASE_BACKWARD &&
                forward.kind() == op.kind() && forward.outputs_size() == op.outputs_size();
    for (int k = 0; same && k < op.outputs_size(); ++k) {
      const proto::Tensor& kept = program.tensors(forward.outputs(k));
      const proto::Tensor& recomputed = program.tensors(op.outputs(k));
      same = kept.role() == proto::ROLE_ACTIVATION && recomputed.role() == proto::ROLE_ACTIVATION &&
             TransientBytes(program, kept) == TransientBytes(program, recomputed);
    }
    if (same) twin[op.id()] = forward.id();
  }
  return twin;
}

// One (layer, micro-step) whose recompute ops can all become renames.
struct Candidate {
  int layer = 0;
  int micro = 0;
  std::vector<int> recomputes;  // their compute instructions
  // Per kept buffer: (twin output tensor, its release instruction, the rename that ends the hold)
  struct Hold {
    int tensor, release, rename;
  };
  std::vector<Hold> holds;
  double seconds = 0;       // recompute seconds saved
  double hold_seconds = 0;  // simulated time from the first release to the last rename
};

// Rewrites `in` with the candidates' recomputes turned into renames and their twin outputs'
// forward releases removed.
Status Apply(const proto::Schedule& in, const std::vector<int>& twin,
             const std::vector<const Candidate*>& kept, proto::Schedule* out) {
  const proto::Program& program = in.program();
  const int n = in.instructions_size();
  std::vector<char> renamed(n, 0);
  std::map<int, std::vector<int>> dropped_from;  // release -> the tensors it no longer frees
  for (const Candidate* c : kept) {
    for (int r : c->recomputes) renamed[r] = 1;
    for (const Candidate::Hold& h : c->holds) dropped_from[h.release].push_back(h.tensor);
  }
  rewriter_internal::CopyAllButInstructions(in, out);
  ScheduleEditor editor(in, out);
  for (int i = 0; i < n; ++i) {
    const proto::Instruction& instr = in.instructions(i);
    if (renamed[i]) {
      proto::Instruction* rename = editor.Keep(i);
      rename->set_kind(proto::INSTR_RENAME);
      rename->clear_tensors();
      for (int t : program.ops(twin[instr.op()]).outputs()) rename->add_tensors(t);
      continue;
    }
    auto dropped = dropped_from.find(i);
    if (dropped == dropped_from.end()) {
      editor.Keep(i);
      continue;
    }
    std::vector<int> left;
    for (int t : instr.tensors()) {
      if (std::find(dropped->second.begin(), dropped->second.end(), t) == dropped->second.end()) {
        left.push_back(t);
      }
    }
    if (left.empty()) {
      editor.Drop(i, {instr.deps().begin(), instr.deps().end()});
      continue;
    }
    proto::Instruction* release = editor.Keep(i);
    release->clear_tensors();
    for (int t : left) release->add_tensors(t);
  }
  return editor.Finish();
}

}  // namespace

std::string KeepActivationsPass::OptionsText() const {
  return "max_attempts=" + std::to_string(options_.max_attempts);
}

StatusOr<bool> KeepActivationsPass::Run(proto::Schedule* schedule, const PassContext& context) {
  stats_ = KeepActivationsStats();
  if (!context.costs) return Status::Error("keep-activations needs a cost model");
  const proto::Program& program = schedule->program();
  const std::vector<int> twin = TwinsOf(program);
  if (std::none_of(twin.begin(), twin.end(), [](int t) { return t >= 0; })) return false;

  // Where each op runs and each activation is released, by micro-step.
  std::map<std::pair<int, int>, int> compute_at, release_at;
  for (int i = 0; i < schedule->instructions_size(); ++i) {
    const proto::Instruction& instr = schedule->instructions(i);
    if (instr.kind() == proto::INSTR_COMPUTE) compute_at[{instr.op(), instr.micro_step()}] = i;
    if (instr.kind() == proto::INSTR_RELEASE) {
      for (int t : instr.tensors()) release_at[{t, instr.micro_step()}] = i;
    }
  }
  SimOptions quick;
  quick.memory_timeline = false;
  DC_ASSIGN_OR_RETURN(const SimResult input, InputSimulation(context, *schedule));
  DC_ASSIGN_OR_RETURN(LiveCurve curve, LiveCurve::Build(*schedule, input));

  // Candidates: every recompute op of the layer in the micro-step has a twin whose outputs are
  // released in the forward, before the recompute.
  std::map<std::pair<int, int>, Candidate> by_key;
  std::map<std::pair<int, int>, bool> viable;
  const int gas = static_cast<int>(std::max<int64_t>(1, program.config().gas()));
  for (const proto::Op& op : program.ops()) {
    if (!op.has_recompute_of()) continue;
    for (int micro = 0; micro < gas; ++micro) {
      const std::pair<int, int> key{op.layer(), micro};
      auto ok = viable.emplace(key, true).first;
      auto r = compute_at.find({op.id(), micro});
      if (twin[op.id()] < 0 || r == compute_at.end()) {
        ok->second = false;
        continue;
      }
      Candidate& c = by_key[key];
      c.layer = op.layer();
      c.micro = micro;
      c.recomputes.push_back(r->second);
      c.seconds += context.costs->OpSeconds(program, op.id());
      for (int t : program.ops(twin[op.id()]).outputs()) {
        auto release = release_at.find({t, micro});
        if (release == release_at.end() || release->second > r->second) {
          ok->second = false;
          break;
        }
        c.holds.push_back({t, release->second, r->second});
      }
    }
  }
  std::vector<Candidate*> candidates;
  for (auto& [key, c] : by_key) {
    if (!viable[key]) continue;
    double first = std::numeric_limits<double>::infinity(), last = 0;
    for (const Candidate::Hold& h : c.holds) {
      first = std::min(first, curve.TimeOf(curve.PointOf(h.release)));
      last = std::max(last, curve.TimeOf(curve.PointOf(h.rename)));
    }
    c.hold_seconds = last - first;
    candidates.push_back(&c);
  }
  stats_.candidates = static_cast<int>(candidates.size());
  if (candidates.empty()) return false;
  std::sort(candidates.begin(), candidates.end(), [](const Candidate* a, const Candidate* b) {
    if (a->hold_seconds != b->hold_seconds) return a->hold_seconds < b->hold_seconds;
    if (a->layer != b->layer) return a->layer > b->layer;
    return a->micro > b->micro;
  });

  const int64_t limit = context.budget_bytes > 0 ? context.budget_bytes : kUnlimitedBytes;
  std::vector<int64_t> bytes_of(program.tensors_size());
  for (const proto::Tensor& t : program.tensors()) bytes_of[t.id()] = TransientBytes(program, t);
  std::vector<const Candidate*> kept;
  for (const Candidate* c : candidates) {
    int begin = curve.size(), end = 0;
    for (const Candidate::Hold& h : c->holds) {
      const int from = curve.PointOf(h.release), to = curve.PointOf(h.rename);
      curve.Add(from, to, bytes_of[h.tensor]);
      begin = std::min(begin, from);
      end = std::max(end, to);
    }
    if (begin < end && curve.Max(begin, end) > limit) {
      for (const Candidate::Hold& h : c->holds) {
        curve.Add(curve.PointOf(h.release), curve.PointOf(h.rename), -bytes_of[h.tensor]);
      }
      continue;
    }
    kept.push_back(c);
  }

  for (int attempt = 0; attempt < options_.max_attempts && !kept.empty(); ++attempt) {
    proto::Schedule out;
    DC_RETURN_IF_ERROR(Apply(*schedule, twin, kept, &out));
    DC_ASSIGN_OR_RETURN(SimResult output, SimulateIn(context, out, quick));
    if (rewriter_internal::Acceptable(input, output, context.budget_bytes, 0)) {
      stats_.kept = static_cast<int>(kept.size());
      for (const Candidate* c : kept) {
        stats_.renames += static_cast<int>(c->recomputes.size());
        stats_.recompute_seconds_saved += c->seconds;
      }
      *schedule = std::move(out);
      return true;
    }
    kept.resize(kept.size() / 2);
  }
  return false;
}

std::string KeepActivationsPass::Summary() const {
  if (stats_.candidates == 0) return "no recomputed layer";
  char text[200];
  std::snprintf(text, sizeof(text),
                "kept %d of %d recomputed (layer, micro-step) pairs' activations: %d recompute ops "
                "skipped, %.4f s of compute",
                stats_.kept, stats_.candidates, stats_.renames, stats_.recompute_seconds_saved);
  return text;
}

}  // namespace dc
