// qt::Comm over NCCL: a non-blocking communicator whose every wait polls with a deadline.
#include "cuda/nccl_comm.h"

#include <fmt/format.h>
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "cuda/check.h"
#include "cuda/collective_timer.h"
#include "cuda/device.h"
#include "dist/device_communicators.h"
#include "runtime/process.h"
#include "cuda/nccl_check.h"
#include "qtrain/error.h"

namespace qt::cuda {

namespace {

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::kF32: return ncclFloat32;
    case DType::kF64: return ncclFloat64;
    case DType::kBF16: return ncclBfloat16;
    case DType::kI32: return ncclInt32;
    case DType::kI64: return ncclInt64;
    case DType::kU64: return ncclUint64;
  }
  return ncclFloat32;
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return ncclSum;
    case ReduceOp::kMax: return ncclMax;
    case ReduceOp::kMin: return ncclMin;
  }
  return ncclSum;
}

// True for memory NCCL can use directly (device or managed); false for host memory.
bool on_device(const void* p) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();  // clear: an unknown pointer is host memory
    return false;
  }
  return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
}

double bytes_of(std::size_t count, DType t) { return static_cast<double>(count * dtype_size(t)); }

}  // namespace

NcclComm::NcclComm(const MpiComm& mpi, std::string name, double timeout_s, OnTimeout on_timeout)
    : name_(std::move(name)),
      rank_(mpi.rank()),
      size_(mpi.size()),
      timeout_s_(timeout_s),
      on_timeout_(on_timeout),
      timer_(std::make_unique<CollectiveTimer>(size_)) {
  if (!(timeout_s_ > 0)) fail_user("NcclComm '{}': timeout must be > 0 s, got {}", name_, timeout_s_);
  setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);  // NVLink multicast stays off (shared GPUs)
  QT_CHECK_CUDA(cudaGetDevice(&device_));
  scratch_ = DeviceBuffer(kHostStagingBytes, "NcclComm '" + name_ + "' scratch");
  QT_CHECK_CUDA(cudaStreamCreate(&stream_));  // blocking: ordered after the legacy default stream

  ncclUniqueId id{};
  if (rank_ == 0) QT_CHECK_NCCL(ncclGetUniqueId(&id));
  QT_CHECK_MPI(MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, mpi.mpi()));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  config.commName = name_.c_str();
  const Pending init{"communicator init", 0, DType::kF32, -1};
  const ncclResult_t rc = ncclCommInitRankConfig(&comm_, size_, id, rank_, &config);
  if (comm_ == nullptr) {
    fail_library("NCCL", __FILE__, __LINE__, "ncclCommInitRankConfig",
                 fmt::format("communicator '{}': {}", name_, ncclGetErrorString(rc)).c_str());
  }
  enqueued(rc, init, "ncclCommInitRankConfig");
  wait_idle(init);
}

