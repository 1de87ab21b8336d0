// Hardware profiles: what one GPU (or one cpu-backend rank) of a known machine can do, for cost
// estimates of programs that were never run here (machine/estimate.h). The numbers are
// checked-in data (machine/hardware_profiles.json, embedded at build time), each with its
// source; machine/HARDWARE.md says which are datasheet facts and which are assumptions to be
// replaced by measurements. Thread-safe: profiles are parsed once and never change.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "schemas/op_kinds.h"
#include "schemas/status.h"

namespace dc {

// Every op kind's roofline time as it is (HardwareProfile::op_time_scale's default).
constexpr std::array<double, kNumOpKinds> OpTimeScaleOnes() {
  std::array<double, kNumOpKinds> ones{};
  for (double& one : ones) one = 1;
  return ones;
}

// The file key of op kind `kind`'s time scale: "op_time_scale.attention".
std::string OpTimeScaleKey(OpKind kind);

// One accelerator and its links, per GPU. Rates are what the hardware can sustain before the
// efficiency factors, except where the source says the number is already an achievable rate.
struct HardwareProfile {
  std::string name;                  // "h100-sxm"
  std::vector<std::string> aliases;  // other names FindHardware accepts
  std::string description;

  // Compute: dense tensor-core bf16 / fp16 rate, and the fp32 rate of the vector units.
  double peak_bf16_flops_per_s = 0;
  double peak_fp32_flops_per_s = 0;
  // Memory: capacity as the runtime reports it (0 = no fixed capacity) and peak bandwidth.
  int64_t device_memory_bytes = 0;
  double memory_bandwidth_bytes_per_s = 0;
  // Achievable fractions (0, 1] of the compute peak and of the memory bandwidth.
  double matmul_efficiency = 1;
  double memory_efficiency = 1;

  // Collectives: the achievable ring bus bandwidth inside a node (NCCL-tests' busBw), the
  // achievable network bandwidth per GPU between nodes, and NCCL's ring latency model.
  double intra_node_bus_bandwidth_bytes_per_s = 0;
  double inter_node_bandwidth_per_gpu_bytes_per_s = 0;
  double collective_base_latency_s = 0;
  double intra_node_step_latency_s = 0;
  double inter_node_step_latency_s = 0;

  // Host link (H2D / D2H copies of pinned memory).
  double host_link_bandwidth_bytes_per_s = 0;
  double host_link_latency_s = 0;
  // Optimizer step on the host (ZeRO-Offload's CPU Adam): param elements per second that one
  // rank's share of the host's cores updates. 0: the host is the device (the cpu backend), an
  // optimizer op there costs what it costs on the device.
  double host_optimizer_elements_per_s = 0;

  // Floor on the duration of one op: launching its kernels.
  double kernel_launch_seconds = 0;
  // Compute that overlaps a collective runs this much slower (>= 1).
  double overlap_compute_slowdown = 1;
  // A collective's transfer that overlaps compute runs this much slower (>= 1): on the cpu
  // backend Gloo over loopback shares the rank's cores with the compute thread.
  double overlap_collective_slowdown = 1;
  // Compute-stream seconds each collective takes when it starts (streams concurrent): on the cpu
  // backend the communication threads of ranks that share cores take the compute thread's core
  // between ops, which no op's time shows (machine/cost_model.h's collective_compute_seconds).
  // Scaled by HostShareSlowdown like every rate. dc-calibrate fits it to traced steps.
  double collective_compute_seconds = 0;
  // The wait of a collective for the last rank to arrive, as a fraction of the time since the
  // previous collective on its stream started (machine/cost_model.h's collective_skew_fraction).
  // dc-calibrate measures it in traces of 2 or more ranks.
  double collective_skew_fraction = 0;
  // That wait's ceiling (0: none).
  double collective_skew_max_seconds = 0;
  // The backend runs one instruction at a time (the cpu backend under DC_CPU_STREAMS=serial).
  bool serial_streams = false;
  // GPUs in one NVLink domain; 0 = no limit.
  int max_gpus_per_node = 0;
  // Cores the ranks of one node share, where ranks are processes on a host's cores (the cpu
  // backend): the rates above are one rank's on a core of its own, and ranks beyond the cores
  // run that much slower (machine/estimate.h's HostShareSlowdown). 0: each rank has a device of
  // its own (GPUs), or not known.
  int host_cores_per_node = 0;
  // How far this profile's predictions of whole steps were from measured ones: the median
  // |predicted / measured - 1| over the step times dc-calibrate fitted it to (0: no whole step
  // measured against it, as for the built-in profiles). A prediction's range (dc-plan) widens by
  // it: the constants may be measured and the model still miss what they do not describe.
  double step_error_fraction = 0;
  // A factor on the roofline time of each op kind's kernels (index = OpKind, schemas/op_kinds.h):
  // the time they take over what the rates above say, 1 where nothing was measured. A roofline of
  // two rates cannot tell a backend's fused attention from its plain elementwise loops; these
  // can, and dc-calibrate fits them per kind from traces (file keys "op_time_scale.<kind>",
  // optional: an absent one is 1).
  std::array<double, kNumOpKinds> op_time_scale = OpTimeScaleOnes();

