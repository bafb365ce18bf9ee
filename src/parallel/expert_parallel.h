// Expert parallelism on the CPU reference (issue 18): a sparse block's experts split over an ep
// group of P ranks, rank r holding experts [r El, (r + 1) El), El = E / P (its gate_up [El, 2 Im,
// H] and down [El, H, Im] are rows of the global tensors). Every rank routes its own tokens
// with the whole router; each (token, slot) row travels to the rank owning its expert
// (all-to-all with counts), runs there, and its output comes back; the owner keeps the rows it
// received for the backward, which travels the same way. Dropless by default: every row is
// sent; with a capacity factor (ops/moe_capacity.h) the source rank decides the drops over its
// own N tokens before the exchange and sends only the kept rows, so a rank receives at most E C
// rows a layer (its El experts, at most C from each of the P sources).
//
// Storage: rank r's local model (ep_local_config) holds only those rows, each sparse layer's
// experts after the head in its layout and a unit of their own in the plan (sharded and reduced
// over the expert-data-parallel group); EpMap places them in the global tensors [E, ...].
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "ops/moe_block.h"
#include "parallel/layout_map.h"
#include "parallel/tensor_parallel.h"
#include "qtrain/comm.h"
#include "qtrain/mesh.h"
#include "qtrain/model_config.h"
#include "qtrain/params.h"
#include "qtrain/shard_plan.h"

namespace qt {

// The model an ep rank stores: cfg with expert_shards = ep (ep must divide num_experts; the deck
// checks it with a clear message). A dense model or ep = 1: cfg itself.
ModelConfig ep_local_config(const ModelConfig& cfg, int ep);

// An ep rank's local layout (ParamLayout(ep_local_config(cfg, ep))) in the global one: its
// experts of layer l, [El, ...] after the head, are rows [r El, (r + 1) El) of the global
// tensor; every other tensor is whole. Nothing is left out when writing: each element a rank
// holds is owned (ZeRO) by one rank of its group, and the ep ranks hold different experts.
class EpMap final : public LayoutMap {
 public:
  EpMap(const ParamLayout& global, const ParamLayout& local, int ep_rank);
  std::vector<Segment> segments(Range r, bool writing) const override;

 private:
  struct Place {
    std::size_t local, numel, global;  // the local tensor's offset and size, where it goes
  };
  std::vector<Place> places_;  // [local tensors], in local flat order
};

// Tensor and expert parallelism together (mesh.tp > 1 and mesh.ep > 1): the (tp, ep) rank's
// local layout (ep_local_config of tp_local_config) holds El = E / ep experts, each with its tp
// rank's columns of the width. Its elements go through EpMap into the tp rank's model at ep 1
// (its experts' rows there), then through TpMap into the global layout.
class TpEpMap final : public LayoutMap {
 public:
  // cfg: the global model; local: ParamLayout(ep_local_config(tp_local_config(cfg, tp), ep)).
  TpEpMap(const ModelConfig& cfg, const ParamLayout& global, const ParamLayout& local,
          const MeshShape& mesh, int tp_rank, int ep_rank);
  // Any layout so split (LoRA adapters: model/lora.h lora_map): tp_layout holds local's tensors
  // as the tp rank's model at ep 1 has them, tp_plan its plan over tp (TpMap reads the specs).
  TpEpMap(const ParamLayout& global, const ParamLayout& local, ParamLayout tp_layout,
          ShardPlan tp_plan, int tp_rank, int ep_rank);
  TpEpMap(const TpEpMap&) = delete;  // tp_ refers to the members before it
  TpEpMap& operator=(const TpEpMap&) = delete;
  std::vector<Segment> segments(Range r, bool writing) const override;

