#include "rewriter/memory_plan.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <set>
#include <tuple>

#include "machine/estimate.h"
#include "machine/simulator.h"
#include "models/model.h"
#include "rewriter/memory_lifetimes.h"
#include "rewriter/offload.h"
#include "rewriter/planner.h"
#include "rewriter/schedule_text.h"
#include "rewriter/zero3.h"
#include "schemas/happens_before.h"
#include "schemas/plan_file.h"
#include "schemas/units.h"

namespace dc {
namespace {

using Key = std::tuple<int, int, int>;  // (instruction, tensor, micro_step)

proto::Schedule TinyBaseline(int64_t gas) {
  ModelOverrides overrides;
  overrides.gas = gas;
  auto config = MakeConfig("tiny", overrides);
  EXPECT_TRUE(config.ok()) << config.status().message();
  auto program = BuildProgram(*config);
  EXPECT_TRUE(program.ok()) << program.status().message();
  proto::Schedule s;
  s.set_world_size(2);
  *s.mutable_program() = *program;
  Zero3Pass zero3;
  EXPECT_TRUE(zero3.Run(&s, PassContext{}).ok());
  return s;
}

// The tiny baseline with half of its optimizer-state excess offloaded: it has offloaded and
// reloaded shards too.
proto::Schedule TinyWithOffload(int64_t gas, CostModel* costs) {
  proto::Schedule s = TinyBaseline(gas);
  *costs = EstimateCostModel(s.program(), *FindHardware("h100"), ClusterShape{1, 2});
  auto sim = Simulate(s, *costs);
  EXPECT_TRUE(sim.ok());
  const int64_t states =
      PersistentBytesByKind(s.program(), 2)[static_cast<int>(BufferKind::kOptimizerState)];
  const int64_t budget = sim->peak_device_bytes - states / 4;
  OffloadPass offload;
  auto changed = offload.Run(&s, PassContext{costs, budget});
  EXPECT_TRUE(changed.ok()) << changed.status().message();
  s.set_budget_bytes(budget);
  return s;
}

std::map<Key, BufferLifetime> LifetimesByKey(const proto::Schedule& s) {
  auto lifetimes = BufferLifetimes(s);
  EXPECT_TRUE(lifetimes.ok()) << lifetimes.status().message();
  std::map<Key, BufferLifetime> by_key;
  for (const BufferLifetime& b : *lifetimes) {
    EXPECT_TRUE(by_key.emplace(Key{b.instruction, b.tensor, b.micro_step}, b).second);
  }
  return by_key;
}

// Every pair of placements: no two share an address while both are alive.
void ExpectNoConflicts(const proto::Schedule& s, const proto::MemoryPlan& plan,
                       int64_t alignment_bytes) {
  const std::map<Key, BufferLifetime> lifetimes = LifetimesByKey(s);
  ASSERT_EQ(static_cast<size_t>(plan.placements_size()), lifetimes.size());
  std::vector<BufferLifetime> life;
  for (const auto& p : plan.placements()) {
    auto it = lifetimes.find(Key{p.instruction(), p.tensor(), p.micro_step()});
    ASSERT_NE(it, lifetimes.end());
    EXPECT_EQ(p.size_bytes(), it->second.size_bytes);
    EXPECT_EQ(p.offset_bytes() % alignment_bytes, 0);
    EXPECT_LE(p.offset_bytes() + p.size_bytes(), plan.arena_bytes());
    life.push_back(it->second);
  }
  for (int i = 0; i < plan.placements_size(); ++i) {
    const auto& a = plan.placements(i);
    for (int j = i + 1; j < plan.placements_size(); ++j) {
      const auto& b = plan.placements(j);
      const bool in_time =
          !(life[i].free_index < life[j].alloc_index || life[j].free_index < life[i].alloc_index);
      const bool in_space = a.offset_bytes() < b.offset_bytes() + b.size_bytes() &&
                            b.offset_bytes() < a.offset_bytes() + a.size_bytes();
      ASSERT_FALSE(in_time && in_space)
          << "placements " << i << " and " << j << " (tensors "
          << s.program().tensors(a.tensor()).name() << ", "
          << s.program().tensors(b.tensor()).name() << ") share bytes while both are alive";
    }
  }
}

// Best-fit decreasing the slow way (all pairs), for checking the fast one.
std::map<Key, int64_t> ReferenceOffsets(const proto::Schedule& s, int64_t alignment_bytes) {
  auto lifetimes = BufferLifetimes(s);
  EXPECT_TRUE(lifetimes.ok());
  const std::vector<BufferLifetime>& buffers = *lifetimes;
  const int n = s.instructions_size();
  auto reserve = [&](int b) {
    return (buffers[b].size_bytes + alignment_bytes - 1) / alignment_bytes * alignment_bytes;
  };
  auto key = [&](int b) {
    return Key{buffers[b].instruction, buffers[b].tensor, buffers[b].micro_step};
  };
  std::vector<int> stacked, rest;
  for (int b = 0; b < static_cast<int>(buffers.size()); ++b) {
    (buffers[b].alloc_index < 0 && buffers[b].free_index >= n ? stacked : rest).push_back(b);
  }
  std::sort(stacked.begin(), stacked.end(), [&](int a, int b) {
    return reserve(a) != reserve(b) ? reserve(a) > reserve(b) : key(a) < key(b);
  });
  std::sort(rest.begin(), rest.end(), [&](int a, int b) {
    if (reserve(a) != reserve(b)) return reserve(a) > reserve(b);
    if (buffers[a].alloc_index != buffers[b].alloc_index) {
      return buffers[a].alloc_index < buffers[b].alloc_index;
    }
    return key(a) < key(b);
  });
  std::map<Key, int64_t> offsets;
  int64_t base = 0;
  for (int b : stacked) {
    offsets[key(b)] = base;
    base += reserve(b);
  }
  std::vector<int> placed;
  for (int b : rest) {
    if (reserve(b) == 0) {
      offsets[key(b)] = base;
      continue;
    }
    std::vector<std::pair<int64_t, int64_t>> taken;
    for (int o : placed) {
      if (buffers[o].free_index < buffers[b].alloc_index ||
          buffers[b].free_index < buffers[o].alloc_index) {
        continue;
      }
      taken.emplace_back(offsets[key(o)], offsets[key(o)] + reserve(o));
    }
    std::sort(taken.begin(), taken.end());
    int64_t cursor = base, best = -1, best_gap = std::numeric_limits<int64_t>::max();
    for (const auto& [start, end] : taken) {
      if (start - cursor >= reserve(b) && start - cursor < best_gap) {
        best_gap = start - cursor;
        best = cursor;
      }
      cursor = std::max(cursor, end);
    }
    offsets[key(b)] = best >= 0 ? best : cursor;
    placed.push_back(b);
  }
  return offsets;
}

TEST(MemoryPlan, NoTwoLiveBuffersShareBytes) {
  CostModel costs;
  for (int64_t gas : {1, 2}) {
    SCOPED_TRACE("gas " + std::to_string(gas));
    for (const proto::Schedule& s : {TinyBaseline(gas), TinyWithOffload(gas, &costs)}) {
      MemoryPlanStats stats;
      auto plan = PlanMemory(s, MemoryPlanOptions{}, 0, nullptr, &stats);
      ASSERT_TRUE(plan.ok()) << plan.status().message();
      ExpectNoConflicts(s, *plan, MemoryPlanOptions{}.alignment_bytes);
      EXPECT_EQ(plan->arena_bytes(), stats.arena_bytes);
      EXPECT_GE(stats.arena_bytes, stats.live_peak_bytes);
    }
  }
}

MemoryPlanOptions InInstructionOrder() {
  MemoryPlanOptions options;
  options.lifetimes = MemoryPlanOptions::Lifetimes::kInstructionOrder;
  return options;
}

// Size-descending alone: the order the all-pairs reference below follows.
MemoryPlanOptions SizeDescendingInInstructionOrder() {
  MemoryPlanOptions options = InInstructionOrder();
  options.orders = {MemoryPlanOptions::Order::kSizeDescending};
  options.last_orders = {};
  options.compaction_rounds = 0;
  return options;
}

TEST(MemoryPlan, MatchesTheAllPairsBestFitDecreasing) {
  CostModel costs;
  for (const proto::Schedule& s : {TinyBaseline(2), TinyWithOffload(2, &costs)}) {
    auto plan = PlanMemory(s, SizeDescendingInInstructionOrder(), 0, nullptr, nullptr);
    ASSERT_TRUE(plan.ok()) << plan.status().message();
    const std::map<Key, int64_t> reference =
        ReferenceOffsets(s, MemoryPlanOptions{}.alignment_bytes);
    for (const auto& p : plan->placements()) {
      EXPECT_EQ(p.offset_bytes(), reference.at(Key{p.instruction(), p.tensor(), p.micro_step()}))
          << s.program().tensors(p.tensor()).name();
    }
  }
}

// Offsets past 2^32 alignment units do not fit the packer's 32-bit index: it packs again with
// 64-bit offsets, to the same result.
TEST(MemoryPlan, MatchesTheAllPairsBestFitDecreasingPastFourGiUnits) {
  ModelOverrides overrides;
  overrides.hidden = 8192;
  overrides.ffn = 16384;
  auto config = MakeConfig("tiny", overrides);
  ASSERT_TRUE(config.ok()) << config.status().message();
  auto program = BuildProgram(*config);
  ASSERT_TRUE(program.ok()) << program.status().message();
  proto::Schedule s;
  s.set_world_size(1);
  *s.mutable_program() = *program;
  Zero3Pass zero3;
  ASSERT_TRUE(zero3.Run(&s, PassContext{}).ok());
  MemoryPlanOptions options = SizeDescendingInInstructionOrder();
  options.alignment_bytes = 1;
  auto plan = PlanMemory(s, options, 0, nullptr, nullptr);
  ASSERT_TRUE(plan.ok()) << plan.status().message();
  ASSERT_GT(plan->arena_bytes(), int64_t{1} << 32);
  const std::map<Key, int64_t> reference = ReferenceOffsets(s, 1);
  for (const auto& p : plan->placements()) {
    EXPECT_EQ(p.offset_bytes(), reference.at(Key{p.instruction(), p.tensor(), p.micro_step()}))
        << s.program().tensors(p.tensor()).name();
  }
}

TEST(MemoryPlan, ArenaCoversTheSimulatedPeakAndFitsTheBudget) {
  CostModel costs;
  proto::Schedule s = TinyWithOffload(2, &costs);
  // With serial streams the simulator's time order is the instruction order, so its peak is the
  // live peak the arena must hold.
  CostModel serial = costs;
  serial.serial_streams = true;
  auto sim = Simulate(s, serial);
  ASSERT_TRUE(sim.ok()) << sim.status().message();
  MemoryPlanPass pass;
  auto changed = pass.Run(&s, PassContext{&serial, sim->peak_device_bytes + (1 << 20)});
  ASSERT_TRUE(changed.ok()) << changed.status().message();
  EXPECT_TRUE(*changed);
  EXPECT_EQ(pass.stats().live_peak_bytes, sim->peak_device_bytes);
  EXPECT_GE(s.memory_plan().arena_bytes(), sim->peak_device_bytes);
  EXPECT_LE(s.memory_plan().arena_bytes(), sim->peak_device_bytes + (1 << 20));
  EXPECT_NE(pass.Summary().find("arena"), std::string::npos) << pass.Summary();
  // Offloaded shards end at their offload; reloaded ones start at their reload.
  int reloaded = 0;
  for (const auto& p : s.memory_plan().placements()) {
    if (p.instruction() < 0) continue;
    const auto& instr = s.instructions(p.instruction());
    if (instr.kind() == proto::INSTR_RELOAD) {
      ++reloaded;
      EXPECT_EQ(p.micro_step(), -1);
    }
    if (instr.kind() == proto::INSTR_ALL_GATHER) {
      EXPECT_EQ(p.micro_step(), -2);
    }
  }
  EXPECT_GT(reloaded, 0);
  // Running again changes nothing.
  changed = pass.Run(&s, PassContext{&serial, sim->peak_device_bytes + (1 << 20)});
  ASSERT_TRUE(changed.ok());
  EXPECT_FALSE(*changed);
}

// The memory-plan pass goes on from the packings the offload pass's arena check left in the
// memo where they packed the same lifetimes under the same budget, and packs anew otherwise; the
// plan is the same either way, whether the check's packings fit or the pass packs past them.
TEST(MemoryPlan, GoesOnFromTheArenaChecksPackingsOnlyForTheSameLifetimesAndBudget) {
  CostModel costs;
  const proto::Schedule s = TinyWithOffload(2, &costs);
  MemoryPlanStats fitting;
  ASSERT_TRUE(PlanMemory(s, MemoryPlanOptions{}, 0, &costs, &fitting).ok());
  // At the schedule's budget the check's first packing fits; one byte under the best arena
  // the packings without waits find, none does: the pass then spills past them.
  for (const int64_t budget : {s.budget_bytes(), fitting.arena_bytes - 1}) {
    SCOPED_TRACE("budget " + std::to_string(budget));
    auto plan_with = [&](PackingMemo* memo, MemoryPlanPass* pass) {
      proto::Schedule planned = s;
      PassContext context{&costs, budget};
      context.packings = memo;
      const StatusOr<bool> changed = pass->Run(&planned, context);
      EXPECT_TRUE(changed.ok() || changed.status().over_budget()) << changed.status().message();
      return planned;
    };
    MemoryPlanPass reference_pass;
    const proto::Schedule reference = plan_with(nullptr, &reference_pass);
    EXPECT_EQ(reference_pass.Summary().find("arena check"), std::string::npos);

    PackingMemo memo;
    ASSERT_TRUE(
        ArenaBytesWithoutWaits(s, MemoryPlanOptions{}, budget, &costs, nullptr, &memo).ok());
    MemoryPlanPass pass;
    const proto::Schedule resumed = plan_with(&memo, &pass);
    EXPECT_EQ(resumed.SerializeAsString(), reference.SerializeAsString());
    EXPECT_NE(pass.Summary().find("by the offload pass's arena check"), std::string::npos)
        << pass.Summary();
    EXPECT_EQ(pass.stats().orders_tried, reference_pass.stats().orders_tried);

    // A check under another budget, or of other lifetimes, is not gone on from.
    PackingMemo other_budget;
    ASSERT_TRUE(ArenaBytesWithoutWaits(s, MemoryPlanOptions{}, budget + 4096, &costs, nullptr,
                                       &other_budget)
                    .ok());
    CostModel other_costs;
    const proto::Schedule other = TinyWithOffload(3, &other_costs);
    PackingMemo other_lifetimes;
    ASSERT_TRUE(ArenaBytesWithoutWaits(other, MemoryPlanOptions{}, budget, &other_costs, nullptr,
                                       &other_lifetimes)
                    .ok());
    for (PackingMemo* memo : {&other_budget, &other_lifetimes}) {
      MemoryPlanPass fresh;
      EXPECT_EQ(plan_with(memo, &fresh).SerializeAsString(), reference.SerializeAsString());
      EXPECT_EQ(fresh.Summary().find("arena check"), std::string::npos) << fresh.Summary();
    }
  }
}

TEST(MemoryPlan, IsDeterministicAndSorted) {
  const proto::Schedule s = TinyBaseline(2);
  auto a = PlanMemory(s, MemoryPlanOptions{}, 0, nullptr, nullptr);
  auto b = PlanMemory(s, MemoryPlanOptions{}, 0, nullptr, nullptr);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->SerializeAsString(), b->SerializeAsString());
  for (int i = 1; i < a->placements_size(); ++i) {
    const auto& x = a->placements(i - 1);
    const auto& y = a->placements(i);
    EXPECT_LT(Key(x.instruction(), x.tensor(), x.micro_step()),
              Key(y.instruction(), y.tensor(), y.micro_step()));
  }
}

// A schedule of activations only (no params, so no persistent shards), from inline text.
proto::Schedule Handmade(const std::vector<std::pair<std::string, int64_t>>& tensors,
                         const std::vector<std::pair<std::string, std::vector<std::string>>>& ops,
                         const std::string& text) {
  proto::Schedule s;
  s.set_world_size(1);
  proto::Program* program = s.mutable_program();
  std::map<std::string, int> ids;
  for (const auto& [name, bytes] : tensors) {
    proto::Tensor* t = program->add_tensors();
    t->set_id(program->tensors_size() - 1);
    t->set_name(name);
    t->add_shape(bytes / 4);
    t->set_dtype(proto::DTYPE_F32);
    t->set_role(proto::ROLE_ACTIVATION);
    t->set_param(-1);
    ids[name] = t->id();
  }
  for (const auto& [name, outputs] : ops) {
    proto::Op* op = program->add_ops();
    op->set_id(program->ops_size() - 1);
    op->set_name(name);
    op->set_phase(proto::PHASE_FORWARD);
    for (const auto& out : outputs) op->add_outputs(ids.at(out));
  }
  Status parsed = ParseScheduleText(text, &s);
  EXPECT_TRUE(parsed.ok()) << parsed.message();
  return s;
}

std::map<std::string, int64_t> OffsetsByName(const proto::Schedule& s,
                                             const proto::MemoryPlan& plan) {
  std::map<std::string, int64_t> offsets;
  for (const auto& p : plan.placements()) {
    offsets[s.program().tensors(p.tensor()).name()] = p.offset_bytes();
  }
  return offsets;
}

TEST(MemoryPlan, BuffersWithDisjointLifetimesShareOffsetZero) {
  const proto::Schedule s = Handmade({{"x", 4096}, {"y", 8192}, {"z", 2048}},
                                     {{"make_x", {"x"}}, {"make_y", {"y"}}, {"make_z", {"z"}}},
                                     R"(compute compute m0 make_x
                                        release compute m0 [x]
                                        compute compute m0 make_y
                                        release compute m0 [y]
                                        compute compute m0 make_z
                                        release compute m0 [z])");
  auto plan = PlanMemory(s, MemoryPlanOptions{}, 0, nullptr, nullptr);
  ASSERT_TRUE(plan.ok()) << plan.status().message();
  EXPECT_EQ(plan->arena_bytes(), 8192);
  for (const auto& [name, offset] : OffsetsByName(s, *plan)) EXPECT_EQ(offset, 0) << name;
}

// Two holes fit e: best fit takes the 5 KiB one above b, not the 10 KiB one a left at 0.
TEST(MemoryPlan, TakesTheBestFittingGap) {
  const proto::Schedule s =
      Handmade({{"a", 10240}, {"b", 6144}, {"c", 5120}, {"d", 3072}, {"e", 2048}},
               {{"make_abcd", {"a", "b", "c", "d"}}, {"make_e", {"e"}}},
               R"(compute compute m0 make_abcd
                  release compute m0 [a, c]
                  compute compute m0 make_e
                  release compute m0 [e]
                  release compute m0 [b, d])");
  auto plan = PlanMemory(s, MemoryPlanOptions{}, 0, nullptr, nullptr);
  ASSERT_TRUE(plan.ok()) << plan.status().message();
  const auto offsets = OffsetsByName(s, *plan);
  EXPECT_EQ(offsets.at("a"), 0);
  EXPECT_EQ(offsets.at("b"), 10240);
  EXPECT_EQ(offsets.at("c"), 16384);
  EXPECT_EQ(offsets.at("d"), 21504);
  EXPECT_EQ(offsets.at("e"), 16384);
  EXPECT_EQ(plan->arena_bytes(), 24576);  // the live peak: a + b + c + d
}

// b, c and d are all live at the peak (7 KiB, instructions 4-5), so breadth ties them. Taken
// longest-lived first, b goes lowest and c and d stack on it; a, live only before c and d
// are, fits under c beside b: the live peak. Taken largest first (c, then b and d), c sits
// at 0, b above it, and a (4 KiB over instructions 0-2) finds only c's 3 KiB under b: on top,
// 9 KiB. Size-descending packs 8 KiB.
TEST(MemoryPlan, BreadthStacksTheLongestLivedFirstOnItsTies) {
  const proto::Schedule s =
      Handmade({{"a", 4096}, {"b", 2048}, {"c", 3072}, {"d", 2048}},
               {{"make_a", {"a"}}, {"make_b", {"b"}}, {"make_c", {"c"}}, {"make_d", {"d"}}},
               R"(compute compute m0 make_a
                  compute compute m0 make_b
                  release compute m0 [a]
                  compute compute m0 make_c
                  compute compute m0 make_d
                  release compute m0 [b, c, d])");
  auto arena_in = [&](MemoryPlanOptions::Order order) {
    MemoryPlanOptions options;
    options.orders = {order};
    options.repaired_orders = {};
    options.last_orders = {};
    auto plan = PlanMemory(s, options, 0, nullptr, nullptr);
    EXPECT_TRUE(plan.ok()) << plan.status().message();
    return plan.ok() ? plan->arena_bytes() : -1;
  };
  EXPECT_EQ(arena_in(MemoryPlanOptions::Order::kBreadthDescending), 7168);
  EXPECT_EQ(arena_in(MemoryPlanOptions::Order::kBreadthSizeDescending), 9216);
  EXPECT_EQ(arena_in(MemoryPlanOptions::Order::kSizeDescending), 8192);
  MemoryPlanStats stats;
  auto plan = PlanMemory(s, MemoryPlanOptions{}, 0, nullptr, &stats);
  ASSERT_TRUE(plan.ok()) << plan.status().message();
  EXPECT_EQ(plan->arena_bytes(), 7168);
  EXPECT_EQ(stats.live_peak_bytes, 7168);
  EXPECT_EQ(stats.order, "breadth-descending");
  const auto offsets = OffsetsByName(s, *plan);
  EXPECT_EQ(offsets.at("b"), 0);
  EXPECT_EQ(offsets.at("c"), 2048);
  EXPECT_EQ(offsets.at("d"), 5120);
  EXPECT_EQ(offsets.at("a"), 2048);
}

// Best fit in size order leaves a low gap empty that the buffers placed after it never
// needed: f (5 KiB, instructions 1-2) takes the 6 KiB gap above b rather than the 8 KiB one under
// it, and c (3 KiB, 0-4) then finds room only on top, 28 KiB. Placed again lowest first, f comes
// down to 0 and c into the gap above b that f left: 25 KiB, the live peak (b, d, a and e at the
// last instruction).
TEST(MemoryPlan, CompactionTakesTheLowerGapsBestFitLeft) {
  const proto::Schedule s = Handmade(
      {{"a", 8192}, {"b", 6144}, {"c", 3072}, {"d", 5120}, {"e", 6144}, {"f", 5120}},
      {{"make_c", {"c"}}, {"make_dbf", {"d", "b", "f"}}, {"make_a", {"a"}}, {"make_e", {"e"}}},
      R"(compute compute m0 make_c
         compute compute m0 make_dbf
         release compute m0 [f]
         compute compute m0 make_a
         release compute m0 [c]
         compute compute m0 make_e)");
  MemoryPlanOptions options = SizeDescendingInInstructionOrder();
  options.repaired_orders = {};
  auto plan_with = [&](int compaction_rounds, MemoryPlanStats* stats) {
    options.compaction_rounds = compaction_rounds;
    return PlanMemory(s, options, 0, nullptr, stats);
  };
  MemoryPlanStats stats;
  auto best_fit = plan_with(0, &stats);
  ASSERT_TRUE(best_fit.ok()) << best_fit.status().message();
  EXPECT_EQ(best_fit->arena_bytes(), 28 * 1024);
  EXPECT_EQ(stats.order, "size-descending");
  auto compacted = plan_with(1, &stats);
  ASSERT_TRUE(compacted.ok()) << compacted.status().message();
  ExpectNoConflicts(s, *compacted, options.alignment_bytes);
  EXPECT_EQ(compacted->arena_bytes(), 25 * 1024);
  EXPECT_EQ(stats.live_peak_bytes, 25 * 1024);
  EXPECT_EQ(stats.order, "compacted size-descending");
  const auto offsets = OffsetsByName(s, *compacted);
  EXPECT_EQ(offsets.at("f"), 0);
  EXPECT_EQ(offsets.at("c"), 14 * 1024);
  EXPECT_EQ(offsets.at("d"), 20 * 1024);
}

TEST(MemoryPlan, BuffersShareBytesOnlyAfterTheFreeingInstruction) {
  // x is freed by instruction 1 and y allocated by instruction 2: they may share; w lives across
  // both, so it shares with neither.
  const proto::Schedule s = Handmade({{"w", 1024}, {"x", 1024}, {"y", 1024}},
                                     {{"make_wx", {"w", "x"}}, {"make_y", {"y"}}},
                                     R"(compute compute m0 make_wx
                                        release compute m0 [x]
                                        compute compute m0 make_y
                                        release compute m0 [w, y])");
  auto plan = PlanMemory(s, MemoryPlanOptions{}, 0, nullptr, nullptr);
  ASSERT_TRUE(plan.ok());
  const auto offsets = OffsetsByName(s, *plan);
  EXPECT_EQ(offsets.at("x"), offsets.at("y"));
  EXPECT_NE(offsets.at("w"), offsets.at("x"));
  EXPECT_EQ(plan->arena_bytes(), 2048);
}

TEST(MemoryPlan, AlignsOffsets) {
  const proto::Schedule s = Handmade({{"p", 100}, {"q", 100}}, {{"make_pq", {"p", "q"}}},
                                     R"(compute compute m0 make_pq
                                        release compute m0 [p, q])");
  MemoryPlanOptions options;
  options.alignment_bytes = 512;
  auto plan = PlanMemory(s, options, 0, nullptr, nullptr);
  ASSERT_TRUE(plan.ok());
  const auto offsets = OffsetsByName(s, *plan);
  EXPECT_EQ(std::min(offsets.at("p"), offsets.at("q")), 0);
  EXPECT_EQ(std::max(offsets.at("p"), offsets.at("q")), 512);
  EXPECT_EQ(plan->arena_bytes(), 512 + 100);
  options.alignment_bytes = 100;
  EXPECT_FALSE(PlanMemory(s, options, 0, nullptr, nullptr).ok());
}

TEST(MemoryPlan, OverBudgetNamesArenaAndBudgetAfterTryingEveryOrder) {
  proto::Schedule s = TinyBaseline(1);
  const CostModel costs = EstimateCostModel(s.program(), *FindHardware("h100"), ClusterShape{1, 2});
  MemoryPlanStats stats;
  auto plan = PlanMemory(s, InInstructionOrder(), 0, &costs, &stats);
  ASSERT_TRUE(plan.ok());
  const int64_t budget = stats.live_peak_bytes - 1;
  MemoryPlanPass pass;
  auto changed = pass.Run(&s, PassContext{&costs, budget});
  ASSERT_FALSE(changed.ok());
  const std::string message = changed.status().message();
  EXPECT_NE(message.find(FormatBytes(stats.arena_bytes)), std::string::npos) << message;
  EXPECT_NE(message.find(FormatBytes(budget)), std::string::npos) << message;
  EXPECT_NE(message.find("no packing fits"), std::string::npos) << message;
  // Every order over simulated-time lifetimes without waits (and the repaired orders' rounds, the
  // first ones and those over the budget, while they mark buffers and pack tighter), then every
  // order spilling at the budget, two lower spill marks, every order in instruction order.
  const MemoryPlanOptions defaults;
  const int orders = static_cast<int>(defaults.orders.size());
  const int repairs = static_cast<int>(defaults.repaired_orders.size()) *
                      (defaults.repair_rounds + defaults.over_budget_repair_rounds);
  const int over_budget = orders + 2 + orders;
  EXPECT_GE(pass.stats().orders_tried, orders + over_budget);
  EXPECT_LE(pass.stats().orders_tried, orders + repairs + over_budget);
  EXPECT_FALSE(s.has_memory_plan());
}

TEST(MemoryPlan, ReportsAnInconsistentStream) {
  proto::Schedule s = TinyBaseline(1);
  // Release the first released buffer a second time, at the end of the step.
  proto::Instruction twice;
  for (const auto& instr : s.instructions()) {
    if (instr.kind() == proto::INSTR_RELEASE) {
      twice = instr;
      break;
    }
  }
  *s.add_instructions() = twice;
  auto plan = PlanMemory(s, MemoryPlanOptions{}, 0, nullptr, nullptr);
  ASSERT_FALSE(plan.ok());
  // The first release frees a gathered param: the second finds it not gathered (the shared
  // message of schemas/effects.h).
  EXPECT_NE(plan.status().message().find(", which is not gathered"), std::string::npos)
      << plan.status().message();
}

// On asynchronous streams, bytes pass from one buffer to the next only when the old buffer's
// freeing instruction has ended before the new one's allocating instruction starts, and is
// issued before it: the reuse dependencies then cost the simulated step nothing.
TEST(MemoryPlan, SimulatedTimeLifetimesMakeReuseFree) {
  CostModel costs;
  proto::Schedule s = TinyWithOffload(2, &costs);
  ASSERT_FALSE(costs.serial_streams);
  auto before = Simulate(s, costs);
  ASSERT_TRUE(before.ok());
  MemoryPlanPass pass;
  auto changed = pass.Run(&s, PassContext{&costs, 0});
  ASSERT_TRUE(changed.ok()) << changed.status().message();
  EXPECT_EQ(pass.stats().lifetimes, MemoryPlanOptions::Lifetimes::kInstructionAndSimulatedTime);
  EXPECT_GT(pass.reuse_dependencies_added(), 0);
  auto after = Simulate(s, costs);
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->step_seconds, before->step_seconds);
  EXPECT_EQ(after->peak_device_bytes, before->peak_device_bytes);
  // The arena holds every buffer from its allocation's start to its free's end.
  EXPECT_GE(s.memory_plan().arena_bytes(), before->peak_device_bytes);

