// Checkpoints: the training state (every param's fp32 master and Adam's m and v, wherever the
// plan keeps them) saved during a run and read back to resume it.
//
// A checkpoint is DIR/step-<8 digits>/: one safetensors file per rank
// (rank-<r>-of-<w>.safetensors: that rank's flat shard of each tensor, by the program's tensor
// name) and manifest.json (the step, world size, global batch, model, tensor shapes and each
// shard file's size and SHA-256). The ranks write their files into DIR/.partial-step-N/; when
// every rank has written, rank 0 writes the manifest there and renames the directory to
// step-N. So a step-N directory is always complete, a save killed half-way leaves only a
// .partial directory (which the next save removes), and the previous checkpoint stays usable.
// The newest `keep` checkpoints are kept.
//
// What a checkpoint needs beyond the tensors is the step: dc's initial values and its data are
// counter-based (seed, element, sample index), so there is no generator state to save, and
// the data position is the step. Resuming reads the state by element ranges, not by rank
// files, so a checkpoint resumes under another world size or another plan of the same model
// (baseline, offload, ...), as long as the global batch is the same.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "executor/executor.h"
#include "schemas/program.h"
#include "schemas/status.h"
#include "weights/safetensors.h"

namespace dc {

struct CheckpointOptions {
  std::string dir;
  int64_t every_steps = 0;  // also every this many steps; 0: only at `final_step`
  int64_t final_step = 0;   // the run's last step count: always saved
  int keep = 2;             // complete checkpoints kept, newest first
  std::string plan_digest;  // recorded in the manifest, for people
  // On rank 0 after each published checkpoint: its step, directory, the bytes of its shard
  // files and the save's wall seconds (every rank's write, the agreement and the publish).
  std::function<void(int64_t step, const std::string& path, int64_t bytes, double seconds)>
      on_saved;
};

// Creates `dir` if needed and checks that files can be written in it, before a run starts.
Status PrepareCheckpointDir(const std::string& dir);

// The RunOptions::after_step hook that saves checkpoints as `options` asks. Every rank calls
// it; the ranks agree on success, so either every rank goes on or every rank stops with the
// error.
std::function<Status(TrainingState&)> CheckpointSaver(CheckpointOptions options);

// A complete checkpoint, open for resuming.
class Checkpoint {
 public:
  // The newest complete checkpoint in `dir`, checked against `program` run on `world_size`
  // ranks: the same tensors with the same shapes, the same model settings, the same global
  // batch. Errors name the checkpoint and what differs.
  static StatusOr<std::unique_ptr<Checkpoint>> OpenNewest(const std::string& dir,
                                                          const proto::Program& program,
                                                          int world_size);
  const std::string& path() const { return path_; }
  int64_t step() const { return step_; }
  int saved_world_size() const { return world_size_; }
  // RunOptions::initial_values: elements [offset, offset + count) of `tensor` (padding past its
  // end as zeros) from the shard files that hold them; each file's SHA-256 is checked against
  // the manifest the first time it is read. Grads are not in a checkpoint: false.
  StatusOr<bool> Read(const proto::Tensor& tensor, int64_t offset, int64_t count, float* out);

 private:
  std::string path_;
  int64_t step_ = 0;
  int world_size_ = 1;
  std::vector<safetensors::File> shards_;  // by the saving rank
  std::vector<std::string> shard_sha256_;
  std::vector<bool> verified_;
};

// The name of step `step`'s checkpoint directory inside a checkpoint directory.
std::string CheckpointDirName(int64_t step);

}  // namespace dc
