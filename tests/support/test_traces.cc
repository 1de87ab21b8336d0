#include "tests/support/test_traces.h"

#include <gtest/gtest.h>
#include <sqlite3.h>
#include <stdlib.h>

#include <filesystem>

#include "collector/host_tracer.h"

namespace dc::testing {

namespace fs = std::filesystem;

TempDir::TempDir() {
  std::string pattern = (fs::temp_directory_path() / "dc_analyzer_test_XXXXXX").string();
  path_ = mkdtemp(pattern.data());
}

TempDir::~TempDir() { fs::remove_all(path_); }

std::string TempDir::File(const std::string& name) const {
  return (fs::path(path_) / name).string();
}

namespace {

void AddTensor(proto::Program* program, const std::string& name, proto::Role role, int param) {
  proto::Tensor* t = program->add_tensors();
  t->set_id(program->tensors_size() - 1);
  t->set_name(name);
  t->add_shape(256);
  t->set_dtype(proto::DTYPE_F32);
  t->set_role(role);
  t->set_param(param);
}

void AddOp(proto::Program* program, const std::string& name, proto::Phase phase, double flops) {
  proto::Op* op = program->add_ops();
  op->set_id(program->ops_size() - 1);
  op->set_name(name);
  op->set_phase(phase);
  op->set_flops(flops);
}

void AddInstruction(proto::Schedule* schedule, proto::InstrKind kind, proto::Stream stream, int op,
                    int tensor) {
  proto::Instruction* instr = schedule->add_instructions();
  instr->set_kind(kind);
  instr->set_stream(stream);
  instr->set_op(op);
  if (tensor >= 0) instr->add_tensors(tensor);
}

void RecordRank(HostTracer& tracer, int rank) {
  constexpr int64_t kStepNs = 10000;
  const int64_t fwd0_ns[2][3] = {{100, 300, 200}, {400, 500, 600}};
  for (int s = 0; s <= 3; ++s) {
    const bool warmup = s == 0;
    const int64_t w = kStepNs * s;
    const int64_t gather_bytes = warmup ? 1000 : 1000 * s;
    const int64_t gather_ns = warmup ? 8000 : 1000 + gather_bytes;
    const int64_t reduce_ns = warmup ? 900 : 100 * s;
    const int64_t fwd0 = warmup ? 5000 : fwd0_ns[rank][s - 1];
    tracer.Kernel("fwd0", proto::STREAM_COMPUTE, w, w + fwd0, {s, 0, 1});
    tracer.Collective(proto::INSTR_ALL_GATHER, proto::STREAM_GATHER, w + 1000, w + 1000 + gather_ns,
                      gather_bytes, 1, 0, {s, 0, 0});
    tracer.Kernel("fwd1", proto::STREAM_COMPUTE, w + 2000, w + 5000, {s, 0, 2});
    tracer.Collective(proto::INSTR_REDUCE_SCATTER, proto::STREAM_REDUCE, w + 6000,
                      w + 6000 + reduce_ns, 500, 1, 0, {s, 0, 3});
    tracer.Copy(proto::INSTR_OFFLOAD, proto::STREAM_D2H, w + 7000, w + 8000, 4000, {s, -1, 4});
    const int64_t end = rank == 1 && s == 3 ? 50000 : w + kStepNs;
    tracer.Step(s, w, end, 3.0 - s, warmup);
  }
  if (rank != 0) return;
  tracer.Memory(10, 1, 100, true, "w0", BufferKind::kGathered, 0);
  tracer.Memory(20, 2, 30, true, "a0", BufferKind::kActivation, 0);
  tracer.Memory(30, 1, 100, false, "w0", BufferKind::kGathered, 0);
  tracer.Memory(40, 99, 50, false, "w0.shard", BufferKind::kShard, 0);
  tracer.Memory(40, 3, 10, true, "tokens", BufferKind::kInput, 0);
}

}  // namespace

proto::Schedule CpuSchedule(int world_size) {
  proto::Schedule schedule;
  schedule.set_format_version(kScheduleFormatVersion);
  schedule.set_world_size(world_size);
  schedule.set_backend("cpu");
  proto::Program* program = schedule.mutable_program();
  program->set_format_version(kProgramFormatVersion);
  program->mutable_config()->set_compute_dtype(proto::DTYPE_F32);
  return schedule;
}

proto::Schedule ProfileSchedule() {
  proto::Schedule schedule = CpuSchedule(2);
  proto::Program* program = schedule.mutable_program();
  AddTensor(program, "w0", proto::ROLE_PARAM, -1);
  AddTensor(program, "a0", proto::ROLE_ACTIVATION, -1);
  AddTensor(program, "g0", proto::ROLE_GRAD, 0);
  AddTensor(program, "m0", proto::ROLE_OPTIMIZER_STATE, 0);
  AddOp(program, "fwd0", proto::PHASE_FORWARD, 3500);
  AddOp(program, "fwd1", proto::PHASE_FORWARD, 0);
  AddOp(program, "bwd", proto::PHASE_BACKWARD, 1e4);
  AddInstruction(&schedule, proto::INSTR_ALL_GATHER, proto::STREAM_GATHER, -1, 0);
  AddInstruction(&schedule, proto::INSTR_COMPUTE, proto::STREAM_COMPUTE, 0, -1);
  AddInstruction(&schedule, proto::INSTR_COMPUTE, proto::STREAM_COMPUTE, 1, -1);
  AddInstruction(&schedule, proto::INSTR_REDUCE_SCATTER, proto::STREAM_REDUCE, -1, 2);
  AddInstruction(&schedule, proto::INSTR_OFFLOAD, proto::STREAM_D2H, -1, 3);
  AddInstruction(&schedule, proto::INSTR_COMPUTE, proto::STREAM_COMPUTE, 2, -1);
  return schedule;
}

std::string WriteProfileTrace(const TempDir& dir) {
  std::vector<std::string> rank_paths;
  for (int rank = 0; rank < 2; ++rank) {
    RankIdentity identity;
    identity.rank = rank;
    identity.local_rank = rank;
    identity.world_size = 2;
    identity.hostname = "test";
    HostTracer tracer(identity, 0);
    RecordRank(tracer, rank);
    rank_paths.push_back(dir.File("rank" + std::to_string(rank) + ".db"));
    if (!tracer.WriteRankFile(rank_paths.back()).ok()) return "";
  }
  const std::string out = dir.File("trace.db");
  return MergeRankTraces(rank_paths, ProfileSchedule(), out).ok() ? out : "";
}

void ExecSql(const std::string& path, const std::string& sql) {
  sqlite3* db = nullptr;
  ASSERT_EQ(sqlite3_open(path.c_str(), &db), SQLITE_OK);
  char* error = nullptr;
  EXPECT_EQ(sqlite3_exec(db, sql.c_str(), nullptr, nullptr, &error), SQLITE_OK)
      << (error ? error : "");
  sqlite3_free(error);
  sqlite3_close(db);
}

}  // namespace dc::testing
