// Stable digests: SHA-256 over canonical (deterministic) protobuf serializations.
#pragma once

#include <google/protobuf/message.h>

#include <string>
#include <string_view>

#include "schemas/status.h"

namespace dc {

// Lower-case hex SHA-256 of `bytes`.
std::string Sha256Hex(std::string_view bytes);

// Lower-case hex SHA-256 of the file at `path`, read in pieces (files of any size).
StatusOr<std::string> Sha256OfFile(const std::string& path);

// The canonical serialization of `message`: deterministic field and map order, so equal
// messages give equal bytes on every run and machine of the same protobuf version.
std::string CanonicalBytes(const google::protobuf::Message& message);

// Sha256Hex(CanonicalBytes(message)).
std::string DigestOf(const google::protobuf::Message& message);

}  // namespace dc
