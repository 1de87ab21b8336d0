// A discrete-event replay of a schedule: each stream serial, instructions waiting for their
// dependencies (and for the previous instruction on the same stream; with
// CostModel::serial_streams for the previous instruction of all), durations from a cost model,
// and exact buffer lifetimes (schemas/program.h's accounting) for memory.
//
// Timing is time-resolved: rates change only when an instruction starts or ends or a
// collective's latency term ends, and in between every running instruction progresses at a
// constant rate. A compute runs CostModel::overlap_compute_slowdown times slower over exactly
// the part of its interval that overlaps an all-gather or reduce-scatter in flight (issued
// before or after it). A collective pays its latency term at full speed; past it, collectives
// in flight together (an all-gather and a reduce-scatter on one rank's links) share the
// bandwidth equally, each progressing at 1/k of its rate while k transfer, and a transfer runs
// CostModel::overlap_collective_slowdown times slower while a compute runs beside it (the cpu
// backend: Gloo and the kernels share the rank's cores). Host copies never
// share: PCIe is full duplex, h2d and d2h each have a direction (machine/HARDWARE.md). A
// collective first waits CostModel::collective_skew_fraction of the time since its stream's
// previous collective started (at most collective_skew_max_seconds), for the last rank to arrive.
// An instruction that met no contention lasts exactly its cost model duration (plus that wait).
//
// Memory: the persistent shards from time 0 (with the compute-dtype shards of the params whose
// masters the schedule offloads: schemas/program.h's ComputeShardParams); an all-gather allocates
// each gathered param at its start; a compute allocates its outputs, and the ROLE_INPUT inputs not
// yet live in its micro-step, at its start; a release frees at its start; an offload frees
// persistent shards (or a transient) at its end and a reload allocates them at its start.
// Transients are identified by (tensor, micro-step), gathered params by tensor. Optimizer-phase ops
// work on persistent shards and read no gathered buffers. Events at one instant apply in
// instruction order. Use checks run in instruction order. The peak is the larger of the
// time-resolved peak and the issue-order peak (every effect applied when its instruction is
// issued, as the executor counts live bytes and checks a device's capacity), so a plan's
// predicted peak bounds what a run holds however its streams overlap. Thread-safe (pure
// function).
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "machine/cost_model.h"
#include "schemas/effects.h"
#include "schemas/program.h"
#include "schemas/status.h"

namespace dc {

struct MemoryPoint {
  double time_seconds = 0;
  int64_t total_bytes = 0;
  std::array<int64_t, kNumBufferKinds> bytes_by_kind{};  // index = BufferKind
};

struct SimResult {
  double step_seconds = 0;
  // The larger of the time-resolved and the issue-order peak (see above); where the issue-order
  // one is larger, peak_at_seconds is its instruction's start.
  int64_t peak_device_bytes = 0;
  double peak_at_seconds = 0;
  int peak_instruction = -1;          // whose change reached the peak; -1: the persistent shards
  std::vector<int64_t> peak_by_kind;  // index = BufferKind, at the peak instant
  double compute_seconds = 0;         // union of compute instructions' intervals
  double communication_seconds = 0;   // union of all-gather and reduce-scatter intervals
  double exposed_communication_seconds = 0;        // communication not overlapped by compute
  std::vector<double> start_seconds, end_seconds;  // per instruction
  // The persistent shards at time 0, then one point per instruction that changed memory
  // (empty when SimOptions::memory_timeline is off).
  std::vector<MemoryPoint> memory_timeline;
};

// Errors on a malformed schedule, naming the instruction and tensor: a dep on itself or a later
// instruction, a release of something not live, a compute reading an activation or grad that is
// not live or a param that is not gathered, a second gather of a gathered param, a read of an
// offloaded shard, ... O(n log n) in the number of instructions (the timing is O(n) events of
// O(streams) each).
StatusOr<SimResult> Simulate(const proto::Schedule& schedule, const CostModel& costs);

struct SimOptions {
  // Fill SimResult::memory_timeline. Callers that need only the peak (a planner simulating
  // thousands of candidates) turn it off: the points are most of the simulation's memory
  // traffic.
  bool memory_timeline = true;
  // Told every buffer effect of the simulation's replay too, after the simulator (e.g. the
  // verifier's HappensBeforeCheck: one replay for both). Not owned; null: none.
  BufferListener* also_listening = nullptr;
};
StatusOr<SimResult> Simulate(const proto::Schedule& schedule, const CostModel& costs,
                             const SimOptions& options);

// The SimResult as the plan file's Prediction.
proto::Prediction ToPrediction(const SimResult& result);

}  // namespace dc
