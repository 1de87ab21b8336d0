// Causal grouped-query attention on the tensor cores, for 16-bit types (__nv_bfloat16, __half)
// and head_dim a multiple of 16 up to 128: the scheme of attention.cuh (online softmax in fp32,
// a backward that recomputes the softmax from lse and delta = rowsum(dO * O)), with every
// product of two tiles a warp's 16 x 16 x 16 tensor-core product (kernel_compat.cuh's Mma*)
// into fp32 accumulators. Probabilities and dS are rounded to the operand type before their
// products, as flash attention does; sums and softmax statistics stay fp32. Included by
// attention.cuh, which chooses these kernels where they apply (TensorCoreAttentionApplies).
//
// A block is 4 warps and owns 64 rows (queries; keys in the dK/dV kernel), 16 per warp; the
// other side streams through shared memory in tiles of 64. Scores land in shared memory, where
// each row's softmax is two lanes' work (a half row each). Output accumulators stay in
// registers; the forward's are rescaled (through shared memory, where each lane owns a part of
// its row) only in tiles where some row's running max grew. No atomics: every output element
// is written once.
#pragma once

#include "executor/cuda/kernel_common.cuh"

namespace dc::cuda_kernels {

inline constexpr int kTcThreads = 128;
inline constexpr int kTcRows = 64;  // the block's rows, 16 per warp
inline constexpr int kTcCols = 64;  // the streamed side's tile
inline constexpr int kTcMaxHeadDim = 128;
// Leading dimensions in shared memory (elements), padded against bank conflicts; each keeps a
// 16-row tile's start 32-byte aligned and is a multiple of 8 (16-bit) or 4 (fp32) as the
// tensor-core loads need.
inline constexpr int kTcScoreLd = kTcCols + 4;  // fp32 scores
inline constexpr int kTcProbLd = kTcCols + 8;   // 16-bit probabilities / dS

// Byte offsets of one kernel's shared-memory regions, each 128-byte aligned: `tiles` 16-bit
// tiles of kTcRows x head_dim, `scores` fp32 score tiles, `probs` 16-bit probability tiles and,
// with `stats`, 2 * kTcCols fp32 statistics (the dK/dV kernel's lse and delta of a query tile).
struct TcSmemLayout {
  int64_t tile[4] = {0, 0, 0, 0};
  int64_t score[2] = {0, 0};
  int64_t prob[2] = {0, 0};
  int64_t stats = 0;
  int64_t bytes = 0;
};

DC_HOST_DEVICE int TcTileLd(int head_dim) { return head_dim + 8; }

// Takes `bytes` at *at (rounded up to 128) and returns where they start.
DC_HOST_DEVICE int64_t TakeTcSmem(int64_t* at, int64_t bytes) {
  const int64_t start = *at;
  *at += (bytes + 127) / 128 * 128;
  return start;
}

DC_HOST_DEVICE TcSmemLayout MakeTcSmemLayout(int head_dim, int tiles, int scores, int probs,
                                             bool stats) {
  TcSmemLayout layout;
  int64_t at = 0;
  for (int i = 0; i < tiles; ++i) {
    layout.tile[i] = TakeTcSmem(&at, int64_t{kTcRows} * TcTileLd(head_dim) * 2);
  }
  for (int i = 0; i < scores; ++i)
    layout.score[i] = TakeTcSmem(&at, int64_t{kTcRows} * kTcScoreLd * 4);
  for (int i = 0; i < probs; ++i)
    layout.prob[i] = TakeTcSmem(&at, int64_t{kTcRows} * kTcProbLd * 2);
  if (stats) layout.stats = TakeTcSmem(&at, int64_t{2} * kTcCols * 4);
  layout.bytes = at;
  return layout;
}
DC_HOST_DEVICE TcSmemLayout TcForwardLayout(int head_dim) {
  return MakeTcSmemLayout(head_dim, 3, 1, 1, false);
}
DC_HOST_DEVICE TcSmemLayout TcDqLayout(int head_dim) {
  return MakeTcSmemLayout(head_dim, 4, 2, 1, false);
}
DC_HOST_DEVICE TcSmemLayout TcDkDvLayout(int head_dim) {
  return MakeTcSmemLayout(head_dim, 4, 2, 2, true);
}

template <typename T>
DC_DEVICE T* SmemAt(unsigned char* smem, int64_t offset) {
  return reinterpret_cast<T*>(smem + offset);
}

// Rows row0 .. row0 + kTcRows - 1 of one head into a shared tile (leading dimension `ld`), 16
// bytes per copy (rows 16-byte aligned: checked at launch); rows at or past `seq` are zero.
template <typename T>
DC_DEVICE void LoadTcTile(T* dst, int ld, const T* head, int64_t row_stride, int64_t row0,
                          int64_t seq, int head_dim) {
  const int chunks = head_dim / 8;
  const uint4 zero = {0, 0, 0, 0};
  for (int e = static_cast<int>(threadIdx.x); e < kTcRows * chunks;
       e += static_cast<int>(blockDim.x)) {
    const int r = e / chunks, c = (e % chunks) * 8;
    const int64_t row = row0 + r;
    if (row < seq) {
      Copy16(dst + r * ld + c, head + row * row_stride + c);
    } else {
      Copy16(dst + r * ld + c, &zero);
    }
  }
}

// The warp's 16 x 64 product a * b^T into `out` (fp32, leading dimension kTcScoreLd): `a` is the
// warp's 16 rows of a tile, `b` the 64 rows of another, both kTcRows x head_dim with
// leading dimension `ld`.
template <typename T>
DC_DEVICE void WarpScores(const T* a, const T* b, int ld, int head_dim, float* out) {
  MmaAcc acc[kTcCols / 16];
  DC_UNROLL
  for (int n = 0; n < kTcCols / 16; ++n) MmaZero(acc[n]);
  for (int kk = 0; kk < head_dim / 16; ++kk) {
    MmaA<T> fa;
    MmaLoad(fa, a + kk * 16, ld);
    DC_UNROLL
    for (int n = 0; n < kTcCols / 16; ++n) {
      MmaBCol<T> fb;
      MmaLoad(fb, b + n * 16 * ld + kk * 16, ld);
      Mma(acc[n], fa, fb);
    }
  }
  DC_UNROLL
  for (int n = 0; n < kTcCols / 16; ++n) MmaStoreAcc(out + n * 16, acc[n], kTcScoreLd);
}

// acc[j] += p * b[:, 16 j .. 16 j + 15] for the warp's 16 x 64 tile `p` (leading dimension
// kTcProbLd) and a 64 x head_dim tile `b` (leading dimension `ld`).
template <typename T, int kMaxD>
DC_DEVICE void WarpAccumulate(const T* p, const T* b, int ld, int head_dim,
                              MmaAcc (&acc)[kMaxD / 16]) {
  DC_UNROLL
  for (int kk = 0; kk < kTcCols / 16; ++kk) {
    MmaA<T> fa;
    MmaLoad(fa, p + kk * 16, kTcProbLd);
    DC_UNROLL
    for (int j = 0; j < kMaxD / 16; ++j) {
      if (j < head_dim / 16) {
        MmaBRow<T> fb;
        MmaLoad(fb, b + kk * 16 * ld + j * 16, ld);
        Mma(acc[j], fa, fb);
      }
    }
  }
}

// The accumulators' blocks one at a time through `staging` (the warp's 16 rows of an fp32 score
// tile), where lane L owns columns 8 (L % 2) .. 8 (L % 2) + 7 of row L / 2: calls
// fn(j, staged row, c) with the lane's 8 values at staged row[c .. c + 7].
template <int kMaxD, typename Fn>
DC_DEVICE void ForEachStagedBlock(MmaAcc (&acc)[kMaxD / 16], int head_dim, float* staging,
                                  bool write_back, Fn&& fn) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  DC_UNROLL
  for (int j = 0; j < kMaxD / 16; ++j) {
    if (j < head_dim / 16) {
      SyncWarp();  // the previous block's readers are done
      MmaStoreAcc(staging, acc[j], kTcScoreLd);
      SyncWarp();
      fn(j, staging + (lane / 2) * kTcScoreLd, (lane % 2) * 8);
      if (write_back) {
        SyncWarp();
        MmaLoadAcc(acc[j], staging, kTcScoreLd);
      }
    }
  }
}

