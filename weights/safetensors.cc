#include "weights/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "schemas/files.h"
#include "schemas/float16.h"

namespace dc::safetensors {
namespace {

using nlohmann::json;

constexpr int64_t kHeaderLengthBytes = 8;
// The format's own limit on the JSON header (safetensors' MAX_HEADER_SIZE).
constexpr int64_t kMaxHeaderBytes = 100'000'000;
constexpr int64_t kHeaderAlignmentBytes = 8;
constexpr char kMetadataKey[] = "__metadata__";

struct DTypeEntry {
  proto::DType dtype;
  const char* name;
};
constexpr DTypeEntry kDTypes[] = {{proto::DTYPE_F32, "F32"},
                                  {proto::DTYPE_BF16, "BF16"},
                                  {proto::DTYPE_F16, "F16"},
                                  {proto::DTYPE_I32, "I32"}};

uint64_t LoadLittleEndian64(const unsigned char* bytes) {
  uint64_t value = 0;
  for (int i = 7; i >= 0; --i) value = (value << 8) | bytes[i];
  return value;
}

Status PreadAll(int fd, char* out, int64_t bytes, int64_t offset) {
  while (bytes > 0) {
    const ssize_t got = ::pread(fd, out, static_cast<size_t>(bytes), offset);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) return Status::Error(std::string("cannot read: ") + std::strerror(errno));
    if (got == 0) return Status::Error("the file ends early (was it truncated?)");
    out += got;
    bytes -= got;
    offset += got;
  }
  return Status::Ok();
}

// A non-negative integer of the header that fits int64, or an error naming `what`.
StatusOr<int64_t> HeaderInteger(const json& value, const std::string& what) {
  if (!value.is_number_unsigned() && !(value.is_number_integer() && value.get<int64_t>() >= 0)) {
    return Status::Error(what + " is not a non-negative integer");
  }
  const uint64_t n = value.get<uint64_t>();
  if (n > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    return Status::Error(what + " is out of range");
  }
  return static_cast<int64_t>(n);
}

StatusOr<TensorInfo> ParseEntry(const std::string& name, const json& entry) {
  const std::string where = "tensor '" + name + "'";
  if (!entry.is_object()) return Status::Error(where + " is not a JSON object");
  for (const char* key : {"dtype", "shape", "data_offsets"}) {
    if (!entry.contains(key)) return Status::Error(where + " has no \"" + key + "\"");
  }
  TensorInfo info;
  info.name = name;
  if (!entry["dtype"].is_string()) return Status::Error(where + "'s dtype is not a string");
  DC_ASSIGN_OR_RETURN(info.dtype, ParseDType(entry["dtype"].get<std::string>()));
  const json& shape = entry["shape"];
  if (!shape.is_array()) return Status::Error(where + "'s shape is not an array");
  // Elements times the dtype's bytes must not overflow: bound the product as it grows.
  int64_t elements = 1;
  const int64_t limit = std::numeric_limits<int64_t>::max() / DTypeSizeBytes(info.dtype);
  for (const json& dim : shape) {
    DC_ASSIGN_OR_RETURN(const int64_t d, HeaderInteger(dim, where + "'s shape"));
    if (d != 0 && elements > limit / d) return Status::Error(where + "'s shape is too large");
    elements *= d;
    info.shape.push_back(d);
  }
  const json& offsets = entry["data_offsets"];
  if (!offsets.is_array() || offsets.size() != 2) {
    return Status::Error(where + "'s data_offsets is not [begin, end]");
  }
  DC_ASSIGN_OR_RETURN(info.begin_bytes, HeaderInteger(offsets[0], where + "'s data_offsets"));
  DC_ASSIGN_OR_RETURN(const int64_t end, HeaderInteger(offsets[1], where + "'s data_offsets"));
  if (end < info.begin_bytes) return Status::Error(where + "'s data_offsets end before they begin");
  info.size_bytes = end - info.begin_bytes;
  if (info.size_bytes != elements * DTypeSizeBytes(info.dtype)) {
    return Status::Error(where + " has " + std::to_string(info.size_bytes) +
                         " bytes of data but its dtype and shape need " +
                         std::to_string(elements * DTypeSizeBytes(info.dtype)));
  }
  return info;
}

Status ValidateFile(int64_t file_bytes, int64_t header_bytes, std::vector<TensorInfo>* tensors) {
  const int64_t data_bytes = file_bytes - kHeaderLengthBytes - header_bytes;
  // The spans must tile the data section: sorted by begin, each starts where the last ended.
  std::vector<const TensorInfo*> by_offset;
  for (const TensorInfo& t : *tensors) by_offset.push_back(&t);
  std::sort(by_offset.begin(), by_offset.end(), [](const TensorInfo* a, const TensorInfo* b) {
    return std::tie(a->begin_bytes, a->size_bytes) < std::tie(b->begin_bytes, b->size_bytes);
  });
  int64_t end = 0;
  for (const TensorInfo* t : by_offset) {
    if (t->begin_bytes < end) {
      return Status::Error("tensor '" + t->name + "' overlaps another tensor's data");
    }
    if (t->begin_bytes > end) {
      return Status::Error("the data section has a hole before tensor '" + t->name + "'");
    }
    end = t->begin_bytes + t->size_bytes;
    if (end > data_bytes) {
      return Status::Error("tensor '" + t->name + "' ends at byte " + std::to_string(end) +
                           " of a data section of " + std::to_string(data_bytes) +
                           " (was the file truncated?)");
    }
  }
  if (end != data_bytes) {
    return Status::Error(std::to_string(data_bytes - end) +
                         " bytes after the last tensor belong to no tensor");
  }
  return Status::Ok();
}

}  // namespace

