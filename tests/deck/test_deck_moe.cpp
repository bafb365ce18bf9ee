// Deck keys and errors of Qwen3-MoE models (docs/moe.md, docs/decks.md): the model keys, what
// each back end and mesh accepts or refuses (each refusal naming its key), and the presets'
// parameter counts against the spec's table.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "deck_test_util.h"
#include "qtrain/deck.h"
#include "qtrain/model_config.h"

namespace {

using qt::Deck;
using qt::deck_test::expect_error;
using qt::deck_test::parse;

TEST(Deck, MoeKeys) {
  const Deck d = parse("[model]\nnum_experts = 8\nnum_experts_per_tok = 2\n"
                       "moe_intermediate_size = 32\nmlp_only_layers = 1\n"
                       "norm_topk_prob = false\nrouter_aux_loss_coef = 0.01\n");
  EXPECT_TRUE(d.model.is_moe());
  EXPECT_EQ(d.model.mlp_only_layers, (std::vector<int>{1}));
  EXPECT_FALSE(d.model.is_moe_layer(1));
  EXPECT_TRUE(d.model.is_moe_layer(0));
  EXPECT_FALSE(d.model.norm_topk_prob);
  const Deck e = parse("[model]\nnum_layers = 6\nnum_experts = 4\nnum_experts_per_tok = 1\n"
                       "mlp_only_layers = 0, 3 ,5\n");
  EXPECT_EQ(e.model.mlp_only_layers, (std::vector<int>{0, 3, 5}));
  EXPECT_EQ(e.model.num_moe_layers(), 3);
  EXPECT_EQ(parse("").model.num_experts, 0);  // dense by default
  EXPECT_TRUE(parse("[model]\nmlp_only_layers =\n").model.mlp_only_layers.empty());
}

TEST(DeckErrors, Moe) {
  const std::string moe = "[model]\nnum_experts = 4\nnum_experts_per_tok = 2\n";
  expect_error("[model]\nnum_experts = -1\n", {"deck.ini:2:", "model.num_experts = -1", ">= 0"});
  expect_error("[model]\nnum_experts = 4\nnum_experts_per_tok = 5\n",
               {"model.num_experts_per_tok = 5", "[1, model.num_experts = 4]"});
  expect_error(moe + "moe_intermediate_size = 0\n", {"model.moe_intermediate_size = 0", ">= 1"});
  expect_error(moe + "decoder_sparse_step = 0\n", {"model.decoder_sparse_step = 0", ">= 1"});
  expect_error(moe + "mlp_only_layers = 2\n", {"model.mlp_only_layers = 2", "layer 2",
                                                "model.num_layers - 1 = 1"});
  expect_error(moe + "mlp_only_layers = 1, 0\n", {"model.mlp_only_layers", "ascending"});
  expect_error(moe + "mlp_only_layers = 1,,0\n", {"model.mlp_only_layers", "empty item"});
  expect_error(moe + "mlp_only_layers = one\n", {"model.mlp_only_layers", "item 'one'"});
  expect_error(moe + "router_aux_loss_coef = -0.1\n", {"model.router_aux_loss_coef", ">= 0"});
  // Auxiliary-loss-free balancing: a rate >= 0, on MoE models only.
  EXPECT_EQ(parse(moe + "router_bias_update_rate = 0.001\n").model.router_bias_update_rate, 0.001);
  expect_error(moe + "router_bias_update_rate = -0.001\n",
               {"model.router_bias_update_rate = -0.001", ">= 0"});
  expect_error(moe + "router_bias_update_rate = nan\n", {"model.router_bias_update_rate", "finite"});
  EXPECT_EQ(parse(moe + "router_bias_update_rate = 0.001\nhead_dim = 64\n[train]\ndevice = cuda\n")
                .model.router_bias_update_rate,
            0.001);
  expect_error("[model]\nrouter_bias_update_rate = 0.001\n",
               {"model.router_bias_update_rate", "dense"});
  // The expert capacity: a factor >= 0 (0 dropless, the default), on MoE models only, cpu only.
  EXPECT_EQ(parse(moe).model.moe_capacity_factor, 0.0);
  EXPECT_EQ(parse(moe + "moe_capacity_factor = 1.25\n").model.moe_capacity_factor, 1.25);
  expect_error(moe + "moe_capacity_factor = -1\n",
               {"deck.ini:4:", "model.moe_capacity_factor = -1", "finite number >= 0"});
  expect_error(moe + "moe_capacity_factor = inf\n", {"model.moe_capacity_factor", "finite"});
  expect_error(moe + "moe_capacity_factor = nan\n", {"model.moe_capacity_factor", "finite"});
  expect_error("[model]\nmoe_capacity_factor = 1.25\n", {"model.moe_capacity_factor", "dense"});
  EXPECT_EQ(parse(moe + "moe_capacity_factor = 1.25\nhead_dim = 64\n[train]\ndevice = cuda\n")
                .model.moe_capacity_factor,
            1.25);
  // train.device = cuda: one GPU, dp, tp (with sequence parallelism too), ep and tp x ep at
  // ZeRO 0-3 (cuda/cuda_ops_moe.cpp, cuda_ops_moe_ep.cpp); the router's limits.
  const std::string cuda = "head_dim = 64\n[train]\ndevice = cuda\n";
  EXPECT_EQ(parse(moe + cuda).train.device, "cuda");
  for (int zero = 0; zero <= 3; ++zero)
    EXPECT_EQ(parse(moe + cuda + "[mesh]\nep = 2\n[optim]\nzero_stage = " +
                    std::to_string(zero) + "\n")
                  .mesh.ep,
              2);
  EXPECT_EQ(parse(moe + cuda + "[mesh]\nep = 2\n[optim]\nzero_stage = 2\noffload = cpu\n")
                .optim.offload,
            "cpu");
  EXPECT_EQ(parse(moe + cuda + "[mesh]\nep = 2\n[optim]\nzero_stage = 3\noffload = cpu\n")
                .optim.zero_stage,
            3);
  EXPECT_EQ(parse(moe + cuda + "[mesh]\nep = 2\ntp = 2\n[train]\nglobal_batch = 16\n", {}, 4)
                .mesh.tp,
            2);
  // ep with pp (cuda/backend_cuda_pipeline.cpp) and with LoRA (backend_cuda_lora.cpp, and the
  // pipeline's), at any ZeRO stage the pipeline runs.
  EXPECT_EQ(parse(moe + cuda + "[mesh]\nep = 2\npp = 2\n[train]\nglobal_batch = 16\n", {}, 4)
                .mesh.ep,
            2);
  EXPECT_EQ(parse(moe + cuda + "[mesh]\nep = 2\npp = 2\npp_schedule = zb-h1\n[train]\n"
                  "global_batch = 16\n", {}, 4)
                .mesh.pp_schedule,
            "zb-h1");
  EXPECT_EQ(parse(moe + cuda + "[mesh]\nep = 2\n[lora]\nr = 4\n").mesh.ep, 2);
  EXPECT_EQ(parse(moe + cuda + "[mesh]\nep = 2\npp = 2\n[lora]\nr = 4\n[train]\n"
                  "global_batch = 16\n", {}, 4)
                .lora.r,
            4);
  expect_error("[model]\nnum_experts = 1025\nnum_experts_per_tok = 2\n" + cuda,
               {"model.num_experts = 1025", "> 1024", "train.device = cuda"});
  expect_error("[model]\nnum_experts = 64\nnum_experts_per_tok = 33\n" + cuda,
               {"model.num_experts_per_tok = 33", "> 32", "train.device = cuda"});
  for (int zero = 0; zero <= 3; ++zero)
    EXPECT_EQ(parse(moe + cuda + "[mesh]\ntp = 2\n[optim]\nzero_stage = " +
                    std::to_string(zero) + "\n")
                  .mesh.tp,
              2);
  EXPECT_TRUE(parse(moe + cuda + "[mesh]\ntp = 2\nsequence_parallel = true\n")
                  .mesh.sequence_parallel);
  // Pipeline parallelism on cuda (backend_cuda_pipeline.cpp): 1F1B, ZB-H1, interleaved, with
  // recompute, ep (above) and LoRA.
  EXPECT_EQ(parse(moe + cuda + "[mesh]\npp = 2\n").mesh.pp, 2);
  EXPECT_EQ(parse(moe + cuda + "[mesh]\npp = 2\npp_schedule = zb-h1\n").mesh.pp_schedule,
            "zb-h1");
  EXPECT_TRUE(parse(moe + cuda + "recompute = true\n[mesh]\npp = 2\n").train.recompute);
  EXPECT_EQ(parse(moe + cuda + "[lora]\nr = 4\n[mesh]\npp = 2\n").mesh.pp, 2);
  const std::string ex_pp = "[lora]\nr = 4\ntargets = experts.down_proj\n[mesh]\npp = 2\n";
  // LoRA on the attention projections (the router and experts frozen): both back ends at any
  // dp, ep, tp and pp; no adapters on the experts or the dense MLP.
  EXPECT_EQ(parse(moe + cuda + "[lora]\nr = 4\n").lora.r, 4);
  EXPECT_EQ(parse(moe + cuda + "[lora]\nr = 4\n[mesh]\ntp = 2\n").mesh.tp, 2);
  EXPECT_EQ(parse(moe + "[lora]\nr = 4\n").lora.r, 4);
  EXPECT_EQ(parse(moe + "[lora]\nr = 4\n[mesh]\nep = 2\n").mesh.ep, 2);
  // MLP targets on a Qwen3-MoE model, on either back end: peft 0.21 reads them as the experts'
  // too.
  for (const std::string& dev : {std::string(), cuda}) {
    expect_error(moe + dev + "[lora]\nr = 4\ntargets = q_proj, gate_proj\n",
                 {"lora.targets", "gate_proj", "Qwen3-MoE", "experts.gate_up_proj"});
    expect_error(moe + dev + "[lora]\nr = 4\ntargets = all-linear\n",
                 {"lora.targets", "gate_proj", "q_proj, k_proj, v_proj, o_proj"});
  }
  // Expert adapters with pp: both back ends at every schedule, with ep on four ranks.
  EXPECT_EQ(parse(moe + ex_pp).mesh.pp, 2);
  EXPECT_EQ(parse(moe + ex_pp + "pp_schedule = zb-h1\n").mesh.pp_schedule, "zb-h1");
  EXPECT_EQ(parse(moe + ex_pp + "ep = 2\n[train]\nglobal_batch = 16\n", {}, 4).mesh.ep, 2);
  EXPECT_EQ(parse(moe + cuda + ex_pp).mesh.pp, 2);
  // Adapters on every expert (experts.gate_up_proj, experts.down_proj): both back ends at any
  // dp, with or without attention adapters, ep, tp and pp (above); not with dropout or on a
  // dense model.
  const std::string ex = "[lora]\nr = 4\ntargets = q_proj, experts.gate_up_proj, experts.down_proj\n";
  EXPECT_EQ(parse(moe + ex).lora.targets, "q_proj, experts.gate_up_proj, experts.down_proj");
  EXPECT_EQ(parse(moe + "[lora]\nr = 4\ntargets = experts.down_proj\n").mesh.dp, 2);
  EXPECT_EQ(parse(moe + cuda + ex).lora.targets, parse(moe + ex).lora.targets);
  EXPECT_EQ(parse(moe + cuda + ex + "[mesh]\nep = 2\n").mesh.ep, 2);
  expect_error(moe + ex + "dropout = 0.1\n", {"lora.dropout = 0.1", "ParamWrapper"});
  expect_error(moe + cuda + ex + "dropout = 0.1\n", {"lora.dropout = 0.1", "ParamWrapper"});
  EXPECT_EQ(parse(moe + ex + "[mesh]\nep = 2\n").mesh.ep, 2);
  EXPECT_EQ(parse(moe + ex + "[mesh]\ntp = 2\n").mesh.tp, 2);
  expect_error(ex, {"lora.targets", "experts.gate_up_proj", "dense model"});
  expect_error("[lora]\ntargets = experts.down_proj\n", {"lora.targets", "dense model"});
  expect_error(moe + "[lora]\nr = 4\ntargets = experts.down_proj, experts.down_proj\n",
               {"lora.targets", "given twice"});
  expect_error(moe + "[lora]\nr = 4\ntargets = experts.gate_proj\n",
               {"lora.targets", "unknown target", "experts.gate_up_proj"});
  EXPECT_EQ(parse(moe + "[lora]\nr = 4\n[mesh]\ntp = 2\n").mesh.tp, 2);
  EXPECT_EQ(parse(moe + "[lora]\nr = 4\n[mesh]\npp = 2\n").mesh.pp, 2);
  EXPECT_EQ(parse(moe + "[lora]\nr = 4\n[mesh]\npp = 2\nep = 2\n[train]\nglobal_batch = 16\n",
                  {}, 4).mesh.ep, 2);
  // The CPU reference runs tp (each expert's width split), pp and both with ep; tp must split
  // the width.
  EXPECT_EQ(parse(moe + "[mesh]\ntp = 2\n").mesh.tp, 2);
  EXPECT_EQ(parse(moe + "[mesh]\npp = 2\n").mesh.pp, 2);
  expect_error(moe + "moe_intermediate_size = 6\n[mesh]\ntp = 4\n", {}, 4,
               {"mesh.tp = 4", "does not divide model.moe_intermediate_size = 6"});
  EXPECT_EQ(parse(moe + "[mesh]\ntp = 2\nep = 2\n[train]\nglobal_batch = 16\n", {}, 4).mesh.ep, 2);
  expect_error("[model]\nnum_experts = 6\nnum_experts_per_tok = 2\n[mesh]\nep = 4\n"
               "[train]\nglobal_batch = 16\n",
               {}, 4, {"mesh.ep = 4", "does not divide model.num_experts = 6"});
  EXPECT_EQ(parse(moe + "[mesh]\nep = 2\n").mesh.ep, 2);  // experts split over the 2 dp ranks
}

TEST(ModelPresets, MoeParameterCountsMatchTheSpecTable) {
  struct Row {
    const char* name;
    std::int64_t total;
    double active;
  };
  for (const Row& r : {Row{"qwen3-30b-a3b", 30532122624LL, 3353032704.0},
                       Row{"qwen3-235b-a22b", 235093634560LL, 22190763520.0}}) {
    auto m = qt::model_preset(r.name);
    ASSERT_TRUE(m.has_value()) << r.name;
    EXPECT_EQ(m->num_params(), r.total) << r.name;
    EXPECT_EQ(m->active_params_f64(), r.active) << r.name;
    EXPECT_EQ(m->num_experts, 128);
    EXPECT_EQ(m->num_experts_per_tok, 8);
    EXPECT_EQ(m->num_kv_heads, 4);
    EXPECT_TRUE(m->norm_topk_prob);
    EXPECT_EQ(m->num_moe_layers(), m->num_layers);
  }
  // transformers' rule for the dense layers among sparse ones.
  qt::ModelConfig c;
  c.num_layers = 6;
  c.num_experts = 4;
  c.decoder_sparse_step = 2;
  c.mlp_only_layers = {3};
  std::vector<int> sparse;
  for (int l = 0; l < c.num_layers; ++l)
    if (c.is_moe_layer(l)) sparse.push_back(l);
  EXPECT_EQ(sparse, (std::vector<int>{1, 5}));
  c.num_experts = 0;
  EXPECT_FALSE(c.is_moe_layer(1));
}

}  // namespace
