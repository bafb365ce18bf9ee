// HF export and import under MPI (np 1 and 2): sharded directories with an index, checkpoint ->
// export -> import gives the bf16-rounded tensors bit for bit, a run started from the export
// trains exactly like one resumed from the same (rounded) weights, and every bad tensor is a
// UserError naming it on every rank.
#include <gtest/gtest.h>
#include <hdf5.h>
#include <mpi.h>

#include <algorithm>
#include <bit>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "hf/config.h"
#include "hf/export.h"
#include "hf/safetensors.h"
#include "hf/weights.h"
#include "hf_test_util.h"
#include "io/hdf5_util.h"
#include "model/qwen3.h"
#include "qtrain/checkpoint.h"
#include "qtrain/deck.h"
#include "qtrain/error.h"
#include "qtrain/mesh.h"
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

// Bitwise equality of the layout's elements of `got` with the bf16 rounding of `src`.
void expect_bf16_of(const ParamLayout& layout, const std::vector<float>& got,
                    const std::vector<float>& src) {
  for (const ParamInfo& p : layout.params()) {
    for (std::size_t i = 0; i < p.numel; ++i) {
      const float want = round_bf16(src[p.offset + i]);
      ASSERT_EQ(std::bit_cast<std::uint32_t>(got[p.offset + i]), std::bit_cast<std::uint32_t>(want))
          << p.name << " element " << i;
    }
  }
}

using test_util::small_model;

std::vector<float> random_params(const ParamLayout& layout, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  return test::random_vector<float>(layout.numel(), rng, 0.5);
}

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

TEST(HfExport, ShardedDirectoryWithIndexLoadsBack) {
  auto world = world_comm();
  for (bool tied : {true, false}) {
    const ModelConfig cfg = small_model(tied);
    const ParamLayout layout(cfg);
    const auto src = random_params(layout, shared_seed());
    const std::string dir = shared_temp_dir("hf-shards");
    const std::uint64_t total = layout.numel() * 2;
    const std::uint64_t limit = total / 3;  // at least three shards
    if (world_rank() == 0)
      write_model_dir(dir, cfg, layout, src.data(), limit, default_extras(cfg), "{}\n");
    barrier();
    const nlohmann::json index = nlohmann::json::parse(read_file(fs::path(dir) / "model.safetensors.index.json"));
    EXPECT_EQ(index["metadata"]["total_size"].get<std::uint64_t>(), total);
    std::set<std::string> files;
    for (const ParamInfo& p : layout.params()) {
      ASSERT_TRUE(index["weight_map"].contains(p.name)) << p.name;
      files.insert(index["weight_map"][p.name].get<std::string>());
    }
    EXPECT_EQ(index["weight_map"].size(), layout.params().size());
    EXPECT_GE(files.size(), 3u);
    for (const std::string& f : files) {
      EXPECT_TRUE(fs::exists(fs::path(dir) / f)) << f;
      EXPECT_LE(fs::file_size(fs::path(dir) / f), limit + 4096) << f;  // tensors fit the limit
      EXPECT_NE(f.find(fmt::format("-of-{:05d}.safetensors", files.size())), std::string::npos) << f;
    }
    EXPECT_FALSE(fs::exists(fs::path(dir) / "model.safetensors"));
    EXPECT_EQ(read_config(dir).vocab_size, cfg.vocab_size);

    std::vector<float> got(layout.numel(), -1.0f);
    const std::string line = load_params(dir, layout, all_rows(layout, got.data()), tied, *world);
    EXPECT_NE(line.find("shards (model.safetensors.index.json)"), std::string::npos) << line;
    expect_bf16_of(layout, got, src);

    // Row ranges only, as a tensor-parallel rank will ask: the other rows stay untouched.
    std::vector<float> part(layout.numel(), -7.0f);
    std::vector<RowSlice> half;
    for (const ParamInfo& p : layout.params()) {
      const std::int64_t rows = p.shape[0], per_row = static_cast<std::int64_t>(p.numel) / rows;
      half.push_back({&p, rows / 2, rows, part.data() + p.offset + rows / 2 * per_row});
    }
    load_params(dir, layout, half, tied, *world);
    for (const ParamInfo& p : layout.params()) {
      const std::size_t first = static_cast<std::size_t>(p.shape[0] / 2) * (p.numel / p.shape[0]);
      for (std::size_t i = 0; i < p.numel; ++i)
        ASSERT_EQ(part[p.offset + i], i < first ? -7.0f : round_bf16(src[p.offset + i])) << p.name << " " << i;
    }
    barrier();
    if (world_rank() == 0) fs::remove_all(dir);
  }
}

