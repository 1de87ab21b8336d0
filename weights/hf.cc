#include "weights/hf.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>

#include "models/param_names.h"
#include "schemas/files.h"

namespace dc::hf {
namespace {

namespace pn = param_names;
using nlohmann::json;
using nlohmann::ordered_json;

constexpr char kLlama[] = "LlamaForCausalLM";
constexpr char kMixtral[] = "MixtralForCausalLM";
constexpr char kLlamaType[] = "llama";
constexpr char kMixtralType[] = "mixtral";
constexpr char kDcFamilyMixtral[] = "mixtral";
// What HF's LlamaConfig / MixtralConfig assume when config.json leaves a field out.
constexpr double kLlamaDefaultRopeTheta = 10000;
constexpr double kMixtralDefaultRopeTheta = 1e6;
constexpr double kLlamaDefaultNormEps = 1e-6;
constexpr double kMixtralDefaultNormEps = 1e-5;
constexpr int64_t kLlamaDefaultMaxPositions = 2048;
constexpr int64_t kMixtralDefaultMaxPositions = 4096 * 32;
constexpr double kMixtralDefaultAuxCoef = 0.001;

std::string ShapeString(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

std::string LayerName(int64_t layer, const std::string& rest) {
  return "model.layers." + std::to_string(layer) + "." + rest + ".weight";
}

// The HF name of a param inside decoder layer `layer`, from its dc name after the layer prefix.
StatusOr<std::string> LayerParamName(int64_t layer, const std::string& rest) {
  static const std::map<std::string, std::string> kDense = {
      {pn::kAttnNorm, "input_layernorm"}, {pn::kWq, "self_attn.q_proj"},
      {pn::kWk, "self_attn.k_proj"},      {pn::kWv, "self_attn.v_proj"},
      {pn::kWo, "self_attn.o_proj"},      {pn::kMlpNorm, "post_attention_layernorm"},
      {pn::kWGate, "mlp.gate_proj"},      {pn::kWUp, "mlp.up_proj"},
      {pn::kWDown, "mlp.down_proj"},      {pn::kRouter, "block_sparse_moe.gate"},
  };
  if (auto it = kDense.find(rest); it != kDense.end()) return LayerName(layer, it->second);
  // "experts.<e>.<mlp param>": Mixtral's w1 is the gate, w3 the up and w2 the down projection.
  static const std::map<std::string, std::string> kExpert = {
      {pn::kWGate, "w1"}, {pn::kWDown, "w2"}, {pn::kWUp, "w3"}};
  const std::string experts = "experts.";
  if (rest.starts_with(experts)) {
    const size_t dot = rest.find('.', experts.size());
    const std::string index = rest.substr(experts.size(), dot - experts.size());
    if (dot != std::string::npos && !index.empty() &&
        std::all_of(index.begin(), index.end(), ::isdigit)) {
      if (auto it = kExpert.find(rest.substr(dot + 1)); it != kExpert.end()) {
        return LayerName(layer, "block_sparse_moe.experts." + index + "." + it->second);
      }
    }
  }
  return Status::Error("");
}

// Reads an optional field of type T (a default when absent); a present field of the wrong
// type is an error naming it.
template <typename T>
StatusOr<T> Field(const json& j, const char* key, const std::string& path, std::optional<T> dflt) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) {
    if (dflt) return *dflt;
    return Status::Error(path + ": has no \"" + key +
                         "\"; is it a Hugging Face config.json for Llama or Mixtral?");
  }
  bool right_type = false;
  if constexpr (std::is_same_v<T, bool>) {
    right_type = it->is_boolean();
  } else if constexpr (std::is_same_v<T, std::string>) {
    right_type = it->is_string();
  } else if constexpr (std::is_integral_v<T>) {
    right_type = it->is_number_integer();
  } else {
    right_type = it->is_number();
  }
  if (!right_type) {
    return Status::Error(path + ": \"" + key + "\" is " + it->dump() + ", not a " +
                         (std::is_same_v<T, bool>          ? "boolean"
                          : std::is_same_v<T, std::string> ? "string"
                          : std::is_integral_v<T>          ? "whole number"
                                                           : "number"));
  }
  return it->get<T>();
}

Status CheckPositive(const std::string& path, const char* key, double value) {
  if (value > 0) return Status::Ok();
  return Status::Error(path + ": \"" + key + "\" must be positive (got " + std::to_string(value) +
                       ")");
}

bool IsFloat(proto::DType dtype) {
  return dtype == proto::DTYPE_F32 || dtype == proto::DTYPE_BF16 || dtype == proto::DTYPE_F16;
}

}  // namespace

