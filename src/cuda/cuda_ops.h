// The op contract of the layer program (model/layer_program.h) on one GPU: bf16 activations and
// weights, fp32 weight gradients, the kernels of src/ops/cuda, every op enqueued on the stream of
// the current micro-batch (begin()). The bf16 rounding points are transformers'
// (qwen3-spec.md 7.2); the CPU ops are the oracle.
//
// The lm head and the cross-entropy run chunked over tokens, each chunk's backward right after
// its forward, so the full [tokens, vocabulary] logits never exist: lm_head_loss is the only form
// of the head here (no separate forward and backward).
//
// Tensor parallelism (a tp communicator given): cfg is the tp rank's local model
// (parallel/tensor_parallel.h: heads, MLP width and vocabulary divided by tp). The collective
// hooks sum over tp on the communicator's stream, ordered with the micro-batch's stream by
// events: the row-parallel output (o, down) in the forward, the column-parallel input gradient
// (q/k/v, gate/up) in the backward, started right after its GEMM so that it overlaps the weight
// gradient's GEMM. The embedding and the lm head are vocabulary-parallel: this rank holds rows
// [tp rank x V, +V) of each; the lookup is summed over tp, the cross-entropy combines the ranks'
// log-sum-exp and target logits (one all-gather a chunk), and the head's input gradient is
// summed over tp. With sequence parallelism (seq_parallel = tp) the residual stream and the norms
// hold this rank's N / tp rows (the program's Nl): the hooks all-gather a block's normed input
// and reduce-scatter its row-parallel output (and the reverse in the backward), the embedding
// reduce-scatters its rows, and the lm head gathers the final norm's rows and reduce-scatters its
// input gradient.
//
// The tp collectives of a block overlap its GEMMs (cuda_ops_tp.cpp; mesh.tp_overlap, no LoRA): a
// row-parallel GEMM (o, down; announced by tp_block_output_ahead) runs in row pieces, each
// piece all-reduced, or with sequence parallelism sent to the rank that owns its rows, while the
// next piece computes; sequence parallelism's gathers (a block's normed input, the gradient of a
// row-parallel output) arrive rank by rank over point-to-point calls and the GEMM that reads them
// runs on each rank's rows as they land, its own first; a column-parallel input gradient is
// reduced beside the weight-gradient GEMM.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "cuda/device.h"
#include "cuda/nccl_comm.h"
#include "model/layer_program.h"
#include "qtrain/model_config.h"

namespace qt::cuda {

using bf16 = __nv_bfloat16;

class LoraCuda;

class CudaOps : public NoCollectives {
 public:
  using Act = bf16;
  using Weight = bf16;

  // Buffers for micro-batches of B x T tokens from `arena` (which must outlive this). tp: the
  // tensor-parallel group (cfg is then its rank's local model), or null. seq_parallel: tp's
  // size for sequence parallelism (the program's activations allocated with it), else 1.
  // tp_overlap: the tp collectives in pieces beside the GEMMs (below), else each whole.
  // moe_recompute: the program recomputes each layer's forward before its backward
  // (train.recompute), so a Qwen3-MoE model keeps one shared set of expert activations instead
  // of one per sparse layer. ep: the expert-parallel group of a Qwen3-MoE model (mesh.ep > 1;
  // cfg is then the ep rank's local model, ep_local_config: E / ep experts stored here), or null.
  // moe_slots: a pipeline stage's (backend_cuda_pipeline.cpp) [L] micro-batches in flight of
  // each layer, 0 for the layers of other stages: a sparse layer keeps that many sets of its
  // routing and (without moe_recompute) expert activations, selected by moe_select; empty: one
  // set for every sparse layer. lm_head false: a pipeline stage without the model's head, so
  // without the lm head's logits and loss buffers (about 1 GiB of logits; lm_head_loss refused,
  // take_loss 0).
  CudaOps(const ModelConfig& cfg, int B, int T, DeviceArena& arena, NcclComm* tp = nullptr,
          int seq_parallel = 1, bool tp_overlap = false, bool moe_recompute = false,
          NcclComm* ep = nullptr, const std::vector<int>& moe_slots = {}, bool lm_head = true);
  // Forward only, for the KV-cache decoder (generate/kv_decoder_cuda.cpp): the layer ops over
  // any number of rows (set_rows), RoPE tables for positions [0, rope_len), and none of the
  // buffers of the backward, the lm head or the loss (the decoder runs its own head).
  struct ForwardOnly {
    int rope_len;
  };
  // A Qwen3-MoE model's block buffers (for rows up to rope_len) come from an arena of the ops'
  // own (own_bytes()).
  CudaOps(const ModelConfig& cfg, ForwardOnly f, DeviceArena& arena);
  // Device bytes of the ops' own arena (forward-only Qwen3-MoE), 0 when none.
  std::size_t own_bytes() const { return moe_arena_ ? moe_arena_->capacity() : 0; }
  // Forward only: the next calls run B x T rows whose RoPE positions are first + t (pos null).
  void set_rows(int B, int T, int first_position);

