// The device kernels of every op kind except attention (attention.cuh), and their launchers
// (kernel_launch.h). Include it in exactly one translation unit of a binary: cuda_kernels.cu, or
// the emulation test. The math follows executor/cpu_kernels.cc operation for operation, in fp32
// whatever the storage type; comments say where the order of a reduction differs.
#pragma once

#include "executor/cuda/kernel_common.cuh"

namespace dc::cuda_kernels {

// ---------------------------------------------------------------------------------------------
// embedding

// One block per token: copies the table row, in 16-byte pieces when rows and pointers allow.
template <typename T>
DC_GLOBAL void DC_LAUNCH_BOUNDS(kThreadsPerBlock)
    EmbeddingKernel(const int32_t* tokens, const T* table, int64_t vocab, int64_t hidden, T* y,
                    bool vectorized, int32_t* device_error) {
  const int64_t t = blockIdx.x;
  const int32_t id = tokens[t];
  T* out = y + t * hidden;
  if (id < 0 || id >= vocab) {
    if (threadIdx.x == 0) RecordBadId(device_error, kBadEmbeddingToken, t, id, vocab);
    for (int64_t h = threadIdx.x; h < hidden; h += blockDim.x) out[h] = FromF32<T>(0.0f);
    return;
  }
  const T* row = table + static_cast<int64_t>(id) * hidden;
  if (vectorized) {
    const int64_t pieces = hidden * static_cast<int64_t>(sizeof(T)) / 16;
    const uint4* src = reinterpret_cast<const uint4*>(row);
    uint4* dst = reinterpret_cast<uint4*>(out);
    for (int64_t i = threadIdx.x; i < pieces; i += blockDim.x) dst[i] = src[i];
  } else {
    for (int64_t h = threadIdx.x; h < hidden; h += blockDim.x) out[h] = row[h];
  }
}

// Backward without atomics and without sorting, so that dtable is bitwise reproducible: a first
// kernel links every token position to the next position holding the same id and marks the
// first occurrence of each id; a second kernel, one block per first occurrence, walks its chain
// in position order and writes the summed row once. The CPU backend adds the rows in the same
// order, so fp32 results match it bit for bit. The link pass compares every pair of positions
// (through shared-memory tiles): O(tokens^2) integer compares, about 1 ms for 32k tokens.
DC_GLOBAL void DC_LAUNCH_BOUNDS(kThreadsPerBlock)
    EmbeddingLinkKernel(const int32_t* tokens, int64_t num_tokens, int64_t vocab, int32_t* next,
                        int32_t* first, int32_t* device_error) {
  DC_SHARED int32_t tile[kThreadsPerBlock];
  const int64_t t = GlobalThreadIndex();
  const bool in_range = t < num_tokens;
  const int32_t id = in_range ? tokens[t] : -1;
  const bool valid = in_range && id >= 0 && id < vocab;
  bool is_first = true;
  int64_t next_position = num_tokens;
  for (int64_t start = 0; start < num_tokens; start += blockDim.x) {
    const int64_t j = start + threadIdx.x;
    tile[threadIdx.x] = j < num_tokens ? tokens[j] : -1;
    SyncThreads();
    const int64_t count = Min64(blockDim.x, num_tokens - start);
    if (valid) {
      for (int64_t i = 0; i < count; ++i) {
        if (tile[i] != id) continue;
        const int64_t position = start + i;
        if (position < t) is_first = false;
        if (position > t && next_position == num_tokens) next_position = position;
      }
    }
    SyncThreads();
  }
  if (!in_range) return;
  if (!valid) RecordBadId(device_error, kBadEmbeddingToken, t, id, vocab);
  next[t] = static_cast<int32_t>(next_position);
  first[t] = valid && is_first ? 1 : 0;
}

template <typename T>
DC_GLOBAL void DC_LAUNCH_BOUNDS(kThreadsPerBlock)
    EmbeddingSumKernel(const T* dy, const int32_t* tokens, int64_t num_tokens, int64_t hidden,
                       const int32_t* next, const int32_t* first, T* dtable) {
  const int64_t t = blockIdx.x;
  if (first[t] == 0) return;
  T* row = dtable + static_cast<int64_t>(tokens[t]) * hidden;
  for (int64_t h = threadIdx.x; h < hidden; h += blockDim.x) {
    float sum = 0.0f;
    for (int64_t j = t; j < num_tokens; j = next[j]) sum += ToF32(dy[j * hidden + h]);
    row[h] = FromF32<T>(sum);
  }
}

cudaError_t Embedding(FloatType type, const int32_t* tokens, int64_t num_tokens, const void* table,
                      int64_t vocab, int64_t hidden, void* y, int32_t* device_error,
                      cudaStream_t stream) {
  return DispatchFloat(type, [&](auto tag) {
    using T = decltype(tag);
    const bool vectorized =
        (hidden * static_cast<int64_t>(sizeof(T))) % 16 == 0 && Aligned16(table) && Aligned16(y);
    return LaunchKernel(EmbeddingKernel<T>, dim3(static_cast<unsigned>(num_tokens)),
                        dim3(kThreadsPerBlock), 0, stream, tokens, static_cast<const T*>(table),
                        vocab, hidden, static_cast<T*>(y), vectorized, device_error);
  });
}

int64_t EmbeddingBackwardScratchInts(int64_t num_tokens) { return 2 * num_tokens; }

cudaError_t EmbeddingBackward(FloatType type, const void* dy, const int32_t* tokens,
                              int64_t num_tokens, int64_t vocab, int64_t hidden, void* dtable,
                              int32_t* links, int32_t* device_error, cudaStream_t stream) {
  return DispatchFloat(type, [&](auto tag) {
    using T = decltype(tag);
    const int64_t bytes = vocab * hidden * static_cast<int64_t>(sizeof(T));
    if (cudaError_t e = MemsetZeroAsync(dtable, bytes, stream); e != cudaSuccess) return e;
    int32_t* next = links;
    int32_t* first = links + num_tokens;
    const dim3 link_grid(
        static_cast<unsigned>((num_tokens + kThreadsPerBlock - 1) / kThreadsPerBlock));
    if (cudaError_t e = LaunchKernel(EmbeddingLinkKernel, link_grid, dim3(kThreadsPerBlock), 0,
                                     stream, tokens, num_tokens, vocab, next, first, device_error);
        e != cudaSuccess) {
      return e;
    }
    return LaunchKernel(EmbeddingSumKernel<T>, dim3(static_cast<unsigned>(num_tokens)),
                        dim3(kThreadsPerBlock), 0, stream, static_cast<const T*>(dy), tokens,
                        num_tokens, hidden, static_cast<const int32_t*>(next),
                        static_cast<const int32_t*>(first), static_cast<T*>(dtable));
  });
}

// ---------------------------------------------------------------------------------------------
// rmsnorm

// One block per row. The CPU backend sums squares in double; fp32 here (relative 1e-6).
template <typename T>
DC_GLOBAL void DC_LAUNCH_BOUNDS(kThreadsPerBlock)
    RmsNormKernel(const T* x, const T* w, int64_t hidden, float eps, T* y) {
  DC_SHARED float scratch[32];
  const T* xr = x + static_cast<int64_t>(blockIdx.x) * hidden;
  T* yr = y + static_cast<int64_t>(blockIdx.x) * hidden;
  float sum_sq = 0.0f;
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
    const float v = ToF32(xr[i]);
    sum_sq += v * v;
  }
  sum_sq = BlockSum(sum_sq, scratch);
  const float inv_rms = 1.0f / sqrtf(sum_sq / static_cast<float>(hidden) + eps);
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
    yr[i] = FromF32<T>(ToF32(xr[i]) * inv_rms * ToF32(w[i]));
  }
}

