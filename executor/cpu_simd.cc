#include "executor/cpu_simd.h"

#include <bit>
#include <cmath>
#include <limits>

#if defined(__x86_64__)
#include <immintrin.h>
#define DC_SIMD_X86_64 1
#endif

namespace dc::simd {
namespace {

// Cephes' expf constants: ln 2 split in two so that n * kLn2High is exact for |n| <= 127.
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2High = 0.693359375f;
constexpr float kLn2Low = -2.12194440e-4f;
constexpr float kExpP0 = 1.9875691500e-4f;
constexpr float kExpP1 = 1.3981999507e-3f;
constexpr float kExpP2 = 8.3334519073e-3f;
constexpr float kExpP3 = 4.1665795894e-2f;
constexpr float kExpP4 = 1.6666665459e-1f;
constexpr float kExpP5 = 5.0000001201e-1f;
// Adding then subtracting 1.5 * 2^23 rounds an fp32 of magnitude < 2^22 to the nearest integer
// (ties to even), the same rounding as the vector path's _mm256_round_ps.
constexpr float kRoundMagic = 12582912.0f;
constexpr int kExponentBias = 127;
constexpr int kMantissaBits = 23;
constexpr float kInf = std::numeric_limits<float>::infinity();
// Lanes of the vector build; the baseline build keeps as many partial sums, in the same order.
constexpr int64_t kLanes = 8;

// ---------------------------------------------------------------------------------------------
// The baseline build: scalar code over kLanes partial sums.

float ExpScalar(float x) {
  if (!(x >= kExpMinArg)) return x != x ? x : 0.0f;  // NaN stays NaN; -inf and tiny give 0
  if (x > kExpMaxArg) return kInf;
  const float n = (x * kLog2e + kRoundMagic) - kRoundMagic;
  const float r = (x - n * kLn2High) - n * kLn2Low;
  float y = kExpP0;
  y = y * r + kExpP1;
  y = y * r + kExpP2;
  y = y * r + kExpP3;
  y = y * r + kExpP4;
  y = y * r + kExpP5;
  y = y * (r * r) + r + 1.0f;
  const int exponent = static_cast<int>(n) + kExponentBias;
  return y * std::bit_cast<float>(static_cast<uint32_t>(exponent) << kMantissaBits);
}

float SigmoidScalar(float g) { return 1.0f / (1.0f + ExpScalar(-g)); }

// Sums the partial sums in a fixed order: ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)).
float ReduceLanes(const float* a) {
  return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

void BaseExp(const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = ExpScalar(x[i]);
}

float BaseMax(const float* x, int64_t n) {
  float m = x[0];
  for (int64_t i = 1; i < n; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

float BaseSumExp(const float* x, int64_t n, float shift) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) acc[j] += ExpScalar(x[i + j] - shift);
  }
  float sum = ReduceLanes(acc);
  for (; i < n; ++i) sum += ExpScalar(x[i] - shift);
  return sum;
}

float BaseExpSum(const float* x, float* y, int64_t n, float shift) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) acc[j] += y[i + j] = ExpScalar(x[i + j] - shift);
  }
  float sum = ReduceLanes(acc);
  for (; i < n; ++i) sum += y[i] = ExpScalar(x[i] - shift);
  return sum;
}

void BaseScale(float* y, int64_t n, float a) {
  for (int64_t i = 0; i < n; ++i) y[i] *= a;
}

float BaseSumSquares(const float* x, int64_t n) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) acc[j] += x[i + j] * x[i + j];
  }
  float sum = ReduceLanes(acc);
  for (; i < n; ++i) sum += x[i] * x[i];
  return sum;
}

float BaseDot(const float* a, const float* b, int64_t n) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) acc[j] += a[i + j] * b[i + j];
  }
  float sum = ReduceLanes(acc);
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

float BaseDot3(const float* a, const float* b, const float* c, int64_t n) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) acc[j] += a[i + j] * b[i + j] * c[i + j];
  }
  float sum = ReduceLanes(acc);
  for (; i < n; ++i) sum += a[i] * b[i] * c[i];
  return sum;
}

