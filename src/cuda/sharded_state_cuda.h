// The CUDA side of the optimizer driver (the CPU's is optim/sharded_state.h): the trained
// parameters' state over the units of a ShardPlan at every ZeRO stage, optionally offloaded.
//
//              bf16 weights          fp32 gradients                      master, AdamW m, v
//   ZeRO-0     every unit, whole     whole; all-reduced on the step's    whole
//                                    last micro-batch
//   ZeRO-1     every unit, whole     whole; reduce-scattered (in place)  own shard
//                                    on the step's last micro-batch
//   ZeRO-2     every unit, whole     own shard (each micro-batch's unit  own shard (GPU; with
//   ZeRO-3     own shard; a unit is  gradient lands in a scratch slot,   offload in host memory,
//              gathered ahead of     reduce-scattered into the shard)    AdamW on the host)
//              use (two in flight)
// At dp = 1 every stage is the same: the shard is the whole unit, gradients accumulate in place,
// nothing is gathered or reduced.
//
// Streams: the model enqueues on the compute stream; gathers and reductions run on the NCCL
// stream, ordered by events (a slot is reused only after the last work that read it). Each
// unit's sum of squares for the gradient norm is taken on the NCCL stream right after its last
// reduction of the step. The step computes the global norm (each element once, by the rank whose
// shard holds it), clips, runs AdamW on the elements this rank updates (the fused GPU kernel, or
// adamw_update on host threads with offload: the same element math) and, at ZeRO-1 and 2,
// all-gathers each unit's updated bf16 shard right after its update.
//
// Expert parallelism (mesh.ep > 1): the plan's expert units (ParamUnit::group kEdp) are sharded,
// reduced and gathered over the expert-data-parallel group (Mesh::edp(), its own communicator and
// stream, possibly of one rank), every other unit over dp; the norm still sums over dp (each
// expert element has one owner in its edp group, and the ep ranks hold different experts). At
// ZeRO-3 the gather ring follows the forward's order of the units (parallel/unit_order.h: a
// layer's experts right after it), with one slot more for the experts' unit.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cuda/device.h"
#include "cuda/nccl_comm.h"
#include "cuda/qwen3_cuda.h"
#include "ops/cuda/adamw.cuh"
#include "optim/adamw_math.h"
#include "optim/optimizer.h"
#include "qtrain/checkpoint.h"
#include "qtrain/comm.h"
#include "qtrain/deck.h"
#include "qtrain/shard_plan.h"
#include "runtime/memory.h"

namespace qt::cuda {

// An untied embedding's gradient as rows (take_embedding_rows): at ZeRO-2/3 with dp > 1 each
// rank all-gathers the micro-batch's ids and d x rows (dp x tokens x hidden bf16) and adds the
// rows of its own shard, instead of reduce-scattering the whole fp32 table (vocabulary x hidden)
// that is zero but for those rows; taken when the gathered rows are fewer than the table's.
// tokens = 0: never (a tied embedding also takes the lm head's dense gradient).
struct EmbeddingRows {
  int tokens = 0;  // per micro-batch (B x T)
  int hidden = 0;
  std::int64_t vocab_begin = 0;  // the table's first row here (tensor parallelism: tp rank x V)
};

// Tensor parallelism's part in the step (plan.tp > 1; the plan and layout are then the tp rank's
// local ones): gradients partial over tp (ShardSpec::partial_over: q_norm, k_norm) are summed on
// `device` once final, those of kv heads shared by tp ranks (ShardSpec::tp_replicas > 1) over
// the ranks sharing them; the gradient norm counts tensors replicated over tp on tp rank 0 only,
// shared kv heads on the first rank of their group, and is summed over `host`. Both null without
// tensor parallelism.
struct TpComms {
  Comm* host = nullptr;
  NcclComm* device = nullptr;
};

// A pipeline stage's part (mesh.pp > 1; at dp > 1 with ZeRO-0 or 1, whose reductions over dp
// all run in step()): the units it holds (the others get no buffers and no elements), a held
// unit the gradient norm leaves out (the last stage's copy of a tied embedding: the first
// stage's counts), and the pp group the norm is summed over.
struct PipelineHold {
  std::vector<int> held;  // ascending; empty: every unit (no pipeline)
  int uncounted = -1;
  Comm* pp = nullptr;
};

class ShardedCudaState final : public UnitSource {
 public:
  // Collective over dp when nccl is given (dp > 1). Offload (cfg.offload = cpu) needs ZeRO-2 or
  // 3; cfg.grad_reduce = bf16 reduces ZeRO-0/1 gradients in bf16. host_threads: the threads of
  // offload's AdamW (the cores this rank may use). edp: the expert-data-parallel group's
  // communicator, needed when the plan has expert units (at dp > 1), else null.
  ShardedCudaState(const ShardPlan& plan, const ParamLayout& layout, const OptimConfig& cfg,
                   MpiComm& dp, NcclComm* nccl, DeviceArena& arena, unsigned host_threads = 1,
                   EmbeddingRows rows = {}, TpComms tp = {}, PipelineHold pipe = {},
                   NcclComm* edp = nullptr);

