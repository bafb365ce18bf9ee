// `qtrain probe` (probe.h): all-reduce bus bandwidth within and across hosts.
#include "dist/probe.h"

#include <fmt/format.h>
#include <mpi.h>

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "dist/topology.h"
#include "qtrain/comm.h"
#include "qtrain/error.h"

namespace qt {

namespace {

constexpr int kWarmup = 3;

constexpr const char* kUsage =
    "usage: mpirun -np N qtrain probe [--mib M] [--iters K] [--device cuda|cpu]\n"
    "\n"
    "Prints the topology report (hosts, ranks and GPUs per host, GPU links, NUMA placement),\n"
    "then times all-reduces of M MiB of fp32 within each host (its ranks together) and across\n"
    "hosts (one rank a host; every local rank's group at once), and prints the bus bandwidths\n"
    "(nccl-tests' busbw, GB/s) as the deck lines of the planner's topology keys. Launch it as\n"
    "the training job is launched (same nodes, ranks per node and binding). docs/cluster.md.\n"
    "\n"
    "  --mib M          MiB per all-reduce (default 256 with --device cuda, 16 with cpu)\n"
    "  --iters K        timed all-reduces per group, after 3 untimed ones (default 20)\n"
    "  --device D       cuda: NCCL on each rank's GPU (local rank % GPUs; CUDA builds, the\n"
    "                   default there); cpu: MPI on host memory (the default without CUDA)\n"
    "  --help           this text\n";

struct Options {
  std::size_t mib = 0;  // 0: the device's default
  int iters = 20;
  std::string device;
  bool help = false;
};

int positive(const std::string& opt, const std::string& s, int most) {
  int v = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || end != s.data() + s.size() || v < 1 || v > most)
    fail_user("{} {}: expected a whole number from 1 to {}", opt, s.empty() ? "''" : s, most);
  return v;
}

Options parse_options(int argc, char** argv) {
  Options o;
#ifdef QTRAIN_HAVE_CUDA
  o.device = "cuda";
#else
  o.device = "cpu";
#endif
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const auto eq = a.find('=');
    const std::string name = a.substr(0, eq);
    auto value = [&]() -> std::string {
      if (eq != std::string::npos) return a.substr(eq + 1);
      if (i + 1 >= argc) fail_user("{} needs a value", name);
      return argv[++i];
    };
    if (name == "--help" || name == "-h") o.help = true;
    else if (name == "--mib") o.mib = static_cast<std::size_t>(positive(name, value(), 16384));
    else if (name == "--iters") o.iters = positive(name, value(), 100000);
    else if (name == "--device") {
      o.device = value();
      if (o.device != "cuda" && o.device != "cpu")
        fail_user("--device {}: expected cuda or cpu", o.device);
    } else {
      fail_user("unknown argument {}; `qtrain probe --help` lists the options", a);
    }
  }
  if (o.mib == 0) o.mib = o.device == "cuda" ? 256 : 16;
  return o;
}

// One group's timing on this rank, or +infinity seconds when the group is this rank alone.
double seconds_in(MpiComm& group, const Options& o, int local_rank, std::size_t count) {
  if (group.size() < 2) return std::numeric_limits<double>::infinity();
  if (o.device == "cuda") return time_device_all_reduce(group, local_rank, count, kWarmup, o.iters);
  std::vector<float> buf(count, 0.0f);  // zeros stay zeros: no overflow however many sums
  return time_all_reduce(group, group, buf.data(), count, kWarmup, o.iters);
}

struct Measured {
  double min_gbps = -1, max_gbps = -1, seconds = 0;
  int groups = 0, min_size = 0, max_size = 0;
};

// Every rank's group timed at once; the slowest and fastest group over the world.
Measured measure(MpiComm& world, MpiComm& group, const Options& o, int local_rank,
                 std::size_t count) {
  const double s = seconds_in(group, o, local_rank, count);
  const bool timed = group.size() > 1;
  const double inf = std::numeric_limits<double>::infinity();
  double lo = timed ? all_reduce_bus_gbps(count * sizeof(float), group.size(), s) : inf;
  double hi = timed ? lo : 0.0;
  double slowest = timed ? s : 0.0;
  world.all_reduce(&lo, 1, DType::kF64, ReduceOp::kMin);
  world.all_reduce(&hi, 1, DType::kF64, ReduceOp::kMax);
  world.all_reduce(&slowest, 1, DType::kF64, ReduceOp::kMax);
  std::int64_t firsts = group.rank() == 0 ? 1 : 0, lo_size = group.size(), hi_size = group.size();
  world.all_reduce(&firsts, 1, DType::kI64, ReduceOp::kSum);
  world.all_reduce(&lo_size, 1, DType::kI64, ReduceOp::kMin);
  world.all_reduce(&hi_size, 1, DType::kI64, ReduceOp::kMax);
  Measured m;
  m.groups = static_cast<int>(firsts);
  m.min_size = static_cast<int>(lo_size);
  m.max_size = static_cast<int>(hi_size);
  if (lo != inf) m.min_gbps = lo, m.max_gbps = hi, m.seconds = slowest;
  return m;
}

