// The memory of one rank of the CUDA back end, predicted from the model, the micro-batch and the
// parallel settings before anything is allocated (`qtrain plan`, docs/plan.md).
//
// Every setting mirrors, buffer by buffer, what the CUDA back end allocates from its DeviceArena,
// each block rounded up to the arena's 256 bytes: the prediction is the arena's used bytes after
// set-up, which is also its peak (nothing in the step loop allocates): src/cuda/backend_cuda.cpp
// and sharded_state_cuda.cpp over the units of plan_qwen3 (include/qtrain/shard_plan.h) at every
// ZeRO stage, with or without offload, and Qwen3Cuda's buffers (qwen3_cuda.cpp). Each term names
// the allocation it mirrors in memory_plan.cpp.
//
// Parallelism enters through MeshShape. dp: ZeRO shards of each unit. tp: the rank's model is
// tp_local_config (heads, kv heads, MLP width and vocabulary divided by tp; norms whole), so its
// units and activations are that model's, except that with sequence parallelism the residual
// stream and the norms' [N, H] buffers hold N / tp rows. pp: stage s holds the units of its
// layers (the first the embedding, the last the final norm and lm head; a tied embedding's copy
// too) and the activations of as many micro-batches as its schedule keeps in flight. The CUDA
// back end runs dp only today: the tp and pp terms predict what it will allocate by the same
// rules (MemoryPlan::built is false for them). ep (Qwen3-MoE): the rank's model is
// ep_local_config's, its units plan_qwen3's (each sparse layer's E / ep experts a unit of their
// own over edp = dp / ep), and its activations add the router's buffers and
// CudaOps::moe_allocate's (memory_plan.cpp, moe_block_bytes: at pp > 1 a set of the routing and
// expert activations per micro-batch in flight, and the pipeline's per-slot load statistics).
// Qwen3-MoE pipelines run at ep = 1 (validate).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "qtrain/mesh.h"
#include "qtrain/model_config.h"