StatusOr<std::string> ParamName(const std::string& dc_name) {
  if (dc_name == pn::kEmbed) return std::string("model.embed_tokens.weight");
  if (dc_name == pn::kFinalNorm) return std::string("model.norm.weight");
  if (dc_name == pn::kLmHead) return std::string("lm_head.weight");
  const std::string layers = "layers.";
  if (dc_name.starts_with(layers)) {
    const size_t dot = dc_name.find('.', layers.size());
    const std::string index = dc_name.substr(layers.size(), dot - layers.size());
    if (dot != std::string::npos && !index.empty() && index.size() < 10 &&
        std::all_of(index.begin(), index.end(), ::isdigit)) {
      auto name = LayerParamName(std::stoll(index), dc_name.substr(dot + 1));
      if (name.ok()) return name;
    }
  }
  return Status::Error("param '" + dc_name +
                       "' has no Hugging Face name (is the program a Llama or Mixtral?)");
}

Config ConfigOf(const proto::ModelConfig& model) {
  Config c;
  const bool moe = model.family() == kDcFamilyMixtral;
  c.architecture = moe ? kMixtral : kLlama;
  c.hidden_size = model.hidden();
  c.intermediate_size = model.ffn();
  c.num_hidden_layers = model.layers();
  c.num_attention_heads = model.heads();
  c.num_key_value_heads = model.kv_heads();
  c.vocab_size = model.vocab();
  c.max_position_embeddings = model.seq();
  c.rms_norm_eps = model.norm_eps();
  c.rope_theta = model.rope_theta();
  if (moe) {
    c.num_local_experts = model.experts();
    c.num_experts_per_tok = model.top_k();
    c.router_aux_loss_coef = model.router_aux_coef();
  }
  return c;
}

std::string ConfigJson(const Config& c) {
  ordered_json j;
  j["architectures"] = {c.architecture};
  j["model_type"] = c.moe() ? kMixtralType : kLlamaType;
  j["hidden_size"] = c.hidden_size;
  j["intermediate_size"] = c.intermediate_size;
  j["num_hidden_layers"] = c.num_hidden_layers;
  j["num_attention_heads"] = c.num_attention_heads;
  j["num_key_value_heads"] = c.num_key_value_heads;
  j["vocab_size"] = c.vocab_size;
  j["max_position_embeddings"] = c.max_position_embeddings;
  j["rms_norm_eps"] = c.rms_norm_eps;
  j["rope_theta"] = c.rope_theta;
  j["hidden_act"] = "silu";
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  j["torch_dtype"] = c.torch_dtype;
  if (c.moe()) {
    j["num_local_experts"] = c.num_local_experts;
    j["num_experts_per_tok"] = c.num_experts_per_tok;
    j["router_aux_loss_coef"] = c.router_aux_loss_coef;
  } else {
    j["attention_bias"] = false;
    j["mlp_bias"] = false;
  }
  return j.dump(2) + "\n";
}

