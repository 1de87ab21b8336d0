#include "tools/cli.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <iostream>

#include "schemas/files.h"
#include "schemas/units.h"

namespace dc::cli {

namespace {
template <typename T>
void AddOptional(CLI::App& app, const std::string& name, std::optional<T>* target,
                 const std::string& help) {
  app.add_option_function<T>(
      name, [target](const T& v) { *target = v; }, help);
}
}  // namespace

std::vector<std::string> ModelFlags::Given(const CLI::App& app) const {
  std::vector<std::string> given;
  for (const std::string& name : names_) {
    if (app.count(name) > 0) given.push_back(name);
  }
  return given;
}

void ModelFlags::Add(CLI::App& app) {
  const size_t before = app.get_options().size();
  app.add_option("--model", preset, "model preset: " + Join(PresetNames(), ", "))
      ->capture_default_str();
  AddOptional(app, "--layers", &overrides.layers, "override the number of decoder layers");
  AddOptional(app, "--hidden", &overrides.hidden, "override the hidden size");
  AddOptional(app, "--heads", &overrides.heads, "override the attention heads");
  AddOptional(app, "--kv-heads", &overrides.kv_heads,
              "override the key/value heads (grouped-query)");
  AddOptional(app, "--ffn", &overrides.ffn, "override the MLP inner size");
  AddOptional(app, "--vocab", &overrides.vocab, "override the vocabulary size");
  AddOptional(app, "--seq", &overrides.seq, "override the sequence length");
  AddOptional(app, "--micro-batch", &overrides.micro_batch, "sequences per rank per micro-step");
  AddOptional(app, "--gas", &overrides.gas, "gradient-accumulation micro-steps per optimizer step");
  AddOptional(app, "--experts", &overrides.experts, "experts per MoE layer (mixtral presets)");
  AddOptional(app, "--top-k", &overrides.top_k,
              "experts each token is routed to (mixtral presets)");
  AddOptional(app, "--router-aux-coef", &overrides.router_aux_coef,
              "weight of the MoE load-balancing loss (mixtral presets)");
  AddOptional(app, "--dtype", &overrides.compute_dtype,
              "compute dtype of activations, gathered params and grads: f32, bf16 or f16 "
              "(master weights and Adam state stay fp32)");
  app.add_flag_function(
      "--recompute", [this](int64_t count) { overrides.recompute_layers = count > 0; },
      "activation checkpointing: each decoder layer keeps only its input and recomputes the rest "
      "in its backward");
  AddOptional(app, "--seed", &overrides.seed, "seed of the initial weights and synthetic data");
  AddOptional(app, "--lr", &overrides.lr, "peak learning rate of AdamW (default: the preset's)");
  AddOptional(app, "--warmup-steps", &overrides.lr_warmup_steps,
              "learning-rate warm-up: optimizer steps from lr/N up to --lr (default 0)");
  AddOptional(app, "--decay-steps", &overrides.lr_decay_steps,
              "learning-rate decay: optimizer steps after the warm-up from --lr down to "
              "--min-lr (cosine unless --lr-decay says otherwise)");
  AddOptional(app, "--min-lr", &overrides.min_lr,
              "learning rate at the end of the decay (default 0)");
  AddOptional(app, "--lr-decay", &overrides.lr_decay,
              "shape of the decay: cosine, linear or constant (default cosine with --decay-steps)");
  AddOptional(app, "--clip-grad-norm", &overrides.clip_grad_norm,
              "clip the grads by their global L2 norm before AdamW, as "
              "torch.nn.utils.clip_grad_norm_ (e.g. 1.0; default 0: no clipping)");
  AddOptional(
      app, "--data", &overrides.data_path,
      "flat binary file of uint16 token ids (as nanoGPT writes them) instead of synthetic tokens");
  const std::vector<CLI::Option*> options = app.get_options();
  for (size_t k = before; k < options.size(); ++k) {
    names_.push_back(options[k]->get_lnames().empty() ? options[k]->get_name()
                                                      : "--" + options[k]->get_lnames().front());
  }
}

CLI::Option* AddBytesOption(CLI::App& app, const std::string& name, int64_t* bytes,
                            const std::string& help) {
  return app.add_option_function<std::string>(
      name,
      [bytes, name](const std::string& text) {
        StatusOr<int64_t> parsed = ParseBytes(text);
        if (!parsed.ok()) throw CLI::ValidationError(name, parsed.status().message());
        *bytes = *parsed;
      },
      help);
}

std::optional<int> Parse(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help and --version are "errors" that exit 0; CLI11 prints them and usage errors alike.
    const int code = app.exit(e);
    return code == static_cast<int>(CLI::ExitCodes::Success) ? 0 : kUsageExitCode;
  }
  return std::nullopt;
}

namespace {
// CLI11's range for --threads-per-rank; what this host allows is checked by Resolve.
constexpr int kMaxThreadsPerRank = 4096;
}  // namespace

void ThreadsPerRankFlag::Add(CLI::App& app) {
  app.add_option("--threads-per-rank", threads,
                 "BLAS threads in each rank (cpu backend; default: the cores available, " +
                     std::to_string(AvailableCores()) +
                     " here, divided by the ranks on this host); results are bit-identical "
                     "across runs and world sizes at equal threads per rank")
      ->check(CLI::Range(1, kMaxThreadsPerRank));
}

StatusOr<int> ThreadsPerRankFlag::Resolve(int world_size) const {
  const int cores = AvailableCores();
  if (threads > cores) {
    return Status::Error("--threads-per-rank " + std::to_string(threads) + " is more than the " +
                         std::to_string(cores) + " core(s) this process may run on; give at most " +
                         std::to_string(cores) + " (or drop it for the default)");
  }
  if (threads > 0) return threads;
  int ranks_on_host = std::max(1, world_size);
  if (const char* local = std::getenv("LOCAL_WORLD_SIZE"); local != nullptr && *local != '\0') {
    // A value that is not a count of ranks is a mistake, not "unset" (as WORLD_SIZE=abc is).
    errno = 0;
    char* end = nullptr;
    const long n = std::strtol(local, &end, 10);
    if (*end != '\0' || errno == ERANGE || n < 1 || n > kMaxThreadsPerRank) {
      return Status::Error(std::string("LOCAL_WORLD_SIZE='") + local +
                           "' is not a whole number of ranks on this host; set it as torchrun "
                           "does (e.g. LOCAL_WORLD_SIZE=2) or unset it");
    }
    ranks_on_host = static_cast<int>(n);
  }
  return std::max(1, cores / ranks_on_host);
}

const CLI::Validator& NonEmptyPath() {
  static const CLI::Validator validator(
      [](std::string& path) {
        return path.empty() ? std::string("must not be empty; name a file") : "";
      },
      "PATH");
  return validator;
}

int Fail(const std::string& program, const Status& status) {
  std::cerr << program << ": " << status.message() << "\n";
  return 1;
}

std::vector<std::string> Args(int argc, char** argv) {
  return std::vector<std::string>(argv, argv + argc);
}

}  // namespace dc::cli
