// LoRA on every expert of a Qwen3-MoE model on the CPU reference (issue 18, item 5) under
// mpiexec -n 2: the tiny MoE deck (inputs/tiny-moe.ini) with adapters on the attention
// projections and on each expert's gate_up_proj and down_proj (lora.targets experts.*), the
// router and the experts frozen. Only the adapters train (every base weight bit for bit, each
// adapter moves, the loss of a repeated batch falls); dp 2, ep 2 and tp 2 reproduce the serial
// run, and their step-5 checkpoints resume on it (ep 2's at ep 1, tp 2's at tp 1); adapters on
// the experts alone train too; pp 2 (every schedule; interleaved on four layers) reproduces it
// and its checkpoint resumes at pp 1; on four ranks pp 2 with dp 2, ep 2 and tp 2; `qtrain export`
// writes peft's target_parameters layout (hf/lora_export.h), which reads back bit for bit.
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
#include "hf/lora_export.h"
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

std::string lora_text(const std::string& targets =
                          "q_proj, v_proj, experts.gate_up_proj, experts.down_proj") {
  return test::deck_text() + "\n[lora]\nr = 4\nalpha = 8\ndropout = 0\ntargets = " + targets +
         "\n";
}
const std::vector<std::string> kLr = {"--optim.lr=2e-2", "--optim.min_lr=2e-3"};

using test::with;

// The export read back, as peft reads the file (get_delta_weight): each adapter of
// lora_layout(cfg, lora) from the tensor of the name and shape peft_adapter_tensors gives it, the
// experts' B [out, r E] (column j E + e: B_e's column j) put back to [E, out, r].
void read_peft_adapters(const std::string& dir, const ModelConfig& cfg, const LoraConfig& lora,
                        std::vector<float>& adapters) {
  const hf::SafetensorsFile f(dir + "/adapter_model.safetensors");
  const ParamLayout layout = lora_layout(cfg, lora);
  adapters.assign(layout.numel(), 0.0f);
  const std::vector<hf::PeftTensor> want = hf::peft_adapter_tensors(cfg, lora, adapters.data());
  ASSERT_EQ(want.size(), layout.params().size());
  for (std::size_t i = 0; i < want.size(); ++i) {
    const ParamInfo& p = layout.params()[i];
    const hf::StTensor* t = f.find(want[i].name);
    ASSERT_NE(t, nullptr) << want[i].name;
    ASSERT_EQ(t->shape, want[i].shape) << want[i].name;
    std::vector<float> v(p.numel);
    f.read_rows_f32(*t, 0, t->rows(), v.data());
    float* dst = adapters.data() + p.offset;
    if (p.shape.size() == 3 && want[i].name.ends_with("lora_B.weight")) {
      const std::int64_t E = p.shape[0], outd = p.shape[1], r = p.shape[2];
      for (std::int64_t e = 0; e < E; ++e)
        for (std::int64_t o = 0; o < outd; ++o)
          for (std::int64_t j = 0; j < r; ++j) dst[(e * outd + o) * r + j] = v[(o * r + j) * E + e];
    } else {
      std::copy(v.begin(), v.end(), dst);
    }
  }
}

