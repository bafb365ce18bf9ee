// The topology report's pure parts: /sys parsing on a fake tree, the GPU link line, the summary
// of given places (identical hosts merged, NUMA warnings), and the probe's arithmetic and lines.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "dist/probe.h"
#include "dist/topology.h"

namespace qt {
namespace {

namespace fs = std::filesystem;

TEST(Topology, CpuListsParseAndFormat) {
  EXPECT_EQ(parse_cpu_list("0-3,8,10-11\n"), (std::vector<int>{0, 1, 2, 3, 8, 10, 11}));
  EXPECT_EQ(parse_cpu_list("5"), (std::vector<int>{5}));
  EXPECT_TRUE(parse_cpu_list("\n").empty());  // a node without CPUs
  for (const char* bad : {"3-1", "a", "1,,2", "1-", "-1"})
    EXPECT_THROW(parse_cpu_list(bad), std::invalid_argument) << bad;
  EXPECT_EQ(format_int_list({0, 1, 2, 5, 7, 8}), "0-2,5,7-8");
  EXPECT_EQ(format_int_list({}), "");
  EXPECT_EQ(parse_cpu_list(format_int_list({0, 2, 3, 4, 9})), (std::vector<int>{0, 2, 3, 4, 9}));
}

// A fake root: two NUMA nodes of 8 CPUs each (interleaved halves, as two-socket hosts number
// hyper-threads), and two GPUs' PCI devices.
class FakeSys : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() /
            ("qtrain_topology_" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) +
             "_" + ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
    write("sys/devices/system/node/node0/cpulist", "0-3,8-11\n");
    write("sys/devices/system/node/node1/cpulist", "4-7,12-15\n");
    write("sys/devices/system/node/possible", "0-1\n");  // not a node directory
    write("sys/bus/pci/devices/0000:1b:00.0/numa_node", "1\n");
    write("sys/bus/pci/devices/0000:3c:00.0/numa_node", "-1\n");  // no NUMA information
  }
  void TearDown() override { fs::remove_all(root_); }
  void write(const std::string& rel, const std::string& text) {
    fs::create_directories((root_ / rel).parent_path());
    std::ofstream(root_ / rel) << text;
  }
  std::string root() const { return root_.string(); }
  fs::path root_;
};

TEST_F(FakeSys, NumaNodesOfCpus) {
  EXPECT_EQ(numa_nodes_of_cpus(root(), {0, 1, 9}), (std::vector<int>{0}));
  EXPECT_EQ(numa_nodes_of_cpus(root(), {12}), (std::vector<int>{1}));
  EXPECT_EQ(numa_nodes_of_cpus(root(), {3, 4}), (std::vector<int>{0, 1}));
  EXPECT_TRUE(numa_nodes_of_cpus(root(), {}).empty());
  EXPECT_TRUE(numa_nodes_of_cpus(root() + "/nowhere", {0}).empty());
}

TEST_F(FakeSys, GpuNumaNodeFromItsBusId) {
  EXPECT_EQ(pci_numa_node(root(), "0000:1B:00.0"), 1);      // CUDA's form
  EXPECT_EQ(pci_numa_node(root(), "00000000:1B:00.0"), 1);  // NVML's 8-digit domain
  EXPECT_EQ(pci_numa_node(root(), "0000:3c:00.0"), -1);
  EXPECT_EQ(pci_numa_node(root(), "0000:99:00.0"), -1);     // no such device
  EXPECT_EQ(pci_numa_node(root(), "garbage"), -1);
}

TEST(Topology, AllowedCpusAreThisProcesssAndSorted) {
  const std::vector<int> cpus = allowed_cpus();
  ASSERT_FALSE(cpus.empty());
  EXPECT_TRUE(std::is_sorted(cpus.begin(), cpus.end()));
}

std::vector<GpuLink> all_pairs(int n, GpuLink k) {
  return std::vector<GpuLink>(static_cast<std::size_t>(n) * n, k);
}