  const std::map<Key, BufferLifetime> lifetimes = LifetimesByKey(s);
  std::vector<BufferLifetime> life;
  for (const auto& p : s.memory_plan().placements()) {
    life.push_back(lifetimes.at(Key{p.instruction(), p.tensor(), p.micro_step()}));
  }
  const auto& placements = s.memory_plan().placements();
  for (int i = 0; i < placements.size(); ++i) {
    for (int j = 0; j < placements.size(); ++j) {
      const auto& a = placements[i];
      const auto& b = placements[j];
      if (i == j || a.size_bytes() == 0 || b.size_bytes() == 0) continue;
      const bool in_space = a.offset_bytes() < b.offset_bytes() + b.size_bytes() &&
                            b.offset_bytes() < a.offset_bytes() + a.size_bytes();
      if (!in_space || life[i].free_index >= life[j].alloc_index) continue;
      // a's bytes go to b: a's free ends before b's allocation starts.
      ASSERT_LE(after->end_seconds[life[i].free_index], after->start_seconds[life[j].alloc_index])
          << s.program().tensors(a.tensor()).name() << " -> "
          << s.program().tensors(b.tensor()).name();
    }
  }
}

// In the zero3 baseline the gathers run ahead of compute in time, so simulated-time lifetimes
// need more than instruction order. At a budget only instruction order meets, a few buffers
// spill (reuse bytes freed earlier in issue order, waiting for the free); without spills the
// whole plan falls back to instruction order.
TEST(MemoryPlan, SpillsToInstructionOrderOnlyWhereTheBudgetNeedsIt) {
  const proto::Schedule input = TinyBaseline(1);
  const CostModel costs =
      EstimateCostModel(input.program(), *FindHardware("h100"), ClusterShape{1, 2});
  MemoryPlanStats in_order, in_time;
  ASSERT_TRUE(PlanMemory(input, InInstructionOrder(), 0, &costs, &in_order).ok());
  ASSERT_TRUE(PlanMemory(input, MemoryPlanOptions{}, 0, &costs, &in_time).ok());
  ASSERT_LT(in_order.arena_bytes, in_time.arena_bytes);
  const int64_t budget = in_order.arena_bytes;
  auto before = Simulate(input, costs);
  ASSERT_TRUE(before.ok());

  proto::Schedule s = input;
  MemoryPlanPass pass;
  auto changed = pass.Run(&s, PassContext{&costs, budget});
  ASSERT_TRUE(changed.ok()) << changed.status().message();
  EXPECT_EQ(pass.stats().lifetimes, MemoryPlanOptions::Lifetimes::kInstructionAndSimulatedTime);
  EXPECT_GT(pass.stats().spilled_buffers, 0);
  EXPECT_LT(pass.stats().spilled_buffers, pass.stats().buffers / 10);
  EXPECT_LE(s.memory_plan().arena_bytes(), budget);
  EXPECT_GT(pass.reuse_dependencies_added(), 0);
  ExpectNoConflicts(s, s.memory_plan(), MemoryPlanOptions{}.alignment_bytes);

  MemoryPlanOptions no_spill;
  no_spill.spill_to_instruction_order = false;
  proto::Schedule t = input;
  MemoryPlanPass fall_back(no_spill);
  changed = fall_back.Run(&t, PassContext{&costs, budget});
  ASSERT_TRUE(changed.ok()) << changed.status().message();
  EXPECT_EQ(fall_back.stats().lifetimes, MemoryPlanOptions::Lifetimes::kInstructionOrder);
  EXPECT_EQ(t.memory_plan().arena_bytes(), in_order.arena_bytes);
  auto after = Simulate(t, costs);
  ASSERT_TRUE(after.ok());
  EXPECT_GE(after->step_seconds, before->step_seconds);
  // Every dependency points backwards and joins different streams.
  auto deps = ReuseDependencies(t);
  ASSERT_TRUE(deps.ok()) << deps.status().message();
  EXPECT_FALSE(deps->empty());
  for (const auto& [allocating, freeing] : *deps) {
    EXPECT_LT(freeing, allocating);
    EXPECT_NE(t.instructions(freeing).stream(), t.instructions(allocating).stream());
  }
}