StatusOr<Config> ParseConfigJson(const std::string& text, const std::string& path) {
  const json j = json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) {
    return Status::Error(path + ": not a JSON object; is it a Hugging Face config.json?");
  }
  Config c;
  auto arch = j.find("architectures");
  if (arch == j.end() || !arch->is_array() || arch->size() != 1 || !(*arch)[0].is_string()) {
    return Status::Error(path + ": \"architectures\" must list one architecture (" + kLlama +
                         " or " + kMixtral + ")");
  }
  c.architecture = (*arch)[0].get<std::string>();
  if (c.architecture != kLlama && c.architecture != kMixtral) {
    return Status::Error(path + ": architecture " + c.architecture + " is not supported; dc " +
                         "reads " + kLlama + " and " + kMixtral);
  }
  const bool moe = c.architecture == kMixtral;
  const std::string want_type = moe ? kMixtralType : kLlamaType;
  DC_ASSIGN_OR_RETURN(const std::string model_type,
                      Field<std::string>(j, "model_type", path, want_type));
  if (model_type != want_type) {
    return Status::Error(path + ": model_type \"" + model_type + "\" does not fit " +
                         c.architecture + " (\"" + want_type + "\")");
  }
  const std::optional<int64_t> required;
  DC_ASSIGN_OR_RETURN(c.hidden_size, Field<int64_t>(j, "hidden_size", path, required));
  DC_ASSIGN_OR_RETURN(c.intermediate_size, Field<int64_t>(j, "intermediate_size", path, required));
  DC_ASSIGN_OR_RETURN(c.num_hidden_layers, Field<int64_t>(j, "num_hidden_layers", path, required));
  DC_ASSIGN_OR_RETURN(c.num_attention_heads,
                      Field<int64_t>(j, "num_attention_heads", path, required));
  DC_ASSIGN_OR_RETURN(c.num_key_value_heads,
                      Field<int64_t>(j, "num_key_value_heads", path, c.num_attention_heads));
  DC_ASSIGN_OR_RETURN(c.vocab_size, Field<int64_t>(j, "vocab_size", path, required));
  DC_ASSIGN_OR_RETURN(c.max_position_embeddings, Field<int64_t>(j, "max_position_embeddings", path,
                                                                moe ? kMixtralDefaultMaxPositions
                                                                    : kLlamaDefaultMaxPositions));
  DC_ASSIGN_OR_RETURN(
      c.rms_norm_eps,
      Field<double>(j, "rms_norm_eps", path, moe ? kMixtralDefaultNormEps : kLlamaDefaultNormEps));
  DC_ASSIGN_OR_RETURN(c.rope_theta,
                      Field<double>(j, "rope_theta", path,
                                    moe ? kMixtralDefaultRopeTheta : kLlamaDefaultRopeTheta));
  DC_ASSIGN_OR_RETURN(c.tie_word_embeddings, Field<bool>(j, "tie_word_embeddings", path, false));
  DC_ASSIGN_OR_RETURN(c.torch_dtype, Field<std::string>(j, "torch_dtype", path, "float32"));
  if (moe) {
    DC_ASSIGN_OR_RETURN(c.num_local_experts,
                        Field<int64_t>(j, "num_local_experts", path, required));
    DC_ASSIGN_OR_RETURN(c.num_experts_per_tok,
                        Field<int64_t>(j, "num_experts_per_tok", path, required));
    DC_ASSIGN_OR_RETURN(c.router_aux_loss_coef,
                        Field<double>(j, "router_aux_loss_coef", path, kMixtralDefaultAuxCoef));
    DC_RETURN_IF_ERROR(CheckPositive(path, "num_local_experts", c.num_local_experts));
    DC_RETURN_IF_ERROR(CheckPositive(path, "num_experts_per_tok", c.num_experts_per_tok));
  }
  for (const auto& [key, value] : {std::pair{"hidden_size", c.hidden_size},
                                   {"intermediate_size", c.intermediate_size},
                                   {"num_hidden_layers", c.num_hidden_layers},
                                   {"num_attention_heads", c.num_attention_heads},
                                   {"num_key_value_heads", c.num_key_value_heads},
                                   {"vocab_size", c.vocab_size}}) {
    DC_RETURN_IF_ERROR(CheckPositive(path, key, static_cast<double>(value)));
  }
  DC_RETURN_IF_ERROR(CheckPositive(path, "rms_norm_eps", c.rms_norm_eps));
  DC_RETURN_IF_ERROR(CheckPositive(path, "rope_theta", c.rope_theta));
  if (c.hidden_size % c.num_attention_heads != 0 ||
      c.num_attention_heads % c.num_key_value_heads != 0) {
    return Status::Error(path + ": num_attention_heads must divide hidden_size and " +
                         "num_key_value_heads must divide num_attention_heads");
  }
  // What dc's model does not compute: refused rather than silently computed otherwise.
  DC_ASSIGN_OR_RETURN(const std::string act, Field<std::string>(j, "hidden_act", path, "silu"));
  if (act != "silu") {
    return Status::Error(path + ": hidden_act \"" + act +
                         "\" is not supported (dc's MLP is "
                         "SwiGLU: silu)");
  }
  for (const char* key : {"attention_bias", "mlp_bias"}) {
    DC_ASSIGN_OR_RETURN(const bool bias, Field<bool>(j, key, path, false));
    if (bias) return Status::Error(path + ": \"" + key + "\" is true; dc's model has no biases");
  }
  if (auto it = j.find("rope_scaling"); it != j.end() && !it->is_null()) {
    return Status::Error(path + ": rope_scaling " + it->dump() +
                         " is not supported (dc's RoPE is unscaled)");
  }
  if (auto it = j.find("head_dim");
      it != j.end() && !it->is_null() && *it != c.hidden_size / c.num_attention_heads) {
    return Status::Error(path + ": head_dim " + it->dump() +
                         " is not hidden_size / num_attention_heads, which dc's model requires");
  }
  return c;
}

