// The mesh (pp x dp x cp x tp): coordinates and one communicator per dimension
// (include/qtrain/mesh.h).
#include "qtrain/mesh.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <string>
#include <vector>

#include "dist/topology.h"
#include "qtrain/error.h"
#include "runtime/process.h"

namespace qt {

const char* mesh_dim_name(MeshDim d) {
  switch (d) {
    case MeshDim::kDp: return "dp";
    case MeshDim::kTp: return "tp";
    case MeshDim::kPp: return "pp";
    case MeshDim::kEp: return "ep";
    case MeshDim::kEdp: return "edp";
    case MeshDim::kCp: return "cp";
    case MeshDim::kDpCp: return "dpcp";
  }
  return "?";
}

MeshCoord mesh_coord_of(const MeshShape& s, int r) {
  MeshCoord c;
  c.tp = r % s.tp;
  c.cp = (r / s.tp) % s.cp;
  c.dp = (r / (s.tp * s.cp)) % s.dp;
  c.pp = r / (s.tp * s.cp * s.dp);
  c.ep = c.dp % s.ep;
  c.edp = c.dp / s.ep;
  return c;
}

int mesh_rank_of(const MeshShape& s, const MeshCoord& c) {
  return ((c.pp * s.dp + c.dp) * s.cp + c.cp) * s.tp + c.tp;
}

std::vector<std::string> tp_groups_across_hosts(const MeshShape& s,
                                                const std::vector<std::string>& host_of_rank) {
  std::vector<std::string> out;
  if (s.tp <= 1) return out;
  // tp is innermost: the groups are world ranks [g * tp, (g + 1) * tp).
  for (int first = 0; first + s.tp <= static_cast<int>(host_of_rank.size()); first += s.tp) {
    std::vector<std::string> hosts;
    for (int r = first; r < first + s.tp; ++r)
      if (std::find(hosts.begin(), hosts.end(), host_of_rank[r]) == hosts.end())
        hosts.push_back(host_of_rank[r]);
    if (hosts.size() > 1)
      out.push_back(fmt::format("world ranks {}..{} on hosts {}", first, first + s.tp - 1,
                                fmt::join(hosts, ", ")));
  }
  return out;
}

namespace {

// Splits `parent` by `color`, ordering ranks by `key`; the result is owned by the MpiComm.
std::unique_ptr<MpiComm> split(MpiComm& parent, int color, int key, const char* name) {
  MPI_Comm out;
  QT_CHECK_MPI(MPI_Comm_split(parent.mpi(), color, key, &out));
  return std::make_unique<MpiComm>(out, name, true);
}

}  // namespace

Mesh::Mesh(const MeshShape& shape, std::shared_ptr<MpiComm> world)
    : shape_(shape), world_(std::move(world)) {
  QT_CHECK(shape_.world() == world_->size(), "mesh {}x{}x{}x{} does not match {} ranks",
           shape_.pp, shape_.dp, shape_.cp, shape_.tp, world_->size());
  QT_CHECK(shape_.ep >= 1 && shape_.dp % shape_.ep == 0, "ep {} must divide dp {}", shape_.ep,
           shape_.dp);
  const int r = world_->rank();
  coord_ = mesh_coord_of(shape_, r);
  const MeshCoord& c = coord_;
  const MeshShape& s = shape_;
  // Colour = the coordinates that stay fixed within a group; key = position within it.
  const int pp_cp_tp = (c.pp * s.cp + c.cp) * s.tp + c.tp;  // fixed within dp, ep and edp
  dp_ = split(*world_, pp_cp_tp, c.dp, "dp");
  tp_ = split(*world_, (c.pp * s.dp + c.dp) * s.cp + c.cp, c.tp, "tp");
  pp_ = split(*world_, (c.dp * s.cp + c.cp) * s.tp + c.tp, c.pp, "pp");
  ep_ = split(*world_, pp_cp_tp * (s.dp / s.ep) + c.edp, c.ep, "ep");
  edp_ = split(*world_, pp_cp_tp * s.ep + c.ep, c.edp, "edp");
  cp_ = split(*world_, (c.pp * s.dp + c.dp) * s.tp + c.tp, c.cp, "cp");
  dp_cp_ = split(*world_, c.pp * s.tp + c.tp, c.dp * s.cp + c.cp, "dpcp");

  MPI_Comm node;
  QT_CHECK_MPI(MPI_Comm_split_type(world_->mpi(), MPI_COMM_TYPE_SHARED, r, MPI_INFO_NULL, &node));
  QT_CHECK_MPI(MPI_Comm_rank(node, &local_rank_));
  QT_CHECK_MPI(MPI_Comm_size(node, &local_size_));
  QT_CHECK_MPI(MPI_Comm_free(&node));
  host_ = host_name();
}

MpiComm& Mesh::mpi(MeshDim d) {
  switch (d) {
    case MeshDim::kDp: return *dp_;
    case MeshDim::kTp: return *tp_;
    case MeshDim::kPp: return *pp_;
    case MeshDim::kEp: return *ep_;
    case MeshDim::kEdp: return *edp_;
    case MeshDim::kCp: return *cp_;
    case MeshDim::kDpCp: return *dp_cp_;
  }
  QT_CHECK(false, "no mesh dimension {}", static_cast<int>(d));
  return *dp_;  // not reached
}

Comm& Mesh::device(MeshDim d, int channel) {
  QT_CHECK(channel >= 0, "device channel {}", channel);
  std::vector<std::unique_ptr<Comm>>& of_d = device_[static_cast<int>(d)];
  if (of_d.size() <= static_cast<std::size_t>(channel)) of_d.resize(channel + 1);
  std::unique_ptr<Comm>& c = of_d[static_cast<std::size_t>(channel)];
  if (!c)
    c = make_device_comm(mpi(d), channel == 0 ? std::string(mesh_dim_name(d))
                                              : fmt::format("{}.{}", mesh_dim_name(d), channel));
  return *c;
}

std::vector<Mesh::CommTimes> Mesh::take_collective_times() {
  std::vector<CommTimes> out;
  for (int d = 0; d < kNumMeshDims; ++d) {
    CommTimes slot{mesh_dim_name(static_cast<MeshDim>(d)), {}};
    for (std::unique_ptr<Comm>& c : device_[d]) {
      if (!c) continue;
      const CollectiveTimes t = c->take_times();
      for (int k = 0; k < kNumCollectiveKinds; ++k) {
        slot.times[k].seconds += t[k].seconds;
        slot.times[k].bytes += t[k].bytes;
        slot.times[k].bus_bytes += t[k].bus_bytes;
        slot.times[k].calls += t[k].calls;
      }
    }
    out.push_back(std::move(slot));
  }
  out.push_back({"mpi.world", world_->take_times()});
  for (int d = 0; d < kNumMeshDims; ++d) {
    const auto dim = static_cast<MeshDim>(d);
    out.push_back({fmt::format("mpi.{}", mesh_dim_name(dim)), mpi(dim).take_times()});
  }
  return out;
}

#ifndef QTRAIN_HAVE_CUDA
std::unique_ptr<Comm> make_device_comm(const MpiComm&, const std::string& name) {
  fail_user("the device communicator of mesh dimension {} needs the CUDA back end; this qtrain "
            "was built without it (cmake --preset cuda)",
            name);
}
#endif

std::string tp_across_hosts_warning(const MeshShape& s,
                                    const std::vector<std::string>& host_of_rank) {
  const std::vector<std::string> groups = tp_groups_across_hosts(s, host_of_rank);
  if (groups.empty()) return {};
  // Ranks per host, in order of each host's first rank.
  std::vector<std::string> names;
  std::vector<int> counts;
  for (const std::string& h : host_of_rank) {
    const auto it = std::find(names.begin(), names.end(), h);
    if (it == names.end()) names.push_back(h), counts.push_back(1);
    else ++counts[it - names.begin()];
  }
  std::vector<int> sizes = counts;
  std::sort(sizes.begin(), sizes.end());
  sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());
  const bool multiples = std::all_of(counts.begin(), counts.end(), [&](int c) { return c % s.tp == 0; });
  const std::string why =
      multiples ? "the ranks are not placed host by host (consecutive world ranks on one host: "
                  "srun --distribution=block, mpirun --map-by ppr:N:node)"
                : fmt::format("the ranks per host ({}) are not a multiple of mesh.tp",
                              fmt::join(sizes, ", "));
  return fmt::format(
      "warning: mesh.tp = {} puts {} of {} tensor-parallel groups across hosts (first: {}): {}; "
      "tensor parallelism exchanges activations twice a layer, over the network between hosts. "
      "Keep each group on one host: launch a multiple of mesh.tp ranks per host, or lower mesh.tp",
      s.tp, groups.size(), host_of_rank.size() / s.tp, groups.front(), why);
}

std::string Mesh::describe(bool gpus) {
  const std::vector<std::string> host_of = gather_strings(host_, *world_);  // by world rank
  const std::string topology = topology_report(*world_, local_rank_, gpus);
  if (world_->rank() != 0) return {};
  std::string out =
      shape_.cp > 1
          ? fmt::format("mesh: world {} = pp {} x dp {} x cp {} x tp {} (ep {} within dp)\n",
                        shape_.world(), shape_.pp, shape_.dp, shape_.cp, shape_.tp, shape_.ep)
          : fmt::format("mesh: world {} = pp {} x dp {} x tp {} (ep {} within dp)\n",
                        shape_.world(), shape_.pp, shape_.dp, shape_.tp, shape_.ep);
  out += topology;
  const std::string warning = tp_across_hosts_warning(shape_, host_of);
  if (!warning.empty()) out += warning + "\n";
  return out;
}

}  // namespace qt