TEST_F(MoeTraining, ExpertLoraTrainsOnlyTheAdapters) {
  auto world = std::make_shared<MpiComm>(MPI_COMM_WORLD, "world", false);
  const std::uint64_t seed = run_seed();
  const Deck deck = parse_deck_text(
      lora_text(), "moe-expert-lora.ini",
      with(kLr, {"--checkpoint.dir=" + tmp_ + "/c", "--train.seed=" + std::to_string(seed)}), 2);
  Mesh mesh(deck.mesh, world);
  auto be = make_cpu_backend(deck, mesh);
  const ParamLayout& base_layout = be->layout();
  const ParamLayout& ad_layout = be->trained_layout();
  float* host_base = be->model_pieces()[0].data;
  float* host_adapters = be->trained_pieces()[0].data;
  init_params(deck.model, base_layout, seed, host_base);
  lora_init(ad_layout, seed, host_adapters);
  be->push_state();
  const std::vector<float> base0(host_base, host_base + base_layout.numel());
  const std::vector<float> ad0(host_adapters, host_adapters + ad_layout.numel());
  // The stacked expert adapters of the sparse layers 0 and 2 (not 1, model.mlp_only_layers):
  // A [E, r, in], B [E, out, r] with E = 8, r = 4, H = 64, Im = 32.
  for (int l : {0, 2}) {
    EXPECT_EQ(ad_layout.find(lora_expert_param_name(l, kLoraExpertsGateUp, 'A')).shape,
              (std::vector<std::int64_t>{8, 4, 64}));
    EXPECT_EQ(ad_layout.find(lora_expert_param_name(l, kLoraExpertsGateUp, 'B')).shape,
              (std::vector<std::int64_t>{8, 64, 4}));
    EXPECT_EQ(ad_layout.find(lora_expert_param_name(l, kLoraExpertsDown, 'A')).shape,
              (std::vector<std::int64_t>{8, 4, 32}));
    EXPECT_EQ(ad_layout.find(lora_expert_param_name(l, kLoraExpertsDown, 'B')).shape,
              (std::vector<std::int64_t>{8, 64, 4}));
  }
  for (const ParamInfo& p : ad_layout.params())
    EXPECT_EQ(p.name.find("layers.1.mlp"), std::string::npos) << p.name;

  auto data = make_data_source(deck);
  const int T = deck.train.seq_len, B = deck.train.micro_batch, local = 4;
  std::vector<double> losses;
  for (std::int64_t step = 0; step < 8; ++step) {
    const auto [loss, counted] =
        test::backend_step(*be, *data, *world, world->rank() * local, local, B, T);
    be->optimizer_step(StepRequest::at(step));
    losses.push_back(world->sum(loss) / counted);
  }
  be->pull_state();
  for (const ParamInfo& p : base_layout.params())
    for (std::size_t i = p.offset; i < p.offset + p.numel; ++i)
      ASSERT_EQ(std::bit_cast<std::uint32_t>(host_base[i]), std::bit_cast<std::uint32_t>(base0[i]))
          << p.name << " element " << i - p.offset;
  int expert_tensors = 0;
  for (const ParamInfo& p : ad_layout.params()) {  // each moved (B from 0, A by B's gradient)
    expert_tensors += p.name.find(".mlp.experts.") != std::string::npos;
    double moved = 0;
    for (std::size_t i = 0; i < p.numel; ++i)
      moved += std::abs(host_adapters[p.offset + i] - ad0[p.offset + i]);
    EXPECT_GT(moved, 0) << p.name;
  }
  EXPECT_EQ(expert_tensors, 8);
  if (world->rank() == 0)
    std::printf("LoRA on the tiny MoE's attention and experts, one batch repeated: loss %.5f -> "
                "%.5f in 8 steps\n", losses.front(), losses.back());
  EXPECT_LT(losses.back(), losses.front() - 0.05) << losses.front() << " -> " << losses.back();
}

// At ep 2 each rank holds the dense adapters whole and its 4 of the 8 experts' rows of each
// stacked expert adapter (plan_adapters, lora_map): in global coordinates its pieces cover those
// rows only, rank r the rows [4 r, 4 r + 4).
TEST_F(MoeTraining, ExpertAdaptersShardedOverEp) {
  auto world = std::make_shared<MpiComm>(MPI_COMM_WORLD, "world", false);
  const Deck deck = parse_deck_text(
      lora_text(), "moe-expert-lora.ini",
      with(kLr, {"--checkpoint.dir=" + tmp_ + "/sharded", "--mesh.ep=2"}), 2);
  Mesh mesh(deck.mesh, world);
  auto be = make_cpu_backend(deck, mesh);
  const ParamLayout& global = be->trained_layout();
  std::size_t held = 0, expert_numel = 0, expert_held = 0;
  for (const FlatPiece& piece : be->trained_pieces()) {
    held += piece.range.size();
    for (const ParamInfo& p : global.params()) {
      const std::size_t lo = std::max(piece.range.begin, p.offset);
      const std::size_t hi = std::min(piece.range.end, p.offset + p.numel);
      if (lo >= hi || p.name.find(".mlp.experts.") == std::string::npos) continue;
      expert_held += hi - lo;
      const std::size_t half = p.numel / 2, r = static_cast<std::size_t>(world->rank());
      EXPECT_GE(lo, p.offset + r * half) << p.name;  // this rank's rows only
      EXPECT_LE(hi, p.offset + (r + 1) * half) << p.name;
    }
  }
  for (const ParamInfo& p : global.params())
    if (p.name.find(".mlp.experts.") != std::string::npos) expert_numel += p.numel;
  ASSERT_GT(expert_numel, 0u);
  EXPECT_EQ(expert_held, expert_numel / 2);
  EXPECT_EQ(held, global.numel() - expert_numel / 2);
}

