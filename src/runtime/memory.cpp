#include "runtime/memory.h"

#include <fmt/format.h>
#include <mpi.h>

#include <cmath>
#include <fstream>
#include <sstream>

#include "qtrain/error.h"
#include "runtime/process.h"

namespace qt {

namespace {

// The first number in a file ("max" and unreadable files give nothing).
std::optional<std::uint64_t> read_number(const std::string& path) {
  std::ifstream in(path);
  std::string word;
  if (!(in >> word) || word.empty() || word.find_first_not_of("0123456789") != std::string::npos)
    return std::nullopt;
  try {
    return std::stoull(word);
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

// MemAvailable of /proc/meminfo in bytes.
std::optional<std::uint64_t> meminfo_available() {
  std::ifstream in("/proc/meminfo");
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream s(line);
    std::string key, unit;
    std::uint64_t kib = 0;
    if (s >> key >> kib >> unit && key == "MemAvailable:") return kib * 1024;
  }
  return std::nullopt;
}

// Free bytes under this process's cgroup memory limit, if it has one.
std::optional<std::uint64_t> cgroup_available() {
  std::ifstream in("/proc/self/cgroup");
  std::string line;
  while (std::getline(in, line)) {
    // v2: "0::/path"; v1: "N:memory:/path" (or "N:cpu,memory:/path").
    const std::size_t a = line.find(':'), b = line.find(':', a + 1);
    if (a == std::string::npos || b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1);
    const std::string path = line.substr(b + 1);
    std::optional<std::uint64_t> limit, used;
    if (controllers.empty()) {
      limit = read_number("/sys/fs/cgroup" + path + "/memory.max");
      used = read_number("/sys/fs/cgroup" + path + "/memory.current");
    } else if (("," + controllers + ",").find(",memory,") != std::string::npos) {
      limit = read_number("/sys/fs/cgroup/memory" + path + "/memory.limit_in_bytes");
      used = read_number("/sys/fs/cgroup/memory" + path + "/memory.usage_in_bytes");
    }
    // v1 reports "no limit" as a huge number; anything beyond 2^60 is no limit.
    if (limit && used && *limit < (std::uint64_t{1} << 60))
      return *limit > *used ? *limit - *used : 0;
  }
  return std::nullopt;
}

// The message of a refusal. total = the node's sum over its `ranks` ranks; avail empty when
// unknown (the need is then beyond any machine).
std::string shortfall(double total, std::optional<std::uint64_t> avail, const HostMemoryNeed& need,
                      const std::string& context, const std::string& where, int ranks) {
  const std::string per_rank =
      ranks > 1 ? fmt::format("{} ranks x {}: ", ranks, format_bytes(need.bytes)) : "";
  const std::string has =
      avail ? fmt::format("{} has {} available", where, format_bytes(static_cast<double>(*avail)))
            : std::string("no machine has that much");
  return fmt::format("{} needs about {} of host memory on {} ({}{}), but {}; change {}", context,
                     format_bytes(total), where, per_rank, need.what, has, need.keys);
}

constexpr double kAbsurd = 9.2e18;  // 2^63 bytes: no machine has it, whatever it reports

}  // namespace

std::optional<std::uint64_t> available_host_bytes() {
  std::optional<std::uint64_t> mem = meminfo_available();
  std::optional<std::uint64_t> cg = cgroup_available();
  if (mem && cg) return std::min(*mem, *cg);
  return mem ? mem : cg;
}

std::string format_bytes(double bytes) {
  if (!std::isfinite(bytes)) return "an unbounded amount";
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  int u = 0;
  while (bytes >= 1024 && u < 6) bytes /= 1024, ++u;
  if (u == 0) return fmt::format("{:.0f} B", bytes);
  if (bytes >= 1e4) return fmt::format("{:.3g} {}", bytes, units[u]);  // beyond EiB
  const int decimals = bytes < 10 ? 2 : bytes < 100 ? 1 : 0;
  return fmt::format("{:.{}f} {}", bytes, decimals, units[u]);
}

void check_host_memory(Comm& world, const HostMemoryNeed& need, const std::string& context) {
  auto* mpi_world = dynamic_cast<MpiComm*>(&world);
  QT_CHECK(mpi_world != nullptr, "check_host_memory needs an MPI communicator");
  MPI_Comm node;
  QT_CHECK_MPI(MPI_Comm_split_type(mpi_world->mpi(), MPI_COMM_TYPE_SHARED, world.rank(),
                                   MPI_INFO_NULL, &node));
  double total = need.bytes;
  int node_rank = 0, node_size = 1;
  QT_CHECK_MPI(MPI_Allreduce(MPI_IN_PLACE, &total, 1, MPI_DOUBLE, MPI_SUM, node));
  QT_CHECK_MPI(MPI_Comm_rank(node, &node_rank));
  QT_CHECK_MPI(MPI_Comm_size(node, &node_size));
  QT_CHECK_MPI(MPI_Comm_free(&node));
  std::string err;
  if (node_rank == 0) {
    const std::optional<std::uint64_t> avail = available_host_bytes();
    if (!std::isfinite(total) || total > kAbsurd || (avail && total > static_cast<double>(*avail)))
      err = shortfall(total, avail, need, context, fmt::format("node {}", host_name()), node_size);
  }
  agree(world, err);
}

void check_host_memory_local(const HostMemoryNeed& need, const std::string& context) {
  const std::optional<std::uint64_t> avail = available_host_bytes();
  if (!std::isfinite(need.bytes) || need.bytes > kAbsurd ||
      (avail && need.bytes > static_cast<double>(*avail)))
    throw UserError(shortfall(need.bytes, avail, need, context, "this machine", 1));
}

std::string MemorySplit::describe() const {
  return fmt::format("params {}, grads {}, optimizer {}, activations {}, workspace {}",
                     format_bytes(params), format_bytes(grads), format_bytes(optimizer),
                     format_bytes(activations), format_bytes(workspace));
}

}  // namespace qt
