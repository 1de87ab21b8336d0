// Causal grouped-query attention, forward and backward, as tiled kernels with an online softmax
// in fp32 (the flash-attention scheme). These run on CUDA cores, in fp32 from any operand type
// and any head_dim up to 256; attention_tc.cuh's run the 16-bit types on the tensor cores where
// head_dim allows (AttentionOnTensorCores). Include in exactly one translation unit of a
// binary: attention_kernels.cu, or the emulation test.
//
// Forward, one block per (64 queries, batch * head): K and V stream through shared memory in
// tiles of 32 keys; each row keeps its running max m and sum l; O = acc / l.
// Backward recomputes the softmax (nothing but q, k, v, dO is saved, as op_kinds.h says):
//   1. the forward kernel in "stats" mode writes per query row lse = m + log(l) and
//      delta = rowsum(dO * O) (O recomputed in fp32, never stored);
//   2. dQ, one block per (64 queries, batch * head): P = exp(S - lse), dP = dO V^T,
//      dS = P * (dP - delta), dQ = scale * dS K;
//   3. dK and dV, one block per (64 keys, batch * kv head), looping over the query heads of the
//      group and the query tiles: dV = sum P^T dO, dK = scale * sum dS^T Q.
// No atomics: every output element is written once, so results are deterministic.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "executor/cuda/kernel_common.cuh"