std::map<std::string, std::vector<int64_t>> ParamShapes(const Config& c) {
  const int64_t head_dim = c.hidden_size / c.num_attention_heads;
  const int64_t q = c.num_attention_heads * head_dim, kv = c.num_key_value_heads * head_dim;
  const int64_t h = c.hidden_size, f = c.intermediate_size;
  std::map<std::string, std::vector<int64_t>> shapes;
  shapes["model.embed_tokens.weight"] = {c.vocab_size, h};
  shapes["model.norm.weight"] = {h};
  shapes["lm_head.weight"] = {c.vocab_size, h};
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    shapes[LayerName(l, "input_layernorm")] = {h};
    shapes[LayerName(l, "self_attn.q_proj")] = {q, h};
    shapes[LayerName(l, "self_attn.k_proj")] = {kv, h};
    shapes[LayerName(l, "self_attn.v_proj")] = {kv, h};
    shapes[LayerName(l, "self_attn.o_proj")] = {h, q};
    shapes[LayerName(l, "post_attention_layernorm")] = {h};
    if (!c.moe()) {
      shapes[LayerName(l, "mlp.gate_proj")] = {f, h};
      shapes[LayerName(l, "mlp.up_proj")] = {f, h};
      shapes[LayerName(l, "mlp.down_proj")] = {h, f};
      continue;
    }
    shapes[LayerName(l, "block_sparse_moe.gate")] = {c.num_local_experts, h};
    for (int64_t e = 0; e < c.num_local_experts; ++e) {
      const std::string expert = "block_sparse_moe.experts." + std::to_string(e) + ".";
      shapes[LayerName(l, expert + "w1")] = {f, h};
      shapes[LayerName(l, expert + "w2")] = {h, f};
      shapes[LayerName(l, expert + "w3")] = {f, h};
    }
  }
  return shapes;
}

