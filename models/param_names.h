// Names of the Llama program's params, shared by the builder (models/model.cc) and the
// initializer (executor/data.cc).
#pragma once

#include <string>
#include <string_view>

namespace dc::param_names {

inline constexpr char kEmbed[] = "embed";
inline constexpr char kFinalNorm[] = "final_norm";
inline constexpr char kLmHead[] = "lm_head";
// Per layer, after "layers.<l>.".
inline constexpr char kAttnNorm[] = "attn_norm";
inline constexpr char kWq[] = "attn.wq";
inline constexpr char kWk[] = "attn.wk";
inline constexpr char kWv[] = "attn.wv";
inline constexpr char kWo[] = "attn.wo";
inline constexpr char kMlpNorm[] = "mlp_norm";
inline constexpr char kWGate[] = "mlp.w_gate";
inline constexpr char kWUp[] = "mlp.w_up";
inline constexpr char kWDown[] = "mlp.w_down";
// Mixture-of-experts layers: the router, and each expert's MLP after ExpertPrefix.
inline constexpr char kRouter[] = "moe.router";

// Suffixes of a param's grad and optimizer states.
inline constexpr char kGradSuffix[] = ".grad";
inline constexpr char kAdamMSuffix[] = ".adam_m";
inline constexpr char kAdamVSuffix[] = ".adam_v";

inline std::string LayerPrefix(int layer) { return "layers." + std::to_string(layer) + "."; }
inline std::string ExpertPrefix(int layer, int64_t expert) {
  return LayerPrefix(layer) + "experts." + std::to_string(expert) + ".";
}

// Output projections write into the residual stream (attn.wo, mlp.w_down); their init is
// scaled down with depth.
inline bool IsResidualOutputProjection(std::string_view name) {
  return name.ends_with(std::string(".") + kWo) || name.ends_with(std::string(".") + kWDown);
}

}  // namespace dc::param_names
