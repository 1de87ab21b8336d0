#include "machine/hardware.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string_view>
#include <type_traits>
#include <variant>

#include "schemas/files.h"

namespace dc {

namespace hardware_internal {
// Defined in the generated hardware_profiles.cc (analyzer/hardware_profiles.cc.in).
const char* EmbeddedHardwareProfilesJson();
}  // namespace hardware_internal

namespace {

using Json = nlohmann::json;

constexpr char kFormat[] = "dc.hardware_profiles/1";

// What values a constant may take.
enum class Range {
  kPositive,     // > 0
  kNonNegative,  // >= 0
  kFraction,     // in (0, 1]
  kAtLeastOne,   // >= 1
  kError,        // in [0, kMaxError]: a relative error
  kBoolean,      // true or false
};

// The largest relative error a profile may record (1000%): a range widened further says nothing.
constexpr double kMaxError = 10;

// One constant of a profile: its key in the file, where it goes, its valid values and its unit
// (the one its key names; a file must say it, so that a value in GB/s is not read as bytes/s).
struct Field {
  const char* key;
  std::variant<double HardwareProfile::*, int64_t HardwareProfile::*, int HardwareProfile::*,
               bool HardwareProfile::*>
      member;
  Range range;
  const char* unit;
  // For a constant added after files were written without it: the value a file that lacks it
  // means (the member's default), and the source recorded for it. Null: the file must say it.
  const char* absent_source = nullptr;
};

const Field kFields[] = {
    {"peak_bf16_flops_per_s", &HardwareProfile::peak_bf16_flops_per_s, Range::kPositive, "flop/s"},
    {"peak_fp32_flops_per_s", &HardwareProfile::peak_fp32_flops_per_s, Range::kPositive, "flop/s"},
    {"device_memory_bytes", &HardwareProfile::device_memory_bytes, Range::kNonNegative, "bytes"},
    {"memory_bandwidth_bytes_per_s", &HardwareProfile::memory_bandwidth_bytes_per_s,
     Range::kPositive, "bytes/s"},
    {"matmul_efficiency", &HardwareProfile::matmul_efficiency, Range::kFraction, "fraction"},
    {"memory_efficiency", &HardwareProfile::memory_efficiency, Range::kFraction, "fraction"},
    {"intra_node_bus_bandwidth_bytes_per_s", &HardwareProfile::intra_node_bus_bandwidth_bytes_per_s,
     Range::kPositive, "bytes/s"},
    {"inter_node_bandwidth_per_gpu_bytes_per_s",
     &HardwareProfile::inter_node_bandwidth_per_gpu_bytes_per_s, Range::kPositive, "bytes/s"},
    {"collective_base_latency_s", &HardwareProfile::collective_base_latency_s, Range::kNonNegative,
     "s"},
    {"intra_node_step_latency_s", &HardwareProfile::intra_node_step_latency_s, Range::kNonNegative,
     "s"},
    {"inter_node_step_latency_s", &HardwareProfile::inter_node_step_latency_s, Range::kNonNegative,
     "s"},
    {"host_link_bandwidth_bytes_per_s", &HardwareProfile::host_link_bandwidth_bytes_per_s,
     Range::kPositive, "bytes/s"},
    {"host_link_latency_s", &HardwareProfile::host_link_latency_s, Range::kNonNegative, "s"},
    {"host_optimizer_elements_per_s", &HardwareProfile::host_optimizer_elements_per_s,
     Range::kNonNegative, "elements/s"},
    {"kernel_launch_seconds", &HardwareProfile::kernel_launch_seconds, Range::kNonNegative, "s"},
    {"overlap_compute_slowdown", &HardwareProfile::overlap_compute_slowdown, Range::kAtLeastOne,
     "ratio"},
    {"overlap_collective_slowdown", &HardwareProfile::overlap_collective_slowdown,
     Range::kAtLeastOne, "ratio",
     "not in the file (written before the constant existed): 1, collectives not slowed beside "
     "compute"},
    {"collective_compute_seconds", &HardwareProfile::collective_compute_seconds,
     Range::kNonNegative, "s",
     "not in the file (written before the constant existed): 0, collectives take no compute-stream "
     "time"},
    {"collective_skew_fraction", &HardwareProfile::collective_skew_fraction, Range::kNonNegative,
     "ratio",
     "not in the file (written before the constant existed): 0, ranks reach each collective "
     "together"},
    {"collective_skew_max_seconds", &HardwareProfile::collective_skew_max_seconds,
     Range::kNonNegative, "s",
     "not in the file (written before the constant existed): 0, no ceiling on the skew's wait"},
    {"serial_streams", &HardwareProfile::serial_streams, Range::kBoolean, "boolean"},
    {"max_gpus_per_node", &HardwareProfile::max_gpus_per_node, Range::kNonNegative, "gpus"},
    {"host_cores_per_node", &HardwareProfile::host_cores_per_node, Range::kNonNegative, "cores",
     "not in the file (written before the constant existed): 0, each rank has a device of its "
     "own"},
    {"step_error_fraction", &HardwareProfile::step_error_fraction, Range::kError, "fraction",
     "not in the file: 0, no whole step measured against the profile"},
};

// The op kinds' time scales (HardwareProfile::op_time_scale): optional, positive ratios.
constexpr char kOpTimeScalePrefix[] = "op_time_scale.";
constexpr char kOpTimeScaleUnit[] = "ratio";
constexpr char kOpTimeScaleAbsentSource[] = "not in the file: 1, the roofline as it is";

// The op kind whose time scale `key` names.
std::optional<OpKind> OpTimeScaleKind(const std::string& key) {
  if (key.rfind(kOpTimeScalePrefix, 0) != 0) return std::nullopt;
  return FindOpKind(std::string_view(key).substr(sizeof(kOpTimeScalePrefix) - 1));
}

bool InRange(double v, Range range) {
  if (!std::isfinite(v)) return false;
  switch (range) {
    case Range::kPositive:
      return v > 0;
    case Range::kNonNegative:
      return v >= 0;
    case Range::kFraction:
      return v > 0 && v <= 1;
    case Range::kAtLeastOne:
      return v >= 1;
    case Range::kError:
      return v >= 0 && v <= kMaxError;
    case Range::kBoolean:
      return false;
  }
  return false;
}

const char* RangeText(Range range) {
  switch (range) {
    case Range::kPositive:
      return "> 0";
    case Range::kNonNegative:
      return ">= 0";
    case Range::kFraction:
      return "in (0, 1]";
    case Range::kAtLeastOne:
      return ">= 1";
    case Range::kError:
      return "in [0, 10]";
    case Range::kBoolean:
      return "true or false";
  }
  return "";
}

std::string Lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

// The "value" of a constant's {"value": ..., "unit": ..., "source": "..."} entry, after checking
// the entry's keys, its source (recorded in `profile` under `key`) and that its unit is `unit`.
StatusOr<const Json*> CheckedValue(const std::string& key, const char* unit, const Json& entry,
                                   HardwareProfile* profile) {
  if (!entry.is_object()) {
    return Status::Error("is not an object {\"value\", \"unit\", \"source\"}");
  }
  for (auto it = entry.begin(); it != entry.end(); ++it) {
    if (it.key() != "value" && it.key() != "unit" && it.key() != "source") {
      return Status::Error("has an unknown key '" + it.key() +
                           "' (expected \"value\", \"unit\" and \"source\")");
    }
  }
  const auto source = entry.find("source");
  if (source == entry.end() || !source->is_string() || source->get<std::string>().empty()) {
    return Status::Error("has no \"source\": say where the number comes from");
  }
  const auto found_unit = entry.find("unit");
  if (found_unit == entry.end() || !found_unit->is_string()) {
    return Status::Error(std::string("has no \"unit\"; add \"unit\": \"") + unit + "\"");
  }
  if (found_unit->get<std::string>() != unit) {
    return Status::Error("is in " + found_unit->dump() + ", not \"" + unit +
                         "\"; give the value in " + unit);
  }
  const auto value = entry.find("value");
  if (value == entry.end()) return Status::Error("has no \"value\"");
  profile->sources[key] = source->get<std::string>();
  return &*value;
}

// Sets one constant from its entry.
Status ParseField(const Field& field, const Json& entry, HardwareProfile* profile) {
  DC_ASSIGN_OR_RETURN(const Json* value, CheckedValue(field.key, field.unit, entry, profile));
  return std::visit(
      [&](auto member) -> Status {
        using T = std::remove_reference_t<decltype(profile->*member)>;
        if constexpr (std::is_same_v<T, bool>) {
          if (!value->is_boolean()) return Status::Error("value is not true or false");
          profile->*member = value->get<bool>();
          return Status::Ok();
        } else {
          if constexpr (std::is_integral_v<T>) {
            if (!value->is_number_integer()) return Status::Error("value is not an integer");
          } else if (!value->is_number()) {
            return Status::Error("value is not a number");
          }
          const double v = value->get<double>();
          if (!InRange(v, field.range)) {
            return Status::Error("value " + value->dump() + " is out of range (must be " +
                                 RangeText(field.range) + ")");
          }
          if constexpr (std::is_integral_v<T>) {
            if (v > static_cast<double>(std::numeric_limits<T>::max())) {
              return Status::Error("value " + value->dump() + " is too large");
            }
            profile->*member = static_cast<T>(value->get<int64_t>());
          } else {
            profile->*member = v;
          }
          return Status::Ok();
        }
      },
      field.member);
}

StatusOr<std::string> RequiredString(const Json& object, const char* key) {
  const auto it = object.find(key);
  if (it == object.end() || !it->is_string() || it->get<std::string>().empty()) {
    return Status::Error(std::string("no \"") + key + "\" string");
  }
  return it->get<std::string>();
}

// Everything of a profile but its name.
Status ParseProfileBody(const Json& object, HardwareProfile* profile) {
  for (auto it = object.begin(); it != object.end(); ++it) {
    const std::string& key = it.key();
    if (key != "name" && key != "aliases" && key != "description" && key != "constants") {
      return Status::Error("unknown key '" + key + "'");
    }
  }
  DC_ASSIGN_OR_RETURN(profile->description, RequiredString(object, "description"));
  const auto aliases = object.find("aliases");
  if (aliases != object.end()) {
    if (!aliases->is_array()) return Status::Error("\"aliases\" is not an array of strings");
    for (const Json& alias : *aliases) {
      if (!alias.is_string() || alias.get<std::string>().empty()) {
        return Status::Error("\"aliases\" is not an array of strings");
      }
      profile->aliases.push_back(alias.get<std::string>());
    }
  }
  const auto constants = object.find("constants");
  if (constants == object.end() || !constants->is_object()) {
    return Status::Error("no \"constants\" object");
  }
  std::set<std::string> known;
  for (const Field& field : kFields) {
    known.insert(field.key);
    const auto entry = constants->find(field.key);
    if (entry == constants->end() && field.absent_source != nullptr) {
      profile->sources[field.key] = field.absent_source;
      continue;
    }
    if (entry == constants->end()) {
      return Status::Error(std::string("constant '") + field.key + "' is missing");
    }
    DC_RETURN_IF_ERROR(
        ParseField(field, *entry, profile).Prefixed(std::string("constant '") + field.key + "' "));
  }
  for (const OpKindInfo& info : kOpKinds) {
    const std::string key = OpTimeScaleKey(info.kind);
    known.insert(key);
    const auto entry = constants->find(key);
    if (entry == constants->end()) {
      profile->sources[key] = kOpTimeScaleAbsentSource;
      continue;
    }
    StatusOr<const Json*> value = CheckedValue(key, kOpTimeScaleUnit, *entry, profile);
    if (value.ok() && !(*value)->is_number()) value = Status::Error("value is not a number");
    if (value.ok() && !InRange((*value)->get<double>(), Range::kPositive)) {
      value = Status::Error("value " + (*value)->dump() + " is out of range (must be > 0)");
    }
    if (!value.ok()) return value.status().Prefixed("constant '" + key + "' ");
    profile->op_time_scale[static_cast<size_t>(info.kind)] = (*value)->get<double>();
  }
  for (auto it = constants->begin(); it != constants->end(); ++it) {
    if (!known.count(it.key())) return Status::Error("unknown constant '" + it.key() + "'");
  }
  return Status::Ok();
}

StatusOr<HardwareProfile> ParseProfile(const Json& object) {
  if (!object.is_object()) return Status::Error("is not an object");
  HardwareProfile profile;
  DC_ASSIGN_OR_RETURN(profile.name, RequiredString(object, "name"));
  DC_RETURN_IF_ERROR(
      ParseProfileBody(object, &profile).Prefixed("profile '" + profile.name + "': "));
  return profile;
}

const StatusOr<std::vector<HardwareProfile>>& EmbeddedProfiles() {
  static const StatusOr<std::vector<HardwareProfile>> profiles = ParseHardwareProfiles(
      hardware_internal::EmbeddedHardwareProfilesJson(), "machine/hardware_profiles.json");
  return profiles;
}

}  // namespace

StatusOr<std::vector<HardwareProfile>> ParseHardwareProfiles(const std::string& json_text,
                                                             const std::string& origin) {
  Json root;
  try {
    root = Json::parse(json_text);
  } catch (const Json::exception& e) {
    // e.what() is "[json.exception.parse_error.101] parse error at line 3, column 5: ...";
    // a number out of range is "[json.exception.out_of_range.406] number overflow ...".
    std::string why = e.what();
    if (const size_t at = why.find("] "); at != std::string::npos) why = why.substr(at + 2);
    return Status::Error(origin + ": not valid JSON (" + why + "); fix the syntax");
  }
  if (!root.is_object()) return Status::Error(origin + ": the top level is not an object");
  for (auto it = root.begin(); it != root.end(); ++it) {
    if (it.key() != "format" && it.key() != "comment" && it.key() != "profiles") {
      return Status::Error(origin + ": unknown top-level key '" + it.key() +
                           "' (expected \"format\", \"comment\" and \"profiles\")");
    }
  }
  const auto format = root.find("format");
  if (format == root.end() || !format->is_string() || format->get<std::string>() != kFormat) {
    return Status::Error(origin + ": \"format\" is not \"" + kFormat + "\"");
  }
  const auto list = root.find("profiles");
  if (list == root.end() || !list->is_array() || list->empty()) {
    return Status::Error(origin + ": no \"profiles\" array");
  }
  std::vector<HardwareProfile> profiles;
  std::set<std::string> names;
  for (size_t i = 0; i < list->size(); ++i) {
    StatusOr<HardwareProfile> profile = ParseProfile((*list)[i]);
    if (!profile.ok()) {
      return profile.status().Prefixed(origin + ": profile " + std::to_string(i) + ": ");
    }
    std::vector<std::string> own = profile->aliases;
    own.push_back(profile->name);
    for (const std::string& name : own) {
      if (!names.insert(Lower(name)).second) {
        return Status::Error(origin + ": the name '" + name + "' is used twice");
      }
    }
    profiles.push_back(std::move(profile).value());
  }
  return profiles;
}

StatusOr<std::vector<HardwareProfile>> HardwareProfiles() { return EmbeddedProfiles(); }

std::vector<std::string> HardwareNames() {
  std::vector<std::string> names;
  const auto& profiles = EmbeddedProfiles();
  if (!profiles.ok()) return names;
  for (const HardwareProfile& p : *profiles) names.push_back(p.name);
  return names;
}

StatusOr<HardwareProfile> FindHardware(const std::string& name) {
  const auto& profiles = EmbeddedProfiles();
  if (!profiles.ok()) return profiles.status();
  const std::string wanted = Lower(name);
  std::string known;
  for (const HardwareProfile& p : *profiles) {
    if (Lower(p.name) == wanted) return p;
    for (const std::string& alias : p.aliases) {
      if (Lower(alias) == wanted) return p;
    }
    known += (known.empty() ? "" : ", ") + p.name;
  }
  return Status::Error("--hardware: unknown hardware '" + name + "'; known: " + known +
                       " (machine/hardware_profiles.json)");
}

StatusOr<HardwareProfile> LoadHardwareFile(const std::string& path) {
  StatusOr<std::string> text = ReadFileBytes(path);
  if (!text.ok()) return text.status().Prefixed("--hardware: ");
  DC_ASSIGN_OR_RETURN(std::vector<HardwareProfile> profiles, ParseHardwareProfiles(*text, path));
  if (profiles.size() != 1) {
    return Status::Error(path + ": holds " + std::to_string(profiles.size()) +
                         " profiles; --hardware takes a file of one (dc-plan --hardware NAME "
                         "--print-hardware writes one)");
  }
  return std::move(profiles.front());
}

bool IsHardwareFile(const std::string& name_or_path) {
  return name_or_path.find('/') != std::string::npos ||
         (name_or_path.size() > 5 &&
          Lower(name_or_path.substr(name_or_path.size() - 5)) == ".json");
}

StatusOr<HardwareProfile> ResolveHardware(const std::string& name_or_path) {
  return IsHardwareFile(name_or_path) ? LoadHardwareFile(name_or_path) : FindHardware(name_or_path);
}

std::string HardwareProfileJson(const HardwareProfile& profile) {
  using Ordered = nlohmann::ordered_json;
  Ordered constants = Ordered::object();
  for (const Field& field : kFields) {
    Ordered entry = Ordered::object();
    std::visit([&](auto member) { entry["value"] = profile.*member; }, field.member);
    entry["unit"] = field.unit;
    const auto source = profile.sources.find(field.key);
    entry["source"] = source != profile.sources.end() ? source->second : std::string("unknown");
    constants[field.key] = std::move(entry);
  }
  // An op kind's scale where it says something: a value other than 1, or a source of its own.
  for (const OpKindInfo& info : kOpKinds) {
    const std::string key = OpTimeScaleKey(info.kind);
    const double value = profile.op_time_scale[static_cast<size_t>(info.kind)];
    const auto source = profile.sources.find(key);
    const bool sourced =
        source != profile.sources.end() && source->second != kOpTimeScaleAbsentSource;
    if (value == 1 && !sourced) continue;
    Ordered entry = Ordered::object();
    entry["value"] = value;
    entry["unit"] = kOpTimeScaleUnit;
    entry["source"] = sourced ? source->second : std::string("unknown");
    constants[key] = std::move(entry);
  }
  Ordered one = Ordered::object();
  one["name"] = profile.name;
  one["aliases"] = profile.aliases;
  one["description"] = profile.description;
  one["constants"] = std::move(constants);
  Ordered root = Ordered::object();
  root["format"] = kFormat;
  root["comment"] =
      "A dc hardware profile (machine/HARDWARE.md): each constant's value in its unit, and where "
      "it comes from. Replace a value by a measurement of your machine and say so in its source; "
      "plan with dc-plan --synthetic --hardware THIS_FILE.json.";
  root["profiles"] = Ordered::array({std::move(one)});
  return root.dump(2) + "\n";
}

std::vector<HardwareConstantInfo> HardwareConstants() {
  std::vector<HardwareConstantInfo> constants;
  for (const Field& field : kFields) {
    if (field.range == Range::kBoolean) continue;
    HardwareConstantInfo info;
    info.key = field.key;
    info.unit = field.unit;
    info.integral = !std::holds_alternative<double HardwareProfile::*>(field.member);
    info.max_value = field.range == Range::kFraction ? 1.0
                     : field.range == Range::kError  ? kMaxError
                                                     : std::numeric_limits<double>::infinity();
    info.min_value = field.range == Range::kAtLeastOne ? 1.0 : 0.0;
    info.min_exclusive = field.range == Range::kPositive || field.range == Range::kFraction;
    constants.push_back(std::move(info));
  }
  for (const OpKindInfo& kind : kOpKinds) {
    HardwareConstantInfo info;
    info.key = OpTimeScaleKey(kind.kind);
    info.unit = kOpTimeScaleUnit;
    info.min_exclusive = true;
    info.max_value = std::numeric_limits<double>::infinity();
    constants.push_back(std::move(info));
  }
  return constants;
}

std::string OpTimeScaleKey(OpKind kind) {
  return kOpTimeScalePrefix + std::string(InfoOf(kind).name);
}

namespace {
const Field* FindNumericField(const std::string& key) {
  for (const Field& field : kFields) {
    if (field.key == key && field.range != Range::kBoolean) return &field;
  }
  return nullptr;
}

Status UnknownConstant(const std::string& key) {
  std::string known;
  for (const HardwareConstantInfo& info : HardwareConstants()) {
    if (OpTimeScaleKind(info.key)) continue;
    known += (known.empty() ? "" : ", ") + info.key;
  }
  return Status::Error("unknown constant '" + key + "'; known: " + known + ", and " +
                       kOpTimeScalePrefix + "<op kind> (schemas/op_kinds.h)");
}
}  // namespace

StatusOr<double> GetHardwareConstant(const HardwareProfile& profile, const std::string& key) {
  if (const std::optional<OpKind> kind = OpTimeScaleKind(key)) {
    return profile.op_time_scale[static_cast<size_t>(*kind)];
  }
  const Field* field = FindNumericField(key);
  if (!field) return UnknownConstant(key);
  return std::visit([&](auto member) { return static_cast<double>(profile.*member); },
                    field->member);
}

Status SetHardwareConstant(HardwareProfile* profile, const std::string& key, double value) {
  if (const std::optional<OpKind> kind = OpTimeScaleKind(key)) {
    if (!InRange(value, Range::kPositive)) {
      return Status::Error("constant '" + key + "': value " + std::to_string(value) +
                           " is out of range (must be > 0)");
    }
    profile->op_time_scale[static_cast<size_t>(*kind)] = value;
    return Status::Ok();
  }
  const Field* field = FindNumericField(key);
  if (!field) return UnknownConstant(key);
  if (!InRange(value, field->range)) {
    return Status::Error("constant '" + key + "': value " + std::to_string(value) +
                         " is out of range (must be " + RangeText(field->range) + ")");
  }
  return std::visit(
      [&](auto member) -> Status {
        using T = std::remove_reference_t<decltype(profile->*member)>;
        if constexpr (std::is_integral_v<T>) {
          if (value > static_cast<double>(std::numeric_limits<T>::max())) {
            return Status::Error("constant '" + key + "': value is too large");
          }
          profile->*member = static_cast<T>(std::llround(value));
        } else {
          profile->*member = value;
        }
        return Status::Ok();
      },
      field->member);
}

StatusOr<ClusterShape> MakeCluster(int world, int gpus_per_node) {
  if (world < 1) {
    return Status::Error("--world " + std::to_string(world) + ": need at least one rank");
  }
  if (gpus_per_node < 1) {
    return Status::Error("--gpus-per-node " + std::to_string(gpus_per_node) +
                         ": need at least one GPU per node");
  }
  if (world <= gpus_per_node) return ClusterShape{1, world};
  if (world % gpus_per_node != 0) {
    return Status::Error("--world " + std::to_string(world) + " is not a multiple of " +
                         "--gpus-per-node " + std::to_string(gpus_per_node) +
                         ": ranks fill whole nodes; use a multiple of " +
                         std::to_string(gpus_per_node) + " or another --gpus-per-node");
  }
  return ClusterShape{world / gpus_per_node, gpus_per_node};
}

Status ValidateCluster(const HardwareProfile& hw, const ClusterShape& cluster) {
  if (cluster.nodes < 1 || cluster.gpus_per_node < 1) {
    return Status::Error("cluster of " + std::to_string(cluster.nodes) + " nodes x " +
                         std::to_string(cluster.gpus_per_node) + " GPUs is empty");
  }
  if (hw.max_gpus_per_node > 0 && cluster.gpus_per_node > hw.max_gpus_per_node) {
    return Status::Error("--gpus-per-node " + std::to_string(cluster.gpus_per_node) + ": " +
                         hw.name + " nodes have at most " + std::to_string(hw.max_gpus_per_node) +
                         " GPUs in one NVLink domain");
  }
  return Status::Ok();
}

}  // namespace dc