// dx per row (one block per row), and 1 / rms of each row into `inv_rms` for the dw pass.
template <typename T>
DC_GLOBAL void DC_LAUNCH_BOUNDS(kThreadsPerBlock)
    RmsNormBackwardRowKernel(const T* dy, const T* x, const T* w, int64_t hidden, float eps, T* dx,
                             float* inv_rms_out) {
  DC_SHARED float scratch[32];
  const int64_t offset = static_cast<int64_t>(blockIdx.x) * hidden;
  const T *xr = x + offset, *dyr = dy + offset;
  T* dxr = dx + offset;
  float sum_sq = 0.0f, dot = 0.0f;  // dot = sum(dy * w * x)
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
    const float xv = ToF32(xr[i]);
    sum_sq += xv * xv;
    dot += ToF32(dyr[i]) * ToF32(w[i]) * xv;
  }
  sum_sq = BlockSum(sum_sq, scratch);
  dot = BlockSum(dot, scratch);
  const float n = static_cast<float>(hidden);
  const float inv_rms = 1.0f / sqrtf(sum_sq / n + eps);
  const float coef = dot / n * inv_rms * inv_rms * inv_rms;
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
    dxr[i] = FromF32<T>(inv_rms * ToF32(dyr[i]) * ToF32(w[i]) - ToF32(xr[i]) * coef);
  }
  if (threadIdx.x == 0) inv_rms_out[blockIdx.x] = inv_rms;
}