// Loading flat pieces (a sharded state's) gives the full load's bits: pieces that start and end
// mid-row and span tensors, whole tensors, single elements, overlapping pieces; nothing is
// written outside a piece.
TEST(HfImport, PiecesEqualTheFullLoad) {
  auto world = world_comm();
  for (bool tied : {true, false}) {
    const ModelConfig cfg = small_model(tied);
    const ParamLayout layout(cfg);
    const std::size_t n = layout.numel();
    const std::uint64_t seed = shared_seed();
    const auto src = random_params(layout, seed);
    const std::string dir = shared_temp_dir("hf-pieces");
    if (world_rank() == 0)
      write_model_dir(dir, cfg, layout, src.data(), n * 2 / 3, default_extras(cfg), "{}\n");
    barrier();
    std::vector<float> full(n, -1.0f);
    load_params(dir, layout, all_rows(layout, full.data()), tied, *world);
    expect_bf16_of(layout, full, src);
    for (int trial = 0; trial < 4; ++trial) {
      std::mt19937_64 rng(seed + trial + world_rank());  // other pieces on every rank
      std::vector<Range> ranges;
      std::vector<std::size_t> cut{0, n};
      for (int i = 0; i < 20; ++i) cut.push_back(rng() % (n + 1));
      std::sort(cut.begin(), cut.end());
      for (std::size_t i = 0; i + 1 < cut.size(); ++i) ranges.push_back({cut[i], cut[i + 1]});
      for (int i = 0; i < 12; ++i) {  // single elements, short and long ranges
        const std::size_t a = rng() % n, kind = rng() % 3;
        const std::size_t len = kind == 0 ? 1 : kind == 1 ? 1 + rng() % 40 : rng() % (n - a + 1);
        ranges.push_back({a, std::min(n, a + len)});
      }
      const ParamInfo& q = layout.find("model.layers.1.self_attn.q_proj.weight");
      const std::size_t row = q.numel / q.shape[0];
      ranges.push_back({q.offset, q.offset + q.numel});                    // a whole tensor
      ranges.push_back({q.offset + row, q.offset + 3 * row});              // whole rows
      ranges.push_back({q.offset + row + 1, q.offset + 2 * row - 1});      // inside one row
      ranges.push_back({q.offset + row + 3, q.offset + row + 4});          // one element
      ranges.push_back({q.offset + q.numel - 1, q.offset + q.numel + 1});  // across tensors
      std::vector<std::vector<float>> bufs;  // each [size + 2]: a guard on either side
      for (const Range& r : ranges) bufs.emplace_back(r.size() + 2, -9.0f);
      std::vector<FlatPiece> pieces;
      for (std::size_t i = 0; i < ranges.size(); ++i)
        pieces.push_back({ranges[i], bufs[i].data() + 1});
      load_params(dir, layout, pieces, tied, *world);
      for (std::size_t i = 0; i < ranges.size(); ++i) {
        const Range r = ranges[i];
        EXPECT_EQ(0,
                  std::memcmp(bufs[i].data() + 1, full.data() + r.begin, r.size() * sizeof(float)))
            << "piece [" << r.begin << ", " << r.end << ") of " << n << " on rank " << world_rank()
            << ", tied " << tied << ", seed " << seed << " trial " << trial;
        EXPECT_EQ(bufs[i].front(), -9.0f)
            << "written before piece [" << r.begin << ", " << r.end << ")";
        EXPECT_EQ(bufs[i].back(), -9.0f)
            << "written after piece [" << r.begin << ", " << r.end << ")";
      }
    }
    barrier();
    if (world_rank() == 0) fs::remove_all(dir);
  }
}

