// Byte sizes for people: parsing "1073741824", "1GiB", "512MiB", "64KiB", "2GB" and printing
// "1.50 GiB".
#pragma once

#include <cstdint>
#include <string>

#include "schemas/status.h"

namespace dc {

StatusOr<int64_t> ParseBytes(const std::string& text);
std::string FormatBytes(int64_t bytes);

}  // namespace dc
