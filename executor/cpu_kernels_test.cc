#include "executor/cpu_kernels.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <numeric>
#include <random>

#include "executor/data.h"
#include "models/model.h"
#include "schemas/op_kinds.h"

namespace dc {
namespace {

using Shape = std::vector<int64_t>;

// ---------------------------------------------------------------------------------------------
// Test scaffolding: owned buffers and ops.

int64_t Count(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

struct Buffer {
  Shape shape;
  std::vector<float> f32;
  std::vector<int32_t> i32;

  static Buffer F32(Shape shape) {
    Buffer b;
    b.f32.assign(Count(shape), 0.0f);
    b.shape = std::move(shape);
    return b;
  }
  static Buffer I32(Shape shape) {
    Buffer b;
    b.i32.assign(Count(shape), 0);
    b.shape = std::move(shape);
    return b;
  }
  bool is_int() const { return !i32.empty(); }
  TensorRef Ref() {
    TensorRef r;
    r.shape = shape;
    if (is_int()) {
      r.i32 = i32.data();
    } else {
      r.f32 = f32.data();
    }
    return r;
  }
};

Buffer RandomF32(Shape shape, std::mt19937* rng, float mean = 0.0f, float std_dev = 1.0f) {
  Buffer b = Buffer::F32(std::move(shape));
  std::normal_distribution<float> dist(mean, std_dev);
  for (float& v : b.f32) v = dist(*rng);
  return b;
}

Buffer RandomI32(Shape shape, int32_t bound, std::mt19937* rng) {
  Buffer b = Buffer::I32(std::move(shape));
  std::uniform_int_distribution<int32_t> dist(0, bound - 1);
  for (int32_t& v : b.i32) v = dist(*rng);
  return b;
}

proto::Op MakeOp(const std::string& kind, const std::map<std::string, int64_t>& int_attrs = {},
                 const std::map<std::string, double>& float_attrs = {}) {
  proto::Op op;
  op.set_name("test." + kind);
  op.set_kind(kind);
  for (const auto& [name, value] : int_attrs) SetAttr(&op, name, value);
  for (const auto& [name, value] : float_attrs) SetAttrFloat(&op, name, value);
  return op;
}

Status RunOp(const proto::Op& op, std::vector<Buffer*> inputs, std::vector<Buffer*> outputs,
             const KernelContext& context = {}) {
  std::vector<TensorRef> in, out;
  for (Buffer* b : inputs) in.push_back(b->Ref());
  for (Buffer* b : outputs) out.push_back(b->Ref());
  return RunCpuOp(op, in, out, context);
}

// ---------------------------------------------------------------------------------------------
// Finite-difference checks of every backward kind against its forward.

// A forward op, its backward and how the backward's operands map onto the forward's.
struct GradCase {
  proto::Op forward, backward;
  std::vector<Buffer> inputs;        // forward inputs
  std::vector<Shape> output_shapes;  // forward outputs
  // Backward inputs in order: k >= 0 is forward input k, kCotangent the forward output's
  // gradient.
  std::vector<int> backward_inputs;
  std::vector<int> differentiable;  // forward inputs whose gradients backward outputs, in order
  // Cross-entropy: the loss is the root, its cotangent is the context's grad_scale.
  bool loss_root = false;
};
constexpr int kCotangent = -1;

GradCase Case(proto::Op forward, proto::Op backward, std::vector<Shape> output_shapes) {
  GradCase c;
  c.forward = std::move(forward);
  c.backward = std::move(backward);
  c.output_shapes = std::move(output_shapes);
  return c;
}

struct GradCheckOptions {
  double step = 1e-2;           // central-difference step
  double abs_tolerance = 2e-3;  // |analytic - numeric| <= abs + rel * |numeric|
  double rel_tolerance = 2e-2;
  double grad_scale = 0.5;  // for loss_root cases
};

std::vector<Buffer> RunForward(GradCase& c) {
  std::vector<Buffer> outputs;
  for (const Shape& s : c.output_shapes) outputs.push_back(Buffer::F32(s));
  std::vector<Buffer*> in, out;
  for (Buffer& b : c.inputs) in.push_back(&b);
  for (Buffer& b : outputs) out.push_back(&b);
  const Status status = RunOp(c.forward, in, out);
  EXPECT_TRUE(status.ok()) << status.message();
  return outputs;
}

// sum_k <cotangent_k, output_k> in double.
double Objective(GradCase& c, const std::vector<Buffer>& cotangents) {
  const std::vector<Buffer> outputs = RunForward(c);
  double sum = 0;
  for (size_t k = 0; k < outputs.size(); ++k) {
    for (size_t j = 0; j < outputs[k].f32.size(); ++j) {
      sum += static_cast<double>(outputs[k].f32[j]) * cotangents[k].f32[j];
    }
  }
  return sum;
}

void CheckGradients(GradCase c, const GradCheckOptions& options = {}) {
  SCOPED_TRACE(c.backward.kind());
  std::mt19937 rng(7);
  std::vector<Buffer> cotangents;
  for (const Shape& s : c.output_shapes) {
    cotangents.push_back(c.loss_root ? Buffer::F32(s) : RandomF32(s, &rng));
    if (c.loss_root) cotangents.back().f32.assign(Count(s), static_cast<float>(options.grad_scale));
  }
  ASSERT_EQ(cotangents.size(), 1u) << "every forward kind has one output";

  std::vector<Buffer*> backward_in;
  for (int source : c.backward_inputs) {
    backward_in.push_back(source == kCotangent ? &cotangents[0] : &c.inputs[source]);
  }
  std::vector<Buffer> grads;
  for (int i : c.differentiable) grads.push_back(Buffer::F32(c.inputs[i].shape));
  std::vector<Buffer*> backward_out;
  for (Buffer& g : grads) backward_out.push_back(&g);
  KernelContext context;
  context.grad_scale = options.grad_scale;
  const Status status = RunOp(c.backward, backward_in, backward_out, context);
  ASSERT_TRUE(status.ok()) << status.message();

  for (size_t g = 0; g < c.differentiable.size(); ++g) {
    std::vector<float>& x = c.inputs[c.differentiable[g]].f32;
    for (size_t e = 0; e < x.size(); ++e) {
      const float saved = x[e];
      x[e] = static_cast<float>(saved + options.step);
      const double plus = Objective(c, cotangents);
      x[e] = static_cast<float>(saved - options.step);
      const double minus = Objective(c, cotangents);
      x[e] = saved;
      const double numeric = (plus - minus) / (2 * options.step);
      const double analytic = grads[g].f32[e];
      ASSERT_NEAR(analytic, numeric,
                  options.abs_tolerance + options.rel_tolerance * std::abs(numeric))
          << "gradient " << g << " element " << e;
    }
  }
}

TEST(GradCheck, Matmul) {
  std::mt19937 rng(1);
  GradCase c = Case(MakeOp(op_kind::kMatmul), MakeOp(op_kind::kMatmulBackward), {{2, 3, 4}});
  c.inputs.push_back(RandomF32({2, 3, 5}, &rng));
  c.inputs.push_back(RandomF32({4, 5}, &rng));
  c.backward_inputs = {kCotangent, 0, 1};
  c.differentiable = {0, 1};
  CheckGradients(std::move(c));
}

TEST(GradCheck, RmsNorm) {
  std::mt19937 rng(2);
  const std::map<std::string, double> eps = {{op_attr::kEps, 1e-5}};
  GradCase c = Case(MakeOp(op_kind::kRmsNorm, {}, eps), MakeOp(op_kind::kRmsNormBackward, {}, eps),
                    {{3, 8}});
  c.inputs.push_back(RandomF32({3, 8}, &rng));
  c.inputs.push_back(RandomF32({8}, &rng, 1.0f, 0.3f));
  c.backward_inputs = {kCotangent, 0, 1};
  c.differentiable = {0, 1};
  CheckGradients(std::move(c));
}

std::map<std::string, int64_t> RopeInts(int64_t heads, int64_t head_dim) {
  return {{op_attr::kHeads, heads}, {op_attr::kHeadDim, head_dim}};
}
const std::map<std::string, double> kRopeTheta = {{op_attr::kTheta, 100.0}};

TEST(GradCheck, Rope) {
  std::mt19937 rng(3);
  GradCase c = Case(MakeOp(op_kind::kRope, RopeInts(2, 6), kRopeTheta),
                    MakeOp(op_kind::kRopeBackward, RopeInts(2, 6), kRopeTheta), {{2, 5, 12}});
  c.inputs.push_back(RandomF32({2, 5, 12}, &rng));
  c.backward_inputs = {kCotangent};
  c.differentiable = {0};
  CheckGradients(std::move(c));
}

std::map<std::string, int64_t> AttentionInts(int64_t heads, int64_t kv_heads, int64_t head_dim) {
  return {{op_attr::kHeads, heads}, {op_attr::kKvHeads, kv_heads}, {op_attr::kHeadDim, head_dim}};
}

void CheckAttentionGradients(int64_t heads, int64_t kv_heads, int64_t seq = 5) {
  std::mt19937 rng(4);
  const int64_t batch = 2, head_dim = 4;
  const auto ints = AttentionInts(heads, kv_heads, head_dim);
  GradCase c = Case(MakeOp(op_kind::kAttention, ints), MakeOp(op_kind::kAttentionBackward, ints),
                    {{batch, seq, heads * head_dim}});
  c.inputs.push_back(RandomF32({batch, seq, heads * head_dim}, &rng));
  c.inputs.push_back(RandomF32({batch, seq, kv_heads * head_dim}, &rng));
  c.inputs.push_back(RandomF32({batch, seq, kv_heads * head_dim}, &rng));
  c.backward_inputs = {kCotangent, 0, 1, 2};
  c.differentiable = {0, 1, 2};
  CheckGradients(std::move(c));
}

TEST(GradCheck, AttentionGroupedQuery) { CheckAttentionGradients(4, 2); }
TEST(GradCheck, AttentionMultiQuery) { CheckAttentionGradients(3, 1); }
TEST(GradCheck, AttentionMultiHead) { CheckAttentionGradients(2, 2); }
// Past the kernel's 32-row query blocks (the last one partial): each block's keys end at its
// last row, and dk, dv sum over the blocks.
TEST(GradCheck, AttentionAcrossQueryBlocks) { CheckAttentionGradients(4, 2, 70); }

TEST(GradCheck, Swiglu) {
  std::mt19937 rng(5);
  GradCase c = Case(MakeOp(op_kind::kSwiglu), MakeOp(op_kind::kSwigluBackward), {{3, 7}});
  c.inputs.push_back(RandomF32({3, 7}, &rng, 0.0f, 2.0f));
  c.inputs.push_back(RandomF32({3, 7}, &rng));
  c.backward_inputs = {kCotangent, 0, 1};
  c.differentiable = {0, 1};
  CheckGradients(std::move(c));
}

TEST(GradCheck, CrossEntropy) {
  std::mt19937 rng(6);
  GradCase c = Case(MakeOp(op_kind::kCrossEntropy), MakeOp(op_kind::kCrossEntropyBackward), {{1}});
  c.inputs.push_back(RandomF32({2, 3, 11}, &rng, 0.0f, 2.0f));
  c.inputs.push_back(RandomI32({2, 3}, 11, &rng));
  c.backward_inputs = {0, 1};
  c.differentiable = {0};
  c.loss_root = true;
  CheckGradients(std::move(c));
}

TEST(GradCheck, Embedding) {
  std::mt19937 rng(8);
  GradCase c = Case(MakeOp(op_kind::kEmbedding), MakeOp(op_kind::kEmbeddingBackward), {{2, 3, 4}});
  c.inputs.push_back(RandomI32({2, 3}, 5, &rng));
  c.inputs[0].i32[1] = c.inputs[0].i32[4];  // a repeated token accumulates
  c.inputs.push_back(RandomF32({5, 4}, &rng));
  c.backward_inputs = {kCotangent, 0};
  c.differentiable = {1};
  CheckGradients(std::move(c));
}

// ---------------------------------------------------------------------------------------------
// Forward kernels against naive double-precision references.

constexpr double kForwardTolerance = 1e-5;

void ExpectClose(const std::vector<float>& actual, const std::vector<double>& expected,
                 double tolerance = kForwardTolerance) {
  ASSERT_EQ(actual.size(), expected.size());
  for (size_t i = 0; i < actual.size(); ++i) {
    ASSERT_NEAR(actual[i], expected[i], tolerance * (1 + std::abs(expected[i]))) << "element " << i;
  }
}

TEST(Forward, MatmulMatchesReference) {
  std::mt19937 rng(11);
  Buffer x = RandomF32({2, 3, 5}, &rng), w = RandomF32({4, 5}, &rng), y = Buffer::F32({2, 3, 4});
  ASSERT_TRUE(RunOp(MakeOp(op_kind::kMatmul), {&x, &w}, {&y}).ok());
  std::vector<double> expected(24);
  for (int m = 0; m < 6; ++m) {
    for (int n = 0; n < 4; ++n) {
      for (int k = 0; k < 5; ++k)
        expected[m * 4 + n] += double{x.f32[m * 5 + k]} * w.f32[n * 5 + k];
    }
  }
  ExpectClose(y.f32, expected);
}

TEST(Forward, RmsNormMatchesReference) {
  std::mt19937 rng(12);
  Buffer x = RandomF32({3, 8}, &rng), w = RandomF32({8}, &rng), y = Buffer::F32({3, 8});
  const double eps = 1e-5;
  ASSERT_TRUE(RunOp(MakeOp(op_kind::kRmsNorm, {}, {{op_attr::kEps, eps}}), {&x, &w}, {&y}).ok());
  std::vector<double> expected(24);
  for (int r = 0; r < 3; ++r) {
    double mean_sq = 0;
    for (int i = 0; i < 8; ++i) mean_sq += double{x.f32[r * 8 + i]} * x.f32[r * 8 + i] / 8;
    for (int i = 0; i < 8; ++i) {
      expected[r * 8 + i] = x.f32[r * 8 + i] / std::sqrt(mean_sq + eps) * w.f32[i];
    }
  }
  ExpectClose(y.f32, expected);
}

TEST(Forward, RopeRotatesHalvesByPosition) {
  std::mt19937 rng(13);
  const int64_t batch = 1, seq = 4, heads = 2, head_dim = 6, half = 3;
  const double theta = 100.0;
  Buffer x = RandomF32({batch, seq, heads * head_dim}, &rng);
  Buffer y = Buffer::F32(x.shape);
  ASSERT_TRUE(RunOp(MakeOp(op_kind::kRope, RopeInts(heads, head_dim), {{op_attr::kTheta, theta}}),
                    {&x}, {&y})
                  .ok());
  std::vector<double> expected(x.f32.size());
  for (int64_t s = 0; s < seq; ++s) {
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t base = s * heads * head_dim + h * head_dim;
      for (int64_t i = 0; i < half; ++i) {
        const double angle = static_cast<double>(s) * std::pow(theta, -2.0 * i / head_dim);
        const double x1 = x.f32[base + i], x2 = x.f32[base + half + i];
        expected[base + i] = x1 * std::cos(angle) - x2 * std::sin(angle);
        expected[base + half + i] = x1 * std::sin(angle) + x2 * std::cos(angle);
      }
    }
  }
  ExpectClose(y.f32, expected);
  // Position 0 is not rotated.
  for (int64_t i = 0; i < heads * head_dim; ++i) EXPECT_EQ(y.f32[i], x.f32[i]);
}

// Causal grouped-query attention, one query head at a time, in double.
std::vector<double> ReferenceAttention(const Buffer& q, const Buffer& k, const Buffer& v,
                                       int64_t heads, int64_t kv_heads, int64_t head_dim) {
  const int64_t batch = q.shape[0], seq = q.shape[1];
  const int64_t qw = heads * head_dim, kw = kv_heads * head_dim;
  std::vector<double> out(q.f32.size());
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t g = h / (heads / kv_heads);
      for (int64_t i = 0; i < seq; ++i) {
        std::vector<double> scores(i + 1);
        for (int64_t j = 0; j <= i; ++j) {
          for (int64_t d = 0; d < head_dim; ++d) {
            scores[j] += double{q.f32[(b * seq + i) * qw + h * head_dim + d]} *
                         k.f32[(b * seq + j) * kw + g * head_dim + d];
          }
          scores[j] /= std::sqrt(static_cast<double>(head_dim));
        }
        const double max = *std::max_element(scores.begin(), scores.end());
        double sum = 0;
        for (double& s : scores) sum += (s = std::exp(s - max));
        for (int64_t j = 0; j <= i; ++j) {
          for (int64_t d = 0; d < head_dim; ++d) {
            out[(b * seq + i) * qw + h * head_dim + d] +=
                scores[j] / sum * v.f32[(b * seq + j) * kw + g * head_dim + d];
          }
        }
      }
    }
  }
  return out;
}

