// Expert parallelism for CudaOps' Qwen3-MoE block (mesh.ep > 1; cuda_ops.h; the CPU reference is
// parallel/expert_parallel.cpp, docs/moe.md "Expert parallelism"). Rank r of an ep group of P
// stores experts [r El, (r + 1) El), El = E / P. Every rank routes its own N tokens with the
// whole router (cuda_ops_moe.cpp: moe_route orders its N k (token, slot) rows by global expert,
// so the rows for rank p are one block); the rows travel to their experts' ranks by one
// all-to-all with exact counts, are put in expert order there (ops/cuda/moe_ep.cuh), run through
// the local experts' grouped GEMMs, go back in received order by the inverse map and a second
// all-to-all, and are weighed and summed by the sender as at ep 1. The backward sends d out the
// same way and d x back; each rank accumulates its own experts' weight gradients (reduced over
// the expert-data-parallel group by the state, not here). While d x travels home, the micro-batch's
// stream runs gate_up's weight gradient and the router's backward (moe_backward joins the
// exchange before it reads d x); the forward's exchanges have nothing beside them (Qwen3's sparse
// blocks have no shared expert).
//
// One host synchronisation per sparse layer's forward: NCCL's all-to-all takes its counts from
// the host, so after routing the group all-gathers its [P, E] routing counts (E int32 a rank) and
// the host waits for their copy (the ep stream) before it enqueues the rows with exact counts
// (NcclComm::all_to_all_v_async). The synchronisation-free alternative, whole blocks of the
// largest possible count (NcclComm::all_to_all_device_async), moves P times the rows and needs
// P x N k rows of buffer for each peer: it does not scale to ep 8. Megatron's all-to-all token
// dispatcher makes the same choice. The counts are kept per sparse layer (and pipeline slot:
// a stage's micro-batches in flight each keep theirs, with the maps and the received rows), so
// the layer's backward and its recomputed forward (train.recompute: the same routing) exchange
// rows with no further synchronisation.
//
// Buffers (from the arena, at set-up): a rank receives at most P N min(k, El) rows, when every
// rank sends it a row for every slot of every token (a token's k slots name distinct experts,
// at most El of them here); with a capacity C (model.moe_capacity_factor) at most C from each
// rank for each of its El experts, E C rows, when that is less. That bound sizes the kept
// inputs and SwiGLU activations of each sparse layer ([rows, H], [rows, 2 Im], [rows, Im]: P x the ep 1 sizes when El >= k; one
// shared set with train.recompute) and the exchange scratch; the returned outputs stay [N k, H].
#include <algorithm>

#include "cuda/check.h"
#include "cuda/cuda_ops.h"
#include "ops/cuda/moe.cuh"
#include "ops/cuda/moe_ep.cuh"
#include "parallel/expert_parallel.h"
#include "qtrain/error.h"

