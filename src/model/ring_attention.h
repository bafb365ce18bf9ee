// Ring attention (context parallelism, issue 24): causal GQA attention of a sequence split over
// the cp ranks of a ring (parallel/context_parallel.h), each rank holding its queries, keys and
// values of 2 of the 2 cp chunks. The result on each rank is exactly its rows of the serial
// attention (ops/attention.h), up to the order of fp32 sums.
//
//   forward:  the K/V block of rank (r - s) mod cp is here at step s = 0 .. cp-1; the local
//             queries attend to it (ops/attention_block.h, masked by global index and document),
//             the partial out and lse are merged by log-sum-exp, and the block moves on to
//             rank r + 1 (cp - 1 hops).
//   backward: the same order; each K/V block travels with its dK/dV accumulator [dK | dV | K | V],
//             every rank adding its queries' share, and after a last hop (the gradients only)
//             the accumulator is home: cp hops in all, dQ stays local.
// Blocks pass between neighbours by blocking MPI send/recv over the cp communicator (even ranks
// send first, odd ranks receive first, so the ring never waits on itself).
#pragma once

#include <cstdint>
#include <vector>

#include "parallel/context_parallel.h"
#include "qtrain/comm.h"

namespace qt {

class RingAttention {
 public:
  // B sequences of split.seq_len() tokens over the ranks of `cp` (cp.size() = split.ranks()).
  RingAttention(Comm& cp, const ContextSplit& split, int B, int nh, int nkv, int hd);

  // Local rows: Tl = split.local_len(cp.rank()). q, out [B, Tl, nh, hd]; k, v [B, Tl, nkv, hd];
  // lse [B, nh, Tl] (written); pos [B, Tl]: the RoPE position of each local token, its index in
  // its document (the global index without packing), which fixes the document's first key.
  void forward(float* out, float* lse, const float* q, const float* k, const float* v,
               const std::int32_t* pos);
  // dq [B, Tl, nh, hd], dk and dv [B, Tl, nkv, hd]: written (=), from the merged out and lse of
  // forward.
  void backward(float* dq, float* dk, float* dv, const float* dout, const float* q,
                const float* k, const float* v, const float* out, const float* lse,
                const std::int32_t* pos);

 private:
  // q_first_ [B, Tl] = global index - pos: the first key each local query may see.
  void set_first_keys(const std::int32_t* pos);
  // Sends send[0, send_count) to rank r + 1 and receives recv_count floats from rank r - 1.
  void pass_on(const float* send, std::size_t send_count, float* recv, std::size_t recv_count);
  std::size_t kv_size(int rank) const;  // floats of one of K, V of `rank`: B x Tl x nkv x hd

  Comm& cp_;
  const ContextSplit& split_;
  int B_, nh_, nkv_, hd_, rank_, Tl_;
  std::vector<std::int32_t> q_first_;        // [B, Tl]
  std::vector<float> hold_, next_;           // the travelling block and the one arriving
  std::vector<float> out_b_, lse_b_;         // a block's out [B, Tl, nh, hd], lse [B, nh, Tl]
};

}  // namespace qt
