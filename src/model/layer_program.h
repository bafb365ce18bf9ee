// The Qwen3 decoder layer and model, written once: forward, backward, recompute and the LoRA
// sites, as a sequence of ops that each back end executes (the CPU reference in fp32, CpuOps in
// src/model/cpu_ops.h; CUDA in bf16, CudaOps in src/cuda/cuda_ops.h). The math is
// ../shared/docs/qwen3-spec.md section 2; tests/model/reference_model.h stays an independent fp64
// oracle.
//
// The program is shaped like the fast path: q/k/v_proj run as one GEMM into [q | k | v] rows and
// gate/up_proj as one into [gate | up] (their weights are adjacent in the parameter layout), q/k
// norm and RoPE are one op reading the fused rows, every residual add is fused with the RMSNorm
// that follows it (so layer l's last op produces layer l + 1's input norm, or the final norm),
// and the lm head with the cross-entropy is one op (chunked on CUDA, so the [tokens, vocabulary]
// logits never exist there). The CPU composes the fused ops from its reference ops.
//
// Parallel dimensions enter through the Ops' collective hooks, called at the points where they
// act (NoCollectives: no-ops): tensor parallelism reduces a block's row-parallel output over tp
// and its column-parallel input gradient; sequence parallelism instead gathers a block's normed
// input rows before its column-parallel GEMM and reduce-scatters the row-parallel output after it
// (issue 17); context parallelism is the attention op itself; expert parallelism replaces the MLP
// block's ops (issue 18). Parameters come unit by unit (the units of the sharding plan) from a Units
// object: weights(u), grads(u), release(u), grads_done(u), and take_embedding_rows(dx, ids, N)
// (true: the store took an untied embedding's gradient as its N rows instead of grads(E) and
// grads_done(E); model/model_params.h: CpuUnits; cuda/qwen3_cuda.h: UnitSource). In an expert-
// parallel rank's local model (ModelConfig::expert_shards > 1) a sparse layer's experts are a unit
// of their own (Qwen3Units::experts), asked for beside the layer's; otherwise they sit in the
// layer's unit, after its router.
//
// Shapes: N = B*T rows, H hidden, Q = nh*hd, KV = nkv*hd, QKV = Q + 2 KV, I intermediate,
// V vocabulary.
//
// Two row counts: the parallel regions (q/k/v to o, gate/up to down, the attention, the lm head)
// run on all N rows; the residual stream, the norms (ln1, ln2, the final norm) and the residual
// adds on Nl = Qwen3Acts::rows, which is N, or with sequence parallelism over tp ranks this tp
// rank's N / tp rows [r N/tp, (r + 1) N/tp) of the micro-batch. The ops below that take a row
// count get the one of their buffers; embedding writes, embedding_backward reads, lm_head_loss*
// read xf and write dxf as [Nl, H] (the Ops gather and scatter the rows they need).
//
// The op contract. Ops::Act is the activation element type, Ops::Weight the weights'; weight
// gradients are fp32; rstd and lse are fp32. `acc`: add into the weight gradient (else write it).
//   linear(y, x, w, N, in, out)                         y[N, out] = x[N, in] w[out, in]^T
//   linear_backward(dx, dw, dy, x, w, N, in, out, acc)   dx = dy w (skipped when null), dw += dy^T x
//   qk_norm_rope(out, rstd, x, ld, w, heads)            out[N, heads*hd] = rope(rmsnorm_hd(x))
//                                                       x rows of stride ld
//   qk_norm_rope_backward(dx, dx_ld, dw, dout, x, ld, w, rstd, heads, acc)   dx written
//   copy_columns(dst, dst_ld, src, src_ld, rows, cols)
//   attention(l, out, lse, q, k, v)  /  attention_backward(l, dq, dk, dv, dout, q, k, v, out, lse)
//   rmsnorm(y, rstd, x, w, N)                           C = H
//   rmsnorm_backward(dx, dw, dy, x, w, rstd, N, acc)    dx written
//   residual_rmsnorm(res_out, y, rstd, res_in, x, w, N) res_out = res_in + x; y = rmsnorm(res_out)
//   residual_rmsnorm_backward(dres, dw, dy, x, w, rstd, N, acc)   dres += d rmsnorm(x) / dx * dy
//   residual_add(res_out, res_in, x, N)                 res_out = res_in + x, [N, H]: a pipeline
//       stage's last layer (the next stage norms it). Optional: without it a back end runs only
//       stages that end in the head, the whole model among them.
//   swiglu(h, gu, N, I)                                 h[N, I] = silu(gate) * up, gu [N, 2I]
//   swiglu_backward(dgu, dh, gu, N, I)                  dgu may alias gu
//   embedding(x, ids, wte, N) / embedding_backward(dwte, dx, ids, N, overwrite)   ids [N], x [Nl, H]
//   lora(l, site, x, y) / lora_backward(l, site, x, dy, dx) / lora_adapts(site) / lora_on()
//   lm_head_loss(xf, lm_head, g_lm_head, targets, scale, dxf, acc)   forward and backward of the
//       logits and the summed cross-entropy; xf, dxf [Nl, H], dxf written
//   lm_head_loss_forward(xf, lm_head, targets) / lm_head_loss_backward(xf, lm_head, g_lm_head,
//       targets, scale, dxf): the same in two calls (the CPU keeps the logits between them)
//   take_loss()                                         the summed loss of this micro-batch
// Qwen3-MoE (model.num_experts > 0; qwen3-spec.md 3), a sparse layer's block in place of the MLP:
//   moe_begin()                                         a micro-batch's forward starts: its
//       load-balancing statistics (pooled over the MoE layers, as transformers) restart
//   moe(l, y, probs, idx, rw, x, router, gate_up, down, stats)   y [N, H] = the routed experts of
//       x [N, H]; writes the router's probs [N, E] (float), idx [N, k] and routing weights
//       rw [N, k]; stats: add them to the micro-batch's statistics (false when recomputing);
//       gate_up [El, 2 Im, H] and down [El, H, Im] are the experts stored here
//       (El = E / expert_shards)
//   moe_backward(l, dx, g_router, g_gate_up, g_down, dy, x, probs, idx, rw, router, gate_up,
//       down, acc)                                      dx [N, H] written; with the statistics
//       of the whole micro-batch, the load-balancing loss's gradient joins the router's
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "qtrain/error.h"
#include "qtrain/model_config.h"
#include "qtrain/params.h"
#include "qtrain/shard_plan.h"

