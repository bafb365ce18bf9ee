// Qwen3-MoE training on the CPU reference (issue 18) under mpiexec -n 2 (and -n 4 for the
// four-rank meshes): the tiny MoE deck (inputs/tiny-moe.ini: sparse and dense layers mixed, the
// load-balancing loss on) at dp 2 with every ZeRO stage and with recompute, and at ep 2 and 4
// (each rank storing only its experts), reproduces the serial run's losses, load-balancing losses
// and gradient norms over 10 steps; checkpoints move between dp, ZeRO and ep sizes (ep 2 -> 1,
// 1 -> 2, 4 -> 1, 2 -> 4) on the uninterrupted run's losses; an ep 2 rank holds the memory of its
// experts only; `qtrain export` of an ep 2 checkpoint writes every expert.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "hf/export.h"
#include "hf/weights.h"
#include "qtrain/params.h"
#include "support/compare.h"
#include "support/random.h"
#include "moe_harness.h"

namespace qt {
namespace {

using test::MoeStep;
using test::MoeTraining;
using test::run;
using test::run_seed;
using test::RunResult;
using test::deck_text;
using test::expect_like_serial;
using test::tail;
using test::worst;

TEST_F(MoeTraining, DpAndEveryZeroStageReproduceTheSerialRun) {
  const std::vector<MoeStep> serial = train("serial", 1, {"--optim.zero_stage=0"});
  ASSERT_EQ(serial.size(), 10u);
  EXPECT_LT(serial.back().loss, serial.front().loss);  // it trains
  for (const MoeStep& s : serial) {  // k = 2 for a balanced router; at least 1 (k / E ... E)
    EXPECT_GE(s.aux, 1.0);
    EXPECT_LT(s.aux, 8.0);
    // The deck's two sparse layers each route 8 sequences x 32 tokens x k = 2 token-slots.
    ASSERT_EQ(s.tokens.size(), 2u) << "step " << s.step;
    for (const std::vector<double>& layer : s.tokens) {
      ASSERT_EQ(layer.size(), 8u);
      double sum = 0;
      for (double t : layer) sum += t;
      EXPECT_EQ(sum, 512.0) << "step " << s.step;
    }
  }
  struct Case {
    const char* name;
    std::vector<std::string> ov;
  };
  for (const Case& c : {Case{"dp2_z0", {"--optim.zero_stage=0"}},
                        Case{"dp2_z1", {"--optim.zero_stage=1"}},
                        Case{"dp2_z2", {"--optim.zero_stage=2"}},
                        Case{"dp2_z3", {"--optim.zero_stage=3"}},
                        Case{"dp2_z3_recompute", {"--optim.zero_stage=3", "--train.recompute=true"}}}) {
    SCOPED_TRACE(c.name);
    expect_like_serial(train(c.name, 2, c.ov), serial, c.name);
  }
  // The load-balancing loss pools a micro-batch's tokens (as transformers pools a forward's), so
  // another micro_batch is another objective: dp 2 with micro_batch 1 matches the serial run
  // with micro_batch 1, not the one above.
  const std::vector<MoeStep> serial1 = train("serial_micro1", 1, {"--train.micro_batch=1"});
  const std::vector<MoeStep> dp2 = train("dp2_micro1", 2, {"--train.micro_batch=1"});
  expect_like_serial(dp2, serial1, "dp2_micro1");
  EXPECT_GT(worst(serial1, serial, [](const MoeStep& s) { return s.aux; }), 1e-4);
}

TEST_F(MoeTraining, ExpertParallelReproducesTheSerialRun) {
  const std::vector<MoeStep> serial = train("serial", 1, {});
  for (int zero : {0, 1, 2, 3}) {
    const std::string name = "ep2_z" + std::to_string(zero);
    expect_like_serial(train(name, 2, {"--mesh.ep=2", "--optim.zero_stage=" + std::to_string(zero)}),
                       serial, name.c_str());
  }
  expect_like_serial(train("ep2_recompute", 2, {"--mesh.ep=2", "--train.recompute=true"}), serial,
                     "ep2_recompute");
  // Checkpoints hold each layer's experts as one global tensor: one written at ep 2 resumes at
  // ep 1, and the serial run's resumes at ep 2.
  expect_like_serial(resume("ep1_resumed", 1, "ep2_z1", {}), tail(serial, 5), "ep2 -> ep1");
  expect_like_serial(resume("ep2_resumed", 2, "serial", {"--mesh.ep=2", "--optim.zero_stage=3"}),
                     tail(serial, 5), "ep1 -> ep2");
}

// An ep 2 rank stores half the experts: at ZeRO-0 (every rank holds every unit whole) its AdamW
// moments are the whole model's less the other rank's experts, exactly, and its parameters the
// same within the padding of its units to dp shards; dp 2 without ep stores what the serial run
// does. The sizes are the deck's arithmetic, written out here.
TEST_F(MoeTraining, ExpertParallelRankStoresOnlyItsExperts) {
  const std::vector<MoeStep> serial = train("serial", 1, {"--optim.zero_stage=0"});
  const std::vector<MoeStep> dp2 = train("dp2", 2, {"--optim.zero_stage=0"});
  const std::vector<MoeStep> ep2 = train("ep2", 2, {"--mesh.ep=2", "--optim.zero_stage=0"});
  ASSERT_FALSE(serial.empty());
  ASSERT_FALSE(dp2.empty());
  ASSERT_FALSE(ep2.empty());
  // inputs/tiny-moe.ini: 2 sparse layers of E = 8 experts, each [2 Im, H] + [H, Im] with
  // Im = 32, H = 64; an ep 2 rank lacks 4 of each layer's 8.
  const double absent = 2.0 * 4 * (2 * 32 * 64 + 64 * 32);  // parameters
  const double units = 7;  // embedding, 3 layers, head, 2 expert units: each padded < 1 element
  EXPECT_EQ(dp2.back().mem_optimizer, serial.back().mem_optimizer);
  EXPECT_EQ(serial.back().mem_optimizer - ep2.back().mem_optimizer, 2 * 4 * absent);  // m and v
  const double saved = serial.back().mem_params - ep2.back().mem_params;
  EXPECT_LE(saved, 4 * absent);
  EXPECT_GE(saved, 4 * (absent - units));
  if (test::world_rank() == 0)
    std::printf("ep 2: %.0f bytes of parameters and %.0f of moments a rank fewer than serial "
                "(%.0f experts' parameters absent)\n", saved,
                serial.back().mem_optimizer - ep2.back().mem_optimizer, absent);
}

// `qtrain export` of an ep 2 run's checkpoint writes every expert of every sparse layer: each
// equals, as far as bf16 keeps it, the serial run's export at the same step.
TEST_F(MoeTraining, ExportOfAnExpertParallelRunHasEveryExpert) {
  train("serial", 1, {"--train.stop_at=5"});
  train("ep2", 2, {"--mesh.ep=2", "--optim.zero_stage=3", "--train.stop_at=5"});
  auto world = std::make_shared<MpiComm>(MPI_COMM_WORLD, "world", false);
  const hf::CheckpointModel cm = hf::read_checkpoint_model(tmp_ + "/ep2/step_00000005.h5");
  const ParamLayout layout(cm.cfg);
  std::vector<std::vector<float>> got;
  for (const char* run_name : {"serial", "ep2"}) {
    hf::ExportOptions o;
    o.checkpoint = tmp_ + "/" + run_name + "/step_00000005.h5";
    o.out_dir = tmp_ + "/" + run_name + "_hf";
    hf::export_checkpoint(o, world);
    got.emplace_back(layout.numel(), NAN);
    hf::load_params(o.out_dir, layout, hf::all_rows(layout, got.back().data()),
                    cm.cfg.tie_word_embeddings, *world);
  }
  int experts = 0;
  for (int l = 0; l < cm.cfg.num_layers; ++l) {
    if (!cm.cfg.is_moe_layer(l)) continue;
    for (const char* t : {"gate_up_proj", "down_proj"}) {
      const ParamInfo& p = layout.find("model.layers." + std::to_string(l) + ".mlp.experts." + t);
      const std::size_t per = p.numel / static_cast<std::size_t>(p.shape[0]);
      for (std::size_t e = 0; e < static_cast<std::size_t>(p.shape[0]); ++e) {
        const std::size_t at = p.offset + e * per;
        const std::vector<float> want(got[0].begin() + at, got[0].begin() + at + per);
        const std::vector<float> mine(got[1].begin() + at, got[1].begin() + at + per);
        EXPECT_LT(test::rel_error(mine, want), 1e-3) << p.name << " expert " << e;
        ++experts;
      }
    }
  }
  EXPECT_EQ(experts, 2 * 2 * 8);  // 2 sparse layers, 2 tensors, 8 experts
  EXPECT_LT(test::rel_error(got[1], got[0]), 1e-3);  // and everything else
}

// mpiexec -n 4 (ctest train_moe_np4): ep 4 and ep 2 x expert-dp 2.
TEST_F(MoeTraining, ExpertParallelOnFourRanks) {
  if (test::world_size() < 4) GTEST_SKIP() << "needs mpiexec -n 4 (ctest train_moe_np4 runs it)";
  const std::vector<MoeStep> serial = train("serial", 1, {});
  expect_like_serial(train("ep4_z1", 4, {"--mesh.ep=4", "--optim.zero_stage=1"}), serial, "ep4_z1");
  expect_like_serial(train("ep2_dp4_z3", 4, {"--mesh.ep=2", "--optim.zero_stage=3"}), serial,
                     "ep2_dp4_z3");
  // Checkpoints move between ep sizes: ep 4 -> 1 and ep 2 -> 4.
  expect_like_serial(resume("ep1_resumed", 1, "ep4_z1", {}), tail(serial, 5), "ep4 -> ep1");
  expect_like_serial(resume("ep4_resumed", 4, "ep2_dp4_z3", {"--mesh.ep=4", "--optim.zero_stage=2"}),
                     tail(serial, 5), "ep2 -> ep4");
}

TEST_F(MoeTraining, CheckpointOfDp2Zero3ResumesSerially) {
  const std::vector<MoeStep> serial = train("serial", 1, {});
  train("z3", 2, {"--optim.zero_stage=3", "--train.stop_at=5"});
  expect_like_serial(resume("resumed", 1, "z3", {"--optim.zero_stage=0"}), tail(serial, 5),
                     "dp2 z3 -> serial");
}

// A checkpoint records the MoE architecture: resuming it with another one is an error naming the
// key, never a silent load of same-shaped tensors (k or the renormalisation change no shape).
TEST_F(MoeTraining, CheckpointRefusesAnotherMoeArchitecture) {
  train("z1", 2, {"--optim.zero_stage=1", "--train.stop_at=5"});
  const std::string ckpt = tmp_ + "/z1/step_00000005.h5";
  struct Case {
    std::vector<std::string> ov;
    std::string says;
  };
  for (const Case& c :
       {Case{{"--model.num_experts_per_tok=1"}, "model.num_experts_per_tok is 2 in the checkpoint but 1"},
        Case{{"--model.norm_topk_prob=false"}, "model.norm_topk_prob is true in the checkpoint but false"},
        Case{{"--model.mlp_only_layers=0"}, "model.mlp_only_layers is '1' in the checkpoint but '0'"},
        Case{{"--model.num_experts=0"}, "model.num_experts is 8 in the checkpoint but 0"}}) {
    std::vector<std::string> ov = c.ov;
    ov.insert(ov.end(), {"--checkpoint.resume=" + ckpt, "--checkpoint.dir=" + tmp_ + "/other",
                         "--train.steps=10"});
    const RunResult r = run(1, deck_text(), ov, tmp_ + "/other.jsonl");
    EXPECT_EQ(r.exit_code, 2) << c.says;
    EXPECT_NE(r.error.find(c.says), std::string::npos) << r.error;
  }
  // The load-balancing weight is an objective setting, not the architecture: it may change.
  const RunResult ok = run(1, deck_text(),
                           {"--checkpoint.resume=" + ckpt, "--checkpoint.dir=" + tmp_ + "/ok",
                            "--train.steps=6", "--model.router_aux_loss_coef=0.1"},
                           tmp_ + "/ok.jsonl");
  EXPECT_EQ(ok.exit_code, 0) << ok.error;
}

}  // namespace
}  // namespace qt
