// LoRA runs on the CPU back end under mpiexec -n 2: only the adapters train (the base stays bit
// for bit), dp = 1 and 2 and ZeRO-1 give the same losses (dropout included), a stopped run
// resumes exactly, wrong resumptions are errors, and `qtrain export` writes PEFT's adapter files
// or, with --merge, the base with W + scale * B A, from a seed base and from a model.init base.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "hf/export.h"
#include "hf/lora_export.h"
#include "hf/safetensors.h"
#include "hf/weights.h"
#include "model/lora.h"
#include "model/qwen3.h"
#include "qtrain/data.h"
#include "train/backend.h"
#include "backend_steps.h"
#include "training_harness.h"

namespace qt {
namespace {

namespace fs = std::filesystem;
using test::run;
using test::StepRecord;

std::string deck_text(const std::string& dir, bool lora = true, bool preset = true) {
  return std::string(preset ? "[model]\npreset = tiny\n" : "") +
         "[train]\nseq_len = 16\nmicro_batch = 2\nglobal_batch = 8\nsteps = 12\nseed = 42\n"
         "[optim]\nlr = 2e-2\nmin_lr = 2e-3\nwarmup_steps = 2\nweight_decay = 0.01\n" +
         (lora ? "[lora]\nr = 4\nalpha = 8\ndropout = 0.1\ntargets = all-linear\n" : "") +
         "[data]\nsource = synthetic\n"
         "[checkpoint]\ndir = " +
         dir +
         "\nevery = 6\nkeep = 3\nresume = none\n"
         "[log]\nevery = 1\n";
}

std::shared_ptr<MpiComm> world_comm() {
  return std::make_shared<MpiComm>(MPI_COMM_WORLD, "world", false);
}

class LoraTraining : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(test::world_size(), 2) << "run under mpiexec -n 2";
    tmp_ = test::shared_temp_dir("lora");
  }
  void TearDown() override {
    MPI_Barrier(MPI_COMM_WORLD);
    if (test::world_rank() == 0) fs::remove_all(tmp_);
  }
  std::string path(const std::string& name) const { return tmp_ + "/" + name; }
  std::string tmp_;
};

// The training loop by hand on the back end, so that its state can be inspected.
TEST_F(LoraTraining, OnlyAdaptersTrainTheBaseStaysBitForBit) {
  auto world = world_comm();
  const Deck deck = parse_deck_text(deck_text(path("c")), "lora.ini", {}, 2);
  Mesh mesh(deck.mesh, world);
  auto be = make_cpu_backend(deck, mesh);
  const ParamLayout& base_layout = be->layout();
  const ParamLayout& ad_layout = be->trained_layout();
  EXPECT_EQ(ad_layout.numel(), lora_layout(deck.model, deck.lora).numel());
  const StateTargets held = be->checkpoint_targets();  // 2 x adapters, nothing else
  ASSERT_EQ(held.exp_avg.size(), 1u);
  EXPECT_EQ(held.exp_avg[0].range.size(), ad_layout.numel());
  ASSERT_EQ(be->model_pieces().size(), 1u);
  ASSERT_EQ(be->trained_pieces().size(), 1u);
  float* host_base = be->model_pieces()[0].data;     // [base numel]
  float* host_adapters = be->trained_pieces()[0].data;  // [adapter numel]
  init_params(deck.model, base_layout, 42, host_base);
  lora_init(ad_layout, 42, host_adapters);
  be->push_state();
  const std::vector<float> base0(host_base, host_base + base_layout.numel());
  const std::vector<float> ad0(host_adapters, host_adapters + ad_layout.numel());

  auto data = make_data_source(deck);
  const int T = deck.train.seq_len, B = deck.train.micro_batch, local = 4;
  std::vector<double> losses;
  for (std::int64_t step = 0; step < 8; ++step) {
    // The same batch every step: its loss must fall (the frozen head of this random base leaves
    // little to learn on fresh batches of the synthetic chain).
    const auto [loss, counted] =
        test::backend_step(*be, *data, *world, world->rank() * local, local, B, T);
    be->optimizer_step(StepRequest::at(step));
    losses.push_back(world->sum(loss) / counted);
  }
  be->pull_state();
  const float* base = host_base;
  for (std::size_t i = 0; i < base0.size(); ++i)
    ASSERT_EQ(std::bit_cast<std::uint32_t>(base[i]), std::bit_cast<std::uint32_t>(base0[i])) << i;
  const std::vector<float> ad(host_adapters, host_adapters + ad_layout.numel());
  EXPECT_NE(ad, ad0);
  for (const ParamInfo& p : ad_layout.params()) {  // every B left zero, every A moved
    double moved = 0;
    for (std::size_t i = 0; i < p.numel; ++i)
      moved += std::abs(ad[p.offset + i] - ad0[p.offset + i]);
    EXPECT_GT(moved, 0) << p.name;
  }
  std::vector<float> r0 = ad;  // the same adapters on every rank
  world->broadcast(r0.data(), r0.size(), DType::kF32, 0);
  EXPECT_EQ(ad, r0);
  EXPECT_LT(losses.back(), losses.front() - 0.1) << losses.front() << " -> " << losses.back();
  EXPECT_NE(be->describe().find("frozen"), std::string::npos);
}

