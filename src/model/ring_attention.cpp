// Ring attention over the cp ranks (model/ring_attention.h), from the block ops of
// ops/attention_block.h.
#include "model/ring_attention.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "ops/attention_block.h"
#include "qtrain/error.h"

namespace qt {

namespace {
constexpr int kRingTag = 24;  // issue 24's ring; the cp communicator carries nothing else
}  // namespace

RingAttention::RingAttention(Comm& cp, const ContextSplit& split, int B, int nh, int nkv, int hd)
    : cp_(cp), split_(split), B_(B), nh_(nh), nkv_(nkv), hd_(hd), rank_(cp.rank()),
      Tl_(split.local_len(cp.rank())) {
  QT_CHECK(cp.size() == split.ranks(), "ring attention over {} ranks for a split over {}",
           cp.size(), split.ranks());
  std::size_t largest = 0;  // the largest block of any rank: [dK | dV | K | V]
  for (int r = 0; r < split.ranks(); ++r) largest = std::max(largest, 4 * kv_size(r));
  hold_.resize(largest);
  next_.resize(largest);
  q_first_.resize(static_cast<std::size_t>(B) * Tl_);
  out_b_.resize(static_cast<std::size_t>(B) * Tl_ * nh * hd);
  lse_b_.resize(static_cast<std::size_t>(B) * nh * Tl_);
}

std::size_t RingAttention::kv_size(int rank) const {
  return static_cast<std::size_t>(B_) * split_.local_len(rank) * nkv_ * hd_;
}

void RingAttention::set_first_keys(const std::int32_t* pos) {
  QT_CHECK(pos != nullptr, "ring attention needs each token's position");
  const std::vector<std::int32_t>& idx = split_.indices(rank_);
  for (int b = 0; b < B_; ++b)
    for (int i = 0; i < Tl_; ++i) {
      const std::size_t at = static_cast<std::size_t>(b) * Tl_ + i;
      QT_CHECK(pos[at] >= 0 && pos[at] <= idx[i], "ring attention: token {} of row {} at "
               "position {}", idx[i], b, pos[at]);
      q_first_[at] = idx[i] - pos[at];
    }
}

void RingAttention::pass_on(const float* send, std::size_t send_count, float* recv,
                            std::size_t recv_count) {
  const int n = cp_.size(), to = (rank_ + 1) % n, from = (rank_ + n - 1) % n;
  if (rank_ % 2 == 0) {
    cp_.send(send, send_count, DType::kF32, to, kRingTag);
    cp_.recv(recv, recv_count, DType::kF32, from, kRingTag);
  } else {
    cp_.recv(recv, recv_count, DType::kF32, from, kRingTag);
    cp_.send(send, send_count, DType::kF32, to, kRingTag);
  }
}

void RingAttention::forward(float* out, float* lse, const float* q, const float* k,
                            const float* v, const std::int32_t* pos) {
  set_first_keys(pos);
  const int n = cp_.size();
  std::fill(out, out + out_b_.size(), 0.0f);
  std::fill(lse, lse + lse_b_.size(), -std::numeric_limits<float>::infinity());
  // hold_ = [K | V] of the block at this step, owned by rank src.
  const std::size_t mine = kv_size(rank_);
  std::copy(k, k + mine, hold_.begin());
  std::copy(v, v + mine, hold_.begin() + static_cast<std::ptrdiff_t>(mine));
  for (int s = 0; s < n; ++s) {
    const int src = (rank_ + n - s) % n;
    const std::size_t kv = kv_size(src);
    const cpu::AttentionBlockRows rows{split_.indices(rank_).data(), split_.indices(src).data(),
                                       q_first_.data()};
    cpu::attention_block_forward(out_b_.data(), lse_b_.data(), q, hold_.data(),
                                 hold_.data() + kv, B_, Tl_, split_.local_len(src), nh_, nkv_,
                                 hd_, rows);
    cpu::attention_merge(out, lse, out_b_.data(), lse_b_.data(), B_, Tl_, nh_, hd_);
    if (s + 1 < n) {
      pass_on(hold_.data(), 2 * kv, next_.data(), 2 * kv_size((src + n - 1) % n));
      std::swap(hold_, next_);
    }
  }
}

void RingAttention::backward(float* dq, float* dk, float* dv, const float* dout, const float* q,
                             const float* k, const float* v, const float* out, const float* lse,
                             const std::int32_t* pos) {
  set_first_keys(pos);
  const int n = cp_.size();
  std::fill(dq, dq + out_b_.size(), 0.0f);
  // hold_ = [dK | dV | K | V] of the block at this step, owned by rank src; the gradients come
  // first so that the last hop, home, sends them alone.
  std::size_t kv = kv_size(rank_);
  std::fill(hold_.begin(), hold_.begin() + static_cast<std::ptrdiff_t>(2 * kv), 0.0f);
  std::copy(k, k + kv, hold_.begin() + static_cast<std::ptrdiff_t>(2 * kv));
  std::copy(v, v + kv, hold_.begin() + static_cast<std::ptrdiff_t>(3 * kv));
  for (int s = 0; s < n; ++s) {
    const int src = (rank_ + n - s) % n;
    kv = kv_size(src);
    float* blk = hold_.data();
    const cpu::AttentionBlockRows rows{split_.indices(rank_).data(), split_.indices(src).data(),
                                       q_first_.data()};
    cpu::attention_block_backward(dq, blk, blk + kv, dout, q, blk + 2 * kv, blk + 3 * kv, out,
                                  lse, B_, Tl_, split_.local_len(src), nh_, nkv_, hd_, rows);
    const int next_src = (src + n - 1) % n;
    const bool home = s + 1 == n;  // the last hop takes each block's gradients to its owner
    pass_on(blk, (home ? 2 : 4) * kv, next_.data(), (home ? 2 : 4) * kv_size(next_src));
    std::swap(hold_, next_);
  }
  kv = kv_size(rank_);
  std::copy(hold_.begin(), hold_.begin() + static_cast<std::ptrdiff_t>(kv), dk);
  std::copy(hold_.begin() + static_cast<std::ptrdiff_t>(kv),
            hold_.begin() + static_cast<std::ptrdiff_t>(2 * kv), dv);
}

}  // namespace qt
