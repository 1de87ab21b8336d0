#include "weights/hf.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "models/model.h"
#include "schemas/files.h"
#include "schemas/float16.h"

namespace dc::hf {
namespace {

namespace fs = std::filesystem;

std::string TempDir() {
  const fs::path dir =
      fs::temp_directory_path() / ("dc-hf-" + std::to_string(::getpid()) + "-" +
                                   ::testing::UnitTest::GetInstance()->current_test_info()->name());
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir.string();
}

proto::Program Program(const std::string& preset) {
  auto config = MakeConfig(preset, {});
  EXPECT_TRUE(config.ok()) << config.status().message();
  auto program = BuildProgram(*config);
  EXPECT_TRUE(program.ok()) << program.status().message();
  return *program;
}

TEST(HfNames, LlamaAndMixtralParamsMapOneToOne) {
  EXPECT_EQ(*ParamName("embed"), "model.embed_tokens.weight");
  EXPECT_EQ(*ParamName("final_norm"), "model.norm.weight");
  EXPECT_EQ(*ParamName("lm_head"), "lm_head.weight");
  EXPECT_EQ(*ParamName("layers.3.attn.wq"), "model.layers.3.self_attn.q_proj.weight");
  EXPECT_EQ(*ParamName("layers.0.attn_norm"), "model.layers.0.input_layernorm.weight");
  EXPECT_EQ(*ParamName("layers.0.mlp_norm"), "model.layers.0.post_attention_layernorm.weight");
  EXPECT_EQ(*ParamName("layers.1.mlp.w_down"), "model.layers.1.mlp.down_proj.weight");
  EXPECT_EQ(*ParamName("layers.1.moe.router"), "model.layers.1.block_sparse_moe.gate.weight");
  EXPECT_EQ(*ParamName("layers.1.experts.7.mlp.w_gate"),
            "model.layers.1.block_sparse_moe.experts.7.w1.weight");
  EXPECT_EQ(*ParamName("layers.1.experts.7.mlp.w_down"),
            "model.layers.1.block_sparse_moe.experts.7.w2.weight");
  EXPECT_EQ(*ParamName("layers.1.experts.7.mlp.w_up"),
            "model.layers.1.block_sparse_moe.experts.7.w3.weight");
  EXPECT_FALSE(ParamName("layers.x.attn.wq").ok());
  EXPECT_FALSE(ParamName("layers.0.experts.1.mlp.w_side").ok());
  EXPECT_FALSE(ParamName("tokens").ok());
}

// The config's param shapes are exactly the program's params, by HF name, for both families.
TEST(HfConfig, DescribesTheProgramsParams) {
  for (const char* preset : {"tiny", "small", "mixtral-tiny"}) {
    const proto::Program program = Program(preset);
    const Config config = ConfigOf(program.config());
    EXPECT_TRUE(CheckMatchesProgram(config, "config.json", program).ok()) << preset;
    size_t params = 0;
    for (const auto& t : program.tensors()) params += t.role() == proto::ROLE_PARAM;
    EXPECT_EQ(ParamShapes(config).size(), params) << preset;
  }
}

TEST(HfConfig, JsonRoundTripsAndHasTheLoadersFields) {
  const proto::Program program = Program("mixtral-tiny");
  const Config config = ConfigOf(program.config());
  const std::string text = ConfigJson(config);
  EXPECT_EQ(text, ConfigJson(config));
  const nlohmann::json j = nlohmann::json::parse(text);
  EXPECT_EQ(j["architectures"][0], "MixtralForCausalLM");
  EXPECT_EQ(j["model_type"], "mixtral");
  EXPECT_EQ(j["num_local_experts"], 8);
  EXPECT_EQ(j["num_experts_per_tok"], 2);
  EXPECT_EQ(j["tie_word_embeddings"], false);
  EXPECT_EQ(j["rope_theta"], 1e6);
  auto back = ParseConfigJson(text, "config.json");
  ASSERT_TRUE(back.ok()) << back.status().message();
  EXPECT_EQ(ConfigJson(*back), text);
}

TEST(HfConfig, RefusesWhatDcDoesNotCompute) {
  const std::string llama = ConfigJson(ConfigOf(Program("tiny").config()));
  auto with = [&](const std::string& key, const nlohmann::json& value) {
    nlohmann::json j = nlohmann::json::parse(llama);
    if (value.is_null()) {
      j.erase(key);
    } else {
      j[key] = value;
    }
    return ParseConfigJson(j.dump(), "m/config.json").status().message();
  };
  EXPECT_EQ(with("architectures", {"GPT2LMHeadModel"}),
            "m/config.json: architecture GPT2LMHeadModel is not supported; dc reads "
            "LlamaForCausalLM and MixtralForCausalLM");
  EXPECT_NE(with("hidden_size", nullptr).find("has no \"hidden_size\""), std::string::npos);
  EXPECT_NE(with("hidden_size", "64").find("not a whole number"), std::string::npos);
  EXPECT_NE(with("num_key_value_heads", 3).find("must divide"), std::string::npos);
  EXPECT_NE(with("rope_scaling", {{"type", "llama3"}}).find("rope_scaling"), std::string::npos);
  EXPECT_NE(with("hidden_act", "gelu").find("hidden_act"), std::string::npos);
  EXPECT_NE(with("attention_bias", true).find("no biases"), std::string::npos);
  EXPECT_NE(ParseConfigJson("[1]", "c.json").status().message().find("not a JSON object"),
            std::string::npos);
}

TEST(HfConfig, AMismatchNamesTheTensorAndBothShapes) {
  const proto::Program program = Program("tiny");
  Config config = ConfigOf(program.config());
  config.intermediate_size = 96;
  EXPECT_EQ(CheckMatchesProgram(config, "d/config.json", program).message(),
            "d/config.json: model.layers.0.mlp.gate_proj.weight is [96, 64] there but [128, 64] "
            "in the plan's model tiny; plan for the model this config.json describes");
  config = ConfigOf(program.config());
  config.num_hidden_layers = 3;
  EXPECT_NE(CheckMatchesProgram(config, "d/config.json", program)
                .message()
                .find("describes model.layers.2.input_layernorm.weight [64]"),
            std::string::npos);
  config = ConfigOf(program.config());
  config.rope_theta = 5e5;
  EXPECT_NE(CheckMatchesProgram(config, "d/config.json", program).message().find("rope_theta"),
            std::string::npos);
  EXPECT_NE(
      CheckMatchesProgram(ConfigOf(Program("mixtral-tiny").config()), "d/config.json", program)
          .message()
          .find("a MixtralForCausalLM, but the plan's model (tiny) is a LlamaForCausalLM"),
      std::string::npos);
}

// A directory in HF's sharded layout with bf16 weights, as save_pretrained writes one.
TEST(HfModelDir, ReadsShardedBf16Checkpoints) {
  const std::string dir = TempDir();
  const proto::Program program = Program("tiny");
  const Config config = ConfigOf(program.config());
  ASSERT_TRUE(WriteFileAtomic(dir + "/config.json", ConfigJson(config)).ok());
  std::vector<safetensors::TensorToWrite> shard[2];
  nlohmann::json weight_map;
  int i = 0;
  for (const auto& [name, shape] : ParamShapes(config)) {
    safetensors::TensorToWrite t;
    t.name = name;
    t.dtype = proto::DTYPE_BF16;
    t.shape = shape;
    t.fill = [](char* out, int64_t bytes) {
      for (int64_t e = 0; e < bytes / 2; ++e) {
        const uint16_t v = FloatToBf16(0.25f * static_cast<float>(e % 7) - 0.5f);
        std::memcpy(out + 2 * e, &v, 2);
      }
      return Status::Ok();
    };
    const std::string file = "model-0000" + std::to_string(i % 2 + 1) + "-of-00002.safetensors";
    weight_map[name] = file;
    shard[i % 2].push_back(t);
    ++i;
  }
  ASSERT_TRUE(safetensors::Write(dir + "/model-00001-of-00002.safetensors", shard[0]).ok());
  ASSERT_TRUE(safetensors::Write(dir + "/model-00002-of-00002.safetensors", shard[1]).ok());
  ASSERT_TRUE(
      WriteFileAtomic(
          dir + "/" + kIndexFile,
          nlohmann::json{{"metadata", {{"total_size", 1}}}, {"weight_map", weight_map}}.dump())
          .ok());
  auto m = ModelDir::Open(dir);
  ASSERT_TRUE(m.ok()) << m.status().message();
  ASSERT_TRUE(m->CheckMatchesProgram(program).ok()) << m->CheckMatchesProgram(program).message();
  auto entry = m->Find("model.layers.1.self_attn.k_proj.weight");
  ASSERT_TRUE(entry.ok());
  std::vector<float> values(9);
  ASSERT_TRUE(entry->file->ReadF32(*entry->info, 3, 9, values.data()).ok());
  for (int e = 0; e < 9; ++e) EXPECT_EQ(values[e], 0.25f * static_cast<float>((e + 3) % 7) - 0.5f);

  // A tensor the index names but its file lacks, and a missing file, are refused.
  for (auto& [name, file] : weight_map.items()) {
    if (file == "model-00002-of-00002.safetensors") {
      file = "model-00001-of-00002.safetensors";
      break;
    }
  }
  ASSERT_TRUE(
      WriteFileAtomic(dir + "/" + kIndexFile, nlohmann::json{{"weight_map", weight_map}}.dump())
          .ok());
  EXPECT_NE(ModelDir::Open(dir).status().message().find("which does not hold it"),
            std::string::npos);
  fs::remove(dir + "/" + kIndexFile);
  EXPECT_NE(ModelDir::Open(dir).status().message().find("model.safetensors"), std::string::npos);
}

TEST(HfModelDir, RefusesMissingTensorsAndWrongShapes) {
  const std::string dir = TempDir();
  const proto::Program program = Program("tiny");
  const Config config = ConfigOf(program.config());
  ASSERT_TRUE(WriteFileAtomic(dir + "/config.json", ConfigJson(config)).ok());
  auto write = [&](std::vector<int64_t> norm_shape) {
    std::vector<safetensors::TensorToWrite> tensors;
    for (const auto& [name, shape] : ParamShapes(config)) {
      if (name == "lm_head.weight") continue;
      std::vector<int64_t> s = name == "model.norm.weight" ? norm_shape : shape;
      int64_t n = 1;
      for (int64_t d : s) n *= d;
      tensors.push_back(safetensors::F32Tensor(
          name, s, std::make_shared<const std::vector<float>>(static_cast<size_t>(n), 1.0f)));
    }
    fs::remove(dir + "/model.safetensors");
    ASSERT_TRUE(safetensors::Write(dir + "/model.safetensors", tensors).ok());
  };
  write({64});
  auto m = ModelDir::Open(dir);
  ASSERT_TRUE(m.ok()) << m.status().message();
  EXPECT_EQ(m->CheckMatchesProgram(program).message(),
            dir + ": has no tensor lm_head.weight; is the export complete?");
  EXPECT_FALSE(m->Find("lm_head.weight").ok());
  EXPECT_EQ(ModelDir::Open(dir + "/nope").status().message(),
            dir +
                "/nope: not a directory; pass a model directory (config.json and "
                "model.safetensors, as --export or Hugging Face write them)");
  // Tied embeddings stand in for the lm_head; then the norm's shape is the first problem.
  nlohmann::json j = nlohmann::json::parse(ConfigJson(config));
  j["tie_word_embeddings"] = true;
  ASSERT_TRUE(WriteFileAtomic(dir + "/config.json", j.dump()).ok());
  write({32});
  m = ModelDir::Open(dir);
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->CheckMatchesProgram(program).message(),
            dir +
                "/model.safetensors: model.norm.weight is [32] but [64] in the plan's model "
                "tiny (and in config.json)");
}

// A directory is written whole or not at all: a failing writer leaves neither it nor its
// temporary directory, and an existing directory is never written into.
TEST(HfWriteDirAtomic, LeavesNothingOnFailure) {
  const std::string parent = TempDir();
  const std::string dir = parent + "/out";
  Status failed = WriteDirAtomic(dir, [](const std::string& tmp) -> Status {
    EXPECT_TRUE(WriteFileAtomic(tmp + "/half", "x").ok());
    return Status::Error("disk full");
  });
  EXPECT_EQ(failed.message(), "disk full");
  EXPECT_TRUE(fs::is_empty(parent));
  ASSERT_TRUE(WriteDirAtomic(dir + "/", [](const std::string& tmp) {
                return WriteFileAtomic(tmp + "/a", "1");
              }).ok());
  EXPECT_EQ(*ReadFileBytes(dir + "/a"), "1");
  EXPECT_NE(WriteDirAtomic(dir, [](const std::string&) { return Status::Ok(); })
                .message()
                .find("already exists"),
            std::string::npos);
  EXPECT_EQ(std::distance(fs::directory_iterator(parent), fs::directory_iterator()), 1);
}

}  // namespace
}  // namespace dc::hf
