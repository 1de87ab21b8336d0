// The CUDA backend on a real device against the CPU backend: every op kind in fp32 (1e-4) and
// bf16 (2e-2), relative to each tensor's largest magnitude (expert ids exactly); the tiny dense
// and mixture-of-experts models' forward and backward op by op; AdamW bit for bit; the device
// layer; NCCL in a world of one. Every test that needs a device skips without one.
#include "executor/cuda/cuda_kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <numeric>
#include <random>

#include "executor/cpu_kernels.h"
#include "executor/cuda/cuda_device.h"
#include "executor/data.h"
#include "models/model.h"
#include "schemas/op_kinds.h"
#if defined(DC_HAVE_NCCL)
#include "executor/cuda/nccl_comm.h"
#endif

namespace dc {
namespace {

using Shape = std::vector<int64_t>;

constexpr double kF32Tolerance = 1e-4;
constexpr double kBF16Tolerance = 2e-2;
// Forward and backward of the whole tiny model chain more roundings than one op.
constexpr double kModelF32Tolerance = 1e-3;
constexpr double kModelBF16LossTolerance = 2e-2;

int64_t Count(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

double ToleranceFor(proto::DType dtype) {
  return dtype == proto::DTYPE_F32 ? kF32Tolerance : kBF16Tolerance;
}

// ---------------------------------------------------------------------------------------------
// Host-side conversions and device buffers.

std::vector<unsigned char> Encode(const std::vector<float>& values, proto::DType dtype) {
  std::vector<unsigned char> bytes(values.size() * DTypeSizeBytes(dtype));
  for (size_t i = 0; i < values.size(); ++i) {
    if (dtype == proto::DTYPE_F32) {
      std::memcpy(&bytes[i * 4], &values[i], 4);
    } else if (dtype == proto::DTYPE_BF16) {
      const __nv_bfloat16 v = __float2bfloat16(values[i]);
      std::memcpy(&bytes[i * 2], &v, 2);
    } else {
      const __half v = __float2half(values[i]);
      std::memcpy(&bytes[i * 2], &v, 2);
    }
  }
  return bytes;
}

std::vector<float> Decode(const std::vector<unsigned char>& bytes, proto::DType dtype) {
  const size_t n = bytes.size() / DTypeSizeBytes(dtype);
  std::vector<float> values(n);
  for (size_t i = 0; i < n; ++i) {
    if (dtype == proto::DTYPE_F32) {
      std::memcpy(&values[i], &bytes[i * 4], 4);
    } else if (dtype == proto::DTYPE_BF16) {
      __nv_bfloat16 v;
      std::memcpy(&v, &bytes[i * 2], 2);
      values[i] = __bfloat162float(v);
    } else {
      __half v;
      std::memcpy(&v, &bytes[i * 2], 2);
      values[i] = __half2float(v);
    }
  }
  return values;
}

std::vector<float> Rounded(const std::vector<float>& values, proto::DType dtype) {
  return Decode(Encode(values, dtype), dtype);
}

void Check(const Status& status) { ASSERT_TRUE(status.ok()) << status.message(); }

// Owns the device buffers of one test.
class DeviceMemoryPool {
 public:
  DeviceTensor Upload(const void* host, int64_t bytes, Shape shape, proto::DType dtype) {
    DeviceTensor t = Allocate(std::move(shape), dtype);
    EXPECT_EQ(bytes, t.SizeBytes());
    Check(CopyAsync(t.data, host, bytes, nullptr, "upload"));
    Check(CudaStatus(cudaDeviceSynchronize(), "upload"));
    return t;
  }
  DeviceTensor UploadFloats(const std::vector<float>& values, Shape shape, proto::DType dtype) {
    const std::vector<unsigned char> bytes = Encode(values, dtype);
    return Upload(bytes.data(), static_cast<int64_t>(bytes.size()), std::move(shape), dtype);
  }
  DeviceTensor UploadInts(const std::vector<int32_t>& values, Shape shape) {
    return Upload(values.data(), static_cast<int64_t>(values.size() * 4), std::move(shape),
                  proto::DTYPE_I32);
  }
  // Filled with 0xFF bytes (NaN in every float type) so that unwritten elements show up.
  DeviceTensor Allocate(Shape shape, proto::DType dtype) {
    DeviceTensor t;
    t.shape = std::move(shape);
    t.dtype = dtype;
    auto buffer = DeviceBuffer::Create(std::max<int64_t>(t.SizeBytes(), 1), "test tensor");
    EXPECT_TRUE(buffer.ok()) << buffer.status().message();
    t.data = buffer->data();
    Check(CudaStatus(cudaMemset(t.data, 0xFF, static_cast<size_t>(t.SizeBytes())), "memset"));
    // cudaMemset is asynchronous on the legacy stream; tests also use non-blocking streams.
    Check(CudaStatus(cudaDeviceSynchronize(), "memset"));
    buffers_.push_back(std::move(buffer).value());
    return t;
  }

 private:
  std::vector<DeviceBuffer> buffers_;
};

std::vector<int32_t> DownloadInts(const DeviceTensor& t) {
  std::vector<int32_t> values(t.NumElements());
  Check(CudaStatus(cudaDeviceSynchronize(), "download"));
  Check(CudaStatus(
      cudaMemcpy(values.data(), t.data, values.size() * sizeof(int32_t), cudaMemcpyDeviceToHost),
      "download"));
  return values;
}

std::vector<float> DownloadFloats(const DeviceTensor& t) {
  std::vector<unsigned char> bytes(t.SizeBytes());
  Check(CudaStatus(cudaDeviceSynchronize(), "download"));
  Check(CudaStatus(cudaMemcpy(bytes.data(), t.data, bytes.size(), cudaMemcpyDeviceToHost),
                   "download"));
  return Decode(bytes, t.dtype);
}

// max |got - want| <= tolerance * max |want|.
void ExpectClose(const std::vector<float>& got, const std::vector<float>& want, double tolerance,
                 const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double scale = 0, worst = 0;
  size_t worst_at = 0;
  for (float w : want) scale = std::max(scale, std::abs(double{w}));
  for (size_t i = 0; i < want.size(); ++i) {
    const double diff = std::abs(double{got[i]} - double{want[i]});
    if (!(diff <= worst)) {
      worst = std::isnan(diff) ? INFINITY : diff;
      worst_at = i;
    }
  }
  EXPECT_LE(worst, tolerance * std::max(scale, 1e-30))
      << what << ": element " << worst_at << " is " << got[worst_at] << ", expected "
      << want[worst_at] << " (tensor scale " << scale << ")";
}

// One resources object for the whole test binary (cuBLASLt handle, workspace).
CudaKernelResources& Resources() {
  static CudaKernelResources* resources = [] {
    auto created = CudaKernelResources::Create();
    EXPECT_TRUE(created.ok()) << created.status().message();
    return created.ok() ? std::move(created).value().release() : nullptr;
  }();
  return *resources;
}

CudaKernelContext SyncContext() {
  CudaKernelContext context;
  context.resources = &Resources();
  context.synchronous = true;
  return context;
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

// ---------------------------------------------------------------------------------------------
// One op on both backends.

// An operand of a comparison. Float inputs are random normal (times `std_dev`) and rounded to the
// GPU run's dtype first, so both backends see the same values; i32 inputs are given; i32
// outputs are compared exactly.
struct Operand {
  Shape shape;
  bool is_int = false;
  std::vector<int32_t> ints;
  float std_dev = 1.0f;
  bool always_f32 = false;  // e.g. the loss: fp32 whatever the compute dtype
};

Operand Floats(Shape shape, float std_dev = 1.0f) { return {std::move(shape), false, {}, std_dev}; }
Operand IntsOf(Shape shape, std::vector<int32_t> values) {
  return {std::move(shape), true, std::move(values)};
}
Operand LossOut() { return {{1}, false, {}, 1.0f, true}; }
// fp32 whatever the compute dtype: MoE gates and their gradient.
Operand F32Floats(Shape shape) { return {std::move(shape), false, {}, 1.0f, true}; }
Operand IntsOut(Shape shape) { return {std::move(shape), true, {}}; }

std::vector<int32_t> RandomIds(int64_t count, int32_t bound, std::mt19937* rng) {
  std::uniform_int_distribution<int32_t> dist(0, bound - 1);
  std::vector<int32_t> ids(count);
  for (int32_t& id : ids) id = dist(*rng);
  return ids;
}

// Runs `op` on the CPU (fp32) and the GPU (`dtype`) and compares every output.
void CompareOp(const proto::Op& op, const std::vector<Operand>& inputs,
               const std::vector<Operand>& outputs, proto::DType dtype, std::mt19937* rng,
               double grad_scale = 1.0, double tolerance = -1) {
  SCOPED_TRACE(op.kind() + " in " + DTypeName(dtype));
  if (tolerance < 0) tolerance = ToleranceFor(dtype);
  DeviceMemoryPool pool;
  std::vector<std::vector<float>> cpu_floats;
  std::vector<std::vector<int32_t>> cpu_ints;
  std::vector<TensorRef> cpu_in, cpu_out;
  std::vector<DeviceTensor> gpu_in, gpu_out;
  cpu_floats.reserve(inputs.size() + outputs.size());
  cpu_ints.reserve(inputs.size() + outputs.size());
  for (const Operand& operand : inputs) {
    TensorRef ref;
    ref.shape = operand.shape;
    if (operand.is_int) {
      cpu_ints.push_back(operand.ints);
      ref.i32 = cpu_ints.back().data();
      gpu_in.push_back(pool.UploadInts(operand.ints, operand.shape));
    } else {
      std::normal_distribution<float> dist(0.0f, operand.std_dev);
      std::vector<float> values(Count(operand.shape));
      for (float& v : values) v = dist(*rng);
      const proto::DType operand_dtype = operand.always_f32 ? proto::DTYPE_F32 : dtype;
      cpu_floats.push_back(Rounded(values, operand_dtype));
      ref.f32 = cpu_floats.back().data();
      gpu_in.push_back(pool.UploadFloats(values, operand.shape, operand_dtype));
    }
    cpu_in.push_back(ref);
  }
  for (const Operand& operand : outputs) {
    TensorRef ref;
    ref.shape = operand.shape;
    if (operand.is_int) {
      cpu_ints.emplace_back(Count(operand.shape), 0);
      ref.i32 = cpu_ints.back().data();
      gpu_out.push_back(pool.Allocate(operand.shape, proto::DTYPE_I32));
    } else {
      cpu_floats.emplace_back(Count(operand.shape), 0.0f);
      ref.f32 = cpu_floats.back().data();
      gpu_out.push_back(
          pool.Allocate(operand.shape, operand.always_f32 ? proto::DTYPE_F32 : dtype));
    }
    cpu_out.push_back(ref);
  }
  KernelContext cpu_context;
  cpu_context.grad_scale = grad_scale;
  Check(RunCpuOp(op, cpu_in, cpu_out, cpu_context));
  CudaKernelContext context = SyncContext();
  context.grad_scale = grad_scale;
  Check(RunCudaOp(op, gpu_in, gpu_out, context));
  for (size_t i = 0; i < outputs.size(); ++i) {
    const int64_t n = Count(outputs[i].shape);
    if (outputs[i].is_int) {
      EXPECT_EQ(DownloadInts(gpu_out[i]), std::vector<int32_t>(cpu_out[i].i32, cpu_out[i].i32 + n))
          << "output " << i;
      continue;
    }
    const std::vector<float> want(cpu_out[i].f32, cpu_out[i].f32 + n);
    ExpectClose(DownloadFloats(gpu_out[i]), want, tolerance, "output " + std::to_string(i));
  }
}

class GpuOp : public ::testing::TestWithParam<proto::DType> {
 protected:
  proto::DType dtype() const { return GetParam(); }
  std::mt19937 rng_{2024};
};

INSTANTIATE_TEST_SUITE_P(DTypes, GpuOp,
                         ::testing::Values(proto::DTYPE_F32, proto::DTYPE_BF16, proto::DTYPE_F16),
                         [](const auto& info) { return std::string(DTypeName(info.param)); });

TEST_P(GpuOp, Embedding) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  const int64_t vocab = 50, hidden = 64;
  std::vector<int32_t> tokens = RandomIds(2 * 33, vocab, &rng_);
  tokens[7] = tokens[0];  // repeats for the backward
  CompareOp(MakeOp(op_kind::kEmbedding), {IntsOf({2, 33}, tokens), Floats({vocab, hidden})},
            {Floats({2, 33, hidden})}, dtype(), &rng_);
  CompareOp(MakeOp(op_kind::kEmbeddingBackward), {Floats({2, 33, hidden}), IntsOf({2, 33}, tokens)},
            {Floats({vocab, hidden})}, dtype(), &rng_);
}

TEST_P(GpuOp, RmsNorm) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  const auto eps = std::map<std::string, double>{{op_attr::kEps, 1e-5}};
  for (const int64_t hidden : {40, 4096}) {
    CompareOp(MakeOp(op_kind::kRmsNorm, {}, eps), {Floats({3, 70, hidden}), Floats({hidden})},
              {Floats({3, 70, hidden})}, dtype(), &rng_);
    CompareOp(MakeOp(op_kind::kRmsNormBackward, {}, eps),
              {Floats({3, 70, hidden}), Floats({3, 70, hidden}), Floats({hidden})},
              {Floats({3, 70, hidden}), Floats({hidden})}, dtype(), &rng_);
  }
}

TEST_P(GpuOp, Matmul) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  struct Dims {
    Shape x;
    int64_t n;
  };
  // Odd sizes (no tensor-core alignment), aligned ones, and a 3-D x.
  for (const Dims& d : {Dims{{5, 3}, 7}, Dims{{64, 256}, 128}, Dims{{2, 9, 24}, 40}}) {
    const int64_t k = d.x.back();
    Shape y = d.x;
    y.back() = d.n;
    CompareOp(MakeOp(op_kind::kMatmul), {Floats(d.x), Floats({d.n, k})}, {Floats(y)}, dtype(),
              &rng_);
    CompareOp(MakeOp(op_kind::kMatmulBackward), {Floats(y), Floats(d.x), Floats({d.n, k})},
              {Floats(d.x), Floats({d.n, k})}, dtype(), &rng_);
  }
}

TEST_P(GpuOp, Rope) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  const std::map<std::string, int64_t> ints = {{op_attr::kHeads, 4}, {op_attr::kHeadDim, 64}};
  const std::map<std::string, double> floats = {{op_attr::kTheta, 5e5}};
  for (const char* kind : {op_kind::kRope, op_kind::kRopeBackward}) {
    CompareOp(MakeOp(kind, ints, floats), {Floats({2, 300, 256})}, {Floats({2, 300, 256})}, dtype(),
              &rng_);
  }
}