// The attempts over the budget packed several at a time (threads > 1) give what packing them one
// by one gives: the same plan, order, spills and count of packings, where a spill fits, where
// only the fall-back to instruction order does, and where nothing does.
// Packings made several at a time (the packings without waits and those over the budget) give
// the plan and stats made one by one, wherever the packings stop: at the fragmentation target,
// at max_packings, after every repair, or over the budget.
TEST(MemoryPlan, PackingsMadeAtOnceGiveTheSamePlan) {
  const proto::Schedule input = TinyBaseline(1);
  const CostModel costs =
      EstimateCostModel(input.program(), *FindHardware("h100"), ClusterShape{1, 2});
  MemoryPlanStats in_order;
  ASSERT_TRUE(PlanMemory(input, InInstructionOrder(), 0, &costs, &in_order).ok());
  MemoryPlanOptions no_spill;
  no_spill.spill_to_instruction_order = false;
  MemoryPlanOptions exact;  // never within the target: every order and repair round
  exact.max_fragmentation = 0;
  MemoryPlanOptions four = exact;
  four.max_packings = 4;
  const struct {
    MemoryPlanOptions options;
    int64_t budget;
    bool over_budget;  // reaches the attempts over the budget
  } cases[] = {{MemoryPlanOptions{}, in_order.arena_bytes, true},
               {no_spill, in_order.arena_bytes, true},
               {MemoryPlanOptions{}, in_order.live_peak_bytes - 1, true},
               {exact, 0, false},
               {four, 0, false}};
  for (const auto& c : cases) {
    MemoryPlanStats one;
    auto by_one = PlanMemory(input, c.options, c.budget, &costs, &one, nullptr, 1);
    ASSERT_TRUE(by_one.ok()) << by_one.status().message();
    if (c.over_budget) {
      EXPECT_GT(one.orders_tried, static_cast<int>(c.options.orders.size())) << c.budget;
    } else if (c.options.max_packings > 0) {
      EXPECT_EQ(one.orders_tried, c.options.max_packings);
    } else {
      EXPECT_GT(one.orders_tried, static_cast<int>(c.options.orders.size()) + 1);
    }
    for (int threads : {2, 3, 4}) {
      SCOPED_TRACE("budget " + std::to_string(c.budget) + ", threads " + std::to_string(threads));
      MemoryPlanStats many;
      auto at_once = PlanMemory(input, c.options, c.budget, &costs, &many, nullptr, threads);
      ASSERT_TRUE(at_once.ok()) << at_once.status().message();
      EXPECT_EQ(by_one->SerializeAsString(), at_once->SerializeAsString());
      EXPECT_EQ(one.arena_bytes, many.arena_bytes);
      EXPECT_EQ(one.order, many.order);
      EXPECT_EQ(one.orders_tried, many.orders_tried);
      EXPECT_EQ(one.spilled_buffers, many.spilled_buffers);
      EXPECT_EQ(one.lifetimes, many.lifetimes);
    }
  }
}

