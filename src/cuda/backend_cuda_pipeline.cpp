// The CUDA back end with pipeline parallelism (mesh.pp > 1; issue 17): each pp rank
// runs one stage of the model, the layer program over CudaOps for its chunks (chunk c of the
// plan's pp x pp_chunks on stage c % pp; the embedding in the first chunk, the final norm, lm
// head and loss in the last), over ShardedCudaState holding only that stage's units. A step
// runs the stage's list from parallel/pipeline_schedule.h (1F1B, or interleaved 1F1B with
// mesh.pp_chunks > 1; ZB-H1 with mesh.pp_schedule = zb-h1, interleaved or not) as the CPU
// pipeline does (train/backend_cpu_pipeline.cpp):
//
//   F(c, m)  chunk c > 0 receives x [N, H] of micro-batch m into its slot; the forward; the last
//            chunk runs the head and the loss in the forward; c < C - 1 sends its output on
//   B(c, m)  chunk c < C - 1 receives d x [N, H]; the backward; c > 0 sends d x back; the slot
//            is free
//   I(c, m)  as B, with the slot's deferral queue set: each projection's weight-gradient GEMM
//            is queued (CudaOps::defer_weight_grads), not run; the slot stays busy
//   W(c, m)  the slot's queued GEMMs (CudaOps::run_deferred); the slot is free
//
// A queued GEMM reads x and gate/up's output gradient in the slot's activations (kept until W:
// ZB-H1 runs without recompute) and o's, down's and q/k/v's output gradients from copies in the
// slot's own store ([layers x N x (Q + 2 KV + 2 H)] bf16 a slot of each chunk, from the arena at
// set-up), since the backward's scratch is rewritten by the next layer.
//
// Each step measures its bubble: timing events on the compute stream at the start and around
// each action's compute (after its waits for received buffers); after the step, 1 - (the
// stages' summed action times) / (P x the longest stage's span from its start to its last
// action's end), the idle share of the step as simulate() defines it (pipeline_idle()).
//
// Everything is enqueued without waiting on the host: the compute stream and one stream per
// point-to-point channel, ordered by events. A channel is a device communicator of the pp group
// of its own (Mesh::device(kPp, channel)) carrying one kind of traffic in one direction
// (activations forward, gradients back, and with interleaving each of their wraps from the last
// stage to the first and back), so that no send ever queues behind a receive it waits for; each
// channel's sends on one stage come in the order its peer receives them (checked at start-up
// on every stage's list). A receive waits for the compute stream's work so far (its buffer's
// last reader); the compute stream waits for the receive, and, before it rewrites a slot or the
// input gradient, for the send that reads it.
//
// A tied embedding lives on the first stage and, as a copy, on the last: before each step the
// two add each other's gradients (a + b and b + a: the same bits), so AdamW keeps the copies
// equal; the first stage's counts in the gradient norm. The loss and the norm are summed over
// pp. With mesh.tp > 1 each stage is split over its tp group (cuda_ops.h). With mesh.dp > 1 each
// stage's state reduces its gradients over its dp group in the step (ZeRO-0: all-reduce, ZeRO-1:
// reduce-scatter and the updated shards all-gathered), after the tied copies are summed.
//
// Qwen3-MoE (as the CPU pipeline, train/backend_cpu_pipeline.cpp): each sparse layer of the stage
// keeps its routing and expert activations a slot of its chunk (CudaOps' moe_slots; selected with
// moe_select beside the slot's dense activations; with recompute the expert activations are one
// shared set that the recomputed forward rewrites), and each (chunk, slot) its micro-batch's load
// statistics (CudaOps::MoeBalance: sums [2, E] doubles on the device, the (layer, token) pairs
// on the host, known from the layer split). The load-balancing loss pools them over all sparse
// layers, so they ride beside the activations on the same channel: F(c, m) receives the chunks
// before c's sums (c > 0), adds its layers' and sends them on; the last chunk keeps the whole
// micro-batch's (its aux loss, computed after the step); B(c, m) / I(c, m) receives the whole
// sums beside d x (c < C - 1) for the aux loss's gradient and sends them back beside its own.
// The MoE block's weight gradients (grouped GEMMs, router) are made in B or I at once, never
// deferred to W. The step's aux losses and the sparse layers' load are summed over pp. With
// mesh.ep > 1 each stage stores its ep rank's E / ep experts of its sparse layers (ep_local_config;
// their units reduced over the stage's expert-dp group by the state) and CudaOps exchanges the
// rows over the ep group (cuda_ops_moe_ep.cpp) with each slot's counts and expert-order maps
// kept for its backward: the ep group's ranks are one stage's dp ranks, which run the same list
// of actions, so their all-to-alls pair up in order; each sparse layer's forward waits on the
// host for its counts (after the activation it routes has arrived), as a blocking receive would.
//
// With [lora] (as the CPU pipeline, train/backend_cpu_pipeline.cpp, and the one-stage LoRA
// back end, backend_cuda_lora.cpp) the stage holds its units of the base as frozen bf16 weights
// only (FrozenUnits: no gradients, no master copy; the tied embedding on both ends, read from
// the same weights) and trains the adapters of its chunks' layers: one LoraCuda over those
// layer ranges (an xa a slot), bound to ShardedCudaState's units of plan_adapters (ZeRO-0 or 1;
// reduced over dp, or the experts' over expert-dp, in the step; the norm summed over pp). Each
// action keys the dropout masks with its micro-batch's first sequence and selects its slot's xa;
// ZB-H1's weight halves are empty (no base weight gradients). lora_map takes the stage's
// adapters to the global PEFT tensors. On a Qwen3-MoE model the routers and experts are frozen
// units (their blocks' backward d x only, the rows still exchanged over ep), adapters on every
// expert run beside them (each slot its xa; their gradients in the input half), and the load
// statistics ride as in full training.
#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <vector>

