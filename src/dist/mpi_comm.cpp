// Communicator interface over MPI for host buffers.
#include <algorithm>
#include <climits>

#include "qtrain/comm.h"
#include "qtrain/error.h"

namespace qt {

std::size_t dtype_size(DType t) {
  switch (t) {
    case DType::kF32: return 4;
    case DType::kF64: return 8;
    case DType::kBF16: return 2;
    case DType::kI32: return 4;
    case DType::kI64: return 8;
    case DType::kU64: return 8;
  }
  return 0;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::kF32: return "f32";
    case DType::kF64: return "f64";
    case DType::kBF16: return "bf16";
    case DType::kI32: return "i32";
    case DType::kI64: return "i64";
    case DType::kU64: return "u64";
  }
  return "?";
}

const char* collective_kind_name(CollectiveKind k) {
  switch (k) {
    case CollectiveKind::kAllReduce: return "all_reduce";
    case CollectiveKind::kReduceScatter: return "reduce_scatter";
    case CollectiveKind::kAllGather: return "all_gather";
    case CollectiveKind::kAllToAll: return "all_to_all";
    case CollectiveKind::kPointToPoint: return "send_recv";
    case CollectiveKind::kBroadcast: return "broadcast";
    case CollectiveKind::kReduce: return "reduce";
  }
  return "?";
}

void add_call(CollectiveTimes& times, CollectiveKind k, double bytes, int ranks, double seconds) {
  const double n = ranks, ring = n > 1 ? (n - 1) / n : 0;
  double factor = 1;
  if (k == CollectiveKind::kAllReduce) factor = 2 * ring;
  if (k == CollectiveKind::kReduceScatter || k == CollectiveKind::kAllGather ||
      k == CollectiveKind::kAllToAll)
    factor = ring;
  CollectiveTime& t = times[static_cast<std::size_t>(k)];
  t.seconds += seconds;
  t.bytes += bytes;
  t.bus_bytes += bytes * factor;
  t.calls += 1;
}

namespace {

MPI_Datatype mpi_type(DType t) {
  switch (t) {
    case DType::kF32: return MPI_FLOAT;
    case DType::kF64: return MPI_DOUBLE;
    case DType::kBF16: return MPI_UINT16_T;  // reductions on bf16 are not supported over MPI
    case DType::kI32: return MPI_INT32_T;
    case DType::kI64: return MPI_INT64_T;
    case DType::kU64: return MPI_UINT64_T;
  }
  return MPI_DATATYPE_NULL;
}

MPI_Op mpi_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return MPI_SUM;
    case ReduceOp::kMax: return MPI_MAX;
    case ReduceOp::kMin: return MPI_MIN;
  }
  return MPI_OP_NULL;
}

// MPI counts are int; larger messages would need MPI-4 large counts.
int as_count(std::size_t n) {
  QT_CHECK(n <= static_cast<std::size_t>(INT_MAX), "message of {} elements exceeds MPI's int count", n);
  return static_cast<int>(n);
}

std::vector<int> as_counts(const std::vector<std::size_t>& v) {
  std::vector<int> out(v.size());
  std::transform(v.begin(), v.end(), out.begin(), as_count);
  return out;
}

}  // namespace

MpiComm::MpiComm(MPI_Comm comm, std::string name, bool owned)
    : comm_(comm), name_(std::move(name)), owned_(owned) {
  QT_CHECK_MPI(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
  QT_CHECK_MPI(MPI_Comm_rank(comm_, &rank_));
  QT_CHECK_MPI(MPI_Comm_size(comm_, &size_));
}

MpiComm::~MpiComm() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (owned_ && !finalized) MPI_Comm_free(&comm_);
}

void MpiComm::all_reduce(void* buf, std::size_t count, DType t, ReduceOp op) {
  QT_CHECK(t != DType::kBF16, "bf16 reductions are not supported by the MPI communicator");
  const double t0 = MPI_Wtime();
  QT_CHECK_MPI(MPI_Allreduce(MPI_IN_PLACE, buf, as_count(count), mpi_type(t), mpi_op(op), comm_));
  timed(CollectiveKind::kAllReduce, static_cast<double>(count * dtype_size(t)), t0);
}

