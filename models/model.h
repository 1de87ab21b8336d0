// Program builders: a Llama-style decoder (token embedding, RMSNorm, causal grouped-query
// attention with RoPE, SwiGLU MLP, final norm, LM head, cross-entropy), its backward and an
// AdamW step, as a proto::Program. Named presets from `tiny` to `llama3-70b`. The Mixtral
// family swaps each layer's MLP for a mixture of experts: a router, top-k choice, E SwiGLU
// experts as grouped matrix products, a weighted combine and a load-balancing loss; presets
// `mixtral-tiny` and `mixtral-8x7b`.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "schemas/program.h"
#include "schemas/status.h"

namespace dc {

// Overrides on top of a preset; unset fields keep the preset's value.
struct ModelOverrides {
  std::optional<int64_t> layers, hidden, heads, kv_heads, ffn, vocab, seq, micro_batch, gas;
  std::optional<int64_t> experts, top_k;  // mixtral presets only
  std::optional<double> router_aux_coef;
  std::optional<uint64_t> seed;
  std::optional<std::string> data_path;
  std::optional<std::string> compute_dtype;  // "f32", "bf16" or "f16"
  std::optional<bool> recompute_layers;      // activation checkpointing per decoder layer
  // The learning-rate schedule (ModelConfig.lr*, schemas/program.h's LearningRate); lr_decay
  // is "constant", "cosine" or "linear".
  std::optional<double> lr, min_lr;
  std::optional<int64_t> lr_warmup_steps, lr_decay_steps;
  std::optional<std::string> lr_decay;
  std::optional<double> clip_grad_norm;  // ModelConfig.clip_grad_norm; 0 = off
};

std::vector<std::string> PresetNames();

// The preset's config with `overrides` applied and checked (heads divide hidden, kv_heads
// divide heads, head dim even for RoPE, ...). Unknown preset: the message lists the known ones.
StatusOr<proto::ModelConfig> MakeConfig(const std::string& preset, const ModelOverrides& overrides);

// ValidateConfig, which checks a config, lives in schemas/program.h: a plan's reader checks the
// config it carries without the builders.

// One training step of the model: forward and backward of one micro-batch, then one AdamW op
// per param. The result passes ValidateProgram. See op_kinds.h for the ops and conventions.
StatusOr<proto::Program> BuildProgram(const proto::ModelConfig& config);

// Parameter count of the model (sum of param elements).
int64_t ParamCount(const proto::Program& program);

}  // namespace dc
