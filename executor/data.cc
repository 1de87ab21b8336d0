#include "executor/data.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <numbers>
#include <thread>
#include <vector>

#include "models/param_names.h"
#include "models/random.h"
#include "schemas/digest.h"

namespace dc {
namespace {

// Independent random streams, one per use.
enum Stream : uint64_t {
  kStreamPermutation = 1,
  kStreamStartToken = 2,
  kStreamStep = 3,
  kStreamInit = 4,
};

uint64_t StreamKey(uint64_t seed, Stream stream) { return random::Combine(seed, stream); }

// InitParamSlice's share of elements per host thread (below it, one thread).
constexpr int64_t kInitElementsPerThread = int64_t{1} << 20;

class SyntheticTokenSource : public TokenSource {
 public:
  SyntheticTokenSource(const proto::ModelConfig& config, const SyntheticDataOptions& options)
      : seq_(config.seq()),
        vocab_(static_cast<uint64_t>(config.vocab())),
        jump_probability_(options.jump_probability),
        start_key_(StreamKey(config.seed(), kStreamStartToken)),
        step_key_(StreamKey(config.seed(), kStreamStep)),
        next_(config.vocab()) {
    // Fisher-Yates shuffle driven by the counter-based hash.
    const uint64_t key = StreamKey(config.seed(), kStreamPermutation);
    for (uint64_t i = 0; i < vocab_; ++i) next_[i] = static_cast<int32_t>(i);
    for (uint64_t i = vocab_ - 1; i > 0; --i) {
      std::swap(next_[i], next_[random::Combine(key, i) % (i + 1)]);
    }
  }

  void Sample(int64_t index, int32_t* tokens, int32_t* targets) const override {
    const uint64_t sample_key = random::Combine(step_key_, static_cast<uint64_t>(index));
    int32_t token =
        static_cast<int32_t>(random::Combine(start_key_, static_cast<uint64_t>(index)) % vocab_);
    for (int64_t pos = 0; pos < seq_; ++pos) {
      tokens[pos] = token;
      const uint64_t h = random::Combine(sample_key, static_cast<uint64_t>(pos));
      if (random::UnitInterval(h) < jump_probability_) {
        token = static_cast<int32_t>(random::Mix64(h) % vocab_);
      } else {
        token = next_[token];
      }
      targets[pos] = token;
    }
  }

 private:
  const int64_t seq_;
  const uint64_t vocab_;
  const double jump_probability_;
  const uint64_t start_key_, step_key_;
  std::vector<int32_t> next_;  // the permutation: token -> its usual successor
};

// A read-only memory map of a whole file, unmapped on destruction.
class MappedFile {
 public:
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile() {
    if (data_ != nullptr) munmap(data_, size_bytes_);
  }

  // `what_to_do` ends every error message.
  static StatusOr<std::unique_ptr<MappedFile>> Open(const std::string& path,
                                                    const std::string& what_to_do) {
    const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      return Status::Error(path + ": cannot open token file (" + std::strerror(errno) + "); " +
                           what_to_do);
    }
    struct stat st {};
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      close(fd);
      return Status::Error(path + ": not a regular file; " + what_to_do);
    }
    std::unique_ptr<MappedFile> file(new MappedFile(static_cast<size_t>(st.st_size)));
    if (file->size_bytes_ > 0) {
      void* data = mmap(nullptr, file->size_bytes_, PROT_READ, MAP_PRIVATE, fd, 0);
      if (data == MAP_FAILED) {
        const std::string reason = std::strerror(errno);
        close(fd);
        return Status::Error(path + ": cannot map token file (" + reason + "); " + what_to_do);
      }
      file->data_ = data;
    }
    close(fd);
    return file;
  }

  const unsigned char* bytes() const { return static_cast<const unsigned char*>(data_); }
  size_t size_bytes() const { return size_bytes_; }

