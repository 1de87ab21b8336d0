#include "executor/data.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <set>

#include "models/model.h"

namespace dc {
namespace {

proto::ModelConfig Tiny(const ModelOverrides& overrides = {}) {
  auto config = MakeConfig("tiny", overrides);
  EXPECT_TRUE(config.ok()) << config.status().message();
  return *config;
}

struct SampleTokens {
  std::vector<int32_t> tokens, targets;
  bool operator==(const SampleTokens&) const = default;
};

SampleTokens Take(const TokenSource& source, const proto::ModelConfig& config, int64_t index) {
  SampleTokens s{std::vector<int32_t>(config.seq()), std::vector<int32_t>(config.seq())};
  source.Sample(index, s.tokens.data(), s.targets.data());
  return s;
}

TEST(SyntheticData, DeterministicShiftedAndInRange) {
  const proto::ModelConfig config = Tiny();
  auto a = TokenSource::Open(config);
  auto b = TokenSource::Open(config);
  ASSERT_TRUE(a.ok() && b.ok());
  for (int64_t index : {0, 1, 17, 123456789}) {
    const SampleTokens s = Take(**a, config, index);
    EXPECT_EQ(s, Take(**b, config, index));
    for (int64_t p = 0; p < config.seq(); ++p) {
      EXPECT_GE(s.tokens[p], 0);
      EXPECT_LT(s.tokens[p], config.vocab());
      if (p + 1 < config.seq()) {
        EXPECT_EQ(s.targets[p], s.tokens[p + 1]);
      }
    }
  }
  EXPECT_NE(Take(**a, config, 0), Take(**a, config, 1));
}

TEST(SyntheticData, SeedChangesTheData) {
  ModelOverrides other_seed;
  other_seed.seed = 99;
  const proto::ModelConfig a = Tiny(), b = Tiny(other_seed);
  EXPECT_NE(Take(*TokenSource::Synthetic(a), a, 0), Take(*TokenSource::Synthetic(b), b, 0));
}

TEST(SyntheticData, IsLearnable) {
  // Most transitions follow one fixed successor per token; the rest are jumps.
  const proto::ModelConfig config = Tiny();
  const SyntheticDataOptions options;
  auto source = TokenSource::Synthetic(config, options);
  std::map<int32_t, std::map<int32_t, int>> successors;
  int transitions = 0;
  for (int64_t i = 0; i < 2000; ++i) {
    const SampleTokens s = Take(*source, config, i);
    for (int64_t p = 0; p < config.seq(); ++p) ++successors[s.tokens[p]][s.targets[p]];
    transitions += static_cast<int>(config.seq());
  }
  int predictable = 0;
  for (const auto& [token, next] : successors) {
    int best = 0;
    for (const auto& [_, count] : next) best = std::max(best, count);
    predictable += best;
  }
  const double fraction = static_cast<double>(predictable) / transitions;
  EXPECT_NEAR(fraction, 1.0 - options.jump_probability, 0.02);
}

TEST(SampleIndex, SameSetForEveryWorldSizeAtAFixedGlobalBatch) {
  struct Layout {
    int world;
    int64_t micro_batch, gas;
  };
  // A global batch of 8 sequences per optimizer step, laid out four ways.
  const Layout layouts[] = {{1, 4, 2}, {1, 8, 1}, {2, 2, 2}, {4, 2, 1}, {4, 1, 2}};
  std::set<int64_t> reference;
  for (const Layout& layout : layouts) {
    ModelOverrides o;
    o.micro_batch = layout.micro_batch;
    o.gas = layout.gas;
    const proto::ModelConfig config = Tiny(o);
    for (int64_t step : {0, 5}) {
      std::set<int64_t> indices;
      for (int rank = 0; rank < layout.world; ++rank) {
        for (int64_t micro = 0; micro < layout.gas; ++micro) {
          for (int64_t b = 0; b < layout.micro_batch; ++b) {
            EXPECT_TRUE(
                indices.insert(SampleIndex(config, layout.world, step, micro, rank, b)).second);
          }
        }
      }
      EXPECT_EQ(indices.size(), 8u);
      EXPECT_EQ(*indices.begin(), step * 8);
      EXPECT_EQ(*indices.rbegin(), step * 8 + 7);
    }
  }
}

class FileDataTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("dc_data_test_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::string Write(const std::string& name, const std::vector<uint16_t>& tokens,
                    bool extra_byte = false) {
    const std::string path = (dir_ / name).string();
    std::ofstream out(path, std::ios::binary);
    for (uint16_t t : tokens) {
      const char bytes[2] = {static_cast<char>(t & 0xff), static_cast<char>(t >> 8)};
      out.write(bytes, 2);
    }
    if (extra_byte) out.put('\0');
    return path;
  }