  void set_lora(LoraCuda* lora) { lora_ = lora; }
  // Starts a micro-batch: its ops go on `s`; pos: device [B, T] RoPE positions (packing) or
  // null: 0..T-1, plain causal. Zeroes the loss sum.
  void begin(cudaStream_t s, const std::int32_t* pos);
  // The positions of the next ops' micro-batch (a pipeline stage switches between micro-batches
  // in flight; the loss sum goes on).
  void set_positions(const std::int32_t* pos) { pos_ = pos; }
  // The summed loss of the micro-batch; waits for the stream.
  double take_loss();

  void linear(bf16* y, const bf16* x, const bf16* w, int N, int in, int out);
  void linear_backward(bf16* dx, float* dw, const bf16* dy, const bf16* x, const bf16* w, int N,
                       int in, int out, bool acc);
  void qk_norm_rope(bf16* out, float* rstd, const bf16* x, int ld, const bf16* w, int heads);
  void qk_norm_rope_backward(bf16* dx, int dx_ld, float* dw, const bf16* dout, const bf16* x,
                             int ld, const bf16* w, const float* rstd, int heads, bool acc);
  void copy_columns(bf16* dst, int dst_ld, const bf16* src, int src_ld, int rows, int cols);
  void attention(int l, bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v);
  void attention_backward(int l, bf16* dq, bf16* dk, bf16* dv, const bf16* dout, const bf16* q,
                          const bf16* k, const bf16* v, const bf16* out, const float* lse);
  void rmsnorm(bf16* y, float* rstd, const bf16* x, const bf16* w, int N);
  void rmsnorm_backward(bf16* dx, float* dw, const bf16* dy, const bf16* x, const bf16* w,
                        const float* rstd, int N, bool acc);
  void residual_rmsnorm(bf16* res_out, bf16* y, float* rstd, const bf16* res_in, const bf16* x,
                        const bf16* w, int N);
  void residual_rmsnorm_backward(bf16* dres, float* dw, const bf16* dy, const bf16* x,
                                 const bf16* w, const float* rstd, int N, bool acc);
  void residual_add(bf16* res_out, const bf16* res_in, const bf16* x, int N);
  void swiglu(bf16* h, const bf16* gu, int N, int I);
  void swiglu_backward(bf16* dgu, const bf16* dh, const bf16* gu, int N, int I);
  void embedding(bf16* x, const std::int32_t* ids, const bf16* wte, int N);
  void embedding_backward(float* dwte, const bf16* dx, const std::int32_t* ids, int N,
                          bool overwrite);
  bool lora_on() const { return lora_ != nullptr; }
  bool lora_adapts(LoraSite site) const;
  void lora(int l, LoraSite site, const bf16* x, bf16* y);
  void lora_backward(int l, LoraSite site, const bf16* x, const bf16* dy, bf16* dx);
  void lm_head_loss(const bf16* xf, const bf16* lm_head, float* g_lm_head,
                    const std::int32_t* targets, float scale, bf16* dxf, bool acc);
  // ZB-H1's split backward (a pipeline stage runs the program's backward unchanged): while a
  // queue is set, linear_backward enqueues dx only and queues its weight gradient, which reads x
  // later in place (a slot's activations: no recompute with ZB-H1) and dy in place when it lies
  // in [keep_begin, keep_end) (the slot's activations: gate/up's gradient written over gu),
  // else from a copy in the queue's store. run_deferred enqueues the queued GEMMs in order on
  // the current stream and empties the queue.
  struct DeferredGrads {
    bf16* store = nullptr;               // [capacity] copies of dy
    std::size_t capacity = 0, used = 0;  // elements
    const void* keep_begin = nullptr;    // dy read in place inside [keep_begin, keep_end)
    const void* keep_end = nullptr;
    struct Gemm {
      float* dw;
      const bf16 *dy, *x;
      int N, in, out;
      bool acc;
    };
    std::vector<Gemm> gemms;
  };
  void defer_weight_grads(DeferredGrads* queue) { defer_ = queue; }
  void run_deferred(DeferredGrads& queue);
  // Tensor parallelism's hooks (layer_program.h's NoCollectives has the contract): the sums
  // over tp in place, or with sequence parallelism the gathers into `full` and the
  // reduce-scatters into `local`; nothing without tp. Each returns what the next op reads.
  bf16* tp_block_input(bf16* full, bf16* x, int rows, int cols);
  bf16* tp_block_input_backward(bf16* local, bf16* dx, int rows, int cols);
  bf16* tp_block_output(bf16* local, bf16* y, int rows, int cols);
  bf16* tp_block_output_backward(bf16* full, bf16* dy, int rows, int cols);
  void tp_block_output_ahead(bf16* local, bf16* y, int rows, int cols);