TEST(Forward, AttentionMatchesReference) {
  for (auto [heads, kv_heads, seq] : {std::tuple<int64_t, int64_t, int64_t>{4, 2, 6},
                                      {4, 1, 6},
                                      {2, 2, 6},
                                      {4, 2, 70},
                                      {2, 1, 64}}) {
    SCOPED_TRACE(std::to_string(heads) + " heads, " + std::to_string(kv_heads) + " kv heads, seq " +
                 std::to_string(seq));
    std::mt19937 rng(14);
    const int64_t batch = 2, head_dim = 4;
    Buffer q = RandomF32({batch, seq, heads * head_dim}, &rng);
    Buffer k = RandomF32({batch, seq, kv_heads * head_dim}, &rng);
    Buffer v = RandomF32({batch, seq, kv_heads * head_dim}, &rng);
    Buffer o = Buffer::F32(q.shape);
    ASSERT_TRUE(RunOp(MakeOp(op_kind::kAttention, AttentionInts(heads, kv_heads, head_dim)),
                      {&q, &k, &v}, {&o})
                    .ok());
    ExpectClose(o.f32, ReferenceAttention(q, k, v, heads, kv_heads, head_dim));
  }
}

TEST(Forward, AttentionIsCausal) {
  std::mt19937 rng(15);
  const int64_t seq = 5, heads = 2, kv_heads = 1, head_dim = 4;
  const proto::Op op = MakeOp(op_kind::kAttention, AttentionInts(heads, kv_heads, head_dim));
  Buffer q = RandomF32({1, seq, heads * head_dim}, &rng);
  Buffer k = RandomF32({1, seq, kv_heads * head_dim}, &rng);
  Buffer v = RandomF32({1, seq, kv_heads * head_dim}, &rng);
  Buffer before = Buffer::F32(q.shape), after = Buffer::F32(q.shape);
  ASSERT_TRUE(RunOp(op, {&q, &k, &v}, {&before}).ok());
  // Changing the last position's keys and values changes only the last position's output.
  for (int64_t d = 0; d < head_dim; ++d) {
    k.f32[(seq - 1) * head_dim + d] += 3.0f;
    v.f32[(seq - 1) * head_dim + d] -= 2.0f;
  }
  ASSERT_TRUE(RunOp(op, {&q, &k, &v}, {&after}).ok());
  const int64_t width = heads * head_dim;
  for (int64_t i = 0; i < (seq - 1) * width; ++i) EXPECT_EQ(before.f32[i], after.f32[i]);
  EXPECT_NE(before.f32[(seq - 1) * width], after.f32[(seq - 1) * width]);
  // The first position attends only to itself: its output is its value.
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t d = 0; d < head_dim; ++d) EXPECT_FLOAT_EQ(after.f32[h * head_dim + d], v.f32[d]);
  }
}