// dp 2, ep 2 and tp 2 on the serial run, their step-5 checkpoints resumed (ep 2's at ep 1,
// tp 2's at tp 1); the experts' adapters alone (the
// backward of layer 0, sparse, ends in its block) train alike at dp 1 and 2.
TEST_F(MoeTraining, ExpertLoraDp2AndResumeReproduceTheSerialRun) {
  const std::vector<MoeStep> serial = train("serial", 1, with(kLr, {"--optim.zero_stage=0"}),
                                            lora_text());
  ASSERT_EQ(serial.size(), 10u);
  for (const MoeStep& s : serial) EXPECT_GT(s.norm, 0) << "step " << s.step;
  const std::vector<MoeStep> dp2 = train("dp2", 2, kLr, lora_text());
  expect_like_serial(dp2, serial, "expert_lora_dp2");
  // ep 2: each rank stores, runs and trains its 4 experts' adapter rows (ExpertAdaptersShardedOverEp).
  const std::vector<MoeStep> ep2 = train("ep2", 2, with(kLr, {"--mesh.ep=2"}), lora_text());
  expect_like_serial(ep2, serial, "expert_lora_ep2");
  expect_like_serial(resume("ep2_to_1", 1, "ep2", kLr, lora_text()), tail(serial, 5),
                     "expert_lora_ep2_to_ep1");
  // tp 2: each expert's width split, its adapters beside it (gate_up's B by rows, gate and up
  // halves; down's A by columns), with and without sequence parallelism; resumed at tp 1.
  const std::vector<MoeStep> tp2 = train("tp2", 2, with(kLr, {"--mesh.tp=2"}), lora_text());
  expect_like_serial(tp2, serial, "expert_lora_tp2");
  expect_like_serial(train("tp2_sp", 2, with(kLr, {"--mesh.tp=2", "--mesh.sequence_parallel=true"}),
                           lora_text()),
                     serial, "expert_lora_tp2_sp");
  expect_like_serial(resume("tp2_to_1", 1, "tp2", kLr, lora_text()), tail(serial, 5),
                     "expert_lora_tp2_to_tp1");
  expect_like_serial(resume("dp2_resumed", 2, "dp2", kLr, lora_text()), tail(dp2, 5),
                     "expert_lora_dp2_resumed");
  const std::string only = lora_text("experts.down_proj");
  const std::vector<MoeStep> s1 = train("only1", 1, kLr, only);
  expect_like_serial(train("only2", 2, kLr, only), s1, "expert_lora_down_only_dp2");
  expect_like_serial(train("only_ep2", 2, with(kLr, {"--mesh.ep=2"}), only), s1,
                     "expert_lora_down_only_ep2");
  for (const MoeStep& s : s1) EXPECT_GT(s.norm, 0) << "step " << s.step;
  // Not the attention-only run: the MLP's and the experts' adapters change the losses.
  const std::vector<MoeStep> attn = train("attn", 1, kLr, lora_text("q_proj, v_proj"));
  double apart = 0;
  for (std::size_t i = 0; i < attn.size() && i < serial.size(); ++i)
    apart = std::max(apart, std::abs(attn[i].loss - serial[i].loss));
  if (test::world_rank() == 0)
    std::printf("attention adapters alone: losses up to %.3g from the run with the experts'\n",
                apart);
  EXPECT_GT(apart, 1e-4);
}

