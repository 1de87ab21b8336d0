// The CUDA kernels' own source (kernels.cuh, attention.cuh, moe.cuh), compiled for the host
// emulator (kernel_emulator.h) and compared with the CPU backend op by op, in fp32, bf16 and fp16.
// This checks the kernels' indexing, tiling, masking, reductions and barriers on any machine; the
// GPU test (cuda_kernels_test.cc) checks the same on a device, with cuBLASLt and NCCL.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <numeric>
#include <random>

#include "executor/cpu_kernels.h"
#include "executor/cuda/attention.cuh"
#include "executor/cuda/kernels.cuh"
#include "executor/cuda/moe.cuh"
#include "executor/moe_layout.h"
#include "schemas/op_kinds.h"

namespace dc {
namespace {

namespace ck = cuda_kernels;
using Shape = std::vector<int64_t>;

constexpr double kF32Tolerance = 1e-4;
constexpr double kBF16Tolerance = 2e-2;

int64_t Count(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// Values in a storage type, as raw bytes (the "device" buffer of the emulator).
std::vector<unsigned char> Encode(const std::vector<float>& values, ck::FloatType type) {
  std::vector<unsigned char> bytes;
  auto put = [&](auto v) {
    const auto* p = reinterpret_cast<const unsigned char*>(&v);
    bytes.insert(bytes.end(), p, p + sizeof(v));
  };
  for (float v : values) {
    switch (type) {
      case ck::FloatType::kF32:
        put(v);
        break;
      case ck::FloatType::kBF16:
        put(__float2bfloat16(v));
        break;
      case ck::FloatType::kF16:
        put(__float2half(v));
        break;
    }
  }
  return bytes;
}

std::vector<float> Decode(const std::vector<unsigned char>& bytes, ck::FloatType type) {
  std::vector<float> values;
  switch (type) {
    case ck::FloatType::kF32:
      values.resize(bytes.size() / 4);
      std::memcpy(values.data(), bytes.data(), bytes.size());
      break;
    case ck::FloatType::kBF16:
      for (size_t i = 0; i < bytes.size(); i += 2) {
        __nv_bfloat16 v;
        std::memcpy(&v, &bytes[i], 2);
        values.push_back(__bfloat162float(v));
      }
      break;
    case ck::FloatType::kF16:
      for (size_t i = 0; i < bytes.size(); i += 2) {
        __half v;
        std::memcpy(&v, &bytes[i], 2);
        values.push_back(__half2float(v));
      }
      break;
  }
  return values;
}

int64_t ElementBytes(ck::FloatType type) { return type == ck::FloatType::kF32 ? 4 : 2; }

// A float tensor on both sides: `ref` (fp32, as the CPU backend sees it) and `dev` (the storage
// type, as the kernels see it). Inputs are rounded to the storage type first, so both sides start
// from the same values.
struct Tensor {
  Shape shape;
  std::vector<float> ref;
  std::vector<unsigned char> dev;

  TensorRef Ref() {
    TensorRef r;
    r.shape = shape;
    r.f32 = ref.data();
    return r;
  }
  void* Dev() { return dev.data(); }
};

Tensor Random(Shape shape, ck::FloatType type, std::mt19937* rng, float std_dev = 1.0f) {
  std::normal_distribution<float> dist(0.0f, std_dev);
  std::vector<float> values(Count(shape));
  for (float& v : values) v = dist(*rng);
  Tensor t;
  t.shape = std::move(shape);
  t.dev = Encode(values, type);
  t.ref = Decode(t.dev, type);
  return t;
}

Tensor Zeros(Shape shape, ck::FloatType type) {
  Tensor t;
  t.shape = std::move(shape);
  t.ref.assign(Count(t.shape), 0.0f);
  // Output buffers start as NaN bytes so that an element the kernel forgets shows up.
  t.dev.assign(Count(t.shape) * ElementBytes(type), 0xFF);
  return t;
}

struct Ints {
  Shape shape;
  std::vector<int32_t> values;
  TensorRef Ref() {
    TensorRef r;
    r.shape = shape;
    r.i32 = values.data();
    return r;
  }
};

Ints RandomInts(Shape shape, int32_t bound, std::mt19937* rng) {
  Ints t;
  t.shape = std::move(shape);
  std::uniform_int_distribution<int32_t> dist(0, bound - 1);
  t.values.resize(Count(t.shape));
  for (int32_t& v : t.values) v = dist(*rng);
  return t;
}

proto::Op MakeOp(const std::string& kind, const std::map<std::string, int64_t>& ints = {},
                 const std::map<std::string, double>& floats = {}) {
  proto::Op op;
  op.set_name("test." + kind);
  op.set_kind(kind);
  for (const auto& [name, value] : ints) SetAttr(&op, name, value);
  for (const auto& [name, value] : floats) SetAttrFloat(&op, name, value);
  return op;
}

void RunCpu(const proto::Op& op, std::vector<TensorRef> in, std::vector<TensorRef> out,
            const KernelContext& context = {}) {
  const Status status = RunCpuOp(op, in, out, context);
  ASSERT_TRUE(status.ok()) << status.message();
}

// max |got - want| <= tolerance * max |want| (relative to the tensor's scale).
void ExpectClose(const Tensor& got_tensor, ck::FloatType type, double tolerance,
                 const std::string& what) {
  const std::vector<float> got = Decode(got_tensor.dev, type);
  const std::vector<float>& want = got_tensor.ref;
  ASSERT_EQ(got.size(), want.size()) << what;
  double scale = 0, worst = 0;
  size_t worst_at = 0;
  for (size_t i = 0; i < want.size(); ++i) scale = std::max(scale, std::abs(double{want[i]}));
  for (size_t i = 0; i < want.size(); ++i) {
    const double diff = std::abs(double{got[i]} - double{want[i]});
    if (!(diff <= worst)) {  // NaN counts as the worst
      worst = std::isnan(diff) ? INFINITY : diff;
      worst_at = i;
    }
  }
  EXPECT_LE(worst, tolerance * std::max(scale, 1e-30))
      << what << ": element " << worst_at << " is " << got[worst_at] << ", expected "
      << want[worst_at] << " (tensor scale " << scale << ")";
}

void ExpectOk(cudaError_t e) { ASSERT_EQ(e, cudaSuccess) << "cudaError_t " << static_cast<int>(e); }

double Tolerance(ck::FloatType type) {
  return type == ck::FloatType::kF32 ? kF32Tolerance : kBF16Tolerance;
}

class Emulated : public ::testing::TestWithParam<ck::FloatType> {
 protected:
  ck::FloatType type() const { return GetParam(); }
  double tolerance() const { return Tolerance(GetParam()); }
  std::mt19937 rng_{1234};
  int32_t device_error_[ck::kDeviceErrorInts] = {};
};

const char* TypeName(ck::FloatType type) {
  switch (type) {
    case ck::FloatType::kF32:
      return "F32";
    case ck::FloatType::kBF16:
      return "BF16";
    case ck::FloatType::kF16:
      return "F16";
  }
  return "?";
}

INSTANTIATE_TEST_SUITE_P(Types, Emulated,
                         ::testing::Values(ck::FloatType::kF32, ck::FloatType::kBF16,
                                           ck::FloatType::kF16),
                         [](const auto& info) { return std::string(TypeName(info.param)); });

TEST_P(Emulated, Embedding) {
  const int64_t vocab = 11;
  for (const int64_t hidden : {24, 5}) {  // 16-byte row copies, then element copies
    SCOPED_TRACE("hidden " + std::to_string(hidden));
    Tensor table = Random({vocab, hidden}, type(), &rng_);
    Ints tokens = RandomInts({3, 7}, vocab, &rng_);
    tokens.values[4] = tokens.values[0];  // repeats for the backward
    tokens.values[20] = tokens.values[0];
    Tensor y = Zeros({3, 7, hidden}, type());
    RunCpu(MakeOp(op_kind::kEmbedding), {tokens.Ref(), table.Ref()}, {y.Ref()});
    ExpectOk(ck::Embedding(type(), tokens.values.data(), 21, table.Dev(), vocab, hidden, y.Dev(),
                           device_error_, nullptr));
    ExpectClose(y, type(), 0, "y");

    Tensor dy = Random({3, 7, hidden}, type(), &rng_);
    Tensor dtable = Zeros({vocab, hidden}, type());
    RunCpu(MakeOp(op_kind::kEmbeddingBackward), {dy.Ref(), tokens.Ref()}, {dtable.Ref()});
    std::vector<int32_t> links(ck::EmbeddingBackwardScratchInts(21));
    ExpectOk(ck::EmbeddingBackward(type(), dy.Dev(), tokens.values.data(), 21, vocab, hidden,
                                   dtable.Dev(), links.data(), device_error_, nullptr));
    // fp32: the same additions in the same order as the CPU backend, so bit for bit.
    ExpectClose(dtable, type(), type() == ck::FloatType::kF32 ? 0 : tolerance(), "dtable");
  }
  EXPECT_EQ(device_error_[0], ck::kNoDeviceError);
}

TEST_P(Emulated, EmbeddingRecordsBadTokens) {
  Tensor table = Random({5, 8}, type(), &rng_);
  std::vector<int32_t> tokens = {1, 7, 2};
  Tensor y = Zeros({3, 8}, type());
  ExpectOk(
      ck::Embedding(type(), tokens.data(), 3, table.Dev(), 5, 8, y.Dev(), device_error_, nullptr));
  EXPECT_EQ(device_error_[0], ck::kBadEmbeddingToken);
  EXPECT_EQ(device_error_[1], 1);  // position
  EXPECT_EQ(device_error_[2], 7);  // id
  EXPECT_EQ(device_error_[3], 5);  // vocabulary
}

TEST_P(Emulated, RmsNorm) {
  const int64_t rows = 150, hidden = 40;  // 3 row chunks in the dw reduction
  const proto::Op fwd = MakeOp(op_kind::kRmsNorm, {}, {{op_attr::kEps, 1e-5}});
  const proto::Op bwd = MakeOp(op_kind::kRmsNormBackward, {}, {{op_attr::kEps, 1e-5}});
  Tensor x = Random({3, 50, hidden}, type(), &rng_);
  Tensor w = Random({hidden}, type(), &rng_);
  Tensor y = Zeros(x.shape, type());
  RunCpu(fwd, {x.Ref(), w.Ref()}, {y.Ref()});
  ExpectOk(ck::RmsNorm(type(), x.Dev(), w.Dev(), rows, hidden, 1e-5f, y.Dev(), nullptr));
  ExpectClose(y, type(), tolerance(), "y");

  Tensor dy = Random(x.shape, type(), &rng_);
  Tensor dx = Zeros(x.shape, type()), dw = Zeros({hidden}, type());
  RunCpu(bwd, {dy.Ref(), x.Ref(), w.Ref()}, {dx.Ref(), dw.Ref()});
  std::vector<float> scratch(ck::RmsNormBackwardScratchFloats(rows, hidden));
  ExpectOk(ck::RmsNormBackward(type(), dy.Dev(), x.Dev(), w.Dev(), rows, hidden, 1e-5f, dx.Dev(),
                               dw.Dev(), scratch.data(), nullptr));
  ExpectClose(dx, type(), tolerance(), "dx");
  ExpectClose(dw, type(), tolerance(), "dw");
}

TEST_P(Emulated, Rope) {
  const int64_t heads = 3, head_dim = 10;
  const std::map<std::string, int64_t> ints = {{op_attr::kHeads, heads},
                                               {op_attr::kHeadDim, head_dim}};
  const std::map<std::string, double> floats = {{op_attr::kTheta, 1e4}};
  Tensor x = Random({2, 9, heads * head_dim}, type(), &rng_);
  for (const bool backward : {false, true}) {
    Tensor y = Zeros(x.shape, type());
    RunCpu(MakeOp(backward ? op_kind::kRopeBackward : op_kind::kRope, ints, floats), {x.Ref()},
           {y.Ref()});
    ExpectOk(ck::Rope(type(), x.Dev(), y.Dev(), 2, 9, heads, head_dim, 1e4, backward ? -1.0f : 1.0f,
                      nullptr));
    ExpectClose(y, type(), tolerance(), backward ? "dx" : "y");
  }
}

struct AttentionCase {
  int64_t batch, seq, heads, kv_heads, head_dim;
};

void CheckAttention(const AttentionCase& c, ck::FloatType type, std::mt19937* rng) {
  SCOPED_TRACE("batch " + std::to_string(c.batch) + " seq " + std::to_string(c.seq) + " heads " +
               std::to_string(c.heads) + " kv_heads " + std::to_string(c.kv_heads) + " head_dim " +
               std::to_string(c.head_dim));
  const std::map<std::string, int64_t> ints = {
      {op_attr::kHeads, c.heads}, {op_attr::kKvHeads, c.kv_heads}, {op_attr::kHeadDim, c.head_dim}};
  Tensor q = Random({c.batch, c.seq, c.heads * c.head_dim}, type, rng);
  Tensor k = Random({c.batch, c.seq, c.kv_heads * c.head_dim}, type, rng);
  Tensor v = Random(k.shape, type, rng);
  Tensor o = Zeros(q.shape, type);
  RunCpu(MakeOp(op_kind::kAttention, ints), {q.Ref(), k.Ref(), v.Ref()}, {o.Ref()});
  const ck::AttentionDims dims{c.batch, c.seq, c.heads, c.kv_heads, c.head_dim};
  // The 16-bit types take the tensor-core kernels where head_dim is a multiple of 16.
  EXPECT_EQ(ck::AttentionOnTensorCores(type, dims, {q.Dev(), k.Dev(), v.Dev(), o.Dev()}),
            type != ck::FloatType::kF32 && c.head_dim % 16 == 0 && c.head_dim <= 128);
  ExpectOk(ck::Attention(type, dims, q.Dev(), k.Dev(), v.Dev(), o.Dev(), nullptr));
  ExpectClose(o, type, Tolerance(type), "o");

  Tensor d_o = Random(q.shape, type, rng);
  Tensor dq = Zeros(q.shape, type), dk = Zeros(k.shape, type), dv = Zeros(v.shape, type);
  RunCpu(MakeOp(op_kind::kAttentionBackward, ints), {d_o.Ref(), q.Ref(), k.Ref(), v.Ref()},
         {dq.Ref(), dk.Ref(), dv.Ref()});
  std::vector<float> scratch(ck::AttentionBackwardScratchFloats(dims));
  ExpectOk(ck::AttentionBackward(type, dims, d_o.Dev(), q.Dev(), k.Dev(), v.Dev(), dq.Dev(),
                                 dk.Dev(), dv.Dev(), scratch.data(), nullptr));
  ExpectClose(dq, type, Tolerance(type), "dq");
  ExpectClose(dk, type, Tolerance(type), "dk");
  ExpectClose(dv, type, Tolerance(type), "dv");
}

TEST_P(Emulated, AttentionGroupedQuery) { CheckAttention({2, 37, 4, 2, 16}, type(), &rng_); }
// Several query and key tiles (64 and 32 rows), multi-query, head_dim below a warp.
TEST_P(Emulated, AttentionSeveralTiles) { CheckAttention({1, 139, 2, 1, 8}, type(), &rng_); }
// head_dim 72 runs the 128-wide kernels with partial column groups.
TEST_P(Emulated, AttentionWideHeads) { CheckAttention({1, 70, 2, 2, 72}, type(), &rng_); }
TEST_P(Emulated, AttentionWidestHeads) { CheckAttention({1, 33, 1, 1, 130}, type(), &rng_); }
// The tensor-core kernels (16-bit types): several 64-row tiles each way, a partial last tile,
// grouped queries, and the widest head they take.
TEST_P(Emulated, AttentionTensorCoreTiles) { CheckAttention({2, 139, 4, 2, 32}, type(), &rng_); }
TEST_P(Emulated, AttentionTensorCoreWideHeads) {
  CheckAttention({1, 70, 2, 1, 128}, type(), &rng_);
}

TEST_P(Emulated, Swiglu) {
  Tensor gate = Random({5, 67}, type(), &rng_), up = Random({5, 67}, type(), &rng_);
  Tensor y = Zeros(gate.shape, type());
  RunCpu(MakeOp(op_kind::kSwiglu), {gate.Ref(), up.Ref()}, {y.Ref()});
  ExpectOk(ck::Swiglu(type(), gate.Dev(), up.Dev(), y.Dev(), 5 * 67, nullptr));
  ExpectClose(y, type(), tolerance(), "y");
  Tensor dy = Random(gate.shape, type(), &rng_);
  Tensor dgate = Zeros(gate.shape, type()), dup = Zeros(gate.shape, type());
  RunCpu(MakeOp(op_kind::kSwigluBackward), {dy.Ref(), gate.Ref(), up.Ref()},
         {dgate.Ref(), dup.Ref()});
  ExpectOk(ck::SwigluBackward(type(), dy.Dev(), gate.Dev(), up.Dev(), dgate.Dev(), dup.Dev(),
                              5 * 67, nullptr));
  ExpectClose(dgate, type(), tolerance(), "dgate");
  ExpectClose(dup, type(), tolerance(), "dup");
}

TEST_P(Emulated, AddTwoAndMany) {
  for (const int count : {2, 11}) {  // 11 takes two passes
    std::vector<Tensor> inputs;
    std::vector<TensorRef> refs;
    std::vector<const void*> devs;
    for (int i = 0; i < count; ++i) inputs.push_back(Random({4, 33}, type(), &rng_));
    for (Tensor& t : inputs) {
      refs.push_back(t.Ref());
      devs.push_back(t.Dev());
    }
    Tensor y = Zeros({4, 33}, type());
    RunCpu(MakeOp(op_kind::kAdd), refs, {y.Ref()});
    ExpectOk(ck::AddN(type(), devs.data(), count, y.Dev(), 4 * 33, nullptr));
    ExpectClose(y, type(), type() == ck::FloatType::kF32 ? 0 : tolerance(), "sum");
  }
}

TEST_P(Emulated, CrossEntropy) {
  const int64_t vocab = 300;
  Tensor logits = Random({2, 5, vocab}, type(), &rng_, 3.0f);
  Ints targets = RandomInts({2, 5}, vocab, &rng_);
  Tensor loss;
  loss.shape = {1};
  loss.ref = {0.0f};
  RunCpu(MakeOp(op_kind::kCrossEntropy), {logits.Ref(), targets.Ref()}, {loss.Ref()});
  float device_loss = NAN;
  std::vector<double> row_losses(10);
  ExpectOk(ck::CrossEntropy(type(), logits.Dev(), targets.values.data(), 10, vocab, &device_loss,
                            row_losses.data(), device_error_, nullptr));
  // The loss is fp32 and computed from the same (rounded) logits: tight in both types.
  EXPECT_NEAR(device_loss, loss.ref[0], 1e-4 * std::abs(loss.ref[0]));

  KernelContext context;
  context.grad_scale = 0.25;
  Tensor dlogits = Zeros(logits.shape, type());
  RunCpu(MakeOp(op_kind::kCrossEntropyBackward), {logits.Ref(), targets.Ref()}, {dlogits.Ref()},
         context);
  ExpectOk(ck::CrossEntropyBackward(type(), logits.Dev(), targets.values.data(), 10, vocab, 0.25f,
                                    dlogits.Dev(), device_error_, nullptr));
  ExpectClose(dlogits, type(), tolerance(), "dlogits");
  EXPECT_EQ(device_error_[0], ck::kNoDeviceError);
}

// ---------------------------------------------------------------------------------------------
// Mixture of experts

// k distinct experts per token drawn from [0, experts - 1): the last expert gets no slot, so
// every test sees an empty segment.
Ints RoutingWithAnEmptyExpert(Shape shape, int32_t experts, std::mt19937* rng) {
  Ints t;
  t.shape = std::move(shape);
  const int64_t k = t.shape.back();
  t.values.resize(Count(t.shape));
  std::vector<int32_t> ids(experts - 1);
  for (int64_t token = 0; token < Count(t.shape) / k; ++token) {
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), *rng);
    std::copy_n(ids.begin(), k, t.values.begin() + token * k);
  }
  return t;
}

// The layout kernels' scratch, run on `experts`.
struct EmulatedLayout {
  std::vector<int32_t> scratch;
  ck::MoeLayoutView view{};
  std::vector<int32_t> Offsets(int64_t num_experts) const {
    return {view.offsets, view.offsets + num_experts + 1};
  }
  std::vector<int32_t> Rows(int64_t slots) const { return {view.rows, view.rows + slots}; }
};

EmulatedLayout RunLayout(const std::vector<int32_t>& experts, int64_t num_experts,
                         int32_t* device_error) {
  const auto slots = static_cast<int64_t>(experts.size());
  EmulatedLayout layout;
  // Garbage, so that an element the kernels forget shows up.
  layout.scratch.assign(ck::MoeLayoutScratchInts(slots, num_experts), 0x3c3c3c3c);
  layout.view = ck::MoeLayoutInScratch(layout.scratch.data(), slots, num_experts);
  EXPECT_EQ(ck::MoeLayout(experts.data(), slots, num_experts, layout.view, device_error, nullptr),
            cudaSuccess);
  return layout;
}

void ExpectLayoutAsCpu(const std::vector<int32_t>& experts, int64_t num_experts) {
  SCOPED_TRACE(std::to_string(experts.size()) + " slots over " + std::to_string(num_experts) +
               " experts");
  const auto slots = static_cast<int64_t>(experts.size());
  int64_t bad_slot = -1;
  const std::optional<MoeLayout> want =
      MakeMoeLayout(experts.data(), slots, num_experts, &bad_slot);
  ASSERT_TRUE(want.has_value());
  int32_t device_error[ck::kDeviceErrorInts] = {};
  const EmulatedLayout got = RunLayout(experts, num_experts, device_error);
  EXPECT_EQ(device_error[0], ck::kNoDeviceError);
  EXPECT_EQ(std::vector<int64_t>(got.view.offsets, got.view.offsets + num_experts + 1),
            want->offsets);
  EXPECT_EQ(std::vector<int64_t>(got.view.rows, got.view.rows + slots), want->row);
}

// Small; many chunks and scan tiles (7 * 40 chunk counts); more experts than threads; every
// slot on one expert.
TEST(EmulatedMoe, LayoutMatchesMakeMoeLayout) {
  std::mt19937 rng(21);
  ExpectLayoutAsCpu(RoutingWithAnEmptyExpert({2, 3, 2}, 4, &rng).values, 4);
  ExpectLayoutAsCpu(RoutingWithAnEmptyExpert({2, 2500, 2}, 7, &rng).values, 7);
  ExpectLayoutAsCpu(RoutingWithAnEmptyExpert({300, 2}, 300, &rng).values, 300);
  ExpectLayoutAsCpu(std::vector<int32_t>(700, 2), 5);
}

TEST(EmulatedMoe, LayoutRecordsBadExpertIds) {
  int32_t device_error[ck::kDeviceErrorInts] = {};
  const EmulatedLayout layout = RunLayout({0, 1, 9, 2}, 4, device_error);
  EXPECT_EQ(device_error[0], ck::kBadExpertId);
  EXPECT_EQ(device_error[1], 2);  // slot
  EXPECT_EQ(device_error[2], 9);  // id
  EXPECT_EQ(device_error[3], 4);  // experts
  // The bad slot is left out: it has no row and the segments hold the other three.
  EXPECT_EQ(layout.Rows(4), (std::vector<int32_t>{0, 1, -1, 2}));
  EXPECT_EQ(layout.Offsets(4), (std::vector<int32_t>{0, 1, 2, 3, 3}));

  int32_t negative_error[ck::kDeviceErrorInts] = {};
  RunLayout({3, -1}, 4, negative_error);
  EXPECT_EQ(negative_error[0], ck::kBadExpertId);
  EXPECT_EQ(negative_error[1], 1);
  EXPECT_EQ(negative_error[2], -1);
}

// Values given, rounded to the storage type (both sides see the rounded ones).
Tensor FromValues(Shape shape, const std::vector<float>& values, ck::FloatType type) {
  Tensor t;
  t.shape = std::move(shape);
  t.dev = Encode(values, type);
  t.ref = Decode(t.dev, type);
  return t;
}

struct RouterCase {
  int64_t experts, top_k;
};

TEST_P(Emulated, MoeRouter) {
  // 40 experts: lanes stride the row.
  for (const RouterCase& c : {RouterCase{6, 2}, RouterCase{40, 3}}) {
    SCOPED_TRACE(std::to_string(c.experts) + " experts, top " + std::to_string(c.top_k));
    const int64_t tokens = 2 * 7;
    std::normal_distribution<float> dist(0.0f, 1.0f);
    std::vector<float> values(tokens * c.experts);
    for (float& v : values) v = dist(rng_);
    values[1] = values[4] = 5.0f;  // token 0: a tie at the top, the lower id first
    Tensor logits = FromValues({2, 7, c.experts}, values, type());
    const std::map<std::string, int64_t> ints = {{op_attr::kTopK, c.top_k}};
    const std::map<std::string, double> floats = {{op_attr::kAuxCoef, 0.3}};
    Tensor gates = Zeros({2, 7, c.top_k}, ck::FloatType::kF32);
    Ints experts;
    experts.shape = {2, 7, c.top_k};
    experts.values.assign(tokens * c.top_k, -7);
    float cpu_aux = NAN;
    TensorRef aux_ref;
    aux_ref.shape = {1};
    aux_ref.f32 = &cpu_aux;
    RunCpu(MakeOp(op_kind::kMoeRouter, ints, floats), {logits.Ref()},
           {gates.Ref(), experts.Ref(), aux_ref});
    ASSERT_EQ(experts.values[0], 1);
    ASSERT_EQ(experts.values[1], 4);

    std::vector<int32_t> device_experts(tokens * c.top_k, -7);
    float device_aux = NAN;
    std::vector<double> scratch(ck::MoeRouterScratchBytes(tokens, c.experts) / 8 + 1);
    ExpectOk(ck::MoeRouter(type(), logits.Dev(), tokens, c.experts, c.top_k, 0.3,
                           reinterpret_cast<float*>(gates.Dev()), device_experts.data(),
                           &device_aux, scratch.data(), nullptr));
    EXPECT_EQ(device_experts, experts.values);
    // Gates and the loss are fp32 from the same (rounded) logits: tight in every type.
    ExpectClose(gates, ck::FloatType::kF32, kF32Tolerance, "gates");
    EXPECT_NEAR(device_aux, cpu_aux, 1e-5 * std::abs(cpu_aux));
  }
}

TEST_P(Emulated, MoeRouterBackward) {
  for (const RouterCase& c : {RouterCase{6, 2}, RouterCase{40, 3}}) {
    SCOPED_TRACE(std::to_string(c.experts) + " experts, top " + std::to_string(c.top_k));
    const int64_t tokens = 3 * 5;
    const std::map<std::string, int64_t> ints = {{op_attr::kTopK, c.top_k}};
    const std::map<std::string, double> floats = {{op_attr::kAuxCoef, 0.3}};
    Tensor logits = Random({3, 5, c.experts}, type(), &rng_);
    Tensor dgates = Random({3, 5, c.top_k}, ck::FloatType::kF32, &rng_);
    Ints experts =
        RoutingWithAnEmptyExpert({3, 5, c.top_k}, static_cast<int32_t>(c.experts), &rng_);
    Tensor dlogits = Zeros(logits.shape, type());
    KernelContext context;
    context.grad_scale = 0.25;
    RunCpu(MakeOp(op_kind::kMoeRouterBackward, ints, floats),
           {dgates.Ref(), logits.Ref(), experts.Ref()}, {dlogits.Ref()}, context);
    const EmulatedLayout layout = RunLayout(experts.values, c.experts, device_error_);
    ExpectOk(ck::MoeRouterBackward(type(), reinterpret_cast<const float*>(dgates.Dev()),
                                   logits.Dev(), experts.values.data(), layout.view.offsets, tokens,
                                   c.experts, c.top_k, 0.25 * 0.3 * c.experts / tokens,
                                   dlogits.Dev(), nullptr));
    ExpectClose(dlogits, type(), tolerance(), "dlogits");
  }
  EXPECT_EQ(device_error_[0], ck::kNoDeviceError);
}

// Dispatch, combine and their backward over a routing with an empty expert; hidden 300 makes
// the row loops stride.
TEST_P(Emulated, MoeDispatchAndCombine) {
  constexpr int64_t kExperts = 4, kTopK = 2, kTokens = 3 * 5, kSlots = kTokens * kTopK;
  const std::map<std::string, int64_t> attr = {{op_attr::kExperts, kExperts}};
  const bool f32 = type() == ck::FloatType::kF32;
  for (const int64_t hidden : {40, 300}) {
    SCOPED_TRACE("hidden " + std::to_string(hidden));
    Ints experts = RoutingWithAnEmptyExpert({3, 5, kTopK}, kExperts, &rng_);
    const EmulatedLayout layout = RunLayout(experts.values, kExperts, device_error_);
    ASSERT_EQ(layout.Offsets(kExperts)[kExperts - 1], kSlots) << "the last expert is empty";
    const int32_t* rows = layout.view.rows;

    Tensor x = Random({3, 5, hidden}, type(), &rng_);
    Tensor xs = Zeros({kSlots, hidden}, type());
    RunCpu(MakeOp(op_kind::kMoeDispatch, attr), {x.Ref(), experts.Ref()}, {xs.Ref()});
    ExpectOk(ck::MoeDispatch(type(), x.Dev(), rows, kTokens, kTopK, hidden, xs.Dev(), nullptr));
    ExpectClose(xs, type(), 0, "xs");  // copies

    Tensor dxs = Random({kSlots, hidden}, type(), &rng_);
    Tensor dx = Zeros(x.shape, type());
    RunCpu(MakeOp(op_kind::kMoeDispatchBackward, attr), {dxs.Ref(), experts.Ref()}, {dx.Ref()});
    ExpectOk(ck::MoeDispatchBackward(type(), dxs.Dev(), rows, kTokens, kTopK, hidden, dx.Dev(),
                                     nullptr));
    // fp32: the CPU backend's additions in its order, so bit for bit.
    ExpectClose(dx, type(), f32 ? 0 : tolerance(), "dx");

    Tensor ys = Random({kSlots, hidden}, type(), &rng_);
    Tensor gates = Random({3, 5, kTopK}, ck::FloatType::kF32, &rng_);
    const auto* gates_dev = reinterpret_cast<const float*>(gates.Dev());
    Tensor y = Zeros(x.shape, type());
    RunCpu(MakeOp(op_kind::kMoeCombine, attr), {ys.Ref(), gates.Ref(), experts.Ref()}, {y.Ref()});
    ExpectOk(ck::MoeCombine(type(), ys.Dev(), gates_dev, rows, kTokens, kTopK, hidden, y.Dev(),
                            nullptr));
    ExpectClose(y, type(), tolerance(), "y");

    Tensor dy = Random(x.shape, type(), &rng_);
    Tensor dys = Zeros(ys.shape, type());
    Tensor dgates = Zeros(gates.shape, ck::FloatType::kF32);
    RunCpu(MakeOp(op_kind::kMoeCombineBackward, attr),
           {dy.Ref(), ys.Ref(), gates.Ref(), experts.Ref()}, {dys.Ref(), dgates.Ref()});
    ExpectOk(ck::MoeCombineBackward(type(), dy.Dev(), ys.Dev(), gates_dev, rows, kTokens, kTopK,
                                    hidden, dys.Dev(), reinterpret_cast<float*>(dgates.Dev()),
                                    nullptr));
    ExpectClose(dys, type(), f32 ? 0 : tolerance(), "dys");  // one product per element
    // fp32 from the same rounded inputs (the CPU backend's dot is in double).
    ExpectClose(dgates, ck::FloatType::kF32, kF32Tolerance, "dgates");
  }
  EXPECT_EQ(device_error_[0], ck::kNoDeviceError);
}

TEST(EmulatedAdamW, MatchesCpuBitForBit) {
  std::mt19937 rng(7);
  const int64_t n = 1000;
  Tensor p = Random({n}, ck::FloatType::kF32, &rng), g = Random({n}, ck::FloatType::kF32, &rng);
  Tensor m = Random({n}, ck::FloatType::kF32, &rng, 0.1f);
  Tensor v = Random({n}, ck::FloatType::kF32, &rng, 0.1f);
  for (float& x : v.ref) x = std::abs(x);
  v.dev = Encode(v.ref, ck::FloatType::kF32);
  const proto::Op op = MakeOp(op_kind::kAdamW, {},
                              {{op_attr::kLr, 1e-3},
                               {op_attr::kBeta1, 0.9},
                               {op_attr::kBeta2, 0.95},
                               {op_attr::kEps, 1e-8},
                               {op_attr::kWeightDecay, 0.1}});
  KernelContext context;
  context.adam_step = 3;
  RunCpu(op, {p.Ref(), g.Ref(), m.Ref(), v.Ref()}, {}, context);
  // The constants as cuda_kernels.cc computes them: in double, then rounded to fp32.
  const double lr = 1e-3, beta1 = 0.9, beta2 = 0.95, step = 3;
  auto f = [](double x) { return static_cast<float>(x); };
  const ck::AdamWConstants c{f(lr),
                             f(beta1),
                             f(1.0 - beta1),
                             f(beta2),
                             f(1.0 - beta2),
                             f(1e-8),
                             f(1.0 / (1.0 - std::pow(beta1, step))),
                             f(1.0 / (1.0 - std::pow(beta2, step))),
                             f(1.0 - lr * 0.1)};
  ExpectOk(ck::AdamW(reinterpret_cast<float*>(p.Dev()), reinterpret_cast<const float*>(g.Dev()),
                     reinterpret_cast<float*>(m.Dev()), reinterpret_cast<float*>(v.Dev()), n, c,
                     nullptr, nullptr));
  ExpectClose(p, ck::FloatType::kF32, 0, "param");
  ExpectClose(m, ck::FloatType::kF32, 0, "m");
  ExpectClose(v, ck::FloatType::kF32, 0, "v");
}

// Clipped: the coefficient from the global squared norm on the device, in the same fp32 steps.
TEST(EmulatedAdamW, ClippedMatchesCpuBitForBit) {
  std::mt19937 rng(9);
  const int64_t n = 1000;
  Tensor p = Random({n}, ck::FloatType::kF32, &rng), g = Random({n}, ck::FloatType::kF32, &rng);
  Tensor m = Random({n}, ck::FloatType::kF32, &rng, 0.1f);
  Tensor v = Random({n}, ck::FloatType::kF32, &rng, 0.1f);
  for (float& x : v.ref) x = std::abs(x);
  v.dev = Encode(v.ref, ck::FloatType::kF32);
  Tensor norm = Zeros({1}, ck::FloatType::kF32);
  norm.ref = {9.7f};
  norm.dev = Encode(norm.ref, ck::FloatType::kF32);
  const proto::Op op = MakeOp(op_kind::kAdamW, {},
                              {{op_attr::kLr, 1e-3},
                               {op_attr::kBeta1, 0.9},
                               {op_attr::kBeta2, 0.95},
                               {op_attr::kEps, 1e-8},
                               {op_attr::kWeightDecay, 0.1},
                               {op_attr::kMaxGradNorm, 0.25}});
  KernelContext context;
  context.adam_step = 3;
  RunCpu(op, {p.Ref(), g.Ref(), m.Ref(), v.Ref(), norm.Ref()}, {}, context);
  const double lr = 1e-3, beta1 = 0.9, beta2 = 0.95, step = 3;
  auto f = [](double x) { return static_cast<float>(x); };
  const ck::AdamWConstants c{f(lr),
                             f(beta1),
                             f(1.0 - beta1),
                             f(beta2),
                             f(1.0 - beta2),
                             f(1e-8),
                             f(1.0 / (1.0 - std::pow(beta1, step))),
                             f(1.0 / (1.0 - std::pow(beta2, step))),
                             f(1.0 - lr * 0.1),
                             0.25f,
                             kClipNormEpsilon};
  ExpectOk(ck::AdamW(reinterpret_cast<float*>(p.Dev()), reinterpret_cast<const float*>(g.Dev()),
                     reinterpret_cast<float*>(m.Dev()), reinterpret_cast<float*>(v.Dev()), n, c,
                     reinterpret_cast<const float*>(norm.Dev()), nullptr));
  ExpectClose(p, ck::FloatType::kF32, 0, "param");
  ExpectClose(m, ck::FloatType::kF32, 0, "m");
  ExpectClose(v, ck::FloatType::kF32, 0, "v");
}

// The squares of every input in double (a tree inside each input on the device, in order on the
// CPU), rounded once: the same fp32 here.
TEST(EmulatedGradNormSquared, MatchesCpu) {
  std::mt19937 rng(11);
  std::vector<Tensor> grads;
  for (int64_t n : {1000, 37, 3000}) grads.push_back(Random({n}, ck::FloatType::kF32, &rng));
  Tensor out = Zeros({1}, ck::FloatType::kF32);
  std::vector<TensorRef> in;
  std::vector<const float*> devs;
  std::vector<int64_t> sizes;
  for (Tensor& t : grads) {
    in.push_back(t.Ref());
    devs.push_back(reinterpret_cast<const float*>(t.Dev()));
    sizes.push_back(t.shape[0]);
  }
  RunCpu(MakeOp(op_kind::kGradNormSquared), in, {out.Ref()}, {});
  std::vector<unsigned char> scratch(ck::GradNormSquaredScratchBytes());
  ExpectOk(ck::GradNormSquared(devs.data(), sizes.data(), 3, reinterpret_cast<float*>(out.Dev()),
                               scratch.data(), nullptr));
  ExpectClose(out, ck::FloatType::kF32, 1e-7, "norm_squared");
}

TEST(EmulatedCast, RoundTripsAndAccumulates) {
  std::mt19937 rng(3);
  Tensor x = Random({100}, ck::FloatType::kF32, &rng);
  std::vector<unsigned char> bf16(200);
  ExpectOk(ck::Cast(ck::FloatType::kF32, x.Dev(), ck::FloatType::kBF16, bf16.data(), 100, nullptr));
  EXPECT_EQ(bf16, Encode(x.ref, ck::FloatType::kBF16));
  std::vector<float> acc(100, 1.0f);
  ExpectOk(ck::AccumulateF32(ck::FloatType::kBF16, bf16.data(), 2.0f, acc.data(), 100, nullptr));
  const std::vector<float> rounded = Decode(bf16, ck::FloatType::kBF16);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(acc[i], 1.0f + 2.0f * rounded[i]);
}

}  // namespace
}  // namespace dc
