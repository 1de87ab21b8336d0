#include "rewriter/memory_lifetimes.h"

#include <algorithm>
#include <limits>
#include <tuple>

#include "schemas/effects.h"

namespace dc {
namespace {

// The buffer effects (schemas/effects.h) as lifetimes over instruction indices: a buffer is
// held from the instruction that allocates it to the one that frees it (the instruction count
// if none does). Handles number the allocations, so they index the lifetimes.
class Lifetimes : public BufferListener {
 public:
  explicit Lifetimes(int num_instructions) : n_(num_instructions) {}
  void Allocated(int instruction, const BufferKey& key, int64_t size_bytes, BufferKind /*kind*/,
                 bool /*at_end*/, int /*handle*/) override {
    BufferLifetime b;
    b.instruction = instruction;
    b.tensor = key.tensor;
    b.micro_step = key.placement_micro_step();
    b.alloc_index = instruction;
    b.free_index = n_;
    b.size_bytes = size_bytes;
    buffers_.push_back(b);
  }
  void Freed(int instruction, const BufferKey& /*key*/, int64_t /*size_bytes*/, BufferKind /*kind*/,
             bool /*at_end*/, int handle) override {
    buffers_[handle].free_index = instruction;
  }
  std::vector<BufferLifetime> Take() { return std::move(buffers_); }

 private:
  const int n_;
  std::vector<BufferLifetime> buffers_;
};

}  // namespace

StatusOr<std::vector<BufferLifetime>> BufferLifetimes(const proto::Schedule& schedule) {
  DC_RETURN_IF_ERROR(CheckReferences(schedule));
  Lifetimes lifetimes(schedule.instructions_size());
  DC_RETURN_IF_ERROR(BufferReplay(schedule, &lifetimes).Run());
  return lifetimes.Take();
}
Status ToSimulatedTimeAxis(const proto::Schedule& schedule, const SimResult& sim,
                           std::vector<BufferLifetime>* buffers, int* axis_length,
                           std::vector<int>* instruction_at) {
  const int n = schedule.instructions_size();
  std::vector<bool> allocates(n, false), frees(n, false);
  for (const BufferLifetime& b : *buffers) {
    if (b.alloc_index >= 0) allocates[b.alloc_index] = true;
    if (b.free_index >= 0 && b.free_index < n) frees[b.free_index] = true;
  }
  // first_free_after[i]: the earliest end of a freeing instruction issued after i.
  std::vector<double> first_free_after(n + 1, std::numeric_limits<double>::infinity());
  for (int i = n - 2; i >= 0; --i) {
    first_free_after[i] = first_free_after[i + 1];
    if (frees[i + 1]) first_free_after[i] = std::min(first_free_after[i], sim.end_seconds[i + 1]);
  }
  // One key per allocating and per freeing instruction (every buffer of an instruction has
  // its key), ranked in one sort: equal keys share a rank.
  struct Key {
    double time_seconds;
    int instruction;
    int* rank;  // where the rank goes
  };
  std::vector<int> alloc_rank(n, -1), free_rank(n, -1);
  std::vector<Key> keys;
  for (int i = 0; i < n; ++i) {
    if (allocates[i]) {
      keys.push_back({std::min(sim.start_seconds[i], first_free_after[i]), i, &alloc_rank[i]});
    }
    if (frees[i]) keys.push_back({sim.end_seconds[i], i, &free_rank[i]});
  }
  auto less = [](const Key& a, const Key& b) {
    return std::tie(a.time_seconds, a.instruction) < std::tie(b.time_seconds, b.instruction);
  };
  std::sort(keys.begin(), keys.end(), less);
  instruction_at->clear();
  for (size_t k = 0; k < keys.size(); ++k) {
    if (k == 0 || less(keys[k - 1], keys[k])) instruction_at->push_back(keys[k].instruction);
    *keys[k].rank = static_cast<int>(instruction_at->size()) - 1;
  }
  const int length = static_cast<int>(instruction_at->size());
  for (BufferLifetime& b : *buffers) {
    b.alloc_index = b.alloc_index >= 0 ? alloc_rank[b.alloc_index] : -1;
    b.free_index = b.free_index < n ? free_rank[b.free_index] : length;
  }
  *axis_length = length;
  return Status::Ok();
}
std::pair<int64_t, int> LivePeak(const std::vector<BufferLifetime>& buffers, int num_instructions) {
  // delta[i + 1]: change when instruction i starts (i = -1: start-up).
  std::vector<int64_t> delta(num_instructions + 2, 0);
  for (const BufferLifetime& b : buffers) {
    delta[b.alloc_index + 1] += b.size_bytes;
    if (b.free_index + 2 < static_cast<int>(delta.size())) delta[b.free_index + 2] -= b.size_bytes;
  }
  int64_t live = 0, peak = 0;
  int at = -1;
  for (int i = 0; i < static_cast<int>(delta.size()); ++i) {
    live += delta[i];
    if (live > peak) {
      peak = live;
      at = i - 1;
    }
  }
  return {peak, at};
}

}  // namespace dc