namespace dc::cuda_kernels {

// A block is 256 threads seen as 16 x 16: ty = tid / 16, tx = tid % 16. A score tile is
// kTileA x kTileB (64 x 32): thread (ty, tx) owns rows ty*4 .. ty*4+3 and columns tx*2, tx*2+1.
// Output tiles are kTileA x head_dim: the thread owns rows ty*4 .. ty*4+3 and columns
// d = tx + 16 j. The 16 threads of one ty are one half-warp, so row reductions are 4 shuffles.
inline constexpr int kAttnThreads = 256;
inline constexpr int kTileA = 64;
inline constexpr int kTileB = 32;
inline constexpr int kThreadRows = 4;  // kTileA / 16
inline constexpr int kThreadCols = 2;  // kTileB / 16
// Row strides in shared memory are padded by one float (head_dim + 1, kTileB + 1) so that the
// threads of a warp read distinct banks.
inline constexpr int kScoreLd = kTileB + 1;

struct AttnParams {
  int64_t seq, heads, kv_heads, head_dim;
  float scale;
};

// Row strides of q (o, dO) and k (v), and where query head `bh` (batch * heads + head) and its
// kv head start in them.
struct HeadOffsets {
  int64_t q_stride, kv_stride, q_offset, kv_offset;
};
DC_DEVICE HeadOffsets QueryHead(const AttnParams& p, int64_t bh) {
  const int64_t b = bh / p.heads, h = bh % p.heads, kv_head = h / (p.heads / p.kv_heads);
  HeadOffsets offsets;
  offsets.q_stride = p.heads * p.head_dim;
  offsets.kv_stride = p.kv_heads * p.head_dim;
  offsets.q_offset = b * p.seq * offsets.q_stride + h * p.head_dim;
  offsets.kv_offset = b * p.seq * offsets.kv_stride + kv_head * p.head_dim;
  return offsets;
}

DC_DEVICE int ThreadRow() { return static_cast<int>(threadIdx.x) / 16; }
DC_DEVICE int ThreadCol() { return static_cast<int>(threadIdx.x) % 16; }

DC_DEVICE float HalfWarpMax(float v) {
  for (int offset = 8; offset > 0; offset >>= 1) v = fmaxf(v, ShflXor(v, offset));
  return v;
}
DC_DEVICE float HalfWarpSum(float v) {
  for (int offset = 8; offset > 0; offset >>= 1) v += ShflXor(v, offset);
  return v;
}

// Rows row0 .. row0 + rows - 1 of one head (`head` points at row 0, column 0 of the head) into
// shared memory as fp32 with row stride `ld`; rows at or past `seq` are zero.
template <typename T>
DC_DEVICE void LoadTile(float* dst, int ld, const T* head, int64_t row_stride, int64_t row0,
                        int rows, int64_t seq, int head_dim) {
  const int count = rows * head_dim;
  for (int e = static_cast<int>(threadIdx.x); e < count; e += static_cast<int>(blockDim.x)) {
    const int r = e / head_dim, d = e % head_dim;
    const int64_t row = row0 + r;
    dst[r * ld + d] = row < seq ? ToF32(head[row * row_stride + d]) : 0.0f;
  }
}

// s[r][c] = sum_d a[ty*4 + r][d] * b[tx*2 + c][d]   (a: kTileA rows, b: kTileB rows, stride ld)
DC_DEVICE void TileScores(const float* a, const float* b, int ld, int head_dim,
                          float (&s)[kThreadRows][kThreadCols]) {
  const int ty = ThreadRow(), tx = ThreadCol();
  DC_UNROLL
  for (int r = 0; r < kThreadRows; ++r) {
    DC_UNROLL
    for (int c = 0; c < kThreadCols; ++c) s[r][c] = 0.0f;
  }
  const float* a_row = a + ty * kThreadRows * ld;
  const float* b_row = b + tx * kThreadCols * ld;
  for (int d = 0; d < head_dim; ++d) {
    float av[kThreadRows], bv[kThreadCols];
    DC_UNROLL
    for (int r = 0; r < kThreadRows; ++r) av[r] = a_row[r * ld + d];
    DC_UNROLL
    for (int c = 0; c < kThreadCols; ++c) bv[c] = b_row[c * ld + d];
    DC_UNROLL
    for (int r = 0; r < kThreadRows; ++r) {
      DC_UNROLL
      for (int c = 0; c < kThreadCols; ++c) s[r][c] += av[r] * bv[c];
    }
  }
}

// acc[r][j] += sum_k p[ty*4 + r][k] * b[k][tx + 16 j]   (p: kTileA x kTileB scores, stride
// kScoreLd; b: kTileB rows, stride ld)
template <int kMaxD>
DC_DEVICE void TileAccumulate(const float* p, const float* b, int ld, int head_dim,
                              float (&acc)[kThreadRows][kMaxD / 16]) {
  const int ty = ThreadRow(), tx = ThreadCol();
  const float* p_row = p + ty * kThreadRows * kScoreLd;
  for (int k = 0; k < kTileB; ++k) {
    float pv[kThreadRows];
    DC_UNROLL
    for (int r = 0; r < kThreadRows; ++r) pv[r] = p_row[r * kScoreLd + k];
    DC_UNROLL
    for (int j = 0; j < kMaxD / 16; ++j) {
      const int d = tx + 16 * j;
      if (d < head_dim) {
        const float bv = b[k * ld + d];
        DC_UNROLL
        for (int r = 0; r < kThreadRows; ++r) acc[r][j] += pv[r] * bv;
      }
    }
  }
}

template <int kMaxD>
DC_DEVICE void ZeroAcc(float (&acc)[kThreadRows][kMaxD / 16]) {
  DC_UNROLL
  for (int r = 0; r < kThreadRows; ++r) {
    DC_UNROLL
    for (int j = 0; j < kMaxD / 16; ++j) acc[r][j] = 0.0f;
  }
}

// Writes acc * scale to rows row0 + ty*4 + r (< seq) of one head.
template <typename T, int kMaxD>
DC_DEVICE void StoreAcc(const float (&acc)[kThreadRows][kMaxD / 16], const float (&scale)[4],
                        T* head, int64_t row_stride, int64_t row0, int64_t seq, int head_dim) {
  const int ty = ThreadRow(), tx = ThreadCol();
  DC_UNROLL
  for (int r = 0; r < kThreadRows; ++r) {
    const int64_t row = row0 + ty * kThreadRows + r;
    if (row >= seq) continue;
    T* out = head + row * row_stride;
    DC_UNROLL
    for (int j = 0; j < kMaxD / 16; ++j) {
      const int d = tx + 16 * j;
      if (d < head_dim) out[d] = FromF32<T>(acc[r][j] * scale[r]);
    }
  }
}

// Shared-memory floats of each kernel.
inline int64_t ForwardSmemFloats(int64_t head_dim) {
  return (kTileA + 2 * kTileB) * (head_dim + 1) + kTileA * kScoreLd;
}
inline int64_t DqSmemFloats(int64_t head_dim) {
  return (2 * kTileA + 2 * kTileB) * (head_dim + 1) + kTileA * kScoreLd;
}
inline int64_t DkDvSmemFloats(int64_t head_dim) {
  return (2 * kTileA + 2 * kTileB) * (head_dim + 1) + 2 * kTileA * kScoreLd + 2 * kTileB;
}

// kStats = false: writes o. kStats = true: writes lse and delta (needs d_o) for the backward.
template <typename T, int kMaxD, bool kStats>
DC_GLOBAL void DC_LAUNCH_BOUNDS(kAttnThreads)
    AttentionForwardKernel(const T* q, const T* k, const T* v, T* o, const T* d_o, float* lse,
                           float* delta, AttnParams p) {
  DC_DYNAMIC_SMEM(float, smem);
  const int head_dim = static_cast<int>(p.head_dim), ld = head_dim + 1;
  float* qs = smem;
  float* ks = qs + kTileA * ld;
  float* vs = ks + kTileB * ld;
  float* ps = vs + kTileB * ld;
  const int ty = ThreadRow(), tx = ThreadCol();
  const int64_t q0 = static_cast<int64_t>(blockIdx.x) * kTileA;
  const int64_t bh = blockIdx.y;
  const auto [q_stride, kv_stride, q_offset, kv_offset] = QueryHead(p, bh);
  LoadTile(qs, ld, q + q_offset, q_stride, q0, kTileA, p.seq, head_dim);

  float m[kThreadRows], l[kThreadRows], acc[kThreadRows][kMaxD / 16];
  DC_UNROLL
  for (int r = 0; r < kThreadRows; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.0f;
  }
  ZeroAcc<kMaxD>(acc);
  // Key tile 0 holds key 0, which every query sees, so after it every row max is finite.
  const int64_t key_end = Min64(p.seq, q0 + kTileA);
  for (int64_t k0 = 0; k0 < key_end; k0 += kTileB) {
    SyncThreads();  // the previous tile's readers are done
    LoadTile(ks, ld, k + kv_offset, kv_stride, k0, kTileB, p.seq, head_dim);
    LoadTile(vs, ld, v + kv_offset, kv_stride, k0, kTileB, p.seq, head_dim);
    SyncThreads();
    float s[kThreadRows][kThreadCols];
    TileScores(qs, ks, ld, head_dim, s);
    DC_UNROLL
    for (int r = 0; r < kThreadRows; ++r) {
      const int64_t qi = q0 + ty * kThreadRows + r;
      float tile_max = -INFINITY;
      DC_UNROLL
      for (int c = 0; c < kThreadCols; ++c) {
        const int64_t kj = k0 + tx * kThreadCols + c;
        s[r][c] = kj <= qi && kj < p.seq ? s[r][c] * p.scale : -INFINITY;
        tile_max = fmaxf(tile_max, s[r][c]);
      }
      const float m_new = fmaxf(m[r], HalfWarpMax(tile_max));
      const float alpha = expf(m[r] - m_new);
      float tile_sum = 0.0f;
      DC_UNROLL
      for (int c = 0; c < kThreadCols; ++c) {
        s[r][c] = expf(s[r][c] - m_new);
        tile_sum += s[r][c];
        ps[(ty * kThreadRows + r) * kScoreLd + tx * kThreadCols + c] = s[r][c];
      }
      l[r] = l[r] * alpha + HalfWarpSum(tile_sum);
      m[r] = m_new;
      DC_UNROLL
      for (int j = 0; j < kMaxD / 16; ++j) acc[r][j] *= alpha;
    }
    SyncThreads();
    TileAccumulate<kMaxD>(ps, vs, ld, head_dim, acc);
  }

  float inv_l[kThreadRows];
  DC_UNROLL
  for (int r = 0; r < kThreadRows; ++r) inv_l[r] = 1.0f / l[r];
  if constexpr (!kStats) {
    StoreAcc<T, kMaxD>(acc, inv_l, o + q_offset, q_stride, q0, p.seq, head_dim);
  } else {
    DC_UNROLL
    for (int r = 0; r < kThreadRows; ++r) {
      const int64_t qi = q0 + ty * kThreadRows + r;
      float dot = 0.0f;
      if (qi < p.seq) {
        const T* grad = d_o + q_offset + qi * q_stride;
        DC_UNROLL
        for (int j = 0; j < kMaxD / 16; ++j) {
          const int d = tx + 16 * j;
          if (d < head_dim) dot += ToF32(grad[d]) * (acc[r][j] * inv_l[r]);
        }
      }
      dot = HalfWarpSum(dot);  // every lane takes part
      if (tx == 0 && qi < p.seq) {
        lse[bh * p.seq + qi] = m[r] + logf(l[r]);
        delta[bh * p.seq + qi] = dot;
      }
    }
  }
}

template <typename T, int kMaxD>
DC_GLOBAL void DC_LAUNCH_BOUNDS(kAttnThreads)
    AttentionDqKernel(const T* d_o, const T* q, const T* k, const T* v, const float* lse,
                      const float* delta, T* dq, AttnParams p) {
  DC_DYNAMIC_SMEM(float, smem);
  const int head_dim = static_cast<int>(p.head_dim), ld = head_dim + 1;
  float* qs = smem;
  float* dos = qs + kTileA * ld;
  float* ks = dos + kTileA * ld;
  float* vs = ks + kTileB * ld;
  float* ds = vs + kTileB * ld;
  const int ty = ThreadRow(), tx = ThreadCol();
  const int64_t q0 = static_cast<int64_t>(blockIdx.x) * kTileA;
  const int64_t bh = blockIdx.y;
  const auto [q_stride, kv_stride, q_offset, kv_offset] = QueryHead(p, bh);
  LoadTile(qs, ld, q + q_offset, q_stride, q0, kTileA, p.seq, head_dim);
  LoadTile(dos, ld, d_o + q_offset, q_stride, q0, kTileA, p.seq, head_dim);
  float row_lse[kThreadRows], row_delta[kThreadRows];
  DC_UNROLL
  for (int r = 0; r < kThreadRows; ++r) {
    const int64_t qi = q0 + ty * kThreadRows + r;
    row_lse[r] = qi < p.seq ? lse[bh * p.seq + qi] : 0.0f;
    row_delta[r] = qi < p.seq ? delta[bh * p.seq + qi] : 0.0f;
  }
  float acc[kThreadRows][kMaxD / 16];
  ZeroAcc<kMaxD>(acc);
  const int64_t key_end = Min64(p.seq, q0 + kTileA);
  for (int64_t k0 = 0; k0 < key_end; k0 += kTileB) {
    SyncThreads();
    LoadTile(ks, ld, k + kv_offset, kv_stride, k0, kTileB, p.seq, head_dim);
    LoadTile(vs, ld, v + kv_offset, kv_stride, k0, kTileB, p.seq, head_dim);
    SyncThreads();
    float s[kThreadRows][kThreadCols], dp[kThreadRows][kThreadCols];
    TileScores(qs, ks, ld, head_dim, s);
    TileScores(dos, vs, ld, head_dim, dp);
    DC_UNROLL
    for (int r = 0; r < kThreadRows; ++r) {
      const int64_t qi = q0 + ty * kThreadRows + r;
      DC_UNROLL
      for (int c = 0; c < kThreadCols; ++c) {
        const int64_t kj = k0 + tx * kThreadCols + c;
        const bool visible = kj <= qi && kj < p.seq && qi < p.seq;
        const float prob = visible ? expf(s[r][c] * p.scale - row_lse[r]) : 0.0f;
        ds[(ty * kThreadRows + r) * kScoreLd + tx * kThreadCols + c] =
            prob * (dp[r][c] - row_delta[r]);
      }
    }
    SyncThreads();
    TileAccumulate<kMaxD>(ds, ks, ld, head_dim, acc);
  }
  const float scale[kThreadRows] = {p.scale, p.scale, p.scale, p.scale};
  StoreAcc<T, kMaxD>(acc, scale, dq + q_offset, q_stride, q0, p.seq, head_dim);
}

template <typename T, int kMaxD>
DC_GLOBAL void DC_LAUNCH_BOUNDS(kAttnThreads)
    AttentionDkDvKernel(const T* d_o, const T* q, const T* k, const T* v, const float* lse,
                        const float* delta, T* dk, T* dv, AttnParams p) {
  DC_DYNAMIC_SMEM(float, smem);
  const int head_dim = static_cast<int>(p.head_dim), ld = head_dim + 1;
  float* ks = smem;
  float* vs = ks + kTileA * ld;
  float* qs = vs + kTileA * ld;
  float* dos = qs + kTileB * ld;
  float* ps = dos + kTileB * ld;
  float* dss = ps + kTileA * kScoreLd;
  float* lse_s = dss + kTileA * kScoreLd;
  float* delta_s = lse_s + kTileB;
  const int ty = ThreadRow(), tx = ThreadCol();
  const int64_t k0 = static_cast<int64_t>(blockIdx.x) * kTileA;
  const int64_t bg = blockIdx.y, b = bg / p.kv_heads, kv_head = bg % p.kv_heads;
  const int64_t group = p.heads / p.kv_heads;
  const HeadOffsets first = QueryHead(p, b * p.heads + kv_head * group);  // the group's first
  const int64_t q_stride = first.q_stride, kv_stride = first.kv_stride;
  const int64_t kv_offset = first.kv_offset;
  LoadTile(ks, ld, k + kv_offset, kv_stride, k0, kTileA, p.seq, head_dim);
  LoadTile(vs, ld, v + kv_offset, kv_stride, k0, kTileA, p.seq, head_dim);
  float dk_acc[kThreadRows][kMaxD / 16], dv_acc[kThreadRows][kMaxD / 16];
  ZeroAcc<kMaxD>(dk_acc);
  ZeroAcc<kMaxD>(dv_acc);
  for (int64_t i = 0; i < group; ++i) {
    const int64_t h = kv_head * group + i;
    const int64_t bh = b * p.heads + h;
    const int64_t q_offset = QueryHead(p, bh).q_offset;
    // Only queries at or after the first key of this tile see it.
    for (int64_t q0 = (k0 / kTileB) * kTileB; q0 < p.seq; q0 += kTileB) {
      SyncThreads();
      LoadTile(qs, ld, q + q_offset, q_stride, q0, kTileB, p.seq, head_dim);
      LoadTile(dos, ld, d_o + q_offset, q_stride, q0, kTileB, p.seq, head_dim);
      for (int t = static_cast<int>(threadIdx.x); t < kTileB; t += static_cast<int>(blockDim.x)) {
        const int64_t qi = q0 + t;
        lse_s[t] = qi < p.seq ? lse[bh * p.seq + qi] : 0.0f;
        delta_s[t] = qi < p.seq ? delta[bh * p.seq + qi] : 0.0f;
      }
      SyncThreads();
      float st[kThreadRows][kThreadCols], dpt[kThreadRows][kThreadCols];
      TileScores(ks, qs, ld, head_dim, st);  // rows: keys, columns: queries
      TileScores(vs, dos, ld, head_dim, dpt);
      DC_UNROLL
      for (int r = 0; r < kThreadRows; ++r) {
        const int64_t kj = k0 + ty * kThreadRows + r;
        DC_UNROLL
        for (int c = 0; c < kThreadCols; ++c) {
          const int col = tx * kThreadCols + c;
          const int64_t qi = q0 + col;
          const bool visible = kj <= qi && qi < p.seq && kj < p.seq;
          const float prob = visible ? expf(st[r][c] * p.scale - lse_s[col]) : 0.0f;
          ps[(ty * kThreadRows + r) * kScoreLd + col] = prob;
          dss[(ty * kThreadRows + r) * kScoreLd + col] = prob * (dpt[r][c] - delta_s[col]);
        }
      }
      SyncThreads();
      TileAccumulate<kMaxD>(ps, dos, ld, head_dim, dv_acc);
      TileAccumulate<kMaxD>(dss, qs, ld, head_dim, dk_acc);
    }
  }
  const float one[kThreadRows] = {1.0f, 1.0f, 1.0f, 1.0f};
  const float scale[kThreadRows] = {p.scale, p.scale, p.scale, p.scale};
  StoreAcc<T, kMaxD>(dk_acc, scale, dk + kv_offset, kv_stride, k0, p.seq, head_dim);
  StoreAcc<T, kMaxD>(dv_acc, one, dv + kv_offset, kv_stride, k0, p.seq, head_dim);
}

}  // namespace dc::cuda_kernels