TEST_P(GpuOp, Attention) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  struct Case {
    int64_t batch, seq, heads, kv_heads, head_dim;
  };
  for (const Case& c : {Case{2, 37, 4, 2, 16}, Case{1, 200, 4, 1, 64}, Case{1, 130, 2, 2, 128},
                        Case{1, 70, 2, 1, 72}}) {
    SCOPED_TRACE("seq " + std::to_string(c.seq) + " head_dim " + std::to_string(c.head_dim));
    const std::map<std::string, int64_t> ints = {{op_attr::kHeads, c.heads},
                                                 {op_attr::kKvHeads, c.kv_heads},
                                                 {op_attr::kHeadDim, c.head_dim}};
    const Shape q{c.batch, c.seq, c.heads * c.head_dim};
    const Shape kv{c.batch, c.seq, c.kv_heads * c.head_dim};
    CompareOp(MakeOp(op_kind::kAttention, ints), {Floats(q), Floats(kv), Floats(kv)}, {Floats(q)},
              dtype(), &rng_);
    CompareOp(MakeOp(op_kind::kAttentionBackward, ints),
              {Floats(q), Floats(q), Floats(kv), Floats(kv)}, {Floats(q), Floats(kv), Floats(kv)},
              dtype(), &rng_);
  }
}

