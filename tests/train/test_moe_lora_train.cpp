// LoRA on a Qwen3-MoE model on the CPU reference (issue 18, item 5) under mpiexec -n 2: the tiny
// MoE deck (inputs/tiny-moe.ini) with adapters on the attention projections, the router and every
// expert frozen. Only the adapters train (the router, the experts and every other base weight
// stay bit for bit, the loss of a repeated batch falls); dp 2, ep 2 and tp 2 (with and without
// sequence parallelism) reproduce the serial run;
// a step-5 checkpoint resumes on the uninterrupted run (and an ep 2 one at ep 1); pp 2 (every
// schedule; interleaved on four layers) reproduces it and its checkpoints move to and from one
// stage; on four ranks pp 2 x dp 2 and pp 2 x ep 2; `qtrain export` writes PEFT's names for
// Qwen3MoeForCausalLM's attention adapters.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "hf/export.h"
#include "hf/safetensors.h"
#include "model/lora.h"
#include "model/qwen3.h"
#include "qtrain/data.h"
#include "train/backend.h"
#include "backend_steps.h"
#include "moe_harness.h"

namespace qt {
namespace {

using test::MoeStep;
using test::MoeTraining;
using test::expect_like_serial;
using test::run_seed;
using test::tail;

// The tiny MoE deck with LoRA on q, k, v and o of its three layers (dropout on: its masks must
// not depend on the mesh either) and an adapter's learning rate.
std::string lora_text() {
  return test::deck_text() +
         "\n[lora]\nr = 4\nalpha = 8\ndropout = 0.1\ntargets = q_proj, k_proj, v_proj, o_proj\n";
}
const std::vector<std::string> kLr = {"--optim.lr=2e-2", "--optim.min_lr=2e-3"};

using test::with;

// The training loop by hand on the back end (as test_lora_train.cpp's), so that its state can be
// inspected: the same batch every step, whose loss must fall.
TEST_F(MoeTraining, LoraTrainsOnlyTheAdaptersRouterAndExpertsStayBitForBit) {
  auto world = std::make_shared<MpiComm>(MPI_COMM_WORLD, "world", false);
  const std::uint64_t seed = run_seed();
  const Deck deck = parse_deck_text(
      lora_text(), "moe-lora.ini",
      with(kLr, {"--checkpoint.dir=" + tmp_ + "/c", "--train.seed=" + std::to_string(seed)}), 2);
  Mesh mesh(deck.mesh, world);
  auto be = make_cpu_backend(deck, mesh);
  const ParamLayout& base_layout = be->layout();
  const ParamLayout& ad_layout = be->trained_layout();
  ASSERT_EQ(be->model_pieces().size(), 1u);
  ASSERT_EQ(be->trained_pieces().size(), 1u);
  float* host_base = be->model_pieces()[0].data;        // [base numel]
  float* host_adapters = be->trained_pieces()[0].data;  // [adapter numel]
  init_params(deck.model, base_layout, seed, host_base);
  lora_init(ad_layout, seed, host_adapters);
  be->push_state();
  const std::vector<float> base0(host_base, host_base + base_layout.numel());
  const std::vector<float> ad0(host_adapters, host_adapters + ad_layout.numel());

  auto data = make_data_source(deck);
  const int T = deck.train.seq_len, B = deck.train.micro_batch, local = 4;  // 8 over 2 ranks
  std::vector<double> losses;
  for (std::int64_t step = 0; step < 8; ++step) {
    const auto [loss, counted] =
        test::backend_step(*be, *data, *world, world->rank() * local, local, B, T);
    // The frozen routers still route and their load-balancing loss is reported (k = 2 when
    // balanced, between 1 and E = 8).
    const double aux = world->sum(be->moe_aux_loss_sum());
    EXPECT_GE(aux / 4, 1.0);  // 4 micro-batches over the 2 ranks
    EXPECT_LT(aux / 4, 8.0);
    be->optimizer_step(StepRequest::at(step));
    losses.push_back(world->sum(loss) / counted);
  }
  be->pull_state();
  // Every base weight bit for bit: the routers, the experts, the dense layer, attention, norms,
  // the embedding.
  bool router = false, experts = false;
  for (const ParamInfo& p : base_layout.params()) {
    router |= p.name.find("mlp.gate.weight") != std::string::npos;
    experts |= p.name.find("mlp.experts.") != std::string::npos;
    for (std::size_t i = p.offset; i < p.offset + p.numel; ++i)
      ASSERT_EQ(std::bit_cast<std::uint32_t>(host_base[i]), std::bit_cast<std::uint32_t>(base0[i]))
          << p.name << " element " << i - p.offset;
  }
  EXPECT_TRUE(router && experts);
  for (const ParamInfo& p : ad_layout.params()) {  // attention adapters only, each moved
    EXPECT_NE(p.name.find(".self_attn."), std::string::npos) << p.name;
    double moved = 0;
    for (std::size_t i = 0; i < p.numel; ++i)
      moved += std::abs(host_adapters[p.offset + i] - ad0[p.offset + i]);
    EXPECT_GT(moved, 0) << p.name;
  }
  if (world->rank() == 0)
    std::printf("LoRA on the tiny MoE, one batch repeated: loss %.5f -> %.5f in 8 steps\n",
                losses.front(), losses.back());
  EXPECT_LT(losses.back(), losses.front() - 0.05) << losses.front() << " -> " << losses.back();
  EXPECT_NE(be->describe().find("frozen"), std::string::npos);
}

// dp 2, ep 2 (each rank storing 4 of the 8 frozen experts) and tp 2 on the serial run; step-5
// checkpoints (the adapters and their moments only) resume on the uninterrupted runs, the ep 2
// one at ep 1.
TEST_F(MoeTraining, LoraMeshesAndResumeReproduceTheSerialRun) {
  const std::vector<MoeStep> serial = train("serial", 1, with(kLr, {"--optim.zero_stage=0"}),
                                            lora_text());
  ASSERT_EQ(serial.size(), 10u);
  for (const MoeStep& s : serial) {
    EXPECT_GE(s.aux, 1.0) << "step " << s.step;
    EXPECT_LT(s.aux, 8.0) << "step " << s.step;
    EXPECT_GT(s.norm, 0) << "step " << s.step;  // the adapters' gradient norm
  }
  const std::vector<MoeStep> dp2 = train("dp2", 2, kLr, lora_text());
  expect_like_serial(dp2, serial, "lora_dp2");
  const std::vector<MoeStep> ep2 = train("ep2", 2, with(kLr, {"--mesh.ep=2"}), lora_text());
  expect_like_serial(ep2, serial, "lora_ep2");
  // tp 2: each expert's width split (frozen), the adapters split beside their projections.
  expect_like_serial(train("tp2", 2, with(kLr, {"--mesh.tp=2"}), lora_text()), serial,
                     "lora_tp2");
  expect_like_serial(train("tp2_sp", 2, with(kLr, {"--mesh.tp=2", "--mesh.sequence_parallel=true"}),
                           lora_text()),
                     serial, "lora_tp2_sp");
  // Optimizer memory: the adapters' moments only (2 x 4 bytes x their count, over ZeRO-1's 2
  // shards), never the frozen experts'.
  const double adapters =
      static_cast<double>(lora_layout(parse_deck_text(lora_text(), "t.ini", {}, 1).model,
                                      parse_deck_text(lora_text(), "t.ini", {}, 1).lora)
                              .numel());
  EXPECT_LE(dp2.back().mem_optimizer, 8.0 * adapters / 2 + 64);
  expect_like_serial(resume("dp2_resumed", 2, "dp2", kLr, lora_text()), tail(dp2, 5),
                     "lora_dp2_resumed");
  expect_like_serial(resume("ep2_to_1", 1, "ep2", kLr, lora_text()), tail(serial, 5),
                     "lora_ep2_to_ep1");
}

// pp 2 (train/backend_cpu_pipeline.cpp): the deck's layers 0 (sparse) and 1 (dense) on stage 0,
// layer 2 (sparse) and the head on stage 1, so each stage's adapters see the other's load
// statistics through the aux loss's gradient; 1F1B, ZB-H1 (empty weight halves) and recompute;
// four layers interleaved, a chunk a layer. The step-5 checkpoint of pp 2 resumes serially and
// the serial run's at pp 2.
TEST_F(MoeTraining, LoraPipelineReproducesTheSerialRun) {
  const std::vector<std::string> serial_ov = with(kLr, {"--optim.zero_stage=0"});
  const std::vector<MoeStep> serial = train("serial", 1, serial_ov, lora_text());
  const std::vector<MoeStep> pp2 = train("pp2", 2, with(kLr, {"--mesh.pp=2"}), lora_text());
  expect_like_serial(pp2, serial, "lora_pp2");
  expect_like_serial(train("pp2_zb", 2, with(kLr, {"--mesh.pp=2", "--mesh.pp_schedule=zb-h1"}),
                           lora_text()),
                     serial, "lora_pp2_zb");
  expect_like_serial(train("pp2_recompute", 2, with(kLr, {"--mesh.pp=2", "--train.recompute=true"}),
                           lora_text()),
                     serial, "lora_pp2_recompute");
  expect_like_serial(resume("pp2_to_1", 1, "pp2", kLr, lora_text()), tail(serial, 5),
                     "lora_pp2_to_serial");
  expect_like_serial(resume("serial_to_pp2", 2, "serial", with(kLr, {"--mesh.pp=2"}), lora_text()),
                     tail(serial, 5), "lora_serial_to_pp2");
  const std::vector<std::string> four = {"--model.num_layers=4"};
  const std::vector<MoeStep> serial4 = train("serial4", 1, with(serial_ov, four), lora_text());
  const std::vector<std::string> v2 = {"--mesh.pp=2", "--mesh.pp_chunks=2"};
  expect_like_serial(train("pp2_v2", 2, with(with(kLr, four), v2), lora_text()), serial4,
                     "lora_pp2_v2");
}

// On four ranks: pp 2 x dp 2 and pp 2 x ep 2 (each stage's frozen experts split over its ep
// group, the adapters reduced over dp), and the pp 2 x ep 2 checkpoint resumed serially.
TEST_F(MoeTraining, LoraPipelineOnFourRanks) {
  if (test::world_size() < 4) GTEST_SKIP() << "needs mpiexec -n 4 (ctest runs it)";
  const std::vector<MoeStep> serial = train("serial", 1, with(kLr, {"--optim.zero_stage=0"}),
                                            lora_text());
  expect_like_serial(train("pp2_dp2", 4, with(kLr, {"--mesh.pp=2"}), lora_text()), serial,
                     "lora_pp2_dp2");
  expect_like_serial(train("pp2_ep2", 4, with(kLr, {"--mesh.pp=2", "--mesh.ep=2"}), lora_text()),
                     serial, "lora_pp2_ep2");
  expect_like_serial(resume("pp2_ep2_to_1", 1, "pp2_ep2", kLr, lora_text()), tail(serial, 5),
                     "lora_pp2_ep2_to_serial");
}

// `qtrain export` of a LoRA checkpoint of the MoE model: PEFT's adapter names for
// Qwen3MoeForCausalLM (whose attention modules are named as Qwen3ForCausalLM's), nothing of the
// router or the experts; adapter_config.json's target_modules.
TEST_F(MoeTraining, LoraExportWritesPeftNamesOfTheAttentionAdapters) {
  train("ex", 2, kLr, lora_text());
  auto world = std::make_shared<MpiComm>(MPI_COMM_WORLD, "world", false);
  hf::ExportOptions o;
  o.checkpoint = tmp_ + "/ex/step_00000010.h5";
  o.out_dir = tmp_ + "/adapter";
  hf::export_checkpoint(o, world);
  std::vector<std::string> want;  // written by hand, PEFT's key scheme
  for (int l = 0; l < 3; ++l)
    for (const char* m : {"q_proj", "k_proj", "v_proj", "o_proj"})
      for (const char* ab : {"A", "B"})
        want.push_back("base_model.model.model.layers." + std::to_string(l) + ".self_attn." + m +
                       ".lora_" + ab + ".weight");
  hf::SafetensorsFile st(o.out_dir + "/adapter_model.safetensors");
  std::vector<std::string> got;
  for (const auto& t : st.tensors()) got.push_back(t.name);
  std::sort(got.begin(), got.end());
  std::sort(want.begin(), want.end());
  EXPECT_EQ(got, want);
  // Shapes: A [r, in], B [out, r]; q is 4 heads x 16 = 64 wide, k and v 2 x 16 = 32.
  EXPECT_EQ(st.find("base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight")->shape,
            (std::vector<std::int64_t>{32, 4}));
  EXPECT_EQ(st.find("base_model.model.model.layers.2.self_attn.o_proj.lora_A.weight")->shape,
            (std::vector<std::int64_t>{4, 64}));
  std::ifstream f(o.out_dir + "/adapter_config.json");
  const nlohmann::json j = nlohmann::json::parse(f);
  EXPECT_EQ(j["target_modules"],
            (std::vector<std::string>{"q_proj", "k_proj", "v_proj", "o_proj"}));
  EXPECT_EQ(j["r"], 4);
}

}  // namespace
}  // namespace qt