  proto::ModelConfig Config(const std::string& path, int64_t seq, int64_t vocab) {
    ModelOverrides o;
    o.data_path = path;
    o.seq = seq;
    o.vocab = vocab;
    return Tiny(o);
  }

  std::string OpenError(const proto::ModelConfig& config) {
    auto source = TokenSource::Open(config);
    EXPECT_FALSE(source.ok());
    return source.status().message();
  }

  std::filesystem::path dir_;
};

TEST_F(FileDataTest, ReadsWindowsInOrder) {
  std::vector<uint16_t> tokens(20);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint16_t>(300 + i);
  const std::string path = Write("tokens.bin", tokens);
  const proto::ModelConfig config = Config(path, 4, 1000);
  auto source = TokenSource::Open(config);
  ASSERT_TRUE(source.ok()) << source.status().message();
  // Sample i starts at (i * seq) mod (n - seq) = (4 i) mod 16.
  const SampleTokens s0 = Take(**source, config, 0);
  EXPECT_EQ(s0.tokens, (std::vector<int32_t>{300, 301, 302, 303}));
  EXPECT_EQ(s0.targets, (std::vector<int32_t>{301, 302, 303, 304}));
  const SampleTokens s3 = Take(**source, config, 3);
  EXPECT_EQ(s3.tokens, (std::vector<int32_t>{312, 313, 314, 315}));
  EXPECT_EQ(s3.targets, (std::vector<int32_t>{313, 314, 315, 316}));
  EXPECT_EQ(Take(**source, config, 4), s0);
}

// A long run's sample index times seq passes int64: the window's start is still the exact
// (index * seq) mod (n - seq), without signed overflow.
TEST_F(FileDataTest, HugeSampleIndicesWrapExactly) {
  std::vector<uint16_t> tokens(21);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint16_t>(i);
  const std::string path = Write("tokens.bin", tokens);
  const proto::ModelConfig config = Config(path, 4, 1000);
  auto source = TokenSource::Open(config);
  ASSERT_TRUE(source.ok()) << source.status().message();
  const int64_t index = std::numeric_limits<int64_t>::max();
  // (2^63 - 1) * 4 mod 17, by hand: 2^63 - 1 = 17 * 542551296285575047 + 8, so 8 * 4 mod 17 = 15.
  const int64_t start = 15;
  const SampleTokens s = Take(**source, config, index);
  EXPECT_EQ(s.tokens, (std::vector<int32_t>{start, start + 1, start + 2, start + 3}));
}

TEST_F(FileDataTest, ReadsTheHighByte) {
  const std::string path = Write("wide.bin", {0x1234, 0xfffe, 7});
  const proto::ModelConfig config = Config(path, 2, 65536);
  auto source = TokenSource::Open(config);
  ASSERT_TRUE(source.ok()) << source.status().message();
  const SampleTokens s = Take(**source, config, 0);
  EXPECT_EQ(s.tokens, (std::vector<int32_t>{0x1234, 0xfffe}));
  EXPECT_EQ(s.targets, (std::vector<int32_t>{0xfffe, 7}));
}

TEST_F(FileDataTest, RejectsBadFiles) {
  const std::string missing = (dir_ / "missing.bin").string();
  std::string message = OpenError(Config(missing, 4, 1000));
  EXPECT_NE(message.find(missing + ": cannot open token file"), std::string::npos) << message;

  const std::string odd = Write("odd.bin", {1, 2, 3, 4, 5, 6}, /*extra_byte=*/true);
  message = OpenError(Config(odd, 4, 1000));
  EXPECT_NE(message.find(odd + ": 13 bytes is not a whole number of uint16 tokens"),
            std::string::npos)
      << message;

  const std::string short_file = Write("short.bin", {1, 2, 3, 4});
  message = OpenError(Config(short_file, 4, 1000));
  EXPECT_NE(message.find(short_file + ": holds 4 tokens, fewer than --seq 4 + 1"),
            std::string::npos)
      << message;

  const std::string empty = Write("empty.bin", {});
  message = OpenError(Config(empty, 4, 1000));
  EXPECT_NE(message.find("holds 0 tokens"), std::string::npos) << message;

  const std::string big = Write("big.bin", {1, 2, 3, 999, 4, 5});
  message = OpenError(Config(big, 4, 500));
  EXPECT_NE(message.find(big + ": token 999 at position 3 is not below --vocab 500"),
            std::string::npos)
      << message;

  message = OpenError(Config(dir_.string(), 4, 1000));
  EXPECT_NE(message.find("not a regular file"), std::string::npos) << message;
}

proto::Tensor ParamTensor(const std::string& name, std::vector<int64_t> shape) {
  proto::Tensor t;
  t.set_name(name);
  for (int64_t d : shape) t.add_shape(d);
  t.set_dtype(proto::DTYPE_F32);
  t.set_role(proto::ROLE_PARAM);
  return t;
}

// A launcher's digest stands for the file only while the file is as the launcher saw it.
TEST_F(FileDataTest, RanksTakeTheLaunchersDigestOfAnUnchangedFile) {
  const std::string path = Write("tokens.bin", std::vector<uint16_t>(4096, 7));
  proto::ModelConfig launcher = Config(path, 32, 256);
  ASSERT_TRUE(RecordDataFile(&launcher).ok());
  const std::string real = launcher.data_sha256();
  ASSERT_EQ(real.size(), 64u);
  // A note whose digest differs from the file's shows which one a rank took.
  std::string note = DataDigestNote(launcher);
  ASSERT_EQ(note.substr(0, 64), real);
  note.replace(0, 64, std::string(64, 'a'));
  ::setenv(kDataDigestVar, note.c_str(), 1);
  proto::ModelConfig rank = Config(path, 32, 256);
  ASSERT_TRUE(RecordDataFile(&rank).ok());
  EXPECT_EQ(rank.data_sha256(), std::string(64, 'a'));  // taken, not read again
  // The file changed (another size): the note no longer stands for it.
  Write("tokens.bin", std::vector<uint16_t>(4097, 7));
  proto::ModelConfig changed = Config(path, 32, 256);
  ASSERT_TRUE(RecordDataFile(&changed).ok());
  EXPECT_NE(changed.data_sha256(), std::string(64, 'a'));
  EXPECT_NE(changed.data_sha256(), real);
  // A malformed note is ignored.
  ::setenv(kDataDigestVar, "not a digest", 1);
  proto::ModelConfig malformed = Config(path, 32, 256);
  ASSERT_TRUE(RecordDataFile(&malformed).ok());
  EXPECT_EQ(malformed.data_sha256(), changed.data_sha256());
  ::unsetenv(kDataDigestVar);
}

TEST(InitParamSlice, SliceEqualsTheSameRangeOfTheWhole) {
  const proto::ModelConfig config = Tiny();
  const proto::Tensor t = ParamTensor("layers.0.attn.wq", {64, 63});
  const int64_t n = 64 * 63;
  std::vector<float> whole(n);
  InitParamSlice(config, t, 0, n, whole.data());
  for (int world : {2, 3, 4, 7}) {
    const int64_t shard = ShardElements(n, world);
    for (int rank = 0; rank < world; ++rank) {
      std::vector<float> slice(shard, -1.0f);
      InitParamSlice(config, t, rank * shard, shard, slice.data());
      for (int64_t i = 0; i < shard; ++i) {
        const int64_t global = rank * shard + i;
        ASSERT_EQ(slice[i], global < n ? whole[global] : 0.0f) << world << " " << global;
      }
    }
  }
  // Odd offsets and lengths split the Box-Muller pairs.
  std::vector<float> odd(5);
  InitParamSlice(config, t, 101, 5, odd.data());
  for (int i = 0; i < 5; ++i) EXPECT_EQ(odd[i], whole[101 + i]);
}

TEST(InitParamSlice, ALargeSliceMadeOnManyThreadsEqualsItsPiecesMadeOnOne) {
  const proto::ModelConfig config = Tiny();
  const int64_t rows = 3 * 1024 + 1, cols = 1025;  // 3.1 M elements: several threads' worth
  const proto::Tensor t = ParamTensor("layers.0.mlp.w_up", {rows, cols});
  const int64_t n = rows * cols, offset = 11;  // an odd start splits a pair at every boundary
  std::vector<float> large(n - offset, -1.0f);
  InitParamSlice(config, t, offset, n - offset, large.data());
  // Pieces of 7 (one thread each) across the whole range, thread boundaries included.
  for (int64_t begin = offset; begin + 7 <= n; begin += 104729) {
    std::vector<float> piece(7, -1.0f);
    InitParamSlice(config, t, begin, 7, piece.data());
    for (int64_t i = 0; i < 7; ++i) ASSERT_EQ(large[begin - offset + i], piece[i]) << begin + i;
  }
  for (int64_t split = 1; split < 64; ++split) {  // around every share up to 64 threads
    const int64_t at = offset + (n - offset) * split / 64;
    std::vector<float> piece(2, -1.0f);
    InitParamSlice(config, t, at - 1, 2, piece.data());
    ASSERT_EQ(large[at - 1 - offset], piece[0]) << at;
    ASSERT_EQ(large[at - offset], piece[1]) << at;
  }
  EXPECT_NE(large.back(), -1.0f);
}

double StdDev(const std::vector<float>& values) {
  double sum = 0, sum_sq = 0;
  for (float v : values) {
    sum += v;
    sum_sq += static_cast<double>(v) * v;
  }
  const double mean = sum / static_cast<double>(values.size());
  return std::sqrt(sum_sq / static_cast<double>(values.size()) - mean * mean);
}

TEST(InitParamSlice, DistributionsByKind) {
  const proto::ModelConfig config = Tiny();
  const int64_t n = 256 * 64;
  std::vector<float> values(n);
  InitParamSlice(config, ParamTensor("embed", {256, 64}), 0, n, values.data());
  EXPECT_NEAR(StdDev(values), config.init_std(), 0.05 * config.init_std());

  InitParamSlice(config, ParamTensor("layers.1.mlp.w_down", {64, 256}), 0, n, values.data());
  const double scaled = config.init_std() / std::sqrt(2.0 * config.layers());
  EXPECT_NEAR(StdDev(values), scaled, 0.05 * scaled);

  std::vector<float> norm(64);
  InitParamSlice(config, ParamTensor("layers.1.attn_norm", {64}), 0, 64, norm.data());
  for (float v : norm) EXPECT_EQ(v, 1.0f);

  std::vector<float> a(8), b(8);
  InitParamSlice(config, ParamTensor("layers.0.attn.wq", {64, 64}), 0, 8, a.data());
  InitParamSlice(config, ParamTensor("layers.0.attn.wk", {64, 64}), 0, 8, b.data());
  EXPECT_NE(a, b);
}

}  // namespace
}  // namespace dc
