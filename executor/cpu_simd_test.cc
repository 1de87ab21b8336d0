#include "executor/cpu_simd.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace dc::simd {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kDenormal = 1e-40f;
// Sizes around the 8 lanes and their tails.
constexpr int64_t kSizes[] = {1, 3, 7, 8, 9, 15, 16, 17, 31, 100, 1027};

// Every build this CPU can run: the baseline always, AVX2+FMA where present.
std::vector<const Kernels*> Builds() {
  std::vector<const Kernels*> builds = {&BaselineKernels()};
  if (Avx2Kernels()) builds.push_back(Avx2Kernels());
  return builds;
}

// Values with the edge cases a kernel meets: zeros, denormals, large magnitudes, signs.
std::vector<float> Values(int64_t n, uint32_t seed, float spread = 4.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, spread);
  std::vector<float> x(n);
  for (int64_t i = 0; i < n; ++i) x[i] = normal(rng);
  const float edges[] = {0.0f, -0.0f, kDenormal, -kDenormal, 30.0f, -30.0f};
  for (int64_t i = 0; i < n; i += 5) x[i] = edges[(i / 5) % std::size(edges)];
  return x;
}

double RelativeError(double got, double want) {
  if (got == want) return 0;
  return std::abs(got - want) / std::max(std::abs(want), 1e-30);
}

TEST(CpuSimdTest, TheChoiceIsNamed) {
  const std::string name = SimdKernels().name;
  EXPECT_TRUE(name == "avx2+fma" || name == "baseline") << name;
  if (Avx2Kernels()) {
    EXPECT_EQ(name, "avx2+fma");
  }
}

TEST(CpuSimdTest, ExpIsWithinItsDocumentedErrorOverTheWholeRange) {
  // 2^21 evenly spaced values and the ends, both builds, against exp in double.
  constexpr int kPoints = 1 << 21;
  std::vector<float> x;
  for (int i = 0; i < kPoints; ++i) {
    x.push_back(kExpMinArg + (kExpMaxArg - kExpMinArg) * (static_cast<float>(i) / kPoints));
  }
  x.push_back(kExpMaxArg);
  x.push_back(std::nextafter(kExpMinArg, kInf));
  for (const Kernels* k : Builds()) {
    std::vector<float> y(x.size());
    k->exp(x.data(), y.data(), static_cast<int64_t>(x.size()));
    double worst = 0;
    float worst_at = 0;
    for (size_t i = 0; i < x.size(); ++i) {
      const double e = RelativeError(y[i], std::exp(static_cast<double>(x[i])));
      if (e > worst) worst = e, worst_at = x[i];
    }
    EXPECT_LE(worst, kExpMaxRelativeError) << k->name << " at x = " << worst_at;
  }
  double worst_scalar = 0;
  for (float v : x) {
    worst_scalar = std::max(worst_scalar, RelativeError(Exp(v), std::exp(static_cast<double>(v))));
  }
  EXPECT_LE(worst_scalar, kExpMaxRelativeError);
}

TEST(CpuSimdTest, ExpEdgeValues) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  // 9 values so the vector build sees them in a full vector and the tail.
  const std::vector<float> x = {-kInf, kInf, nan, 0.0f, -0.0f, kDenormal, -100.0f, 100.0f, -kInf};
  for (const Kernels* k : Builds()) {
    std::vector<float> y(x.size());
    k->exp(x.data(), y.data(), static_cast<int64_t>(x.size()));
    EXPECT_EQ(y[0], 0.0f) << k->name;
    EXPECT_EQ(y[1], kInf) << k->name;
    EXPECT_TRUE(std::isnan(y[2])) << k->name;
    EXPECT_EQ(y[3], 1.0f) << k->name;
    EXPECT_EQ(y[4], 1.0f) << k->name;
    EXPECT_EQ(y[5], 1.0f) << k->name;
    EXPECT_EQ(y[6], 0.0f) << k->name << ": below the range, 0";
    EXPECT_EQ(y[7], kInf) << k->name << ": above the range, +inf";
    EXPECT_EQ(y[8], 0.0f) << k->name << " (tail)";
  }
  EXPECT_EQ(Exp(-kInf), 0.0f);
  EXPECT_EQ(Exp(kInf), kInf);
  EXPECT_TRUE(std::isnan(Exp(nan)));
  EXPECT_LT(Exp(kExpMinArg), 1.2e-38f * 1.0001f);
  EXPECT_GT(Exp(kExpMinArg), 0.0f);
}

