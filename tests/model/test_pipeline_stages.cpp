// Pipeline stages of the layer program (Qwen3Stage, model/qwen3_stage.h): a 5-layer model cut into
// 1, 2 and 3 stages (even and uneven), run in one process, gives the whole model's (Qwen3Model's)
// loss of every micro-batch and every parameter gradient, with recompute on and off, tied and
// untied embeddings, and one micro-batch at a time, 1F1B (up to P - s in flight on stage s) or
// all forwards before all backwards. Each stage asks only for its own units and releases all. A
// Qwen3-MoE model's stages, passing each micro-batch's load-balancing statistics beside x and
// d x (Qwen3Stage::moe_stats), give the whole model's aux losses and gradients too.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <map>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "model/qwen3.h"
#include "model/qwen3_stage.h"
#include "parallel/pipeline_schedule.h"
#include "support/compare.h"
#include "support/random.h"
#include "support/random_model.h"

namespace qt {
namespace {

using test::rel_error;

constexpr int kLayers = 5;

ModelConfig tiny_config(bool tied) {
  ModelConfig c;
  c.vocab_size = 24;
  c.hidden_size = 16;
  c.intermediate_size = 20;
  c.num_layers = kLayers;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 8;
  c.tie_word_embeddings = tied;
  c.rope_theta = 10000.0;
  return c;
}

// Random weights (norms away from 1) and M micro-batches of B x T tokens, each row packed from
// two documents (positions restart at a random column), some targets ignored.
struct Problem {
  ModelConfig cfg;
  ParamLayout layout;
  int B = 2, T = 6, M;
  std::vector<float> params;
  std::vector<std::vector<std::int32_t>> inputs, targets, positions;  // [M][B*T]
  long counted = 0;

  Problem(const ModelConfig& c, int micro_batches) : cfg(c), layout(c), M(micro_batches) {
    std::mt19937_64 rng(test::test_seed());
    params = test::random_model_params(layout, rng);
    std::uniform_int_distribution<int> tok(0, c.vocab_size - 1), cut(1, T - 1);
    for (int m = 0; m < M; ++m) {
      inputs.emplace_back();
      targets.emplace_back();
      positions.emplace_back();
      for (int b = 0; b < B; ++b) {
        const int doc2 = cut(rng);
        for (int t = 0; t < T; ++t) {
          inputs[m].push_back(tok(rng));
          targets[m].push_back((b * T + t) % 5 == 3 ? -100 : tok(rng));
          counted += targets[m].back() != -100;
          positions[m].push_back(t < doc2 ? t : t - doc2);
        }
      }
    }
  }
  float scale() const { return 1.0f / static_cast<float>(counted); }
};

// The whole model, one micro-batch after the other: losses [M], a MoE model's aux losses [M]
// (with the load-balancing loss weighed aux_scale in the gradients), and gradients.
struct Result {
  std::vector<double> losses;
  std::vector<float> grads;
  std::vector<double> aux = {};
};

Result run_whole(const Problem& pb, bool recompute, float aux_scale = 0) {
  Qwen3Model model(pb.cfg, pb.B, pb.T, recompute);
  model.set_moe_aux_scale(aux_scale);
  Result r{{}, std::vector<float>(pb.layout.numel(), 0.0f)};
  for (int m = 0; m < pb.M; ++m) {
    r.losses.push_back(model.forward(pb.params.data(), pb.inputs[m].data(), pb.targets[m].data(),
                                     pb.positions[m].data()));
    r.aux.push_back(model.moe_aux_loss());
    model.backward(pb.params.data(), r.grads.data(), pb.scale());
  }
  return r;
}

// A flat buffer seen by one stage: every unit it asks for must be one of `owned`, its weights
// read only while acquired; `held` is what it has acquired and not released.
class StageParams final : public ModelParams {
 public:
  StageParams(const ShardPlan& plan, const float* params, float* grads, std::set<int> owned)
      : flat_(plan, params, grads), owned_(std::move(owned)) {}
  const float* params(int u) override {
    check(u);
    EXPECT_TRUE(held.count(u)) << "unit " << u << " read without acquire";
    return flat_.params(u);
  }
  float* grads(int u) override { return check(u), flat_.grads(u); }
  void acquire(int u) override { check(u), held.insert(u); }
  void release(int u) override { check(u), held.erase(u); }
  void grads_done(int u) override { check(u); }
  std::set<int> held;