TEST(Forward, SwigluAddCrossEntropyEmbedding) {
  std::mt19937 rng(16);
  Buffer gate = RandomF32({2, 3}, &rng), up = RandomF32({2, 3}, &rng), y = Buffer::F32({2, 3});
  ASSERT_TRUE(RunOp(MakeOp(op_kind::kSwiglu), {&gate, &up}, {&y}).ok());
  std::vector<double> expected(6);
  for (int i = 0; i < 6; ++i) {
    expected[i] = gate.f32[i] / (1 + std::exp(-double{gate.f32[i]})) * up.f32[i];
  }
  ExpectClose(y.f32, expected);

  Buffer c = RandomF32({2, 3}, &rng), sum = Buffer::F32({2, 3});
  ASSERT_TRUE(RunOp(MakeOp(op_kind::kAdd), {&gate, &up, &c}, {&sum}).ok());
  for (int i = 0; i < 6; ++i) expected[i] = double{gate.f32[i]} + up.f32[i] + c.f32[i];
  ExpectClose(sum.f32, expected);

  Buffer logits = RandomF32({2, 5}, &rng), targets = RandomI32({2}, 5, &rng);
  Buffer loss = Buffer::F32({1});
  ASSERT_TRUE(RunOp(MakeOp(op_kind::kCrossEntropy), {&logits, &targets}, {&loss}).ok());
  double total = 0;
  for (int r = 0; r < 2; ++r) {
    double z = 0;
    for (int i = 0; i < 5; ++i) z += std::exp(double{logits.f32[r * 5 + i]});
    total += std::log(z) - logits.f32[r * 5 + targets.i32[r]];
  }
  ExpectClose(loss.f32, {total});

  Buffer tokens = Buffer::I32({1, 2}), table = RandomF32({3, 2}, &rng),
         rows = Buffer::F32({1, 2, 2});
  tokens.i32 = {2, 0};
  ASSERT_TRUE(RunOp(MakeOp(op_kind::kEmbedding), {&tokens, &table}, {&rows}).ok());
  EXPECT_EQ(rows.f32, (std::vector<float>{table.f32[4], table.f32[5], table.f32[0], table.f32[1]}));
}

