// The CPU reference back end with pipeline parallelism (mesh.pp > 1; issue 17): each pp rank
// runs one stage of the model over the optimizer driver ShardedState holding only that stage's
// units (ZeRO 0-3 over its dp group). The sharding plan cuts the layers into pp x pp_chunks
// chunks balanced by cost; chunk c runs on stage c % pp as a Qwen3Stage (model/qwen3_stage.h),
// the embedding in the first chunk, the final norm, lm head and loss in the last. A step runs
// the stage's list from parallel/pipeline_schedule.h (mesh.pp_schedule: 1F1B or ZB-H1;
// mesh.pp_chunks > 1: interleaved 1F1B):
//
//   F(c, m)  chunk c > 0 receives x [n, H] of micro-batch m from the previous stage; the
//            forward; c < C - 1 sends its output to the next stage (stage P - 1 sends to stage 0
//            between chunks); the last chunk runs the head and the loss in the forward
//   B(c, m)  chunk c < C - 1 receives d x [n, H] from the next stage; the backward; c > 0 sends
//            d x to the previous stage
//   I, W     (ZB-H1) B's input half, as B; the weight half later, from the slot's saved state
//
// Sends are non-blocking (MPI_Isend from buffers kept until the send completes), receives
// blocking: every stage then only waits for data its schedule needs, which the schedule's
// simulation shows always comes. Tags: 2 (m C + c) for the activation into chunk c, + 1 for
// its gradient.
//
// Qwen3-MoE: the load-balancing loss pools each micro-batch's statistics over all its sparse
// layers before the product, so every chunk's backward needs those of the chunks after it. They
// ride with the activations (Qwen3Stage::moe_stats): F(c, m) receives the running sum of chunks
// < c beside x and sends the sum through chunk c beside its output, so the last chunk ends with
// the micro-batch's whole statistics (its aux loss, in the step log, is the serial run's); B(c,
// m) (or I) receives them back beside d x and sends them on beside its own. A chunk's backward
// of m always follows the last chunk's forward of m in every schedule (its d x comes from
// there), so the whole statistics are there when needed, whatever the order of 1F1B,
// interleaved chunks or ZB-H1's halves; recompute does not count a layer twice (the layer
// program's rule). One message of 2 E + 1 doubles (counts, probability sums, tokens) a
// micro-batch and direction, tag 2 M C + the activation's. The expert load of the step log is
// summed over the stages; with mesh.ep > 1 each stage's experts are split over its ep group as
// the plain CPU back end does (parallel/expert_parallel.h), its expert units over edp, and with
// mesh.tp > 1 too each of them by columns over tp.
//
// A tied embedding lives on the first stage (the lookup) and, as a copy, on the last (the lm
// head): before each optimizer step the two exchange their gradients of it and add them (a + b
// on one, b + a on the other: the same bits), so AdamW keeps the copies equal; the first stage's
// counts in the norm and goes to checkpoints. The loss and the gradient norm are summed over pp.
// With mesh.tp > 1 each stage is split over its tp group as the plain CPU back end does
// (parallel/tensor_parallel.h); the pp communicator joins the ranks of one tp index. n is a
// micro-batch's rows N = B x T, or with mesh.sequence_parallel the tp rank's N / tp (its rows of
// the residual stream: each tp rank sends its own to its peer of the next stage).
//
// With [lora] (train/stage_lora.h) the stage holds its units of the base, frozen (no gradients,
// no moments; a tied embedding's two copies both read from the model), and trains the adapters
// of its chunks' layers as plan_adapters' units of the driver (over dp; the experts' adapters at
// ep > 1 over expert-dp; ZeRO 0 or 1; the gradient norm summed over pp). Each action keys the
// dropout masks with its micro-batch's first sequence and each activation slot keeps its own
// adapter activations, so the masks and the gradients are the serial run's. ZB-H1 runs too:
// with no base gradients its weight halves have nothing to do (the adapters' gradients come with
// the input halves). On a Qwen3-MoE model the routers
// and experts are frozen base units like the rest (with mesh.ep > 1 each stage's its ep rank's
// experts), the load statistics and the expert exchanges run as in full training, and the aux
// loss's gradient reaches the adapters through d x. Adapters on every expert (lora.targets
// experts.*) are the stage's sparse layers' stacked tensors in its chunks' LoraAdapters; the MoE
// block's backward, which ZB-H1 does not split, adds their gradients in the input half, once.
//
// With mesh.cp > 1 (a dense model without [lora]) every stage holds its cp rank's tokens of each
// sequence (parallel/context_parallel.h), as the plain CPU back end does: micro_batches takes
// them from the step's micro-batches (with their global positions) before running the
// schedule, each stage's attention runs the ring over Mesh::cp() (the pp communicator joins
// ranks of one cp index, so the activations between stages are the same tokens' rows), the
// state is planned and reduced over dp x cp, and the loss is summed over cp too.
#include <mpi.h>