  // Where each constant's value comes from, by its key in the file ("ASSUMPTION: ..." marks one
  // to be replaced by a measurement).
  std::map<std::string, std::string> sources;
};

// Ranks spread evenly over nodes: rank r is on node r / gpus_per_node.
struct ClusterShape {
  int nodes = 1;
  int gpus_per_node = 1;
  int world_size() const { return nodes * gpus_per_node; }
};

// The profile named `name` or one of its aliases (case-insensitive). Unknown name: the message
// lists the known ones.
StatusOr<HardwareProfile> FindHardware(const std::string& name);

// Names of the checked-in profiles, in file order.
std::vector<std::string> HardwareNames();

// All checked-in profiles, in file order, or why the embedded data does not parse.
StatusOr<std::vector<HardwareProfile>> HardwareProfiles();

// Parses profiles in the hardware_profiles.json format. Every constant must be present, in
// range and carry a non-empty source; unknown keys are errors (they are typos). `origin` names
// the text in messages.
StatusOr<std::vector<HardwareProfile>> ParseHardwareProfiles(const std::string& json_text,
                                                             const std::string& origin);

// The one profile of a file in the hardware_profiles.json format (dc-plan --hardware FILE.json).
// Messages name the file and the key: not JSON (with line and column), unknown or missing keys,
// a unit other than the constant's, a value of the wrong type, negative or non-finite, or a file
// of more than one profile.
StatusOr<HardwareProfile> LoadHardwareFile(const std::string& path);

// Whether --hardware names a file (a path with '/' or a name ending in .json) rather than a
// built-in profile.
bool IsHardwareFile(const std::string& name_or_path);

// The profile --hardware names: LoadHardwareFile for a file, else FindHardware.
StatusOr<HardwareProfile> ResolveHardware(const std::string& name_or_path);

// `profile` as a file of one profile in the hardware_profiles.json format, every constant with its
// value, unit and source (dc-plan --print-hardware). LoadHardwareFile of it gives the same profile.
std::string HardwareProfileJson(const HardwareProfile& profile);

// `world` ranks with `gpus_per_node` per node. A world smaller than one node is one partial node;
// otherwise the world must be a whole number of nodes. Messages name the command-line flags.
StatusOr<ClusterShape> MakeCluster(int world, int gpus_per_node);

// The numeric constants of a profile by their key in the file, for code that treats them alike
// (dc-calibrate fits any of them; machine/calibrate.h): every constant of the file's field table
// but the booleans, in file order, with its unit and the values it may take.
struct HardwareConstantInfo {
  std::string key;
  std::string unit;
  bool integral = false;
  double min_value = 0;  // the smallest valid value (inclusive unless min_exclusive)
  bool min_exclusive = false;
  double max_value = 0;  // the largest valid value; +inf where none
};
std::vector<HardwareConstantInfo> HardwareConstants();

// The value of the numeric constant `key`, or an error naming the known keys.
StatusOr<double> GetHardwareConstant(const HardwareProfile& profile, const std::string& key);

// Sets the numeric constant `key` to `value` (rounded for integral ones) after checking it is in
// the constant's range; errors name the key and the range.
Status SetHardwareConstant(HardwareProfile* profile, const std::string& key, double value);

// Checks that `cluster` can be built from `hw` (no more GPUs per node than one NVLink domain).
Status ValidateCluster(const HardwareProfile& hw, const ClusterShape& cluster);

}  // namespace dc
