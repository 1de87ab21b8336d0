// The dc trace reader under corrupt rows: each input is a list of row edits (fuzz/trace_edits.h)
// applied to tests/data/tiny-2rank.db, then read as dc-trace and dc-plan would. Any crash,
// sanitizer report or hang is a finding; errors and counted warnings are the expected outcomes.
#include <cstddef>
#include <cstdint>

#include "fuzz/trace_edits.h"

namespace {

// The tables whose rows a reader interprets (TC_BLOB is guarded by its digests).
const dc::fuzz::SeedTrace& Seed() {
  static const dc::fuzz::SeedTrace seed = dc::fuzz::SeedTrace::FromFile(
      DC_SOURCE_DIR "/tests/data/tiny-2rank.db",
      {"CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_MEMCPY", "CUPTI_ACTIVITY_KIND_MEMSET",
       "CUDA_GPU_MEMORY_USAGE_EVENTS", "TC_RANK", "TC_STEP", "TC_INSTRUCTION_MAP", "TC_COLLECTIVE",
       "TC_STREAM", "TC_RECORD_STATS", "StringIds", "META_DATA_EXPORT", "TARGET_INFO_GPU"});
  return seed;
}

}  // namespace

// The seed is made before the first input, outside the per-input timeout.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  Seed();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = dc::fuzz::TempPath("trace.db");
  Seed().WriteEdited(data, size, path);
  dc::fuzz::ReadEverything(path);
  return 0;
}