// Writes a checkpoint of `params` (moments zero) with the resolved text of `deck`.
void write_checkpoint(const std::string& path, const Deck& deck, const ParamLayout& layout,
                      const std::vector<float>& params, std::shared_ptr<MpiComm> world) {
  MeshShape shape;
  shape.dp = world->size();
  Mesh mesh(shape, world);
  std::vector<float> m(layout.numel(), 0.0f), v(layout.numel(), 0.0f);
  TrainState st;
  st.seed = deck.train.seed;
  checkpoint_write(path, mesh, layout, params.data(), {{0, layout.numel()}, m.data(), v.data()}, st,
                   deck.model, deck.resolved);
}

TEST(HfExport, CheckpointExportThenImportGivesIdenticalTensors) {
  auto world = world_comm();
  const std::string dir = shared_temp_dir("hf-export");
  const Deck deck = parse_deck_text(
      "[model]\nvocab_size = 96\nhidden_size = 32\nintermediate_size = 48\nnum_layers = 2\n"
      "head_dim = 8\ntie_word_embeddings = false\nmax_position_embeddings = 512\n"
      "rope_theta = 12345.5\nrms_norm_eps = 1e-5\n[train]\nseq_len = 16\n",
      "deck.ini", {}, world->size());
  const ParamLayout layout(deck.model);
  const auto src = random_params(layout, shared_seed());
  const std::string ckpt = dir + "/step_00000007.h5";
  write_checkpoint(ckpt, deck, layout, src, world);
  // A tokenizer directory to copy from.
  const std::string tok = dir + "/tok";
  if (world_rank() == 0) {
    fs::create_directories(tok);
    for (const char* f : {"tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"})
      std::ofstream(tok + "/" + f) << "{\"file\": \"" << f << "\"}";
  }
  barrier();

  ExportOptions o;
  o.checkpoint = ckpt;
  o.out_dir = dir + "/hf";
  o.tokenizer_dir = tok;
  const std::string summary = export_checkpoint(o, world);
  if (world_rank() == 0) EXPECT_NE(summary.find("1 weight file"), std::string::npos) << summary;
  const fs::path out(o.out_dir);
  EXPECT_TRUE(fs::exists(out / "model.safetensors"));
  EXPECT_FALSE(fs::exists(out / "model.safetensors.index.json"));  // one shard: no index, as HF
  EXPECT_TRUE(fs::exists(out / "generation_config.json"));
  for (const char* f : {"tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"})
    EXPECT_EQ(read_file(out / f), read_file(fs::path(tok) / f)) << f;
  EXPECT_FALSE(fs::exists(fs::path(dir) / ".hf.qtrain-export-tmp"));

  // config.json gives the checkpoint's model back, max_position_embeddings from its deck.
  const ModelConfig back = read_config(o.out_dir);
  EXPECT_EQ(back.rope_theta, 12345.5);
  EXPECT_EQ(back.rms_norm_eps, 1e-5);
  EXPECT_EQ(back.max_position_embeddings, 512);
  EXPECT_FALSE(back.tie_word_embeddings);
  EXPECT_EQ(back.num_params(), deck.model.num_params());
  // The weights: every file tensor is BF16 and equals the rounded source bit for bit.
  SafetensorsFile f((out / "model.safetensors").string());
  EXPECT_EQ(f.metadata().at("format"), "pt");
  for (const StTensor& t : f.tensors()) EXPECT_EQ(t.dtype, StDType::kBF16) << t.name;
  std::vector<float> got(layout.numel(), -1.0f);
  load_params(o.out_dir, ParamLayout(back), all_rows(layout, got.data()), false, *world);
  expect_bf16_of(layout, got, src);

  // Export again, split: the index's shards hold the same tensors.
  o.max_shard_bytes = 4000;
  expect_error_everywhere([&] { export_checkpoint(o, world); }, {o.out_dir, "not empty", "--force"});
  o.force = true;
  export_checkpoint(o, world);
  EXPECT_TRUE(fs::exists(out / "model.safetensors.index.json"));
  EXPECT_FALSE(fs::exists(out / "model.safetensors"));
  std::fill(got.begin(), got.end(), -1.0f);
  load_params(o.out_dir, layout, all_rows(layout, got.data()), false, *world);
  expect_bf16_of(layout, got, src);
  barrier();
  if (world_rank() == 0) fs::remove_all(dir);
}

