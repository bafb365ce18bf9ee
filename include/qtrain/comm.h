// One communicator interface for every parallel dimension.
//
// The CPU back end implements it over MPI (MpiComm); the CUDA back end will implement it over NCCL
// with device pointers. Every call is collective over the communicator unless it says otherwise,
// and blocking: when it returns, the output buffer is ready.
#pragma once

#include <mpi.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace qt {

enum class DType { kF32, kF64, kBF16, kI32, kI64, kU64 };
enum class ReduceOp { kSum, kMax, kMin };

std::size_t dtype_size(DType t);
const char* dtype_name(DType t);

// The time a communicator's calls took, by kind (Comm::take_times). Sizes follow NCCL's tests:
// `bytes` is a call's whole buffer (all-reduce: the buffer; reduce-scatter: its input, all ranks'
// blocks; all-gather: its output; all-to-all: what the rank sends; point to point, broadcast,
// reduce: the message), and `bus_bytes` that times the algorithm's bus factor on n ranks
// (all-reduce 2 (n - 1) / n; reduce-scatter, all-gather, all-to-all (n - 1) / n; the others 1),
// so bus_bytes / seconds is the bus bandwidth, comparable with the link's peak.
enum class CollectiveKind {
  kAllReduce, kReduceScatter, kAllGather, kAllToAll, kPointToPoint, kBroadcast, kReduce
};
inline constexpr int kNumCollectiveKinds = 7;
const char* collective_kind_name(CollectiveKind k);  // "all_reduce", ...
struct CollectiveTime {
  double seconds = 0;  // summed over calls
  double bytes = 0;
  double bus_bytes = 0;
  double calls = 0;
};
using CollectiveTimes = std::array<CollectiveTime, kNumCollectiveKinds>;  // by CollectiveKind
// Adds one call of `bytes` on `ranks` ranks that took `seconds`.
void add_call(CollectiveTimes& times, CollectiveKind k, double bytes, int ranks, double seconds);

class Comm {
 public:
  virtual ~Comm() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // A short name for messages, e.g. "dp" or "world".
  virtual const std::string& name() const = 0;

  // In place: buf[count] <- op over ranks of buf[count].
  virtual void all_reduce(void* buf, std::size_t count, DType t, ReduceOp op) = 0;
  // send[count * size()] reduced over ranks; rank r receives block r into recv[count].
  virtual void reduce_scatter(const void* send, void* recv, std::size_t count, DType t,
                              ReduceOp op) = 0;
  // send[count] from each rank; recv[count * size()] holds them in rank order. In place when
  // send == recv + rank() * count (each rank's block already sits in recv).
  virtual void all_gather(const void* send, void* recv, std::size_t count, DType t) = 0;
  // send_counts[r] elements go to rank r starting at send_displs[r]; likewise for receives.
  virtual void all_to_all_v(const void* send, const std::vector<std::size_t>& send_counts,
                            const std::vector<std::size_t>& send_displs, void* recv,
                            const std::vector<std::size_t>& recv_counts,
                            const std::vector<std::size_t>& recv_displs, DType t) = 0;
  // Point to point; not collective.
  virtual void send(const void* buf, std::size_t count, DType t, int dest, int tag) = 0;
  virtual void recv(void* buf, std::size_t count, DType t, int src, int tag) = 0;
  virtual void broadcast(void* buf, std::size_t count, DType t, int root) = 0;
  virtual void barrier() = 0;

  // The time of this communicator's calls since the last take_times(), which starts the count
  // again: MPI measures each call's wall time on the host; a device communicator measures its
  // kernels on its stream (overlapping computation), waiting for the last ones to finish.
  virtual CollectiveTimes take_times() { return {}; }

  // Typed conveniences.
  double sum(double x) {
    all_reduce(&x, 1, DType::kF64, ReduceOp::kSum);
    return x;
  }
  double max(double x) {
    all_reduce(&x, 1, DType::kF64, ReduceOp::kMax);
    return x;
  }
  std::int64_t sum(std::int64_t x) {
    all_reduce(&x, 1, DType::kI64, ReduceOp::kSum);
    return x;
  }
};

// Broadcasts a string from `root` (packed in 64-bit words: Comm has no byte type).
void broadcast_string(Comm& comm, std::string& s, int root);

class MpiComm;
// Rank 0 receives every rank's string, in rank order (empty elsewhere). Collective over `comm`.
std::vector<std::string> gather_strings(const std::string& mine, const MpiComm& comm);

// Every rank passes its own error text ("" = none). If any rank has one, every rank throws a
// UserError with the text of the lowest failing rank, so that one rank's bad input stops all of
// them with the same message instead of leaving the others waiting in a collective.
void agree(Comm& comm, const std::string& err);

// MPI implementation. Owns (and frees) the MPI communicator if `owned` is true.
// Sets MPI_ERRORS_RETURN on it, so every call is checked with QT_CHECK_MPI.
class MpiComm final : public Comm {
 public:
  MpiComm(MPI_Comm comm, std::string name, bool owned);
  ~MpiComm() override;
  MpiComm(const MpiComm&) = delete;
  MpiComm& operator=(const MpiComm&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::string& name() const override { return name_; }
  MPI_Comm mpi() const { return comm_; }

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
  CollectiveTimes take_times() override;

 private:
  // Adds a call's wall time since `start_s` (MPI_Wtime) to times_.
  void timed(CollectiveKind k, double bytes, double start_s);

  CollectiveTimes times_{};
  MPI_Comm comm_;
  std::string name_;
  bool owned_;
  int rank_ = 0;
  int size_ = 1;
};

}  // namespace qt
