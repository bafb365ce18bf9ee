// CudaOps' Qwen3-MoE block (layer_program.h's moe contract; the CPU oracle is
// model/cpu_ops_moe.cpp): the router's logits by the GEMM (bf16, as transformers), the router,
// routing, gather and combine kernels of ops/cuda/moe.cuh, the experts by grouped_gemm.h, and
// the micro-batch's load-balancing statistics on the device (qwen3-spec.md 3.3: pooled over the
// sparse layers' tokens, then multiplied).
//
// No host synchronisation at ep 1: the experts' row offsets stay on the device (kept per sparse
// layer for its backward) and feed the grouped GEMMs (grouped_gemm.h) directly (with an ep group
// the all-to-all needs its counts on the host: cuda_ops_moe_ep.cpp); the load metrics are
// summed on the device and copied when read. The experts' activations (gate/up, SwiGLU and down
// outputs) are kept per sparse layer for its backward, or with train.recompute in one shared set
// that the program's recomputed forward of the layer has just written; the input rows in expert
// order are gathered again in the backward (a copy) rather than kept. A pipeline stage keeps a
// set of the routing and activations per micro-batch in flight (moe_slots, moe_select) and
// gives each micro-batch its own statistics (MoeBalance, carried between stages by the
// pipeline: backend_cuda_pipeline.cpp). The experts themselves (experts_forward and
// experts_backward, for ep 1 and the ep path alike) run LoRA's adapters on every expert beside
// their grouped GEMMs when bound (lora_cuda.h).
//
// Tensor parallelism (tp_; the CPU's rule, model/cpu_ops_moe.cpp): cfg_ is the tp rank's local
// model, each expert's gate/up rows and down columns of its share of the width (Im here is
// moe_intermediate_size / tp); the router [E, H] is whole. Every tp rank routes the same N rows
// (the program gathers them first under sequence parallelism), so the routing, the capacity,
// the statistics and the load are the same on each (counted once: the trainer sums them over dp
// only). The experts' outputs, hence y, are partial over tp (the program's tp_block_output sums
// them), and so is everything the backward derives from dy: the routing weights' gradient, the
// router's logit and weight gradients (partial over tp in the plan), dx (tp_block_input_backward
// sums it). The load-balancing loss's gradient depends on the router alone: tp rank 0 adds it.
// With mesh.tp_overlap and sequence parallelism the gathered input and output gradient arrive
// rank by rank (cuda_ops_tp.cpp): the router's GEMM reads the input as it lands, the backward
// waits for the whole output gradient.
#include <algorithm>

#include "cuda/check.h"
#include "cuda/cuda_ops.h"
#include "cuda/grouped_gemm.h"
#include "cuda/lora_cuda.h"
#include "ops/cuda/gemm.cuh"
#include "ops/cuda/moe.cuh"
#include "ops/cuda/swiglu.cuh"
#include "ops/moe_capacity.h"
#include "qtrain/error.h"