TEST(HfExport, TrainingFromTheExportEqualsResumingTheRoundedWeights) {
  auto world = world_comm();
  const std::string dir = shared_temp_dir("hf-train");
  const std::string base =
      "[model]\npreset = tiny\n[train]\nseq_len = 16\nmicro_batch = 2\nglobal_batch = 4\n"
      "steps = 3\nseed = 77\n[optim]\nwarmup_steps = 1\n[checkpoint]\nevery = -1\ndir = " + dir +
      "/ck\n";
  const Deck deck = parse_deck_text(base, "deck.ini", {}, world->size());
  const ParamLayout layout(deck.model);
  std::vector<float> w(layout.numel());
  init_params(deck.model, layout, deck.train.seed, w.data());
  for (float& x : w) x = round_bf16(x);  // what the export keeps
  const std::string ckpt = dir + "/step_00000000.h5";
  write_checkpoint(ckpt, deck, layout, w, world);
  ExportOptions o;
  o.checkpoint = ckpt;
  o.out_dir = dir + "/hf";
  export_checkpoint(o, world);

  const int n = world->size();
  auto a = test::run(n, base, {"--checkpoint.resume=" + ckpt}, dir + "/a.jsonl");
  auto b = test::run(n, base, {"--model.init=" + o.out_dir, "--checkpoint.resume=none"}, dir + "/b.jsonl");
  ASSERT_EQ(a.exit_code, 0) << a.error;
  ASSERT_EQ(b.exit_code, 0) << b.error;
  ASSERT_EQ(a.steps.size(), 3u);
  ASSERT_EQ(b.steps.size(), 3u);
  for (std::size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(a.steps[i].loss, b.steps[i].loss) << "step " << i + 1;
    EXPECT_EQ(a.steps[i].grad_norm, b.steps[i].grad_norm) << "step " << i + 1;
    EXPECT_TRUE(std::isfinite(b.steps[i].loss));
  }
  // A checkpoint in checkpoint.dir wins over model.init: the run resumes instead.
  auto c = test::run(n, base, {"--model.init=" + o.out_dir, "--checkpoint.every=0", "--train.stop_at=2"},
                     dir + "/c.jsonl");
  ASSERT_EQ(c.exit_code, 0) << c.error;
  auto d = test::run(n, base, {"--model.init=" + o.out_dir, "--checkpoint.every=0"}, dir + "/d.jsonl");
  ASSERT_EQ(d.exit_code, 0) << d.error;
  ASSERT_EQ(d.steps.size(), 1u);  // only step 3 ran: steps 1-2 came from the checkpoint
  EXPECT_EQ(d.steps[0].step, 3);
  EXPECT_EQ(d.steps[0].loss, b.steps[2].loss);
  barrier();
  if (world_rank() == 0) fs::remove_all(dir);
}

// ---- import errors ---------------------------------------------------------------------------