  // UnitSource.
  const bf16* weights(int unit, cudaStream_t s) override;
  float* grads(int unit, cudaStream_t s) override;
  void release(int unit, cudaStream_t s) override;
  void grads_done(int unit, cudaStream_t s) override;
  bool take_embedding_rows(const bf16* dx, const std::int32_t* ids, int N,
                           cudaStream_t s) override;

  // A step's gradients start here (before its first micro-batch): no unit is reduced yet.
  void begin_step();
  // Zeroes every gradient buffer (for writers that only add, as LoRA's adapters; the model
  // itself overwrites on the first micro-batch, GradWrite::kOverwrite).
  void clear_grads(cudaStream_t s);
  // Before each micro-batch's forward_backward; returns how the model writes gradients: into
  // fresh scratch (ZeRO-2/3 at dp > 1: always kOverwrite), or into the whole buffer (kOverwrite
  // first, then kAccumulate). last_of_step: no micro-batch follows before step(), so each unit is
  // reduced (ZeRO-0/1) and its sum of squares taken as soon as its gradients are final; a unit
  // not reduced then (a writer that reports no units, as LoRA) is reduced in step().
  Qwen3Cuda::GradWrite begin_micro_batch(bool first_of_step, bool last_of_step);
  // Reduces, clips and applies the step's gradients, or with a non-finite loss or gradient norm
  // applies nothing (OptimStepStats::skipped).
  OptimStepStats step(const StepRequest& request, std::int64_t total_steps, cudaStream_t s);

  // Whole-buffer stages (ZeRO-0/1) keep each unit's weights and gradients in place: these point
  // at unit 0's (for a single-unit plan, e.g. LoRA's adapters bound to them).
  bf16* unit_weights(int u) { return units_[u].weights; }
  float* unit_grads(int u) { return units_[u].grad; }

  // Host copies of the elements this rank updates (master weights and moments). Fill
  // param_pieces() then push(); pull() before reading. With offload they are the live state.
  std::vector<FlatPiece> param_pieces();
  std::vector<StatePiece> checkpoint_pieces();  // each element once over dp (and pp)
  StateTargets checkpoint_targets();
  void push(cudaStream_t s);
  void pull(cudaStream_t s);

  std::string describe() const;
  // Its device buffers by kind (activations and workspace left at 0).
  const MemorySplit& bytes() const { return bytes_; }