TEST(MemoryPlan, RoundTripsThroughThePlanFile) {
  CostModel costs;
  proto::Schedule s = TinyWithOffload(2, &costs);
  MemoryPlanPass pass;
  ASSERT_TRUE(pass.Run(&s, PassContext{&costs, 0}).ok());
  ASSERT_GT(s.memory_plan().placements_size(), 0);
  auto back = ParsePlan(SerializePlan(s), "tiny.dcplan");
  ASSERT_TRUE(back.ok()) << back.status().message();
  EXPECT_EQ(back->memory_plan().SerializeAsString(), s.memory_plan().SerializeAsString());
  EXPECT_EQ(back->memory_plan().arena_bytes(), s.memory_plan().arena_bytes());
}

// The packings try further orders and repair rounds until the arena is within
// max_fragmentation (1%) of the live peak: on dc's own schedules of representative shapes
// (several micro-steps, MoE, recompute, offloaded optimizer state under a tight budget) they
// get there. The schedule is dc's plan with the memory-plan pass switched off, packed as the
// pass would pack it.
TEST(MemoryPlan, ArenaWithinOnePercentOfTheLivePeakOnDcSchedules) {
  struct Shape {
    std::string preset;
    int64_t gas;
    bool recompute;
    int world;
    double budget_share;  // of the zero3 baseline's peak; 0: the GPU's memory
    int64_t seq;          // 0: the preset's
  };
  const Shape shapes[] = {
      {"llama-1b", 4, false, 8, 0, 512},
      {"llama-1b", 2, true, 8, 0, 512},
      {"llama-1b", 2, false, 8, 0.8, 512},
      {"mixtral-tiny", 4, false, 2, 0, 0},
      {"mixtral-tiny", 2, false, 2, 0.8, 0},
      // Offloaded optimizer state freed through the forward and reloaded through the backward:
      // 1.11% over the live peak before kEdgesFromTheTop (plan_bench's 8-rank loose rows).
      {"llama3-70b", 1, false, 8, 0, 1024},
  };
  for (const Shape& shape : shapes) {
    SCOPED_TRACE(shape.preset + " gas " + std::to_string(shape.gas) +
                 (shape.recompute ? " recompute" : "") + " budget share " +
                 std::to_string(shape.budget_share));
    ModelOverrides overrides;
    overrides.gas = shape.gas;
    overrides.recompute_layers = shape.recompute;
    if (shape.seq > 0) overrides.seq = shape.seq;
    auto config = MakeConfig(shape.preset, overrides);
    ASSERT_TRUE(config.ok()) << config.status().message();
    PlanRequest request;
    auto program = BuildProgram(*config);
    ASSERT_TRUE(program.ok()) << program.status().message();
    request.program = *program;
    request.world_size = shape.world;
    const HardwareProfile hw = *FindHardware("h100");
    request.costs = EstimateCostModel(request.program, hw, ClusterShape{1, shape.world});
    request.budget_bytes = hw.device_memory_bytes;
    if (shape.budget_share > 0) {
      proto::Schedule baseline;
      baseline.set_world_size(shape.world);
      *baseline.mutable_program() = request.program;
      ASSERT_TRUE(Zero3Pass().Run(&baseline, PassContext{}).ok());
      auto sim = Simulate(baseline, request.costs);
      ASSERT_TRUE(sim.ok());
      request.budget_bytes =
          static_cast<int64_t>(static_cast<double>(sim->peak_device_bytes) * shape.budget_share);
    }
    request.disabled_passes = {"memory-plan"};
    auto plan = MakePlan(request);
    ASSERT_TRUE(plan.ok()) << plan.status().message();
    MemoryPlanStats stats;
    auto packed =
        PlanMemory(*plan, MemoryPlanOptions{}, request.budget_bytes, &request.costs, &stats);
    ASSERT_TRUE(packed.ok()) << packed.status().message();
    ExpectNoConflicts(*plan, *packed, MemoryPlanOptions{}.alignment_bytes);
    EXPECT_GE(stats.arena_bytes, stats.live_peak_bytes);
    EXPECT_LE(static_cast<double>(stats.arena_bytes),
              1.01 * static_cast<double>(stats.live_peak_bytes))
        << stats.order << ", " << stats.orders_tried << " packings";
  }
}