NcclComm::~NcclComm() {
  if (comm_ != nullptr && !aborted_) {
    // Finalize flushes outstanding work; destroy only once it is quiescent, else abort.
    bool clean = false;
    const ncclResult_t rc = ncclCommFinalize(comm_);
    if (rc == ncclSuccess || rc == ncclInProgress) {
      const auto deadline = std::chrono::steady_clock::now() +
                            std::chrono::duration<double>(std::min(timeout_s_, 60.0));
      ncclResult_t state = ncclInProgress;
      while (ncclCommGetAsyncError(comm_, &state) == ncclSuccess && state == ncclInProgress &&
             std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
      clean = state == ncclSuccess;
    }
    if (clean) {
      ncclCommDestroy(comm_);
    } else {
      ncclCommAbort(comm_);
    }
  }
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

// ---- waiting -------------------------------------------------------------------------------------

std::string NcclComm::describe(const Pending& what) const {
  if (what.count == 0 && what.peer < 0) return what.op;  // init, synchronize
  std::string s = fmt::format("{} of {} {} ({})", what.op, what.count, dtype_name(what.t),
                              format_bytes(what.count * dtype_size(what.t)));
  if (what.peer >= 0) s += fmt::format(", peer rank {}", what.peer);
  return s;
}

void NcclComm::check_usable(const char* op) const {
  if (aborted_) {
    throw std::logic_error(fmt::format(
        "NcclComm '{}': {} called after the communicator was aborted by a timeout", name_, op));
  }
}

void NcclComm::enqueued(ncclResult_t rc, const Pending& what, const char* call) {
  if (rc == ncclSuccess) return;
  if (rc == ncclInProgress) {
    // A non-blocking communicator takes no further call until NCCL has handed this one to the
    // stream: wait for that (usually microseconds), with the same deadline and reports.
    using Clock = std::chrono::steady_clock;
    const auto start = Clock::now();
    ncclResult_t state = ncclInProgress;
    for (;;) {
      QT_CHECK_NCCL(ncclCommGetAsyncError(comm_, &state));
      if (state != ncclInProgress) break;
      const double waited = std::chrono::duration<double>(Clock::now() - start).count();
      if (waited > timeout_s_) timed_out(what, waited);
      if (waited > 0.1) {
        std::this_thread::sleep_for(std::chrono::microseconds(500));
      } else if (waited > 1e-3) {
        std::this_thread::yield();
      }
    }
    if (state == ncclSuccess) return;
    rc = state;
  }
  const std::string msg = fmt::format("communicator '{}' (rank {} of {}), {}: {} ({})", name_, rank_,
                                      size_, describe(what), ncclGetErrorString(rc),
                                      comm_ != nullptr ? ncclGetLastError(comm_) : "");
  fail_library("NCCL", __FILE__, __LINE__, call, msg.c_str());
}

void NcclComm::wait_idle(const Pending& what) {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  for (;;) {
    // An NCCL error means the operation will never finish; ncclInProgress means NCCL has not yet
    // handed all the work to the stream (non-blocking communicator).
    ncclResult_t state = ncclSuccess;
    QT_CHECK_NCCL(ncclCommGetAsyncError(comm_, &state));
    if (state != ncclSuccess && state != ncclInProgress) {
      const std::string msg = fmt::format("communicator '{}' (rank {} of {}) waiting for {}: {} ({})",
                                          name_, rank_, size_, describe(what),
                                          ncclGetErrorString(state), ncclGetLastError(comm_));
      fail_library("NCCL", __FILE__, __LINE__, "ncclCommGetAsyncError", msg.c_str());
    }
    if (state == ncclSuccess) {
      const cudaError_t q = cudaStreamQuery(stream_);
      if (q == cudaSuccess) return;
      if (q != cudaErrorNotReady) QT_CHECK_CUDA(q);
    }
    const double waited = std::chrono::duration<double>(Clock::now() - start).count();
    if (waited > timeout_s_) timed_out(what, waited);
    // Spin for the short waits that small collectives need, then back off.
    if (waited > 0.1) {
      std::this_thread::sleep_for(std::chrono::microseconds(500));
    } else if (waited > 1e-3) {
      std::this_thread::yield();
    }
  }
}

void NcclComm::timed_out(const Pending& what, double waited_s) {
  const std::string msg = fmt::format(
      "NCCL timeout: world rank {} ({}, device {}) waited {:.1f} s (timeout {} s) on communicator "
      "'{}' (rank {} of {}) for {}",
      world_rank_or_zero(), host_name(), device_, waited_s, timeout_s_, name_, rank_, size_,
      describe(what));
  std::fprintf(stderr, "qtrain: %s; aborting the communicator%s\n", msg.c_str(),
               on_timeout_ == OnTimeout::kAbortJob ? " and the job" : "");
  std::fflush(stderr);
  if (on_timeout_ == OnTimeout::kThrow) {
    ncclCommAbort(comm_);
    comm_ = nullptr;
    aborted_ = true;
    throw CommTimeout(msg);
  }
  // ncclCommAbort has been seen to hang in some NCCL versions: never let it keep the job alive.
  std::thread([] {
    std::this_thread::sleep_for(std::chrono::seconds(10));
    std::fprintf(stderr, "qtrain: ncclCommAbort did not return within 10 s; exiting\n");
    std::fflush(stderr);
    std::_Exit(1);
  }).detach();
  ncclCommAbort(comm_);
  comm_ = nullptr;
  aborted_ = true;
  MPI_Abort(MPI_COMM_WORLD, 1);
  std::abort();
}

void NcclComm::synchronize() {
  check_usable("synchronize");
  wait_idle(last_async_);
  last_async_ = Pending{"synchronize", 0, DType::kF32, -1};
}

CollectiveTimes NcclComm::take_times() { return timer_->take(); }

void NcclComm::wait_event(cudaEvent_t e) { QT_CHECK_CUDA(cudaStreamWaitEvent(stream_, e, 0)); }

void* NcclComm::staging(std::size_t bytes, const Pending& what) {
  if (bytes > kHostStagingBytes) {
    throw std::invalid_argument(fmt::format(
        "NcclComm '{}': {} on host buffers of {} in all; NCCL needs device buffers (host buffers "
        "are staged only up to {})",
        name_, describe(what), format_bytes(bytes), format_bytes(kHostStagingBytes)));
  }
  return scratch_.get();
}

// ---- collectives ---------------------------------------------------------------------------------

namespace {

void require_buffer(const void* p, std::size_t count, const char* op, const char* which) {
  if (p == nullptr && count > 0)
    throw std::invalid_argument(fmt::format("NcclComm::{}: {} is null with count {}", op, which, count));
}

void require_device(const void* p, const char* op, const char* which) {
  if (!on_device(p))
    throw std::invalid_argument(fmt::format("NcclComm::{}: {} must be device memory", op, which));
}

}  // namespace

void NcclComm::all_reduce_async(void* buf, std::size_t count, DType t, ReduceOp op) {
  const Pending what{"all_reduce", count, t, -1};
  check_usable(what.op);
  require_buffer(buf, count, what.op, "buf");
  if (count == 0) return;
  require_device(buf, what.op, "buf");
  const TimedCall timed(*timer_, stream_, CollectiveKind::kAllReduce, bytes_of(count, t));
  enqueued(ncclAllReduce(buf, buf, count, nccl_type(t), nccl_op(op), comm_, stream_), what,
           "ncclAllReduce");
  last_async_ = what;
}

void NcclComm::reduce_async(void* buf, std::size_t count, DType t, ReduceOp op, int root) {
  const Pending what{"reduce", count, t, root};
  check_usable(what.op);
  require_buffer(buf, count, what.op, "buf");
  QT_CHECK(root >= 0 && root < size_, "reduce on '{}': root {} of {} ranks", name_, root, size_);
  if (count == 0) return;
  require_device(buf, what.op, "buf");
  const TimedCall timed(*timer_, stream_, CollectiveKind::kReduce, bytes_of(count, t));
  enqueued(ncclReduce(buf, buf, count, nccl_type(t), nccl_op(op), root, comm_, stream_), what,
           "ncclReduce");
  last_async_ = what;
}

void NcclComm::group_start() {
  check_usable("group_start");
  QT_CHECK_NCCL(ncclGroupStart());
  timer_->group_begin(stream_);
}

void NcclComm::group_end() {
  enqueued(ncclGroupEnd(), last_async_, "ncclGroupEnd");
  timer_->group_end(stream_);
}

void NcclComm::reduce_scatter_async(const void* send, void* recv, std::size_t count, DType t,
                                    ReduceOp op) {
  const Pending what{"reduce_scatter", count, t, -1};
  check_usable(what.op);
  require_buffer(send, count, what.op, "send");
  require_buffer(recv, count, what.op, "recv");
  if (count == 0) return;
  require_device(send, what.op, "send");
  require_device(recv, what.op, "recv");
  const TimedCall timed(*timer_, stream_, CollectiveKind::kReduceScatter,
                        bytes_of(count * size_, t));
  enqueued(ncclReduceScatter(send, recv, count, nccl_type(t), nccl_op(op), comm_, stream_), what,
           "ncclReduceScatter");
  last_async_ = what;
}

void NcclComm::all_gather_async(const void* send, void* recv, std::size_t count, DType t) {
  const Pending what{"all_gather", count, t, -1};
  check_usable(what.op);
  require_buffer(send, count, what.op, "send");
  require_buffer(recv, count, what.op, "recv");
  if (count == 0) return;
  require_device(send, what.op, "send");
  require_device(recv, what.op, "recv");
  const TimedCall timed(*timer_, stream_, CollectiveKind::kAllGather, bytes_of(count * size_, t));
  enqueued(ncclAllGather(send, recv, count, nccl_type(t), comm_, stream_), what, "ncclAllGather");
  last_async_ = what;
}

void NcclComm::all_reduce(void* buf, std::size_t count, DType t, ReduceOp op) {
  const Pending what{"all_reduce", count, t, -1};
  check_usable(what.op);
  require_buffer(buf, count, what.op, "buf");
  if (count == 0) return;
  if (on_device(buf)) {
    all_reduce_async(buf, count, t, op);
    wait_idle(what);
    return;
  }
  const std::size_t bytes = count * dtype_size(t);
  void* d = staging(bytes, what);
  QT_CHECK_CUDA(cudaMemcpyAsync(d, buf, bytes, cudaMemcpyHostToDevice, stream_));
  {
    const TimedCall timed(*timer_, stream_, CollectiveKind::kAllReduce, bytes_of(count, t));
    enqueued(ncclAllReduce(d, d, count, nccl_type(t), nccl_op(op), comm_, stream_), what,
             "ncclAllReduce");
  }
  wait_idle(what);  // before the copy back, which blocks the host
  QT_CHECK_CUDA(cudaMemcpyAsync(buf, d, bytes, cudaMemcpyDeviceToHost, stream_));
  wait_idle(what);
}

void NcclComm::reduce_scatter(const void* send, void* recv, std::size_t count, DType t,
                              ReduceOp op) {
  const Pending what{"reduce_scatter", count, t, -1};
  check_usable(what.op);
  require_buffer(send, count, what.op, "send");
  require_buffer(recv, count, what.op, "recv");
  if (count == 0) return;
  const bool dev_send = on_device(send), dev_recv = on_device(recv);
  if (dev_send && dev_recv) {
    reduce_scatter_async(send, recv, count, t, op);
    wait_idle(what);
    return;
  }
  if (dev_send || dev_recv)
    throw std::invalid_argument("NcclComm::reduce_scatter: send and recv must both be device or both host memory");
  const std::size_t in = count * size_ * dtype_size(t), out = count * dtype_size(t);
  char* d = static_cast<char*>(staging(round_up(in, 256) + out, what));
  QT_CHECK_CUDA(cudaMemcpyAsync(d, send, in, cudaMemcpyHostToDevice, stream_));
  {
    const TimedCall timed(*timer_, stream_, CollectiveKind::kReduceScatter,
                          static_cast<double>(in));
    enqueued(ncclReduceScatter(d, d + round_up(in, 256), count, nccl_type(t), nccl_op(op), comm_,
                               stream_),
             what, "ncclReduceScatter");
  }
  wait_idle(what);
  QT_CHECK_CUDA(cudaMemcpyAsync(recv, d + round_up(in, 256), out, cudaMemcpyDeviceToHost, stream_));
  wait_idle(what);
}

void NcclComm::all_gather(const void* send, void* recv, std::size_t count, DType t) {
  const Pending what{"all_gather", count, t, -1};
  check_usable(what.op);
  require_buffer(send, count, what.op, "send");
  require_buffer(recv, count, what.op, "recv");
  if (count == 0) return;
  const bool dev_send = on_device(send), dev_recv = on_device(recv);
  if (dev_send && dev_recv) {
    all_gather_async(send, recv, count, t);
    wait_idle(what);
    return;
  }
  if (dev_send || dev_recv)
    throw std::invalid_argument("NcclComm::all_gather: send and recv must both be device or both host memory");
  const std::size_t in = count * dtype_size(t), out = count * size_ * dtype_size(t);
  char* d = static_cast<char*>(staging(round_up(in, 256) + out, what));
  QT_CHECK_CUDA(cudaMemcpyAsync(d, send, in, cudaMemcpyHostToDevice, stream_));
  {
    const TimedCall timed(*timer_, stream_, CollectiveKind::kAllGather, static_cast<double>(out));
    enqueued(ncclAllGather(d, d + round_up(in, 256), count, nccl_type(t), comm_, stream_), what,
             "ncclAllGather");
  }
  wait_idle(what);
  QT_CHECK_CUDA(cudaMemcpyAsync(recv, d + round_up(in, 256), out, cudaMemcpyDeviceToHost, stream_));
  wait_idle(what);
}

void NcclComm::all_to_all_v(const void* send, const std::vector<std::size_t>& send_counts,
                            const std::vector<std::size_t>& send_displs, void* recv,
                            const std::vector<std::size_t>& recv_counts,
                            const std::vector<std::size_t>& recv_displs, DType t) {
  all_to_all_v_async(send, send_counts, send_displs, recv, recv_counts, recv_displs, t);
  wait_idle(last_async_);
}

void NcclComm::all_to_all_v_async(const void* send, const std::vector<std::size_t>& send_counts,
                                  const std::vector<std::size_t>& send_displs, void* recv,
                                  const std::vector<std::size_t>& recv_counts,
                                  const std::vector<std::size_t>& recv_displs, DType t) {
  std::size_t total = 0;
  for (std::size_t c : send_counts) total += c;
  const Pending what{"all_to_all_v (send total)", total, t, -1};
  check_usable(what.op);
  const auto n = static_cast<std::size_t>(size_);
  if (send_counts.size() != n || send_displs.size() != n || recv_counts.size() != n ||
      recv_displs.size() != n) {
    throw std::invalid_argument(fmt::format(
        "NcclComm::all_to_all_v on '{}': counts and displacements need {} entries each", name_, n));
  }
  std::size_t recv_total = 0;
  for (std::size_t c : recv_counts) recv_total += c;
  if (total > 0) require_device(send, "all_to_all_v", "send");
  if (recv_total > 0) require_device(recv, "all_to_all_v", "recv");
  const std::size_t es = dtype_size(t);
  const auto* s = static_cast<const char*>(send);
  auto* r = static_cast<char*>(recv);
  const ncclDataType_t nt = nccl_type(t);
  // This rank's own block is a device copy; the pairs' counts agree, so zero blocks are skipped
  // on both sides.
  if (send_counts[rank_] != recv_counts[rank_]) {
    throw std::invalid_argument(fmt::format(
        "NcclComm::all_to_all_v on '{}': rank {} sends {} elements to itself but receives {}",
        name_, rank_, send_counts[rank_], recv_counts[rank_]));
  }
  const TimedCall timed(*timer_, stream_, CollectiveKind::kAllToAll, bytes_of(total, t));
  if (send_counts[rank_] > 0) {
    QT_CHECK_CUDA(cudaMemcpyAsync(r + recv_displs[rank_] * es, s + send_displs[rank_] * es,
                                  send_counts[rank_] * es, cudaMemcpyDeviceToDevice, stream_));
  }
  QT_CHECK_NCCL(ncclGroupStart());
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    if (send_counts[p] > 0)
      enqueued(ncclSend(s + send_displs[p] * es, send_counts[p], nt, p, comm_, stream_), what,
               "ncclSend");
    if (recv_counts[p] > 0)
      enqueued(ncclRecv(r + recv_displs[p] * es, recv_counts[p], nt, p, comm_, stream_), what,
               "ncclRecv");
  }
  enqueued(ncclGroupEnd(), what, "ncclGroupEnd");
  last_async_ = what;
}

void NcclComm::point_to_point(bool is_send, const void* buf, std::size_t count, DType t, int peer,
                              bool blocking) {
  const Pending what{is_send ? "send" : "recv", count, t, peer};
  check_usable(what.op);
  if (peer < 0 || peer >= size_)
    throw std::invalid_argument(fmt::format("NcclComm::{}{} on '{}': {} {} not in [0, {})", what.op,
                                            blocking ? "" : "_async", name_,
                                            is_send ? "dest" : "src", peer, size_));
  require_buffer(buf, count, what.op, "buf");
  if (count == 0) return;
  require_device(buf, what.op, "buf");
  const TimedCall timed(*timer_, stream_, CollectiveKind::kPointToPoint, bytes_of(count, t));
  if (is_send)
    enqueued(ncclSend(buf, count, nccl_type(t), peer, comm_, stream_), what, "ncclSend");
  else  // ncclRecv writes buf: it came in as the non-const pointer of recv/recv_async
    enqueued(ncclRecv(const_cast<void*>(buf), count, nccl_type(t), peer, comm_, stream_), what,
             "ncclRecv");
  if (blocking)
    wait_idle(what);
  else
    last_async_ = what;
}

void NcclComm::send_async(const void* buf, std::size_t count, DType t, int dest) {
  point_to_point(true, buf, count, t, dest, /*blocking=*/false);
}

void NcclComm::recv_async(void* buf, std::size_t count, DType t, int src) {
  point_to_point(false, buf, count, t, src, /*blocking=*/false);
}

void NcclComm::all_to_all_device_async(const void* send, const std::int64_t* d_send_counts,
                                       void* recv, std::int64_t* d_recv_counts,
                                       std::size_t capacity, DType t) {
  const Pending what{"all_to_all_device (block per peer)", capacity, t, -1};
  check_usable(what.op);
  const char* api = "all_to_all_device_async";
  const auto n = static_cast<std::size_t>(size_);
  require_buffer(d_send_counts, n, api, "d_send_counts");
  require_buffer(d_recv_counts, n, api, "d_recv_counts");
  require_device(d_send_counts, api, "d_send_counts");
  require_device(d_recv_counts, api, "d_recv_counts");
  require_buffer(send, n * capacity, api, "send");
  require_buffer(recv, n * capacity, api, "recv");
  if (capacity > 0) {
    require_device(send, api, "send");
    require_device(recv, api, "recv");
  }
  const std::size_t block = capacity * dtype_size(t);
  const auto* s = static_cast<const char*>(send);
  auto* r = static_cast<char*>(recv);
  const auto s_at = reinterpret_cast<std::uintptr_t>(s), r_at = reinterpret_cast<std::uintptr_t>(r);
  if (block > 0 && s_at < r_at + n * block && r_at < s_at + n * block)
    throw std::invalid_argument(fmt::format(
        "NcclComm::{} on '{}': recv overlaps send (not in place)", api, name_));
  const TimedCall timed(*timer_, stream_, CollectiveKind::kAllToAll,
                        static_cast<double>(n * block));
  // The rank's own count and block: device copies on the same stream.
  QT_CHECK_CUDA(cudaMemcpyAsync(d_recv_counts + rank_, d_send_counts + rank_, sizeof(std::int64_t),
                                cudaMemcpyDeviceToDevice, stream_));
  if (block > 0) {
    QT_CHECK_CUDA(cudaMemcpyAsync(r + rank_ * block, s + rank_ * block, block,
                                  cudaMemcpyDeviceToDevice, stream_));
  }
  // One group, one launch: calls to the same peer run in order, so each peer's count and block
  // pair up with the matching receives whatever the other peers do.
  QT_CHECK_NCCL(ncclGroupStart());
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    enqueued(ncclSend(d_send_counts + p, 1, ncclInt64, p, comm_, stream_), what, "ncclSend");
    enqueued(ncclRecv(d_recv_counts + p, 1, ncclInt64, p, comm_, stream_), what, "ncclRecv");
    if (capacity > 0) {
      enqueued(ncclSend(s + p * block, capacity, nccl_type(t), p, comm_, stream_), what,
               "ncclSend");
      enqueued(ncclRecv(r + p * block, capacity, nccl_type(t), p, comm_, stream_), what,
               "ncclRecv");
    }
  }
  enqueued(ncclGroupEnd(), what, "ncclGroupEnd");
  last_async_ = what;
}