TEST_P(GpuOp, Swiglu) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  CompareOp(MakeOp(op_kind::kSwiglu), {Floats({7, 333}), Floats({7, 333})}, {Floats({7, 333})},
            dtype(), &rng_);
  CompareOp(MakeOp(op_kind::kSwigluBackward),
            {Floats({7, 333}), Floats({7, 333}), Floats({7, 333})},
            {Floats({7, 333}), Floats({7, 333})}, dtype(), &rng_);
}

TEST_P(GpuOp, Add) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  for (const int count : {2, 3, 11}) {
    std::vector<Operand> inputs(count, Floats({5, 1000}));
    CompareOp(MakeOp(op_kind::kAdd), inputs, {Floats({5, 1000})}, dtype(), &rng_);
  }
}

TEST_P(GpuOp, CrossEntropy) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  const int64_t vocab = 3000;
  const std::vector<int32_t> targets = RandomIds(2 * 17, vocab, &rng_);
  const Operand logits = Floats({2, 17, vocab}, 3.0f);
  // The loss is fp32 from the same rounded logits: tight in every dtype.
  CompareOp(MakeOp(op_kind::kCrossEntropy), {logits, IntsOf({2, 17}, targets)}, {LossOut()},
            dtype(), &rng_, 1.0, kF32Tolerance);
  CompareOp(MakeOp(op_kind::kCrossEntropyBackward), {logits, IntsOf({2, 17}, targets)},
            {Floats({2, 17, vocab})}, dtype(), &rng_, 1.0 / 34);
}

// k distinct experts per token drawn from [0, experts - 1): the last expert gets no token.
std::vector<int32_t> RoutingWithAnEmptyExpert(int64_t tokens, int64_t top_k, int32_t experts,
                                              std::mt19937* rng) {
  std::vector<int32_t> routing(tokens * top_k), ids(experts - 1);
  for (int64_t t = 0; t < tokens; ++t) {
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), *rng);
    std::copy_n(ids.begin(), top_k, routing.begin() + t * top_k);
  }
  return routing;
}

struct MoeCase {
  int64_t experts, top_k;
};

TEST_P(GpuOp, MoeRouter) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  // 40 experts: a warp's lanes stride the row.
  for (const MoeCase& c : {MoeCase{8, 2}, MoeCase{40, 3}}) {
    const Shape choice{2, 33, c.top_k};
    // Ids exactly; gates and the loss are fp32 from the same rounded logits: tight in every dtype.
    CompareOp(MakeOp(op_kind::kMoeRouter, {{op_attr::kTopK, c.top_k}}, {{op_attr::kAuxCoef, 0.01}}),
              {Floats({2, 33, c.experts})}, {F32Floats(choice), IntsOut(choice), LossOut()},
              dtype(), &rng_, 1.0, kF32Tolerance);
  }
}

TEST_P(GpuOp, MoeRouterBackward) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  for (const MoeCase& c : {MoeCase{8, 2}, MoeCase{40, 3}}) {
    const Shape choice{2, 33, c.top_k};
    const std::vector<int32_t> routing =
        RoutingWithAnEmptyExpert(2 * 33, c.top_k, static_cast<int32_t>(c.experts), &rng_);
    CompareOp(MakeOp(op_kind::kMoeRouterBackward, {{op_attr::kTopK, c.top_k}},
                     {{op_attr::kAuxCoef, 0.3}}),
              {F32Floats(choice), Floats({2, 33, c.experts}), IntsOf(choice, routing)},
              {Floats({2, 33, c.experts})}, dtype(), &rng_, 1.0 / 66);
  }
}

TEST_P(GpuOp, MoeDispatchAndCombine) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  const int64_t experts = 8, top_k = 2, slots = 2 * 33 * top_k;
  const std::map<std::string, int64_t> attr = {{op_attr::kExperts, experts}};
  const Shape choice{2, 33, top_k};
  const std::vector<int32_t> routing = RoutingWithAnEmptyExpert(2 * 33, top_k, experts, &rng_);
  for (const int64_t hidden : {96, 1000}) {
    const Shape tokens{2, 33, hidden}, rows{slots, hidden};
    CompareOp(MakeOp(op_kind::kMoeDispatch, attr), {Floats(tokens), IntsOf(choice, routing)},
              {Floats(rows)}, dtype(), &rng_);
    CompareOp(MakeOp(op_kind::kMoeDispatchBackward, attr), {Floats(rows), IntsOf(choice, routing)},
              {Floats(tokens)}, dtype(), &rng_);
    CompareOp(MakeOp(op_kind::kMoeCombine, attr),
              {Floats(rows), F32Floats(choice), IntsOf(choice, routing)}, {Floats(tokens)}, dtype(),
              &rng_);
    CompareOp(MakeOp(op_kind::kMoeCombineBackward, attr),
              {Floats(tokens), Floats(rows), F32Floats(choice), IntsOf(choice, routing)},
              {Floats(rows), F32Floats(choice)}, dtype(), &rng_);
  }
}

TEST_P(GpuOp, GroupedMatmul) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  const int32_t experts = 4;
  const int64_t top_k = 2, slots = 2 * 33 * top_k;
  struct Case {
    std::vector<int32_t> routing;
    int64_t n, k;
  };
  // An empty last expert with odd sizes (segments at unaligned rows); every slot on expert 1.
  for (const Case& c : {Case{RoutingWithAnEmptyExpert(2 * 33, top_k, experts, &rng_), 7, 5},
                        Case{RoutingWithAnEmptyExpert(2 * 33, top_k, experts, &rng_), 40, 48},
                        Case{std::vector<int32_t>(slots, 1), 64, 32}}) {
    SCOPED_TRACE("n " + std::to_string(c.n) + " k " + std::to_string(c.k));
    std::vector<Operand> forward_in = {Floats({slots, c.k}), IntsOf({2, 33, top_k}, c.routing)};
    std::vector<Operand> backward_in = {Floats({slots, c.n}), Floats({slots, c.k}),
                                        IntsOf({2, 33, top_k}, c.routing)};
    std::vector<Operand> backward_out = {Floats({slots, c.k})};
    for (int32_t e = 0; e < experts; ++e) {
      forward_in.push_back(Floats({c.n, c.k}));
      backward_in.push_back(Floats({c.n, c.k}));
      backward_out.push_back(Floats({c.n, c.k}));  // an empty expert's must be zeroed
    }
    CompareOp(MakeOp(op_kind::kGroupedMatmul), forward_in, {Floats({slots, c.n})}, dtype(), &rng_);
    CompareOp(MakeOp(op_kind::kGroupedMatmulBackward), backward_in, backward_out, dtype(), &rng_);
  }
}

// ---------------------------------------------------------------------------------------------
// AdamW, errors, the matmul cache

TEST(GpuAdamW, MatchesCpuBitForBit) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(5);
  const int64_t n = 100003;
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<std::vector<float>> host(4, std::vector<float>(n));
  for (auto& values : host) {
    for (float& v : values) v = dist(rng);
  }
  for (float& v : host[3]) v = std::abs(v) * 0.01f;  // v >= 0
  const proto::Op op = MakeOp(op_kind::kAdamW, {},
                              {{op_attr::kLr, 3e-4},
                               {op_attr::kBeta1, 0.9},
                               {op_attr::kBeta2, 0.95},
                               {op_attr::kEps, 1e-8},
                               {op_attr::kWeightDecay, 0.1}});
  DeviceMemoryPool pool;
  std::vector<DeviceTensor> gpu;
  for (const auto& values : host) gpu.push_back(pool.UploadFloats(values, {n}, proto::DTYPE_F32));
  for (int64_t step = 1; step <= 3; ++step) {
    std::vector<TensorRef> cpu;
    for (auto& values : host) {
      TensorRef ref;
      ref.shape = {n};
      ref.f32 = values.data();
      cpu.push_back(ref);
    }
    KernelContext cpu_context;
    cpu_context.adam_step = step;
    Check(RunCpuOp(op, cpu, {}, cpu_context));
    CudaKernelContext context = SyncContext();
    context.adam_step = step;
    Check(RunCudaOp(op, gpu, {}, context));
  }
  const char* names[] = {"param", "grad", "m", "v"};
  for (int i = 0; i < 4; ++i) {
    const std::vector<float> got = DownloadFloats(gpu[i]);
    EXPECT_EQ(0, std::memcmp(got.data(), host[i].data(), n * sizeof(float)))
        << names[i] << " differs from the CPU backend";
  }
}

