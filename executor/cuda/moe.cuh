// The device kernels of the mixture-of-experts kinds (schemas/op_kinds.h) and their launchers
// (kernel_launch.h). Include it in exactly one translation unit of a binary: moe_kernels.cu, or
// the emulation test. The math follows executor/cpu_kernels.cc ("mixture of experts"); the CPU
// backend reduces in double where these kernels reduce in fp32 (softmax, gates, router
// gradients, the gates' gradient), except the load-balancing loss's statistics, in double here
// too.
//
// Everything is deterministic: no kernel uses a floating-point atomic or an order that depends
// on scheduling. The expert-major layout (executor/moe_layout.h) is made without any atomic in
// three passes over chunks of kMoeSlotsPerChunk slots: (1) per chunk, each expert's count and
// each slot's rank among the chunk's earlier slots of its expert; (2) in one block, the
// exclusive scan of the counts in (expert, chunk) order, which gives every (expert, chunk) its
// first row and every expert its segment; (3) each slot's row = its (expert, chunk) base + its
// rank. Rows inside a segment thus follow slot order, as MakeMoeLayout's.
#pragma once

#include "executor/cuda/kernel_common.cuh"

namespace dc::cuda_kernels {

// ---------------------------------------------------------------------------------------------
// The expert-major layout

// One block of kMoeSlotsPerChunk threads per chunk in passes (1) and (3).
inline constexpr int64_t kMoeSlotsPerChunk = kThreadsPerBlock;
// The router kernels give each token one warp, so a block routes this many tokens.
inline constexpr int64_t kMoeTokensPerBlock = kThreadsPerBlock / 32;

inline int64_t MoeChunks(int64_t slots) {
  return (slots + kMoeSlotsPerChunk - 1) / kMoeSlotsPerChunk;
}

// Pass (1): `chunk_counts` [E][chunks] (expert-major) and each valid slot's rank into `rows`;
// a slot whose id is outside [0, E) is recorded in the device error record and gets row -1.
DC_GLOBAL void DC_LAUNCH_BOUNDS(kMoeSlotsPerChunk)
    MoeChunkCountKernel(const int32_t* experts, int64_t slots, int64_t num_experts, int64_t chunks,
                        int32_t* chunk_counts, int32_t* rows, int32_t* device_error) {
  DC_SHARED int32_t tile[kMoeSlotsPerChunk];
  const int64_t chunk = blockIdx.x;
  const int64_t first = chunk * kMoeSlotsPerChunk;
  const int64_t count = Min64(kMoeSlotsPerChunk, slots - first);
  const int64_t s = first + threadIdx.x;
  const bool in_range = static_cast<int64_t>(threadIdx.x) < count;
  const int32_t id = in_range ? experts[s] : -1;
  const bool valid = id >= 0 && id < num_experts;
  tile[threadIdx.x] = valid ? id : -1;
  SyncThreads();
  if (in_range) {
    if (valid) {
      int32_t rank = 0;
      for (unsigned i = 0; i < threadIdx.x; ++i) rank += tile[i] == id ? 1 : 0;
      rows[s] = rank;
    } else {
      RecordBadId(device_error, kBadExpertId, s, id, num_experts);
      rows[s] = -1;
    }
  }
  for (int64_t e = threadIdx.x; e < num_experts; e += blockDim.x) {
    int32_t n = 0;
    for (int64_t i = 0; i < count; ++i) n += tile[i] == e ? 1 : 0;
    chunk_counts[e * chunks + chunk] = n;
  }
}

// Pass (2), one block: `chunk_bases` (the counts on entry) become their exclusive prefix sums in
// place; offsets[e] is expert e's first chunk's base and offsets[E] the number of valid slots.
// A tile of blockDim counts at a time is scanned in shared memory (Hillis-Steele), the running
// total carried from tile to tile.
DC_GLOBAL void DC_LAUNCH_BOUNDS(kThreadsPerBlock)
    MoeScanKernel(int32_t* chunk_bases, int64_t num_experts, int64_t chunks, int32_t* offsets) {
  DC_SHARED int32_t partial[kThreadsPerBlock];
  const int64_t n = num_experts * chunks;
  int32_t carry = 0;
  for (int64_t start = 0; start < n; start += blockDim.x) {
    const int64_t i = start + threadIdx.x;
    const int32_t value = i < n ? chunk_bases[i] : 0;
    partial[threadIdx.x] = value;
    SyncThreads();
    for (unsigned offset = 1; offset < blockDim.x; offset <<= 1) {
      const int32_t add = threadIdx.x >= offset ? partial[threadIdx.x - offset] : 0;
      SyncThreads();
      partial[threadIdx.x] += add;
      SyncThreads();
    }
    if (i < n) chunk_bases[i] = carry + partial[threadIdx.x] - value;
    carry += partial[blockDim.x - 1];
    SyncThreads();  // every thread has read the tile's total before the next tile overwrites it
  }
  // The barrier above also makes the other threads' bases visible.
  for (int64_t e = threadIdx.x; e < num_experts; e += blockDim.x) {
    offsets[e] = chunk_bases[e * chunks];
  }
  if (threadIdx.x == 0) offsets[num_experts] = carry;
}

// Pass (3): row = the (expert, chunk) base + the rank from pass (1).
DC_GLOBAL void DC_LAUNCH_BOUNDS(kMoeSlotsPerChunk)
    MoeRowKernel(const int32_t* experts, int64_t slots, int64_t chunks, const int32_t* chunk_bases,
                 int32_t* rows) {
  const int64_t s = GlobalThreadIndex();
  if (s >= slots || rows[s] < 0) return;
  rows[s] += chunk_bases[static_cast<int64_t>(experts[s]) * chunks + blockIdx.x];
}

int64_t MoeLayoutScratchInts(int64_t slots, int64_t num_experts) {
  return (num_experts + 1) + slots + num_experts * MoeChunks(slots);
}

MoeLayoutView MoeLayoutInScratch(int32_t* scratch, int64_t slots, int64_t num_experts) {
  MoeLayoutView view;
  view.offsets = scratch;
  view.rows = scratch + (num_experts + 1);
  view.chunk_bases = view.rows + slots;
  return view;
}

cudaError_t MoeLayout(const int32_t* experts, int64_t slots, int64_t num_experts,
                      const MoeLayoutView& layout, int32_t* device_error, cudaStream_t stream) {
  const int64_t chunks = MoeChunks(slots);
  const dim3 grid(static_cast<unsigned>(chunks));
  const dim3 block(static_cast<unsigned>(kMoeSlotsPerChunk));
  if (cudaError_t e =
          LaunchKernel(MoeChunkCountKernel, grid, block, 0, stream, experts, slots, num_experts,
                       chunks, layout.chunk_bases, layout.rows, device_error);
      e != cudaSuccess) {
    return e;
  }
  if (cudaError_t e = LaunchKernel(MoeScanKernel, dim3(1), dim3(kThreadsPerBlock), 0, stream,
                                   layout.chunk_bases, num_experts, chunks, layout.offsets);
      e != cudaSuccess) {
    return e;
  }
  return LaunchKernel(MoeRowKernel, grid, block, 0, stream, experts, slots, chunks,
                      static_cast<const int32_t*>(layout.chunk_bases), layout.rows);
}

// ---------------------------------------------------------------------------------------------
// moe_router

// The fp32 softmax of one row, reduced across a warp (lanes stride the row).
struct WarpSoftmax {
  float max, sum;
  DC_DEVICE float P(float logit) const { return expf(logit - max) / sum; }
};

template <typename T>
DC_DEVICE WarpSoftmax RowSoftmaxInWarp(const T* row, int64_t n, unsigned lane) {
  float max = -INFINITY;
  for (int64_t e = lane; e < n; e += 32) max = fmaxf(max, ToF32(row[e]));
  max = WarpMax(max);
  float sum = 0.0f;
  for (int64_t e = lane; e < n; e += 32) sum += expf(ToF32(row[e]) - max);
  return {max, WarpSum(sum)};
}

// The router's order: the larger logit first, the lower index on a tie. exp is monotonic, so
// this is the order of p, without the ties that rounding p to fp32 would add.
DC_DEVICE bool RanksBefore(float value, int32_t index, float other_value, int32_t other_index) {
  return value > other_value || (value == other_value && index < other_index);
}

// One warp per token: softmax, then top_k rounds, each the first expert in the router's order
// after the previous round's choice (so no per-token "taken" array is needed). Writes the ids,
// the renormalized gates and the token's probabilities (for the balancing statistics).
template <typename T>
DC_GLOBAL void DC_LAUNCH_BOUNDS(kThreadsPerBlock)
    MoeRouterKernel(const T* logits, int64_t tokens, int64_t num_experts, int64_t top_k,
                    float* gates, int32_t* experts, float* probs) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (t >= tokens) return;  // the whole warp: every lane has the same t
  const unsigned lane = threadIdx.x % 32;
  const T* row = logits + t * num_experts;
  const WarpSoftmax softmax = RowSoftmaxInWarp(row, num_experts, lane);
  for (int64_t e = lane; e < num_experts; e += 32) {
    probs[t * num_experts + e] = softmax.P(ToF32(row[e]));
  }
  float prev_value = 0.0f, chosen_sum = 0.0f;
  int32_t prev_index = -1;  // none yet
  for (int64_t j = 0; j < top_k; ++j) {
    float best_value = 0.0f;
    int32_t best_index = -1;
    for (int64_t e = lane; e < num_experts; e += 32) {
      const float value = ToF32(row[e]);
      const auto index = static_cast<int32_t>(e);
      const bool eligible = prev_index < 0 || RanksBefore(prev_value, prev_index, value, index);
      if (eligible && (best_index < 0 || RanksBefore(value, index, best_value, best_index))) {
        best_value = value;
        best_index = index;
      }
    }
    // The order is total, so every lane ends with the same winner.
    for (int offset = 16; offset > 0; offset >>= 1) {
      const float other_value = ShflXor(best_value, offset);
      const int32_t other_index = ShflXor(best_index, offset);
      if (other_index >= 0 &&
          (best_index < 0 || RanksBefore(other_value, other_index, best_value, best_index))) {
        best_value = other_value;
        best_index = other_index;
      }
    }
    prev_value = best_value;
    prev_index = best_index;
    const float p = softmax.P(best_value);
    chosen_sum += p;
    if (lane == 0) {
      experts[t * top_k + j] = best_index;
      gates[t * top_k + j] = p;
    }
  }
  if (lane == 0) {
    for (int64_t j = 0; j < top_k; ++j) gates[t * top_k + j] /= chosen_sum;
  }
}

