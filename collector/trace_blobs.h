// The program and the schedule a trace ran, as TC_BLOB rows. Private to collector/.
#pragma once

#include "collector/sqlite_writer.h"
#include "schemas/program.h"
#include "schemas/status.h"

namespace dc::collector_internal {

// Writes the program and the schedule as TC_BLOB rows with their digests and format versions:
// in the merged trace, and in each rank's streamed file so that the rank files of a stopped run
// can be merged without the plan.
Status WriteScheduleBlobs(Database* db, const proto::Schedule& schedule);

}  // namespace dc::collector_internal
