// The op kinds a Program may hold: ONE table of them (DC_OP_KINDS), their operand order and
// attributes. Every backend implements exactly these (executor/cpu_kernels.cc is the reference
// math); each backend's kernel table and the roofline estimate's classification
// (machine/estimate.cc) are generated from DC_OP_KINDS, so a kind that one of them lacks does not
// compile.
//
// Adding a kind: its row in DC_OP_KINDS, its operands below, and a kernel function named as the
// row's id in each backend (executor/cpu_kernels.cc, executor/cuda/cuda_kernels.cc).
//
// Conventions shared by all kinds:
// - Tensors are row-major. "[..., H]" means any leading dims, flattened to rows of H.
// - A backward kind "<kind>_backward" takes the gradient(s) of the forward outputs first, then
//   the forward inputs it needs, and outputs the gradients of the forward's differentiable
//   inputs in the forward's input order. Param gradients (dW) are written whole (not
//   accumulated): one backward op makes the full micro-batch gradient of each param.
// - Every op carries `flops` (floating-point operations of one execution, the formula given
//   per kind below; M = rows, i.e. tokens) and `layer` (-1 outside the decoder layers).
// - Storage may be fp32 whatever the compute dtype; softmax and norms always reduce in fp32.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

// ---------------------------------------------------------------------------------------------
// The kinds, in the order of DC_OP_KINDS.
//
// embedding: gathers rows of the embedding table.
//   inputs  [tokens i32 [B, S], table [V, H]]   outputs [y [B, S, H]]
//   flops   0 (a gather)
// embedding_backward
//   inputs  [dy [B, S, H], tokens i32 [B, S]]   outputs [dtable [V, H]]
//   flops   M * H (scatter-add)

// rmsnorm: y = x / sqrt(mean(x^2) + eps) * w, per row.
//   inputs  [x [..., H], w [H]]   outputs [y [..., H]]   attrs  eps (f)
//   flops   4 * M * H
// rmsnorm_backward
//   inputs  [dy, x, w]   outputs [dx, dw]   attrs  eps (f)
//   flops   8 * M * H

// matmul: y = x W^T.
//   inputs  [x [..., K], w [N, K]]   outputs [y [..., N]]
//   flops   2 * M * N * K
// matmul_backward
//   inputs  [dy [..., N], x [..., K], w [N, K]]   outputs [dx [..., K], dw [N, K]]
//   flops   4 * M * N * K

// rope: rotary position embedding, "rotate half" pairing (element i with i + head_dim / 2 inside
// each head, as Hugging Face Llama), position = index along S, frequency theta^(-2i / head_dim).
//   inputs  [x [B, S, heads * head_dim]]   outputs [y, same shape]
//   attrs   heads (i), head_dim (i, even), theta (f)
//   flops   3 * M * heads * head_dim
// rope_backward
//   inputs  [dy]   outputs [dx]   attrs as rope (rotation by the opposite angle)

// attention: causal grouped-query attention: query head h reads kv head h / (heads / kv_heads);
// scores scaled by 1 / sqrt(head_dim); softmax in fp32.
//   inputs  [q [B, S, heads * head_dim], k [B, S, kv_heads * head_dim], v (as k)]
//   outputs [o [B, S, heads * head_dim]]
//   attrs   heads (i), kv_heads (i), head_dim (i)
//   flops   2 * B * heads * S * S * head_dim (two matmuls, half of each masked away)
// attention_backward: recomputes the softmax from q and k (as flash-attention does); nothing else
// is saved.
//   inputs  [do, q, k, v]   outputs [dq, dk, dv]   attrs as attention
//   flops   5 * B * heads * S * S * head_dim (recompute scores, dP, dV, dQ, dK)

// swiglu: y = silu(gate) * up.
//   inputs  [gate [..., F], up [..., F]]   outputs [y [..., F]]
//   flops   5 * M * F
// swiglu_backward
//   inputs  [dy, gate, up]   outputs [dgate, dup]
//   flops   10 * M * F

