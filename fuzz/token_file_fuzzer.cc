// The token-file loader (executor/data.h, --data): the first 11 bytes choose seq (1..256), vocab
// (2..65536) and a sample index (any int64 >= 0); the rest is the file. A file that opens is
// sampled as the executor samples it, at the start and at the chosen index. A refusal is fine; a
// crash, a sanitizer report or a token outside the vocabulary is a finding.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "executor/data.h"
#include "models/model.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  constexpr size_t kHeaderBytes = 11;
  if (size < kHeaderBytes) return 0;
  const int64_t seq = 1 + data[0];
  const int64_t vocab = 2 + (data[1] | (data[2] << 8));
  uint64_t index_bits = 0;
  for (size_t i = 3; i < kHeaderBytes; ++i) index_bits = (index_bits << 8) | data[i];
  index_bits >>= 1;  // a sample index is never negative
  static const std::string path = "/tmp/dc-token-fuzz." + std::to_string(::getpid()) + ".bin";
  FILE* file = std::fopen(path.c_str(), "wb");
  if (file == nullptr) __builtin_trap();
  std::fwrite(data + kHeaderBytes, 1, size - kHeaderBytes, file);
  std::fclose(file);

  dc::ModelOverrides overrides;
  overrides.seq = seq;
  overrides.vocab = vocab;
  overrides.data_path = path;
  auto config = dc::MakeConfig("tiny", overrides);
  if (!config.ok()) return 0;
  auto source = dc::TokenSource::Open(*config);
  if (!source.ok()) return 0;
  std::vector<int32_t> tokens(seq), targets(seq);
  for (int64_t index : {int64_t{0}, int64_t{1}, static_cast<int64_t>(index_bits)}) {
    (*source)->Sample(index, tokens.data(), targets.data());
    for (int64_t i = 0; i < seq; ++i) {
      if (tokens[i] < 0 || tokens[i] >= vocab || targets[i] < 0 || targets[i] >= vocab) {
        __builtin_trap();
      }
    }
  }
  return 0;
}
