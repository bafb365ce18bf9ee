// The op contract of the layer program (model/layer_program.h) on the CPU, in fp32: each fused
// op composed from the reference ops of src/ops (BLAS GEMMs, loops), so the CPU stays the oracle
// the CUDA ops are checked against. Buffers of micro-batches of B x T tokens.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "model/layer_program.h"
#include "ops/moe_experts.h"
#include "ops/moe_router.h"
#include "qtrain/comm.h"
#include "qtrain/model_config.h"

namespace qt {

class LoraAdapters;
class ExpertDispatch;
class ContextSplit;
class RingAttention;

// Zero-filled host buffers with stable addresses (the program's activations on the CPU); with
// counting_only, counts the bytes and hands out nothing (for the memory check before allocating).
class HostArena {
 public:
  explicit HostArena(bool counting_only = false) : counting_(counting_only) {}
  template <class T>
  T* allocate(std::size_t n) {
    bytes_ += n * sizeof(T);
    if (counting_) return nullptr;
    blocks_.push_back(std::make_unique<float[]>((n * sizeof(T) + 3) / 4));  // zeroed
    return reinterpret_cast<T*>(blocks_.back().get());
  }
  double bytes() const { return static_cast<double>(bytes_); }

 private:
  bool counting_;
  std::size_t bytes_ = 0;
  std::vector<std::unique_ptr<float[]>> blocks_;
};

class CpuOps : public NoCollectives {
 public:
  using Act = float;
  using Weight = float;

  // Buffers from `arena` (which must outlive this). seq_parallel > 1: for sequence parallelism
  // over a tp group of that size (set_tp).
  CpuOps(const ModelConfig& cfg, int B, int T, HostArena& arena, int seq_parallel = 1);
  // Forward only, for a KV-cache decoder (generate/kv_decoder.cpp): the layer ops over up to
  // max_rows rows a call (set_rows), RoPE tables for positions [0, rope_len) (set_positions gives
  // each row's), and none of the buffers of the backward or the lm head (the decoder runs its own
  // head over the rows it returns).
  struct ForwardOnly {
    int max_rows, rope_len;
  };
  CpuOps(const ModelConfig& cfg, ForwardOnly f, HostArena& arena);

  // The rows of the next calls, B x T <= the rows the buffers were made for.
  void set_rows(int B, int T);

  // The RoPE positions of the next micro-batch ([B, T], layer_program.h's packing rule), or
  // null: 0..T-1, plain causal.
  void set_positions(const std::int32_t* pos) { pos_ = pos; }
  void set_lora(LoraAdapters* lora) { lora_ = lora; }
  // Tensor parallelism: the tp group this rank's local model is a part of, or null (none). The
  // local vocabulary is then rows [tp rank x V_local, ...) of the global one: the embedding and
  // the cross-entropy run vocabulary-parallel (model/vocab_parallel.h). With the constructor's
  // seq_parallel (which must be tp's size) sequence parallelism is on: the residual stream
  // holds this rank's N / tp rows (Qwen3Acts::rows; the program's activations are allocated
  // so), the embedding reduce-scatters its rows, the lm head gathers its input and
  // reduce-scatters its input gradient.
  void set_tp(Comm* tp);
  // Context parallelism over `cp` (null: none): the ops' B x T rows are this cp rank's tokens
  // of sequences of split.seq_len() tokens (parallel/context_parallel.h); attention runs as
  // ring attention (model/ring_attention.h) and RoPE over the global positions, so
  // set_positions must give every row's (never null). `split` must outlive the ops.
  void set_context_parallel(Comm* cp, const ContextSplit* split);

  // The collective hooks (layer_program.h's NoCollectives has the contract): with tp, a
  // row-parallel GEMM's partial output and a column-parallel pair's partial input gradient
  // summed over tp (all-reduced in place, or reduce-scattered into `local` with sequence
  // parallelism); with sequence parallelism the normed block input and the output gradient
  // all-gathered into `full`.
  float* tp_block_input(float* full, float* x, int rows, int cols);
  float* tp_block_input_backward(float* local, float* dx, int rows, int cols);
  float* tp_block_output(float* local, float* y, int rows, int cols);
  float* tp_block_output_backward(float* full, float* dy, int rows, int cols);
  // [N, V] logits of the last lm_head_loss_forward (valid until its backward).
  const float* logits() const { return logits_; }

