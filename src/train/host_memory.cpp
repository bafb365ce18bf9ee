#include "train/host_memory.h"

#include <fmt/format.h>

#include <algorithm>

#include "model/lora.h"
#include "model/qwen3.h"
#include "plan/memory_plan.h"

namespace qt {

namespace {

// LoRA adapter parameters: r x (in + out) per targeted projection and layer.
double lora_params(const ModelConfig& c, const LoraConfig& l) {
  const double H = c.hidden_size, I = c.intermediate_size;
  const double Q = static_cast<double>(c.num_heads) * c.head_dim;
  const double KV = static_cast<double>(c.num_kv_heads) * c.head_dim;
  const double in_out[kNumLoraTargets] = {H + Q, H + KV, H + KV, Q + H, H + I, H + I, I + H};
  double per_layer = 0, per_dense = 0;  // the MLP's only in dense layers
  for (int t : parse_lora_targets(l.targets, "lora.targets"))
    (t >= kLoraGate ? per_dense : per_layer) += l.r * in_out[t];
  // Every expert's adapters in each sparse layer: E x r x (in + out).
  const double Im = c.moe_intermediate_size, experts_in_out[kNumLoraExpertTargets] = {
                                                  H + 2 * Im, Im + H};
  double per_sparse = 0;
  for (int et : parse_lora_expert_targets(l.targets, "lora.targets"))
    per_sparse += static_cast<double>(c.num_experts) * l.r * experts_in_out[et];
  return per_layer * c.num_layers + per_dense * (c.num_layers - c.num_moe_layers()) +
         per_sparse * c.num_moe_layers();
}

// Parameters of the largest unit of the sharding plan: the embedding (or lm head) or one layer.
double largest_unit(const ModelConfig& c) {
  const double H = c.hidden_size, I = c.intermediate_size;
  const double Q = static_cast<double>(c.num_heads) * c.head_dim;
  const double KV = static_cast<double>(c.num_kv_heads) * c.head_dim;
  const double layer = 2 * H + H * (Q + 2 * KV) + Q * H + 2.0 * c.head_dim + 3 * H * I;
  return std::max(static_cast<double>(c.vocab_size) * H, layer);
}

}  // namespace

HostMemoryNeed training_host_memory(const Deck& deck, int dp) {
  const ModelConfig& c = deck.model;
  const double model = c.num_params_f64();
  const double trained = deck.lora.enabled() ? lora_params(c, deck.lora) : model;
  const bool zero1 = deck.optim.zero_stage == 1;
  const double shard = zero1 ? trained / dp : trained;  // AdamW moments held by this rank
  HostMemoryNeed need;
  need.keys = "the model's size (model.preset, model.*)";
  const std::string params = fmt::format("{:.3g}B parameters", model * 1e-9);
  const int split = deck.mesh.tp * deck.mesh.pp;
  if (deck.train.device == "cuda" && !deck.lora.enabled() && split > 1) {
    // Tensor or pipeline parallelism (not modelled by `qtrain plan` yet): the host copies of the
    // fp32 master weights and moments of the rank's part (1 / (tp x pp) of the model; of that
    // the dp shard above ZeRO-0).
    const double part = model / split / (deck.optim.zero_stage >= 1 ? dp : 1);
    need.bytes = 12 * part;
    need.what = fmt::format("fp32 host copies of this rank's part of the {} and its AdamW "
                            "moments",
                            params);
    need.keys += ", more GPUs (mesh.tp, mesh.pp, mesh.dp), or fewer ranks per node";
    return need;
  }
  if (deck.train.device == "cuda" && !deck.lora.enabled()) {
    // The CUDA back ends' host state as `qtrain plan` models it (src/plan/memory_plan.h; dense
    // and Qwen3-MoE): the fp32 copies for initialisation and checkpoints, or with offload the
    // live master weights and moments of the rank's shard, and the pinned staging.
    plan::MemoryPlanInput in;
    in.model = c;
    in.micro_batch = deck.train.micro_batch;
    in.seq_len = deck.train.seq_len;
    in.recompute = deck.train.recompute;
    in.mesh = deck.mesh;
    in.zero_stage = deck.optim.zero_stage;
    in.offload = deck.optim.offload == "cpu" ? plan::Offload::kCpu : plan::Offload::kNone;
    in.grad_reduce_bf16 = deck.optim.grad_reduce == "bf16";
    const plan::MemoryPlan mp = plan::memory_plan(in);
    need.bytes = static_cast<double>(mp.host) + static_cast<double>(mp.host_pinned);
    need.what = fmt::format("fp32 master weights (or their host copies) and AdamW moments of this "
                            "rank's part of the {}", params);
    need.keys += ", a higher optim.zero_stage over more GPUs (mesh.dp), or fewer ranks per node";
    return need;
  }
  if (deck.train.device == "cuda") {
    // Host copies of the trained fp32 state for init, checkpoints and resume (with LoRA, which
    // the planner does not model).
    need.bytes = 4 * (model + (deck.lora.enabled() ? trained : 0) + 2 * shard);
    need.what = fmt::format("fp32 host copies of the {} and their AdamW moments", params);
    need.keys += ", optim.zero_stage = 1 or fewer ranks per node";
    return need;
  }
  const double acts = Qwen3Model::buffer_bytes(c, deck.train.micro_batch, deck.train.seq_len,
                                               deck.train.recompute, deck.mesh.seq_parallel());
  // The optimizer driver's buffers (optim/sharded_state.h) at each ZeRO stage; at 2 and 3 the
  // whole units alive at once are at most two (a layer, or the head with a tied embedding).
  const int zero = deck.optim.zero_stage;
  const double units = 2 * largest_unit(c);
  const double own = zero >= 1 ? trained / dp : trained;  // moments, and the reduced gradients
  const double held = zero == 3 ? trained / dp + units : trained;
  const double grads = zero <= 1 ? trained + (zero == 1 ? own : 0) : own + units;
  // With [lora] the frozen base is whole beside the adapters.
  need.bytes = 4 * ((deck.lora.enabled() ? model : 0) + held + grads + 2 * own) + acts;
  need.what = fmt::format(
      "fp32 {}, gradients and AdamW moments, {} of activations for {} x {} tokens", params,
      format_bytes(acts), deck.train.micro_batch, deck.train.seq_len);
  need.keys += ", train.micro_batch, train.seq_len, train.recompute = true, a higher "
               "optim.zero_stage or fewer ranks per node";
  return need;
}

}  // namespace qt