 private:
  void check(int u) const { EXPECT_TRUE(owned_.count(u)) << "unit " << u << " of another stage"; }
  FlatParams flat_;
  std::set<int> owned_;
};

enum class Order { kSequential, k1F1B, kAllForwardsFirst };
const char* order_name(Order o) {
  return o == Order::kSequential ? "sequential" : o == Order::k1F1B ? "1F1B" : "all-forwards-first";
}

// Per stage: its actions and how many micro-batches it may hold (its activation slots).
PipeSchedule actions(Order o, int P, int M) {
  if (o == Order::k1F1B) return schedule(PipeScheduleConfig{P, M});
  PipeSchedule s(P);
  for (int st = 0; st < P; ++st) {
    for (int m = 0; m < M; ++m) {
      s[st].push_back({PipeOp::kForward, st, m});
      if (o == Order::kSequential) s[st].push_back({PipeOp::kBackward, st, m});
    }
    if (o == Order::kAllForwardsFirst)
      for (int m = 0; m < M; ++m) s[st].push_back({PipeOp::kBackward, st, m});
  }
  return s;
}
int slots_of(Order o, int P, int st, int M) {
  return o == Order::kSequential ? 1 : o == Order::k1F1B ? std::min(P - st, M) : M;
}

// The stages of `layers` (counts from the first), run in one process: each stage's actions in
// its order, a forward once the previous stage's x has arrived, a backward once the next stage's
// d x has (a message is a copy of the sender's buffer). Each stage adds into its own gradient
// buffer of the whole layout; the result is their sum. A tied table is on two stages (the first
// for the embedding, the last for the lm head), as in a real pipeline where each holds a copy:
// the sum of their buffers is the sum of the two copies' gradients that the pipeline reduces.
// A MoE model's load statistics travel as the pipeline back end sends them: the running sum
// beside x, the last stage's whole micro-batch's back beside d x.
Result run_stages(const Problem& pb, const std::vector<int>& layers, bool recompute, Order order,
                  float aux_scale = 0) {
  const int P = static_cast<int>(layers.size()), M = pb.M;
  const std::size_t NH = static_cast<std::size_t>(pb.B) * pb.T * pb.cfg.hidden_size;
  const Qwen3Units unit{kLayers};
  const PipeSchedule sched = actions(order, P, M);
  std::vector<std::unique_ptr<Qwen3Stage>> stage;
  std::vector<std::vector<float>> grads(P, std::vector<float>(pb.layout.numel(), 0.0f));
  std::vector<std::unique_ptr<StageParams>> params;
  int first = 0;
  for (int s = 0; s < P; ++s) {
    const StageRange range = StageRange::layers(kLayers, first, first + layers[s]);
    first += layers[s];
    stage.push_back(std::make_unique<Qwen3Stage>(pb.cfg, pb.B, pb.T, recompute, range,
                                                 slots_of(order, P, s, M)));
    stage.back()->set_moe_aux_scale(aux_scale);
    // The units a stage owns, independently of the program's list.
    std::set<int> owned;
    if (range.has_embedding || (range.has_head && pb.cfg.tie_word_embeddings))
      owned.insert(unit.embed());
    for (int l = range.first_layer; l < range.last_layer; ++l) owned.insert(unit.layer(l));
    if (range.has_head) owned.insert(unit.head());
    const std::vector<int> listed = stage[s]->stage_units();
    EXPECT_EQ(std::set<int>(listed.begin(), listed.end()), owned) << "stage " << s;
    params.push_back(std::make_unique<StageParams>(stage[s]->units(), pb.params.data(),
                                                   grads[s].data(), owned));
  }
  EXPECT_EQ(first, kLayers);

  Result r{std::vector<double>(M, std::nan("")), std::vector<float>(pb.layout.numel(), 0.0f),
           std::vector<double>(M, std::nan(""))};
  std::map<std::pair<int, int>, std::vector<float>> x_msg, dx_msg;  // (sender, m) -> [N, H]
  std::map<std::pair<int, int>, cpu::RouterBalance> x_stats, dx_stats;  // beside them (MoE)
  const bool moe = pb.cfg.is_moe();
  std::vector<std::map<int, int>> slot_of(P);                       // stage: m -> slot
  std::vector<std::size_t> next(P, 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (int s = 0; s < P; ++s) {
      if (next[s] == sched[s].size()) continue;
      const PipeAction a = sched[s][next[s]];
      const int m = a.micro_batch;
      const StageBatch batch{pb.inputs[m].data(), pb.targets[m].data(), pb.positions[m].data()};
      if (a.op == PipeOp::kForward) {
        if (s > 0 && !x_msg.count({s - 1, m})) continue;
        std::set<int> used;
        for (const auto& kv : slot_of[s]) used.insert(kv.second);
        int k = 0;  // the lowest free slot
        while (used.count(k)) ++k;
        slot_of[s][m] = k;
        const float* x_in = s > 0 ? x_msg[{s - 1, m}].data() : nullptr;
        if (moe && s > 0) stage[s]->moe_stats(k) = x_stats.at({s - 1, m});
        const double loss = stage[s]->forward(*params[s], k, batch, x_in, pb.scale());
        if (s == P - 1) {
          r.losses[m] = loss;
          if (moe) r.aux[m] = cpu::router_aux_loss(stage[s]->moe_stats(k));
        } else {
          x_msg[{s, m}].assign(stage[s]->output(k), stage[s]->output(k) + NH);
          if (moe) x_stats.insert_or_assign({s, m}, stage[s]->moe_stats(k));
        }
        x_msg.erase({s - 1, m});
        x_stats.erase({s - 1, m});
      } else {
        if (s < P - 1 && !dx_msg.count({s + 1, m})) continue;
        const float* dx_in = s < P - 1 ? dx_msg[{s + 1, m}].data() : nullptr;
        const int k = slot_of[s].at(m);
        if (moe && s < P - 1) stage[s]->moe_stats(k) = dx_stats.at({s + 1, m});
        stage[s]->backward(*params[s], k, dx_in);
        slot_of[s].erase(m);
        if (s > 0) {
          dx_msg[{s, m}].assign(stage[s]->input_grad(), stage[s]->input_grad() + NH);
          if (moe) dx_stats.insert_or_assign({s, m}, stage[s]->moe_stats(k));
        }
        dx_msg.erase({s + 1, m});
        dx_stats.erase({s + 1, m});
      }
      ++next[s];
      progress = true;
    }
  }
  for (int s = 0; s < P; ++s) {
    EXPECT_EQ(next[s], sched[s].size()) << "stage " << s << " stuck: " << describe(sched[s]);
    EXPECT_TRUE(params[s]->held.empty()) << "stage " << s << " kept units acquired";
    for (std::size_t i = 0; i < r.grads.size(); ++i) r.grads[i] += grads[s][i];
  }
  EXPECT_TRUE(x_msg.empty() && dx_msg.empty() && x_stats.empty() && dx_stats.empty());
  return r;
}

struct Cut {
  const char* name;
  std::vector<int> layers;
};
using Params = std::tuple<Cut, bool /*tied*/, bool /*recompute*/>;

class PipelineStages : public ::testing::TestWithParam<Params> {};

// Every order of every cut gives the whole model's losses (bitwise) and gradients: bitwise for
// every tensor but a tied table whose head and embedding parts are summed in another order,
// within 1e-6 of the whole model there.
TEST_P(PipelineStages, ReproduceTheWholeModel) {
  const auto& [cut, tied, recompute] = GetParam();
  const Problem pb(tiny_config(tied), 3);
  const Result whole = run_whole(pb, recompute);
  for (Order order : {Order::kSequential, Order::k1F1B, Order::kAllForwardsFirst}) {
    SCOPED_TRACE(order_name(order));
    const Result got = run_stages(pb, cut.layers, recompute, order);
    for (int m = 0; m < pb.M; ++m) EXPECT_EQ(got.losses[m], whole.losses[m]) << "micro-batch " << m;
    ASSERT_LT(rel_error(got.grads, whole.grads), 1e-6);
    for (const ParamInfo& p : pb.layout.params()) {
      const std::vector<float> a(got.grads.begin() + p.offset,
                                 got.grads.begin() + p.offset + p.numel);
      const std::vector<float> b(whole.grads.begin() + p.offset,
                                 whole.grads.begin() + p.offset + p.numel);
      const double e = rel_error(a, b);
      EXPECT_LE(e, 1e-6) << p.name;
      // A tied table's two parts are added in another order across stages, or when heads (in
      // the forwards) run before the embeddings' backwards.
      const bool reordered = tied && p.name == "model.embed_tokens.weight" &&
                             (cut.layers.size() > 1 || order == Order::kAllForwardsFirst);
      if (!reordered) EXPECT_EQ(a, b) << p.name << " (relative error " << e << ")";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cuts, PipelineStages,
    ::testing::Combine(::testing::Values(Cut{"whole", {5}}, Cut{"s2_3", {2, 3}},
                                         Cut{"s3_2", {3, 2}}, Cut{"s1_2_2", {1, 2, 2}},
                                         Cut{"s2_2_1", {2, 2, 1}}, Cut{"s1x5", {1, 1, 1, 1, 1}}),
                       ::testing::Bool(), ::testing::Bool()),
    [](const auto& info) {
      return std::string(std::get<0>(info.param).name) +
             (std::get<1>(info.param) ? "_tied" : "_untied") +
             (std::get<2>(info.param) ? "_recompute" : "_keep");
    });

// Two micro-batches in flight on the first of two stages (1F1B: F0 F1 B0 B1 there, F0 B0 F1 B1
// on the last) give the gradients of running them one after the other, bit for bit.
TEST(PipelineStagesInFlight, TwoMicroBatchesGiveTheSequentialGradients) {
  for (bool recompute : {false, true}) {
    SCOPED_TRACE(recompute ? "recompute" : "keep");
    const Problem pb(tiny_config(false), 2);
    const PipeSchedule s = schedule(PipeScheduleConfig{2, 2});
    ASSERT_EQ(describe(s[0]), "F0.0 F0.1 B0.0 B0.1");
    const Result seq = run_stages(pb, {2, 3}, recompute, Order::kSequential);
    const Result pipe = run_stages(pb, {2, 3}, recompute, Order::k1F1B);
    EXPECT_EQ(pipe.losses, seq.losses);
    EXPECT_EQ(pipe.grads, seq.grads);
    for (float g : pipe.grads) ASSERT_TRUE(std::isfinite(g));
  }
}

// Qwen3-MoE (layers 0, 2, 3, 4 sparse, 1 dense; the load-balancing loss weighed 0.5): every cut
// and order gives the whole model's losses (bitwise), aux losses and gradients. The statistics
// are summed stage by stage rather than layer by layer (fp64: about 1e-16 apart), so the
// router's gradients are compared within 1e-6, not bitwise. Without the statistics from the
// later stages (each stage's backward weighing the aux loss with its own layers' only) the
// routers' gradients would be off by far more: the comparison fails then.
TEST(PipelineStagesMoe, CarryTheLoadStatisticsAndReproduceTheWholeModel) {
  ModelConfig c = tiny_config(false);
  c.num_experts = 4;
  c.num_experts_per_tok = 2;
  c.moe_intermediate_size = 12;
  c.mlp_only_layers = {1};
  c.norm_topk_prob = true;
  const Problem pb(c, 3);
  const float aux_scale = 0.5f;
  for (bool recompute : {false, true}) {
    SCOPED_TRACE(recompute ? "recompute" : "keep");
    const Result whole = run_whole(pb, recompute, aux_scale);
    for (double a : whole.aux) EXPECT_GT(a, 1.0);  // at least 1 (k / E ... E for k = 2)
    for (const std::vector<int>& cut :
         {std::vector<int>{2, 3}, std::vector<int>{1, 2, 2}, std::vector<int>{1, 1, 1, 1, 1}})
      for (Order order : {Order::kSequential, Order::k1F1B, Order::kAllForwardsFirst}) {
        SCOPED_TRACE(std::string(order_name(order)) + ", " + std::to_string(cut.size()) +
                     " stages");
        const Result got = run_stages(pb, cut, recompute, order, aux_scale);
        EXPECT_EQ(got.losses, whole.losses);
        for (int m = 0; m < pb.M; ++m)
          EXPECT_NEAR(got.aux[m], whole.aux[m], 1e-12 * whole.aux[m]) << "micro-batch " << m;
        for (const ParamInfo& p : pb.layout.params()) {
          const std::vector<float> a(got.grads.begin() + p.offset,
                                     got.grads.begin() + p.offset + p.numel);
          const std::vector<float> b(whole.grads.begin() + p.offset,
                                     whole.grads.begin() + p.offset + p.numel);
          EXPECT_LE(rel_error(a, b), 1e-6) << p.name;
        }
      }
  }
}

}  // namespace
}  // namespace qt