// dw in two deterministic stages: per (column, chunk of rows) partial sums, then the sum of the
// partials in chunk order.
inline constexpr int64_t kRmsNormRowsPerChunk = 64;
inline constexpr int64_t kRmsNormMaxChunks = 128;

inline int64_t RmsNormChunks(int64_t rows) {
  return std::clamp<int64_t>((rows + kRmsNormRowsPerChunk - 1) / kRmsNormRowsPerChunk, 1,
                             kRmsNormMaxChunks);
}

template <typename T>
DC_GLOBAL void DC_LAUNCH_BOUNDS(kThreadsPerBlock)
    RmsNormDwPartialKernel(const T* dy, const T* x, const float* inv_rms, int64_t rows,
                           int64_t hidden, int64_t rows_per_chunk, float* partial) {
  const int64_t col = GlobalThreadIndex();
  if (col >= hidden) return;
  const int64_t chunk = blockIdx.y;
  const int64_t begin = chunk * rows_per_chunk;
  const int64_t end = Min64(rows, begin + rows_per_chunk);
  float acc = 0.0f;
  for (int64_t r = begin; r < end; ++r) {
    acc += ToF32(dy[r * hidden + col]) * ToF32(x[r * hidden + col]) * inv_rms[r];
  }
  partial[chunk * hidden + col] = acc;
}

template <typename T>
DC_GLOBAL void DC_LAUNCH_BOUNDS(kThreadsPerBlock)
    RmsNormDwFinalKernel(const float* partial, int64_t chunks, int64_t hidden, T* dw) {
  const int64_t col = GlobalThreadIndex();
  if (col >= hidden) return;
  float acc = 0.0f;
  for (int64_t c = 0; c < chunks; ++c) acc += partial[c * hidden + col];
  dw[col] = FromF32<T>(acc);
}

cudaError_t RmsNorm(FloatType type, const void* x, const void* w, int64_t rows, int64_t hidden,
                    float eps, void* y, cudaStream_t stream) {
  return DispatchFloat(type, [&](auto tag) {
    using T = decltype(tag);
    return LaunchKernel(RmsNormKernel<T>, dim3(static_cast<unsigned>(rows)), dim3(kThreadsPerBlock),
                        0, stream, static_cast<const T*>(x), static_cast<const T*>(w), hidden, eps,
                        static_cast<T*>(y));
  });
}

int64_t RmsNormBackwardScratchFloats(int64_t rows, int64_t hidden) {
  return rows + RmsNormChunks(rows) * hidden;
}