// Where every packing of the first rounds is over the budget, more repair rounds come before
// any reuse that waits. On the schedule of plan_bench's llama3-8b row (8 ranks, GAS 4, 80% of
// the baseline's peak), the over-budget rounds pack a smaller arena than the first rounds do;
// at a budget of that arena the pass then needs no spill, where stopping at the first rounds
// spills buffers to instruction order (their waits cost the step).
TEST(MemoryPlan, RepairsMoreBeforeReuseThatWaits) {
  ModelOverrides overrides;
  overrides.gas = 4;
  overrides.seq = 1024;
  overrides.micro_batch = 1;
  auto config = MakeConfig("llama3-8b", overrides);
  ASSERT_TRUE(config.ok()) << config.status().message();
  auto program = BuildProgram(*config);
  ASSERT_TRUE(program.ok()) << program.status().message();
  PlanRequest request;
  request.program = *program;
  request.world_size = 8;
  request.costs = EstimateCostModel(request.program, *FindHardware("h100"), ClusterShape{1, 8});
  proto::Schedule baseline;
  baseline.set_world_size(8);
  *baseline.mutable_program() = request.program;
  ASSERT_TRUE(Zero3Pass().Run(&baseline, PassContext{}).ok());
  auto sim = Simulate(baseline, request.costs);
  ASSERT_TRUE(sim.ok());
  request.budget_bytes = static_cast<int64_t>(static_cast<double>(sim->peak_device_bytes) * 0.8);
  request.disabled_passes = {"memory-plan"};
  auto plan = MakePlan(request);
  ASSERT_TRUE(plan.ok()) << plan.status().message();

  // The smallest arena without waits, under a budget nothing meets: after the first rounds,
  // and after the over-budget rounds too.
  auto arena_without_waits = [&](int over_budget_rounds) {
    MemoryPlanOptions options;
    options.spill_to_instruction_order = false;
    options.fall_back_to_instruction_order = false;
    options.over_budget_repair_rounds = over_budget_rounds;
    MemoryPlanStats stats;
    auto packed = PlanMemory(*plan, options, 1, &request.costs, &stats);
    EXPECT_TRUE(packed.ok()) << packed.status().message();
    return stats.arena_bytes;
  };
  const int64_t first_rounds = arena_without_waits(0);
  const int64_t more_rounds = arena_without_waits(MemoryPlanOptions{}.over_budget_repair_rounds);
  ASSERT_LT(more_rounds, first_rounds);

  MemoryPlanOptions first_rounds_only;
  first_rounds_only.over_budget_repair_rounds = 0;
  MemoryPlanStats spilling;
  auto spilled = PlanMemory(*plan, first_rounds_only, more_rounds, &request.costs, &spilling);
  ASSERT_TRUE(spilled.ok()) << spilled.status().message();
  EXPECT_GT(spilling.spilled_buffers, 0) << spilling.order;

  MemoryPlanStats stats;
  auto packed = PlanMemory(*plan, MemoryPlanOptions{}, more_rounds, &request.costs, &stats);
  ASSERT_TRUE(packed.ok()) << packed.status().message();
  ExpectNoConflicts(*plan, *packed, MemoryPlanOptions{}.alignment_bytes);
  EXPECT_EQ(stats.arena_bytes, more_rounds);
  EXPECT_EQ(stats.spilled_buffers, 0) << stats.order;
  EXPECT_EQ(stats.lifetimes, MemoryPlanOptions::Lifetimes::kInstructionAndSimulatedTime);
  EXPECT_NE(stats.order.find("repair round"), std::string::npos) << stats.order;
}