#include <fmt/format.h>

#include <algorithm>
#include <deque>
#include <memory>
#include <vector>

#include "model/qwen3.h"
#include "model/qwen3_stage.h"
#include "optim/sharded_state.h"
#include "parallel/context_parallel.h"
#include "parallel/expert_parallel.h"
#include "parallel/pipeline_schedule.h"
#include "parallel/tensor_parallel.h"
#include "qtrain/error.h"
#include "qtrain/shard_plan.h"
#include "train/backend.h"
#include "train/stage_lora.h"

namespace qt {

namespace {

// Stage s's list of a step: 1F1B, ZB-H1 (split backwards, P weight halves may wait), or
// interleaved 1F1B over mesh.pp_chunks chunks a stage.
std::vector<PipeAction> stage_actions(const MeshShape& mesh, int M, int s) {
  return schedule(schedule_config(mesh, M))[static_cast<std::size_t>(s)];
}

class CpuPipelineBackend final : public TrainBackend {
 public:
  CpuPipelineBackend(const Deck& deck, Mesh& mesh)
      : split_(deck.train.seq_len, mesh.shape().cp),
        cp_(mesh.shape().cp > 1 ? &mesh.cp() : nullptr),
        local_len_(split_.local_len(mesh.coord().cp)),
        vocab_size_(deck.model.vocab_size),
        P_(mesh.shape().pp),
        V_(mesh.shape().pp_chunks),
        s_(mesh.coord().pp),
        N_(static_cast<std::size_t>(deck.train.micro_batch) * local_len_),
        n_(N_ / static_cast<std::size_t>(mesh.shape().seq_parallel())),
        H_(deck.model.hidden_size),
        M_(deck.train.global_batch / (deck.train.micro_batch * mesh.shape().dp)),
        B_(deck.train.micro_batch),
        tp_(mesh.shape().tp),
        ep_(deck.model.is_moe() ? mesh.shape().ep : 1),
        global_layout_(deck.model),
        local_(ep_local_config(tp_local_config(deck.model, tp_), ep_)),
        layout_(local_),
        plan_(plan_qwen3(local_, layout_, plan_shape(mesh.shape()), deck.optim.zero_stage,
                         tp_kv_replicas(deck.model, tp_))),
        actions_(stage_actions(mesh.shape(), M_, s_)),
        chunks_(make_chunks(deck)),
        share_{held_units(), &mesh.pp(), tied_copy() ? Qwen3Units{}.embed() : -1},
        lora_(deck.lora.enabled() ? make_lora(deck, mesh) : nullptr),
        state_(lora_ ? lora_->plan() : plan_, lora_ ? lora_->layout() : layout_, deck.optim,
               cp_ ? mesh.dp_cp() : mesh.dp(), deck.train.steps, &mesh.tp(),
               lora_ ? &lora_->share() : &share_, &mesh.edp()),
        pp_(mesh.pp()),
        dx_(n_ * H_),
        schedule_name_(schedule_name(mesh.shape())),
        seed_(deck.train.seed) {
    if (lora_)
      for (std::size_t v = 0; v < chunks_.size(); ++v)
        chunks_[v].stage->set_lora(&lora_->chunk(static_cast<int>(v)));
    if (tp_ > 1) {
      for (Chunk& c : chunks_) {
        c.stage->set_tensor_parallel(&mesh.tp());
        QT_CHECK(static_cast<std::size_t>(c.stage->rows()) == n_, "stage rows {}, messages of {}",
                 c.stage->rows(), n_);
      }
    }
    model_map_ = make_model_map(deck.model, global_layout_, layout_, plan_, mesh.shape(),
                                mesh.tp().rank(), mesh.ep().rank());
    if (cp_) {  // the deck refuses the rest; the engine's own guard
      QT_CHECK(!lora_ && !local_.is_moe(), "mesh.cp > 1 with LoRA or a Qwen3-MoE model");
      for (Chunk& c : chunks_) c.stage->set_context_parallel(cp_, &split_);
    }
    if (local_.is_moe()) {
      // Each micro-batch's load-balancing loss weighs coef / (the step's micro-batches on all
      // dp ranks), as in the plain CPU back end.
      aux_weight_ = deck.model.router_aux_loss_coef * deck.train.micro_batch / deck.train.global_batch;
      for (Chunk& c : chunks_) {
        c.stage->set_moe_aux_scale(static_cast<float>(aux_weight_));
        if (ep_ > 1) c.stage->set_expert_parallel(&mesh.ep());
      }
      stats_msg_.resize(2 * static_cast<std::size_t>(local_.num_experts) + 1);
    }
  }