void BaseAdd(const float* a, const float* b, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = a[i] + b[i];
}

void BaseRmsNormRow(const float* x, const float* w, float r, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * r * w[i];
}

void BaseRmsNormBackwardRow(const float* dy, const float* x, const float* w, float r, float coef,
                            float* dx, float* dw, bool accumulate, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    dx[i] = r * dy[i] * w[i] - x[i] * coef;
    const float d = dy[i] * x[i] * r;
    dw[i] = accumulate ? dw[i] + d : d;
  }
}

void BaseRopeRow(const float* x1, const float* x2, const float* c, const float* s, float* y1,
                 float* y2, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float a = x1[i], b = x2[i];
    y1[i] = a * c[i] - b * s[i];
    y2[i] = a * s[i] + b * c[i];
  }
}

void BaseSwiglu(const float* g, const float* u, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = g[i] * SigmoidScalar(g[i]) * u[i];
}

// silu'(g) = s (1 + g (1 - s)) with s = sigmoid(g).
void BaseSwigluBackward(const float* dy, const float* g, const float* u, float* dg, float* du,
                        int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i], s = SigmoidScalar(gi);
    dg[i] = dy[i] * u[i] * s * (1.0f + gi * (1.0f - s));
    du[i] = dy[i] * gi * s;
  }
}

void BaseSoftmaxBackwardRow(const float* p, float* ds, int64_t n) {
  const float dot = BaseDot(p, ds, n);
  for (int64_t i = 0; i < n; ++i) ds[i] = p[i] * (ds[i] - dot);
}

// With std::fma exactly where the AVX2 build fuses (and the cuda backend's AdamWKernel), so every
// build computes the same bits.
void BaseAdamW(float* p, const float* g, float* m, float* v, int64_t n, const AdamCoefficients& c) {
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i] * c.grad_scale;
    const float mi = std::fma(c.beta1, m[i], c.one_minus_beta1 * gi);
    const float vi = std::fma(c.beta2, v[i], c.one_minus_beta2 * (gi * gi));
    m[i] = mi;
    v[i] = vi;
    const float update = (mi * c.m_correction) / (std::sqrt(vi * c.v_correction) + c.eps);
    p[i] = std::fma(p[i], c.decay, -(c.lr * update));
  }
}

constexpr Kernels kBaseline = {
    "baseline",
    BaseExp,
    BaseMax,
    BaseSumExp,
    BaseExpSum,
    BaseScale,
    BaseSumSquares,
    BaseDot,
    BaseDot3,
    BaseAdd,
    BaseRmsNormRow,
    BaseRmsNormBackwardRow,
    BaseRopeRow,
    BaseSwiglu,
    BaseSwigluBackward,
    BaseSoftmaxBackwardRow,
    BaseAdamW,
};

// ---------------------------------------------------------------------------------------------
// The AVX2+FMA build: the same algorithms, 8 lanes; tails go to the scalar code. Every function
// carries the target attribute, so only this code uses the instructions and only after
// Avx2Kernels() has checked the CPU.

#if DC_SIMD_X86_64
#define DC_AVX2 __attribute__((target("avx2,fma")))

DC_AVX2 inline __m256 Exp8(__m256 x) {
  const __m256 too_small = _mm256_cmp_ps(x, _mm256_set1_ps(kExpMinArg), _CMP_LT_OQ);
  const __m256 too_large = _mm256_cmp_ps(x, _mm256_set1_ps(kExpMaxArg), _CMP_GT_OQ);
  const __m256 is_nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  // Clamped so the exponent arithmetic stays in range; the masks restore the true results.
  const __m256 xc =
      _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(kExpMinArg)), _mm256_set1_ps(kExpMaxArg));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2High), xc);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Low), r);
  __m256 y = _mm256_set1_ps(kExpP0);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kExpP1));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kExpP2));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kExpP3));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kExpP4));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kExpP5));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
  const __m256i exponent = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(kExponentBias)), kMantissaBits);
  y = _mm256_mul_ps(y, _mm256_castsi256_ps(exponent));
  y = _mm256_andnot_ps(too_small, y);
  y = _mm256_blendv_ps(y, _mm256_set1_ps(kInf), too_large);
  return _mm256_blendv_ps(y, x, is_nan);
}