// [lora] with train.device = cuda goes to the CUDA back end (tests/gpu/test_lora_cuda.cpp); a
// build without it says so rather than training without the adapters.
TEST_F(LoraTraining, CudaDeviceGoesToTheCudaBackEnd) {
#ifdef QTRAIN_HAVE_CUDA
  GTEST_SKIP() << "built with CUDA: tests/gpu/test_lora_cuda.cpp trains LoRA on the GPU";
#else
  Deck deck = parse_deck_text(deck_text(path("c")), "lora.ini",
                              {"--train.device=cuda", "--model.head_dim=64"}, 2);
  Mesh mesh(deck.mesh, world_comm());
  try {
    make_backend(deck, mesh);
    ADD_FAILURE() << "no error";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("built without the CUDA back end"), std::string::npos)
        << e.what();
  }
#endif
}

TEST_F(LoraTraining, MeshIndependentResumableAndRefusesMismatches) {
  auto one = run(1, deck_text(path("a")), {}, path("a.jsonl"));
  auto two = run(2, deck_text(path("b")), {}, path("b.jsonl"));
  auto z1 = run(2, deck_text(path("c")), {"--optim.zero_stage=1"}, path("c.jsonl"));
  ASSERT_EQ(one.exit_code, 0) << one.error;
  ASSERT_EQ(two.steps.size(), 12u);
  // It learns: lower than the frozen base on the same batches (lr ~ 0) over the last steps.
  auto frozen =
      run(2, deck_text(path("g")), {"--optim.lr=1e-12", "--optim.min_lr=0"}, path("g.jsonl"));
  ASSERT_EQ(frozen.steps.size(), 12u);
  double gain = 0;
  for (int i = 8; i < 12; ++i) gain += (frozen.steps[i].loss - two.steps[i].loss) / 4;
  EXPECT_GT(gain, 0.03);
  EXPECT_LT(test::max_rel_loss_diff(two.steps, one.steps), 1e-5);
  EXPECT_LT(test::max_rel_loss_diff(z1.steps, one.steps), 1e-5);

  auto first = run(2, deck_text(path("d")), {"--train.stop_at=6"}, path("d.jsonl"));
  ASSERT_EQ(first.steps.size(), 6u);
  auto rest = run(2, deck_text(path("d")), {"--checkpoint.resume=auto"}, path("d.jsonl"));
  ASSERT_EQ(rest.exit_code, 0) << rest.error;
  ASSERT_EQ(rest.steps.size(), 12u);
  for (int i = 6; i < 12; ++i) {
    EXPECT_EQ(rest.steps[i].loss, two.steps[i].loss) << "step " << i + 1;  // bit for bit
    EXPECT_EQ(rest.steps[i].grad_norm, two.steps[i].grad_norm) << "step " << i + 1;
  }

  const std::string ckpt = path("b/step_00000012.h5");
  auto full = run(2, deck_text(path("e"), false), {"--checkpoint.resume=" + ckpt}, path("e.jsonl"));
  EXPECT_EQ(full.exit_code, 2);
  EXPECT_NE(full.error.find("holds LoRA adapters (lora.r = 4), not the whole model"),
            std::string::npos)
      << full.error;
  auto r8 =
      run(2, deck_text(path("e")), {"--checkpoint.resume=" + ckpt, "--lora.r=8"}, path("e.jsonl"));
  EXPECT_EQ(r8.exit_code, 2);
  EXPECT_NE(r8.error.find("lora.r is 4 in the checkpoint but 8 in the deck"), std::string::npos)
      << r8.error;
  auto seed = run(2, deck_text(path("e")), {"--checkpoint.resume=" + ckpt, "--train.seed=7"},
                  path("e.jsonl"));
  EXPECT_EQ(seed.exit_code, 2);
  EXPECT_NE(seed.error.find("trained on the base train.seed = 42, but this run's base is "
                            "train.seed = 7"),
            std::string::npos)
      << seed.error;
  auto whole = run(2, deck_text(path("f"), false), {"--train.steps=2"}, path("f.jsonl"));
  ASSERT_EQ(whole.exit_code, 0) << whole.error;
  auto onto = run(2, deck_text(path("e")), {"--checkpoint.resume=" + path("f/step_00000002.h5")},
                  path("e.jsonl"));
  EXPECT_EQ(onto.exit_code, 2);
  EXPECT_NE(onto.error.find("holds the whole model, not LoRA adapters"), std::string::npos)
      << onto.error;
}