// ---------------------------------------------------------------------------------------------
// adamw

proto::Op AdamOp(double lr, double beta1, double beta2, double eps, double weight_decay) {
  return MakeOp(op_kind::kAdamW, {},
                {{op_attr::kLr, lr},
                 {op_attr::kBeta1, beta1},
                 {op_attr::kBeta2, beta2},
                 {op_attr::kEps, eps},
                 {op_attr::kWeightDecay, weight_decay}});
}

TEST(AdamW, FirstStepMovesEachParamByLr) {
  // Step 1 with zero state: m_hat = g, v_hat = g^2, so the update is lr * sign(g), after the
  // decoupled decay p *= 1 - lr * wd.
  Buffer p = Buffer::F32({3}), g = Buffer::F32({3}), m = Buffer::F32({3}), v = Buffer::F32({3});
  p.f32 = {1.0f, -2.0f, 0.5f};
  g.f32 = {0.1f, -0.2f, 0.0f};
  KernelContext context;
  context.adam_step = 1;
  ASSERT_TRUE(RunOp(AdamOp(0.1, 0.9, 0.999, 1e-8, 0.01), {&p, &g, &m, &v}, {}, context).ok());
  EXPECT_NEAR(p.f32[0], 1.0 * 0.999 - 0.1, 1e-6);
  EXPECT_NEAR(p.f32[1], -2.0 * 0.999 + 0.1, 1e-6);
  EXPECT_NEAR(p.f32[2], 0.5 * 0.999, 1e-6);
  EXPECT_NEAR(m.f32[1], 0.1 * -0.2, 1e-7);
  EXPECT_NEAR(v.f32[1], 0.001 * 0.04, 1e-9);
}

TEST(AdamW, SecondStepWithBiasCorrection) {
  // By hand: m = 0.9 * 0.05 + 0.1 * 0.2 = 0.065; v = 0.99 * 0.01 + 0.01 * 0.04 = 0.0103;
  // p = 0.5 * (1 - 0.01 * 0.1) - 0.01 * (0.065 / 0.19) / (sqrt(0.0103 / 0.0199) + 1e-8).
  Buffer p = Buffer::F32({1}), g = Buffer::F32({1}), m = Buffer::F32({1}), v = Buffer::F32({1});
  p.f32 = {0.5f};
  g.f32 = {0.2f};
  m.f32 = {0.05f};
  v.f32 = {0.01f};
  KernelContext context;
  context.adam_step = 2;
  ASSERT_TRUE(RunOp(AdamOp(0.01, 0.9, 0.99, 1e-8, 0.1), {&p, &g, &m, &v}, {}, context).ok());
  EXPECT_NEAR(m.f32[0], 0.065, 1e-7);
  EXPECT_NEAR(v.f32[0], 0.0103, 1e-8);
  EXPECT_NEAR(p.f32[0], 0.4947448121781676, 1e-7);
}

TEST(AdamW, FallsBackToTheConfig) {
  auto config = MakeConfig("tiny", {});
  ASSERT_TRUE(config.ok());
  Buffer p = Buffer::F32({2}), g = Buffer::F32({2}), m = Buffer::F32({2}), v = Buffer::F32({2});
  g.f32 = {1.0f, -1.0f};
  KernelContext context;
  context.config = &*config;
  ASSERT_TRUE(RunOp(MakeOp(op_kind::kAdamW), {&p, &g, &m, &v}, {}, context).ok());
  EXPECT_NEAR(p.f32[0], -config->lr(), 1e-7);
  EXPECT_NEAR(p.f32[1], config->lr(), 1e-7);

  const Status no_config = RunOp(MakeOp(op_kind::kAdamW), {&p, &g, &m, &v}, {});
  EXPECT_NE(no_config.message().find("has no attr 'lr' and no model config"), std::string::npos)
      << no_config.message();
}

// ---------------------------------------------------------------------------------------------
// gradient clipping: grad_norm_squared and adamw's fifth input

TEST(GradNormSquared, SumsTheSquaresOfEveryInput) {
  Buffer a = Buffer::F32({2}), b = Buffer::F32({3}), out = Buffer::F32({1});
  a.f32 = {3.0f, -4.0f};
  b.f32 = {1.0f, 2.0f, -2.0f};
  ASSERT_TRUE(RunOp(MakeOp(op_kind::kGradNormSquared), {&a, &b}, {&out}).ok());
  EXPECT_EQ(out.f32[0], 34.0f);
  Buffer wide = Buffer::F32({2});
  const Status s = RunOp(MakeOp(op_kind::kGradNormSquared), {&a}, {&wide});
  EXPECT_NE(s.message().find("output 0 (norm_squared) has shape [2], expected [1]"),
            std::string::npos)
      << s.message();
}

proto::Op ClippedAdamOp(double max_norm) {
  proto::Op op = AdamOp(0.01, 0.9, 0.99, 1e-8, 0.1);
  SetAttrFloat(&op, op_attr::kMaxGradNorm, max_norm);
  return op;
}

// One AdamW step of (p, g) at step 3 from a non-zero state; `norm` appended as input 4 if given.
std::vector<float> AdamStep(const proto::Op& op, const std::vector<float>& grad,
                            const Buffer* norm) {
  std::mt19937 rng(5);
  const int64_t n = static_cast<int64_t>(grad.size());
  Buffer p = RandomF32({n}, &rng), g = Buffer::F32({n}), m = RandomF32({n}, &rng, 0, 0.01f),
         v = RandomF32({n}, &rng, 0.5f, 0.1f);
  g.f32 = grad;
  std::vector<Buffer*> in = {&p, &g, &m, &v};
  Buffer norm_copy = norm ? *norm : Buffer::F32({1});
  if (norm) in.push_back(&norm_copy);
  KernelContext context;
  context.adam_step = 3;
  const Status s = RunOp(op, in, {}, context);
  EXPECT_TRUE(s.ok()) << s.message();
  std::vector<float> out = p.f32;
  out.insert(out.end(), m.f32.begin(), m.f32.end());
  out.insert(out.end(), v.f32.begin(), v.f32.end());
  return out;
}