#include "cuda/check.h"
#include "cuda/cuda_ops.h"
#include "cuda/device.h"
#include "cuda/lora_cuda.h"
#include "cuda/nccl_comm.h"
#include "cuda/qwen3_cuda.h"
#include "cuda/sharded_state_cuda.h"
#include "cuda/training_buffers.h"
#include "ops/cuda/convert.cuh"
#include "model/lora.h"
#include "ops/cuda/gemm.cuh"
#include "parallel/expert_parallel.h"
#include "parallel/pipeline_schedule.h"
#include "parallel/tensor_parallel.h"
#include "qtrain/error.h"
#include "qtrain/shard_plan.h"
#include "train/backend.h"

namespace qt {

namespace {

using cuda::bf16;

// The point-to-point channels (Mesh::device(MeshDim::kPp, channel)).
enum Channel { kActivations, kGradients, kActivationsWrap, kGradientsWrap, kChannels };

// The channel of the activation into chunk c (from chunk c - 1) and of the gradient out of it.
Channel activation_into(int c, int P) { return c % P == 0 ? kActivationsWrap : kActivations; }
Channel gradient_into(int c, int P) { return (c + 1) % P == 0 ? kGradientsWrap : kGradients; }
static_assert(cuda_pipeline_channels(2) == kChannels &&
                  cuda_pipeline_channels(1) == kActivationsWrap,
              "parallel/pipeline_schedule.h counts the channels this pipeline opens");

// Every stage's sends on each channel in the order its receiver takes them: NCCL matches
// point-to-point calls by order alone. Throws when a list breaks it (a schedule bug).
void check_channel_order(const PipeSchedule& all, int P, int V) {
  const int C = P * V;
  // [channel][sender stage]: (micro-batch, chunk sent into) in send order, and in receive order.
  std::vector<std::vector<std::vector<std::pair<int, int>>>> sent(
      kChannels, std::vector<std::vector<std::pair<int, int>>>(P)),
      received = sent;
  for (int s = 0; s < P; ++s)
    for (const PipeAction& a : all[s]) {
      const int c = a.chunk, m = a.micro_batch;
      if (a.op == PipeOp::kForward) {
        if (c > 0) received[activation_into(c, P)][(s + P - 1) % P].push_back({m, c});
        if (c < C - 1) sent[activation_into(c + 1, P)][s].push_back({m, c + 1});
      } else if (a.op != PipeOp::kBackwardWeight) {
        if (c < C - 1) received[gradient_into(c, P)][(s + 1) % P].push_back({m, c});
        if (c > 0) sent[gradient_into(c - 1, P)][s].push_back({m, c - 1});
      }
    }
  for (int ch = 0; ch < kChannels; ++ch)
    for (int s = 0; s < P; ++s)
      QT_CHECK(sent[ch][s] == received[ch][s],
               "pipeline channel {} from stage {}: sends and receives in different orders", ch, s);
}

// With [lora]: a stage's units of the frozen base, bf16 on the GPU (no gradients), and their fp32
// values on the host as loaded (initialisation, model.init), uploaded by push().
class FrozenUnits final : public cuda::UnitSource {
 public:
  FrozenUnits(const ShardPlan& plan, const std::vector<int>& held, cuda::DeviceArena& arena)
      : at_(plan.units.size(), nullptr) {
    for (const int u : held) {
      const Range r = plan.units[static_cast<std::size_t>(u)].range;
      at_[static_cast<std::size_t>(u)] = arena.allocate<bf16>(r.size());
      host_.push_back({u, r, std::vector<float>(r.size(), 0.0f)});
      bytes_ += 2.0 * static_cast<double>(r.size());
    }
  }
  const bf16* weights(int u, cudaStream_t) override {
    const bf16* w = at_.at(static_cast<std::size_t>(u));
    QT_CHECK(w != nullptr, "base unit {} is not held by this stage", u);
    return w;
  }
  float* grads(int, cudaStream_t) override { return nullptr; }  // frozen
  // The held units' host values, in the local layout.
  std::vector<FlatPiece> host_pieces() {
    std::vector<FlatPiece> out;
    for (Host& h : host_) out.push_back({h.range, h.values.data()});
    return out;
  }
  void push(cuda::DeviceArena& arena, cudaStream_t s) {
    for (Host& h : host_)
      cuda::upload_as_bf16(at_[static_cast<std::size_t>(h.unit)], h.values.data(),
                           h.values.size(), arena, s);
  }
  double bytes() const { return bytes_; }