 private:
  struct Unit {
    bool held = true;          // false: another pipeline stage's (no buffers, empty ranges)
    Range own;                 // the elements this rank updates: the whole unit at ZeRO-0,
                               // else its shard
    Range shard;               // its shard (the norm's part: each element once over dp)
    bf16* weights = nullptr;   // ZeRO-3 (dp > 1): [chunk] own shard; else [padded] whole
    float* master = nullptr;   // [own size at ZeRO-0, chunk above] (null with offload)
    float *m = nullptr, *v = nullptr;  // [own size] (null with offload)
    float* grad = nullptr;     // whole_grads(): [padded] whole; else [chunk] the reduced shard
    std::vector<float> host_master, host_m, host_v;  // [own size]
  };
  // A device buffer holding whole units in turn (gathered weights, or gradient scratch).
  struct Slot {
    void* data = nullptr;
    float* reduced = nullptr;  // gradient slots: [max chunk] reduce-scatter output
    int unit = -1;             // the unit it holds now, or -1
    std::uint64_t freed = 0;   // when it was last given up (a count of releases): 0 = never
    Event ready, free;         // gather landed (NCCL stream); last reader done
  };

  // Unit u's group (dp, or edp for an expert unit): its communicator, this rank's place in it,
  // and the norm's workspace and the bf16 reduction stage of that communicator's stream.
  bool expert(int u) const { return plan_.units[u].group == MeshDim::kEdp; }
  NcclComm& comm(int u) const { return expert(u) ? *edp_ : *nccl_; }
  int group_rank(int u) const { return expert(u) ? edp_->rank() : rank_; }
  void* comm_norm_ws(int u) const { return expert(u) ? edp_norm_ws_ : scatter_norm_ws_; }
  bf16* comm_stage(int u) const { return expert(u) ? edp_stage_ : reduce_stage_; }
  void synchronize_comms();  // every reduction and gather of both groups has landed
  bool gathers() const { return zero_ == 3 && nccl_ != nullptr; }
  bool scatters() const { return nccl_ != nullptr; }
  // Gradients kept whole and written by the model in place (ZeRO-0/1, or dp 1).
  bool whole_grads() const { return zero_ <= 1 || nccl_ == nullptr; }
  // Each unit's updated bf16 shard is all-gathered after the update (ZeRO-1/2 at dp > 1).
  bool shares_updates() const { return (zero_ == 1 || zero_ == 2) && nccl_ != nullptr; }
  float* own_grads(int u);               // the reduced gradients of units_[u].own
  const float* shard_grads(int u) const;  // ... of units_[u].shard
  // Unit u's shard gradients are final (on stream s): its tensors partial over tp summed over tp,
  // then the sums of squares of its counted ranges into unit_sumsq_, with the workspace of
  // that stream.
  void take_sum_of_squares(int u, cudaStream_t s, void* ws);
  // The ranges of the layout's tensors with `pick(spec)` inside `within`, relative to its begin,
  // adjacent ones merged.
  template <class Pick>
  std::vector<Range> tensor_ranges(Range within, Pick pick) const;
  // ZeRO-0/1: unit u's whole gradients summed over dp (all-reduce, or reduce-scatter in place)
  // on the NCCL stream after the work enqueued on s, then its sum of squares.
  void reduce_whole(int u, cudaStream_t s);
  // The ring slot given up longest ago among those that hold no unit, or null: its last reader
  // (or reduction) has had the most time to finish, so waiting for it costs least.
  static Slot* free_slot(std::vector<std::unique_ptr<Slot>>& ring);
  void give_up(Slot& slot);  // marks it free, now
  void gather(int unit, Slot& slot);
  void prefetch_after(int unit);
  // ZeRO-3: gathers unit u (updated on stream s) for the next step's forward, or nothing when
  // it is held or no slot is free.
  void prefetch_for_next_step(int unit, cudaStream_t s);
  void drop_prefetched();  // gathered weights are stale (push() rewrote the shards)
  void share_update(int u, cudaStream_t s);  // shares_updates(): unit u's bf16 shard to all
  bf16* updated_weights(int u);  // where AdamW writes the own elements' bf16 copy
  // Offload: AdamW of unit u's own shard on host threads from `grads` [own size] (host), the
  // updated weights rounded to bf16 into `out` [own size] (host).
  void host_adamw(int u, const AdamWStep& s, const float* grads, bf16* out);
  void offload_step(const AdamWStep& s);