cudaError_t RmsNormBackward(FloatType type, const void* dy, const void* x, const void* w,
                            int64_t rows, int64_t hidden, float eps, void* dx, void* dw,
                            float* scratch, cudaStream_t stream) {
  return DispatchFloat(type, [&](auto tag) {
    using T = decltype(tag);
    const T *dy_t = static_cast<const T*>(dy), *x_t = static_cast<const T*>(x);
    float* inv_rms = scratch;
    float* partial = scratch + rows;
    if (cudaError_t e =
            LaunchKernel(RmsNormBackwardRowKernel<T>, dim3(static_cast<unsigned>(rows)),
                         dim3(kThreadsPerBlock), 0, stream, dy_t, x_t, static_cast<const T*>(w),
                         hidden, eps, static_cast<T*>(dx), inv_rms);
        e != cudaSuccess) {
      return e;
    }
    const int64_t chunks = RmsNormChunks(rows);
    const int64_t rows_per_chunk = (rows + chunks - 1) / chunks;
    const unsigned col_blocks =
        static_cast<unsigned>((hidden + kThreadsPerBlock - 1) / kThreadsPerBlock);
    if (cudaError_t e =
            LaunchKernel(RmsNormDwPartialKernel<T>, dim3(col_blocks, static_cast<unsigned>(chunks)),
                         dim3(kThreadsPerBlock), 0, stream, dy_t, x_t,
                         static_cast<const float*>(inv_rms), rows, hidden, rows_per_chunk, partial);
        e != cudaSuccess) {
      return e;
    }
    return LaunchKernel(RmsNormDwFinalKernel<T>, dim3(col_blocks), dim3(kThreadsPerBlock), 0,
                        stream, static_cast<const float*>(partial), chunks, hidden,
                        static_cast<T*>(dw));
  });
}

// ---------------------------------------------------------------------------------------------
// rope

// One block per token. The angle table is made as the CPU backend makes it: frequency, angle,
// cos and sin in double, then rounded to fp32.
template <typename T>
DC_GLOBAL void DC_LAUNCH_BOUNDS(kThreadsPerBlock)
    RopeKernel(const T* x, T* y, int64_t seq, int64_t heads, int64_t head_dim, double theta,
               float sign) {
  DC_SHARED float cos_table[kRopeMaxHeadDim / 2];
  DC_SHARED float sin_table[kRopeMaxHeadDim / 2];
  const int64_t token = blockIdx.x;
  const int64_t position = token % seq;
  const int64_t half = head_dim / 2;
  for (int64_t i = threadIdx.x; i < half; i += blockDim.x) {
    const double inv_freq =
        pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(head_dim));
    const double angle = static_cast<double>(position) * inv_freq;
    cos_table[i] = static_cast<float>(cos(angle));
    sin_table[i] = sign * static_cast<float>(sin(angle));
  }
  SyncThreads();
  const int64_t base = token * heads * head_dim;
  for (int64_t e = threadIdx.x; e < heads * half; e += blockDim.x) {
    const int64_t h = e / half, i = e % half;
    const int64_t at = base + h * head_dim + i;
    const float x1 = ToF32(x[at]), x2 = ToF32(x[at + half]);
    const float c = cos_table[i], s = sin_table[i];
    y[at] = FromF32<T>(x1 * c - x2 * s);
    y[at + half] = FromF32<T>(x1 * s + x2 * c);
  }
}

cudaError_t Rope(FloatType type, const void* x, void* y, int64_t batch, int64_t seq, int64_t heads,
                 int64_t head_dim, double theta, float sign, cudaStream_t stream) {
  return DispatchFloat(type, [&](auto tag) {
    using T = decltype(tag);
    return LaunchKernel(RopeKernel<T>, dim3(static_cast<unsigned>(batch * seq)),
                        dim3(kThreadsPerBlock), 0, stream, static_cast<const T*>(x),
                        static_cast<T*>(y), seq, heads, head_dim, theta, sign);
  });
}

// ---------------------------------------------------------------------------------------------
// swiglu

DC_DEVICE float Sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

template <typename T>
DC_GLOBAL void DC_LAUNCH_BOUNDS(kThreadsPerBlock)
    SwigluKernel(const T* gate, const T* up, T* y, int64_t n) {
  for (int64_t i = GlobalThreadIndex(); i < n; i += GridThreads()) {
    const float g = ToF32(gate[i]);
    y[i] = FromF32<T>(g * Sigmoid(g) * ToF32(up[i]));
  }
}