int64_t TensorInfo::elements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string DTypeName(proto::DType dtype) {
  for (const DTypeEntry& e : kDTypes) {
    if (e.dtype == dtype) return e.name;
  }
  return "unknown";
}

StatusOr<proto::DType> ParseDType(const std::string& name) {
  for (const DTypeEntry& e : kDTypes) {
    if (name == e.name) return e.dtype;
  }
  return Status::Error("dtype '" + name.substr(0, 32) +
                       "' is not one dc reads (F32, BF16, F16, I32)");
}

StatusOr<File> File::Open(const std::string& path) {
  auto fail = [&](const std::string& what) {
    return Status::Error(path + ": " + what + "; re-export it or check the path");
  };
  const int raw_fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (raw_fd < 0) return fail(std::string("cannot open: ") + std::strerror(errno));
  File file;
  file.path_ = path;
  file.fd_ = std::shared_ptr<const int>(new int(raw_fd), [](const int* fd) {
    ::close(*fd);
    delete fd;
  });
  struct stat st {};
  if (::fstat(raw_fd, &st) != 0) return fail(std::string("cannot stat: ") + std::strerror(errno));
  if (!S_ISREG(st.st_mode)) return fail("not a regular file");
  const int64_t file_bytes = st.st_size;
  if (file_bytes < kHeaderLengthBytes) {
    return fail("not a safetensors file: " + std::to_string(file_bytes) +
                " bytes, shorter than the header length");
  }
  unsigned char length[kHeaderLengthBytes];
  DC_RETURN_IF_ERROR(PreadAll(raw_fd, reinterpret_cast<char*>(length), kHeaderLengthBytes, 0)
                         .Prefixed(path + ": "));
  const uint64_t header_bytes = LoadLittleEndian64(length);
  if (header_bytes > static_cast<uint64_t>(file_bytes - kHeaderLengthBytes)) {
    return fail("the header length " + std::to_string(header_bytes) + " is past the end of the " +
                std::to_string(file_bytes) + "-byte file (not a safetensors file, or truncated)");
  }
  if (header_bytes > static_cast<uint64_t>(kMaxHeaderBytes)) {
    return fail("the header of " + std::to_string(header_bytes) +
                " bytes is over the format's 100 MB limit");
  }
  std::string header(header_bytes, '\0');
  DC_RETURN_IF_ERROR(
      PreadAll(raw_fd, header.data(), static_cast<int64_t>(header_bytes), kHeaderLengthBytes)
          .Prefixed(path + ": "));
  const json parsed = json::parse(header, nullptr, /*allow_exceptions=*/false);
  if (parsed.is_discarded() || !parsed.is_object()) {
    return fail("the header is not a JSON object (not a safetensors file?)");
  }
  for (const auto& [name, entry] : parsed.items()) {
    if (name == kMetadataKey) {
      if (!entry.is_object()) return fail("__metadata__ is not an object");
      for (const auto& [key, value] : entry.items()) {
        if (!value.is_string()) return fail("__metadata__ '" + key + "' is not a string");
        file.metadata_[key] = value.get<std::string>();
      }
      continue;
    }
    StatusOr<TensorInfo> info = ParseEntry(name, entry);
    if (!info.ok()) return fail(info.status().message());
    file.tensors_.push_back(std::move(*info));
  }
  std::sort(file.tensors_.begin(), file.tensors_.end(),
            [](const TensorInfo& a, const TensorInfo& b) { return a.name < b.name; });
  file.data_begin_bytes_ = kHeaderLengthBytes + static_cast<int64_t>(header_bytes);
  const Status tiled = ValidateFile(file_bytes, static_cast<int64_t>(header_bytes), &file.tensors_);
  if (!tiled.ok()) return fail(tiled.message());
  return file;
}

const TensorInfo* File::Find(const std::string& name) const {
  auto it = std::lower_bound(tensors_.begin(), tensors_.end(), name,
                             [](const TensorInfo& t, const std::string& n) { return t.name < n; });
  return it != tensors_.end() && it->name == name ? &*it : nullptr;
}