// dc's plan of `preset` (`layers` layers, seq 512) on 8 ranks with the memory-plan pass switched
// off, and the request that made it.
proto::Schedule PlanWithoutMemoryPlan(const std::string& preset, int64_t layers, int64_t gas,
                                      PlanRequest* request) {
  ModelOverrides overrides;
  overrides.gas = gas;
  overrides.layers = layers;
  overrides.seq = 512;
  auto config = MakeConfig(preset, overrides);
  EXPECT_TRUE(config.ok()) << config.status().message();
  auto program = BuildProgram(*config);
  EXPECT_TRUE(program.ok()) << program.status().message();
  request->program = *program;
  request->world_size = 8;
  const HardwareProfile hw = *FindHardware("h100");
  request->costs = EstimateCostModel(request->program, hw, ClusterShape{1, 8});
  request->budget_bytes = hw.device_memory_bytes;
  request->disabled_passes = {"memory-plan"};
  auto plan = MakePlan(*request);
  EXPECT_TRUE(plan.ok()) << plan.status().message();
  return plan.ok() ? *plan : proto::Schedule();
}

// PlanMemory of `plan` under the budget and costs of the `request` that planned it.
StatusOr<proto::MemoryPlan> PackUnder(const proto::Schedule& plan, const PlanRequest& request,
                                      const MemoryPlanOptions& options, MemoryPlanStats* stats,
                                      const PackingMemo* memo = nullptr) {
  return PlanMemory(plan, options, request.budget_bytes, &request.costs, stats, nullptr, 1, memo);
}

