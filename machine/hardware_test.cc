#include "machine/hardware.h"

#include <gtest/gtest.h>

#include <string>

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
  EXPECT_TRUE(cpu->serial_streams);
  EXPECT_DOUBLE_EQ(cpu->peak_fp32_flops_per_s, 30e9);
  EXPECT_DOUBLE_EQ(cpu->overlap_compute_slowdown, 1.0);
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
  "peak_bf16_flops_per_s": {"value": 1e12, "source": "s"},
  "peak_fp32_flops_per_s": {"value": 1e11, "source": "s"},
  "device_memory_bytes": {"value": 1024, "source": "s"},
  "memory_bandwidth_bytes_per_s": {"value": 1e11, "source": "s"},
  "matmul_efficiency": {"value": 0.5, "source": "s"},
  "memory_efficiency": {"value": 0.5, "source": "s"},
  "intra_node_bus_bandwidth_bytes_per_s": {"value": 1e10, "source": "s"},
  "inter_node_bandwidth_per_gpu_bytes_per_s": {"value": 1e9, "source": "s"},
  "collective_base_latency_s": {"value": 1e-5, "source": "s"},
  "intra_node_step_latency_s": {"value": 1e-6, "source": "s"},
  "inter_node_step_latency_s": {"value": 1e-5, "source": "s"},
  "host_link_bandwidth_bytes_per_s": {"value": 1e10, "source": "s"},
  "host_link_latency_s": {"value": 1e-5, "source": "s"},
  "host_optimizer_elements_per_s": {"value": 1e8, "source": "s"},
  "kernel_launch_seconds": {"value": 1e-6, "source": "s"},
  "overlap_compute_slowdown": {"value": 1.0, "source": "s"},
  "serial_streams": {"value": false, "source": "s"},
  "max_gpus_per_node": {"value": 4, "source": "s"})";

std::string ToyJson(const std::string& constants) {
  return std::string(kOneProfileHead) + constants + kOneProfileTail;
}

// A well-formed file parses; what is wrong with a malformed one is named.
TEST(HardwareTest, ParseErrorsNameTheConstant) {
  const auto good = ParseHardwareProfiles(ToyJson(kToyConstants), "toy.json");
  ASSERT_TRUE(good.ok()) << good.status().message();
  EXPECT_EQ(good->at(0).max_gpus_per_node, 4);

  std::string no_source = kToyConstants;
  no_source.replace(no_source.find("\"s\"}"), 4, "\"\"}");
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

  const auto typo = ParseHardwareProfiles(
      ToyJson(std::string(kToyConstants) + R"(, "peak_bf61": {"value": 1, "source": "s"})"),
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

}  // namespace
}  // namespace dc