TEST(CpuSimdTest, ReductionsMatchDoubleOnOddSizes) {
  for (const Kernels* k : Builds()) {
    for (int64_t n : kSizes) {
      SCOPED_TRACE(std::string(k->name) + " n=" + std::to_string(n));
      const std::vector<float> a = Values(n, 1), b = Values(n, 2), c = Values(n, 3);
      double sq = 0, dot = 0, dot3 = 0, sum_abs3 = 0, sum_abs2 = 0;
      float max = a[0];
      for (int64_t i = 0; i < n; ++i) {
        sq += static_cast<double>(a[i]) * a[i];
        dot += static_cast<double>(a[i]) * b[i];
        dot3 += static_cast<double>(a[i]) * b[i] * c[i];
        sum_abs2 += std::abs(static_cast<double>(a[i]) * b[i]);
        sum_abs3 += std::abs(static_cast<double>(a[i]) * b[i] * c[i]);
        max = std::max(max, a[i]);
      }
      // fp32 summation: error within n * eps of the sum of magnitudes.
      const double eps = n * 1.2e-7;
      EXPECT_NEAR(k->sum_squares(a.data(), n), sq, eps * sq + 1e-30);
      EXPECT_NEAR(k->dot(a.data(), b.data(), n), dot, eps * sum_abs2 + 1e-30);
      EXPECT_NEAR(k->dot3(a.data(), b.data(), c.data(), n), dot3, eps * sum_abs3 + 1e-30);
      EXPECT_EQ(k->max_value(a.data(), n), max);
    }
  }
}

// The cross-entropy and softmax building blocks on logits with a large spread and -inf masks.
TEST(CpuSimdTest, ExpSumsMatchDoubleWithLargeLogitsAndMasks) {
  for (const Kernels* k : Builds()) {
    for (int64_t n : kSizes) {
      SCOPED_TRACE(std::string(k->name) + " n=" + std::to_string(n));
      std::vector<float> x = Values(n, 4, 30.0f);
      x[0] = 1e4f;  // a huge logit: everything else underflows after the shift
      for (int64_t i = 3; i < n; i += 4) x[i] = -kInf;  // masked
      const float max = k->max_value(x.data(), n);
      EXPECT_EQ(max, 1e4f);
      // Each exp: its own error and that of rounding x - shift to fp32 (eps |x - shift|).
      double want = 0, sum_tol = 0;
      std::vector<double> e(n), tol(n);
      for (int64_t i = 0; i < n; ++i) {
        const double arg = static_cast<double>(x[i]) - max;
        want += e[i] = std::exp(arg);
        tol[i] = std::isinf(arg) ? 0 : e[i] * (3e-7 + 6e-8 * std::abs(arg)) + 1.2e-38;
        sum_tol += tol[i];
      }
      sum_tol += n * 1.2e-7 * want;
      EXPECT_NEAR(k->sum_exp(x.data(), n, max), want, sum_tol);
      std::vector<float> y(n, -1.0f);
      EXPECT_NEAR(k->exp_sum(x.data(), y.data(), n, max), want, sum_tol);
      for (int64_t i = 0; i < n; ++i) {
        EXPECT_NEAR(y[i], e[i], tol[i]) << i;
        if (std::isinf(x[i])) {
          EXPECT_EQ(y[i], 0.0f) << i;
        }
      }
      // In place, shifted by something other than the max.
      std::vector<float> z = Values(n, 5);
      std::vector<float> z0 = z;
      const float s = k->exp_sum(z.data(), z.data(), n, 1.5f);
      double want_z = 0, tol_z = 0;
      for (int64_t i = 0; i < n; ++i) {
        const double arg = static_cast<double>(z0[i]) - 1.5, ei = std::exp(arg);
        const double tol = ei * (3e-7 + 6e-8 * std::abs(arg));
        want_z += ei;
        tol_z += tol;
        EXPECT_NEAR(z[i], ei, tol) << i;
      }
      EXPECT_NEAR(s, want_z, tol_z + n * 1.2e-7 * want_z);
    }
  }
}

