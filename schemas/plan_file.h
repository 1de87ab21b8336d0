// The plan file on disk: a fixed header (magic, format version, payload size, SHA-256 of the
// payload) followed by the canonical serialization of a Schedule. The header makes a
// truncated, corrupt or newer file detectable before a single field is trusted.
#pragma once

#include <string>

#include "schemas/program.h"
#include "schemas/status.h"

namespace dc {

// Fills format_version and program_digest, then writes atomically.
Status SavePlan(const std::string& path, proto::Schedule schedule);

// Reads and checks magic, size, digest, format version and the embedded program's digest and
// format version, then validates the plan (schemas/plan_check.h: a matching digest is not trust).
// A plan of another format version is refused, an older one with "re-plan".
StatusOr<proto::Schedule> LoadPlan(const std::string& path);

// The same, over bytes already in memory (`what` names them in messages).
StatusOr<proto::Schedule> ParsePlan(const std::string& bytes, const std::string& what);
std::string SerializePlan(proto::Schedule schedule);

}  // namespace dc