// silu'(g) = s (1 + g (1 - s)) with s = sigmoid(g).
template <typename T>
DC_GLOBAL void DC_LAUNCH_BOUNDS(kThreadsPerBlock)
    SwigluBackwardKernel(const T* dy, const T* gate, const T* up, T* dgate, T* dup, int64_t n) {
  for (int64_t i = GlobalThreadIndex(); i < n; i += GridThreads()) {
    const float g = ToF32(gate[i]), s = Sigmoid(g), d = ToF32(dy[i]);
    dgate[i] = FromF32<T>(d * ToF32(up[i]) * s * (1.0f + g * (1.0f - s)));
    dup[i] = FromF32<T>(d * g * s);
  }
}

cudaError_t Swiglu(FloatType type, const void* gate, const void* up, void* y, int64_t n,
                   cudaStream_t stream) {
  return DispatchFloat(type, [&](auto tag) {
    using T = decltype(tag);
    return LaunchKernel(SwigluKernel<T>, ElementwiseGrid(n), dim3(kThreadsPerBlock), 0, stream,
                        static_cast<const T*>(gate), static_cast<const T*>(up), static_cast<T*>(y),
                        n);
  });
}

cudaError_t SwigluBackward(FloatType type, const void* dy, const void* gate, const void* up,
                           void* dgate, void* dup, int64_t n, cudaStream_t stream) {
  return DispatchFloat(type, [&](auto tag) {
    using T = decltype(tag);
    return LaunchKernel(SwigluBackwardKernel<T>, ElementwiseGrid(n), dim3(kThreadsPerBlock), 0,
                        stream, static_cast<const T*>(dy), static_cast<const T*>(gate),
                        static_cast<const T*>(up), static_cast<T*>(dgate), static_cast<T*>(dup), n);
  });
}

// ---------------------------------------------------------------------------------------------
// add

// Inputs of one pass, by value in the kernel's parameters.
inline constexpr int kAddInputsPerPass = 8;
template <typename T>
struct AddInputs {
  const T* data[kAddInputsPerPass];
  int count;
};

template <typename T>
DC_GLOBAL void DC_LAUNCH_BOUNDS(kThreadsPerBlock) AddKernel(AddInputs<T> in, T* y, int64_t n) {
  for (int64_t i = GlobalThreadIndex(); i < n; i += GridThreads()) {
    float sum = ToF32(in.data[0][i]);
    for (int j = 1; j < in.count; ++j) sum += ToF32(in.data[j][i]);
    y[i] = FromF32<T>(sum);
  }
}

// y = a + b, 16 bytes of each per thread and step (a, b and y 16-byte aligned): the residual
// adds of every layer, where AddKernel's inputs, indexed at run time, cost a tenth of the
// memory's speed.
template <typename T>
DC_GLOBAL void DC_LAUNCH_BOUNDS(kThreadsPerBlock)
    Add2Kernel(const T* a, const T* b, T* y, int64_t n) {
  constexpr int kVector = 16 / static_cast<int>(sizeof(T));
  const int64_t vectors = n / kVector;
  for (int64_t i = GlobalThreadIndex(); i < vectors; i += GridThreads()) {
    alignas(16) T x[kVector], z[kVector];
    Copy16(x, a + i * kVector);
    Copy16(z, b + i * kVector);
    DC_UNROLL
    for (int e = 0; e < kVector; ++e) x[e] = FromF32<T>(ToF32(x[e]) + ToF32(z[e]));
    Copy16(y + i * kVector, x);
  }
  for (int64_t i = vectors * kVector + GlobalThreadIndex(); i < n; i += GridThreads()) {
    y[i] = FromF32<T>(ToF32(a[i]) + ToF32(b[i]));
  }
}

