// The SQLite schema of a dc trace (schemas/trace_schema.sql, compiled in).
#pragma once

namespace dc {

// Bumped when a table or column changes meaning; readers refuse newer traces.
inline constexpr int kTraceSchemaVersion = 1;

// The DDL: CREATE TABLE statements and the ENUM rows, ready for sqlite3_exec.
const char* TraceSchemaSql();

}  // namespace dc
