#include "analyzer/calibration.h"

#include <algorithm>
#include <cstdio>
#include <memory>
#include <optional>
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

namespace {

// The groups every trace adds to, and what decides their keys.
struct TraceFits {
  FitGroup ops, host_adam, coll, link, skew, concurrency, step;
  std::vector<SkewSample> skews;                // every trace's
  int compute_pairs = 0, collective_pairs = 0;  // the concurrency group's, by constant
  bool bf16 = false;
  std::set<int64_t> coll_sizes, link_sizes;
  std::set<int> coll_ranks;   // world sizes of traces with collectives, on one node
  std::set<OpKind> op_kinds;  // the kinds of the ops measured
  bool inter = false, one_rank = false, overlap = false;
  // The largest collective_compute_seconds a trace's own profile fitted (analyzer/profile.h):
  // where the step fit of that constant starts.
  double collective_compute_seconds = 0;
};

void AddInput(FitGroup* group, const std::string& path) {
  group->input += (group->input.empty() ? "" : ", ") + path;
}

Status AddTrace(const Trace& trace, TraceFits* fits) {
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
  // The traced host's cores where recorded, else the profile's: every prediction below is at
  // that host's HostShareSlowdown, so the rates fitted are a rank's on a core of its own,
  // whatever the trace's ranks per core. (The fits call these for every candidate profile:
  // the whole-step one copies the profile, the per-sample ones do not.)
  const int host_cores = TraceHostCores(trace);
  auto slowdown = [host_cores, cluster](const HardwareProfile& hw) {
    return HostShareSlowdown(host_cores > 0 ? host_cores : hw.host_cores_per_node, cluster);
  };
  auto at_host = [host_cores](HardwareProfile hw) {
    if (host_cores > 0) hw.host_cores_per_node = host_cores;
    return hw;
  };
  const std::string& path = trace.path();
  fits->bf16 = fits->bf16 || program->config().compute_dtype() != proto::DTYPE_F32;

  // Ops: every measured op but the host optimizer's (its own rate, below).
  std::set<int> host_ops;
  for (const proto::Instruction& in : schedule->instructions()) {
    if (in.kind() == proto::INSTR_COMPUTE && in.stream() == proto::STREAM_HOST) {
      host_ops.insert(in.op());
    }
  }
  const size_t ops_before = fits->ops.observations.size();
  for (int id = 0; id < program->ops_size(); ++id) {
    if (samples.op_seconds[id].empty() || host_ops.count(id)) continue;
    Observation o;
    o.what = path + ": op " + program->ops(id).name() + " (" + program->ops(id).kind() + ")";
    o.measured_seconds = Median(samples.op_seconds[id]);
    if (o.measured_seconds <= 0) continue;
    o.predict = [program, id, world, slowdown](const HardwareProfile& hw) {
      return EstimateOp(*program, program->ops(id), hw, world).seconds * slowdown(hw);
    };
    fits->ops.observations.push_back(std::move(o));
    if (const std::optional<OpKind> kind = FindOpKind(program->ops(id).kind())) {
      fits->op_kinds.insert(*kind);
    }
  }
  if (fits->ops.observations.size() > ops_before) AddInput(&fits->ops, path);

  // Host optimizer: elements of the rank's shards over the time.
  const size_t adam_before = fits->host_adam.observations.size();
  for (const proto::Instruction& in : schedule->instructions()) {
    if (in.kind() != proto::INSTR_COMPUTE || in.stream() != proto::STREAM_HOST) continue;
    if (in.op() < 0 || in.op() >= program->ops_size() || samples.op_seconds[in.op()].empty()) {
      continue;
    }
    const int64_t elements = HostOptimizerElements(*program, world, in);
    if (elements <= 0) continue;
    Observation o;
    o.what = path + ": host optimizer " + program->ops(in.op()).name();
    o.measured_seconds = Median(samples.op_seconds[in.op()]);
    o.predict = [elements](const HardwareProfile& hw) {
      return hw.host_optimizer_elements_per_s > 0 ? elements / hw.host_optimizer_elements_per_s
                                                  : 0.0;
    };
    fits->host_adam.observations.push_back(std::move(o));
  }
  if (fits->host_adam.observations.size() > adam_before) AddInput(&fits->host_adam, path);

  // Collectives over the trace's ranks.
  if (world < 2) {
    fits->one_rank = true;
  } else {
    const size_t before = fits->coll.observations.size();
    auto ring = [cluster, slowdown](const HardwareProfile& hw) {
      return Slowed(RingCollectiveCost(hw, cluster), slowdown(hw));
    };
    AddTransfers("all_gather", samples.all_gather, ring, &fits->coll, &fits->coll_sizes);
    AddTransfers("reduce_scatter", samples.reduce_scatter, ring, &fits->coll, &fits->coll_sizes);
    if (fits->coll.observations.size() > before) {
      AddInput(&fits->coll, path);
      if (nodes > 1) {
        fits->inter = true;
      } else {
        fits->coll_ranks.insert(world);
      }
    }
  }

  // The overlap slowdowns, as the profile of the trace measures them: each op's median beside
  // collectives against its median alone, each collective beside compute against its line.
  const size_t concurrency_before = fits->concurrency.observations.size();
  auto add_pairs = [&](const std::vector<BesidePair>& pairs, const char* what,
                       double HardwareProfile::*slowdown, int* count) {
    for (const BesidePair& p : pairs) {
      if (!(p.alone_seconds > 0) || !(p.beside_seconds > 0)) continue;
      Observation o;
      o.what = path + ": " + what + " (" + std::to_string(p.alone_seconds) + " s alone)";
      o.measured_seconds = p.beside_seconds;
      o.predict = [alone = p.alone_seconds, slowdown](const HardwareProfile& hw) {
        return alone * (hw.*slowdown);
      };
      fits->concurrency.observations.push_back(std::move(o));
      ++*count;
    }
  };
  add_pairs(samples.compute_beside, "an op beside collectives",
            &HardwareProfile::overlap_compute_slowdown, &fits->compute_pairs);
  add_pairs(samples.collectives_beside, "a collective beside compute",
            &HardwareProfile::overlap_collective_slowdown, &fits->collective_pairs);
  if (fits->concurrency.observations.size() > concurrency_before) {
    AddInput(&fits->concurrency, path);
  }

  // The ranks' skew at collectives (traces of 2 or more ranks on one host).
  if (!samples.collective_skews.empty()) {
    fits->skews.insert(fits->skews.end(), samples.collective_skews.begin(),
                       samples.collective_skews.end());
    AddInput(&fits->skew, path);
  }

  // Host link: offloads and reloads.
  const size_t link_before = fits->link.observations.size();
  auto host = [slowdown](const HardwareProfile& hw) {
    return Slowed({hw.host_link_latency_s, hw.host_link_bandwidth_bytes_per_s}, slowdown(hw));
  };
  AddTransfers("reload", samples.host_to_device, host, &fits->link, &fits->link_sizes);
  AddTransfers("offload", samples.device_to_host, host, &fits->link, &fits->link_sizes);
  if (fits->link.observations.size() > link_before) AddInput(&fits->link, path);

  // The whole step.
  if (profile.step_seconds_median > 0) {
    Observation o;
    o.what = path + ": median step of " + Plural(schedule->instructions_size(), "instruction");
    o.measured_seconds = profile.step_seconds_median;
    o.predict = [program, schedule, cluster, at_host](const HardwareProfile& hw) {
      SimOptions options;
      options.memory_timeline = false;
      const StatusOr<SimResult> sim =
          Simulate(*schedule, EstimateCostModel(*program, at_host(hw), cluster), options);
      return sim.ok() ? sim->step_seconds : -1.0;
    };
    fits->step.observations.push_back(std::move(o));
    AddInput(&fits->step, path);
    for (const StepOverlap& s : profile.overlap)
      fits->overlap = fits->overlap || s.overlap_seconds > 0;
    fits->collective_compute_seconds =
        std::max(fits->collective_compute_seconds, profile.costs.collective_compute_seconds);
  }
  return Status::Ok();
}

}  // namespace