Status File::ReadBytes(const TensorInfo& info, int64_t offset_bytes, int64_t bytes,
                       void* out) const {
  if (offset_bytes < 0 || bytes < 0 || offset_bytes > info.size_bytes ||
      bytes > info.size_bytes - offset_bytes) {
    return Status::Error(path_ + ": reading bytes [" + std::to_string(offset_bytes) + ", +" +
                         std::to_string(bytes) + ") of tensor '" + info.name + "', which has " +
                         std::to_string(info.size_bytes));
  }
  return PreadAll(*fd_, static_cast<char*>(out), bytes,
                  data_begin_bytes_ + info.begin_bytes + offset_bytes)
      .Prefixed(path_ + ": tensor '" + info.name + "': ");
}

Status File::ReadF32(const TensorInfo& info, int64_t first, int64_t count, float* out) const {
  const int64_t element_bytes = DTypeSizeBytes(info.dtype);
  if (info.dtype == proto::DTYPE_I32) {
    return Status::Error(path_ + ": tensor '" + info.name + "' is I32, not floating point");
  }
  if (first < 0 || count < 0 || first > info.elements() || count > info.elements() - first) {
    return Status::Error(path_ + ": reading elements [" + std::to_string(first) + ", +" +
                         std::to_string(count) + ") of tensor '" + info.name + "', which has " +
                         std::to_string(info.elements()));
  }
  if (info.dtype == proto::DTYPE_F32) {
    return ReadBytes(info, first * element_bytes, count * element_bytes, out);
  }
  std::vector<uint16_t> narrow(static_cast<size_t>(count));
  DC_RETURN_IF_ERROR(ReadBytes(info, first * element_bytes, count * element_bytes, narrow.data()));
  for (int64_t i = 0; i < count; ++i) {
    out[i] = info.dtype == proto::DTYPE_BF16 ? Bf16ToFloat(narrow[i]) : F16ToFloat(narrow[i]);
  }
  return Status::Ok();
}

TensorToWrite F32Tensor(std::string name, std::vector<int64_t> shape,
                        std::shared_ptr<const std::vector<float>> values) {
  TensorToWrite t;
  t.name = std::move(name);
  t.dtype = proto::DTYPE_F32;
  t.shape = std::move(shape);
  t.fill = [values = std::move(values)](char* out, int64_t bytes) {
    if (bytes != static_cast<int64_t>(values->size() * sizeof(float))) {
      return Status::Error("the tensor's values do not match its shape");
    }
    std::memcpy(out, values->data(), static_cast<size_t>(bytes));
    return Status::Ok();
  };
  return t;
}

Status Write(const std::string& path, std::vector<TensorToWrite> tensors,
             const std::map<std::string, std::string>& metadata) {
  std::sort(tensors.begin(), tensors.end(),
            [](const TensorToWrite& a, const TensorToWrite& b) { return a.name < b.name; });
  // nlohmann's default object is a std::map: keys come out sorted, so the header is
  // deterministic.
  json header = json::object();
  if (!metadata.empty()) header[kMetadataKey] = metadata;
  std::vector<int64_t> sizes;
  int64_t offset = 0;
  std::set<std::string> names;
  for (const TensorToWrite& t : tensors) {
    if (t.name == kMetadataKey || !names.insert(t.name).second) {
      return Status::Error(path + ": tensor name '" + t.name + "' is reserved or repeated");
    }
    if (DTypeName(t.dtype) == "unknown") {
      return Status::Error(path + ": tensor '" + t.name +
                           "' has a dtype safetensors files of dc "
                           "cannot hold");
    }
    int64_t elements = 1;
    for (int64_t d : t.shape) elements *= d;
    const int64_t bytes = elements * DTypeSizeBytes(t.dtype);
    header[t.name] = {{"dtype", DTypeName(t.dtype)},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + bytes}}};
    sizes.push_back(bytes);
    offset += bytes;
  }
  std::string text = header.dump();
  // Hugging Face's writer pads the header with spaces so the data starts 8-byte aligned.
  text.append(static_cast<size_t>((kHeaderAlignmentBytes - text.size() % kHeaderAlignmentBytes) %
                                  kHeaderAlignmentBytes),
              ' ');
  char length[kHeaderLengthBytes];
  for (int i = 0; i < kHeaderLengthBytes; ++i) {
    length[i] = static_cast<char>((static_cast<uint64_t>(text.size()) >> (8 * i)) & 0xff);
  }
  // Streamed tensor by tensor: a writer holds one tensor at a time, never the whole model.
  DC_ASSIGN_OR_RETURN(std::unique_ptr<AtomicFileWriter> file, AtomicFileWriter::Open(path));
  DC_RETURN_IF_ERROR(file->Append(length, kHeaderLengthBytes));
  DC_RETURN_IF_ERROR(file->Append(text.data(), static_cast<int64_t>(text.size())));
  std::vector<char> buffer;
  for (size_t i = 0; i < tensors.size(); ++i) {
    buffer.assign(static_cast<size_t>(sizes[i]), 0);
    DC_RETURN_IF_ERROR(tensors[i]
                           .fill(buffer.data(), sizes[i])
                           .Prefixed(path + ": tensor '" + tensors[i].name + "': "));
    DC_RETURN_IF_ERROR(file->Append(buffer.data(), sizes[i]));
  }
  return file->Commit();
}

}  // namespace dc::safetensors