 private:
  struct Host {
    int unit;
    Range range;                // in the local layout
    std::vector<float> values;  // [range size]
  };
  std::vector<bf16*> at_;  // [units] each held unit's bf16 weights, or null
  std::vector<Host> host_;
  double bytes_ = 0;
};

class CudaPipelineBackend final : public cuda::CudaTrainBackend {
 public:
  CudaPipelineBackend(const Deck& deck, Mesh& mesh)
      : device_(cuda::select_device(mesh.local_rank())),
        deck_(deck),
        P_(mesh.shape().pp),
        V_(mesh.shape().pp_chunks),
        s_(mesh.coord().pp),
        N_(static_cast<std::size_t>(deck.train.micro_batch) * deck.train.seq_len),
        sp_(mesh.shape().seq_parallel()),
        H_(deck.model.hidden_size),
        M_(static_cast<int>(deck.train.global_batch /
                            (std::int64_t{deck.train.micro_batch} * mesh.shape().dp))),
        tp_(mesh.shape().tp),
        ep_(deck.model.is_moe() ? mesh.shape().ep : 1),
        layout_(deck.model),
        local_cfg_(ep_local_config(tp_local_config(deck.model, tp_), ep_)),
        local_layout_(local_cfg_),
        plan_(plan_qwen3(local_cfg_, local_layout_, mesh.shape(), deck.optim.zero_stage,
                         tp_kv_replicas(deck.model, tp_))),
        actions_(schedule(schedule_config(mesh.shape(), M_))),
        arena_(cuda::training_arena_bytes(), fmt::format("GPU {} arena", device_)),
        gemm_ws_(arena_.allocate(cuda::kGemmWorkspaceBytes)),
        nccl_tp_(tp_ > 1 ? &cuda::nccl(mesh, MeshDim::kTp) : nullptr),
        nccl_dp_(mesh.dp().size() > 1 ? &cuda::nccl(mesh, MeshDim::kDp) : nullptr),
        nccl_ep_(ep_ > 1 ? &cuda::nccl(mesh, MeshDim::kEp) : nullptr),
        nccl_edp_(ep_ > 1 ? &cuda::nccl(mesh, MeshDim::kEdp) : nullptr),
        lora_(deck.lora.enabled() ? make_lora(deck) : nullptr),
        lora_plan_(lora_ ? plan_adapters(lora_->layout(), mesh.shape(), deck.optim.zero_stage,
                                         tp_kv_replicas(deck.model, tp_))
                         : ShardPlan{}),
        state_(lora_ ? lora_plan_ : plan_, lora_ ? lora_->layout() : local_layout_, deck.optim,
               mesh.dp(), nccl_dp_, arena_, cuda::offload_threads(mesh), {},
               {tp_ > 1 ? &mesh.tp() : nullptr, nccl_tp_},
               lora_ ? cuda::PipelineHold{lora_plan_.unit_indices(), -1, &mesh.pp()}
                     : cuda::PipelineHold{held_units(), tied_copy() ? 0 : -1, &mesh.pp()},
               nccl_edp_),
        batch_(M_ * deck.train.micro_batch, deck.train.seq_len, arena_),
        pp_(mesh.pp()),
        zb_(mesh.shape().pp_schedule == "zb-h1"),
        moe_(deck.model.is_moe()),
        E_(static_cast<std::size_t>(deck.model.num_experts)) {
    QT_CHECK(mesh.shape().dp == 1 || deck.optim.zero_stage <= 1,
             "the CUDA pipeline at dp > 1 runs ZeRO-0 or 1 (the deck checks it)");
    QT_CHECK(!zb_ || !deck.train.recompute, "ZB-H1 without recompute (the deck checks it)");
    check_channel_order(actions_, P_, V_);
    cuda::gemm_init(gemm_ws_, cuda::kGemmWorkspaceBytes);
    for (int ch = 0; ch < cuda_pipeline_channels(V_); ++ch)
      channel_[ch] = &cuda::nccl(mesh, MeshDim::kPp, ch);  // collective: every stage, in order
    // [lora]: the frozen base of the stage's units (parameters, not activations).
    if (lora_) frozen_ = std::make_unique<FrozenUnits>(plan_, held_units(), arena_);
    const std::size_t before = arena_.used();
    const std::vector<PipeAction>& mine = actions_[static_cast<std::size_t>(s_)];
    // Qwen3-MoE: each sparse layer of the stage keeps a set of routing and expert activations
    // a slot of its chunk (the ops' moe_slots); other stages' layers none.
    std::vector<int> moe_slots(static_cast<std::size_t>(local_cfg_.num_layers), 0);
    for (int v = 0; v < V_; ++v) {
      const int c = v * P_ + s_;
      for (int l = plan_.stage_layers[c]; l < plan_.stage_layers[c + 1]; ++l)
        moe_slots[static_cast<std::size_t>(l)] = activation_slots(mine, c);
    }
    // The lm head's buffers on the last stage only (it holds the last chunk, P V - 1).
    ops_ = std::make_unique<cuda::CudaOps>(local_cfg_, deck.train.micro_batch, deck.train.seq_len,
                                           arena_, nccl_tp_, sp_, mesh.shape().tp_overlap,
                                           deck.train.recompute, nccl_ep_, moe_slots,
                                           /*lm_head=*/s_ == P_ - 1);
    std::vector<int> asked;
    for (int v = 0; v < V_; ++v) {
      const int c = v * P_ + s_, slots = activation_slots(mine, c);
      const StageRange range = StageRange::layers(local_cfg_.num_layers, plan_.stage_layers[c],
                                                  plan_.stage_layers[c + 1]);
      auto ch = std::make_unique<Chunk>();
      ch->program = std::make_unique<Qwen3Program<cuda::CudaOps>>(
          local_cfg_, deck.train.micro_batch, deck.train.seq_len, deck.train.recompute, range,
          allocate_stage_acts<bf16>(local_cfg_, deck.train.micro_batch, deck.train.seq_len,
                                    deck.train.recompute, range, slots, arena_, sp_));
      ch->busy.assign(slots, 0);
      for (int k = 0; k < slots; ++k) ch->sent.push_back(std::make_unique<cuda::Event>());
      if (zb_ && !lora_) defer_storage(*ch, range.last_layer - range.first_layer);
      if (zb_ && lora_) ch->deferred.resize(static_cast<std::size_t>(slots));  // stay empty
      ch->slot_of.assign(M_, -1);
      if (moe_) {  // each slot's micro-batch statistics [2, E] and the event of their last send
        for (int k = 0; k < slots; ++k) {
          ch->balance.push_back({arena_.allocate<double>(2 * local_cfg_.num_experts), 0, false});
          ch->stats_sent.push_back(std::make_unique<cuda::Event>());
        }
      }
      const std::vector<int> us = ch->program->stage_units();
      asked.insert(asked.end(), us.begin(), us.end());
      chunks_.push_back(std::move(ch));
    }
    std::sort(asked.begin(), asked.end());
    asked.erase(std::unique(asked.begin(), asked.end()), asked.end());
    QT_CHECK(asked == held_units(), "the plan's units of stage {} are not its programs'", s_);
    if (lora_) {  // the adapters' units: whole at ZeRO-0 and 1
      lora_->bind(AdapterBuffers<bf16>::of_units(
          lora_plan_.units, [&](int u) { return state_.unit_weights(u); },
          [&](int u) { return state_.unit_grads(u); }));
      if (tp_ > 1) lora_->set_tensor_parallel(tp_, mesh.tp().rank());
      ops_->set_lora(lora_.get());
      global_lora_layout_ = std::make_unique<ParamLayout>(lora_layout(deck.model, deck.lora));
      lora_map_ = lora_map(deck.model, deck.lora, lora_ranges(), *global_lora_layout_,
                           lora_->layout(), lora_plan_, mesh.shape(), mesh.tp().rank(),
                           mesh.ep().rank());
    } else if (tied_copy() || (s_ == 0 && local_cfg_.tie_word_embeddings)) {
      const std::size_t n = plan_.units[0].range.size();
      tied_other_ = arena_.allocate<float>(std::min(n, kTiedPiece));
    }
    // Local -> global pieces: TpMap (tp), EpMap (ep: the rank's experts), TpEpMap, or none.
    model_map_ = make_model_map(deck.model, layout_, local_layout_, plan_, mesh.shape(),
                                mesh.tp().rank(), mesh.ep().rank());
    if (moe_) {
      // Each micro-batch's load-balancing loss weighs coef / (the step's micro-batches on all dp
      // ranks), as in the one-GPU back end (backend_cuda.cpp).
      ops_->set_moe_aux_scale(static_cast<float>(deck.model.router_aux_loss_coef *
                                                 deck.train.micro_batch / deck.train.global_batch));
      if (s_ == P_ - 1) {  // the last chunk's stage keeps each micro-batch's whole statistics
        aux_sums_ = arena_.allocate<double>(2 * static_cast<std::size_t>(M_) *
                                            local_cfg_.num_experts);
        aux_host_.assign(2 * static_cast<std::size_t>(M_) * local_cfg_.num_experts, 0.0);
        aux_tokens_.assign(static_cast<std::size_t>(M_), 0.0);
      }
    }
    activations_ = static_cast<double>(arena_.used() - before) + batch_.bytes();
    for (std::size_t i = 0; i < 2 * mine.size() + 1; ++i)
      marks_.push_back(std::make_unique<cuda::Event>(/*timing=*/true));
    if (const char* prefix = std::getenv("QTRAIN_PIPELINE_TIMELINE");
        prefix != nullptr && *prefix != '\0' && mesh.dp().rank() == 0 && mesh.tp().rank() == 0)
      timeline_ = fmt::format("{}.stage{}.jsonl", prefix, s_);
    QT_CHECK_CUDA(cudaDeviceSynchronize());
  }