// Under tensor parallelism the adapters follow their base projection's split (B by rows beside
// q/k/v and gate/up, A by columns beside o and down; the whole factors' gradients summed over
// tp), and a row-parallel projection's dropout masks are the columns of the serial run's: tp 2,
// with and without sequence parallelism, gives the serial losses (dropout 0.1 on), and its
// checkpoint (global tensors) continues on one rank as the serial run does.
TEST_F(LoraTraining, TensorParallelFollowsTheBaseSplit) {
  auto one = run(1, deck_text(path("a")), {}, path("a.jsonl"));
  ASSERT_EQ(one.exit_code, 0) << one.error;
  ASSERT_EQ(one.steps.size(), 12u);
  for (const auto& [name, extra] :
       std::vector<std::pair<std::string, std::vector<std::string>>>{
           {"tp2", {"--mesh.tp=2"}},
           {"tp2_sp", {"--mesh.tp=2", "--mesh.sequence_parallel=true"}}}) {
    SCOPED_TRACE(name);
    auto tp = run(2, deck_text(path(name)), extra, path(name + ".jsonl"));
    ASSERT_EQ(tp.exit_code, 0) << tp.error;
    ASSERT_EQ(tp.steps.size(), 12u);
    EXPECT_LT(test::max_rel_loss_diff(tp.steps, one.steps), 1e-5);
  }
  auto rest = run(1, deck_text(path("r")),
                  {"--checkpoint.resume=" + path("tp2/step_00000006.h5")}, path("r.jsonl"));
  ASSERT_EQ(rest.exit_code, 0) << rest.error;
  ASSERT_EQ(rest.steps.size(), 6u);
  EXPECT_EQ(rest.steps.front().step, 7);
  for (std::size_t i = 0; i < rest.steps.size(); ++i)
    EXPECT_NEAR(rest.steps[i].loss, one.steps[6 + i].loss, 1e-5 * one.steps[6 + i].loss)
        << "step " << rest.steps[i].step;
}

