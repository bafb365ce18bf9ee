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
// of its chunks' layers as one unit of the driver over its dp group (ZeRO 0 or 1; the gradient
// norm summed over pp). Each action keys the dropout masks with its micro-batch's first sequence
// and each activation slot keeps its own adapter activations, so the masks and the gradients
// are the serial run's. ZB-H1 runs too: with no base gradients its weight halves have nothing
// to do (the adapters' gradients come with the input halves).
#include <mpi.h>

#include <fmt/format.h>

#include <algorithm>
#include <deque>
#include <memory>
#include <vector>

#include "model/qwen3_stage.h"
#include "optim/sharded_state.h"
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
      : P_(mesh.shape().pp),
        V_(mesh.shape().pp_chunks),
        s_(mesh.coord().pp),
        N_(static_cast<std::size_t>(deck.train.micro_batch) * deck.train.seq_len),
        n_(N_ / static_cast<std::size_t>(mesh.shape().seq_parallel())),
        H_(deck.model.hidden_size),
        M_(deck.train.global_batch / (deck.train.micro_batch * mesh.shape().dp)),
        B_(deck.train.micro_batch),
        tp_(mesh.shape().tp),
        global_layout_(deck.model),
        local_(tp_local_config(deck.model, tp_)),
        layout_(local_),
        plan_(plan_qwen3(local_, layout_, mesh.shape(), deck.optim.zero_stage,
                         tp_kv_replicas(deck.model, tp_))),
        actions_(stage_actions(mesh.shape(), M_, s_)),
        chunks_(make_chunks(deck)),
        share_{held_units(), &mesh.pp(), tied_copy() ? Qwen3Units{}.embed() : -1},
        lora_(deck.lora.enabled() ? make_lora(deck, mesh) : nullptr),
        state_(lora_ ? lora_->plan() : plan_, lora_ ? lora_->layout() : layout_, deck.optim,
               mesh.dp(), deck.train.steps, &mesh.tp(), lora_ ? &lora_->share() : &share_),
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
      tp_map_ = std::make_unique<TpMap>(global_layout_, layout_, plan_, mesh.tp().rank());
    }
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
  // Pieces in global coordinates (TpMap under tensor parallelism; a stage's adapters always).
  std::vector<FlatPiece> model_pieces() override {
    return global_pieces(tp_map_.get(), lora_ ? lora_->base_pieces() : state_.param_pieces(),
                         /*writing=*/false);
  }
  std::vector<FlatPiece> trained_pieces() override {
    if (!lora_) return model_pieces();
    return lora_->map().to_global(state_.param_pieces(), /*writing=*/false);
  }
  const ParamLayout& trained_layout() const override {
    return lora_ ? lora_->global_layout() : global_layout_;
  }
  std::vector<StatePiece> checkpoint_pieces() override {
    if (lora_) return lora_->map().to_global(state_.checkpoint_pieces(), /*writing=*/true);
    return global_pieces(tp_map_.get(), state_.checkpoint_pieces(), /*writing=*/true);
  }
  StateTargets checkpoint_targets() override {
    if (lora_) return lora_->map().to_global(state_.checkpoint_targets());
    return global_targets(tp_map_.get(), state_.checkpoint_targets());
  }
  void push_state() override {}  // the host buffers are the live state
  void pull_state() override {}
  void zero_grads() override { state_.zero_grads(); }
  double micro_step(const std::int32_t*, const std::int32_t*, const std::int32_t*,
                    float) override {
    QT_CHECK(false, "a pipeline stage runs a step's micro-batches together (micro_batches)");
    return 0;
  }

  double micro_batches(const MicroBatches& mb, float loss_scale) override {
    QT_CHECK(mb.count == M_, "{} micro-batches, the schedule has {}", mb.count, M_);
    const int C = P_ * V_;  // chunks of the model; chunk c runs on stage c % P
    const int prev = (s_ + P_ - 1) % P_, next = (s_ + 1) % P_;  // the wrap: chunk v P + P - 1 -> (v + 1) P
    // Tags: the activation into chunk c of micro-batch m, 2 (m C + c); its gradient, + 1.
    auto tag = [&](int c, int m, int grad) { return 2 * (m * C + c) + grad; };
    for (Chunk& c : chunks_) {
      std::fill(c.slot_of.begin(), c.slot_of.end(), -1);
      std::fill(c.busy.begin(), c.busy.end(), 0);
    }
    // The stage's parameters: the model's, or the frozen base beside the bound adapters.
    ModelParams& mp = lora_ ? static_cast<ModelParams&>(*lora_) : state_;
    if (lora_) lora_->bind(state_.params(0), state_.grads(0));  // one unit, whole at ZeRO 0/1
    double loss = 0;
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
        }
        loss += st.forward(mp, k, batch, x_in, loss_scale);
        if (c < C - 1) send(st.output(k), next, tag(c + 1, m, 0), &ch.fwd_send[k]);
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
        }
        if (a.op == PipeOp::kBackwardInput) {
          st.backward_input(mp, k, dx_in);  // the slot waits for its weight half
        } else {
          st.backward(mp, k, dx_in);
          ch.busy[k] = 0;
        }
        if (c > 0) send_copy(st.input_grad(), prev, tag(c - 1, m, 1));
      }
    }
    for (Chunk& c : chunks_)
      for (MPI_Request& r : c.fwd_send) QT_CHECK_MPI(MPI_Wait(&r, MPI_STATUS_IGNORE));
    for (Pending& p : grad_sends_) QT_CHECK_MPI(MPI_Wait(&p.request, MPI_STATUS_IGNORE));
    grad_sends_.clear();
    return pp_.sum(loss);  // the last stage's, on every stage
  }

  OptimStepStats optimizer_step(std::int64_t step) override {
    if (local_.tie_word_embeddings && !lora_) sum_tied_copies();  // (a frozen base: no gradients)
    return state_.step(step);
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
  // A gradient send in flight, from a buffer of its own.
  struct Pending {
    std::vector<float> data;
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
          local_, deck.train.micro_batch, deck.train.seq_len, deck.train.recompute,
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
                                       &mesh.pp(), mesh.tp().rank());
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
  // Sends a copy of buf (overwritten by the next backward), reusing a finished send's buffer.
  void send_copy(const float* buf, int to, int tag) {
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
    p->data.assign(buf, buf + n_ * H_);
    send(p->data.data(), to, tag, &p->request);
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

  int P_, V_, s_;  // stages, chunks a stage, this stage
  std::size_t N_;  // rows of a micro-batch, B x T
  std::size_t n_;  // rows of the activations between stages: N, or N / tp (sequence parallel)
  std::size_t H_;
  int M_;                       // micro-batches a step
  int B_;                       // sequences of a micro-batch
  int tp_;                      // mesh.tp
  ParamLayout global_layout_;   // the model's
  ModelConfig local_;           // the tp rank's part of the model (the model at tp 1)
  ParamLayout layout_;          // its layout (units keep their ranges in it)
  ShardPlan plan_;              // its units' stages and the layer split
  std::unique_ptr<TpMap> tp_map_;  // local -> global pieces with tp > 1, else null
  std::vector<PipeAction> actions_;  // this stage's list of a step
  std::vector<Chunk> chunks_;
  PipelineShare share_;
  std::unique_ptr<StageLora> lora_;  // [lora]: the frozen base and the adapters, else null
  ShardedState state_;               // the trained parameters: the model's, or the adapters
  MpiComm& pp_;
  std::vector<float> dx_;            // [n, H] a received d x
  std::deque<Pending> grad_sends_;   // stable addresses while in flight
  const char* schedule_name_;
  std::uint64_t seed_;  // train.seed: keys LoRA's dropout masks
};

}  // namespace

std::unique_ptr<TrainBackend> make_cpu_pipeline_backend(const Deck& deck, Mesh& mesh) {
  return std::make_unique<CpuPipelineBackend>(deck, mesh);
}

}  // namespace qt