TEST(AdamW, ClippingScalesTheGradByMaxOverTheNorm) {
  std::mt19937 rng(8);
  const std::vector<float> grad = RandomF32({37}, &rng).f32;
  Buffer norm = Buffer::F32({1});
  norm.f32 = {16.0f};  // a global norm of 4
  // clip_grad_norm_'s coefficient in fp32: 0.5 / (4 + 1e-6), below 1.
  const float coef = 0.5f / (4.0f + 1e-6f);
  std::vector<float> scaled = grad;
  for (float& x : scaled) x *= coef;
  EXPECT_EQ(AdamStep(ClippedAdamOp(0.5), grad, &norm),
            AdamStep(AdamOp(0.01, 0.9, 0.99, 1e-8, 0.1), scaled, nullptr));
  // A norm under the max leaves the step exactly the unclipped one.
  EXPECT_EQ(AdamStep(ClippedAdamOp(1e30), grad, &norm),
            AdamStep(AdamOp(0.01, 0.9, 0.99, 1e-8, 0.1), grad, nullptr));
  EXPECT_NE(AdamStep(ClippedAdamOp(0.5), grad, &norm),
            AdamStep(AdamOp(0.01, 0.9, 0.99, 1e-8, 0.1), grad, nullptr));
}

TEST(AdamW, ClippingNeedsAPositiveMax) {
  Buffer p = Buffer::F32({2}), g = Buffer::F32({2}), m = Buffer::F32({2}), v = Buffer::F32({2}),
         norm = Buffer::F32({1});
  KernelContext context;
  context.adam_step = 1;
  const Status s = RunOp(AdamOp(0.01, 0.9, 0.99, 1e-8, 0.1), {&p, &g, &m, &v, &norm}, {}, context);
  EXPECT_NE(s.message().find("attr 'max_grad_norm' is not a positive number"), std::string::npos)
      << s.message();
}

// ---------------------------------------------------------------------------------------------
// Every kind of the table (schemas/op_kinds.h) has a kernel: without operands each answers with
// its own operand check, never that the backend lacks the kind.

TEST(Kinds, EveryKindOfTheTableHasAKernel) {
  for (const OpKindInfo& info : kOpKinds) {
    const Status status = RunOp(MakeOp(info.name), {}, {});
    EXPECT_FALSE(status.ok()) << info.name;
    EXPECT_EQ(status.message().find("has no kernel"), std::string::npos) << status.message();
  }
}

// ---------------------------------------------------------------------------------------------
// Errors name the op.

TEST(Errors, ArityShapeKindAndValues) {
  std::mt19937 rng(21);
  proto::Op matmul = MakeOp(op_kind::kMatmul);
  matmul.set_name("layers.0.attn.q_proj");
  Buffer x = RandomF32({2, 5}, &rng), w = RandomF32({4, 6}, &rng), y = Buffer::F32({2, 4});

  Status s = RunOp(matmul, {&x}, {&y});
  EXPECT_EQ(s.message(),
            "op layers.0.attn.q_proj (matmul): expects 2 inputs and 1 outputs, got 1 and 1");

  s = RunOp(matmul, {&x, &w}, {&y});
  EXPECT_EQ(s.message(),
            "op layers.0.attn.q_proj (matmul): input 1 (w) has shape [4, 6], expected [4, 5]");

  Buffer w_ok = RandomF32({4, 5}, &rng), y_bad = Buffer::F32({2, 3});
  s = RunOp(matmul, {&x, &w_ok}, {&y_bad});
  EXPECT_EQ(s.message(),
            "op layers.0.attn.q_proj (matmul): output 0 (y) has shape [2, 3], expected [2, 4]");

  Buffer tokens = Buffer::I32({2, 5});
  s = RunOp(matmul, {&tokens, &w_ok}, {&y});
  EXPECT_EQ(s.message(), "op layers.0.attn.q_proj (matmul): input 0 (x) has no f32 data");

  proto::Op unknown = MakeOp("conv2d");
  EXPECT_EQ(RunOp(unknown, {&x}, {&y}).message(),
            "op test.conv2d (conv2d): the CPU backend has no kernel for this kind");

  Buffer q = RandomF32({1, 3, 8}, &rng), kv = RandomF32({1, 3, 4}, &rng),
         o = Buffer::F32({1, 3, 8});
  s = RunOp(MakeOp(op_kind::kAttention, {{op_attr::kHeads, 2}, {op_attr::kHeadDim, 4}}),
            {&q, &kv, &kv}, {&o});
  EXPECT_EQ(s.message(), "op test.attention (attention): needs a positive int attr 'kv_heads'");

  Buffer logits = RandomF32({2, 5}, &rng), targets = Buffer::I32({2}), loss = Buffer::F32({1});
  targets.i32 = {1, 5};
  s = RunOp(MakeOp(op_kind::kCrossEntropy), {&logits, &targets}, {&loss});
  EXPECT_EQ(s.message(),
            "op test.cross_entropy (cross_entropy): target 5 at 1 is outside the vocabulary of 5");

  Buffer tokens_bad = Buffer::I32({1, 2}), table = RandomF32({4, 3}, &rng);
  Buffer rows = Buffer::F32({1, 2, 3});
  tokens_bad.i32 = {0, -1};
  s = RunOp(MakeOp(op_kind::kEmbedding), {&tokens_bad, &table}, {&rows});
  EXPECT_EQ(s.message(),
            "op test.embedding (embedding): token -1 at 1 is outside the vocabulary of 4");

  Buffer gain = RandomF32({3}, &rng), normed = Buffer::F32({2, 3});
  s = RunOp(MakeOp(op_kind::kRmsNorm), {&normed, &gain}, {&normed});
  EXPECT_EQ(s.message(), "op test.rmsnorm (rmsnorm): needs a positive attr 'eps'");

  Buffer a = RandomF32({3}, &rng), sum = Buffer::F32({3});
  s = RunOp(MakeOp(op_kind::kAdd), {&a}, {&sum});
  EXPECT_EQ(s.message(), "op test.add (add): expects 2 or more inputs and 1 output, got 1 and 1");

  Buffer p = Buffer::F32({3}), g = Buffer::F32({2});
  s = RunOp(AdamOp(0.1, 0.9, 0.9, 1e-8, 0), {&p, &g, &p, &p}, {});
  EXPECT_EQ(s.message(), "op test.adamw (adamw): input 1 (grad) has 2 elements, param has 3");
}

// ---------------------------------------------------------------------------------------------
// Mixture of experts

// Central differences of `objective` over every element of `x` against `analytic`.
void CheckNumeric(const std::function<double()>& objective, std::vector<float>* x,
                  const std::vector<float>& analytic, const std::string& what, double step = 1e-3,
                  double abs_tolerance = 1e-3, double rel_tolerance = 1e-2) {
  SCOPED_TRACE(what);
  ASSERT_EQ(x->size(), analytic.size());
  for (size_t e = 0; e < x->size(); ++e) {
    const float saved = (*x)[e];
    (*x)[e] = static_cast<float>(saved + step);
    const double plus = objective();
    (*x)[e] = static_cast<float>(saved - step);
    const double minus = objective();
    (*x)[e] = saved;
    const double numeric = (plus - minus) / (2 * step);
    ASSERT_NEAR(analytic[e], numeric, abs_tolerance + rel_tolerance * std::abs(numeric))
        << "element " << e;
  }
}

double Dot(const Buffer& a, const Buffer& b) {
  double sum = 0;
  for (size_t i = 0; i < a.f32.size(); ++i) sum += double{a.f32[i]} * b.f32[i];
  return sum;
}

