// The static memory plan's packer: one device arena for the whole step, and an offset in it
// for every device buffer (rewriter/memory_lifetimes.h), so the executor makes one allocation
// and never fragments.
//
// On asynchronous streams issue order is not enough: bytes freed by instruction k and reused by
// a later instruction j are safe only if j's work starts after k's has ended. By default
// (MemoryPlanOptions::Lifetimes) lifetimes are therefore also ordered in the schedule's
// simulated time, and every reuse across streams becomes a dependency of j on k (the
// memory-plan pass adds them: rewriter/memory_plan.h), which then costs the simulated step
// nothing. Where that arena would go over the budget, a buffer may instead reuse bytes freed
// earlier in instruction order only; its dependency then delays it.
//
// Packing is best-fit decreasing over lifetimes, as XLA's heap simulator
// (GlobalDecreasingSizeBestFitHeap) does: buffers that live the whole step overlap every other
// buffer, so they are stacked at the bottom first (no packing does better); the rest are taken
// in the order's sequence and each goes into the smallest free gap (lowest offset on ties),
// among the buffers already placed that overlap it in time, that holds it, or on top of them.
// The ranges taken during a lifetime come from a segment tree over time holding coalesced
// unions (rewriter/arena_occupancy.h), so a placement costs O(log² n) plus the number of runs,
// not the number of buffers that overlap it.
//
// A step of many micro-steps repeats itself: where at least three in a row hold the same buffers
// shifted by one micro-step on the lifetimes' axis, one of them is packed first on a circle (its
// lifetimes modulo its length: the offsets then hold in every repeat next to the ones before and
// after it), and every repeat takes those offsets; only the step's edges (its first and last
// micro-steps, the optimizer phase) are placed around them, each where the same buffer of a
// repeat sits if that is free. That packing (MemoryPlanOptions::periodic) comes before the
// orders above, which run only where it is not good enough. The best packing, where still not
// good enough, is compacted: its buffers placed again lowest first at the lowest free offset,
// which never moves one up (MemoryPlanOptions::compaction_rounds). Thread-safe (pure functions);
// PackingMemo is not.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "machine/cost_model.h"
#include "machine/simulator.h"
#include "schemas/program.h"
#include "schemas/status.h"