std::string measured_line(const char* what, const Measured& m) {
  const std::string sizes = m.min_size == m.max_size ? std::to_string(m.min_size)
                                                     : fmt::format("{}-{}", m.min_size, m.max_size);
  if (m.min_gbps < 0)
    return fmt::format("  {}: {} group{} of {} rank{}: nothing to measure\n", what, m.groups,
                       m.groups == 1 ? "" : "s", sizes, m.max_size == 1 ? "" : "s");
  return fmt::format("  {}: {} group{} of {} ranks at once: bus bandwidth {:.1f} GB/s (slowest "
                     "group; fastest {:.1f}), {:.3f} ms a call\n",
                     what, m.groups, m.groups == 1 ? "" : "s", sizes, m.min_gbps, m.max_gbps,
                     m.seconds * 1e3);
}

}  // namespace

double all_reduce_bus_gbps(std::size_t bytes, int ranks, double seconds) {
  if (ranks < 2 || !(seconds > 0)) return 0.0;
  return static_cast<double>(bytes) / seconds * 2.0 * (ranks - 1) / ranks / 1e9;
}

double time_all_reduce(Comm& comm, const MpiComm& group, void* buf, std::size_t count, int warmup,
                       int iters) {
  for (int i = 0; i < warmup; ++i) comm.all_reduce(buf, count, DType::kF32, ReduceOp::kSum);
  QT_CHECK_MPI(MPI_Barrier(group.mpi()));
  const double t0 = MPI_Wtime();
  for (int i = 0; i < iters; ++i) comm.all_reduce(buf, count, DType::kF32, ReduceOp::kSum);
  double s = (MPI_Wtime() - t0) / iters;
  QT_CHECK_MPI(MPI_Allreduce(MPI_IN_PLACE, &s, 1, MPI_DOUBLE, MPI_MAX, group.mpi()));
  return s;
}

#ifndef QTRAIN_HAVE_CUDA
double time_device_all_reduce(const MpiComm&, int, std::size_t, int, int) {
  fail_user("--device cuda needs the CUDA back end; this qtrain was built without it (cmake "
            "--preset cuda), so probe with --device cpu");
}
#endif

std::string probe_deck_lines(const ProbeResult& r) {
  std::string out;
  if (r.gpus_per_host > 0) out += fmt::format("topology.gpus_per_host = {}\n", r.gpus_per_host);
  else out += "# topology.gpus_per_host: not known (probed on host memory, --device cpu)\n";
  if (r.intra_host_gbps >= 0) out += fmt::format("topology.intra_host_gbps = {:.1f}\n", r.intra_host_gbps);
  else out += "# topology.intra_host_gbps: not measured (one rank a host)\n";
  if (r.inter_host_gbps >= 0) out += fmt::format("topology.inter_host_gbps = {:.1f}\n", r.inter_host_gbps);
  else out += "# topology.inter_host_gbps: not measured (one host)\n";
  return out;
}

int probe_main(int argc, char** argv, MpiComm& world) {
  const bool root = world.rank() == 0;
  try {
    const Options o = parse_options(argc, argv);
    if (o.help) {
      if (root) std::printf("%s", kUsage);
      return 0;
    }
    MPI_Comm node_mpi, across_mpi;
    QT_CHECK_MPI(MPI_Comm_split_type(world.mpi(), MPI_COMM_TYPE_SHARED, world.rank(),
                                     MPI_INFO_NULL, &node_mpi));
    MpiComm node(node_mpi, "host", true);
    QT_CHECK_MPI(MPI_Comm_split(world.mpi(), node.rank(), world.rank(), &across_mpi));
    MpiComm across(across_mpi, "across hosts", true);
    const bool cuda = o.device == "cuda";
    const std::string report = topology_report(world, node.rank(), cuda);
    ProbeResult r;
    if (cuda) {  // every rank needs a GPU before any of them starts NCCL
      const LocalGpus g = query_local_gpus(false);
      agree(world, g.count > 0 ? "" : fmt::format("--device cuda: no GPU on this rank ({}); "
                                                  "probe with --device cpu", g.error));
      r.gpus_per_host = g.count;
    }
    if (root) {
      std::printf("%sprobe: all-reduce of %zu MiB (fp32), %d untimed + %d timed a group, %s\n",
                  report.c_str(), o.mib, kWarmup, o.iters,
                  cuda ? "NCCL on each rank's GPU" : "MPI on host memory");
      std::fflush(stdout);
    }
    const std::size_t count = o.mib * (std::size_t{1} << 20) / sizeof(float);
    const Measured intra = measure(world, node, o, node.rank(), count);
    const Measured inter = measure(world, across, o, node.rank(), count);
    r.intra_host_gbps = intra.min_gbps;
    r.inter_host_gbps = inter.min_gbps;
    if (root)
      std::printf("%s%s# the planner's topology keys: all-reduce bus bandwidth in GB/s (1e9 "
                  "bytes/s), the slowest group's\n%s",
                  measured_line("within a host", intra).c_str(),
                  measured_line("across hosts (one rank a host)", inter).c_str(),
                  probe_deck_lines(r).c_str());
    return 0;
  } catch (const UserError& e) {
    if (root) std::fprintf(stderr, "qtrain probe: error: %s\n", e.what());
    return kExitBadInput;
  }
}

}  // namespace qt