  // Qwen3-MoE (layer_program.h's contract; cuda_ops_moe.cpp). The router, the
  // routing and the combine are ops/cuda/moe.cuh's kernels, the experts grouped_gemm.h's GEMMs
  // (their row offsets stay on the device: no host synchronisation at ep 1); a layer keeps the
  // routing and the experts' activations (gate/up, SwiGLU and down outputs, in expert order) for
  // its backward. With an ep group the rows travel to their experts' ranks and back
  // (cuda_ops_moe_ep.cpp: one host synchronisation per sparse layer's forward, for the
  // all-to-all's counts, kept for the backward and a recomputed forward). With moe_recompute the
  // activations are one shared set, which the program's recomputed forward of the layer has just
  // written when its backward comes (checked). aux_scale: the weight of each micro-batch's
  // load-balancing loss in the objective (CpuOps' the same). Under tensor parallelism (cfg the tp
  // rank's local model: moe_intermediate_size / tp of every expert's width) the router is
  // replicated and every tp rank routes all N rows alike (gathered with sequence parallelism),
  // so the statistics, the load and the aux loss are whole on each tp rank (not summed over
  // tp); the block's output, its input gradient and the router's weight gradient are partial
  // over tp (the program's hooks and the state sum them), and tp rank 0 alone adds the
  // load-balancing loss's gradient, so that the sums count it once (CpuOps::moe_backward).
  void moe_begin();
  void moe(int l, bf16* y, float* probs, int* idx, bf16* rw, const bf16* x, const bf16* router,
           const bf16* gate_up, const bf16* down, bool stats);
  void moe_backward(int l, bf16* dx, float* g_router, float* g_gate_up, float* g_down,
                    const bf16* dy, const bf16* x, const float* probs, const int* idx,
                    const bf16* rw, const bf16* router, const bf16* gate_up, const bf16* down,
                    bool acc);
  void set_moe_aux_scale(float aux_scale) { aux_scale_ = aux_scale; }
  // A micro-batch's load-balancing statistics: sums [2, E] device doubles (each expert's routed
  // token-slots, then its summed router probabilities) over `tokens` (sparse layer, token) pairs.
  // received: the sums and tokens were received from the stages before (a pipeline stage's
  // forward); the next moe_begin() continues them instead of restarting, and clears this.
  struct MoeBalance {
    double* sums = nullptr;
    double tokens = 0;
    bool received = false;
  };
  // Pipeline parallelism (several micro-batches in flight): the next moe, moe_backward and
  // moe_begin use activation slot `slot` of each sparse layer (< its moe_slots) and the
  // micro-batch's statistics `balance` (which must outlive their use; null: the ops' own).
  void moe_select(int slot, MoeBalance* balance);
  // The load-balancing loss of statistics [2, E] over `tokens` pairs: E sum_e count_e psum_e /
  // tokens^2 (k when balanced; 0 without tokens).
  static double moe_aux_loss_of(const double* sums, int E, double tokens);
  // Auxiliary-loss-free balancing: the routers' bias [sparse layers, E] (fp32; empty: none) for
  // the following forwards, copied to the device on the stream (after the step: no wait inside
  // it) and added to each sparse layer's probabilities for the choice of experts only.
  void set_router_bias(const std::vector<float>& bias);
  // The load-balancing loss of the micro-batch's forward (k when balanced); waits for the stream.
  double moe_aux_loss();
  // Token-slots routed to each expert of each sparse layer since clear_moe_load():
  // [sparse layers][E] (exact counts, summed on the device; reading them waits for the stream).
  const std::vector<double>& moe_load() const;
  // Token-slots the capacity (model.moe_capacity_factor) dropped in each sparse layer since
  // clear_moe_load(): [sparse layers] (exact; reading them waits for the stream).
  const std::vector<double>& moe_dropped() const;
  void clear_moe_load();

