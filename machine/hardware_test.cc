#include "machine/hardware.h"

#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "machine/cost_model.h"
#include "machine/estimate.h"
#include "models/model.h"

namespace dc {
namespace {

// Every checked-in profile parses, with its constants in range.
TEST(HardwareTest, EveryProfileLoads) {
  const auto profiles = HardwareProfiles();
  ASSERT_TRUE(profiles.ok()) << profiles.status().message();
  ASSERT_GE(profiles->size(), 4u);
  for (const std::string& name : HardwareNames()) {
    const auto hw = FindHardware(name);
    ASSERT_TRUE(hw.ok()) << hw.status().message();
    EXPECT_EQ(hw->name, name);
    EXPECT_FALSE(hw->description.empty());
    EXPECT_GT(hw->peak_bf16_flops_per_s, 0) << name;
    EXPECT_GT(hw->peak_fp32_flops_per_s, 0) << name;
    EXPECT_GT(hw->memory_bandwidth_bytes_per_s, 0) << name;
    EXPECT_GT(hw->matmul_efficiency, 0) << name;
    EXPECT_LE(hw->matmul_efficiency, 1) << name;
    EXPECT_GT(hw->memory_efficiency, 0) << name;
    EXPECT_LE(hw->memory_efficiency, 1) << name;
    EXPECT_GT(hw->intra_node_bus_bandwidth_bytes_per_s, 0) << name;
    EXPECT_GT(hw->inter_node_bandwidth_per_gpu_bytes_per_s, 0) << name;
    EXPECT_GT(hw->host_link_bandwidth_bytes_per_s, 0) << name;
    EXPECT_GE(hw->overlap_compute_slowdown, 1) << name;
  }
}

// The profiles the planner is documented to know, with their datasheet numbers.
TEST(HardwareTest, DatasheetNumbers) {
  const auto h100 = FindHardware("h100-sxm");
  ASSERT_TRUE(h100.ok()) << h100.status().message();
  EXPECT_DOUBLE_EQ(h100->peak_bf16_flops_per_s, 989e12);
  EXPECT_DOUBLE_EQ(h100->memory_bandwidth_bytes_per_s, 3.35e12);
  EXPECT_EQ(h100->device_memory_bytes, int64_t{81559} << 20);
  EXPECT_EQ(h100->max_gpus_per_node, 8);
  EXPECT_FALSE(h100->serial_streams);

  const auto h200 = FindHardware("h200");
  ASSERT_TRUE(h200.ok()) << h200.status().message();
  EXPECT_DOUBLE_EQ(h200->peak_bf16_flops_per_s, 989e12);
  EXPECT_DOUBLE_EQ(h200->memory_bandwidth_bytes_per_s, 4.8e12);
  EXPECT_GT(h200->device_memory_bytes, h100->device_memory_bytes);

  const auto a100 = FindHardware("a100-80gb");
  ASSERT_TRUE(a100.ok()) << a100.status().message();
  EXPECT_DOUBLE_EQ(a100->peak_bf16_flops_per_s, 312e12);
  EXPECT_DOUBLE_EQ(a100->memory_bandwidth_bytes_per_s, 2.039e12);
  EXPECT_LT(a100->host_link_bandwidth_bytes_per_s, h100->host_link_bandwidth_bytes_per_s);

  const auto cpu = FindHardware("cpu");
  ASSERT_TRUE(cpu.ok()) << cpu.status().message();
  EXPECT_FALSE(cpu->serial_streams);  // a thread per stream (executor/cpu_device.cc)
  EXPECT_DOUBLE_EQ(cpu->peak_fp32_flops_per_s, 30e9);
  // Measured by bench/overlap_bench: compute and Gloo share the rank's cores.
  EXPECT_GT(cpu->overlap_compute_slowdown, 1.0);
  EXPECT_GT(cpu->overlap_collective_slowdown, 1.0);
  EXPECT_NE(cpu->sources.at("overlap_compute_slowdown").find("overlap_bench"), std::string::npos);
  EXPECT_NE(cpu->sources.at("overlap_collective_slowdown").find("overlap_bench"),
            std::string::npos);
  EXPECT_DOUBLE_EQ(h100->overlap_collective_slowdown, 1.0);
}

// Aliases and case do not matter.
TEST(HardwareTest, AliasesAndCase) {
  const auto by_alias = FindHardware("H100");
  ASSERT_TRUE(by_alias.ok()) << by_alias.status().message();
  EXPECT_EQ(by_alias->name, "h100-sxm");
  const auto a100 = FindHardware("dgx-a100");
  ASSERT_TRUE(a100.ok()) << a100.status().message();
  EXPECT_EQ(a100->name, "a100-80gb");
}

// An unknown name says which names exist.
TEST(HardwareTest, UnknownNameListsKnownNames) {
  const auto hw = FindHardware("tpu-v5");
  ASSERT_FALSE(hw.ok());
  const std::string message = hw.status().message();  // status() returns a copy
  EXPECT_NE(message.find("tpu-v5"), std::string::npos) << message;
  for (const std::string& name : HardwareNames()) {
    EXPECT_NE(message.find(name), std::string::npos) << message;
  }
}

constexpr char kOneProfileHead[] = R"({"format": "dc.hardware_profiles/1", "profiles": [
  {"name": "toy", "description": "a toy", "constants": {)";
constexpr char kOneProfileTail[] = "}}]}";
constexpr char kToyConstants[] = R"(
  "peak_bf16_flops_per_s": {"value": 1e12, "unit": "flop/s", "source": "s"},
  "peak_fp32_flops_per_s": {"value": 1e11, "unit": "flop/s", "source": "s"},
  "device_memory_bytes": {"value": 1024, "unit": "bytes", "source": "s"},
  "memory_bandwidth_bytes_per_s": {"value": 1e11, "unit": "bytes/s", "source": "s"},
  "matmul_efficiency": {"value": 0.5, "unit": "fraction", "source": "s"},
  "memory_efficiency": {"value": 0.5, "unit": "fraction", "source": "s"},
  "intra_node_bus_bandwidth_bytes_per_s": {"value": 1e10, "unit": "bytes/s", "source": "s"},
  "inter_node_bandwidth_per_gpu_bytes_per_s": {"value": 1e9, "unit": "bytes/s", "source": "s"},
  "collective_base_latency_s": {"value": 1e-5, "unit": "s", "source": "s"},
  "intra_node_step_latency_s": {"value": 1e-6, "unit": "s", "source": "s"},
  "inter_node_step_latency_s": {"value": 1e-5, "unit": "s", "source": "s"},
  "host_link_bandwidth_bytes_per_s": {"value": 1e10, "unit": "bytes/s", "source": "s"},
  "host_link_latency_s": {"value": 1e-5, "unit": "s", "source": "s"},
  "host_optimizer_elements_per_s": {"value": 1e8, "unit": "elements/s", "source": "s"},
  "kernel_launch_seconds": {"value": 1e-6, "unit": "s", "source": "s"},
  "overlap_compute_slowdown": {"value": 1.0, "unit": "ratio", "source": "s"},
  "overlap_collective_slowdown": {"value": 1.0, "unit": "ratio", "source": "s"},
  "serial_streams": {"value": false, "unit": "boolean", "source": "s"},
  "max_gpus_per_node": {"value": 4, "unit": "gpus", "source": "s"})";

std::string ToyJson(const std::string& constants) {
  return std::string(kOneProfileHead) + constants + kOneProfileTail;
}

// A well-formed file parses; what is wrong with a malformed one is named.
TEST(HardwareTest, ParseErrorsNameTheConstant) {
  const auto good = ParseHardwareProfiles(ToyJson(kToyConstants), "toy.json");
  ASSERT_TRUE(good.ok()) << good.status().message();
  EXPECT_EQ(good->at(0).max_gpus_per_node, 4);

  std::string no_source = kToyConstants;
  no_source.replace(no_source.find("\"source\": \"s\"}"), 14, "\"source\": \"\"}");
  const auto unsourced = ParseHardwareProfiles(ToyJson(no_source), "toy.json");
  ASSERT_FALSE(unsourced.ok());
  EXPECT_NE(unsourced.status().message().find("peak_bf16_flops_per_s"), std::string::npos)
      << unsourced.status().message();
  EXPECT_NE(unsourced.status().message().find("source"), std::string::npos);

  std::string bad_efficiency = kToyConstants;
  bad_efficiency.replace(bad_efficiency.find("0.5"), 3, "1.5");
  const auto out_of_range = ParseHardwareProfiles(ToyJson(bad_efficiency), "toy.json");
  ASSERT_FALSE(out_of_range.ok());
  EXPECT_NE(out_of_range.status().message().find("matmul_efficiency"), std::string::npos)
      << out_of_range.status().message();

  const auto typo =
      ParseHardwareProfiles(ToyJson(std::string(kToyConstants) +
                                    R"(, "peak_bf61": {"value": 1, "unit": "s", "source": "s"})"),
                            "toy.json");
  ASSERT_FALSE(typo.ok());
  EXPECT_NE(typo.status().message().find("peak_bf61"), std::string::npos);

  const auto not_json = ParseHardwareProfiles("{", "toy.json");
  ASSERT_FALSE(not_json.ok());
  EXPECT_NE(not_json.status().message().find("toy.json"), std::string::npos);
}

// World and GPUs per node make whole nodes, or one partial node.
TEST(HardwareTest, MakeCluster) {
  const auto four_nodes = MakeCluster(32, 8);
  ASSERT_TRUE(four_nodes.ok()) << four_nodes.status().message();
  EXPECT_EQ(four_nodes->nodes, 4);
  EXPECT_EQ(four_nodes->gpus_per_node, 8);
  EXPECT_EQ(four_nodes->world_size(), 32);

  const auto partial = MakeCluster(4, 8);
  ASSERT_TRUE(partial.ok()) << partial.status().message();
  EXPECT_EQ(partial->nodes, 1);
  EXPECT_EQ(partial->gpus_per_node, 4);

  const auto uneven = MakeCluster(12, 8);
  ASSERT_FALSE(uneven.ok());
  EXPECT_NE(uneven.status().message().find("--gpus-per-node"), std::string::npos)
      << uneven.status().message();
  EXPECT_FALSE(MakeCluster(0, 8).ok());
  EXPECT_FALSE(MakeCluster(8, 0).ok());
}

// A node cannot have more GPUs than the profile's NVLink domain.
TEST(HardwareTest, ValidateCluster) {
  const auto h100 = FindHardware("h100-sxm");
  ASSERT_TRUE(h100.ok());
  EXPECT_TRUE(ValidateCluster(*h100, ClusterShape{4, 8}).ok());
  const Status too_many = ValidateCluster(*h100, ClusterShape{1, 16});
  ASSERT_FALSE(too_many.ok());
  EXPECT_NE(too_many.message().find("h100-sxm"), std::string::npos) << too_many.message();
  const auto cpu = FindHardware("cpu");
  ASSERT_TRUE(cpu.ok());
  EXPECT_TRUE(ValidateCluster(*cpu, ClusterShape{1, 64}).ok());
}

// ----- profiles from files (dc-plan --hardware FILE.json, --print-hardware) -----

std::string WriteTemp(const std::string& name, const std::string& text) {
  const std::string path = ::testing::TempDir() + name;
  std::ofstream(path) << text;
  return path;
}

// Every built-in profile printed and loaded back is the same profile: the same constants, units
// and sources, and the same cost model (so the same plans: tests/e2e_test.cc plans both).
TEST(HardwareFileTest, PrintThenLoadIsTheSameProfile) {
  auto config = MakeConfig("tiny", ModelOverrides{});
  ASSERT_TRUE(config.ok());
  auto program = BuildProgram(*config);
  ASSERT_TRUE(program.ok());
  for (const std::string& name : HardwareNames()) {
    auto builtin = FindHardware(name);
    ASSERT_TRUE(builtin.ok());
    const std::string printed = HardwareProfileJson(*builtin);
    const std::string path = WriteTemp(name + ".json", printed);
    auto loaded = LoadHardwareFile(path);
    ASSERT_TRUE(loaded.ok()) << loaded.status().message();
    EXPECT_EQ(HardwareProfileJson(*loaded), printed) << name;
    EXPECT_EQ(loaded->sources, builtin->sources) << name;
    EXPECT_EQ(loaded->aliases, builtin->aliases) << name;
    const ClusterShape cluster{1, 2};
    EXPECT_EQ(CostModelText(EstimateCostModel(*program, *loaded, cluster)),
              CostModelText(EstimateCostModel(*program, *builtin, cluster)))
        << name;
    auto resolved = ResolveHardware(path);
    ASSERT_TRUE(resolved.ok()) << resolved.status().message();
    EXPECT_EQ(resolved->name, name);
  }
  EXPECT_TRUE(IsHardwareFile("my.json"));
  EXPECT_TRUE(IsHardwareFile("profiles/h100"));
  EXPECT_FALSE(IsHardwareFile("h100-sxm"));
}

// A file printed before overlap_collective_slowdown existed still loads: the constant is 1
// (collectives not slowed), and its source says why.
TEST(HardwareFileTest, AFileWithoutALaterConstantLoadsWithItsDefault) {
  auto h100 = FindHardware("h100-sxm");
  ASSERT_TRUE(h100.ok());
  nlohmann::json file = nlohmann::json::parse(HardwareProfileJson(*h100));
  size_t erased = 0;
  for (auto& profile : file["profiles"]) {
    erased += profile["constants"].erase("overlap_collective_slowdown");
  }
  ASSERT_EQ(erased, 1u);
  auto loaded = LoadHardwareFile(WriteTemp("older.json", file.dump(2)));
  ASSERT_TRUE(loaded.ok()) << loaded.status().message();
  EXPECT_EQ(loaded->overlap_collective_slowdown, 1.0);
  EXPECT_NE(loaded->sources.at("overlap_collective_slowdown").find("not in the file"),
            std::string::npos);
  // So does one printed before host_cores_per_node: ranks do not share cores.
  for (auto& profile : file["profiles"]) profile["constants"].erase("host_cores_per_node");
  auto before_cores = LoadHardwareFile(WriteTemp("older-cores.json", file.dump(2)));
  ASSERT_TRUE(before_cores.ok()) << before_cores.status().message();
  EXPECT_EQ(before_cores->host_cores_per_node, 0);
  EXPECT_NE(before_cores->sources.at("host_cores_per_node").find("not in the file"),
            std::string::npos);
  file["profiles"][0]["constants"]["host_cores_per_node"] = {
      {"value", -2}, {"unit", "cores"}, {"source", "typo"}};
  auto negative = LoadHardwareFile(WriteTemp("negative-cores.json", file.dump(2)));
  ASSERT_FALSE(negative.ok());
  EXPECT_NE(negative.status().message().find("host_cores_per_node"), std::string::npos)
      << negative.status().message();
  file["profiles"][0]["constants"].erase("host_cores_per_node");
  // Any other constant is still required.
  file["profiles"][0]["constants"].erase("overlap_compute_slowdown");
  auto older = LoadHardwareFile(WriteTemp("older2.json", file.dump(2)));
  ASSERT_FALSE(older.ok());
  EXPECT_NE(older.status().message().find("'overlap_compute_slowdown' is missing"),
            std::string::npos)
      << older.status().message();
}

// The op kinds' time scales are optional in a file (1 where absent); one that is given is printed
// and loads back; a kind the table does not name, a wrong unit or a value that is not positive is
// one line naming the key.
TEST(HardwareFileTest, OpTimeScalesAreOptionalAndRoundTrip) {
  auto cpu = FindHardware("cpu");
  ASSERT_TRUE(cpu.ok());
  for (double scale : cpu->op_time_scale) EXPECT_EQ(scale, 1.0);
  EXPECT_EQ(HardwareProfileJson(*cpu).find("op_time_scale"), std::string::npos);
  HardwareProfile fitted = *cpu;
  ASSERT_TRUE(SetHardwareConstant(&fitted, "op_time_scale.attention", 4.25).ok());
  fitted.sources["op_time_scale.attention"] = "fitted from t.db";
  auto loaded = LoadHardwareFile(WriteTemp("scaled.json", HardwareProfileJson(fitted)));
  ASSERT_TRUE(loaded.ok()) << loaded.status().message();
  EXPECT_EQ(loaded->op_time_scale, fitted.op_time_scale);
  EXPECT_EQ(*GetHardwareConstant(*loaded, "op_time_scale.attention"), 4.25);
  EXPECT_EQ(loaded->sources.at("op_time_scale.attention"), "fitted from t.db");
  EXPECT_EQ(HardwareProfileJson(*loaded), HardwareProfileJson(fitted));

  const std::string good = HardwareProfileJson(fitted);
  const std::string entry = R"("op_time_scale.attention": {
          "value": 4.25,
          "unit": "ratio",)";
  ASSERT_NE(good.find(entry), std::string::npos) << good;
  const std::pair<std::string, std::vector<std::string>> cases[] = {
      {R"("op_time_scale.atention": {"value": 4.25, "unit": "ratio",)",
       {"unknown constant 'op_time_scale.atention'"}},
      {R"("op_time_scale.attention": {"value": 0, "unit": "ratio",)",
       {"'op_time_scale.attention'", "out of range (must be > 0)"}},
      {R"("op_time_scale.attention": {"value": -2, "unit": "ratio",)",
       {"'op_time_scale.attention'", "out of range"}},
      {R"("op_time_scale.attention": {"value": "x", "unit": "ratio",)",
       {"'op_time_scale.attention'", "not a number"}},
      {R"("op_time_scale.attention": {"value": 4.25, "unit": "%",)",
       {"'op_time_scale.attention'", "give the value in ratio"}},
  };
  for (const auto& [to, wanted] : cases) {
    std::string text = good;
    text.replace(text.find(entry), entry.size(), to);
    auto bad = LoadHardwareFile(WriteTemp("bad-scale.json", text));
    ASSERT_FALSE(bad.ok()) << to;
    for (const std::string& w : wanted) {
      EXPECT_NE(bad.status().message().find(w), std::string::npos) << bad.status().message();
    }
  }
  EXPECT_FALSE(SetHardwareConstant(&fitted, "op_time_scale.attention", 0).ok());
  auto unknown = GetHardwareConstant(fitted, "op_time_scale.conv2d");
  ASSERT_FALSE(unknown.ok());
  EXPECT_NE(unknown.status().message().find("op_time_scale.<op kind>"), std::string::npos);
}

// Each way a file can be wrong is one line naming the file and the key, and what to do.
TEST(HardwareFileTest, ErrorsNameTheFileAndTheKey) {
  auto h100 = FindHardware("h100-sxm");
  ASSERT_TRUE(h100.ok());
  const std::string good = HardwareProfileJson(*h100);
  struct Case {
    const char* what;
    std::string from, to;             // the edit to the printed profile
    std::vector<std::string> wanted;  // in the message
  };
  const std::string bf16 = R"("peak_bf16_flops_per_s": {
          "value": 989000000000000.0,
          "unit": "flop/s",)";
  const Case cases[] = {
      {"unknown constant",
       R"("constants": {)",
       R"("constants": {"peak_bf61": 1,)",
       {"unknown constant 'peak_bf61'"}},
      {"unknown key of a constant",
       bf16,
       R"("peak_bf16_flops_per_s": {"value": 989e12, "unit": "flop/s", "note": "x",)",
       {"peak_bf16_flops_per_s", "unknown key 'note'"}},
      {"unknown key of a profile",
       R"("description":)",
       R"("vendor": "x", "description":)",
       {"unknown key 'vendor'"}},
      {"unknown top-level key",
       R"("comment":)",
       R"("formats": 2, "comment":)",
       {"unknown top-level key 'formats'"}},
      {"missing constant",
       bf16,
       R"("peak_bf16_flops_pers": {"value": 1, "unit": "flop/s",)",
       {"constant 'peak_bf16_flops_per_s' is missing"}},
      {"missing unit",
       bf16,
       R"("peak_bf16_flops_per_s": {"value": 989e12,)",
       {"peak_bf16_flops_per_s", "no \"unit\"", "flop/s"}},
      {"missing value",
       bf16,
       R"("peak_bf16_flops_per_s": {"unit": "flop/s",)",
       {"peak_bf16_flops_per_s", "no \"value\""}},
      {"wrong unit",
       bf16,
       R"("peak_bf16_flops_per_s": {"value": 989, "unit": "TFLOP/s",)",
       {"peak_bf16_flops_per_s", "\"TFLOP/s\"", "give the value in flop/s"}},
      {"negative rate",
       bf16,
       R"("peak_bf16_flops_per_s": {"value": -1, "unit": "flop/s",)",
       {"peak_bf16_flops_per_s", "out of range", "> 0"}},
      {"non-finite rate",
       bf16,
       R"("peak_bf16_flops_per_s": {"value": 1e999, "unit": "flop/s",)",
       {"not valid JSON", "1e999"}},
      {"wrong type",
       bf16,
       R"("peak_bf16_flops_per_s": {"value": "989e12", "unit": "flop/s",)",
       {"peak_bf16_flops_per_s", "not a number"}},
      {"fraction for an integer",
       R"("value": 85520809984,)",
       R"("value": 85520809984.5,)",
       {"device_memory_bytes", "not an integer"}},
      {"collective speed-up",
       R"("overlap_collective_slowdown": {
          "value": 1.0,)",
       R"("overlap_collective_slowdown": {
          "value": 0.5,)",
       {"overlap_collective_slowdown", "out of range", ">= 1"}},
      {"string for a boolean",
       R"("value": false,)",
       R"("value": "false",)",
       {"serial_streams", "not true or false"}},
      {"not JSON", R"("constants": {)", R"("constants": {{)", {"not valid JSON", "line"}},
  };
  for (const Case& c : cases) {
    std::string text = good;
    const size_t at = text.find(c.from);
    ASSERT_NE(at, std::string::npos) << c.what;
    text.replace(at, c.from.size(), c.to);
    const std::string path = WriteTemp("bad.json", text);
    auto loaded = LoadHardwareFile(path);
    ASSERT_FALSE(loaded.ok()) << c.what;
    const std::string message = loaded.status().message();
    EXPECT_EQ(message.rfind(path, 0), 0u) << c.what << ": " << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << c.what << ": " << message;
    for (const std::string& wanted : c.wanted) {
      EXPECT_NE(message.find(wanted), std::string::npos) << c.what << ": " << message;
    }
  }
  // A file of two profiles, and a file that is not there.
  std::string two = good;
  const size_t list = two.find(R"("profiles": [)") + 13;
  const size_t end = two.rfind(']');
  std::string other = two.substr(list, end - list);
  for (const char* name : {"\"h100", "\"dgx-h100"}) {
    for (size_t at = other.find(name); at != std::string::npos; at = other.find(name, at + 4)) {
      other.insert(at + 1, "my-");
    }
  }
  two.insert(end, "," + other);
  auto doubled = LoadHardwareFile(WriteTemp("two.json", two));
  ASSERT_FALSE(doubled.ok());
  EXPECT_NE(doubled.status().message().find("holds 2 profiles"), std::string::npos)
      << doubled.status().message();
  auto missing = LoadHardwareFile(::testing::TempDir() + "no-such-profile.json");
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("no-such-profile.json"), std::string::npos)
      << missing.status().message();
}

}  // namespace
}  // namespace dc
