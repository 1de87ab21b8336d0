#include "schemas/effects.h"

#include <gtest/gtest.h>

#include <initializer_list>
#include <string>
#include <tuple>

#include "tests/support/program_builder.h"

namespace dc {
namespace {

// A small program (world size 2, fp32), one op of every kind of use:
//   tensors  w param [4] (16 B gathered, 8 B shard), x input i32 [2] (8 B), a, b, b2
//            activations [4] (16 B), g grad of w [4] (16 B, 8 B shard), m optimizer state [4]
//   ops      0 fwd (x, w -> a), 1 head (a -> b), 2 head-recompute (a -> b2, b's twin),
//            3 bwd (b2, w -> g), 4 adam (w, g, m -> w, m, updated in place), 5 norm (g -> n,
//            the grads' squared norm, an optimizer-phase activation [1]), 6 clipped-adam
//            (w, g, m, n -> w, m)
enum TensorId { kW, kX, kA, kB, kB2, kG, kM, kN };
enum OpId { kFwd, kHead, kHeadRecompute, kBwd, kAdam, kNorm, kClippedAdam };

using test::AddOp;

// x holds 2 token ids, the rest 4 elements; grads and states belong to w.
void AddTensor(proto::Program* program, const std::string& name, proto::Role role,
               proto::DType dtype = proto::DTYPE_F32) {
  const bool of_w = role == proto::ROLE_GRAD || role == proto::ROLE_OPTIMIZER_STATE;
  test::AddTensor(program, name, name == "x" ? 2 : (name == "n" ? 1 : 4), role, dtype,
                  of_w ? kW : -1);
}

proto::Schedule Empty() {
  proto::Schedule schedule;
  schedule.set_world_size(2);
  proto::Program& program = *schedule.mutable_program();
  program.mutable_config()->set_compute_dtype(proto::DTYPE_F32);
  AddTensor(&program, "w", proto::ROLE_PARAM);
  AddTensor(&program, "x", proto::ROLE_INPUT, proto::DTYPE_I32);
  AddTensor(&program, "a", proto::ROLE_ACTIVATION);
  AddTensor(&program, "b", proto::ROLE_ACTIVATION);
  AddTensor(&program, "b2", proto::ROLE_ACTIVATION);
  AddTensor(&program, "g", proto::ROLE_GRAD);
  AddTensor(&program, "m", proto::ROLE_OPTIMIZER_STATE);
  AddTensor(&program, "n", proto::ROLE_ACTIVATION);
  AddOp(&program, "fwd", proto::PHASE_FORWARD, {kX, kW}, {kA});
  AddOp(&program, "head", proto::PHASE_FORWARD, {kA}, {kB});
  AddOp(&program, "head-recompute", proto::PHASE_BACKWARD, {kA}, {kB2});
  AddOp(&program, "bwd", proto::PHASE_BACKWARD, {kB2, kW}, {kG});
  AddOp(&program, "adam", proto::PHASE_OPTIMIZER, {kW, kG, kM}, {kW, kM});
  AddOp(&program, "norm", proto::PHASE_OPTIMIZER, {kG}, {kN});
  AddOp(&program, "clipped-adam", proto::PHASE_OPTIMIZER, {kW, kG, kM, kN}, {});
  return schedule;
}

void Add(proto::Schedule* schedule, proto::InstrKind kind, int op,
         std::initializer_list<int> tensors, int micro_step = 0,
         proto::Stream stream = proto::STREAM_COMPUTE) {
  proto::Instruction* instr = schedule->add_instructions();
  instr->set_kind(kind);
  instr->set_stream(stream);
  instr->set_micro_step(micro_step);
  instr->set_op(op);
  for (int t : tensors) instr->add_tensors(t);
}

// One instruction of every kind, every effect once.
proto::Schedule EveryKind() {
  proto::Schedule s = Empty();
  Add(&s, proto::INSTR_ALL_GATHER, -1, {kW}, 0, proto::STREAM_GATHER);      // 0
  Add(&s, proto::INSTR_COMPUTE, kFwd, {});                                  // 1
  Add(&s, proto::INSTR_COMPUTE, kHead, {});                                 // 2
  Add(&s, proto::INSTR_RENAME, kHeadRecompute, {kB});                       // 3
  Add(&s, proto::INSTR_COMPUTE, kBwd, {});                                  // 4
  Add(&s, proto::INSTR_RELEASE, -1, {kW, kX, kA, kB2});                     // 5
  Add(&s, proto::INSTR_REDUCE_SCATTER, -1, {kG}, 0, proto::STREAM_REDUCE);  // 6
  Add(&s, proto::INSTR_RELEASE, -1, {kG});                                  // 7
  Add(&s, proto::INSTR_OFFLOAD, -1, {kM}, -1, proto::STREAM_D2H);           // 8
  Add(&s, proto::INSTR_RELOAD, -1, {kM}, -1, proto::STREAM_H2D);            // 9
  Add(&s, proto::INSTR_COMPUTE, kNorm, {}, -1);                             // 10
  Add(&s, proto::INSTR_ALL_REDUCE, -1, {kN}, -1, proto::STREAM_REDUCE);     // 11
  Add(&s, proto::INSTR_COMPUTE, kAdam, {}, -1);                             // 12
  Add(&s, proto::INSTR_RELEASE, -1, {kN}, -1);                              // 13
  return s;
}

const char* SlotName(BufferSlot slot) {
  switch (slot) {
    case BufferSlot::kPersistent:
      return "persistent";
    case BufferSlot::kComputeShard:
      return "compute-shard";
    case BufferSlot::kGathered:
      return "gathered";
    case BufferSlot::kTransient:
      return "transient";
  }
  return "?";
}

// Every event as one line: "instruction +/-/= tensor slot micro-step bytes kind start|end #handle",
// a use of a buffer's contents "instruction r|w tensor slot micro-step #handle".
class Recorder : public BufferListener {
 public:
  explicit Recorder(const proto::Program& program) : program_(program) {}
  void Allocated(int instruction, const BufferKey& key, int64_t size_bytes, BufferKind kind,
                 bool at_end, int handle) override {
    Line(instruction, "+", key, size_bytes, kind, at_end, handle);
  }
  void Freed(int instruction, const BufferKey& key, int64_t size_bytes, BufferKind kind,
             bool at_end, int handle) override {
    Line(instruction, "-", key, size_bytes, kind, at_end, handle);
  }
  void Renamed(int instruction, const BufferKey& from, const BufferKey& to, int handle) override {
    text += std::to_string(instruction) + " = " + program_.tensors(from.tensor).name() + " -> " +
            program_.tensors(to.tensor).name() + " #" + std::to_string(handle) + "\n";
  }
  void Accessed(int instruction, const BufferKey& key, BufferAccess access, int handle) override {
    text += std::to_string(instruction) + (access == BufferAccess::kRead ? " r " : " w ") +
            program_.tensors(key.tensor).name() + " " + SlotName(key.slot) + " " +
            std::to_string(key.placement_micro_step()) + " #" + std::to_string(handle) + "\n";
  }
  std::string text;

