#include "schemas/units.h"

#include <cctype>
#include <cmath>
#include <cstdio>
#include <utility>

namespace dc {

StatusOr<int64_t> ParseBytes(const std::string& text) {
  static const std::pair<const char*, double> kUnits[] = {{"", 1.0},
                                                          {"B", 1.0},
                                                          {"KiB", 1024.0},
                                                          {"MiB", 1048576.0},
                                                          {"GiB", 1073741824.0},
                                                          {"TiB", 1099511627776.0},
                                                          {"PiB", 1125899906842624.0},
                                                          {"EiB", 1152921504606846976.0},
                                                          {"KB", 1e3},
                                                          {"MB", 1e6},
                                                          {"GB", 1e9},
                                                          {"TB", 1e12},
                                                          {"PB", 1e15},
                                                          {"EB", 1e18},
                                                          {"K", 1024.0},
                                                          {"M", 1048576.0},
                                                          {"G", 1073741824.0}};
  size_t pos = 0;
  while (pos < text.size() &&
         (std::isdigit(static_cast<unsigned char>(text[pos])) || text[pos] == '.'))
    ++pos;
  const std::string number = text.substr(0, pos);
  const std::string unit = text.substr(pos);
  const std::string error =
      "'" + text + "' is not a byte size; write e.g. 1073741824, 1GiB or 512MiB";
  if (number.empty()) return Status::Error(error);
  char* end = nullptr;
  const double value = std::strtod(number.c_str(), &end);
  if (*end != '\0') return Status::Error(error);
  for (const auto& [name, scale] : kUnits) {
    if (unit == name) {
      const double bytes = value * scale;
      // int64 holds just under 8 EiB; the double comparison is exact at this power of two.
      if (bytes >= 9223372036854775808.0) {
        return Status::Error("'" + text +
                             "' is too large: byte sizes go up to 8EiB (minus a byte)");
      }
      return static_cast<int64_t>(std::llround(bytes));
    }
  }
  return Status::Error(error);
}

std::string FormatBytes(int64_t bytes) {
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (std::fabs(value) >= 1024.0 && unit < 4) {
    value /= 1024.0;
    ++unit;
  }
  char text[32];
  if (unit == 0) {
    std::snprintf(text, sizeof(text), "%lld B", static_cast<long long>(bytes));
  } else {
    std::snprintf(text, sizeof(text), "%.2f %s", value, kUnits[unit]);
  }
  return text;
}

std::string Join(const std::vector<std::string>& parts, std::string_view separator) {
  std::string text;
  for (size_t i = 0; i < parts.size(); ++i) {
    if (i > 0) text += separator;
    text += parts[i];
  }
  return text;
}

}  // namespace dc