 private:
  explicit MappedFile(size_t size_bytes) : size_bytes_(size_bytes) {}
  void* data_ = nullptr;
  size_t size_bytes_;
};

constexpr int64_t kTokenBytes = 2;  // uint16 little-endian, as nanoGPT's prepare.py writes

class FileTokenSource : public TokenSource {
 public:
  // `what_to_do` ends the messages of a file that cannot be read.
  static StatusOr<std::unique_ptr<FileTokenSource>> Open(const proto::ModelConfig& config,
                                                         const std::string& path,
                                                         const std::string& what_to_do) {
    DC_ASSIGN_OR_RETURN(std::unique_ptr<MappedFile> file, MappedFile::Open(path, what_to_do));
    const int64_t size_bytes = static_cast<int64_t>(file->size_bytes());
    if (size_bytes % kTokenBytes != 0) {
      return Status::Error(path + ": " + std::to_string(size_bytes) +
                           " bytes is not a whole number of uint16 tokens; is it a nanoGPT .bin "
                           "token file?");
    }
    const int64_t num_tokens = size_bytes / kTokenBytes;
    if (num_tokens < config.seq() + 1) {
      return Status::Error(path + ": holds " + std::to_string(num_tokens) +
                           " tokens, fewer than --seq " + std::to_string(config.seq()) +
                           " + 1; use a longer file or a shorter --seq");
    }
    std::unique_ptr<FileTokenSource> source(
        new FileTokenSource(std::move(file), num_tokens, config.seq()));
    for (int64_t i = 0; i < num_tokens; ++i) {
      const int64_t token = source->TokenAt(i);
      if (token >= config.vocab()) {
        return Status::Error(path + ": token " + std::to_string(token) + " at position " +
                             std::to_string(i) + " is not below --vocab " +
                             std::to_string(config.vocab()) +
                             "; set --vocab to the tokenizer's vocabulary size");
      }
    }
    return source;
  }

  int64_t num_tokens() const { return num_tokens_; }

  // Windows start at index * seq, wrapping so that seq + 1 tokens always fit: consecutive
  // samples read consecutive stretches of the file. The product in 128 bits: a long run's index
  // times seq may pass int64.
  void Sample(int64_t index, int32_t* tokens, int32_t* targets) const override {
    const int64_t start =
        static_cast<int64_t>(static_cast<unsigned __int128>(index) * static_cast<uint64_t>(seq_) %
                             static_cast<uint64_t>(num_tokens_ - seq_));
    for (int64_t pos = 0; pos < seq_; ++pos) {
      tokens[pos] = TokenAt(start + pos);
      targets[pos] = TokenAt(start + pos + 1);
    }
  }

 private:
  FileTokenSource(std::unique_ptr<MappedFile> file, int64_t num_tokens, int64_t seq)
      : file_(std::move(file)), num_tokens_(num_tokens), seq_(seq) {}

  int32_t TokenAt(int64_t i) const {
    const unsigned char* p = file_->bytes() + i * kTokenBytes;
    return static_cast<int32_t>(p[0] | (p[1] << 8));
  }

  std::unique_ptr<MappedFile> file_;
  const int64_t num_tokens_, seq_;
};

// Two residual branches (attention, MLP) write into the stream per layer.
constexpr double kResidualBranchesPerLayer = 2;

// A standard normal pair (Box-Muller) from one 64-bit hash: u1 from the top 32 bits (never 0),
// u2 from the bottom 32.
void NormalPair(uint64_t bits, double* a, double* b) {
  constexpr double kTwoToMinus32 = 1.0 / 4294967296.0;
  constexpr uint64_t kLow32 = 0xffffffffULL;
  const double u1 = (static_cast<double>(bits >> 32) + 1.0) * kTwoToMinus32;
  const double u2 = static_cast<double>(bits & kLow32) * kTwoToMinus32;
  const double radius = std::sqrt(-2.0 * std::log(u1));
  const double angle = 2.0 * std::numbers::pi * u2;
  *a = radius * std::cos(angle);
  *b = radius * std::sin(angle);
}

}  // namespace