// For each activation tensor, the most micro-steps that place it at one offset.
std::map<int, int> MostMicroStepsAtOneOffset(const proto::MemoryPlan& plan) {
  std::map<std::pair<int, int64_t>, std::set<int>> steps;  // (tensor, offset) -> micro-steps
  for (const proto::BufferPlacement& p : plan.placements()) {
    if (p.micro_step() >= 0) steps[{p.tensor(), p.offset_bytes()}].insert(p.micro_step());
  }
  std::map<int, int> most;
  for (const auto& [key, micro_steps] : steps) {
    most[key.first] = std::max(most[key.first], static_cast<int>(micro_steps.size()));
  }
  return most;
}

// Where micro-steps repeat, one of them is packed once for all: the same offsets in every
// repeat (each activation at one offset in all the repeated micro-steps, where the packings
// of the whole step place them anew each time), no two live buffers sharing bytes, the reuse
// ordered on asynchronous streams (the happens-before check), and the arena within 1% of the
// live peak. A single packing makes it: the first.
TEST(MemoryPlan, PacksRepeatedMicroStepsOnceForAll) {
  PlanRequest request;
  const proto::Schedule plan = PlanWithoutMemoryPlan("llama-1b", 16, 8, &request);
  ASSERT_GT(plan.instructions_size(), 0);
  MemoryPlanStats stats;
  auto packed = PackUnder(plan, request, MemoryPlanOptions{}, &stats);
  ASSERT_TRUE(packed.ok()) << packed.status().message();
  ASSERT_EQ(stats.order.rfind("periodic (", 0), 0u) << stats.order;
  EXPECT_EQ(stats.orders_tried, 1) << stats.order;
  ExpectNoConflicts(plan, *packed, MemoryPlanOptions{}.alignment_bytes);
  EXPECT_LE(static_cast<double>(stats.arena_bytes),
            1.01 * static_cast<double>(stats.live_peak_bytes))
      << stats.order;
  // "periodic (R repeats of ...": R micro-steps share each activation's offset.
  const int repeats = std::stoi(stats.order.substr(std::string("periodic (").size()));
  EXPECT_GE(repeats, 3);
  EXPECT_LE(repeats, 8);
  const std::map<int, int> most = MostMicroStepsAtOneOffset(*packed);
  ASSERT_FALSE(most.empty());
  for (const auto& [tensor, micro_steps] : most) {
    EXPECT_GE(micro_steps, repeats) << plan.program().tensors(tensor).name();
  }

  proto::Schedule with_plan = plan;
  MemoryPlanPass pass;
  PassContext context{&request.costs, request.budget_bytes};
  auto changed = pass.Run(&with_plan, context);
  ASSERT_TRUE(changed.ok()) << changed.status().message();
  EXPECT_EQ(with_plan.memory_plan().arena_bytes(), stats.arena_bytes);
  const Status ordered = CheckHappensBefore(with_plan);
  EXPECT_TRUE(ordered.ok()) << ordered.message();

  // The packings of the whole step do not repeat the layout: what the test above holds is the
  // periodic packing's.
  MemoryPlanOptions whole_step;
  whole_step.periodic = false;
  MemoryPlanStats whole_stats;
  auto whole = PackUnder(plan, request, whole_step, &whole_stats);
  ASSERT_TRUE(whole.ok()) << whole.status().message();
  EXPECT_EQ(whole_stats.order.find("periodic"), std::string::npos) << whole_stats.order;
  int repeated = 0;
  const std::map<int, int> whole_most = MostMicroStepsAtOneOffset(*whole);
  for (const auto& [tensor, micro_steps] : whole_most) repeated += micro_steps >= repeats;
  EXPECT_LT(repeated, static_cast<int>(whole_most.size()));
}