namespace qt {

// The places LoRA adapters attach, in forward order: each is one fused projection's output.
//   kQKV: x = rmsnorm 1 [N, H], y = [q | k | v]     kO: x = attention [N, Q], y = [N, H]
//   kGateUp: x = rmsnorm 2 [N, H], y = [gate | up]  kDown: x = swiglu [N, I], y = [N, H]
enum class LoraSite { kQKV, kO, kGateUp, kDown };

// The collective hooks of the program (NoCollectives: no-ops). Each takes the buffer it may
// write (`full` [rows, cols] or `local` [rows / tp, cols]; null unless sequence parallelism is
// on) and the one it reads, and returns the buffer the next op reads: the input itself (an
// all-reduce in place, or nothing) or the buffer it wrote. rows is N, always the whole
// micro-batch's; elements of the back end's activation type.
struct NoCollectives {
  // Before a block's column-parallel GEMMs (q/k/v, gate/up), on its normed input x: sequence
  // parallelism all-gathers the tp ranks' rows [rows / tp, cols] into full. Its backward, on
  // the input gradient dx [rows, cols] (partial over tp): tensor parallelism all-reduces it in
  // place, sequence parallelism reduce-scatters it into local.
  template <class A>
  A* tp_block_input(A* /*full*/, A* x, int /*rows*/, int /*cols*/) {
    return x;
  }
  template <class A>
  A* tp_block_input_backward(A* /*local*/, A* dx, int /*rows*/, int /*cols*/) {
    return dx;
  }
  // After a block's row-parallel GEMM (o, down), on its output y [rows, cols] (partial over
  // tp): tensor parallelism all-reduces it in place, sequence parallelism reduce-scatters it
  // into local. Its backward, on the gradient dy: sequence parallelism all-gathers the rows
  // [rows / tp, cols] into full.
  template <class A>
  A* tp_block_output(A* /*local*/, A* y, int /*rows*/, int /*cols*/) {
    return y;
  }
  // Just before that GEMM, with tp_block_output's arguments: the next linear writes y, which
  // tp_block_output then reduces, so a back end may run the GEMM in row pieces and reduce each
  // piece while the next one computes (the CUDA back end; tp_block_output still follows).
  template <class A>
  void tp_block_output_ahead(A* /*local*/, A* /*y*/, int /*rows*/, int /*cols*/) {}
  template <class A>
  A* tp_block_output_backward(A* /*full*/, A* dy, int /*rows*/, int /*cols*/) {
    return dy;
  }
};

// What one layer keeps from its forward for its backward (one shared set with recompute).
template <class A>
struct LayerActs {
  A* qkv_raw;              // [N, QKV] before q/k norm
  float *q_rstd, *k_rstd;  // [N*nh], [N*nkv]
  A *q, *k, *v;            // [N, Q], [N, KV], [N, KV] after norm and rope
  A* att;                  // [N, Q]
  float* lse;              // [B, nh, T]
  A *x_mid, *ln2;          // [Nl, H] (Qwen3Acts::rows)
  float* rstd2;            // [Nl]
  A* gu;                   // [N, 2I] (dense layers)
  A* h;                    // [N, I] (dense layers)
  // A sparse (MoE) layer's router output: probabilities [N, E] (fp32 on every back end, as
  // transformers' softmax), the k experts of each row [N, k] and their routing weights [N, k]
  // (the activation type: bf16 on CUDA, as transformers); null in dense layers.
  float* moe_probs = nullptr;
  int* moe_idx = nullptr;
  A* moe_w = nullptr;
  // Sequence parallelism: ln1 and ln2 gathered over tp, the column-parallel GEMMs' inputs, kept
  // for their weight gradients (null without: those read ln and ln2 themselves).
  A* ln1_full = nullptr;   // [N, H]
  A* ln2_full = nullptr;   // [N, H]
};

// Every activation buffer of the program for micro-batches of B x T tokens. Nl = rows: N, or
// with sequence parallelism this tp rank's N / tp (the layer program's two row counts).
template <class A>
struct Qwen3Acts {
  int rows = 0;                 // Nl
  std::vector<A*> x;            // [L+1] residual stream [Nl, H]; x[l] is layer l's input
  std::vector<A*> ln;           // [L+1] rmsnorm(x[l]) [Nl, H]; ln[L] is the final norm
  std::vector<float*> rstd;     // [L+1] [Nl]
  std::vector<LayerActs<A>> layer;  // [L], or [1] shared by every layer with recompute
  A *tmp, *dtmp, *dln;          // [N, H] scratch
  A* dx;                        // [Nl, H] d residual stream
  A *dh, *datt, *dq, *dk, *dv;  // [N, I], [N, Q], [N, Q], [N, KV], [N, KV]
  A* dqkv;                      // [N, QKV]
  A* dhead;  // [Nl, H] d ln[L] from the head to the backward: dtmp, or a slot's own (below)
  // Sequence parallelism: a block's output or input gradient reduce-scattered to this rank's
  // rows, read by the residual op right after (null without).
  A* tmp_local = nullptr;       // [Nl, H]
};

// The part of the model one pipeline stage runs: layers [first_layer, last_layer), with the
// embedding on the first stage and the final norm, lm head and loss on the last. Across the
// boundary after layer b - 1 travels x[b] [Nl, H] forward and d x[b] [Nl, H] backward; the
// receiving stage norms x[b] itself (its first layer's ln1), so the sender never reads it.
struct StageRange {
  int first_layer = 0, last_layer = 0;
  bool has_embedding = true;  // first stage: reads token ids (first_layer == 0)
  bool has_head = true;       // last stage: final norm, lm head, loss (last_layer == L)

