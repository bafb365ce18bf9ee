// Partition-to-range redistribution of a flat buffer (see redistribute.h).
#include "io/redistribute.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "qtrain/error.h"

namespace qt {

namespace {

Range intersect(Range a, Range b) {
  Range r{std::max(a.begin, b.begin), std::min(a.end, b.end)};
  if (r.end < r.begin) r.end = r.begin;
  return r;
}

}  // namespace

void redistribute_flat(Comm& comm, std::size_t n, const float* mine, Range want, float* out,
                       std::size_t stage) {
  QT_CHECK(want.begin <= want.end && want.end <= n, "range [{}, {}) outside [0, {})", want.begin,
           want.end, n);
  const int P = comm.size(), r = comm.rank();
  std::vector<std::uint64_t> wants(2 * static_cast<std::size_t>(P));
  const std::uint64_t my_want[2] = {want.begin, want.end};
  comm.all_gather(my_want, wants.data(), 2, DType::kU64);
  auto want_of = [&](int s) { return Range{wants[2 * s], wants[2 * s + 1]}; };
  auto part_of = [&](int s) { return split_range(n, P, s); };
  // Every rank knows every pair's overlap, so all agree on the number of rounds.
  std::size_t max_pair = 0;
  for (int a = 0; a < P; ++a)
    for (int b = 0; b < P; ++b)
      max_pair = std::max(max_pair, intersect(part_of(a), want_of(b)).size());
  const std::size_t per_peer = std::max<std::size_t>(1, stage / P);
  const std::size_t rounds = (max_pair + per_peer - 1) / per_peer;
  const Range my_part = part_of(r);
  std::vector<Range> to(P), from(P);  // this round's slices: sent to / received from rank s
  std::vector<std::size_t> sc(P), sd(P), rc(P), rd(P);
  std::vector<float> sbuf, rbuf;
  for (std::size_t k = 0; k < rounds; ++k) {
    // Pair (a -> b) moves elements [k * per_peer, (k + 1) * per_peer) of part_a ∩ want_b.
    auto slice = [&](Range x) {
      return Range{x.begin + std::min(x.size(), k * per_peer),
                   x.begin + std::min(x.size(), (k + 1) * per_peer)};
    };
    std::size_t ns = 0, nr = 0;
    for (int s = 0; s < P; ++s) {
      to[s] = slice(intersect(my_part, want_of(s)));
      from[s] = slice(intersect(part_of(s), want));
      sc[s] = to[s].size();
      sd[s] = ns;
      ns += sc[s];
      rc[s] = from[s].size();
      rd[s] = nr;
      nr += rc[s];
    }
    sbuf.resize(std::max<std::size_t>(ns, 1));
    rbuf.resize(std::max<std::size_t>(nr, 1));
    for (int s = 0; s < P; ++s)
      std::copy_n(mine + (to[s].begin - my_part.begin), to[s].size(), sbuf.data() + sd[s]);
    comm.all_to_all_v(sbuf.data(), sc, sd, rbuf.data(), rc, rd, DType::kF32);
    for (int s = 0; s < P; ++s)
      std::copy_n(rbuf.data() + rd[s], from[s].size(), out + (from[s].begin - want.begin));
  }
}

}  // namespace qt
