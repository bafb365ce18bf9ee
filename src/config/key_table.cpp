// The deck's key table (config/key_table.h), deck_keys() and deck_help().
#include "config/key_table.h"

#include <fmt/format.h>

#include "config/deck_keys.h"

namespace qt {

namespace config {

namespace {

template <class Part, class T>
KeySpec spec(const char* section, const char* name, Part Deck::*part, T Part::*member,
             std::string unit, std::string meaning) {
  return {std::string(section) + "." + name, std::move(unit), std::move(meaning),
          [part, member](Deck& d) -> FieldRef { return &((d.*part).*member); }};
}

}  // namespace

// The one table of keys, in section order. model.preset comes first: it is applied before the
// other model keys, which override it.
const std::vector<KeySpec>& key_table() {
  static const std::vector<KeySpec> table = [] {
    using D = Deck;
    using M = ModelConfig;
    using S = MeshShape;
    using T = TrainConfig;
    using O = OptimConfig;
    using Lo = LoraConfig;
    using Da = DataConfig;
    using C = CheckpointConfig;
    using L = LogConfig;
    using E = EvalConfig;
    using To = TopologyConfig;
    return std::vector<KeySpec>{
        spec("model", "preset", &D::model, &M::preset, "",
             "Model preset (" + join(model_preset_names(), " | ") +
                 "); sets every model key, which the keys below override"),
        KeySpec{"model.init", "path",
                "Hugging Face model directory to start from (config.json + safetensors); its "
                "config.json sets every model key; empty = initialise from train.seed",
                [](Deck& d) -> FieldRef { return &d.model_init; }},
        spec("model", "vocab_size", &D::model, &M::vocab_size, "tokens", "Vocabulary size V"),
        spec("model", "hidden_size", &D::model, &M::hidden_size, "", "Hidden size H"),
        spec("model", "intermediate_size", &D::model, &M::intermediate_size, "",
             "SwiGLU MLP width I"),
        spec("model", "num_layers", &D::model, &M::num_layers, "", "Decoder layers L"),
        spec("model", "num_heads", &D::model, &M::num_heads, "", "Query heads"),
        spec("model", "num_kv_heads", &D::model, &M::num_kv_heads, "",
             "Key/value heads (GQA); must divide num_heads"),
        spec("model", "head_dim", &D::model, &M::head_dim, "", "Width of one head; even"),
        spec("model", "rope_theta", &D::model, &M::rope_theta, "", "RoPE base frequency"),
        spec("model", "rms_norm_eps", &D::model, &M::rms_norm_eps, "",
             "Epsilon inside every RMSNorm"),
        spec("model", "tie_word_embeddings", &D::model, &M::tie_word_embeddings, "",
             "lm_head shares the embedding matrix (true | false)"),
        spec("model", "initializer_range", &D::model, &M::initializer_range, "",
             "Standard deviation of the normal initialisation of weights"),
        spec("model", "max_position_embeddings", &D::model, &M::max_position_embeddings,
             "tokens", "Longest sequence the model allows; train.seq_len must not exceed it"),
        spec("model", "rope_type", &D::model, &M::rope_type, "",
             "RoPE scaling: default (none) | yarn (transformers' YaRN: longer context than the "
             "model was pretrained for); with model.init, set here over its config.json"),
        spec("model", "rope_factor", &D::model, &M::rope_factor, "",
             "yarn: the context extension factor (e.g. 4: 32K -> 128K tokens)"),
        spec("model", "rope_original_max_position_embeddings", &D::model,
             &M::rope_original_max_position_embeddings, "tokens",
             "yarn: the context the model was pretrained for"),
        spec("model", "rope_attention_factor", &D::model, &M::rope_attention_factor, "",
             "yarn: the factor on cos and sin; 0 = 0.1 ln(rope_factor) + 1"),
        spec("model", "rope_beta_fast", &D::model, &M::rope_beta_fast, "rotations",
             "yarn: dimensions rotating more often than this in the pretrained context keep "
             "their frequency"),
        spec("model", "rope_beta_slow", &D::model, &M::rope_beta_slow, "rotations",
             "yarn: dimensions rotating less often than this are interpolated by rope_factor"),
        spec("model", "num_experts", &D::model, &M::num_experts, "",
             "Qwen3-MoE: routed experts E of each sparse layer; 0 = a dense model"),
        spec("model", "num_experts_per_tok", &D::model, &M::num_experts_per_tok, "",
             "Qwen3-MoE: experts k each token is routed to (1 <= k <= num_experts)"),
        spec("model", "moe_intermediate_size", &D::model, &M::moe_intermediate_size, "",
             "Qwen3-MoE: SwiGLU width Im of one expert"),
        spec("model", "norm_topk_prob", &D::model, &M::norm_topk_prob, "",
             "Qwen3-MoE: renormalise a token's k routing weights to sum 1"),
        spec("model", "decoder_sparse_step", &D::model, &M::decoder_sparse_step, "layers",
             "Qwen3-MoE: layer l is sparse when (l + 1) is a multiple of it (and l is not in "
             "mlp_only_layers)"),
        spec("model", "mlp_only_layers", &D::model, &M::mlp_only_layers, "",
             "Qwen3-MoE: comma list of layers (from 0) that keep a dense MLP of "
             "intermediate_size; empty: none"),
        spec("model", "router_aux_loss_coef", &D::model, &M::router_aux_loss_coef, "",
             "Qwen3-MoE: weight of the load-balancing loss (transformers' aux loss, averaged "
             "over a step's micro-batches) in the objective; 0 = none"),
        spec("model", "router_bias_update_rate", &D::model, &M::router_bias_update_rate,
             "probability",
             "Qwen3-MoE: auxiliary-loss-free balancing: after each step every sparse layer's "
             "router bias (added to the probabilities for the choice of experts only) moves by "
             "this toward an even expert load; 0 = off"),
        spec("model", "moe_capacity_factor", &D::model, &M::moe_capacity_factor, "",
             "Qwen3-MoE: expert capacity: each expert takes at most ceil(factor x tokens x k / "
             "num_experts) of a micro-batch's token-slots, in token order; the overflow is "
             "dropped (its slot adds nothing) and counted; 0 = dropless"),

        spec("mesh", "dp", &D::mesh, &S::dp, "ranks",
             "Data-parallel ranks; 0 = auto (world size / (tp x pp x cp))"),
        spec("mesh", "cp", &D::mesh, &S::cp, "ranks",
             "Context-parallel ranks: each sequence split over them in 2 cp load-balanced "
             "chunks, ring attention (cpu, dense model, with mesh.dp, tp, pp and [lora]; "
             "seq_len >= 2 cp)"),
        spec("mesh", "tp", &D::mesh, &S::tp, "ranks",
             "Tensor-parallel ranks: heads, MLP columns and vocabulary split over them (must "
             "divide model.num_heads, intermediate_size and vocab_size, and divide num_kv_heads "
             "or, on train.device = cpu, be a multiple of it)"),
        spec("mesh", "sequence_parallel", &D::mesh, &S::sequence_parallel, "",
             "With mesh.tp > 1: norms and residual adds on 1/tp of each micro-batch's rows, "
             "block inputs all-gathered and outputs reduce-scattered over tp (true | false)"),
        spec("mesh", "tp_overlap", &D::mesh, &S::tp_overlap, "",
             "With mesh.tp > 1 on train.device = cuda: each block's tp collectives run in "
             "pieces beside its GEMMs (true | false: each whole, after its GEMM)"),
        spec("mesh", "pp", &D::mesh, &S::pp, "ranks",
             "Pipeline stages, each a range of layers (both back ends)"),
        spec("mesh", "pp_schedule", &D::mesh, &S::pp_schedule, "",
             "Pipeline schedule: 1f1b | zb-h1 (zero bubble: backward split in two; cpu, cuda)"),
        spec("mesh", "pp_chunks", &D::mesh, &S::pp_chunks, "chunks",
             "Model chunks a pipeline stage runs; > 1: interleaved 1F1B (or ZB-H1)"),
        spec("mesh", "pp_layers", &D::mesh, &S::pp_layers, "layers",
             "Layers of each pipeline chunk, a comma list; empty: balanced by cost"),
        spec("mesh", "ep", &D::mesh, &S::ep, "ranks",
             "Expert-parallel ranks for a Qwen3-MoE model: each computes num_experts / ep of "
             "the experts; divides mesh.dp and model.num_experts"),

        spec("train", "seq_len", &D::train, &T::seq_len, "tokens", "Tokens per sequence T"),
        spec("train", "micro_batch", &D::train, &T::micro_batch, "sequences",
             "Sequences per micro-batch on each dp rank"),
        spec("train", "global_batch", &D::train, &T::global_batch, "sequences",
             "Sequences per optimizer step over all dp ranks; a multiple of micro_batch x dp"),
        spec("train", "steps", &D::train, &T::steps, "steps",
             "Optimizer steps of the whole run (the schedule's horizon)"),
        spec("train", "stop_at", &D::train, &T::stop_at, "steps",
             "Stop after this step, checkpointing first; 0 = run to train.steps"),
        spec("train", "seed", &D::train, &T::seed, "",
             "Seed of initialisation, data order and synthetic data"),
        spec("train", "recompute", &D::train, &T::recompute, "",
             "Recompute each layer's activations in backward (true | false)"),
        spec("train", "device", &D::train, &T::device, "",
             "Back end: cpu (fp32 reference) | cuda (bf16 compute, fp32 master weights; one GPU per rank)"),
        spec("train", "max_consecutive_skips", &D::train, &T::max_consecutive_skips, "steps",
             "A step with a non-finite loss or gradient norm is skipped (no parameter or moment "
             "changes) and counted; this many in a row stop the run (exit 3); >= 1"),
        spec("train", "loss_spike_factor", &D::train, &T::loss_spike_factor, "",
             "Log a warning when a step's loss exceeds this factor times the recent mean; "
             "> 1, or 0 = off"),
        spec("train", "precision", &D::train, &T::precision, "",
             "Arithmetic: auto (cpu fp32, cuda bf16) | fp32 (cpu) | bf16 (cuda) | fp16 (loss "
             "scaling; on the cpu the arithmetic stays fp32 and only the scaling runs)"),
        spec("train", "loss_scale", &D::train, &T::loss_scale, "",
             "train.precision = fp16: a static loss scale (> 0), or 0 = dynamic"),
        spec("train", "initial_scale_power", &D::train, &T::initial_scale_power, "",
             "train.precision = fp16, dynamic: the first loss scale is 2^this (0 to 64)"),
        spec("train", "loss_scale_window", &D::train, &T::loss_scale_window, "steps",
             "train.precision = fp16, dynamic: steps without an overflow before the scale "
             "doubles; >= 1"),
        spec("train", "hysteresis", &D::train, &T::hysteresis, "",
             "train.precision = fp16, dynamic: overflows tolerated before the scale halves "
             "(refilled when it grows); >= 1"),
        spec("train", "consecutive_hysteresis", &D::train, &T::consecutive_hysteresis, "",
             "train.precision = fp16, dynamic: refill the hysteresis after every step without an "
             "overflow (true | false)"),
        spec("train", "min_loss_scale", &D::train, &T::min_loss_scale, "",
             "train.precision = fp16, dynamic: the scale's floor; an overflow there stops the "
             "run (exit 3); > 0"),

        spec("optim", "lr", &D::optim, &O::lr, "", "Peak learning rate (AdamW)"),
        spec("optim", "min_lr", &D::optim, &O::min_lr, "",
             "Learning rate at the end of the decay; at most lr"),
        spec("optim", "warmup_steps", &D::optim, &O::warmup_steps, "steps",
             "Linear warm-up from 0 to lr"),
        spec("optim", "schedule", &D::optim, &O::schedule, "",
             "Decay after warm-up: " + join(schedule_names(), " | ")),
        spec("optim", "beta1", &D::optim, &O::beta1, "", "AdamW first-moment decay, in [0, 1)"),
        spec("optim", "beta2", &D::optim, &O::beta2, "", "AdamW second-moment decay, in [0, 1)"),
        spec("optim", "eps", &D::optim, &O::eps, "", "AdamW epsilon"),
        spec("optim", "weight_decay", &D::optim, &O::weight_decay, "",
             "Decoupled weight decay (AdamW)"),
        spec("optim", "grad_clip", &D::optim, &O::grad_clip, "",
             "Clip the global gradient L2 norm to this; 0 disables clipping"),
        spec("optim", "zero_stage", &D::optim, &O::zero_stage, "",
             "ZeRO over dp: 0 replicated; 1 optimizer state sharded; 2 + gradients; 3 + "
             "parameters (gathered per layer)"),
        spec("optim", "offload", &D::optim, &O::offload, "",
             "Master weights and AdamW moments in host memory, AdamW on the host: none | cpu"),
        spec("optim", "grad_reduce", &D::optim, &O::grad_reduce, "",
             "dtype of the dp gradient reduction: fp32 | bf16 (bf16: cuda only, half the traffic)"),
        spec("optim", "reduce_bucket_mb", &D::optim, &O::reduce_bucket_mb, "MiB",
             "not used (gradients are reduced a unit at a time); kept for older decks"),

        spec("lora", "r", &D::lora, &Lo::r, "",
             "LoRA rank; 0 = off (the whole model trains); > 0: only adapters train, base frozen"),
        spec("lora", "alpha", &D::lora, &Lo::alpha, "", "LoRA scale numerator: scale = alpha / r"),
        spec("lora", "dropout", &D::lora, &Lo::dropout, "",
             "Dropout on the adapters' input, in [0, 1)"),
        spec("lora", "targets", &D::lora, &Lo::targets, "",
             "Projections adapted: comma list of q_proj, k_proj, v_proj, o_proj, gate_proj, "
             "up_proj, down_proj, or all-linear; on a Qwen3-MoE model also experts.gate_up_proj, "
             "experts.down_proj (every expert's, peft's target_parameters)"),

        spec("data", "source", &D::data, &Da::source, "",
             "Training data: " + join(kDataSources, " | ")),
        spec("data", "path", &D::data, &Da::path, "path",
             "Token file (HDF5, docs/data.md) when source = file"),
        spec("data", "packing", &D::data, &Da::packing, "",
             "Documents in windows: " + join(kPackings, " | ") + " (docs/data.md, Packing)"),
        spec("data", "synthetic_branching", &D::data, &Da::synthetic_branching, "tokens",
             "Synthetic Markov chain: successors per token, 1..vocab_size"),

        spec("checkpoint", "dir", &D::checkpoint, &C::dir, "path", "Directory of checkpoints"),
        spec("checkpoint", "every", &D::checkpoint, &C::every, "steps",
             "Steps between checkpoints; 0 = only at the end; -1 = none at all (benchmarks)"),
        spec("checkpoint", "keep", &D::checkpoint, &C::keep, "checkpoints",
             "Newest complete checkpoints kept; older ones are deleted"),
        spec("checkpoint", "resume", &D::checkpoint, &C::resume, "",
             "auto (newest in dir, if any) | none | path of a checkpoint file"),

        spec("log", "every", &D::log, &L::every, "steps", "Steps between log lines"),
        spec("log", "metrics", &D::log, &L::metrics, "path",
             "JSON-lines metrics file written by rank 0; empty disables it"),
        spec("log", "tensorboard", &D::log, &L::tensorboard, "path",
             "Directory of TensorBoard event files written by rank 0 (created if missing); "
             "empty disables them"),

        spec("eval", "paths", &D::eval, &E::paths, "paths",
             "Held-out token files (HDF5, as data.path), comma-separated; their loss is "
             "evaluated every eval.every steps and at the end; empty: none"),
        spec("eval", "split", &D::eval, &E::split, "",
             "Fraction of data.path's windows held out of training and evaluated, in [0, 1); "
             "0: none"),
        spec("eval", "every", &D::eval, &E::every, "steps",
             "Steps between evaluations of the held-out loss; 0 = only at the end"),
        spec("eval", "max_sequences", &D::eval, &E::max_sequences, "sequences",
             "Evaluate at most this many held-out sequences (the first of a fixed order); 0 = all"),
        spec("eval", "samples", &D::eval, &E::samples, "path",
             "Text file of prompts, one a line, continued greedily every eval.samples_every "
             "steps and at the end; empty: none"),
        spec("eval", "samples_every", &D::eval, &E::samples_every, "steps",
             "Steps between samples; 0 = only at the end"),
        spec("eval", "max_new_tokens", &D::eval, &E::max_new_tokens, "tokens",
             "Tokens generated for each prompt of eval.samples (fewer at a stop token)"),
        spec("eval", "tokenizer", &D::eval, &E::tokenizer, "path",
             "Directory with tokenizer.json for eval.samples; empty: model.init's"),

        spec("topology", "gpus_per_host", &D::topology, &To::gpus_per_host, "GPUs",
             "GPUs (ranks) of one host; tensor parallelism stays inside one (qtrain plan)"),
        spec("topology", "intra_host_gbps", &D::topology, &To::intra_host_gbps, "GB/s",
             "All-reduce bus bandwidth per GPU within a host (NVLink), for qtrain plan"),
        spec("topology", "inter_host_gbps", &D::topology, &To::inter_host_gbps, "GB/s",
             "All-reduce bus bandwidth per GPU across hosts (network), for qtrain plan"),
    };
  }();
  return table;
}

const KeySpec* find_spec(const std::string& key) {
  for (const KeySpec& s : key_table()) {
    if (s.key == key) return &s;
  }
  return nullptr;
}

std::vector<std::string> all_keys() {
  std::vector<std::string> out;
  for (const KeySpec& s : key_table()) out.push_back(s.key);
  return out;
}

Deck deck_defaults() {
  Deck d;
  d.mesh.dp = 0;
  return d;
}

}  // namespace config

using config::KeySpec;

std::vector<DeckKeyInfo> deck_keys() {
  using config::deck_defaults;
  using config::key_table;
  Deck d = deck_defaults();
  std::vector<DeckKeyInfo> out;
  for (const KeySpec& s : key_table()) {
    out.push_back({s.key, s.unit, s.meaning, format_value(s.field(d))});
  }
  return out;
}

std::string deck_help() {
  std::string out =
      "usage: qtrain [--section.key=value ...] deck.ini\n"
      "       mpiexec -n N qtrain [--section.key=value ...] deck.ini\n"
      "       qtrain --help | --version\n"
      "\n"
      "A deck is an INI file of [section] headers and `key = value` lines; `#` starts a\n"
      "comment. A --section.key=value on the command line wins over the file. Unknown keys\n"
      "and bad values are errors (exit code 2). docs/decks.md describes every key.\n"
      "Keys, with their defaults (the [model] defaults are the tiny preset's):\n";
  std::string section;
  for (const DeckKeyInfo& k : deck_keys()) {
    std::string sec = k.key.substr(0, k.key.find('.'));
    if (sec != section) {
      out += "\n[" + sec + "]\n";
      section = sec;
    }
    out += fmt::format("  {} = {}{}\n      {}\n", k.key,
                       k.default_value.empty() ? "\"\"" : k.default_value,
                       k.unit.empty() ? "" : "  [" + k.unit + "]", k.meaning);
  }
  return out;
}

}  // namespace qt