// One key/value head at tp 2: both ranks hold its k/v projections and their adapters (B by the
// head's rows, summed over the two ranks; A whole, summed over tp as usual), so tp 2 gives the
// serial losses, with and without sequence parallelism, and checkpoints move both ways between
// tp 2 and one rank. Fails if the B factors' gradients are not summed (the copies drift apart).
TEST_F(LoraTraining, TensorParallelSharesKeyValueHeadAdapters) {
  const std::string heads = "--model.num_kv_heads=1";
  auto one = run(1, deck_text(path("a")), {heads}, path("a.jsonl"));
  ASSERT_EQ(one.exit_code, 0) << one.error;
  ASSERT_EQ(one.steps.size(), 12u);
  for (const auto& [name, extra] :
       std::vector<std::pair<std::string, std::vector<std::string>>>{
           {"tp2", {heads, "--mesh.tp=2"}},
           {"tp2_sp", {heads, "--mesh.tp=2", "--mesh.sequence_parallel=true"}},
           {"to_tp2", {heads, "--mesh.tp=2", "--checkpoint.resume=" + path("a/step_00000006.h5")}},
           {"to_one", {heads, "--checkpoint.resume=" + path("tp2/step_00000006.h5")}}}) {
    SCOPED_TRACE(name);
    const bool resumed = name.rfind("to_", 0) == 0;
    auto r = run(name == "to_one" ? 1 : 2, deck_text(path(name)), extra, path(name + ".jsonl"));
    ASSERT_EQ(r.exit_code, 0) << r.error;
    ASSERT_EQ(r.steps.size(), resumed ? 6u : 12u);
    const std::size_t first = resumed ? 6 : 0;
    EXPECT_EQ(r.steps.front().step, static_cast<long>(first) + 1);
    for (std::size_t i = 0; i < r.steps.size(); ++i)
      EXPECT_NEAR(r.steps[i].loss, one.steps[first + i].loss, 1e-5 * one.steps[first + i].loss)
          << "step " << r.steps[i].step;
  }
}

float round_bf16(float x) { return hf::bf16_to_f32(hf::f32_to_bf16(x)); }

// Exports of a LoRA checkpoint: adapter files exactly as stored, and the merge bit for bit the
// bf16 rounding of base + scale * B A computed here. `base_dir` "" = the seed's base.
void check_exports(const std::string& ckpt, const std::string& out, const std::string& base_dir) {
  auto world = world_comm();
  const hf::CheckpointModel cm = hf::read_checkpoint_model(ckpt);
  ASSERT_TRUE(cm.lora.has_value());
  EXPECT_EQ(cm.lora->base.init, base_dir);
  hf::ExportOptions o;
  o.checkpoint = ckpt;
  o.out_dir = out + "/adapter";
  const bool root = world->rank() == 0;  // the summary line is rank 0's
  const std::string summary = hf::export_checkpoint(o, world);
  if (root) EXPECT_NE(summary.find("LoRA adapters for peft"), std::string::npos) << summary;
  const std::vector<float> adapters = hf::read_lora_adapters(ckpt, cm, world);
  const ParamLayout lay = lora_layout(cm.cfg, cm.lora->config);
  {
    hf::SafetensorsFile st(o.out_dir + "/adapter_model.safetensors");
    ASSERT_EQ(st.tensors().size(), lay.params().size());
    for (const ParamInfo& p : lay.params()) {
      const hf::StTensor* t = st.find(p.name);
      ASSERT_NE(t, nullptr) << p.name;
      EXPECT_EQ(t->dtype, hf::StDType::kF32);
      EXPECT_EQ(t->shape, p.shape);
      std::vector<float> v(p.numel);
      st.read_rows_f32(*t, 0, t->rows(), v.data());
      EXPECT_TRUE(std::equal(v.begin(), v.end(), adapters.begin() + p.offset)) << p.name;
    }
    std::ifstream f(o.out_dir + "/adapter_config.json");
    const nlohmann::json j = nlohmann::json::parse(f);
    EXPECT_EQ(j["peft_type"], "LORA");
    EXPECT_EQ(j["task_type"], "CAUSAL_LM");
    EXPECT_EQ(j["r"], 4);
    EXPECT_EQ(j["lora_alpha"], 8);
    EXPECT_EQ(j["lora_dropout"], 0.1);
    EXPECT_EQ(j["bias"], "none");
    EXPECT_EQ(j["fan_in_fan_out"], false);
    EXPECT_EQ(j["use_rslora"], false);
    EXPECT_EQ(j["init_lora_weights"], true);
    EXPECT_TRUE(j["modules_to_save"].is_null());
    EXPECT_EQ(j["target_modules"].size(), 7u);
    if (base_dir.empty())
      EXPECT_TRUE(j["base_model_name_or_path"].is_null());
    else
      EXPECT_EQ(j["base_model_name_or_path"], base_dir);
  }
  o.out_dir = out + "/merged";
  o.merge = true;
  const std::string merged = hf::export_checkpoint(o, world);
  if (root) EXPECT_NE(merged.find("LoRA adapters merged"), std::string::npos) << merged;
  const ParamLayout layout(cm.cfg);
  std::vector<float> want(layout.numel()), got(layout.numel());
  if (base_dir.empty())
    init_params(cm.cfg, layout, 42, want.data());
  else
    hf::load_params(base_dir, layout, hf::all_rows(layout, want.data()), cm.cfg.tie_word_embeddings,
                    *world);
  std::vector<float> base = want;
  lora_merge(cm.cfg, cm.lora->config, adapters.data(), layout, want.data());
  hf::load_params(o.out_dir, layout, hf::all_rows(layout, got.data()), cm.cfg.tie_word_embeddings,
                  *world);
  std::size_t changed = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    ASSERT_EQ(std::bit_cast<std::uint32_t>(got[i]),
              std::bit_cast<std::uint32_t>(round_bf16(want[i])))
        << i;
    changed += round_bf16(want[i]) != round_bf16(base[i]);
  }
  EXPECT_GT(changed, want.size() / 4);  // the merge moved the adapted projections
}