  const ParamLayout& layout() const override { return layout_; }
  std::string describe() const override {
    const cuda::DeviceInfo d = cuda::device_info(device_);
    std::string out = fmt::format("cuda: GPU {} ({}, {} SMs), bf16 compute; {}; stage {} of {}:",
                                  device_, d.name, d.sm_count, state_.describe(), s_, P_);
    int slots = 0;
    for (const auto& c : chunks_) {
      out += qt::describe(c->program->stage());
      slots += c->program->slots();
    }
    out += fmt::format(", {} over {} micro-batches ({} activation slots)",
                       schedule_name(deck_.mesh), M_, slots);
    if (tied_copy()) out += " (and a copy of the tied embedding)";
    if (tp_ > 1) out += "; " + describe_tp(local_cfg_, tp_, sp_ > 1);
    if (ep_ > 1)
      out += fmt::format("; expert parallelism over ep {}: {} of {} experts a sparse layer here{}",
                         ep_, local_cfg_.local_experts(), local_cfg_.num_experts,
                         lora_ ? " (frozen)"
                               : fmt::format(", their state over expert-dp {}",
                                             deck_.mesh.dp / ep_));
    if (lora_)
      out += fmt::format("; LoRA: bf16 base frozen ({}, no gradients, moments or fp32 copy), the "
                         "{} adapter parameters of this stage's layers trained",
                         cuda::format_bytes(static_cast<std::size_t>(frozen_->bytes())),
                         lora_->layout().numel());
    return out + fmt::format("; arena {} ({} used after set-up)",
                             cuda::format_bytes(arena_.capacity()),
                             cuda::format_bytes(arena_.used()));
  }
  // Global coordinates (model_map_ under tp or ep; a stage's adapters always).
  std::vector<FlatPiece> model_pieces() override {
    return global_pieces(model_map_.get(), lora_ ? frozen_->host_pieces() : state_.param_pieces(),
                         /*writing=*/false);
  }
  const ParamLayout& trained_layout() const override {
    return lora_ ? *global_lora_layout_ : layout_;
  }
  std::vector<FlatPiece> trained_pieces() override {
    if (!lora_) return model_pieces();
    return lora_map_->to_global(state_.param_pieces(), /*writing=*/false);
  }
  std::vector<StatePiece> checkpoint_pieces() override {
    if (lora_) return lora_map_->to_global(state_.checkpoint_pieces(), /*writing=*/true);
    return global_pieces(model_map_.get(), state_.checkpoint_pieces(), /*writing=*/true);
  }
  StateTargets checkpoint_targets() override {
    if (lora_) return lora_map_->to_global(state_.checkpoint_targets());
    return global_targets(model_map_.get(), state_.checkpoint_targets());
  }
  void push_state() override {
    if (frozen_) frozen_->push(arena_, stream_.get());  // the base never changes after this
    state_.push(stream_.get());
  }
  void pull_state() override { state_.pull(stream_.get()); }
  void zero_grads() override {
    state_.begin_step();
    state_.clear_grads(stream_.get());  // every micro-batch adds (the head's in its forward)
    if (moe_) {
      ops_->clear_moe_load();
      aux_sum_ = 0;
      load_.clear();
      dropped_.clear();
    }
  }
  // Qwen3-MoE: summed over the stages by micro_batches (the same on every stage).
  double moe_aux_loss_sum() const override { return moe_ ? aux_sum_ : -1; }
  std::vector<double> moe_load() const override { return load_; }
  std::vector<double> moe_dropped() const override { return dropped_; }
  // The whole model's [sparse layers, E]: each stage's layers read their rows.
  void set_router_bias(const std::vector<float>& bias) override { ops_->set_router_bias(bias); }
  double micro_step(const std::int32_t*, const std::int32_t*, const std::int32_t*,
                    float) override {
    QT_CHECK(false, "a pipeline stage runs a step's micro-batches together (micro_batches)");
    return 0;
  }

