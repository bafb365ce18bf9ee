// Collective helpers over any Comm: string broadcast and agreement on a rank's error.
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

}  // namespace qt