  void set_loss_scaling(double S) override {
    if (!local_.is_moe()) return;
    for (Chunk& c : chunks_) c.stage->set_moe_aux_scale(static_cast<float>(aux_weight_ * S));
  }

  // The global layout (checkpoints, initialisation and imports see global tensors).
  const ParamLayout& layout() const override { return global_layout_; }
  std::string describe() const override {
    std::string d = fmt::format("cpu: fp32 reference (OpenBLAS); {}; this is stage {} of {}:",
                                state_.plan().describe(), s_, P_);
    for (const Chunk& c : chunks_) {
      d += qt::describe(c.stage->stage());
    }
    int slots = 0;
    for (const Chunk& c : chunks_) slots += c.stage->slots();
    d += fmt::format(", {} over {} micro-batches ({} activation slots)", schedule_name_, M_, slots);
    if (tied_copy()) d += " (and a copy of the tied embedding)";
    if (tp_ > 1) d += "; " + describe_tp(local_, tp_, n_ < N_);
    if (lora_)
      d += fmt::format("; LoRA: fp32 base frozen (no gradients or moments), the {} adapter "
                       "parameters of this stage's layers trained",
                       lora_->layout().numel());
    return d;
  }
  // Pieces in global coordinates (model_map_ under tp or ep; a stage's adapters always).
  std::vector<FlatPiece> model_pieces() override {
    return global_pieces(model_map_.get(), lora_ ? lora_->base_pieces() : state_.param_pieces(),
                         /*writing=*/false);
  }
  std::vector<FlatPiece> trained_pieces() override {
    if (!lora_) return model_pieces();
    return global_pieces(lora_->map(), state_.param_pieces(), /*writing=*/false);
  }
  const ParamLayout& trained_layout() const override {
    return lora_ ? lora_->global_layout() : global_layout_;
  }
  std::vector<StatePiece> checkpoint_pieces() override {
    if (lora_) return global_pieces(lora_->map(), state_.checkpoint_pieces(), /*writing=*/true);
    return global_pieces(model_map_.get(), state_.checkpoint_pieces(), /*writing=*/true);
  }
  StateTargets checkpoint_targets() override {
    if (lora_) return global_targets(lora_->map(), state_.checkpoint_targets());
    return global_targets(model_map_.get(), state_.checkpoint_targets());
  }
  void push_state() override {}  // the host buffers are the live state
  void pull_state() override {}
  void zero_grads() override {
    state_.zero_grads();
    for (Chunk& c : chunks_) c.stage->clear_moe_load();
    aux_sum_ = 0;
    load_.clear();
    dropped_.clear();
  }
  // Qwen3-MoE: summed over the stages by micro_batches (the same on every stage).
  double moe_aux_loss_sum() const override { return local_.is_moe() ? aux_sum_ : -1; }
  std::vector<double> moe_load() const override { return load_; }
  std::vector<double> moe_dropped() const override { return dropped_; }
  void set_router_bias(const std::vector<float>& bias) override {
    router_bias_ = bias;  // the whole model's: each stage reads its sparse layers' rows
    for (Chunk& c : chunks_) c.stage->set_router_bias(bias.empty() ? nullptr : router_bias_.data());
  }
  double micro_step(const std::int32_t*, const std::int32_t*, const std::int32_t*,
                    float) override {
    QT_CHECK(false, "a pipeline stage runs a step's micro-batches together (micro_batches)");
    return 0;
  }

