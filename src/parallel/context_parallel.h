// Context parallelism (mesh.cp, issue 24): how a sequence of T tokens is split over cp ranks.
// The sequence is cut into 2 cp chunks, the first T % (2 cp) of them one token longer than the
// rest (T / (2 cp) tokens; T >= 2 cp, so none is empty). cp rank r holds chunk r and its mirror
// chunk 2 cp - 1 - r, in that order: under a causal mask the early chunk sees few keys and the
// late one many, so every rank has about the same attention work. A rank's local rows keep
// their global indices (the attention mask and RoPE use them); every op but attention is per
// token and runs on the local rows as they are.
#pragma once

#include <cstdint>
#include <vector>

#include "qtrain/mesh.h"

namespace qt {

// The mesh as the sharding plan and the optimizer see it: the cp ranks of a dp index hold the
// same parameters and sum their gradients like dp ranks, so the plan's dp is dp x cp (ZeRO
// shards spread over the dp x cp ranks, reduced over Mesh::dp_cp()) and its cp is 1.
MeshShape plan_shape(const MeshShape& mesh);

class ContextSplit {
 public:
  // T tokens a sequence over cp ranks (T >= 2 cp, cp >= 1; cp = 1: one rank holds all).
  ContextSplit(int T, int cp);

  int seq_len() const { return T_; }
  int ranks() const { return cp_; }
  // [begin, end) global token indices of chunk j of 2 cp.
  int chunk_begin(int j) const;
  int chunk_end(int j) const { return chunk_begin(j + 1); }
  // Tokens cp rank r holds (its two chunks); they differ by at most 2 between ranks.
  int local_len(int r) const;
  // The global index of each of rank r's tokens, ascending: chunk r, then chunk 2 cp - 1 - r.
  // [local_len(r)]
  const std::vector<std::int32_t>& indices(int r) const { return indices_[r]; }

  // Rank r's tokens of each row: out [B, local_len(r)] <- in [B, T].
  void take(std::int32_t* out, const std::int32_t* in, int B, int r) const;
  // The RoPE positions of rank r's tokens: out [B, local_len(r)] <- pos [B, T] (packing: the
  // position within its document), or the global index where pos is null (plain causal).
  void take_positions(std::int32_t* out, const std::int32_t* pos, int B, int r) const;

 private:
  int T_, cp_;
  std::vector<std::vector<std::int32_t>> indices_;  // [cp][local_len(r)]
};

}  // namespace qt