 private:
  // Qwen3-MoE buffers (cuda_ops_moe.cpp; none for a dense model). Scratch [rows = N k] shared by
  // the layers; the routing of each sparse layer kept from its forward for its backward (a set
  // per pipeline slot: moe_slots_).
  struct MoeLayer {
    int *pos = nullptr, *pair = nullptr;  // [N k] pair -> expert-ordered row, and back
    int* offsets = nullptr;               // [E + 1] device: the layer's expert row offsets
    // The experts' activations in expert order (shared by the layers with moe_recompute_):
    bf16 *gu = nullptr, *h = nullptr, *out = nullptr;  // [rows, 2Im], [rows, Im], [rows, H]
  };
  // The block's buffers from `arena` (or their bytes counted); the backward's only when training.
  void moe_allocate(ArenaCarver& arena);
  std::unique_ptr<DeviceArena> moe_arena_;  // forward-only MoE: the block's buffers
  std::vector<std::vector<MoeLayer>> moe_layers_;  // [L][slots] (none for dense layers and
                                                   // other pipeline stages' layers)
  int moe_slot_ = 0;                      // moe_select's slot
  std::vector<int> moe_slots_;            // [L] the constructor's moe_slots (empty: 1 each)
  // Layer l's buffers of the selected slot (checked).
  MoeLayer& moe_layer(int l);
  // The experts stored here (groups of them: all E at ep 1, this rank's at ep > 1) of layer l
  // over `rows` input rows x [rows, H] in expert order (offsets [groups + 1] device): gu, h
  // (layer l's, kept) and out [rows, H] = down(swiglu(gate_up(x))), with LoRA's adapters on the
  // experts when bound (lora_cuda.h). gate_up, down: those experts' weights.
  void experts_forward(int l, bf16* out, const bf16* x, const int* offsets, int groups, int rows,
                       const bf16* gate_up, const bf16* down);
  // Their backward from dout [rows, H]: dx [rows, H] (may alias dout: written once d h is made),
  // the weight gradients (+= when acc; null: frozen) and the adapters'. x as in the forward.
  void experts_backward(int l, bf16* dx, float* g_gate_up, float* g_down, const bf16* dout,
                        const bf16* x, const int* offsets, int groups, int rows,
                        const bf16* gate_up, const bf16* down, bool acc);
  // experts_backward in two parts: all but gate_up's weight gradient, then that gradient (from
  // the first part's d gate_up, kept until the next experts_backward_inputs), which the ep path
  // runs while d x travels home.
  void experts_backward_inputs(int l, bf16* dx, float* g_down, const bf16* dout, const bf16* x,
                               const int* offsets, int groups, int rows, const bf16* gate_up,
                               const bf16* down, bool acc);
  void experts_gate_up_weight_grad(float* g_gate_up, const bf16* x, const int* offsets,
                                   int groups, int rows, bool acc);
  int* moe_counts_ = nullptr;             // [E] device: the layer being routed, pairs routed
  int* moe_kept_ = nullptr;               // [E] device: of those, kept by the capacity
  int moe_capacity_ = 0;                  // pairs an expert keeps (kMoeDropless: all)
  void* moe_route_ws_ = nullptr;
  bf16* moe_logits_ = nullptr;            // [N, E] router logits, then their gradient
  float* router_bias_ = nullptr;          // [sparse layers, E] device: set_router_bias's
  bool router_bias_on_ = false;           // set_router_bias gave one
  std::vector<float> router_bias_host_;   // its source, alive while the copy may run
  bf16* moe_x_ = nullptr;                 // [rows, H] the layer's input rows in expert order
  bf16* moe_dout_ = nullptr;              // [rows, H] d out, then d x_perm
  bf16 *moe_dh_ = nullptr, *moe_dgu_ = nullptr;  // [rows, Im], [rows, 2Im]
  bf16* moe_dx_gate_ = nullptr;           // [N, H] the router's input gradient
  float* moe_dw_ = nullptr;               // [N k] d routing weights
  MoeBalance moe_own_;                    // the ops' own statistics: sums [2, E] device
  MoeBalance* moe_balance_ = nullptr;     // the current micro-batch's (moe_select; &moe_own_)
  float aux_scale_ = 0;
  double* moe_load_ = nullptr;            // [sparse layers, E] device: moe_load()'s sums
  mutable std::vector<double> load_;      // moe_load()'s host copy
  double* moe_dropped_ = nullptr;         // [sparse layers] device: moe_dropped()'s sums
  mutable std::vector<double> dropped_;   // moe_dropped()'s host copy
  bool moe_recompute_ = false;
  int moe_last_ = -1;                     // the layer of the last moe() (moe_recompute_)

