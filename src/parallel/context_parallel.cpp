// The load-balanced split of a sequence over the cp ranks (parallel/context_parallel.h).
#include "parallel/context_parallel.h"

#include <cstddef>

#include "qtrain/error.h"

namespace qt {

MeshShape plan_shape(const MeshShape& mesh) {
  MeshShape s = mesh;
  s.dp = mesh.dp * mesh.cp;
  s.cp = 1;
  return s;
}

ContextSplit::ContextSplit(int T, int cp) : T_(T), cp_(cp) {
  QT_CHECK(cp >= 1 && (cp == 1 || T >= 2 * cp),
           "a sequence of {} tokens cannot be cut into 2 x {} chunks", T, cp);
  indices_.resize(static_cast<std::size_t>(cp));
  for (int r = 0; r < cp; ++r)
    for (int j : {r, 2 * cp - 1 - r})
      for (int t = chunk_begin(j); t < chunk_end(j); ++t) indices_[r].push_back(t);
}

int ContextSplit::chunk_begin(int j) const {
  const int chunks = 2 * cp_, base = T_ / chunks, longer = T_ % chunks;
  return j * base + (j < longer ? j : longer);
}

int ContextSplit::local_len(int r) const { return static_cast<int>(indices_[r].size()); }

void ContextSplit::take(std::int32_t* out, const std::int32_t* in, int B, int r) const {
  const std::vector<std::int32_t>& idx = indices_[r];
  for (int b = 0; b < B; ++b)
    for (std::size_t i = 0; i < idx.size(); ++i)
      out[static_cast<std::size_t>(b) * idx.size() + i] =
          in[static_cast<std::size_t>(b) * T_ + idx[i]];
}

void ContextSplit::take_positions(std::int32_t* out, const std::int32_t* pos, int B, int r) const {
  if (pos != nullptr) return take(out, pos, B, r);
  const std::vector<std::int32_t>& idx = indices_[r];
  for (int b = 0; b < B; ++b)
    for (std::size_t i = 0; i < idx.size(); ++i)
      out[static_cast<std::size_t>(b) * idx.size() + i] = idx[i];
}

}  // namespace qt