// Multiplies the accumulators' row L / 2 by lane L's `row_scale`.
template <int kMaxD>
DC_DEVICE void WarpScaleRows(MmaAcc (&acc)[kMaxD / 16], float row_scale, int head_dim,
                             float* staging) {
  ForEachStagedBlock<kMaxD>(acc, head_dim, staging, true, [&](int, float* row, int c) {
    DC_UNROLL
    for (int i = 0; i < 8; ++i) row[c + i] *= row_scale;
  });
}

// Writes acc * row_scale (lane L's value for row L / 2), the warp's 16 rows (rows
// row0 + r0 + i < seq) of one head.
template <typename T, int kMaxD>
DC_DEVICE void WarpStoreAcc(MmaAcc (&acc)[kMaxD / 16], float row_scale, float* staging, T* head,
                            int64_t row_stride, int64_t row0, int r0, int64_t seq, int head_dim) {
  const int64_t row = row0 + r0 + static_cast<int>(threadIdx.x % 32) / 2;
  ForEachStagedBlock<kMaxD>(acc, head_dim, staging, false, [&](int j, float* staged, int c) {
    if (row >= seq) return;
    alignas(16) T out[8];
    DC_UNROLL
    for (int i = 0; i < 8; ++i) out[i] = FromF32<T>(staged[c + i] * row_scale);
    Copy16(head + row * row_stride + j * 16 + c, out);
  });
}

