// The CPU backend's math: real fp32 forward and backward of every op kind in schemas/op_kinds.h,
// and the AdamW step. Kernels are pure functions of their views; they allocate nothing that
// outlives the call.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "schemas/program.h"
#include "schemas/status.h"

namespace dc {

// A tensor as a kernel sees it. Exactly one of f32 / i32 is set (i32 for DTYPE_I32 tensors);
// storage is fp32 whatever the declared compute dtype. For optimizer ops the views are the
// rank's 1-D shards (param, grad, m, v), of equal length.
struct TensorRef {
  float* f32 = nullptr;
  int32_t* i32 = nullptr;
  std::vector<int64_t> shape;
  int64_t NumElements() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
};

struct KernelContext {
  const proto::ModelConfig* config = nullptr;
  // Scale applied to the loss gradient: 1 / (tokens in the whole optimizer step over all
  // ranks), so reduce-scattered sums of grads are the gradient of the mean loss.
  double grad_scale = 1.0;
  int64_t adam_step = 1;  // 1-based optimizer step, for Adam's bias correction
  double lr_scale = 1.0;  // the schedule's factor on the op's lr (LearningRateScale)
  // BLAS threads. OpenBLAS's setting is process-global: RunCpuOp applies the latest value.
  // Keep 1 when each rank is its own process on a few cores.
  int num_threads = 1;
};

// Runs `op` with `inputs` and `outputs` in the op's own order (schemas/op_kinds.h). Outputs are
// preallocated with the tensors' shapes and are overwritten, never accumulated into; in-place
// ops (adamw) mutate their inputs. Checks arity, shapes, attrs and token ids; errors name the
// op ("op layers.0.attn.q_proj (matmul): input 1 (w) has shape [4, 6], expected [4, 5]").
// Thread-safety: kernels share no state, but see num_threads.
Status RunCpuOp(const proto::Op& op, std::span<TensorRef> inputs, std::span<TensorRef> outputs,
                const KernelContext& context);

// The kernels OpenBLAS picked for this process when it loaded ("SkylakeX", "Haswell", "Zen",
// "Prescott", ...; OPENBLAS_CORETYPE overrides its pick).
std::string BlasCore();
// Where OpenBLAS picked kernels without AVX2 on a CPU that has AVX2 and FMA (a CPU model it does
// not know, as some virtual machines report): its matrix products then run at a fraction of the
// core's speed (4x slower on one such VM). The warning names the kernels to ask for; empty
// otherwise. dc leaves OPENBLAS_CORETYPE to the user: it changes the GEMMs' rounding.
std::string BlasCoreWarning();

}  // namespace dc
