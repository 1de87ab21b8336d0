#include "models/model.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <map>
#include <set>

#include "schemas/op_kinds.h"

namespace dc {
namespace {

proto::Program Build(const std::string& preset, const ModelOverrides& overrides = {}) {
  auto config = MakeConfig(preset, overrides);
  EXPECT_TRUE(config.ok()) << config.status().message();
  auto program = BuildProgram(*config);
  EXPECT_TRUE(program.ok()) << program.status().message();
  return *program;
}

std::string BuildError(const std::string& preset, const ModelOverrides& overrides) {
  auto config = MakeConfig(preset, overrides);
  EXPECT_FALSE(config.ok());
  return config.status().message();
}

TEST(Model, EveryPresetBuildsAndValidates) {
  for (const std::string& name : PresetNames()) {
    proto::Program program = Build(name);
    Status status = ValidateProgram(program);
    EXPECT_TRUE(status.ok()) << name << ": " << status.message();
    EXPECT_EQ(program.config().preset(), name);
    EXPECT_EQ(program.format_version(), kProgramFormatVersion);
  }
}

TEST(Model, PresetsListTheLlamaShapes) {
  const std::vector<std::string> names = PresetNames();
  for (const char* expected : {"tiny", "small", "llama-1b", "llama3-8b", "llama3-70b"}) {
    EXPECT_NE(std::find(names.begin(), names.end(), expected), names.end()) << expected;
  }
}

TEST(Model, Llama3ParamCounts) {
  EXPECT_NEAR(static_cast<double>(ParamCount(Build("llama3-8b"))), 8.03e9, 0.01 * 8.03e9);
  EXPECT_NEAR(static_cast<double>(ParamCount(Build("llama3-70b"))), 70.6e9, 0.01 * 70.6e9);
}

TEST(Model, TinyParamCountByHand) {
  const int64_t h = 64, kv = 32, f = 128, v = 256, layers = 2;
  const int64_t per_layer = 2 * h + h * h * 2 + 2 * kv * h + 3 * f * h;
  EXPECT_EQ(ParamCount(Build("tiny")), layers * per_layer + 2 * v * h + h);
}

// How fast it builds is bench/speed_bench's to measure; tests never assert speed.
TEST(Model, BuildsLlama3_70b) {
  auto config = MakeConfig("llama3-70b", {});
  ASSERT_TRUE(config.ok());
  auto program = BuildProgram(*config);
  ASSERT_TRUE(program.ok());
  EXPECT_GT(program->ops_size(), 3000);
}

TEST(Model, SameConfigSameBytes) {
  std::string a, b;
  ASSERT_TRUE(Build("small").SerializeToString(&a));
  ASSERT_TRUE(Build("small").SerializeToString(&b));
  EXPECT_EQ(a, b);
}

TEST(Model, OverridesApply) {
  ModelOverrides o;
  o.layers = 3;
  o.hidden = 96;
  o.heads = 6;
  o.kv_heads = 3;
  o.ffn = 200;
  o.vocab = 300;
  o.seq = 16;
  o.micro_batch = 3;
  o.gas = 2;
  o.seed = 7;
  o.data_path = "/tmp/tokens.bin";
  auto config = MakeConfig("tiny", o);
  ASSERT_TRUE(config.ok()) << config.status().message();
  EXPECT_EQ(config->layers(), 3);
  EXPECT_EQ(config->hidden(), 96);
  EXPECT_EQ(config->heads(), 6);
  EXPECT_EQ(config->kv_heads(), 3);
  EXPECT_EQ(config->ffn(), 200);
  EXPECT_EQ(config->vocab(), 300);
  EXPECT_EQ(config->seq(), 16);
  EXPECT_EQ(config->micro_batch(), 3);
  EXPECT_EQ(config->gas(), 2);
  EXPECT_EQ(config->seed(), 7u);
  EXPECT_EQ(config->data_path(), "/tmp/tokens.bin");
  auto program = BuildProgram(*config);
  ASSERT_TRUE(program.ok());
  EXPECT_TRUE(ValidateProgram(*program).ok());
  int layers_seen = 0;
  for (const auto& t : program->tensors()) layers_seen = std::max(layers_seen, t.layer() + 1);
  EXPECT_EQ(layers_seen, 3);
}

TEST(Model, BadOverridesFailWithTheFlag) {
  ModelOverrides heads;
  heads.heads = 5;
  EXPECT_EQ(BuildError("tiny", heads), "--heads 5 does not divide --hidden 64");
  ModelOverrides kv;
  kv.kv_heads = 3;
  EXPECT_EQ(BuildError("tiny", kv), "--kv-heads 3 does not divide --heads 4");
  ModelOverrides odd_head_dim;
  odd_head_dim.hidden = 36;  // 4 heads of 9
  EXPECT_EQ(BuildError("tiny", odd_head_dim),
            "head dim 9 (--hidden 36 / --heads 4) must be even for RoPE");
  ModelOverrides zero_layers;
  zero_layers.layers = 0;
  EXPECT_EQ(BuildError("tiny", zero_layers), "--layers must be at least 1 (got 0)");
  ModelOverrides negative_batch;
  negative_batch.micro_batch = -2;
  EXPECT_EQ(BuildError("tiny", negative_batch), "--micro-batch must be at least 1 (got -2)");
}

// With --recompute every layer's forward op is run again at the start of its backward, except
// the ones only the layer's output needs (the residual add after the MLP, and the dense
// down_proj or the MoE combine); the forward's own intermediates are then read by forward ops
// alone, and the backward reads the recomputed copies.
TEST(Model, RecomputeRunsEachLayersForwardAgainInItsBackward) {
  for (const std::string preset : {"tiny", "mixtral-tiny"}) {
    SCOPED_TRACE(preset);
    ModelOverrides recompute;
    recompute.recompute_layers = true;
    const proto::Program plain = Build(preset);
    const proto::Program program = Build(preset, recompute);
    ASSERT_TRUE(ValidateProgram(program).ok());
    std::set<std::string> forward_layer_ops, recomputed;
    for (const auto& op : plain.ops()) {
      if (op.phase() == proto::PHASE_FORWARD && op.layer() >= 0)
        forward_layer_ops.insert(op.name());
    }
    for (const auto& op : program.ops()) {
      // The name is a label for people: it carries the suffix exactly when recompute_of is set.
      EXPECT_EQ(op.name().ends_with(op_kind::kRecomputeSuffix), op.has_recompute_of()) << op.name();
      if (!op.has_recompute_of()) continue;
      EXPECT_EQ(op.phase(), proto::PHASE_BACKWARD) << op.name();
      const proto::Op& forward = program.ops(op.recompute_of());
      EXPECT_EQ(forward.phase(), proto::PHASE_FORWARD) << op.name();
      EXPECT_EQ(forward.kind(), op.kind()) << op.name();
      EXPECT_EQ(forward.name() + op_kind::kRecomputeSuffix, op.name());
      recomputed.insert(forward.name());
    }
    std::set<std::string> expected = forward_layer_ops;
    for (int l = 0; l < static_cast<int>(plain.config().layers()); ++l) {
      const std::string pre = "layers." + std::to_string(l) + ".";
      expected.erase(pre + "mlp.add");
      expected.erase(pre + (preset == "tiny" ? "mlp.down_proj" : "moe.combine"));
    }
    EXPECT_EQ(recomputed, expected);
    // No backward op reads a layer's forward intermediate: only its input (the checkpoint).
    std::map<int, const proto::Op*> producer;
    for (const auto& op : program.ops()) {
      for (int t : op.outputs()) producer[t] = &op;
    }
    for (const auto& op : program.ops()) {
      if (op.phase() != proto::PHASE_BACKWARD) continue;
      for (int t : op.inputs()) {
        auto it = producer.find(t);
        if (it == producer.end() || it->second->phase() != proto::PHASE_FORWARD) continue;
        const proto::Op& from = *it->second;
        if (from.layer() < 0) continue;  // embedding output, final norm, lm head, loss
        // Read in the backward: a layer's output, i.e. the next layer's kept input.
        EXPECT_TRUE(from.name().ends_with("mlp.add"))
            << op.name() << " reads " << program.tensors(t).name();
      }
    }
    EXPECT_EQ(ParamCount(program), ParamCount(plain));
  }
}

TEST(Model, DtypeOverrideSetsTheComputeDtype) {
  ModelOverrides bf16;
  bf16.compute_dtype = "bf16";
  auto config = MakeConfig("tiny", bf16);
  ASSERT_TRUE(config.ok()) << config.status().message();
  EXPECT_EQ(config->compute_dtype(), proto::DTYPE_BF16);
  ModelOverrides f32;
  f32.compute_dtype = "f32";
  config = MakeConfig("llama3-8b", f32);
  ASSERT_TRUE(config.ok()) << config.status().message();
  EXPECT_EQ(config->compute_dtype(), proto::DTYPE_F32);
  ModelOverrides bad;
  bad.compute_dtype = "fp8";
  EXPECT_EQ(BuildError("tiny", bad), "--dtype fp8 is not a compute dtype; use f32, bf16 or f16");
}

TEST(Model, UnknownPresetListsKnownOnes) {
  EXPECT_EQ(BuildError("llama9", {}),
            "unknown preset 'llama9'; known presets: tiny, small, llama-1b, llama3-8b, "
            "llama3-70b, mixtral-tiny, mixtral-8x7b");
}

TEST(Model, BuildProgramRejectsABadConfig) {
  auto config = MakeConfig("tiny", {});
  ASSERT_TRUE(config.ok());
  config->set_heads(3);
  auto program = BuildProgram(*config);
  ASSERT_FALSE(program.ok());
  EXPECT_EQ(program.status().message(), "--heads 3 does not divide --hidden 64");
}

TEST(Model, ConventionsHold) {
  const proto::Program program = Build("tiny");
  const auto& config = program.config();
  std::map<std::string, int> by_name;
  for (const auto& t : program.tensors()) {
    EXPECT_TRUE(by_name.emplace(t.name(), t.id()).second) << "duplicate tensor " << t.name();
  }
  std::set<std::string> op_names;
  for (const auto& op : program.ops()) {
    EXPECT_TRUE(op_names.insert(op.name()).second) << "duplicate op " << op.name();
  }
  for (const char* input : {"tokens", "targets"}) {
    const auto& t = program.tensors(by_name.at(input));
    EXPECT_EQ(t.role(), proto::ROLE_INPUT);
    EXPECT_EQ(t.dtype(), proto::DTYPE_I32);
    EXPECT_EQ(std::vector<int64_t>(t.shape().begin(), t.shape().end()),
              (std::vector<int64_t>{config.micro_batch(), config.seq()}));
  }
  const auto& loss = program.tensors(by_name.at("loss"));
  EXPECT_EQ(loss.dtype(), proto::DTYPE_F32);
  ASSERT_EQ(loss.shape_size(), 1);
  EXPECT_EQ(loss.shape(0), 1);

  // Every param: one grad (compute dtype, same shape), m and v (f32), one adamw op.
  std::map<int, int> grads, states, adamw_ops;
  for (const auto& t : program.tensors()) {
    if (t.role() == proto::ROLE_GRAD) {
      ++grads[t.param()];
      EXPECT_EQ(t.dtype(), config.compute_dtype());
      EXPECT_EQ(t.shape_size(), program.tensors(t.param()).shape_size());
    }
    if (t.role() == proto::ROLE_OPTIMIZER_STATE) {
      ++states[t.param()];
      EXPECT_EQ(t.dtype(), proto::DTYPE_F32);
    }
  }
  for (const auto& op : program.ops()) {
    if (op.kind() != op_kind::kAdamW) continue;
    ASSERT_EQ(op.inputs_size(), 4);
    EXPECT_EQ(op.outputs_size(), 0);
    const auto& param = program.tensors(op.inputs(0));
    ++adamw_ops[param.id()];
    const double decay = AttrFloat(op, op_attr::kWeightDecay, -1);
    EXPECT_EQ(decay, param.shape_size() >= 2 ? config.weight_decay() : 0.0) << param.name();
  }
  int params = 0;
  for (const auto& t : program.tensors()) {
    if (t.role() != proto::ROLE_PARAM) continue;
    ++params;
    EXPECT_EQ(t.dtype(), proto::DTYPE_F32);
    EXPECT_EQ(grads[t.id()], 1) << t.name();
    EXPECT_EQ(states[t.id()], 2) << t.name();
    EXPECT_EQ(adamw_ops[t.id()], 1) << t.name();
  }
  EXPECT_EQ(params, 9 * 2 + 3);
  EXPECT_TRUE(by_name.contains("layers.1.attn.wq"));
  EXPECT_TRUE(by_name.contains("layers.1.attn.wq.grad"));
  EXPECT_TRUE(by_name.contains("layers.1.attn.wq.adam_m"));
  EXPECT_TRUE(by_name.contains("layers.1.attn.wq.adam_v"));
}

// --clip-grad-norm: one optimizer-phase op sums the squares of every grad into a scalar that
// every adamw op reads (after the schedule's all-reduce), with the max as an attr. Off (0, the
// default): no such op, four inputs, and the program is the one it always was.
TEST(Model, ClippingAddsTheNormOpAndTheAdamWInput) {
  ModelOverrides clip;
  clip.clip_grad_norm = 0.5;
  auto config = MakeConfig("tiny", clip);
  ASSERT_TRUE(config.ok()) << config.status().message();
  auto program = BuildProgram(*config);
  ASSERT_TRUE(program.ok()) << program.status().message();
  ASSERT_TRUE(ValidateProgram(*program).ok());
  int norm_op = -1, norm = -1, grads = 0, steps = 0;
  for (const auto& op : program->ops()) {
    if (op.kind() != op_kind::kGradNormSquared) continue;
    EXPECT_EQ(norm_op, -1) << "a second norm op";
    norm_op = op.id();
    EXPECT_EQ(op.phase(), proto::PHASE_OPTIMIZER);
    EXPECT_TRUE(IsShardReduction(*program, op));
    ASSERT_EQ(op.outputs_size(), 1);
    norm = op.outputs(0);
    for (int t : op.inputs()) grads += program->tensors(t).role() == proto::ROLE_GRAD;
    EXPECT_EQ(grads, op.inputs_size());
  }
  ASSERT_GE(norm, 0);
  EXPECT_EQ(program->tensors(norm).dtype(), proto::DTYPE_F32);
  EXPECT_EQ(NumElements(program->tensors(norm)), 1);
  for (const auto& op : program->ops()) {
    if (op.kind() != op_kind::kAdamW) continue;
    ++steps;
    EXPECT_GT(op.id(), norm_op);
    ASSERT_EQ(op.inputs_size(), 5);
    EXPECT_EQ(op.inputs(4), norm);
    EXPECT_EQ(AttrFloat(op, op_attr::kMaxGradNorm, -1), 0.5);
  }
  EXPECT_EQ(grads, steps);  // every param's grad, once

  const proto::Program plain = Build("tiny");
  for (const auto& op : plain.ops()) EXPECT_NE(op.kind(), op_kind::kGradNormSquared);
  EXPECT_EQ(plain.tensors_size() + 1, program->tensors_size());
  EXPECT_EQ(plain.ops_size() + 1, program->ops_size());

  for (const double bad : {-1.0, std::nan(""), std::numeric_limits<double>::infinity()}) {
    clip.clip_grad_norm = bad;
    const auto refused = MakeConfig("tiny", clip);
    ASSERT_FALSE(refused.ok()) << bad;
    EXPECT_EQ(refused.status().message().rfind("--clip-grad-norm must ", 0), 0)
        << refused.status().message();
  }
}

TEST(Model, OpsCarryFlopsAndLayers) {
  const proto::Program program = Build("tiny");
  for (const auto& op : program.ops()) {
    if (op.kind() != op_kind::kEmbedding) {
      EXPECT_GT(op.flops(), 0) << op.name();
    }
    EXPECT_GE(op.layer(), -1);
    EXPECT_LT(op.layer(), program.config().layers());
    if (op.phase() == proto::PHASE_FORWARD && op.name().starts_with("layers.0.")) {
      EXPECT_EQ(op.layer(), 0) << op.name();
    }
  }
  // The q projection: 2 * tokens * hidden * hidden.
  for (const auto& op : program.ops()) {
    if (op.name() == "layers.0.attn.q_proj") {
      EXPECT_DOUBLE_EQ(op.flops(), 2.0 * 64 * 64 * 64);
    }
  }
}

TEST(Model, Llama3_8bMatmulFlopsDominate) {
  // 6 * params * tokens is the usual estimate of a training step (forward 2, backward 4),
  // attention adds a little on top.
  const proto::Program program = Build("llama3-8b");
  double matmul_flops = 0;
  for (const auto& op : program.ops()) {
    if (op.kind() == op_kind::kMatmul || op.kind() == op_kind::kMatmulBackward) {
      matmul_flops += op.flops();
    }
  }
  const double tokens = 2048;
  const double embed_params = 128256.0 * 4096;
  const double estimate = 6 * (static_cast<double>(ParamCount(program)) - embed_params) * tokens;
  // The norm gains (0.004% of the params) have no matmul.
  EXPECT_NEAR(matmul_flops / estimate, 1.0, 1e-4);
}

// ---------------------------------------------------------------------------------------------
// Mixtral

TEST(Mixtral, ParamCountIsThePublished46_7B) {
  // Hugging Face's count for Mixtral-8x7B: 46,702,792,704 (untied embedding and LM head).
  EXPECT_EQ(ParamCount(Build("mixtral-8x7b")), 46'702'792'704);
  const proto::ModelConfig config = Build("mixtral-8x7b").config();
  EXPECT_EQ(config.family(), "mixtral");
  EXPECT_EQ(config.experts(), 8);
  EXPECT_EQ(config.top_k(), 2);
  EXPECT_EQ(config.hidden(), 4096);
  EXPECT_EQ(config.ffn(), 14336);
  EXPECT_EQ(config.kv_heads(), 8);
  EXPECT_EQ(config.vocab(), 32000);
}

TEST(Mixtral, EachExpertIsItsOwnParamUsedOnlyByTheGroupedOps) {
  const proto::Program program = Build("mixtral-tiny");
  const auto& config = program.config();
  std::map<std::string, int> by_name;
  for (const auto& t : program.tensors()) by_name[t.name()] = t.id();
  for (int64_t e = 0; e < config.experts(); ++e) {
    const std::string w = "layers.1.experts." + std::to_string(e) + ".mlp.w_gate";
    ASSERT_TRUE(by_name.contains(w)) << w;
    EXPECT_TRUE(by_name.contains(w + ".grad"));
    EXPECT_TRUE(by_name.contains(w + ".adam_m"));
    // Read by exactly the forward gate_proj and its backward; nothing else gathers it.
    std::vector<std::string> readers;
    for (const auto& op : program.ops()) {
      if (op.phase() == proto::PHASE_OPTIMIZER) continue;
      for (int in : op.inputs()) {
        if (in == by_name.at(w)) readers.push_back(op.name());
      }
    }
    EXPECT_EQ(readers, (std::vector<std::string>{"layers.1.experts.gate_proj",
                                                 "layers.1.experts.gate_proj.backward"}));
  }
  EXPECT_FALSE(by_name.contains("layers.0.mlp.w_gate")) << "no dense MLP in a MoE layer";
  // Dispatched buffers are static: M * k rows whatever the routing.
  const auto& xs = program.tensors(by_name.at("layers.0.moe.dispatched"));
  EXPECT_EQ(xs.shape(0), config.micro_batch() * config.seq() * config.top_k());
  EXPECT_EQ(program.tensors(by_name.at("layers.0.moe.experts")).dtype(), proto::DTYPE_I32);
  EXPECT_TRUE(op_kind::IsLossTerm("layers.0.moe.aux_loss"));
  EXPECT_TRUE(by_name.contains("layers.0.moe.aux_loss"));
}

TEST(Mixtral, GatesAndTheirGradientAreF32InABf16Program) {
  // op_kinds.h: the router's gates and moe_combine_backward's dgates are fp32 whatever the
  // compute dtype (the CUDA backend checks it).
  const proto::Program program = Build("mixtral-8x7b");
  ASSERT_EQ(program.config().compute_dtype(), proto::DTYPE_BF16);
  std::map<std::string, proto::DType> dtype;
  for (const auto& t : program.tensors()) dtype[t.name()] = t.dtype();
  EXPECT_EQ(dtype.at("layers.0.moe.gates"), proto::DTYPE_F32);
  EXPECT_EQ(dtype.at("layers.0.moe.gates.grad"), proto::DTYPE_F32);
  EXPECT_EQ(dtype.at("layers.0.moe.router_logits"), proto::DTYPE_BF16);
}

TEST(Mixtral, MatmulFlopsAreSixTimesTheActiveParams) {
  // Each token runs top_k of the experts: the step's matmul flops are 6 * active params *
  // tokens, the router included, the embedding excluded.
  const proto::Program program = Build("mixtral-8x7b");
  const auto& c = program.config();
  double matmul_flops = 0;
  for (const auto& op : program.ops()) {
    if (op.kind() == op_kind::kMatmul || op.kind() == op_kind::kMatmulBackward ||
        op.kind() == op_kind::kGroupedMatmul || op.kind() == op_kind::kGroupedMatmulBackward) {
      matmul_flops += op.flops();
    }
  }
  const double expert_params = 3.0 * c.ffn() * c.hidden();
  const double inactive =
      static_cast<double>(c.layers()) * (c.experts() - c.top_k()) * expert_params;
  const double embed_params = static_cast<double>(c.vocab()) * c.hidden();
  const double active = static_cast<double>(ParamCount(program)) - inactive - embed_params;
  const double tokens = static_cast<double>(c.seq() * c.micro_batch());
  EXPECT_NEAR(matmul_flops / (6 * active * tokens), 1.0, 1e-4);
}

TEST(Mixtral, BadExpertSettingsNameTheFlag) {
  ModelOverrides dense_with_experts;
  dense_with_experts.experts = 4;
  EXPECT_EQ(
      BuildError("tiny", dense_with_experts),
      "--experts and --top-k apply to the mixtral presets only (this is 'tiny', a dense llama)");
  ModelOverrides too_many;
  too_many.top_k = 9;
  EXPECT_EQ(BuildError("mixtral-tiny", too_many), "--top-k 9 is more than --experts 8");
  ModelOverrides no_experts;
  no_experts.experts = 0;
  EXPECT_EQ(BuildError("mixtral-tiny", no_experts), "--experts must be at least 1 (got 0)");
  ModelOverrides negative;
  negative.router_aux_coef = -1;
  EXPECT_EQ(BuildError("mixtral-tiny", negative),
            "--router-aux-coef must not be negative (got -1)");
  ModelOverrides nan;
  nan.router_aux_coef = std::numeric_limits<double>::quiet_NaN();
  EXPECT_EQ(BuildError("mixtral-tiny", nan), "--router-aux-coef must be a finite number (got nan)");
  ModelOverrides four;
  four.experts = 4;
  four.top_k = 1;
  EXPECT_EQ(Build("mixtral-tiny", four).config().experts(), 4);
}

TEST(LearningRateFlags, SetTheScheduleAndRefuseWhatCannotBe) {
  ModelOverrides o;
  o.lr = 1e-3;
  o.lr_warmup_steps = 10;
  o.lr_decay_steps = 100;
  o.min_lr = 1e-4;
  auto c = MakeConfig("tiny", o);
  ASSERT_TRUE(c.ok()) << c.status().message();
  EXPECT_EQ(c->lr_decay(), proto::LR_DECAY_COSINE);  // decay steps alone mean cosine
  EXPECT_EQ(c->lr_warmup_steps(), 10);
  o.lr_decay = "linear";
  EXPECT_EQ(MakeConfig("tiny", o)->lr_decay(), proto::LR_DECAY_LINEAR);
  struct Case {
    ModelOverrides o;
    const char* expect;
  };
  std::vector<Case> cases(5);
  cases[0].o.lr_decay = "cosine";
  cases[0].expect = "needs --decay-steps";
  cases[1].o.lr_decay = "step";
  cases[1].expect = "--lr-decay step is not a schedule";
  cases[2].o.min_lr = 1.0;
  cases[2].expect = "--min-lr 1 is above --lr";
  cases[3].o.lr = std::nan("");
  cases[3].expect = "--lr must be a finite number";
  cases[4].o.lr_warmup_steps = -1;
  cases[4].expect = "must not be negative";
  for (const Case& k : cases) {
    auto bad = MakeConfig("tiny", k.o);
    ASSERT_FALSE(bad.ok()) << k.expect;
    EXPECT_NE(bad.status().message().find(k.expect), std::string::npos) << bad.status().message();
  }
}

}  // namespace
}  // namespace dc
