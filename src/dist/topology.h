// The machine under the mesh (issue 17, topology): hosts, ranks and GPUs per host, the links
// between the GPUs of a host and the NUMA placement of each rank, gathered at start-up and
// summarised by rank 0 in a few lines (identical hosts in one). No CUDA types here: the GPU query
// is topology_cuda.cpp (CUDA builds); elsewhere it says "unknown".
#pragma once

#include <string>
#include <vector>

namespace qt {

class MpiComm;

// How two GPUs of a host reach each other: NVLink, PCIe peer access, peer access whose link NVML
// was not there to name, no peer access at all, or not known.
enum class GpuLink { kUnknown, kNvLink, kPcie, kPeer, kNoPeer };

// The GPUs a rank sees (CUDA_VISIBLE_DEVICES order, as the CUDA back end indexes them).
struct LocalGpus {
  int count = -1;                     // -1: not queried (CPU build, or not asked)
  std::string name;                   // GPU 0's, e.g. "NVIDIA H100 80GB HBM3"
  std::vector<std::string> bus_ids;   // [count] PCI bus ids, "0000:18:00.0"
  std::string links;                  // gpu_links_text() of the host's pairs; empty if not asked
  std::string error;                  // why count is 0 or -1, for the report
};

// Queries this process's GPUs; `with_links` also classifies every pair (NVML loaded with
// dlopen("libnvidia-ml.so.1") when present: NVLink state and P2P status; else CUDA's peer
// access, which cannot tell NVLink from PCIe). Never throws: failures end up in `error`.
// Defined by topology_cuda.cpp in CUDA builds; otherwise count = -1.
LocalGpus query_local_gpus(bool with_links);

// One rank's place, as that rank sees it.
struct RankPlace {
  std::string host;
  int local_rank = 0;
  std::vector<int> cpu_numa;  // NUMA nodes of the CPUs it may run on, sorted; empty: unknown
  int gpu = -1;               // the GPU the CUDA back end gives it (local_rank % count); -1: none
  int gpu_numa = -1;          // that GPU's NUMA node (-1: unknown)
  // The host's GPUs, filled on local rank 0 only (count -1 elsewhere).
  int host_gpus = -1;
  std::string gpu_name, gpu_links, gpu_error;
};

// "0-3,8,10-11" (the kernel's cpulist format) -> {0, 1, 2, 3, 8, 10, 11}. Throws
// std::invalid_argument on anything else.
std::vector<int> parse_cpu_list(const std::string& text);
// Sorted, as the kernel writes them: {0, 1, 2, 5} -> "0-2,5".
std::string format_int_list(const std::vector<int>& v);
// NUMA nodes holding any of `cpus`, from <root>/sys/devices/system/node/node*/cpulist (root "" is
// the real /sys). Empty when the directory is missing (no NUMA information).
std::vector<int> numa_nodes_of_cpus(const std::string& root, const std::vector<int>& cpus);
// NUMA node of the PCI device `bus_id` ("0000:1B:00.0" from CUDA or "00000000:1B:00.0" from
// NVML) from <root>/sys/bus/pci/devices/<0000:1b:00.0>/numa_node; -1 when unknown.
int pci_numa_node(const std::string& root, const std::string& bus_id);
// The CPUs this process may run on (sched_getaffinity), sorted.
std::vector<int> allowed_cpus();

// One line on the GPUs of a host: n GPUs, kind[i * n + j] for each pair (the diagonal is not
// read), nvlinks[i] active NVLinks of GPU i (empty: unknown). E.g. "NVLink between all 8 GPUs
// (18 links each)", "PCIe between all 4 GPUs (no NVLink)", "NVLink between 2 of 6 pairs (0-1,
// 2-3), PCIe otherwise".
std::string gpu_links_text(int n, const std::vector<GpuLink>& kind, const std::vector<int>& nvlinks);

// This rank's place: host, NUMA nodes of its CPUs and, with `gpus`, its GPU and (on local rank
// 0) the host's GPUs and links.
RankPlace local_place(const std::string& host, int local_rank, bool gpus);

// The report rank 0 prints, from every rank's place (in world rank order):
//   topology: 4 hosts, 32 ranks
//     hosts n01, n02, n03, n04: 8 ranks, 8 GPUs (NVIDIA H100 80GB HBM3), NVLink between all 8 GPUs (18 links each)
//       local ranks 0-3: CPUs on NUMA 0, GPUs 0-3 on NUMA 0
//       local ranks 4-7: CPUs on NUMA 1, GPUs 4-7 on NUMA 1
// Hosts whose lines would be the same share one entry; a warning follows when a rank's CPUs are
// not on its GPU's NUMA node.
std::string topology_summary(const std::vector<RankPlace>& places);

// Collective over `world`: every rank's place, and the summary on rank 0 (empty elsewhere).
std::string topology_report(MpiComm& world, int local_rank, bool gpus);

}  // namespace qt