void MpiComm::reduce_scatter(const void* send, void* recv, std::size_t count, DType t,
                             ReduceOp op) {
  QT_CHECK(t != DType::kBF16, "bf16 reductions are not supported by the MPI communicator");
  const double t0 = MPI_Wtime();
  QT_CHECK_MPI(MPI_Reduce_scatter_block(send, recv, as_count(count), mpi_type(t), mpi_op(op), comm_));
  timed(CollectiveKind::kReduceScatter, static_cast<double>(count * size_ * dtype_size(t)), t0);
}

void MpiComm::all_gather(const void* send, void* recv, std::size_t count, DType t) {
  const bool in_place =
      send == static_cast<const char*>(recv) + static_cast<std::size_t>(rank_) * count * dtype_size(t);
  const double t0 = MPI_Wtime();
  if (in_place) {
    QT_CHECK_MPI(MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, recv, as_count(count),
                               mpi_type(t), comm_));
  } else {
    QT_CHECK_MPI(MPI_Allgather(send, as_count(count), mpi_type(t), recv, as_count(count),
                               mpi_type(t), comm_));
  }
  timed(CollectiveKind::kAllGather, static_cast<double>(count * size_ * dtype_size(t)), t0);
}

void MpiComm::all_to_all_v(const void* send, const std::vector<std::size_t>& send_counts,
                           const std::vector<std::size_t>& send_displs, void* recv,
                           const std::vector<std::size_t>& recv_counts,
                           const std::vector<std::size_t>& recv_displs, DType t) {
  QT_CHECK(send_counts.size() == static_cast<std::size_t>(size_) &&
               send_displs.size() == send_counts.size() &&
               recv_counts.size() == send_counts.size() && recv_displs.size() == send_counts.size(),
           "all_to_all_v needs {} counts and displacements per direction", size_);
  auto sc = as_counts(send_counts), sd = as_counts(send_displs);
  auto rc = as_counts(recv_counts), rd = as_counts(recv_displs);
  std::size_t sent = 0;
  for (std::size_t c : send_counts) sent += c;
  const double t0 = MPI_Wtime();
  QT_CHECK_MPI(MPI_Alltoallv(send, sc.data(), sd.data(), mpi_type(t), recv, rc.data(), rd.data(),
                             mpi_type(t), comm_));
  timed(CollectiveKind::kAllToAll, static_cast<double>(sent * dtype_size(t)), t0);
}

void MpiComm::send(const void* buf, std::size_t count, DType t, int dest, int tag) {
  const double t0 = MPI_Wtime();
  QT_CHECK_MPI(MPI_Send(buf, as_count(count), mpi_type(t), dest, tag, comm_));
  timed(CollectiveKind::kPointToPoint, static_cast<double>(count * dtype_size(t)), t0);
}

void MpiComm::recv(void* buf, std::size_t count, DType t, int src, int tag) {
  const double t0 = MPI_Wtime();
  QT_CHECK_MPI(MPI_Recv(buf, as_count(count), mpi_type(t), src, tag, comm_, MPI_STATUS_IGNORE));
  timed(CollectiveKind::kPointToPoint, static_cast<double>(count * dtype_size(t)), t0);
}

void MpiComm::broadcast(void* buf, std::size_t count, DType t, int root) {
  const double t0 = MPI_Wtime();
  QT_CHECK_MPI(MPI_Bcast(buf, as_count(count), mpi_type(t), root, comm_));
  timed(CollectiveKind::kBroadcast, static_cast<double>(count * dtype_size(t)), t0);
}

void MpiComm::barrier() { QT_CHECK_MPI(MPI_Barrier(comm_)); }

void MpiComm::timed(CollectiveKind k, double bytes, double start_s) {
  add_call(times_, k, bytes, size_, MPI_Wtime() - start_s);
}

CollectiveTimes MpiComm::take_times() {
  CollectiveTimes out = times_;
  times_ = {};
  return out;
}

}  // namespace qt