// Clipping: grad_norm_squared of several grads on the GPU (then used as the global norm) and the
// clipped AdamW step match the CPU backend; the step bit for bit.
TEST(GpuAdamW, ClippedMatchesCpuBitForBit) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(6);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  const std::vector<int64_t> sizes = {100003, 4097, 1};
  std::vector<std::vector<float>> grads;
  for (int64_t n : sizes) {
    grads.emplace_back(n);
    for (float& v : grads.back()) v = dist(rng);
  }
  DeviceMemoryPool pool;
  std::vector<DeviceTensor> gpu_grads;
  std::vector<TensorRef> cpu_grads;
  for (auto& g : grads) {
    gpu_grads.push_back(pool.UploadFloats(g, {static_cast<int64_t>(g.size())}, proto::DTYPE_F32));
    TensorRef ref;
    ref.shape = {static_cast<int64_t>(g.size())};
    ref.f32 = g.data();
    cpu_grads.push_back(ref);
  }
  std::vector<float> cpu_norm(1);
  TensorRef norm_ref;
  norm_ref.shape = {1};
  norm_ref.f32 = cpu_norm.data();
  std::vector<TensorRef> cpu_out = {norm_ref};
  Check(RunCpuOp(MakeOp(op_kind::kGradNormSquared), cpu_grads, cpu_out, {}));
  std::vector<DeviceTensor> gpu_norm = {pool.Allocate({1}, proto::DTYPE_F32)};
  Check(RunCudaOp(MakeOp(op_kind::kGradNormSquared), gpu_grads, gpu_norm, SyncContext()));
  EXPECT_NEAR(DownloadFloats(gpu_norm[0])[0], cpu_norm[0], 1e-6 * cpu_norm[0]);

  // One step of the first grad's param, clipped at a max below the norm, from the CPU's norm.
  const int64_t n = sizes[0];
  std::vector<std::vector<float>> host(4, std::vector<float>(n));
  for (auto& values : host) {
    for (float& v : values) v = dist(rng);
  }
  host[1] = grads[0];
  for (float& v : host[3]) v = std::abs(v) * 0.01f;
  const proto::Op op = MakeOp(op_kind::kAdamW, {},
                              {{op_attr::kLr, 3e-4},
                               {op_attr::kBeta1, 0.9},
                               {op_attr::kBeta2, 0.95},
                               {op_attr::kEps, 1e-8},
                               {op_attr::kWeightDecay, 0.1},
                               {op_attr::kMaxGradNorm, 1.0}});
  std::vector<DeviceTensor> gpu;
  for (const auto& values : host) gpu.push_back(pool.UploadFloats(values, {n}, proto::DTYPE_F32));
  gpu.push_back(pool.UploadFloats(cpu_norm, {1}, proto::DTYPE_F32));
  std::vector<TensorRef> cpu;
  for (auto& values : host) {
    TensorRef ref;
    ref.shape = {n};
    ref.f32 = values.data();
    cpu.push_back(ref);
  }
  cpu.push_back(norm_ref);
  KernelContext cpu_context;
  cpu_context.adam_step = 2;
  Check(RunCpuOp(op, cpu, {}, cpu_context));
  CudaKernelContext context = SyncContext();
  context.adam_step = 2;
  Check(RunCudaOp(op, gpu, {}, context));
  const char* names[] = {"param", "grad", "m", "v"};
  for (int i = 0; i < 4; ++i) {
    const std::vector<float> got = DownloadFloats(gpu[i]);
    EXPECT_EQ(0, std::memcmp(got.data(), host[i].data(), n * sizeof(float)))
        << names[i] << " differs from the CPU backend";
  }
}

TEST(GpuErrors, NameTheOpAndTheOperand) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  DeviceMemoryPool pool;
  std::vector<DeviceTensor> in = {pool.Allocate({4, 8}, proto::DTYPE_BF16),
                                  pool.Allocate({6, 8}, proto::DTYPE_F32)};
  std::vector<DeviceTensor> out = {pool.Allocate({4, 6}, proto::DTYPE_BF16)};
  const Status status = RunCudaOp(MakeOp(op_kind::kMatmul), in, out, SyncContext());
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.message().find("op test.matmul (matmul): input 1 (w) has dtype f32"),
            std::string::npos)
      << status.message();

  const Status unknown = RunCudaOp(MakeOp("conv2d"), in, out, SyncContext());
  EXPECT_NE(unknown.message().find("no kernel"), std::string::npos) << unknown.message();
}

TEST(GpuErrors, BadTokenIdIsReportedByTheOp) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  DeviceMemoryPool pool;
  std::vector<DeviceTensor> in = {
      pool.UploadInts({1, 99, 2}, {3}),
      pool.UploadFloats(std::vector<float>(40, 1.0f), {5, 8}, proto::DTYPE_F32)};
  std::vector<DeviceTensor> out = {pool.Allocate({3, 8}, proto::DTYPE_F32)};
  const Status status = RunCudaOp(MakeOp(op_kind::kEmbedding), in, out, SyncContext());
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.message().find("op test.embedding (embedding): embedding: token id 99 at "
                                  "position 1 is outside the vocabulary of 5"),
            std::string::npos)
      << status.message();
  // The record was cleared: the next good op passes.
  in[0] = pool.UploadInts({1, 4, 2}, {3});
  Check(RunCudaOp(MakeOp(op_kind::kEmbedding), in, out, SyncContext()));
}

TEST(GpuErrors, BadExpertIdIsReportedByTheOp) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  DeviceMemoryPool pool;
  const proto::Op dispatch = MakeOp(op_kind::kMoeDispatch, {{op_attr::kExperts, 4}});
  std::vector<DeviceTensor> in = {pool.Allocate({1, 2, 8}, proto::DTYPE_F32),
                                  pool.UploadInts({0, 1, 9, 2}, {1, 2, 2})};
  std::vector<DeviceTensor> out = {pool.Allocate({4, 8}, proto::DTYPE_F32)};
  const Status status = RunCudaOp(dispatch, in, out, SyncContext());
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.message().find("op test.moe_dispatch (moe_dispatch): moe routing: expert id 9 "
                                  "at slot 2 is outside the 4 experts"),
            std::string::npos)
      << status.message();
  // The record was cleared: the next good op passes.
  in[1] = pool.UploadInts({0, 1, 3, 2}, {1, 2, 2});
  Check(RunCudaOp(dispatch, in, out, SyncContext()));

  // A grouped matmul waits for the segment offsets anyway, so it reports a bad id even when
  // the context is asynchronous.
  std::vector<DeviceTensor> matmul_in = {pool.Allocate({4, 8}, proto::DTYPE_F32),
                                         pool.UploadInts({0, -1, 1, 1}, {1, 2, 2})};
  for (int e = 0; e < 2; ++e) matmul_in.push_back(pool.Allocate({3, 8}, proto::DTYPE_F32));
  std::vector<DeviceTensor> matmul_out = {pool.Allocate({4, 3}, proto::DTYPE_F32)};
  CudaKernelContext context;
  context.resources = &Resources();
  const Status grouped = RunCudaOp(MakeOp(op_kind::kGroupedMatmul), matmul_in, matmul_out, context);
  ASSERT_FALSE(grouped.ok());
  EXPECT_NE(grouped.message().find("op test.grouped_matmul (grouped_matmul): moe routing: expert "
                                   "id -1 at slot 1 is outside the 2 experts"),
            std::string::npos)
      << grouped.message();
  Check(Resources().CheckDeviceErrors(nullptr));
}