class HfImportErrors : public test_util::ImportErrorFixture {
 protected:
  void SetUp() override {
    dir_ = shared_temp_dir("hf-bad");
    cfg_ = small_model(true);
    layout_ = std::make_unique<ParamLayout>(cfg_);
    src_ = random_params(*layout_, 5);
  }
  void load(const std::string& d) {
    std::vector<float> got(layout_->numel());
    load_params(d, *layout_, all_rows(*layout_, got.data()), cfg_.tie_word_embeddings, *world_comm());
  }
};

TEST_F(HfImportErrors, MissingUnexpectedMisshapenMistyped) {
  auto d = model_dir("missing", [](auto& ts) { erase(ts, "model.norm.weight"); });
  expect_error_everywhere([&] { load(d); }, {d, "1 tensor", "missing", "model.norm.weight"});
  const float extra[2] = {1, 2};
  d = model_dir("unexpected", [&](auto& ts) {
    ts.push_back({"model.layers.0.self_attn.q_proj.bias", StDType::kF32, {2}, extra, nullptr});
  });
  expect_error_everywhere([&] { load(d); }, {"unexpected", "model.layers.0.self_attn.q_proj.bias"});
  d = model_dir("shape", [](auto& ts) { find(ts, "model.layers.1.mlp.up_proj.weight").shape = {24, 32}; });
  expect_error_everywhere([&] { load(d); }, {"model.layers.1.mlp.up_proj.weight", "[24, 32]", "[48, 32]"});
  std::vector<std::int32_t> ints(32);
  d = model_dir("dtype", [&](auto& ts) {
    StTensorOut& t = find(ts, "model.norm.weight");
    t.dtype = StDType::kI32;
    t.f32 = nullptr;
    t.raw = ints.data();
  });
  expect_error_everywhere([&] { load(d); }, {"model.norm.weight", "dtype I32", "BF16, F16 and F32"});
  std::vector<float> inf(32, 1.0f);
  inf[5] = std::numeric_limits<float>::infinity();
  d = model_dir("nonfinite", [&](auto& ts) {
    StTensorOut& t = find(ts, "model.norm.weight");
    t.dtype = StDType::kF32;
    t.f32 = inf.data();
  });
  expect_error_everywhere([&] { load(d); }, {"model.norm.weight", "non-finite", "element 5"});
}

TEST_F(HfImportErrors, TiedLmHeadIsIgnoredAndOtherDTypesLoad) {
  auto d = model_dir("tied", [&](auto& ts) {
    const ParamInfo& e = layout_->find("model.embed_tokens.weight");
    ts.push_back({"lm_head.weight", StDType::kBF16, e.shape, nullptr, src_.data() + e.offset});
    find(ts, "model.norm.weight").dtype = StDType::kF16;
    find(ts, "model.layers.0.self_attn.k_norm.weight").dtype = StDType::kF32;
  });
  std::vector<float> got(layout_->numel());
  load_params(d, *layout_, all_rows(*layout_, got.data()), true, *world_comm());
  const ParamInfo& n = layout_->find("model.norm.weight");
  EXPECT_EQ(got[n.offset + 3], f16_to_f32(f32_to_f16(src_[n.offset + 3])));
  const ParamInfo& k = layout_->find("model.layers.0.self_attn.k_norm.weight");
  EXPECT_EQ(got[k.offset + 1], src_[k.offset + 1]);
  barrier();
}