  static StageRange whole(int L) { return {0, L, true, true}; }
  // Layers [first, last) of a model of L layers, the ends where they belong.
  static StageRange layers(int L, int first, int last) {
    return {first, last, first == 0, last == L};
  }
};

// " layers a..b with the embedding ..." for a back end's description.
inline std::string describe(const StageRange& st) {
  return " layers " + std::to_string(st.first_layer) + ".." + std::to_string(st.last_layer - 1) +
         (st.has_embedding ? " with the embedding" : "") +
         (st.has_head ? " with the final norm and lm head" : "");
}

// Checks that `st` is a stage of `c`'s model: 0 <= first < last <= L (first == last only for a
// model without layers), the ends where they belong.
inline void check_stage(const ModelConfig& c, const StageRange& st) {
  QT_CHECK(0 <= st.first_layer && st.first_layer <= st.last_layer &&
               st.last_layer <= c.num_layers && st.has_embedding == (st.first_layer == 0) &&
               st.has_head == (st.last_layer == c.num_layers) &&
               (st.first_layer < st.last_layer || c.num_layers == 0),
           "stage of layers [{}, {}) of {} (embedding {}, head {})", st.first_layer,
           st.last_layer, c.num_layers, st.has_embedding, st.has_head);
}

// Activations of a stage for `slots` micro-batches in flight between forward and backward (1F1B:
// P - s on stage s). Each slot has its own x, ln, rstd [Nl, H] of layers [first, last] (null
// elsewhere, so indices stay global) and, without recompute, LayerActs of its layers; the one
// shared recompute LayerActs and the scratch are common to all slots. dhead is the slot's own
// on a last stage with several slots (its head runs in the forward), else dtmp. One whole-model
// slot is allocate_acts below, in that function's order. seq_parallel: the tp ranks sequence
// parallelism splits the rows over (Nl = N / seq_parallel; 1: none, and nothing else is
// allocated then).
template <class A, class Alloc>
std::vector<Qwen3Acts<A>> allocate_stage_acts(const ModelConfig& c, int B, int T, bool recompute,
                                              const StageRange& st, int slots, Alloc& alloc,
                                              int seq_parallel = 1) {
  const std::size_t N = static_cast<std::size_t>(B) * T, H = c.hidden_size, Q = c.q_dim();
  const std::size_t KV = c.kv_dim(), I = c.intermediate_size, L = c.num_layers;
  const std::size_t E = c.num_experts, K = c.num_experts_per_tok;
  check_stage(c, st);
  // The layers of the stage: a dense one needs gu, h and the scratch dh; a sparse one the router
  // output. With recompute the one shared LayerActs serves both kinds.
  bool any_dense = false, any_moe = false;
  for (int l = st.first_layer; l < st.last_layer; ++l) (c.is_moe_layer(l) ? any_moe : any_dense) = true;
  QT_CHECK(slots >= 1, "{} activation slots", slots);
  QT_CHECK(seq_parallel >= 1 && N % static_cast<std::size_t>(seq_parallel) == 0,
           "{} rows split over {} sequence-parallel ranks", N, seq_parallel);
  const bool sp = seq_parallel > 1;
  const std::size_t Nl = N / static_cast<std::size_t>(seq_parallel);
  std::vector<Qwen3Acts<A>> s(static_cast<std::size_t>(slots));
  for (std::size_t k = 0; k < s.size(); ++k) {
    Qwen3Acts<A>& a = s[k];
    a.rows = static_cast<int>(Nl);
    a.x.assign(L + 1, nullptr);
    a.ln.assign(L + 1, nullptr);
    a.rstd.assign(L + 1, nullptr);
    for (int l = st.first_layer; l <= st.last_layer; ++l) {
      a.x[l] = alloc.template allocate<A>(Nl * H);
      a.ln[l] = alloc.template allocate<A>(Nl * H);
      a.rstd[l] = alloc.template allocate<float>(Nl);
    }
    a.layer.resize(recompute ? 1 : L);
    if (recompute && k > 0) {
      a.layer = s[0].layer;  // shared
      continue;
    }
    for (std::size_t i = 0; i < a.layer.size(); ++i) {
      if (!recompute && (i < std::size_t(st.first_layer) || i >= std::size_t(st.last_layer)))
        continue;
      LayerActs<A>& la = a.layer[i];
      la.qkv_raw = alloc.template allocate<A>(N * (Q + 2 * KV));
      la.q_rstd = alloc.template allocate<float>(N * c.num_heads);
      la.k_rstd = alloc.template allocate<float>(N * c.num_kv_heads);
      la.q = alloc.template allocate<A>(N * Q);
      la.k = alloc.template allocate<A>(N * KV);
      la.v = alloc.template allocate<A>(N * KV);
      la.att = alloc.template allocate<A>(N * Q);
      la.lse = alloc.template allocate<float>(static_cast<std::size_t>(B) * c.num_heads * T);
      la.x_mid = alloc.template allocate<A>(Nl * H);
      la.ln2 = alloc.template allocate<A>(Nl * H);
      la.rstd2 = alloc.template allocate<float>(Nl);
      const bool dense = recompute ? any_dense : !c.is_moe_layer(static_cast<int>(i));
      const bool moe = recompute ? any_moe : c.is_moe_layer(static_cast<int>(i));
      if (dense) {
        la.gu = alloc.template allocate<A>(N * 2 * I);
        la.h = alloc.template allocate<A>(N * I);
      }
      if (moe) {
        la.moe_probs = alloc.template allocate<float>(N * E);
        la.moe_idx = alloc.template allocate<int>(N * K);
        la.moe_w = alloc.template allocate<A>(N * K);
      }
      if (sp) {
        la.ln1_full = alloc.template allocate<A>(N * H);
        la.ln2_full = alloc.template allocate<A>(N * H);
      }
    }
  }
  Qwen3Acts<A>& a = s[0];
  a.tmp = alloc.template allocate<A>(N * H);
  a.dx = alloc.template allocate<A>(Nl * H);
  a.dtmp = alloc.template allocate<A>(N * H);
  a.dln = alloc.template allocate<A>(N * H);
  a.dh = any_dense ? alloc.template allocate<A>(N * I) : nullptr;
  a.datt = alloc.template allocate<A>(N * Q);
  a.dq = alloc.template allocate<A>(N * Q);
  a.dk = alloc.template allocate<A>(N * KV);
  a.dv = alloc.template allocate<A>(N * KV);
  a.dqkv = alloc.template allocate<A>(N * (Q + 2 * KV));
  if (sp) a.tmp_local = alloc.template allocate<A>(Nl * H);
  a.dhead = a.dtmp;
  for (std::size_t k = 1; k < s.size(); ++k) {  // slot 0's scratch, the slot's own x .. layer
    Qwen3Acts<A> own = std::move(s[k]);
    s[k] = a;
    s[k].x = std::move(own.x);
    s[k].ln = std::move(own.ln);
    s[k].rstd = std::move(own.rstd);
    s[k].layer = std::move(own.layer);
  }
  if (st.has_head && slots > 1)
    for (Qwen3Acts<A>& sk : s) sk.dhead = alloc.template allocate<A>(Nl * H);
  return s;
}

// Allocates Qwen3Acts of the whole model from `alloc` (alloc.template allocate<T>(count)), in a
// fixed order: x, ln, rstd of each l, the LayerActs, the scratch.
template <class A, class Alloc>
Qwen3Acts<A> allocate_acts(const ModelConfig& c, int B, int T, bool recompute, Alloc& alloc,
                           int seq_parallel = 1) {
  return allocate_stage_acts<A>(c, B, T, recompute, StageRange::whole(c.num_layers), 1, alloc,
                                seq_parallel)[0];
}

// The program's fused q/k/v and gate/up GEMMs read wq, wk, wv (and w_gate, w_up) as one matrix:
// checks that the layout keeps them adjacent.
inline void check_fused_layout(const ModelConfig& cfg, const ModelOffsets& off) {
  const std::size_t Q = cfg.q_dim(), KV = cfg.kv_dim(), H = cfg.hidden_size;
  const std::size_t I = cfg.intermediate_size;
  for (const LayerOffsets& o : off.layers)
    QT_CHECK(o.wk == o.wq + Q * H && o.wv == o.wk + KV * H && (o.moe || o.w_up == o.w_gate + I * H),
             "q/k/v_proj and gate/up_proj must be adjacent in the parameter layout");
}

// Layer l's tensors inside its unit's buffer (weights or gradients; a null unit gives nulls).
// wq is [QKV, H] (wq, wk, wv adjacent), w_gate [2I, H] (w_gate, w_up adjacent). A sparse layer
// has router [E, H], experts_gate_up [E, 2 Im, H] and experts_down [E, H, Im] instead of w_gate
// and w_down (null).
template <class T>
struct LayerTensors {
  T *ln1, *wq, *wo, *q_norm, *k_norm, *ln2, *w_gate, *w_down;
  T* router = nullptr;
  T* experts_gate_up = nullptr;
  T* experts_down = nullptr;
};

// The residual stream in and out of one layer's forward, and its scratch. The training program
// gives each layer its own x and ln (Qwen3Acts); a KV-cache decoder runs in place (x_in ==
// x_out, with LayerActs::x_mid the same buffer; ln_in, ln2 and ln_out one buffer; rstd2 and
// rstd_out one), which every op allows: residual_rmsnorm adds element by element before its norm,
// and each ln is dead before the next is written.
template <class A>
struct LayerIO {
  const A* x_in;    // [Nl, H] the layer's input
  A* ln_in;         // [Nl, H] rmsnorm(x_in) with the layer's ln1 (the previous op made it)
  A* x_out;         // [Nl, H] the layer's output
  A* ln_out;        // [Nl, H] rmsnorm(x_out) with next_norm
  float* rstd_out;  // [Nl]
  A* tmp;           // [N, H] scratch
  // Sequence parallelism (Qwen3Acts' fields): Nl, the rows of the buffers above, and the
  // reduce-scattered block output [Nl, H]. Without: 0 (Nl = N) and null.
  int rows = 0;
  A* tmp_local = nullptr;
  // A sparse layer adds its router output to the micro-batch's load statistics (not when
  // recomputing, nor in a decoder).
  bool moe_stats = false;
};

// res_out = res_in + x [N, H] through the optional op residual_add (see the contract).
template <class Ops, class A>
void residual_add(Ops& ops, A* res_out, const A* res_in, const A* x, int N) {
  if constexpr (requires { ops.residual_add(res_out, res_in, x, N); })
    ops.residual_add(res_out, res_in, x, N);
  else
    QT_CHECK(false, "this back end has no residual_add: its stages must end in the head");
}

// One Qwen3 layer's forward over N rows, the op sequence of training, recompute and the KV-cache
// decoders (src/generate/kv_decoder*.cpp, whose Ops attend over their cache and write k and v
// into it). next_norm: the input norm weight of layer l + 1, or the final norm's after the last
// layer, or null at a pipeline stage's end (ln_out and rstd_out are then not written). Writes
// every field of `a` (lse as the Ops' attention does).
template <class Ops>
void qwen3_layer_forward(Ops& ops, const ModelConfig& cfg, int l, int N,
                         const LayerTensors<const typename Ops::Weight>& w,
                         const typename Ops::Weight* next_norm, const LayerIO<typename Ops::Act>& io,
                         LayerActs<typename Ops::Act>& a) {
  const int H = cfg.hidden_size, Q = cfg.q_dim(), KV = cfg.kv_dim();
  const int I = cfg.intermediate_size, QKV = Q + 2 * KV;
  const int Nl = io.rows > 0 ? io.rows : N;  // the residual stream's rows (sequence parallelism)
  // attention block: x_mid = x + o_proj(attention(rope(norm(q, k)), v)) of rmsnorm(x)
  auto* ln1 = ops.tp_block_input(a.ln1_full, io.ln_in, N, H);  // [N, H]
  ops.linear(a.qkv_raw, ln1, w.wq, N, H, QKV);  // wq, wk, wv: one [QKV, H] matrix
  ops.lora(l, LoraSite::kQKV, ln1, a.qkv_raw);
  ops.qk_norm_rope(a.q, a.q_rstd, a.qkv_raw, QKV, w.q_norm, cfg.num_heads);
  ops.qk_norm_rope(a.k, a.k_rstd, a.qkv_raw + Q, QKV, w.k_norm, cfg.num_kv_heads);
  ops.copy_columns(a.v, KV, a.qkv_raw + Q + KV, QKV, N, KV);
  ops.attention(l, a.att, a.lse, a.q, a.k, a.v);
  ops.tp_block_output_ahead(io.tmp_local, io.tmp, N, H);
  ops.linear(io.tmp, a.att, w.wo, N, Q, H);
  ops.lora(l, LoraSite::kO, a.att, io.tmp);
  const auto* o = ops.tp_block_output(io.tmp_local, io.tmp, N, H);  // [Nl, H]
  ops.residual_rmsnorm(a.x_mid, a.ln2, a.rstd2, io.x_in, o, w.ln2, Nl);
  // MLP block: x_out = x_mid + down(silu(gate(ln2)) * up(ln2)), then the next norm; in a
  // sparse layer the routed experts' weighted sum instead
  auto* ln2 = ops.tp_block_input(a.ln2_full, a.ln2, N, H);  // [N, H]
  if (w.router) {
    if constexpr (requires { ops.moe_begin(); }) {
      ops.moe(l, io.tmp, a.moe_probs, a.moe_idx, a.moe_w, ln2, w.router, w.experts_gate_up,
              w.experts_down, io.moe_stats);
    } else {
      QT_CHECK(false, "this back end has no Qwen3-MoE block");
    }
  } else {
    ops.linear(a.gu, ln2, w.w_gate, N, H, 2 * I);  // w_gate, w_up: one [2I, H]
    ops.lora(l, LoraSite::kGateUp, ln2, a.gu);
    ops.swiglu(a.h, a.gu, N, I);
    ops.tp_block_output_ahead(io.tmp_local, io.tmp, N, H);
    ops.linear(io.tmp, a.h, w.w_down, N, I, H);
    ops.lora(l, LoraSite::kDown, a.h, io.tmp);
  }
  const auto* down = ops.tp_block_output(io.tmp_local, io.tmp, N, H);  // [Nl, H]
  if (next_norm)
    ops.residual_rmsnorm(io.x_out, io.ln_out, io.rstd_out, a.x_mid, down, next_norm, Nl);
  else  // a pipeline stage's last layer: x_out only, the next stage norms it
    residual_add(ops, io.x_out, a.x_mid, down, Nl);
}

// A layer's tensors from its flat offsets, each through at(offset) (a dense layer's MLP or a
// sparse layer's router and experts; the other set null).
template <class T, class At>
LayerTensors<T> layer_tensors_at(const LayerOffsets& o, At at) {
  LayerTensors<T> t{at(o.ln1),    at(o.wq),  at(o.wo), at(o.q_norm),
                    at(o.k_norm), at(o.ln2), nullptr,  nullptr};
  if (o.moe) {
    t.router = at(o.router);
    t.experts_gate_up = at(o.experts_gate_up);
    t.experts_down = at(o.experts_down);
  } else {
    t.w_gate = at(o.w_gate);
    t.w_down = at(o.w_down);
  }
  return t;
}

// Layer l's tensors in a flat buffer of the whole model (ParamLayout order), for callers without
// units (the KV-cache decoders).
template <class T>
LayerTensors<T> layer_tensors(const LayerOffsets& o, T* flat) {
  return layer_tensors_at<T>(o, [flat](std::size_t off) { return flat + off; });
}

// The Qwen3 model over Ops (the contract above) for micro-batches of B x T tokens, or one
// pipeline stage of it (StageRange) with several micro-batches in flight (slots). The whole
// model is the one-stage, one-slot case: forward, head_*, backward below.
template <class Ops>
class Qwen3Program {
 public:
  using A = typename Ops::Act;
  using W = typename Ops::Weight;

