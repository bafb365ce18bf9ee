// The deck's feature sections (config/deck_builder.h): [lora], [eval], train.precision with fp16's
// loss scaling and a Qwen3-MoE model's keys, each refusal naming its key (docs/decks.md).
#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "config/deck_builder.h"
#include "config/deck_keys.h"
#include "config/suggest.h"

namespace qt::deck_build {

// [lora] is checked whether or not it is on (r = 0), so that switching it on cannot surprise.
void Builder::validate_lora() {
  const LoraConfig& l = deck_.lora;
  need(l.r >= 0, "lora.r", "must be >= 0 (0 = LoRA off)");
  need(l.alpha > 0, "lora.alpha", "must be > 0");
  need(l.dropout >= 0 && l.dropout < 1, "lora.dropout", "must be in [0, 1)");
  std::vector<int> targets;
  try {
    targets = parse_lora_targets(l.targets, "");
  } catch (const UserError& e) {
    need(false, "lora.targets", "{}", e.what());  // ": unknown target ..."
  }
  if (l.r == 0 || l.dropout == 0 || deck_.train.device != "cuda") return;
  // The GPU's dropout masks go 8 bf16 at a time over each adapter's input row (this tp rank's
  // columns of o_proj's and down_proj's).
  const ModelConfig& m = deck_.model;
  const int tp = deck_.mesh.tp;
  for (const int t : targets) {
    const std::string name = kLoraTargets[t];
    const bool o = name == "o_proj", down = name == "down_proj";
    const int in = o ? m.q_dim() / tp : down ? m.intermediate_size / tp : m.hidden_size;
    need(in % 8 == 0, "lora.dropout", "> 0 on train.device = cuda needs the input width of each "
         "adapter a multiple of 8; {} reads {} columns a tp rank{}", name, in,
         o ? " (model.num_heads x model.head_dim / mesh.tp)"
           : down ? " (model.intermediate_size / mesh.tp)" : " (model.hidden_size)");
  }
}

// [eval] (train/evaluation.h): the held-out loss's files or split, the samples' prompts and
// tokenizer; a key that has nothing to act on is an error, so that a typo cannot leave it off.
void Builder::validate_eval() {
  const EvalConfig& e = deck_.eval;
  for (const std::string& p : split_eval_paths(e.paths)) {
    need(!p.empty(), "eval.paths", "has an empty entry; list token files separated by commas");
    const std::string why = file_problem(p);
    need(why.empty(), "eval.paths", ": {}: {}", p, why);
  }
  need(!e.loss_on() || deck_.train.device != "cuda" || deck_.lora.r == 0 ||
           deck_.lora.dropout == 0,
       e.split > 0 ? "eval.split" : "eval.paths",
       "with lora.dropout = {} on train.device = cuda is not built (the evaluation forward there "
       "would drop adapter inputs as training does); set lora.dropout = 0 or use "
       "train.device = cpu", deck_.lora.dropout);
  need(e.split >= 0 && e.split < 1, "eval.split", "must be in [0, 1) (0: nothing held out)");
  need(e.split == 0 || deck_.data.source == "file", "eval.split",
       "holds out windows of data.path: needs data.source = file");
  need(e.every >= 0, "eval.every", "must be >= 0 (0 = only at the end)");
  need(e.max_sequences >= 0, "eval.max_sequences", "must be >= 0 (0 = all)");
  // A value other than the default where it has nothing to act on (a resolved deck, which
  // lists every key, still reads back).
  const EvalConfig off;
  need(e.loss_on() || (e.every == off.every && e.max_sequences == off.max_sequences),
       e.every != off.every ? "eval.every" : "eval.max_sequences",
       "is set, but nothing is evaluated: set eval.paths (token files) or eval.split");
  need(e.samples_every >= 0, "eval.samples_every", "must be >= 0 (0 = only at the end)");
  need(e.max_new_tokens >= 1, "eval.max_new_tokens", "must be >= 1");
  need(e.samples_on() || (e.samples_every == off.samples_every &&
                           e.max_new_tokens == off.max_new_tokens && e.tokenizer.empty()),
       e.samples_every != off.samples_every    ? "eval.samples_every"
       : e.max_new_tokens != off.max_new_tokens ? "eval.max_new_tokens"
                                                 : "eval.tokenizer",
       "is set, but there are no prompts: set eval.samples (a text file, one prompt a line)");
  if (!e.samples_on()) return;
  const std::string why = file_problem(e.samples);
  need(why.empty(), "eval.samples", ": {}", why);
  const std::string dir = e.tokenizer.empty() ? deck_.model_init : e.tokenizer;
  const std::string key = e.tokenizer.empty() ? "eval.samples" : "eval.tokenizer";
  need(!dir.empty(), key,
       "needs a tokenizer: set eval.tokenizer (a directory with tokenizer.json) or model.init");
  const std::string json = (std::filesystem::path(dir) / "tokenizer.json").string();
  need(file_problem(json).empty(), key, ": {}: {}{}", json, file_problem(json),
       e.tokenizer.empty() ? " (model.init's; set eval.tokenizer)" : "");
  need(e.max_new_tokens < deck_.model.max_position_embeddings, "eval.max_new_tokens",
       "must be below model.max_position_embeddings = {}", deck_.model.max_position_embeddings);
}

// train.precision and fp16's loss-scaling keys (optim/loss_scaler.h), which act only with fp16:
// another value there is refused, as a typo would otherwise leave it off unseen.
void Builder::validate_precision() {
  const TrainConfig& t = deck_.train;
  const bool cuda = t.device == "cuda";
  need(t.precision == "auto" || t.precision == "fp32" || t.precision == "bf16" ||
           t.precision == "fp16",
       "train.precision", "must be auto, fp32, bf16 or fp16");
  need(t.precision != "fp32" || !cuda, "train.precision",
       "is the cpu's arithmetic; train.device = cuda computes in bf16 or fp16");
  need(t.precision != "bf16" || cuda, "train.precision",
       "is train.device = cuda's arithmetic; the cpu computes in fp32 (auto)");
  need(!t.fp16() || !cuda, "train.precision",
       "on train.device = cuda is not built yet (the GPU kernels compute in bf16); use "
       "bf16, or train.device = cpu to run fp16's loss scaling over fp32 arithmetic");
  const TrainConfig off;
  if (!t.fp16()) {
    for (const auto& [k, set] :
         {std::pair{"train.loss_scale", t.loss_scale != off.loss_scale},
          std::pair{"train.initial_scale_power", t.initial_scale_power != off.initial_scale_power},
          std::pair{"train.loss_scale_window", t.loss_scale_window != off.loss_scale_window},
          std::pair{"train.hysteresis", t.hysteresis != off.hysteresis},
          std::pair{"train.consecutive_hysteresis",
                    t.consecutive_hysteresis != off.consecutive_hysteresis},
          std::pair{"train.min_loss_scale", t.min_loss_scale != off.min_loss_scale}})
      need(!set, k, "applies to train.precision = fp16 only (train.precision = {})", t.precision);
    return;
  }
  need(t.loss_scale >= 0 && std::isfinite(t.loss_scale), "train.loss_scale",
       "must be a finite number > 0 (a static scale) or 0 (dynamic)");
  need(t.initial_scale_power >= 0 && t.initial_scale_power <= 64, "train.initial_scale_power",
       "must be in [0, 64] (the first loss scale is 2^this)");
  need(t.loss_scale_window >= 1, "train.loss_scale_window", "must be >= 1");
  need(t.hysteresis >= 1, "train.hysteresis", "must be >= 1 (1: the first overflow halves)");
  need(t.min_loss_scale > 0 && std::isfinite(t.min_loss_scale), "train.min_loss_scale",
       "must be a finite number > 0");
  need(t.loss_scale > 0 || t.min_loss_scale <= std::ldexp(1.0, t.initial_scale_power),
       "train.min_loss_scale", "is above the first loss scale 2^train.initial_scale_power = {}",
       std::ldexp(1.0, t.initial_scale_power));
}

// Qwen3-MoE (model.num_experts > 0): the block's sizes, then what is not built yet.
void Builder::validate_moe() {
  const ModelConfig& m = deck_.model;
  need(m.num_experts >= 0, "model.num_experts", "must be >= 0 (0: a dense model)");
  need(m.router_bias_update_rate >= 0 && std::isfinite(m.router_bias_update_rate),
       "model.router_bias_update_rate", "must be a finite number >= 0 (0: no router bias)");
  need(m.num_experts > 0 || m.router_bias_update_rate == 0, "model.router_bias_update_rate",
       "> 0 balances a Qwen3-MoE model's experts (model.num_experts > 0); this model is dense: "
       "set it to 0");
  need(m.moe_capacity_factor >= 0 && std::isfinite(m.moe_capacity_factor),
       "model.moe_capacity_factor", "must be a finite number >= 0 (0: dropless)");
  need(m.num_experts > 0 || m.moe_capacity_factor == 0, "model.moe_capacity_factor",
       "> 0 limits a Qwen3-MoE model's experts (model.num_experts > 0); this model is dense: "
       "set it to 0");
  if (m.num_experts == 0) {
    validate_moe_lora();  // refuses expert targets
    return;
  }
  need(m.num_experts_per_tok >= 1 && m.num_experts_per_tok <= m.num_experts,
       "model.num_experts_per_tok", "must be in [1, model.num_experts = {}]", m.num_experts);
  need(m.moe_intermediate_size >= 1, "model.moe_intermediate_size", "must be >= 1");
  need(m.decoder_sparse_step >= 1, "model.decoder_sparse_step", "must be >= 1");
  for (std::size_t i = 0; i < m.mlp_only_layers.size(); ++i) {
    const int l = m.mlp_only_layers[i];
    need(l >= 0 && l < m.num_layers, "model.mlp_only_layers",
         ": layer {} is not one of the model's (0 .. model.num_layers - 1 = {})", l,
         m.num_layers - 1);
    need(i == 0 || l > m.mlp_only_layers[i - 1], "model.mlp_only_layers",
         "must list layers in ascending order, each once");
  }
  need(m.router_aux_loss_coef >= 0, "model.router_aux_loss_coef", "must be >= 0 (0: no "
       "load-balancing loss)");
  // train.device = cuda's limits for Qwen3-MoE: each names its key.
  if (deck_.train.device == "cuda") {  // cuda/cuda_ops_moe.cpp, ops/cuda/moe.cuh
    // Expert parallelism (cuda/cuda_ops_moe_ep.cpp) at every ZeRO stage, with or without tp
    // (and sequence parallelism), pp (cuda/backend_cuda_pipeline.cpp) and LoRA.
    need(m.num_experts <= 1024, "model.num_experts", "> 1024 is not supported by train.device "
         "= cuda (its router keeps a token's experts in shared memory); use train.device = cpu");
    need(m.num_experts_per_tok <= 32, "model.num_experts_per_tok", "> 32 is not supported by "
         "train.device = cuda (its router gives each slot a lane of a warp); use train.device = "
         "cpu");
  }
  // Tensor parallelism (with or without sequence parallelism and ep) on both back ends
  // (model/cpu_ops_moe.cpp, cuda/cuda_ops_moe.cpp); pipeline parallelism on both
  // (train/backend_cpu_pipeline.cpp, cuda/backend_cuda_pipeline.cpp: 1F1B, interleaved and
  // ZB-H1, with tp, ep and LoRA).
  need(m.moe_intermediate_size % deck_.mesh.tp == 0, "mesh.tp", "does not divide "
       "model.moe_intermediate_size = {} (each tp rank takes an equal share of every expert's "
       "width)", m.moe_intermediate_size);
  validate_moe_lora();
  need(m.num_experts % deck_.mesh.ep == 0, "mesh.ep", "does not divide model.num_experts = {} "
       "(each expert-parallel rank takes an equal share)", m.num_experts);
}

// LoRA on a Qwen3-MoE model (docs/finetune.md, "LoRA on Qwen3-MoE"): adapters on the attention
// projections, the router and the experts frozen; both back ends at any dp, ep, tp and pp.
// Adapters on every expert as well (experts.gate_up_proj, experts.down_proj): both back ends at
// any dp, ep, tp and pp, no dropout. Expert targets on a dense model are refused whether or not
// LoRA is on, MLP targets on a Qwen3-MoE model always (below).
void Builder::validate_moe_lora() {
  const LoraConfig& l = deck_.lora;
  std::vector<int> targets, experts;
  try {
    targets = parse_lora_targets(l.targets, "");
    experts = parse_lora_expert_targets(l.targets, "");
  } catch (const UserError&) {
    return;  // validate_lora named it
  }
  if (!deck_.model.is_moe()) {
    need(experts.empty(), "lora.targets", "names {} on a dense model (model.num_experts = 0): "
         "expert targets adapt a Qwen3-MoE model's experts; list the dense projections "
         "(q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj)",
         experts.empty() ? "" : kLoraExpertTargets[experts[0]]);
    return;
  }
  if (l.r == 0) return;
  // gate_proj, up_proj, down_proj (and all-linear) on a Qwen3-MoE model: peft 0.21 with
  // transformers 5 applies these target_modules to the experts' fused parameters too (seen on
  // the GPU machine, 2026-11-27: PeftModel.from_pretrained of such an adapter wraps
  // mlp.experts), so an adapter of the dense MLP of model.mlp_only_layers alone would load as
  // another model. The engine can train it (model/lora.h lora_target_in_layer); the deck
  // refuses it until its export says the same to peft.
  for (const int t : targets)
    need(std::string(kLoraModules[t]).starts_with("self_attn."), "lora.targets",
         "names {} on a Qwen3-MoE model (model.num_experts > 0): peft (0.21, transformers 5) "
         "reads the MLP targets of a Qwen3-MoE adapter as the experts' too, so adapters on the "
         "dense MLP of model.mlp_only_layers alone are refused; list attention projections "
         "(q_proj, k_proj, v_proj, o_proj; all-linear includes the MLP's) and, for the experts, "
         "experts.gate_up_proj and experts.down_proj",
         kLoraTargets[t]);
  if (experts.empty()) return;
  // Adapters on every expert (docs/finetune.md, "LoRA on Qwen3-MoE"): both back ends at any dp,
  // ep, tp and pp; PEFT's ParamWrapper has no dropout.
  const std::string et = kLoraExpertTargets[experts[0]];
  need(l.dropout == 0, "lora.dropout", "> 0 with {} in lora.targets: adapters on the experts "
       "have no dropout (as PEFT's target_parameters, whose ParamWrapper refuses it); set "
       "lora.dropout = 0", et);
}

}  // namespace qt::deck_build
