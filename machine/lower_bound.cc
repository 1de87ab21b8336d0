#include "machine/lower_bound.h"

#include <algorithm>
#include <limits>
#include <utility>
#include <vector>

namespace dc {
namespace {

// One optimizer op's cost on the compute stream and on the host.
struct OptimizerCost {
  double device_seconds = 0;
  double host_seconds = 0;
};

// The smallest max(device, host) over fractional splits of the optimizer ops, where the compute
// stream has `device_start` seconds of work before any of them and the host is idle until
// `host_start`: the ops that save the most device time per host second move first.
double BalancedOptimizer(double device_start, double host_start, std::vector<OptimizerCost> ops) {
  double device = device_start, host = host_start;
  for (const OptimizerCost& op : ops) device += op.device_seconds;
  // Highest device / host first; ops free on the host lead.
  std::stable_sort(ops.begin(), ops.end(), [](const OptimizerCost& a, const OptimizerCost& b) {
    return a.device_seconds * b.host_seconds > b.device_seconds * a.host_seconds;
  });
  for (const OptimizerCost& op : ops) {
    if (device <= host) break;
    if (device - op.device_seconds >= host + op.host_seconds) {
      device -= op.device_seconds;
      host += op.host_seconds;
      continue;
    }
    // Split this op where both sides meet.
    const double share = (device - host) / (op.device_seconds + op.host_seconds);
    device -= share * op.device_seconds;
    host = device;
    break;
  }
  return std::max(device, host);
}

}  // namespace

StepBound StepLowerBound(const proto::Program& program, int world_size, const CostModel& costs) {
  const int world = std::max(1, world_size);
  const double gas = static_cast<double>(std::max<int64_t>(1, program.config().gas()));
  const int tensors = program.tensors_size();

  std::vector<bool> produced(tensors, false), read_by_mandatory(tensors, false);
  for (const proto::Op& op : program.ops()) {
    for (int t : op.outputs()) {
      if (t >= 0 && t < tensors) produced[t] = true;
    }
  }
  auto role = [&](int t) {
    return t >= 0 && t < tensors ? program.tensors(t).role() : proto::ROLE_UNSPECIFIED;
  };
  auto bytes = [&](int t) {
    return t >= 0 && t < tensors ? TransientBytes(program, program.tensors(t)) : int64_t{0};
  };

  double micro_step_compute = 0;  // one micro-step's mandatory forward and backward compute
  double first_gather = std::numeric_limits<double>::infinity();
  std::vector<bool> gathered(tensors, false);
  std::vector<int> grads;  // produced by forward and backward ops
  std::vector<OptimizerCost> optimizer;
  std::vector<double> optimizer_of_grad(tensors, 0);  // cheapest optimizer step reading it
  // The grads' squared norm (clipping): on the device after every reduce-scatter, then its
  // all-reduce, before any optimizer step.
  double norm_seconds = 0;
  for (int id = 0; id < program.ops_size(); ++id) {
    const proto::Op& op = program.ops(id);
    if (IsShardReduction(program, op)) {
      int64_t reduced_bytes = 0;
      for (int t : op.outputs()) reduced_bytes += bytes(t);
      norm_seconds += costs.OpSeconds(program, id) + costs.AllReduceSeconds(reduced_bytes);
      continue;
    }
    if (op.phase() == proto::PHASE_OPTIMIZER) {
      proto::Instruction on_host;
      on_host.set_kind(proto::INSTR_COMPUTE);
      on_host.set_stream(proto::STREAM_HOST);
      on_host.set_op(id);
      const OptimizerCost cost{costs.OpSeconds(program, id),
                               costs.InstructionSeconds(program, world, on_host)};
      optimizer.push_back(cost);
      for (int t : op.inputs()) {
        if (role(t) == proto::ROLE_GRAD) {
          optimizer_of_grad[t] = std::min(cost.device_seconds, cost.host_seconds);
        }
      }
      continue;
    }
    // A recompute may be a rename of the forward's output instead (keep-activations): free.
    if (!op.has_recompute_of()) {
      micro_step_compute += costs.OpSeconds(program, id);
      for (int t : op.inputs()) {
        if (t >= 0 && t < tensors) read_by_mandatory[t] = true;
      }
    }
    int64_t param_bytes = 0;
    bool reads_produced = false;
    for (int t : op.inputs()) {
      if (role(t) == proto::ROLE_PARAM) {
        param_bytes += bytes(t);
        gathered[t] = true;
      } else if (t >= 0 && t < tensors && produced[t]) {
        reads_produced = true;
      }
    }
    // An op that reads only inputs and params can be the first compute: it waits for the
    // gather of its params (if it has any).
    if (!reads_produced) {
      first_gather =
          std::min(first_gather, param_bytes > 0 ? costs.all_gather.Seconds(param_bytes) : 0.0);
    }
    for (int t : op.outputs()) {
      if (role(t) == proto::ROLE_GRAD) grads.push_back(t);
    }
  }
  if (!(first_gather < std::numeric_limits<double>::infinity())) first_gather = 0;
  const double compute = gas * micro_step_compute;

  // Collectives: every param once in one bucket; every grad once per micro-step, one
  // reduce-scatter per micro-step at least.
  int64_t gather_bytes = 0, grad_bytes = 0;
  for (int t = 0; t < tensors; ++t) {
    if (gathered[t]) gather_bytes += bytes(t);
  }
  std::sort(grads.begin(), grads.end());
  grads.erase(std::unique(grads.begin(), grads.end()), grads.end());
  for (int t : grads) grad_bytes += bytes(t);
  const double gathers = gather_bytes > 0 ? costs.all_gather.Seconds(gather_bytes) : 0;
  const double reductions = grad_bytes > 0 ? gas * costs.reduce_scatter.Seconds(grad_bytes) : 0;
  auto transfer = [](const LinearCost& cost, double moved_bytes) {
    return cost.bandwidth_bytes_per_second > 0 ? moved_bytes / cost.bandwidth_bytes_per_second
                                               : 0.0;
  };
  double links = 0;
  if (gather_bytes > 0 && grad_bytes > 0) {
    // Both share the links (processor sharing): their transfers add up, after the first
    // collective's latency, during which nothing transfers.
    links = std::min(costs.all_gather.latency_seconds, costs.reduce_scatter.latency_seconds) +
            transfer(costs.all_gather, static_cast<double>(gather_bytes)) +
            transfer(costs.reduce_scatter, gas * static_cast<double>(grad_bytes));
  }
  const double communication = std::max({gathers, reductions, links});

  // After the last forward or backward op ends, the reduce-scatter of a grad it wrote (and, in a
  // step of one micro-step, that grad's optimizer step). Only where every such op writes a grad
  // or feeds another: else the last one may be neither, and nothing need follow it.
  double tail = std::numeric_limits<double>::infinity();
  bool every_op_leads_to_a_grad = true;
  for (const proto::Op& op : program.ops()) {
    if (op.phase() == proto::PHASE_OPTIMIZER || op.has_recompute_of()) continue;
    bool leads = false;
    for (int t : op.outputs()) {
      leads =
          leads || role(t) == proto::ROLE_GRAD || (t >= 0 && t < tensors && read_by_mandatory[t]);
    }
    every_op_leads_to_a_grad = every_op_leads_to_a_grad && leads;
  }
  for (int t : grads) {
    tail = std::min(
        tail, costs.reduce_scatter.Seconds(bytes(t)) + (gas == 1 ? optimizer_of_grad[t] : 0.0));
  }
  if (!every_op_leads_to_a_grad || !(tail < std::numeric_limits<double>::infinity())) tail = 0;

  StepBound bound;
  bound.compute_seconds = first_gather + compute + tail + norm_seconds;
  // The host's optimizer steps need grads, which need the first compute.
  bound.compute_host_seconds =
      BalancedOptimizer(first_gather + compute + norm_seconds, first_gather, optimizer);
  bound.communication_seconds = communication;
  // Compute c_o that overlaps collectives takes s * c_o; the collectives' time K not under
  // running compute is at least K - s * c_o. The step is at least the larger of the two ways the
  // smallest total falls: max(K, C + (1 - 1/s) * min(K, s * C)).
  const double slowdown = std::max(1.0, costs.overlap_compute_slowdown);
  bound.overlap_seconds = std::max(
      communication, compute + (1 - 1 / slowdown) * std::min(communication, slowdown * compute));
  if (costs.serial_streams) {
    double optimizer_seconds = 0;
    for (const OptimizerCost& op : optimizer) {
      optimizer_seconds += std::min(op.device_seconds, op.host_seconds);
    }
    bound.serial_seconds = compute + optimizer_seconds + norm_seconds + gathers + reductions;
  }
  const std::pair<double, const char*> terms[] = {
      {bound.compute_seconds, "compute"},
      {bound.compute_host_seconds, "compute and optimizer"},
      {bound.communication_seconds, "communication"},
      {bound.overlap_seconds, "communication under the overlap slowdown"},
      {bound.serial_seconds, "serial streams"},
  };
  for (const auto& [seconds, name] : terms) {
    if (seconds > bound.seconds) {
      bound.seconds = seconds;
      bound.binding = name;
    }
  }
  return bound;
}

double HostOptimizerSeconds(const proto::Program& program, int world_size, const CostModel& costs) {
  double seconds = 0;
  for (int id = 0; id < program.ops_size(); ++id) {
    // Only the in-place steps go to the host; the grads' norm stays on the device.
    if (!IsOptimizerStep(program, program.ops(id))) continue;
    proto::Instruction on_host;
    on_host.set_kind(proto::INSTR_COMPUTE);
    on_host.set_stream(proto::STREAM_HOST);
    on_host.set_op(id);
    seconds += costs.InstructionSeconds(program, std::max(1, world_size), on_host);
  }
  return seconds;
}

double BoundGap(double step_seconds, double bound_seconds) {
  return bound_seconds > 0 ? step_seconds / bound_seconds - 1 : 0;
}

}  // namespace dc