DC_AVX2 inline float Reduce8(__m256 v) {
  alignas(32) float a[kLanes];
  _mm256_store_ps(a, v);
  return ReduceLanes(a);
}

DC_AVX2 inline __m256 Sigmoid8(__m256 g) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 e = Exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
  return _mm256_div_ps(one, _mm256_add_ps(one, e));
}

DC_AVX2 void Avx2Exp(const float* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) _mm256_storeu_ps(y + i, Exp8(_mm256_loadu_ps(x + i)));
  for (; i < n; ++i) y[i] = ExpScalar(x[i]);
}

DC_AVX2 float Avx2Max(const float* x, int64_t n) {
  if (n < kLanes) return BaseMax(x, n);
  __m256 m = _mm256_loadu_ps(x);
  int64_t i = kLanes;
  for (; i + kLanes <= n; i += kLanes) m = _mm256_max_ps(m, _mm256_loadu_ps(x + i));
  alignas(32) float a[kLanes];
  _mm256_store_ps(a, m);
  float best = a[0];
  for (int64_t j = 1; j < kLanes; ++j) best = a[j] > best ? a[j] : best;
  for (; i < n; ++i) best = x[i] > best ? x[i] : best;
  return best;
}

DC_AVX2 float Avx2SumExp(const float* x, int64_t n, float shift) {
  const __m256 s = _mm256_set1_ps(shift);
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    acc = _mm256_add_ps(acc, Exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), s)));
  }
  float sum = Reduce8(acc);
  for (; i < n; ++i) sum += ExpScalar(x[i] - shift);
  return sum;
}

DC_AVX2 float Avx2ExpSum(const float* x, float* y, int64_t n, float shift) {
  const __m256 s = _mm256_set1_ps(shift);
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const __m256 e = Exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), s));
    _mm256_storeu_ps(y + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  float sum = Reduce8(acc);
  for (; i < n; ++i) sum += y[i] = ExpScalar(x[i] - shift);
  return sum;
}

DC_AVX2 void Avx2Scale(float* y, int64_t n, float a) {
  const __m256 va = _mm256_set1_ps(a);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_loadu_ps(y + i), va));
  }
  for (; i < n; ++i) y[i] *= a;
}

DC_AVX2 float Avx2SumSquares(const float* x, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const __m256 v = _mm256_loadu_ps(x + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  float sum = Reduce8(acc);
  for (; i < n; ++i) sum += x[i] * x[i];
  return sum;
}

DC_AVX2 float Avx2Dot(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  }
  float sum = Reduce8(acc);
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

DC_AVX2 float Avx2Dot3(const float* a, const float* b, const float* c, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const __m256 ab = _mm256_mul_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i));
    acc = _mm256_fmadd_ps(ab, _mm256_loadu_ps(c + i), acc);
  }
  float sum = Reduce8(acc);
  for (; i < n; ++i) sum += a[i] * b[i] * c[i];
  return sum;
}

DC_AVX2 void Avx2Add(const float* a, const float* b, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    _mm256_storeu_ps(y + i, _mm256_add_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
  }
  for (; i < n; ++i) y[i] = a[i] + b[i];
}

DC_AVX2 void Avx2RmsNormRow(const float* x, const float* w, float r, float* y, int64_t n) {
  const __m256 vr = _mm256_set1_ps(r);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const __m256 xr = _mm256_mul_ps(_mm256_loadu_ps(x + i), vr);
    _mm256_storeu_ps(y + i, _mm256_mul_ps(xr, _mm256_loadu_ps(w + i)));
  }
  for (; i < n; ++i) y[i] = x[i] * r * w[i];
}