// One block per expert: terms[e] = count_e * sum_t p[t, e], both sums in double in a fixed order.
DC_GLOBAL void DC_LAUNCH_BOUNDS(kThreadsPerBlock)
    MoeRouterStatsKernel(const float* probs, const int32_t* experts, int64_t tokens,
                         int64_t num_experts, int64_t top_k, double* terms) {
  DC_SHARED double scratch[32];
  const int64_t e = blockIdx.x;
  double prob_sum = 0.0, count = 0.0;
  for (int64_t t = threadIdx.x; t < tokens; t += blockDim.x) prob_sum += probs[t * num_experts + e];
  for (int64_t s = threadIdx.x; s < tokens * top_k; s += blockDim.x) {
    count += experts[s] == e ? 1.0 : 0.0;
  }
  prob_sum = BlockSum(prob_sum, scratch);
  count = BlockSum(count, scratch);
  if (threadIdx.x == 0) terms[e] = count * prob_sum;
}

// One block: aux = aux_coef * E * sum_e terms[e] / M (the layer's loss in the sum scale).
DC_GLOBAL void DC_LAUNCH_BOUNDS(kThreadsPerBlock)
    MoeAuxLossKernel(const double* terms, int64_t num_experts, int64_t tokens, double aux_coef,
                     float* aux_loss) {
  DC_SHARED double scratch[32];
  double balance = 0.0;
  for (int64_t e = threadIdx.x; e < num_experts; e += blockDim.x) balance += terms[e];
  balance = BlockSum(balance, scratch);
  if (threadIdx.x == 0) {
    *aux_loss = static_cast<float>(aux_coef * static_cast<double>(num_experts) * balance /
                                   static_cast<double>(tokens));
  }
}