// NCCL has no tags: messages between a pair arrive in the order they were sent.
void NcclComm::send(const void* buf, std::size_t count, DType t, int dest, int /*tag*/) {
  point_to_point(true, buf, count, t, dest, /*blocking=*/true);
}

void NcclComm::recv(void* buf, std::size_t count, DType t, int src, int /*tag*/) {
  point_to_point(false, buf, count, t, src, /*blocking=*/true);
}

void NcclComm::broadcast(void* buf, std::size_t count, DType t, int root) {
  const Pending what{"broadcast", count, t, root};
  check_usable(what.op);
  if (root < 0 || root >= size_)
    throw std::invalid_argument(fmt::format("NcclComm::broadcast on '{}': root {} not in [0, {})", name_, root, size_));
  require_buffer(buf, count, what.op, "buf");
  if (count == 0) return;
  const std::size_t bytes = count * dtype_size(t);
  const bool dev = on_device(buf);
  void* d = dev ? buf : staging(bytes, what);
  if (!dev) QT_CHECK_CUDA(cudaMemcpyAsync(d, buf, bytes, cudaMemcpyHostToDevice, stream_));
  {
    const TimedCall timed(*timer_, stream_, CollectiveKind::kBroadcast, static_cast<double>(bytes));
    enqueued(ncclBroadcast(d, d, count, nccl_type(t), root, comm_, stream_), what, "ncclBroadcast");
  }
  wait_idle(what);
  if (!dev) {
    QT_CHECK_CUDA(cudaMemcpyAsync(buf, d, bytes, cudaMemcpyDeviceToHost, stream_));
    wait_idle(what);
  }
}

