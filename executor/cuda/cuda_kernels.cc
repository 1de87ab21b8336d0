#include "executor/cuda/cuda_kernels.h"

#include <cublasLt.h>

#include <algorithm>
#include <cmath>
#include <compare>
#include <iterator>
#include <limits>
#include <map>
#include <optional>

#include "executor/cuda/cuda_device.h"
#include "executor/cuda/kernel_launch.h"
#include "schemas/op_kinds.h"

namespace dc {

namespace ck = cuda_kernels;

namespace {

using Shape = std::vector<int64_t>;
using Tensors = std::span<const DeviceTensor>;

// Launch geometry limits: rows, tokens and (batch * seq) index grid.x.
constexpr int64_t kMaxGridX = std::numeric_limits<int32_t>::max();
constexpr int64_t kMaxGridY = 65535;
// cuBLASLt wants pointers aligned to this for its fastest kernels.
constexpr uint32_t kMaxPointerAlignmentBytes = 256;
// Granularity of the resources' own scratch buffer.
constexpr int64_t kScratchGranularityBytes = int64_t{1} << 20;

std::string ShapeString(const Shape& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

Status OpError(const proto::Op& op, const std::string& message) {
  return Status::Error("op " + op.name() + " (" + op.kind() + "): " + message);
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

const char* FloatTypeName(ck::FloatType type) {
  switch (type) {
    case ck::FloatType::kF32:
      return "f32";
    case ck::FloatType::kBF16:
      return "bf16";
    case ck::FloatType::kF16:
      return "f16";
  }
  return "?";
}

bool ToFloatType(proto::DType dtype, ck::FloatType* type) {
  switch (dtype) {
    case proto::DTYPE_F32:
      *type = ck::FloatType::kF32;
      return true;
    case proto::DTYPE_BF16:
      *type = ck::FloatType::kBF16;
      return true;
    case proto::DTYPE_F16:
      *type = ck::FloatType::kF16;
      return true;
    default:
      return false;
  }
}

// Operand checks of one op. The first float operand checked fixes the op's compute dtype; every
// later float operand must have it (except those checked with FloatAs, e.g. the fp32 loss).
class Checker {
 public:
  explicit Checker(const proto::Op& op) : op_(op) {}
  // For sizing scratch before any buffer exists: every check but the data pointers'.
  static Checker ShapesOnly(const proto::Op& op) {
    Checker check(op);
    check.check_data_ = false;
    return check;
  }

  Status Error(const std::string& message) const { return OpError(op_, message); }

  Status Arity(Tensors in, Tensors out, size_t num_inputs, size_t num_outputs) const {
    if (in.size() != num_inputs || out.size() != num_outputs) {
      return Error("expects " + std::to_string(num_inputs) + " inputs and " +
                   std::to_string(num_outputs) + " outputs, got " + std::to_string(in.size()) +
                   " and " + std::to_string(out.size()));
    }
    return Status::Ok();
  }

  Status Float(const DeviceTensor& t, const Operand& what) {
    ck::FloatType type{};
    if (!ToFloatType(t.dtype, &type)) {
      return Error(what.Label() + " has dtype " + DTypeName(t.dtype) +
                   ", expected a float dtype (f32, bf16, f16)");
    }
    if (!type_set_) {
      type_ = type;
      type_set_ = true;
      type_from_ = what.Label();
    } else if (type != type_) {
      return Error(what.Label() + " has dtype " + DTypeName(t.dtype) + ", expected " +
                   FloatTypeName(type_) + " like " + type_from_);
    }
    return Data(t, what);
  }

  Status FloatAs(const DeviceTensor& t, proto::DType dtype, const Operand& what) const {
    if (t.dtype != dtype) {
      return Error(what.Label() + " has dtype " + DTypeName(t.dtype) + ", expected " +
                   DTypeName(dtype));
    }
    return Data(t, what);
  }

  Status I32(const DeviceTensor& t, const Operand& what) const {
    return FloatAs(t, proto::DTYPE_I32, what);
  }

  Status ShapeIs(const DeviceTensor& t, const Shape& expected, const Operand& what) const {
    if (t.shape != expected) {
      return Error(what.Label() + " has shape " + ShapeString(t.shape) + ", expected " +
                   ShapeString(expected));
    }
    return Status::Ok();
  }

  // Rank in [min_rank, max_rank] and no empty dimension.
  Status Rank(const DeviceTensor& t, size_t min_rank, const Operand& what,
              size_t max_rank = std::numeric_limits<size_t>::max()) const {
    if (t.shape.size() < min_rank || t.shape.size() > max_rank) {
      const std::string expected =
          min_rank == max_rank ? std::to_string(min_rank) : std::to_string(min_rank) + " or more";
      return Error(what.Label() + " has shape " + ShapeString(t.shape) + ", expected rank " +
                   expected);
    }
    for (int64_t d : t.shape) {
      if (d <= 0) {
        return Error(what.Label() + " has shape " + ShapeString(t.shape) +
                     ", with an empty dimension");
      }
    }
    return Status::Ok();
  }

  Status FitsGrid(int64_t value, int64_t limit, const std::string& what) const {
    if (value > limit) {
      return Error(what + " " + std::to_string(value) + " exceeds the CUDA backend's limit of " +
                   std::to_string(limit));
    }
    return Status::Ok();
  }

  Status IntAttr(const char* name, int64_t* value) const {
    *value = AttrInt(op_, name, 0);
    if (*value <= 0) return Error(std::string("needs a positive int attr '") + name + "'");
    return Status::Ok();
  }

  Status FloatAttr(const char* name, double* value) const {
    *value = AttrFloat(op_, name, 0);
    if (!(*value > 0)) return Error(std::string("needs a positive attr '") + name + "'");
    return Status::Ok();
  }

  Status NonNegativeFloatAttr(const char* name, double* value) const {
    *value = AttrFloat(op_, name, 0);
    if (!(*value >= 0)) return Error(std::string("attr '") + name + "' must not be negative");
    return Status::Ok();
  }

  ck::FloatType type() const { return type_; }

 private:
  Status Data(const DeviceTensor& t, const Operand& what) const {
    if (check_data_ && t.data == nullptr && t.NumElements() > 0) {
      return Error(what.Label() + " has no data");
    }
    return Status::Ok();
  }

  const proto::Op& op_;
  bool check_data_ = true;
  bool type_set_ = false;
  ck::FloatType type_ = ck::FloatType::kF32;
  std::string type_from_;
};

Shape WithLast(Shape shape, int64_t last) {
  shape.back() = last;
  return shape;
}

Shape DropLast(Shape shape) {
  shape.pop_back();
  return shape;
}

Shape Append(Shape shape, int64_t last) {
  shape.push_back(last);
  return shape;
}

Status Launched(const proto::Op& op, cudaError_t error) {
  return CudaStatus(error, "kernel launch").Prefixed("op " + op.name() + " (" + op.kind() + "): ");
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Resources

namespace {

// One cached matrix product: its descriptors and the algorithm the heuristic chose.
struct MatmulPlan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  ~MatmulPlan() {
    if (c != nullptr) (void)cublasLtMatrixLayoutDestroy(c);
    if (b != nullptr) (void)cublasLtMatrixLayoutDestroy(b);
    if (a != nullptr) (void)cublasLtMatrixLayoutDestroy(a);
    if (desc != nullptr) (void)cublasLtMatmulDescDestroy(desc);
  }
};

// Column-major C [m x n] = op(A) op(B) in cuBLAS's terms.
struct MatmulKey {
  cudaDataType_t type;
  bool trans_a, trans_b;
  int64_t m, n, k, lda, ldb, ldc;
  uint32_t align_a, align_b, align_c;  // pointer alignment in bytes, up to 256
  auto operator<=>(const MatmulKey&) const = default;
};

Status CublasStatus(cublasStatus_t status, const std::string& what) {
  if (status == CUBLAS_STATUS_SUCCESS) return Status::Ok();
  return Status::Error(what + ": " + cublasLtGetStatusName(status) + " (" +
                       cublasLtGetStatusString(status) + ")");
}

uint32_t PointerAlignment(const void* p) {
  const auto address = reinterpret_cast<uintptr_t>(p);
  if (address == 0) return kMaxPointerAlignmentBytes;
  return static_cast<uint32_t>(
      std::min<uintptr_t>(address & (~address + 1), kMaxPointerAlignmentBytes));
}

}  // namespace

struct CudaKernelResources::Impl {
  ~Impl() {
    matmuls.clear();
    if (lt != nullptr) (void)cublasLtDestroy(lt);
  }

  cublasLtHandle_t lt = nullptr;
  DeviceBuffer workspace;
  DeviceBuffer device_error;      // int32 [kDeviceErrorInts]
  PinnedHostBuffer host_error;    // its copy on the host
  PinnedHostBuffer host_offsets;  // the grouped matmuls' segment offsets, grown on demand
  DeviceBuffer scratch;
  CudaDeviceInfo device;
  std::map<MatmulKey, std::unique_ptr<MatmulPlan>> matmuls;

  int32_t* device_error_ints() const { return static_cast<int32_t*>(device_error.data()); }

  // The plan for `key`: built, with the heuristic's best algorithm, on first use.
  StatusOr<const MatmulPlan*> Plan(const MatmulKey& key) {
    if (auto it = matmuls.find(key); it != matmuls.end()) return it->second.get();
    auto plan = std::make_unique<MatmulPlan>();
    DC_RETURN_IF_ERROR(
        CublasStatus(cublasLtMatmulDescCreate(&plan->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F),
                     "cublasLtMatmulDescCreate"));
    const cublasOperation_t op_a = key.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t op_b = key.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    DC_RETURN_IF_ERROR(
        CublasStatus(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a,
                                                    sizeof(op_a)),
                     "cublasLtMatmulDescSetAttribute(TRANSA)"));
    DC_RETURN_IF_ERROR(
        CublasStatus(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b,
                                                    sizeof(op_b)),
                     "cublasLtMatmulDescSetAttribute(TRANSB)"));
    // Stored shapes (column-major): A is m x k, or k x m when transposed; B likewise.
    const auto rows_a = static_cast<uint64_t>(key.trans_a ? key.k : key.m);
    const auto cols_a = static_cast<uint64_t>(key.trans_a ? key.m : key.k);
    const auto rows_b = static_cast<uint64_t>(key.trans_b ? key.n : key.k);
    const auto cols_b = static_cast<uint64_t>(key.trans_b ? key.k : key.n);
    DC_RETURN_IF_ERROR(
        CublasStatus(cublasLtMatrixLayoutCreate(&plan->a, key.type, rows_a, cols_a, key.lda),
                     "cublasLtMatrixLayoutCreate(A)"));
    DC_RETURN_IF_ERROR(
        CublasStatus(cublasLtMatrixLayoutCreate(&plan->b, key.type, rows_b, cols_b, key.ldb),
                     "cublasLtMatrixLayoutCreate(B)"));
    DC_RETURN_IF_ERROR(
        CublasStatus(cublasLtMatrixLayoutCreate(&plan->c, key.type, static_cast<uint64_t>(key.m),
                                                static_cast<uint64_t>(key.n), key.ldc),
                     "cublasLtMatrixLayoutCreate(C)"));

    cublasLtMatmulPreference_t preference = nullptr;
    DC_RETURN_IF_ERROR(CublasStatus(cublasLtMatmulPreferenceCreate(&preference),
                                    "cublasLtMatmulPreferenceCreate"));
    struct PreferenceOwner {
      cublasLtMatmulPreference_t p;
      ~PreferenceOwner() { (void)cublasLtMatmulPreferenceDestroy(p); }
    } owner{preference};
    const auto workspace_bytes = static_cast<uint64_t>(workspace.size_bytes());
    DC_RETURN_IF_ERROR(CublasStatus(
        cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                             &workspace_bytes, sizeof(workspace_bytes)),
        "cublasLtMatmulPreferenceSetAttribute(MAX_WORKSPACE_BYTES)"));
    const std::pair<cublasLtMatmulPreferenceAttributes_t, uint32_t> alignments[] = {
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, key.align_a},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, key.align_b},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, key.align_c},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, key.align_c},
    };
    for (const auto& [attribute, bytes] : alignments) {
      DC_RETURN_IF_ERROR(CublasStatus(
          cublasLtMatmulPreferenceSetAttribute(preference, attribute, &bytes, sizeof(bytes)),
          "cublasLtMatmulPreferenceSetAttribute(MIN_ALIGNMENT)"));
    }
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    DC_RETURN_IF_ERROR(
        CublasStatus(cublasLtMatmulAlgoGetHeuristic(lt, plan->desc, plan->a, plan->b, plan->c,
                                                    plan->c, preference, 1, &result, &found),
                     "cublasLtMatmulAlgoGetHeuristic"));
    if (found == 0) {
      return Status::Error("cuBLASLt has no algorithm for m=" + std::to_string(key.m) +
                           " n=" + std::to_string(key.n) + " k=" + std::to_string(key.k));
    }
    plan->algo = result.algo;
    const MatmulPlan* raw = plan.get();
    matmuls.emplace(key, std::move(plan));
    return raw;
  }

  // Column-major C = op(A) op(B) on `stream` (beta = 0: C is only written).
  Status Matmul(cudaDataType_t type, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                const void* a, int64_t lda, const void* b, int64_t ldb, void* c, int64_t ldc,
                cudaStream_t stream) {
    const MatmulKey key{type,
                        trans_a,
                        trans_b,
                        m,
                        n,
                        k,
                        lda,
                        ldb,
                        ldc,
                        PointerAlignment(a),
                        PointerAlignment(b),
                        PointerAlignment(c)};
    DC_ASSIGN_OR_RETURN(const MatmulPlan* plan, Plan(key));
    const float alpha = 1.0f, beta = 0.0f;
    return CublasStatus(cublasLtMatmul(lt, plan->desc, &alpha, a, plan->a, b, plan->b, &beta, c,
                                       plan->c, c, plan->c, &plan->algo, workspace.data(),
                                       static_cast<size_t>(workspace.size_bytes()), stream),
                        "cublasLtMatmul");
  }

  // Scratch of at least `bytes` for one op: the context's, else ours (grown on demand).
  StatusOr<void*> Scratch(const CudaKernelContext& context, int64_t bytes, const proto::Op& op) {
    if (bytes == 0) return static_cast<void*>(nullptr);
    if (context.scratch != nullptr) {
      if (context.scratch_bytes < bytes) {
        return OpError(op, "needs " + std::to_string(bytes) +
                               " bytes of scratch, the context gives " +
                               std::to_string(context.scratch_bytes));
      }
      return context.scratch;
    }
    if (scratch.size_bytes() < bytes) {
      // The old buffer may still be in use by enqueued work.
      DC_RETURN_IF_ERROR(CudaStatus(cudaDeviceSynchronize(), "growing the kernel scratch"));
      scratch = DeviceBuffer();
      const int64_t rounded = (bytes + kScratchGranularityBytes - 1) / kScratchGranularityBytes *
                              kScratchGranularityBytes;
      DC_ASSIGN_OR_RETURN(scratch, DeviceBuffer::Create(rounded, "kernel scratch"));
    }
    return scratch.data();
  }
};