  Qwen3Program(const ModelConfig& cfg, int B, int T, bool recompute, Qwen3Acts<A> acts)
      : Qwen3Program(cfg, B, T, recompute, StageRange::whole(cfg.num_layers), {std::move(acts)}) {}
  // A stage over its slots' activations (allocate_stage_acts with the same stage and B, T).
  Qwen3Program(const ModelConfig& cfg, int B, int T, bool recompute, const StageRange& stage,
               std::vector<Qwen3Acts<A>> slots)
      : cfg_(cfg),
        layout_(cfg),
        plan_(plan_qwen3(cfg, layout_, MeshShape{}, 0)),
        unit_{cfg.num_layers},
        N_(B * T),
        recompute_(recompute),
        st_(stage),
        slots_(std::move(slots)) {
    check_fused_layout(cfg, off_);
    check_stage(cfg, st_);
    // An ep rank's local model keeps each sparse layer's experts in a unit of their own.
    experts_unit_.assign(cfg.num_layers, -1);
    for (int l = 0, m = 0; l < cfg.num_layers && cfg.expert_shards > 1; ++l)
      if (cfg.is_moe_layer(l)) experts_unit_[l] = unit_.experts(m++);
    QT_CHECK(!slots_.empty() && slots_[0].x.size() == off_.layers.size() + 1,
             "activations of another model");
    Nl_ = slots_[0].rows;
    for (const Qwen3Acts<A>& a : slots_)
      QT_CHECK(a.rows == Nl_ && Nl_ >= 1 && N_ % Nl_ == 0,
               "activations of {} rows for micro-batches of {}", a.rows, N_);
  }