// Distinct experts per token, k of them, drawn from [0, experts - 1): the last expert gets no
// tokens, so the empty segment is exercised too.
Buffer RandomRouting(Shape shape, int32_t experts, std::mt19937* rng) {
  Buffer b = Buffer::I32(shape);
  const int64_t k = shape.back();
  std::vector<int32_t> ids(experts - 1);
  for (int64_t t = 0; t < Count(shape) / k; ++t) {
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), *rng);
    std::copy_n(ids.begin(), k, b.i32.begin() + t * k);
  }
  return b;
}

TEST(Moe, RouterPicksTopKRenormalizesAndWeighsTheBalance) {
  Buffer logits = Buffer::F32({1, 2, 4});
  logits.f32 = {0, 2, 1, 3, /*token 1, a tie:*/ 1, 1, 0, 0};
  Buffer gates = Buffer::F32({1, 2, 2}), experts = Buffer::I32({1, 2, 2}), aux = Buffer::F32({1});
  constexpr double kCoef = 0.1;
  const proto::Op op =
      MakeOp(op_kind::kMoeRouter, {{op_attr::kTopK, 2}}, {{op_attr::kAuxCoef, kCoef}});
  ASSERT_TRUE(RunOp(op, {&logits}, {&gates, &experts, &aux}).ok());
  EXPECT_EQ(experts.i32, (std::vector<int32_t>{3, 1, 0, 1}))
      << "descending p; a tie takes the lower id";
  EXPECT_NEAR(gates.f32[0], std::exp(3.0) / (std::exp(3.0) + std::exp(2.0)), 1e-6);
  EXPECT_NEAR(gates.f32[1], std::exp(2.0) / (std::exp(3.0) + std::exp(2.0)), 1e-6);
  EXPECT_NEAR(gates.f32[2], 0.5, 1e-6);
  EXPECT_NEAR(gates.f32[3], 0.5, 1e-6);
  // aux (sum scale) = coef * E * sum_e count_e * sum_t p[t, e] / M.
  const double z0 = 1 + std::exp(2.0) + std::exp(1.0) + std::exp(3.0), z1 = 2 * std::exp(1.0) + 2;
  const double p_sum[4] = {1 / z0 + std::exp(1.0) / z1, std::exp(2.0) / z0 + std::exp(1.0) / z1,
                           std::exp(1.0) / z0 + 1 / z1, std::exp(3.0) / z0 + 1 / z1};
  const double counts[4] = {1, 2, 0, 1};
  double balance = 0;
  for (int e = 0; e < 4; ++e) balance += counts[e] * p_sum[e];
  EXPECT_NEAR(aux.f32[0], kCoef * 4 * balance / 2, 1e-6);
}

TEST(Moe, DispatchGroupedMatmulCombineEqualEachTokensExperts) {
  std::mt19937 rng(11);
  constexpr int32_t kExperts = 4;
  constexpr int64_t kTopK = 2, kHidden = 5, kOut = 3;
  Buffer x = RandomF32({2, 3, kHidden}, &rng);
  Buffer routing = RandomRouting({2, 3, kTopK}, kExperts, &rng);
  Buffer gates = RandomF32({2, 3, kTopK}, &rng);
  std::vector<Buffer> w;
  for (int e = 0; e < kExperts; ++e) w.push_back(RandomF32({kOut, kHidden}, &rng));
  Buffer xs = Buffer::F32({6 * kTopK, kHidden}), ys = Buffer::F32({6 * kTopK, kOut});
  Buffer y = Buffer::F32({2, 3, kOut});
  ASSERT_TRUE(
      RunOp(MakeOp(op_kind::kMoeDispatch, {{op_attr::kExperts, kExperts}}), {&x, &routing}, {&xs})
          .ok());
  std::vector<Buffer*> matmul_in = {&xs, &routing};
  for (Buffer& b : w) matmul_in.push_back(&b);
  ASSERT_TRUE(RunOp(MakeOp(op_kind::kGroupedMatmul), matmul_in, {&ys}).ok());
  ASSERT_TRUE(RunOp(MakeOp(op_kind::kMoeCombine, {{op_attr::kExperts, kExperts}}),
                    {&ys, &gates, &routing}, {&y})
                  .ok());
  for (int64_t t = 0; t < 6; ++t) {
    for (int64_t n = 0; n < kOut; ++n) {
      double expected = 0;
      for (int64_t j = 0; j < kTopK; ++j) {
        const Buffer& we = w[routing.i32[t * kTopK + j]];
        double dot = 0;
        for (int64_t h = 0; h < kHidden; ++h)
          dot += double{x.f32[t * kHidden + h]} * we.f32[n * kHidden + h];
        expected += gates.f32[t * kTopK + j] * dot;
      }
      EXPECT_NEAR(y.f32[t * kOut + n], expected, 1e-4) << "token " << t << " column " << n;
    }
  }
  // Expert-major: the rows of expert 0 come first, in token order.
  int64_t row = 0;
  for (int32_t e = 0; e < kExperts; ++e) {
    for (int64_t s = 0; s < 6 * kTopK; ++s) {
      if (routing.i32[s] != e) continue;
      EXPECT_EQ(xs.f32[row * kHidden], x.f32[(s / kTopK) * kHidden]) << "row " << row;
      ++row;
    }
  }
}

// Top-2 and top-1 (where the renormalized gate is always 1, so the router learns from the
// balancing loss alone: the gates' cotangent must contribute nothing).
class RouterGradCheck : public ::testing::TestWithParam<int64_t> {};
INSTANTIATE_TEST_SUITE_P(TopK, RouterGradCheck, ::testing::Values(2, 1));

TEST_P(RouterGradCheck, MoeRouterWithTheBalancingLoss) {
  std::mt19937 rng(12);
  const int64_t top_k = GetParam();
  constexpr double kCoef = 0.3, kGradScale = 0.25;
  const std::map<std::string, int64_t> ints = {{op_attr::kTopK, top_k}};
  const std::map<std::string, double> floats = {{op_attr::kAuxCoef, kCoef}};
  Buffer logits = RandomF32({3, 2, 5}, &rng);
  Buffer cotangent = RandomF32({3, 2, top_k}, &rng);
  Buffer gates = Buffer::F32({3, 2, top_k}), experts = Buffer::I32({3, 2, top_k}),
         aux = Buffer::F32({1});
  const proto::Op forward = MakeOp(op_kind::kMoeRouter, ints, floats);
  // The executor's loss: <cotangent, gates> from the layers above, plus grad_scale * aux.
  auto objective = [&] {
    EXPECT_TRUE(RunOp(forward, {&logits}, {&gates, &experts, &aux}).ok());
    return Dot(cotangent, gates) + kGradScale * aux.f32[0];
  };
  objective();
  const std::vector<int32_t> routing = experts.i32;
  Buffer dlogits = Buffer::F32({3, 2, 5});
  KernelContext context;
  context.grad_scale = kGradScale;
  const proto::Op backward = MakeOp(op_kind::kMoeRouterBackward, ints, floats);
  ASSERT_TRUE(RunOp(backward, {&cotangent, &logits, &experts}, {&dlogits}, context).ok());
  CheckNumeric(objective, &logits.f32, dlogits.f32, "dlogits");
  objective();
  EXPECT_EQ(experts.i32, routing) << "the steps must not change the routing";
  if (top_k == 1) {
    EXPECT_EQ(gates.f32, std::vector<float>(6, 1.0f));
    // Without the balancing loss nothing reaches the router.
    const proto::Op no_balance =
        MakeOp(op_kind::kMoeRouterBackward, ints, {{op_attr::kAuxCoef, 0.0}});
    ASSERT_TRUE(RunOp(no_balance, {&cotangent, &logits, &experts}, {&dlogits}, context).ok());
    for (float g : dlogits.f32) EXPECT_NEAR(g, 0.0f, 1e-7f);
  }
}