CudaKernelResources::CudaKernelResources(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudaKernelResources::~CudaKernelResources() = default;

StatusOr<std::unique_ptr<CudaKernelResources>> CudaKernelResources::Create(
    const CudaKernelOptions& options) {
  if (CudaDeviceCount() == 0)
    return Status::Error("the CUDA backend needs a CUDA device; none found");
  auto impl = std::make_unique<Impl>();
  DC_ASSIGN_OR_RETURN(const int ordinal, CurrentCudaDevice());
  DC_ASSIGN_OR_RETURN(impl->device, GetCudaDeviceInfo(ordinal));
  DC_RETURN_IF_ERROR(CublasStatus(cublasLtCreate(&impl->lt), "cublasLtCreate"));
  DC_ASSIGN_OR_RETURN(impl->workspace,
                      DeviceBuffer::Create(options.cublas_workspace_bytes, "cuBLASLt workspace"));
  constexpr int64_t kErrorBytes = ck::kDeviceErrorInts * sizeof(int32_t);
  DC_ASSIGN_OR_RETURN(impl->device_error, DeviceBuffer::Create(kErrorBytes, "device error record"));
  DC_ASSIGN_OR_RETURN(impl->host_error,
                      PinnedHostBuffer::Create(kErrorBytes, "device error record"));
  DC_RETURN_IF_ERROR(CudaStatus(cudaMemset(impl->device_error.data(), 0, kErrorBytes),
                                "clearing the device error record"));
  return std::unique_ptr<CudaKernelResources>(new CudaKernelResources(std::move(impl)));
}

int64_t CudaKernelResources::cached_matmul_algorithms() const {
  return static_cast<int64_t>(impl_->matmuls.size());
}

namespace {

// The message of a device error record {source, position, id, bound}.
std::string DeviceErrorMessage(const int32_t* e) {
  const std::string id = std::to_string(e[2]), position = std::to_string(e[1]);
  const std::string bound = std::to_string(e[3]);
  switch (e[0]) {
    case ck::kBadEmbeddingToken:
      return "embedding: token id " + id + " at position " + position +
             " is outside the vocabulary of " + bound;
    case ck::kBadCrossEntropyTarget:
      return "cross_entropy: target id " + id + " at position " + position +
             " is outside the vocabulary of " + bound;
    case ck::kBadExpertId:
      return "moe routing: expert id " + id + " at slot " + position + " is outside the " + bound +
             " experts";
    default:
      return "the device error record holds the unknown source " + std::to_string(e[0]) +
             "; is DeviceErrorSource (kernel_launch.h) missing from this switch?";
  }
}

}  // namespace

Status CudaKernelResources::CheckDeviceErrors(cudaStream_t stream) {
  constexpr int64_t kErrorBytes = ck::kDeviceErrorInts * sizeof(int32_t);
  DC_RETURN_IF_ERROR(CopyAsync(impl_->host_error.data(), impl_->device_error.data(), kErrorBytes,
                               stream, "reading the device error record"));
  DC_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(stream), "waiting for the stream's kernels"));
  const auto* e = static_cast<const int32_t*>(impl_->host_error.data());
  if (e[0] == ck::kNoDeviceError) return Status::Ok();
  const Status error = Status::Error(DeviceErrorMessage(e));
  DC_RETURN_IF_ERROR(CudaStatus(cudaMemsetAsync(impl_->device_error.data(), 0, kErrorBytes, stream),
                                "clearing the device error record"));
  return error;
}

// ---------------------------------------------------------------------------------------------
// The op kinds. Each checks its operands as the CPU backend does (same messages), then enqueues.

