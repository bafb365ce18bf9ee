// Collective helpers: string broadcast and gather, and agreement on a rank's error.
#include <cstring>

#include "qtrain/comm.h"
#include "qtrain/error.h"

namespace qt {

void broadcast_string(Comm& comm, std::string& s, int root) {
  std::uint64_t n = s.size();
  comm.broadcast(&n, 1, DType::kU64, root);
  std::vector<std::uint64_t> words((n + 7) / 8, 0);
  if (comm.rank() == root && n > 0) std::memcpy(words.data(), s.data(), n);
  if (!words.empty()) comm.broadcast(words.data(), words.size(), DType::kU64, root);
  s.assign(reinterpret_cast<const char*>(words.data()), n);
}

void agree(Comm& comm, const std::string& err) {
  std::int64_t first = err.empty() ? comm.size() : comm.rank();
  comm.all_reduce(&first, 1, DType::kI64, ReduceOp::kMin);
  if (first == comm.size()) return;
  std::string msg = err;
  broadcast_string(comm, msg, static_cast<int>(first));
  throw UserError(msg);
}

std::vector<std::string> gather_strings(const std::string& mine, const MpiComm& comm) {
  const int P = comm.size();
  int n = static_cast<int>(mine.size());
  std::vector<int> lens(P), displs(P);
  QT_CHECK_MPI(MPI_Gather(&n, 1, MPI_INT, lens.data(), 1, MPI_INT, 0, comm.mpi()));
  std::string all;
  if (comm.rank() == 0) {
    for (int r = 1; r < P; ++r) displs[r] = displs[r - 1] + lens[r - 1];
    all.resize(static_cast<std::size_t>(displs[P - 1] + lens[P - 1]));
  }
  QT_CHECK_MPI(MPI_Gatherv(mine.data(), n, MPI_CHAR, all.data(), lens.data(), displs.data(),
                           MPI_CHAR, 0, comm.mpi()));
  std::vector<std::string> out;
  if (comm.rank() == 0)
    for (int r = 0; r < P; ++r) out.push_back(all.substr(displs[r], lens[r]));
  return out;
}

}  // namespace qt