// pp 2 (train/backend_cpu_pipeline.cpp): layers 0 (sparse) and 1 (dense) on stage 0, layer 2
// (sparse) and the head on stage 1, so each stage trains its own sparse layer's expert adapters
// (its LoraAdapters over its layer range, one slot a micro-batch in flight); 1F1B, ZB-H1 (the
// MoE block's backward is not split: the expert adapters' gradients come with the input half,
// once) and recompute (the block's forward again, its adapters with it); four layers
// interleaved, a chunk a layer. The pp 2 step-5 checkpoint (each stage's stacked [E, r, in] and
// [E, out, r] tensors under the model's names) resumes serially on the serial run.
TEST_F(MoeTraining, ExpertLoraPipelineReproducesTheSerialRun) {
  // One dp rank: each stage adds its micro-batches' gradients in the serial run's order, so the
  // losses are its bits and the gradient norms (summed over pp in double) within rounding.
  constexpr double kNormTight = 1e-12;
  const std::vector<std::string> serial_ov = with(kLr, {"--optim.zero_stage=0"});
  const std::vector<MoeStep> serial = train("serial", 1, serial_ov, lora_text());
  const std::vector<MoeStep> pp2 = train("pp2", 2, with(kLr, {"--mesh.pp=2"}), lora_text());
  expect_like_serial(pp2, serial, "expert_lora_pp2", kNormTight);
  expect_like_serial(train("pp2_zb", 2, with(kLr, {"--mesh.pp=2", "--mesh.pp_schedule=zb-h1"}),
                           lora_text()),
                     serial, "expert_lora_pp2_zb", kNormTight);
  expect_like_serial(train("pp2_recompute", 2, with(kLr, {"--mesh.pp=2", "--train.recompute=true"}),
                           lora_text()),
                     serial, "expert_lora_pp2_recompute", kNormTight);
  expect_like_serial(resume("pp2_to_1", 1, "pp2", kLr, lora_text()), tail(pp2, 5),
                     "expert_lora_pp2_to_serial", kNormTight);
  const std::vector<std::string> four = {"--model.num_layers=4"};
  const std::vector<MoeStep> serial4 = train("serial4", 1, with(serial_ov, four), lora_text());
  const std::vector<std::string> v2 = {"--mesh.pp=2", "--mesh.pp_chunks=2"};
  expect_like_serial(train("pp2_v2", 2, with(with(kLr, four), v2), lora_text()), serial4,
                     "expert_lora_pp2_v2", kNormTight);
}

// On four ranks: pp 2 x dp 2, pp 2 x ep 2 (each stage's experts, and their adapters' rows, run
// over its ep group, an expert exchange a slot; the adapters' gradients summed over dp), the
// latter with ZB-H1 too and its checkpoint resumed serially, and pp 2 x tp 2 (each expert's
// adapters split beside its width on every stage).
TEST_F(MoeTraining, ExpertLoraPipelineOnFourRanks) {
  if (test::world_size() < 4) GTEST_SKIP() << "needs mpiexec -n 4 (ctest runs it)";
  const std::vector<MoeStep> serial = train("serial", 1, with(kLr, {"--optim.zero_stage=0"}),
                                            lora_text());
  expect_like_serial(train("pp2_dp2", 4, with(kLr, {"--mesh.pp=2"}), lora_text()), serial,
                     "expert_lora_pp2_dp2");
  expect_like_serial(train("pp2_ep2", 4, with(kLr, {"--mesh.pp=2", "--mesh.ep=2"}), lora_text()),
                     serial, "expert_lora_pp2_ep2");
  expect_like_serial(train("pp2_ep2_zb", 4,
                           with(kLr, {"--mesh.pp=2", "--mesh.ep=2", "--mesh.pp_schedule=zb-h1"}),
                           lora_text()),
                     serial, "expert_lora_pp2_ep2_zb");
  expect_like_serial(train("pp2_tp2", 4, with(kLr, {"--mesh.pp=2", "--mesh.tp=2"}), lora_text()),
                     serial, "expert_lora_pp2_tp2");
  expect_like_serial(resume("pp2_ep2_to_1", 1, "pp2_ep2", kLr, lora_text()), tail(serial, 5),
                     "expert_lora_pp2_ep2_to_serial");
}