StatusOr<std::unique_ptr<TokenSource>> TokenSource::Open(const proto::ModelConfig& config) {
  if (config.data_path().empty()) return Synthetic(config);
  DC_ASSIGN_OR_RETURN(std::unique_ptr<FileTokenSource> source,
                      FileTokenSource::Open(config, config.data_path(),
                                            "pass a flat uint16 token file (nanoGPT .bin) to "
                                            "--data, or leave --data unset for synthetic tokens"));
  return std::unique_ptr<TokenSource>(std::move(source));
}

StatusOr<std::unique_ptr<TokenSource>> OpenEvalData(const proto::ModelConfig& config,
                                                    const std::string& path, int64_t batches,
                                                    int64_t batch_sequences) {
  DC_ASSIGN_OR_RETURN(
      std::unique_ptr<FileTokenSource> source,
      FileTokenSource::Open(config, path,
                            "pass a flat uint16 token file (nanoGPT .bin) to --eval-data"));
  if (batches < 1 || batch_sequences < 1) {
    return Status::Error(path + ": an evaluation needs at least one batch of one sequence");
  }
  // In 128 bits: counts from the command line and the plan.
  const unsigned __int128 needed = static_cast<unsigned __int128>(batches) *
                                       static_cast<uint64_t>(batch_sequences) *
                                       static_cast<uint64_t>(config.seq()) +
                                   1;
  if (needed > static_cast<unsigned __int128>(source->num_tokens())) {
    return Status::Error(path + ": holds " + std::to_string(source->num_tokens()) +
                         " tokens, fewer than the " + std::to_string(batches) + " x " +
                         std::to_string(batch_sequences) + " x " + std::to_string(config.seq()) +
                         " + 1 that --eval-batches " + std::to_string(batches) +
                         " needs (batches x sequences per global batch x --seq, and one more); "
                         "use a longer file or fewer --eval-batches");
  }
  return std::unique_ptr<TokenSource>(std::move(source));
}

std::unique_ptr<TokenSource> TokenSource::Synthetic(const proto::ModelConfig& config,
                                                    const SyntheticDataOptions& options) {
  return std::make_unique<SyntheticTokenSource>(config, options);
}

namespace {

// What identifies a file's content without reading it, for a launcher's digest to stand for
// it: "<size> <modification time in ns> <path>".
std::string FileIdentity(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return "";
  const int64_t mtime_ns =
      static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
  return std::to_string(st.st_size) + " " + std::to_string(mtime_ns) + " " + path;
}

// The digest a launcher left in kDataDigestVar for `path`, if it is for this file as it is now.
std::string LaunchersDigest(const std::string& path) {
  const char* note = std::getenv(kDataDigestVar);
  if (note == nullptr) return "";
  const std::string text = note;
  constexpr size_t kHexDigits = 64;
  if (text.size() <= kHexDigits + 1 || text[kHexDigits] != ' ') return "";
  const std::string sha256 = text.substr(0, kHexDigits);
  if (sha256.find_first_not_of("0123456789abcdef") != std::string::npos) return "";
  const std::string identity = FileIdentity(path);
  return !identity.empty() && text.substr(kHexDigits + 1) == identity ? sha256 : "";
}

}  // namespace

Status RecordDataFile(proto::ModelConfig* config) {
  if (config->data_path().empty()) return Status::Ok();
  std::error_code error;
  const std::filesystem::path absolute = std::filesystem::absolute(config->data_path(), error);
  if (error) return Status::Error(config->data_path() + ": " + error.message());
  config->set_data_path(absolute.lexically_normal().string());
  DC_RETURN_IF_ERROR(TokenSource::Open(*config).status());
  std::string sha256 = LaunchersDigest(config->data_path());
  if (sha256.empty()) {
    DC_ASSIGN_OR_RETURN(sha256, Sha256OfFile(config->data_path()));
  }
  config->set_data_sha256(sha256);
  return Status::Ok();
}