  // The schedule with loss scale 0 (TrainBackend's default), the adapters' dropout off.
  double eval_loss(const MicroBatches& mb) override {
    auto dropout = [this](bool on) {
      for (std::size_t v = 0; lora_ && v < chunks_.size(); ++v)
        lora_->chunk(static_cast<int>(v)).set_dropout_enabled(on);
    };
    dropout(false);
    const double loss = TrainBackend::eval_loss(mb);
    dropout(true);
    return loss;
  }

  double micro_batches(const MicroBatches& mb, float loss_scale) override {
    if (!cp_) return run_schedule(mb, loss_scale);
    return cp_->sum(run_schedule(local_batches(mb), loss_scale));  // the whole sequences' sum
  }

 private:
  // Context parallelism: this cp rank's tokens of every micro-batch of `mb` (each [B, T],
  // checked whole first) into cp_inputs_, cp_targets_, cp_positions_ (the global RoPE
  // positions), [M, B, local_len_]; the micro-batches as those arrays.
  MicroBatches local_batches(const MicroBatches& mb) {
    const std::size_t whole = static_cast<std::size_t>(mb.B) * mb.T;
    for (auto* v : {&cp_inputs_, &cp_targets_, &cp_positions_})
      v->resize(N_ * static_cast<std::size_t>(mb.count));
    const int r = cp_->rank();
    for (int m = 0; m < mb.count; ++m) {
      const std::size_t at = whole * m, to = N_ * m;
      const std::int32_t* pos = mb.positions ? mb.positions + at : nullptr;
      check_micro_batch(mb.inputs + at, mb.targets + at, pos, mb.B, mb.T, vocab_size_);
      split_.take(cp_inputs_.data() + to, mb.inputs + at, mb.B, r);
      split_.take(cp_targets_.data() + to, mb.targets + at, mb.B, r);
      split_.take_positions(cp_positions_.data() + to, pos, mb.B, r);
    }
    MicroBatches local = mb;
    local.inputs = cp_inputs_.data();
    local.targets = cp_targets_.data();
    local.positions = cp_positions_.data();
    local.T = local_len_;
    return local;
  }

