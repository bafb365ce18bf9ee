// The step-time model of `qtrain plan` (step_time.h). Times in seconds, bytes and FLOPs as
// doubles: a prediction, not an allocation.
#include "plan/step_time.h"

#include <algorithm>

#include "parallel/pipeline_schedule.h"
#include "parallel/tensor_parallel.h"

namespace qt::plan {

namespace {

// A collective over a group of n ranks on a link of `busbw` bytes/s (nccl-tests' bus
// bandwidth): all-reduce 2 (n - 1) / n of the bytes, all-gather and reduce-scatter (n - 1) / n
// of the whole (gathered) buffer's bytes.
struct Link {
  double busbw = 1, latency = 0;
  double all_reduce(double bytes, int n) const {
    return n <= 1 ? 0 : 2.0 * (n - 1) / n * bytes / busbw + latency;
  }
  double gather(double bytes, int n) const {  // all-gather or reduce-scatter
    return n <= 1 ? 0 : double(n - 1) / n * bytes / busbw + latency;
  }
  double send(double bytes) const { return bytes / busbw + latency; }
};

Link link(bool inside_host, const TopologyConfig& topo, const Rates& r) {
  return inside_host ? Link{topo.intra_host_gbps * 1e9, r.latency_intra_s}
                     : Link{topo.inter_host_gbps * 1e9, r.latency_inter_s};
}

// One stage's share of a micro-batch, in seconds, and what its communication costs.
struct StageCost {
  double fwd = 0, bwd_input = 0, bwd_weight = 0;  // compute: F, and B = I + W
  double tp_fwd = 0, tp_bwd = 0;                   // tp collectives, exposed
  double ep_fwd = 0, ep_bwd = 0;                   // expert all-to-alls, exposed
  double p2p = 0;                                  // one pipeline message, each way
  double dp_fwd = 0, dp_bwd = 0;                   // ZeRO-2/3 beside each micro-batch
  double dp_last = 0;                              // ZeRO-0/1: the whole stage's reduction
  double dp_tail = 0;                              // the reduction after the last backward
  double params = 0;                               // elements the stage holds (tp-local)
  double largest_unit = 0;
  double k = 0;  // Rates::dp_interference
  // A micro-batch's forward and backward with the dp collectives beside them.
  double f() const { return std::max(fwd + tp_fwd + ep_fwd + p2p + k * dp_fwd, dp_fwd); }
  double b() const {
    return std::max(bwd_input + bwd_weight + tp_bwd + ep_bwd + p2p + k * dp_bwd, dp_bwd);
  }
};

}  // namespace

bool group_inside_host(int stride, int size, int world, int gpus_per_host) {
  if (world <= gpus_per_host || size <= 1) return true;
  const long long span = static_cast<long long>(stride) * size;
  return span <= gpus_per_host && gpus_per_host % span == 0;
}

StepTime step_time(const MemoryPlanInput& in, const TopologyConfig& topo, const Rates& r) {
  const std::vector<StageParts> stages = pipeline_stages(in);  // validates
  const MeshShape& mesh = in.mesh;
  const int dp = mesh.dp, tp = mesh.tp, P = mesh.pp, V = mesh.pp_chunks, M = in.micro_batches;
  const int world = mesh.world(), G = topo.gpus_per_host;
  const ModelConfig m = tp_local_config(in.model, tp);  // the tp rank's model
  const double B = in.micro_batch, T = in.seq_len, N = B * T, H = m.hidden_size;
  const double Q = m.q_dim(), KV = m.kv_dim(), I = m.intermediate_size, Vl = m.vocab_size;
  const bool sp = in.sequence_parallel && tp > 1;
  const double Ns = sp ? N / tp : N;
  const ParamUnits units = param_units(m);
  const Link tp_link = link(group_inside_host(1, tp, world, G), topo, r);
  const Link dp_link = link(group_inside_host(tp, dp, world, G), topo, r);
  const Link pp_link = link(world <= G, topo, r);  // some stage boundary crosses hosts otherwise

  // FLOPs a token, forward: a layer's projections, its causal attention, the lm head. A sparse
  // layer (Qwen3-MoE) runs its router [E, H] and k experts of width Im instead of the dense MLP
  // (active parameters only, as ModelConfig::active_params_f64 counts them); layer_flops is the
  // mean over the model's layers (at pp > 1 each stage's layers are costed at that mean: the
  // stages' mix of sparse and dense layers is not modelled).
  const double E = m.num_experts, K = m.num_experts_per_tok, Im = m.moe_intermediate_size;
  const double attn_proj_flops = 2 * H * (Q + 2 * KV) + 2 * Q * H;
  const double sparse_layers = m.is_moe() ? m.num_moe_layers() : 0;
  // A layer's GEMM time a token, forward: its projections at the GEMM rate and, averaged over
  // the layers, the sparse layers' experts at the grouped GEMM's rate.
  const double expert_flops = 6 * H * Im * K;
  const double layer_flops =
      m.is_moe() ? attn_proj_flops + ((m.num_layers - sparse_layers) * 6 * H * I +
                                      sparse_layers * (2 * H * E + expert_flops)) / m.num_layers
                 : 2 * H * (Q + 2 * KV) + 2 * Q * H + 6 * H * I;
  const double layer_expert_flops = sparse_layers * expert_flops / m.num_layers;
  const double layer_gemm_s = (layer_flops - layer_expert_flops) / r.gemm_flops +
                              layer_expert_flops / r.expert_gemm_flops;
  // Expert parallelism (ep > 1): each sparse layer sends its (token, slot) rows [N k, H] bf16 to
  // the experts' ranks and back (dispatch and combine), in the forward and again in the
  // backward: 4 all-to-alls a layer, each (ep - 1) / ep of its 2 N k H bytes over the link of
  // the ep group (ep consecutive dp ranks, tp apart). Not overlapped with the compute.
  const int ep = mesh.ep;
  const Link ep_link = link(group_inside_host(tp, ep, world, G), topo, r);
  const double all_to_all =
      ep > 1 ? double(ep - 1) / ep * 2 * N * K * H / ep_link.busbw + ep_link.latency : 0;
  // The rank's parameters: each sparse layer's experts E / ep (3 E H Im elements in all) and
  // the router [E, H]; at ep > 1 the experts are units of their own (sharded over edp = dp / ep;
  // timed here as if over dp: the update's share per rank, E / ep / edp = E / dp, is the same).
  const double experts_per_layer = 3 * E * H * Im;
  const double moe_layer_params =
      m.is_moe() ? H + Q * H + 2 * KV * H + H * Q + 2 * m.head_dim + H + E * H +
                       (ep == 1 ? experts_per_layer : 0)
                 : 0;
  const double attn_flops = 2 * T * Q;
  const double head_flops = 2 * H * Vl;
  const double act_bytes = 2 * N * H;  // a tp all-reduce's [N, H] bf16 (sp: gather + scatter)
  const double wire = in.grad_reduce_bf16 ? 2 : 4;

  StageCost crit;
  double crit_time = -1;
  for (int s = 0; s < P; ++s) {
    const StageParts& st = stages[static_cast<std::size_t>(s)];
    const double layers = st.layers();
    StageCost c;
    c.k = r.dp_interference;
    const double gemm = N * (layers * layer_gemm_s + (st.head ? head_flops / r.gemm_flops : 0));
    const double attn = N * layers * attn_flops / r.attention_flops;
    const double recompute =
        in.recompute ? N * layers * (layer_gemm_s + attn_flops / r.attention_flops) : 0;
    c.fwd = gemm + attn;
    c.bwd_input = gemm + 2.5 * attn + recompute;  // input gradients (and the recomputation)
    c.bwd_weight = gemm;                          // weight gradients
    if (tp > 1) {  // two all-reduces a layer each way (+ the embedding's, + recomputed ones)
      const double ar = tp_link.all_reduce(act_bytes, tp) + (sp ? tp_link.latency : 0);
      c.tp_fwd = (2 * layers + (st.embedding ? 1 : 0)) * ar + (st.head ? 2 * tp_link.latency : 0);
      c.tp_bwd = (in.recompute ? 4 : 2) * layers * ar;
    }
    if (P > 1) c.p2p = V * pp_link.send(2 * Ns * H);
    const bool holds_embed = st.embedding || st.tied_copy;
    if (ep > 1) {
      c.ep_fwd = 2 * sparse_layers * all_to_all;
      c.ep_bwd = 2 * sparse_layers * all_to_all;
    }
    c.params = (holds_embed ? units.embed : 0) + layers * double(units.layer) +
               (st.head ? units.last : 0);
    c.largest_unit = std::max<double>(layers > 0 ? units.layer : 0, st.head ? units.last : 0);
    if (m.is_moe()) {  // every layer on the one stage
      c.params = (holds_embed ? units.embed : 0) + (layers - sparse_layers) * double(units.layer) +
                 sparse_layers * (moe_layer_params + (ep > 1 ? experts_per_layer / ep : 0)) +
                 (st.head ? units.last : 0);
      c.largest_unit = std::max({sparse_layers < layers ? double(units.layer) : 0.0,
                                 moe_layer_params, ep > 1 ? experts_per_layer / ep : 0.0,
                                 st.head ? double(units.last) : 0.0});
    }
    if (dp > 1) {
      const double n_units = (holds_embed ? 1 : 0) + layers + (st.head ? 1 : 0);
      const double lat = n_units * dp_link.latency;
      // An untied embedding's gradient goes as the micro-batch's rows (ids and bf16 d x of every
      // dp rank) when they are fewer than the table's elements (memory_plan's rule).
      const bool rows = !m.tie_word_embeddings && st.embedding && dp * N * H < units.embed;
      const double scattered = c.params - (rows ? units.embed : 0);
      const double rows_time = rows ? dp_link.gather(dp * N * (2 * H + 4), dp) : 0;
      if (in.zero_stage >= 2) {  // each micro-batch's gradients reduce-scattered in fp32
        const double rs = dp_link.gather(4 * scattered, dp) - dp_link.latency + lat + rows_time;
        const double ag = in.zero_stage == 3 ? dp_link.gather(2 * c.params, dp) + lat : 0;
        c.dp_fwd = ag;
        c.dp_bwd = ag + rs;
        c.dp_tail = holds_embed && st.embedding ? (rows ? rows_time
                                                        : dp_link.gather(4 * units.embed, dp))
                                                : dp_link.gather(4 * c.largest_unit, dp);
      } else {  // ZeRO-0/1: the whole stage once a step, beside the last micro-batch's backward
        c.dp_last = (in.zero_stage == 0 ? dp_link.all_reduce(wire * c.params, dp)
                                        : dp_link.gather(wire * c.params, dp)) -
                    dp_link.latency + lat;
        c.dp_tail = c.dp_last * std::max(units.embed * (holds_embed ? 1.0 : 0.0),
                                         c.largest_unit) / c.params;
      }
    }
    const double t = M * (c.f() + c.b()) + c.dp_last;
    if (t > crit_time) crit_time = t, crit = c;
  }

  StepTime out;
  // The pipeline: the schedule's own simulation with every stage as slow as the slowest.
  double makespan = M * (crit.f() + crit.b());
  if (P > 1) {
    const PipeScheduleConfig cfg = schedule_config(mesh, M);
    PipeCosts costs;
    costs.forward = crit.f() / V;
    costs.backward = crit.b() / V;
    costs.backward_input = std::max(crit.bwd_input + crit.tp_bwd + crit.p2p, crit.dp_bwd) / V;
    costs.backward_weight = crit.bwd_weight / V;
    const PipeSimulation sim = simulate(schedule(cfg), cfg, costs);
    makespan = sim.makespan;
    out.bubble_fraction = sim.bubble;
  }
  out.compute = M * (crit.fwd + crit.bwd_input + crit.bwd_weight);
  out.tp_comm = M * (crit.tp_fwd + crit.tp_bwd);
  out.ep_comm = M * (crit.ep_fwd + crit.ep_bwd);
  out.pp_comm = M * 2 * crit.p2p;
  out.bubble = std::max(0.0, makespan - M * (crit.f() + crit.b()));
  // ZeRO-0/1 reduce beside the last backward; ZeRO-2/3's last unit after it.
  const double dp_hidden_behind =
      std::max(0.0, M * (crit.f() + crit.b()) - out.compute - out.tp_comm - out.ep_comm -
                        out.pp_comm);
  const double last_overlap =
      in.zero_stage <= 1 ? std::max(0.0, crit.dp_last - crit.b()) +
                               r.dp_interference * std::min(crit.dp_last, crit.b())
                         : 0.0;
  out.dp_exposed = dp_hidden_behind + last_overlap + crit.dp_tail;

  // The update of the rank's own elements (its dp shard above ZeRO-0).
  const double owned = in.zero_stage == 0 || dp == 1 ? crit.params : crit.params / dp;
  double update = 30 * owned / r.adamw_bytes_per_s;
  if (in.offload == Offload::kCpu) {
    const double ranks_per_host = std::min(G, world);
    update = std::max(owned * ranks_per_host / r.host_adamw_params_per_s,
                      6 * owned / r.pcie_bytes_per_s);
  }
  if ((in.zero_stage == 1 || in.zero_stage == 2) && dp > 1) {  // updated bf16 shards gathered
    const double ag = dp_link.gather(2 * crit.params, dp);
    update = std::max(update, ag) + dp_link.gather(2 * crit.largest_unit, dp);
  }
  if (P > 1 && in.model.tie_word_embeddings)  // the first and last stages swap the tied gradient
    update += pp_link.send(4 * double(units.embed));
  out.optimizer = update + link(world <= G, topo, r).latency;  // + the gradient norm's sum

  out.total = out.compute + out.tp_comm + out.ep_comm + out.pp_comm + out.bubble +
              out.dp_exposed + out.optimizer;
  const double tokens = double(M) * B * T * dp;
  out.tokens_per_s_per_gpu = tokens / out.total / world;
  // Model FLOPs as bench/summarize_throughput.py counts them: 6 x the parameters in matrix
  // products (the lm head once) + 12 L Q T a token, global sizes.
  // Qwen3-MoE: a sparse layer's router and k of its E experts (bench/moe_slice.sh's count).
  const ModelConfig& g = in.model;
  const double g_sparse = g.is_moe() ? g.num_moe_layers() : 0;
  const double n =
      !g.is_moe()
          ? double(g.num_layers) * (2.0 * g.hidden_size * g.q_dim() +
                                    2.0 * g.hidden_size * g.kv_dim() +
                                    3.0 * g.hidden_size * g.intermediate_size) +
                double(g.vocab_size) * g.hidden_size
          : double(g.num_layers) * (2.0 * g.hidden_size * g.q_dim() +
                                    2.0 * g.hidden_size * g.kv_dim()) +
                (g.num_layers - g_sparse) * 3.0 * g.hidden_size * g.intermediate_size +
                g_sparse * (double(g.num_experts) * g.hidden_size +
                            3.0 * g.num_experts_per_tok * g.hidden_size *
                                g.moe_intermediate_size) +
                double(g.vocab_size) * g.hidden_size;
  const double model_flops = 6 * n + 12.0 * g.num_layers * g.q_dim() * T;
  out.mfu = model_flops * out.tokens_per_s_per_gpu / r.peak_flops;
  return out;
}

}  // namespace qt::plan
