#include "schemas/program.h"

#include <gtest/gtest.h>

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

}  // namespace
}  // namespace dc