  double micro_batches(const MicroBatches& mb, float loss_scale) override {
    QT_CHECK(mb.count == M_, "{} micro-batches, the schedule has {}", mb.count, M_);
    cudaStream_t s = stream_.get();
    const std::int32_t* pos = batch_.upload(mb.inputs, mb.targets, mb.positions, s);
    const int C = P_ * V_;
    const int prev = (s_ + P_ - 1) % P_, next = (s_ + 1) % P_;
    for (auto& c : chunks_) {
      std::fill(c->slot_of.begin(), c->slot_of.end(), -1);
      std::fill(c->busy.begin(), c->busy.end(), 0);
    }
    ops_->begin(s, nullptr);  // the loss sum starts; positions per action below
    (void)state_.begin_micro_batch(false, false);  // gradients added in place (zero_grads)
    cuda::StreamUnits units{frozen_ ? static_cast<cuda::UnitSource&>(*frozen_) : state_, s};
    marks_[0]->record(s);
    std::size_t mark = 1;  // each action's compute between marks_[mark] and marks_[mark + 1]
    for (const PipeAction& a : actions_[static_cast<std::size_t>(s_)]) {
      const int m = a.micro_batch, c = a.chunk;
      Chunk& ch = *chunks_.at(static_cast<std::size_t>(c / P_));
      Qwen3Program<cuda::CudaOps>& prog = *ch.program;
      const std::size_t off = N_ * static_cast<std::size_t>(m);
      const std::int32_t* inputs = batch_.inputs() + off;
      ops_->set_positions(pos ? pos + off : nullptr);
      // Micro-batch m's dropout masks, in its forward and again in its backward.
      if (lora_)
        lora_->set_dropout_key(deck_.train.seed,
                               mb.first_sample + std::int64_t{m} * deck_.train.micro_batch);
      if (a.op == PipeOp::kForward) {
        const auto free = std::find(ch.busy.begin(), ch.busy.end(), 0);
        QT_CHECK(free != ch.busy.end(), "no free activation slot for micro-batch {}", m);
        const int k = static_cast<int>(free - ch.busy.begin());
        ch.busy[k] = 1;
        ch.slot_of[m] = k;
        if (lora_) lora_->select_slot(k);
        wait(*ch.sent[k]);  // the slot's last output has left
        if (c > 0)
          receive(prog.stage_input(k), N_ / sp_ * H_, DType::kBF16, activation_into(c, P_), prev);
        if (moe_) {
          cuda::CudaOps::MoeBalance& b = ch.balance[static_cast<std::size_t>(k)];
          wait(*ch.stats_sent[static_cast<std::size_t>(k)]);  // the slot's last statistics left
          if (c > 0) {  // the chunks before's statistics: this chunk's sparse layers add theirs
            receive(b.sums, 2 * E_, DType::kF64, activation_into(c, P_), prev);
            b.tokens = static_cast<double>(N_) *
                       local_cfg_.moe_layers_before(prog.stage().first_layer);
            b.received = true;
          }
          ops_->moe_select(k, &b);
        }
        marks_[mark]->record(s);
        prog.forward_stage(*ops_, units, k, inputs, c > 0 ? prog.stage_input(k) : nullptr);
        if (prog.stage().has_head)
          prog.head_forward_backward(*ops_, units, batch_.targets() + off, loss_scale,
                                     /*accumulate=*/true, k);
        marks_[mark + 1]->record(s);
        if (c < C - 1) {
          send(prog.stage_output(k), N_ / sp_ * H_, DType::kBF16, activation_into(c + 1, P_),
               next, *ch.sent[k]);
          if (moe_)  // beside the activation (its event covers both)
            send(ch.balance[static_cast<std::size_t>(k)].sums, 2 * E_, DType::kF64,
                 activation_into(c + 1, P_), next, *ch.sent[k]);
        } else if (moe_) {  // the micro-batch's whole statistics, for its aux loss
          const cuda::CudaOps::MoeBalance& b = ch.balance[static_cast<std::size_t>(k)];
          QT_CHECK_CUDA(cudaMemcpyAsync(aux_sums_ + 2 * E_ * static_cast<std::size_t>(m), b.sums,
                                        2 * E_ * sizeof(double), cudaMemcpyDeviceToDevice, s));
          aux_tokens_[static_cast<std::size_t>(m)] = b.tokens;
        }
      } else if (a.op == PipeOp::kBackwardWeight) {
        const int k = ch.slot_of[m];
        QT_CHECK(k >= 0 && ch.busy[k], "weight half of micro-batch {} before its input half", m);
        marks_[mark]->record(s);
        ops_->run_deferred(ch.deferred[k]);
        marks_[mark + 1]->record(s);
        ch.busy[k] = 0;
      } else {
        const int k = ch.slot_of[m];
        QT_CHECK(k >= 0, "backward of micro-batch {} before its forward", m);
        if (lora_) lora_->select_slot(k);
        wait(ch.grad_sent);  // the last input gradient has left: its buffer is rewritten now
        if (c < C - 1)
          receive(prog.input_grad(), N_ / sp_ * H_, DType::kBF16, gradient_into(c, P_), next);
        if (moe_) {
          cuda::CudaOps::MoeBalance& b = ch.balance[static_cast<std::size_t>(k)];
          if (c < C - 1) {  // the micro-batch's whole statistics (the last chunk has them)
            wait(*ch.sent[k]);  // the forward's send of the slot's sums has left
            receive(b.sums, 2 * E_, DType::kF64, gradient_into(c, P_), next);
            b.tokens = static_cast<double>(N_) * local_cfg_.num_moe_layers();
          }
          b.received = false;
          ops_->moe_select(k, &b);
        }
        marks_[mark]->record(s);
        const bool split = a.op == PipeOp::kBackwardInput;  // the slot waits for its weight half
        if (split) ops_->defer_weight_grads(&ch.deferred[k]);
        prog.backward_stage(*ops_, units, k, inputs, c < C - 1 ? prog.input_grad() : nullptr,
                            /*accumulate=*/true);
        ops_->defer_weight_grads(nullptr);
        marks_[mark + 1]->record(s);
        if (!split) ch.busy[k] = 0;
        if (c > 0) {
          send(prog.input_grad(), N_ / sp_ * H_, DType::kBF16, gradient_into(c - 1, P_), prev,
               ch.grad_sent);
          if (moe_)
            send(ch.balance[static_cast<std::size_t>(k)].sums, 2 * E_, DType::kF64,
                 gradient_into(c - 1, P_), prev, *ch.stats_sent[static_cast<std::size_t>(k)]);
        }
      }
      mark += 2;
    }
    const double loss = ops_->take_loss();  // waits for the compute stream
    for (cuda::NcclComm* ch : channel_)
      if (ch) ch->synchronize();
    if (moe_) moe_statistics();
    // The bubble as simulate() counts it: 1 - (the stages' compute) / (P x the step's span),
    // the span the longest stage's from its start event to its last action's end (the clocks
    // of the GPUs differ; the stages start about together, after the last step's collectives
    // over pp). Milliseconds.
    double busy_ms = 0;
    for (std::size_t i = 1; i < mark; i += 2)
      busy_ms += marks_[i + 1]->elapsed_ms_since(*marks_[i]);
    const double span_ms = pp_.max(marks_[mark - 1]->elapsed_ms_since(*marks_[0]));
    busy_ms = pp_.sum(busy_ms);
    idle_ = span_ms > 0 ? std::clamp(1.0 - busy_ms / (P_ * span_ms), 0.0, 1.0) : 0.0;
    if (!timeline_.empty()) write_timeline();
    ++steps_run_;
    return pp_.sum(loss);  // the last stage's, on every stage
  }
  double pipeline_idle() const override { return idle_; }