TEST_F(LoraTraining, ExportsAdaptersAndMergesFromASeedBase) {
  auto r = run(2, deck_text(path("s")), {}, path("s.jsonl"));
  ASSERT_EQ(r.exit_code, 0) << r.error;
  check_exports(path("s/step_00000012.h5"), path("out"), "");
}

TEST_F(LoraTraining, StartsFromModelInitAndExportsAgainstIt) {
  // A whole-model run exported as the HF base, then LoRA on it (model.init defines the model).
  auto whole = run(2, deck_text(path("w"), false), {"--train.steps=2"}, path("w.jsonl"));
  ASSERT_EQ(whole.exit_code, 0) << whole.error;
  hf::ExportOptions o;
  o.checkpoint = path("w/step_00000002.h5");
  o.out_dir = path("base");
  hf::export_checkpoint(o, world_comm());
  auto lora =
      run(2, deck_text(path("l"), true, false), {"--model.init=" + path("base")}, path("l.jsonl"));
  ASSERT_EQ(lora.exit_code, 0) << lora.error;
  // Resuming reloads the frozen base from model.init (the checkpoint holds only the adapters).
  auto resumed =
      run(2, deck_text(path("l"), true, false),
          {"--model.init=" + path("base"), "--checkpoint.resume=" + path("l/step_00000006.h5"),
           "--checkpoint.dir=" + path("l2")},
          path("l2.jsonl"));
  ASSERT_EQ(resumed.exit_code, 0) << resumed.error;
  ASSERT_EQ(resumed.steps.size(), 6u);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(resumed.steps[i].loss, lora.steps[6 + i].loss);
  check_exports(path("l/step_00000012.h5"), path("out"), path("base"));
  // --merge wants a LoRA checkpoint.
  o.out_dir = path("nope");
  o.merge = true;
  try {
    hf::export_checkpoint(o, world_comm());
    ADD_FAILURE() << "--merge of a whole-model checkpoint did not fail";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("is not a LoRA run's"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace qt
