// Every way to lay a training run out on N GPUs (`qtrain plan`, docs/plan.md): each
// (dp, tp, pp) mesh with dp x tp x pp = N that the model and the machine allow (for Qwen3-MoE
// with each expert-parallel size ep that divides dp and the experts; ep 1 at pp > 1), and on each
// every ZeRO stage, offload and recompute setting the CUDA back end runs (at dp 1, where every
// stage is the same run, ZeRO-0 and ZeRO-2 with offload only); for each its memory
// (memory_plan.h), whether it fits, and its predicted step time (step_time.h). The recommended
// layout is the fastest that fits, ties going to the simpler one.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "plan/memory_plan.h"
#include "plan/step_time.h"
#include "qtrain/deck.h"

namespace qt::plan {

struct LayoutSearch {
  ModelConfig model;
  int micro_batch = 1;     // train.micro_batch
  int seq_len = 1;         // train.seq_len
  int global_batch = 1;    // train.global_batch: sequences a step over all dp ranks
  bool grad_reduce_bf16 = false;   // optim.grad_reduce = bf16 (ZeRO 0 and 1 rows)
  bool sequence_parallel = false;  // mesh.sequence_parallel (rows with tp > 1)
  std::string pp_schedule = "1f1b";  // mesh.pp_schedule of the rows with pp > 1
  int pp_chunks = 1;                 // mesh.pp_chunks of the rows with pp > 1
  int gpus = 1;                      // N: the whole job
  std::vector<int> tp, pp;           // the sizes allowed (empty: any)
  // Qwen3-MoE: the expert-parallel sizes tried on each mesh (empty: every divisor of dp; each
  // must divide dp and model.num_experts, as the deck requires). Dense models: ep 1 only.
  std::vector<int> ep;
  TopologyConfig topology;           // gpus_per_host bounds tp; the links time the collectives
  std::uint64_t usable = 0;          // GPU bytes a rank may use (memory_plan's device())
};

// A (dp, tp, pp) mesh left out, and why (naming the deck keys).
struct Excluded {
  int dp = 1, tp = 1, pp = 1;
  int ep = 1;  // Qwen3-MoE: the expert-parallel size left out (1 for a whole mesh)
  std::string why;
};

struct Layout {
  MemoryPlanInput in;  // mesh, ZeRO stage, offload, recompute, micro-batches
  MemoryPlan memory;   // of the stage needing most
  StepTime time;
  bool fits = false;
};

struct Layouts {
  std::vector<Layout> rows;        // fitting first, each group fastest first
  std::vector<Excluded> excluded;  // meshes that cannot run, with the reason
  int settings_skipped = 0;        // settings a mesh's schedule refuses (zb-h1: recompute;
                                   // ZeRO-2/3 at dp > 1)
};

// Throws UserError for a model or batch memory_plan refuses whatever the layout.
Layouts enumerate_layouts(const LayoutSearch& search);

// The fastest row that fits, or null. Rows within 1% of its step time tie; of those the simplest
// wins: no offload, then fewer pipeline stages, fewer tp ranks, fewer ep ranks, the lower ZeRO
// stage, no recompute. built_only: among the rows the CUDA back end runs today (MemoryPlan::built).
const Layout* recommended(const Layouts& layouts, bool built_only = false);

// The deck keys that select a row, "mesh.dp = 4", ... in deck order (mesh, train, optim).
std::vector<std::string> deck_keys(const Layout& row);

}  // namespace qt::plan
