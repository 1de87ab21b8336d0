// dc-calibrate's readers of outside text: the first byte chooses the reader (even: nccl-tests'
// table, machine/calibrate.h; odd: the step-time CSV, calibrate/step_times.h), the rest is the
// file. A refusal is fine; a crash, a sanitizer report, a refusal of more than one line or an
// accepted value that is not finite and positive is a finding.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>

#include "calibrate/step_times.h"
#include "machine/calibrate.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  auto check_message = [](const dc::Status& status) {
    if (status.message().find('\n') != std::string::npos) __builtin_trap();
  };
  if (data[0] % 2 == 0) {
    auto table = dc::ParseNcclTests(text, "fuzz.txt");
    if (!table.ok()) return check_message(table.status()), 0;
    if (table->rows.empty() || table->ranks < 1 || table->nodes < 1) __builtin_trap();
    for (const dc::NcclTestsRow& row : table->rows) {
      if (!(row.time_us > 0) || !std::isfinite(row.time_us) || row.size_bytes <= 0) {
        __builtin_trap();
      }
    }
    auto group = dc::NcclTestsGroup({*table});
    if (!group.ok()) check_message(group.status());
  } else {
    auto rows = dc::ParseStepTimes(text, "fuzz.csv");
    if (!rows.ok()) return check_message(rows.status()), 0;
    for (const dc::StepTimeRow& row : *rows) {
      if (!(row.measured_seconds > 0) || !std::isfinite(row.measured_seconds) || row.world < 1) {
        __builtin_trap();
      }
    }
  }
  return 0;
}