  const ModelConfig& config() const { return cfg_; }
  const ParamLayout& layout() const { return layout_; }
  // The units the program asks for (a plan for dp 1: unit ranges do not depend on dp).
  const ShardPlan& units() const { return plan_; }
  const StageRange& stage() const { return st_; }
  int slots() const { return static_cast<int>(slots_.size()); }
  const Qwen3Acts<A>& acts(int slot = 0) const { return slots_.at(slot); }
  // The residual stream's rows: N, or with sequence parallelism this tp rank's N / tp.
  int local_rows() const { return Nl_; }

  // The units the stage asks for, ascending: its layers, the embedding on the first stage, the
  // head on the last, and the embedding there too when tied (a pipeline's last stage holds a
  // copy of the table; the two copies' gradients are summed before the step).
  std::vector<int> stage_units() const {
    std::vector<int> u;
    if (st_.has_embedding || (st_.has_head && cfg_.tie_word_embeddings)) u.push_back(unit_.embed());
    for (int l = st_.first_layer; l < st_.last_layer; ++l) u.push_back(unit_.layer(l));
    if (st_.has_head) u.push_back(unit_.head());
    for (int l = st_.first_layer; l < st_.last_layer; ++l)
      if (experts_unit_[l] >= 0) u.push_back(experts_unit_[l]);
    return u;
  }