// `qtrain export`: peft's names and shapes for target_parameters (derived from peft's
// lora.ParamWrapper, hf/lora_export.h), adapter_config.json's target_parameters, and the
// directory read back (read_peft_adapters) gives the checkpoint's adapters bit for bit.
TEST_F(MoeTraining, ExpertLoraExportIsPeftsLayoutAndReadsBack) {
  train("ex", 2, kLr, lora_text());
  auto world = std::make_shared<MpiComm>(MPI_COMM_WORLD, "world", false);
  hf::ExportOptions o;
  o.checkpoint = tmp_ + "/ex/step_00000010.h5";
  o.out_dir = tmp_ + "/adapter";
  hf::export_checkpoint(o, world);
  const hf::CheckpointModel cm = hf::read_checkpoint_model(o.checkpoint);
  ASSERT_TRUE(cm.lora.has_value());
  const std::vector<float> ckpt = hf::read_lora_adapters(o.checkpoint, cm, world);
  std::vector<float> back;
  ASSERT_NO_FATAL_FAILURE(read_peft_adapters(o.out_dir, cm.cfg, cm.lora->config, back));
  ASSERT_EQ(back.size(), ckpt.size());
  for (std::size_t i = 0; i < ckpt.size(); ++i)
    ASSERT_EQ(std::bit_cast<std::uint32_t>(back[i]), std::bit_cast<std::uint32_t>(ckpt[i])) << i;

  hf::SafetensorsFile st(o.out_dir + "/adapter_model.safetensors");
  std::vector<std::string> got, want;
  for (const auto& t : st.tensors()) got.push_back(t.name);
  const std::string p = "base_model.model.model.layers.";
  for (int l = 0; l < 3; ++l) {
    for (const char* m : {"q_proj", "v_proj"})
      for (const char* ab : {"A", "B"})
        want.push_back(p + std::to_string(l) + ".self_attn." + m + ".lora_" + ab + ".weight");
    if (l == 1) continue;  // dense
    // peft nests one ParamWrapper a parameter: gate_up_proj's inside down_proj's.
    for (const char* ab : {"A", "B"}) {
      want.push_back(p + std::to_string(l) + ".mlp.experts.base_layer.lora_" + ab + ".weight");
      want.push_back(p + std::to_string(l) + ".mlp.experts.lora_" + ab + ".weight");
    }
  }
  std::sort(got.begin(), got.end());
  std::sort(want.begin(), want.end());
  EXPECT_EQ(got, want);
  // lora_A [E r, in], lora_B [out, r E] (peft's nn.Linear(in, r E) and nn.Linear(r E, out)).
  using S = std::vector<std::int64_t>;
  EXPECT_EQ(st.find(p + "0.mlp.experts.base_layer.lora_A.weight")->shape, (S{32, 64}));
  EXPECT_EQ(st.find(p + "0.mlp.experts.base_layer.lora_B.weight")->shape, (S{64, 32}));
  EXPECT_EQ(st.find(p + "2.mlp.experts.lora_A.weight")->shape, (S{32, 32}));
  EXPECT_EQ(st.find(p + "2.mlp.experts.lora_B.weight")->shape, (S{64, 32}));
  // By hand, peft's get_delta_weight: B.reshape(out, r, E)[o, j, e] is B_e[o, j]: element
  // (o, j E + e). Expert 5, row 7, rank column 3 of layer 2's down_proj.
  const ParamLayout layout = lora_layout(cm.cfg, cm.lora->config);
  const ParamInfo& b = layout.find(lora_expert_param_name(2, kLoraExpertsDown, 'B'));  // [8,64,4]
  const int E = 8, r = 4, e = 5, row = 7, j = 3;
  std::vector<float> peft_b(64 * 32);
  st.read_rows_f32(*st.find(p + "2.mlp.experts.lora_B.weight"), 0, 64, peft_b.data());
  EXPECT_EQ(peft_b[row * r * E + j * E + e], ckpt[b.offset + (e * 64 + row) * r + j]);
  EXPECT_NE(ckpt[b.offset + (e * 64 + row) * r + j], 0.0f);

  std::ifstream f(o.out_dir + "/adapter_config.json");
  const nlohmann::json jc = nlohmann::json::parse(f);
  EXPECT_EQ(jc["target_modules"], (std::vector<std::string>{"q_proj", "v_proj"}));
  EXPECT_EQ(jc["target_parameters"],
            (std::vector<std::string>{"mlp.experts.gate_up_proj", "mlp.experts.down_proj"}));
  EXPECT_EQ(jc["lora_dropout"], 0.0);
}

}  // namespace
}  // namespace qt
