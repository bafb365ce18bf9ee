// Pipeline schedules (issue 17): what each pipeline stage runs, in order, for one optimizer step
// of M micro-batches over P stages. The trainer executes a stage's list; activations and their
// gradients travel between neighbouring stages (the executor receives an input before a forward
// or backward needs it and sends an output when it is made), so only compute actions are listed.
//
//   kForward        F(k, m): virtual stage k's forward of micro-batch m
//   kBackward       B(k, m): its whole backward (input and weight gradients)
//   kBackwardInput  I(k, m): the input-gradient half of the backward (zero-bubble schedules)
//   kBackwardWeight W(k, m): the weight-gradient half, any time after I(k, m)
//
// Virtual stages (interleaving): the model's layers are cut into P x V consecutive chunks; chunk
// k runs on stage k % P, so micro-batches pass every stage V times. Dependencies: F(k, m) after
// F(k - 1, m); B or I(k, m) after F(k, m) and after B or I(k + 1, m); W(k, m) after I(k, m).
//
// schedule() builds the lists by simulating the actions greedily, the way 1F1B does by hand:
// each stage, whenever it is free, runs the first ready action in the order B/I, F, W, with at
// most P - s micro-batches between their forward and their backward on stage s (1F1B's memory)
// and at most max_weights_waiting weight halves waiting. With whole backwards this is exactly
// 1F1B. With split ones the weight halves fill the bubble: with F = I = W = 1 the step takes
// 3M + 2(P - 1) (P - s halves waiting, about 1F1B's memory) or ZB-H1's 3M + P - 1 (P waiting),
// instead of 1F1B's 3(M + P - 1). Interleaving (V > 1) follows Megatron's fixed order instead
// (the greedy order deadlocks there under 1F1B's memory limit).
#pragma once

#include <string>
#include <vector>

#include "qtrain/mesh.h"

namespace qt {

enum class PipeOp { kForward, kBackward, kBackwardInput, kBackwardWeight };

struct PipeAction {
  PipeOp op;
  int chunk;        // virtual stage k of the action (stage k % P runs it)
  int micro_batch;  // m
  bool operator==(const PipeAction&) const = default;
};

struct PipeScheduleConfig {
  int stages = 1;            // P
  int micro_batches = 1;     // M
  int virtual_chunks = 1;    // V: chunks per stage (interleaving when > 1)
  bool split_backward = false;  // I and W instead of B (zero bubble)
  // With split backwards: how many weight halves may wait on a stage (each holds its layers'
  // inputs and output gradients); 0: P - s on stage s. P gives ZB-H1's step (3M + P - 1 unit
  // actions with F = I = W = 1).
  int max_weights_waiting = 0;
};

// [P] the actions of each stage, in execution order.
using PipeSchedule = std::vector<std::vector<PipeAction>>;

// The schedule of a mesh's pipeline (mesh.pp, pp_chunks, pp_schedule) over M micro-batches a
// step: ZB-H1 splits the backwards and lets P weight halves wait; pp_chunks > 1 interleaves.
PipeScheduleConfig schedule_config(const MeshShape& mesh, int micro_batches);
// Its name: "1F1B", "ZB-H1", "interleaved 1F1B" or "interleaved ZB-H1".
const char* schedule_name(const MeshShape& mesh);

// virtual_chunks > 1: interleaved 1F1B in Megatron's order (micro-batches a multiple of the
// stages, else std::invalid_argument); with split backwards its forwards and input halves in that
// order, each weight half where the stage would wait (or when max_weights_waiting wait).
PipeSchedule schedule(const PipeScheduleConfig& cfg);

// Unit costs of the actions, for the simulation (a forward, a whole backward, its two halves).
struct PipeCosts {
  double forward = 1, backward = 2, backward_input = 1, backward_weight = 1;
};

struct PipeSimulation {
  double makespan = 0;  // time from the first action to the last
  double bubble = 0;    // idle fraction of the stages over the makespan: 1 - busy / (P makespan)
};

// Runs `s` with costs `c`: every stage executes its list in order, each action as soon as its
// dependencies have finished. Throws std::logic_error naming the stuck actions when the lists
// deadlock, and when they miss or repeat an action of cfg's step.
PipeSimulation simulate(const PipeSchedule& s, const PipeScheduleConfig& cfg,
                        const PipeCosts& c = {});

// The layers of each of `stages` pipeline stages, consecutive and at least one each, balanced
// by cost: layer_cost each, plus first_extra on the first stage (the embedding) and last_extra on
// the last (the final norm, lm head and loss). Minimises the largest stage's cost, then the sum
// of squared stage costs (the evenest cut); among equals earlier stages run more. Returns [stages + 1] boundaries: stage s runs layers
// [b[s], b[s + 1]). Throws std::invalid_argument unless 1 <= stages <= layers.
std::vector<int> split_layers(int layers, int stages, double layer_cost, double first_extra,
                              double last_extra);

// The boundaries of a split given as layer counts, "a, b, ..." (mesh.pp_layers): one positive
// count a chunk, `chunks` of them, summing to `layers`. Throws std::invalid_argument saying
// what is wrong.
std::vector<int> layer_bounds_from_counts(const std::string& counts, int chunks, int layers);

// The activation slots chunk c needs on a stage running `actions`: the most of its micro-batches
// between a forward and the end of their backward (the weight half, when split); at least 1.
int activation_slots(const std::vector<PipeAction>& actions, int chunk);

// "F0.3 B1.2 ..." (chunk.micro_batch) of one stage, for messages and tests.
std::string describe(const std::vector<PipeAction>& stage);

// The point-to-point channels (Mesh::device(MeshDim::kPp, k), one NCCL communicator each) that
// the CUDA pipeline (src/cuda/backend_cuda_pipeline.cpp) uses between neighbouring stages:
// activations and gradients, and with interleaved chunks (pp_chunks > 1) two more for the wrap
// from the last stage to the first. `qtrain plan` counts their memory (plan/memory_plan.h).
constexpr int cuda_pipeline_channels(int pp_chunks) { return pp_chunks > 1 ? 4 : 2; }

}  // namespace qt
