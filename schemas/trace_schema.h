// The SQLite schema of a dc trace (schemas/trace_schema.sql, compiled in).
#pragma once

namespace dc {

// Bumped when a table or column changes meaning; readers refuse newer traces.
inline constexpr int kTraceSchemaVersion = 1;

// META_DATA_EXPORT's row in a trace whose run stopped before its last step: why, e.g. "stopped
// by SIGINT after step 3 of 10". The trace holds the steps every rank completed.
inline constexpr char kIncompleteKey[] = "dc.incomplete";

// The DDL: CREATE TABLE statements and the ENUM rows, ready for sqlite3_exec.
const char* TraceSchemaSql();

}  // namespace dc