DC_AVX2 void Avx2RmsNormBackwardRow(const float* dy, const float* x, const float* w, float r,
                                    float coef, float* dx, float* dw, bool accumulate, int64_t n) {
  const __m256 vr = _mm256_set1_ps(r), vc = _mm256_set1_ps(coef);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const __m256 vdy = _mm256_loadu_ps(dy + i), vx = _mm256_loadu_ps(x + i);
    const __m256 g = _mm256_mul_ps(_mm256_mul_ps(vr, vdy), _mm256_loadu_ps(w + i));
    _mm256_storeu_ps(dx + i, _mm256_fnmadd_ps(vx, vc, g));
    const __m256 d = _mm256_mul_ps(_mm256_mul_ps(vdy, vx), vr);
    _mm256_storeu_ps(dw + i, accumulate ? _mm256_add_ps(_mm256_loadu_ps(dw + i), d) : d);
  }
  BaseRmsNormBackwardRow(dy + i, x + i, w + i, r, coef, dx + i, dw + i, accumulate, n - i);
}

DC_AVX2 void Avx2RopeRow(const float* x1, const float* x2, const float* c, const float* s,
                         float* y1, float* y2, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const __m256 a = _mm256_loadu_ps(x1 + i), b = _mm256_loadu_ps(x2 + i);
    const __m256 vc = _mm256_loadu_ps(c + i), vs = _mm256_loadu_ps(s + i);
    _mm256_storeu_ps(y1 + i, _mm256_fmsub_ps(a, vc, _mm256_mul_ps(b, vs)));
    _mm256_storeu_ps(y2 + i, _mm256_fmadd_ps(a, vs, _mm256_mul_ps(b, vc)));
  }
  BaseRopeRow(x1 + i, x2 + i, c + i, s + i, y1 + i, y2 + i, n - i);
}

DC_AVX2 void Avx2Swiglu(const float* g, const float* u, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const __m256 vg = _mm256_loadu_ps(g + i);
    const __m256 silu = _mm256_mul_ps(vg, Sigmoid8(vg));
    _mm256_storeu_ps(y + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
  }
  BaseSwiglu(g + i, u + i, y + i, n - i);
}

DC_AVX2 void Avx2SwigluBackward(const float* dy, const float* g, const float* u, float* dg,
                                float* du, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const __m256 vg = _mm256_loadu_ps(g + i), vdy = _mm256_loadu_ps(dy + i);
    const __m256 s = Sigmoid8(vg);
    // dg = dy u s (1 + g (1 - s)); du = dy g s.
    const __m256 slope = _mm256_fmadd_ps(vg, _mm256_sub_ps(one, s), one);
    const __m256 dys = _mm256_mul_ps(vdy, s);
    _mm256_storeu_ps(dg + i, _mm256_mul_ps(_mm256_mul_ps(dys, _mm256_loadu_ps(u + i)), slope));
    _mm256_storeu_ps(du + i, _mm256_mul_ps(dys, vg));
  }
  BaseSwigluBackward(dy + i, g + i, u + i, dg + i, du + i, n - i);
}

DC_AVX2 void Avx2SoftmaxBackwardRow(const float* p, float* ds, int64_t n) {
  const float dot = Avx2Dot(p, ds, n);
  const __m256 vdot = _mm256_set1_ps(dot);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const __m256 d = _mm256_sub_ps(_mm256_loadu_ps(ds + i), vdot);
    _mm256_storeu_ps(ds + i, _mm256_mul_ps(_mm256_loadu_ps(p + i), d));
  }
  for (; i < n; ++i) ds[i] = p[i] * (ds[i] - dot);
}

// Lanes [0, count) set, for a tail of fewer than kLanes elements.
DC_AVX2 inline __m256i TailMask(int64_t count) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count)), lane);
}