  // Expert parallelism (cuda_ops_moe_ep.cpp; ep_ null without). P = ep size, El = E / P experts
  // stored here; "send order": this rank's N k rows by global expert (rank p's experts a block);
  // "received order": by source rank, then local expert; "expert order": by local expert, then
  // source rank (ops/cuda/moe_ep.cuh). Per sparse layer and pipeline slot, from its forward:
  struct MoeEp {
    std::vector<std::size_t> send, send_at, recv, recv_at;  // [P] rows to / from each ep rank
    int received = 0;                 // rows received (sum of recv) <= moe_ep_rows_
    int* offsets = nullptr;           // [El + 1] device: local expert e's rows in expert order
    int *to_expert = nullptr, *from_expert = nullptr;  // [moe_ep_rows_] device: the two orders
    bf16* x = nullptr;                // [moe_ep_rows_, H] received rows in expert order (kept;
                                      // shared by the layers with moe_recompute_)
    bool counted = false;             // a forward of the slot's micro-batch made the counts
  };
  NcclComm* ep_ = nullptr;
  std::vector<std::vector<MoeEp>> moe_ep_;  // [L][slots] as moe_layers_ (none for dense layers)
  int moe_ep_rows_ = 0;               // the most rows a rank receives: P N min(k, El), or E C
                                      // with a capacity C when less
  int* moe_ep_counts_ = nullptr;      // [P, E] device: the group's kept routing counts
  PinnedBuffer moe_ep_host_;          // [P, E] int32: their host copy
  int* moe_ep_segments_ = nullptr;    // [2 E] moe_ep_recv_order's scratch
  bf16 *moe_ep_a_ = nullptr, *moe_ep_b_ = nullptr;  // [moe_ep_rows_, H] scratch
  // Layer l's exchange state of the selected slot (checked).
  MoeEp& moe_ep_layer(int l);
  Event ep_ready_, ep_done_;
  void moe_ep_allocate(DeviceArena& arena);
  // Layer l's counts: the group's all-gather, copied to the host (the one synchronisation), the
  // send and receive counts and the device maps of moe_ep_[l].
  void moe_ep_counts(int l);
  // send -> recv over the ep group, [rows, H] bf16: to the experts (send order -> received
  // order) or back (received -> send order), on the ep stream after the micro-batch's stream's
  // work so far; the micro-batch's stream does not wait for it until moe_ep_join.
  void moe_ep_exchange(const bf16* send, bf16* recv, const MoeEp& e, bool to_experts);
  void moe_ep_join();  // the micro-batch's stream waits for the last exchange
  // The experts of moe_x_'s rows (send order) on their ranks: layer l's out (send order).
  // fresh: a micro-batch's forward, which makes the slot's counts; else its recomputed forward
  // (train.recompute), which reuses them: the slot holds that micro-batch from its forward to
  // its backward, whatever other slots run between.
  void moe_ep_forward(int l, const bf16* gate_up, const bf16* down, bool fresh);
  // Their backward from moe_dout_ (d out, send order): d x_perm into moe_x_ (send order; still
  // arriving on the ep stream on return: the micro-batch's stream reads it after moe_ep_join),
  // this rank's experts' weight gradients (+= when acc).
  void moe_ep_backward(int l, float* g_gate_up, float* g_down, const bf16* gate_up,
                       const bf16* down, bool acc);

