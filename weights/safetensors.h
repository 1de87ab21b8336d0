// The safetensors format (github.com/huggingface/safetensors), as Hugging Face's loaders read it:
// an 8-byte little-endian header length N, N bytes of JSON ({"name": {"dtype": "F32", "shape":
// [..], "data_offsets": [begin, end]}, ..., "__metadata__": {"key": "value"}}), then the raw
// little-endian tensor bytes, offsets relative to the end of the header. dc writes its exports
// and its checkpoint shards in it.
//
// Reading is hostile-input reading: the header length must lie inside the file and under the
// format's 100 MB limit, the JSON must be an object of well-formed entries, every dtype known,
// every shape's bytes equal to its offsets' span, and the spans must tile the data section
// exactly (no overlap, no hole, nothing past the end), as the format requires. Tensor bytes are
// read on demand with pread, so a reader never holds a whole model.
//
// Writing is deterministic (tensors in name order, the header padded with spaces to 8 bytes)
// and atomic (a temporary file beside the path, renamed when complete): the same tensors give
// the same bytes, and a killed writer leaves no partial file under the name.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "schemas/program.h"
#include "schemas/status.h"

namespace dc::safetensors {

// The dtypes dc reads and writes: "F32", "BF16", "F16", "I32". Others are refused by name.
std::string DTypeName(proto::DType dtype);
StatusOr<proto::DType> ParseDType(const std::string& name);

struct TensorInfo {
  std::string name;
  proto::DType dtype = proto::DTYPE_F32;
  std::vector<int64_t> shape;
  int64_t begin_bytes = 0;  // offset in the data section
  int64_t size_bytes = 0;
  int64_t elements() const;
};

class File {
 public:
  // Opens and validates `path` (the header only; tensor bytes are read on demand). Errors name
  // the file and what is wrong with it.
  static StatusOr<File> Open(const std::string& path);

  const std::string& path() const { return path_; }
  // In name order.
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // Null when the file has no such tensor.
  const TensorInfo* Find(const std::string& name) const;

  // Reads `bytes` bytes of tensor `info` starting at byte `offset_bytes` of it into `out`.
  Status ReadBytes(const TensorInfo& info, int64_t offset_bytes, int64_t bytes, void* out) const;
  // Reads elements [first, first + count) of a floating-point tensor as fp32 (bf16 and f16
  // widened exactly).
  Status ReadF32(const TensorInfo& info, int64_t first, int64_t count, float* out) const;

 private:
  std::string path_;
  std::shared_ptr<const int> fd_;  // closed when the last copy goes
  int64_t data_begin_bytes_ = 0;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

// A tensor to write: its bytes come from `fill`, called once with a buffer of exactly its size
// (so a writer can stream a large tensor from wherever it lives).
struct TensorToWrite {
  std::string name;
  proto::DType dtype = proto::DTYPE_F32;
  std::vector<int64_t> shape;
  std::function<Status(char* out, int64_t bytes)> fill;
};

// An fp32 tensor from values in memory.
TensorToWrite F32Tensor(std::string name, std::vector<int64_t> shape,
                        std::shared_ptr<const std::vector<float>> values);

// Writes `tensors` (names unique, not "__metadata__") and `metadata` to `path` atomically.
Status Write(const std::string& path, std::vector<TensorToWrite> tensors,
             const std::map<std::string, std::string>& metadata = {});

}  // namespace dc::safetensors
