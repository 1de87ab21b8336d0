#include "models/model.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <unordered_map>
#include <utility>

#include "models/param_names.h"
#include "schemas/op_kinds.h"

namespace dc {
namespace {

namespace pn = param_names;

// ---------------------------------------------------------------------------------------------
// Presets

struct Preset {
  const char* name;
  int64_t layers, hidden, heads, kv_heads, ffn, vocab, seq, micro_batch, gas;
  proto::DType compute_dtype;
  double rope_theta;
  double lr;
  int64_t experts, top_k;  // 0, 0: a dense Llama MLP; else a Mixtral MoE block per layer
};

// Llama 3 and Mixtral shapes with their published rope theta; tiny, small and mixtral-tiny are
// CPU-sized. The training settings every preset shares are in CommonDefaults.
// clang-format off
constexpr Preset kPresets[] = {
    // name          layers hidden heads kv  ffn    vocab   seq   mb gas dtype              theta lr      E  k
    {"tiny",         2,     64,    4,    2,  128,   256,    32,   2, 1,  proto::DTYPE_F32,  1e4,  3e-3,   0, 0},
    {"small",        4,     256,   8,    4,  688,   2048,   128,  4, 1,  proto::DTYPE_F32,  1e4,  1e-3,   0, 0},
    {"llama-1b",     16,    2048,  32,   8,  8192,  128256, 2048, 1, 1,  proto::DTYPE_BF16, 5e5,  3e-4,   0, 0},
    {"llama3-8b",    32,    4096,  32,   8,  14336, 128256, 2048, 1, 1,  proto::DTYPE_BF16, 5e5,  3e-4,   0, 0},
    {"llama3-70b",   80,    8192,  64,   8,  28672, 128256, 2048, 1, 1,  proto::DTYPE_BF16, 5e5,  1.5e-4, 0, 0},
    {"mixtral-tiny", 2,     64,    4,    2,  64,    256,    32,   2, 1,  proto::DTYPE_F32,  1e6,  3e-3,   8, 2},
    {"mixtral-8x7b", 32,    4096,  32,   8,  14336, 32000,  2048, 1, 1,  proto::DTYPE_BF16, 1e6,  3e-4,   8, 2},
};
// clang-format on

// Settings every preset shares (Llama 3 / GPT-style training defaults).
struct CommonDefaults {
  static constexpr double kNormEps = 1e-5;
  static constexpr double kInitStd = 0.02;
  static constexpr double kBeta1 = 0.9;
  static constexpr double kBeta2 = 0.95;
  static constexpr double kAdamEps = 1e-8;
  static constexpr double kWeightDecay = 0.1;
  static constexpr uint64_t kSeed = 1234;
  // Mixtral's load-balancing loss weight (Hugging Face MixtralConfig.router_aux_loss_coef).
  static constexpr double kRouterAuxCoef = 0.001;
};

proto::ModelConfig ConfigFromPreset(const Preset& p) {
  proto::ModelConfig c;
  c.set_preset(p.name);
  c.set_family(p.experts > 0 ? kFamilyMixtral : kFamilyLlama);
  c.set_layers(p.layers);
  c.set_hidden(p.hidden);
  c.set_heads(p.heads);
  c.set_kv_heads(p.kv_heads);
  c.set_ffn(p.ffn);
  c.set_vocab(p.vocab);
  c.set_seq(p.seq);
  c.set_micro_batch(p.micro_batch);
  c.set_gas(p.gas);
  c.set_compute_dtype(p.compute_dtype);
  c.set_rope_theta(p.rope_theta);
  c.set_norm_eps(CommonDefaults::kNormEps);
  c.set_init_std(CommonDefaults::kInitStd);
  c.set_lr(p.lr);
  c.set_beta1(CommonDefaults::kBeta1);
  c.set_beta2(CommonDefaults::kBeta2);
  c.set_adam_eps(CommonDefaults::kAdamEps);
  c.set_weight_decay(CommonDefaults::kWeightDecay);
  c.set_seed(CommonDefaults::kSeed);
  if (p.experts > 0) {
    c.set_experts(p.experts);
    c.set_top_k(p.top_k);
    c.set_router_aux_coef(CommonDefaults::kRouterAuxCoef);
  }
  return c;
}

// ---------------------------------------------------------------------------------------------
// FLOPs per execution (formulas in op_kinds.h).

constexpr double kFlopsPerMac = 2;
constexpr double kMatmulBackwardGemms = 2;  // dX and dW
constexpr double kRmsNormFlopsPerElement = 4;
constexpr double kRmsNormBackwardFlopsPerElement = 8;
constexpr double kRopeFlopsPerElement = 3;
constexpr double kSwigluFlopsPerElement = 5;
constexpr double kSwigluBackwardFlopsPerElement = 10;
constexpr double kCrossEntropyFlopsPerElement = 4;
constexpr double kAdamWFlopsPerElement = 12;
constexpr double kGradNormFlopsPerElement = 2;  // a square and an add
// Causal attention does half of each S x S matmul; forward has two (QK^T, PV), backward five
// (recomputed QK^T, dP, dV, dQ, dK).
constexpr double kCausalFraction = 0.5;
constexpr double kAttentionForwardGemms = 2;
constexpr double kAttentionBackwardGemms = 5;
// Mixture of experts (op_kinds.h).
constexpr double kRouterFlopsPerElement = 6;
constexpr double kRouterBackwardFlopsPerElement = 8;
constexpr double kCombineFlopsPerElement = 2;
constexpr double kCombineBackwardFlopsPerElement = 4;

// ---------------------------------------------------------------------------------------------
// The builder: Llama, and Mixtral (Llama attention, a mixture-of-experts MLP).

class LlamaBuilder {
 public:
  explicit LlamaBuilder(const proto::ModelConfig& config)
      : config_(config),
        batch_(config.micro_batch()),
        seq_(config.seq()),
        tokens_(config.micro_batch() * config.seq()),
        hidden_(config.hidden()),
        heads_(config.heads()),
        kv_heads_(config.kv_heads()),
        head_dim_(config.hidden() / config.heads()),
        ffn_(config.ffn()),
        vocab_(config.vocab()),
        experts_(config.experts()),
        top_k_(config.top_k()) {}