  // QTRAIN_PIPELINE_TIMELINE=prefix: the first dp and tp rank of each stage appends one JSON line
  // a step to prefix.stage<s>.jsonl: each action's op, chunk, micro-batch and compute start and
  // end in ms from the stage's step start (bench/pipeline_timeline.py reads them).
  void write_timeline() {
    std::FILE* f = std::fopen(timeline_.c_str(), "a");
    if (f == nullptr) {  // this rank alone writes: a warning, not an error the others miss
      std::fprintf(stderr, "qtrain: warning: QTRAIN_PIPELINE_TIMELINE: cannot append to %s; "
                   "the timeline stops\n", timeline_.c_str());
      timeline_.clear();
      return;
    }
    std::string line = fmt::format("{{\"step\": {}, \"stage\": {}, \"actions\": [", steps_run_,
                                   s_);
    std::size_t mark = 1;
    for (const PipeAction& a : actions_[static_cast<std::size_t>(s_)]) {
      static constexpr const char* kOp[] = {"F", "B", "I", "W"};
      line += fmt::format("{}[\"{}\", {}, {}, {:.4f}, {:.4f}]", mark > 1 ? ", " : "",
                          kOp[static_cast<int>(a.op)], a.chunk, a.micro_batch,
                          marks_[mark]->elapsed_ms_since(*marks_[0]),
                          marks_[mark + 1]->elapsed_ms_since(*marks_[0]));
      mark += 2;
    }
    line += "]}\n";
    std::fputs(line.c_str(), f);
    std::fclose(f);
  }

  OptimStepStats optimizer_step(const StepRequest& request) override {
    if (local_cfg_.tie_word_embeddings && !lora_) sum_tied_copies();  // (a frozen base: none)
    return state_.step(request, deck_.train.steps, stream_.get());
  }
  std::string memory_report() override { return cuda::memory_report(arena_); }
  MemorySplit memory_split() override {
    MemorySplit m = state_.bytes();
    if (frozen_) m.params += frozen_->bytes();
    m.activations = activations_;
    m.workspace = std::max(0.0, static_cast<double>(arena_.peak()) - m.total());
    return m;
  }

