// A pipeline stage of Qwen3 on the CPU: the layer program's stage entry points over CpuOps.
#include "model/qwen3_stage.h"

#include "model/lora.h"
#include "model/qwen3.h"
#include "qtrain/error.h"

namespace qt {

Qwen3Stage::Qwen3Stage(const ModelConfig& cfg, int B, int T, bool recompute,
                       const StageRange& stage, int slots, int seq_parallel)
    : cfg_(cfg),
      B_(B),
      T_(T),
      recompute_(recompute),
      ops_(cfg, B, T, arena_, seq_parallel),
      program_(cfg, B, T, recompute, stage,
               allocate_stage_acts<float>(cfg, B, T, recompute, stage, slots, arena_,
                                          seq_parallel)),
      slot_(static_cast<std::size_t>(slots)),
      owed_(static_cast<std::size_t>(cfg.num_layers) + 2, 0) {}

void Qwen3Stage::set_lora(LoraAdapters* lora) {
  const StageRange& st = program_.stage();
  QT_CHECK(lora == nullptr || (lora->first_layer() <= st.first_layer &&
                               st.last_layer <= lora->last_layer() && lora->slots() >= slots()),
           "LoRA adapters of layers [{}, {}) with {} slots on a stage of layers [{}, {}) with {}",
           lora->first_layer(), lora->last_layer(), lora->slots(), st.first_layer, st.last_layer,
           slots());
  lora_ = lora;
  ops_.set_lora(lora);
}

namespace {
// The params as an input half sees them: a layer unit's grads_done is owed to the weight half
// (its projections' gradients are still to come); the others' pass through.
struct InputHalfUnits : CpuUnits {
  int num_layers;
  std::vector<int>* owed;        // [units] the stage's counts
  std::vector<int>* slot_owed;   // the units this slot's weight half completes
  void grads_done(int u) {
    if (u < Qwen3Units{num_layers}.layer(0) || u > Qwen3Units{num_layers}.layer(num_layers - 1))
      return mp.grads_done(u);
    ++(*owed)[static_cast<std::size_t>(u)];
    slot_owed->push_back(u);
  }
};
}  // namespace


double Qwen3Stage::forward(ModelParams& mp, int k, const StageBatch& b, const float* x_in,
                           float loss_scale) {
  const StageRange& st = program_.stage();
  QT_CHECK(k >= 0 && k < slots() && !slot_[k].busy, "forward into slot {} of {}: not free", k,
           slots());
  QT_CHECK(st.has_embedding ? b.inputs != nullptr : x_in != nullptr,
           "a stage forward without its input");
  QT_CHECK(!st.has_head || b.targets != nullptr, "the last stage's forward without targets");
  QT_CHECK(!context_parallel_ || b.positions != nullptr,
           "a context-parallel forward needs each token's global position");
  check_micro_batch(st.has_embedding ? b.inputs : nullptr, st.has_head ? b.targets : nullptr,
                    context_parallel_ ? nullptr : b.positions, B_, T_, vocab_global_);
  Slot& s = slot_[k];
  const std::size_t N = static_cast<std::size_t>(B_) * T_;
  if (st.has_embedding) s.inputs.assign(b.inputs, b.inputs + N);
  s.has_pos = b.positions != nullptr;
  if (s.has_pos) s.pos.assign(b.positions, b.positions + N);
  s.busy = true;
  if (lora_) lora_->select_slot(k);
  ops_.select_moe_slot(k);

  ops_.set_positions(s.has_pos ? s.pos.data() : nullptr);
  CpuUnits units{mp};
  program_.forward_stage(ops_, units, k, s.inputs.data(), x_in);
  if (cfg_.is_moe()) {  // the running sum of the load statistics, this chunk's layers added
    if (st.has_embedding) s.moe = cpu::RouterBalance(cfg_.num_experts);
    const cpu::RouterBalance& mine = ops_.moe_balance();
    QT_CHECK(s.moe.count.size() == mine.count.size(), "load statistics of {} experts, not {}",
             s.moe.count.size(), mine.count.size());
    for (std::size_t e = 0; e < mine.count.size(); ++e) {
      s.moe.count[e] += mine.count[e];
      s.moe.psum[e] += mine.psum[e];
    }
    s.moe.tokens += mine.tokens;
  }
  if (!st.has_head) return 0;
  // The head's forward and backward at once (gradients added): its d ln[L] waits in the slot.
  program_.head_forward_backward(ops_, units, b.targets, loss_scale, /*accumulate=*/true, k);
  return ops_.take_loss();
}

void Qwen3Stage::backward(ModelParams& mp, int k, const float* dx_in) {
  QT_CHECK(k >= 0 && k < slots() && slot_[k].busy && !slot_[k].weights_owed,
           "backward of slot {} of {}: no forward", k, slots());
  QT_CHECK(program_.stage().has_head || dx_in != nullptr, "a stage backward without d x");
  Slot& s = slot_[k];
  if (lora_) lora_->select_slot(k);
  ops_.select_moe_slot(k);
  ops_.set_positions(s.has_pos ? s.pos.data() : nullptr);
  if (cfg_.is_moe()) ops_.set_moe_balance(s.moe);
  CpuUnits units{mp};
  program_.backward_stage(ops_, units, k, s.inputs.data(), dx_in, /*accumulate=*/true);
  s.busy = false;
}

void Qwen3Stage::backward_input(ModelParams& mp, int k, const float* dx_in) {
  QT_CHECK(!recompute_, "a split backward needs the layers' activations (no recompute)");
  QT_CHECK(k >= 0 && k < slots() && slot_[k].busy && !slot_[k].weights_owed,
           "backward of slot {} of {}: no forward", k, slots());
  QT_CHECK(program_.stage().has_head || dx_in != nullptr, "a stage backward without d x");
  Slot& s = slot_[k];
  if (lora_) lora_->select_slot(k);
  ops_.select_moe_slot(k);
  ops_.set_positions(s.has_pos ? s.pos.data() : nullptr);
  if (cfg_.is_moe()) ops_.set_moe_balance(s.moe);
  ops_.defer_weight_grads(&s.deferred);
  InputHalfUnits units{{mp}, cfg_.num_layers, &owed_, &s.owed_units};
  program_.backward_stage(ops_, units, k, s.inputs.data(), dx_in, /*accumulate=*/true);
  ops_.defer_weight_grads(nullptr);
  s.weights_owed = true;
}

void Qwen3Stage::backward_weight(ModelParams& mp, int k) {
  QT_CHECK(k >= 0 && k < slots() && slot_[k].weights_owed,
           "weight gradients of slot {} of {}: no input half", k, slots());
  Slot& s = slot_[k];
  CpuOps::run_deferred(s.deferred);
  for (const int u : s.owed_units)
    if (--owed_[static_cast<std::size_t>(u)] == 0) mp.grads_done(u);
  s.owed_units.clear();
  s.weights_owed = false;
  s.busy = false;
}

}  // namespace qt
