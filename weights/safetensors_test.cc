#include "weights/safetensors.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "schemas/files.h"
#include "schemas/float16.h"

namespace dc::safetensors {
namespace {

namespace fs = std::filesystem;

std::string TempDir() {
  const fs::path dir =
      fs::temp_directory_path() / ("dc-safetensors-" + std::to_string(::getpid()) + "-" +
                                   ::testing::UnitTest::GetInstance()->current_test_info()->name());
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir.string();
}

// A file from a header's JSON text and `data_bytes` bytes of data.
std::string FileOf(const std::string& header, size_t data_bytes) {
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  return bytes + header + std::string(data_bytes, '\x01');
}

TEST(Safetensors, WritesWhatItReadsBackExactly) {
  const std::string dir = TempDir();
  auto a = std::make_shared<std::vector<float>>(
      std::vector<float>{1.5f, -2.0f, 3.25f, 0.0f, 1e-30f, 7.0f});
  auto b = std::make_shared<std::vector<float>>(std::vector<float>{42.0f});
  std::vector<TensorToWrite> tensors = {F32Tensor("z.weight", {2, 3}, a),
                                        F32Tensor("a.bias", {1}, b)};
  TensorToWrite half;
  half.name = "m.half";
  half.dtype = proto::DTYPE_BF16;
  half.shape = {2};
  half.fill = [](char* out, int64_t bytes) {
    const uint16_t v[2] = {FloatToBf16(0.5f), FloatToBf16(-3.0f)};
    std::memcpy(out, v, static_cast<size_t>(bytes));
    return Status::Ok();
  };
  tensors.push_back(half);
  ASSERT_TRUE(Write(dir + "/m.safetensors", tensors, {{"format", "pt"}}).ok());

  StatusOr<File> file = File::Open(dir + "/m.safetensors");
  ASSERT_TRUE(file.ok()) << file.status().message();
  ASSERT_EQ(file->tensors().size(), 3u);
  EXPECT_EQ(file->tensors()[0].name, "a.bias");  // name order
  EXPECT_EQ(file->metadata().at("format"), "pt");
  const TensorInfo* z = file->Find("z.weight");
  ASSERT_NE(z, nullptr);
  EXPECT_EQ(z->shape, (std::vector<int64_t>{2, 3}));
  std::vector<float> back(6);
  ASSERT_TRUE(file->ReadF32(*z, 0, 6, back.data()).ok());
  EXPECT_EQ(back, *a);
  float slice[2];
  ASSERT_TRUE(file->ReadF32(*z, 3, 2, slice).ok());
  EXPECT_EQ(slice[0], 0.0f);
  EXPECT_EQ(slice[1], 1e-30f);
  float widened[2];
  ASSERT_TRUE(file->ReadF32(*file->Find("m.half"), 0, 2, widened).ok());
  EXPECT_EQ(widened[0], 0.5f);
  EXPECT_EQ(widened[1], -3.0f);
  EXPECT_EQ(file->Find("missing"), nullptr);
  EXPECT_FALSE(file->ReadF32(*z, 5, 2, slice).ok());  // past the tensor's end
}

TEST(Safetensors, TheSameTensorsGiveTheSameBytesAndAnAlignedHeader) {
  const std::string dir = TempDir();
  auto values = std::make_shared<std::vector<float>>(std::vector<float>{1, 2, 3});
  ASSERT_TRUE(
      Write(dir + "/1", {F32Tensor("x", {3}, values), F32Tensor("w", {1, 3}, values)}).ok());
  ASSERT_TRUE(
      Write(dir + "/2", {F32Tensor("w", {1, 3}, values), F32Tensor("x", {3}, values)}).ok());
  const std::string one = *ReadFileBytes(dir + "/1");
  EXPECT_EQ(one, *ReadFileBytes(dir + "/2"));
  uint64_t header = 0;
  std::memcpy(&header, one.data(), 8);
  EXPECT_EQ(header % 8, 0u);
  // The header is the JSON Hugging Face's loader expects.
  const auto json = nlohmann::json::parse(one.substr(8, header));
  EXPECT_EQ(json["x"]["dtype"], "F32");
  EXPECT_EQ(json["x"]["data_offsets"][1].get<int>() - json["x"]["data_offsets"][0].get<int>(), 12);
  EXPECT_FALSE(fs::exists(TempPathBeside(dir + "/1")));
}

TEST(Safetensors, AFailedWriteLeavesNothing) {
  const std::string dir = TempDir();
  TensorToWrite bad;
  bad.name = "x";
  bad.shape = {4};
  bad.fill = [](char*, int64_t) { return Status::Error("the source is gone"); };
  const Status s = Write(dir + "/m.safetensors", {bad});
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("the source is gone"), std::string::npos);
  EXPECT_TRUE(fs::is_empty(dir));
  EXPECT_FALSE(Write(dir + "/m", {bad, bad}).ok());  // repeated name
}

struct BadFile {
  const char* what;
  std::string bytes;
  const char* expect;
};

TEST(Safetensors, RefusesBadFilesNamingTheFileAndTheFault) {
  const std::string dir = TempDir();
  const std::string good = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  std::string long_length(8, '\xff');
  const std::vector<BadFile> cases = {
      {"empty", "", "shorter than the header length"},
      {"length past the end", long_length + "{}", "past the end"},
      {"not json", FileOf("{not json", 0), "not a JSON object"},
      {"json array", FileOf("[1,2]", 0), "not a JSON object"},
      {"unknown dtype", FileOf(R"({"a":{"dtype":"F8_E4M3","shape":[1],"data_offsets":[0,1]}})", 1),
       "dtype 'F8_E4M3'"},
      {"missing shape", FileOf(R"({"a":{"dtype":"F32","data_offsets":[0,4]}})", 4),
       "has no \"shape\""},
      {"negative dim", FileOf(R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", 4),
       "not a non-negative integer"},
      {"huge shape",
       FileOf(R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,4]}})", 4),
       "too large"},
      {"size mismatch", FileOf(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8),
       "need 12"},
      {"offsets reversed", FileOf(R"({"a":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", 8),
       "end before they begin"},
      {"past the end", FileOf(good, 4), "was the file truncated"},
      {"trailing bytes", FileOf(good, 12), "belong to no tensor"},
      {"overlap",
       FileOf(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
              R"("b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
              8),
       "overlaps"},
      {"hole", FileOf(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8), "hole"},
      {"metadata not strings", FileOf(R"({"__metadata__":{"k":1}})", 0), "not a string"},
      {"number out of range",
       FileOf(R"({"a":{"dtype":"F32","shape":[1e400],"data_offsets":[0,4]}})", 4), "not a JSON"},
  };
  for (const BadFile& c : cases) {
    const std::string path = dir + "/bad.safetensors";
    ASSERT_TRUE(WriteFileAtomic(path, c.bytes).ok());
    StatusOr<File> file = File::Open(path);
    ASSERT_FALSE(file.ok()) << c.what;
    const std::string message = file.status().message();
    EXPECT_EQ(message.rfind(path + ": ", 0), 0u) << c.what << ": " << message;
    EXPECT_NE(message.find(c.expect), std::string::npos) << c.what << ": " << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << c.what;
  }
  EXPECT_FALSE(File::Open(dir).ok());  // a directory
  EXPECT_FALSE(File::Open(dir + "/none").ok());
  ASSERT_TRUE(WriteFileAtomic(dir + "/ok", FileOf(good, 8)).ok());
  EXPECT_TRUE(File::Open(dir + "/ok").ok());
}

}  // namespace
}  // namespace dc::safetensors
