// The device mesh: world = pp x dp x cp x tp, tp innermost, then cp (context parallelism), dp,
// pp outermost (Megatron's order); ep divides dp.
//
//   world rank = ((pp_idx * dp + dp_idx) * cp + cp_idx) * tp + tp_idx
//   dp_idx     = edp_idx * ep + ep_idx          (expert-parallel groups are contiguous in dp)
//
// Each dimension gets its own communicator: dp, tp, pp, cp, ep (within dp) and edp (expert data
// parallel, dp / ep ranks that hold the same experts), and dpcp: the dp x cp ranks of one (pp,
// tp) index, which hold the same parameters and reduce their gradients together (rank
// dp_idx * cp + cp_idx). With cp = 1, dpcp has dp's ranks in dp's order.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "qtrain/comm.h"

namespace qt {

// The dimensions of the mesh, for the parts of the code that pick one (the sharding plan, the
// device communicators). kEdp is the expert-data-parallel group (dp / ep ranks holding the same
// experts), the group that reduces expert gradients. kCp splits each sequence (context
// parallelism); kDpCp is dp x cp, the group that reduces the dense gradients when cp > 1.
enum class MeshDim { kDp, kTp, kPp, kEp, kEdp, kCp, kDpCp };
inline constexpr int kNumMeshDims = 7;
const char* mesh_dim_name(MeshDim d);

struct MeshShape {
  int dp = 1;
  int tp = 1;
  int pp = 1;
  int ep = 1;
  // The pipeline schedule (pp > 1): "1f1b", or "zb-h1" (each backward split into its input and
  // weight halves, the weight halves filling the bubble; parallel/pipeline_schedule.h).
  std::string pp_schedule = "1f1b";
  // Model chunks a pipeline stage runs (> 1: interleaved 1F1B; chunk c on stage c % pp).
  int pp_chunks = 1;
  // Layers of each pipeline chunk, "a, b, ..." (pp x pp_chunks counts), or empty: the plan
  // balances them by cost.
  std::string pp_layers;
  // Sequence parallelism (Megatron's, with tp > 1): each tp rank keeps the residual stream, the
  // norms and the residual adds on its N / tp rows of a micro-batch's N; the blocks' inputs are
  // all-gathered and their outputs reduce-scattered over tp. Nothing with tp = 1.
  bool sequence_parallel = false;
  // With tp > 1 on GPUs: each block's tp collectives run in pieces beside its GEMMs
  // (cuda/cuda_ops.h); false (default: faster on two H200s, docs/performance.md): each after
  // its GEMM, whole.
  bool tp_overlap = false;
  // Context parallelism: each sequence of a micro-batch split over cp ranks in 2 cp
  // load-balanced chunks (parallel/context_parallel.h), attention by ring (model/ring_attention.h).
  int cp = 1;
  int world() const { return dp * cp * tp * pp; }
  // The ranks that hold the same parameters and sum their gradients: dp x cp.
  int dp_cp() const { return dp * cp; }
  // The tp ranks sequence parallelism splits a micro-batch's rows over: tp, or 1 (off).
  int seq_parallel() const { return sequence_parallel && tp > 1 ? tp : 1; }
};

// Coordinates of one rank in the mesh.
struct MeshCoord {
  int pp = 0, dp = 0, tp = 0, ep = 0, edp = 0, cp = 0;
};

// Pure functions of the mesh arithmetic (testable without MPI).
MeshCoord mesh_coord_of(const MeshShape& s, int world_rank);
int mesh_rank_of(const MeshShape& s, const MeshCoord& c);
// The tensor-parallel groups whose ranks are on more than one host, given each world rank's
// host: one line each, "world ranks a..b on hosts x, y". Tensor parallelism exchanges
// activations twice a layer; across hosts that traffic crosses the network.
std::vector<std::string> tp_groups_across_hosts(const MeshShape& s,
                                                const std::vector<std::string>& host_of_rank);
// One warning line naming mesh.tp and the ranks per host when any tensor-parallel group spans
// hosts (tp is innermost, so that happens when the ranks per host are not a multiple of mesh.tp,
// or when ranks are dealt round robin over the hosts); empty when none does.
std::string tp_across_hosts_warning(const MeshShape& s,
                                    const std::vector<std::string>& host_of_rank);

class Mesh {
 public:
  // Collective over `world`. The shape must already be validated against world->size().
  Mesh(const MeshShape& shape, std::shared_ptr<MpiComm> world);

  const MeshShape& shape() const { return shape_; }
  const MeshCoord& coord() const { return coord_; }
  int world_rank() const { return world_->rank(); }
  int local_rank() const { return local_rank_; }      // rank within this node
  int local_size() const { return local_size_; }      // ranks on this node
  const std::string& host() const { return host_; }

  // The MPI communicators of each dimension; device communicators (NCCL) are built from them.
  MpiComm& world() { return *world_; }
  MpiComm& dp() { return *dp_; }
  MpiComm& tp() { return *tp_; }
  MpiComm& pp() { return *pp_; }
  MpiComm& ep() { return *ep_; }
  MpiComm& edp() { return *edp_; }
  MpiComm& cp() { return *cp_; }
  MpiComm& dp_cp() { return *dp_cp_; }  // dp x cp: the gradient reduction's group
  // Raw MPI handle of the world communicator (for parallel HDF5).
  MPI_Comm world_mpi() const { return world_->mpi(); }
  MpiComm& mpi(MeshDim d);

  // The device communicator (NCCL) of dimension d: made on first use, collectively over that
  // dimension's ranks, on the GPU current then (a back end selects its device first); owned by
  // the mesh, so every user of a dimension shares one. Back ends never build their own. CUDA
  // builds only: elsewhere a UserError. channel k > 0: another communicator over the same ranks,
  // with a stream of its own, for traffic that must not queue behind channel 0's (a pipeline's
  // activations and gradients flow in opposite directions at once).
  Comm& device(MeshDim d, int channel = 0);

  // The time of each communicator's calls since the last take (Comm::take_times), in slots that
  // are the same on every rank whatever it has made: the device communicators by dimension
  // ("dp", "tp", "pp", "ep", "edp", "cp", "dpcp"; a dimension's channels summed), then the MPI
  // ones ("mpi.world", "mpi.dp", ...). Not collective; waits for the device communicators' timed
  // calls.
  struct CommTimes {
    std::string name;
    CollectiveTimes times;
  };
  std::vector<CommTimes> take_collective_times();

  // The start-up banner: the mesh's shape, the topology report (dist/topology.h: hosts, ranks and,
  // with `gpus`, GPUs per host, their links, each rank's NUMA placement; a few lines whatever the
  // job's size) and the warning of tp_across_hosts_warning. Collective; result on rank 0.
  std::string describe(bool gpus = false);

 private:
  MeshShape shape_;
  MeshCoord coord_;
  std::shared_ptr<MpiComm> world_;
  std::unique_ptr<MpiComm> dp_, tp_, pp_, ep_, edp_, cp_, dp_cp_;
  std::vector<std::unique_ptr<Comm>> device_[kNumMeshDims];  // by MeshDim and channel, made on
                                                            // first use
  int local_rank_ = 0, local_size_ = 1;
  std::string host_;
};

// Makes the device communicator of `mpi`'s ranks (collective over them). Defined by the CUDA build
// (src/cuda/nccl_comm.cpp, an NcclComm); without it, throws UserError.
std::unique_ptr<Comm> make_device_comm(const MpiComm& mpi, const std::string& name);

}  // namespace qt
