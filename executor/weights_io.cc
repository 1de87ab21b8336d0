#include "executor/weights_io.h"

#include <algorithm>
#include <filesystem>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <utility>
#include <vector>

#include "schemas/files.h"
#include "weights/hf.h"
#include "weights/safetensors.h"

namespace dc {
namespace {

namespace fs = std::filesystem;

constexpr char kGradsFile[] = "grads.safetensors";
constexpr char kRunFile[] = "dc_run.json";

// An output directory: new, under an existing directory.
Status CheckNewDirectory(const std::string& flag, const std::string& dir) {
  std::string d = dir;
  while (d.size() > 1 && d.back() == '/') d.pop_back();
  std::error_code ec;
  if (fs::exists(fs::symlink_status(d, ec))) {
    return Status::Error(flag + " " + dir + ": already exists; " + flag +
                         " writes a new directory (remove it or pick another name)");
  }
  const fs::path parent = fs::path(d).parent_path();
  if (!parent.empty() && !fs::is_directory(parent, ec)) {
    return Status::Error(flag + " " + dir + ": the parent directory " + parent.string() +
                         " does not exist; create it first");
  }
  return Status::Ok();
}

// The whole of param or grad `tensor` on every rank, from each rank's shard: the rank order
// is the shard order, the padding cut off.
StatusOr<std::vector<float>> GatherWhole(Communicator* comm, const proto::Tensor& tensor,
                                         const std::vector<float>& shard) {
  const int64_t elements = NumElements(tensor);
  const int64_t shard_elements = ShardElements(elements, comm->world_size());
  if (static_cast<int64_t>(shard.size()) != shard_elements) {
    return Status::Error("the shard of " + tensor.name() + " has " + std::to_string(shard.size()) +
                         " elements, not " + std::to_string(shard_elements) + " (a dc bug)");
  }
  std::vector<float> whole(static_cast<size_t>(shard_elements * comm->world_size()));
  DC_RETURN_IF_ERROR(comm->AllGather(shard.data(), shard_elements, whole.data()));
  whole.resize(static_cast<size_t>(elements));
  return whole;
}

std::vector<int64_t> ShapeOf(const proto::Tensor& t) {
  return {t.shape().begin(), t.shape().end()};
}

// What a reference implementation needs to repeat the run's first step and optimizer.
std::string RunJson(const proto::Program& program, int world_size, int64_t step) {
  const proto::ModelConfig& c = program.config();
  nlohmann::ordered_json j;
  j["preset"] = c.preset();
  j["step"] = step;
  j["world_size"] = world_size;
  j["micro_batch"] = c.micro_batch();
  j["gas"] = c.gas();
  j["seq"] = c.seq();
  j["data_path"] = c.data_path();
  j["compute_dtype"] = DTypeName(c.compute_dtype());
  j["lr"] = c.lr();
  j["beta1"] = c.beta1();
  j["beta2"] = c.beta2();
  j["adam_eps"] = c.adam_eps();
  j["weight_decay"] = c.weight_decay();      // of matrices; 1-D params (the norms) have none
  j["clip_grad_norm"] = c.clip_grad_norm();  // 0: no clipping
  j["router_aux_coef"] = c.router_aux_coef();
  return j.dump(2) + "\n";
}

// The hooks' shared state.
struct WeightsIo {
  WeightsIoOptions options;
  const proto::Program* program = nullptr;
  int64_t last_step = 0;   // steps_done after the run's last step
  int64_t first_step = 0;  // the run's first step
  std::shared_ptr<const hf::ModelDir> init_from;
  std::map<int, std::string> hf_names;      // param id -> its HF name
  std::map<int, std::vector<float>> grads;  // grad id -> this rank's first-step shard
  bool grads_dumped = false;

  Status Export(TrainingState& state) {
    Communicator* comm = state.comm();
    std::vector<safetensors::TensorToWrite> tensors;
    for (const auto& t : program->tensors()) {
      if (t.role() != proto::ROLE_PARAM) continue;
      DC_ASSIGN_OR_RETURN(const std::vector<float> shard, state.ReadShard(t.id()));
      DC_ASSIGN_OR_RETURN(std::vector<float> whole, GatherWhole(comm, t, shard));
      if (comm->rank() != 0) continue;
      tensors.push_back(
          safetensors::F32Tensor(hf_names.at(t.id()), ShapeOf(t),
                                 std::make_shared<const std::vector<float>>(std::move(whole))));
    }
    if (comm->rank() != 0) return Status::Ok();
    return hf::WriteModelDir(options.export_dir, hf::ConfigOf(program->config()),
                             std::move(tensors))
        .Prefixed("--export: ");
  }