  ShardPlan plan_;
  const ParamLayout& layout_;
  OptimConfig cfg_;
  bool offload_;
  int zero_, rank_;
  MpiComm& dp_;
  NcclComm* nccl_;
  NcclComm* edp_ = nullptr;          // expert units' group (null without expert units)
  void* edp_norm_ws_ = nullptr;      // grad_norm_squared's workspace on edp's stream
  bf16* edp_stage_ = nullptr;        // reduce_stage_'s twin on edp's stream
  std::vector<Unit> units_;
  std::vector<Slot*> weight_at_, grad_at_;     // [units]: the slot holding it, or null
  std::vector<std::unique_ptr<Slot>> weight_ring_, grad_ring_;
  Slot embed_weights_, embed_grads_;         // the embedding's own slots (a tied embedding
                                             // stays in use from the forward to the end)
  std::uint64_t releases_ = 0;                // the clock of Slot::freed
  int direction_ = +1;                        // forward (+1) or backward (-1): prefetch order
  std::vector<int> order_, order_at_;         // forward_unit_order and each unit's place in it
  bool last_of_step_ = false;
  // Per unit, this step: its gradients hold their dp reduction (ZeRO-2/3: the first
  // reduce-scatter writes the shard, later ones add to it; nothing zeroes it), and its sum of
  // squares is in unit_sumsq_ (taken after its last reduction).
  std::vector<char> reduced_, summed_;
  double* unit_sumsq_ = nullptr;     // [sum of counted_ sizes] device, unit by unit
  // Per unit: the parts of its shard the norm counts (all of it but, on tp ranks other than 0,
  // the tensors replicated over tp), their first entry in unit_sumsq_, and the parts of its own
  // range partial over tp. Ranges relative to the shard's and own's begin.
  std::vector<std::vector<Range>> counted_, partial_;
  // Per unit: the parts of its own range holding kv heads shared by kv_replicas_ tp ranks (fewer
  // kv heads than tp ranks), summed over those ranks only (sum_shared_kv_rows).
  std::vector<std::vector<Range>> shared_;
  int kv_replicas_ = 1;
  float* shared_gathered_ = nullptr;  // [tp, the largest unit's shared rows]
  void sum_shared_kv_rows(int u, cudaStream_t s);
  std::vector<std::size_t> sumsq_at_;
  TpComms tp_;
  Event tp_ready_, tp_done_;
  Comm* pp_ = nullptr;  // the norm's sum over pipeline stages, or null
  int uncounted_ = -1;  // PipelineHold::uncounted (not in the norm, not written to checkpoints)
  void* scatter_norm_ws_ = nullptr;  // grad_norm_squared's workspace on the NCCL stream
  bf16* reduce_stage_ = nullptr;     // ZeRO-0/1 with grad_reduce = bf16: [max padded]
  Event compute_done_;
  // Embedding rows (EmbeddingRows): on when rows_.tokens > 0; the gathered ids [dp x tokens],
  // rows [dp x tokens, hidden] and the sort's workspace.
  EmbeddingRows rows_;
  std::int32_t* rows_ids_ = nullptr;
  bf16* rows_dx_ = nullptr;
  void* rows_ws_ = nullptr;
  std::size_t rows_ws_bytes_ = 0;
  Event rows_gathered_;
  AdamWSegment* segments_ = nullptr;
  int num_segments_ = 0;
  void* norm_ws_ = nullptr;
  // Offload: double-buffered pinned staging, [max chunk] fp32 gradients in and bf16 weights out,
  // on copy streams of their own, so that unit u's host AdamW overlaps the copies of its
  // neighbours; the copy events say when a buffer may be read or written again.
  PinnedBuffer stage_grads_[2], stage_weights_[2];
  Stream to_host_, to_device_;
  Event grads_landed_[2], weights_sent_[2];
  unsigned host_threads_ = 1;
  MemorySplit bytes_;
};

}  // namespace qt::cuda