// AdamCoefficients broadcast to every lane.
struct AdamVectors {
  __m256 b1, b2, ob1, ob2, mc, vc, eps, lr, decay, grad_scale;
};
// One vector of AdamW, the same arithmetic for full vectors and the tail: m, v and p updated
// from g, m, v and p.
DC_AVX2 inline void AdamStep(const AdamVectors& c, __m256 g, __m256 m, __m256 v, __m256 p,
                             __m256* m_out, __m256* v_out, __m256* p_out) {
  const __m256 gi = _mm256_mul_ps(g, c.grad_scale);
  const __m256 mi = _mm256_fmadd_ps(c.b1, m, _mm256_mul_ps(c.ob1, gi));
  const __m256 vi = _mm256_fmadd_ps(c.b2, v, _mm256_mul_ps(c.ob2, _mm256_mul_ps(gi, gi)));
  const __m256 denom = _mm256_add_ps(_mm256_sqrt_ps(_mm256_mul_ps(vi, c.vc)), c.eps);
  const __m256 update = _mm256_div_ps(_mm256_mul_ps(mi, c.mc), denom);
  *m_out = mi;
  *v_out = vi;
  *p_out = _mm256_fmsub_ps(p, c.decay, _mm256_mul_ps(c.lr, update));
}

// The tail goes through the same vector arithmetic (masked loads and stores): an element's
// update does not depend on where the shard starts, so every world size computes the same bits.
// Full vectors use plain loads and stores: AMD's masked stores are microcoded (on this VM's EPYC
// perf put 10% of a 512-wide cpu step's samples in the all-masked loop, 1.4% in this one; the
// step's cycles fell about 2%).
DC_AVX2 void Avx2AdamW(float* p, const float* g, float* m, float* v, int64_t n,
                       const AdamCoefficients& c) {
  const AdamVectors k = {_mm256_set1_ps(c.beta1),
                         _mm256_set1_ps(c.beta2),
                         _mm256_set1_ps(c.one_minus_beta1),
                         _mm256_set1_ps(c.one_minus_beta2),
                         _mm256_set1_ps(c.m_correction),
                         _mm256_set1_ps(c.v_correction),
                         _mm256_set1_ps(c.eps),
                         _mm256_set1_ps(c.lr),
                         _mm256_set1_ps(c.decay),
                         _mm256_set1_ps(c.grad_scale)};
  __m256 mi, vi, pi;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    AdamStep(k, _mm256_loadu_ps(g + i), _mm256_loadu_ps(m + i), _mm256_loadu_ps(v + i),
             _mm256_loadu_ps(p + i), &mi, &vi, &pi);
    _mm256_storeu_ps(m + i, mi);
    _mm256_storeu_ps(v + i, vi);
    _mm256_storeu_ps(p + i, pi);
  }
  if (i < n) {
    const __m256i mask = TailMask(n - i);
    AdamStep(k, _mm256_maskload_ps(g + i, mask), _mm256_maskload_ps(m + i, mask),
             _mm256_maskload_ps(v + i, mask), _mm256_maskload_ps(p + i, mask), &mi, &vi, &pi);
    _mm256_maskstore_ps(m + i, mask, mi);
    _mm256_maskstore_ps(v + i, mask, vi);
    _mm256_maskstore_ps(p + i, mask, pi);
  }
}

constexpr Kernels kAvx2 = {
    "avx2+fma",
    Avx2Exp,
    Avx2Max,
    Avx2SumExp,
    Avx2ExpSum,
    Avx2Scale,
    Avx2SumSquares,
    Avx2Dot,
    Avx2Dot3,
    Avx2Add,
    Avx2RmsNormRow,
    Avx2RmsNormBackwardRow,
    Avx2RopeRow,
    Avx2Swiglu,
    Avx2SwigluBackward,
    Avx2SoftmaxBackwardRow,
    Avx2AdamW,
};

bool CpuHasAvx2Fma() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
#endif  // DC_SIMD_X86_64

}  // namespace

float Exp(float x) { return ExpScalar(x); }

const Kernels& BaselineKernels() { return kBaseline; }

const Kernels* Avx2Kernels() {
#if DC_SIMD_X86_64
  static const bool supported = CpuHasAvx2Fma();
  return supported ? &kAvx2 : nullptr;
#else
  return nullptr;
#endif
}

const Kernels& SimdKernels() {
  static const Kernels& chosen = Avx2Kernels() ? *Avx2Kernels() : kBaseline;
  return chosen;
}

}  // namespace dc::simd