// [terms: E doubles][probs: M * E floats]
int64_t MoeRouterScratchBytes(int64_t tokens, int64_t num_experts) {
  return num_experts * static_cast<int64_t>(sizeof(double)) +
         tokens * num_experts * static_cast<int64_t>(sizeof(float));
}

inline dim3 MoeRouterGrid(int64_t tokens) {
  return dim3(static_cast<unsigned>((tokens + kMoeTokensPerBlock - 1) / kMoeTokensPerBlock));
}

cudaError_t MoeRouter(FloatType type, const void* logits, int64_t tokens, int64_t num_experts,
                      int64_t top_k, double aux_coef, float* gates, int32_t* experts,
                      float* aux_loss, void* scratch, cudaStream_t stream) {
  auto* terms = static_cast<double*>(scratch);
  float* probs = reinterpret_cast<float*>(terms + num_experts);
  const cudaError_t routed = DispatchFloat(type, [&](auto tag) {
    using T = decltype(tag);
    return LaunchKernel(MoeRouterKernel<T>, MoeRouterGrid(tokens), dim3(kThreadsPerBlock), 0,
                        stream, static_cast<const T*>(logits), tokens, num_experts, top_k, gates,
                        experts, probs);
  });
  if (routed != cudaSuccess) return routed;
  if (cudaError_t e =
          LaunchKernel(MoeRouterStatsKernel, dim3(static_cast<unsigned>(num_experts)),
                       dim3(kThreadsPerBlock), 0, stream, static_cast<const float*>(probs),
                       static_cast<const int32_t*>(experts), tokens, num_experts, top_k, terms);
      e != cudaSuccess) {
    return e;
  }
  return LaunchKernel(MoeAuxLossKernel, dim3(1), dim3(kThreadsPerBlock), 0, stream,
                      static_cast<const double*>(terms), num_experts, tokens, aux_coef, aux_loss);
}

