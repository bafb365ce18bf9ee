// Qwen3-MoE through Hugging Face directories under MPI (np 1 and 2): export writes the experts
// per expert (the checkpoint names, as transformers' save_pretrained) and import stacks them into
// the layout's fused tensors, or takes fused ones; a run from an export trains as one resumed
// from the same weights; the directories that transformers 5.17 wrote for the golden fixtures
// import to the fixtures' parameters exactly; a missing, misshapen or doubly stored expert is a
// UserError naming it on every rank.
#include <gtest/gtest.h>
#include <hdf5.h>
#include <mpi.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "hf/config.h"
#include "hf/export.h"
#include "hf/moe_weights.h"
#include "hf/safetensors.h"
#include "hf/weights.h"
#include "hf_test_util.h"
#include "model/qwen3.h"
#include "qtrain/checkpoint.h"
#include "qtrain/deck.h"
#include "qtrain/error.h"
#include "qtrain/mesh.h"
#include "reference/fixture.h"
#include "support/compare.h"
#include "support/random.h"
#include "train/training_harness.h"

namespace qt::hf {
namespace {

namespace fs = std::filesystem;
using test::shared_temp_dir;
using test::world_rank;
using test_util::barrier;
using test_util::expect_error_everywhere;
using test_util::round_bf16;
using test_util::shared_seed;
using test_util::world_comm;

// Layers 0 and 2 sparse (4 experts of width 8, 2 a token), layer 1 dense (mlp_only_layers).
// H = 32 != Im, 2 Im: a transposed expert has another shape.
ModelConfig small_moe(bool tied) {
  ModelConfig c = test_util::small_model(tied);
  c.vocab_size = 64;
  c.num_layers = 3;
  c.max_position_embeddings = 256;
  c.num_experts = 4;
  c.num_experts_per_tok = 2;
  c.moe_intermediate_size = 8;
  c.norm_topk_prob = false;
  c.mlp_only_layers = {1};
  c.router_aux_loss_coef = 0.02;
  return c;
}

// Random weights that bf16 holds exactly, so that export -> import is the identity.
std::vector<float> bf16_params(const ParamLayout& layout, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto v = test::random_vector<float>(layout.numel(), rng, 0.5);
  for (float& x : v) x = round_bf16(x);
  return v;
}

void expect_bitwise(const ParamLayout& layout, const std::vector<float>& got,
                    const std::vector<float>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (const ParamInfo& p : layout.params())
    for (std::size_t i = 0; i < p.numel; ++i)
      ASSERT_EQ(std::bit_cast<std::uint32_t>(got[p.offset + i]),
                std::bit_cast<std::uint32_t>(want[p.offset + i]))
          << p.name << " element " << i;
}

void expect_same_config(const ModelConfig& a, const ModelConfig& b) {
  EXPECT_EQ(a.num_params(), b.num_params());
  EXPECT_EQ(a.head_dim, b.head_dim);
  EXPECT_EQ(a.tie_word_embeddings, b.tie_word_embeddings);
  EXPECT_EQ(a.num_experts, b.num_experts);
  EXPECT_EQ(a.num_experts_per_tok, b.num_experts_per_tok);
  EXPECT_EQ(a.moe_intermediate_size, b.moe_intermediate_size);
  EXPECT_EQ(a.norm_topk_prob, b.norm_topk_prob);
  EXPECT_EQ(a.decoder_sparse_step, b.decoder_sparse_step);
  EXPECT_EQ(a.mlp_only_layers, b.mlp_only_layers);
  EXPECT_EQ(a.router_aux_loss_coef, b.router_aux_loss_coef);
}

std::vector<float> load_all(const std::string& dir, const ParamLayout& layout, bool tied) {
  std::vector<float> got(layout.numel(), -1.0f);
  load_params(dir, layout, all_rows(layout, got.data()), tied, *world_comm());
  return got;
}

// The tensor names and shapes of a directory's files (every shard).
std::map<std::string, std::vector<std::int64_t>> file_tensors(const std::string& dir) {
  std::map<std::string, std::vector<std::int64_t>> out;
  for (const auto& f : fs::directory_iterator(dir))
    if (f.path().extension() == ".safetensors") {
      const SafetensorsFile file(f.path().string());
      for (const StTensor& t : file.tensors()) out[t.name] = t.shape;
    }
  return out;
}

TEST(HfMoe, ExpertFileTensorsSplitTheFusedRows) {
  const ParamLayout layout(small_moe(false));
  const auto gu = expert_file_tensors(layout.find("model.layers.2.mlp.experts.gate_up_proj"));
  ASSERT_EQ(gu.size(), 4u);
  ASSERT_EQ(gu[3].size(), 2u);
  EXPECT_EQ(gu[3][0].name, "model.layers.2.mlp.experts.3.gate_proj.weight");
  EXPECT_EQ(gu[3][1].name, "model.layers.2.mlp.experts.3.up_proj.weight");
  EXPECT_EQ(gu[3][1].shape, (std::vector<std::int64_t>{8, 32}));
  const auto d = expert_file_tensors(layout.find("model.layers.0.mlp.experts.down_proj"));
  ASSERT_EQ(d.size(), 4u);
  EXPECT_EQ(d[1][0].name, "model.layers.0.mlp.experts.1.down_proj.weight");
  EXPECT_EQ(d[1][0].shape, (std::vector<std::int64_t>{32, 8}));
  EXPECT_TRUE(expert_file_tensors(layout.find("model.layers.0.mlp.gate.weight")).empty());
  EXPECT_TRUE(expert_file_tensors(layout.find("model.layers.1.mlp.down_proj.weight")).empty());
  EXPECT_TRUE(is_expert_file_tensor("model.layers.0.mlp.experts.12.up_proj.weight"));
  EXPECT_FALSE(is_expert_file_tensor("model.layers.0.mlp.experts.gate_up_proj"));
  EXPECT_FALSE(is_expert_file_tensor("model.layers.0.mlp.down_proj.weight"));
}

// write_model_dir -> config.json and per-expert tensors -> load_params gives the same
// parameters, in one file and in shards cut between an expert's tensors, tied and untied; and
// flat pieces cutting through experts (a ZeRO shard's) read the same bits.
TEST(HfMoe, ExportThenImportIsTheIdentity) {
  auto world = world_comm();
  for (bool tied : {false, true}) {
    SCOPED_TRACE(tied ? "tied" : "untied");
    const ModelConfig cfg = small_moe(tied);
    const ParamLayout layout(cfg);
    const std::uint64_t seed = shared_seed();
    const auto src = bf16_params(layout, seed);
    for (std::uint64_t shard : {std::uint64_t{5'000'000'000}, std::uint64_t{3000}}) {
      const std::string dir = shared_temp_dir("hf-moe");
      if (world_rank() == 0)
        write_model_dir(dir, cfg, layout, src.data(), shard, default_extras(cfg), "{}\n");
      barrier();
      const nlohmann::json j = nlohmann::json::parse(std::ifstream(dir + "/config.json"));
      EXPECT_EQ(j["architectures"][0], "Qwen3MoeForCausalLM");
      EXPECT_EQ(j["model_type"], "qwen3_moe");
      EXPECT_EQ(j["output_router_logits"], false);
      expect_same_config(read_config(dir), cfg);

      // The files: the checkpoint names, no fused tensor; gate rows before up rows.
      const auto names = file_tensors(dir);
      EXPECT_EQ(names.size(), tied ? 55u : 56u);  // 2 layers x (4 experts x 3 + router) + 30 or 29
      for (const auto& [name, shape] : names)
        EXPECT_EQ(name.find("gate_up_proj"), std::string::npos) << name;
      EXPECT_EQ(names.at("model.layers.2.mlp.experts.3.down_proj.weight"),
                (std::vector<std::int64_t>{32, 8}));
      EXPECT_EQ(names.count("model.layers.1.mlp.experts.0.down_proj.weight"), 0u);
      EXPECT_EQ(names.at("model.layers.1.mlp.gate_proj.weight"), (std::vector<std::int64_t>{48, 32}));
      if (shard < 1'000'000) {
        EXPECT_TRUE(fs::exists(dir + "/model.safetensors.index.json"));
        EXPECT_FALSE(fs::exists(dir + "/model.safetensors"));
        const nlohmann::json index =
            nlohmann::json::parse(std::ifstream(dir + "/model.safetensors.index.json"));
        EXPECT_EQ(index["weight_map"].size(), names.size());
        EXPECT_NE(index["weight_map"]["model.layers.0.mlp.experts.0.gate_proj.weight"],
                  index["weight_map"]["model.layers.0.mlp.experts.3.down_proj.weight"]);
      }
      {
        const HfWeights w(dir);
        const ParamInfo& gu = layout.find("model.layers.0.mlp.experts.gate_up_proj");
        std::vector<float> up(8 * 32);
        w.read_rows("model.layers.0.mlp.experts.3.up_proj.weight", 0, 8, up.data());
        // expert 3's row of [E, 2 Im, H]: rows [Im, 2 Im) are up
        EXPECT_EQ(0, std::memcmp(up.data(), src.data() + gu.offset + (3 * 16 + 8) * 32,
                                 up.size() * sizeof(float)));
      }
      const auto got = load_all(dir, layout, tied);
      expect_bitwise(layout, got, src);

      std::mt19937_64 rng(seed + world_rank());
      std::vector<std::size_t> cut{0, layout.numel()};
      for (int i = 0; i < 15; ++i) cut.push_back(rng() % layout.numel());
      std::sort(cut.begin(), cut.end());
      std::vector<float> flat(layout.numel(), -9.0f);
      std::vector<FlatPiece> pieces;
      for (std::size_t i = 0; i + 1 < cut.size(); ++i)
        pieces.push_back({{cut[i], cut[i + 1]}, flat.data() + cut[i]});
      load_params(dir, layout, pieces, tied, *world);
      expect_bitwise(layout, flat, src);
      barrier();
      if (world_rank() == 0) fs::remove_all(dir);
    }
  }
}

// A checkpoint of a MoE run -> `qtrain export` -> import: the model (router_aux_loss_coef from
// the stored deck) and the bf16-rounded weights.
TEST(HfMoe, CheckpointExportThenImport) {
  auto world = world_comm();
  const std::string dir = shared_temp_dir("hf-moe-export");
  const Deck deck = parse_deck_text(
      "[model]\nvocab_size = 64\nhidden_size = 32\nintermediate_size = 48\nnum_layers = 3\n"
      "head_dim = 8\ntie_word_embeddings = false\nmax_position_embeddings = 256\n"
      "num_experts = 4\nnum_experts_per_tok = 2\nmoe_intermediate_size = 8\n"
      "norm_topk_prob = true\ndecoder_sparse_step = 1\nmlp_only_layers = 0\n"
      "router_aux_loss_coef = 0.03\n[train]\nseq_len = 16\n",
      "deck.ini", {}, world->size());
  const ParamLayout layout(deck.model);
  std::mt19937_64 rng(shared_seed());
  const auto src = test::random_vector<float>(layout.numel(), rng, 0.5);
  const std::string ckpt = dir + "/step_00000004.h5";
  {
    MeshShape shape;
    shape.dp = world->size();
    Mesh mesh(shape, world);
    std::vector<float> m(layout.numel(), 0.0f), v(layout.numel(), 0.0f);
    TrainState st;
    checkpoint_write(ckpt, mesh, layout, src.data(), {{0, layout.numel()}, m.data(), v.data()},
                     st, deck.model, deck.resolved);
  }
  const CheckpointModel cm = read_checkpoint_model(ckpt);
  expect_same_config(cm.cfg, deck.model);

  ExportOptions o;
  o.checkpoint = ckpt;
  o.out_dir = dir + "/hf";
  o.max_shard_bytes = 4000;
  export_checkpoint(o, world);
  const ModelConfig back = read_config(o.out_dir);
  expect_same_config(back, deck.model);
  EXPECT_EQ(back.router_aux_loss_coef, 0.03);
  const auto got = load_all(o.out_dir, ParamLayout(back), false);
  std::vector<float> want(src);
  for (float& x : want) x = round_bf16(x);
  expect_bitwise(layout, got, want);
  for (const auto& [name, shape] : file_tensors(o.out_dir))
    EXPECT_EQ(name.find("gate_up_proj"), std::string::npos) << name;
  barrier();
  if (world_rank() == 0) fs::remove_all(dir);
}

// A run from the export (model.init, its MoE keys from config.json; ZeRO-1 pieces at np 2) trains
// exactly like one resumed from the checkpoint of the same bf16-rounded weights.
TEST(HfMoe, TrainingFromTheExportEqualsResumingTheRoundedWeights) {
  auto world = world_comm();
  const std::string dir = shared_temp_dir("hf-moe-train");
  const std::string moe =
      "num_experts = 4\nnum_experts_per_tok = 2\nmoe_intermediate_size = 16\n"
      "mlp_only_layers = 1\nrouter_aux_loss_coef = 0.01\n";
  const std::string rest =
      "[train]\nseq_len = 16\nmicro_batch = 2\nglobal_batch = 4\nsteps = 3\nseed = 77\n"
      "device = cpu\n[optim]\nwarmup_steps = 1\nzero_stage = 1\n[checkpoint]\nevery = -1\n"
      "dir = " + dir + "/ck\n";
  const std::string sizes = "[model]\npreset = tiny\nnum_layers = 3\n";
  const Deck deck = parse_deck_text(sizes + moe + rest, "deck.ini", {}, world->size());
  const ParamLayout layout(deck.model);
  std::vector<float> w(layout.numel());
  init_params(deck.model, layout, deck.train.seed, w.data());
  for (float& x : w) x = round_bf16(x);  // what the export keeps
  const std::string ckpt = dir + "/step_00000000.h5";
  {
    MeshShape shape;
    shape.dp = world->size();
    Mesh mesh(shape, world);
    std::vector<float> m(layout.numel(), 0.0f), v(layout.numel(), 0.0f);
    TrainState st;
    st.seed = deck.train.seed;
    checkpoint_write(ckpt, mesh, layout, w.data(), {{0, layout.numel()}, m.data(), v.data()}, st,
                     deck.model, deck.resolved);
  }
  ExportOptions o;
  o.checkpoint = ckpt;
  o.out_dir = dir + "/hf";
  export_checkpoint(o, world);

  const int n = world->size();
  auto a = test::run(n, sizes + moe + rest, {"--checkpoint.resume=" + ckpt}, dir + "/a.jsonl");
  // No MoE key in the deck: config.json gives them.
  auto b = test::run(n, "[model]\ninit = " + o.out_dir + "\n" + rest, {"--checkpoint.resume=none"},
                     dir + "/b.jsonl");
  ASSERT_EQ(a.exit_code, 0) << a.error;
  ASSERT_EQ(b.exit_code, 0) << b.error;
  ASSERT_EQ(a.steps.size(), 3u);
  ASSERT_EQ(b.steps.size(), 3u);
  for (std::size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(a.steps[i].loss, b.steps[i].loss) << "step " << i + 1;
    EXPECT_EQ(a.steps[i].grad_norm, b.steps[i].grad_norm) << "step " << i + 1;
    EXPECT_TRUE(std::isfinite(b.steps[i].loss));
  }
  barrier();
  if (world_rank() == 0) fs::remove_all(dir);
}

// ---- the directories transformers 5.17 wrote (tests/reference/make_moe_fixtures.py) --------

class HfMoeFixture : public ::testing::TestWithParam<std::string> {
 protected:
  std::string h5() const { return std::string(QT_MOE_FIXTURE_DIR) + "/" + GetParam() + ".h5"; }
  std::string hf() const { return std::string(QT_MOE_FIXTURE_DIR) + "/" + GetParam() + "_hf"; }
};

// config.json gives the fixture's model; model.safetensors (F32, per expert) its parameters bit
// for bit, and the engine on them the fixture's logits.
TEST_P(HfMoeFixture, ImportGivesTheFixtureParameters) {
  test::Fixture fx(h5());
  ASSERT_GE(fx.file, 0) << "cannot open " << h5();
  const ModelConfig want = fx.config();
  ASSERT_TRUE(want.is_moe());
  const ModelConfig cfg = read_config(hf());
  expect_same_config(cfg, want);
  const ParamLayout layout(cfg);
  const std::vector<float> ref = fx.params(layout);
  ASSERT_EQ(ref.size(), layout.numel()) << "a parameter of " << h5() << " is missing or misshapen";
  const auto got = load_all(hf(), layout, cfg.tie_word_embeddings);
  expect_bitwise(layout, got, ref);

  const auto ids_shape = fx.shape("input_ids");
  ASSERT_EQ(ids_shape.size(), 2u);
  const int B = static_cast<int>(ids_shape[0]), T = static_cast<int>(ids_shape[1]);
  const auto ids = fx.read<std::int32_t>("input_ids", H5T_NATIVE_INT32);
  std::vector<std::int32_t> targets;
  ASSERT_GT(fx.targets(B, T, targets), 0);
  Qwen3Model model(cfg, B, T, false);
  model.forward(got.data(), ids.data(), targets.data());
  const auto logits = fx.read<float>("logits", H5T_NATIVE_FLOAT);
  ASSERT_EQ(logits.size(), static_cast<std::size_t>(B) * T * cfg.vocab_size);
  EXPECT_LT(test::rel_error(model.logits(), logits.data(), logits.size()), 1e-5);
  barrier();
}

// Our export of the fixture's parameters has exactly the tensors (names, shapes) that
// transformers' save_pretrained wrote, and the same model in config.json.
TEST_P(HfMoeFixture, ExportWritesWhatTransformersWrites) {
  test::Fixture fx(h5());
  const ModelConfig cfg = read_config(hf());
  const ParamLayout layout(cfg);
  const std::vector<float> ref = fx.params(layout);
  ASSERT_EQ(ref.size(), layout.numel());
  const std::string dir = shared_temp_dir("hf-moe-fx");
  if (world_rank() == 0)
    write_model_dir(dir, cfg, layout, ref.data(), 5'000'000'000, {}, "");
  barrier();
  EXPECT_EQ(file_tensors(dir), file_tensors(hf()));
  expect_same_config(read_config(dir), cfg);
  barrier();
  if (world_rank() == 0) fs::remove_all(dir);
}

// The fused runtime names in a file (as ParamLayout names them) load too.
TEST_P(HfMoeFixture, FusedExpertsLoad) {
  test::Fixture fx(h5());
  const ModelConfig cfg = read_config(hf());
  const ParamLayout layout(cfg);
  const std::vector<float> ref = fx.params(layout);
  ASSERT_EQ(ref.size(), layout.numel());
  const std::string dir = shared_temp_dir("hf-moe-fused");
  if (world_rank() == 0) {
    std::vector<StTensorOut> ts;
    for (const ParamInfo& p : layout.params())
      ts.push_back({p.name, StDType::kF32, p.shape, nullptr, ref.data() + p.offset});
    write_safetensors(dir + "/model.safetensors", ts, {{"format", "pt"}});
    fs::copy_file(hf() + "/config.json", dir + "/config.json");
  }
  barrier();
  expect_bitwise(layout, load_all(dir, layout, cfg.tie_word_embeddings), ref);
  barrier();
  if (world_rank() == 0) fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Transformers, HfMoeFixture,
                         ::testing::Values("moe_norm_topk", "moe_no_norm_topk_tied"));

// ---- import errors -------------------------------------------------------------------------

class HfMoeImportErrors : public test_util::ImportErrorFixture {
 protected:
  void SetUp() override {
    dir_ = shared_temp_dir("hf-moe-bad");
    cfg_ = small_moe(false);
    layout_ = std::make_unique<ParamLayout>(cfg_);
    src_ = bf16_params(*layout_, 11);
  }
  // The model's file tensors: the experts one by one (transformers' names).
  std::vector<StTensorOut> file_tensors() const override {
    std::vector<StTensorOut> ts;
    for (const ParamInfo& p : layout_->params()) {
      const auto per_expert = expert_file_tensors(p);
      if (per_expert.empty()) {
        ts.push_back({p.name, StDType::kBF16, p.shape, nullptr, src_.data() + p.offset});
        continue;
      }
      const float* at = src_.data() + p.offset;
      for (const auto& row : per_expert)
        for (const FileTensor& t : row) {
          ts.push_back({t.name, StDType::kBF16, t.shape, nullptr, at});
          at += t.numel();
        }
    }
    return ts;
  }
  void load(const std::string& d) { load_all(d, *layout_, false); }
};

TEST_F(HfMoeImportErrors, MissingMisshapenDuplicateUnexpected) {
  const std::string up = "model.layers.2.mlp.experts.1.up_proj.weight";
  auto d = model_dir("missing", [&](auto& ts) { erase(ts, up); });
  expect_error_everywhere([&] { load(d); },
                          {d + ": 1 tensor of the model is missing: " + up, "per expert"});
  d = model_dir("shape", [&](auto& ts) { find(ts, up).shape = {32, 8}; });  // transposed
  expect_error_everywhere([&] { load(d); },
                          {d + "/model.safetensors: tensor " + up, "[32, 8]", "needs [8, 32]"});
  d = model_dir("down_shape", [&](auto& ts) {
    find(ts, "model.layers.0.mlp.experts.3.down_proj.weight").shape = {8, 32};
  });
  expect_error_everywhere([&] { load(d); }, {"model.layers.0.mlp.experts.3.down_proj.weight",
                                             "[8, 32]", "needs [32, 8]"});
  // Fused and per-expert experts of one layer: stored twice.
  const ParamInfo& gu = layout_->find("model.layers.0.mlp.experts.gate_up_proj");
  d = model_dir("both", [&](auto& ts) {
    ts.push_back({gu.name, StDType::kBF16, gu.shape, nullptr, src_.data() + gu.offset});
  });
  expect_error_everywhere([&] { load(d); },
                          {d + "/model.safetensors: tensor model.layers.0.mlp.experts.0.gate_proj.weight",
                           "model.layers.0.mlp.experts.gate_up_proj", "stored once"});
  // A fused tensor in another layout (Qwen3-VL-MoE's [E, H, 2 Im]) is misshapen.
  d = model_dir("fused_shape", [&](auto& ts) {
    std::erase_if(ts, [](const StTensorOut& t) {
      return t.name.starts_with("model.layers.0.mlp.experts.") && !t.name.ends_with("down_proj.weight");
    });
    ts.push_back({gu.name, StDType::kBF16, {4, 32, 16}, nullptr, src_.data() + gu.offset});
  });
  expect_error_everywhere([&] { load(d); }, {gu.name, "[4, 32, 16]", "needs [4, 16, 32]"});
  // An expert beyond num_experts; experts in a dense layer.
  const float* any = src_.data();
  d = model_dir("extra", [&](auto& ts) {
    ts.push_back({"model.layers.0.mlp.experts.4.down_proj.weight", StDType::kBF16, {32, 8}, nullptr, any});
    ts.push_back({"model.layers.1.mlp.experts.0.down_proj.weight", StDType::kBF16, {32, 8}, nullptr, any});
  });
  expect_error_everywhere([&] { load(d); },
                          {"2 unexpected tensors", "model.layers.0.mlp.experts.4.down_proj.weight",
                           "model.layers.1.mlp.experts.0.down_proj.weight", "num_experts"});
  // A non-finite value is named by the file's tensor and element.
  std::vector<float> nan(8 * 32, 0.5f);
  nan[37] = std::numeric_limits<float>::quiet_NaN();
  d = model_dir("nonfinite", [&](auto& ts) {
    StTensorOut& t = find(ts, up);
    t.dtype = StDType::kF32;
    t.f32 = nan.data();
  });
  expect_error_everywhere([&] { load(d); }, {up, "non-finite", "element 37"});
}

// Per-expert tensors spread over shards with an index load as from one file; a missing shard
// entry is named.
TEST_F(HfMoeImportErrors, ShardedPerExpertDirectory) {
  const std::string d = dir_ + "/sharded";
  if (world_rank() == 0) {
    fs::create_directories(d);
    write_model_dir(d, cfg_, *layout_, src_.data(), 2500, {}, "");
  }
  barrier();
  std::vector<float> got(layout_->numel());
  load_params(d, *layout_, all_rows(*layout_, got.data()), false, *world_comm());
  expect_bitwise(*layout_, got, src_);
  barrier();
  if (world_rank() == 0) {  // the index names a shard's tensor that the shard does not hold
    nlohmann::json index = nlohmann::json::parse(std::ifstream(d + "/model.safetensors.index.json"));
    const std::string f = index["weight_map"]["model.layers.2.mlp.experts.2.gate_proj.weight"];
    index["weight_map"]["model.layers.2.mlp.experts.9.gate_proj.weight"] = f;
    std::ofstream(d + "/model.safetensors.index.json") << index.dump();
  }
  barrier();
  expect_error_everywhere([&] { load(d); }, {"model.layers.2.mlp.experts.9.gate_proj.weight",
                                             "no such tensor"});
}

}  // namespace
}  // namespace qt::hf