namespace qt::cuda {

void CudaOps::moe_allocate(ArenaCarver& arena) {
  const int E = cfg_.num_experts, k = cfg_.num_experts_per_tok, L = cfg_.num_layers;
  const std::size_t N = static_cast<std::size_t>(N_), H = cfg_.hidden_size;
  const std::size_t Im = cfg_.moe_intermediate_size, rows = N * k;
  QT_CHECK(cfg_.expert_shards == (ep_ ? ep_->size() : 1),
           "experts stored over {} ranks (the ep rank's local config) computed over {}",
           cfg_.expert_shards, ep_ ? ep_->size() : 1);
  // The experts' rows: this rank's N k, or with an ep group the most it can receive.
  const double factor = forward_only_ ? 0.0 : cfg_.moe_capacity_factor;  // generation: dropless
  moe_capacity_ = factor > 0 ? expert_capacity(N_, k, E, factor) : kMoeDropless;
  const std::size_t ex_rows = moe_expert_rows(N_, k, E, ep_ ? ep_->size() : 1, factor);
  if (ep_) moe_ep_rows_ = static_cast<int>(ex_rows);
  QT_CHECK(moe_slots_.empty() || moe_slots_.size() == static_cast<std::size_t>(L),
           "MoE slots for {} layers of {}", moe_slots_.size(), L);
  moe_layers_.assign(static_cast<std::size_t>(L), {});
  MoeLayer shared;
  bool have_shared = false;
  for (int l = 0; l < L; ++l) {
    if (!cfg_.is_moe_layer(l)) continue;
    const int slots = moe_slots_.empty() ? 1 : moe_slots_[static_cast<std::size_t>(l)];
    for (int k = 0; k < slots; ++k) {  // a set a micro-batch in flight (pipeline slot)
      MoeLayer m;
      m.pos = arena.take<int>(rows);
      m.pair = arena.take<int>(rows);
      m.offsets = arena.take<int>(static_cast<std::size_t>(E) + 1);
      if (!moe_recompute_ || !have_shared) {
        shared.gu = arena.take<bf16>(ex_rows * 2 * Im);
        shared.h = arena.take<bf16>(ex_rows * Im);
        shared.out = arena.take<bf16>(rows * H);
        have_shared = true;
      }
      m.gu = shared.gu;
      m.h = shared.h;
      m.out = shared.out;
      moe_layers_[static_cast<std::size_t>(l)].push_back(m);
    }
  }
  moe_counts_ = arena.take<int>(E);
  moe_kept_ = arena.take<int>(E);
  moe_route_ws_ = arena.take<char>(moe_route_workspace_bytes(static_cast<int>(rows), E));
  moe_logits_ = arena.take<bf16>(N * E);
  moe_x_ = arena.take<bf16>(rows * H);
  if (!forward_only_) {  // the backward's
    moe_dout_ = arena.take<bf16>(rows * H);
    moe_dh_ = arena.take<bf16>(ex_rows * Im);
    moe_dgu_ = arena.take<bf16>(ex_rows * 2 * Im);
    moe_dx_gate_ = arena.take<bf16>(N * H);
    moe_dw_ = arena.take<float>(rows);
  }
  moe_own_.sums = arena.take<double>(2 * static_cast<std::size_t>(E));
  moe_balance_ = &moe_own_;
  const std::size_t n_load = static_cast<std::size_t>(cfg_.num_moe_layers()) * E;
  router_bias_ = arena.take<float>(n_load);
  moe_load_ = arena.take<double>(n_load);
  load_.assign(n_load, 0.0);
  const std::size_t n_sparse = static_cast<std::size_t>(cfg_.num_moe_layers());
  moe_dropped_ = arena.take<double>(n_sparse);
  dropped_.assign(n_sparse, 0.0);
  if (arena.counting()) return;
  QT_CHECK_CUDA(cudaMemset(moe_load_, 0, sizeof(double) * n_load));
  QT_CHECK_CUDA(cudaMemset(moe_dropped_, 0, sizeof(double) * n_sparse));
}

const std::vector<double>& CudaOps::moe_load() const {
  if (moe_load_ != nullptr) {
    QT_CHECK_CUDA(cudaMemcpyAsync(load_.data(), moe_load_, sizeof(double) * load_.size(),
                                  cudaMemcpyDeviceToHost, s_));
    QT_CHECK_CUDA(cudaStreamSynchronize(s_));
  }
  return load_;
}

const std::vector<double>& CudaOps::moe_dropped() const {
  if (moe_dropped_ != nullptr) {
    QT_CHECK_CUDA(cudaMemcpyAsync(dropped_.data(), moe_dropped_, sizeof(double) * dropped_.size(),
                                  cudaMemcpyDeviceToHost, s_));
    QT_CHECK_CUDA(cudaStreamSynchronize(s_));
  }
  return dropped_;
}

// The bias is the trainer's: the host updates it after each optimizer step from the step's load
// (moe_load), read after the step has ended (the host has waited for the loss and the gradient
// norm by then), so neither the read nor this copy adds a wait inside the step. One copy on the
// stream orders it after the step's forwards that read the old bias and before the next; from
// pageable memory it is staged at once (the host copy is kept all the same).
void CudaOps::set_router_bias(const std::vector<float>& bias) {
  router_bias_on_ = !bias.empty();
  if (!router_bias_on_) return;
  const std::size_t n = static_cast<std::size_t>(cfg_.num_moe_layers()) * cfg_.num_experts;
  QT_CHECK(router_bias_ != nullptr && bias.size() == n,
           "router bias of {} values for {} sparse layers of {} experts", bias.size(),
           cfg_.num_moe_layers(), cfg_.num_experts);
  router_bias_host_ = bias;
  QT_CHECK_CUDA(cudaMemcpyAsync(router_bias_, router_bias_host_.data(), sizeof(float) * n,
                                cudaMemcpyHostToDevice, s_));
}

void CudaOps::clear_moe_load() {
  std::fill(load_.begin(), load_.end(), 0.0);
  std::fill(dropped_.begin(), dropped_.end(), 0.0);
  if (moe_load_ != nullptr) {
    QT_CHECK_CUDA(cudaMemsetAsync(moe_load_, 0, sizeof(double) * load_.size(), s_));
    QT_CHECK_CUDA(cudaMemsetAsync(moe_dropped_, 0, sizeof(double) * dropped_.size(), s_));
  }
}

CudaOps::MoeLayer& CudaOps::moe_layer(int l) {
  std::vector<MoeLayer>& sets = moe_layers_.at(static_cast<std::size_t>(l));
  QT_CHECK(moe_slot_ >= 0 && moe_slot_ < static_cast<int>(sets.size()),
           "MoE slot {} of layer {}, which keeps {} here", moe_slot_, l, sets.size());
  return sets[static_cast<std::size_t>(moe_slot_)];
}

void CudaOps::moe_select(int slot, MoeBalance* balance) {
  QT_CHECK(moe_own_.sums != nullptr, "moe_select on CudaOps of a dense model");
  moe_slot_ = slot;
  moe_balance_ = balance ? balance : &moe_own_;
}

double CudaOps::moe_aux_loss_of(const double* sums, int E, double tokens) {
  if (tokens == 0) return 0.0;
  double s = 0;
  for (int e = 0; e < E; ++e) s += sums[e] * sums[E + e];
  return E * s / (tokens * tokens);
}

void CudaOps::moe_begin() {
  QT_CHECK(moe_balance_ != nullptr, "moe_begin on CudaOps of a dense model");
  MoeBalance& b = *moe_balance_;
  if (b.received) {  // the stages before's sums and tokens: this stage's layers add to them
    b.received = false;
  } else {
    QT_CHECK_CUDA(cudaMemsetAsync(b.sums, 0, 2 * sizeof(double) * cfg_.num_experts, s_));
    b.tokens = 0;
  }
}

void CudaOps::moe(int l, bf16* y, float* probs, int* idx, bf16* rw, const bf16* x,
                  const bf16* router, const bf16* gate_up, const bf16* down, bool stats) {
  QT_CHECK(moe_balance_ != nullptr && cfg_.is_moe_layer(l), "moe on layer {}, not a sparse one", l);
  const int E = cfg_.num_experts, k = cfg_.num_experts_per_tok, H = cfg_.hidden_size;
  const int rows = N_ * k;
  MoeLayer& m = moe_layer(l);
  double* balance = moe_balance_->sums;  // [2, E] the micro-batch's statistics
  linear(moe_logits_, x, router, N_, H, E);  // [N, E] bf16 (over a gathered x as it lands)
  const float* bias =
      router_bias_on_
          ? router_bias_ + static_cast<std::size_t>(cfg_.moe_layers_before(l)) * E
          : nullptr;  // layer l's [E]
  moe_router_forward(probs, idx, rw, moe_logits_, N_, E, k, cfg_.norm_topk_prob, s_, bias);
  moe_route(moe_counts_, moe_kept_, m.offsets, m.pos, m.pair, stats ? balance : nullptr,
            idx, rows, E, moe_capacity_, moe_route_ws_, s_);
  if (stats) {
    moe_probs_colsum(balance + E, probs, N_, E, s_);
    moe_balance_->tokens += N_;
    const std::size_t sparse = static_cast<std::size_t>(cfg_.moe_layers_before(l));
    moe_load_add(moe_load_ + sparse * E, moe_counts_, E, s_);
    if (moe_capacity_ != kMoeDropless)
      moe_dropped_add(moe_dropped_ + sparse, moe_counts_, moe_kept_, E, s_);
  }
  // The experts: out = down(swiglu(gate_up(x_perm))), kept for the backward (with an ep group
  // on the experts' ranks, out returned in this rank's expert order).
  moe_permute(moe_x_, x, m.pair, rows, k, H, s_);
  if (ep_)
    moe_ep_forward(l, gate_up, down, /*fresh=*/stats);  // stats: not a recomputed forward
  else
    experts_forward(l, m.out, moe_x_, m.offsets, E, rows, gate_up, down);
  moe_unpermute(y, m.out, rw, m.pos, N_, k, H, s_);
  moe_last_ = l;
}

void CudaOps::moe_backward(int l, bf16* dx, float* g_router, float* g_gate_up, float* g_down,
                           const bf16* dy, const bf16* x, const float* probs, const int* idx,
                           const bf16* rw, const bf16* router, const bf16* gate_up,
                           const bf16* down, bool acc) {
  // Null gradients: a frozen block (LoRA: the router and the experts frozen, PEFT's frozen
  // Linear), dx only, through the experts and the router's logits alike (ops/moe_block.h); the
  // grouped and the router's GEMMs skip their null weight gradients (with an ep group too: the
  // rows still go to the experts' ranks and back).
  const bool frozen = g_router == nullptr;
  QT_CHECK(frozen == (g_gate_up == nullptr) && frozen == (g_down == nullptr),
           "an MoE block with some of its gradients (the router's and the experts': all or "
           "none)");
  const int E = cfg_.num_experts, k = cfg_.num_experts_per_tok, H = cfg_.hidden_size;
  const int rows = N_ * k;
  const MoeLayer& m = moe_layer(l);
  wait_gathered(dy);  // sequence parallelism with overlap: every rank's rows of dy landed
  QT_CHECK(!moe_recompute_ || moe_last_ == l,
           "moe_backward of layer {} after the forward of layer {}: with recompute the expert "
           "activations are shared, the layer's forward must come right before", l, moe_last_);
  // d out = w dy and d w = dot(out, dy); then down, SwiGLU and gate_up backward. The layer's
  // activations stay intact (a backward may run again on them).
  moe_unpermute_backward(moe_dout_, moe_dw_, dy, m.out, rw, m.pos, N_, k, H, s_);
  const bf16* dx_perm = moe_dout_;  // d x_perm [N k, H] in this rank's expert order
  if (ep_) {  // the experts on their ranks (their inputs kept there): d x_perm into moe_x_
    moe_ep_backward(l, g_gate_up, g_down, gate_up, down, acc);
    dx_perm = moe_x_;
  } else {
    // The input rows again for gate_up's weight gradient, or its adapter's.
    if (!frozen || (lora_ && lora_->adapts_experts(kLoraExpertsGateUp)))
      moe_permute(moe_x_, x, m.pair, rows, k, H, s_);
    // d x_perm into moe_dout_ (dead once d h is made).
    experts_backward(l, moe_dout_, g_gate_up, g_down, moe_dout_, moe_x_, m.offsets, E, rows,
                     gate_up, down, acc);
  }
  // The router: d logits from d w (and the load-balancing loss, with the micro-batch's counts;
  // under tp on rank 0 only, the rest being partial over tp).
  const double tokens = moe_balance_->tokens;  // the whole micro-batch's (all stages')
  const bool aux = aux_scale_ != 0 && tokens > 0 && (tp_ == nullptr || tp_->rank() == 0);
  const float aux_scale = aux ? static_cast<float>(aux_scale_ * E / (tokens * tokens)) : 0.f;
  moe_router_backward(moe_logits_, moe_dw_, probs, idx, aux ? moe_balance_->sums : nullptr,
                      aux_scale,
                      N_, E, k, cfg_.norm_topk_prob, s_);
  cuda::linear_backward(moe_dx_gate_, g_router, moe_logits_, x, router, N_, H, E, s_, acc);
  if (ep_) moe_ep_join();  // d x_perm home (the router's backward ran beside its exchange)
  moe_permute_backward(dx, dx_perm, moe_dx_gate_, m.pos, N_, k, H, s_);
  dx_pending_ = nullptr;  // dx is not a linear_backward's: its tp sum waits for the stream
}

void CudaOps::experts_forward(int l, bf16* out, const bf16* x, const int* offsets, int groups,
                              int rows, const bf16* gate_up, const bf16* down) {
  const int H = cfg_.hidden_size, Im = cfg_.moe_intermediate_size;
  MoeLayer& m = moe_layer(l);
  grouped_linear(m.gu, x, gate_up, offsets, groups, rows, H, 2 * Im, s_);
  if (lora_) lora_->expert_forward(l, kLoraExpertsGateUp, x, m.gu, offsets, groups, rows, s_);
  swiglu_forward_strided(m.h, m.gu, m.gu + Im, 2 * Im, rows, Im, s_);
  grouped_linear(out, m.h, down, offsets, groups, rows, Im, H, s_);
  if (lora_) lora_->expert_forward(l, kLoraExpertsDown, m.h, out, offsets, groups, rows, s_);
}

void CudaOps::experts_backward(int l, bf16* dx, float* g_gate_up, float* g_down,
                               const bf16* dout, const bf16* x, const int* offsets, int groups,
                               int rows, const bf16* gate_up, const bf16* down, bool acc) {
  experts_backward_inputs(l, dx, g_down, dout, x, offsets, groups, rows, gate_up, down, acc);
  experts_gate_up_weight_grad(g_gate_up, x, offsets, groups, rows, acc);
}

void CudaOps::experts_backward_inputs(int l, bf16* dx, float* g_down, const bf16* dout,
                                      const bf16* x, const int* offsets, int groups, int rows,
                                      const bf16* gate_up, const bf16* down, bool acc) {
  const int H = cfg_.hidden_size, Im = cfg_.moe_intermediate_size;
  const MoeLayer& m = moe_layer(l);
  grouped_linear_backward(moe_dh_, g_down, dout, m.h, down, offsets, groups, rows, Im, H, s_,
                          acc);
  if (lora_)
    lora_->expert_backward(l, kLoraExpertsDown, m.h, dout, moe_dh_, offsets, groups, rows, s_);
  swiglu_backward_strided(moe_dgu_, moe_dgu_ + Im, moe_dh_, m.gu, m.gu + Im, 2 * Im, rows, Im,
                          s_);
  // dout is dead from here: dx may take its place.
  grouped_linear_backward(dx, nullptr, moe_dgu_, x, gate_up, offsets, groups, rows, H, 2 * Im,
                          s_, acc);
  if (lora_)
    lora_->expert_backward(l, kLoraExpertsGateUp, x, moe_dgu_, dx, offsets, groups, rows, s_);
}

void CudaOps::experts_gate_up_weight_grad(float* g_gate_up, const bf16* x, const int* offsets,
                                          int groups, int rows, bool acc) {
  const int H = cfg_.hidden_size, Im = cfg_.moe_intermediate_size;
  grouped_linear_backward(nullptr, g_gate_up, moe_dgu_, x, nullptr, offsets, groups, rows, H,
                          2 * Im, s_, acc);
}

double CudaOps::moe_aux_loss() {
  if (moe_balance_ == nullptr || moe_balance_->tokens == 0) return 0.0;
  const int E = cfg_.num_experts;
  std::vector<double> b(2 * static_cast<std::size_t>(E));
  QT_CHECK_CUDA(cudaMemcpyAsync(b.data(), moe_balance_->sums, sizeof(double) * b.size(),
                                cudaMemcpyDeviceToHost, s_));
  QT_CHECK_CUDA(cudaStreamSynchronize(s_));
  return moe_aux_loss_of(b.data(), E, moe_balance_->tokens);
}

}  // namespace qt::cuda