// ---------------------------------------------------------------------------------------------
// moe_router_backward

// d(loss)/dp[t, e]: the balancing term plus, for each choice j of expert e, (dg_j - weighted) / S.
DC_DEVICE float RouterProbGrad(int64_t e, const int32_t* ids, const float* dgates, int64_t top_k,
                               float weighted, float chosen_sum, float balance) {
  float dp = balance;
  for (int64_t j = 0; j < top_k; ++j) {
    if (ids[j] == e) dp += (dgates[j] - weighted) / chosen_sum;
  }
  return dp;
}

// One warp per token, as the CPU backend's loop body: gates_j = p[e_j] / S gives
// dp[e_j] += (dg_j - sum_i dg_i gates_i) / S; then dlogits = p * (dp - sum_e p dp). Ids outside
// [0, E) (recorded by the layout pass) are skipped.
template <typename T>
DC_GLOBAL void DC_LAUNCH_BOUNDS(kThreadsPerBlock)
    MoeRouterBackwardKernel(const float* dgates, const T* logits, const int32_t* experts,
                            const int32_t* offsets, int64_t tokens, int64_t num_experts,
                            int64_t top_k, double balance_grad_per_choice, T* dlogits) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (t >= tokens) return;  // the whole warp
  const unsigned lane = threadIdx.x % 32;
  const T* row = logits + t * num_experts;
  T* grad = dlogits + t * num_experts;
  const int32_t* ids = experts + t * top_k;
  const float* dg = dgates + t * top_k;
  const WarpSoftmax softmax = RowSoftmaxInWarp(row, num_experts, lane);
  float chosen_sum = 0.0f;
  for (int64_t j = 0; j < top_k; ++j) {
    if (ids[j] >= 0 && ids[j] < num_experts) chosen_sum += softmax.P(ToF32(row[ids[j]]));
  }
  float weighted = 0.0f;
  for (int64_t j = 0; j < top_k; ++j) {
    if (ids[j] >= 0 && ids[j] < num_experts) {
      weighted += dg[j] * softmax.P(ToF32(row[ids[j]])) / chosen_sum;
    }
  }
  auto balance = [&](int64_t e) {
    return static_cast<float>(balance_grad_per_choice *
                              static_cast<double>(offsets[e + 1] - offsets[e]));
  };
  float dot = 0.0f;
  for (int64_t e = lane; e < num_experts; e += 32) {
    dot += softmax.P(ToF32(row[e])) *
           RouterProbGrad(e, ids, dg, top_k, weighted, chosen_sum, balance(e));
  }
  dot = WarpSum(dot);
  for (int64_t e = lane; e < num_experts; e += 32) {
    const float p = softmax.P(ToF32(row[e]));
    const float dp = RouterProbGrad(e, ids, dg, top_k, weighted, chosen_sum, balance(e));
    grad[e] = FromF32<T>(p * (dp - dot));
  }
}