// sum_d acc[row][d] * row_scale * other[d] for row L / 2 of the warp (`other`: that row of
// another tensor, or null for none); both lanes of the row get it.
template <typename T, int kMaxD>
DC_DEVICE float WarpRowDot(MmaAcc (&acc)[kMaxD / 16], float row_scale, const T* other, int head_dim,
                           float* staging) {
  float dot = 0.0f;
  ForEachStagedBlock<kMaxD>(acc, head_dim, staging, false, [&](int j, float* staged, int c) {
    if (other == nullptr) return;
    DC_UNROLL
    for (int i = 0; i < 8; ++i) dot += ToF32(other[j * 16 + c + i]) * (staged[c + i] * row_scale);
  });
  return dot + ShflXor(dot, 1);  // every lane takes part
}

// kStats = false: writes o. kStats = true: writes lse and delta (needs d_o) for the backward.
template <typename T, int kMaxD, bool kStats>
DC_GLOBAL void DC_LAUNCH_BOUNDS(kTcThreads)
    AttentionForwardTcKernel(const T* q, const T* k, const T* v, T* o, const T* d_o, float* lse,
                             float* delta, AttnParams p) {
  DC_DYNAMIC_SMEM_BYTES(smem);
  const int head_dim = static_cast<int>(p.head_dim), ld = TcTileLd(head_dim);
  const TcSmemLayout layout = TcForwardLayout(head_dim);
  T* qs = SmemAt<T>(smem, layout.tile[0]);
  T* ks = SmemAt<T>(smem, layout.tile[1]);
  T* vs = SmemAt<T>(smem, layout.tile[2]);
  float* ss = SmemAt<float>(smem, layout.score[0]);
  T* ps = SmemAt<T>(smem, layout.prob[0]);
  const int warp = static_cast<int>(threadIdx.x / 32), lane = static_cast<int>(threadIdx.x % 32);
  const int r0 = warp * 16;                        // the warp's rows
  const int row = r0 + lane / 2, half = lane % 2;  // the half row this lane keeps
  float* staging = ss + r0 * kTcScoreLd;           // the warp's rows of the score tile
  const int64_t q0 = static_cast<int64_t>(blockIdx.x) * kTcRows, qi = q0 + row;
  const int64_t bh = blockIdx.y;
  const auto [q_stride, kv_stride, q_offset, kv_offset] = QueryHead(p, bh);
  LoadTcTile(qs, ld, q + q_offset, q_stride, q0, p.seq, head_dim);
  MmaAcc acc[kMaxD / 16];
  DC_UNROLL
  for (int j = 0; j < kMaxD / 16; ++j) MmaZero(acc[j]);

  float m = -INFINITY, l = 0.0f;
  // Key tile 0 holds key 0, which every row sees, so after it every row max is finite.
  const int64_t key_end = Min64(p.seq, q0 + kTcRows);
  for (int64_t k0 = 0; k0 < key_end; k0 += kTcCols) {
    SyncThreads();  // the previous tile's readers are done
    LoadTcTile(ks, ld, k + kv_offset, kv_stride, k0, p.seq, head_dim);
    LoadTcTile(vs, ld, v + kv_offset, kv_stride, k0, p.seq, head_dim);
    SyncThreads();
    WarpScores(qs + r0 * ld, ks, ld, head_dim, staging);
    SyncWarp();
    float* s_row = ss + row * kTcScoreLd + half * 32;
    float tile_max = -INFINITY;
    for (int c = 0; c < 32; ++c) {
      const int64_t kj = k0 + half * 32 + c;
      const float s = kj <= qi && kj < p.seq ? s_row[c] * p.scale : -INFINITY;
      s_row[c] = s;
      tile_max = fmaxf(tile_max, s);
    }
    const float m_new = fmaxf(m, fmaxf(tile_max, ShflXor(tile_max, 1)));
    const float alpha = expf(m - m_new);
    T* p_row = ps + row * kTcProbLd + half * 32;
    float tile_sum = 0.0f;
    for (int c = 0; c < 32; ++c) {
      const float e = expf(s_row[c] - m_new);
      tile_sum += e;
      p_row[c] = FromF32<T>(e);
    }
    l = l * alpha + tile_sum + ShflXor(tile_sum, 1);
    // The accumulators are zero until the first tile, and unchanged by a max that stayed.
    const bool grew = m != -INFINITY && alpha != 1.0f;
    m = m_new;
    if (WarpMax(grew ? 1.0f : 0.0f) > 0.0f) WarpScaleRows<kMaxD>(acc, alpha, head_dim, staging);
    SyncWarp();
    WarpAccumulate<T, kMaxD>(ps + r0 * kTcProbLd, vs, ld, head_dim, acc);
  }

  const float inv_l = 1.0f / l;
  if constexpr (!kStats) {
    WarpStoreAcc<T, kMaxD>(acc, inv_l, staging, o + q_offset, q_stride, q0, r0, p.seq, head_dim);
  } else {
    const T* grad = qi < p.seq ? d_o + q_offset + qi * q_stride : nullptr;
    const float dot = WarpRowDot<T, kMaxD>(acc, inv_l, grad, head_dim, staging);
    if (half == 0 && qi < p.seq) {
      lse[bh * p.seq + qi] = m + logf(l);
      delta[bh * p.seq + qi] = dot;
    }
  }
}