void NcclComm::barrier() {
  const Pending what{"barrier", 1, DType::kI32, -1};
  check_usable(what.op);
  QT_CHECK_CUDA(cudaMemsetAsync(scratch_.get(), 0, sizeof(int), stream_));
  enqueued(ncclAllReduce(scratch_.get(), scratch_.get(), 1, ncclInt32, ncclSum, comm_, stream_),
           what, "ncclAllReduce");
  wait_idle(what);
}

void NcclComm::connect(const std::vector<int>& peers) {
  const Pending what{"connect", 1, DType::kI32, -1};
  check_usable(what.op);
  int* word = static_cast<int*>(scratch_.get());  // [0] the all-reduce's, [1] sent, [2] received
  QT_CHECK_CUDA(cudaMemsetAsync(word, 0, 3 * sizeof(int), stream_));
  enqueued(ncclAllReduce(word, word, 1, ncclInt32, ncclSum, comm_, stream_), what,
           "ncclAllReduce");
  if (!peers.empty()) {
    QT_CHECK_NCCL(ncclGroupStart());
    for (const int p : peers) {
      enqueued(ncclSend(word + 1, 1, ncclInt32, p, comm_, stream_), what, "ncclSend");
      enqueued(ncclRecv(word + 2, 1, ncclInt32, p, comm_, stream_), what, "ncclRecv");
    }
    enqueued(ncclGroupEnd(), what, "ncclGroupEnd");
  }
  wait_idle(what);
}