cudaError_t MoeRouterBackward(FloatType type, const float* dgates, const void* logits,
                              const int32_t* experts, const int32_t* offsets, int64_t tokens,
                              int64_t num_experts, int64_t top_k, double balance_grad_per_choice,
                              void* dlogits, cudaStream_t stream) {
  return DispatchFloat(type, [&](auto tag) {
    using T = decltype(tag);
    return LaunchKernel(MoeRouterBackwardKernel<T>, MoeRouterGrid(tokens), dim3(kThreadsPerBlock),
                        0, stream, dgates, static_cast<const T*>(logits), experts, offsets, tokens,
                        num_experts, top_k, balance_grad_per_choice, static_cast<T*>(dlogits));
  });
}

// ---------------------------------------------------------------------------------------------
// moe_dispatch, moe_combine and their backward: row kernels over the layout's rows. A slot with
// row -1 (a bad expert id, already recorded) is skipped.

// One block per slot: xs[row of s] = x[s / k].
template <typename T>
DC_GLOBAL void DC_LAUNCH_BOUNDS(kThreadsPerBlock)
    MoeDispatchKernel(const T* x, const int32_t* rows, int64_t top_k, int64_t hidden, T* xs) {
  const int64_t s = blockIdx.x;
  const int32_t r = rows[s];
  if (r < 0) return;
  const T* src = x + (s / top_k) * hidden;
  T* dst = xs + static_cast<int64_t>(r) * hidden;
  for (int64_t h = threadIdx.x; h < hidden; h += blockDim.x) dst[h] = src[h];
}

// One block per token: dx[t] = the sum of its k rows, in choice order (the CPU backend's).
template <typename T>
DC_GLOBAL void DC_LAUNCH_BOUNDS(kThreadsPerBlock)
    MoeDispatchBackwardKernel(const T* dxs, const int32_t* rows, int64_t top_k, int64_t hidden,
                              T* dx) {
  const int64_t t = blockIdx.x;
  const int32_t* token_rows = rows + t * top_k;
  T* dst = dx + t * hidden;
  for (int64_t h = threadIdx.x; h < hidden; h += blockDim.x) {
    float sum = 0.0f;
    for (int64_t j = 0; j < top_k; ++j) {
      if (token_rows[j] >= 0) sum += ToF32(dxs[static_cast<int64_t>(token_rows[j]) * hidden + h]);
    }
    dst[h] = FromF32<T>(sum);
  }
}

// One block per token: y[t] = sum_j gates[t, j] * ys[row of (t, j)], in choice order.
template <typename T>
DC_GLOBAL void DC_LAUNCH_BOUNDS(kThreadsPerBlock)
    MoeCombineKernel(const T* ys, const float* gates, const int32_t* rows, int64_t top_k,
                     int64_t hidden, T* y) {
  const int64_t t = blockIdx.x;
  const int32_t* token_rows = rows + t * top_k;
  const float* g = gates + t * top_k;
  T* dst = y + t * hidden;
  for (int64_t h = threadIdx.x; h < hidden; h += blockDim.x) {
    float sum = 0.0f;
    for (int64_t j = 0; j < top_k; ++j) {
      if (token_rows[j] >= 0) {
        sum += g[j] * ToF32(ys[static_cast<int64_t>(token_rows[j]) * hidden + h]);
      }
    }
    dst[h] = FromF32<T>(sum);
  }
}