  // The stage's list of actions over the step's micro-batches (each B x N_ / B rows).
  double run_schedule(const MicroBatches& mb, float loss_scale) {
    QT_CHECK(mb.count == M_, "{} micro-batches, the schedule has {}", mb.count, M_);
    const int C = P_ * V_;  // chunks of the model; chunk c runs on stage c % P
    const int prev = (s_ + P_ - 1) % P_, next = (s_ + 1) % P_;  // the wrap: chunk v P + P - 1 -> (v + 1) P
    // Tags: the activation into chunk c of micro-batch m, 2 (m C + c); its gradient, + 1.
    auto tag = [&](int c, int m, int grad) { return 2 * (m * C + c) + grad; };
    // A micro-batch's load statistics beside its activation or gradient (Qwen3-MoE).
    const bool moe = local_.is_moe();
    auto stats_tag = [&](int c, int m, int grad) { return 2 * M_ * C + tag(c, m, grad); };
    for (Chunk& c : chunks_) {
      std::fill(c.slot_of.begin(), c.slot_of.end(), -1);
      std::fill(c.busy.begin(), c.busy.end(), 0);
    }
    // The stage's parameters: the model's, or the frozen base beside the bound adapters.
    ModelParams& mp = lora_ ? static_cast<ModelParams&>(*lora_) : state_;
    if (lora_)  // the adapters' units, whole at ZeRO 0/1
      lora_->bind(AdapterBuffers<float>::of_units(
          state_.plan().units, [&](int u) { return state_.params(u); },
          [&](int u) { return state_.grads(u); }));
    double loss = 0, aux = 0;
    for (const PipeAction& a : actions_) {
      const int m = a.micro_batch, c = a.chunk;
      // Micro-batch m's masks, in its forward and again in its backward.
      if (lora_) lora_->set_dropout_key(seed_, mb.first_sample + std::int64_t{m} * B_);
      Chunk& ch = chunks_.at(static_cast<std::size_t>(c / P_));
      Qwen3Stage& st = *ch.stage;
      const std::size_t off = N_ * static_cast<std::size_t>(m);
      StageBatch batch{mb.inputs + off, mb.targets + off,
                       mb.positions ? mb.positions + off : nullptr};
      if (a.op == PipeOp::kForward) {
        const auto free = std::find(ch.busy.begin(), ch.busy.end(), 0);
        QT_CHECK(free != ch.busy.end(), "no free activation slot for micro-batch {}", m);
        const int k = static_cast<int>(free - ch.busy.begin());
        ch.busy[k] = 1;
        ch.slot_of[m] = k;
        // The slot's last output may still be leaving (it was received before its backward).
        QT_CHECK_MPI(MPI_Wait(&ch.fwd_send[k], MPI_STATUS_IGNORE));
        float* x_in = nullptr;
        if (c > 0) {
          x_in = st.input(k);
          receive(x_in, prev, tag(c, m, 0));
          if (moe) receive_stats(st.moe_stats(k), prev, stats_tag(c, m, 0));
        }
        loss += st.forward(mp, k, batch, x_in, loss_scale);
        if (c < C - 1) {
          send(st.output(k), next, tag(c + 1, m, 0), &ch.fwd_send[k]);
          if (moe) send_stats(st.moe_stats(k), next, stats_tag(c + 1, m, 0));
        } else if (moe) {  // the micro-batch's whole statistics: its aux loss
          aux += cpu::router_aux_loss(st.moe_stats(k));
        }
      } else if (a.op == PipeOp::kBackwardWeight) {
        const int k = ch.slot_of[m];
        QT_CHECK(k >= 0, "weight half of micro-batch {} before its forward", m);
        st.backward_weight(mp, k);
        ch.busy[k] = 0;
      } else {
        const int k = ch.slot_of[m];
        QT_CHECK(k >= 0, "backward of micro-batch {} before its forward", m);
        const float* dx_in = nullptr;
        if (c < C - 1) {
          receive(dx_.data(), next, tag(c, m, 1));
          dx_in = dx_.data();
          if (moe) receive_stats(st.moe_stats(k), next, stats_tag(c, m, 1));
        }
        if (a.op == PipeOp::kBackwardInput) {
          st.backward_input(mp, k, dx_in);  // the slot waits for its weight half
        } else {
          st.backward(mp, k, dx_in);
          ch.busy[k] = 0;
        }
        if (c > 0) {
          send_copy(st.input_grad(), n_ * H_, MPI_FLOAT, prev, tag(c - 1, m, 1));
          if (moe) send_stats(st.moe_stats(k), prev, stats_tag(c - 1, m, 1));
        }
      }
    }
    for (Chunk& c : chunks_)
      for (MPI_Request& r : c.fwd_send) QT_CHECK_MPI(MPI_Wait(&r, MPI_STATUS_IGNORE));
    for (Pending& p : grad_sends_) QT_CHECK_MPI(MPI_Wait(&p.request, MPI_STATUS_IGNORE));
    grad_sends_.clear();
    if (moe) {  // the last stage's aux losses and each stage's layers' load, on every stage
      aux_sum_ += pp_.sum(aux);
      // The chunks' counts summed, then over the stages; every stage's vector has the model's
      // length (a stage without sparse layers may have counted none yet: empty).
      using Counts = const std::vector<double>& (Qwen3Stage::*)() const;
      auto over_stages = [&](Counts counts, std::size_t n) {
        std::vector<double> sum(n, 0.0);
        for (const Chunk& c : chunks_) {
          const std::vector<double>& mine = ((*c.stage).*counts)();
          for (std::size_t i = 0; i < mine.size(); ++i) sum.at(i) += mine[i];
        }
        pp_.all_reduce(sum.data(), sum.size(), DType::kF64, ReduceOp::kSum);
        return sum;
      };
      const std::size_t sparse = static_cast<std::size_t>(local_.num_moe_layers());
      load_ = over_stages(&Qwen3Stage::moe_load, sparse * local_.num_experts);
      dropped_ = over_stages(&Qwen3Stage::moe_dropped, sparse);
    }
    return pp_.sum(loss);  // the last stage's, on every stage
  }