std::size_t connect_before_arena(Mesh& mesh, bool moe) {
  const std::size_t free_before = device_memory().free_bytes;
  for (const DeviceCommunicator& d : device_communicators(mesh.shape(), moe)) {
    NcclComm& c = nccl(mesh, d.dim, d.channel);
    // The point-to-point peers beside the all-reduce: the all-to-all's (every other rank of
    // the ep group) and each pipeline channel's neighbouring stages, both ways (the wrap joins
    // P - 1 and 0).
    std::vector<int> peers;
    if (d.dim == MeshDim::kEp) {
      for (int r = 0; r < c.size(); ++r)
        if (r != c.rank()) peers.push_back(r);
    } else if (d.dim == MeshDim::kPp) {
      const int s = mesh.coord().pp, P = mesh.shape().pp;
      peers.push_back((s + 1) % P);
      if ((s + P - 1) % P != peers[0]) peers.push_back((s + P - 1) % P);
    }
    c.connect(peers);
  }
  QT_CHECK_CUDA(cudaDeviceSynchronize());
  const std::size_t free_after = device_memory().free_bytes;
  return free_before > free_after ? free_before - free_after : 0;
}

NcclComm& nccl(Mesh& mesh, MeshDim d, int channel) {
  auto* c = dynamic_cast<NcclComm*>(&mesh.device(d, channel));
  QT_CHECK(c != nullptr, "the mesh's device communicator {} is not an NcclComm", mesh_dim_name(d));
  return *c;
}

}  // namespace qt::cuda

namespace qt {

std::unique_ptr<Comm> make_device_comm(const MpiComm& mpi, const std::string& name) {
  return std::make_unique<cuda::NcclComm>(mpi, name);
}

}  // namespace qt