TEST(GpuMatmul, CachesOneAlgorithmPerShape) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  DeviceMemoryPool pool;
  std::vector<DeviceTensor> in = {pool.Allocate({32, 48}, proto::DTYPE_BF16),
                                  pool.Allocate({80, 48}, proto::DTYPE_BF16)};
  Check(CudaStatus(cudaMemset(in[0].data, 0, in[0].SizeBytes()), "memset"));
  Check(CudaStatus(cudaMemset(in[1].data, 0, in[1].SizeBytes()), "memset"));
  std::vector<DeviceTensor> out = {pool.Allocate({32, 80}, proto::DTYPE_BF16)};
  Check(RunCudaOp(MakeOp(op_kind::kMatmul), in, out, SyncContext()));
  const int64_t cached = Resources().cached_matmul_algorithms();
  Check(RunCudaOp(MakeOp(op_kind::kMatmul), in, out, SyncContext()));
  EXPECT_EQ(Resources().cached_matmul_algorithms(), cached);
}

TEST(GpuScratch, ContextScratchMustBeLargeEnough) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  DeviceMemoryPool pool;
  const int64_t vocab = 100;
  std::vector<DeviceTensor> in = {pool.Allocate({2, 8, vocab}, proto::DTYPE_F32),
                                  pool.UploadInts(std::vector<int32_t>(16, 3), {2, 8})};
  std::vector<DeviceTensor> out = {pool.Allocate({1}, proto::DTYPE_F32)};
  const proto::Op op = MakeOp(op_kind::kCrossEntropy);
  auto bytes = CudaScratchBytes(op, in, out);
  ASSERT_TRUE(bytes.ok()) << bytes.status().message();
  EXPECT_EQ(*bytes, 16 * static_cast<int64_t>(sizeof(double)));
  DeviceTensor scratch = pool.Allocate({*bytes / 4}, proto::DTYPE_F32);
  CudaKernelContext context = SyncContext();
  context.scratch = scratch.data;
  context.scratch_bytes = *bytes - 1;
  EXPECT_FALSE(RunCudaOp(op, in, out, context).ok());
  context.scratch_bytes = *bytes;
  Check(CudaStatus(cudaMemset(in[0].data, 0, in[0].SizeBytes()), "memset"));
  Check(RunCudaOp(op, in, out, context));
  // Uniform logits: every row's loss is log(vocab).
  EXPECT_NEAR(DownloadFloats(out[0])[0], 16 * std::log(100.0), 1e-3);
}

// No device needed: every kind of the table (schemas/op_kinds.h) has an entry (its kernel and
// scratch size), so without operands each answers 0 bytes or its own operand check, never that
// the backend lacks the kind.
TEST(CudaKinds, EveryKindOfTheTableHasAKernel) {
  for (const OpKindInfo& info : kOpKinds) {
    const auto bytes = CudaScratchBytes(MakeOp(info.name), {}, {});
    if (bytes.ok()) {
      EXPECT_EQ(*bytes, 0) << info.name;
    } else {
      EXPECT_EQ(bytes.status().message().find("has no kernel"), std::string::npos)
          << bytes.status().message();
    }
  }
  const auto unknown = CudaScratchBytes(MakeOp("conv2d"), {}, {});
  ASSERT_FALSE(unknown.ok());
  EXPECT_EQ(unknown.status().message(),
            "op test.conv2d (conv2d): the CUDA backend has no kernel for this kind");
}

// No device needed: CudaScratchBytes only checks operands (the pointers are never read).
TEST(CudaScratch, MoeKindsSizeTheirScratchWithoutADevice) {
  void* const fake = reinterpret_cast<void*>(uintptr_t{256});
  auto tensor = [&](Shape shape, proto::DType dtype) {
    DeviceTensor t;
    t.data = fake;
    t.dtype = dtype;
    t.shape = std::move(shape);
    return t;
  };
  const int64_t tokens = 2 * 300, experts = 8, top_k = 2, slots = tokens * top_k;
  const int64_t chunks = (slots + 255) / 256;
  const int64_t layout_bytes = 4 * ((experts + 1) + slots + experts * chunks);
  const proto::Op router =
      MakeOp(op_kind::kMoeRouter, {{op_attr::kTopK, top_k}}, {{op_attr::kAuxCoef, 0.01}});
  const std::vector<DeviceTensor> logits = {tensor({2, 300, experts}, proto::DTYPE_BF16)};
  const std::vector<DeviceTensor> routed = {tensor({2, 300, top_k}, proto::DTYPE_F32),
                                            tensor({2, 300, top_k}, proto::DTYPE_I32),
                                            tensor({1}, proto::DTYPE_F32)};
  auto bytes = CudaScratchBytes(router, logits, routed);
  ASSERT_TRUE(bytes.ok()) << bytes.status().message();
  EXPECT_EQ(*bytes, experts * 8 + tokens * experts * 4);

  const std::vector<DeviceTensor> dispatch_in = {tensor({2, 300, 64}, proto::DTYPE_BF16),
                                                 routed[1]};
  const std::vector<DeviceTensor> dispatch_out = {tensor({slots, 64}, proto::DTYPE_BF16)};
  bytes = CudaScratchBytes(MakeOp(op_kind::kMoeDispatch, {{op_attr::kExperts, experts}}),
                           dispatch_in, dispatch_out);
  ASSERT_TRUE(bytes.ok()) << bytes.status().message();
  EXPECT_EQ(*bytes, layout_bytes);

  std::vector<DeviceTensor> matmul_in = {dispatch_out[0], routed[1]};
  for (int64_t e = 0; e < experts; ++e) matmul_in.push_back(tensor({32, 64}, proto::DTYPE_BF16));
  bytes = CudaScratchBytes(MakeOp(op_kind::kGroupedMatmul), matmul_in,
                           std::vector<DeviceTensor>{tensor({slots, 32}, proto::DTYPE_BF16)});
  ASSERT_TRUE(bytes.ok()) << bytes.status().message();
  EXPECT_EQ(*bytes, layout_bytes);

  // The checks name the op and the operand, as the CPU backend's do.
  const std::vector<DeviceTensor> bf16_gates = {tensor({2, 300, top_k}, proto::DTYPE_BF16),
                                                routed[1], routed[2]};
  bytes = CudaScratchBytes(router, logits, bf16_gates);
  ASSERT_FALSE(bytes.ok());
  EXPECT_EQ(bytes.status().message(),
            "op test.moe_router (moe_router): output 0 (gates) has dtype bf16, expected f32");
  bytes = CudaScratchBytes(
      MakeOp(op_kind::kMoeRouter, {{op_attr::kTopK, 9}}, {{op_attr::kAuxCoef, 0.01}}), logits,
      routed);
  ASSERT_FALSE(bytes.ok());
  EXPECT_EQ(bytes.status().message(),
            "op test.moe_router (moe_router): top_k 9 is more than the 8 experts");
}

TEST(GpuCast, RoundsAndAccumulates) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  DeviceMemoryPool pool;
  const std::vector<float> values = {1.0f, 1.00390625f, -3.14159f, 65504.0f, 1e-3f};
  DeviceTensor f32 = pool.UploadFloats(values, {5}, proto::DTYPE_F32);
  DeviceTensor bf16 = pool.Allocate({5}, proto::DTYPE_BF16);
  Check(CudaCast(f32, bf16, nullptr));
  EXPECT_EQ(DownloadFloats(bf16), Rounded(values, proto::DTYPE_BF16));
  DeviceTensor acc = pool.UploadFloats(std::vector<float>(5, 1.0f), {5}, proto::DTYPE_F32);
  Check(CudaAccumulate(bf16, 0.5f, acc, nullptr));
  const std::vector<float> rounded = Rounded(values, proto::DTYPE_BF16);
  const std::vector<float> got = DownloadFloats(acc);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(got[i], 1.0f + 0.5f * rounded[i]) << i;
  EXPECT_FALSE(CudaCast(f32, pool.Allocate({4}, proto::DTYPE_BF16), nullptr).ok());
  EXPECT_FALSE(CudaAccumulate(f32, 1.0f, bf16, nullptr).ok());
}