 private:
  ParamLayout tp_layout_;  // the tp rank's model at ep 1
  ShardPlan tp_plan_;      // its split over tp (TpMap reads the specs)
  EpMap ep_;               // local -> tp_layout_
  TpMap tp_;               // tp_layout_ -> global
};

// The map of a rank's local model to the global one (both back ends): TpMap (tp > 1),
// EpMap (ep > 1), TpEpMap (both), or null (neither: the local layout is the global one).
// local_plan: plan_qwen3's for the local layout (TpMap reads its specs).
std::unique_ptr<LayoutMap> make_model_map(const ModelConfig& cfg, const ParamLayout& global,
                                          const ParamLayout& local, const ShardPlan& local_plan,
                                          const MeshShape& mesh, int tp_rank, int ep_rank);

// An all-to-all's row counts: each block's first row (the exclusive prefix sum of `counts`), and
// the counts in elements of `f` each (rows of H values).
std::vector<std::size_t> block_offsets(const std::vector<std::size_t>& counts);
std::vector<std::size_t> scaled_counts(const std::vector<std::size_t>& v, std::size_t f);

// One sparse layer's exchange: what forward sent and received, kept for backward.
class ExpertDispatch {
 public:
  // experts: E of the whole model; the group's size must divide it.
  ExpertDispatch(Comm& ep, int experts, int hidden, int moe_width);

  int local_experts() const { return el_; }
  int first_expert() const { return el_ * ep_.rank(); }
  // Rows the last forward received (every source's kept rows for this rank's experts).
  std::size_t received_rows() const { return recv_ids_.size(); }

  // out [N k, H] written: row t k + j is expert idx[t, j]'s output for token t (x [N, H]),
  // unweighted; zero for a pair that keep [N k] drops (null: all kept), which is not sent.
  // gate_up, down: this rank's experts.
  // lora: this rank's experts' adapters (its local model's, model/lora.h; null: none).
  void forward(float* out, const float* x, const int* idx, int N, int k, const float* gate_up,
               const float* down, const std::uint8_t* keep = nullptr,
               const cpu::ExpertLora<float>* lora = nullptr);
  // dx_slot [N k, H] written: each slot row's input gradient from its expert, given dout [N k, H]
  // (the gradient of forward's out; a dropped row's is not read and its dx_slot is zero); this
  // rank's experts' gradients accumulated (+=), or both null: frozen experts (LoRA). Weights as
  // forward's.
  void backward(float* dx_slot, const float* dout, const float* gate_up, const float* down,
                float* g_gate_up, float* g_down, const cpu::ExpertLora<float>* lora = nullptr);

 private:
  // slots [N k, H] written: slot row i is rows' row pos_[i] (send order), zeros if dropped.
  void to_slots(const float* rows, float* slots) const;
  // rows [n, H] in send order <-> the peers' rows in receive order (counts in rows).
  void exchange(const float* send, float* recv, bool forward_direction);

  Comm& ep_;
  int e_, el_, h_, im_;
  int nk_ = 0;                                // rows this rank routed (N k)
  static constexpr std::size_t kDropped = static_cast<std::size_t>(-1);
  std::vector<std::size_t> pos_;              // [N k] a slot row's place in the send order, or
                                              // kDropped
  std::vector<std::size_t> send_rows_, send_at_, recv_rows_, recv_at_;  // [P] rows
  std::vector<float> recv_x_;                 // [R, H] the rows received, kept for backward
  std::vector<int> recv_ids_;                 // [R] their local expert
};

// The sparse block with its experts over `dispatch` (ops/moe_block.h's math, its capacity
// included; s.E the whole model's experts). slot_out [N k, H]: the experts' outputs (zero rows
// for dropped pairs), written by forward and read by backward. y and dx written; dgate and this
// rank's expert gradients accumulated (+=), or all three null: a frozen block (LoRA), dx only.
// bias [E]: the router's balancing bias (cpu::router_forward; null: none). The forward returns
// the pairs of this rank's tokens that the capacity dropped. lora: this rank's experts'
// adapters (ExpertDispatch's), their gradients accumulated by the backward.
long moe_block_forward_ep(float* y, float* probs, int* idx, float* w, float* slot_out,
                          const float* x, const float* gate, const float* gate_up,
                          const float* down, const cpu::MoeShape& s, ExpertDispatch& dispatch,
                          const float* bias = nullptr,
                          const cpu::ExpertLora<float>* lora = nullptr);
void moe_block_backward_ep(float* dx, float* dgate, float* dgate_up, float* ddown, const float* dy,
                           const float* x, const float* probs, const int* idx, const float* w,
                           const float* slot_out, const float* gate, const float* gate_up,
                           const float* down, const cpu::MoeShape& s, ExpertDispatch& dispatch,
                           const cpu::RouterBalance* balance = nullptr, float aux_coef = 0,
                           const cpu::ExpertLora<float>* lora = nullptr);

}  // namespace qt