// More than kAddInputsPerPass inputs take several passes, each adding the next inputs to y; in
// fp32 the sum and its order are the CPU backend's, in bf16 / fp16 y is rounded between passes.
cudaError_t AddN(FloatType type, const void* const* inputs, int num_inputs, void* y, int64_t n,
                 cudaStream_t stream) {
  return DispatchFloat(type, [&](auto tag) {
    using T = decltype(tag);
    if (num_inputs == 2 && Aligned16(inputs[0]) && Aligned16(inputs[1]) && Aligned16(y)) {
      constexpr int64_t kVector = 16 / static_cast<int64_t>(sizeof(T));
      return LaunchKernel(Add2Kernel<T>, ElementwiseGrid((n + kVector - 1) / kVector),
                          dim3(kThreadsPerBlock), 0, stream, static_cast<const T*>(inputs[0]),
                          static_cast<const T*>(inputs[1]), static_cast<T*>(y), n);
    }
    int next = 0;
    bool first_pass = true;
    while (next < num_inputs) {
      AddInputs<T> pass{};
      if (!first_pass) pass.data[pass.count++] = static_cast<const T*>(y);
      while (pass.count < kAddInputsPerPass && next < num_inputs) {
        pass.data[pass.count++] = static_cast<const T*>(inputs[next++]);
      }
      if (cudaError_t e = LaunchKernel(AddKernel<T>, ElementwiseGrid(n), dim3(kThreadsPerBlock), 0,
                                       stream, pass, static_cast<T*>(y), n);
          e != cudaSuccess) {
        return e;
      }
      first_pass = false;
    }
    return cudaSuccess;
  });
}

// ---------------------------------------------------------------------------------------------
// cross_entropy

// log(sum(exp(row))) in one pass (online max), fp32; every thread of the block gets it.
template <typename T>
DC_DEVICE float RowLogSumExp(const T* row, int64_t vocab, MaxSum* scratch) {
  MaxSum acc = EmptyMaxSum();
  for (int64_t i = threadIdx.x; i < vocab; i += blockDim.x) AddToMaxSum(acc, ToF32(row[i]));
  acc = BlockMaxSum(acc, scratch);
  return acc.max + logf(acc.sum);
}

// One block per row: the row's loss into `row_losses` (0 for a bad target, which is recorded).
template <typename T>
DC_GLOBAL void DC_LAUNCH_BOUNDS(kThreadsPerBlock)
    CrossEntropyRowKernel(const T* logits, const int32_t* targets, int64_t vocab,
                          double* row_losses, int32_t* device_error) {
  DC_SHARED MaxSum scratch[32];
  const int64_t r = blockIdx.x;
  const T* row = logits + r * vocab;
  const float lse = RowLogSumExp(row, vocab, scratch);
  if (threadIdx.x != 0) return;
  const int32_t target = targets[r];
  if (target < 0 || target >= vocab) {
    RecordBadId(device_error, kBadCrossEntropyTarget, r, target, vocab);
    row_losses[r] = 0.0;
    return;
  }
  row_losses[r] = static_cast<double>(lse) - static_cast<double>(ToF32(row[target]));
}

// One block: loss = sum of the row losses, in double, in a fixed order.
DC_GLOBAL void DC_LAUNCH_BOUNDS(kThreadsPerBlock)
    SumRowsKernel(const double* row_losses, int64_t rows, float* loss) {
  DC_SHARED double scratch[32];
  double sum = 0.0;
  for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) sum += row_losses[r];
  sum = BlockSum(sum, scratch);
  if (threadIdx.x == 0) *loss = static_cast<float>(sum);
}

// dlogits = (softmax(row) - onehot(target)) * grad_scale, one block per row.
template <typename T>
DC_GLOBAL void DC_LAUNCH_BOUNDS(kThreadsPerBlock)
    CrossEntropyBackwardKernel(const T* logits, const int32_t* targets, int64_t vocab,
                               float grad_scale, T* dlogits, int32_t* device_error) {
  DC_SHARED MaxSum scratch[32];
  const int64_t r = blockIdx.x;
  const T* row = logits + r * vocab;
  T* grad = dlogits + r * vocab;
  const float lse = RowLogSumExp(row, vocab, scratch);
  const int32_t target = targets[r];
  const bool valid = target >= 0 && target < vocab;
  if (!valid && threadIdx.x == 0) {
    RecordBadId(device_error, kBadCrossEntropyTarget, r, target, vocab);
  }
  for (int64_t i = threadIdx.x; i < vocab; i += blockDim.x) {
    float g = expf(ToF32(row[i]) - lse) * grad_scale;
    if (i == target) g -= grad_scale;
    grad[i] = FromF32<T>(valid ? g : 0.0f);
  }
}