TEST(GradCheck, MoeDispatchGroupedMatmulAndCombine) {
  std::mt19937 rng(13);
  constexpr int32_t kExperts = 4;
  constexpr int64_t kTopK = 2, kHidden = 4, kOut = 3, kSlots = 4 * kTopK;
  Buffer routing = RandomRouting({2, 2, kTopK}, kExperts, &rng);
  const std::map<std::string, int64_t> experts_attr = {{op_attr::kExperts, kExperts}};

  // Dispatch: objective <c, xs> over x.
  Buffer x = RandomF32({2, 2, kHidden}, &rng), xs = Buffer::F32({kSlots, kHidden});
  Buffer c_xs = RandomF32({kSlots, kHidden}, &rng), dx = Buffer::F32({2, 2, kHidden});
  const proto::Op dispatch = MakeOp(op_kind::kMoeDispatch, experts_attr);
  ASSERT_TRUE(
      RunOp(MakeOp(op_kind::kMoeDispatchBackward, experts_attr), {&c_xs, &routing}, {&dx}).ok());
  CheckNumeric(
      [&] {
        EXPECT_TRUE(RunOp(dispatch, {&x, &routing}, {&xs}).ok());
        return Dot(c_xs, xs);
      },
      &x.f32, dx.f32, "dispatch dx");

  // Grouped matmul: objective <c, y> over x and every expert's w (the unused expert's dW is 0).
  std::vector<Buffer> w;
  for (int e = 0; e < kExperts; ++e) w.push_back(RandomF32({kOut, kHidden}, &rng));
  Buffer y = Buffer::F32({kSlots, kOut}), c_y = RandomF32({kSlots, kOut}, &rng);
  std::vector<Buffer*> forward_in = {&xs, &routing}, backward_in = {&c_y, &xs, &routing};
  for (Buffer& b : w) {
    forward_in.push_back(&b);
    backward_in.push_back(&b);
  }
  Buffer dxs = Buffer::F32({kSlots, kHidden});
  std::vector<Buffer> dw(kExperts, Buffer::F32({kOut, kHidden}));
  for (Buffer& b : dw) b.f32.assign(b.f32.size(), 7.0f);  // must be overwritten
  std::vector<Buffer*> backward_out = {&dxs};
  for (Buffer& b : dw) backward_out.push_back(&b);
  ASSERT_TRUE(RunOp(MakeOp(op_kind::kGroupedMatmulBackward), backward_in, backward_out).ok());
  const proto::Op grouped = MakeOp(op_kind::kGroupedMatmul);
  auto matmul_objective = [&] {
    EXPECT_TRUE(RunOp(grouped, forward_in, {&y}).ok());
    return Dot(c_y, y);
  };
  CheckNumeric(matmul_objective, &xs.f32, dxs.f32, "grouped dx");
  for (int e = 0; e < kExperts; ++e)
    CheckNumeric(matmul_objective, &w[e].f32, dw[e].f32, "grouped dw " + std::to_string(e));
  EXPECT_EQ(dw[kExperts - 1].f32, std::vector<float>(kOut * kHidden, 0.0f))
      << "an expert without tokens";

  // Combine: objective <c, y> over the experts' rows and the gates.
  Buffer gates = RandomF32({2, 2, kTopK}, &rng), combined = Buffer::F32({2, 2, kOut});
  Buffer c_combined = RandomF32({2, 2, kOut}, &rng);
  Buffer dys = Buffer::F32({kSlots, kOut}), dgates = Buffer::F32({2, 2, kTopK});
  ASSERT_TRUE(RunOp(MakeOp(op_kind::kMoeCombineBackward, experts_attr),
                    {&c_combined, &y, &gates, &routing}, {&dys, &dgates})
                  .ok());
  const proto::Op combine = MakeOp(op_kind::kMoeCombine, experts_attr);
  auto combine_objective = [&] {
    EXPECT_TRUE(RunOp(combine, {&y, &gates, &routing}, {&combined}).ok());
    return Dot(c_combined, combined);
  };
  CheckNumeric(combine_objective, &y.f32, dys.f32, "combine dys");
  CheckNumeric(combine_objective, &gates.f32, dgates.f32, "combine dgates");
}

TEST(Moe, BadRoutingAndAttrsAreNamed) {
  Buffer x = Buffer::F32({1, 2, 4}), routing = Buffer::I32({1, 2, 2}), xs = Buffer::F32({4, 4});
  routing.i32 = {0, 1, 9, 2};
  const Status bad_id =
      RunOp(MakeOp(op_kind::kMoeDispatch, {{op_attr::kExperts, 4}}), {&x, &routing}, {&xs});
  EXPECT_EQ(bad_id.message(),
            "op test.moe_dispatch (moe_dispatch): input 1 (experts) names expert 9 at slot 2, "
            "outside the 4 experts");
  Buffer logits = Buffer::F32({1, 2, 4}), gates = Buffer::F32({1, 2, 5}),
         ids = Buffer::I32({1, 2, 5});
  Buffer aux = Buffer::F32({1});
  const Status too_many =
      RunOp(MakeOp(op_kind::kMoeRouter, {{op_attr::kTopK, 5}}), {&logits}, {&gates, &ids, &aux});
  EXPECT_EQ(too_many.message(),
            "op test.moe_router (moe_router): top_k 5 is more than the 4 experts");
  Buffer y = Buffer::F32({3, 4});
  Buffer w = Buffer::F32({4, 4});
  const Status rows = RunOp(MakeOp(op_kind::kGroupedMatmul), {&xs, &routing, &w}, {&y});
  EXPECT_FALSE(rows.ok());
}

// ---------------------------------------------------------------------------------------------
// The whole tiny program, op by op.

// Every tensor of a program, allocated whole, with params initialized and inputs filled.
class ProgramRunner {
 public:
  explicit ProgramRunner(proto::Program program) : program_(std::move(program)) {
    const auto& config = program_.config();
    for (const auto& t : program_.tensors()) {
      const Shape shape(t.shape().begin(), t.shape().end());
      buffers_.push_back(t.dtype() == proto::DTYPE_I32 ? Buffer::I32(shape) : Buffer::F32(shape));
      if (t.role() == proto::ROLE_PARAM) {
        InitParamSlice(config, t, 0, NumElements(t), buffers_.back().f32.data());
      }
    }
    context_.config = &program_.config();
    context_.grad_scale =
        1.0 / static_cast<double>(TokensPerStep(program_.config(), /*world_size=*/1));
  }