 public:
  OptimStepStats optimizer_step(const StepRequest& request) override {
    if (local_.tie_word_embeddings && !lora_) sum_tied_copies();  // (a frozen base: no gradients)
    return state_.step(request);
  }
  MemorySplit memory_split() override {
    const StateBytes b = state_.peak_bytes();
    MemorySplit m;
    m.params = b.params + (lora_ ? lora_->base_bytes() : 0);
    m.grads = b.grads;
    m.optimizer = b.optimizer;
    for (const Chunk& c : chunks_) m.activations += c.stage->buffer_bytes();
    return m;
  }

 private:
  // A send in flight, from a buffer of its own (a gradient's floats or load statistics).
  struct Pending {
    std::vector<char> data;
    MPI_Request request = MPI_REQUEST_NULL;
  };

  // The model chunks this stage runs: chunk v P + s for v < pp_chunks, each a Qwen3Stage with
  // its activation slots and per-step bookkeeping.
  struct Chunk {
    std::unique_ptr<Qwen3Stage> stage;
    std::vector<char> busy;              // [slots]
    std::vector<MPI_Request> fwd_send;   // [slots] the slot's output in flight
    std::vector<int> slot_of;            // [M] the slot of each micro-batch, or -1
  };
  std::vector<Chunk> make_chunks(const Deck& deck) const {
    std::vector<Chunk> out;
    for (int v = 0; v < V_; ++v) {
      const int c = v * P_ + s_;
      const int slots = activation_slots(actions_, c);
      Chunk ch;
      ch.stage = std::make_unique<Qwen3Stage>(
          local_, deck.train.micro_batch, local_len_, deck.train.recompute,
          StageRange::layers(local_.num_layers, plan_.stage_layers[c], plan_.stage_layers[c + 1]),
          slots, static_cast<int>(N_ / n_));
      ch.busy.assign(slots, 0);
      ch.fwd_send.assign(slots, MPI_REQUEST_NULL);
      ch.slot_of.assign(M_, -1);
      out.push_back(std::move(ch));
    }
    return out;
  }
  // The stage's LoRA: its chunks' layers and slots, the held base units (share_'s).
  std::unique_ptr<StageLora> make_lora(const Deck& deck, Mesh& mesh) const {
    std::vector<StageLora::ChunkLayers> layers;
    for (const Chunk& c : chunks_)
      layers.push_back({c.stage->stage().first_layer, c.stage->stage().last_layer,
                        c.stage->slots()});
    return std::make_unique<StageLora>(deck, local_, plan_, share_.held, layers, mesh.shape(),
                                       &mesh.pp(), mesh.tp().rank(), mesh.ep().rank());
  }
  // The last stage of a tied model holds a copy of the embedding.
  bool tied_copy() const { return local_.tie_word_embeddings && s_ == P_ - 1; }
  // The plan's units of this stage (and a tied copy): what its chunks' programs ask for.
  std::vector<int> held_units() const {
    std::vector<int> held, asked;
    for (std::size_t u = 0; u < plan_.units.size(); ++u)
      if (plan_.units[u].stage == s_ || (tied_copy() && static_cast<int>(u) == 0))
        held.push_back(static_cast<int>(u));
    for (const Chunk& c : chunks_) {
      const std::vector<int> us = c.stage->stage_units();
      asked.insert(asked.end(), us.begin(), us.end());
    }
    std::sort(asked.begin(), asked.end());
    asked.erase(std::unique(asked.begin(), asked.end()), asked.end());
    QT_CHECK(held == asked, "the plan's units of stage {} are not its programs'", s_);
    return held;
  }