template <typename T, int kMaxD>
DC_GLOBAL void DC_LAUNCH_BOUNDS(kTcThreads)
    AttentionDqTcKernel(const T* d_o, const T* q, const T* k, const T* v, const float* lse,
                        const float* delta, T* dq, AttnParams p) {
  DC_DYNAMIC_SMEM_BYTES(smem);
  const int head_dim = static_cast<int>(p.head_dim), ld = TcTileLd(head_dim);
  const TcSmemLayout layout = TcDqLayout(head_dim);
  T* qs = SmemAt<T>(smem, layout.tile[0]);
  T* dos = SmemAt<T>(smem, layout.tile[1]);
  T* ks = SmemAt<T>(smem, layout.tile[2]);
  T* vs = SmemAt<T>(smem, layout.tile[3]);
  float* ss = SmemAt<float>(smem, layout.score[0]);
  float* dps = SmemAt<float>(smem, layout.score[1]);
  T* dss = SmemAt<T>(smem, layout.prob[0]);
  const int warp = static_cast<int>(threadIdx.x / 32), lane = static_cast<int>(threadIdx.x % 32);
  const int r0 = warp * 16, row = r0 + lane / 2, half = lane % 2;
  const int64_t q0 = static_cast<int64_t>(blockIdx.x) * kTcRows, qi = q0 + row;
  const int64_t bh = blockIdx.y;
  const auto [q_stride, kv_stride, q_offset, kv_offset] = QueryHead(p, bh);
  LoadTcTile(qs, ld, q + q_offset, q_stride, q0, p.seq, head_dim);
  LoadTcTile(dos, ld, d_o + q_offset, q_stride, q0, p.seq, head_dim);
  const float row_lse = qi < p.seq ? lse[bh * p.seq + qi] : 0.0f;
  const float row_delta = qi < p.seq ? delta[bh * p.seq + qi] : 0.0f;
  MmaAcc acc[kMaxD / 16];
  DC_UNROLL
  for (int j = 0; j < kMaxD / 16; ++j) MmaZero(acc[j]);
  const int64_t key_end = Min64(p.seq, q0 + kTcRows);
  for (int64_t k0 = 0; k0 < key_end; k0 += kTcCols) {
    SyncThreads();
    LoadTcTile(ks, ld, k + kv_offset, kv_stride, k0, p.seq, head_dim);
    LoadTcTile(vs, ld, v + kv_offset, kv_stride, k0, p.seq, head_dim);
    SyncThreads();
    WarpScores(qs + r0 * ld, ks, ld, head_dim, ss + r0 * kTcScoreLd);
    WarpScores(dos + r0 * ld, vs, ld, head_dim, dps + r0 * kTcScoreLd);
    SyncWarp();
    for (int c = 0; c < 32; ++c) {
      const int col = half * 32 + c;
      const int64_t kj = k0 + col;
      const bool visible = kj <= qi && kj < p.seq && qi < p.seq;
      const float prob = visible ? expf(ss[row * kTcScoreLd + col] * p.scale - row_lse) : 0.0f;
      dss[row * kTcProbLd + col] = FromF32<T>(prob * (dps[row * kTcScoreLd + col] - row_delta));
    }
    SyncWarp();
    WarpAccumulate<T, kMaxD>(dss + r0 * kTcProbLd, ks, ld, head_dim, acc);
  }
  WarpStoreAcc<T, kMaxD>(acc, p.scale, ss + r0 * kTcScoreLd, dq + q_offset, q_stride, q0, r0, p.seq,
                         head_dim);
}

