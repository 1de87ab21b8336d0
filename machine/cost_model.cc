#include "machine/cost_model.h"

#include <algorithm>
#include <cstdio>

#include "machine/intervals.h"
#include "schemas/effects.h"

namespace dc {

double CostModel::SkewWaitSeconds(double since_previous) const {
  const double wait = collective_skew_fraction * since_previous;
  return collective_skew_max_seconds > 0 ? std::min(wait, collective_skew_max_seconds) : wait;
}

double CostModel::OpSeconds(const proto::Program& program, int op_id) const {
  if (op_id >= 0 && op_id < static_cast<int>(op_seconds.size()) && op_seconds[op_id] >= 0) {
    return op_seconds[op_id];
  }
  if (op_id < 0 || op_id >= program.ops_size() || flops_per_second <= 0) return 0;
  return program.ops(op_id).flops() / flops_per_second;
}

double CostModel::InstructionSeconds(const proto::Program& program, int world_size,
                                     const proto::Instruction& instruction) const {
  switch (instruction.kind()) {
    case proto::INSTR_COMPUTE:
      if (instruction.stream() == proto::STREAM_HOST && host_optimizer_elements_per_second > 0) {
        return static_cast<double>(HostOptimizerElements(program, world_size, instruction)) /
               host_optimizer_elements_per_second;
      }
      return OpSeconds(program, instruction.op());
    case proto::INSTR_ALL_GATHER:
      return all_gather.Seconds(InstructionBytes(program, instruction));
    case proto::INSTR_REDUCE_SCATTER:
      return reduce_scatter.Seconds(InstructionBytes(program, instruction));
    case proto::INSTR_ALL_REDUCE:
      return AllReduceSeconds(InstructionBytes(program, instruction));
    case proto::INSTR_OFFLOAD:
      return device_to_host.Seconds(CopyBytes(program, world_size, instruction));
    case proto::INSTR_RELOAD:
      return host_to_device.Seconds(CopyBytes(program, world_size, instruction));
    case proto::INSTR_RELEASE:
      return release_seconds;
    default:
      return 0;
  }
}

namespace {

using analyzer_internal::Median;

const proto::Tensor* FindTensor(const proto::Program& program, int id) {
  return id >= 0 && id < program.tensors_size() ? &program.tensors(id) : nullptr;
}

// Latency 0, the bandwidth of the typical sample.
LinearCost ThroughOriginAtMedian(const std::vector<CostSample>& samples) {
  std::vector<double> seconds, bytes;
  for (const CostSample& s : samples) {
    seconds.push_back(s.seconds);
    bytes.push_back(static_cast<double>(s.bytes));
  }
  const double median_seconds = Median(seconds);
  const double median_bytes = Median(bytes);
  if (median_bytes <= 0) return {median_seconds, 0};  // nothing moved: pure latency
  if (median_seconds <= 0) return {0, 0};
  return {0, median_bytes / median_seconds};
}

// What a least-squares line through the samples needs.
struct Moments {
  double mean_x = 0, mean_y = 0, sxx = 0, sxy = 0;
  // False for equal bytes everywhere (no slope to fit) or bigger transfers not slower (noise).
  bool HasSlope() const { return sxx > 0 && sxy > 0; }
};

Moments MomentsOf(const std::vector<CostSample>& samples) {
  Moments m;
  if (samples.empty()) return m;
  const double n = static_cast<double>(samples.size());
  for (const CostSample& s : samples) {
    m.mean_x += static_cast<double>(s.bytes) / n;
    m.mean_y += s.seconds / n;
  }
  for (const CostSample& s : samples) {
    const double dx = static_cast<double>(s.bytes) - m.mean_x;
    m.sxx += dx * dx;
    m.sxy += dx * (s.seconds - m.mean_y);
  }
  return m;
}

// `samples` cannot separate latency from bandwidth: `latency_seconds` (from elsewhere) and the
// bandwidth that puts their median on the line; false where that latency leaves no time for
// the bytes.
bool WithLatency(const std::vector<CostSample>& samples, double latency_seconds, LinearCost* cost) {
  std::vector<double> seconds, bytes;
  for (const CostSample& s : samples) {
    seconds.push_back(s.seconds);
    bytes.push_back(static_cast<double>(s.bytes));
  }
  const double transfer_seconds = Median(seconds) - latency_seconds;
  const double median_bytes = Median(bytes);
  if (latency_seconds <= 0 || median_bytes <= 0 || transfer_seconds <= 0) return false;
  *cost = {latency_seconds, median_bytes / transfer_seconds};
  return true;
}

}  // namespace

int64_t HostOptimizerElements(const proto::Program& program, int world_size,
                              const proto::Instruction& instruction) {
  if (instruction.kind() != proto::INSTR_COMPUTE || instruction.op() < 0 ||
      instruction.op() >= program.ops_size()) {
    return 0;
  }
  int64_t elements = 0;
  for (int id : program.ops(instruction.op()).inputs()) {
    const proto::Tensor* t = FindTensor(program, id);
    if (t && t->role() == proto::ROLE_PARAM) {
      elements += ShardElements(NumElements(*t), std::max(1, world_size));
    }
  }
  return elements;
}

LinearCost FitLinearCost(const std::vector<CostSample>& samples) {
  if (samples.empty()) return {};
  const Moments m = MomentsOf(samples);
  if (!m.HasSlope()) return ThroughOriginAtMedian(samples);
  const double seconds_per_byte = m.sxy / m.sxx;
  const double latency_seconds = m.mean_y - seconds_per_byte * m.mean_x;
  if (latency_seconds >= 0) return {latency_seconds, 1 / seconds_per_byte};
  // A negative intercept is not a latency: fit the line through the origin instead.
  double xx = 0, xy = 0;
  for (const CostSample& s : samples) {
    xx += static_cast<double>(s.bytes) * static_cast<double>(s.bytes);
    xy += static_cast<double>(s.bytes) * s.seconds;
  }
  return {0, xy > 0 ? xx / xy : 0};
}

CollectiveCosts FitCollectiveCosts(const std::vector<CostSample>& all_gather,
                                   const std::vector<CostSample>& reduce_scatter) {
  CollectiveCosts costs{FitLinearCost(all_gather), FitLinearCost(reduce_scatter)};
  const bool gather_alone = all_gather.empty() || MomentsOf(all_gather).HasSlope();
  const bool reduce_alone = reduce_scatter.empty() || MomentsOf(reduce_scatter).HasSlope();
  if (gather_alone && reduce_alone) return costs;
  std::vector<CostSample> both = all_gather;
  both.insert(both.end(), reduce_scatter.begin(), reduce_scatter.end());
  if (!MomentsOf(both).HasSlope()) return costs;
  const double latency_seconds = FitLinearCost(both).latency_seconds;
  if (!gather_alone) {
    costs.all_gather_pooled = WithLatency(all_gather, latency_seconds, &costs.all_gather);
  }
  if (!reduce_alone) {
    costs.reduce_scatter_pooled =
        WithLatency(reduce_scatter, latency_seconds, &costs.reduce_scatter);
  }
  return costs;
}

std::string CostModelText(const CostModel& costs) {
  std::string text;
  char line[128];
  auto add = [&](const char* name, double value) {
    std::snprintf(line, sizeof(line), "%s %.9g\n", name, value);
    text += line;
  };
  auto add_linear = [&](const std::string& name, const LinearCost& cost) {
    add((name + ".latency_seconds").c_str(), cost.latency_seconds);
    add((name + ".bandwidth_bytes_per_second").c_str(), cost.bandwidth_bytes_per_second);
  };
  for (size_t op = 0; op < costs.op_seconds.size(); ++op) {
    add(("op_seconds." + std::to_string(op)).c_str(), costs.op_seconds[op]);
  }
  add("flops_per_second", costs.flops_per_second);
  add_linear("all_gather", costs.all_gather);
  add_linear("reduce_scatter", costs.reduce_scatter);
  add_linear("host_to_device", costs.host_to_device);
  add_linear("device_to_host", costs.device_to_host);
  add("host_optimizer_elements_per_second", costs.host_optimizer_elements_per_second);
  add("release_seconds", costs.release_seconds);
  add("serial_streams", costs.serial_streams ? 1 : 0);
  add("overlap_compute_slowdown", costs.overlap_compute_slowdown);
  // Only where it slows something: the digests of profiles without it stay as they were.
  if (costs.overlap_collective_slowdown != 1) {
    add("overlap_collective_slowdown", costs.overlap_collective_slowdown);
  }
  if (costs.collective_compute_seconds != 0) {
    add("collective_compute_seconds", costs.collective_compute_seconds);
  }
  if (costs.collective_skew_fraction != 0) {
    add("collective_skew_fraction", costs.collective_skew_fraction);
    add("collective_skew_max_seconds", costs.collective_skew_max_seconds);
  }
  return text;
}

}  // namespace dc