TEST(Topology, GpuLinkLine) {
  EXPECT_EQ(gpu_links_text(8, all_pairs(8, GpuLink::kNvLink), std::vector<int>(8, 18)),
            "NVLink between all 8 GPUs (18 links each)");
  EXPECT_EQ(gpu_links_text(2, all_pairs(2, GpuLink::kNvLink), {}), "NVLink between all 2 GPUs");
  EXPECT_EQ(gpu_links_text(4, all_pairs(4, GpuLink::kPcie), {0, 0, 0, 0}),
            "PCIe between all 4 GPUs (no NVLink)");
  EXPECT_EQ(gpu_links_text(2, all_pairs(2, GpuLink::kPeer), {}),
            "peer access (link unknown) between all 2 GPUs");
  EXPECT_EQ(gpu_links_text(2, all_pairs(2, GpuLink::kNoPeer), {}),
            "no peer access between the 2 GPUs (copies through host memory)");
  EXPECT_EQ(gpu_links_text(1, all_pairs(1, GpuLink::kNvLink), {}), "one GPU");
  EXPECT_EQ(gpu_links_text(0, {}, {}), "no GPU");
  // NVLink bridges 0-1 and 2-3 (4 links each), PCIe between the pairs.
  std::vector<GpuLink> k = all_pairs(4, GpuLink::kPcie);
  k[0 * 4 + 1] = k[1 * 4 + 0] = k[2 * 4 + 3] = k[3 * 4 + 2] = GpuLink::kNvLink;
  EXPECT_EQ(gpu_links_text(4, k, {4, 4, 4, 4}),
            "NVLink between 2 of 6 pairs (0-1, 2-3) (4 links each); PCIe between 4 of 6 pairs "
            "(0-2, 0-3, 1-2, 1-3)");
}

// A host of `n` ranks, half on each NUMA node with their GPUs (bound), or every rank on both.
std::vector<RankPlace> host(const std::string& name, int n, bool bound, int gpus = 8) {
  std::vector<RankPlace> out;
  for (int l = 0; l < n; ++l) {
    RankPlace p;
    p.host = name;
    p.local_rank = l;
    p.gpu = gpus > 0 ? l % gpus : -1;
    p.gpu_numa = gpus > 0 ? (l < n / 2 ? 0 : 1) : -1;
    p.cpu_numa = bound ? std::vector<int>{l < n / 2 ? 0 : 1} : std::vector<int>{0, 1};
    if (l == 0) {
      p.host_gpus = gpus;
      p.gpu_name = "NVIDIA H100 80GB HBM3";
      p.gpu_links = "NVLink between all 8 GPUs (18 links each)";
    }
    out.push_back(p);
  }
  return out;
}

std::vector<RankPlace> join(std::vector<std::vector<RankPlace>> hosts) {
  std::vector<RankPlace> out;
  for (auto& h : hosts) out.insert(out.end(), h.begin(), h.end());
  return out;
}

TEST(Topology, IdenticalHostsShareOneEntry) {
  const std::string text = topology_summary(
      join({host("n01", 8, true), host("n02", 8, true), host("n03", 8, true), host("n04", 8, true)}));
  EXPECT_EQ(text,
            "topology: 4 hosts, 32 ranks\n"
            "  hosts n01, n02, n03, n04: 8 ranks, 8 GPUs (NVIDIA H100 80GB HBM3), NVLink between "
            "all 8 GPUs (18 links each)\n"
            "    local ranks 0-3: CPUs on NUMA 0, GPUs 0-3 on NUMA 0\n"
            "    local ranks 4-7: CPUs on NUMA 1, GPUs 4-7 on NUMA 1\n");
}

TEST(Topology, BigJobsStayShort) {
  std::vector<std::vector<RankPlace>> hosts;
  for (int h = 0; h < 64; ++h) hosts.push_back(host(fmt::format("n{:02}", h), 8, true));
  hosts[5] = host("n05", 7, true);  // one host short of a rank: an entry of its own
  const std::string text = topology_summary(join(hosts));
  EXPECT_EQ(std::count(text.begin(), text.end(), '\n'), 7) << text;
  EXPECT_NE(text.find("topology: 64 hosts, 511 ranks\n"), std::string::npos) << text;
  EXPECT_NE(text.find("  hosts n00, n01, n02, n03, n04, n06 and 57 more: 8 ranks"), std::string::npos)
      << text;
  EXPECT_NE(text.find("  host n05: 7 ranks"), std::string::npos) << text;
  EXPECT_NE(text.find("    local ranks 0-2: CPUs on NUMA 0, GPUs 0-2 on NUMA 0\n"), std::string::npos)
      << text;
}