 private:
  // Elements of the tied embedding's gradient exchanged at a time (64 MB of fp32).
  static constexpr std::size_t kTiedPiece = std::size_t{1} << 24;

  // One model chunk of this stage with its activation slots and per-step bookkeeping.
  struct Chunk {
    std::unique_ptr<Qwen3Program<cuda::CudaOps>> program;
    std::vector<char> busy;                     // [slots]
    std::vector<std::unique_ptr<cuda::Event>> sent;  // [slots] the slot's output has left
    cuda::Event grad_sent;                      // the input gradient has left
    std::vector<int> slot_of;                   // [M] the slot of each micro-batch, or -1
    std::vector<cuda::CudaOps::DeferredGrads> deferred;  // [slots] ZB-H1's weight halves owed
    // Qwen3-MoE: [slots] the micro-batch's load statistics (sums [2, E] device doubles), and
    // when their last send back (beside d x) has left.
    std::vector<cuda::CudaOps::MoeBalance> balance;
    std::vector<std::unique_ptr<cuda::Event>> stats_sent;
  };

  // ZB-H1: each slot's queue of deferred weight gradients, reading the slot's activations in
  // place (allocate_stage_acts lays each slot's buffers out as one stretch, slot after slot,
  // then the shared scratch) and copies of the output gradients held in the shared scratch: o's
  // and down's [N, H] and q/k/v's [N, Q + 2 KV] a layer.
  void defer_storage(Chunk& ch, int layers) {
    const Qwen3Program<cuda::CudaOps>& prog = *ch.program;
    const int first = prog.stage().first_layer, slots = prog.slots();
    const std::size_t per_slot = static_cast<std::size_t>(layers) * N_ *
                                 (local_cfg_.q_dim() + 2 * local_cfg_.kv_dim() + 2 * H_);
    ch.deferred.resize(static_cast<std::size_t>(slots));
    for (int k = 0; k < slots; ++k) {
      cuda::CudaOps::DeferredGrads& q = ch.deferred[static_cast<std::size_t>(k)];
      q.keep_begin = prog.acts(k).x[first];
      q.keep_end = k + 1 < slots ? static_cast<const void*>(prog.acts(k + 1).x[first])
                                 : static_cast<const void*>(prog.acts(0).tmp);
      q.store = arena_.allocate<bf16>(per_slot);
      q.capacity = per_slot;
      q.gemms.reserve(4 * static_cast<std::size_t>(layers));  // down, gate/up, o, q/k/v a layer
    }
  }

  // [lora]: one LoraCuda over the stage's chunks' layers, with an xa a layer for each activation
  // slot of the chunk holding it (the chunks' layers differ: slot k of each is LoRA's slot k).
  // The layers of the stage's chunks, [first, last) each.
  std::vector<std::pair<int, int>> lora_ranges() const {
    std::vector<std::pair<int, int>> ranges;
    for (int v = 0; v < V_; ++v)
      ranges.push_back({plan_.stage_layers[v * P_ + s_], plan_.stage_layers[v * P_ + s_ + 1]});
    return ranges;
  }
  std::unique_ptr<cuda::LoraCuda> make_lora(const Deck& deck) {
    const std::vector<PipeAction>& mine = actions_[static_cast<std::size_t>(s_)];
    int slots = 1;
    for (int v = 0; v < V_; ++v) slots = std::max(slots, activation_slots(mine, v * P_ + s_));
    return std::make_unique<cuda::LoraCuda>(local_cfg_, deck.lora, deck.train.micro_batch,
                                            deck.train.seq_len, arena_, lora_ranges(), slots);
  }

  bool tied_copy() const { return local_cfg_.tie_word_embeddings && s_ == P_ - 1; }
  // The plan's units of this stage (and a tied copy), ascending.
  std::vector<int> held_units() const {
    std::vector<int> held;
    for (std::size_t u = 0; u < plan_.units.size(); ++u)
      if (plan_.units[u].stage == s_ || (tied_copy() && u == 0)) held.push_back(static_cast<int>(u));
    return held;
  }

  // The compute stream waits for `e` (recorded on a channel; a no-op if never recorded).
  void wait(const cuda::Event& e) {
    QT_CHECK_CUDA(cudaStreamWaitEvent(stream_.get(), e.get(), 0));
  }
  // Qwen3-MoE, after a step's micro-batches (the compute stream drained): the aux losses of the
  // micro-batches' whole statistics (the last stage's) and each stage's sparse layers' load,
  // summed over pp, so that every stage reports the model's.
  void moe_statistics() {
    double aux = 0;
    if (aux_sums_ != nullptr) {
      QT_CHECK_CUDA(cudaMemcpy(aux_host_.data(), aux_sums_, aux_host_.size() * sizeof(double),
                               cudaMemcpyDeviceToHost));
      for (int m = 0; m < M_; ++m)
        aux += cuda::CudaOps::moe_aux_loss_of(
            aux_host_.data() + 2 * E_ * static_cast<std::size_t>(m), static_cast<int>(E_),
            aux_tokens_[static_cast<std::size_t>(m)]);
    }
    aux_sum_ += pp_.sum(aux);
    load_ = ops_->moe_load();  // since zero_grads: this stage's layers, 0 elsewhere
    pp_.all_reduce(load_.data(), load_.size(), DType::kF64, ReduceOp::kSum);
    dropped_ = ops_->moe_dropped();
    pp_.all_reduce(dropped_.data(), dropped_.size(), DType::kF64, ReduceOp::kSum);
  }