namespace qt::plan {

// optim.offload: where the rank's master weights and AdamW moments live.
enum class Offload { kNone, kCpu };
const char* offload_name(Offload o);  // "none" | "cpu", as in the deck

struct MemoryPlanInput {
  ModelConfig model;
  int micro_batch = 1;               // B: sequences per micro-batch (train.micro_batch)
  int seq_len = 1;                   // T: tokens per sequence (train.seq_len)
  bool recompute = false;            // train.recompute
  // mesh.dp, tp, pp, pp_schedule, pp_chunks, pp_layers; ep (Qwen3-MoE only: dividing dp and
  // model.num_experts, with pp = 1).
  MeshShape mesh;
  // mesh.sequence_parallel: the residual stream and norms split over tp by rows (tp > 1 only).
  bool sequence_parallel = false;
  // M, the micro-batches of a step on a dp rank (train.global_batch / (micro_batch x dp)): how
  // many a pipeline stage may hold at once. Not used at pp = 1.
  int micro_batches = 1;
  int zero_stage = 0;                // optim.zero_stage, 0-3
  Offload offload = Offload::kNone;  // kCpu needs zero_stage 2 or 3 (as the deck does on cuda)
  // optim.grad_reduce = bf16: a bf16 copy of the gradients on the wire; ZeRO 0 and 1 only (the
  // reduce-scatters of ZeRO 2 and 3 are fp32, and the deck refuses bf16 there).
  bool grad_reduce_bf16 = false;
};

// Bytes of one rank: dp rank 0 (the largest shard) of one pipeline stage (memory_plan: the stage
// needing the most GPU memory). GPU terms are sums of arena blocks, each rounded up to 256 bytes
// as DeviceArena::allocate does.
struct MemoryPlan {
  std::uint64_t params = 0;       // bf16 compute weights (ZeRO-3: shard + gather slots)
  std::uint64_t grads = 0;        // fp32 gradients (ZeRO-2/3: shard + scratch slots), bf16 wire
  std::uint64_t optimizer = 0;    // fp32 master weights, AdamW moments, AdamW segment table
  std::uint64_t activations = 0;  // Qwen3Cuda's buffers and the micro-batch's tokens
  std::uint64_t workspace = 0;    // cuBLASLt, op and grad-norm workspaces
  std::uint64_t host = 0;         // pageable host bytes of the trained state (copies for init and
                                  // checkpoints; with offload the live master weights and moments)
  std::uint64_t host_pinned = 0;  // page-locked host bytes: offload's staging
  bool built = true;              // what the CUDA back end allocates today; false: a prediction
                                  // of a path not built on it yet (pp > 1 at dp > 1 with
                                  // ZeRO-2 or 3)
  int stage = 0;                  // the pipeline stage described
  int slots = 1;                  // micro-batches whose activations it holds at once (the most
                                  // of its chunks')
  std::uint64_t nccl = 0;         // NCCL's communicators, outside the arena (nccl_bytes)
  // The arena (what the back end allocates), and with NCCL's communicators the rank's GPU memory
  // besides the margin (kGpuMarginBytes).
  std::uint64_t gpu() const { return params + grads + optimizer + activations + workspace; }
  std::uint64_t device() const { return gpu() + nccl; }
};

// Throws UserError, naming the deck key, for what cannot be planned: ep > 1 on a dense model, a
// Qwen3-MoE model at ep > 1 with pp > 1 or an ep not dividing dp or its experts, a tp that does not
// divide the heads, kv heads, MLP width or vocabulary, more pipeline chunks than layers, a
// pipeline schedule its settings refuse (as the deck does), a stage outside 0-3, offload below
// ZeRO-2, a bf16 gradient wire above ZeRO-1, sizes below 1, or a total beyond 2^63 bytes.
MemoryPlan memory_plan(const MemoryPlanInput& in);
// Pipeline stage s of mesh.pp (memory_plan is the largest of them).
MemoryPlan memory_plan_stage(const MemoryPlanInput& in, int s);

// What pipeline stage s of the input's mesh runs and holds (the whole model at pp = 1).
struct StageParts {
  bool embedding = false;  // the embedding's lookup (the first stage)
  bool head = false;       // the final norm, lm head and loss (the last stage)
  bool tied_copy = false;  // the last stage's copy of a tied embedding (its lm head)
  struct Chunk {
    int first = 0, last = 0;  // decoder layers [first, last)
    int slots = 1;            // micro-batches in flight between forward and end of backward
  };
  std::vector<Chunk> chunks;  // chunk v P + s for v < mesh.pp_chunks
  int layers() const;
  int max_slots() const;
};
// Every stage's, [mesh.pp]; validates as memory_plan does.
std::vector<StageParts> pipeline_stages(const MemoryPlanInput& in);
StageParts stage_parts(const MemoryPlanInput& in, int s);

// A ZeRO stage and offload setting the CUDA back end can run, with its plan.
struct Setting {
  int zero_stage = 0;
  Offload offload = Offload::kNone;
  MemoryPlan plan;
};

// Every setting the CUDA back end runs, in the order they are preferred when several fit: no
// offload before offload (it moves gradients and weights over PCIe and runs AdamW on the host
// each step), then the lower ZeRO stage (less communication). Offload needs ZeRO-2 or 3, and
// ZeRO-2 and 3 reduce gradients in fp32 (in.grad_reduce_bf16 applies to stages 0 and 1 only).
std::vector<Setting> settings_by_preference(const MemoryPlanInput& in);

// The first setting of settings_by_preference whose arena (gpu()) is at most `usable` (a back
// end's arena, NCCL's memory already outside it), or none.
std::optional<Setting> cheapest_fitting(const MemoryPlanInput& in, std::uint64_t usable);

// The units of plan_qwen3 (ZeRO-2/3 shards, reduces and gathers them one at a time), in
// flat-layout order: the embedding, each decoder layer (all alike), the final norm with the lm
// head when it is untied (tied: the lm head is the embedding). Elements.
struct ParamUnits {
  std::uint64_t embed = 0;   // V x H
  std::uint64_t layer = 0;   // one decoder layer
  std::uint64_t last = 0;    // H (+ V x H untied)
  std::uint64_t layers = 0;  // L
  std::uint64_t total() const { return embed + layers * layer + last; }
  std::uint64_t largest() const;
  // The largest unit but the embedding: the size of ZeRO-2/3's shared gather and gradient slots
  // (the embedding has slots of its own).
  std::uint64_t largest_after_embed() const;
  // Elements of dp rank 0's shard: the sum of every unit's chunk.
  std::uint64_t shard(int dp) const;
  // ParamUnit::chunk: a unit's shard, ceil(unit / dp) and at least 1; rank 0 owns that many.
  static std::uint64_t chunk(std::uint64_t unit, int dp);
  // ParamUnit::padded: chunk x dp (a gathered unit or its gradient scratch).
  static std::uint64_t padded(std::uint64_t unit, int dp);
};
ParamUnits param_units(const ModelConfig& m);

// GPU memory outside the arena: the back end leaves 3 GiB of the free memory to NCCL, cuBLASLt
// and the CUDA runtime (training_arena_bytes), and the CUDA context and the driver hold about
// 1.5 GiB of a card before the run starts (an "80 GB" H100 shows 78.7 GiB free: a 75.7 GiB arena,
// docs/performance.md). A setting fits when device() (the arena and NCCL's communicators) <=
// card - kGpuMarginBytes.
inline constexpr std::uint64_t kGpuMarginBytes = (std::uint64_t{9} << 30) / 2;  // 4.5 GiB

// NCCL's device memory: the communicators a CUDA training rank connects before sizing its arena
// (dist/device_communicators.h, cuda::connect_before_arena), about 1 GiB each (measured on
// 2 x H200, NCCL 2.28, 2026-11-27: one of 2 ranks 864 MiB; two 2.13 GiB; four 3.83 GiB; the
// back end logs its own).
inline constexpr std::uint64_t kNcclCommunicatorBytes = std::uint64_t{1} << 30;
int device_communicator_count(const MeshShape& mesh, bool moe);
inline std::uint64_t nccl_bytes(const MeshShape& mesh, bool moe) {
  return kNcclCommunicatorBytes *
         static_cast<std::uint64_t>(device_communicator_count(mesh, moe));
}

}  // namespace qt::plan
