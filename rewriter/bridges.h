// Keeping a param gathered across the gap between two of its gathered spans (a bridge): the
// release that ends the first span and the gather that opens the next lose it. The passes that
// make params stay gathered longer (unshard, DeepCompile's selective gather) write their choices
// with ApplyBridges. Private to rewriter/: the passes' headers are the public surface.
#pragma once

#include <vector>

#include "rewriter/gather_index.h"
#include "schemas/program.h"
#include "schemas/status.h"

namespace dc::rewriter_internal {

// Keeping param `param` gathered across the gap between its spans `span` and `span + 1`: the
// release that ends the first and the gather that opens the second lose it.
struct Bridge {
  int param = -1;
  int span = -1;  // the gap between spans[span] and spans[span + 1]
};

// Writes `in`'s stream with every bridge applied to out->instructions: bridged releases and
// gathers lose the param (and vanish when empty); computes that waited for a removed gather
// wait for the gather that now keeps the param live. REQUIRES: `index` is IndexGathers(in).
Status ApplyBridges(const proto::Schedule& in, const GatherIndex& index,
                    const std::vector<Bridge>& bridges, proto::Schedule* out);

}  // namespace dc::rewriter_internal