  void receive(float* buf, int from, int tag) {
    QT_CHECK_MPI(MPI_Recv(buf, static_cast<int>(n_ * H_), MPI_FLOAT, from, tag, pp_.mpi(),
                          MPI_STATUS_IGNORE));
  }
  void send(const float* buf, int to, int tag, MPI_Request* r) {
    QT_CHECK_MPI(MPI_Isend(buf, static_cast<int>(n_ * H_), MPI_FLOAT, to, tag, pp_.mpi(), r));
  }
  // Sends a copy of `count` elements of `type` at buf (overwritten before the send completes:
  // the next backward's d x, a slot's statistics), reusing a finished send's buffer.
  void send_copy(const void* buf, std::size_t count, MPI_Datatype type, int to, int tag) {
    Pending* p = nullptr;
    for (Pending& q : grad_sends_) {
      int done = 0;
      QT_CHECK_MPI(MPI_Test(&q.request, &done, MPI_STATUS_IGNORE));
      if (done) {
        p = &q;
        break;
      }
    }
    if (p == nullptr) p = &grad_sends_.emplace_back();
    int size = 0;
    QT_CHECK_MPI(MPI_Type_size(type, &size));
    const char* bytes = static_cast<const char*>(buf);
    p->data.assign(bytes, bytes + count * static_cast<std::size_t>(size));
    QT_CHECK_MPI(MPI_Isend(p->data.data(), static_cast<int>(count), type, to, tag, pp_.mpi(),
                           &p->request));
  }
  // A micro-batch's load statistics as one message [count (E), psum (E), tokens].
  void send_stats(const cpu::RouterBalance& b, int to, int tag) {
    const std::size_t E = b.count.size();
    QT_CHECK(stats_msg_.size() == 2 * E + 1, "load statistics of {} experts", E);
    std::copy(b.count.begin(), b.count.end(), stats_msg_.begin());
    std::copy(b.psum.begin(), b.psum.end(), stats_msg_.begin() + static_cast<std::ptrdiff_t>(E));
    stats_msg_[2 * E] = b.tokens;
    send_copy(stats_msg_.data(), stats_msg_.size(), MPI_DOUBLE, to, tag);
  }
  void receive_stats(cpu::RouterBalance& b, int from, int tag) {
    const std::size_t E = (stats_msg_.size() - 1) / 2;
    QT_CHECK_MPI(MPI_Recv(stats_msg_.data(), static_cast<int>(stats_msg_.size()), MPI_DOUBLE,
                          from, tag, pp_.mpi(), MPI_STATUS_IGNORE));
    b = cpu::RouterBalance(static_cast<int>(E));
    std::copy(stats_msg_.begin(), stats_msg_.begin() + static_cast<std::ptrdiff_t>(E),
              b.count.begin());
    std::copy(stats_msg_.begin() + static_cast<std::ptrdiff_t>(E), stats_msg_.end() - 1,
              b.psum.begin());
    b.tokens = stats_msg_[2 * E];
  }

