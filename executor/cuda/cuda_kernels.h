// The CUDA backend's math: every op kind of schemas/op_kinds.h on device tensors, with the CPU
// backend (executor/cpu_kernels.cc) as the reference it is tested against.
//
// Mixed precision as DeepSpeed does it: an op's float operands share one storage dtype, the
// compute dtype (bf16 or fp16; fp32 too, which tests compare tightly with the CPU backend);
// every kernel accumulates in fp32, softmax, RMSNorm and cross-entropy statistics are fp32, the
// loss is an fp32 [1] tensor; AdamW runs on fp32 shards (param, grad, m, v). Matrix products go
// through cuBLASLt (CUBLAS_COMPUTE_32F); the rest are own kernels (kernels.cuh, attention.cuh,
// moe.cuh). The mixture-of-experts kinds keep the router's gates, the gates' gradient and the
// aux loss in fp32 and the expert ids in i32 whatever the compute dtype; they rebuild the
// expert-major layout (executor/moe_layout.h) on the device from the ids, deterministically.
//
// Work is enqueued on the context's stream and RunCudaOp returns without waiting, except with
// `synchronous`, and except grouped_matmul and grouped_matmul_backward: cuBLASLt needs each
// expert's row count on the host, so they copy the segment offsets back and wait for the stream
// once per op. Errors that only the device sees (a token id outside the vocabulary, an expert
// id outside [0, experts)) land in a device error record that CheckDeviceErrors reads.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "executor/device_tensor.h"
#include "schemas/program.h"
#include "schemas/status.h"

namespace dc {

struct CudaKernelOptions {
  // cuBLASLt workspace; NVIDIA suggests 32 MiB on Hopper.
  int64_t cublas_workspace_bytes = int64_t{32} << 20;
};

// What the kernels of one device share: the cuBLASLt handle, its workspace, the per-shape
// algorithm cache, the device's limits, a growable scratch buffer and the device error record.
// Create it with the device current; use it from one host thread at a time (not thread-safe).
// The cuBLASLt workspace and the own scratch are reused by every op, so the ops that use one
// resources object must be ordered on one stream (the executor's compute stream); ops on
// concurrent streams need their own resources (or their own scratch in the context).
class CudaKernelResources {
 public:
  static StatusOr<std::unique_ptr<CudaKernelResources>> Create(
      const CudaKernelOptions& options = {});
  ~CudaKernelResources();
  CudaKernelResources(const CudaKernelResources&) = delete;
  CudaKernelResources& operator=(const CudaKernelResources&) = delete;

  // Waits for `stream`, then returns (and clears) the first bad token or expert id any kernel
  // met since the last call: "embedding: token id 70000 at position 12 is outside the
  // vocabulary of 32000", "moe routing: expert id 9 at slot 2 is outside the 8 experts".
  Status CheckDeviceErrors(cudaStream_t stream);

  // Matmul algorithms cached so far (one per distinct shape, dtype, transposes and alignment).
  int64_t cached_matmul_algorithms() const;

  struct Impl;
  Impl& impl() { return *impl_; }

 private:
  explicit CudaKernelResources(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

struct CudaKernelContext {
  CudaKernelResources* resources = nullptr;  // required
  cudaStream_t stream = nullptr;
  // Device scratch for the kinds that need it (CudaScratchBytes). When null, the resources'
  // own scratch is used, grown on demand (growing waits for the device).
  void* scratch = nullptr;
  int64_t scratch_bytes = 0;
  // AdamW's settings where the op has no attrs.
  const proto::ModelConfig* config = nullptr;
  // Scale of the loss gradient: 1 / (tokens in the whole optimizer step over all ranks).
  double grad_scale = 1.0;
  int64_t adam_step = 1;  // 1-based optimizer step, for Adam's bias correction
  double lr_scale = 1.0;  // the schedule's factor on the op's lr (LearningRateScale)
  // Wait for the stream after the op and check the device error record, so that a failure is
  // reported by the op that caused it (tests, debugging).
  bool synchronous = false;
};

// Device scratch bytes `op` needs with these operands (0 for most kinds; embedding_backward,
// rmsnorm_backward, attention_backward, cross_entropy and every mixture-of-experts kind need
// some). Errors as RunCudaOp's checks.
StatusOr<int64_t> CudaScratchBytes(const proto::Op& op, std::span<const DeviceTensor> inputs,
                                   std::span<const DeviceTensor> outputs);

// Runs `op` with operands in the op's own order (schemas/op_kinds.h). Outputs are preallocated
// and overwritten, never accumulated into; adamw mutates its inputs. Checks arity, dtypes, shapes
// and attrs on the host and names the op in every error ("op layers.0.attn (attention): input 1
// (k) has dtype f32, expected bf16 like input 0"), and CUDA / cuBLASLt errors with the call.
Status RunCudaOp(const proto::Op& op, std::span<DeviceTensor> inputs,
                 std::span<DeviceTensor> outputs, const CudaKernelContext& context);

// Executor helpers. `to` = `from` converted elementwise (same element count, float dtypes).
Status CudaCast(const DeviceTensor& from, const DeviceTensor& to, cudaStream_t stream);
// dst (fp32) += scale * src (any float dtype), elementwise; for accumulating micro-step grads.
Status CudaAccumulate(const DeviceTensor& src, float scale, const DeviceTensor& dst,
                      cudaStream_t stream);

}  // namespace dc