  // Embedding, layers, final norm: leaves rmsnorm(x[L]) in acts().ln[L]. Asks for layer l + 1
  // (or the head) while it runs layer l, whose last op reads the next unit's input norm. Keeps
  // the head (and a tied embedding) acquired for the head and the backward.
  template <class Units>
  void forward(Ops& ops, Units& units, const std::int32_t* inputs) {
    forward_stage(ops, units, 0, inputs, nullptr);
  }

  // The stage's forward of the micro-batch in `slot`: from token ids `inputs` [N] (first stage)
  // or x_in = x[first] [Nl, H] (received; copied unless it is stage_input(slot)). Leaves x[last]
  // in stage_output(slot) (to send), or on the last stage rmsnorm(x[L]) in acts(slot).ln[L] for
  // the head. The slot's activations live until its backward_stage.
  template <class Units>
  void forward_stage(Ops& ops, Units& units, int slot, const std::int32_t* inputs, const A* x_in) {
    select(slot);
    const int N = N_, Nl = Nl_, H = cfg_.hidden_size, first = st_.first_layer;
    const int last = st_.last_layer, E = unit_.embed(), Hd = unit_.head();
    Qwen3Acts<A>& a = *a_;
    if (st_.has_embedding) {
      ops.embedding(a.x[first], inputs, units.weights(E), N);
      if (!(cfg_.tie_word_embeddings && st_.has_head)) units.release(E);  // tied: the head's too
    } else if (x_in != a.x[first]) {
      ops.copy_columns(a.x[first], H, x_in, H, Nl, H);
    }
    // The stage's first norm: its first layer's ln1, or the final norm (no layers).
    const int entry = first < last ? unit_.layer(first) : st_.has_head ? Hd : -1;
    if constexpr (requires { ops.moe_begin(); })
      if (cfg_.is_moe()) ops.moe_begin();
    if (entry >= 0) ops.rmsnorm(a.ln[first], a.rstd[first], a.x[first], norm_of(units, entry), Nl);
    for (int l = first; l < last; ++l) {
      const int u = unit_.layer(l), xu = experts_unit_[l];
      const W* next_norm = ends_stage(l) ? nullptr : norm_of(units, next(l));
      const W* experts = xu >= 0 ? units.weights(xu) : nullptr;
      layer_forward(ops, l, tensors(l, units.weights(u), experts), next_norm);
      units.release(u);
      if (xu >= 0) units.release(xu);
    }
  }
  // [Nl, H] x[first] of a slot, where a receive may write before forward_stage (non-first stage).
  A* stage_input(int slot) { return slots_.at(slot).x[st_.first_layer]; }
  // [Nl, H] x[last] of a slot after forward_stage: what a non-last stage sends.
  const A* stage_output(int slot) const { return slots_.at(slot).x[st_.last_layer]; }

  // The lm head and the loss, forward and backward in one (leaves d ln[L] in acts(slot).dhead).
  // A pipeline's last stage runs it right after forward_stage (its loss scale is known then).
  template <class Units>
  void head_forward_backward(Ops& ops, Units& units, const std::int32_t* targets,
                             float loss_scale, bool accumulate, int slot = 0) {
    QT_CHECK(st_.has_head, "the head of a stage without it");
    const HeadTensors h = head(units, true);
    Qwen3Acts<A>& a = slots_.at(slot);
    ops.lm_head_loss(a.ln[cfg_.num_layers], h.lm_head, h.g_lm_head, targets, loss_scale, a.dhead,
                     accumulate);
  }
  // The same in two calls (the forward alone serves evaluation), slot 0.
  template <class Units>
  void head_forward(Ops& ops, Units& units, const std::int32_t* targets) {
    ops.lm_head_loss_forward(slots_[0].ln[cfg_.num_layers], head(units, false).lm_head, targets);
  }
  template <class Units>
  void head_backward(Ops& ops, Units& units, const std::int32_t* targets, float loss_scale) {
    const HeadTensors h = head(units, true);
    ops.lm_head_loss_backward(slots_[0].ln[cfg_.num_layers], h.lm_head, h.g_lm_head, targets,
                              loss_scale, slots_[0].dhead);
  }

  // From d ln[L] (acts().dhead) down: the final norm, layers L-1 .. 0, the embedding. Reports
  // each unit's gradients done in that order. accumulate: add into the gradients (else write
  // them: the first micro-batch of a step). Null gradients: the base is frozen (LoRA).
  template <class Units>
  void backward(Ops& ops, Units& units, const std::int32_t* inputs, bool accumulate) {
    backward_stage(ops, units, 0, inputs, nullptr, accumulate);
  }

