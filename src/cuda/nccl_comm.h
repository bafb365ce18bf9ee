// qt::Comm over NCCL on device buffers.
//
// Built collectively from an MpiComm (rank 0 makes the NCCL unique id, MPI broadcasts it) on the
// current device, as a non-blocking NCCL communicator with its own stream. The Comm calls are
// blocking: each enqueues on stream() and then waits, polling ncclCommGetAsyncError and
// cudaStreamQuery until a deadline (timeout_s). On timeout every waiting rank prints what it was
// waiting for (operation, communicator, count, dtype, peer) and, by default, the communicator and
// the job are aborted (MPI_Abort); an NCCL async error aborts the job at once.
//
// Ordering: stream() is a blocking stream, so device work queued earlier on the legacy default
// stream is ordered before a collective; work on other streams must be synchronised first, or
// ordered with wait_event(). Host buffers (e.g. Comm::sum(double)) are staged through a small
// device scratch buffer (kHostStagingBytes); larger buffers must be device memory.
// send/recv ignore `tag` (NCCL matches point-to-point calls by order) and are rendezvous: a send
// returns only once the peer's recv has completed, so two ranks must not both send first.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda/device.h"
#include "qtrain/comm.h"
#include "qtrain/mesh.h"

namespace qt::cuda {

class CollectiveTimer;

// Thrown on timeout when the communicator was made with OnTimeout::kThrow (tests); the
// communicator is aborted and every later call on it throws std::logic_error.
class CommTimeout : public std::runtime_error {
 public:
  explicit CommTimeout(const std::string& msg) : std::runtime_error(msg) {}
};

enum class OnTimeout { kAbortJob, kThrow };

class NcclComm final : public Comm {
 public:
  static constexpr double kDefaultTimeoutS = 600.0;
  static constexpr std::size_t kHostStagingBytes = 64 * 1024;

  // Collective over `mpi`. Sets NCCL_NVLS_ENABLE=0 when unset (NVLink multicast stays off).
  NcclComm(const MpiComm& mpi, std::string name, double timeout_s = kDefaultTimeoutS,
           OnTimeout on_timeout = OnTimeout::kAbortJob);
  ~NcclComm() override;
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::string& name() const override { return name_; }

  void all_reduce(void* buf, std::size_t count, DType t, ReduceOp op) override;
  void reduce_scatter(const void* send, void* recv, std::size_t count, DType t,
                      ReduceOp op) override;
  void all_gather(const void* send, void* recv, std::size_t count, DType t) override;
  void all_to_all_v(const void* send, const std::vector<std::size_t>& send_counts,
                    const std::vector<std::size_t>& send_displs, void* recv,
                    const std::vector<std::size_t>& recv_counts,
                    const std::vector<std::size_t>& recv_displs, DType t) override;
  void send(const void* buf, std::size_t count, DType t, int dest, int tag) override;
  void recv(void* buf, std::size_t count, DType t, int src, int tag) override;
  void broadcast(void* buf, std::size_t count, DType t, int root) override;
  void barrier() override;
  // Each call's kernels timed on stream() with CUDA events (cuda/collective_timer.h); a group's
  // calls count as one of the first call's kind. Waits for the timed calls to finish.
  CollectiveTimes take_times() override;

