// Qwen3 dense model on the CPU: hand-written forward and backward over the fp32 flat parameter
// buffer (include/qtrain/params.h), exactly the math of ../shared/docs/qwen3-spec.md section 2.
#pragma once

#include <cstdint>
#include <vector>

#include "model/model_params.h"
#include "qtrain/model_config.h"
#include "qtrain/params.h"
#include "qtrain/shard_plan.h"

namespace qt {

class LoraAdapters;

// Deterministic initialisation as transformers does it: Linear and Embedding weights
// N(0, initializer_range), norm weights 1. Each element's value depends only on (seed, parameter
// name, element index), never on the mesh.
void init_params(const ModelConfig& cfg, const ParamLayout& layout, std::uint64_t seed,
                 float* params);
// The same values, for the flat ranges `pieces` of `layout` only (a sharded state initialises
// just what the rank holds).
void init_params(const ModelConfig& cfg, const ParamLayout& layout, std::uint64_t seed,
                 const std::vector<FlatPiece>& pieces);
// The host threads init_params uses for `layout`: up to 16, no more than the CPUs this process
// may run on (its affinity mask).
unsigned init_params_threads(const ParamLayout& layout);

class Qwen3Model {
 public:
  // Buffers for micro-batches of B sequences of T tokens. recompute: keep only each layer's input
  // and recompute the rest of the layer in backward.
  Qwen3Model(const ModelConfig& cfg, int B, int T, bool recompute);

  // Bytes of the buffers that constructor allocates (activations, logits, their gradients), in
  // double so that absurd shapes cannot overflow; the memory check runs it before allocating.
  static double buffer_bytes(const ModelConfig& cfg, int B, int T, bool recompute);

  const ModelConfig& config() const { return cfg_; }
  const ParamLayout& layout() const { return layout_; }
  int batch() const { return B_; }
  int seq_len() const { return T_; }

  // inputs, targets: [B, T]; targets -100 are not counted. positions: [B, T] RoPE position of
  // each input, 0 where a document starts, attention only within a document (packing; a valid
  // row: pos[0] = 0, pos[t] = pos[t-1] + 1 or 0), or null: positions 0..T-1, plain causal.
  // Returns the sum of the cross-entropy over counted targets (nats) and keeps what backward
  // needs.
  // The parameters come unit by unit from `params` (model/model_params.h; the units of
  // units()); the head's units stay acquired from the forward to the backward.
  double forward(ModelParams& params, const std::int32_t* inputs, const std::int32_t* targets,
                 const std::int32_t* positions = nullptr);
  // The same over the whole flat buffer of layout().
  double forward(const float* params, const std::int32_t* inputs, const std::int32_t* targets,
                 const std::int32_t* positions = nullptr);

  // grads += loss_scale * d(summed loss)/d(params), for the last forward, unit by unit in reverse
  // (the head, layers L-1 .. 0, the embedding). Null grads: the base is frozen (LoRA), only the
  // adapters' gradients accumulate.
  void backward(ModelParams& params, float loss_scale);
  void backward(const float* params, float* grads, float loss_scale);

  // The units the model asks ModelParams for (a plan for dp 1: unit ranges do not depend on dp).
  const ShardPlan& units() const { return plan_; }

  // LoRA adapters applied beside the projections they target in every forward and backward
  // (src/model/lora.h; their weights and gradients are bound there), or null: none.
  void set_lora(LoraAdapters* lora) { lora_ = lora; }

  // [B*T, V] logits of the last forward (valid until backward).
  const float* logits() const { return logits_.data(); }

 private:
  struct LayerActs {    // saved activations of one layer, N = B*T rows
    std::vector<float> ln1, rstd1;          // [N, H], [N]
    std::vector<float> q_raw, k_raw;        // [N, Q], [N, KV] before q/k norm
    std::vector<float> q_rstd, k_rstd;      // [N*nh], [N*nkv]
    std::vector<float> q, k, v;             // [N, Q], [N, KV], [N, KV] after norm and rope
    std::vector<float> att, lse;            // [N, Q], [B, nh, T]
    std::vector<float> x_mid;               // [N, H] residual after attention
    std::vector<float> ln2, rstd2;          // [N, H], [N]
    std::vector<float> gate, up, h;         // [N, I]
    void allocate(const ModelConfig& c, int B, int T);
  };

  // One layer's tensors (or their gradients: all null when frozen).
  template <class T>
  struct LayerTensors {
    T *ln1, *wq, *wk, *wv, *wo, *q_norm, *k_norm, *ln2, *w_gate, *w_up, *w_down;
  };
  template <class T>
  LayerTensors<T> layer_tensors(int l, T* unit) const;

  void layer_forward(int l, const LayerTensors<const float>& w, const float* x_in, float* x_out,
                     LayerActs& a);
  // dx: [N, H] gradient of the layer output in, gradient of the layer input out.
  void layer_backward(int l, const LayerTensors<const float>& w, const LayerTensors<float>& g,
                      const float* x_in, float* dx, LayerActs& a);

  ModelConfig cfg_;
  ParamLayout layout_;
  ModelOffsets off_ = layout_.model_offsets();
  ShardPlan plan_;
  Qwen3Units unit_;
  int B_, T_, N_;
  bool recompute_;
  LoraAdapters* lora_ = nullptr;
  std::vector<float> rope_cos_, rope_sin_;   // [T, hd/2]

  std::vector<std::int32_t> inputs_, targets_, pos_;
  const std::int32_t* pos_ptr_ = nullptr;    // pos_.data() when the last forward had positions
  std::vector<std::vector<float>> x_;        // x_[l]: [N, H] input of layer l; x_[L]: final
  std::vector<LayerActs> acts_;              // one per layer, or one scratch with recompute
  std::vector<float> xf_, rstdf_;            // final norm output [N, H], [N]
  std::vector<float> logits_, losses_, lse_; // [N, V], [N], [N]
  // backward scratch
  std::vector<float> dx_, dtmp_, dln_, dq_, dk_, dv_, datt_, dgate_, dup_, dh_;
};

}  // namespace qt