TEST_F(HfImportErrors, DirectoriesAndIndexes) {
  expect_error_everywhere([&] { load(dir_); }, {dir_, "no model.safetensors or model.safetensors.index.json"});
  const std::string d = dir_ + "/indexed";
  auto write_index = [&](const std::string& text) {
    if (world_rank() == 0) {
      fs::create_directories(d);
      std::ofstream(d + "/model.safetensors.index.json") << text;
    }
    barrier();
  };
  write_index("{\"weight_map\": {\"model.norm.weight\": \"model-1.safetensors\"}}");
  expect_error_everywhere([&] { load(d); }, {"model-1.safetensors", "does not exist"});
  write_index("{\"weight_map\": {\"model.norm.weight\": \"../x.safetensors\"}}");
  expect_error_everywhere([&] { load(d); }, {"../x.safetensors", "not a file inside"});
  write_index("{\"metadata\": {}}");
  expect_error_everywhere([&] { load(d); }, {"weight_map"});
  write_index("{\"weight_map\": ");
  expect_error_everywhere([&] { load(d); }, {"model.safetensors.index.json", "not valid JSON"});
  // An index entry whose shard lacks the tensor; a tensor in two shards.
  if (world_rank() == 0) {
    const float one = 1;
    write_safetensors(d + "/a.safetensors", {{"x", StDType::kF32, {1}, &one, nullptr}}, {});
    write_safetensors(d + "/b.safetensors", {{"x", StDType::kF32, {1}, &one, nullptr}}, {});
  }
  write_index("{\"weight_map\": {\"y\": \"a.safetensors\"}}");
  expect_error_everywhere([&] { load(d); }, {"\"y\"", "a.safetensors", "no such tensor"});
  write_index("{\"weight_map\": {\"x\": \"a.safetensors\", \"z\": \"b.safetensors\"}}");
  expect_error_everywhere([&] { load(d); }, {"\"x\"", "two files"});
}

// A checkpoint of the tiny preset with random weights at `path` (its directory created).
void write_tiny_checkpoint(const std::string& path, std::shared_ptr<MpiComm> world) {
  const Deck deck = parse_deck_text("[model]\npreset = tiny\n[train]\nseq_len = 16\n", "deck.ini",
                                    {}, world->size());
  const ParamLayout layout(deck.model);
  if (world_rank() == 0) fs::create_directories(fs::path(path).parent_path());
  barrier();
  write_checkpoint(path, deck, layout, random_params(layout, shared_seed()), world);
}