Status CheckMatchesProgram(const Config& config, const std::string& path,
                           const proto::Program& program) {
  const proto::ModelConfig& model = program.config();
  const std::string what_to_do = "; plan for the model this config.json describes";
  const Config planned = ConfigOf(model);
  if (config.architecture != planned.architecture) {
    return Status::Error(path + ": a " + config.architecture + ", but the plan's model (" +
                         model.preset() + ") is a " + planned.architecture + what_to_do);
  }
  // Every param, by name, in both directions: the first difference is the message.
  const auto shapes = ParamShapes(config);
  std::set<std::string> planned_names;
  for (const auto& t : program.tensors()) {
    if (t.role() != proto::ROLE_PARAM) continue;
    DC_ASSIGN_OR_RETURN(const std::string name, ParamName(t.name()));
    planned_names.insert(name);
    const std::vector<int64_t> shape(t.shape().begin(), t.shape().end());
    auto it = shapes.find(name);
    if (it == shapes.end()) {
      return Status::Error(path + ": describes no " + name + " (shape " + ShapeString(shape) +
                           " in the plan's model " + model.preset() + ")" + what_to_do);
    }
    if (it->second != shape) {
      return Status::Error(path + ": " + name + " is " + ShapeString(it->second) + " there but " +
                           ShapeString(shape) + " in the plan's model " + model.preset() +
                           what_to_do);
    }
  }
  for (const auto& [name, shape] : shapes) {
    if (!planned_names.count(name)) {
      return Status::Error(path + ": describes " + name + " " + ShapeString(shape) +
                           ", which the plan's model " + model.preset() + " does not have" +
                           what_to_do);
    }
  }
  struct Setting {
    const char* key;
    double file, plan;
  };
  for (const Setting& s :
       {Setting{"rope_theta", config.rope_theta, planned.rope_theta},
        Setting{"rms_norm_eps", config.rms_norm_eps, planned.rms_norm_eps},
        Setting{"num_experts_per_tok", static_cast<double>(config.num_experts_per_tok),
                static_cast<double>(planned.num_experts_per_tok)}}) {
    if (s.file != s.plan) {
      return Status::Error(path + ": " + s.key + " " + json(s.file).dump() + " differs from the " +
                           "plan's model (" + json(s.plan).dump() + ")" + what_to_do);
    }
  }
  return Status::Ok();
}

StatusOr<ModelDir> ModelDir::Open(const std::string& dir) {
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) {
    return Status::Error(dir + ": not a directory; pass a model directory (config.json and " +
                         kModelFile + ", as --export or Hugging Face write them)");
  }
  ModelDir m;
  m.dir_ = dir;
  const std::string config_path = dir + "/" + kConfigFile;
  auto text = ReadFileBytes(config_path);
  if (!text.ok()) {
    return Status::Error(config_path + ": cannot read it; a model directory needs a config.json");
  }
  DC_ASSIGN_OR_RETURN(m.config_, ParseConfigJson(*text, config_path));

  // The files: HF's index (sharded checkpoints) or the one model.safetensors.
  std::map<std::string, std::string> file_of;  // tensor -> file, from the index
  std::vector<std::string> file_names;
  const std::string index_path = dir + "/" + kIndexFile;
  if (std::filesystem::exists(index_path, ec)) {
    DC_ASSIGN_OR_RETURN(const std::string index_text, ReadFileBytes(index_path));
    const json index = json::parse(index_text, nullptr, false);
    auto map = index.is_object() ? index.find("weight_map") : index.end();
    if (index.is_discarded() || !index.is_object() || map == index.end() || !map->is_object()) {
      return Status::Error(index_path + ": not a safetensors index (a JSON object with a " +
                           "\"weight_map\" object)");
    }
    std::set<std::string> names;
    for (const auto& [tensor, file] : map->items()) {
      const std::string f = file.is_string() ? file.get<std::string>() : "";
      if (f.empty() || f.find('/') != std::string::npos || f == "." || f == "..") {
        return Status::Error(index_path + ": " + tensor + " maps to " + file.dump() +
                             ", not a file name in this directory");
      }
      file_of[tensor] = f;
      names.insert(f);
    }
    file_names.assign(names.begin(), names.end());
  } else {
    file_names.push_back(kModelFile);
  }
  for (const std::string& name : file_names) {
    DC_ASSIGN_OR_RETURN(safetensors::File file, safetensors::File::Open(dir + "/" + name));
    m.files_.push_back(std::make_shared<safetensors::File>(std::move(file)));
    const safetensors::File* f = m.files_.back().get();
    for (const safetensors::TensorInfo& info : f->tensors()) {
      if (!file_of.empty()) {
        auto it = file_of.find(info.name);
        if (it == file_of.end() || it->second != name) continue;  // the index says elsewhere
      }
      if (!m.entries_.emplace(info.name, Entry{f, &info}).second) {
        return Status::Error(dir + ": tensor " + info.name + " is in more than one file");
      }
    }
  }
  for (const auto& [tensor, file] : file_of) {
    if (!m.entries_.count(tensor)) {
      return Status::Error(index_path + ": lists " + tensor + " in " + file +
                           ", which does not hold it");
    }
  }
  return m;
}

