#include "analyzer/calibration.h"

#include <algorithm>
#include <memory>
#include <set>
#include <string>

#include "analyzer/profile.h"
#include "machine/estimate.h"
#include "machine/simulator.h"

namespace dc {

namespace {

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::string Plural(size_t n, const char* what) {
  return std::to_string(n) + " " + what + (n == 1 ? "" : "s");
}

// Samples of one transfer kind against `predict`, into `group`.
void AddTransfers(const char* kind, const std::vector<CostSample>& samples,
                  const std::function<LinearCost(const HardwareProfile&)>& cost, FitGroup* group,
                  std::set<int64_t>* sizes) {
  for (const CostSample& s : samples) {
    if (s.seconds <= 0) continue;
    sizes->insert(s.bytes);
    Observation o;
    o.what = std::string(kind) + " " + std::to_string(s.bytes) + " B";
    o.measured_seconds = s.seconds;
    o.predict = [cost, bytes = s.bytes](const HardwareProfile& hw) {
      return cost(hw).Seconds(bytes);
    };
    group->observations.push_back(std::move(o));
  }
}

}  // namespace

StatusOr<std::vector<FitGroup>> TraceGroups(const Trace& trace, const HardwareProfile& base) {
  if (!trace.program() || !trace.schedule()) {
    return Status::Error(trace.path() +
                         ": not a dc trace (no program): record one with dc-collect or dc-run "
                         "--trace");
  }
  DC_ASSIGN_OR_RETURN(CostSamples samples, CollectCostSamples(trace));
  DC_ASSIGN_OR_RETURN(Profile profile, BuildProfile(trace));
  const auto program = std::make_shared<proto::Program>(*trace.program());
  const auto schedule = std::make_shared<proto::Schedule>(*trace.schedule());
  const int world = std::max<int>(1, static_cast<int>(trace.ranks().size()));
  std::set<std::string> hosts;
  for (const TraceRank& r : trace.ranks()) hosts.insert(r.hostname);
  const int nodes = hosts.size() > 1 && world % static_cast<int>(hosts.size()) == 0
                        ? static_cast<int>(hosts.size())
                        : 1;
  const ClusterShape cluster{nodes, world / nodes};
  std::vector<FitGroup> groups;

  // Ops: every measured op but the host optimizer's (its own rate, below).
  std::set<int> host_ops;
  for (const proto::Instruction& in : schedule->instructions()) {
    if (in.kind() == proto::INSTR_COMPUTE && in.stream() == proto::STREAM_HOST) {
      host_ops.insert(in.op());
    }
  }
  FitGroup ops;
  ops.input = trace.path();
  ops.error = FitGroup::Error::kAbsolute;
  ops.kind = "trace ops";
  for (int id = 0; id < program->ops_size(); ++id) {
    if (samples.op_seconds[id].empty() || host_ops.count(id)) continue;
    Observation o;
    o.what = "op " + program->ops(id).name() + " (" + program->ops(id).kind() + ")";
    o.measured_seconds = Median(samples.op_seconds[id]);
    if (o.measured_seconds <= 0) continue;
    o.predict = [program, id, world](const HardwareProfile& hw) {
      return EstimateOp(*program, program->ops(id), hw, world).seconds;
    };
    ops.observations.push_back(std::move(o));
  }
  if (!ops.observations.empty()) {
    std::vector<std::string> peaks = {"peak_fp32_flops_per_s"};
    if (program->config().compute_dtype() != proto::DTYPE_F32) {
      peaks.push_back("peak_bf16_flops_per_s");
    }
    ops.keys = EfficiencyOrRateKeys(base, "matmul_efficiency", peaks);
    for (const std::string& k :
         EfficiencyOrRateKeys(base, "memory_efficiency", {"memory_bandwidth_bytes_per_s"})) {
      ops.keys.push_back(k);
    }
    ops.keys.push_back("kernel_launch_seconds");
    groups.push_back(std::move(ops));
  }

  // Host optimizer: elements of the rank's shards over the time.
  FitGroup host_adam;
  host_adam.input = trace.path();
  host_adam.error = FitGroup::Error::kAbsolute;
  host_adam.kind = "trace host optimizer";
  for (const proto::Instruction& in : schedule->instructions()) {
    if (in.kind() != proto::INSTR_COMPUTE || in.stream() != proto::STREAM_HOST) continue;
    if (in.op() < 0 || in.op() >= program->ops_size() || samples.op_seconds[in.op()].empty()) {
      continue;
    }
    const int64_t elements = HostOptimizerElements(*program, world, in);
    if (elements <= 0) continue;
    Observation o;
    o.what = "host optimizer " + program->ops(in.op()).name();
    o.measured_seconds = Median(samples.op_seconds[in.op()]);
    o.predict = [elements](const HardwareProfile& hw) {
      return hw.host_optimizer_elements_per_s > 0 ? elements / hw.host_optimizer_elements_per_s
                                                  : 0.0;
    };
    host_adam.observations.push_back(std::move(o));
  }
  if (!host_adam.observations.empty() && base.host_optimizer_elements_per_s > 0) {
    host_adam.keys = {"host_optimizer_elements_per_s"};
    groups.push_back(std::move(host_adam));
  }

  // Collectives over the trace's ranks.
  FitGroup coll;
  coll.input = trace.path();
  coll.error = FitGroup::Error::kAbsolute;
  coll.kind = "trace collectives";
  if (world < 2) {
    coll.undetermined.push_back(
        "intra_node_bus_bandwidth_bytes_per_s, collective_base_latency_s: one rank: its "
        "collectives are local copies");
  } else {
    std::set<int64_t> sizes;
    auto ring = [cluster](const HardwareProfile& hw) { return RingCollectiveCost(hw, cluster); };
    AddTransfers("all_gather", samples.all_gather, ring, &coll, &sizes);
    AddTransfers("reduce_scatter", samples.reduce_scatter, ring, &coll, &sizes);
    const std::string bandwidth = nodes > 1 ? "inter_node_bandwidth_per_gpu_bytes_per_s"
                                            : "intra_node_bus_bandwidth_bytes_per_s";
    if (coll.observations.empty()) {
      coll.undetermined.push_back(bandwidth + ": no collective in a measured step");
    } else {
      coll.keys.push_back(bandwidth);
      if (sizes.size() >= 2) {
        coll.keys.push_back("collective_base_latency_s");
      } else {
        coll.undetermined.push_back(
            "collective_base_latency_s: one message size: latency and bandwidth cannot both be "
            "fitted");
      }
      coll.undetermined.push_back(
          "intra_node_step_latency_s: one rank count: the base latency takes the whole");
    }
  }
  if (!coll.observations.empty() || !coll.undetermined.empty()) groups.push_back(std::move(coll));

  // Host link: offloads and reloads.
  FitGroup link;
  link.input = trace.path();
  link.error = FitGroup::Error::kAbsolute;
  link.kind = "trace host link";
  std::set<int64_t> link_sizes;
  auto host = [](const HardwareProfile& hw) {
    return LinearCost{hw.host_link_latency_s, hw.host_link_bandwidth_bytes_per_s};
  };
  AddTransfers("reload", samples.host_to_device, host, &link, &link_sizes);
  AddTransfers("offload", samples.device_to_host, host, &link, &link_sizes);
  if (!link.observations.empty()) {
    link.keys.push_back("host_link_bandwidth_bytes_per_s");
    if (link_sizes.size() >= 2 && base.host_link_latency_s > 0) {
      link.keys.push_back("host_link_latency_s");
    } else {
      link.undetermined.push_back(
          "host_link_latency_s: one copy size: latency and bandwidth cannot both be fitted");
    }
    groups.push_back(std::move(link));
  }

  // The whole step.
  FitGroup step;
  step.input = trace.path();
  step.kind = "trace step";
  if (profile.step_seconds_median > 0) {
    Observation o;
    o.what = "median step of " + Plural(schedule->instructions_size(), "instruction");
    o.measured_seconds = profile.step_seconds_median;
    o.predict = [program, schedule, cluster](const HardwareProfile& hw) {
      SimOptions options;
      options.memory_timeline = false;
      const StatusOr<SimResult> sim =
          Simulate(*schedule, EstimateCostModel(*program, hw, cluster), options);
      return sim.ok() ? sim->step_seconds : -1.0;
    };
    step.observations.push_back(std::move(o));
    double overlap_seconds = 0;
    for (const StepOverlap& s : profile.overlap) overlap_seconds += s.overlap_seconds;
    if (base.serial_streams) {
      step.undetermined.push_back(
          "overlap_compute_slowdown: the backend runs one instruction at a time");
    } else if (overlap_seconds <= 0) {
      step.undetermined.push_back(
          "overlap_compute_slowdown: no compute beside a collective in the trace");
    } else {
      step.keys.push_back("overlap_compute_slowdown");
    }
    groups.push_back(std::move(step));
  }
  return groups;
}

}  // namespace dc
