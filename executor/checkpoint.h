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

// One published checkpoint, as rank 0 saw its save.
struct SavedCheckpoint {
  int64_t step = 0;
  std::string path;   // DIR/step-N
  int64_t bytes = 0;  // every rank's shard file
  // Rank 0's training thread, blocked by this save: the snapshot, the waits for its writer (at
  // the next save point or the end), the agreement and the publishing (the manifest and the
  // rename).
  double blocking_seconds = 0;
  // Rank 0's writer: removing the checkpoints past `keep` that the last publish left, then
  // serializing, writing, fsyncing and hashing its shard file, while training went on (with
  // `background` false, the file's write on the training thread, inside blocking_seconds).
  double background_seconds = 0;
  double seconds = 0;  // from the snapshot to the publishing
};

struct CheckpointOptions {
  std::string dir;
  int64_t every_steps = 0;  // also every this many steps; 0: only at `final_step`
  int64_t final_step = 0;   // the run's last step count: always saved
  int keep = 2;             // complete checkpoints kept, newest first
  std::string plan_digest;  // recorded in the manifest, for people
  // true: a save point only copies the rank's state into host memory (kept from one save to the
  // next: the size of the rank's shards) and a writer thread writes the file while the next
  // steps train. false: the file is written between steps, shard by shard, with no host copy of
  // the state (for a host without the memory for one).
  bool background = true;
  // Tests: the background writer waits, after writing a shard file's header, until this file
  // exists (a save provably in flight). Empty: it never waits.
  std::string writer_gate_for_tests;
  // On rank 0 after each published checkpoint.
  std::function<void(const SavedCheckpoint&)> on_saved;
};

// Creates `dir` if needed and checks that files can be written in it, before a run starts.
Status PrepareCheckpointDir(const std::string& dir);

// Sets `run`'s after_step and at_end to save checkpoints as `options` asks (every rank). A save
// point (every `every_steps` steps and the last step) snapshots the rank's state and hands it
// to the rank's writer thread; at most one save is in flight per rank: the next save point, a
// stop or the end of the run waits for it first. Once every rank's writer is done (asked once a
// step while a save is in flight: one number summed over the ranks), the ranks agree on the
// outcome on the training thread and rank 0 publishes the checkpoint; so either every rank goes
// on or every rank stops with the error, at the step after the writer failed at the latest.
void AttachCheckpointSaver(CheckpointOptions options, RunOptions* run);

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