// add: elementwise sum of two or more same-shaped tensors: residual joins in forward, and in
// backward wherever gradients of one activation from several consumers join.
//   inputs  [a, b, ...]   outputs [sum]
//   flops   (inputs - 1) * elements

// cross_entropy: cross-entropy of logits against target ids: the SUM over tokens of
// logsumexp(logits) - logits[target] (the mean is taken by the gradient scale).
//   inputs  [logits [..., V], targets i32 [...]]   outputs [loss f32 [1]]
//   flops   4 * M * V
// cross_entropy_backward: the loss is the root: there is no incoming gradient tensor. Writes
// (softmax(logits) - onehot(target)) * grad_scale, grad_scale from the executor
// (1 / tokens of the whole optimizer step over all ranks).
//   inputs  [logits, targets]   outputs [dlogits]
//   flops   4 * M * V

// adamw: AdamW with bias correction (PyTorch semantics: p -= lr * wd * p, then the Adam update).
// In place on the rank's equal-length shards; no outputs. Step count from the executor. With
// gradient clipping (ModelConfig.clip_grad_norm > 0) a fifth input is the global squared norm
// of the grads (grad_norm_squared's output, summed over the ranks) and attr max_grad_norm is
// set: the grad is used times min(1, max_grad_norm / (sqrt(norm_squared) + kClipNormEpsilon)),
// all in fp32 (torch.nn.utils.clip_grad_norm_'s formula).
//   inputs  [param, grad, m, v] or [param, grad, m, v, norm_squared f32 [1]]   outputs []
//   attrs   lr, beta1, beta2, eps, weight_decay (f; weight_decay is 0 for 1-D params),
//           max_grad_norm (f, > 0; with the fifth input only)
//   flops   12 * elements

// ---------------------------------------------------------------------------------------------
// Mixture of experts (the Mixtral block). Tokens are routed to `top_k` of `experts` experts and
// dispatched without dropping: the routed rows of a micro-batch are laid out expert after expert
// in one [M * top_k, ...] buffer (inside an expert, by token, then by choice), so every buffer
// has a static shape whatever the routing, and each expert's rows are a contiguous segment
// whose bounds every op recomputes from the i32 `experts` tensor (a counting pass over M * k
// ids). Expert e's params are ordinary params, inputs of the grouped ops that use them.

// moe_router: top-k routing with renormalized gates and the load-balancing loss. p =
// softmax(logits) in fp32; per token the top_k experts by p (ties: the lower index), gates = their
// p over the sum of their p (Mixtral), experts = their ids in descending p. The auxiliary loss of
// this layer is aux_coef * E * sum_e f_e * P_e with f_e = tokens choosing e / M and P_e = mean_t
// p[t, e] over the micro-batch's M tokens (Switch Transformer / Mixtral; one term per MoE layer, as
// each rank computes it on its own micro-batch); it is written in the cross-entropy's sum scale,
// times M, so it joins the loss like another cross-entropy (see kAuxLossSuffix).
//   inputs  [logits [..., E]]
//   outputs [gates f32 [..., k], experts i32 [..., k], aux_loss f32 [1]]
//   attrs   top_k (i), aux_coef (f)
//   flops   6 * M * E
// moe_router_backward: the gradient through the gates (the expert choice is not differentiable)
// plus the load balancing term: dp[t, e] += grad_scale * aux_coef * E * f_e; softmax recomputed
// from logits.
//   inputs  [dgates [..., k], logits [..., E], experts i32 [..., k]]   outputs [dlogits [..., E]]
//   attrs   as moe_router
//   flops   8 * M * E

// moe_dispatch: copies each token's row once per chosen expert into the expert-major layout.
//   inputs  [x [..., H], experts i32 [..., k]]   outputs [xs [M * k, H]]   attrs  experts (i)
//   flops   0 (a gather)
// moe_dispatch_backward
//   inputs  [dxs [M * k, H], experts i32 [..., k]]   outputs [dx [..., H]] (sum of a token's rows)
//   attrs   experts (i)
//   flops   M * k * H