  proto::Program Build() &&;

 private:
  // A dense layer has w_gate, w_up, w_down; a MoE layer a router and E of each instead.
  struct LayerParams {
    int attn_norm, wq, wk, wv, wo, mlp_norm, w_gate = -1, w_up = -1, w_down = -1, router = -1;
    std::vector<int> expert_gate, expert_up, expert_down;
  };
  // Forward tensors of one layer that its backward reads (q and k only name and shape their
  // grads). In a MoE layer gate, up and act are the experts' [M * k, F] rows.
  struct LayerActs {
    int x, attn_norm_out, q, k, q_rot, k_rot, v, ctx, h, mlp_norm_out, gate, up, act;
    int router_logits = -1, gates = -1, experts = -1, xs = -1, ys = -1;
  };
  bool moe() const { return experts_ > 0; }

  int AddTensor(const std::string& name, std::vector<int64_t> shape, proto::DType dtype,
                proto::Role role, int layer, int param = -1);
  int AddParam(const std::string& name, std::vector<int64_t> shape, int layer);
  int AddActivation(const std::string& name, std::vector<int64_t> shape, int layer) {
    return AddTensor(name, std::move(shape), config_.compute_dtype(), proto::ROLE_ACTIVATION,
                     layer);
  }
  // An activation shaped like `like`, named `name`.
  int AddActivationLike(const std::string& name, int like) {
    const auto& t = program_.tensors(like);
    return AddActivation(name, {t.shape().begin(), t.shape().end()}, t.layer());
  }
  int AddGrad(int param);
  proto::Op* AddOp(const std::string& name, const char* kind, proto::Phase phase, int layer,
                   const std::vector<int>& inputs, const std::vector<int>& outputs, double flops);
  const std::string& Name(int tensor) const { return program_.tensors(tensor).name(); }
  std::vector<int64_t> Tokens(int64_t width) const { return {batch_, seq_, width}; }

  // Forward pieces; each returns its output tensor.
  int RmsNorm(const std::string& name, int x, int w, int layer);
  int Matmul(const std::string& op_name, const std::string& out_name, int x, int w, int layer);
  int Rope(const std::string& op_name, const std::string& out_name, int x, int64_t heads,
           int layer);
  int Add(const std::string& op_name, const std::string& out_name, std::initializer_list<int> xs,
          int layer, proto::Phase phase);
  LayerParams MakeLayerParams(int layer);
  // A checkpointed layer's forward again, from its kept input `x`, as backward-phase ops
  // recomputing the forward's (Op.recompute_of; kRecomputeSuffix names), without what only the
  // layer's output needs.
  LayerActs RecomputeLayer(int layer, const LayerParams& p, int x);
  // Adds layer `layer` reading `x`; sets `*out` to its output (null: stops at what the layer's
  // backward reads).
  LayerActs LayerForward(int layer, const LayerParams& p, int x, int* out);
  // The MoE MLP of a layer reading a->mlp_norm_out; returns its output, or -1 without the
  // combine when `combine_output` is false.
  int MoeForward(int layer, const LayerParams& p, LayerActs* a, bool combine_output);
  // One matmul per expert over its rows of x (an expert-major [M * k, K] activation).
  int GroupedMatmul(const std::string& op_name, const std::string& out_name, int x, int experts,
                    const std::vector<int>& weights, int layer);

  // Backward pieces; each returns the gradient of the forward op's activation input.
  int MatmulBackward(const std::string& fwd_op, int dy, int x, int w, const std::string& dx_name);
  int RmsNormBackward(const std::string& fwd_op, int dy, int x, int w, const std::string& dx_name);
  int RopeBackward(const std::string& fwd_op, int dy, int x, int64_t heads);
  // The gradient of `x` from several consumers: one `add` op.
  int JoinGrads(int x, std::initializer_list<int> partials, int layer);
  int LayerBackward(int layer, const LayerParams& p, const LayerActs& a, int d_out);
  // The MLP's backward from d_out; returns the gradient of a.mlp_norm_out.
  int DenseMlpBackward(int layer, const LayerParams& p, const LayerActs& a, int d_out);
  int MoeBackward(int layer, const LayerParams& p, const LayerActs& a, int d_out);
  int GroupedMatmulBackward(const std::string& fwd_op, int dy, int x, int experts,
                            const std::vector<int>& weights, const std::string& dx_name);

  void Optimizer();
  double AttentionFlops(double gemms) const {
    return gemms * kFlopsPerMac * kCausalFraction * static_cast<double>(batch_ * heads_) *
           static_cast<double>(seq_ * seq_ * head_dim_);
  }

