#include "collector/trace_blobs.h"

#include "schemas/digest.h"

namespace dc::collector_internal {

Status WriteScheduleBlobs(Database* db, const proto::Schedule& schedule) {
  DC_ASSIGN_OR_RETURN(Statement insert,
                      db->Prepare("INSERT INTO TC_BLOB(name, formatVersion, digest, data) "
                                  "VALUES (?, ?, ?, ?)"));
  const struct {
    const char* name;
    const google::protobuf::Message& message;
    uint32_t format_version;
  } blobs[] = {
      {"program", schedule.program(), schedule.program().format_version()},
      {"schedule", schedule, schedule.format_version()},
  };
  for (const auto& blob : blobs) {
    insert.Bind(1, std::string_view(blob.name));
    insert.Bind(2, int64_t{blob.format_version});
    insert.Bind(3, DigestOf(blob.message));
    insert.BindBlob(4, CanonicalBytes(blob.message));
    DC_RETURN_IF_ERROR(insert.Run());
  }
  return Status::Ok();
}

}  // namespace dc::collector_internal