  // The stage's backward of the micro-batch in `slot`: from d ln[L] in acts(slot).dhead (last
  // stage) or dx_in = d x[last] [Nl, H] (received; copied unless it is input_grad()). Leaves
  // d x[first] in input_grad() (to send; valid until the next backward_stage), or on the first
  // stage ends in the embedding's gradient. inputs: the slot's token ids (first stage).
  template <class Units>
  void backward_stage(Ops& ops, Units& units, int slot, const std::int32_t* inputs,
                      const A* dx_in, bool accumulate) {
    select(slot);
    const int N = N_, Nl = Nl_, H = cfg_.hidden_size, first = st_.first_layer;
    const int last = st_.last_layer, E = unit_.embed(), Hd = unit_.head();
    const bool tied = cfg_.tie_word_embeddings;
    Qwen3Acts<A>& a = *a_;
    acc_ = accumulate;
    if (st_.has_head) {
      const W* head_w = units.weights(Hd);
      float* g_head = units.grads(Hd);
      QT_CHECK(g_head != nullptr || ops.lora_on(), "a frozen base (no gradients) without LoRA");
      ops.rmsnorm_backward(a.dx, at(Hd, g_head, off_.norm), a.dhead, a.x[last],
                           at(Hd, head_w, off_.norm), a.rstd[last], Nl, acc_);
      units.grads_done(Hd);
      if (tied && !st_.has_embedding) {  // the last stage's copy of a tied table: the head's part
        units.grads_done(E);
        units.release(E);
      }
    } else if (dx_in != a.dx) {
      ops.copy_columns(a.dx, H, dx_in, H, Nl, H);
    }
    for (int l = last - 1; l >= first; --l) {
      const int u = unit_.layer(l), n = ends_stage(l) ? -1 : next(l), xu = experts_unit_[l];
      const W* experts = xu >= 0 ? units.weights(xu) : nullptr;
      const LayerTensors<const W> w = tensors(l, units.weights(u), experts);
      // Recomputing rewrites x[l + 1], ln[l + 1] and rstd[l + 1] with the same values; layer
      // l + 1's backward, their last reader, came before it. It reads the next unit's norm.
      if (recompute_) layer_forward(ops, l, w, n >= 0 ? norm_of(units, n) : nullptr, true);
      if (n >= 0) units.release(n);
      float* g_experts = xu >= 0 ? units.grads(xu) : nullptr;
      layer_backward(ops, l, w, tensors(l, units.grads(u), g_experts));
      if (xu >= 0) {  // the experts' gradients are complete before the layer's router's
        units.grads_done(xu);
        units.release(xu);
      }
      units.grads_done(u);
    }
    if (first < last) units.release(unit_.layer(first));
    if (st_.has_embedding) {
      // An untied embedding's gradient is N rows of dx: a store that reduces over dp may take
      // the rows and ids themselves (and reduce those, not the whole table; not with sequence
      // parallelism, whose dx holds only this rank's rows).
      if (tied || Nl < N || !units.take_embedding_rows(a.dx, inputs, N)) {
        if (float* g_embed = units.grads(E))
          // The embedding backward adds rows: written from zero unless the tied lm head (the
          // same table, on this stage) has already written them.
          ops.embedding_backward(g_embed, a.dx, inputs, N, !acc_ && !(tied && st_.has_head));
        units.grads_done(E);
      }
      if (tied) units.release(E);
    }
    if (st_.has_head && first == last) units.release(Hd);
  }
  // [Nl, H] d x[first] after backward_stage (what a non-first stage sends); a receive of
  // d x[last] may write here before backward_stage.
  A* input_grad() { return slots_[0].dx; }

 private:
  struct HeadTensors {
    const W* lm_head;
    float* g_lm_head;
  };
  template <class Units>
  HeadTensors head(Units& units, bool with_grads) {
    // The head's gradients first: a sharded store takes the first grads() as the start of the
    // backward and prefetches from the head down.
    const int E = unit_.embed(), Hd = unit_.head();
    const W* w = units.weights(Hd);
    float* g = with_grads ? units.grads(Hd) : nullptr;
    if (cfg_.tie_word_embeddings)
      return {units.weights(E), with_grads ? units.grads(E) : nullptr};
    return {at(Hd, w, off_.lm_head), at(Hd, g, off_.lm_head)};
  }

  // The unit after layer l's (layer l + 1, or the head).
  int next(int l) const { return l + 1 < cfg_.num_layers ? unit_.layer(l + 1) : unit_.head(); }
  // A unit's tensor at flat offset `off` (null stays null).
  template <class T>
  T* at(int u, T* base, std::size_t off) const {
    return base ? base + (off - plan_.units[u].range.begin) : nullptr;
  }
  // The input norm weight of unit u: layer l's ln1, or the head's final norm.
  template <class Units>
  const W* norm_of(Units& units, int u) {
    const std::size_t off =
        u == unit_.head() ? off_.norm : off_.layers[static_cast<std::size_t>(u - 1)].ln1;
    return at(u, units.weights(u), off);
  }
  // Layer l's tensors in its unit's buffer, and its experts in theirs when they are a unit of
  // their own (experts_unit_).
  template <class T>
  LayerTensors<T> tensors(int l, T* unit, T* experts = nullptr) const {
    const int u = unit_.layer(l), xu = experts_unit_[l];
    return layer_tensors_at<T>(off_.layers[l], [&](std::size_t off) {
      return xu >= 0 && off >= plan_.units[xu].range.begin ? at(xu, experts, off)
                                                            : at(u, unit, off);
    });
  }
  LayerActs<A>& layer_acts(int l) { return a_->layer[recompute_ ? 0 : l]; }
  // The slot the next ops use (every entry point selects its own first).
  void select(int slot) {
    QT_CHECK(slot >= 0 && slot < slots(), "slot {} of {}", slot, slots());
    a_ = &slots_[static_cast<std::size_t>(slot)];
  }
  // Layer l is the stage's last and the next stage norms its output (x[l + 1] is sent).
  bool ends_stage(int l) const { return l + 1 == st_.last_layer && !st_.has_head; }

  // next_norm: the input norm weight of layer l + 1, or the final norm's after the last layer,
  // or null at a stage's end.
  // recomputing: the backward's second forward (the load statistics are not added again).
  void layer_forward(Ops& ops, int l, const LayerTensors<const W>& w, const W* next_norm,
                     bool recomputing = false) {
    const LayerIO<A> io{a_->x[l],        a_->ln[l], a_->x[l + 1], a_->ln[l + 1],
                        a_->rstd[l + 1], a_->tmp,   Nl_,          a_->tmp_local,
                        !recomputing};
    qwen3_layer_forward(ops, cfg_, l, N_, w, next_norm, io, layer_acts(l));
  }
  // A hook's output buffer: `p` with sequence parallelism, else null (the hooks work in place).
  A* sp_only(A* p) const { return Nl_ < N_ ? p : nullptr; }