  ModelConfig cfg_;
  int B_, T_, N_;
  bool forward_only_ = false;
  int rope_len_;                       // positions in the tables
  int rope_first_ = 0;                 // the position of row t is rope_first_ + t (pos_ null)
  cudaStream_t s_ = nullptr;
  const std::int32_t* pos_ = nullptr;  // device [B, T] positions of this micro-batch, or null
  LoraCuda* lora_ = nullptr;
  float *cos_, *sin_;                  // [rope_len (T), hd/2] fp32 tables
  // Training only (null, 0 when ForwardOnly):
  int chunk_ = 0;                      // lm-head rows per chunk
  bf16* logits_ = nullptr;             // [chunk, V]
  float *losses_ = nullptr, *chunk_lse_ = nullptr;  // [chunk]
  double* loss_sum_ = nullptr;         // device scalar
  void* ws_ = nullptr;                 // norm / embedding backward workspace
  std::size_t ws_bytes_ = 0;
  // Tensor parallelism (null, unused without):
  NcclComm* tp_ = nullptr;
  int vocab_begin_ = 0;                // this rank's first row of the vocabulary
  float *vp_part_ = nullptr, *vp_parts_ = nullptr;  // [2, chunk], [tp, 2, chunk]
  std::int32_t* vp_targets_ = nullptr;               // [chunk] this rank's columns
  Event tp_ready_, tp_done_, dx_done_;
  const bf16* dx_pending_ = nullptr;  // the input gradient whose GEMM dx_done_ follows
  bool sp_ = false;                   // sequence parallelism
  bf16 *rows_full_ = nullptr, *xf_full_ = nullptr;  // sp: [N, H] gathered rows (embedding, head)
  // Runs `issue` (calls on the tp communicator, enqueued on its stream) after `after` (an event
  // recorded on the micro-batch's stream) or, null, after everything enqueued so far; the
  // micro-batch's later work waits for it.
  template <class Issue>
  void tp_run(Issue issue, cudaEvent_t after = nullptr);
  void tp_all_reduce(void* buf, std::size_t n, DType t, cudaEvent_t after = nullptr);
  // Sequence parallelism: full [rows, cols] = the tp ranks' x [rows / tp, cols] in rank order;
  // local [rows / tp, cols] = this rank's rows of the sum over tp of y [rows, cols].
  void gather_rows(bf16* full, const bf16* x, int rows, int cols);
  void scatter_rows(bf16* local, const bf16* y, int rows, int cols, cudaEvent_t after = nullptr);
  // The event after dx's GEMM when the last linear_backward made dx (and forgets it), else null.
  cudaEvent_t take_dx_event(const bf16* dx);

  // The overlap of tp collectives with GEMMs (cuda_ops_tp.cpp).
  struct Ahead {                 // tp_block_output_ahead: the next linear into y reduces it
    bf16* local = nullptr;       // sp: [rows / tp, cols] this rank's rows of the sum
    bf16* y = nullptr;           // [rows, cols] partial over tp
  };
  bool overlap_ = false;          // mesh.tp_overlap
  Ahead ahead_;
  bf16* reduced_ = nullptr;      // the linear reduced this y: tp_block_output only returns
  const bf16* gathered_ = nullptr;  // sp: [N, cols] whose other ranks' rows are still landing
  std::vector<std::unique_ptr<Event>> landed_;  // [tp] rows of rank (r - i) mod tp landed
  bf16* parts_ = nullptr;        // sp with overlap_: [tp - 1, N / tp, H] the other ranks' partial
                                 // rows of mine
  // sp: full [rows, cols] = the ranks' x [rows / tp, cols]: this rank's copied, the others' sent
  // and received pairwise, marking landed_; the next GEMM reads full (gathered_).
  void start_gather(bf16* full, const bf16* x, int rows, int cols);
  // Runs gemm(first row, rows) over the blocks of gathered_ rows as they land (this rank's
  // first); the stream has waited for every block when it returns.
  template <class Gemm>
  void over_landed_rows(Gemm gemm);
  // linear over a gathered x, and linear_backward's dx (if not null) over a gathered dy
  // (gathered_), block by block.
  void linear_gathered(bf16* y, const bf16* x, const bf16* w, int N, int in, int out);
  void input_grad_gathered(bf16* dx, const bf16* dy, const bf16* w, int N, int in, int out);
  // The stream waits until every block of x has landed when x is the gathered_ buffer (the MoE
  // backward reads its gathered output gradient whole); nothing otherwise.
  void wait_gathered(const bf16* x);
  // dw (+)= dy^T x now, or queued when deferring (defer_weight_grads).
  void weight_grad(float* dw, const bf16* dy, const bf16* x, int N, int in, int out, bool acc);
  DeferredGrads* defer_ = nullptr;
  // y = x w^T summed over tp (in place, or sp: into ahead_.local) in row pieces.
  void linear_reduced(bf16* y, const bf16* x, const bf16* w, int N, int in, int out);
};

}  // namespace qt::cuda