namespace dc {

struct MemoryPlanOptions {
  enum class Lifetimes {
    // As instructions are issued: a buffer is held from its allocating instruction to its
    // freeing one. Enough when instructions run one at a time (the cpu backend).
    kInstructionOrder,
    // Issue order and simulated time: freed when the freeing instruction ends; allocated when
    // the allocating instruction starts or, if sooner, when an instruction issued after it ends
    // a free (so a reuse never needs a dependency that points forwards). Equal to
    // kInstructionOrder when streams are serial.
    kInstructionAndSimulatedTime,
  };
  Lifetimes lifetimes = Lifetimes::kInstructionAndSimulatedTime;
  // With kInstructionAndSimulatedTime and a budget: a buffer whose best place would end above
  // the budget may instead reuse bytes freed before it in instruction order but not yet in
  // simulated time, if that place ends lower. Its reuse dependency then delays it (the summary
  // says by how much); the rest of the plan still costs nothing.
  bool spill_to_instruction_order = true;
  // If spilling at the budget is not enough, spill from these fractions below it (each a
  // further attempt with the first order).
  std::vector<double> spill_headroom_fractions = {0.02, 0.05};
  // Last resort when the arena is still over the budget: plan every buffer in instruction order
  // (all reuse waits for its free: the step may get much slower; the summary says how much).
  bool fall_back_to_instruction_order = true;
  // Every offset (and every buffer's reserved size) is a multiple of this; a power of two.
  int64_t alignment_bytes = 256;
  enum class Order {
    kSizeDescending,  // XLA's order: size descending, earlier allocation first on ties
    kAreaDescending,  // size × lifetime descending: long-lived large buffers first
    // The most bytes live at once during the buffer's lifetime, descending, then lifetime
    // descending, then size descending: the buffers held at the live peak all overlap there,
    // so they are stacked first without holes, the longest-lived lowest (a buffer placed above
    // a shorter-lived one leaves a hole under itself once that one is freed); those of the next
    // busiest instants are placed around them. (Size before lifetime on the ties, as
    // kBreadthSizeDescending, packed llama3-70b on 64 ranks at 80% of the baseline's peak
    // 2.49% over the live peak; lifetime first, 0.53%.)
    kBreadthDescending,
    // Breadth descending, then size descending (lifetime left to the allocation order): on
    // small schedules whose ties hold few long-lived buffers (mixtral-tiny at 80% of the
    // baseline's peak) it packs tighter than kBreadthDescending.
    kBreadthSizeDescending,
    // The buffers alive at the step's start but not its end (shards offloaded during the step)
    // or at its end but not its start (reloaded shards, reduce-scattered grads) are stacked down
    // from the live peak, the longest-lived highest (those alive at the start by free
    // descending, then those alive at the end by allocation ascending), where there is room;
    // the rest go by kBreadthDescending's keys, bottom up. Such buffers, placed by breadth,
    // sit among the step's transient ones and split the free bytes those reuse in two; from the
    // top, the free bytes stay one run. (llama3-70b on 8 ranks at the GPU's memory: 1.11% over
    // the live peak with the orders and repairs above, 0.56% this way.)
    kEdgesFromTheTop,
  };
  // Tried in turn (the first always runs) until the arena is within max_fragmentation of the
  // live peak and fits the budget; the smallest arena found wins. Where size-descending packs
  // tightly enough, it is the only packing made. (kAreaDescending, once in the default
  // sequence, packed no plan_bench or paper_bench row tightest once both breadth orders were.)
  std::vector<Order> orders = {Order::kSizeDescending, Order::kBreadthDescending,
                               Order::kBreadthSizeDescending};
  // The arena may exceed the live peak by this fraction before a further packing is tried.
  double max_fragmentation = 0.01;
  // When every order has packed and none is good enough, up to repair_rounds more packings in
  // each of these orders (round by round, in this sequence), each placing first every buffer
  // that the order's earlier packings put above the live peak, those put there most often
  // first (then in the order's sequence): a best fit by decreasing keys places small
  // long-lived buffers last, when the union of what is taken during their lifetime leaves no
  // gap, and breadth's stacking at the busiest instants leaves such buffers above the peak.
  // Placing a buffer first moves others above the peak in turn; counting the rounds each spent
  // there ranks the buffers that keep landing there before those that did once (as squeaky-wheel
  // optimization does). (Size-descending's repairs packed llama3-70b on 32 ranks at the GPU's
  // memory 3.05% over the live peak after 9 rounds, against 3.54% unrepaired.)
  std::vector<Order> repaired_orders = {Order::kBreadthDescending, Order::kBreadthSizeDescending,
                                        Order::kSizeDescending};
  int repair_rounds = 3;
  // Repair rounds of an order stop after this many in a row that pack no tighter than its best.
  int repair_patience = 1;
  // Where every packing above is over the budget: up to this many more repair rounds of each
  // order, with this patience, before any packing that waits (those cost the step time; these
  // cost planning time). llama3-8b on 8 ranks, GAS 4, at 80% of the baseline's peak: the first
  // rounds' patience stopped breadth-descending's repairs over the budget, its next round fits
  // it, where spills had cost the step 12 ms (0.6800 s -> 0.6677 s). The search gains slowly,
  // so a plan whose arena fits the budget is not searched further: with these rounds for every
  // plan over the fragmentation target, llama3-70b on 32 ranks at 80% of the baseline's peak
  // went from 4.49% over the live peak to 3.52% (after 20 rounds) for 2.6x the planning time,
  // and no plan_bench row came within 1%.
  int over_budget_repair_rounds = 24;
  int over_budget_repair_patience = 8;
  // After every order and repair round, while none is good enough: these orders, once each.
  // (Last, so that the offload pass's arena check, a prefix of the sequence, is unchanged.)
  std::vector<Order> last_orders = {Order::kEdgesFromTheTop};
  // Where micro-steps repeat (at least periodic_min_repeats in a row whose buffers are the same
  // tensors, sizes and lifetimes, shifted by one micro-step on the lifetimes' axis), a packing
  // before all others: one micro-step packed on a circle (its lifetimes modulo its length, so
  // that the same offsets hold in every repeat next to the ones before and after it) in each of
  // `orders`, with up to periodic_repair_rounds repairs each (stopping after
  // periodic_repair_patience in a row that pack no tighter); every repeat at those offsets; the
  // rest (the step's first and last micro-steps, its edges) by best fit around them. One
  // micro-step's buffers are 1/GAS of the step's, so its search costs a fraction of a packing.
  bool periodic = true;
  int periodic_min_repeats = 3;
  // Its ways of placing the rest stop at the first arena within this fraction of the live peak;
  // there (and under the budget) it is the plan, no other packing made. (At max_fragmentation,
  // llama3-8b on 32 ranks at GAS 16 took it 0.79% over the live peak, where size-descending
  // packs 0.14%.)
  double periodic_fragmentation = 0.005;
  // Within periodic_fragmentation, over the budget too, no other packing without waits is made:
  // the offload pass's arena check (BudgetCheckOptions), which learns by how much the arena is
  // over, where the whole step's packings are rarely tighter than a repeat's layout (Llama-3
  // 405B's first check: 5 packings, 1.3-1.8% over the live peak against 0.47%).
  bool periodic_ends_over_budget = false;
  int periodic_repair_rounds = 8;
  int periodic_repair_patience = 2;
  // Where the best packing without waits is not good enough (over max_fragmentation or the
  // budget), and again at the end, up to this many rounds that place its buffers again, lowest
  // first, each at the lowest offset free among those placed again before it (Compact in
  // rewriter/memory_packer.cc): none moves up, and a best fit leaves lower gaps empty that this
  // takes. Not for packings that spill. 0: none. (With one round, offload makes room for a
  // smaller arena: plan_bench's llama3-70b on 32 ranks at GAS 4 and 80% of the baseline's peak
  // plans 4.5834 s with an arena 2.85% over the live peak, against 4.6434 s and 6.04% without;
  // more rounds found nothing more on plan_bench's rows.) The repairs mark the packings as the
  // orders placed them.
  int compaction_rounds = 1;
  // At most this many packings without waits (0: no limit; the periodic packing is not one).
  int max_packings = 0;
  // The offload pass's arena check (ArenaBytesWithoutWaits) makes at most this many: a prefix
  // of the memory-plan pass's sequence, by default every order and one repair of each breadth
  // order. With one (size-descending) the check overstates the arena and offload gives back
  // more than it must (llama3-8b on 8 ranks at 80% of the baseline's peak: 0.2349 s against
  // 0.2003 s with three). Three once left tiny's zero3,offload,memory-plan at 87% of the
  // baseline's peak 305 bytes over the budget after the offload pass's last arena round (each
  // lowered the planning budget by about the excess, and a plan moves whole fragments); the
  // rounds now lower it twice as far each time (OffloadOptions::arena_overshoot_factor). Five
  // hold the three of the sequence before breadth ordered its ties by lifetime (size,
  // breadth-size and its first repair): with only today's first three, llama3-70b on 64 ranks
  // at the GPU's memory offloaded more and stepped 0.6% slower.
  int budget_check_packings = 5;
  // Make every instruction that allocates a buffer wait for the instructions on other streams
  // that freed the bytes it reuses (AddReuseDependencies), so the plan is safe on asynchronous
  // streams for an executor that honours deps, and the simulator predicts that step. Off: the
  // executor must order reuse itself. Always on with kInstructionOrder lifetimes or spills
  // (there the waits are what makes reuse safe).
  bool add_reuse_dependencies = true;
};

struct MemoryPlanStats {
  int buffers = 0;
  int64_t arena_bytes = 0;
  // Most bytes held at once over the lifetimes packed: no packing can be smaller.
  int64_t live_peak_bytes = 0;
  int live_peak_instruction = -1;
  std::string order;        // the order that produced the plan
  int orders_tried = 0;     // packings tried (orders, spill marks, fall-back)
  int packings_reused = 0;  // of them, the offload pass's arena check's (PackingMemo)
  MemoryPlanOptions::Lifetimes lifetimes = MemoryPlanOptions::Lifetimes::kInstructionOrder;
  int spilled_buffers = 0;  // placed by spill_to_instruction_order
  // Most bytes held at once in instruction order: no arena can be smaller.
  int64_t instruction_order_peak_bytes = 0;
  int instruction_order_peak_instruction = -1;
};

class PackingMemo;
namespace rewriter_internal {
class ThreadShare;
}  // namespace rewriter_internal

// The plan of `schedule` under `options`: placements sorted by (instruction, tensor,
// micro_step). First the packings without waits (the orders and their repair rounds) until one
// is within max_fragmentation of the live peak and fits the budget; then, with budget_bytes > 0
// and the arena still over it, those that spill and fall back to instruction order. The
// smallest arena found is returned either way (the caller judges the budget). `costs` times
// the simulation for kInstructionAndSimulatedTime; without them (null) lifetimes are in
// instruction order. `stats` is optional; so is `simulation`, Simulate(schedule, *costs) when
// the caller has it (the memory timeline is not needed), which spares simulating again.
// `threads` > 1 packs that many attempts at a time (the plan is the same); with `share`, as many
// as it lends at the time, up to its threads.
// `memo` (optional): where the offload pass's last arena check packed the same lifetimes under
// the same budget and orders, its packings are this plan's first, and the plan goes on from
// them instead of packing them again (the same plan; MemoryPlanStats::packings_reused).
StatusOr<proto::MemoryPlan> PlanMemory(const proto::Schedule& schedule,
                                       const MemoryPlanOptions& options, int64_t budget_bytes,
                                       const CostModel* costs, MemoryPlanStats* stats,
                                       const SimResult* simulation = nullptr, int threads = 1,
                                       const PackingMemo* memo = nullptr,
                                       rewriter_internal::ThreadShare* share = nullptr);

// Where PlanMemory's packings without waits stopped (memory_packer.cc).
struct PackingProgress;

// What the offload pass's last arena check (ArenaBytesWithoutWaits) packed, for the
// memory-plan pass to go on from: the check's packings are the first of the pass's sequence
// (BudgetCheckOptions), and where the pass packs the same lifetimes (the check packs over the
// offload planner's simulation, which may order a few events otherwise) under the same budget,
// it takes their outcome instead of packing them again. Not thread-safe.
class PackingMemo {
 public:
  PackingMemo();
  ~PackingMemo();
  PackingMemo(const PackingMemo&) = delete;
  PackingMemo& operator=(const PackingMemo&) = delete;
  // The last check's progress; null before one.
  const PackingProgress* last() const;