cudaError_t CrossEntropy(FloatType type, const void* logits, const int32_t* targets, int64_t rows,
                         int64_t vocab, float* loss, double* row_losses, int32_t* device_error,
                         cudaStream_t stream) {
  return DispatchFloat(type, [&](auto tag) {
    using T = decltype(tag);
    if (cudaError_t e = LaunchKernel(
            CrossEntropyRowKernel<T>, dim3(static_cast<unsigned>(rows)), dim3(kThreadsPerBlock), 0,
            stream, static_cast<const T*>(logits), targets, vocab, row_losses, device_error);
        e != cudaSuccess) {
      return e;
    }
    return LaunchKernel(SumRowsKernel, dim3(1), dim3(kThreadsPerBlock), 0, stream,
                        static_cast<const double*>(row_losses), rows, loss);
  });
}

cudaError_t CrossEntropyBackward(FloatType type, const void* logits, const int32_t* targets,
                                 int64_t rows, int64_t vocab, float grad_scale, void* dlogits,
                                 int32_t* device_error, cudaStream_t stream) {
  return DispatchFloat(type, [&](auto tag) {
    using T = decltype(tag);
    return LaunchKernel(CrossEntropyBackwardKernel<T>, dim3(static_cast<unsigned>(rows)),
                        dim3(kThreadsPerBlock), 0, stream, static_cast<const T*>(logits), targets,
                        vocab, grad_scale, static_cast<T*>(dlogits), device_error);
  });
}

// ---------------------------------------------------------------------------------------------
// adamw

// The CPU backend's update (executor/cpu_simd.cc's AdamW): fp32, with fused multiply-adds exactly
// where it fuses and no other contraction, so the result is the CPU's bit for bit.
DC_GLOBAL void DC_LAUNCH_BOUNDS(kThreadsPerBlock)
    AdamWKernel(float* param, const float* grad, float* m, float* v, int64_t n, AdamWConstants c,
                const float* norm_squared) {
  // The clipping coefficient (executor/cpu_kernels.cc's ClipGradScale): 1 without clipping,
  // which leaves the grad's bits as they are.
  float grad_scale = 1.0f;
  if (norm_squared != nullptr) {
    const float coef = FDiv(c.max_grad_norm, FAdd(FSqrt(*norm_squared), c.clip_epsilon));
    grad_scale = coef < 1.0f ? coef : 1.0f;
  }
  for (int64_t i = GlobalThreadIndex(); i < n; i += GridThreads()) {
    const float g = FMul(grad[i], grad_scale);
    const float mi = FFma(c.beta1, m[i], FMul(c.one_minus_beta1, g));
    const float vi = FFma(c.beta2, v[i], FMul(c.one_minus_beta2, FMul(g, g)));
    m[i] = mi;
    v[i] = vi;
    const float update =
        FDiv(FMul(mi, c.m_correction), FAdd(FSqrt(FMul(vi, c.v_correction)), c.eps));
    param[i] = FFma(param[i], c.decay, -FMul(c.lr, update));
  }
}

cudaError_t AdamW(float* param, const float* grad, float* m, float* v, int64_t n,
                  const AdamWConstants& constants, const float* norm_squared, cudaStream_t stream) {
  return LaunchKernel(AdamWKernel, ElementwiseGrid(n), dim3(kThreadsPerBlock), 0, stream, param,
                      grad, m, v, n, constants, norm_squared);
}

// ---------------------------------------------------------------------------------------------
// grad_norm_squared

// Per input: each block sums the squares of its grid-stride elements in double into
// partials[1 + block]; then one block adds the partials, in block order, to the running total
// partials[0] (set by the first input) and writes it, rounded, to *out. Fixed grids and orders,
// so the result is the same run to run.
inline constexpr int64_t kGradNormBlocks = 256;