// ---------------------------------------------------------------------------------------------
// A tiny model, forward and backward, op by op on both backends.

// Both backends run the forward and backward, each on its own results; after every op the
// GPU's outputs are compared with the CPU's. Params are fp32 masters; in a bf16 program the GPU
// ops see bf16 copies of them (as gathered params would be). The AdamW ops get the CPU's own
// inputs (fp32 param, grad, m, v), so their results must match bit for bit: Adam's first step
// is about sign(grad) * lr, which chained rounding could flip for a grad near zero.
void RunTinyModel(const std::string& preset, proto::DType compute_dtype) {
  SCOPED_TRACE(preset + " in " + DTypeName(compute_dtype));
  auto config = MakeConfig(preset, {});
  ASSERT_TRUE(config.ok()) << config.status().message();
  config->set_compute_dtype(compute_dtype);
  auto program = BuildProgram(*config);
  ASSERT_TRUE(program.ok()) << program.status().message();
  const bool f32 = compute_dtype == proto::DTYPE_F32;

  DeviceMemoryPool pool;
  const int num_tensors = program->tensors_size();
  std::vector<std::vector<float>> cpu_f32(num_tensors);
  std::vector<std::vector<int32_t>> cpu_i32(num_tensors);
  std::vector<DeviceTensor> gpu(num_tensors);          // in the tensor's dtype
  std::vector<DeviceTensor> gpu_compute(num_tensors);  // params: the compute-dtype copy
  auto token_source = TokenSource::Open(*config);
  ASSERT_TRUE(token_source.ok()) << token_source.status().message();

  const proto::Tensor* tokens = nullptr;
  const proto::Tensor* targets = nullptr;
  for (const proto::Tensor& t : program->tensors()) {
    const int64_t n = NumElements(t);
    if (t.dtype() == proto::DTYPE_I32) {
      cpu_i32[t.id()].resize(n);
    } else {
      cpu_f32[t.id()].assign(n, 0.0f);
    }
    if (t.role() == proto::ROLE_PARAM) InitParamSlice(*config, t, 0, n, cpu_f32[t.id()].data());
    if (t.name() == "tokens") tokens = &t;
    if (t.name() == "targets") targets = &t;
  }
  ASSERT_NE(tokens, nullptr);
  ASSERT_NE(targets, nullptr);
  // The inputs: micro-batch 0 of step 0 on rank 0 of 1.
  for (int64_t b = 0; b < config->micro_batch(); ++b) {
    (*token_source)
        ->Sample(SampleIndex(*config, 1, 0, 0, 0, b),
                 cpu_i32[tokens->id()].data() + b * config->seq(),
                 cpu_i32[targets->id()].data() + b * config->seq());
  }
  for (const proto::Tensor& t : program->tensors()) {
    const Shape shape(t.shape().begin(), t.shape().end());
    if (t.dtype() == proto::DTYPE_I32) {
      gpu[t.id()] = pool.UploadInts(cpu_i32[t.id()], shape);
    } else if (t.role() == proto::ROLE_PARAM) {
      gpu[t.id()] = pool.UploadFloats(cpu_f32[t.id()], shape, proto::DTYPE_F32);
      gpu_compute[t.id()] =
          f32 ? gpu[t.id()] : pool.UploadFloats(cpu_f32[t.id()], shape, compute_dtype);
    } else if (t.role() != proto::ROLE_OPTIMIZER_STATE) {
      gpu[t.id()] = pool.Allocate(shape, t.dtype());
    }
  }

  const double grad_scale = 1.0 / static_cast<double>(TokensPerStep(*config, 1));
  KernelContext cpu_context;
  cpu_context.config = &program->config();
  cpu_context.grad_scale = grad_scale;
  CudaKernelContext context = SyncContext();
  context.config = &program->config();
  context.grad_scale = grad_scale;

  int compared_ops = 0, optimizer_ops = 0;
  for (const proto::Op& op : program->ops()) {
    SCOPED_TRACE("op " + op.name() + " (" + op.kind() + ")");
    std::vector<TensorRef> cpu_in, cpu_out;
    std::vector<DeviceTensor> gpu_in, gpu_out;
    const bool optimizer = op.phase() == proto::PHASE_OPTIMIZER;
    for (int id : op.inputs()) {
      const proto::Tensor& t = program->tensors(id);
      TensorRef ref;
      ref.shape.assign(t.shape().begin(), t.shape().end());
      if (t.dtype() == proto::DTYPE_I32) {
        ref.i32 = cpu_i32[id].data();
      } else {
        ref.f32 = cpu_f32[id].data();
      }
      cpu_in.push_back(ref);
      if (optimizer) {
        gpu_in.push_back(pool.UploadFloats(cpu_f32[id], ref.shape, proto::DTYPE_F32));
      } else {
        gpu_in.push_back(t.role() == proto::ROLE_PARAM ? gpu_compute[id] : gpu[id]);
      }
    }
    for (int id : op.outputs()) {
      const proto::Tensor& t = program->tensors(id);
      TensorRef ref;
      ref.shape.assign(t.shape().begin(), t.shape().end());
      if (t.dtype() == proto::DTYPE_I32) {
        ref.i32 = cpu_i32[id].data();  // a router's expert ids
      } else {
        ref.f32 = cpu_f32[id].data();
      }
      cpu_out.push_back(ref);
      gpu_out.push_back(gpu[id]);
    }
    Check(RunCpuOp(op, cpu_in, cpu_out, cpu_context));
    Check(RunCudaOp(op, gpu_in, gpu_out, context));
    if (optimizer) {
      ++optimizer_ops;
      const char* names[] = {"param", "grad", "m", "v"};
      for (int i = 0; i < 4; ++i) {
        const std::vector<float> got = DownloadFloats(gpu_in[i]);
        EXPECT_EQ(0, std::memcmp(got.data(), cpu_in[i].f32, got.size() * sizeof(float)))
            << names[i] << " after the update differs from the CPU backend";
      }
      continue;
    }
    ++compared_ops;
    for (size_t i = 0; i < gpu_out.size(); ++i) {
      const int id = op.outputs(static_cast<int>(i));
      const bool is_loss = program->tensors(id).name() == "loss";
      if (!f32 && !is_loss) continue;  // bf16: only the loss is held to a bound
      if (program->tensors(id).dtype() == proto::DTYPE_I32) {
        // fp32 router logits agree to ~1e-6, so both backends route every token alike.
        EXPECT_EQ(DownloadInts(gpu_out[i]), cpu_i32[id])
            << "output " << program->tensors(id).name();
        continue;
      }
      ExpectClose(DownloadFloats(gpu_out[i]), cpu_f32[id],
                  f32 ? kModelF32Tolerance : kModelBF16LossTolerance,
                  "output " + program->tensors(id).name());
    }
  }
  EXPECT_GT(compared_ops, 0);
  EXPECT_GT(optimizer_ops, 0);
}

class GpuTinyModel : public ::testing::TestWithParam<std::string> {};

TEST_P(GpuTinyModel, ForwardBackwardF32MatchesCpuOpByOp) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  RunTinyModel(GetParam(), proto::DTYPE_F32);
}

TEST_P(GpuTinyModel, ForwardBackwardBF16LossMatchesCpu) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  RunTinyModel(GetParam(), proto::DTYPE_BF16);
}

INSTANTIATE_TEST_SUITE_P(DenseAndMoe, GpuTinyModel, ::testing::Values("tiny", "mixtral-tiny"),
                         [](const auto& info) {
                           std::string name = info.param;
                           std::replace(name.begin(), name.end(), '-', '_');
                           return name;
                         });

// ---------------------------------------------------------------------------------------------
// The device layer