#include "executor/cuda/attention_tc.cuh"

namespace dc::cuda_kernels {

// ---------------------------------------------------------------------------------------------
// Launchers

// Calls fn(std::integral_constant<int, kMaxD>) with the smallest supported kMaxD >= head_dim.
template <typename Fn>
cudaError_t DispatchHeadDim(int64_t head_dim, Fn&& fn) {
  if (head_dim <= 64) return fn(std::integral_constant<int, 64>{});
  if (head_dim <= 128) return fn(std::integral_constant<int, 128>{});
  if (head_dim <= kAttentionMaxHeadDim) return fn(std::integral_constant<int, 256>{});
  return cudaErrorInvalidValue;
}

inline AttnParams MakeAttnParams(const AttentionDims& dims) {
  return AttnParams{dims.seq, dims.heads, dims.kv_heads, dims.head_dim,
                    static_cast<float>(1.0 / std::sqrt(static_cast<double>(dims.head_dim)))};
}

inline unsigned Tiles(int64_t n, int tile) { return static_cast<unsigned>((n + tile - 1) / tile); }

// Sets the kernel's dynamic shared-memory limit and launches it.
template <typename... KernelArgs, typename... Args>
cudaError_t LaunchAttentionKernel(void (*kernel)(KernelArgs...), dim3 grid, int64_t smem_floats,
                                  cudaStream_t stream, Args... args) {
  const int64_t bytes = smem_floats * static_cast<int64_t>(sizeof(float));
  if (cudaError_t e = AllowDynamicSmem(kernel, bytes); e != cudaSuccess) return e;
  return LaunchKernel(kernel, grid, dim3(kAttnThreads), static_cast<size_t>(bytes), stream,
                      args...);
}

bool AttentionOnTensorCores(FloatType type, const AttentionDims& dims,
                            std::initializer_list<const void*> operands) {
  if (type == FloatType::kF32 || dims.head_dim % 16 != 0 || dims.head_dim > kTcMaxHeadDim) {
    return false;
  }
  for (const void* operand : operands) {
    if (!Aligned16(operand)) return false;
  }
  return true;
}

// Sets the tensor-core kernel's dynamic shared-memory limit and launches it.
template <typename... KernelArgs, typename... Args>
cudaError_t LaunchTcKernel(void (*kernel)(KernelArgs...), dim3 grid, int64_t smem_bytes,
                           cudaStream_t stream, Args... args) {
  if (cudaError_t e = AllowDynamicSmem(kernel, smem_bytes); e != cudaSuccess) return e;
  return LaunchKernel(kernel, grid, dim3(kTcThreads), static_cast<size_t>(smem_bytes), stream,
                      args...);
}

// Calls fn(std::integral_constant<int, kMaxD>) for the tensor-core kernels (head_dim <= 128).
template <typename Fn>
cudaError_t DispatchTcHeadDim(int64_t head_dim, Fn&& fn) {
  if (head_dim <= 64) return fn(std::integral_constant<int, 64>{});
  return fn(std::integral_constant<int, kTcMaxHeadDim>{});
}

int64_t AttentionSmemBytes(int64_t head_dim, bool backward) {
  const int64_t floats = backward ? std::max({ForwardSmemFloats(head_dim), DqSmemFloats(head_dim),
                                              DkDvSmemFloats(head_dim)})
                                  : ForwardSmemFloats(head_dim);
  int64_t bytes = floats * static_cast<int64_t>(sizeof(float));
  if (head_dim % 16 == 0 && head_dim <= kTcMaxHeadDim) {  // the 16-bit types' kernels
    const int d = static_cast<int>(head_dim);
    bytes = std::max(bytes, backward ? std::max({TcForwardLayout(d).bytes, TcDqLayout(d).bytes,
                                                 TcDkDvLayout(d).bytes})
                                     : TcForwardLayout(d).bytes);
  }
  return bytes;
}

int64_t AttentionBackwardScratchFloats(const AttentionDims& dims) {
  return 2 * dims.batch * dims.heads * dims.seq;
}

cudaError_t Attention(FloatType type, const AttentionDims& dims, const void* q, const void* k,
                      const void* v, void* o, cudaStream_t stream) {
  const AttnParams params = MakeAttnParams(dims);
  const dim3 grid(Tiles(dims.seq, kTileA), static_cast<unsigned>(dims.batch * dims.heads));
  const bool tensor_cores = AttentionOnTensorCores(type, dims, {q, k, v, o});
  return DispatchFloat(type, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (!std::is_same_v<T, float>) {
      if (tensor_cores) {
        return DispatchTcHeadDim(dims.head_dim, [&](auto max_d) {
          constexpr int kMaxD = decltype(max_d)::value;
          return LaunchTcKernel(AttentionForwardTcKernel<T, kMaxD, false>, grid,
                                TcForwardLayout(static_cast<int>(dims.head_dim)).bytes, stream,
                                static_cast<const T*>(q), static_cast<const T*>(k),
                                static_cast<const T*>(v), static_cast<T*>(o),
                                static_cast<const T*>(nullptr), static_cast<float*>(nullptr),
                                static_cast<float*>(nullptr), params);
        });
      }
    }
    return DispatchHeadDim(dims.head_dim, [&](auto max_d) {
      constexpr int kMaxD = decltype(max_d)::value;
      return LaunchAttentionKernel(
          AttentionForwardKernel<T, kMaxD, false>, grid, ForwardSmemFloats(dims.head_dim), stream,
          static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v),
          static_cast<T*>(o), static_cast<const T*>(nullptr), static_cast<float*>(nullptr),
          static_cast<float*>(nullptr), params);
    });
  });
}