  // The first and the last stage add each other's gradients of the tied embedding.
  void sum_tied_copies() {
    if (s_ != 0 && s_ != P_ - 1) return;
    std::vector<float>& g = state_.tied_grads(Qwen3Units{}.embed());
    std::vector<float> other(g.size());
    const int peer = s_ == 0 ? P_ - 1 : 0, n = static_cast<int>(g.size());
    QT_CHECK_MPI(MPI_Sendrecv(g.data(), n, MPI_FLOAT, peer, 0, other.data(), n, MPI_FLOAT, peer, 0,
                              pp_.mpi(), MPI_STATUS_IGNORE));
    for (std::size_t i = 0; i < g.size(); ++i) g[i] += other[i];
  }

  ContextSplit split_;  // mesh.cp's split of train.seq_len (one chunk pair at cp 1)
  Comm* cp_;            // Mesh::cp() with mesh.cp > 1, else null
  int local_len_;       // tokens of a sequence on this rank (train.seq_len at cp 1)
  int vocab_size_;      // the global model's
  std::vector<std::int32_t> cp_inputs_, cp_targets_, cp_positions_;  // cp > 1: [M, B, local_len_]
  int P_, V_, s_;  // stages, chunks a stage, this stage
  std::size_t N_;  // rows of a micro-batch, B x T (T: this cp rank's tokens of a sequence)
  std::size_t n_;  // rows of the activations between stages: N, or N / tp (sequence parallel)
  std::size_t H_;
  int M_;                       // micro-batches a step
  int B_;                       // sequences of a micro-batch
  int tp_;                      // mesh.tp
  int ep_;                      // mesh.ep of a Qwen3-MoE model, else 1
  ParamLayout global_layout_;   // the model's
  ModelConfig local_;           // the tp rank's part of the model (the model at tp 1)
  ParamLayout layout_;          // its layout (units keep their ranges in it)
  ShardPlan plan_;              // its units' stages and the layer split
  std::unique_ptr<LayoutMap> model_map_;  // local -> global pieces (make_model_map), or null
  std::vector<PipeAction> actions_;  // this stage's list of a step
  std::vector<Chunk> chunks_;
  PipelineShare share_;
  std::unique_ptr<StageLora> lora_;  // [lora]: the frozen base and the adapters, else null
  ShardedState state_;               // the trained parameters: the model's, or the adapters
  MpiComm& pp_;
  std::vector<float> dx_;            // [n, H] a received d x
  std::deque<Pending> grad_sends_;   // stable addresses while in flight
  std::vector<double> stats_msg_;    // [2 E + 1] Qwen3-MoE: a load statistics message
  double aux_sum_ = 0;               // moe_aux_loss_sum()
  double aux_weight_ = 0;            // a micro-batch's load-balancing loss in the objective
  std::vector<double> load_;         // moe_load(), summed over the stages
  std::vector<double> dropped_;      // moe_dropped(), summed over the stages
  std::vector<float> router_bias_;   // set_router_bias: [sparse layers, E], or empty
  const char* schedule_name_;
  std::uint64_t seed_;  // train.seed: keys LoRA's dropout masks
};

}  // namespace

std::unique_ptr<TrainBackend> make_cpu_pipeline_backend(const Deck& deck, Mesh& mesh) {
  return std::make_unique<CpuPipelineBackend>(deck, mesh);
}

}  // namespace qt