StatusOr<ModelDir::Entry> ModelDir::Find(const std::string& name) const {
  auto it = entries_.find(name);
  if (it == entries_.end() && name == "lm_head.weight" && config_.tie_word_embeddings) {
    it = entries_.find("model.embed_tokens.weight");
  }
  if (it == entries_.end()) {
    return Status::Error(dir_ + ": has no tensor " + name + "; is the export complete?");
  }
  return it->second;
}

Status ModelDir::CheckMatchesProgram(const proto::Program& program) const {
  DC_RETURN_IF_ERROR(hf::CheckMatchesProgram(config_, dir_ + "/" + kConfigFile, program));
  for (const auto& t : program.tensors()) {
    if (t.role() != proto::ROLE_PARAM) continue;
    DC_ASSIGN_OR_RETURN(const std::string name, ParamName(t.name()));
    DC_ASSIGN_OR_RETURN(const Entry entry, Find(name));
    const std::vector<int64_t> shape(t.shape().begin(), t.shape().end());
    if (entry.info->shape != shape) {
      return Status::Error(entry.file->path() + ": " + name + " is " +
                           ShapeString(entry.info->shape) + " but " + ShapeString(shape) +
                           " in the plan's model " + program.config().preset() +
                           " (and in config.json)");
    }
    if (!IsFloat(entry.info->dtype)) {
      return Status::Error(entry.file->path() + ": " + name + " is " +
                           safetensors::DTypeName(entry.info->dtype) +
                           ", not a float type (F32, BF16, F16)");
    }
  }
  return Status::Ok();
}

namespace {

// fsync of a directory, so that a rename inside it survives a crash.
Status SyncDirectory(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return Status::Error(dir + ": cannot open to flush (" + std::strerror(errno) + ")");
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) return Status::Error(dir + ": cannot flush (" + std::strerror(err) + ")");
  return Status::Ok();
}

}  // namespace

Status WriteDirAtomic(const std::string& dir_flag,
                      const std::function<Status(const std::string& tmp_dir)>& fill) {
  namespace fs = std::filesystem;
  std::string dir = dir_flag;
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();  // "out/" names "out"
  std::error_code ec;
  if (fs::exists(fs::symlink_status(dir, ec))) {
    return Status::Error(dir + ": already exists; write to a new directory or remove it first");
  }
  const std::string tmp = dir + ".tmp." + std::to_string(::getpid());
  fs::remove_all(tmp, ec);
  if (!fs::create_directory(tmp, ec)) {
    return Status::Error(tmp + ": cannot create (" + ec.message() +
                         "); does the parent directory exist and is it writable?");
  }
  Status status = fill(tmp);
  if (status.ok()) status = SyncDirectory(tmp);
  if (status.ok()) {
    fs::rename(tmp, dir, ec);
    if (ec)
      status = Status::Error(dir + ": cannot rename " + tmp + " to it (" + ec.message() + ")");
  }
  if (!status.ok()) {
    fs::remove_all(tmp, ec);
    return status;
  }
  const std::string parent = fs::path(dir).parent_path().string();
  return SyncDirectory(parent.empty() ? "." : parent);
}

Status WriteModelDir(const std::string& dir, const Config& config,
                     std::vector<safetensors::TensorToWrite> tensors) {
  return WriteDirAtomic(dir, [&](const std::string& tmp) -> Status {
    DC_RETURN_IF_ERROR(
        safetensors::Write(tmp + "/" + kModelFile, std::move(tensors), {{"format", "pt"}}));
    return WriteFileAtomic(tmp + "/" + kConfigFile, ConfigJson(config));
  });
}

}  // namespace dc::hf