cudaError_t AttentionBackward(FloatType type, const AttentionDims& dims, const void* d_o,
                              const void* q, const void* k, const void* v, void* dq, void* dk,
                              void* dv, float* scratch, cudaStream_t stream) {
  const AttnParams params = MakeAttnParams(dims);
  float* lse = scratch;
  float* delta = scratch + dims.batch * dims.heads * dims.seq;
  const dim3 query_grid(Tiles(dims.seq, kTileA), static_cast<unsigned>(dims.batch * dims.heads));
  const dim3 key_grid(Tiles(dims.seq, kTileA), static_cast<unsigned>(dims.batch * dims.kv_heads));
  const bool tensor_cores = AttentionOnTensorCores(type, dims, {d_o, q, k, v, dq, dk, dv});
  return DispatchFloat(type, [&](auto tag) {
    using T = decltype(tag);
    const T *d_o_t = static_cast<const T*>(d_o), *q_t = static_cast<const T*>(q),
            *k_t = static_cast<const T*>(k), *v_t = static_cast<const T*>(v);
    if constexpr (!std::is_same_v<T, float>) {
      if (tensor_cores) {
        const int d = static_cast<int>(dims.head_dim);
        return DispatchTcHeadDim(dims.head_dim, [&](auto max_d) {
          constexpr int kMaxD = decltype(max_d)::value;
          if (cudaError_t e = LaunchTcKernel(AttentionForwardTcKernel<T, kMaxD, true>, query_grid,
                                             TcForwardLayout(d).bytes, stream, q_t, k_t, v_t,
                                             static_cast<T*>(nullptr), d_o_t, lse, delta, params);
              e != cudaSuccess) {
            return e;
          }
          if (cudaError_t e =
                  LaunchTcKernel(AttentionDqTcKernel<T, kMaxD>, query_grid, TcDqLayout(d).bytes,
                                 stream, d_o_t, q_t, k_t, v_t, static_cast<const float*>(lse),
                                 static_cast<const float*>(delta), static_cast<T*>(dq), params);
              e != cudaSuccess) {
            return e;
          }
          return LaunchTcKernel(AttentionDkDvTcKernel<T, kMaxD>, key_grid, TcDkDvLayout(d).bytes,
                                stream, d_o_t, q_t, k_t, v_t, static_cast<const float*>(lse),
                                static_cast<const float*>(delta), static_cast<T*>(dk),
                                static_cast<T*>(dv), params);
        });
      }
    }
    return DispatchHeadDim(dims.head_dim, [&](auto max_d) {
      constexpr int kMaxD = decltype(max_d)::value;
      if (cudaError_t e = LaunchAttentionKernel(
              AttentionForwardKernel<T, kMaxD, true>, query_grid, ForwardSmemFloats(dims.head_dim),
              stream, q_t, k_t, v_t, static_cast<T*>(nullptr), d_o_t, lse, delta, params);
          e != cudaSuccess) {
        return e;
      }
      if (cudaError_t e = LaunchAttentionKernel(
              AttentionDqKernel<T, kMaxD>, query_grid, DqSmemFloats(dims.head_dim), stream, d_o_t,
              q_t, k_t, v_t, static_cast<const float*>(lse), static_cast<const float*>(delta),
              static_cast<T*>(dq), params);
          e != cudaSuccess) {
        return e;
      }
      return LaunchAttentionKernel(AttentionDkDvKernel<T, kMaxD>, key_grid,
                                   DkDvSmemFloats(dims.head_dim), stream, d_o_t, q_t, k_t, v_t,
                                   static_cast<const float*>(lse), static_cast<const float*>(delta),
                                   static_cast<T*>(dk), static_cast<T*>(dv), params);
    });
  });
}

}  // namespace dc::cuda_kernels