TEST(GpuDevice, InfoStreamsEventsArenaPinned) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  auto info = GetCudaDeviceInfo(0);
  ASSERT_TRUE(info.ok()) << info.status().message();
  EXPECT_GT(info->multiprocessors, 0);
  EXPECT_GT(info->memory_bytes, 0);
  std::printf("device 0: %s, sm_%d%d, %d SMs, driver %d, runtime %d\n", info->name.c_str(),
              info->compute_capability_major, info->compute_capability_minor, info->multiprocessors,
              info->driver_version, info->runtime_version);
  EXPECT_FALSE(GetCudaDeviceInfo(CudaDeviceCount()).ok());

  auto streams = CudaStreamSet::Create();
  ASSERT_TRUE(streams.ok()) << streams.status().message();
  for (proto::Stream s : {proto::STREAM_COMPUTE, proto::STREAM_GATHER, proto::STREAM_REDUCE,
                          proto::STREAM_H2D, proto::STREAM_D2H}) {
    EXPECT_NE(streams->get(s), nullptr) << StreamName(s);
  }
  EXPECT_EQ(streams->get(proto::STREAM_UNSPECIFIED), nullptr);

  auto arena = DeviceArena::Create(1 << 20);
  ASSERT_TRUE(arena.ok()) << arena.status().message();
  auto buffer = arena->Buffer(4096, 1024, "buffer");
  ASSERT_TRUE(buffer.ok()) << buffer.status().message();
  EXPECT_EQ(static_cast<char*>(*buffer) - static_cast<char*>(arena->base()), 4096);
  EXPECT_FALSE(arena->Buffer((1 << 20) - 512, 1024, "past the end").ok());
  EXPECT_FALSE(arena->Buffer(100, 16, "unaligned").ok());

  // h2d on one stream, d2h on another after an event: the bytes come back.
  auto pinned_in = PinnedHostBuffer::Create(1024, "in");
  auto pinned_out = PinnedHostBuffer::Create(1024, "out");
  ASSERT_TRUE(pinned_in.ok() && pinned_out.ok());
  std::memset(pinned_in->data(), 0x5A, 1024);
  std::memset(pinned_out->data(), 0, 1024);
  auto copied = CudaEvent::Create(true);
  auto start = CudaEvent::Create(true);
  ASSERT_TRUE(copied.ok() && start.ok());
  Check(start->Record(streams->get(proto::STREAM_H2D)));
  Check(CopyAsync(*buffer, pinned_in->data(), 1024, streams->get(proto::STREAM_H2D), "h2d"));
  Check(copied->Record(streams->get(proto::STREAM_H2D)));
  Check(copied->MakeStreamWait(streams->get(proto::STREAM_D2H)));
  Check(CopyAsync(pinned_out->data(), *buffer, 1024, streams->get(proto::STREAM_D2H), "d2h"));
  Check(streams->SynchronizeAll());
  EXPECT_EQ(0, std::memcmp(pinned_in->data(), pinned_out->data(), 1024));
  auto done = copied->Done();
  ASSERT_TRUE(done.ok());
  EXPECT_TRUE(*done);
  auto ms = CudaEvent::ElapsedMs(*start, *copied);
  ASSERT_TRUE(ms.ok()) << ms.status().message();
  EXPECT_GE(*ms, 0.0f);
}

// ---------------------------------------------------------------------------------------------
// Timings at a real layer's shapes (llama3-8b, one sequence of 2048 tokens, bf16). Opt-in: set
// DC_GPU_BENCH=1; prints one line per op kind, for bench/ records.

constexpr int64_t kBenchVocab = 128256;

TEST(GpuBench, Llama8bLayerKernels) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  if (std::getenv("DC_GPU_BENCH") == nullptr) GTEST_SKIP() << "set DC_GPU_BENCH=1 to time kernels";
  constexpr int kWarmups = 3, kRepeats = 20;
  const int64_t tokens = 2048, hidden = 4096, heads = 32, kv_heads = 8, head_dim = 128;
  const int64_t ffn = 14336, vocab = kBenchVocab;
  const proto::DType bf16 = proto::DTYPE_BF16;
  DeviceMemoryPool pool;
  // Outputs start at zero; inputs are random (zeros can run faster than real data, and hide
  // wrong indexing): normal(0, 1) floats, token ids uniform over the vocabulary.
  auto zeros = [&](Shape shape, proto::DType dtype) {
    DeviceTensor t = pool.Allocate(std::move(shape), dtype);
    Check(CudaStatus(cudaMemset(t.data, 0, t.SizeBytes()), "memset"));
    Check(CudaStatus(cudaDeviceSynchronize(), "memset"));
    return t;
  };
  std::mt19937 rng(2026);
  auto random = [&](Shape shape, proto::DType dtype) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    if (dtype == proto::DTYPE_I32) {
      std::uniform_int_distribution<int32_t> id(0, static_cast<int32_t>(kBenchVocab) - 1);
      std::vector<int32_t> ids(static_cast<size_t>(n));
      for (int32_t& v : ids) v = id(rng);
      return pool.UploadInts(ids, std::move(shape));
    }
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> values(static_cast<size_t>(n));
    for (float& v : values) v = normal(rng);
    return pool.UploadFloats(values, std::move(shape), dtype);
  };
  auto stream = CudaStream::Create();
  ASSERT_TRUE(stream.ok());
  CudaKernelContext context;
  context.resources = &Resources();
  context.stream = stream->get();
  context.grad_scale = 1.0 / tokens;
  auto start = CudaEvent::Create(true);
  auto end = CudaEvent::Create(true);
  ASSERT_TRUE(start.ok() && end.ok());

  auto measure = [&](const proto::Op& op, std::vector<DeviceTensor> in,
                     std::vector<DeviceTensor> out, double flops, double bytes) {
    for (int i = 0; i < kWarmups; ++i) Check(RunCudaOp(op, in, out, context));
    Check(start->Record(context.stream));
    for (int i = 0; i < kRepeats; ++i) Check(RunCudaOp(op, in, out, context));
    Check(end->Record(context.stream));
    Check(end->Synchronize());
    auto ms = CudaEvent::ElapsedMs(*start, *end);
    ASSERT_TRUE(ms.ok()) << ms.status().message();
    const double seconds = *ms / 1e3 / kRepeats;
    std::printf("bench %-22s %9.3f ms  %8.1f TFLOP/s  %8.1f GB/s\n", op.kind().c_str(),
                seconds * 1e3, flops / seconds / 1e12, bytes / seconds / 1e9);
  };
  const std::map<std::string, int64_t> attn = {
      {op_attr::kHeads, heads}, {op_attr::kKvHeads, kv_heads}, {op_attr::kHeadDim, head_dim}};
  const auto eps = std::map<std::string, double>{{op_attr::kEps, 1e-5}};
  const DeviceTensor x = random({1, tokens, hidden}, bf16);
  const DeviceTensor q = random({1, tokens, heads * head_dim}, bf16);
  const DeviceTensor kv = random({1, tokens, kv_heads * head_dim}, bf16);
  const DeviceTensor w = random({hidden, hidden}, bf16);
  const DeviceTensor norm_w = random({hidden}, bf16);
  const DeviceTensor gate = random({1, tokens, ffn}, bf16);
  const DeviceTensor logits = random({1, tokens, vocab}, bf16);
  const DeviceTensor targets = random({1, tokens}, proto::DTYPE_I32);
  const DeviceTensor table = random({vocab, hidden}, bf16);
  const double s2 = static_cast<double>(tokens) * tokens;
  const double two_bytes = 2;

  measure(MakeOp(op_kind::kMatmul), {x, w}, {zeros({1, tokens, hidden}, bf16)},
          2.0 * tokens * hidden * hidden, two_bytes * (2.0 * tokens * hidden + hidden * hidden));
  measure(MakeOp(op_kind::kMatmulBackward), {x, x, w}, {zeros(x.shape, bf16), zeros(w.shape, bf16)},
          4.0 * tokens * hidden * hidden,
          two_bytes * (4.0 * tokens * hidden + 2.0 * hidden * hidden));
  measure(MakeOp(op_kind::kAttention, attn), {q, kv, kv}, {zeros(q.shape, bf16)},
          2.0 * heads * s2 * head_dim, two_bytes * (2.0 * tokens * hidden + 2.0 * tokens * 1024));
  measure(MakeOp(op_kind::kAttentionBackward, attn), {q, q, kv, kv},
          {zeros(q.shape, bf16), zeros(kv.shape, bf16), zeros(kv.shape, bf16)},
          5.0 * heads * s2 * head_dim, two_bytes * (4.0 * tokens * hidden + 4.0 * tokens * 1024));
  measure(MakeOp(op_kind::kRmsNorm, {}, eps), {x, norm_w}, {zeros(x.shape, bf16)},
          4.0 * tokens * hidden, two_bytes * 2.0 * tokens * hidden);
  measure(MakeOp(op_kind::kRmsNormBackward, {}, eps), {x, x, norm_w},
          {zeros(x.shape, bf16), zeros({hidden}, bf16)}, 8.0 * tokens * hidden,
          two_bytes * 3.0 * tokens * hidden);
  measure(MakeOp(op_kind::kRope, {{op_attr::kHeads, heads}, {op_attr::kHeadDim, head_dim}},
                 {{op_attr::kTheta, 5e5}}),
          {q}, {zeros(q.shape, bf16)}, 3.0 * tokens * hidden, two_bytes * 2.0 * tokens * hidden);
  measure(MakeOp(op_kind::kSwiglu), {gate, gate}, {zeros(gate.shape, bf16)}, 5.0 * tokens * ffn,
          two_bytes * 3.0 * tokens * ffn);
  measure(MakeOp(op_kind::kSwigluBackward), {gate, gate, gate},
          {zeros(gate.shape, bf16), zeros(gate.shape, bf16)}, 10.0 * tokens * ffn,
          two_bytes * 5.0 * tokens * ffn);
  measure(MakeOp(op_kind::kAdd), {x, x}, {zeros(x.shape, bf16)}, 1.0 * tokens * hidden,
          two_bytes * 3.0 * tokens * hidden);
  measure(MakeOp(op_kind::kCrossEntropy), {logits, targets}, {zeros({1}, proto::DTYPE_F32)},
          4.0 * tokens * vocab, two_bytes * tokens * vocab);
  measure(MakeOp(op_kind::kCrossEntropyBackward), {logits, targets}, {zeros(logits.shape, bf16)},
          4.0 * tokens * vocab, two_bytes * 3.0 * tokens * vocab);
  measure(MakeOp(op_kind::kEmbedding), {targets, table}, {zeros(x.shape, bf16)}, 0,
          two_bytes * 2.0 * tokens * hidden);
  measure(MakeOp(op_kind::kEmbeddingBackward), {x, targets}, {zeros(table.shape, bf16)},
          1.0 * tokens * hidden, two_bytes * (1.0 * tokens * hidden + 1.0 * vocab * hidden));
  const int64_t shard = int64_t{1} << 26;  // 64 Mi fp32 elements
  const DeviceTensor p = random({shard}, proto::DTYPE_F32);
  measure(MakeOp(op_kind::kAdamW, {},
                 {{op_attr::kLr, 1e-4},
                  {op_attr::kBeta1, 0.9},
                  {op_attr::kBeta2, 0.95},
                  {op_attr::kEps, 1e-8},
                  {op_attr::kWeightDecay, 0.1}}),
          {p, random({shard}, proto::DTYPE_F32), zeros({shard}, proto::DTYPE_F32),
           zeros({shard}, proto::DTYPE_F32)},  // param, grad random; m, v as at the first step
          {}, 12.0 * shard, 4.0 * 7.0 * shard);
  Check(CudaStatus(cudaStreamSynchronize(context.stream), "bench"));
}

