// Launchers of the device kernels (kernels.cuh, attention.cuh, moe.cuh), callable from plain
// C++: private to executor/cuda. Pointers are device pointers, row-major; `FloatType` is the one
// storage type of an op's float operands (fp32 accumulation inside every kernel whatever it is).
// Each launcher enqueues its kernels on `stream` and returns the first launch error; it checks
// nothing that the caller (cuda_kernels.cc) has already checked: shapes, sizes that fit the grid,
// scratch size.
#pragma once

#include <driver_types.h>

#include <cstdint>
#include <initializer_list>

namespace dc::cuda_kernels {

enum class FloatType { kF32, kBF16, kF16 };

// The device error record that kernels fill when they meet a bad token or expert id (they cannot
// return a Status): int32 [kDeviceErrorInts] = {source (0 = none), position, id, bound}. The first
// error wins; the host reads and clears it (CudaKernelResources::CheckDeviceErrors).
inline constexpr int kDeviceErrorInts = 4;
enum DeviceErrorSource : int32_t {
  kNoDeviceError = 0,
  kBadEmbeddingToken = 1,
  kBadCrossEntropyTarget = 2,
  kBadExpertId = 3,  // position: the slot t * k + j; bound: the number of experts
};

// Threads per block of every kernel except attention's.
inline constexpr int kThreadsPerBlock = 256;

cudaError_t Embedding(FloatType type, const int32_t* tokens, int64_t num_tokens, const void* table,
                      int64_t vocab, int64_t hidden, void* y, int32_t* device_error,
                      cudaStream_t stream);
// `links` is scratch of EmbeddingBackwardScratchInts(num_tokens) int32.
int64_t EmbeddingBackwardScratchInts(int64_t num_tokens);
cudaError_t EmbeddingBackward(FloatType type, const void* dy, const int32_t* tokens,
                              int64_t num_tokens, int64_t vocab, int64_t hidden, void* dtable,
                              int32_t* links, int32_t* device_error, cudaStream_t stream);

cudaError_t RmsNorm(FloatType type, const void* x, const void* w, int64_t rows, int64_t hidden,
                    float eps, void* y, cudaStream_t stream);
// `scratch` is RmsNormBackwardScratchFloats(rows, hidden) floats.
int64_t RmsNormBackwardScratchFloats(int64_t rows, int64_t hidden);
cudaError_t RmsNormBackward(FloatType type, const void* dy, const void* x, const void* w,
                            int64_t rows, int64_t hidden, float eps, void* dx, void* dw,
                            float* scratch, cudaStream_t stream);

// sign +1 rotates forward, -1 backward.
cudaError_t Rope(FloatType type, const void* x, void* y, int64_t batch, int64_t seq, int64_t heads,
                 int64_t head_dim, double theta, float sign, cudaStream_t stream);
inline constexpr int64_t kRopeMaxHeadDim = 1024;

struct AttentionDims {
  int64_t batch, seq, heads, kv_heads, head_dim;
};
inline constexpr int64_t kAttentionMaxHeadDim = 256;
// Dynamic shared memory of the largest attention kernel for this head_dim (forward or
// backward), for the caller to compare with the device's per-block limit.
int64_t AttentionSmemBytes(int64_t head_dim, bool backward);
// Whether Attention and AttentionBackward run on the tensor cores for these operands: 16-bit
// types, head_dim a multiple of 16 up to 128, every operand 16-byte aligned (else the fp32
// CUDA-core kernels, which take any head_dim up to kAttentionMaxHeadDim).
bool AttentionOnTensorCores(FloatType type, const AttentionDims& dims,
                            std::initializer_list<const void*> operands);
// The grid's y extent is batch * heads: at most this many.
inline constexpr int64_t kAttentionMaxBatchHeads = 65535;
cudaError_t Attention(FloatType type, const AttentionDims& dims, const void* q, const void* k,
                      const void* v, void* o, cudaStream_t stream);
// `scratch` is AttentionBackwardScratchFloats(dims) floats (softmax log-sum-exp and
// rowsum(dO * O) per query row).
int64_t AttentionBackwardScratchFloats(const AttentionDims& dims);
cudaError_t AttentionBackward(FloatType type, const AttentionDims& dims, const void* d_o,
                              const void* q, const void* k, const void* v, void* dq, void* dk,
                              void* dv, float* scratch, cudaStream_t stream);

cudaError_t Swiglu(FloatType type, const void* gate, const void* up, void* y, int64_t n,
                   cudaStream_t stream);
cudaError_t SwigluBackward(FloatType type, const void* dy, const void* gate, const void* up,
                           void* dgate, void* dup, int64_t n, cudaStream_t stream);

// y = inputs[0] + inputs[1] + ... (in that order); y may alias an input.
cudaError_t AddN(FloatType type, const void* const* inputs, int num_inputs, void* y, int64_t n,
                 cudaStream_t stream);

// `row_losses` is scratch of `rows` doubles; `loss` one fp32 on the device.
cudaError_t CrossEntropy(FloatType type, const void* logits, const int32_t* targets, int64_t rows,
                         int64_t vocab, float* loss, double* row_losses, int32_t* device_error,
                         cudaStream_t stream);
cudaError_t CrossEntropyBackward(FloatType type, const void* logits, const int32_t* targets,
                                 int64_t rows, int64_t vocab, float grad_scale, void* dlogits,
                                 int32_t* device_error, cudaStream_t stream);

// Mixture of experts (moe.cuh). `experts` holds the i32 ids of M * k slots (s = t * k + j),
// `tokens` is M and `top_k` k; gates, dgates and the aux loss are fp32 whatever `type` is.

// The expert-major layout of executor/moe_layout.h on the device, in int32 scratch of
// MoeLayoutScratchInts(slots, E): offsets [E + 1] (expert e's rows are [offsets[e],
// offsets[e + 1])) and rows [slots] (slot s's row). A slot whose id is outside [0, E) is
// recorded in the device error record, gets row -1 and is left out of the offsets (then
// offsets[E] < slots); the kernels below skip such slots.
struct MoeLayoutView {
  int32_t* offsets;
  int32_t* rows;
  int32_t* chunk_bases;  // the layout pass's own
};
int64_t MoeLayoutScratchInts(int64_t slots, int64_t num_experts);
MoeLayoutView MoeLayoutInScratch(int32_t* scratch, int64_t slots, int64_t num_experts);
cudaError_t MoeLayout(const int32_t* experts, int64_t slots, int64_t num_experts,
                      const MoeLayoutView& layout, int32_t* device_error, cudaStream_t stream);

// Top-k routing and the load-balancing loss; `scratch` is MoeRouterScratchBytes (8-byte
// aligned).
int64_t MoeRouterScratchBytes(int64_t tokens, int64_t num_experts);
cudaError_t MoeRouter(FloatType type, const void* logits, int64_t tokens, int64_t num_experts,
                      int64_t top_k, double aux_coef, float* gates, int32_t* experts,
                      float* aux_loss, void* scratch, cudaStream_t stream);
// `offsets` from MoeLayout of `experts`; balance_grad_per_choice = grad_scale * aux_coef * E / M,
// the balancing term's d(loss)/dp[t, e] per token routed to e.
cudaError_t MoeRouterBackward(FloatType type, const float* dgates, const void* logits,
                              const int32_t* experts, const int32_t* offsets, int64_t tokens,
                              int64_t num_experts, int64_t top_k, double balance_grad_per_choice,
                              void* dlogits, cudaStream_t stream);
// `rows` from MoeLayout. Rows that no valid slot maps to are left unwritten.
cudaError_t MoeDispatch(FloatType type, const void* x, const int32_t* rows, int64_t tokens,
                        int64_t top_k, int64_t hidden, void* xs, cudaStream_t stream);
cudaError_t MoeDispatchBackward(FloatType type, const void* dxs, const int32_t* rows,
                                int64_t tokens, int64_t top_k, int64_t hidden, void* dx,
                                cudaStream_t stream);
cudaError_t MoeCombine(FloatType type, const void* ys, const float* gates, const int32_t* rows,
                       int64_t tokens, int64_t top_k, int64_t hidden, void* y, cudaStream_t stream);
cudaError_t MoeCombineBackward(FloatType type, const void* dy, const void* ys, const float* gates,
                               const int32_t* rows, int64_t tokens, int64_t top_k, int64_t hidden,
                               void* dys, float* dgates, cudaStream_t stream);

// AdamW's constants, computed on the host exactly as the CPU backend computes them (in double,
// then rounded to fp32 for the fp32 pass).
// With clipping, max_grad_norm > 0 and the launcher's norm_squared (the global squared norm,
// one fp32 on the device) scale the grad by min(1, max_grad_norm / (sqrt(norm_squared) +
// clip_epsilon)) in fp32, as the CPU backend does; without, norm_squared is null.
struct AdamWConstants {
  float lr, beta1, one_minus_beta1, beta2, one_minus_beta2, eps;
  float m_correction, v_correction, decay;
  float max_grad_norm = 0, clip_epsilon = 0;  // used only with a norm_squared
};
cudaError_t AdamW(float* param, const float* grad, float* m, float* v, int64_t n,
                  const AdamWConstants& constants, const float* norm_squared, cudaStream_t stream);

// grad_norm_squared: the sum of squares of each of `count` fp32 inputs, in double, in input order
// and a fixed order inside each (deterministic), written to *out as fp32. `partials` is
// GradNormSquaredScratchBytes() of device memory.
int64_t GradNormSquaredScratchBytes();
cudaError_t GradNormSquared(const float* const* inputs, const int64_t* sizes, int64_t count,
                            float* out, void* partials, cudaStream_t stream);

// to[i] = from[i] converted (round to nearest even).
cudaError_t Cast(FloatType from_type, const void* from, FloatType to_type, void* to, int64_t n,
                 cudaStream_t stream);
// dst[i] += scale * src[i] in fp32.
cudaError_t AccumulateF32(FloatType src_type, const void* src, float scale, float* dst, int64_t n,
                          cudaStream_t stream);

}  // namespace dc::cuda_kernels