namespace qt::cuda {

void CudaOps::moe_ep_allocate(DeviceArena& arena) {
  const int P = ep_->size(), E = cfg_.num_experts, El = E / P;
  const std::size_t H = cfg_.hidden_size, rows = static_cast<std::size_t>(moe_ep_rows_);
  moe_ep_.assign(static_cast<std::size_t>(cfg_.num_layers), {});
  bf16* shared_x = nullptr;
  for (int l = 0; l < cfg_.num_layers; ++l) {
    // A set a micro-batch in flight, as moe_layers_ (moe_allocate): a pipeline's slots.
    const std::size_t slots = moe_layers_[static_cast<std::size_t>(l)].size();
    for (std::size_t k = 0; k < slots; ++k) {
      MoeEp e;
      e.offsets = arena.allocate<int>(static_cast<std::size_t>(El) + 1);
      e.to_expert = arena.allocate<int>(rows);
      e.from_expert = arena.allocate<int>(rows);
      if (!moe_recompute_ || shared_x == nullptr) shared_x = arena.allocate<bf16>(rows * H);
      e.x = shared_x;
      moe_ep_[static_cast<std::size_t>(l)].push_back(std::move(e));
    }
  }
  const std::size_t PE = static_cast<std::size_t>(P) * E;
  moe_ep_counts_ = arena.allocate<int>(PE);
  moe_ep_host_ = PinnedBuffer(PE * sizeof(int));
  moe_ep_segments_ = arena.allocate<int>(2 * static_cast<std::size_t>(E));
  moe_ep_a_ = arena.allocate<bf16>(rows * H);
  moe_ep_b_ = arena.allocate<bf16>(rows * H);
}

CudaOps::MoeEp& CudaOps::moe_ep_layer(int l) {
  std::vector<MoeEp>& sets = moe_ep_.at(static_cast<std::size_t>(l));
  QT_CHECK(moe_slot_ >= 0 && moe_slot_ < static_cast<int>(sets.size()),
           "MoE exchange slot {} of layer {}, which keeps {} here", moe_slot_, l, sets.size());
  return sets[static_cast<std::size_t>(moe_slot_)];
}

void CudaOps::moe_ep_counts(int l) {
  const int P = ep_->size(), r = ep_->rank(), E = cfg_.num_experts, El = E / P;
  MoeEp& e = moe_ep_layer(l);
  // moe_kept_ [E]: this layer's routing (the rows the capacity keeps), just made on the
  // micro-batch's stream.
  ep_ready_.record(s_);
  ep_->wait_event(ep_ready_.get());
  ep_->all_gather_async(moe_kept_, moe_ep_counts_, static_cast<std::size_t>(E), DType::kI32);
  const int* c = moe_ep_host_.as<int>();  // [P, E]
  QT_CHECK_CUDA(cudaMemcpyAsync(moe_ep_host_.as<int>(), moe_ep_counts_,
                                sizeof(int) * static_cast<std::size_t>(P) * E,
                                cudaMemcpyDeviceToHost, ep_->stream()));
  ep_->synchronize();  // the layer's one host synchronisation (with the communicator's timeout)
  e.send.assign(P, 0);
  e.recv.assign(P, 0);
  for (int p = 0; p < P; ++p)
    for (int j = 0; j < El; ++j) {
      e.send[p] += static_cast<std::size_t>(c[static_cast<std::size_t>(r) * E + p * El + j]);
      e.recv[p] += static_cast<std::size_t>(c[static_cast<std::size_t>(p) * E + r * El + j]);
    }
  e.send_at = block_offsets(e.send);
  e.recv_at = block_offsets(e.recv);
  const std::size_t sent = e.send_at.back() + e.send.back();
  const std::size_t received = e.recv_at.back() + e.recv.back();
  const std::size_t nk = static_cast<std::size_t>(N_) * cfg_.num_experts_per_tok;
  // Every row goes out, or with a capacity the kept ones.
  const bool sent_ok = moe_capacity_ == kMoeDropless ? sent == nk : sent <= nk;
  QT_CHECK(sent_ok && received <= static_cast<std::size_t>(moe_ep_rows_),
           "layer {}: ep rank {} routes {} rows (N k = {}) and receives {} (at most {})", l, r,
           sent, nk, received, moe_ep_rows_);
  e.received = static_cast<int>(received);
  // The device counts are complete (synchronised above); the next layer's all-gather overwrites
  // them only after the micro-batch's stream has passed this kernel (ep_ready_ of that layer).
  moe_ep_recv_order(e.offsets, e.to_expert, e.from_expert, moe_ep_counts_, P, E, r, e.received,
                    moe_ep_segments_, s_);
  e.counted = true;
}

void CudaOps::moe_ep_exchange(const bf16* send, bf16* recv, const MoeEp& e, bool to_experts) {
  const std::size_t H = cfg_.hidden_size;
  ep_ready_.record(s_);  // send is written, recv free
  ep_->wait_event(ep_ready_.get());
  // Rows to the experts: e.send out, e.recv in; back: the reverse.
  const auto& out = to_experts ? e.send : e.recv;
  const auto& out_at = to_experts ? e.send_at : e.recv_at;
  const auto& in = to_experts ? e.recv : e.send;
  const auto& in_at = to_experts ? e.recv_at : e.send_at;
  ep_->all_to_all_v_async(send, scaled_counts(out, H), scaled_counts(out_at, H), recv,
                          scaled_counts(in, H), scaled_counts(in_at, H), DType::kBF16);
  ep_done_.record(ep_->stream());
}

void CudaOps::moe_ep_join() { QT_CHECK_CUDA(cudaStreamWaitEvent(s_, ep_done_.get(), 0)); }

void CudaOps::moe_ep_forward(int l, const bf16* gate_up, const bf16* down, bool fresh) {
  MoeLayer& m = moe_layer(l);
  MoeEp& e = moe_ep_layer(l);
  // A recomputed forward of the slot's micro-batch routes the same: its counts stand.
  if (fresh || !e.counted) moe_ep_counts(l);
  const int El = cfg_.local_experts(), H = cfg_.hidden_size;
  const int R = e.received;
  moe_ep_exchange(moe_x_, moe_ep_a_, e, /*to_experts=*/true);  // received order
  moe_ep_join();
  moe_permute(e.x, moe_ep_a_, e.from_expert, R, 1, H, s_);      // expert order, kept
  experts_forward(l, moe_ep_b_, e.x, e.offsets, El, R, gate_up, down);
  moe_permute(moe_ep_a_, moe_ep_b_, e.to_expert, R, 1, H, s_);  // received order
  moe_ep_exchange(moe_ep_a_, m.out, e, /*to_experts=*/false);   // send order
  moe_ep_join();
}

void CudaOps::moe_ep_backward(int l, float* g_gate_up, float* g_down, const bf16* gate_up,
                              const bf16* down, bool acc) {
  const MoeEp& e = moe_ep_layer(l);
  QT_CHECK(e.counted, "moe_backward of layer {} without its forward's counts", l);
  const int El = cfg_.local_experts(), H = cfg_.hidden_size;
  const int R = e.received;
  moe_ep_exchange(moe_dout_, moe_ep_a_, e, /*to_experts=*/true);
  moe_ep_join();
  moe_permute(moe_ep_b_, moe_ep_a_, e.from_expert, R, 1, H, s_);  // d out in expert order
  // d x in expert order into moe_ep_b_ (dead once d h is made), then received order, then home;
  // gate_up's weight gradient runs while it travels (the caller joins before reading moe_x_).
  experts_backward_inputs(l, moe_ep_b_, g_down, moe_ep_b_, e.x, e.offsets, El, R, gate_up, down,
                          acc);
  moe_permute(moe_ep_a_, moe_ep_b_, e.to_expert, R, 1, H, s_);
  moe_ep_exchange(moe_ep_a_, moe_x_, e, /*to_experts=*/false);
  experts_gate_up_weight_grad(g_gate_up, e.x, e.offsets, El, R, acc);
}

}  // namespace qt::cuda
