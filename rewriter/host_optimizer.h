// The host optimizer pass (`host-optimizer`): ZeRO-Offload's CPU Adam, the optimizer step of
// DeepSpeed's ZeRO-3 offload. Every optimizer op runs on the host (STREAM_HOST) once the last
// backward and its reduce-scatters are done; the params' optimizer states and fp32 masters live
// in host memory for the whole run (schemas/program.h's HostResidentTensors), so the device
// keeps only each param's shard in the compute dtype (for the gathers) and its grad shard. Each
// host op copies its grad shard from the device, updates master, m and v on the host, and
// writes the compute-dtype shard back (CostModel::host_optimizer_elements_per_second prices the
// whole of it; the copies overlap the host's Adam, as DeepSpeed's do).
//
// Unlike `offload`, nothing comes back to the device: what moves over the host link is grads
// and compute-dtype params, 6 bytes per element in bf16 instead of 24 of states and masters
// there and back; the price is the host's Adam, 5x the device step or more.
#pragma once

#include <cstdint>
#include <string>

#include "rewriter/pass.h"

namespace dc {

struct HostOptimizerOptions {
  // 0: every optimizer op on the host (ZeRO-3 offload). Above 0 (`host-optimizer-part`, dc's
  // fallback where the device cannot hold the optimizer step): only the ops of the largest
  // params, until the device's persistent shards fit this share of the budget; the other
  // params step on the device, and the offload pass moves their state as it must.
  double device_share_of_budget = 0;
};

struct HostOptimizerStats {
  int host_ops = 0;                 // optimizer ops moved to the host
  int64_t host_resident_bytes = 0;  // states and masters kept in host memory (per rank)
  int64_t compute_shard_bytes = 0;  // compute-dtype shards left on the device (per rank)
};

class HostOptimizerPass : public Pass {
 public:
  explicit HostOptimizerPass(HostOptimizerOptions options = {}) : options_(options) {}
  // The partial pass frees only what the optimizer step needs; the offload pass after it frees
  // what the forward and backward need, so the budget is checked from there on.
  bool FreesMemory() const override { return options_.device_share_of_budget <= 0; }
  std::string_view name() const override {
    return options_.device_share_of_budget > 0 ? "host-optimizer-part" : "host-optimizer";
  }
  std::string OptionsText() const override;
  // Errors when the schedule already offloads or reloads anything (run this pass instead of the
  // offload passes) or has no optimizer op.
  StatusOr<bool> Run(proto::Schedule* schedule, const PassContext& context) override;
  std::string Summary() const override;
  const HostOptimizerStats& stats() const { return stats_; }

 private:
  HostOptimizerOptions options_;
  HostOptimizerStats stats_;
};

}  // namespace dc