  // Zero-bubble pipelines split each backward into its input-gradient and weight-gradient halves.
  // While deferring into `queue` (not null), linear_backward computes dx only and queues its
  // weight gradient with a copy of dy; x must stay valid until run_deferred (a stage's slot
  // activations, without recompute). run_deferred does the queued ones in order, then empties it.
  struct DeferredGrad {
    float* dw;
    std::vector<float> dy;  // [N, out]
    const float* x;         // [N, in]
    int N, in, out;
    bool acc;
  };
  void defer_weight_grads(std::vector<DeferredGrad>* queue) { defer_ = queue; }
  static void run_deferred(std::vector<DeferredGrad>& queue);

  void linear(float* y, const float* x, const float* w, int N, int in, int out);
  void linear_backward(float* dx, float* dw, const float* dy, const float* x, const float* w,
                       int N, int in, int out, bool acc);
  void qk_norm_rope(float* out, float* rstd, const float* x, int ld, const float* w, int heads);
  void qk_norm_rope_backward(float* dx, int dx_ld, float* dw, const float* dout, const float* x,
                             int ld, const float* w, const float* rstd, int heads, bool acc);
  void copy_columns(float* dst, int dst_ld, const float* src, int src_ld, int rows, int cols);
  void attention(int l, float* out, float* lse, const float* q, const float* k, const float* v);
  void attention_backward(int l, float* dq, float* dk, float* dv, const float* dout,
                          const float* q, const float* k, const float* v, const float* out,
                          const float* lse);
  void rmsnorm(float* y, float* rstd, const float* x, const float* w, int N);
  void rmsnorm_backward(float* dx, float* dw, const float* dy, const float* x, const float* w,
                        const float* rstd, int N, bool acc);
  void residual_rmsnorm(float* res_out, float* y, float* rstd, const float* res_in,
                        const float* x, const float* w, int N);
  void residual_add(float* res_out, const float* res_in, const float* x, int N);
  void residual_rmsnorm_backward(float* dres, float* dw, const float* dy, const float* x,
                                 const float* w, const float* rstd, int N, bool acc);
  void swiglu(float* h, const float* gu, int N, int I);
  void swiglu_backward(float* dgu, const float* dh, const float* gu, int N, int I);
  void embedding(float* x, const std::int32_t* ids, const float* wte, int N);
  void embedding_backward(float* dwte, const float* dx, const std::int32_t* ids, int N,
                          bool overwrite);
  bool lora_on() const { return lora_ != nullptr; }
  bool lora_adapts(LoraSite site) const;
  void lora(int l, LoraSite site, const float* x, float* y);
  void lora_backward(int l, LoraSite site, const float* x, const float* dy, float* dx);
  void lm_head_loss(const float* xf, const float* lm_head, float* g_lm_head,
                    const std::int32_t* targets, float scale, float* dxf, bool acc);
  void lm_head_loss_forward(const float* xf, const float* lm_head, const std::int32_t* targets);
  void lm_head_loss_backward(const float* xf, const float* lm_head, float* g_lm_head,
                             const std::int32_t* targets, float scale, float* dxf);
  double take_loss() const { return loss_; }

  // Qwen3-MoE (layer_program.h's contract; src/model/cpu_ops_moe.cpp). aux_scale: the weight of
  // this micro-batch's load-balancing loss in the step's objective (model.router_aux_loss_coef
  // over the step's micro-batches on all dp ranks; 0: none, the default).
  void set_moe_aux_scale(float aux_scale) { aux_scale_ = aux_scale; }
  // Auxiliary-loss-free balancing: bias [sparse layers, E] (global sparse-layer order, fp32;
  // null: none) is added to each sparse layer's router probabilities for the choice of experts
  // only (cpu::router_forward). Not a parameter: no gradient. The caller keeps it alive.
  void set_router_bias(const float* bias) { router_bias_ = bias; }
  // Expert parallelism over `ep` (null or one rank: none): each sparse layer's (token, slot)
  // rows go to the rank owning their expert and back (parallel/expert_parallel.h), so a rank
  // computes only its E / ep experts, which are all it stores: the config must be the ep rank's
  // local one (ep_local_config: expert_shards = ep), whose expert tensors are [E / ep, ...].
  // slots: the micro-batches in flight between their forward and backward (a pipeline stage's
  // activation slots), each keeping its own exchanges; select_moe_slot picks the next calls'.
  void set_expert_parallel(Comm* ep, int slots = 1);
  void select_moe_slot(int slot);
  void moe_begin();
  void moe(int l, float* y, float* probs, int* idx, float* rw, const float* x, const float* router,
           const float* gate_up, const float* down, bool stats);
  void moe_backward(int l, float* dx, float* g_router, float* g_gate_up, float* g_down,
                    const float* dy, const float* x, const float* probs, const int* idx,
                    const float* rw, const float* router, const float* gate_up,
                    const float* down, bool acc);
  // The load-balancing loss of the last micro-batch's forward (k for a balanced router; 0 for
  // a dense model), and its statistics.
  double moe_aux_loss() const;
  const cpu::RouterBalance& moe_balance() const { return balance_; }
  // A pipeline stage's backward: the statistics of the whole micro-batch (every stage's sparse
  // layers, model/qwen3_stage.h), in place of those its own forward collected.
  void set_moe_balance(const cpu::RouterBalance& b) { balance_ = b; }
  // Token-slots routed to each expert of each sparse layer since the last clear_moe_load():
  // [sparse layers in order][E], as doubles (the forwards that counted statistics; the routing
  // before any drop).
  const std::vector<double>& moe_load() const { return load_; }
  // Token-slots of this rank's tokens that model.moe_capacity_factor dropped in each sparse
  // layer since the last clear_moe_load(): [sparse layers in order] (the same forwards; zeros
  // when dropless).
  const std::vector<double>& moe_dropped() const { return dropped_; }
  void clear_moe_load() {
    std::fill(load_.begin(), load_.end(), 0.0);
    std::fill(dropped_.begin(), dropped_.end(), 0.0);
  }

