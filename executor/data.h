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

// The synthetic source: sample i starts at a seeded random token; each next token is the
// previous one mapped through a fixed seeded random permutation of the vocabulary, except that
// with probability `jump_probability` it is a fresh random token. A model learns the
// permutation, so the loss falls from log(vocab) towards the entropy of the jumps.
struct SyntheticDataOptions {
  double jump_probability = 1.0 / 16;
};

// Thread-safety: Sample is const and safe to call concurrently.
class TokenSource {
 public:
  virtual ~TokenSource() = default;
  // Opens config.data_path if set (checking it exists, has whole uint16 tokens, at least
  // seq + 1 of them and none >= vocab), else the seeded synthetic source.
  static StatusOr<std::unique_ptr<TokenSource>> Open(const proto::ModelConfig& config);
  static std::unique_ptr<TokenSource> Synthetic(const proto::ModelConfig& config,
                                                const SyntheticDataOptions& options = {});
  // Writes sample `index`: `seq` input tokens and the `seq` targets (the inputs shifted by one).
  virtual void Sample(int64_t index, int32_t* tokens, int32_t* targets) const = 0;
};

// Held-out tokens (dc-run --eval-data): `path` checked as TokenSource::Open checks a token file
// and long enough for `batches` batches of `batch_sequences` samples without wrapping
// (batches * batch_sequences * seq + 1 tokens), so sample i reads tokens [i * seq, (i + 1) * seq]
// and no token is evaluated twice. Messages name the file and the flags.
StatusOr<std::unique_ptr<TokenSource>> OpenEvalData(const proto::ModelConfig& config,
                                                    const std::string& path, int64_t batches,
                                                    int64_t batch_sequences);

// Records the token file of `config` (data_path, if any) as a plan keeps it: the path made
// absolute, the file checked as TokenSource::Open checks it, and its SHA-256 in data_sha256.
Status RecordDataFile(proto::ModelConfig* config);
// A launcher that recorded the file hashes it once for all its ranks: it sets kDataDigestVar to
// DataDigestNote(config), and RecordDataFile in a rank takes that digest instead of reading the
// file again, if the file's size, modification time and path are still those of the note.
inline constexpr char kDataDigestVar[] = "DC_DATA_DIGEST";
std::string DataDigestNote(const proto::ModelConfig& config);
// Checks that the token file of `config` is the one it recorded (its SHA-256); the message
// names the file and says to re-plan or to pass the file with --data to train on it as it is.
// Configs without a recorded digest (synthetic data, older programs) pass.
Status CheckDataFile(const proto::ModelConfig& config);

// The global sample index of sequence `b` of `rank`'s micro-batch in micro-step `micro_step`
// of optimizer step `step`. With a fixed global batch, the union over ranks is the same set
// for every world size: ((step * gas + micro_step) * world + rank) * micro_batch + b.
int64_t SampleIndex(const proto::ModelConfig& config, int world_size, int64_t step,
                    int64_t micro_step, int rank, int64_t b);

// Deterministic initial value of elements [offset, offset + count) of the flattened param
// `tensor` (counter-based: any rank can make any slice, independent of world size). Elements
// past the end of the tensor (shard padding) are zero. 1-D params (the RMSNorm gains) are 1;
// the others are normal(0, init_std) keyed by (seed, tensor name, element index), with the
// residual output projections (attn.wo, mlp.w_down) scaled by 1 / sqrt(2 * layers) as in
// GPT-2.
void InitParamSlice(const proto::ModelConfig& config, const proto::Tensor& tensor, int64_t offset,
                    int64_t count, float* out);

}  // namespace dc