 private:
  friend StatusOr<int64_t> ArenaBytesWithoutWaits(const proto::Schedule&, const MemoryPlanOptions&,
                                                  int64_t, const CostModel*, const SimResult*,
                                                  PackingMemo*, int,
                                                  rewriter_internal::ThreadShare*);
  std::unique_ptr<PackingProgress> last_;
};

// The options ArenaBytesWithoutWaits packs with: `options` without spills or the fall-back to
// instruction order, stopping at the first packing that fits the budget (the fragmentation
// target is the memory-plan pass's to meet: it goes on from there where that packing is not
// within it).
MemoryPlanOptions BudgetCheckOptions(const MemoryPlanOptions& options);

// The arena `schedule` gets without slowing down: packed with BudgetCheckOptions(options) (no
// reuse that waits (no spills, no fall-back to instruction order: those
// are the memory-plan pass's last resorts). What the offload pass asks of a candidate plan.
// `costs`, `simulation`, `threads` and `share` as for PlanMemory (with threads > 1 its packings are
// made that many at a time: the same arena); where its packings stopped is kept in `memo`
// (optional) for the memory-plan pass to go on from.
StatusOr<int64_t> ArenaBytesWithoutWaits(const proto::Schedule& schedule,
                                         const MemoryPlanOptions& options, int64_t budget_bytes,
                                         const CostModel* costs, const SimResult* simulation,
                                         PackingMemo* memo, int threads = 1,
                                         rewriter_internal::ThreadShare* share = nullptr);

// `options` as text, for a pass's OptionsText (part of the plan cache's key).
std::string MemoryPlanOptionsText(const MemoryPlanOptions& options);

}  // namespace dc