TEST(CpuSimdTest, ElementwiseKernelsMatchDouble) {
  for (const Kernels* k : Builds()) {
    for (int64_t n : kSizes) {
      SCOPED_TRACE(std::string(k->name) + " n=" + std::to_string(n));
      const std::vector<float> g = Values(n, 6), u = Values(n, 7), dy = Values(n, 8);
      std::vector<float> gx = g;
      gx[0] = 100.0f;              // sigmoid saturates to 1
      if (n > 1) gx[1] = -100.0f;  // and to 0: exp(100) overflows nothing it should not
      std::vector<float> y(n), dg(n), du(n);
      k->swiglu(gx.data(), u.data(), y.data(), n);
      k->swiglu_backward(dy.data(), gx.data(), u.data(), dg.data(), du.data(), n);
      for (int64_t i = 0; i < n; ++i) {
        const double gi = gx[i], s = 1.0 / (1.0 + std::exp(-gi));
        const double want_y = gi * s * u[i];
        const double want_dg = static_cast<double>(dy[i]) * u[i] * s * (1.0 + gi * (1.0 - s));
        const double want_du = static_cast<double>(dy[i]) * gi * s;
        EXPECT_NEAR(y[i], want_y, 1e-6 * std::abs(gi * u[i]) + 1e-30) << i;
        EXPECT_NEAR(dg[i], want_dg, 1e-6 * std::abs(dy[i] * u[i] * (1.0 + std::abs(gi))) + 1e-30)
            << i;
        EXPECT_NEAR(du[i], want_du, 1e-6 * std::abs(dy[i] * gi) + 1e-30) << i;
        EXPECT_FALSE(std::isnan(y[i]) || std::isnan(dg[i]) || std::isnan(du[i])) << i;
      }

      std::vector<float> sum(n), in_place = g;
      k->add(g.data(), u.data(), sum.data(), n);
      k->add(in_place.data(), u.data(), in_place.data(), n);
      for (int64_t i = 0; i < n; ++i) {
        EXPECT_EQ(sum[i], g[i] + u[i]) << i;
        EXPECT_EQ(in_place[i], g[i] + u[i]) << i;
      }

      std::vector<float> scaled = g;
      k->scale(scaled.data(), n, 0.25f);
      for (int64_t i = 0; i < n; ++i) EXPECT_EQ(scaled[i], g[i] * 0.25f) << i;
    }
  }
}