// grouped_matmul: one matrix product per expert over its segment of rows: y[r] = x[r] w_e^T for r
// in expert e's segment. An expert with no tokens costs nothing (and gets a zero dW).
//   inputs  [x [M * k, K], experts i32 [..., k], w_0 [N, K], ..., w_{E-1} [N, K]]
//   outputs [y [M * k, N]]
//   flops   2 * M * k * N * K (exact whatever the balance: the segments sum to M * k rows)
// grouped_matmul_backward
//   inputs  [dy [M * k, N], x, experts, w_0, ..., w_{E-1}]   outputs [dx, dw_0, ..., dw_{E-1}]
//   flops   4 * M * k * N * K

// moe_combine: y[t] = sum_j gates[t, j] * ys[row of (t, j)]: the experts' outputs, weighted and
// summed back per token.
//   inputs  [ys [M * k, H], gates f32 [..., k], experts i32 [..., k]]   outputs [y [..., H]]
//   attrs   experts (i)
//   flops   2 * M * k * H
// moe_combine_backward
//   inputs  [dy [..., H], ys, gates, experts]   outputs [dys [M * k, H], dgates f32 [..., k]]
//   attrs   experts (i)
//   flops   4 * M * k * H

// ---------------------------------------------------------------------------------------------
// Gradient clipping (ModelConfig.clip_grad_norm > 0).

// grad_norm_squared: the sum of the squares of every element of its inputs (the rank's grad
// shards, in input order, accumulated in double), in the optimizer phase; the schedule's
// INSTR_ALL_REDUCE then sums it over the ranks, and every adamw op reads the sum.
//   inputs  [grad_0, ..., grad_{n-1}]   outputs [norm_squared f32 [1]]
//   flops   2 * elements (of all inputs)

// ---------------------------------------------------------------------------------------------
// The table. One row per kind: X(Id, name, math)
// - Id:   the C++ name: op_kind::kId (the name as a string constant), OpKind::kId, and the kernel
//         function each backend must define.
// - name: proto::Op.kind.
// - math: what the op computes, as OpMath says; the roofline estimate's classification.
#define DC_OP_KINDS(X)                                         \
  X(Embedding, "embedding", kRowGather)                        \
  X(EmbeddingBackward, "embedding_backward", kVector)          \
  X(RmsNorm, "rmsnorm", kVector)                               \
  X(RmsNormBackward, "rmsnorm_backward", kVector)              \
  X(Matmul, "matmul", kMatrix)                                 \
  X(MatmulBackward, "matmul_backward", kMatrix)                \
  X(Rope, "rope", kVector)                                     \
  X(RopeBackward, "rope_backward", kVector)                    \
  X(Attention, "attention", kMatrix)                           \
  X(AttentionBackward, "attention_backward", kMatrix)          \
  X(Swiglu, "swiglu", kVector)                                 \
  X(SwigluBackward, "swiglu_backward", kVector)                \
  X(Add, "add", kVector)                                       \
  X(CrossEntropy, "cross_entropy", kVector)                    \
  X(CrossEntropyBackward, "cross_entropy_backward", kVector)   \
  X(AdamW, "adamw", kVector)                                   \
  X(MoeRouter, "moe_router", kVector)                          \
  X(MoeRouterBackward, "moe_router_backward", kVector)         \
  X(MoeDispatch, "moe_dispatch", kVector)                      \
  X(MoeDispatchBackward, "moe_dispatch_backward", kVector)     \
  X(GroupedMatmul, "grouped_matmul", kMatrix)                  \
  X(GroupedMatmulBackward, "grouped_matmul_backward", kMatrix) \
  X(MoeCombine, "moe_combine", kVector)                        \
  X(MoeCombineBackward, "moe_combine_backward", kVector)       \
  X(GradNormSquared, "grad_norm_squared", kVector)

