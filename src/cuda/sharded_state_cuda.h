// The CUDA side of the sharded optimizer driver (the CPU's is optim/sharded_state.h): the trained
// model's state over the units of a ShardPlan at ZeRO-2 or ZeRO-3, optionally offloaded.
//
//                bf16 weights           fp32 gradients                 master, AdamW m, v
//   ZeRO-2       every unit, whole      own shard of each unit          own shard
//   ZeRO-3       own shard; a unit is    (dp > 1: each micro-batch's    (GPU; with offload in
//                gathered ahead of use   unit gradient lands in a        host memory, AdamW on
//                (two units in flight)   scratch slot, reduce-scattered  the host)
//                                        and added to the shard)
// At dp = 1 the shard is the whole unit: the gradients accumulate in place, nothing is gathered.
//
// Streams: the model enqueues on the compute stream; gathers and reduce-scatters run on the NCCL
// stream, ordered by events (a slot is reused only after the last work that read it). The step
// computes the global gradient norm (each element once, by its owner), clips, runs AdamW on each
// own shard (the fused GPU kernel, or adamw_update on host threads with offload: the same element
// math), and at ZeRO-2 all-gathers every unit's updated bf16 shard.
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

// An untied embedding's gradient as rows (take_embedding_rows): at dp > 1 each rank all-gathers
// the micro-batch's ids and d x rows (dp x tokens x hidden bf16) and adds the rows of its own
// shard, instead of reduce-scattering the whole fp32 table (vocabulary x hidden) that is zero but
// for those rows; taken when the gathered rows are fewer than the table's. tokens = 0: never (a
// tied embedding also takes the lm head's dense gradient).
struct EmbeddingRows {
  int tokens = 0;  // per micro-batch (B x T)
  int hidden = 0;
};

class ShardedCudaState final : public UnitSource {
 public:
  // Collective over dp when nccl is given (dp > 1). plan.zero_stage must be 2 or 3.
  // host_threads: the threads of offload's AdamW (the cores this rank may use).
  ShardedCudaState(const ShardPlan& plan, const ParamLayout& layout, const OptimConfig& cfg,
                   bool offload, MpiComm& dp, NcclComm* nccl, DeviceArena& arena,
                   unsigned host_threads = 1, EmbeddingRows rows = {});

  // UnitSource.
  const bf16* weights(int unit, cudaStream_t s) override;
  float* grads(int unit, cudaStream_t s) override;
  void release(int unit, cudaStream_t s) override;
  void grads_done(int unit, cudaStream_t s) override;
  bool take_embedding_rows(const bf16* dx, const std::int32_t* ids, int N,
                           cudaStream_t s) override;

  // Before each micro-batch's forward_backward; returns how the model writes gradients: into
  // fresh scratch (dp > 1: always kOverwrite), or into the shard (dp 1: kOverwrite first).
  // last_of_step: no micro-batch follows before step(), so each unit's sum of squares for the
  // gradient norm is taken on the NCCL stream as soon as its last reduction lands (a unit whose
  // sum was not taken then is summed in step()).
  Qwen3Cuda::GradWrite begin_micro_batch(bool first_of_step, bool last_of_step);
  void zero_grads(cudaStream_t s);
  OptimStepStats step(std::int64_t step, std::int64_t total_steps, cudaStream_t s);

  // Host copies: the own shard of every unit (master weights and moments). Fill param_pieces()
  // then push(); pull() before reading. With offload they are the live state.
  std::vector<FlatPiece> param_pieces();
  std::vector<StatePiece> checkpoint_pieces();
  StateTargets checkpoint_targets();
  void push(cudaStream_t s);
  void pull(cudaStream_t s);

  std::string describe() const;
  // Its device buffers by kind (activations and workspace left at 0).
  const MemorySplit& bytes() const { return bytes_; }

 private:
  struct Unit {
    Range own;                       // flat range this rank owns
    bf16* weights = nullptr;         // ZeRO-3 (dp > 1): [chunk] own shard; else [padded] whole
    float* master = nullptr;         // [chunk] (null with offload)
    float *m = nullptr, *v = nullptr;  // [own size] (null with offload)
    float* grad = nullptr;           // [chunk] reduced gradients of the own shard
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

  bool gathers() const { return zero_ == 3 && nccl_ != nullptr; }
  bool scatters() const { return nccl_ != nullptr; }
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
  bf16* updated_weights(int u);  // where AdamW writes the own shard's bf16 copy
  // Offload: AdamW of unit u's own shard on host threads from `grads` [own size] (host), the
  // updated weights rounded to bf16 into `out` [own size] (host).
  void host_adamw(int u, const AdamWStep& s, const float* grads, bf16* out);

  ShardPlan plan_;
  const ParamLayout& layout_;
  OptimConfig cfg_;
  bool offload_;
  int zero_, rank_;
  MpiComm& dp_;
  NcclComm* nccl_;
  std::vector<Unit> units_;
  std::vector<Slot*> weight_at_, grad_at_;     // [units]: the slot holding it, or null
  std::vector<std::unique_ptr<Slot>> weight_ring_, grad_ring_;
  Slot embed_weights_, embed_grads_;         // the embedding's own slots (a tied embedding
                                             // stays in use from the forward to the end)
  std::uint64_t releases_ = 0;                // the clock of Slot::freed
  int direction_ = +1;                        // forward (+1) or backward (-1): prefetch order
  bool last_of_step_ = false;
  // Per unit, this step: its gradient shard holds a reduction (dp > 1: the first reduce-scatter
  // writes the shard, later ones add to it; nothing zeroes it), and its sum of squares is in
  // unit_sumsq_ (taken after its last reduction).
  std::vector<char> reduced_, summed_;
  double* unit_sumsq_ = nullptr;  // [units] device
  void* scatter_norm_ws_ = nullptr;  // grad_norm_squared's workspace on the NCCL stream
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