  // How far down layer l's backward goes: through its projections in backward order, then to
  // its input (kBelow), unless the base is frozen and nothing below needs a gradient.
  enum Depth { kDown, kGateUp, kO, kQKV, kBelow };
  Depth backward_depth(const Ops& ops, int l, bool frozen) const {
    if (!frozen || l > 0) return kBelow;
    // Frozen base, layer 0: down to the adapter nearest the input (every layer has the same).
    if (ops.lora_adapts(LoraSite::kQKV)) return kQKV;
    if (ops.lora_adapts(LoraSite::kO)) return kO;
    if (ops.lora_adapts(LoraSite::kGateUp)) return kGateUp;
    return kDown;
  }

  // a_->dx holds d x_out on entry and d x_in on return ([Nl, H]).
  void layer_backward(Ops& ops, int l, const LayerTensors<const W>& w, const LayerTensors<float>& g) {
    LayerActs<A>& a = layer_acts(l);
    const int N = N_, Nl = Nl_, H = cfg_.hidden_size, Q = cfg_.q_dim(), KV = cfg_.kv_dim();
    const int I = cfg_.intermediate_size, QKV = Q + 2 * KV;
    // The column-parallel GEMMs' inputs [N, H] as the forward read them.
    const A* ln1 = Nl < N ? a.ln1_full : a_->ln[l];
    const A* ln2 = Nl < N ? a.ln2_full : a.ln2;
    const bool acc = acc_;  // each weight gradient is made once per micro-batch
    // An activation gradient past the depth has no reader: not computed (null dx).
    const Depth depth = backward_depth(ops, l, g.wq == nullptr);
    auto past = [depth](Depth d, A* dx) { return depth > d ? dx : nullptr; };
    // MLP block; dx holds d x_out and becomes d x_mid. gu is overwritten by its gradient.
    const A* dy = ops.tp_block_output_backward(sp_only(a_->dtmp), a_->dx, N, H);  // [N, H]
    if (w.router) {
      // A sparse layer: its adapters, if any, on every expert inside the block (the Ops' LoRA);
      // with a frozen base (null g) its backward still gives d ln2 for the attention adapters
      // below, and ends here in layer 0 when none are.
      if constexpr (requires { ops.moe_begin(); })
        ops.moe_backward(l, a_->dln, g.router, g.experts_gate_up, g.experts_down, dy, ln2,
                         a.moe_probs, a.moe_idx, a.moe_w, w.router, w.experts_gate_up,
                         w.experts_down, acc);
      if (depth == kDown || depth == kGateUp) return;
    } else {
      ops.linear_backward(past(kDown, a_->dh), g.w_down, dy, a.h, w.w_down, N, I, H, acc);
      ops.lora_backward(l, LoraSite::kDown, a.h, dy, past(kDown, a_->dh));
      if (depth == kDown) return;
      ops.swiglu_backward(a.gu, a_->dh, a.gu, N, I);
      ops.linear_backward(past(kGateUp, a_->dln), g.w_gate, a.gu, ln2, w.w_gate, N, H, 2 * I, acc);
      ops.lora_backward(l, LoraSite::kGateUp, ln2, a.gu, past(kGateUp, a_->dln));
      if (depth == kGateUp) return;
    }
    const A* dln = ops.tp_block_input_backward(sp_only(a_->tmp_local), a_->dln, N, H);  // [Nl, H]
    ops.residual_rmsnorm_backward(a_->dx, g.ln2, dln, a.x_mid, w.ln2, a.rstd2, Nl, acc);
    // attention block; dx holds d x_mid and becomes d x_in.
    dy = ops.tp_block_output_backward(sp_only(a_->dtmp), a_->dx, N, H);
    ops.linear_backward(past(kO, a_->datt), g.wo, dy, a.att, w.wo, N, Q, H, acc);
    ops.lora_backward(l, LoraSite::kO, a.att, dy, past(kO, a_->datt));
    if (depth == kO) return;
    ops.attention_backward(l, a_->dq, a_->dk, a_->dv, a_->datt, a.q, a.k, a.v, a.att, a.lse);
    // d q, d k, d v into dqkv rows [dq | dk | dv] for one GEMM against [wq; wk; wv].
    ops.qk_norm_rope_backward(a_->dqkv, QKV, g.q_norm, a_->dq, a.qkv_raw, QKV, w.q_norm, a.q_rstd,
                              cfg_.num_heads, acc);
    ops.qk_norm_rope_backward(a_->dqkv + Q, QKV, g.k_norm, a_->dk, a.qkv_raw + Q, QKV, w.k_norm,
                              a.k_rstd, cfg_.num_kv_heads, acc);
    ops.copy_columns(a_->dqkv + Q + KV, QKV, a_->dv, KV, N, KV);
    ops.linear_backward(past(kQKV, a_->dln), g.wq, a_->dqkv, ln1, w.wq, N, H, QKV, acc);
    ops.lora_backward(l, LoraSite::kQKV, ln1, a_->dqkv, past(kQKV, a_->dln));
    if (depth == kQKV) return;
    dln = ops.tp_block_input_backward(sp_only(a_->tmp_local), a_->dln, N, H);
    ops.residual_rmsnorm_backward(a_->dx, g.ln1, dln, a_->x[l], w.ln1, a_->rstd[l], Nl, acc);
  }

  ModelConfig cfg_;
  ParamLayout layout_;
  ModelOffsets off_ = layout_.model_offsets();
  ShardPlan plan_;
  Qwen3Units unit_;
  std::vector<int> experts_unit_;  // [L] the unit of layer l's experts, or -1: in the layer's
  int N_;  // rows of a micro-batch: B x T
  int Nl_;  // rows of the residual stream: N, or N / tp with sequence parallelism
  bool recompute_;
  bool acc_ = true;
  StageRange st_;
  std::vector<Qwen3Acts<A>> slots_;  // [slots] (one: the whole model's)
  Qwen3Acts<A>* a_ = nullptr;        // the selected slot (select())
};

}  // namespace qt
