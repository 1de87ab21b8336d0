// What the SQLite trace fuzzers share: a fuzz input read as row edits (a cell set to NULL, an
// integer, a real or text; a row deleted or duplicated; a table dropped) applied to a copy of a
// seed trace, so that libFuzzer explores corrupt rows rather than corrupt SQLite pages; and
// everything dc-trace and dc-plan do with a trace. Not thread-safe (libFuzzer runs one input at
// a time).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace dc::fuzz {

// A path for `name` in this process's own temporary directory.
std::string TempPath(const std::string& name);

class SeedTrace {
 public:
  // The database at `path`, or made by running `sql` on an empty one; `tables` lose their
  // constraints (so NULLs and text go in) and are the ones edits address.
  static SeedTrace FromFile(const std::string& path, const std::vector<std::string>& tables);
  static SeedTrace FromSql(const std::string& sql, const std::vector<std::string>& tables);

  // Writes the seed with the edits `data` encodes to `out`.
  void WriteEdited(const uint8_t* data, size_t size, const std::string& out) const;

 private:
  static SeedTrace Loosened(const std::string& path, const std::vector<std::string>& tables);
  std::string bytes_;
  std::vector<std::string> tables_;
  std::vector<std::vector<std::string>> columns_;
};

// Opens `path` as dc-trace and dc-plan would and reads everything: the summary (by instruction),
// its JSON and text, the memory chart, Perfetto JSON, and the profile.
void ReadEverything(const std::string& path);

}  // namespace dc::fuzz
