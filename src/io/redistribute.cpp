// Moving a flat buffer between any two layouts of pieces (see redistribute.h).
#include "io/redistribute.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <map>
#include <vector>

#include "qtrain/error.h"

namespace qt {

namespace {

// A stretch of one pair's sequence of elements: `len` floats at `at` (in a have piece on the
// sending side, in a want piece on the receiving side).
template <typename T>
struct Span {
  T* at;
  std::size_t len;
};

// Where one pair's sequence stands: the next element is spans[seg].at[off].
template <typename T>
struct Cursor {
  std::vector<Span<T>> spans;
  std::size_t seg = 0, off = 0, total = 0;
  void add(T* at, std::size_t len) {
    if (len == 0) return;
    spans.push_back({at, len});
    total += len;
  }
  // Calls f(pointer, count) for the next `count` elements, in order, and moves past them.
  template <typename F>
  void take(std::size_t count, F&& f) {
    while (count > 0) {
      const Span<T>& s = spans[seg];
      const std::size_t k = std::min(count, s.len - off);
      f(s.at + off, k);
      off += k;
      count -= k;
      if (off == s.len) ++seg, off = 0;
    }
  }
};

// A piece of a have partition: `range` held by rank `owner` at `data` (null unless it is ours).
struct Held {
  Range range;
  int owner;
  const float* data;
};

// The held pieces overlapping `r`, in flat order: [first, last) of `held` (sorted, disjoint).
std::pair<std::size_t, std::size_t> overlapping(const std::vector<Held>& held, Range r) {
  auto first = std::partition_point(held.begin(), held.end(),
                                    [&](const Held& h) { return h.range.end <= r.begin; });
  auto last =
      std::partition_point(first, held.end(), [&](const Held& h) { return h.range.begin < r.end; });
  return {static_cast<std::size_t>(first - held.begin()),
          static_cast<std::size_t>(last - held.begin())};
}

}  // namespace

std::vector<std::vector<Range>> all_gather_ranges(Comm& comm, const std::vector<Range>& mine) {
  const int P = comm.size();
  std::vector<std::uint64_t> counts(P);
  const std::uint64_t my_count = mine.size();
  comm.all_gather(&my_count, counts.data(), 1, DType::kU64);
  // Variable counts through all_to_all_v: every rank sends its ranges to every rank.
  std::vector<std::uint64_t> flat(2 * mine.size() + 1);
  for (std::size_t i = 0; i < mine.size(); ++i) {
    flat[2 * i] = mine[i].begin;
    flat[2 * i + 1] = mine[i].end;
  }
  std::vector<std::size_t> sc(P, 2 * mine.size()), sd(P, 0), rc(P), rd(P);
  std::size_t total = 0;
  for (int s = 0; s < P; ++s) {
    rc[s] = 2 * counts[s];
    rd[s] = total;
    total += rc[s];
  }
  std::vector<std::uint64_t> all(total + 1);
  comm.all_to_all_v(flat.data(), sc, sd, all.data(), rc, rd, DType::kU64);
  std::vector<std::vector<Range>> out(P);
  for (int s = 0; s < P; ++s)
    for (std::size_t i = 0; i < counts[s]; ++i)
      out[s].push_back(Range{all[rd[s] + 2 * i], all[rd[s] + 2 * i + 1]});
  return out;
}

std::string partition_error(const std::vector<std::vector<Range>>& ranges, std::size_t n) {
  struct Owned {
    Range r;
    int rank;
  };
  std::vector<Owned> all;
  for (std::size_t s = 0; s < ranges.size(); ++s)
    for (const Range& r : ranges[s]) {
      if (r.begin > r.end || r.end > n)
        return fmt::format("rank {} holds [{}, {}), which is not a range inside [0, {})", s,
                           r.begin, r.end, n);
      if (r.size() > 0) all.push_back({r, static_cast<int>(s)});
    }
  std::sort(all.begin(), all.end(), [](const Owned& a, const Owned& b) {
    return a.r.begin != b.r.begin ? a.r.begin < b.r.begin : a.rank < b.rank;
  });
  std::size_t next = 0;  // every element below it is held exactly once
  for (std::size_t i = 0; i < all.size(); ++i) {
    const Owned& o = all[i];
    if (o.r.begin > next)
      return fmt::format("elements [{}, {}) of [0, {}) are held by no rank", next, o.r.begin, n);
    if (o.r.begin < next) {
      const Owned& p = all[i - 1];  // the range ending at `next`
      return fmt::format(
          "elements [{}, {}) are held twice: by rank {} in [{}, {}) and by rank {} in [{}, {})",
          o.r.begin, std::min(next, o.r.end), p.rank, p.r.begin, p.r.end, o.rank, o.r.begin,
          o.r.end);
    }
    next = o.r.end;
  }
  if (next < n) return fmt::format("elements [{}, {}) of [0, {}) are held by no rank", next, n, n);
  return {};
}

void redistribute_pieces(Comm& comm, std::size_t n, const std::vector<ConstFlatPiece>& have,
                         const std::vector<FlatPiece>& want, std::size_t stage) {
  const int P = comm.size(), me = comm.rank();
  std::vector<Range> my_have, my_want;
  for (const ConstFlatPiece& h : have) {
    QT_CHECK(h.range.size() == 0 || h.data != nullptr, "have piece [{}, {}) has no data",
             h.range.begin, h.range.end);
    my_have.push_back(h.range);
  }
  for (const FlatPiece& w : want) {
    QT_CHECK(w.range.begin <= w.range.end && w.range.end <= n,
             "want piece [{}, {}) outside [0, {})", w.range.begin, w.range.end, n);
    QT_CHECK(w.range.size() == 0 || w.data != nullptr, "want piece [{}, {}) has no data",
             w.range.begin, w.range.end);
    my_want.push_back(w.range);
  }
  const auto haves = all_gather_ranges(comm, my_have);
  const auto wants = all_gather_ranges(comm, my_want);
  const std::string err = partition_error(haves, n);
  QT_CHECK(err.empty(), "the have pieces of redistribute_pieces are not a partition: {}", err);

  // Every rank's held pieces in flat order (ours with their data).
  std::vector<Held> held;
  for (int s = 0; s < P; ++s)
    for (std::size_t i = 0; i < haves[s].size(); ++i)
      if (haves[s][i].size() > 0)
        held.push_back({haves[s][i], s, s == me ? have[i].data : nullptr});
  std::sort(held.begin(), held.end(),
            [](const Held& a, const Held& b) { return a.range.begin < b.range.begin; });
  std::vector<Held> ours;  // this rank's, in flat order
  std::copy_if(held.begin(), held.end(), std::back_inserter(ours),
               [&](const Held& h) { return h.owner == me; });

  // Pair sequences, in the same order on both sides: b's want pieces in order, then flat index.
  std::vector<Cursor<const float>> to(P);  // what this rank sends to rank b
  std::vector<Cursor<float>> from(P);      // what this rank receives from rank a
  for (int b = 0; b < P; ++b)
    for (const Range& w : wants[b]) {
      const auto [i0, i1] = overlapping(ours, w);
      for (std::size_t i = i0; i < i1; ++i) {
        const std::size_t lo = std::max(w.begin, ours[i].range.begin);
        const std::size_t hi = std::min(w.end, ours[i].range.end);
        to[b].add(ours[i].data + (lo - ours[i].range.begin), hi - lo);
      }
    }
  for (const FlatPiece& w : want) {
    const auto [i0, i1] = overlapping(held, w.range);
    for (std::size_t i = i0; i < i1; ++i) {
      const std::size_t lo = std::max(w.range.begin, held[i].range.begin);
      const std::size_t hi = std::min(w.range.end, held[i].range.end);
      from[held[i].owner].add(w.data + (lo - w.range.begin), hi - lo);
    }
  }
  std::uint64_t longest = 0;  // the longest pair sequence of any rank sets the rounds
  for (int s = 0; s < P; ++s)
    longest = std::max<std::uint64_t>({longest, to[s].total, from[s].total});
  comm.all_reduce(&longest, 1, DType::kU64, ReduceOp::kMax);
  const std::size_t per_pair = std::max<std::size_t>(1, stage / static_cast<std::size_t>(P));
  const std::size_t rounds = (longest + per_pair - 1) / per_pair;

  std::vector<std::size_t> sc(P), sd(P), rc(P), rd(P);
  std::vector<float> sbuf, rbuf;  // [sum sc], [sum rc]: at most max(stage, P) each
  for (std::size_t k = 0; k < rounds; ++k) {
    std::size_t ns = 0, nr = 0;
    for (int s = 0; s < P; ++s) {
      sc[s] = std::min(per_pair, to[s].total - std::min(to[s].total, k * per_pair));
      sd[s] = ns;
      ns += sc[s];
      rc[s] = std::min(per_pair, from[s].total - std::min(from[s].total, k * per_pair));
      rd[s] = nr;
      nr += rc[s];
    }
    sbuf.resize(std::max<std::size_t>(ns, 1));
    rbuf.resize(std::max<std::size_t>(nr, 1));
    for (int s = 0; s < P; ++s) {
      float* dst = sbuf.data() + sd[s];
      to[s].take(sc[s], [&](const float* x, std::size_t len) { dst = std::copy_n(x, len, dst); });
    }
    comm.all_to_all_v(sbuf.data(), sc, sd, rbuf.data(), rc, rd, DType::kF32);
    for (int s = 0; s < P; ++s) {
      const float* src = rbuf.data() + rd[s];
      from[s].take(rc[s], [&](float* x, std::size_t len) {
        std::copy_n(src, len, x);
        src += len;
      });
    }
  }
}

void gather_pieces(Comm& comm, std::size_t n, const std::vector<ConstFlatPiece>& have, float* out,
                   const char* what, std::size_t stage) {
  std::vector<Range> mine;
  for (const ConstFlatPiece& h : have) mine.push_back(h.range);
  const auto all = all_gather_ranges(comm, mine);
  // A partition: each piece less what the pieces before it hold (`held`: disjoint, by begin),
  // alike on every rank; this rank's parts keep their data.
  std::map<std::size_t, std::size_t> held;  // begin -> end
  std::vector<std::vector<Range>> once(all.size());
  std::vector<ConstFlatPiece> first;
  for (std::size_t s = 0; s < all.size(); ++s)
    for (std::size_t i = 0; i < all[s].size(); ++i) {
      const Range r = all[s][i];
      std::size_t at = r.begin;  // the parts of r below `at` are placed
      auto it = held.upper_bound(at);
      if (it != held.begin() && std::prev(it)->second > at) --it;
      for (; at < r.end; ++it) {
        const std::size_t gap_end = it == held.end() ? r.end : std::min(r.end, it->first);
        if (at < gap_end) {
          once[s].push_back({at, gap_end});
          if (static_cast<int>(s) == comm.rank())
            first.push_back({{at, gap_end}, have[i].data + (at - r.begin)});
        }
        if (it == held.end()) break;
        at = std::max(at, it->second);
      }
      if (r.begin >= r.end) continue;
      // held gains r: merged with the ranges it touches.
      std::size_t lo = r.begin, hi = r.end;
      auto m = held.upper_bound(lo);
      if (m != held.begin() && std::prev(m)->second >= lo) --m;
      while (m != held.end() && m->first <= hi) {
        lo = std::min(lo, m->first);
        hi = std::max(hi, m->second);
        m = held.erase(m);
      }
      held.emplace(lo, hi);
    }
  const std::string err = partition_error(once, n);
  QT_CHECK(err.empty(), "gathering {}: {}", what, err);
  std::vector<FlatPiece> want;
  if (comm.rank() == 0) want.push_back({Range{0, n}, out});
  redistribute_pieces(comm, n, first, want, stage);
}

void redistribute_flat(Comm& comm, std::size_t n, const float* mine, Range want, float* out,
                       std::size_t stage) {
  QT_CHECK(want.begin <= want.end && want.end <= n, "range [{}, {}) outside [0, {})", want.begin,
           want.end, n);
  const Range part = split_range(n, comm.size(), comm.rank());
  redistribute_pieces(comm, n, {ConstFlatPiece{part, mine}}, {FlatPiece{want, out}}, stage);
}

}  // namespace qt