StatusOr<std::vector<FitGroup>> TraceGroups(const std::vector<const Trace*>& traces,
                                            const HardwareProfile& base) {
  TraceFits fits;
  fits.ops.kind = "trace ops";
  fits.host_adam.kind = "trace host optimizer";
  fits.coll.kind = "trace collectives";
  fits.link.kind = "trace host link";
  fits.skew.kind = "trace skew";
  fits.concurrency.kind = "trace concurrency";
  fits.step.kind = "trace step";
  for (FitGroup* g : {&fits.host_adam, &fits.coll, &fits.link, &fits.skew, &fits.concurrency}) {
    g->error = FitGroup::Error::kAbsolute;
  }
  for (const Trace* trace : traces) DC_RETURN_IF_ERROR(AddTrace(*trace, &fits));
  std::vector<FitGroup> groups;

  if (!fits.ops.observations.empty()) {
    std::vector<std::string> peaks = {"peak_fp32_flops_per_s"};
    if (fits.bf16) peaks.push_back("peak_bf16_flops_per_s");
    fits.ops.keys = EfficiencyOrRateKeys(base, "matmul_efficiency", peaks);
    for (const std::string& k :
         EfficiencyOrRateKeys(base, "memory_efficiency", {"memory_bandwidth_bytes_per_s"})) {
      fits.ops.keys.push_back(k);
    }
    fits.ops.keys.push_back("kernel_launch_seconds");
    // Then each kind's factor on that roofline, from the same ops: the rates above are what all
    // kinds share, the factors what sets a kind's kernels apart (a fused attention, a loop that
    // does not vectorise).
    FitGroup by_kind;
    by_kind.kind = "trace ops by kind";
    by_kind.input = fits.ops.input;
    by_kind.observations = fits.ops.observations;
    for (OpKind kind : fits.op_kinds) by_kind.keys.push_back(OpTimeScaleKey(kind));
    groups.push_back(std::move(fits.ops));
    groups.push_back(std::move(by_kind));
  }
  if (!fits.host_adam.observations.empty() && base.host_optimizer_elements_per_s > 0) {
    fits.host_adam.keys = {"host_optimizer_elements_per_s"};
    groups.push_back(std::move(fits.host_adam));
  }

  FitGroup& coll = fits.coll;
  if (coll.observations.empty()) {
    if (fits.one_rank) {
      coll.input = traces.empty() ? "" : traces.front()->path();
      coll.undetermined.push_back(
          "intra_node_bus_bandwidth_bytes_per_s, collective_base_latency_s: one rank: its "
          "collectives are local copies");
      groups.push_back(std::move(coll));
    }
  } else {
    if (!fits.coll_ranks.empty()) coll.keys.push_back("intra_node_bus_bandwidth_bytes_per_s");
    if (fits.inter) coll.keys.push_back("inter_node_bandwidth_per_gpu_bytes_per_s");
    if (fits.coll_sizes.size() >= 2) {
      coll.keys.push_back("collective_base_latency_s");
      if (fits.coll_ranks.size() >= 2) {
        coll.keys.push_back("intra_node_step_latency_s");
      } else if (!fits.coll_ranks.empty()) {
        coll.undetermined.push_back(
            "intra_node_step_latency_s: one rank count: the base latency takes the whole (trace "
            "two world sizes to tell them apart)");
      }
      if (fits.inter) coll.keys.push_back("inter_node_step_latency_s");
    } else {
      coll.undetermined.push_back(
          "collective_base_latency_s: one message size: latency and bandwidth cannot both be "
          "fitted");
    }
    groups.push_back(std::move(coll));
  }

  FitGroup& link = fits.link;
  if (!link.observations.empty()) {
    link.keys.push_back("host_link_bandwidth_bytes_per_s");
    if (fits.link_sizes.size() >= 2 && base.host_link_latency_s > 0) {
      link.keys.push_back("host_link_latency_s");
    } else {
      link.undetermined.push_back(
          "host_link_latency_s: one copy size: latency and bandwidth cannot both be fitted");
    }
    groups.push_back(std::move(link));
  }

  // The skew: the collectives in groups of similar gaps since their stream's previous one, each
  // group's waits against the fraction of its gaps (least squares of seconds: the waits add up
  // to what the steps lost), searched from the ratio of all waits to all gaps.
  if (!fits.skews.empty()) {
    FitGroup& skew = fits.skew;
    std::vector<SkewSample> sorted = fits.skews;
    std::sort(sorted.begin(), sorted.end(), [](const SkewSample& a, const SkewSample& b) {
      return a.gap_seconds < b.gap_seconds;
    });
    constexpr size_t kGroups = 8;
    const size_t count = std::min(kGroups, sorted.size());
    double gaps = 0, waits = 0;
    for (size_t g = 0; g < count; ++g) {
      const size_t begin = g * sorted.size() / count, end = (g + 1) * sorted.size() / count;
      double gap = 0, wait = 0;
      for (size_t i = begin; i < end; ++i) {
        gap += sorted[i].gap_seconds;
        wait += sorted[i].wait_seconds;
      }
      gaps += gap;
      waits += wait;
      if (!(wait > 0)) continue;
      Observation o;
      char what[160];
      std::snprintf(what, sizeof(what),
                    "%zu collectives %.3g-%.3g ms after their stream's previous: the last rank's "
                    "waits",
                    end - begin, 1e3 * sorted[begin].gap_seconds,
                    1e3 * sorted[end - 1].gap_seconds);
      o.what = what;
      o.measured_seconds = wait;
      // Each collective's wait as the simulator prices it (CostModel::SkewWaitSeconds).
      std::vector<double> each;
      each.reserve(end - begin);
      for (size_t i = begin; i < end; ++i) each.push_back(sorted[i].gap_seconds);
      o.predict = [each = std::move(each)](const HardwareProfile& hw) {
        CostModel costs;
        ApplyConcurrency(hw, &costs);
        double total = 0;
        for (double g : each) total += costs.SkewWaitSeconds(g);
        return total;
      };
      skew.observations.push_back(std::move(o));
    }
    if (waits > 0 && gaps > 0 && !skew.observations.empty()) {
      skew.keys.push_back("collective_skew_fraction");
      skew.start_values["collective_skew_fraction"] = waits / gaps;
      // The ceiling where the longest gaps wait less than their share (they wait no longer
      // than the others: the ranks met elsewhere), from the longest gaps' mean wait.
      const size_t top = sorted.size() - std::max<size_t>(1, sorted.size() / count);
      double top_wait = 0;
      for (size_t i = top; i < sorted.size(); ++i) top_wait += sorted[i].wait_seconds;
      top_wait /= static_cast<double>(sorted.size() - top);
      if (count >= 3 && top_wait > 0) {
        skew.keys.push_back("collective_skew_max_seconds");
        skew.start_values["collective_skew_max_seconds"] = top_wait;
      } else {
        skew.undetermined.push_back(
            "collective_skew_max_seconds: too few collectives to tell a ceiling (3 groups of "
            "gaps at least)");
      }
      groups.push_back(std::move(skew));
    }
  }

  // Measured where enough work ran both alone and beside (the profile's own thresholds,
  // ConcurrencyFitOptions, over every trace together).
  const ConcurrencyFitOptions thresholds;
  const bool compute_measured = !base.serial_streams && fits.compute_pairs >= thresholds.min_ops;
  FitGroup& concurrency = fits.concurrency;
  if (!base.serial_streams && !concurrency.observations.empty()) {
    if (compute_measured) {
      concurrency.keys.push_back("overlap_compute_slowdown");
    } else if (fits.compute_pairs > 0) {
      concurrency.undetermined.push_back(
          "overlap_compute_slowdown: " + Plural(fits.compute_pairs, "op") +
          " ran both alone and beside a collective (at least " +
          std::to_string(thresholds.min_ops) + " tell it)");
    }
    if (fits.collective_pairs >= thresholds.min_collectives) {
      concurrency.keys.push_back("overlap_collective_slowdown");
    } else if (fits.collective_pairs > 0) {
      concurrency.undetermined.push_back(
          "overlap_collective_slowdown: " + Plural(fits.collective_pairs, "collective") +
          " ran beside compute (at least " + std::to_string(thresholds.min_collectives) +
          " tell it)");
    }
    if (!concurrency.keys.empty()) {
      groups.push_back(std::move(concurrency));
    } else {
      concurrency.observations.clear();
      if (!concurrency.undetermined.empty()) groups.push_back(std::move(concurrency));
    }
  }

  FitGroup& step = fits.step;
  if (!step.observations.empty()) {
    // The whole step fits the compute slowdown only where no op measured it: a step's
    // unexplained seconds are not all overlap (tiny on 2 ranks: ops ran beside collectives at
    // their speed alone, and a fit to the steps took 62x).
    if (base.serial_streams) {
      step.undetermined.push_back(
          "overlap_compute_slowdown: the backend runs one instruction at a time");
    } else if (!fits.overlap) {
      step.undetermined.push_back(
          "overlap_compute_slowdown: no compute beside a collective in the trace");
    } else if (compute_measured) {
      step.undetermined.push_back(
          "overlap_compute_slowdown: measured op by op (trace concurrency), not fitted to the "
          "steps");
    } else {
      step.keys.push_back("overlap_compute_slowdown");
    }
    // What the communication threads take from the compute thread's core between ops: only
    // whole steps show it (no op's time holds it), from a trace whose own schedule needed it.
    if (!base.serial_streams && fits.collective_compute_seconds > 0) {
      step.keys.push_back("collective_compute_seconds");
      step.start_values["collective_compute_seconds"] = fits.collective_compute_seconds;
    } else if (!base.serial_streams) {
      step.undetermined.push_back(
          "collective_compute_seconds: no trace of 2 or more ranks whose measured op and "
          "collective times fall short of its steps");
    }
    groups.push_back(std::move(step));
  }
  return groups;
}

int TraceHostCores(const Trace& trace) {
  int cores = 0;
  for (const TraceRank& r : trace.ranks()) cores = std::max(cores, r.host_cores);
  return cores;
}

}  // namespace dc
