// `qtrain probe` (docs/cluster.md): the topology report, then a short all-reduce probe of the
// bus bandwidth within a host (the ranks of each host together) and across hosts (one rank a host,
// every local rank's group at once, as data parallelism over hosts runs), printed as the deck lines
// of the planner's topology keys. NCCL on each rank's GPU (CUDA builds), or MPI on host memory.
#pragma once

#include <cstddef>
#include <string>

namespace qt {

class Comm;
class MpiComm;

// nccl-tests' all-reduce bus bandwidth in GB/s (1e9 bytes/s): bytes / seconds x 2 (n - 1) / n,
// the traffic each rank's link carries in a ring; 0 when n < 2.
double all_reduce_bus_gbps(std::size_t bytes, int ranks, double seconds);

// Seconds per call of `iters` blocking all-reduces (sum) of count fp32 values of `buf` over
// `comm`, after `warmup` untimed ones; `group` is the MPI communicator of the same ranks (the
// barrier before the clock starts, and the slowest rank's time, which every rank returns).
double time_all_reduce(Comm& comm, const MpiComm& group, void* buf, std::size_t count, int warmup,
                       int iters);

// The same over NCCL on this rank's GPU (local_rank % GPUs, as the CUDA back end picks it), a
// communicator of `group`'s ranks and a device buffer of count fp32. CUDA builds only
// (topology_cuda.cpp); otherwise a UserError.
double time_device_all_reduce(const MpiComm& group, int local_rank, std::size_t count, int warmup,
                              int iters);

// What the probe measured; a bandwidth < 0 was not measured (a group of one rank).
struct ProbeResult {
  int gpus_per_host = -1;  // -1: unknown (probe on host memory)
  double intra_host_gbps = -1;
  double inter_host_gbps = -1;
};
// The deck lines the planner reads: "topology.intra_host_gbps = 362.1" and so on, a comment line
// in place of a value that was not measured, saying why.
std::string probe_deck_lines(const ProbeResult& r);

// argv[0] is "probe"; options --mib, --iters, --device, --help. Collective over `world`. Returns
// 0, or 2 (kExitBadInput) after rank 0 printed "qtrain probe: error: ...".
int probe_main(int argc, char** argv, MpiComm& world);

}  // namespace qt
