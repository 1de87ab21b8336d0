#include "executor/cpu_kernels.h"

#include <cblas.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cmath>
#include <iterator>
#include <limits>
#include <optional>
#include <string>

#include "executor/cpu_simd.h"
#include "executor/moe_layout.h"
#include "schemas/op_kinds.h"

namespace dc {
namespace {

using Shape = std::vector<int64_t>;
using Refs = std::span<TensorRef>;

// ---------------------------------------------------------------------------------------------
// Checking operands. Every message names the op.

std::string ShapeString(const Shape& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

Status OpError(const proto::Op& op, const std::string& message) {
  return Status::Error("op " + op.name() + " (" + op.kind() + "): " + message);
}

// Checks the operand counts.
Status CheckArity(const proto::Op& op, Refs in, Refs out, size_t num_inputs, size_t num_outputs) {
  if (in.size() != num_inputs || out.size() != num_outputs) {
    return OpError(op, "expects " + std::to_string(num_inputs) + " inputs and " +
                           std::to_string(num_outputs) + " outputs, got " +
                           std::to_string(in.size()) + " and " + std::to_string(out.size()));
  }
  return Status::Ok();
}

// What a kernel calls one operand in messages: "input 1 (w)".
struct Operand {
  const char* side;  // "input" or "output"
  size_t index;
  const char* name;
  std::string Label() const {
    return std::string(side) + " " + std::to_string(index) + " (" + name + ")";
  }
};
Operand In(size_t index, const char* name) { return {"input", index, name}; }
Operand Out(size_t index, const char* name) { return {"output", index, name}; }

Status CheckF32(const proto::Op& op, const TensorRef& t, const Operand& what) {
  if (t.f32 == nullptr) return OpError(op, what.Label() + " has no f32 data");
  return Status::Ok();
}

Status CheckI32(const proto::Op& op, const TensorRef& t, const Operand& what) {
  if (t.i32 == nullptr) return OpError(op, what.Label() + " has no i32 data");
  return Status::Ok();
}

Status CheckShape(const proto::Op& op, const TensorRef& t, const Shape& expected,
                  const Operand& what) {
  if (t.shape != expected) {
    return OpError(op, what.Label() + " has shape " + ShapeString(t.shape) + ", expected " +
                           ShapeString(expected));
  }
  return Status::Ok();
}

// An f32 operand with exactly `expected` shape.
Status CheckF32Shape(const proto::Op& op, const TensorRef& t, const Shape& expected,
                     const Operand& what) {
  DC_RETURN_IF_ERROR(CheckF32(op, t, what));
  return CheckShape(op, t, expected, what);
}

// An f32 operand of rank in [min_rank, max_rank] with no empty dimension.
Status CheckF32Rank(const proto::Op& op, const TensorRef& t, size_t min_rank, const Operand& what,
                    size_t max_rank = std::numeric_limits<size_t>::max()) {
  DC_RETURN_IF_ERROR(CheckF32(op, t, what));
  if (t.shape.size() < min_rank || t.shape.size() > max_rank) {
    const std::string expected =
        min_rank == max_rank ? std::to_string(min_rank) : std::to_string(min_rank) + " or more";
    return OpError(
        op, what.Label() + " has shape " + ShapeString(t.shape) + ", expected rank " + expected);
  }
  for (int64_t d : t.shape) {
    if (d <= 0) {
      return OpError(
          op, what.Label() + " has shape " + ShapeString(t.shape) + ", with an empty dimension");
    }
  }
  return Status::Ok();
}

// `shape` with its last dimension replaced.
Shape WithLast(Shape shape, int64_t last) {
  shape.back() = last;
  return shape;
}

Shape DropLast(Shape shape) {
  shape.pop_back();
  return shape;
}

Status RequireIntAttr(const proto::Op& op, const char* name, int64_t* value) {
  *value = AttrInt(op, name, 0);
  if (*value <= 0) return OpError(op, std::string("needs a positive int attr '") + name + "'");
  return Status::Ok();
}

Status RequireFloatAttr(const proto::Op& op, const char* name, double* value) {
  *value = AttrFloat(op, name, 0);
  if (!(*value > 0)) return OpError(op, std::string("needs a positive attr '") + name + "'");
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------------
// BLAS

// OpenBLAS's thread count is process-global; set it only when it changes.
void UseBlasThreads(int num_threads) {
  static std::atomic<int> current{0};
  const int wanted = std::max(1, num_threads);
  if (current.exchange(wanted) != wanted) openblas_set_num_threads(wanted);
}

// Row-major C = alpha * op(A) op(B) + beta * C; op(A) is m x k, op(B) is k x n.
void Gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
          int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, static_cast<blasint>(m), static_cast<blasint>(n),
              static_cast<blasint>(k), alpha, a, static_cast<blasint>(lda), b,
              static_cast<blasint>(ldb), beta, c, static_cast<blasint>(ldc));
}

Status CheckBlasDims(const proto::Op& op, std::initializer_list<int64_t> dims) {
  for (int64_t d : dims) {
    if (d > std::numeric_limits<blasint>::max()) {
      return OpError(op, "dimension " + std::to_string(d) + " is too large for the CPU backend");
    }
  }
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------------
// embedding

Status Embedding(const proto::Op& op, Refs in, Refs out, const KernelContext&) {
  DC_RETURN_IF_ERROR(CheckArity(op, in, out, 2, 1));
  const TensorRef &tokens = in[0], &table = in[1];
  DC_RETURN_IF_ERROR(CheckI32(op, tokens, In(0, "tokens")));
  DC_RETURN_IF_ERROR(CheckF32Rank(op, table, 2, In(1, "table"), 2));
  const int64_t vocab = table.shape[0], hidden = table.shape[1];
  Shape expected = tokens.shape;
  expected.push_back(hidden);
  DC_RETURN_IF_ERROR(CheckF32Shape(op, out[0], expected, Out(0, "y")));
  const int64_t num_tokens = tokens.NumElements();
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int32_t id = tokens.i32[t];
    if (id < 0 || id >= vocab) {
      return OpError(op, "token " + std::to_string(id) + " at " + std::to_string(t) +
                             " is outside the vocabulary of " + std::to_string(vocab));
    }
    std::copy_n(table.f32 + id * hidden, hidden, out[0].f32 + t * hidden);
  }
  return Status::Ok();
}

Status EmbeddingBackward(const proto::Op& op, Refs in, Refs out, const KernelContext&) {
  DC_RETURN_IF_ERROR(CheckArity(op, in, out, 2, 1));
  const TensorRef &dy = in[0], &tokens = in[1], &dtable = out[0];
  DC_RETURN_IF_ERROR(CheckI32(op, tokens, In(1, "tokens")));
  DC_RETURN_IF_ERROR(CheckF32Rank(op, dtable, 2, Out(0, "dtable"), 2));
  const int64_t vocab = dtable.shape[0], hidden = dtable.shape[1];
  Shape expected = tokens.shape;
  expected.push_back(hidden);
  DC_RETURN_IF_ERROR(CheckF32Shape(op, dy, expected, In(0, "dy")));
  std::fill_n(dtable.f32, dtable.NumElements(), 0.0f);
  const int64_t num_tokens = tokens.NumElements();
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int32_t id = tokens.i32[t];
    if (id < 0 || id >= vocab) {
      return OpError(op, "token " + std::to_string(id) + " at " + std::to_string(t) +
                             " is outside the vocabulary of " + std::to_string(vocab));
    }
    float* row = dtable.f32 + id * hidden;
    const float* g = dy.f32 + t * hidden;
    for (int64_t h = 0; h < hidden; ++h) row[h] += g[h];
  }
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------------
// rmsnorm

// 1 / sqrt(mean(x^2) + eps) of one row.
float InvRms(const float* x, int64_t n, double eps) {
  const double sum_sq = simd::SimdKernels().sum_squares(x, n);
  return static_cast<float>(1.0 / std::sqrt(sum_sq / static_cast<double>(n) + eps));
}

// Checks x [..., H] (input `x_index`) and w [H] (the next input); sets the rows and width.
Status CheckNormOperands(const proto::Op& op, const TensorRef& x, const TensorRef& w,
                         size_t x_index, int64_t* rows, int64_t* hidden) {
  DC_RETURN_IF_ERROR(CheckF32Rank(op, x, 1, In(x_index, "x")));
  *hidden = x.shape.back();
  *rows = x.NumElements() / *hidden;
  return CheckF32Shape(op, w, {*hidden}, In(x_index + 1, "w"));
}

Status RmsNorm(const proto::Op& op, Refs in, Refs out, const KernelContext&) {
  DC_RETURN_IF_ERROR(CheckArity(op, in, out, 2, 1));
  const TensorRef &x = in[0], &w = in[1], &y = out[0];
  int64_t rows = 0, hidden = 0;
  DC_RETURN_IF_ERROR(CheckNormOperands(op, x, w, 0, &rows, &hidden));
  DC_RETURN_IF_ERROR(CheckF32Shape(op, y, x.shape, Out(0, "y")));
  double eps = 0;
  DC_RETURN_IF_ERROR(RequireFloatAttr(op, op_attr::kEps, &eps));
  const simd::Kernels& k = simd::SimdKernels();
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x.f32 + r * hidden;
    k.rms_norm_row(xr, w.f32, InvRms(xr, hidden, eps), y.f32 + r * hidden, hidden);
  }
  return Status::Ok();
}

// With g = dy * w and r = 1 / rms(x): dx = r * g - x * r^3 * mean(g * x); dw = sum_rows dy x r.
Status RmsNormBackward(const proto::Op& op, Refs in, Refs out, const KernelContext&) {
  DC_RETURN_IF_ERROR(CheckArity(op, in, out, 3, 2));
  const TensorRef &dy = in[0], &x = in[1], &w = in[2], &dx = out[0], &dw = out[1];
  int64_t rows = 0, hidden = 0;
  DC_RETURN_IF_ERROR(CheckNormOperands(op, x, w, 1, &rows, &hidden));
  DC_RETURN_IF_ERROR(CheckF32Shape(op, dy, x.shape, In(0, "dy")));
  DC_RETURN_IF_ERROR(CheckF32Shape(op, dx, x.shape, Out(0, "dx")));
  DC_RETURN_IF_ERROR(CheckF32Shape(op, dw, w.shape, Out(1, "dw")));
  double eps = 0;
  DC_RETURN_IF_ERROR(RequireFloatAttr(op, op_attr::kEps, &eps));
  const simd::Kernels& k = simd::SimdKernels();
  for (int64_t r = 0; r < rows; ++r) {  // the first row writes dw, the others add to it
    const float* xr = x.f32 + r * hidden;
    const float* dyr = dy.f32 + r * hidden;
    const float inv_rms = InvRms(xr, hidden, eps);
    const double dot = k.dot3(dyr, w.f32, xr, hidden);  // sum(dy * w * x)
    const float coef =
        static_cast<float>(dot / static_cast<double>(hidden)) * inv_rms * inv_rms * inv_rms;
    k.rms_norm_backward_row(dyr, xr, w.f32, inv_rms, coef, dx.f32 + r * hidden, dw.f32, r > 0,
                            hidden);
  }
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------------
// matmul: y [M, N] = x [M, K] w[N, K]^T

Status CheckMatmulOperands(const proto::Op& op, const TensorRef& x, const TensorRef& w,
                           size_t x_index, int64_t* m, int64_t* n, int64_t* k) {
  DC_RETURN_IF_ERROR(CheckF32Rank(op, x, 1, In(x_index, "x")));
  DC_RETURN_IF_ERROR(CheckF32Rank(op, w, 2, In(x_index + 1, "w"), 2));
  *k = x.shape.back();
  *m = x.NumElements() / *k;
  *n = w.shape[0];
  DC_RETURN_IF_ERROR(CheckShape(op, w, {*n, *k}, In(x_index + 1, "w")));
  return CheckBlasDims(op, {*m, *n, *k});
}

Status Matmul(const proto::Op& op, Refs in, Refs out, const KernelContext&) {
  DC_RETURN_IF_ERROR(CheckArity(op, in, out, 2, 1));
  const TensorRef &x = in[0], &w = in[1], &y = out[0];
  int64_t m = 0, n = 0, k = 0;
  DC_RETURN_IF_ERROR(CheckMatmulOperands(op, x, w, 0, &m, &n, &k));
  DC_RETURN_IF_ERROR(CheckF32Shape(op, y, WithLast(x.shape, n), Out(0, "y")));
  Gemm(false, true, m, n, k, 1.0f, x.f32, k, w.f32, k, 0.0f, y.f32, n);
  return Status::Ok();
}

// dx = dy w; dw = dy^T x.
Status MatmulBackward(const proto::Op& op, Refs in, Refs out, const KernelContext&) {
  DC_RETURN_IF_ERROR(CheckArity(op, in, out, 3, 2));
  const TensorRef &dy = in[0], &x = in[1], &w = in[2], &dx = out[0], &dw = out[1];
  int64_t m = 0, n = 0, k = 0;
  DC_RETURN_IF_ERROR(CheckMatmulOperands(op, x, w, 1, &m, &n, &k));
  DC_RETURN_IF_ERROR(CheckF32Shape(op, dy, WithLast(x.shape, n), In(0, "dy")));
  DC_RETURN_IF_ERROR(CheckF32Shape(op, dx, x.shape, Out(0, "dx")));
  DC_RETURN_IF_ERROR(CheckF32Shape(op, dw, w.shape, Out(1, "dw")));
  Gemm(false, false, m, k, n, 1.0f, dy.f32, n, w.f32, k, 0.0f, dx.f32, k);
  Gemm(true, false, n, k, m, 1.0f, dy.f32, n, x.f32, k, 0.0f, dw.f32, k);
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------------
// rope

struct RopeDims {
  int64_t batch, seq, heads, head_dim;
  double theta;
};

Status CheckRope(const proto::Op& op, const TensorRef& x, const TensorRef& y, RopeDims* dims) {
  DC_RETURN_IF_ERROR(RequireIntAttr(op, op_attr::kHeads, &dims->heads));
  DC_RETURN_IF_ERROR(RequireIntAttr(op, op_attr::kHeadDim, &dims->head_dim));
  if (dims->head_dim % 2 != 0) return OpError(op, "head_dim must be even");
  DC_RETURN_IF_ERROR(RequireFloatAttr(op, op_attr::kTheta, &dims->theta));
  DC_RETURN_IF_ERROR(CheckF32Rank(op, x, 3, In(0, "x"), 3));
  dims->batch = x.shape[0];
  dims->seq = x.shape[1];
  DC_RETURN_IF_ERROR(
      CheckShape(op, x, {dims->batch, dims->seq, dims->heads * dims->head_dim}, In(0, "x")));
  return CheckF32Shape(op, y, x.shape, Out(0, "y"));
}

// The rotation's cos and sin per (position, pair), for one (seq, head_dim, theta): every rope of
// a step shares them, so each thread keeps the last table it made (a step's ropes all have the
// same shape) instead of paying seq * head_dim / 2 sincos per call.
struct RopeTable {
  int64_t seq = -1;
  int64_t head_dim = -1;
  double theta = 0;
  std::vector<float> cos, sin, minus_sin;
};

const RopeTable& RopeTableFor(const RopeDims& d) {
  thread_local RopeTable table;
  if (table.seq == d.seq && table.head_dim == d.head_dim && table.theta == d.theta) return table;
  const int64_t half = d.head_dim / 2;
  table.cos.resize(d.seq * half);
  table.sin.resize(d.seq * half);
  table.minus_sin.resize(d.seq * half);
  for (int64_t i = 0; i < half; ++i) {
    const double inv_freq =
        std::pow(d.theta, -2.0 * static_cast<double>(i) / static_cast<double>(d.head_dim));
    for (int64_t s = 0; s < d.seq; ++s) {
      const double angle = static_cast<double>(s) * inv_freq;
      table.cos[s * half + i] = static_cast<float>(std::cos(angle));
      table.sin[s * half + i] = static_cast<float>(std::sin(angle));
      table.minus_sin[s * half + i] = -table.sin[s * half + i];
    }
  }
  table.seq = d.seq;
  table.head_dim = d.head_dim;
  table.theta = d.theta;
  return table;
}

// Rotates each (i, i + head_dim / 2) pair by +angle (forward) or -angle (backward, the
// transpose of the rotation).
void ApplyRope(const RopeDims& d, const float* x, float* y, bool backward) {
  const int64_t half = d.head_dim / 2;
  const RopeTable& table = RopeTableFor(d);
  const std::vector<float>& sin_table = backward ? table.minus_sin : table.sin;
  const int64_t width = d.heads * d.head_dim;
  const simd::Kernels& k = simd::SimdKernels();
  for (int64_t b = 0; b < d.batch; ++b) {
    for (int64_t s = 0; s < d.seq; ++s) {
      const float* c = table.cos.data() + s * half;
      const float* sn = sin_table.data() + s * half;
      for (int64_t h = 0; h < d.heads; ++h) {
        const int64_t base = (b * d.seq + s) * width + h * d.head_dim;
        k.rope_row(x + base, x + base + half, c, sn, y + base, y + base + half, half);
      }
    }
  }
}

Status Rope(const proto::Op& op, Refs in, Refs out, const KernelContext&) {
  DC_RETURN_IF_ERROR(CheckArity(op, in, out, 1, 1));
  RopeDims dims{};
  DC_RETURN_IF_ERROR(CheckRope(op, in[0], out[0], &dims));
  ApplyRope(dims, in[0].f32, out[0].f32, /*backward=*/false);
  return Status::Ok();
}

Status RopeBackward(const proto::Op& op, Refs in, Refs out, const KernelContext&) {
  DC_RETURN_IF_ERROR(CheckArity(op, in, out, 1, 1));
  RopeDims dims{};
  DC_RETURN_IF_ERROR(CheckRope(op, in[0], out[0], &dims));
  ApplyRope(dims, in[0].f32, out[0].f32, /*backward=*/true);
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------------
// attention

struct AttentionDims {
  int64_t batch, seq, heads, kv_heads, head_dim;
  int64_t q_width() const { return heads * head_dim; }
  int64_t kv_width() const { return kv_heads * head_dim; }
  // Offsets of head h (query) / its kv head in batch b.
  int64_t QOffset(int64_t b, int64_t h) const { return b * seq * q_width() + h * head_dim; }
  int64_t KvOffset(int64_t b, int64_t h) const {
    return b * seq * kv_width() + (h / (heads / kv_heads)) * head_dim;
  }
};

// Checks q, k, v (at input positions `first`..`first + 2`) against the attrs.
Status CheckAttention(const proto::Op& op, Refs in, size_t first, AttentionDims* d) {
  DC_RETURN_IF_ERROR(RequireIntAttr(op, op_attr::kHeads, &d->heads));
  DC_RETURN_IF_ERROR(RequireIntAttr(op, op_attr::kKvHeads, &d->kv_heads));
  DC_RETURN_IF_ERROR(RequireIntAttr(op, op_attr::kHeadDim, &d->head_dim));
  if (d->heads % d->kv_heads != 0) return OpError(op, "kv_heads does not divide heads");
  const TensorRef &q = in[first], &k = in[first + 1], &v = in[first + 2];
  DC_RETURN_IF_ERROR(CheckF32Rank(op, q, 3, In(first, "q"), 3));
  d->batch = q.shape[0];
  d->seq = q.shape[1];
  DC_RETURN_IF_ERROR(CheckShape(op, q, {d->batch, d->seq, d->q_width()}, In(first, "q")));
  DC_RETURN_IF_ERROR(CheckF32Shape(op, k, {d->batch, d->seq, d->kv_width()}, In(first + 1, "k")));
  DC_RETURN_IF_ERROR(CheckF32Shape(op, v, k.shape, In(first + 2, "v")));
  return CheckBlasDims(op, {d->seq, d->q_width()});
}

// Query rows go in blocks of kAttentionBlockRows: a block's rows attend to the keys up to its
// last row only (causal), so no GEMM computes the upper triangle beyond the block's diagonal
// part, about (1 + 1 / blocks) / 2 of the full S x S work (0.56 at seq 256).
constexpr int64_t kAttentionBlockRows = 32;

// probs rows [r0, r1), columns [0, r1) = causal softmax(scale * q_h k_g^T) for head h of batch
// b; the block's entries above the diagonal are zero (the next GEMMs read the block's columns).
void AttentionProbs(const AttentionDims& d, const float* q, const float* k, int64_t b, int64_t h,
                    float scale, int64_t r0, int64_t r1, float* probs) {
  Gemm(false, true, r1 - r0, r1, d.head_dim, scale, q + d.QOffset(b, h) + r0 * d.q_width(),
       d.q_width(), k + d.KvOffset(b, h), d.kv_width(), 0.0f, probs + r0 * d.seq, d.seq);
  const simd::Kernels& kernels = simd::SimdKernels();
  for (int64_t i = r0; i < r1; ++i) {
    float* row = probs + i * d.seq;
    const float max = kernels.max_value(row, i + 1);
    const float sum = kernels.exp_sum(row, row, i + 1, max);
    kernels.scale(row, i + 1, 1.0f / sum);
    std::fill(row + i + 1, row + r1, 0.0f);
  }
}

float SoftmaxScale(const AttentionDims& d) {
  return static_cast<float>(1.0 / std::sqrt(static_cast<double>(d.head_dim)));
}

Status Attention(const proto::Op& op, Refs in, Refs out, const KernelContext&) {
  DC_RETURN_IF_ERROR(CheckArity(op, in, out, 3, 1));
  AttentionDims d{};
  DC_RETURN_IF_ERROR(CheckAttention(op, in, 0, &d));
  const TensorRef &q = in[0], &k = in[1], &v = in[2], &o = out[0];
  DC_RETURN_IF_ERROR(CheckF32Shape(op, o, q.shape, Out(0, "o")));
  std::vector<float> probs(d.seq * d.seq);
  for (int64_t b = 0; b < d.batch; ++b) {
    for (int64_t h = 0; h < d.heads; ++h) {
      for (int64_t r0 = 0; r0 < d.seq; r0 += kAttentionBlockRows) {
        const int64_t r1 = std::min(d.seq, r0 + kAttentionBlockRows);
        AttentionProbs(d, q.f32, k.f32, b, h, SoftmaxScale(d), r0, r1, probs.data());
        Gemm(false, false, r1 - r0, d.head_dim, r1, 1.0f, probs.data() + r0 * d.seq, d.seq,
             v.f32 + d.KvOffset(b, h), d.kv_width(), 0.0f,
             o.f32 + d.QOffset(b, h) + r0 * d.q_width(), d.q_width());
      }
    }
  }
  return Status::Ok();
}

// With P the probs and dP = dO V^T: dS = P * (dP - rowsum(P * dP)); dQ = scale dS K;
// dK += scale dS^T Q; dV += P^T dO (kv heads sum over their query heads), block by block of
// query rows as the forward.
Status AttentionBackward(const proto::Op& op, Refs in, Refs out, const KernelContext&) {
  DC_RETURN_IF_ERROR(CheckArity(op, in, out, 4, 3));
  AttentionDims d{};
  DC_RETURN_IF_ERROR(CheckAttention(op, in, 1, &d));
  const TensorRef &d_o = in[0], &q = in[1], &k = in[2], &v = in[3];
  const TensorRef &dq = out[0], &dk = out[1], &dv = out[2];
  DC_RETURN_IF_ERROR(CheckF32Shape(op, d_o, q.shape, In(0, "do")));
  DC_RETURN_IF_ERROR(CheckF32Shape(op, dq, q.shape, Out(0, "dq")));
  DC_RETURN_IF_ERROR(CheckF32Shape(op, dk, k.shape, Out(1, "dk")));
  DC_RETURN_IF_ERROR(CheckF32Shape(op, dv, v.shape, Out(2, "dv")));
  const float scale = SoftmaxScale(d);
  const int64_t group = d.heads / d.kv_heads;
  const simd::Kernels& kernels = simd::SimdKernels();
  std::vector<float> probs(d.seq * d.seq), dprobs(d.seq * d.seq);
  for (int64_t b = 0; b < d.batch; ++b) {
    for (int64_t h = 0; h < d.heads; ++h) {
      const int64_t qo = d.QOffset(b, h), kvo = d.KvOffset(b, h);
      // The blocks add into dk and dv; the first query head of a kv head starts them at zero.
      if (h % group == 0) {
        for (int64_t i = 0; i < d.seq; ++i) {
          std::fill_n(dk.f32 + kvo + i * d.kv_width(), d.head_dim, 0.0f);
          std::fill_n(dv.f32 + kvo + i * d.kv_width(), d.head_dim, 0.0f);
        }
      }
      for (int64_t r0 = 0; r0 < d.seq; r0 += kAttentionBlockRows) {
        const int64_t r1 = std::min(d.seq, r0 + kAttentionBlockRows), rows = r1 - r0;
        float* p = probs.data() + r0 * d.seq;
        float* ds = dprobs.data() + r0 * d.seq;
        const float* d_o_rows = d_o.f32 + qo + r0 * d.q_width();
        AttentionProbs(d, q.f32, k.f32, b, h, scale, r0, r1, probs.data());
        Gemm(false, true, rows, r1, d.head_dim, 1.0f, d_o_rows, d.q_width(), v.f32 + kvo,
             d.kv_width(), 0.0f, ds, d.seq);
        Gemm(true, false, r1, d.head_dim, rows, 1.0f, p, d.seq, d_o_rows, d.q_width(), 1.0f,
             dv.f32 + kvo, d.kv_width());
        for (int64_t i = r0; i < r1; ++i) {
          float* row = dprobs.data() + i * d.seq;
          kernels.softmax_backward_row(probs.data() + i * d.seq, row, i + 1);
          std::fill(row + i + 1, row + r1, 0.0f);
        }
        Gemm(false, false, rows, d.head_dim, r1, scale, ds, d.seq, k.f32 + kvo, d.kv_width(), 0.0f,
             dq.f32 + qo + r0 * d.q_width(), d.q_width());
        Gemm(true, false, r1, d.head_dim, rows, scale, ds, d.seq, q.f32 + qo + r0 * d.q_width(),
             d.q_width(), 1.0f, dk.f32 + kvo, d.kv_width());
      }
    }
  }
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------------
// swiglu

Status Swiglu(const proto::Op& op, Refs in, Refs out, const KernelContext&) {
  DC_RETURN_IF_ERROR(CheckArity(op, in, out, 2, 1));
  const TensorRef &gate = in[0], &up = in[1], &y = out[0];
  DC_RETURN_IF_ERROR(CheckF32Rank(op, gate, 1, In(0, "gate")));
  DC_RETURN_IF_ERROR(CheckF32Shape(op, up, gate.shape, In(1, "up")));
  DC_RETURN_IF_ERROR(CheckF32Shape(op, y, gate.shape, Out(0, "y")));
  simd::SimdKernels().swiglu(gate.f32, up.f32, y.f32, gate.NumElements());
  return Status::Ok();
}

// silu'(g) = s (1 + g (1 - s)) with s = sigmoid(g) (cpu_simd.cc).
Status SwigluBackward(const proto::Op& op, Refs in, Refs out, const KernelContext&) {
  DC_RETURN_IF_ERROR(CheckArity(op, in, out, 3, 2));
  const TensorRef &dy = in[0], &gate = in[1], &up = in[2], &dgate = out[0], &dup = out[1];
  DC_RETURN_IF_ERROR(CheckF32Rank(op, gate, 1, In(1, "gate")));
  DC_RETURN_IF_ERROR(CheckF32Shape(op, dy, gate.shape, In(0, "dy")));
  DC_RETURN_IF_ERROR(CheckF32Shape(op, up, gate.shape, In(2, "up")));
  DC_RETURN_IF_ERROR(CheckF32Shape(op, dgate, gate.shape, Out(0, "dgate")));
  DC_RETURN_IF_ERROR(CheckF32Shape(op, dup, gate.shape, Out(1, "dup")));
  simd::SimdKernels().swiglu_backward(dy.f32, gate.f32, up.f32, dgate.f32, dup.f32,
                                      gate.NumElements());
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------------
// add

Status Add(const proto::Op& op, Refs in, Refs out, const KernelContext&) {
  constexpr size_t kMinInputs = 2;
  if (in.size() < kMinInputs || out.size() != 1) {
    return OpError(op, "expects 2 or more inputs and 1 output, got " + std::to_string(in.size()) +
                           " and " + std::to_string(out.size()));
  }
  DC_RETURN_IF_ERROR(CheckF32Rank(op, in[0], 0, In(0, "a")));
  for (size_t i = 1; i < in.size(); ++i) {
    DC_RETURN_IF_ERROR(CheckF32Shape(op, in[i], in[0].shape, In(i, "b")));
  }
  DC_RETURN_IF_ERROR(CheckF32Shape(op, out[0], in[0].shape, Out(0, "sum")));
  const int64_t n = in[0].NumElements();
  float* y = out[0].f32;
  // y may alias an input. Pairwise adds into y are safe unless y is an input after the second.
  bool aliases_later_input = false;
  for (size_t j = 2; j < in.size(); ++j) aliases_later_input |= in[j].f32 == y;
  if (!aliases_later_input) {
    const simd::Kernels& k = simd::SimdKernels();
    k.add(in[0].f32, in[1].f32, y, n);
    for (size_t j = 2; j < in.size(); ++j) k.add(y, in[j].f32, y, n);
    return Status::Ok();
  }
  for (int64_t i = 0; i < n; ++i) {  // read every input at i before writing y[i]
    float sum = in[0].f32[i];
    for (size_t j = 1; j < in.size(); ++j) sum += in[j].f32[i];
    y[i] = sum;
  }
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------------
// cross_entropy

Status CheckCrossEntropy(const proto::Op& op, const TensorRef& logits, const TensorRef& targets,
                         int64_t* rows, int64_t* vocab) {
  DC_RETURN_IF_ERROR(CheckF32Rank(op, logits, 1, In(0, "logits")));
  DC_RETURN_IF_ERROR(CheckI32(op, targets, In(1, "targets")));
  DC_RETURN_IF_ERROR(CheckShape(op, targets, DropLast(logits.shape), In(1, "targets")));
  *vocab = logits.shape.back();
  *rows = targets.NumElements();
  for (int64_t r = 0; r < *rows; ++r) {
    if (targets.i32[r] < 0 || targets.i32[r] >= *vocab) {
      return OpError(op, "target " + std::to_string(targets.i32[r]) + " at " + std::to_string(r) +
                             " is outside the vocabulary of " + std::to_string(*vocab));
    }
  }
  return Status::Ok();
}

// log(sum(exp(row))), stably: fp32 exps and partial sums, the log in double.
double LogSumExp(const float* row, int64_t n) {
  const simd::Kernels& k = simd::SimdKernels();
  const float max = k.max_value(row, n);
  return static_cast<double>(max) + std::log(static_cast<double>(k.sum_exp(row, n, max)));
}

Status CrossEntropy(const proto::Op& op, Refs in, Refs out, const KernelContext&) {
  DC_RETURN_IF_ERROR(CheckArity(op, in, out, 2, 1));
  int64_t rows = 0, vocab = 0;
  DC_RETURN_IF_ERROR(CheckCrossEntropy(op, in[0], in[1], &rows, &vocab));
  DC_RETURN_IF_ERROR(CheckF32Shape(op, out[0], {1}, Out(0, "loss")));
  double loss = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = in[0].f32 + r * vocab;
    loss += LogSumExp(row, vocab) - row[in[1].i32[r]];
  }
  out[0].f32[0] = static_cast<float>(loss);
  return Status::Ok();
}

Status CrossEntropyBackward(const proto::Op& op, Refs in, Refs out, const KernelContext& context) {
  DC_RETURN_IF_ERROR(CheckArity(op, in, out, 2, 1));
  int64_t rows = 0, vocab = 0;
  DC_RETURN_IF_ERROR(CheckCrossEntropy(op, in[0], in[1], &rows, &vocab));
  DC_RETURN_IF_ERROR(CheckF32Shape(op, out[0], in[0].shape, Out(0, "dlogits")));
  // softmax(row) * scale - scale * onehot(target): one exp per logit, written as it is summed,
  // then one scaling pass (the log-sum-exp is not recomputed).
  const float scale = static_cast<float>(context.grad_scale);
  const simd::Kernels& k = simd::SimdKernels();
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = in[0].f32 + r * vocab;
    float* grad = out[0].f32 + r * vocab;
    const float sum = k.exp_sum(row, grad, vocab, k.max_value(row, vocab));
    k.scale(grad, vocab, static_cast<float>(context.grad_scale / static_cast<double>(sum)));
    grad[in[1].i32[r]] -= scale;
  }
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------------
// adamw

struct AdamSettings {
  double lr, beta1, beta2, eps, weight_decay;
};

// The op's attrs, or the config's values where an attr is absent.
Status ReadAdamSettings(const proto::Op& op, const KernelContext& context, AdamSettings* s) {
  const proto::ModelConfig* c = context.config;
  struct Field {
    const char* attr;
    double config_value;
    double* out;
  };
  const Field fields[] = {
      {op_attr::kLr, c ? c->lr() : std::nan(""), &s->lr},
      {op_attr::kBeta1, c ? c->beta1() : std::nan(""), &s->beta1},
      {op_attr::kBeta2, c ? c->beta2() : std::nan(""), &s->beta2},
      {op_attr::kEps, c ? c->adam_eps() : std::nan(""), &s->eps},
      {op_attr::kWeightDecay, c ? c->weight_decay() : std::nan(""), &s->weight_decay},
  };
  for (const Field& f : fields) {
    *f.out = AttrFloat(op, f.attr, f.config_value);
    if (std::isnan(*f.out)) {
      return OpError(op, std::string("has no attr '") + f.attr + "' and no model config");
    }
  }
  if (context.adam_step < 1) {
    return OpError(op, "adam step " + std::to_string(context.adam_step) + " is not 1-based");
  }
  s->lr *= context.lr_scale;  // the op's lr is the schedule's peak
  return Status::Ok();
}

// The clipping coefficient from the global squared norm, in fp32 as clip_grad_norm_:
// min(1, max_norm / (sqrt(norm_squared) + kClipNormEpsilon)). The cuda backend's AdamWKernel
// computes the same on the device.
float ClipGradScale(float max_norm, float norm_squared) {
  const float coef = max_norm / (std::sqrt(norm_squared) + kClipNormEpsilon);
  return coef < 1.0f ? coef : 1.0f;
}

// With clipping, input 4 (the global squared norm, fp32 [1]) and a positive max_grad_norm.
Status AdamWGradScale(const proto::Op& op, Refs in, float* grad_scale) {
  *grad_scale = 1.0f;
  if (in.size() == 4) return Status::Ok();
  DC_RETURN_IF_ERROR(CheckF32Shape(op, in[4], {1}, In(4, "norm_squared")));
  const double max_norm = AttrFloat(op, op_attr::kMaxGradNorm, 0);
  if (!(std::isfinite(max_norm) && max_norm > 0)) {
    return OpError(op, std::string("reads the grads' norm but its attr '") + op_attr::kMaxGradNorm +
                           "' is not a positive number");
  }
  *grad_scale = ClipGradScale(static_cast<float>(max_norm), in[4].f32[0]);
  return Status::Ok();
}

Status AdamW(const proto::Op& op, Refs in, Refs out, const KernelContext& context) {
  if (in.size() != 5) DC_RETURN_IF_ERROR(CheckArity(op, in, out, 4, 0));
  if (in.size() == 5) DC_RETURN_IF_ERROR(CheckArity(op, in, out, 5, 0));
  const char* names[] = {"param", "grad", "m", "v"};
  for (size_t i = 0; i < 4; ++i) {
    DC_RETURN_IF_ERROR(CheckF32(op, in[i], In(i, names[i])));
    if (in[i].NumElements() != in[0].NumElements()) {
      return OpError(op, In(i, names[i]).Label() + " has " + std::to_string(in[i].NumElements()) +
                             " elements, param has " + std::to_string(in[0].NumElements()));
    }
  }
  AdamSettings s{};
  DC_RETURN_IF_ERROR(ReadAdamSettings(op, context, &s));
  const double step = static_cast<double>(context.adam_step);
  const double m_correction = 1.0 / (1.0 - std::pow(s.beta1, step));
  const double v_correction = 1.0 / (1.0 - std::pow(s.beta2, step));
  // The constants in double, the pass in fp32 (as PyTorch's fp32 AdamW).
  simd::AdamCoefficients c = {
      static_cast<float>(s.beta1),
      static_cast<float>(s.beta2),
      static_cast<float>(1.0 - s.beta1),
      static_cast<float>(1.0 - s.beta2),
      static_cast<float>(m_correction),
      static_cast<float>(v_correction),
      static_cast<float>(s.eps),
      static_cast<float>(s.lr),
      static_cast<float>(1.0 - s.lr * s.weight_decay),
  };
  DC_RETURN_IF_ERROR(AdamWGradScale(op, in, &c.grad_scale));
  simd::SimdKernels().adamw(in[0].f32, in[1].f32, in[2].f32, in[3].f32, in[0].NumElements(), c);
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------------
// grad_norm_squared

// Each input's squares summed in double, in input order, then rounded once: a rank's partial.
Status GradNormSquared(const proto::Op& op, Refs in, Refs out, const KernelContext& /*context*/) {
  if (in.empty() || out.size() != 1) {
    return OpError(op, "expects one or more inputs and 1 output, got " + std::to_string(in.size()) +
                           " and " + std::to_string(out.size()));
  }
  DC_RETURN_IF_ERROR(CheckF32Shape(op, out[0], {1}, Out(0, "norm_squared")));
  double sum = 0;
  for (size_t i = 0; i < in.size(); ++i) {
    DC_RETURN_IF_ERROR(CheckF32(op, in[i], In(i, "grad")));
    const float* g = in[i].f32;
    const int64_t n = in[i].NumElements();
    for (int64_t k = 0; k < n; ++k) sum += static_cast<double>(g[k]) * g[k];
  }
  out[0].f32[0] = static_cast<float>(sum);
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------------
// mixture of experts

Status CheckNonNegativeFloatAttr(const proto::Op& op, const char* name, double* value) {
  *value = AttrFloat(op, name, 0);
  if (!(*value >= 0)) return OpError(op, std::string("attr '") + name + "' must not be negative");
  return Status::Ok();
}

// The routing tensor `experts` [..., k] of `tokens` rows and its layout over `num_experts`.
Status CheckRouting(const proto::Op& op, const TensorRef& experts, const Operand& what,
                    int64_t num_experts, MoeLayout* layout) {
  DC_RETURN_IF_ERROR(CheckI32(op, experts, what));
  if (experts.shape.empty()) return OpError(op, what.Label() + " has no dimensions");
  int64_t bad = -1;
  auto made = MakeMoeLayout(experts.i32, experts.NumElements(), num_experts, &bad);
  if (!made) {
    return OpError(op, what.Label() + " names expert " + std::to_string(experts.i32[bad]) +
                           " at slot " + std::to_string(bad) + ", outside the " +
                           std::to_string(num_experts) + " experts");
  }
  *layout = std::move(*made);
  return Status::Ok();
}

// softmax(row) in double.
void SoftmaxRow(const float* row, int64_t n, std::vector<double>* p) {
  const float max = *std::max_element(row, row + n);
  double sum = 0;
  p->resize(n);
  for (int64_t i = 0; i < n; ++i) sum += (*p)[i] = std::exp(static_cast<double>(row[i] - max));
  for (int64_t i = 0; i < n; ++i) (*p)[i] /= sum;
}

struct RouterDims {
  int64_t tokens = 0, experts = 0, top_k = 0;
  double aux_coef = 0;
};

Status CheckRouter(const proto::Op& op, const TensorRef& logits, size_t index, RouterDims* d) {
  DC_RETURN_IF_ERROR(CheckF32Rank(op, logits, 1, In(index, "logits")));
  d->experts = logits.shape.back();
  d->tokens = logits.NumElements() / d->experts;
  DC_RETURN_IF_ERROR(RequireIntAttr(op, op_attr::kTopK, &d->top_k));
  if (d->top_k > d->experts) {
    return OpError(op, "top_k " + std::to_string(d->top_k) + " is more than the " +
                           std::to_string(d->experts) + " experts");
  }
  return CheckNonNegativeFloatAttr(op, op_attr::kAuxCoef, &d->aux_coef);
}

Status MoeRouter(const proto::Op& op, Refs in, Refs out, const KernelContext&) {
  DC_RETURN_IF_ERROR(CheckArity(op, in, out, 1, 3));
  const TensorRef &logits = in[0], &gates = out[0], &experts = out[1], &aux = out[2];
  RouterDims d;
  DC_RETURN_IF_ERROR(CheckRouter(op, logits, 0, &d));
  const Shape choice_shape = WithLast(logits.shape, d.top_k);
  DC_RETURN_IF_ERROR(CheckF32Shape(op, gates, choice_shape, Out(0, "gates")));
  DC_RETURN_IF_ERROR(CheckI32(op, experts, Out(1, "experts")));
  DC_RETURN_IF_ERROR(CheckShape(op, experts, choice_shape, Out(1, "experts")));
  DC_RETURN_IF_ERROR(CheckF32Shape(op, aux, {1}, Out(2, "aux_loss")));
  std::vector<double> p, prob_sum(d.experts, 0.0);
  std::vector<int64_t> count(d.experts, 0);
  std::vector<char> taken(d.experts);
  for (int64_t t = 0; t < d.tokens; ++t) {
    SoftmaxRow(logits.f32 + t * d.experts, d.experts, &p);
    for (int64_t e = 0; e < d.experts; ++e) prob_sum[e] += p[e];
    std::fill(taken.begin(), taken.end(), 0);
    double chosen_sum = 0;
    int32_t* ids = experts.i32 + t * d.top_k;
    for (int64_t j = 0; j < d.top_k; ++j) {
      int64_t best = -1;
      for (int64_t e = 0; e < d.experts; ++e) {
        if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;
      }
      taken[best] = 1;
      ids[j] = static_cast<int32_t>(best);
      chosen_sum += p[best];
      ++count[best];
    }
    for (int64_t j = 0; j < d.top_k; ++j) {
      gates.f32[t * d.top_k + j] = static_cast<float>(p[ids[j]] / chosen_sum);
    }
  }
  // M * aux_coef * E * sum_e (count_e / M) * (prob_sum_e / M): the layer's loss in sum scale.
  double balance = 0;
  for (int64_t e = 0; e < d.experts; ++e) balance += static_cast<double>(count[e]) * prob_sum[e];
  aux.f32[0] = static_cast<float>(d.aux_coef * static_cast<double>(d.experts) * balance /
                                  static_cast<double>(d.tokens));
  return Status::Ok();
}

Status MoeRouterBackward(const proto::Op& op, Refs in, Refs out, const KernelContext& context) {
  DC_RETURN_IF_ERROR(CheckArity(op, in, out, 3, 1));
  const TensorRef &dgates = in[0], &logits = in[1], &experts = in[2], &dlogits = out[0];
  RouterDims d;
  DC_RETURN_IF_ERROR(CheckRouter(op, logits, 1, &d));
  const Shape choice_shape = WithLast(logits.shape, d.top_k);
  DC_RETURN_IF_ERROR(CheckF32Shape(op, dgates, choice_shape, In(0, "dgates")));
  DC_RETURN_IF_ERROR(CheckShape(op, experts, choice_shape, In(2, "experts")));
  MoeLayout layout;
  DC_RETURN_IF_ERROR(CheckRouting(op, experts, In(2, "experts"), d.experts, &layout));
  DC_RETURN_IF_ERROR(CheckF32Shape(op, dlogits, logits.shape, Out(0, "dlogits")));
  // d(loss)/dp[t, e] from the balancing term: grad_scale * aux_coef * E * count_e / M.
  std::vector<double> balance_grad(d.experts);
  for (int64_t e = 0; e < d.experts; ++e) {
    const double count = static_cast<double>(layout.offsets[e + 1] - layout.offsets[e]);
    balance_grad[e] = context.grad_scale * d.aux_coef * static_cast<double>(d.experts) * count /
                      static_cast<double>(d.tokens);
  }
  std::vector<double> p, dp(d.experts);
  for (int64_t t = 0; t < d.tokens; ++t) {
    SoftmaxRow(logits.f32 + t * d.experts, d.experts, &p);
    dp = balance_grad;
    const int32_t* ids = experts.i32 + t * d.top_k;
    const float* dg = dgates.f32 + t * d.top_k;
    // gates_j = p[e_j] / S: dp[e_i] += (dg_i - sum_j dg_j gates_j) / S.
    double chosen_sum = 0;
    for (int64_t j = 0; j < d.top_k; ++j) chosen_sum += p[ids[j]];
    double weighted = 0;
    for (int64_t j = 0; j < d.top_k; ++j) weighted += dg[j] * p[ids[j]] / chosen_sum;
    for (int64_t j = 0; j < d.top_k; ++j) dp[ids[j]] += (dg[j] - weighted) / chosen_sum;
    double dot = 0;
    for (int64_t e = 0; e < d.experts; ++e) dot += p[e] * dp[e];
    float* row = dlogits.f32 + t * d.experts;
    for (int64_t e = 0; e < d.experts; ++e) row[e] = static_cast<float>(p[e] * (dp[e] - dot));
  }
  return Status::Ok();
}

// Checks a token-side tensor [..., H] against `experts` [..., k]; sets the rows, width and k.
Status CheckTokenSide(const proto::Op& op, const TensorRef& x, const Operand& x_what,
                      const TensorRef& experts, const Operand& experts_what, int64_t* tokens,
                      int64_t* width, int64_t* top_k) {
  DC_RETURN_IF_ERROR(CheckF32Rank(op, x, 1, x_what));
  DC_RETURN_IF_ERROR(CheckI32(op, experts, experts_what));
  *width = x.shape.back();
  *tokens = x.NumElements() / *width;
  if (experts.shape.empty() || DropLast(experts.shape) != DropLast(x.shape)) {
    return OpError(op, experts_what.Label() + " has shape " + ShapeString(experts.shape) +
                           ", expected " + ShapeString(WithLast(x.shape, 0)) + " with k last");
  }
  *top_k = experts.shape.back();
  return Status::Ok();
}

// Checks a dispatch or its backward: the token side x [..., H], experts (input 1) and the
// expert-major side [M * k, H]; sets the dims and the layout.
Status CheckDispatch(const proto::Op& op, const TensorRef& x, const Operand& x_what,
                     const TensorRef& experts, const TensorRef& rows, const Operand& rows_what,
                     int64_t* tokens, int64_t* hidden, int64_t* top_k, MoeLayout* layout) {
  DC_RETURN_IF_ERROR(
      CheckTokenSide(op, x, x_what, experts, In(1, "experts"), tokens, hidden, top_k));
  int64_t num_experts = 0;
  DC_RETURN_IF_ERROR(RequireIntAttr(op, op_attr::kExperts, &num_experts));
  DC_RETURN_IF_ERROR(CheckRouting(op, experts, In(1, "experts"), num_experts, layout));
  return CheckF32Shape(op, rows, {*tokens * *top_k, *hidden}, rows_what);
}

Status MoeDispatch(const proto::Op& op, Refs in, Refs out, const KernelContext&) {
  DC_RETURN_IF_ERROR(CheckArity(op, in, out, 2, 1));
  const TensorRef &x = in[0], &experts = in[1], &xs = out[0];
  int64_t tokens = 0, hidden = 0, top_k = 0;
  MoeLayout layout;
  DC_RETURN_IF_ERROR(CheckDispatch(op, x, In(0, "x"), experts, xs, Out(0, "xs"), &tokens, &hidden,
                                   &top_k, &layout));
  for (int64_t s = 0; s < tokens * top_k; ++s) {
    std::copy_n(x.f32 + (s / top_k) * hidden, hidden, xs.f32 + layout.row[s] * hidden);
  }
  return Status::Ok();
}

Status MoeDispatchBackward(const proto::Op& op, Refs in, Refs out, const KernelContext&) {
  DC_RETURN_IF_ERROR(CheckArity(op, in, out, 2, 1));
  const TensorRef &dxs = in[0], &experts = in[1], &dx = out[0];
  int64_t tokens = 0, hidden = 0, top_k = 0;
  MoeLayout layout;
  DC_RETURN_IF_ERROR(CheckDispatch(op, dx, Out(0, "dx"), experts, dxs, In(0, "dxs"), &tokens,
                                   &hidden, &top_k, &layout));
  for (int64_t t = 0; t < tokens; ++t) {
    float* row = dx.f32 + t * hidden;
    std::copy_n(dxs.f32 + layout.row[t * top_k] * hidden, hidden, row);
    for (int64_t j = 1; j < top_k; ++j) {
      const float* src = dxs.f32 + layout.row[t * top_k + j] * hidden;
      for (int64_t h = 0; h < hidden; ++h) row[h] += src[h];
    }
  }
  return Status::Ok();
}

// Checks x [R, K] (input `x_index`), experts (the next input, R ids) and the E weights after
// it, all [N, K]; sets the dims and the layout.
Status CheckGroupedMatmul(const proto::Op& op, Refs in, size_t x_index, int64_t* rows, int64_t* n,
                          int64_t* k, MoeLayout* layout) {
  const size_t first_weight = x_index + 2;
  if (in.size() < first_weight + 1) {
    return OpError(op, "expects x, experts and at least one expert weight");
  }
  const TensorRef &x = in[x_index], &experts = in[x_index + 1];
  DC_RETURN_IF_ERROR(CheckF32Rank(op, x, 2, In(x_index, "x"), 2));
  DC_RETURN_IF_ERROR(CheckF32Rank(op, in[first_weight], 2, In(first_weight, "w_0"), 2));
  *rows = x.shape[0];
  *k = x.shape[1];
  *n = in[first_weight].shape[0];
  for (size_t i = first_weight; i < in.size(); ++i) {
    DC_RETURN_IF_ERROR(CheckF32Shape(op, in[i], {*n, *k}, In(i, "w")));
  }
  DC_RETURN_IF_ERROR(CheckRouting(op, experts, In(x_index + 1, "experts"),
                                  static_cast<int64_t>(in.size() - first_weight), layout));
  if (experts.NumElements() != *rows) {
    return OpError(op, In(x_index + 1, "experts").Label() + " routes " +
                           std::to_string(experts.NumElements()) + " slots for " +
                           std::to_string(*rows) + " rows of x");
  }
  return CheckBlasDims(op, {*rows, *n, *k});
}

Status GroupedMatmul(const proto::Op& op, Refs in, Refs out, const KernelContext&) {
  if (out.size() != 1) return OpError(op, "expects 1 output, got " + std::to_string(out.size()));
  int64_t rows = 0, n = 0, k = 0;
  MoeLayout layout;
  DC_RETURN_IF_ERROR(CheckGroupedMatmul(op, in, 0, &rows, &n, &k, &layout));
  const TensorRef& x = in[0];
  DC_RETURN_IF_ERROR(CheckF32Shape(op, out[0], {rows, n}, Out(0, "y")));
  const int64_t num_experts = static_cast<int64_t>(layout.offsets.size()) - 1;
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t begin = layout.offsets[e], count = layout.offsets[e + 1] - begin;
    if (count == 0) continue;
    Gemm(false, true, count, n, k, 1.0f, x.f32 + begin * k, k, in[2 + e].f32, k, 0.0f,
         out[0].f32 + begin * n, n);
  }
  return Status::Ok();
}

Status GroupedMatmulBackward(const proto::Op& op, Refs in, Refs out, const KernelContext&) {
  int64_t rows = 0, n = 0, k = 0;
  MoeLayout layout;
  DC_RETURN_IF_ERROR(CheckGroupedMatmul(op, in, 1, &rows, &n, &k, &layout));
  const int64_t num_experts = static_cast<int64_t>(layout.offsets.size()) - 1;
  if (static_cast<int64_t>(out.size()) != 1 + num_experts) {
    return OpError(op, "expects " + std::to_string(1 + num_experts) +
                           " outputs (dx and one dW per expert), got " +
                           std::to_string(out.size()));
  }
  const TensorRef &dy = in[0], &x = in[1];
  DC_RETURN_IF_ERROR(CheckF32Shape(op, dy, {rows, n}, In(0, "dy")));
  DC_RETURN_IF_ERROR(CheckF32Shape(op, out[0], {rows, k}, Out(0, "dx")));
  for (int64_t e = 0; e < num_experts; ++e) {
    const TensorRef& dw = out[1 + e];
    DC_RETURN_IF_ERROR(CheckF32Shape(op, dw, {n, k}, Out(1 + e, "dw")));
    const int64_t begin = layout.offsets[e], count = layout.offsets[e + 1] - begin;
    if (count == 0) {
      std::fill_n(dw.f32, n * k, 0.0f);
      continue;
    }
    Gemm(false, false, count, k, n, 1.0f, dy.f32 + begin * n, n, in[3 + e].f32, k, 0.0f,
         out[0].f32 + begin * k, k);
    Gemm(true, false, n, k, count, 1.0f, dy.f32 + begin * n, n, x.f32 + begin * k, k, 0.0f, dw.f32,
         k);
  }
  return Status::Ok();
}

// Checks ys [M * k, H], gates f32 [..., k] and experts i32 [..., k] (inputs from `first`).
Status CheckCombine(const proto::Op& op, Refs in, size_t first, int64_t* tokens, int64_t* hidden,
                    int64_t* top_k, MoeLayout* layout) {
  const TensorRef &ys = in[first], &gates = in[first + 1], &experts = in[first + 2];
  DC_RETURN_IF_ERROR(CheckF32Rank(op, ys, 2, In(first, "ys"), 2));
  DC_RETURN_IF_ERROR(CheckF32Rank(op, gates, 1, In(first + 1, "gates")));
  DC_RETURN_IF_ERROR(CheckShape(op, experts, gates.shape, In(first + 2, "experts")));
  int64_t num_experts = 0;
  DC_RETURN_IF_ERROR(RequireIntAttr(op, op_attr::kExperts, &num_experts));
  DC_RETURN_IF_ERROR(CheckRouting(op, experts, In(first + 2, "experts"), num_experts, layout));
  *top_k = gates.shape.back();
  *tokens = gates.NumElements() / *top_k;
  *hidden = ys.shape[1];
  return CheckShape(op, ys, {*tokens * *top_k, *hidden}, In(first, "ys"));
}

Status MoeCombine(const proto::Op& op, Refs in, Refs out, const KernelContext&) {
  DC_RETURN_IF_ERROR(CheckArity(op, in, out, 3, 1));
  int64_t tokens = 0, hidden = 0, top_k = 0;
  MoeLayout layout;
  DC_RETURN_IF_ERROR(CheckCombine(op, in, 0, &tokens, &hidden, &top_k, &layout));
  const TensorRef &ys = in[0], &gates = in[1], &y = out[0];
  DC_RETURN_IF_ERROR(CheckF32Shape(op, y, WithLast(gates.shape, hidden), Out(0, "y")));
  for (int64_t t = 0; t < tokens; ++t) {
    float* row = y.f32 + t * hidden;
    std::fill_n(row, hidden, 0.0f);
    for (int64_t j = 0; j < top_k; ++j) {
      const float g = gates.f32[t * top_k + j];
      const float* src = ys.f32 + layout.row[t * top_k + j] * hidden;
      for (int64_t h = 0; h < hidden; ++h) row[h] += g * src[h];
    }
  }
  return Status::Ok();
}

Status MoeCombineBackward(const proto::Op& op, Refs in, Refs out, const KernelContext&) {
  DC_RETURN_IF_ERROR(CheckArity(op, in, out, 4, 2));
  int64_t tokens = 0, hidden = 0, top_k = 0;
  MoeLayout layout;
  DC_RETURN_IF_ERROR(CheckCombine(op, in, 1, &tokens, &hidden, &top_k, &layout));
  const TensorRef &dy = in[0], &ys = in[1], &gates = in[2], &dys = out[0], &dgates = out[1];
  DC_RETURN_IF_ERROR(CheckF32Shape(op, dy, WithLast(gates.shape, hidden), In(0, "dy")));
  DC_RETURN_IF_ERROR(CheckF32Shape(op, dys, ys.shape, Out(0, "dys")));
  DC_RETURN_IF_ERROR(CheckF32Shape(op, dgates, gates.shape, Out(1, "dgates")));
  for (int64_t s = 0; s < tokens * top_k; ++s) {
    const float* dyr = dy.f32 + (s / top_k) * hidden;
    const float* src = ys.f32 + layout.row[s] * hidden;
    float* dst = dys.f32 + layout.row[s] * hidden;
    const float g = gates.f32[s];
    double dot = 0;
    for (int64_t h = 0; h < hidden; ++h) {
      dst[h] = g * dyr[h];
      dot += static_cast<double>(dyr[h]) * src[h];
    }
    dgates.f32[s] = static_cast<float>(dot);
  }
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------------
// Dispatch

using Kernel = Status (*)(const proto::Op&, Refs, Refs, const KernelContext&);

// Indexed by OpKind: one kernel per row of DC_OP_KINDS, the function named as the row's id.
constexpr Kernel kKernels[] = {
#define DC_CPU_KERNEL(id, name, math) id,
    DC_OP_KINDS(DC_CPU_KERNEL)
#undef DC_CPU_KERNEL
};
static_assert(std::size(kKernels) == kNumOpKinds);

}  // namespace

Status RunCpuOp(const proto::Op& op, std::span<TensorRef> inputs, std::span<TensorRef> outputs,
                const KernelContext& context) {
  const std::optional<OpKind> kind = FindOpKind(op.kind());
  if (!kind) return OpError(op, "the CPU backend has no kernel for this kind");
  UseBlasThreads(context.num_threads);
  return kKernels[static_cast<size_t>(*kind)](op, inputs, outputs, context);
}

std::string BlasCore() {
  const char* name = openblas_get_corename();
  return name ? name : "unknown";
}

std::string BlasCoreWarning() {
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return "";
  // OpenBLAS's x86-64 kernels with AVX2 and FMA.
  std::string core = BlasCore();
  for (char& c : core) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  for (const char* modern :
       {"haswell", "zen", "excavator", "skylakex", "cooperlake", "sapphirerapids"}) {
    if (core == modern) return "";
  }
  const char* ask = __builtin_cpu_supports("avx512f") ? "SkylakeX" : "Haswell";
  return "OpenBLAS chose its " + BlasCore() + " kernels on a CPU with AVX2 and FMA" +
         (__builtin_cpu_supports("avx512f") ? " (and AVX-512)" : "") +
         ": it does not know this CPU model, and its matrix products run several times slower "
         "than the CPU can; set OPENBLAS_CORETYPE=" +
         ask + " to use its " + ask + " kernels";
}

}  // namespace dc