// Over the budget, the offload pass's arena check ends at a periodic packing within
// periodic_fragmentation of the live peak (it only learns by how much the arena is over), and the
// memory-plan pass goes on from there to the plan it makes without the check.
TEST(MemoryPlan, TheArenaCheckEndsAtAPeriodicPackingOverTheBudget) {
  PlanRequest request;
  const proto::Schedule plan = PlanWithoutMemoryPlan("llama-1b", 16, 8, &request);
  ASSERT_GT(plan.instructions_size(), 0);
  MemoryPlanStats periodic;
  ASSERT_TRUE(PackUnder(plan, request, MemoryPlanOptions{}, &periodic).ok());
  ASSERT_EQ(periodic.order.rfind("periodic (", 0), 0u) << periodic.order;

  request.budget_bytes = periodic.arena_bytes - 1;
  PackingMemo memo;
  auto arena = ArenaBytesWithoutWaits(plan, MemoryPlanOptions{}, request.budget_bytes,
                                      &request.costs, nullptr, &memo);
  ASSERT_TRUE(arena.ok()) << arena.status().message();
  EXPECT_EQ(*arena, periodic.arena_bytes);

  MemoryPlanStats fresh, resumed;
  auto without_memo = PackUnder(plan, request, MemoryPlanOptions{}, &fresh);
  auto with_memo = PackUnder(plan, request, MemoryPlanOptions{}, &resumed, &memo);
  ASSERT_TRUE(without_memo.ok() && with_memo.ok());
  EXPECT_EQ(resumed.packings_reused, 1);
  EXPECT_GT(fresh.orders_tried, 1);  // over the budget the pass packs on
  EXPECT_EQ(resumed.orders_tried, fresh.orders_tried);
  EXPECT_EQ(with_memo->SerializeAsString(), without_memo->SerializeAsString());
}

// Fewer micro-steps than periodic_min_repeats: no period, and the packings of the whole step
// as before.
TEST(MemoryPlan, FindsNoPeriodInTwoMicroSteps) {
  PlanRequest request;
  const proto::Schedule plan = PlanWithoutMemoryPlan("llama-1b", 4, 2, &request);
  ASSERT_GT(plan.instructions_size(), 0);
  MemoryPlanStats stats;
  auto packed = PackUnder(plan, request, MemoryPlanOptions{}, &stats);
  ASSERT_TRUE(packed.ok()) << packed.status().message();
  EXPECT_EQ(stats.order.find("periodic"), std::string::npos) << stats.order;
  MemoryPlanOptions whole_step;
  whole_step.periodic = false;
  auto whole = PackUnder(plan, request, whole_step, nullptr);
  ASSERT_TRUE(whole.ok());
  EXPECT_EQ(packed->SerializeAsString(), whole->SerializeAsString());
}

// The scale the pass must handle: Llama-3 70B, GAS 16, 16 ranks (≈127k instructions, ≈83k
// buffers). How fast (0.2-0.4 s on one core) is bench/speed_bench's to measure: tests never
// assert speed.
TEST(MemoryPlan, PlansLlama70bGas16) {
  ModelOverrides overrides;
  overrides.seq = 1024;
  overrides.micro_batch = 1;
  overrides.gas = 16;
  auto config = MakeConfig("llama3-70b", overrides);
  ASSERT_TRUE(config.ok());
  auto program = BuildProgram(*config);
  ASSERT_TRUE(program.ok());
  proto::Schedule s;
  s.set_world_size(16);
  *s.mutable_program() = *program;
  ASSERT_TRUE(Zero3Pass().Run(&s, PassContext{}).ok());
  const CostModel costs = EstimateCostModel(*program, *FindHardware("h100"), ClusterShape{2, 8});
  for (const MemoryPlanOptions& options : {MemoryPlanOptions{}, InInstructionOrder()}) {
    const auto start = std::chrono::steady_clock::now();
    MemoryPlanStats stats;
    auto plan = PlanMemory(s, options, 0, &costs, &stats);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    ASSERT_TRUE(plan.ok()) << plan.status().message();
    EXPECT_GT(stats.buffers, 50'000);
    EXPECT_GE(stats.arena_bytes, stats.live_peak_bytes);
    const bool in_order = options.lifetimes == MemoryPlanOptions::Lifetimes::kInstructionOrder;
    RecordProperty(in_order ? "instruction_order_seconds" : "simulated_time_seconds",
                   std::to_string(seconds));
    std::printf("memory plan (%s) of %d instructions, %d buffers: %.3f s, arena %s, live peak %s\n",
                in_order ? "instruction order" : "simulated time", s.instructions_size(),
                stats.buffers, seconds, FormatBytes(stats.arena_bytes).c_str(),
                FormatBytes(stats.live_peak_bytes).c_str());
  }
}

}  // namespace
}  // namespace dc