// ---------------------------------------------------------------------------------------------
// NCCL

#if defined(DC_HAVE_NCCL)

std::string TempDir(const std::string& name) {
  const auto dir =
      std::filesystem::temp_directory_path() /
      (name + "-" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) + "-" +
       std::to_string(std::chrono::steady_clock::now().time_since_epoch().count()));
  std::filesystem::create_directories(dir);
  return dir.string();
}

TEST(GpuNccl, WorldOfOne) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  RendezvousOptions options;
  options.store_dir = TempDir("dc-nccl");
  options.timeout = std::chrono::milliseconds(30000);
  auto stream = CudaStream::Create();
  ASSERT_TRUE(stream.ok());
  auto comm = ConnectNcclCommunicator(options, stream->get());
  ASSERT_TRUE(comm.ok()) << comm.status().message();
  // Rank 0 removes the id once every rank has joined.
  EXPECT_FALSE(std::filesystem::exists(NcclIdPath(options)));
  NcclCommunicator& c = **comm;
  EXPECT_EQ(c.rank(), 0);
  EXPECT_EQ(c.world_size(), 1);

  DeviceMemoryPool pool;
  const std::vector<float> values = {1.5f, -2.0f, 3.25f, 0.0f, 7.0f};
  DeviceTensor shard = pool.UploadFloats(values, {5}, proto::DTYPE_F32);
  DeviceTensor full = pool.Allocate({5}, proto::DTYPE_F32);
  Check(c.AllGather(static_cast<const float*>(shard.data), 5, static_cast<float*>(full.data)));
  EXPECT_EQ(DownloadFloats(full), values);
  DeviceTensor back = pool.Allocate({5}, proto::DTYPE_F32);
  Check(c.ReduceScatterSum(static_cast<float*>(full.data), 5, static_cast<float*>(back.data)));
  EXPECT_EQ(DownloadFloats(back), values);

  double sums[3] = {1.0, 2.0, 3.0};
  Check(c.AllReduceSum(sums, 3));
  EXPECT_EQ(sums[2], 3.0);
  double maxes[2] = {-1.0, 4.0};
  Check(c.AllReduceMax(maxes, 2));
  EXPECT_EQ(maxes[0], -1.0);
  int64_t value = 42;
  Check(c.Broadcast(&value, 0));
  EXPECT_EQ(value, 42);
  EXPECT_FALSE(c.Broadcast(&value, 1).ok());

  // Grouped, mixed dtypes, then a wait.
  DeviceTensor bf16_shard = pool.UploadFloats(values, {5}, proto::DTYPE_BF16);
  DeviceTensor bf16_full = pool.Allocate({5}, proto::DTYPE_BF16);
  DeviceTensor f32_full = pool.Allocate({5}, proto::DTYPE_F32);
  const NcclGatherItem gathers[] = {{bf16_shard.data, bf16_full.data, 5, proto::DTYPE_BF16},
                                    {shard.data, f32_full.data, 5, proto::DTYPE_F32}};
  Check(c.AllGatherGroup(gathers));
  DeviceTensor bf16_back = pool.Allocate({5}, proto::DTYPE_BF16);
  const NcclReduceScatterItem scatters[] = {{bf16_full.data, bf16_back.data, 5, proto::DTYPE_BF16}};
  Check(c.ReduceScatterGroup(scatters));
  Check(c.Synchronize("grouped calls"));
  EXPECT_EQ(DownloadFloats(bf16_back), Rounded(values, proto::DTYPE_BF16));
  EXPECT_EQ(DownloadFloats(f32_full), values);
  std::filesystem::remove_all(options.store_dir);
}

TEST(GpuNccl, MissingRankZeroTimesOut) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  RendezvousOptions options;
  options.rank = 1;
  options.world_size = 2;
  options.store_dir = TempDir("dc-nccl-missing");
  options.timeout = std::chrono::milliseconds(300);
  const auto begin = std::chrono::steady_clock::now();
  auto comm = ConnectNccl(options, nullptr);
  ASSERT_FALSE(comm.ok());
  EXPECT_NE(comm.status().message().find("rank 1: no NCCL id at"), std::string::npos)
      << comm.status().message();
  EXPECT_LT(std::chrono::steady_clock::now() - begin, std::chrono::seconds(10));
  std::filesystem::remove_all(options.store_dir);
}

#endif  // DC_HAVE_NCCL

}  // namespace
}  // namespace dc
