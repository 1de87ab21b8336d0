-- dc trace schema, version 1.
-- Nsight Systems' table and column names and ENUM numbering wherever nsys records the same
-- data, so one reader serves both and nsys-literate users can reuse their SQL; our own data in
-- tables prefixed TC_. Timestamps are INTEGER nanoseconds relative to the session start
-- (TARGET_INFO_SESSION_START_TIME.utcEpochNs). Process ids are nsys global ids:
-- globalPid = pid << 24 (plus the rank in bits 48 and up, so ranks of one run never collide).

-- ===== Nsight Systems compatible =====
CREATE TABLE StringIds(id INTEGER PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE ThreadNames(nameId INTEGER NOT NULL, priority INTEGER, globalTid INTEGER);
CREATE TABLE TARGET_INFO_SESSION_START_TIME(utcEpochNs INTEGER, utcTime TEXT, localTime TEXT);
CREATE TABLE ANALYSIS_DETAILS(globalVid INTEGER NOT NULL, duration INTEGER NOT NULL,
  startTime INTEGER NOT NULL, stopTime INTEGER NOT NULL);
CREATE TABLE META_DATA_CAPTURE(name TEXT NOT NULL, value TEXT);
CREATE TABLE META_DATA_EXPORT(name TEXT NOT NULL, value TEXT);
CREATE TABLE TARGET_INFO_GPU(vmId INTEGER NOT NULL, id INTEGER NOT NULL, name TEXT, busLocation TEXT,
  uuid TEXT, totalMemory INTEGER, memoryBandwidth INTEGER, clockRate INTEGER, smCount INTEGER,
  l2CacheSize INTEGER, computeMajor INTEGER, computeMinor INTEGER, cuDevice INTEGER);
CREATE TABLE TARGET_INFO_CUDA_STREAM(streamId INTEGER NOT NULL, hwId INTEGER NOT NULL,
  vmId INTEGER NOT NULL, processId INTEGER NOT NULL, contextId INTEGER NOT NULL,
  priority INTEGER NOT NULL, flag INTEGER NOT NULL);

CREATE TABLE ENUM_CUDA_MEMCPY_OPER(id INTEGER PRIMARY KEY, name TEXT, label TEXT);
CREATE TABLE ENUM_CUDA_MEM_KIND(id INTEGER PRIMARY KEY, name TEXT, label TEXT);
CREATE TABLE ENUM_CUDA_DEV_MEM_EVENT_OPER(id INTEGER PRIMARY KEY, name TEXT, label TEXT);
CREATE TABLE ENUM_NSYS_EVENT_TYPE(id INTEGER PRIMARY KEY, name TEXT, label TEXT);
CREATE TABLE ENUM_NSYS_EVENT_CLASS(id INTEGER PRIMARY KEY, name TEXT, label TEXT);

INSERT INTO ENUM_CUDA_MEMCPY_OPER VALUES
  (0,'CUDA_MEMCPY_OPER_UNKNOWN','Unknown'),(1,'CUDA_MEMCPY_OPER_HTOD','Host-to-Device'),
  (2,'CUDA_MEMCPY_OPER_DTOH','Device-to-Host'),(3,'CUDA_MEMCPY_OPER_HTOA','Host-to-Array'),
  (4,'CUDA_MEMCPY_OPER_ATOH','Array-to-Host'),(5,'CUDA_MEMCPY_OPER_ATOA','Array-to-Array'),
  (6,'CUDA_MEMCPY_OPER_ATOD','Array-to-Device'),(7,'CUDA_MEMCPY_OPER_DTOA','Device-to-Array'),
  (8,'CUDA_MEMCPY_OPER_DTOD','Device-to-Device'),(9,'CUDA_MEMCPY_OPER_HTOH','Host-to-Host'),
  (10,'CUDA_MEMCPY_OPER_PTOP','Peer-to-Peer'),(11,'CUDA_MEMCPY_OPER_UVM_HTOD','Unified Host-to-Device'),
  (12,'CUDA_MEMCPY_OPER_UVM_DTOH','Unified Device-to-Host'),(13,'CUDA_MEMCPY_OPER_UVM_DTOD','Unified Device-to-Device');
INSERT INTO ENUM_CUDA_MEM_KIND VALUES
  (0,'CUDA_MEMOPR_MEMORY_KIND_PAGEABLE','Pageable'),(1,'CUDA_MEMOPR_MEMORY_KIND_PINNED','Pinned'),
  (2,'CUDA_MEMOPR_MEMORY_KIND_DEVICE','Device'),(3,'CUDA_MEMOPR_MEMORY_KIND_ARRAY','Array'),
  (4,'CUDA_MEMOPR_MEMORY_KIND_MANAGED','Managed'),(5,'CUDA_MEMOPR_MEMORY_KIND_DEVICE_STATIC','Device Static'),
  (6,'CUDA_MEMOPR_MEMORY_KIND_MANAGED_STATIC','Managed Static'),(7,'CUDA_MEMOPR_MEMORY_KIND_UNKNOWN','Unknown');
INSERT INTO ENUM_CUDA_DEV_MEM_EVENT_OPER VALUES
  (0,'CUDA_DEV_MEM_EVENT_OPR_ALLOCATION','Allocation'),(1,'CUDA_DEV_MEM_EVENT_OPR_DEALLOCATION','Deallocation');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES
  (34,'NvtxMark','NVTX Mark'),(59,'NvtxPushPopRange','NVTX PushPop Range'),
  (60,'NvtxStartEndRange','NVTX StartEnd Range'),(75,'NvtxDomainCreate','NVTX Domain Create');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES (0,'TRACE_PROCESS_EVENT_CUDA_RUNTIME','CUDA Runtime'),
  (1,'TRACE_PROCESS_EVENT_CUDA_DRIVER','CUDA Driver');

CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL(start INTEGER NOT NULL, end INTEGER NOT NULL,
  deviceId INTEGER NOT NULL, contextId INTEGER NOT NULL, streamId INTEGER NOT NULL,
  correlationId INTEGER, globalPid INTEGER, demangledName INTEGER NOT NULL,
  shortName INTEGER NOT NULL, mangledName INTEGER, launchType INTEGER, cacheConfig INTEGER,
  registersPerThread INTEGER NOT NULL, gridX INTEGER NOT NULL, gridY INTEGER NOT NULL,
  gridZ INTEGER NOT NULL, blockX INTEGER NOT NULL, blockY INTEGER NOT NULL, blockZ INTEGER NOT NULL,
  staticSharedMemory INTEGER NOT NULL, dynamicSharedMemory INTEGER NOT NULL,
  localMemoryPerThread INTEGER NOT NULL, localMemoryTotal INTEGER NOT NULL, gridId INTEGER NOT NULL,
  sharedMemoryExecuted INTEGER, graphNodeId INTEGER, sharedMemoryLimitConfig INTEGER);
CREATE TABLE CUPTI_ACTIVITY_KIND_MEMCPY(start INTEGER NOT NULL, end INTEGER NOT NULL,
  deviceId INTEGER NOT NULL, contextId INTEGER NOT NULL, streamId INTEGER NOT NULL,
  correlationId INTEGER, globalPid INTEGER, bytes INTEGER NOT NULL, copyKind INTEGER NOT NULL,
  deprecatedSrcId INTEGER, srcKind INTEGER, dstKind INTEGER, srcDeviceId INTEGER,
  srcContextId INTEGER, dstDeviceId INTEGER, dstContextId INTEGER, migrationCause INTEGER,
  graphNodeId INTEGER, virtualAddress INTEGER);
CREATE TABLE CUPTI_ACTIVITY_KIND_MEMSET(start INTEGER NOT NULL, end INTEGER NOT NULL,
  deviceId INTEGER NOT NULL, contextId INTEGER NOT NULL, streamId INTEGER NOT NULL,
  correlationId INTEGER, globalPid INTEGER, value INTEGER NOT NULL, bytes INTEGER NOT NULL,
  graphNodeId INTEGER, memKind INTEGER);
CREATE TABLE CUPTI_ACTIVITY_KIND_RUNTIME(start INTEGER NOT NULL, end INTEGER NOT NULL,
  eventClass INTEGER NOT NULL, globalTid INTEGER, correlationId INTEGER, nameId INTEGER NOT NULL,
  returnValue INTEGER NOT NULL, callchainId INTEGER);
CREATE TABLE CUDA_GPU_MEMORY_USAGE_EVENTS(start INTEGER NOT NULL, globalPid INTEGER NOT NULL,
  deviceId INTEGER NOT NULL, contextId INTEGER NOT NULL, address INTEGER NOT NULL, pc INTEGER NOT NULL,
  bytes INTEGER NOT NULL, memKind INTEGER NOT NULL, memoryOperationType INTEGER NOT NULL, name TEXT,
  correlationId INTEGER, streamId INTEGER, localMemoryPoolAddress INTEGER,
  localMemoryPoolReleaseThreshold INTEGER, localMemoryPoolSize INTEGER,
  localMemoryPoolUtilizedSize INTEGER, importedMemoryPoolAddress INTEGER,
  importedMemoryPoolProcessId INTEGER,
  tcKind TEXT);  -- extension: gathered | shard | grad | grad_shard | optimizer_state | activation | input
CREATE TABLE NVTX_EVENTS(start INTEGER NOT NULL, end INTEGER, eventType INTEGER NOT NULL,
  rangeId INTEGER, category INTEGER, color INTEGER, text TEXT, globalTid INTEGER,
  endGlobalTid INTEGER, textId INTEGER, domainId INTEGER, uint64Value INTEGER, int64Value INTEGER,
  doubleValue REAL, uint32Value INTEGER, int32Value INTEGER, floatValue REAL, jsonTextId INTEGER,
  jsonText TEXT);

-- ===== dc extensions =====
-- One row per rank of the run.
CREATE TABLE TC_RANK(globalPid INTEGER PRIMARY KEY, hostname TEXT, rank INTEGER NOT NULL,
  localRank INTEGER, worldSize INTEGER NOT NULL, deviceId INTEGER, backend TEXT, device TEXT,
  deviceMemoryBytes INTEGER, hostCores INTEGER, threadsPerRank INTEGER);
-- Clock anchors: the same instant on each clock a rank used.
CREATE TABLE TC_CLOCK_ANCHOR(globalPid INTEGER, tag TEXT, realtimeNs INTEGER, monotonicNs INTEGER,
  sessionNs INTEGER);
-- Records seen, dropped and with a zero timestamp, per rank and activity kind.
CREATE TABLE TC_RECORD_STATS(globalPid INTEGER, kind TEXT, records INTEGER, dropped INTEGER,
  zeroTimestamp INTEGER);
-- Stream names (nsys has none for ours).
CREATE TABLE TC_STREAM(streamId INTEGER PRIMARY KEY, name TEXT NOT NULL);
-- Every recorded activity (by its correlationId within the rank) to its schedule instruction.
CREATE TABLE TC_INSTRUCTION_MAP(globalPid INTEGER NOT NULL, correlationId INTEGER NOT NULL,
  step INTEGER NOT NULL, microStep INTEGER, instruction INTEGER NOT NULL, kind TEXT NOT NULL);
-- Collectives with their payload (nsys has no table for them; NCCL shows up as kernels).
CREATE TABLE TC_COLLECTIVE(start INTEGER NOT NULL, end INTEGER NOT NULL, globalPid INTEGER NOT NULL,
  deviceId INTEGER, streamId INTEGER, correlationId INTEGER, kind TEXT NOT NULL,
  bytes INTEGER NOT NULL, tensors INTEGER, bucket INTEGER);
-- Optimizer steps as executed.
CREATE TABLE TC_STEP(globalPid INTEGER NOT NULL, step INTEGER NOT NULL, start INTEGER NOT NULL,
  end INTEGER NOT NULL, loss REAL, warmup INTEGER NOT NULL);
-- Held-out evaluations (dc-run --eval-data) as executed: after `step` optimizer steps, the mean
-- loss over the held-out batches (every rank's row holds the loss agreed over the ranks).
CREATE TABLE TC_EVAL(globalPid INTEGER NOT NULL, step INTEGER NOT NULL, start INTEGER NOT NULL,
  end INTEGER NOT NULL, loss REAL);
-- The program and schedule the trace was taken under: canonical protobuf bytes and their digest.
CREATE TABLE TC_BLOB(name TEXT PRIMARY KEY, formatVersion INTEGER NOT NULL, digest TEXT NOT NULL,
  data BLOB NOT NULL);