template <typename T, int kMaxD>
DC_GLOBAL void DC_LAUNCH_BOUNDS(kTcThreads)
    AttentionDkDvTcKernel(const T* d_o, const T* q, const T* k, const T* v, const float* lse,
                          const float* delta, T* dk, T* dv, AttnParams p) {
  DC_DYNAMIC_SMEM_BYTES(smem);
  const int head_dim = static_cast<int>(p.head_dim), ld = TcTileLd(head_dim);
  const TcSmemLayout layout = TcDkDvLayout(head_dim);
  T* ks = SmemAt<T>(smem, layout.tile[0]);
  T* vs = SmemAt<T>(smem, layout.tile[1]);
  T* qs = SmemAt<T>(smem, layout.tile[2]);
  T* dos = SmemAt<T>(smem, layout.tile[3]);
  float* sts = SmemAt<float>(smem, layout.score[0]);
  float* dpts = SmemAt<float>(smem, layout.score[1]);
  T* pts = SmemAt<T>(smem, layout.prob[0]);
  T* dsts = SmemAt<T>(smem, layout.prob[1]);
  float* lse_s = SmemAt<float>(smem, layout.stats);
  float* delta_s = lse_s + kTcCols;
  const int warp = static_cast<int>(threadIdx.x / 32), lane = static_cast<int>(threadIdx.x % 32);
  const int r0 = warp * 16, row = r0 + lane / 2, half = lane % 2;
  const int64_t k0 = static_cast<int64_t>(blockIdx.x) * kTcRows, kj = k0 + row;
  const int64_t bg = blockIdx.y, b = bg / p.kv_heads, kv_head = bg % p.kv_heads;
  const int64_t group = p.heads / p.kv_heads;
  const HeadOffsets first = QueryHead(p, b * p.heads + kv_head * group);  // the group's first
  const int64_t q_stride = first.q_stride, kv_stride = first.kv_stride;
  const int64_t kv_offset = first.kv_offset;
  LoadTcTile(ks, ld, k + kv_offset, kv_stride, k0, p.seq, head_dim);
  LoadTcTile(vs, ld, v + kv_offset, kv_stride, k0, p.seq, head_dim);
  MmaAcc dk_acc[kMaxD / 16], dv_acc[kMaxD / 16];
  DC_UNROLL
  for (int j = 0; j < kMaxD / 16; ++j) {
    MmaZero(dk_acc[j]);
    MmaZero(dv_acc[j]);
  }
  for (int64_t i = 0; i < group; ++i) {
    const int64_t h = kv_head * group + i;
    const int64_t bh = b * p.heads + h;
    const int64_t q_offset = QueryHead(p, bh).q_offset;
    // Only queries at or after the tile's first key see it (query and key tiles are both 64).
    for (int64_t q0 = k0; q0 < p.seq; q0 += kTcCols) {
      SyncThreads();
      LoadTcTile(qs, ld, q + q_offset, q_stride, q0, p.seq, head_dim);
      LoadTcTile(dos, ld, d_o + q_offset, q_stride, q0, p.seq, head_dim);
      for (int t = static_cast<int>(threadIdx.x); t < kTcCols; t += static_cast<int>(blockDim.x)) {
        const int64_t qi = q0 + t;
        lse_s[t] = qi < p.seq ? lse[bh * p.seq + qi] : 0.0f;
        delta_s[t] = qi < p.seq ? delta[bh * p.seq + qi] : 0.0f;
      }
      SyncThreads();
      // Rows: the warp's keys; columns: the tile's queries.
      WarpScores(ks + r0 * ld, qs, ld, head_dim, sts + r0 * kTcScoreLd);
      WarpScores(vs + r0 * ld, dos, ld, head_dim, dpts + r0 * kTcScoreLd);
      SyncWarp();
      for (int c = 0; c < 32; ++c) {
        const int col = half * 32 + c;
        const int64_t qi = q0 + col;
        const bool visible = kj <= qi && qi < p.seq && kj < p.seq;
        const float prob =
            visible ? expf(sts[row * kTcScoreLd + col] * p.scale - lse_s[col]) : 0.0f;
        pts[row * kTcProbLd + col] = FromF32<T>(prob);
        dsts[row * kTcProbLd + col] =
            FromF32<T>(prob * (dpts[row * kTcScoreLd + col] - delta_s[col]));
      }
      SyncWarp();
      WarpAccumulate<T, kMaxD>(pts + r0 * kTcProbLd, dos, ld, head_dim, dv_acc);
      WarpAccumulate<T, kMaxD>(dsts + r0 * kTcProbLd, qs, ld, head_dim, dk_acc);
    }
  }
  WarpStoreAcc<T, kMaxD>(dk_acc, p.scale, sts + r0 * kTcScoreLd, dk + kv_offset, kv_stride, k0, r0,
                         p.seq, head_dim);
  WarpStoreAcc<T, kMaxD>(dv_acc, 1.0f, sts + r0 * kTcScoreLd, dv + kv_offset, kv_stride, k0, r0,
                         p.seq, head_dim);
}

}  // namespace dc::cuda_kernels
