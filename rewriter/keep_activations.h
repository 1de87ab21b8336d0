// The keep-activations pass: selective activation checkpointing, chosen against the memory
// timeline. A program built with --recompute runs each decoder layer's forward again at the
// start of its backward (ops whose Op.recompute_of names the forward op they recompute) so
// that only the layer's input lives across. Where memory allows, this pass keeps a layer's
// forward outputs live instead, from the forward to the layer's backward in that micro-step,
// and replaces each of its recompute ops by an INSTR_RENAME: the op's outputs are the kept
// buffers (the same values: the recompute reads the same inputs through the same kernels), so
// the recomputed forward is not run and training is bit-identical.
//
// Algorithm: simulate the input once; every (layer, micro-step) whose recompute ops all have a
// forward twin (same kind, outputs of the same sizes) is a candidate, worth the recompute ops'
// seconds and costing each twin output's bytes from its release in the forward to its
// recompute op. Candidates are taken shortest hold first (in simulated seconds; ties: the later
// layer and micro-step first, whose backward comes first) while an editable curve of live bytes
// plus what they hold stays within the budget at every instant. Then simulate: over the budget
// (the curve's timing is the input's) plans again with the first half of the kept candidates,
// at most max_attempts times; a plan slower than the input is not kept.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "rewriter/pass.h"

namespace dc {

struct KeepActivationsOptions {
  // Plans made before the input is kept unchanged (each after a simulation found the plan over
  // the budget or slower than the input).
  int max_attempts = 6;
};

struct KeepActivationsStats {
  int candidates = 0;                  // (layer, micro-step) pairs whose recompute could be skipped
  int kept = 0;                        // of them, kept instead of recomputed
  int renames = 0;                     // recompute ops replaced by renames
  double recompute_seconds_saved = 0;  // predicted compute seconds of the skipped recompute ops
};

class KeepActivationsPass : public Pass {
 public:
  explicit KeepActivationsPass(KeepActivationsOptions options = {}) : options_(options) {}
  std::string_view name() const override { return "keep-activations"; }
  std::string OptionsText() const override;
  // No change for a program without recompute ops. Needs a cost model.
  StatusOr<bool> Run(proto::Schedule* schedule, const PassContext& context) override;
  std::string Summary() const override;
  const KeepActivationsStats& stats() const { return stats_; }

 private:
  KeepActivationsOptions options_;
  KeepActivationsStats stats_;
};

}  // namespace dc