  // buf [n] of type t from stage `from` on channel ch, after the compute stream's work so far;
  // the compute stream's later work waits for it.
  void receive(void* buf, std::size_t n, DType t, Channel ch, int from) {
    cuda::NcclComm& c = *channel_[ch];
    ready_.record(stream_.get());
    c.wait_event(ready_.get());
    c.recv_async(buf, n, t, from);
    landed_.record(c.stream());
    wait(landed_);
  }
  // buf [n] of type t to stage `to` on channel ch after the compute stream's work so far; `sent`
  // marks when buf (and what the channel sent before it) may be rewritten.
  void send(const void* buf, std::size_t n, DType t, Channel ch, int to, cuda::Event& sent) {
    cuda::NcclComm& c = *channel_[ch];
    ready_.record(stream_.get());
    c.wait_event(ready_.get());
    c.send_async(buf, n, t, to);
    sent.record(c.stream());
  }

  // The first and the last stage add each other's gradients of the tied embedding, a piece at a
  // time on the activation channel (idle between steps).
  void sum_tied_copies() {
    if (s_ != 0 && s_ != P_ - 1) return;
    cuda::NcclComm& c = *channel_[kActivations];
    float* g = state_.unit_grads(0);
    const std::size_t n = plan_.units[0].range.size();
    const int peer = s_ == 0 ? P_ - 1 : 0;
    ready_.record(stream_.get());
    c.wait_event(ready_.get());
    for (std::size_t at = 0; at < n; at += kTiedPiece) {
      const std::size_t k = std::min(kTiedPiece, n - at);
      c.group_start();
      c.send_async(g + at, k, DType::kF32, peer);
      c.recv_async(tied_other_, k, DType::kF32, peer);
      c.group_end();
      cuda::add_f32(g + at, tied_other_, k, c.stream());
    }
    c.synchronize();
  }

  // First member: the rank's device is current before any CUDA object below is made.
  int device_;
  const Deck& deck_;
  int P_, V_, s_;       // stages, chunks a stage, this stage
  std::size_t N_;       // rows of a micro-batch (B x T)
  int sp_;              // mesh.tp with sequence parallelism (a stage's rows: N / sp), else 1
  std::size_t H_;       // hidden size
  int M_;               // micro-batches a step of this dp rank
  int tp_;              // mesh.tp
  int ep_;              // mesh.ep of a Qwen3-MoE model, else 1
  ParamLayout layout_;        // the model's (global)
  ModelConfig local_cfg_;     // the tp and ep rank's model (the model's at tp = ep = 1)
  ParamLayout local_layout_;  // its layout: the plan's, the state's and the programs'
  ShardPlan plan_;            // its units' stages and the layer split
  PipeSchedule actions_;      // every stage's list of a step (this stage's: [s_])
  cuda::DeviceArena arena_;
  cuda::Stream stream_;       // the compute stream
  void* gemm_ws_;
  cuda::NcclComm* nccl_tp_;   // the mesh's tp communicator; null at tp 1
  cuda::NcclComm* nccl_dp_;   // the stage's dp group; null at dp 1
  cuda::NcclComm* nccl_ep_;   // the stage's ep and expert-dp groups; null at ep 1
  cuda::NcclComm* nccl_edp_;
  std::unique_ptr<cuda::LoraCuda> lora_;  // [lora]: the stage's adapters, else null
  ShardPlan lora_plan_;                   // [lora]: lora_->layout()'s units (plan_adapters)
  cuda::ShardedCudaState state_;  // the trained parameters: the stage's units, or its adapters
  cuda::BatchBuffers batch_;  // the step's micro-batches, [M x B, T] each
  MpiComm& pp_;
  cuda::NcclComm* channel_[kChannels] = {};
  std::unique_ptr<cuda::CudaOps> ops_;  // shared by the chunks (one stream, one action at a time)
  std::vector<std::unique_ptr<Chunk>> chunks_;
  std::unique_ptr<LayoutMap> model_map_;  // local -> global pieces with tp or ep > 1, else null
  std::unique_ptr<FrozenUnits> frozen_;  // [lora]: the stage's frozen base, else null
  std::unique_ptr<ParamLayout> global_lora_layout_;  // [lora]: the model's adapters
  std::unique_ptr<LayoutMap> lora_map_;  // [lora]: the stage's adapters -> the global ones
  cuda::Event ready_, landed_;
  float* tied_other_ = nullptr;  // [min(embedding, kTiedPiece)] the peer's piece
  double activations_ = 0;
  bool zb_;                      // mesh.pp_schedule = zb-h1: split backwards
  bool moe_;                     // a Qwen3-MoE model
  std::size_t E_;                // its experts (0: dense)
  double* aux_sums_ = nullptr;   // [M, 2, E] the last stage: each micro-batch's whole statistics
  std::vector<double> aux_host_;    // [M, 2, E] their host copy
  std::vector<double> aux_tokens_;  // [M] their (sparse layer, token) pairs
  double aux_sum_ = 0;              // moe_aux_loss_sum()
  std::vector<double> load_;        // moe_load(): the step's, summed over pp
  std::vector<double> dropped_;     // moe_dropped(): the step's, summed over pp
  std::vector<std::unique_ptr<cuda::Event>> marks_;  // [2 x actions + 1] timing: start, then
                                                     // each action's compute begin and end
  double idle_ = -1;             // the last step's pipeline_idle()
  std::string timeline_;         // QTRAIN_PIPELINE_TIMELINE's file of this stage, or empty
  long steps_run_ = 0;
};

}  // namespace

std::unique_ptr<TrainBackend> make_cuda_pipeline_backend(const Deck& deck, Mesh& mesh) {
  return std::make_unique<CudaPipelineBackend>(deck, mesh);
}

}  // namespace qt