 private:
  void Line(int instruction, const char* sign, const BufferKey& key, int64_t bytes, BufferKind kind,
            bool at_end, int handle) {
    text += std::to_string(instruction) + " " + sign + " " + program_.tensors(key.tensor).name() +
            " " + SlotName(key.slot) + " " + std::to_string(key.placement_micro_step()) + " " +
            std::to_string(bytes) + " " + BufferKindName(kind) + (at_end ? " end" : " start") +
            " #" + std::to_string(handle) + "\n";
  }
  const proto::Program& program_;
};

std::string Replay(const proto::Schedule& schedule) {
  Status checked = CheckReferences(schedule);
  if (!checked.ok()) return checked.message();
  Recorder recorder(schedule.program());
  Status status = BufferReplay(schedule, &recorder).Run();
  return status.ok() ? recorder.text : status.message();
}

// The table of every instruction kind's effects. A change to any rule changes a line here: if
// that change is meant, every consumer (simulator, memory plan, live curve, backends) moves with
// it, and this table is updated on purpose.
TEST(Effects, EveryInstructionKindsEffectsAsATable) {
  EXPECT_EQ(Replay(EveryKind()),
            "-1 + w persistent -1 8 shard start #0\n"
            "-1 + g persistent -1 8 grad_shard start #1\n"
            "-1 + m persistent -1 8 optimizer_state start #2\n"
            "0 r w persistent -1 #0\n"
            "0 + w gathered -2 16 gathered start #3\n"
            "0 w w gathered -2 #3\n"
            "1 + x transient 0 8 input start #4\n"
            "1 w x transient 0 #4\n"
            "1 r x transient 0 #4\n"
            "1 r w gathered -2 #3\n"
            "1 + a transient 0 16 activation start #5\n"
            "1 w a transient 0 #5\n"
            "2 r a transient 0 #5\n"
            "2 + b transient 0 16 activation start #6\n"
            "2 w b transient 0 #6\n"
            "3 = b -> b2 #6\n"
            "4 r b2 transient 0 #6\n"
            "4 r w gathered -2 #3\n"
            "4 + g transient 0 16 grad start #7\n"
            "4 w g transient 0 #7\n"
            "5 - w gathered -2 16 gathered start #3\n"
            "5 - x transient 0 8 input start #4\n"
            "5 - a transient 0 16 activation start #5\n"
            "5 - b2 transient 0 16 activation start #6\n"
            "6 r g transient 0 #7\n"
            "6 w g persistent -1 #1\n"
            "7 - g transient 0 16 grad start #7\n"
            "8 r m persistent -1 #2\n"
            "8 - m persistent -1 8 optimizer_state end #2\n"
            "9 + m persistent -1 8 optimizer_state start #8\n"
            "9 w m persistent -1 #8\n"
            "10 r g persistent -1 #1\n"
            "10 + n transient -1 4 activation start #9\n"
            "10 w n transient -1 #9\n"
            "11 w n transient -1 #9\n"
            "12 r w persistent -1 #0\n"
            "12 r g persistent -1 #1\n"
            "12 r m persistent -1 #8\n"
            "12 w w persistent -1 #0\n"
            "12 w m persistent -1 #8\n"
            "13 - n transient -1 4 activation start #9\n");
}

// The norm's order: computed, then all-reduced (once), then read; through deps or one stream.
TEST(Effects, ShardReductionsAreAllReducedBeforeTheirReaders) {
  auto with = [](std::initializer_list<
                  std::tuple<proto::InstrKind, int, proto::Stream, std::initializer_list<int>>>
                     instrs) {
    proto::Schedule s = Empty();
    for (const auto& [kind, op, stream, deps] : instrs) {
      Add(&s, kind, op,
          kind == proto::INSTR_ALL_REDUCE ? std::initializer_list<int>{kN}
                                          : std::initializer_list<int>{},
          -1, stream);
      for (int d : deps) s.mutable_instructions()->rbegin()->add_deps(d);
    }
    const Status checked = CheckShardReductions(s);
    return checked.ok() ? std::string("ok") : checked.message();
  };
  constexpr auto kCompute = proto::INSTR_COMPUTE;
  constexpr auto kAllReduce = proto::INSTR_ALL_REDUCE;
  constexpr auto kOnCompute = proto::STREAM_COMPUTE;
  constexpr auto kOnReduce = proto::STREAM_REDUCE;
  EXPECT_EQ(with({{kCompute, kNorm, kOnCompute, {}},
                  {kAllReduce, -1, kOnReduce, {0}},
                  {kCompute, kClippedAdam, kOnCompute, {1}}}),
            "ok");
  EXPECT_EQ(with({{kCompute, kNorm, kOnCompute, {}},
                  {kAllReduce, -1, kOnCompute, {}},
                  {kCompute, kClippedAdam, proto::STREAM_HOST, {1}}}),
            "ok");  // the all-reduce after the norm by stream order
  EXPECT_EQ(with({{kCompute, kNorm, kOnCompute, {}},
                  {kAllReduce, -1, kOnReduce, {0}},
                  {kCompute, kClippedAdam, kOnCompute, {}}}),
            "instruction 2 (compute) reads n without waiting for its all-reduce (instruction 1)");
  EXPECT_EQ(with({{kCompute, kNorm, kOnCompute, {}},
                  {kAllReduce, -1, kOnReduce, {}},
                  {kCompute, kClippedAdam, kOnCompute, {1}}}),
            "instruction 1 (all_reduce) all-reduces n without waiting for the compute of it");
  EXPECT_EQ(with({{kCompute, kNorm, kOnCompute, {}}, {kCompute, kClippedAdam, kOnCompute, {}}}),
            "no instruction all-reduces n, each rank's partial sum");
  EXPECT_EQ(with({{kCompute, kNorm, kOnCompute, {}},
                  {kAllReduce, -1, kOnReduce, {0}},
                  {kAllReduce, -1, kOnReduce, {0}}}),
            "instruction 2 (all_reduce) all-reduces n a second time (instruction 1 did)");
}

TEST(Effects, HostOptimizerKeepsMasterAndStatesOnTheHostWithAComputeShard) {
  proto::Schedule s = Empty();
  s.mutable_program()->mutable_config()->set_compute_dtype(proto::DTYPE_BF16);
  Add(&s, proto::INSTR_COMPUTE, kAdam, {}, -1, proto::STREAM_HOST);
  // Only the grad shard is on the device; the bf16 compute shard of w (4 B) sits beside it. The
  // step reads the grad shard from the device and writes w's compute shard back.
  EXPECT_EQ(Replay(s),
            "-1 + g persistent -1 8 grad_shard start #0\n"
            "-1 + w compute-shard -3 4 shard start #1\n"
            "0 r g persistent -1 #0\n"
            "0 w w compute-shard -3 #1\n");
}

TEST(Effects, KeysNameBuffersAsTheMemoryPlanDoes) {
  EXPECT_EQ(BufferKey::Persistent(3).placement_micro_step(), -1);
  EXPECT_EQ(BufferKey::Gathered(3).placement_micro_step(), kGatheredMicroStep);
  EXPECT_EQ(BufferKey::ComputeShard(3).placement_micro_step(), kComputeShardMicroStep);
  EXPECT_EQ(BufferKey::Transient(3, 2).placement_micro_step(), 2);
  EXPECT_EQ(BufferKey::OfOperand(3, proto::ROLE_PARAM, 1), BufferKey::Gathered(3));
  EXPECT_EQ(BufferKey::OfOperand(3, proto::ROLE_ACTIVATION, 1), BufferKey::Transient(3, 1));
  EXPECT_LT(BufferKey::Persistent(3), BufferKey::Transient(3, -1));  // distinct keys
  EXPECT_TRUE(EffectsAtEnd(proto::INSTR_OFFLOAD));
  EXPECT_FALSE(EffectsAtEnd(proto::INSTR_RELOAD));
  EXPECT_EQ(ShardBytes(Empty().program().tensors(kW), 3), 8);  // 4 elements over 3: 2 each
}

// Every check, with its one message.
TEST(Effects, EveryMisuseIsRefusedWithItsMessage) {
  struct Case {
    const char* what;
    void (*edit)(proto::Schedule*);
    const char* message;
  };
  const Case cases[] = {
      {"second gather",
       [](proto::Schedule* s) {
         Add(s, proto::INSTR_ALL_GATHER, -1, {kW});
         Add(s, proto::INSTR_ALL_GATHER, -1, {kW});
       },
       "instruction 1 (all_gather) gathers w, which is already gathered and not released"},
      {"gather of a non-param",
       [](proto::Schedule* s) { Add(s, proto::INSTR_ALL_GATHER, -1, {kA}); },
       "instruction 0 (all_gather) gathers a, which is not a param"},
      {"read of an ungathered param",
       [](proto::Schedule* s) { Add(s, proto::INSTR_COMPUTE, kFwd, {}); },
       "instruction 0 (compute) reads param w, which is not gathered"},
      {"read of a dead activation",
       [](proto::Schedule* s) { Add(s, proto::INSTR_COMPUTE, kHead, {}); },
       "instruction 0 (compute) reads a (micro-step 0), which is not live"},
      {"second write",
       [](proto::Schedule* s) {
         Add(s, proto::INSTR_ALL_GATHER, -1, {kW});
         Add(s, proto::INSTR_COMPUTE, kFwd, {});
         Add(s, proto::INSTR_COMPUTE, kFwd, {});
       },
       "instruction 2 (compute) writes a, which is still live from an earlier write"},
      {"release of an ungathered param",
       [](proto::Schedule* s) { Add(s, proto::INSTR_RELEASE, -1, {kW}); },
       "instruction 0 (release) releases param w, which is not gathered"},
      {"release of a dead transient",
       [](proto::Schedule* s) { Add(s, proto::INSTR_RELEASE, -1, {kA}); },
       "instruction 0 (release) releases a (micro-step 0), which is not live"},
      {"reduce-scatter of a non-grad",
       [](proto::Schedule* s) { Add(s, proto::INSTR_REDUCE_SCATTER, -1, {kA}); },
       "instruction 0 (reduce_scatter) reduce-scatters a, which is not a grad"},
      {"reduce-scatter of a dead grad",
       [](proto::Schedule* s) { Add(s, proto::INSTR_REDUCE_SCATTER, -1, {kG}); },
       "instruction 0 (reduce_scatter) reduce-scatters g (micro-step 0), which is not live"},
      {"optimizer read of an offloaded state",
       [](proto::Schedule* s) {
         Add(s, proto::INSTR_OFFLOAD, -1, {kM}, -1);
         Add(s, proto::INSTR_COMPUTE, kAdam, {}, -1);
       },
       "instruction 1 (compute) reads m, which is offloaded to the host; reload it first"},
      {"second offload",
       [](proto::Schedule* s) {
         Add(s, proto::INSTR_OFFLOAD, -1, {kM}, -1);
         Add(s, proto::INSTR_OFFLOAD, -1, {kM}, -1);
       },
       "instruction 1 (offload) offloads m, which is already offloaded"},
      {"reload of what is on the device",
       [](proto::Schedule* s) { Add(s, proto::INSTR_RELOAD, -1, {kM}, -1); },
       "instruction 0 (reload) reloads m, which is not offloaded"},
      {"all-reduce of a dead buffer",
       [](proto::Schedule* s) { Add(s, proto::INSTR_ALL_REDUCE, -1, {kN}, -1); },
       "instruction 0 (all_reduce) all-reduces n (micro-step -1), which is not live"},
      {"all-reduce of a grad",
       [](proto::Schedule* s) { Add(s, proto::INSTR_ALL_REDUCE, -1, {kG}, -1); },
       "instruction 0 (all_reduce) all-reduces g, which is not an activation"},
      {"rename of a dead buffer",
       [](proto::Schedule* s) { Add(s, proto::INSTR_RENAME, kHeadRecompute, {kB}); },
       "instruction 0 (rename) renames b (micro-step 0), which is not live"},
      {"rename of a non-twin",
       [](proto::Schedule* s) { Add(s, proto::INSTR_RENAME, kHeadRecompute, {kG}); },
       "instruction 0 (rename) renames tensors that are not, one for one, activations of the size "
       "of head-recompute's outputs"},
      {"bad tensor id", [](proto::Schedule* s) { Add(s, proto::INSTR_RELEASE, -1, {99}); },
       "instruction 0 (release) names a bad tensor id 99"},
      {"bad op id", [](proto::Schedule* s) { Add(s, proto::INSTR_COMPUTE, 99, {}); },
       "instruction 0 (compute) computes a bad op id 99"},
      {"bad micro-step", [](proto::Schedule* s) { Add(s, proto::INSTR_RELEASE, -1, {kA}, -5); },
       "instruction 0 (release) is in micro-step -5, outside the plan's 4096 (dc's limit without a "
       "gas)"},
      // Issue 13: untrusted plans index per-micro-step tables and op operands.
      {"micro-step beyond any gas",
       [](proto::Schedule* s) { Add(s, proto::INSTR_RELEASE, -1, {kA}, 2147483647); },
       "instruction 0 (release) is in micro-step 2147483647, outside the plan's 4096 (dc's limit "
       "without a gas)"},
      {"micro-step beyond the program's gas",
       [](proto::Schedule* s) {
         s->mutable_program()->mutable_config()->set_gas(2);
         Add(s, proto::INSTR_RELEASE, -1, {kA}, 2);
       },
       "instruction 0 (release) is in micro-step 2, outside the plan's 2 (gas)"},
      {"op reading a bad tensor id",
       [](proto::Schedule* s) { s->mutable_program()->mutable_ops(kHead)->set_inputs(0, 12345); },
       "op 1 (head) names a bad tensor id 12345"},
      {"op writing a bad tensor id",
       [](proto::Schedule* s) { s->mutable_program()->mutable_ops(kFwd)->set_outputs(0, -7); },
       "op 0 (fwd) names a bad tensor id -7"},
      {"shape past 64 bits",
       [](proto::Schedule* s) {
         proto::Tensor* t = s->mutable_program()->mutable_tensors(kA);
         t->add_shape(int64_t{1} << 40);
         t->add_shape(int64_t{1} << 40);
       },
       "tensor 2 (a) has a non-positive or too large shape"},
      {"negative dimension",
       [](proto::Schedule* s) { s->mutable_program()->mutable_tensors(kB)->set_shape(0, -4); },
       "tensor 3 (b) has a non-positive or too large shape"},
      {"world size out of range", [](proto::Schedule* s) { s->set_world_size(-3); },
       "the schedule's world size -3 is out of range"},
      {"no kind", [](proto::Schedule* s) { Add(s, proto::INSTR_UNSPECIFIED, -1, {}); },
       "instruction 0 has no valid kind"},
      {"dep on a later instruction",
       [](proto::Schedule* s) {
         Add(s, proto::INSTR_ALL_GATHER, -1, {kW});
         s->mutable_instructions(0)->add_deps(0);
       },
       "instruction 0 (all_gather) depends on instruction 0, which does not come before it"},
  };
  for (const Case& c : cases) {
    proto::Schedule s = Empty();
    c.edit(&s);
    EXPECT_EQ(Replay(s), c.message) << c.what;
  }
}

TEST(Effects, HostOptimizerOpMustNotFindItsStateOnTheDevice) {
  // Reloading the host-kept state puts it on the device, where the host op no longer finds it.
  proto::Schedule reloaded = Empty();
  Add(&reloaded, proto::INSTR_RELOAD, -1, {kM}, -1, proto::STREAM_H2D);
  Add(&reloaded, proto::INSTR_COMPUTE, kAdam, {}, -1, proto::STREAM_HOST);
  EXPECT_EQ(Replay(reloaded),
            "instruction 1 (compute) runs on the host but reads m, which is on the device");
}

}  // namespace
}  // namespace dc