TEST(CpuSimdTest, RowKernelsMatchDouble) {
  for (const Kernels* k : Builds()) {
    for (int64_t n : kSizes) {
      SCOPED_TRACE(std::string(k->name) + " n=" + std::to_string(n));
      const std::vector<float> x = Values(n, 9), w = Values(n, 10), dy = Values(n, 11);
      const std::vector<float> c = Values(n, 12), s = Values(n, 13), x2 = Values(n, 14);
      const float r = 0.7f, coef = 0.3f;
      std::vector<float> y(n), dx(n), dw(n, 123.0f), dw_acc = w;
      k->rms_norm_row(x.data(), w.data(), r, y.data(), n);
      k->rms_norm_backward_row(dy.data(), x.data(), w.data(), r, coef, dx.data(), dw.data(), false,
                               n);
      k->rms_norm_backward_row(dy.data(), x.data(), w.data(), r, coef, dx.data(), dw_acc.data(),
                               true, n);
      std::vector<float> y1(n), y2(n);
      k->rope_row(x.data(), x2.data(), c.data(), s.data(), y1.data(), y2.data(), n);
      for (int64_t i = 0; i < n; ++i) {
        const double xi = x[i], wi = w[i], dyi = dy[i];
        const double tol = 1e-6 * (std::abs(xi * wi) + std::abs(dyi * wi) + std::abs(xi)) + 1e-30;
        EXPECT_NEAR(y[i], xi * r * wi, tol) << i;
        EXPECT_NEAR(dx[i], r * dyi * wi - xi * coef, tol) << i;
        EXPECT_NEAR(dw[i], dyi * xi * r, 1e-6 * std::abs(dyi * xi) + 1e-30) << i;
        EXPECT_NEAR(dw_acc[i], wi + dyi * xi * r, 1e-6 * (std::abs(wi) + std::abs(dyi * xi))) << i;
        const double a = x[i], b = x2[i], ci = c[i], si = s[i];
        const double rope_tol =
            1e-6 * (std::abs(a * ci) + std::abs(b * si) + std::abs(a * si) + std::abs(b * ci)) +
            1e-30;
        EXPECT_NEAR(y1[i], a * ci - b * si, rope_tol) << i;
        EXPECT_NEAR(y2[i], a * si + b * ci, rope_tol) << i;
      }

      // Softmax backward of a softmax row.
      std::vector<float> p = Values(n, 15);
      const float sum = k->exp_sum(p.data(), p.data(), n, k->max_value(p.data(), n));
      k->scale(p.data(), n, 1.0f / sum);
      std::vector<float> ds = Values(n, 16);
      const std::vector<float> ds0 = ds;
      k->softmax_backward_row(p.data(), ds.data(), n);
      double dot = 0;
      for (int64_t i = 0; i < n; ++i) dot += static_cast<double>(p[i]) * ds0[i];
      for (int64_t i = 0; i < n; ++i) {
        EXPECT_NEAR(ds[i], p[i] * (ds0[i] - dot), 1e-6 * p[i] * (std::abs(ds0[i]) + 10) + 1e-30)
            << i;
      }
    }
  }
}

TEST(CpuSimdTest, AdamWMatchesDouble) {
  const double beta1 = 0.9, beta2 = 0.95, eps = 1e-8, lr = 1e-3, wd = 0.1;
  const int step = 3;
  const double mc = 1.0 / (1.0 - std::pow(beta1, step)), vc = 1.0 / (1.0 - std::pow(beta2, step));
  const AdamCoefficients coef = {
      static_cast<float>(beta1),     static_cast<float>(beta2), static_cast<float>(1 - beta1),
      static_cast<float>(1 - beta2), static_cast<float>(mc),    static_cast<float>(vc),
      static_cast<float>(eps),       static_cast<float>(lr),    static_cast<float>(1 - lr * wd)};
  for (const Kernels* k : Builds()) {
    for (int64_t n : kSizes) {
      SCOPED_TRACE(std::string(k->name) + " n=" + std::to_string(n));
      std::vector<float> p = Values(n, 17), g = Values(n, 18, 1e-2f), m = Values(n, 19, 1e-3f);
      std::vector<float> v = Values(n, 20, 1e-4f);
      for (float& vi : v) vi = vi * vi;  // second moments are not negative
      g[0] = 0.0f;
      const std::vector<float> p0 = p, m0 = m, v0 = v;
      k->adamw(p.data(), g.data(), m.data(), v.data(), n, coef);
      for (int64_t i = 0; i < n; ++i) {
        const double mi = beta1 * m0[i] + (1 - beta1) * g[i];
        const double vi = beta2 * v0[i] + (1 - beta2) * static_cast<double>(g[i]) * g[i];
        const double update = mi * mc / (std::sqrt(vi * vc) + eps);
        // fp32 rounding of each term, not of the (cancelling) sum.
        EXPECT_NEAR(m[i], mi, 3e-7 * (beta1 * std::abs(m0[i]) + std::abs(g[i])) + 1e-30) << i;
        EXPECT_NEAR(v[i], vi, 1e-6 * vi + 1e-30) << i;
        // fp32 update: a few ulp of p and of lr * |update| (bounded by lr * ~sqrt(1/(1-b2))).
        EXPECT_NEAR(p[i], p0[i] * (1 - lr * wd) - lr * update,
                    1e-6 * std::abs(p0[i]) + 1e-6 * lr * std::abs(update) + 1e-30)
            << i;
      }
    }
  }
}

