// The cpu kernels' element-wise and row-reduction loops, in two builds of the same algorithms:
// a portable one (baseline x86-64 / any target, scalar code the compiler may vectorise for
// SSE2) and an AVX2+FMA one (8 lanes, compiled with a function-level target attribute). The
// binary stays portable: which one runs is chosen once, at first use, from the CPU's features
// (`__builtin_cpu_supports`), and `SimdKernels().name` says which, for the run's log.
//
// Numerics. Reductions accumulate in fp32 over several partial sums (8 or 16 lanes) in a fixed
// order, so results are a pure function of the inputs and of the build chosen; the two builds
// differ only by fp32 rounding (FMA contractions, summation order). Exp is `Exp` below in both.
// Thread-safety: every function is pure; the table is immutable after its first use.
#pragma once

#include <cstdint>

namespace dc::simd {

// exp(x) in fp32 without errno (Cephes' expf: x = n ln2 + r, |r| <= ln2/2, a degree-7
// polynomial for e^r, 2^n by the exponent bits). Error against the exact exp over
// [kExpMinArg, kExpMaxArg]: at most 8.4e-8 relative (1.01 ulp) measured on 2^24 evenly spaced
// points in both builds; cpu_simd_test holds both to kExpMaxRelativeError against std::exp in
// double over 2^21 points. Below kExpMinArg (results under 2^-126, the denormals) it returns 0,
// an absolute error under 1.2e-38; above kExpMaxArg it returns +inf (exp there is at least
// 2.4e38; fp32 overflows at 88.72); -inf gives 0, NaN gives NaN.
inline constexpr float kExpMinArg = -87.33654f;  // ln(2^-126)
inline constexpr float kExpMaxArg = 88.3762f;    // just below ln(2^127.5)
inline constexpr float kExpMaxRelativeError = 1.2e-7f;

// AdamW's per-step constants, all fp32: p = p * decay - lr * (m * m_correction) /
// (sqrt(v * v_correction) + eps), over the grad times grad_scale (the clipping coefficient; 1
// without clipping, which leaves every grad's bits as they are).
struct AdamCoefficients {
  float beta1, beta2, one_minus_beta1, one_minus_beta2;
  float m_correction, v_correction, eps, lr, decay;
  float grad_scale = 1.0f;
};

// One build of the loops. Pointers may alias only where a comment says so; n >= 0 unless
// noted; max_value needs n >= 1.
struct Kernels {
  const char* name;  // "avx2+fma" or "baseline"
  // y[i] = exp(x[i]) (the Exp above); y may be x.
  void (*exp)(const float* x, float* y, int64_t n);
  float (*max_value)(const float* x, int64_t n);
  // sum exp(x[i] - shift).
  float (*sum_exp)(const float* x, int64_t n, float shift);
  // y[i] = exp(x[i] - shift); returns their sum. y may be x.
  float (*exp_sum)(const float* x, float* y, int64_t n, float shift);
  // y[i] *= a.
  void (*scale)(float* y, int64_t n, float a);
  // sum x[i]^2.
  float (*sum_squares)(const float* x, int64_t n);
  // sum a[i] b[i].
  float (*dot)(const float* a, const float* b, int64_t n);
  // sum a[i] b[i] c[i].
  float (*dot3)(const float* a, const float* b, const float* c, int64_t n);
  // y[i] = a[i] + b[i]; y may be a or b.
  void (*add)(const float* a, const float* b, float* y, int64_t n);
  // y[i] = x[i] * r * w[i].
  void (*rms_norm_row)(const float* x, const float* w, float r, float* y, int64_t n);
  // dx[i] = r dy[i] w[i] - x[i] coef; dw[i] = (accumulate ? dw[i] : 0) + dy[i] x[i] r.
  void (*rms_norm_backward_row)(const float* dy, const float* x, const float* w, float r,
                                float coef, float* dx, float* dw, bool accumulate, int64_t n);
  // The rotation of one head's halves: y1 = x1 c - x2 s; y2 = x1 s + x2 c (y may be x).
  void (*rope_row)(const float* x1, const float* x2, const float* c, const float* s, float* y1,
                   float* y2, int64_t n);
  // y = silu(g) u.
  void (*swiglu)(const float* g, const float* u, float* y, int64_t n);
  // dg = dy u silu'(g); du = dy silu(g).
  void (*swiglu_backward)(const float* dy, const float* g, const float* u, float* dg, float* du,
                          int64_t n);
  // ds[i] = p[i] (ds[i] - sum_j p[j] ds[j]): the softmax backward of one row.
  void (*softmax_backward_row)(const float* p, float* ds, int64_t n);
  // AdamW over n elements in place (p, m, v), one pass. Each element's result depends only on
  // its own values, not on its position (a rank's shard of any world size gives the same bits).
  void (*adamw)(float* p, const float* g, float* m, float* v, int64_t n, const AdamCoefficients& c);
};

// The build this CPU runs: AVX2+FMA where the CPU has both, else the baseline.
const Kernels& SimdKernels();
// The portable build (always), and the AVX2+FMA one or nullptr where this CPU lacks it: for
// tests that hold one against the other.
const Kernels& BaselineKernels();
const Kernels* Avx2Kernels();

// The scalar Exp (the baseline build's), for one value.
float Exp(float x);

}  // namespace dc::simd