// What --force must never replace (issue 15, case 3): every target below is refused on every
// rank before anything is written, and what it holds survives.
TEST(HfExport, ForceNeverReplacesCheckpointsOrUserDirectories) {
  auto world = world_comm();
  const std::string dir = shared_temp_dir("hf-force");
  const std::string ck_dir = dir + "/ck", ckpt = ck_dir + "/step_00000007.h5";
  write_tiny_checkpoint(ckpt, world);
  const std::string tok = dir + "/tok", work = dir + "/work", home = dir + "/home";
  if (world_rank() == 0) {
    for (const std::string& d : {tok, work, home, dir + "/other", dir + "/data", dir + "/renamed"})
      fs::create_directories(d);
    std::ofstream(tok + "/tokenizer.json") << "{}";
    std::ofstream(tok + "/notes.txt") << "mine";
    std::ofstream(work + "/notes.txt") << "mine";
    std::ofstream(home + "/notes.txt") << "mine";
    fs::copy_file(ckpt, dir + "/other/step_00000003.h5");  // another run's checkpoint
    fs::copy_file(ckpt, dir + "/renamed/final.h5");        // a checkpoint by another name
    std::ofstream(dir + "/data/tokens.bin") << "x";
  }
  barrier();
  // An HDF5 token file (not a checkpoint): nothing an export writes either.
  if (world_rank() == 0) {
    hid_t f = H5Fcreate((dir + "/data/tokens.h5").c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
    H5Fclose(f);
  }
  barrier();
  const std::string cwd = fs::current_path().string();
  const char* old_home = std::getenv("HOME");
  const std::string saved_home = old_home ? old_home : "";
  fs::current_path(work);
  setenv("HOME", home.c_str(), 1);
  struct Case {
    std::string out;
    std::string tokenizer;
    std::vector<std::string> says;
  };
  const std::vector<Case> cases = {
      {ck_dir, "", {"export directory " + ck_dir + " contains " + ckpt}},
      {dir, "", {"contains " + ckpt}},
      {ckpt, "", {"is " + ckpt}},
      {tok, tok, {"export directory " + tok + " is " + tok}},
      {dir + "/other", "", {"holds " + dir + "/other/step_00000003.h5 (a qtrain checkpoint)"}},
      {dir + "/renamed", "", {"holds " + dir + "/renamed/final.h5 (an HDF5 file"}},
      {dir + "/data", "", {"holds " + dir + "/data/tokens.h5 (an HDF5 file"}},
      {work, "", {"is " + work + " (the working directory)"}},
      {home, "", {"is " + home + " (the home directory)"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.out);
    ExportOptions o;
    o.checkpoint = ckpt;
    o.out_dir = c.out;
    o.tokenizer_dir = c.tokenizer;
    o.force = true;
    expect_error_everywhere([&] { export_checkpoint(o, world); }, c.says);
  }
  fs::current_path(cwd);
  setenv("HOME", saved_home.c_str(), 1);
  for (const std::string& f : {ckpt, dir + "/other/step_00000003.h5", dir + "/renamed/final.h5",
                               dir + "/data/tokens.h5", tok + "/notes.txt", work + "/notes.txt",
                               home + "/notes.txt"})
    EXPECT_TRUE(fs::exists(f)) << f;
  barrier();
  if (world_rank() == 0) fs::remove_all(dir);
}

TEST(HfExport, ModelTooLargeForTheMachineIsRefusedBeforeAllocating) {
  auto world = world_comm();
  const std::string dir = shared_temp_dir("hf-huge");
  const std::string ckpt = dir + "/step_00000001.h5";
  write_tiny_checkpoint(ckpt, world);
  if (world_rank() == 0) {  // a damaged or hand-edited size: 2e9 layers
    hid_t f = H5Fopen(ckpt.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    ASSERT_GE(H5Adelete(f, "num_layers"), 0);
    h5::write_attr_i64(f, "num_layers", 2'000'000'000);
    H5Fclose(f);
  }
  barrier();
  ExportOptions o;
  o.checkpoint = ckpt;
  o.out_dir = dir + "/hf";
  expect_error_everywhere([&] { export_checkpoint(o, world); },
                          {"qtrain export needs about", "of host memory", "fp32 weights of 9.86e+13 parameters"});
  EXPECT_FALSE(fs::exists(o.out_dir));
  barrier();
  if (world_rank() == 0) fs::remove_all(dir);
}

TEST(HfExportCli, ArgumentsAndExitCodes) {
  auto world = world_comm();
  auto run = [&](std::vector<std::string> args) {
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    return export_main(static_cast<int>(argv.size()), argv.data(), world);
  };
  EXPECT_EQ(run({"export", "--help"}), 0);
  EXPECT_EQ(run({"export", "only-one"}), 2);
  EXPECT_EQ(run({"export", "a.h5", "out", "--bogus=1"}), 2);
  EXPECT_EQ(run({"export", "a.h5", "out", "--max-shard-size", "5XB"}), 2);
  const std::string dir = shared_temp_dir("hf-cli");
  EXPECT_EQ(run({"export", "no/such/checkpoint.h5", dir + "/out"}), 2);
  barrier();
  if (world_rank() == 0) fs::remove_all(dir);  // nothing may be left in it
  EXPECT_EQ(parse_size("5GB"), 5'000'000'000u);
  EXPECT_EQ(parse_size("2GiB"), 2147483648u);
  EXPECT_EQ(parse_size("500 mb"), 500'000'000u);
  EXPECT_EQ(parse_size("1024"), 1024u);
  EXPECT_EQ(parse_size("1.5KB"), 1500u);
  EXPECT_THROW(parse_size("GB"), UserError);
  EXPECT_THROW(parse_size("0"), UserError);
}

}  // namespace
}  // namespace qt::hf
