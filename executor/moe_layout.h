// The expert-major row layout of the mixture-of-experts ops (schemas/op_kinds.h): which row of
// the dispatched [M * k, ...] buffer holds token t's j-th choice, and where each expert's
// segment begins. A pure function of the i32 `experts` tensor, shared by every backend so they
// all agree on the order.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

namespace dc {

struct MoeLayout {
  std::vector<int64_t> offsets;  // num_experts + 1: expert e's rows are [offsets[e], offsets[e+1])
  std::vector<int64_t> row;      // per slot s = t * k + j, its row
};

// `experts` holds M * k ids. Inside an expert, rows follow slot order (token, then choice), so
// the layout is deterministic. Returns nullopt and sets `*bad_slot` when an id is outside
// [0, num_experts).
inline std::optional<MoeLayout> MakeMoeLayout(const int32_t* experts, int64_t slots,
                                              int64_t num_experts, int64_t* bad_slot) {
  MoeLayout layout;
  layout.offsets.assign(num_experts + 1, 0);
  for (int64_t s = 0; s < slots; ++s) {
    const int32_t e = experts[s];
    if (e < 0 || e >= num_experts) {
      *bad_slot = s;
      return std::nullopt;
    }
    ++layout.offsets[e + 1];
  }
  for (int64_t e = 0; e < num_experts; ++e) layout.offsets[e + 1] += layout.offsets[e];
  std::vector<int64_t> next(layout.offsets.begin(), layout.offsets.end() - 1);
  layout.row.resize(slots);
  for (int64_t s = 0; s < slots; ++s) layout.row[s] = next[experts[s]]++;
  return layout;
}

}  // namespace dc