 private:
  // The projections of a LoRA site, each with its first column in the site's fused output.
  struct SiteTarget {
    int target, col;
  };
  std::vector<SiteTarget> site_targets(LoraSite site) const;
  // Sparse layer l's expert adapters for the experts stored here (none: r = 0).
  cpu::ExpertLora<float> expert_lora(int l, bool grads) const;
  int site_width(LoraSite site) const;  // columns of the site's fused output
  // The hooks' collectives. gather_rows (sequence parallelism): full [rows, cols] <- every tp
  // rank's local [rows / tp, cols] in rank order; returns full, or null without sequence
  // parallelism (nothing done). sum_rows: the partial y [rows, cols] summed over tp: in place
  // (returns y), or this rank's rows into local (sequence parallelism); without tp returns y.
  float* gather_rows(float* full, const float* local, int rows, int cols);
  float* sum_rows(float* local, float* y, int rows, int cols);

  ModelConfig cfg_;
  int B_, T_, N_;
  int max_rows_;
  const std::int32_t* pos_ = nullptr;
  LoraAdapters* lora_ = nullptr;
  Comm* tp_ = nullptr;
  int seq_parallel_ = 1;  // the constructor's
  bool sp_ = false;       // sequence parallelism over tp_ (set_tp)
  std::vector<DeferredGrad>* defer_ = nullptr;  // defer_weight_grads
  int vocab_begin_ = 0;  // the first global token id of the local vocabulary
  float *cos_, *sin_;      // [T (or rope_len, or cp's global T), hd/2]
  // Context parallelism (set_context_parallel), else null / empty: the ring and the RoPE table
  // of the global sequence [T, hd/2] each.
  std::shared_ptr<RingAttention> ring_;
  std::vector<float> cp_cos_, cp_sin_;
  float *xs_, *ys_;        // [N, max(Q, KV)] contiguous copies of strided q/k columns
  // Training only (null when ForwardOnly):
  float* norm_dx_ = nullptr;                   // [N, H] a norm's input gradient before it is added
  float* logits_ = nullptr;                    // [N, V]
  float *losses_ = nullptr, *lse_ = nullptr;   // [N]
  // Sequence parallelism only (else null): the lm head's gathered input, kept from its forward
  // to its backward, and the embedding's or the head's full rows before they are scattered.
  float *xf_full_ = nullptr, *rows_full_ = nullptr;  // [N, H]
  double loss_ = 0;
  cpu::RouterBalance balance_{0};  // the micro-batch's, pooled over its MoE layers (moe_begin)
  float aux_scale_ = 0;
  const float* router_bias_ = nullptr;  // set_router_bias: [sparse layers, E]
  std::vector<double> load_;       // moe_load(), sized at the first sparse layer
  std::vector<double> dropped_;    // moe_dropped(), sized with load_
  Comm* ep_ = nullptr;             // set_expert_parallel
  // Expert parallelism: each sparse layer's exchange and its experts' outputs [N k, H], from
  // its forward to its backward, for each slot (set_expert_parallel); index slot x L + l.
  std::vector<std::shared_ptr<ExpertDispatch>> dispatch_;  // [slots x L]
  std::vector<std::vector<float>> slot_out_;               // [slots x L]
  int moe_slot_ = 0;                                       // select_moe_slot
};

}  // namespace qt
