// Whole-file reads and atomic writes: a file is either fully written or not there at all.
#pragma once

#include <string>
#include <vector>

#include "schemas/status.h"

namespace dc {

StatusOr<std::string> ReadFileBytes(const std::string& path);

// Writes `bytes` to a temporary file beside `path`, flushes it and renames it over `path`.
Status WriteFileAtomic(const std::string& path, const std::string& bytes);

// A temporary path beside `path` ("path.tmp.<pid>") for writers that build a file in place
// (SQLite) before renaming it.
std::string TempPathBeside(const std::string& path);

// Refuses to write `output` over one of `inputs` (the same file by path or by link): "t.db:
// the output is also the input t.db; write it to another file". Empty paths are ignored.
Status CheckOutputIsNotAnInput(const std::string& output, const std::vector<std::string>& inputs);

}  // namespace dc