TEST(Topology, RanksAwayFromTheirGpusNumaNodeAreWarnedAbout) {
  const std::string text = topology_summary(join({host("a", 8, false), host("b", 8, true)}));
  EXPECT_NE(text.find("  host a: 8 ranks"), std::string::npos) << text;
  EXPECT_NE(text.find("    local ranks 0-3: CPUs on NUMA 0-1, GPUs 0-3 on NUMA 0\n"), std::string::npos)
      << text;
  EXPECT_NE(text.find("    warning: local ranks 0-3 may run on CPUs of NUMA 0-1, their GPUs are on "
                      "NUMA 0; local ranks 4-7 may run on CPUs of NUMA 0-1, their GPUs are on NUMA "
                      "1: bind each rank to its GPU's NUMA node"),
            std::string::npos)
      << text;
  EXPECT_EQ(text.find("warning", text.find("host b")), std::string::npos) << text;  // b is bound
}

TEST(Topology, WithoutGpusOnlyCpusAreReported) {
  std::vector<RankPlace> ranks = host("vm", 2, true, 0);
  ranks[0].host_gpus = -1;  // not queried: nothing said about GPUs
  ranks[0].cpu_numa = ranks[1].cpu_numa = {0};
  EXPECT_EQ(topology_summary(ranks),
            "topology: 1 host, 2 ranks\n  host vm: 2 ranks\n    local ranks 0-1: CPUs on NUMA 0\n");
  ranks[0].gpu_error = "this qtrain was built without CUDA";
  ranks[1].cpu_numa = {};
  EXPECT_EQ(topology_summary(ranks),
            "topology: 1 host, 2 ranks\n"
            "  host vm: 2 ranks, GPUs unknown (this qtrain was built without CUDA)\n"
            "    local rank 0: CPUs on NUMA 0\n"
            "    local rank 1: CPUs (NUMA unknown)\n");
  ranks[0].host_gpus = 0;
  ranks[0].gpu_error = "none visible";
  EXPECT_NE(topology_summary(ranks).find("  host vm: 2 ranks, no GPU (none visible)\n"),
            std::string::npos);
}

TEST(Probe, BusBandwidthIsNcclTestsBusbw) {
  // 1 GB in 1 s over 8 ranks: algbw 1 GB/s, each link carries 2 x 7/8 of it.
  EXPECT_DOUBLE_EQ(all_reduce_bus_gbps(1'000'000'000, 8, 1.0), 1.75);
  EXPECT_DOUBLE_EQ(all_reduce_bus_gbps(1'000'000'000, 2, 0.5), 2.0);
  EXPECT_EQ(all_reduce_bus_gbps(1'000'000'000, 1, 1.0), 0.0);
  EXPECT_EQ(all_reduce_bus_gbps(1'000'000'000, 4, 0.0), 0.0);
}

TEST(Probe, DeckLinesNameThePlannersKeys) {
  ProbeResult r;
  r.gpus_per_host = 8;
  r.intra_host_gbps = 362.14;
  r.inter_host_gbps = 45.24;
  EXPECT_EQ(probe_deck_lines(r),
            "topology.gpus_per_host = 8\ntopology.intra_host_gbps = 362.1\n"
            "topology.inter_host_gbps = 45.2\n");
  r.gpus_per_host = -1;
  r.inter_host_gbps = -1;
  EXPECT_EQ(probe_deck_lines(r),
            "# topology.gpus_per_host: not known (probed on host memory, --device cpu)\n"
            "topology.intra_host_gbps = 362.1\n"
            "# topology.inter_host_gbps: not measured (one host)\n");
}

}  // namespace
}  // namespace qt