  Status DumpGrads(TrainingState& state) {
    Communicator* comm = state.comm();
    std::vector<safetensors::TensorToWrite> tensors;
    for (const auto& t : program->tensors()) {
      if (t.role() != proto::ROLE_GRAD) continue;
      auto shard = grads.find(t.id());
      if (shard == grads.end()) {
        return Status::Error("--dump-grads: the first step handed over no shard of " + t.name() +
                             " (a dc bug)");
      }
      DC_ASSIGN_OR_RETURN(std::vector<float> whole, GatherWhole(comm, t, shard->second));
      if (comm->rank() != 0) continue;
      tensors.push_back(
          safetensors::F32Tensor(hf_names.at(t.param()), ShapeOf(t),
                                 std::make_shared<const std::vector<float>>(std::move(whole))));
    }
    grads.clear();
    if (comm->rank() != 0) return Status::Ok();
    const std::string run_json = RunJson(*program, comm->world_size(), first_step);
    return hf::WriteDirAtomic(
               options.dump_grads_dir,
               [&](const std::string& tmp) -> Status {
                 DC_RETURN_IF_ERROR(safetensors::Write(tmp + "/" + kGradsFile, std::move(tensors),
                                                       {{"format", "pt"}}));
                 return WriteFileAtomic(tmp + "/" + kRunFile, run_json);
               })
        .Prefixed("--dump-grads: ");
  }
};

}  // namespace

Status CheckWeightsIo(const WeightsIoOptions& options, const proto::Program& program) {
  for (const auto& t : program.tensors()) {
    if (t.role() != proto::ROLE_PARAM) continue;
    if (!options.init_from_dir.empty() || !options.export_dir.empty() ||
        !options.dump_grads_dir.empty()) {
      DC_RETURN_IF_ERROR(hf::ParamName(t.name()).status());
    }
  }
  if (!options.init_from_dir.empty()) {
    DC_ASSIGN_OR_RETURN(const hf::ModelDir dir, hf::ModelDir::Open(options.init_from_dir));
    DC_RETURN_IF_ERROR(dir.CheckMatchesProgram(program).Prefixed("--init-from: "));
  }
  if (!options.export_dir.empty()) {
    DC_RETURN_IF_ERROR(CheckNewDirectory("--export", options.export_dir));
  }
  if (!options.dump_grads_dir.empty()) {
    DC_RETURN_IF_ERROR(CheckNewDirectory("--dump-grads", options.dump_grads_dir));
    if (fs::path(options.dump_grads_dir).lexically_normal() ==
        fs::path(options.export_dir).lexically_normal()) {
      return Status::Error("--dump-grads and --export name the same directory " +
                           options.export_dir + "; give each its own");
    }
  }
  return Status::Ok();
}

Status AttachWeightsIo(const WeightsIoOptions& options, const proto::Program& program,
                       RunOptions* run) {
  if (options.init_from_dir.empty() && options.export_dir.empty() &&
      options.dump_grads_dir.empty()) {
    return Status::Ok();
  }
  auto io = std::make_shared<WeightsIo>();
  io->options = options;
  io->program = &program;
  io->first_step = run->first_step;
  io->last_step = run->first_step + run->warmup_steps + run->steps;
  for (const auto& t : program.tensors()) {
    if (t.role() != proto::ROLE_PARAM) continue;
    DC_ASSIGN_OR_RETURN(io->hf_names[t.id()], hf::ParamName(t.name()));
  }

  if (!options.init_from_dir.empty()) {
    if (run->initial_values) {
      return Status::Error("--init-from " + options.init_from_dir +
                           " and a resumed run both set the start; use one of them");
    }
    DC_ASSIGN_OR_RETURN(hf::ModelDir dir, hf::ModelDir::Open(options.init_from_dir));
    DC_RETURN_IF_ERROR(dir.CheckMatchesProgram(program).Prefixed("--init-from: "));
    io->init_from = std::make_shared<const hf::ModelDir>(std::move(dir));
    // Each rank reads only its slice of each param; Adam's states start at zero.
    run->initial_values = [io](const proto::Tensor& t, int64_t offset, int64_t count,
                               float* out) -> StatusOr<bool> {
      if (t.role() != proto::ROLE_PARAM) return false;
      const std::string& name = io->hf_names.at(t.id());
      DC_ASSIGN_OR_RETURN(const hf::ModelDir::Entry entry, io->init_from->Find(name));
      const int64_t in_tensor = std::clamp<int64_t>(NumElements(t) - offset, 0, count);
      std::fill(out + in_tensor, out + count, 0.0f);  // the shard's padding
      if (in_tensor > 0) {
        DC_RETURN_IF_ERROR(
            entry.file->ReadF32(*entry.info, offset, in_tensor, out)
                .Prefixed("--init-from: " + entry.file->path() + ": " + name + ": "));
      }
      return true;
    };
  }

  if (!options.dump_grads_dir.empty()) {
    if (run->warmup_steps + run->steps == 0) {
      return Status::Error("--dump-grads " + options.dump_grads_dir +
                           " writes the first step's gradients; run at least one step");
    }
    auto previous = run->on_first_grads;
    run->on_first_grads = [io, previous](const proto::Tensor& grad,
                                         const std::vector<float>& shard) -> Status {
      if (previous) DC_RETURN_IF_ERROR(previous(grad, shard));
      io->grads[grad.id()] = shard;
      return Status::Ok();
    };
  }

  auto previous = run->after_step;
  run->after_step = [io, previous](TrainingState& state) -> Status {
    if (previous) DC_RETURN_IF_ERROR(previous(state));
    if (!io->options.dump_grads_dir.empty() && !io->grads_dumped) {
      io->grads_dumped = true;
      DC_RETURN_IF_ERROR(io->DumpGrads(state));
    }
    if (!io->options.export_dir.empty() && state.steps_done() == io->last_step) {
      DC_RETURN_IF_ERROR(io->Export(state));
    }
    return Status::Ok();
  };
  return Status::Ok();
}

}  // namespace dc