namespace dc {

// How an op kind computes, which decides how its time is estimated (machine/estimate.h).
enum class OpMath {
  kMatrix,     // matrix products (matmuls, attention): tensor cores at the compute dtype's rate
  kVector,     // elementwise ops, reductions, norms, softmax: vector units at the fp32 rate
  kRowGather,  // reads input 1 (a table) only at the rows input 0 (i32 ids) names; vector units
};

enum class OpKind {
#define DC_OP_KIND_ENUMERATOR(id, name, math) k##id,
  DC_OP_KINDS(DC_OP_KIND_ENUMERATOR)
#undef DC_OP_KIND_ENUMERATOR
};

struct OpKindInfo {
  OpKind kind;
  const char* name;  // proto::Op.kind
  OpMath math;
};

// Every kind, indexed by OpKind.
inline constexpr OpKindInfo kOpKinds[] = {
#define DC_OP_KIND_INFO(id, name, math) {OpKind::k##id, name, OpMath::math},
    DC_OP_KINDS(DC_OP_KIND_INFO)
#undef DC_OP_KIND_INFO
};
inline constexpr size_t kNumOpKinds = sizeof(kOpKinds) / sizeof(kOpKinds[0]);

inline constexpr const OpKindInfo& InfoOf(OpKind kind) {
  return kOpKinds[static_cast<size_t>(kind)];
}

// The kind named `name` (proto::Op.kind); nullopt when no row has that name.
inline std::optional<OpKind> FindOpKind(std::string_view name) {
  for (const OpKindInfo& info : kOpKinds) {
    if (name == info.name) return info.kind;
  }
  return std::nullopt;
}

}  // namespace dc

namespace dc::op_kind {

// The names as constants: op_kind::kMatmul is "matmul".
#define DC_OP_KIND_NAME(id, name, math) inline constexpr char k##id[] = name;
DC_OP_KINDS(DC_OP_KIND_NAME)
#undef DC_OP_KIND_NAME

// A tensor whose name ends so is a term of the loss, in the cross-entropy's sum scale (the
// executor adds it to the tensor named "loss" before dividing by the step's tokens).
inline constexpr char kAuxLossSuffix[] = ".aux_loss";
// Ops and activations a checkpointed layer recomputes in its backward (ModelConfig's
// recompute_layers) are named as the forward's with this suffix, for people reading traces.
// Whether an op is a recompute, and of which op, is its Op.recompute_of: never decided from a
// name. A recomputed balancing loss is not a loss term (it is counted once, in the forward).
inline constexpr char kRecomputeSuffix[] = ".recompute";
inline constexpr char kLossName[] = "loss";
inline bool IsLossTerm(const std::string& tensor_name) {
  return tensor_name == kLossName || tensor_name.ends_with(kAuxLossSuffix);
}

// The backward kind of a forward kind.
inline std::string BackwardKind(const std::string& kind) { return kind + "_backward"; }

}  // namespace dc::op_kind

// Attribute names (proto::Attr.name).
namespace dc::op_attr {
inline constexpr char kEps[] = "eps";
inline constexpr char kHeads[] = "heads";
inline constexpr char kKvHeads[] = "kv_heads";
inline constexpr char kHeadDim[] = "head_dim";
inline constexpr char kTheta[] = "theta";
inline constexpr char kLr[] = "lr";
inline constexpr char kBeta1[] = "beta1";
inline constexpr char kBeta2[] = "beta2";
inline constexpr char kWeightDecay[] = "weight_decay";
inline constexpr char kExperts[] = "experts";
inline constexpr char kTopK[] = "top_k";
inline constexpr char kAuxCoef[] = "aux_coef";
inline constexpr char kMaxGradNorm[] = "max_grad_norm";
}  // namespace dc::op_attr

namespace dc {
// What clip_grad_norm_ adds to the norm before dividing (PyTorch's constant).
inline constexpr float kClipNormEpsilon = 1e-6f;
}  // namespace dc