  // Asynchronous variants (device buffers only): enqueue on stream() and return. Complete them
  // with synchronize(), or order other streams after them with an event recorded on stream().
  void all_reduce_async(void* buf, std::size_t count, DType t, ReduceOp op);
  void reduce_scatter_async(const void* send, void* recv, std::size_t count, DType t, ReduceOp op);
  void all_gather_async(const void* send, void* recv, std::size_t count, DType t);
  // In place: root's buf[count] <- op over ranks of buf[count]; other ranks' buf is unchanged.
  void reduce_async(void* buf, std::size_t count, DType t, ReduceOp op, int root);
  // Point to point, asynchronous: enqueue on stream() and return. Inside group_start/group_end
  // any number of sends and receives (to several peers, in both directions at once: a pipeline
  // stage's exchange) run as one batch without deadlock; outside a group each is its own launch.
  void send_async(const void* buf, std::size_t count, DType t, int dest);
  void recv_async(void* buf, std::size_t count, DType t, int src);
  // Comm::all_to_all_v (counts and displacements in elements, from the host), asynchronous:
  // enqueued on stream() (one NCCL group: a send and a receive per peer with a count, this
  // rank's own block a device copy) and never waited for. Expert dispatch with exact counts
  // (cuda_ops_moe_ep.cpp): the host learns them once per sparse layer.
  void all_to_all_v_async(const void* send, const std::vector<std::size_t>& send_counts,
                          const std::vector<std::size_t>& send_displs, void* recv,
                          const std::vector<std::size_t>& recv_counts,
                          const std::vector<std::size_t>& recv_displs, DType t);
  // All-to-all whose counts live in device memory (expert dispatch: the router computes them on
  // the GPU), asynchronous: enqueued on stream() and never waited for, so no host sync per layer.
  //   send[size() * capacity]: block p (elements [p * capacity, (p + 1) * capacity)) goes to rank
  //     p, of which the first d_send_counts[p] are valid; d_send_counts: int64 [size()].
  //   recv[size() * capacity]: block p comes from rank p, of which the first d_recv_counts[p]
  //     are valid (rank p's d_send_counts[rank()]); d_recv_counts: int64 [size()].
  // NCCL takes its counts from the host, so whole blocks of `capacity` travel, padding included:
  // one NCCL group sends the counts (one int64 per peer) and the blocks, in that order per peer;
  // the rank's own count and block are device copies. The counts are carried, never read here:
  // counts outside [0, capacity] are the caller's bug (the transfer stays inside the buffers;
  // a consumer that trusts such a count does not). Collective: every rank passes the same
  // capacity and t. All four buffers are device memory, written or read by work ordered with
  // stream() (wait_event, an event recorded on it), and recv must not overlap send.
  void all_to_all_device_async(const void* send, const std::int64_t* d_send_counts, void* recv,
                               std::int64_t* d_recv_counts, std::size_t capacity, DType t);
  // Brackets several async calls into one NCCL group (one fused launch); calls between them
  // return at once and the whole group is enqueued by group_end().
  void group_start();
  void group_end();

  // Sets up NCCL's connections now: the ring of the collectives (a one-word all-reduce) and a
  // send and a receive with each of `peers`. NCCL otherwise makes them, and allocates their
  // device buffers, at the first collective or send/receive of the step, by then out of the
  // little that a training arena leaves (connect_before_arena).
  void connect(const std::vector<int>& peers);
  // Waits, with the timeout, until everything enqueued on stream() has finished.
  void synchronize();
  // Makes later work on stream() wait for `e` (recorded on a producing stream).
  void wait_event(cudaEvent_t e);

  cudaStream_t stream() const { return stream_; }
  ncclComm_t nccl() const { return comm_; }
  int device() const { return device_; }
  double timeout_s() const { return timeout_s_; }
  bool aborted() const { return aborted_; }

 private:
  // What a wait is for, formatted only when a report is needed.
  struct Pending {
    const char* op = "";
    std::size_t count = 0;
    DType t = DType::kF32;
    int peer = -1;  // root, source or destination; -1 if none
  };

  void check_usable(const char* op) const;
  // send (is_send) or recv of a device buffer with `peer`: the body of send, recv, send_async and
  // recv_async. `blocking` waits for it; otherwise it is recorded for synchronize().
  void point_to_point(bool is_send, const void* buf, std::size_t count, DType t, int peer,
                      bool blocking);
  void enqueued(ncclResult_t rc, const Pending& what, const char* call);
  void wait_idle(const Pending& what);
  [[noreturn]] void timed_out(const Pending& what, double waited_s);
  std::string describe(const Pending& what) const;
  void* staging(std::size_t bytes, const Pending& what);

  std::string name_;
  int rank_ = 0, size_ = 1;
  int device_ = -1;
  double timeout_s_;
  OnTimeout on_timeout_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  DeviceBuffer scratch_;  // host staging and the barrier's word
  Pending last_async_;    // the latest async operation, for synchronize()'s report
  bool aborted_ = false;
  std::unique_ptr<CollectiveTimer> timer_;
};

// The mesh's device communicator of dimension d and channel k (Mesh::device), as the NcclComm it
// is.
NcclComm& nccl(Mesh& mesh, MeshDim d, int channel = 0);

// Makes the device communicators that a CUDA training back end of this mesh uses
// (dist/device_communicators.h; moe: a Qwen3-MoE model) and connects them (NcclComm::connect)
// before the back end sizes its arena from the free memory. Collective over the world, every
// rank in the same order. Returns the device memory they took (the free memory before less
// after, in bytes): outside the arena, which `qtrain plan` counts beside it (plan::nccl_bytes).
std::size_t connect_before_arena(Mesh& mesh, bool moe);

}  // namespace qt::cuda