namespace {

using Impl = CudaKernelResources::Impl;

struct Call {
  const proto::Op& op;
  Tensors in;
  Tensors out;
  const CudaKernelContext& context;
  Impl& r;
};

// --- embedding

struct EmbeddingDims {
  int64_t tokens, vocab, hidden;
};

Status CheckEmbedding(Tensors in, Tensors out, bool backward, Checker* check, EmbeddingDims* d) {
  DC_RETURN_IF_ERROR(check->Arity(in, out, 2, 1));
  const DeviceTensor& tokens = backward ? in[1] : in[0];
  const DeviceTensor& table = backward ? out[0] : in[1];
  const Operand tokens_what = backward ? In(1, "tokens") : In(0, "tokens");
  const Operand table_what = backward ? Out(0, "dtable") : In(1, "table");
  DC_RETURN_IF_ERROR(check->I32(tokens, tokens_what));
  DC_RETURN_IF_ERROR(check->Rank(table, 2, table_what, 2));
  DC_RETURN_IF_ERROR(check->Float(table, table_what));
  d->vocab = table.shape[0];
  d->hidden = table.shape[1];
  d->tokens = tokens.NumElements();
  const DeviceTensor& rows = backward ? in[0] : out[0];
  const Operand rows_what = backward ? In(0, "dy") : Out(0, "y");
  DC_RETURN_IF_ERROR(check->Float(rows, rows_what));
  DC_RETURN_IF_ERROR(check->ShapeIs(rows, Append(tokens.shape, d->hidden), rows_what));
  return check->FitsGrid(d->tokens, kMaxGridX, "token count");
}

Status Embedding(Call c) {
  Checker check(c.op);
  EmbeddingDims d{};
  DC_RETURN_IF_ERROR(CheckEmbedding(c.in, c.out, false, &check, &d));
  if (d.tokens == 0) return Status::Ok();
  return Launched(c.op, ck::Embedding(check.type(), static_cast<const int32_t*>(c.in[0].data),
                                      d.tokens, c.in[1].data, d.vocab, d.hidden, c.out[0].data,
                                      c.r.device_error_ints(), c.context.stream));
}

int64_t EmbeddingBackwardScratch(const EmbeddingDims& d) {
  return ck::EmbeddingBackwardScratchInts(d.tokens) * static_cast<int64_t>(sizeof(int32_t));
}

Status EmbeddingBackward(Call c) {
  Checker check(c.op);
  EmbeddingDims d{};
  DC_RETURN_IF_ERROR(CheckEmbedding(c.in, c.out, true, &check, &d));
  DC_ASSIGN_OR_RETURN(void* scratch, c.r.Scratch(c.context, EmbeddingBackwardScratch(d), c.op));
  if (d.tokens == 0) {
    return Launched(c.op,
                    cudaMemsetAsync(c.out[0].data, 0, static_cast<size_t>(c.out[0].SizeBytes()),
                                    c.context.stream));
  }
  return Launched(
      c.op, ck::EmbeddingBackward(check.type(), c.in[0].data,
                                  static_cast<const int32_t*>(c.in[1].data), d.tokens, d.vocab,
                                  d.hidden, c.out[0].data, static_cast<int32_t*>(scratch),
                                  c.r.device_error_ints(), c.context.stream));
}

// --- rmsnorm

struct NormDims {
  int64_t rows, hidden;
  double eps;
};

Status CheckNorm(Tensors in, Tensors out, bool backward, Checker* check, NormDims* d) {
  DC_RETURN_IF_ERROR(backward ? check->Arity(in, out, 3, 2) : check->Arity(in, out, 2, 1));
  const size_t xi = backward ? 1 : 0;
  const DeviceTensor &x = in[xi], &w = in[xi + 1];
  DC_RETURN_IF_ERROR(check->Rank(x, 1, In(xi, "x")));
  DC_RETURN_IF_ERROR(check->Float(x, In(xi, "x")));
  d->hidden = x.shape.back();
  d->rows = x.NumElements() / d->hidden;
  DC_RETURN_IF_ERROR(check->Float(w, In(xi + 1, "w")));
  DC_RETURN_IF_ERROR(check->ShapeIs(w, {d->hidden}, In(xi + 1, "w")));
  if (backward) {
    DC_RETURN_IF_ERROR(check->Float(in[0], In(0, "dy")));
    DC_RETURN_IF_ERROR(check->ShapeIs(in[0], x.shape, In(0, "dy")));
    DC_RETURN_IF_ERROR(check->Float(out[0], Out(0, "dx")));
    DC_RETURN_IF_ERROR(check->ShapeIs(out[0], x.shape, Out(0, "dx")));
    DC_RETURN_IF_ERROR(check->Float(out[1], Out(1, "dw")));
    DC_RETURN_IF_ERROR(check->ShapeIs(out[1], w.shape, Out(1, "dw")));
  } else {
    DC_RETURN_IF_ERROR(check->Float(out[0], Out(0, "y")));
    DC_RETURN_IF_ERROR(check->ShapeIs(out[0], x.shape, Out(0, "y")));
  }
  DC_RETURN_IF_ERROR(check->FloatAttr(op_attr::kEps, &d->eps));
  DC_RETURN_IF_ERROR(check->FitsGrid(d->rows, kMaxGridX, "row count"));
  return check->FitsGrid((d->hidden + ck::kThreadsPerBlock - 1) / ck::kThreadsPerBlock, kMaxGridX,
                         "hidden size / 256");
}

Status RmsNorm(Call c) {
  Checker check(c.op);
  NormDims d{};
  DC_RETURN_IF_ERROR(CheckNorm(c.in, c.out, false, &check, &d));
  return Launched(c.op, ck::RmsNorm(check.type(), c.in[0].data, c.in[1].data, d.rows, d.hidden,
                                    static_cast<float>(d.eps), c.out[0].data, c.context.stream));
}

int64_t RmsNormBackwardScratch(const NormDims& d) {
  return ck::RmsNormBackwardScratchFloats(d.rows, d.hidden) * static_cast<int64_t>(sizeof(float));
}

Status RmsNormBackward(Call c) {
  Checker check(c.op);
  NormDims d{};
  DC_RETURN_IF_ERROR(CheckNorm(c.in, c.out, true, &check, &d));
  DC_ASSIGN_OR_RETURN(void* scratch, c.r.Scratch(c.context, RmsNormBackwardScratch(d), c.op));
  return Launched(
      c.op, ck::RmsNormBackward(check.type(), c.in[0].data, c.in[1].data, c.in[2].data, d.rows,
                                d.hidden, static_cast<float>(d.eps), c.out[0].data, c.out[1].data,
                                static_cast<float*>(scratch), c.context.stream));
}

// --- matmul: y [M, N] = x [M, K] w [N, K]^T

cudaDataType_t CudaType(ck::FloatType type) {
  switch (type) {
    case ck::FloatType::kF32:
      return CUDA_R_32F;
    case ck::FloatType::kBF16:
      return CUDA_R_16BF;
    case ck::FloatType::kF16:
      return CUDA_R_16F;
  }
  return CUDA_R_32F;
}

struct MatmulDims {
  int64_t m, n, k;
};

Status CheckMatmulOperands(const DeviceTensor& x, const DeviceTensor& w, size_t x_index,
                           Checker* check, MatmulDims* d) {
  DC_RETURN_IF_ERROR(check->Rank(x, 1, In(x_index, "x")));
  DC_RETURN_IF_ERROR(check->Float(x, In(x_index, "x")));
  DC_RETURN_IF_ERROR(check->Rank(w, 2, In(x_index + 1, "w"), 2));
  DC_RETURN_IF_ERROR(check->Float(w, In(x_index + 1, "w")));
  d->k = x.shape.back();
  d->m = x.NumElements() / d->k;
  d->n = w.shape[0];
  return check->ShapeIs(w, {d->n, d->k}, In(x_index + 1, "w"));
}

Status Matmul(Call c) {
  Checker check(c.op);
  DC_RETURN_IF_ERROR(check.Arity(c.in, c.out, 2, 1));
  MatmulDims d{};
  DC_RETURN_IF_ERROR(CheckMatmulOperands(c.in[0], c.in[1], 0, &check, &d));
  DC_RETURN_IF_ERROR(check.Float(c.out[0], Out(0, "y")));
  DC_RETURN_IF_ERROR(check.ShapeIs(c.out[0], WithLast(c.in[0].shape, d.n), Out(0, "y")));
  // Column-major: Y^T [N x M] = (W [K x N])^T X^T [K x M].
  return c.r
      .Matmul(CudaType(check.type()), true, false, d.n, d.m, d.k, c.in[1].data, d.k, c.in[0].data,
              d.k, c.out[0].data, d.n, c.context.stream)
      .Prefixed("op " + c.op.name() + " (" + c.op.kind() + "): ");
}

Status MatmulBackward(Call c) {
  Checker check(c.op);
  DC_RETURN_IF_ERROR(check.Arity(c.in, c.out, 3, 2));
  MatmulDims d{};
  DC_RETURN_IF_ERROR(CheckMatmulOperands(c.in[1], c.in[2], 1, &check, &d));
  const DeviceTensor &dy = c.in[0], &x = c.in[1], &w = c.in[2], &dx = c.out[0], &dw = c.out[1];
  DC_RETURN_IF_ERROR(check.Float(dy, In(0, "dy")));
  DC_RETURN_IF_ERROR(check.ShapeIs(dy, WithLast(x.shape, d.n), In(0, "dy")));
  DC_RETURN_IF_ERROR(check.Float(dx, Out(0, "dx")));
  DC_RETURN_IF_ERROR(check.ShapeIs(dx, x.shape, Out(0, "dx")));
  DC_RETURN_IF_ERROR(check.Float(dw, Out(1, "dw")));
  DC_RETURN_IF_ERROR(check.ShapeIs(dw, w.shape, Out(1, "dw")));
  const cudaDataType_t type = CudaType(check.type());
  const std::string prefix = "op " + c.op.name() + " (" + c.op.kind() + "): ";
  // dX [M, K] = dY W: column-major dX^T [K x M] = W^T [K x N] dY^T [N x M].
  DC_RETURN_IF_ERROR(c.r.Matmul(type, false, false, d.k, d.m, d.n, w.data, d.k, dy.data, d.n,
                                dx.data, d.k, c.context.stream)
                         .Prefixed(prefix + "dx: "));
  // dW [N, K] = dY^T X: column-major dW^T [K x N] = X^T [K x M] (dY^T [N x M])^T.
  return c.r
      .Matmul(type, false, true, d.k, d.n, d.m, x.data, d.k, dy.data, d.n, dw.data, d.k,
              c.context.stream)
      .Prefixed(prefix + "dw: ");
}

// --- rope

struct RopeDims {
  int64_t batch, seq, heads, head_dim;
  double theta;
};

Status CheckRope(Tensors in, Tensors out, Checker* check, RopeDims* d) {
  DC_RETURN_IF_ERROR(check->Arity(in, out, 1, 1));
  DC_RETURN_IF_ERROR(check->IntAttr(op_attr::kHeads, &d->heads));
  DC_RETURN_IF_ERROR(check->IntAttr(op_attr::kHeadDim, &d->head_dim));
  if (d->head_dim % 2 != 0) return check->Error("head_dim must be even");
  DC_RETURN_IF_ERROR(check->FitsGrid(d->head_dim, ck::kRopeMaxHeadDim, "head_dim"));
  DC_RETURN_IF_ERROR(check->FloatAttr(op_attr::kTheta, &d->theta));
  const DeviceTensor &x = in[0], &y = out[0];
  DC_RETURN_IF_ERROR(check->Rank(x, 3, In(0, "x"), 3));
  DC_RETURN_IF_ERROR(check->Float(x, In(0, "x")));
  d->batch = x.shape[0];
  d->seq = x.shape[1];
  DC_RETURN_IF_ERROR(check->ShapeIs(x, {d->batch, d->seq, d->heads * d->head_dim}, In(0, "x")));
  DC_RETURN_IF_ERROR(check->Float(y, Out(0, "y")));
  DC_RETURN_IF_ERROR(check->ShapeIs(y, x.shape, Out(0, "y")));
  return check->FitsGrid(d->batch * d->seq, kMaxGridX, "token count");
}

Status RopeOp(Call c, float sign) {
  Checker check(c.op);
  RopeDims d{};
  DC_RETURN_IF_ERROR(CheckRope(c.in, c.out, &check, &d));
  return Launched(c.op, ck::Rope(check.type(), c.in[0].data, c.out[0].data, d.batch, d.seq, d.heads,
                                 d.head_dim, d.theta, sign, c.context.stream));
}

Status Rope(Call c) { return RopeOp(c, 1.0f); }
Status RopeBackward(Call c) { return RopeOp(c, -1.0f); }

// --- attention

Status CheckAttention(Tensors in, size_t first, Checker* check, const CudaDeviceInfo& device,
                      bool backward, ck::AttentionDims* d) {
  DC_RETURN_IF_ERROR(check->IntAttr(op_attr::kHeads, &d->heads));
  DC_RETURN_IF_ERROR(check->IntAttr(op_attr::kKvHeads, &d->kv_heads));
  DC_RETURN_IF_ERROR(check->IntAttr(op_attr::kHeadDim, &d->head_dim));
  if (d->heads % d->kv_heads != 0) return check->Error("kv_heads does not divide heads");
  DC_RETURN_IF_ERROR(check->FitsGrid(d->head_dim, ck::kAttentionMaxHeadDim, "head_dim"));
  const DeviceTensor &q = in[first], &k = in[first + 1], &v = in[first + 2];
  DC_RETURN_IF_ERROR(check->Rank(q, 3, In(first, "q"), 3));
  DC_RETURN_IF_ERROR(check->Float(q, In(first, "q")));
  d->batch = q.shape[0];
  d->seq = q.shape[1];
  DC_RETURN_IF_ERROR(check->ShapeIs(q, {d->batch, d->seq, d->heads * d->head_dim}, In(first, "q")));
  DC_RETURN_IF_ERROR(check->Float(k, In(first + 1, "k")));
  DC_RETURN_IF_ERROR(
      check->ShapeIs(k, {d->batch, d->seq, d->kv_heads * d->head_dim}, In(first + 1, "k")));
  DC_RETURN_IF_ERROR(check->Float(v, In(first + 2, "v")));
  DC_RETURN_IF_ERROR(check->ShapeIs(v, k.shape, In(first + 2, "v")));
  DC_RETURN_IF_ERROR(
      check->FitsGrid(d->batch * d->heads, ck::kAttentionMaxBatchHeads, "batch * heads"));
  const int64_t smem_bytes = ck::AttentionSmemBytes(d->head_dim, backward);
  if (device.shared_memory_per_block_optin_bytes > 0 &&
      smem_bytes > device.shared_memory_per_block_optin_bytes) {
    return check->Error("head_dim " + std::to_string(d->head_dim) + " needs " +
                        std::to_string(smem_bytes) + " bytes of shared memory per block; " +
                        device.name + " allows " +
                        std::to_string(device.shared_memory_per_block_optin_bytes));
  }
  return Status::Ok();
}

Status Attention(Call c) {
  Checker check(c.op);
  DC_RETURN_IF_ERROR(check.Arity(c.in, c.out, 3, 1));
  ck::AttentionDims d{};
  DC_RETURN_IF_ERROR(CheckAttention(c.in, 0, &check, c.r.device, false, &d));
  DC_RETURN_IF_ERROR(check.Float(c.out[0], Out(0, "o")));
  DC_RETURN_IF_ERROR(check.ShapeIs(c.out[0], c.in[0].shape, Out(0, "o")));
  return Launched(c.op, ck::Attention(check.type(), d, c.in[0].data, c.in[1].data, c.in[2].data,
                                      c.out[0].data, c.context.stream));
}

Status CheckAttentionBackward(Tensors in, Tensors out, Checker* check, const CudaDeviceInfo& device,
                              ck::AttentionDims* d) {
  DC_RETURN_IF_ERROR(check->Arity(in, out, 4, 3));
  DC_RETURN_IF_ERROR(CheckAttention(in, 1, check, device, true, d));
  DC_RETURN_IF_ERROR(check->Float(in[0], In(0, "do")));
  DC_RETURN_IF_ERROR(check->ShapeIs(in[0], in[1].shape, In(0, "do")));
  DC_RETURN_IF_ERROR(check->Float(out[0], Out(0, "dq")));
  DC_RETURN_IF_ERROR(check->ShapeIs(out[0], in[1].shape, Out(0, "dq")));
  DC_RETURN_IF_ERROR(check->Float(out[1], Out(1, "dk")));
  DC_RETURN_IF_ERROR(check->ShapeIs(out[1], in[2].shape, Out(1, "dk")));
  DC_RETURN_IF_ERROR(check->Float(out[2], Out(2, "dv")));
  return check->ShapeIs(out[2], in[3].shape, Out(2, "dv"));
}

int64_t AttentionBackwardScratch(const ck::AttentionDims& d) {
  return ck::AttentionBackwardScratchFloats(d) * static_cast<int64_t>(sizeof(float));
}

Status AttentionBackward(Call c) {
  Checker check(c.op);
  ck::AttentionDims d{};
  DC_RETURN_IF_ERROR(CheckAttentionBackward(c.in, c.out, &check, c.r.device, &d));
  DC_ASSIGN_OR_RETURN(void* scratch, c.r.Scratch(c.context, AttentionBackwardScratch(d), c.op));
  return Launched(c.op,
                  ck::AttentionBackward(check.type(), d, c.in[0].data, c.in[1].data, c.in[2].data,
                                        c.in[3].data, c.out[0].data, c.out[1].data, c.out[2].data,
                                        static_cast<float*>(scratch), c.context.stream));
}

// --- swiglu

Status Swiglu(Call c) {
  Checker check(c.op);
  DC_RETURN_IF_ERROR(check.Arity(c.in, c.out, 2, 1));
  const DeviceTensor &gate = c.in[0], &up = c.in[1], &y = c.out[0];
  DC_RETURN_IF_ERROR(check.Rank(gate, 1, In(0, "gate")));
  DC_RETURN_IF_ERROR(check.Float(gate, In(0, "gate")));
  DC_RETURN_IF_ERROR(check.Float(up, In(1, "up")));
  DC_RETURN_IF_ERROR(check.ShapeIs(up, gate.shape, In(1, "up")));
  DC_RETURN_IF_ERROR(check.Float(y, Out(0, "y")));
  DC_RETURN_IF_ERROR(check.ShapeIs(y, gate.shape, Out(0, "y")));
  return Launched(c.op, ck::Swiglu(check.type(), gate.data, up.data, y.data, gate.NumElements(),
                                   c.context.stream));
}

Status SwigluBackward(Call c) {
  Checker check(c.op);
  DC_RETURN_IF_ERROR(check.Arity(c.in, c.out, 3, 2));
  const DeviceTensor &dy = c.in[0], &gate = c.in[1], &up = c.in[2];
  DC_RETURN_IF_ERROR(check.Rank(gate, 1, In(1, "gate")));
  DC_RETURN_IF_ERROR(check.Float(gate, In(1, "gate")));
  DC_RETURN_IF_ERROR(check.Float(dy, In(0, "dy")));
  DC_RETURN_IF_ERROR(check.ShapeIs(dy, gate.shape, In(0, "dy")));
  DC_RETURN_IF_ERROR(check.Float(up, In(2, "up")));
  DC_RETURN_IF_ERROR(check.ShapeIs(up, gate.shape, In(2, "up")));
  DC_RETURN_IF_ERROR(check.Float(c.out[0], Out(0, "dgate")));
  DC_RETURN_IF_ERROR(check.ShapeIs(c.out[0], gate.shape, Out(0, "dgate")));
  DC_RETURN_IF_ERROR(check.Float(c.out[1], Out(1, "dup")));
  DC_RETURN_IF_ERROR(check.ShapeIs(c.out[1], gate.shape, Out(1, "dup")));
  return Launched(c.op, ck::SwigluBackward(check.type(), dy.data, gate.data, up.data, c.out[0].data,
                                           c.out[1].data, gate.NumElements(), c.context.stream));
}

// --- add

Status Add(Call c) {
  Checker check(c.op);
  constexpr size_t kMinInputs = 2;
  if (c.in.size() < kMinInputs || c.out.size() != 1) {
    return check.Error("expects 2 or more inputs and 1 output, got " + std::to_string(c.in.size()) +
                       " and " + std::to_string(c.out.size()));
  }
  DC_RETURN_IF_ERROR(check.Rank(c.in[0], 0, In(0, "a")));
  DC_RETURN_IF_ERROR(check.Float(c.in[0], In(0, "a")));
  std::vector<const void*> inputs{c.in[0].data};
  for (size_t i = 1; i < c.in.size(); ++i) {
    DC_RETURN_IF_ERROR(check.Float(c.in[i], In(i, "b")));
    DC_RETURN_IF_ERROR(check.ShapeIs(c.in[i], c.in[0].shape, In(i, "b")));
    inputs.push_back(c.in[i].data);
  }
  DC_RETURN_IF_ERROR(check.Float(c.out[0], Out(0, "sum")));
  DC_RETURN_IF_ERROR(check.ShapeIs(c.out[0], c.in[0].shape, Out(0, "sum")));
  const int64_t n = c.in[0].NumElements();
  if (n == 0) return Status::Ok();
  return Launched(c.op, ck::AddN(check.type(), inputs.data(), static_cast<int>(inputs.size()),
                                 c.out[0].data, n, c.context.stream));
}

// --- cross_entropy

struct CrossEntropyDims {
  int64_t rows, vocab;
};

Status CheckCrossEntropy(Tensors in, Tensors out, bool backward, Checker* check,
                         CrossEntropyDims* d) {
  DC_RETURN_IF_ERROR(check->Arity(in, out, 2, 1));
  const DeviceTensor &logits = in[0], &targets = in[1];
  DC_RETURN_IF_ERROR(check->Rank(logits, 1, In(0, "logits")));
  DC_RETURN_IF_ERROR(check->Float(logits, In(0, "logits")));
  DC_RETURN_IF_ERROR(check->I32(targets, In(1, "targets")));
  DC_RETURN_IF_ERROR(check->ShapeIs(targets, DropLast(logits.shape), In(1, "targets")));
  d->vocab = logits.shape.back();
  d->rows = targets.NumElements();
  DC_RETURN_IF_ERROR(check->FitsGrid(d->rows, kMaxGridX, "row count"));
  if (backward) {
    DC_RETURN_IF_ERROR(check->Float(out[0], Out(0, "dlogits")));
    return check->ShapeIs(out[0], logits.shape, Out(0, "dlogits"));
  }
  // The loss is fp32 whatever the compute dtype.
  DC_RETURN_IF_ERROR(check->FloatAs(out[0], proto::DTYPE_F32, Out(0, "loss")));
  return check->ShapeIs(out[0], {1}, Out(0, "loss"));
}

int64_t CrossEntropyScratch(const CrossEntropyDims& d) {
  return d.rows * static_cast<int64_t>(sizeof(double));
}

Status CrossEntropy(Call c) {
  Checker check(c.op);
  CrossEntropyDims d{};
  DC_RETURN_IF_ERROR(CheckCrossEntropy(c.in, c.out, false, &check, &d));
  DC_ASSIGN_OR_RETURN(void* scratch, c.r.Scratch(c.context, CrossEntropyScratch(d), c.op));
  return Launched(
      c.op,
      ck::CrossEntropy(check.type(), c.in[0].data, static_cast<const int32_t*>(c.in[1].data),
                       d.rows, d.vocab, static_cast<float*>(c.out[0].data),
                       static_cast<double*>(scratch), c.r.device_error_ints(), c.context.stream));
}

Status CrossEntropyBackward(Call c) {
  Checker check(c.op);
  CrossEntropyDims d{};
  DC_RETURN_IF_ERROR(CheckCrossEntropy(c.in, c.out, true, &check, &d));
  return Launched(c.op, ck::CrossEntropyBackward(
                            check.type(), c.in[0].data, static_cast<const int32_t*>(c.in[1].data),
                            d.rows, d.vocab, static_cast<float>(c.context.grad_scale),
                            c.out[0].data, c.r.device_error_ints(), c.context.stream));
}

// --- adamw

// The op's attrs, or the config's values where an attr is absent (as the CPU backend).
Status AdamWConstantsFor(const proto::Op& op, const CudaKernelContext& context,
                         ck::AdamWConstants* c) {
  const proto::ModelConfig* config = context.config;
  double lr = 0, beta1 = 0, beta2 = 0, eps = 0, weight_decay = 0;
  struct Field {
    const char* attr;
    double config_value;
    double* out;
  };
  const Field fields[] = {
      {op_attr::kLr, config ? config->lr() : std::nan(""), &lr},
      {op_attr::kBeta1, config ? config->beta1() : std::nan(""), &beta1},
      {op_attr::kBeta2, config ? config->beta2() : std::nan(""), &beta2},
      {op_attr::kEps, config ? config->adam_eps() : std::nan(""), &eps},
      {op_attr::kWeightDecay, config ? config->weight_decay() : std::nan(""), &weight_decay},
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
  const double step = static_cast<double>(context.adam_step);
  lr *= context.lr_scale;  // the op's lr is the schedule's peak
  // As the CPU backend's AdamW (executor/cpu_kernels.cc): in double, then rounded to fp32.
  c->lr = static_cast<float>(lr);
  c->beta1 = static_cast<float>(beta1);
  c->one_minus_beta1 = static_cast<float>(1.0 - beta1);
  c->beta2 = static_cast<float>(beta2);
  c->one_minus_beta2 = static_cast<float>(1.0 - beta2);
  c->eps = static_cast<float>(eps);
  c->m_correction = static_cast<float>(1.0 / (1.0 - std::pow(beta1, step)));
  c->v_correction = static_cast<float>(1.0 / (1.0 - std::pow(beta2, step)));
  c->decay = static_cast<float>(1.0 - lr * weight_decay);
  c->max_grad_norm = 0;
  c->clip_epsilon = kClipNormEpsilon;
  return Status::Ok();
}

Status AdamW(Call c) {
  Checker check(c.op);
  // With clipping, input 4 is the grads' global squared norm (fp32 [1], on the device).
  const bool clip = c.in.size() == 5;
  DC_RETURN_IF_ERROR(check.Arity(c.in, c.out, clip ? 5 : 4, 0));
  const char* names[] = {"param", "grad", "m", "v"};
  for (size_t i = 0; i < 4; ++i) {
    DC_RETURN_IF_ERROR(check.FloatAs(c.in[i], proto::DTYPE_F32, In(i, names[i])));
    if (c.in[i].NumElements() != c.in[0].NumElements()) {
      return check.Error(In(i, names[i]).Label() + " has " + std::to_string(c.in[i].NumElements()) +
                         " elements, param has " + std::to_string(c.in[0].NumElements()));
    }
  }
  ck::AdamWConstants constants{};
  DC_RETURN_IF_ERROR(AdamWConstantsFor(c.op, c.context, &constants));
  const float* norm_squared = nullptr;
  if (clip) {
    DC_RETURN_IF_ERROR(check.FloatAs(c.in[4], proto::DTYPE_F32, In(4, "norm_squared")));
    if (c.in[4].NumElements() != 1) {
      return check.Error(In(4, "norm_squared").Label() + " has " +
                         std::to_string(c.in[4].NumElements()) + " elements, expected 1");
    }
    const double max_norm = AttrFloat(c.op, op_attr::kMaxGradNorm, 0);
    if (!(std::isfinite(max_norm) && max_norm > 0)) {
      return check.Error(std::string("reads the grads' norm but its attr '") +
                         op_attr::kMaxGradNorm + "' is not a positive number");
    }
    constants.max_grad_norm = static_cast<float>(max_norm);
    norm_squared = static_cast<const float*>(c.in[4].data);
  }
  const int64_t n = c.in[0].NumElements();
  if (n == 0) return Status::Ok();
  return Launched(
      c.op, ck::AdamW(static_cast<float*>(c.in[0].data), static_cast<const float*>(c.in[1].data),
                      static_cast<float*>(c.in[2].data), static_cast<float*>(c.in[3].data), n,
                      constants, norm_squared, c.context.stream));
}

// --- grad_norm_squared

Status CheckGradNormSquared(Tensors in, Tensors out, Checker* check) {
  if (in.empty() || out.size() != 1) {
    return check->Error("expects one or more inputs and 1 output, got " +
                        std::to_string(in.size()) + " and " + std::to_string(out.size()));
  }
  for (size_t i = 0; i < in.size(); ++i) {
    DC_RETURN_IF_ERROR(check->FloatAs(in[i], proto::DTYPE_F32, In(i, "grad")));
  }
  DC_RETURN_IF_ERROR(check->FloatAs(out[0], proto::DTYPE_F32, Out(0, "norm_squared")));
  if (out[0].NumElements() != 1) {
    return check->Error(Out(0, "norm_squared").Label() + " has " +
                        std::to_string(out[0].NumElements()) + " elements, expected 1");
  }
  return Status::Ok();
}

StatusOr<int64_t> GradNormSquaredScratchBytes(const proto::Op& op, Tensors in, Tensors out) {
  Checker check = Checker::ShapesOnly(op);
  DC_RETURN_IF_ERROR(CheckGradNormSquared(in, out, &check));
  return ck::GradNormSquaredScratchBytes();
}

Status GradNormSquared(Call c) {
  Checker check(c.op);
  DC_RETURN_IF_ERROR(CheckGradNormSquared(c.in, c.out, &check));
  DC_ASSIGN_OR_RETURN(void* scratch,
                      c.r.Scratch(c.context, ck::GradNormSquaredScratchBytes(), c.op));
  std::vector<const float*> inputs;
  std::vector<int64_t> sizes;
  for (const DeviceTensor& t : c.in) {
    inputs.push_back(static_cast<const float*>(t.data));
    sizes.push_back(t.NumElements());
  }
  return Launched(
      c.op, ck::GradNormSquared(inputs.data(), sizes.data(), static_cast<int64_t>(inputs.size()),
                                static_cast<float*>(c.out[0].data), scratch, c.context.stream));
}

// --- mixture of experts. The expert-major layout is made on the device (ck::MoeLayout) by
// every op that needs it, from the i32 `experts` tensor, as the CPU backend makes it per op; an
// expert id outside [0, E) lands in the device error record.

constexpr char kExpertIdsLabel[] = "experts";

int64_t MoeLayoutScratch(int64_t slots, int64_t num_experts) {
  return ck::MoeLayoutScratchInts(slots, num_experts) * static_cast<int64_t>(sizeof(int32_t));
}

// Enqueues the layout of `experts` (`slots` ids over `num_experts`) in the op's scratch.
StatusOr<ck::MoeLayoutView> EnqueueMoeLayout(const Call& c, const DeviceTensor& experts,
                                             int64_t slots, int64_t num_experts) {
  DC_ASSIGN_OR_RETURN(void* scratch,
                      c.r.Scratch(c.context, MoeLayoutScratch(slots, num_experts), c.op));
  const ck::MoeLayoutView layout =
      ck::MoeLayoutInScratch(static_cast<int32_t*>(scratch), slots, num_experts);
  DC_RETURN_IF_ERROR(
      Launched(c.op, ck::MoeLayout(static_cast<const int32_t*>(experts.data), slots, num_experts,
                                   layout, c.r.device_error_ints(), c.context.stream)));
  return layout;
}

// The routing operand `experts` [..., k]: i32, no empty dimension (k = 0 would launch empty
// grids).
Status CheckRoutingTensor(const DeviceTensor& experts, const Operand& what, Checker* check) {
  DC_RETURN_IF_ERROR(check->I32(experts, what));
  if (experts.shape.empty()) return check->Error(what.Label() + " has no dimensions");
  return check->Rank(experts, 1, what);
}

struct RouterDims {
  int64_t tokens = 0, experts = 0, top_k = 0;
  double aux_coef = 0;
  int64_t slots() const { return tokens * top_k; }
};

Status CheckRouterLogits(const DeviceTensor& logits, size_t index, Checker* check, RouterDims* d) {
  DC_RETURN_IF_ERROR(check->Rank(logits, 1, In(index, "logits")));
  DC_RETURN_IF_ERROR(check->Float(logits, In(index, "logits")));
  d->experts = logits.shape.back();
  d->tokens = logits.NumElements() / d->experts;
  DC_RETURN_IF_ERROR(check->IntAttr(op_attr::kTopK, &d->top_k));
  if (d->top_k > d->experts) {
    return check->Error("top_k " + std::to_string(d->top_k) + " is more than the " +
                        std::to_string(d->experts) + " experts");
  }
  DC_RETURN_IF_ERROR(check->NonNegativeFloatAttr(op_attr::kAuxCoef, &d->aux_coef));
  DC_RETURN_IF_ERROR(check->FitsGrid(d->slots(), kMaxGridX, "routed slot count"));
  return check->FitsGrid(d->experts, kMaxGridX, "expert count");
}

Status CheckMoeRouter(Tensors in, Tensors out, Checker* check, RouterDims* d) {
  DC_RETURN_IF_ERROR(check->Arity(in, out, 1, 3));
  DC_RETURN_IF_ERROR(CheckRouterLogits(in[0], 0, check, d));
  const Shape choice_shape = WithLast(in[0].shape, d->top_k);
  // Gates and the loss are fp32 whatever the compute dtype.
  DC_RETURN_IF_ERROR(check->FloatAs(out[0], proto::DTYPE_F32, Out(0, "gates")));
  DC_RETURN_IF_ERROR(check->ShapeIs(out[0], choice_shape, Out(0, "gates")));
  DC_RETURN_IF_ERROR(check->I32(out[1], Out(1, kExpertIdsLabel)));
  DC_RETURN_IF_ERROR(check->ShapeIs(out[1], choice_shape, Out(1, kExpertIdsLabel)));
  DC_RETURN_IF_ERROR(check->FloatAs(out[2], proto::DTYPE_F32, Out(2, "aux_loss")));
  return check->ShapeIs(out[2], {1}, Out(2, "aux_loss"));
}

int64_t MoeRouterScratch(const RouterDims& d) {
  return ck::MoeRouterScratchBytes(d.tokens, d.experts);
}

Status MoeRouter(Call c) {
  Checker check(c.op);
  RouterDims d;
  DC_RETURN_IF_ERROR(CheckMoeRouter(c.in, c.out, &check, &d));
  DC_ASSIGN_OR_RETURN(void* scratch, c.r.Scratch(c.context, MoeRouterScratch(d), c.op));
  return Launched(
      c.op, ck::MoeRouter(check.type(), c.in[0].data, d.tokens, d.experts, d.top_k, d.aux_coef,
                          static_cast<float*>(c.out[0].data), static_cast<int32_t*>(c.out[1].data),
                          static_cast<float*>(c.out[2].data), scratch, c.context.stream));
}

Status CheckMoeRouterBackward(Tensors in, Tensors out, Checker* check, RouterDims* d) {
  DC_RETURN_IF_ERROR(check->Arity(in, out, 3, 1));
  DC_RETURN_IF_ERROR(CheckRouterLogits(in[1], 1, check, d));
  const Shape choice_shape = WithLast(in[1].shape, d->top_k);
  DC_RETURN_IF_ERROR(check->FloatAs(in[0], proto::DTYPE_F32, In(0, "dgates")));
  DC_RETURN_IF_ERROR(check->ShapeIs(in[0], choice_shape, In(0, "dgates")));
  DC_RETURN_IF_ERROR(CheckRoutingTensor(in[2], In(2, kExpertIdsLabel), check));
  DC_RETURN_IF_ERROR(check->ShapeIs(in[2], choice_shape, In(2, kExpertIdsLabel)));
  DC_RETURN_IF_ERROR(check->Float(out[0], Out(0, "dlogits")));
  return check->ShapeIs(out[0], in[1].shape, Out(0, "dlogits"));
}

Status MoeRouterBackward(Call c) {
  Checker check(c.op);
  RouterDims d;
  DC_RETURN_IF_ERROR(CheckMoeRouterBackward(c.in, c.out, &check, &d));
  DC_ASSIGN_OR_RETURN(const ck::MoeLayoutView layout,
                      EnqueueMoeLayout(c, c.in[2], d.slots(), d.experts));
  // The balancing term's d(loss)/dp[t, e] is grad_scale * aux_coef * E * count_e / M.
  const double balance_grad_per_choice = c.context.grad_scale * d.aux_coef *
                                         static_cast<double>(d.experts) /
                                         static_cast<double>(d.tokens);
  return Launched(c.op,
                  ck::MoeRouterBackward(check.type(), static_cast<const float*>(c.in[0].data),
                                        c.in[1].data, static_cast<const int32_t*>(c.in[2].data),
                                        layout.offsets, d.tokens, d.experts, d.top_k,
                                        balance_grad_per_choice, c.out[0].data, c.context.stream));
}

struct TokenSideDims {
  int64_t tokens = 0, hidden = 0, top_k = 0, experts = 0;
  int64_t slots() const { return tokens * top_k; }
};

// A token-side tensor x [..., H] against `experts` [..., k] (the next input), the `experts` attr
// and the slot-side tensor [M * k, H].
Status CheckTokenSide(const DeviceTensor& x, const Operand& x_what, const DeviceTensor& experts,
                      const Operand& experts_what, const DeviceTensor& slot_side,
                      const Operand& slot_what, Checker* check, TokenSideDims* d) {
  DC_RETURN_IF_ERROR(check->Rank(x, 1, x_what));
  DC_RETURN_IF_ERROR(check->Float(x, x_what));
  DC_RETURN_IF_ERROR(CheckRoutingTensor(experts, experts_what, check));
  d->hidden = x.shape.back();
  d->tokens = x.NumElements() / d->hidden;
  if (DropLast(experts.shape) != DropLast(x.shape)) {
    return check->Error(experts_what.Label() + " has shape " + ShapeString(experts.shape) +
                        ", expected " + ShapeString(WithLast(x.shape, 0)) + " with k last");
  }
  d->top_k = experts.shape.back();
  DC_RETURN_IF_ERROR(check->IntAttr(op_attr::kExperts, &d->experts));
  DC_RETURN_IF_ERROR(check->Float(slot_side, slot_what));
  DC_RETURN_IF_ERROR(check->ShapeIs(slot_side, {d->slots(), d->hidden}, slot_what));
  DC_RETURN_IF_ERROR(check->FitsGrid(d->slots(), kMaxGridX, "routed slot count"));
  return check->FitsGrid(d->experts, kMaxGridX, "expert count");
}

Status CheckMoeDispatch(Tensors in, Tensors out, bool backward, Checker* check, TokenSideDims* d) {
  DC_RETURN_IF_ERROR(check->Arity(in, out, 2, 1));
  if (backward) {
    return CheckTokenSide(out[0], Out(0, "dx"), in[1], In(1, kExpertIdsLabel), in[0], In(0, "dxs"),
                          check, d);
  }
  return CheckTokenSide(in[0], In(0, "x"), in[1], In(1, kExpertIdsLabel), out[0], Out(0, "xs"),
                        check, d);
}

Status MoeDispatchOp(Call c, bool backward) {
  Checker check(c.op);
  TokenSideDims d;
  DC_RETURN_IF_ERROR(CheckMoeDispatch(c.in, c.out, backward, &check, &d));
  DC_ASSIGN_OR_RETURN(const ck::MoeLayoutView layout,
                      EnqueueMoeLayout(c, c.in[1], d.slots(), d.experts));
  if (backward) {
    return Launched(
        c.op, ck::MoeDispatchBackward(check.type(), c.in[0].data, layout.rows, d.tokens, d.top_k,
                                      d.hidden, c.out[0].data, c.context.stream));
  }
  return Launched(c.op, ck::MoeDispatch(check.type(), c.in[0].data, layout.rows, d.tokens, d.top_k,
                                        d.hidden, c.out[0].data, c.context.stream));
}

Status MoeDispatch(Call c) { return MoeDispatchOp(c, false); }
Status MoeDispatchBackward(Call c) { return MoeDispatchOp(c, true); }

// ys [M * k, H], gates f32 [..., k] and experts i32 [..., k], inputs from `first`.
Status CheckCombineInputs(Tensors in, size_t first, Checker* check, TokenSideDims* d) {
  const DeviceTensor &ys = in[first], &gates = in[first + 1], &experts = in[first + 2];
  DC_RETURN_IF_ERROR(check->Rank(ys, 2, In(first, "ys"), 2));
  DC_RETURN_IF_ERROR(check->Float(ys, In(first, "ys")));
  DC_RETURN_IF_ERROR(check->Rank(gates, 1, In(first + 1, "gates")));
  DC_RETURN_IF_ERROR(check->FloatAs(gates, proto::DTYPE_F32, In(first + 1, "gates")));
  DC_RETURN_IF_ERROR(CheckRoutingTensor(experts, In(first + 2, kExpertIdsLabel), check));
  DC_RETURN_IF_ERROR(check->ShapeIs(experts, gates.shape, In(first + 2, kExpertIdsLabel)));
  DC_RETURN_IF_ERROR(check->IntAttr(op_attr::kExperts, &d->experts));
  d->top_k = gates.shape.back();
  d->tokens = gates.NumElements() / d->top_k;
  d->hidden = ys.shape[1];
  DC_RETURN_IF_ERROR(check->ShapeIs(ys, {d->slots(), d->hidden}, In(first, "ys")));
  DC_RETURN_IF_ERROR(check->FitsGrid(d->slots(), kMaxGridX, "routed slot count"));
  return check->FitsGrid(d->experts, kMaxGridX, "expert count");
}

Status CheckMoeCombine(Tensors in, Tensors out, bool backward, Checker* check, TokenSideDims* d) {
  DC_RETURN_IF_ERROR(backward ? check->Arity(in, out, 4, 2) : check->Arity(in, out, 3, 1));
  const size_t first = backward ? 1 : 0;
  DC_RETURN_IF_ERROR(CheckCombineInputs(in, first, check, d));
  const Shape token_shape = WithLast(in[first + 1].shape, d->hidden);
  if (!backward) {
    DC_RETURN_IF_ERROR(check->Float(out[0], Out(0, "y")));
    return check->ShapeIs(out[0], token_shape, Out(0, "y"));
  }
  DC_RETURN_IF_ERROR(check->Float(in[0], In(0, "dy")));
  DC_RETURN_IF_ERROR(check->ShapeIs(in[0], token_shape, In(0, "dy")));
  DC_RETURN_IF_ERROR(check->Float(out[0], Out(0, "dys")));
  DC_RETURN_IF_ERROR(check->ShapeIs(out[0], in[1].shape, Out(0, "dys")));
  DC_RETURN_IF_ERROR(check->FloatAs(out[1], proto::DTYPE_F32, Out(1, "dgates")));
  return check->ShapeIs(out[1], in[2].shape, Out(1, "dgates"));
}

Status MoeCombine(Call c) {
  Checker check(c.op);
  TokenSideDims d;
  DC_RETURN_IF_ERROR(CheckMoeCombine(c.in, c.out, false, &check, &d));
  DC_ASSIGN_OR_RETURN(const ck::MoeLayoutView layout,
                      EnqueueMoeLayout(c, c.in[2], d.slots(), d.experts));
  return Launched(
      c.op,
      ck::MoeCombine(check.type(), c.in[0].data, static_cast<const float*>(c.in[1].data),
                     layout.rows, d.tokens, d.top_k, d.hidden, c.out[0].data, c.context.stream));
}

Status MoeCombineBackward(Call c) {
  Checker check(c.op);
  TokenSideDims d;
  DC_RETURN_IF_ERROR(CheckMoeCombine(c.in, c.out, true, &check, &d));
  DC_ASSIGN_OR_RETURN(const ck::MoeLayoutView layout,
                      EnqueueMoeLayout(c, c.in[3], d.slots(), d.experts));
  return Launched(
      c.op, ck::MoeCombineBackward(check.type(), c.in[0].data, c.in[1].data,
                                   static_cast<const float*>(c.in[2].data), layout.rows, d.tokens,
                                   d.top_k, d.hidden, c.out[0].data,
                                   static_cast<float*>(c.out[1].data), c.context.stream));
}

// --- grouped_matmul: per expert e, y[seg e] = x[seg e] w_e^T. One cuBLASLt matmul per non-empty
// segment through Impl::Matmul. Its plan cache is keyed by shape and pointer alignment, and the
// segment lengths change with the routing every step: the cache gains a plan (and pays one
// heuristic query) per distinct (length, alignment) seen, at most M * k lengths per weight shape.
// A cuBLASLt grouped GEMM, or plans shared across lengths, would bound that.

struct GroupedMatmulDims {
  int64_t rows = 0, n = 0, k = 0, experts = 0;
};

// x [R, K] (input `x_index`), experts (the next input, R ids) and the E weights after it, all
// [N, K].
Status CheckGroupedMatmulInputs(Tensors in, size_t x_index, Checker* check, GroupedMatmulDims* d) {
  const size_t first_weight = x_index + 2;
  if (in.size() < first_weight + 1) {
    return check->Error("expects x, experts and at least one expert weight");
  }
  const DeviceTensor &x = in[x_index], &experts = in[x_index + 1];
  DC_RETURN_IF_ERROR(check->Rank(x, 2, In(x_index, "x"), 2));
  DC_RETURN_IF_ERROR(check->Float(x, In(x_index, "x")));
  DC_RETURN_IF_ERROR(check->Rank(in[first_weight], 2, In(first_weight, "w_0"), 2));
  d->rows = x.shape[0];
  d->k = x.shape[1];
  d->n = in[first_weight].shape[0];
  for (size_t i = first_weight; i < in.size(); ++i) {
    DC_RETURN_IF_ERROR(check->Float(in[i], In(i, "w")));
    DC_RETURN_IF_ERROR(check->ShapeIs(in[i], {d->n, d->k}, In(i, "w")));
  }
  d->experts = static_cast<int64_t>(in.size() - first_weight);
  DC_RETURN_IF_ERROR(CheckRoutingTensor(experts, In(x_index + 1, kExpertIdsLabel), check));
  if (experts.NumElements() != d->rows) {
    return check->Error(In(x_index + 1, kExpertIdsLabel).Label() + " routes " +
                        std::to_string(experts.NumElements()) + " slots for " +
                        std::to_string(d->rows) + " rows of x");
  }
  return check->FitsGrid(d->rows, kMaxGridX, "row count");
}

Status CheckGroupedMatmul(Tensors in, Tensors out, Checker* check, GroupedMatmulDims* d) {
  if (out.size() != 1) return check->Error("expects 1 output, got " + std::to_string(out.size()));
  DC_RETURN_IF_ERROR(CheckGroupedMatmulInputs(in, 0, check, d));
  DC_RETURN_IF_ERROR(check->Float(out[0], Out(0, "y")));
  return check->ShapeIs(out[0], {d->rows, d->n}, Out(0, "y"));
}

Status CheckGroupedMatmulBackward(Tensors in, Tensors out, Checker* check, GroupedMatmulDims* d) {
  DC_RETURN_IF_ERROR(CheckGroupedMatmulInputs(in, 1, check, d));
  if (static_cast<int64_t>(out.size()) != 1 + d->experts) {
    return check->Error("expects " + std::to_string(1 + d->experts) +
                        " outputs (dx and one dW per expert), got " + std::to_string(out.size()));
  }
  DC_RETURN_IF_ERROR(check->Float(in[0], In(0, "dy")));
  DC_RETURN_IF_ERROR(check->ShapeIs(in[0], {d->rows, d->n}, In(0, "dy")));
  DC_RETURN_IF_ERROR(check->Float(out[0], Out(0, "dx")));
  DC_RETURN_IF_ERROR(check->ShapeIs(out[0], {d->rows, d->k}, Out(0, "dx")));
  for (size_t i = 1; i < out.size(); ++i) {
    DC_RETURN_IF_ERROR(check->Float(out[i], Out(i, "dw")));
    DC_RETURN_IF_ERROR(check->ShapeIs(out[i], {d->n, d->k}, Out(i, "dw")));
  }
  return Status::Ok();
}

// The E + 1 segment offsets of `experts` on the host. cuBLASLt takes matrix sizes from the host,
// so the layout made on the device is copied back (into pinned memory) and the host waits for
// the stream: one synchronization per grouped op (three per MoE layer forward, three backward).
// It drains the work queued before the op, so the host no longer runs ahead and the launch
// latency of the ops after it is exposed instead of hidden behind the queue. Returns the device
// error record's message when an id was outside [0, E).
StatusOr<std::vector<int64_t>> SegmentOffsetsOnHost(const Call& c, const DeviceTensor& experts,
                                                    int64_t slots, int64_t num_experts) {
  DC_ASSIGN_OR_RETURN(const ck::MoeLayoutView layout,
                      EnqueueMoeLayout(c, experts, slots, num_experts));
  const int64_t bytes = (num_experts + 1) * static_cast<int64_t>(sizeof(int32_t));
  if (c.r.host_offsets.size_bytes() < bytes) {
    // Nothing is in flight into the old buffer: every use below ends with a synchronization.
    c.r.host_offsets = PinnedHostBuffer();
    DC_ASSIGN_OR_RETURN(c.r.host_offsets,
                        PinnedHostBuffer::Create(bytes, "grouped matmul segment offsets"));
  }
  const std::string prefix = "op " + c.op.name() + " (" + c.op.kind() + "): ";
  DC_RETURN_IF_ERROR(CopyAsync(c.r.host_offsets.data(), layout.offsets, bytes, c.context.stream,
                               "copying the segment offsets to the host")
                         .Prefixed(prefix));
  DC_RETURN_IF_ERROR(
      CudaStatus(cudaStreamSynchronize(c.context.stream), "waiting for the segment offsets")
          .Prefixed(prefix));
  const auto* device_offsets = static_cast<const int32_t*>(c.r.host_offsets.data());
  std::vector<int64_t> offsets(device_offsets, device_offsets + num_experts + 1);
  if (offsets.back() != slots) {
    // Some slot's id was outside [0, E): report it (and clear the record) now.
    DC_RETURN_IF_ERROR(c.context.resources->CheckDeviceErrors(c.context.stream).Prefixed(prefix));
    return OpError(c.op, "the layout holds " + std::to_string(offsets.back()) + " of " +
                             std::to_string(slots) +
                             " slots but the device error record is empty (a layout kernel bug)");
  }
  return offsets;
}

// Row `row` of `t`, a row-major [*, width] tensor.
char* RowPointer(const DeviceTensor& t, int64_t row, int64_t width) {
  return static_cast<char*>(t.data) + row * width * DTypeSizeBytes(t.dtype);
}

Status GroupedMatmul(Call c) {
  Checker check(c.op);
  GroupedMatmulDims d;
  DC_RETURN_IF_ERROR(CheckGroupedMatmul(c.in, c.out, &check, &d));
  DC_ASSIGN_OR_RETURN(const std::vector<int64_t> offsets,
                      SegmentOffsetsOnHost(c, c.in[1], d.rows, d.experts));
  const cudaDataType_t type = CudaType(check.type());
  const DeviceTensor &x = c.in[0], &y = c.out[0];
  for (int64_t e = 0; e < d.experts; ++e) {
    const int64_t begin = offsets[e], count = offsets[e + 1] - begin;
    if (count == 0) continue;  // an expert without tokens costs nothing
    const DeviceTensor& w = c.in[2 + e];
    // As Matmul: column-major Y_e^T [N x count] = (W_e [K x N])^T X_e^T [K x count].
    DC_RETURN_IF_ERROR(c.r.Matmul(type, true, false, d.n, count, d.k, w.data, d.k,
                                  RowPointer(x, begin, d.k), d.k, RowPointer(y, begin, d.n), d.n,
                                  c.context.stream)
                           .Prefixed("op " + c.op.name() + " (" + c.op.kind() + "): expert " +
                                     std::to_string(e) + ": "));
  }
  return Status::Ok();
}

Status GroupedMatmulBackward(Call c) {
  Checker check(c.op);
  GroupedMatmulDims d;
  DC_RETURN_IF_ERROR(CheckGroupedMatmulBackward(c.in, c.out, &check, &d));
  DC_ASSIGN_OR_RETURN(const std::vector<int64_t> offsets,
                      SegmentOffsetsOnHost(c, c.in[2], d.rows, d.experts));
  const cudaDataType_t type = CudaType(check.type());
  const DeviceTensor &dy = c.in[0], &x = c.in[1], &dx = c.out[0];
  for (int64_t e = 0; e < d.experts; ++e) {
    const std::string prefix =
        "op " + c.op.name() + " (" + c.op.kind() + "): expert " + std::to_string(e) + " ";
    const DeviceTensor &w = c.in[3 + e], &dw = c.out[1 + e];
    const int64_t begin = offsets[e], count = offsets[e + 1] - begin;
    if (count == 0) {
      // dW is written whole: an expert without tokens has a zero gradient.
      DC_RETURN_IF_ERROR(CudaStatus(cudaMemsetAsync(dw.data, 0, static_cast<size_t>(dw.SizeBytes()),
                                                    c.context.stream),
                                    "zeroing dw")
                             .Prefixed(prefix));
      continue;
    }
    // As MatmulBackward on the segment: dX_e = dY_e W_e, dW_e = dY_e^T X_e.
    DC_RETURN_IF_ERROR(c.r.Matmul(type, false, false, d.k, count, d.n, w.data, d.k,
                                  RowPointer(dy, begin, d.n), d.n, RowPointer(dx, begin, d.k), d.k,
                                  c.context.stream)
                           .Prefixed(prefix + "dx: "));
    DC_RETURN_IF_ERROR(c.r.Matmul(type, false, true, d.k, d.n, count, RowPointer(x, begin, d.k),
                                  d.k, RowPointer(dy, begin, d.n), d.n, dw.data, d.k,
                                  c.context.stream)
                           .Prefixed(prefix + "dw: "));
  }
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------------
// Dispatch

using Kernel = Status (*)(Call);

// The device scratch of the kinds that need some (CudaScratchBytes), checking the operands as
// their kernels do.
using ScratchBytes = StatusOr<int64_t> (*)(const proto::Op&, Tensors, Tensors);

StatusOr<int64_t> EmbeddingBackwardScratchBytes(const proto::Op& op, Tensors in, Tensors out) {
  Checker check = Checker::ShapesOnly(op);
  EmbeddingDims d{};
  DC_RETURN_IF_ERROR(CheckEmbedding(in, out, true, &check, &d));
  return EmbeddingBackwardScratch(d);
}

StatusOr<int64_t> RmsNormBackwardScratchBytes(const proto::Op& op, Tensors in, Tensors out) {
  Checker check = Checker::ShapesOnly(op);
  NormDims d{};
  DC_RETURN_IF_ERROR(CheckNorm(in, out, true, &check, &d));
  return RmsNormBackwardScratch(d);
}

StatusOr<int64_t> AttentionBackwardScratchBytes(const proto::Op& op, Tensors in, Tensors out) {
  Checker check = Checker::ShapesOnly(op);
  ck::AttentionDims d{};
  DC_RETURN_IF_ERROR(CheckAttentionBackward(in, out, &check, CudaDeviceInfo{}, &d));
  return AttentionBackwardScratch(d);
}

StatusOr<int64_t> CrossEntropyScratchBytes(const proto::Op& op, Tensors in, Tensors out) {
  Checker check = Checker::ShapesOnly(op);
  CrossEntropyDims d{};
  DC_RETURN_IF_ERROR(CheckCrossEntropy(in, out, false, &check, &d));
  return CrossEntropyScratch(d);
}

StatusOr<int64_t> MoeRouterScratchBytes(const proto::Op& op, Tensors in, Tensors out) {
  Checker check = Checker::ShapesOnly(op);
  RouterDims d;
  DC_RETURN_IF_ERROR(CheckMoeRouter(in, out, &check, &d));
  return MoeRouterScratch(d);
}

StatusOr<int64_t> MoeRouterBackwardScratchBytes(const proto::Op& op, Tensors in, Tensors out) {
  Checker check = Checker::ShapesOnly(op);
  RouterDims d;
  DC_RETURN_IF_ERROR(CheckMoeRouterBackward(in, out, &check, &d));
  return MoeLayoutScratch(d.slots(), d.experts);
}

template <bool kBackward>
StatusOr<int64_t> MoeDispatchScratchBytes(const proto::Op& op, Tensors in, Tensors out) {
  Checker check = Checker::ShapesOnly(op);
  TokenSideDims d;
  DC_RETURN_IF_ERROR(CheckMoeDispatch(in, out, kBackward, &check, &d));
  return MoeLayoutScratch(d.slots(), d.experts);
}

template <bool kBackward>
StatusOr<int64_t> MoeCombineScratchBytes(const proto::Op& op, Tensors in, Tensors out) {
  Checker check = Checker::ShapesOnly(op);
  TokenSideDims d;
  DC_RETURN_IF_ERROR(CheckMoeCombine(in, out, kBackward, &check, &d));
  return MoeLayoutScratch(d.slots(), d.experts);
}

StatusOr<int64_t> GroupedMatmulScratchBytes(const proto::Op& op, Tensors in, Tensors out) {
  Checker check = Checker::ShapesOnly(op);
  GroupedMatmulDims d;
  DC_RETURN_IF_ERROR(CheckGroupedMatmul(in, out, &check, &d));
  return MoeLayoutScratch(d.rows, d.experts);
}

StatusOr<int64_t> GroupedMatmulBackwardScratchBytes(const proto::Op& op, Tensors in, Tensors out) {
  Checker check = Checker::ShapesOnly(op);
  GroupedMatmulDims d;
  DC_RETURN_IF_ERROR(CheckGroupedMatmulBackward(in, out, &check, &d));
  return MoeLayoutScratch(d.rows, d.experts);
}

// A kind's scratch function; none (null: no scratch) unless given here.
template <OpKind>
constexpr ScratchBytes kScratchBytes = nullptr;
template <>
constexpr ScratchBytes kScratchBytes<OpKind::kEmbeddingBackward> = EmbeddingBackwardScratchBytes;
template <>
constexpr ScratchBytes kScratchBytes<OpKind::kRmsNormBackward> = RmsNormBackwardScratchBytes;
template <>
constexpr ScratchBytes kScratchBytes<OpKind::kAttentionBackward> = AttentionBackwardScratchBytes;
template <>
constexpr ScratchBytes kScratchBytes<OpKind::kCrossEntropy> = CrossEntropyScratchBytes;
template <>
constexpr ScratchBytes kScratchBytes<OpKind::kMoeRouter> = MoeRouterScratchBytes;
template <>
constexpr ScratchBytes kScratchBytes<OpKind::kMoeRouterBackward> = MoeRouterBackwardScratchBytes;
template <>
constexpr ScratchBytes kScratchBytes<OpKind::kMoeDispatch> = MoeDispatchScratchBytes<false>;
template <>
constexpr ScratchBytes kScratchBytes<OpKind::kMoeDispatchBackward> = MoeDispatchScratchBytes<true>;
template <>
constexpr ScratchBytes kScratchBytes<OpKind::kMoeCombine> = MoeCombineScratchBytes<false>;
template <>
constexpr ScratchBytes kScratchBytes<OpKind::kMoeCombineBackward> = MoeCombineScratchBytes<true>;
template <>
constexpr ScratchBytes kScratchBytes<OpKind::kGroupedMatmul> = GroupedMatmulScratchBytes;
template <>
constexpr ScratchBytes kScratchBytes<OpKind::kGroupedMatmulBackward> =
    GroupedMatmulBackwardScratchBytes;
template <>
constexpr ScratchBytes kScratchBytes<OpKind::kGradNormSquared> = GradNormSquaredScratchBytes;

struct KindEntry {
  Kernel run;
  ScratchBytes scratch_bytes;  // null: the kind needs no scratch
};

// Indexed by OpKind: per row of DC_OP_KINDS, the kernel named as the row's id and the scratch
// function, if any.
constexpr KindEntry kKinds[] = {
#define DC_CUDA_KERNEL(id, name, math) {id, kScratchBytes<OpKind::k##id>},
    DC_OP_KINDS(DC_CUDA_KERNEL)
#undef DC_CUDA_KERNEL
};
static_assert(std::size(kKinds) == kNumOpKinds);

// The entry of `op`'s kind, or null when no row has that name.
const KindEntry* EntryOf(const proto::Op& op) {
  const std::optional<OpKind> kind = FindOpKind(op.kind());
  return kind ? &kKinds[static_cast<size_t>(*kind)] : nullptr;
}

}  // namespace

StatusOr<int64_t> CudaScratchBytes(const proto::Op& op, Tensors inputs, Tensors outputs) {
  const KindEntry* entry = EntryOf(op);
  if (entry == nullptr) return OpError(op, "the CUDA backend has no kernel for this kind");
  if (entry->scratch_bytes == nullptr) return int64_t{0};
  return entry->scratch_bytes(op, inputs, outputs);
}

Status RunCudaOp(const proto::Op& op, std::span<DeviceTensor> inputs,
                 std::span<DeviceTensor> outputs, const CudaKernelContext& context) {
  if (context.resources == nullptr) return OpError(op, "the CUDA kernel context has no resources");
  const KindEntry* entry = EntryOf(op);
  if (entry == nullptr) return OpError(op, "the CUDA backend has no kernel for this kind");
  Impl& r = context.resources->impl();
  DC_RETURN_IF_ERROR(entry->run(Call{op, inputs, outputs, context, r}));
  if (!context.synchronous) return Status::Ok();
  const std::string prefix = "op " + op.name() + " (" + op.kind() + "): ";
  DC_RETURN_IF_ERROR(
      CudaStatus(cudaStreamSynchronize(context.stream), "running on the device").Prefixed(prefix));
  return context.resources->CheckDeviceErrors(context.stream).Prefixed(prefix);
}

Status CudaCast(const DeviceTensor& from, const DeviceTensor& to, cudaStream_t stream) {
  ck::FloatType from_type{}, to_type{};
  if (!ToFloatType(from.dtype, &from_type) || !ToFloatType(to.dtype, &to_type)) {
    return Status::Error(std::string("cast: ") + DTypeName(from.dtype) + " to " +
                         DTypeName(to.dtype) + " is not between float dtypes");
  }
  if (from.NumElements() != to.NumElements()) {
    return Status::Error("cast: " + std::to_string(from.NumElements()) + " elements into " +
                         std::to_string(to.NumElements()));
  }
  if (from.NumElements() == 0) return Status::Ok();
  return CudaStatus(ck::Cast(from_type, from.data, to_type, to.data, from.NumElements(), stream),
                    "cast kernel launch");
}

Status CudaAccumulate(const DeviceTensor& src, float scale, const DeviceTensor& dst,
                      cudaStream_t stream) {
  ck::FloatType src_type{};
  if (!ToFloatType(src.dtype, &src_type) || dst.dtype != proto::DTYPE_F32) {
    return Status::Error(std::string("accumulate: ") + DTypeName(src.dtype) + " into " +
                         DTypeName(dst.dtype) + "; expected a float source and an f32 target");
  }
  if (src.NumElements() != dst.NumElements()) {
    return Status::Error("accumulate: " + std::to_string(src.NumElements()) + " elements into " +
                         std::to_string(dst.NumElements()));
  }
  if (src.NumElements() == 0) return Status::Ok();
  return CudaStatus(ck::AccumulateF32(src_type, src.data, scale, static_cast<float*>(dst.data),
                                      src.NumElements(), stream),
                    "accumulate kernel launch");
}

}  // namespace dc
