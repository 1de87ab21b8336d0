// dc's models as Hugging Face's transformers stores them: the param names of LlamaForCausalLM
// and MixtralForCausalLM, their config.json, and reading a model directory (one
// model.safetensors, or HF's sharded model.safetensors.index.json + model-0000X-of-0000Y files).
//
// The layouts need no conversion, only names: dc's matmul weights are [out, in] as nn.Linear
// stores them (schemas/op_kinds.h: y = x W^T), its embedding is [vocab, hidden] as nn.Embedding,
// each Mixtral expert's w1/w2/w3 is its own [out, in] param, and dc's RoPE pairs element i
// with i + head_dim / 2 as HF's rotate_half does, so q_proj and k_proj keep HF's row order (no
// permutation, unlike Meta's original interleaved checkpoints).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "schemas/program.h"
#include "schemas/status.h"
#include "weights/safetensors.h"

namespace dc::hf {

inline constexpr char kConfigFile[] = "config.json";
inline constexpr char kModelFile[] = "model.safetensors";
inline constexpr char kIndexFile[] = "model.safetensors.index.json";

// The Hugging Face name of dc param `dc_name` ("layers.0.attn.wq" ->
// "model.layers.0.self_attn.q_proj.weight"); an error for a name dc's builder never makes.
StatusOr<std::string> ParamName(const std::string& dc_name);

// The config.json fields HF's loaders read for these two architectures.
struct Config {
  std::string architecture;  // "LlamaForCausalLM" or "MixtralForCausalLM"
  int64_t hidden_size = 0, intermediate_size = 0, num_hidden_layers = 0;
  int64_t num_attention_heads = 0, num_key_value_heads = 0, vocab_size = 0;
  int64_t max_position_embeddings = 0;
  double rms_norm_eps = 0, rope_theta = 0;
  bool tie_word_embeddings = false;
  std::string torch_dtype = "float32";
  // Mixtral only.
  int64_t num_local_experts = 0, num_experts_per_tok = 0;
  double router_aux_loss_coef = 0;
  bool moe() const { return num_local_experts > 0; }
};

// The config of dc model `model` (tie_word_embeddings false: dc's lm_head is its own param).
Config ConfigOf(const proto::ModelConfig& model);
// config.json's text: fixed key order, two-space indent, a final newline (deterministic).
std::string ConfigJson(const Config& config);
// Parses config.json's text; `path` names the file in errors. Unknown architectures, missing or
// non-positive sizes and inconsistent heads are refused.
StatusOr<Config> ParseConfigJson(const std::string& text, const std::string& path);

// The params the config describes, by HF name, with their shapes.
std::map<std::string, std::vector<int64_t>> ParamShapes(const Config& config);

// Checks that `config` (from `path`) describes the model of `program`: the architecture, every
// param's name and shape (an error names the tensor and both shapes), and the settings that
// change the math (rope_theta, rms_norm_eps, num_experts_per_tok).
Status CheckMatchesProgram(const Config& config, const std::string& path,
                           const proto::Program& program);

// A model directory as HF writes it, opened for reading: config.json and the safetensors
// file(s), headers validated. Tensor bytes are read on demand.
class ModelDir {
 public:
  static StatusOr<ModelDir> Open(const std::string& dir);
  const std::string& dir() const { return dir_; }
  const Config& config() const { return config_; }

  // The file and entry holding HF tensor `name` (model.embed_tokens.weight standing in for a
  // missing lm_head.weight when the config ties them); an error naming the directory and the
  // tensor when it has none.
  struct Entry {
    const safetensors::File* file = nullptr;
    const safetensors::TensorInfo* info = nullptr;
  };
  StatusOr<Entry> Find(const std::string& name) const;

  // Checks the directory against `program`: config.json (CheckMatchesProgram), then every
  // param's tensor present, of a float dtype and of the program's shape.
  Status CheckMatchesProgram(const proto::Program& program) const;

 private:
  std::string dir_;
  Config config_;
  std::vector<std::shared_ptr<safetensors::File>> files_;
  std::map<std::string, Entry> entries_;
};

// Makes directory `dir` (which must not exist) whole or not at all: `fill` writes its files
// into a temporary directory beside it ("<dir>.tmp.<pid>"), renamed to `dir` once complete and
// flushed; on an error the temporary directory is removed.
Status WriteDirAtomic(const std::string& dir,
                      const std::function<Status(const std::string& tmp_dir)>& fill);

// Writes a model directory atomically: model.safetensors (its metadata "format": "pt", which
// transformers' loader requires) and config.json.
Status WriteModelDir(const std::string& dir, const Config& config,
                     std::vector<safetensors::TensorToWrite> tensors);

}  // namespace dc::hf
