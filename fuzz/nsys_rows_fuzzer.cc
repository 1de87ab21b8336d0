// The nsys export reader under corrupt rows: row edits (fuzz/trace_edits.h) applied to a small
// export in Nsight Systems' schema (integer names into StringIds, MPI ranks, a GPU, memory
// events), then read as dc-trace and dc-plan would.
#include <cstddef>
#include <cstdint>

#include "fuzz/trace_edits.h"

namespace {

constexpr char kExport[] = R"sql(
CREATE TABLE StringIds(id INTEGER PRIMARY KEY, value TEXT NOT NULL);
INSERT INTO StringIds VALUES (1, 'gemm'), (2, 'ncclDevKernel_AllGather_RING_LL'), (3, 'saxpy');
CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL(start INTEGER NOT NULL, end INTEGER NOT NULL,
  deviceId INTEGER NOT NULL, streamId INTEGER NOT NULL, globalPid INTEGER,
  correlationId INTEGER, shortName INTEGER NOT NULL, demangledName INTEGER NOT NULL);
INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES
  (100, 400, 0, 7, 16777216, 1, 1, 1), (300, 900, 0, 13, 16777216, 2, 2, 2),
  (1000, 1200, 0, 7, 16777216, 3, 3, 3), (150, 650, 1, 7, 33554432, 4, 1, 1),
  (700, 800, 1, 14, 33554432, 5, 2, 2);
CREATE TABLE CUPTI_ACTIVITY_KIND_MEMCPY(start INTEGER NOT NULL, end INTEGER NOT NULL,
  deviceId INTEGER NOT NULL, streamId INTEGER NOT NULL, globalPid INTEGER,
  correlationId INTEGER, bytes INTEGER NOT NULL, copyKind INTEGER NOT NULL);
INSERT INTO CUPTI_ACTIVITY_KIND_MEMCPY VALUES (50, 90, 0, 7, 16777216, 6, 4096, 1),
  (950, 990, 1, 7, 33554432, 7, 8192, 2);
CREATE TABLE CUPTI_ACTIVITY_KIND_MEMSET(start INTEGER NOT NULL, end INTEGER NOT NULL,
  deviceId INTEGER NOT NULL, streamId INTEGER NOT NULL, globalPid INTEGER,
  correlationId INTEGER, bytes INTEGER NOT NULL);
INSERT INTO CUPTI_ACTIVITY_KIND_MEMSET VALUES (60, 70, 0, 7, 16777216, 8, 512);
CREATE TABLE CUDA_GPU_MEMORY_USAGE_EVENTS(start INTEGER NOT NULL, globalPid INTEGER NOT NULL,
  deviceId INTEGER NOT NULL, address INTEGER NOT NULL, bytes INTEGER NOT NULL,
  memKind INTEGER NOT NULL, memoryOperationType INTEGER NOT NULL, name TEXT,
  correlationId INTEGER);
INSERT INTO CUDA_GPU_MEMORY_USAGE_EVENTS VALUES
  (10, 16777216, 0, 4096, 1048576, 2, 0, NULL, 1), (20, 16777216, 0, 8192, 2048, 2, 0, NULL, 2),
  (500, 16777216, 0, 4096, 1048576, 2, 1, NULL, 3), (600, 16777216, 0, 65536, 64, 2, 1, NULL, 4),
  (30, 33554432, 1, 4096, 4096, 2, 0, NULL, 5);
CREATE TABLE MPI_RANKS(globalTid INTEGER, rank INTEGER);
INSERT INTO MPI_RANKS VALUES (16777217, 0), (33554433, 1);
CREATE TABLE TARGET_INFO_GPU(vmId INTEGER NOT NULL, id INTEGER NOT NULL, name TEXT,
  totalMemory INTEGER);
INSERT INTO TARGET_INFO_GPU VALUES (0, 0, 'NVIDIA A100-SXM4-40GB', 42505273344);
)sql";

const dc::fuzz::SeedTrace& Seed() {
  static const dc::fuzz::SeedTrace seed = dc::fuzz::SeedTrace::FromSql(
      kExport,
      {"CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_MEMCPY", "CUPTI_ACTIVITY_KIND_MEMSET",
       "CUDA_GPU_MEMORY_USAGE_EVENTS", "MPI_RANKS", "TARGET_INFO_GPU", "StringIds"});
  return seed;
}

}  // namespace

// The seed is made before the first input, outside the per-input timeout.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  Seed();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = dc::fuzz::TempPath("export.sqlite");
  Seed().WriteEdited(data, size, path);
  dc::fuzz::ReadEverything(path);
  return 0;
}