std::string DataDigestNote(const proto::ModelConfig& config) {
  if (config.data_path().empty() || config.data_sha256().empty()) return "";
  const std::string identity = FileIdentity(config.data_path());
  return identity.empty() ? "" : config.data_sha256() + " " + identity;
}

Status CheckDataFile(const proto::ModelConfig& config) {
  if (config.data_path().empty() || config.data_sha256().empty()) return Status::Ok();
  StatusOr<std::string> sha256 = Sha256OfFile(config.data_path());
  if (!sha256.ok()) {
    return Status::Error(sha256.status().message() +
                         "; the plan trains on this token file: restore it, re-plan, or pass "
                         "--data FILE");
  }
  if (*sha256 != config.data_sha256()) {
    return Status::Error(config.data_path() +
                         ": the token file changed since the plan was made "
                         "(SHA-256 " +
                         sha256->substr(0, 12) + "..., the plan recorded " +
                         config.data_sha256().substr(0, 12) + "...); re-plan, or pass --data " +
                         config.data_path() + " to train on it as it is now");
  }
  return Status::Ok();
}

int64_t SampleIndex(const proto::ModelConfig& config, int world_size, int64_t step,
                    int64_t micro_step, int rank, int64_t b) {
  return ((step * config.gas() + micro_step) * world_size + rank) * config.micro_batch() + b;
}

void InitParamSlice(const proto::ModelConfig& config, const proto::Tensor& tensor, int64_t offset,
                    int64_t count, float* out) {
  const int64_t num_elements = NumElements(tensor);
  const int64_t end = offset + count;
  const int64_t valid_end = std::min(end, num_elements);
  for (int64_t i = std::max(valid_end, offset); i < end; ++i) out[i - offset] = 0.0f;
  if (tensor.shape_size() == 1) {
    for (int64_t i = offset; i < valid_end; ++i) out[i - offset] = 1.0f;
    return;
  }
  double std_dev = config.init_std();
  if (param_names::IsResidualOutputProjection(tensor.name())) {
    std_dev /= std::sqrt(kResidualBranchesPerLayer * static_cast<double>(config.layers()));
  }
  const uint64_t key =
      random::Combine(StreamKey(config.seed(), kStreamInit), random::HashName(tensor.name()));
  // Elements 2j and 2j + 1 are the two halves of normal pair j.
  const auto fill = [&](int64_t begin, int64_t stop) {
    for (int64_t i = begin; i < stop;) {
      const int64_t pair = i / 2;
      double even = 0, odd = 0;
      NormalPair(random::Combine(key, static_cast<uint64_t>(pair)), &even, &odd);
      if (i % 2 == 0) {
        out[i - offset] = static_cast<float>(std_dev * even);
        ++i;
        if (i >= stop) break;
      }
      out[i - offset] = static_cast<float>(std_dev * odd);
      ++i;
    }
  };
  // Each element is a function of its index alone, so the slice splits across the host's cores
  // with the same values (a 1B model's 1.2 G normals take half a minute on one core).
  const int64_t valid = std::max<int64_t>(valid_end - offset, 0);
  const int64_t threads = std::clamp<int64_t>(
      valid / kInitElementsPerThread, 1, std::max<int64_t>(1, std::thread::hardware_concurrency()));
  if (threads == 1) {
    fill(offset, valid_end);
    return;
  }
  std::vector<std::thread> workers;
  workers.reserve(static_cast<size_t>(threads));
  for (int64_t t = 0; t < threads; ++t) {
    workers.emplace_back(fill, offset + valid * t / threads, offset + valid * (t + 1) / threads);
  }
  for (auto& worker : workers) worker.join();
}

}  // namespace dc