DC_GLOBAL void DC_LAUNCH_BOUNDS(kThreadsPerBlock)
    SumSquaresKernel(const float* x, int64_t n, double* partials) {
  DC_SHARED double scratch[32];
  double sum = 0;
  for (int64_t i = GlobalThreadIndex(); i < n; i += GridThreads()) {
    const double v = x[i];
    sum = DAdd(sum, DMul(v, v));
  }
  sum = BlockSum(sum, scratch);
  if (threadIdx.x == 0) partials[1 + blockIdx.x] = sum;
}

DC_GLOBAL void DC_LAUNCH_BOUNDS(kThreadsPerBlock)
    AddPartialsKernel(double* partials, int64_t blocks, bool first, float* out) {
  DC_SHARED double scratch[32];
  double sum = 0;
  for (int64_t b = threadIdx.x; b < blocks; b += blockDim.x) sum = DAdd(sum, partials[1 + b]);
  sum = BlockSum(sum, scratch);
  if (threadIdx.x == 0) {
    partials[0] = first ? sum : DAdd(partials[0], sum);
    *out = static_cast<float>(partials[0]);
  }
}

int64_t GradNormSquaredScratchBytes() {
  return (1 + kGradNormBlocks) * static_cast<int64_t>(sizeof(double));
}

cudaError_t GradNormSquared(const float* const* inputs, const int64_t* sizes, int64_t count,
                            float* out, void* partials, cudaStream_t stream) {
  double* p = static_cast<double*>(partials);
  for (int64_t k = 0; k < count; ++k) {
    const int64_t n = sizes[k];
    const int64_t blocks =
        std::clamp<int64_t>((n + kThreadsPerBlock - 1) / kThreadsPerBlock, 1, kGradNormBlocks);
    cudaError_t e = LaunchKernel(SumSquaresKernel, dim3(static_cast<unsigned>(blocks)),
                                 dim3(kThreadsPerBlock), 0, stream, inputs[k], n, p);
    if (e != cudaSuccess) return e;
    e = LaunchKernel(AddPartialsKernel, dim3(1), dim3(kThreadsPerBlock), 0, stream, p, blocks,
                     k == 0, out);
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

// ---------------------------------------------------------------------------------------------
// cast and accumulate (for the executor: gathered params, grad-shard accumulation)

template <typename From, typename To>
DC_GLOBAL void DC_LAUNCH_BOUNDS(kThreadsPerBlock) CastKernel(const From* from, To* to, int64_t n) {
  for (int64_t i = GlobalThreadIndex(); i < n; i += GridThreads()) {
    to[i] = FromF32<To>(ToF32(from[i]));
  }
}

template <typename T>
DC_GLOBAL void DC_LAUNCH_BOUNDS(kThreadsPerBlock)
    AccumulateKernel(const T* src, float scale, float* dst, int64_t n) {
  for (int64_t i = GlobalThreadIndex(); i < n; i += GridThreads()) {
    dst[i] += scale * ToF32(src[i]);
  }
}

cudaError_t Cast(FloatType from_type, const void* from, FloatType to_type, void* to, int64_t n,
                 cudaStream_t stream) {
  return DispatchFloat(from_type, [&](auto from_tag) {
    using From = decltype(from_tag);
    return DispatchFloat(to_type, [&](auto to_tag) {
      using To = decltype(to_tag);
      return LaunchKernel(CastKernel<From, To>, ElementwiseGrid(n), dim3(kThreadsPerBlock), 0,
                          stream, static_cast<const From*>(from), static_cast<To*>(to), n);
    });
  });
}

cudaError_t AccumulateF32(FloatType src_type, const void* src, float scale, float* dst, int64_t n,
                          cudaStream_t stream) {
  return DispatchFloat(src_type, [&](auto tag) {
    using T = decltype(tag);
    return LaunchKernel(AccumulateKernel<T>, ElementwiseGrid(n), dim3(kThreadsPerBlock), 0, stream,
                        static_cast<const T*>(src), scale, dst, n);
  });
}

}  // namespace dc::cuda_kernels
