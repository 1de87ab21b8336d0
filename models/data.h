// Training data: seeded synthetic token sequences (learnable, so the loss falls) or a flat
// binary file of uint16 token ids as nanoGPT writes them. Sample i is the same on every rank,
// every run and every world size, so sharding never changes what is trained on.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "schemas/program.h"
#include "schemas/status.h"

namespace dc {

class TokenSource {
 public:
  virtual ~TokenSource() = default;
  // Opens config.data_path if set (checking it exists, has whole uint16 tokens, at least
  // seq + 1 of them and none >= vocab), else the seeded synthetic source.
  static StatusOr<std::unique_ptr<TokenSource>> Open(const proto::ModelConfig& config);
  // Writes sample `index`: `seq` input tokens and the `seq` targets (the inputs shifted by one).
  virtual void Sample(int64_t index, int32_t* tokens, int32_t* targets) const = 0;
};

// The global sample index of sequence `b` of `rank`'s micro-batch in micro-step `micro_step`
// of optimizer step `step`. With a fixed global batch, the union over ranks is the same set
// for every world size: ((step * gas + micro_step) * world + rank) * micro_batch + b.
int64_t SampleIndex(const proto::ModelConfig& config, int world_size, int64_t step,
                    int64_t micro_step, int rank, int64_t b);

// Deterministic initial value of elements [offset, offset + count) of the flattened param
// `tensor` (counter-based: any rank can make any slice, independent of world size). Elements
// past the end of the tensor (shard padding) are zero.
void InitParamSlice(const proto::ModelConfig& config, const proto::Tensor& tensor, int64_t offset,
                    int64_t count, float* out);

}  // namespace dc