  const proto::ModelConfig& config_;
  const int64_t batch_, seq_, tokens_, hidden_, heads_, kv_heads_, head_dim_, ffn_, vocab_;
  const int64_t experts_, top_k_;
  proto::Program program_;
  std::vector<int> params_;
  std::unordered_map<int, int> grad_of_;  // param id -> its grad's id
  bool recomputing_ = false;  // inside RecomputeLayer: forward ops become backward recomputes
  // Forward ops by name, for the recomputes of RecomputeLayer (which rebuilds them by the same
  // names) to say which op each recomputes.
  std::unordered_map<std::string, int> forward_ops_;
};

int LlamaBuilder::AddTensor(const std::string& name, std::vector<int64_t> shape, proto::DType dtype,
                            proto::Role role, int layer, int param) {
  auto* t = program_.add_tensors();
  const int id = program_.tensors_size() - 1;
  t->set_id(id);
  t->set_name(recomputing_ && role == proto::ROLE_ACTIVATION ? name + op_kind::kRecomputeSuffix
                                                             : name);
  for (int64_t d : shape) t->add_shape(d);
  t->set_dtype(dtype);
  t->set_role(role);
  t->set_layer(layer);
  t->set_param(param);
  return id;
}

int LlamaBuilder::AddParam(const std::string& name, std::vector<int64_t> shape, int layer) {
  const int id = AddTensor(name, std::move(shape), proto::DTYPE_F32, proto::ROLE_PARAM, layer);
  params_.push_back(id);
  return id;
}

int LlamaBuilder::AddGrad(int param) {
  const auto& p = program_.tensors(param);
  const int grad = AddTensor(p.name() + pn::kGradSuffix, {p.shape().begin(), p.shape().end()},
                             config_.compute_dtype(), proto::ROLE_GRAD, p.layer(), param);
  grad_of_[param] = grad;
  return grad;
}

proto::Op* LlamaBuilder::AddOp(const std::string& name, const char* kind, proto::Phase phase,
                               int layer, const std::vector<int>& inputs,
                               const std::vector<int>& outputs, double flops) {
  auto* op = program_.add_ops();
  op->set_id(program_.ops_size() - 1);
  if (recomputing_ && phase == proto::PHASE_FORWARD) {
    // The name keeps the suffix for people reading traces; recompute_of is what says it.
    op->set_name(name + op_kind::kRecomputeSuffix);
    op->set_phase(proto::PHASE_BACKWARD);
    op->set_recompute_of(forward_ops_.at(name));
  } else {
    op->set_name(name);
    op->set_phase(phase);
    if (phase == proto::PHASE_FORWARD) forward_ops_.emplace(name, op->id());
  }
  op->set_kind(kind);
  op->set_layer(layer);
  op->set_flops(flops);
  for (int in : inputs) op->add_inputs(in);
  for (int out : outputs) op->add_outputs(out);
  return op;
}

int LlamaBuilder::RmsNorm(const std::string& name, int x, int w, int layer) {
  const int y = AddActivationLike(name + ".out", x);
  auto* op = AddOp(name, op_kind::kRmsNorm, proto::PHASE_FORWARD, layer, {x, w}, {y},
                   kRmsNormFlopsPerElement * static_cast<double>(tokens_ * hidden_));
  SetAttrFloat(op, op_attr::kEps, config_.norm_eps());
  return y;
}

int LlamaBuilder::Matmul(const std::string& op_name, const std::string& out_name, int x, int w,
                         int layer) {
  const int64_t n = program_.tensors(w).shape(0);
  const int64_t k = program_.tensors(w).shape(1);
  const int y = AddActivation(out_name, Tokens(n), layer);
  AddOp(op_name, op_kind::kMatmul, proto::PHASE_FORWARD, layer, {x, w}, {y},
        kFlopsPerMac * static_cast<double>(tokens_) * static_cast<double>(n * k));
  return y;
}

int LlamaBuilder::Rope(const std::string& op_name, const std::string& out_name, int x,
                       int64_t heads, int layer) {
  const int y = AddActivationLike(out_name, x);
  auto* op = AddOp(op_name, op_kind::kRope, proto::PHASE_FORWARD, layer, {x}, {y},
                   kRopeFlopsPerElement * static_cast<double>(tokens_ * heads * head_dim_));
  SetAttr(op, op_attr::kHeads, heads);
  SetAttr(op, op_attr::kHeadDim, head_dim_);
  SetAttrFloat(op, op_attr::kTheta, config_.rope_theta());
  return y;
}

int LlamaBuilder::Add(const std::string& op_name, const std::string& out_name,
                      std::initializer_list<int> xs, int layer, proto::Phase phase) {
  const int y = AddActivationLike(out_name, *xs.begin());
  const double elements = static_cast<double>(NumElements(program_.tensors(y)));
  AddOp(op_name, op_kind::kAdd, phase, layer, xs, {y},
        static_cast<double>(xs.size() - 1) * elements);
  return y;
}

LlamaBuilder::LayerParams LlamaBuilder::MakeLayerParams(int layer) {
  const std::string p = pn::LayerPrefix(layer);
  const int64_t q_width = heads_ * head_dim_;
  const int64_t kv_width = kv_heads_ * head_dim_;
  LayerParams lp;
  lp.attn_norm = AddParam(p + pn::kAttnNorm, {hidden_}, layer);
  lp.wq = AddParam(p + pn::kWq, {q_width, hidden_}, layer);
  lp.wk = AddParam(p + pn::kWk, {kv_width, hidden_}, layer);
  lp.wv = AddParam(p + pn::kWv, {kv_width, hidden_}, layer);
  lp.wo = AddParam(p + pn::kWo, {hidden_, q_width}, layer);
  lp.mlp_norm = AddParam(p + pn::kMlpNorm, {hidden_}, layer);
  if (!moe()) {
    lp.w_gate = AddParam(p + pn::kWGate, {ffn_, hidden_}, layer);
    lp.w_up = AddParam(p + pn::kWUp, {ffn_, hidden_}, layer);
    lp.w_down = AddParam(p + pn::kWDown, {hidden_, ffn_}, layer);
    return lp;
  }
  lp.router = AddParam(p + pn::kRouter, {experts_, hidden_}, layer);
  for (int64_t e = 0; e < experts_; ++e) {
    const std::string expert = pn::ExpertPrefix(layer, e);
    lp.expert_gate.push_back(AddParam(expert + pn::kWGate, {ffn_, hidden_}, layer));
    lp.expert_up.push_back(AddParam(expert + pn::kWUp, {ffn_, hidden_}, layer));
    lp.expert_down.push_back(AddParam(expert + pn::kWDown, {hidden_, ffn_}, layer));
  }
  return lp;
}

LlamaBuilder::LayerActs LlamaBuilder::LayerForward(int layer, const LayerParams& p, int x,
                                                   int* out) {
  const std::string pre = pn::LayerPrefix(layer);
  LayerActs a;
  a.x = x;
  a.attn_norm_out = RmsNorm(pre + pn::kAttnNorm, x, p.attn_norm, layer);
  a.q = Matmul(pre + "attn.q_proj", pre + "attn.q", a.attn_norm_out, p.wq, layer);
  a.k = Matmul(pre + "attn.k_proj", pre + "attn.k", a.attn_norm_out, p.wk, layer);
  a.v = Matmul(pre + "attn.v_proj", pre + "attn.v", a.attn_norm_out, p.wv, layer);
  a.q_rot = Rope(pre + "attn.q_rope", pre + "attn.q_rot", a.q, heads_, layer);
  a.k_rot = Rope(pre + "attn.k_rope", pre + "attn.k_rot", a.k, kv_heads_, layer);
  a.ctx = AddActivationLike(pre + "attn.ctx", a.q_rot);
  auto* sdpa = AddOp(pre + "attn.sdpa", op_kind::kAttention, proto::PHASE_FORWARD, layer,
                     {a.q_rot, a.k_rot, a.v}, {a.ctx}, AttentionFlops(kAttentionForwardGemms));
  SetAttr(sdpa, op_attr::kHeads, heads_);
  SetAttr(sdpa, op_attr::kKvHeads, kv_heads_);
  SetAttr(sdpa, op_attr::kHeadDim, head_dim_);
  const int attn_out = Matmul(pre + "attn.o_proj", pre + "attn.out", a.ctx, p.wo, layer);
  a.h = Add(pre + "attn.add", pre + "h", {x, attn_out}, layer, proto::PHASE_FORWARD);

  a.mlp_norm_out = RmsNorm(pre + pn::kMlpNorm, a.h, p.mlp_norm, layer);
  if (moe()) {
    const int moe_out = MoeForward(layer, p, &a, out != nullptr);
    if (out) *out = Add(pre + "mlp.add", pre + "out", {a.h, moe_out}, layer, proto::PHASE_FORWARD);
    return a;
  }
  a.gate = Matmul(pre + "mlp.gate_proj", pre + "mlp.gate", a.mlp_norm_out, p.w_gate, layer);
  a.up = Matmul(pre + "mlp.up_proj", pre + "mlp.up", a.mlp_norm_out, p.w_up, layer);
  a.act = AddActivationLike(pre + "mlp.act", a.gate);
  AddOp(pre + "mlp.swiglu", op_kind::kSwiglu, proto::PHASE_FORWARD, layer, {a.gate, a.up}, {a.act},
        kSwigluFlopsPerElement * static_cast<double>(tokens_ * ffn_));
  if (out == nullptr) return a;  // down_proj's backward reads act and w_down, not its output
  const int down = Matmul(pre + "mlp.down_proj", pre + "mlp.down", a.act, p.w_down, layer);
  *out = Add(pre + "mlp.add", pre + "out", {a.h, down}, layer, proto::PHASE_FORWARD);
  return a;
}

LlamaBuilder::LayerActs LlamaBuilder::RecomputeLayer(int layer, const LayerParams& p, int x) {
  recomputing_ = true;
  LayerActs a = LayerForward(layer, p, x, nullptr);
  recomputing_ = false;
  return a;
}

int LlamaBuilder::GroupedMatmul(const std::string& op_name, const std::string& out_name, int x,
                                int experts, const std::vector<int>& weights, int layer) {
  const int64_t rows = program_.tensors(x).shape(0);
  const int64_t n = program_.tensors(weights.front()).shape(0);
  const int64_t k = program_.tensors(weights.front()).shape(1);
  const int y = AddActivation(out_name, {rows, n}, layer);
  std::vector<int> inputs = {x, experts};
  inputs.insert(inputs.end(), weights.begin(), weights.end());
  AddOp(op_name, op_kind::kGroupedMatmul, proto::PHASE_FORWARD, layer, inputs, {y},
        kFlopsPerMac * static_cast<double>(rows) * static_cast<double>(n * k));
  return y;
}

int LlamaBuilder::MoeForward(int layer, const LayerParams& p, LayerActs* a, bool combine_output) {
  const std::string pre = pn::LayerPrefix(layer);
  const double slots = static_cast<double>(tokens_ * top_k_);
  a->router_logits =
      Matmul(pre + "moe.router", pre + "moe.router_logits", a->mlp_norm_out, p.router, layer);
  a->gates =
      AddTensor(pre + "moe.gates", Tokens(top_k_), proto::DTYPE_F32, proto::ROLE_ACTIVATION, layer);
  a->experts = AddTensor(pre + "moe.experts", Tokens(top_k_), proto::DTYPE_I32,
                         proto::ROLE_ACTIVATION, layer);
  const int aux = AddTensor(pre + "moe" + op_kind::kAuxLossSuffix, {1}, proto::DTYPE_F32,
                            proto::ROLE_ACTIVATION, layer);
  auto* route = AddOp(pre + "moe.route", op_kind::kMoeRouter, proto::PHASE_FORWARD, layer,
                      {a->router_logits}, {a->gates, a->experts, aux},
                      kRouterFlopsPerElement * static_cast<double>(tokens_ * experts_));
  SetAttr(route, op_attr::kTopK, top_k_);
  SetAttrFloat(route, op_attr::kAuxCoef, config_.router_aux_coef());

  a->xs = AddActivation(pre + "moe.dispatched", {tokens_ * top_k_, hidden_}, layer);
  auto* dispatch = AddOp(pre + "moe.dispatch", op_kind::kMoeDispatch, proto::PHASE_FORWARD, layer,
                         {a->mlp_norm_out, a->experts}, {a->xs}, 0);
  SetAttr(dispatch, op_attr::kExperts, experts_);
  a->gate = GroupedMatmul(pre + "experts.gate_proj", pre + "experts.gate", a->xs, a->experts,
                          p.expert_gate, layer);
  a->up = GroupedMatmul(pre + "experts.up_proj", pre + "experts.up", a->xs, a->experts, p.expert_up,
                        layer);
  a->act = AddActivationLike(pre + "experts.act", a->gate);
  AddOp(pre + "experts.swiglu", op_kind::kSwiglu, proto::PHASE_FORWARD, layer, {a->gate, a->up},
        {a->act}, kSwigluFlopsPerElement * slots * static_cast<double>(ffn_));
  a->ys = GroupedMatmul(pre + "experts.down_proj", pre + "experts.down", a->act, a->experts,
                        p.expert_down, layer);
  if (!combine_output) return -1;  // the combine's backward reads ys, gates and experts
  const int y = AddActivation(pre + "moe.out", Tokens(hidden_), layer);
  auto* combine = AddOp(pre + "moe.combine", op_kind::kMoeCombine, proto::PHASE_FORWARD, layer,
                        {a->ys, a->gates, a->experts}, {y},
                        kCombineFlopsPerElement * slots * static_cast<double>(hidden_));
  SetAttr(combine, op_attr::kExperts, experts_);
  return y;
}

int LlamaBuilder::GroupedMatmulBackward(const std::string& fwd_op, int dy, int x, int experts,
                                        const std::vector<int>& weights,
                                        const std::string& dx_name) {
  const int layer = program_.tensors(x).layer();
  const int dx = AddActivationLike(dx_name, x);
  std::vector<int> inputs = {dy, x, experts};
  inputs.insert(inputs.end(), weights.begin(), weights.end());
  std::vector<int> outputs = {dx};
  for (int w : weights) outputs.push_back(AddGrad(w));
  const double macs = static_cast<double>(program_.tensors(x).shape(0)) *
                      static_cast<double>(NumElements(program_.tensors(weights.front())));
  AddOp(fwd_op + ".backward", op_kind::kGroupedMatmulBackward, proto::PHASE_BACKWARD, layer, inputs,
        outputs, kMatmulBackwardGemms * kFlopsPerMac * macs);
  return dx;
}

int LlamaBuilder::MoeBackward(int layer, const LayerParams& p, const LayerActs& a, int d_out) {
  const std::string pre = pn::LayerPrefix(layer);
  const double slots = static_cast<double>(tokens_ * top_k_);
  auto partial = [&](int x, const char* consumer) {
    return Name(x) + pn::kGradSuffix + ".from_" + consumer;
  };
  const int d_ys = AddActivationLike(Name(a.ys) + pn::kGradSuffix, a.ys);
  // fp32 like the gates whatever the compute dtype (op_kinds.h: moe_combine_backward's dgates).
  const int d_gates = AddTensor(Name(a.gates) + pn::kGradSuffix, Tokens(top_k_), proto::DTYPE_F32,
                                proto::ROLE_ACTIVATION, layer);
  auto* combine =
      AddOp(pre + "moe.combine.backward", op_kind::kMoeCombineBackward, proto::PHASE_BACKWARD,
            layer, {d_out, a.ys, a.gates, a.experts}, {d_ys, d_gates},
            kCombineBackwardFlopsPerElement * slots * static_cast<double>(hidden_));
  SetAttr(combine, op_attr::kExperts, experts_);
  const int d_act = GroupedMatmulBackward(pre + "experts.down_proj", d_ys, a.act, a.experts,
                                          p.expert_down, Name(a.act) + pn::kGradSuffix);
  const int d_gate = AddActivationLike(Name(a.gate) + pn::kGradSuffix, a.gate);
  const int d_up = AddActivationLike(Name(a.up) + pn::kGradSuffix, a.up);
  AddOp(pre + "experts.swiglu.backward", op_kind::kSwigluBackward, proto::PHASE_BACKWARD, layer,
        {d_act, a.gate, a.up}, {d_gate, d_up},
        kSwigluBackwardFlopsPerElement * slots * static_cast<double>(ffn_));
  const int d_xs_up = GroupedMatmulBackward(pre + "experts.up_proj", d_up, a.xs, a.experts,
                                            p.expert_up, partial(a.xs, "up_proj"));
  const int d_xs_gate = GroupedMatmulBackward(pre + "experts.gate_proj", d_gate, a.xs, a.experts,
                                              p.expert_gate, partial(a.xs, "gate_proj"));
  const int d_xs = JoinGrads(a.xs, {d_xs_gate, d_xs_up}, layer);
  const int d_n2_dispatch = AddActivationLike(partial(a.mlp_norm_out, "dispatch"), a.mlp_norm_out);
  auto* dispatch =
      AddOp(pre + "moe.dispatch.backward", op_kind::kMoeDispatchBackward, proto::PHASE_BACKWARD,
            layer, {d_xs, a.experts}, {d_n2_dispatch}, slots * static_cast<double>(hidden_));
  SetAttr(dispatch, op_attr::kExperts, experts_);
  const int d_logits = AddActivationLike(Name(a.router_logits) + pn::kGradSuffix, a.router_logits);
  auto* route =
      AddOp(pre + "moe.route.backward", op_kind::kMoeRouterBackward, proto::PHASE_BACKWARD, layer,
            {d_gates, a.router_logits, a.experts}, {d_logits},
            kRouterBackwardFlopsPerElement * static_cast<double>(tokens_ * experts_));
  SetAttr(route, op_attr::kTopK, top_k_);
  SetAttrFloat(route, op_attr::kAuxCoef, config_.router_aux_coef());
  const int d_n2_router = MatmulBackward(pre + "moe.router", d_logits, a.mlp_norm_out, p.router,
                                         partial(a.mlp_norm_out, "router"));
  return JoinGrads(a.mlp_norm_out, {d_n2_router, d_n2_dispatch}, layer);
}

int LlamaBuilder::MatmulBackward(const std::string& fwd_op, int dy, int x, int w,
                                 const std::string& dx_name) {
  const int layer = program_.tensors(w).layer();
  const int dx = AddActivationLike(dx_name, x);
  const int dw = AddGrad(w);
  const double macs =
      static_cast<double>(tokens_) * static_cast<double>(NumElements(program_.tensors(w)));
  AddOp(fwd_op + ".backward", op_kind::kMatmulBackward, proto::PHASE_BACKWARD, layer, {dy, x, w},
        {dx, dw}, kMatmulBackwardGemms * kFlopsPerMac * macs);
  return dx;
}

int LlamaBuilder::RmsNormBackward(const std::string& fwd_op, int dy, int x, int w,
                                  const std::string& dx_name) {
  const int layer = program_.tensors(w).layer();
  const int dx = AddActivationLike(dx_name, x);
  const int dw = AddGrad(w);
  auto* op = AddOp(fwd_op + ".backward", op_kind::kRmsNormBackward, proto::PHASE_BACKWARD, layer,
                   {dy, x, w}, {dx, dw},
                   kRmsNormBackwardFlopsPerElement * static_cast<double>(tokens_ * hidden_));
  SetAttrFloat(op, op_attr::kEps, config_.norm_eps());
  return dx;
}

int LlamaBuilder::RopeBackward(const std::string& fwd_op, int dy, int x, int64_t heads) {
  const int layer = program_.tensors(x).layer();
  const int dx = AddActivationLike(Name(x) + pn::kGradSuffix, x);
  auto* op = AddOp(fwd_op + ".backward", op_kind::kRopeBackward, proto::PHASE_BACKWARD, layer, {dy},
                   {dx}, kRopeFlopsPerElement * static_cast<double>(tokens_ * heads * head_dim_));
  SetAttr(op, op_attr::kHeads, heads);
  SetAttr(op, op_attr::kHeadDim, head_dim_);
  SetAttrFloat(op, op_attr::kTheta, config_.rope_theta());
  return dx;
}

int LlamaBuilder::JoinGrads(int x, std::initializer_list<int> partials, int layer) {
  const std::string grad_name = Name(x) + pn::kGradSuffix;
  return Add(grad_name + ".join", grad_name, partials, layer, proto::PHASE_BACKWARD);
}

int LlamaBuilder::DenseMlpBackward(int layer, const LayerParams& p, const LayerActs& a, int d_out) {
  const std::string pre = pn::LayerPrefix(layer);
  auto partial = [&](int x, const char* consumer) {
    return Name(x) + pn::kGradSuffix + ".from_" + consumer;
  };
  const int d_act =
      MatmulBackward(pre + "mlp.down_proj", d_out, a.act, p.w_down, Name(a.act) + pn::kGradSuffix);
  const int d_gate = AddActivationLike(Name(a.gate) + pn::kGradSuffix, a.gate);
  const int d_up = AddActivationLike(Name(a.up) + pn::kGradSuffix, a.up);
  AddOp(pre + "mlp.swiglu.backward", op_kind::kSwigluBackward, proto::PHASE_BACKWARD, layer,
        {d_act, a.gate, a.up}, {d_gate, d_up},
        kSwigluBackwardFlopsPerElement * static_cast<double>(tokens_ * ffn_));
  const int d_n2_up = MatmulBackward(pre + "mlp.up_proj", d_up, a.mlp_norm_out, p.w_up,
                                     partial(a.mlp_norm_out, "up_proj"));
  const int d_n2_gate = MatmulBackward(pre + "mlp.gate_proj", d_gate, a.mlp_norm_out, p.w_gate,
                                       partial(a.mlp_norm_out, "gate_proj"));
  return JoinGrads(a.mlp_norm_out, {d_n2_gate, d_n2_up}, layer);
}

int LlamaBuilder::LayerBackward(int layer, const LayerParams& p, const LayerActs& a, int d_out) {
  const std::string pre = pn::LayerPrefix(layer);
  auto partial = [&](int x, const char* consumer) {
    return Name(x) + pn::kGradSuffix + ".from_" + consumer;
  };
  // MLP. The residual add passes d_out unchanged to both of its inputs.
  const int d_n2 = moe() ? MoeBackward(layer, p, a, d_out) : DenseMlpBackward(layer, p, a, d_out);
  const int d_h_norm =
      RmsNormBackward(pre + pn::kMlpNorm, d_n2, a.h, p.mlp_norm, partial(a.h, pn::kMlpNorm));
  const int d_h = JoinGrads(a.h, {d_out, d_h_norm}, layer);

  // Attention.
  const int d_ctx =
      MatmulBackward(pre + "attn.o_proj", d_h, a.ctx, p.wo, Name(a.ctx) + pn::kGradSuffix);
  const int d_q_rot = AddActivationLike(Name(a.q_rot) + pn::kGradSuffix, a.q_rot);
  const int d_k_rot = AddActivationLike(Name(a.k_rot) + pn::kGradSuffix, a.k_rot);
  const int d_v = AddActivationLike(Name(a.v) + pn::kGradSuffix, a.v);
  auto* sdpa = AddOp(pre + "attn.sdpa.backward", op_kind::kAttentionBackward, proto::PHASE_BACKWARD,
                     layer, {d_ctx, a.q_rot, a.k_rot, a.v}, {d_q_rot, d_k_rot, d_v},
                     AttentionFlops(kAttentionBackwardGemms));
  SetAttr(sdpa, op_attr::kHeads, heads_);
  SetAttr(sdpa, op_attr::kKvHeads, kv_heads_);
  SetAttr(sdpa, op_attr::kHeadDim, head_dim_);
  const int d_k = RopeBackward(pre + "attn.k_rope", d_k_rot, a.k, kv_heads_);
  const int d_q = RopeBackward(pre + "attn.q_rope", d_q_rot, a.q, heads_);
  const int d_n1_v = MatmulBackward(pre + "attn.v_proj", d_v, a.attn_norm_out, p.wv,
                                    partial(a.attn_norm_out, "v_proj"));
  const int d_n1_k = MatmulBackward(pre + "attn.k_proj", d_k, a.attn_norm_out, p.wk,
                                    partial(a.attn_norm_out, "k_proj"));
  const int d_n1_q = MatmulBackward(pre + "attn.q_proj", d_q, a.attn_norm_out, p.wq,
                                    partial(a.attn_norm_out, "q_proj"));
  const int d_n1 = JoinGrads(a.attn_norm_out, {d_n1_q, d_n1_k, d_n1_v}, layer);
  const int d_x_norm =
      RmsNormBackward(pre + pn::kAttnNorm, d_n1, a.x, p.attn_norm, partial(a.x, pn::kAttnNorm));
  return JoinGrads(a.x, {d_h, d_x_norm}, layer);
}

void LlamaBuilder::Optimizer() {
  // With clipping, one op sums the squares of every grad first; each AdamW op reads the sum
  // (made global by the schedule's all-reduce), so the dependency is in the program.
  const bool clip = config_.clip_grad_norm() > 0;
  int norm_squared = -1;
  if (clip) {
    std::vector<int> grads;
    int64_t elements = 0;
    for (int param : params_) {
      grads.push_back(grad_of_.at(param));
      elements += NumElements(program_.tensors(param));
    }
    norm_squared =
        AddTensor("grad_norm_squared", {1}, proto::DTYPE_F32, proto::ROLE_ACTIVATION, -1);
    AddOp("grad_norm_squared", op_kind::kGradNormSquared, proto::PHASE_OPTIMIZER, -1, grads,
          {norm_squared}, kGradNormFlopsPerElement * static_cast<double>(elements));
  }
  for (int param : params_) {
    const auto& p = program_.tensors(param);
    const std::string name = p.name();
    const std::vector<int64_t> shape(p.shape().begin(), p.shape().end());
    const int layer = p.layer();
    const bool is_matrix = shape.size() >= 2;
    const int64_t elements = NumElements(p);
    const int grad = grad_of_.at(param);
    const int m = AddTensor(name + pn::kAdamMSuffix, shape, proto::DTYPE_F32,
                            proto::ROLE_OPTIMIZER_STATE, layer, param);
    const int v = AddTensor(name + pn::kAdamVSuffix, shape, proto::DTYPE_F32,
                            proto::ROLE_OPTIMIZER_STATE, layer, param);
    std::vector<int> inputs = {param, grad, m, v};
    if (clip) inputs.push_back(norm_squared);
    auto* op = AddOp(name + ".adamw", op_kind::kAdamW, proto::PHASE_OPTIMIZER, layer, inputs, {},
                     kAdamWFlopsPerElement * static_cast<double>(elements));
    SetAttrFloat(op, op_attr::kLr, config_.lr());
    SetAttrFloat(op, op_attr::kBeta1, config_.beta1());
    SetAttrFloat(op, op_attr::kBeta2, config_.beta2());
    SetAttrFloat(op, op_attr::kEps, config_.adam_eps());
    SetAttrFloat(op, op_attr::kWeightDecay, is_matrix ? config_.weight_decay() : 0.0);
    if (clip) SetAttrFloat(op, op_attr::kMaxGradNorm, config_.clip_grad_norm());
  }
}

proto::Program LlamaBuilder::Build() && {
  program_.set_format_version(kProgramFormatVersion);
  *program_.mutable_config() = config_;
  const int tokens = AddTensor("tokens", {batch_, seq_}, proto::DTYPE_I32, proto::ROLE_INPUT, -1);
  const int targets = AddTensor("targets", {batch_, seq_}, proto::DTYPE_I32, proto::ROLE_INPUT, -1);

  // Forward.
  const int embed = AddParam(pn::kEmbed, {vocab_, hidden_}, -1);
  int x = AddActivation(std::string(pn::kEmbed) + ".out", Tokens(hidden_), -1);
  AddOp(pn::kEmbed, op_kind::kEmbedding, proto::PHASE_FORWARD, -1, {tokens, embed}, {x}, 0);
  const int num_layers = static_cast<int>(config_.layers());
  std::vector<LayerParams> layer_params;
  std::vector<LayerActs> layer_acts;
  layer_params.reserve(num_layers);
  layer_acts.reserve(num_layers);
  for (int l = 0; l < num_layers; ++l) {
    layer_params.push_back(MakeLayerParams(l));
    layer_acts.push_back(LayerForward(l, layer_params.back(), x, &x));
  }
  const int final_norm = AddParam(pn::kFinalNorm, {hidden_}, -1);
  const int lm_head = AddParam(pn::kLmHead, {vocab_, hidden_}, -1);
  const int final_out = RmsNorm(pn::kFinalNorm, x, final_norm, -1);
  const int logits = Matmul(pn::kLmHead, "logits", final_out, lm_head, -1);
  const int loss = AddTensor("loss", {1}, proto::DTYPE_F32, proto::ROLE_ACTIVATION, -1);
  const double ce_flops = kCrossEntropyFlopsPerElement * static_cast<double>(tokens_ * vocab_);
  AddOp("loss", op_kind::kCrossEntropy, proto::PHASE_FORWARD, -1, {logits, targets}, {loss},
        ce_flops);

  // Backward, in reverse.
  const int d_logits = AddActivationLike("logits.grad", logits);
  AddOp("loss.backward", op_kind::kCrossEntropyBackward, proto::PHASE_BACKWARD, -1,
        {logits, targets}, {d_logits}, ce_flops);
  const int d_final_out =
      MatmulBackward(pn::kLmHead, d_logits, final_out, lm_head, Name(final_out) + pn::kGradSuffix);
  int d_x = RmsNormBackward(pn::kFinalNorm, d_final_out, x, final_norm, Name(x) + pn::kGradSuffix);
  for (int l = num_layers - 1; l >= 0; --l) {
    const LayerActs acts = config_.recompute_layers()
                               ? RecomputeLayer(l, layer_params[l], layer_acts[l].x)
                               : layer_acts[l];
    d_x = LayerBackward(l, layer_params[l], acts, d_x);
  }
  const int d_embed = AddGrad(embed);
  AddOp(std::string(pn::kEmbed) + ".backward", op_kind::kEmbeddingBackward, proto::PHASE_BACKWARD,
        -1, {d_x, tokens}, {d_embed}, static_cast<double>(tokens_ * hidden_));

  Optimizer();
  return std::move(program_);
}

}  // namespace

std::vector<std::string> PresetNames() {
  std::vector<std::string> names;
  for (const Preset& p : kPresets) names.push_back(p.name);
  return names;
}

// The schedule's flags onto `c`. A decay needs its steps; decay steps without a decay kind mean
// cosine, the usual choice (Llama, GPT-3).
Status ApplyLearningRateSchedule(const ModelOverrides& overrides, proto::ModelConfig* c) {
  if (overrides.lr) c->set_lr(*overrides.lr);
  if (overrides.min_lr) c->set_min_lr(*overrides.min_lr);
  if (overrides.lr_warmup_steps) c->set_lr_warmup_steps(*overrides.lr_warmup_steps);
  if (overrides.lr_decay_steps) {
    c->set_lr_decay_steps(*overrides.lr_decay_steps);
    c->set_lr_decay(proto::LR_DECAY_COSINE);
  }
  if (overrides.lr_decay) {
    const std::string& name = *overrides.lr_decay;
    if (name == "constant") {
      c->set_lr_decay(proto::LR_DECAY_CONSTANT);
    } else if (name == "cosine") {
      c->set_lr_decay(proto::LR_DECAY_COSINE);
    } else if (name == "linear") {
      c->set_lr_decay(proto::LR_DECAY_LINEAR);
    } else {
      return Status::Error("--lr-decay " + name +
                           " is not a schedule; use cosine, linear or constant");
    }
  }
  return Status::Ok();
}

StatusOr<proto::ModelConfig> MakeConfig(const std::string& preset,
                                        const ModelOverrides& overrides) {
  const Preset* found = nullptr;
  for (const Preset& p : kPresets) {
    if (preset == p.name) found = &p;
  }
  if (found == nullptr) {
    std::string known;
    for (const std::string& name : PresetNames()) known += (known.empty() ? "" : ", ") + name;
    return Status::Error("unknown preset '" + preset + "'; known presets: " + known);
  }
  proto::ModelConfig c = ConfigFromPreset(*found);
  if (overrides.layers) c.set_layers(*overrides.layers);
  if (overrides.hidden) c.set_hidden(*overrides.hidden);
  if (overrides.heads) c.set_heads(*overrides.heads);
  if (overrides.kv_heads) c.set_kv_heads(*overrides.kv_heads);
  if (overrides.ffn) c.set_ffn(*overrides.ffn);
  if (overrides.vocab) c.set_vocab(*overrides.vocab);
  if (overrides.seq) c.set_seq(*overrides.seq);
  if (overrides.micro_batch) c.set_micro_batch(*overrides.micro_batch);
  if (overrides.gas) c.set_gas(*overrides.gas);
  if (overrides.seed) c.set_seed(*overrides.seed);
  if (overrides.experts) c.set_experts(*overrides.experts);
  if (overrides.top_k) c.set_top_k(*overrides.top_k);
  if (overrides.router_aux_coef) c.set_router_aux_coef(*overrides.router_aux_coef);
  if (overrides.clip_grad_norm) c.set_clip_grad_norm(*overrides.clip_grad_norm);
  if (overrides.data_path) c.set_data_path(*overrides.data_path);
  if (overrides.recompute_layers) c.set_recompute_layers(*overrides.recompute_layers);
  DC_RETURN_IF_ERROR(ApplyLearningRateSchedule(overrides, &c));
  if (overrides.compute_dtype) {
    const std::string& name = *overrides.compute_dtype;
    if (name == "f32") {
      c.set_compute_dtype(proto::DTYPE_F32);
    } else if (name == "bf16") {
      c.set_compute_dtype(proto::DTYPE_BF16);
    } else if (name == "f16") {
      c.set_compute_dtype(proto::DTYPE_F16);
    } else {
      return Status::Error("--dtype " + name + " is not a compute dtype; use f32, bf16 or f16");
    }
  }
  DC_RETURN_IF_ERROR(ValidateConfig(c));
  return c;
}

StatusOr<proto::Program> BuildProgram(const proto::ModelConfig& config) {
  DC_RETURN_IF_ERROR(ValidateConfig(config));
  return LlamaBuilder(config).Build();
}

int64_t ParamCount(const proto::Program& program) {
  int64_t count = 0;
  for (const auto& t : program.tensors()) {
    if (t.role() == proto::ROLE_PARAM) count += NumElements(t);
  }
  return count;
}

}  // namespace dc