// One block per slot: dys[row] = gate * dy[t]; dgates[s] = dy[t] . ys[row], a block reduction in
// fp32 (the CPU backend's dot is in double).
template <typename T>
DC_GLOBAL void DC_LAUNCH_BOUNDS(kThreadsPerBlock)
    MoeCombineBackwardKernel(const T* dy, const T* ys, const float* gates, const int32_t* rows,
                             int64_t top_k, int64_t hidden, T* dys, float* dgates) {
  DC_SHARED float scratch[32];
  const int64_t s = blockIdx.x;
  const int32_t r = rows[s];
  if (r < 0) {  // the whole block
    if (threadIdx.x == 0) dgates[s] = 0.0f;
    return;
  }
  const T* dyr = dy + (s / top_k) * hidden;
  const T* src = ys + static_cast<int64_t>(r) * hidden;
  T* dst = dys + static_cast<int64_t>(r) * hidden;
  const float g = gates[s];
  float dot = 0.0f;
  for (int64_t h = threadIdx.x; h < hidden; h += blockDim.x) {
    const float d = ToF32(dyr[h]);
    dst[h] = FromF32<T>(g * d);
    dot += d * ToF32(src[h]);
  }
  dot = BlockSum(dot, scratch);
  if (threadIdx.x == 0) dgates[s] = dot;
}

cudaError_t MoeDispatch(FloatType type, const void* x, const int32_t* rows, int64_t tokens,
                        int64_t top_k, int64_t hidden, void* xs, cudaStream_t stream) {
  return DispatchFloat(type, [&](auto tag) {
    using T = decltype(tag);
    return LaunchKernel(MoeDispatchKernel<T>, dim3(static_cast<unsigned>(tokens * top_k)),
                        dim3(kThreadsPerBlock), 0, stream, static_cast<const T*>(x), rows, top_k,
                        hidden, static_cast<T*>(xs));
  });
}

cudaError_t MoeDispatchBackward(FloatType type, const void* dxs, const int32_t* rows,
                                int64_t tokens, int64_t top_k, int64_t hidden, void* dx,
                                cudaStream_t stream) {
  return DispatchFloat(type, [&](auto tag) {
    using T = decltype(tag);
    return LaunchKernel(MoeDispatchBackwardKernel<T>, dim3(static_cast<unsigned>(tokens)),
                        dim3(kThreadsPerBlock), 0, stream, static_cast<const T*>(dxs), rows, top_k,
                        hidden, static_cast<T*>(dx));
  });
}

cudaError_t MoeCombine(FloatType type, const void* ys, const float* gates, const int32_t* rows,
                       int64_t tokens, int64_t top_k, int64_t hidden, void* y,
                       cudaStream_t stream) {
  return DispatchFloat(type, [&](auto tag) {
    using T = decltype(tag);
    return LaunchKernel(MoeCombineKernel<T>, dim3(static_cast<unsigned>(tokens)),
                        dim3(kThreadsPerBlock), 0, stream, static_cast<const T*>(ys), gates, rows,
                        top_k, hidden, static_cast<T*>(y));
  });
}

cudaError_t MoeCombineBackward(FloatType type, const void* dy, const void* ys, const float* gates,
                               const int32_t* rows, int64_t tokens, int64_t top_k, int64_t hidden,
                               void* dys, float* dgates, cudaStream_t stream) {
  return DispatchFloat(type, [&](auto tag) {
    using T = decltype(tag);
    return LaunchKernel(MoeCombineBackwardKernel<T>, dim3(static_cast<unsigned>(tokens * top_k)),
                        dim3(kThreadsPerBlock), 0, stream, static_cast<const T*>(dy),
                        static_cast<const T*>(ys), gates, rows, top_k, hidden, static_cast<T*>(dys),
                        dgates);
  });
}

}  // namespace dc::cuda_kernels
