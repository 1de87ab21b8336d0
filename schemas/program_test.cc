#include "schemas/program.h"

#include <gtest/gtest.h>

#include <cmath>

namespace dc {
namespace {

proto::Tensor* AddTensor(proto::Program* p, const std::string& name, proto::Role role,
                         int param = -1) {
  auto* t = p->add_tensors();
  t->set_id(p->tensors_size() - 1);
  t->set_name(name);
  t->add_shape(3);
  t->add_shape(5);
  t->set_dtype(proto::DTYPE_F32);
  t->set_role(role);
  t->set_param(param);
  return t;
}

proto::Op* AddOp(proto::Program* p, const std::string& name, proto::Phase phase,
                 std::vector<int> in, std::vector<int> out) {
  auto* op = p->add_ops();
  op->set_id(p->ops_size() - 1);
  op->set_name(name);
  op->set_kind("test");
  op->set_phase(phase);
  for (int i : in) op->add_inputs(i);
  for (int o : out) op->add_outputs(o);
  return op;
}

TEST(Program, SizesAndShards) {
  proto::Tensor t;
  t.add_shape(3);
  t.add_shape(5);
  t.set_dtype(proto::DTYPE_BF16);
  EXPECT_EQ(NumElements(t), 15);
  EXPECT_EQ(SizeBytes(t), 30);
  EXPECT_EQ(ShardElements(15, 4), 4);
  EXPECT_EQ(ShardElements(16, 4), 4);
  EXPECT_EQ(ShardElements(15, 1), 15);
}

TEST(Program, AttrsStaySorted) {
  proto::Op op;
  SetAttr(&op, "zeta", 1);
  SetAttr(&op, "alpha", 2);
  SetAttrFloat(&op, "mid", 0.5);
  ASSERT_EQ(op.attrs_size(), 3);
  EXPECT_EQ(op.attrs(0).name(), "alpha");
  EXPECT_EQ(op.attrs(2).name(), "zeta");
  EXPECT_EQ(AttrInt(op, "zeta", 0), 1);
  EXPECT_DOUBLE_EQ(AttrFloat(op, "mid", 0), 0.5);
  EXPECT_EQ(AttrInt(op, "missing", 7), 7);
}

TEST(Program, ValidProgramPasses) {
  proto::Program p;
  AddTensor(&p, "x", proto::ROLE_INPUT);
  AddTensor(&p, "w", proto::ROLE_PARAM);
  AddTensor(&p, "y", proto::ROLE_ACTIVATION);
  AddTensor(&p, "dw", proto::ROLE_GRAD, 1);
  AddOp(&p, "fwd", proto::PHASE_FORWARD, {0, 1}, {2});
  AddOp(&p, "bwd", proto::PHASE_BACKWARD, {0, 2}, {3});
  EXPECT_TRUE(ValidateProgram(p).ok()) << ValidateProgram(p).message();
}

TEST(Program, RejectsReadBeforeProduce) {
  proto::Program p;
  AddTensor(&p, "x", proto::ROLE_INPUT);
  AddTensor(&p, "y", proto::ROLE_ACTIVATION);
  AddTensor(&p, "z", proto::ROLE_ACTIVATION);
  AddOp(&p, "a", proto::PHASE_FORWARD, {1}, {2});
  AddOp(&p, "b", proto::PHASE_FORWARD, {0}, {1});
  Status s = ValidateProgram(p);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("before it is produced"), std::string::npos);
}

TEST(Program, RejectsGradWithoutProducer) {
  proto::Program p;
  AddTensor(&p, "w", proto::ROLE_PARAM);
  AddTensor(&p, "dw", proto::ROLE_GRAD, 0);
  EXPECT_FALSE(ValidateProgram(p).ok());
}

// A recompute names an earlier forward op of its kind; the name decides nothing.
TEST(Program, RecomputeNamesAnEarlierForwardOpOfItsKind) {
  proto::Program p;
  AddTensor(&p, "x", proto::ROLE_INPUT);
  AddTensor(&p, "w", proto::ROLE_PARAM);
  AddTensor(&p, "y", proto::ROLE_ACTIVATION);
  AddTensor(&p, "y.again", proto::ROLE_ACTIVATION);
  AddOp(&p, "fwd", proto::PHASE_FORWARD, {0, 1}, {2});
  proto::Op* again = AddOp(&p, "fwd.again", proto::PHASE_BACKWARD, {0, 1}, {3});
  again->set_recompute_of(0);
  EXPECT_TRUE(ValidateProgram(p).ok()) << ValidateProgram(p).message();

  again->set_recompute_of(1);
  EXPECT_EQ(ValidateProgram(p).message(),
            "op fwd.again is a recompute of op 1, which is not an earlier forward op of its kind");
  again->set_recompute_of(0);
  p.mutable_ops(0)->set_kind("other");
  EXPECT_FALSE(ValidateProgram(p).ok());
  p.mutable_ops(0)->set_kind(again->kind());
  again->set_phase(proto::PHASE_FORWARD);
  EXPECT_FALSE(ValidateProgram(p).ok());
}

TEST(Program, RejectsWritingAParam) {
  proto::Program p;
  AddTensor(&p, "w", proto::ROLE_PARAM);
  AddOp(&p, "bad", proto::PHASE_FORWARD, {}, {0});
  EXPECT_FALSE(ValidateProgram(p).ok());
}

TEST(LearningRate, WarmsUpThenDecaysToTheFloorAndStaysThere) {
  proto::ModelConfig c;
  c.set_lr(1.0);
  EXPECT_EQ(LearningRate(c, 0), 1.0);  // all zero: constant
  EXPECT_EQ(LearningRate(c, 1000), 1.0);
  c.set_lr_warmup_steps(4);
  c.set_lr_decay_steps(10);
  c.set_min_lr(0.1);
  c.set_lr_decay(proto::LR_DECAY_COSINE);
  EXPECT_EQ(LearningRate(c, 0), 0.25);  // (step + 1) / warm-up: the first step is not at 0
  EXPECT_EQ(LearningRate(c, 3), 1.0);
  EXPECT_EQ(LearningRate(c, 4), 1.0);            // the decay starts at the peak
  EXPECT_NEAR(LearningRate(c, 9), 0.55, 1e-12);  // half-way: the mean of peak and floor
  EXPECT_NEAR(LearningRate(c, 6), 0.1 + 0.45 * (1 + std::cos(M_PI * 0.2)), 1e-12);
  EXPECT_EQ(LearningRate(c, 14), 0.1);
  EXPECT_EQ(LearningRate(c, 1000000), 0.1);
  c.set_lr_decay(proto::LR_DECAY_LINEAR);
  EXPECT_NEAR(LearningRate(c, 6), 1.0 - 0.2 * 0.9, 1e-12);
  EXPECT_EQ(LearningRate(c, 20), 0.1);
  c.set_lr_decay(proto::LR_DECAY_CONSTANT);
  EXPECT_EQ(LearningRate(c, 20), 1.0);
  EXPECT_EQ(LearningRateScale(c, 0), 0.25);
  c.set_lr(0);
  EXPECT_EQ(LearningRateScale(c, 0), 1.0);
}

}  // namespace
}  // namespace dc