  void LoadBatch(const TokenSource& source, int64_t step) {
    const auto& config = program_.config();
    Buffer& tokens = ByName("tokens");
    Buffer& targets = ByName("targets");
    for (int64_t b = 0; b < config.micro_batch(); ++b) {
      source.Sample(SampleIndex(config, 1, step, 0, 0, b), tokens.i32.data() + b * config.seq(),
                    targets.i32.data() + b * config.seq());
    }
  }

  // Runs the ops of `phase`, in program order.
  void RunPhase(proto::Phase phase) {
    for (const auto& op : program_.ops()) {
      if (op.phase() != phase) continue;
      std::vector<Buffer*> in, out;
      for (int id : op.inputs()) in.push_back(&buffers_[id]);
      for (int id : op.outputs()) out.push_back(&buffers_[id]);
      const Status status = RunOp(op, in, out, context_);
      ASSERT_TRUE(status.ok()) << status.message();
    }
  }

  // Mean loss over the micro-batch's tokens: the cross-entropy and any MoE balancing terms.
  double Loss() {
    RunPhase(proto::PHASE_FORWARD);
    double sum = 0;
    for (const auto& t : program_.tensors()) {
      if (op_kind::IsLossTerm(t.name())) sum += buffers_[t.id()].f32[0];
    }
    return sum * context_.grad_scale;
  }

  // Every MoE layer's expert choice of the last forward, concatenated (empty for dense models).
  std::vector<int32_t> Routing() const {
    std::vector<int32_t> ids;
    for (const auto& op : program_.ops()) {
      if (op.kind() != op_kind::kMoeRouter) continue;
      const std::vector<int32_t>& layer = buffers_[op.outputs(1)].i32;
      ids.insert(ids.end(), layer.begin(), layer.end());
    }
    return ids;
  }

  Buffer& ByName(const std::string& name) {
    for (const auto& t : program_.tensors()) {
      if (t.name() == name) return buffers_[t.id()];
    }
    ADD_FAILURE() << "no tensor " << name;
    return buffers_[0];
  }
  KernelContext& context() { return context_; }
  const proto::Program& program() const { return program_; }

 private:
  proto::Program program_;
  std::vector<Buffer> buffers_;
  KernelContext context_;
};

proto::Program TinyProgram(const std::string& preset = "tiny", ModelOverrides overrides = {}) {
  auto config = MakeConfig(preset, overrides);
  EXPECT_TRUE(config.ok());
  auto program = BuildProgram(*config);
  EXPECT_TRUE(program.ok());
  return *program;
}

class TinyPrograms : public ::testing::TestWithParam<std::string> {
 protected:
  // mixtral-tiny with a balancing-loss weight large enough to show in every router gradient.
  static proto::Program Program() {
    ModelOverrides overrides;
    if (GetParam() == "mixtral-tiny") overrides.router_aux_coef = 1.0;
    return TinyProgram(GetParam(), overrides);
  }
};
INSTANTIATE_TEST_SUITE_P(DenseAndMoe, TinyPrograms, ::testing::Values("tiny", "mixtral-tiny"),
                         [](const auto& info) {
                           return info.param == "tiny" ? std::string("Tiny")
                                                       : std::string("MixtralTiny");
                         });

TEST_P(TinyPrograms, BackwardMatchesFiniteDifferencesOfTheLoss) {
  ProgramRunner runner(Program());
  auto source = TokenSource::Open(runner.program().config());
  ASSERT_TRUE(source.ok());
  runner.LoadBatch(**source, 0);
  const double loss = runner.Loss();
  // Untrained: about log(vocab) (plus aux_coef * top_k per MoE layer of balancing loss).
  const double balance = GetParam() == "mixtral-tiny" ? 1.0 * 2 * 2 : 0.0;
  EXPECT_NEAR(loss, std::log(256.0) + balance, 0.1);
  runner.RunPhase(proto::PHASE_BACKWARD);

  // Top-k routing makes the MoE loss piecewise smooth: a central difference is valid only when
  // neither side changes which experts a token goes to. Such a step is shrunk (up to 100x).
  const std::vector<int32_t> routing = runner.Routing();
  auto central = [&](const std::function<void(double)>& move, double step) {
    for (int attempt = 0; attempt < 3; ++attempt, step /= 10) {
      move(step);
      const double plus = runner.Loss();
      const bool plus_same = runner.Routing() == routing;
      move(-step);
      const double minus = runner.Loss();
      if (plus_same && runner.Routing() == routing) return (plus - minus) / (2 * step);
    }
    ADD_FAILURE() << "every step changed the routing";
    return 0.0;
  };
  constexpr double kDirectionStep = 1e-2;
  constexpr double kElementStep = 1e-2;
  for (const auto& t : runner.program().tensors()) {
    if (t.role() != proto::ROLE_PARAM) continue;
    SCOPED_TRACE(t.name());
    std::vector<float>& param = runner.ByName(t.name()).f32;
    const std::vector<float> grad = runner.ByName(t.name() + ".grad").f32;
    const std::vector<float> saved = param;
    double norm_sq = 0;
    for (float g : grad) norm_sq += double{g} * g;
    const double norm = std::sqrt(norm_sq);
    ASSERT_GT(norm, 0);

    // Along the gradient's own direction the derivative is |grad|: this checks every element
    // at once with a large, well-conditioned signal.
    const double directional = central(
        [&](double step) {
          for (size_t i = 0; i < param.size(); ++i) {
            param[i] = static_cast<float>(saved[i] + step * grad[i] / norm);
          }
        },
        kDirectionStep);
    param = saved;
    EXPECT_NEAR(directional, norm, 0.02 * norm);

    // The element with the largest gradient, alone.
    const size_t e = std::max_element(grad.begin(), grad.end(),
                                      [](float a, float b) { return std::abs(a) < std::abs(b); }) -
                     grad.begin();
    const double numeric =
        central([&](double step) { param[e] = static_cast<float>(saved[e] + step); }, kElementStep);
    param = saved;
    EXPECT_NEAR(grad[e], numeric, 0.05 * std::abs(numeric) + 1e-5) << "element " << e;
  }
}

TEST_P(TinyPrograms, LossFallsWithinTwentyAdamSteps) {
  ProgramRunner runner(Program());
  auto source = TokenSource::Open(runner.program().config());
  ASSERT_TRUE(source.ok());
  constexpr int kSteps = 20;
  std::vector<double> losses;
  for (int step = 0; step < kSteps; ++step) {
    runner.LoadBatch(**source, step);
    losses.push_back(runner.Loss());
    runner.RunPhase(proto::PHASE_BACKWARD);
    runner.context().adam_step = step + 1;
    runner.RunPhase(proto::PHASE_OPTIMIZER);
  }
  // Single micro-batches of 64 tokens are noisy: compare the mean of the last few steps. The
  // loss goes from log(256) = 5.55 to about 4.4.
  constexpr int kTail = 5;
  double tail_mean = 0;
  for (int i = kSteps - kTail; i < kSteps; ++i) tail_mean += losses[i] / kTail;
  EXPECT_LT(tail_mean, losses.front() - 0.75)
      << "first " << losses.front() << ", mean of the last " << kTail << " " << tail_mean;
}

}  // namespace
}  // namespace dc
