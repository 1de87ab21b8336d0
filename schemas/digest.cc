#include "schemas/digest.h"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>
#include <openssl/evp.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <memory>
#include <vector>

namespace dc {

namespace {

std::string Hex(const unsigned char* md, unsigned int md_len) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string hex;
  hex.reserve(md_len * 2);
  for (unsigned int i = 0; i < md_len; ++i) {
    hex.push_back(kHex[md[i] >> 4]);
    hex.push_back(kHex[md[i] & 0xF]);
  }
  return hex;
}

}  // namespace

std::string Sha256Hex(std::string_view bytes) {
  std::array<unsigned char, EVP_MAX_MD_SIZE> md{};
  unsigned int md_len = 0;
  EVP_Digest(bytes.data(), bytes.size(), md.data(), &md_len, EVP_sha256(), nullptr);
  return Hex(md.data(), md_len);
}

StatusOr<std::string> Sha256OfFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::Error(path + ": cannot open (" + std::strerror(errno) + ")");
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> context(EVP_MD_CTX_new(),
                                                                  &EVP_MD_CTX_free);
  if (!context || EVP_DigestInit_ex(context.get(), EVP_sha256(), nullptr) != 1) {
    return Status::Error(path + ": cannot start a SHA-256 digest");
  }
  std::vector<char> buffer(1 << 20);
  while (in) {
    in.read(buffer.data(), static_cast<std::streamsize>(buffer.size()));
    EVP_DigestUpdate(context.get(), buffer.data(), static_cast<size_t>(in.gcount()));
  }
  if (in.bad()) return Status::Error(path + ": read failed");
  std::array<unsigned char, EVP_MAX_MD_SIZE> md{};
  unsigned int md_len = 0;
  EVP_DigestFinal_ex(context.get(), md.data(), &md_len);
  return Hex(md.data(), md_len);
}

std::string CanonicalBytes(const google::protobuf::Message& message) {
  std::string bytes;
  {
    google::protobuf::io::StringOutputStream raw(&bytes);
    google::protobuf::io::CodedOutputStream coded(&raw);
    coded.SetSerializationDeterministic(true);
    message.SerializeToCodedStream(&coded);
  }
  return bytes;
}

std::string DigestOf(const google::protobuf::Message& message) {
  return Sha256Hex(CanonicalBytes(message));
}

}  // namespace dc
