// A run's weights in and out in Hugging Face's format (weights/hf.h), as hooks on RunOptions:
// start from a model directory (--init-from), write the trained model at the end (--export),
// and, for parity tests and debugging, write the first step's full gradients (--dump-grads).
#pragma once

#include <string>

#include "executor/executor.h"
#include "schemas/program.h"
#include "schemas/status.h"

namespace dc {

struct WeightsIoOptions {
  // A model directory (config.json + model.safetensors or HF's sharded files, fp32/bf16/f16)
  // whose weights replace dc's seeded init; Adam's states start at zero. Empty: none.
  std::string init_from_dir;
  // Written at the end of the run: <dir>/model.safetensors (fp32, HF names) and
  // <dir>/config.json, atomically as a directory. Every rank gathers one param at a time; rank
  // 0 keeps them all until the file is written (the whole fp32 model in host memory). Empty:
  // none.
  std::string export_dir;
  // Written after the run's first step: <dir>/grads.safetensors (each param's gradient of the
  // step's mean loss, fp32, by the param's HF name) and <dir>/dc_run.json (the settings a
  // reference needs to repeat the step: batch, world size, data, optimizer). Empty: none.
  std::string dump_grads_dir;
};

// Checks the options against the plan's program before any rank starts, one line per problem:
// the init-from directory holds this model, the output directories do not exist yet and their
// parents do.
Status CheckWeightsIo(const WeightsIoOptions& options, const proto::Program& program);

// Installs the hooks on `run`, which must already hold its steps, warm-up steps and first step
// (the export follows the last step). Hooks already there (a checkpoint's after_step) still run,
// first; a start of another kind (initial_values, as a resume sets) and --init-from are refused
// together. Every rank calls it; only rank 0 writes.
Status AttachWeightsIo(const WeightsIoOptions& options, const proto::Program& program,
                       RunOptions* run);

}  // namespace dc
