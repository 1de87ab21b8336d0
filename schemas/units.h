// Text for people: byte sizes (parsing "1073741824", "1GiB", "512MiB", "64KiB", "2GB" and
// printing "1.50 GiB") and lists of names ("a, b, c").
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "schemas/status.h"

namespace dc {

StatusOr<int64_t> ParseBytes(const std::string& text);
std::string FormatBytes(int64_t bytes);

// `parts` with `separator` between each two: Join({"a", "b"}, ", ") is "a, b"; "" when empty.
std::string Join(const std::vector<std::string>& parts, std::string_view separator);

}  // namespace dc