// A rank's shard starts anywhere: AdamW over [0, n) and over two pieces split off the lanes'
// boundary give the same bits (dc-run's exports are byte-identical on any world size).
TEST(CpuSimdTest, AdamWDoesNotDependOnWhereTheShardStarts) {
  const AdamCoefficients coef = {0.9f, 0.95f, 0.1f, 0.05f, 3.69f, 7.0f, 1e-8f, 1e-3f, 0.9999f};
  constexpr int64_t n = 1027, split = 513;
  for (const Kernels* k : Builds()) {
    SCOPED_TRACE(k->name);
    std::vector<float> p = Values(n, 22), g = Values(n, 23, 1e-2f), m = Values(n, 24, 1e-3f);
    std::vector<float> v = Values(n, 25, 1e-4f);
    for (float& vi : v) vi = vi * vi;
    std::vector<float> p2 = p, m2 = m, v2 = v;
    k->adamw(p.data(), g.data(), m.data(), v.data(), n, coef);
    k->adamw(p2.data(), g.data(), m2.data(), v2.data(), split, coef);
    k->adamw(p2.data() + split, g.data() + split, m2.data() + split, v2.data() + split, n - split,
             coef);
    EXPECT_EQ(p, p2);
    EXPECT_EQ(m, m2);
    EXPECT_EQ(v, v2);
  }
}

// AdamW is the same bits in both builds (and in the cuda backend's AdamWKernel): the same fp32
// operations with fused multiply-adds in the same places, so a run's weights do not depend on
// the CPU it ran on.
// So is a clipped step (grad_scale below 1), and a grad_scale of 1 is the unclipped step exactly.
TEST(CpuSimdTest, AdamWIsTheSameBitsInBothBuilds) {
  const Kernels* avx2 = Avx2Kernels();
  if (!avx2) GTEST_SKIP() << "this CPU has no AVX2+FMA";
  for (const float grad_scale : {1.0f, 0.37f}) {
    SCOPED_TRACE(grad_scale);
    AdamCoefficients coef = {0.9f, 0.95f, 0.1f, 0.05f, 3.69f, 7.0f, 1e-8f, 1e-3f, 0.9999f};
    coef.grad_scale = grad_scale;
    constexpr int64_t n = 1027;
    std::vector<float> p = Values(n, 32), g = Values(n, 33, 1e-2f), m = Values(n, 34, 1e-3f);
    std::vector<float> v = Values(n, 35, 1e-4f);
    for (float& vi : v) vi = vi * vi;
    std::vector<float> p2 = p, m2 = m, v2 = v;
    avx2->adamw(p.data(), g.data(), m.data(), v.data(), n, coef);
    BaselineKernels().adamw(p2.data(), g.data(), m2.data(), v2.data(), n, coef);
    EXPECT_EQ(p, p2);
    EXPECT_EQ(m, m2);
    EXPECT_EQ(v, v2);
  }
}

// The two builds agree to fp32 rounding, where this CPU has both.
TEST(CpuSimdTest, Avx2AgreesWithBaseline) {
  const Kernels* avx2 = Avx2Kernels();
  if (!avx2) GTEST_SKIP() << "this CPU has no AVX2+FMA";
  const Kernels& base = BaselineKernels();
  for (int64_t n : kSizes) {
    SCOPED_TRACE("n=" + std::to_string(n));
    const std::vector<float> x = Values(n, 21, 20.0f);
    std::vector<float> a(n), b(n);
    avx2->exp(x.data(), a.data(), n);
    base.exp(x.data(), b.data(), n);
    for (int64_t i = 0; i < n; ++i) {
      EXPECT_NEAR(a[i], b[i], 2 * kExpMaxRelativeError * std::abs(b[i]) + 1e-38) << i;
    }
    const float max = base.max_value(x.data(), n);
    EXPECT_EQ(avx2->max_value(x.data(), n), max);
    const float sa = avx2->sum_exp(x.data(), n, max), sb = base.sum_exp(x.data(), n, max);
    EXPECT_NEAR(sa, sb, 1e-6 * sb);
  }
}

}  // namespace
}  // namespace dc::simd
