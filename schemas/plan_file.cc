#include "schemas/plan_file.h"

#include <cstring>

#include "schemas/digest.h"
#include "schemas/files.h"
#include "schemas/plan_check.h"

namespace dc {
namespace {

constexpr char kMagic[8] = {'D', 'C', 'P', 'L', 'A', 'N', '\r', '\n'};
constexpr size_t kDigestHexBytes = 64;
// magic, u32 version, u64 payload size, hex digest
constexpr size_t kHeaderBytes = sizeof(kMagic) + 4 + 8 + kDigestHexBytes;

void PutLe(std::string* out, uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) out->push_back(static_cast<char>((value >> (8 * i)) & 0xFF));
}

uint64_t GetLe(const char* p, int bytes) {
  uint64_t value = 0;
  for (int i = 0; i < bytes; ++i)
    value |= static_cast<uint64_t>(static_cast<unsigned char>(p[i])) << (8 * i);
  return value;
}

}  // namespace

std::string SerializePlan(proto::Schedule schedule) {
  schedule.set_format_version(kScheduleFormatVersion);
  schedule.mutable_program()->set_format_version(kProgramFormatVersion);
  schedule.set_program_digest(DigestOf(schedule.program()));
  const std::string payload = CanonicalBytes(schedule);
  std::string bytes(kMagic, sizeof(kMagic));
  PutLe(&bytes, kScheduleFormatVersion, 4);
  PutLe(&bytes, payload.size(), 8);
  bytes += Sha256Hex(payload);
  bytes += payload;
  return bytes;
}

Status SavePlan(const std::string& path, proto::Schedule schedule) {
  return WriteFileAtomic(path, SerializePlan(std::move(schedule)));
}

StatusOr<proto::Schedule> ParsePlan(const std::string& bytes, const std::string& what) {
  if (bytes.empty())
    return Status::Error(what + ": empty file; is this a plan written by dc-plan?");
  if (bytes.size() < sizeof(kMagic) || std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) != 0) {
    return Status::Error(what + ": not a dc plan file (bad magic); write one with dc-plan");
  }
  if (bytes.size() < kHeaderBytes) {
    return Status::Error(what + ": truncated plan header; re-run dc-plan");
  }
  const uint32_t version = static_cast<uint32_t>(GetLe(bytes.data() + sizeof(kMagic), 4));
  if (version > kScheduleFormatVersion) {
    return Status::Error(what + ": plan format version " + std::to_string(version) +
                         " is newer than this dc reads (" + std::to_string(kScheduleFormatVersion) +
                         "); upgrade dc or re-plan with this version");
  }
  if (version < kScheduleFormatVersion) {
    return Status::Error(what + ": plan format version " + std::to_string(version) +
                         " is older than this dc reads (" + std::to_string(kScheduleFormatVersion) +
                         "); re-plan with dc-plan");
  }
  const uint64_t payload_size = GetLe(bytes.data() + sizeof(kMagic) + 4, 8);
  const std::string digest = bytes.substr(sizeof(kMagic) + 12, kDigestHexBytes);
  if (bytes.size() - kHeaderBytes > payload_size) {
    return Status::Error(what + ": " + std::to_string(bytes.size() - kHeaderBytes - payload_size) +
                         " byte(s) after the end of the plan (appended to, or not a plan file); "
                         "re-run dc-plan");
  }
  if (bytes.size() - kHeaderBytes < payload_size) {
    return Status::Error(what + ": truncated plan (" + std::to_string(bytes.size() - kHeaderBytes) +
                         " of " + std::to_string(payload_size) + " payload bytes); re-run dc-plan");
  }
  const std::string payload = bytes.substr(kHeaderBytes);
  if (Sha256Hex(payload) != digest) {
    return Status::Error(what + ": corrupt plan (payload digest mismatch); re-run dc-plan");
  }
  proto::Schedule schedule;
  if (!schedule.ParseFromString(payload)) {
    return Status::Error(what + ": corrupt plan (payload does not parse); re-run dc-plan");
  }
  if (schedule.format_version() != version) {
    return Status::Error(what +
                         ": plan header and body disagree on the format version; re-run dc-plan");
  }
  if (schedule.program().format_version() > kProgramFormatVersion) {
    return Status::Error(what + ": embedded program format version " +
                         std::to_string(schedule.program().format_version()) +
                         " is newer than this dc reads; upgrade dc");
  }
  if (schedule.program().format_version() < kProgramFormatVersion) {
    return Status::Error(what + ": embedded program format version " +
                         std::to_string(schedule.program().format_version()) +
                         " is older than this dc reads (" + std::to_string(kProgramFormatVersion) +
                         "); re-plan with dc-plan");
  }
  if (DigestOf(schedule.program()) != schedule.program_digest()) {
    return Status::Error(what + ": embedded program does not match its digest; re-run dc-plan");
  }
  // A matching digest says the file is as written, not that what was written is sound.
  if (Status valid = ValidatePlan(schedule); !valid.ok()) {
    return Status::Error(what + ": " + valid.message() + "; re-plan with dc-plan");
  }
  return schedule;
}

StatusOr<proto::Schedule> LoadPlan(const std::string& path) {
  DC_ASSIGN_OR_RETURN(std::string bytes, ReadFileBytes(path));
  return ParsePlan(bytes, path);
}

}  // namespace dc
