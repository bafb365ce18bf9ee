// [eval] end to end (train/evaluation.h), each run on the first ranks of the world:
//   - the held-out loss (eval.paths and eval.split together) is the same at dp 1, dp 2 under
//     ZeRO-3, tp 2, pp 2 and dp 2 x pp 2, and equals a direct forward (Qwen3Model, batch 1) of
//     the run's final checkpoint over every held-out sequence;
//   - gather_model gives rank 0 the whole model on every mesh (with LoRA: base + scale B A);
//   - the samples equal what `qtrain generate` prints for a checkpoint of the same step (an
//     independent path: checkpoint file, its own load, its own stop tokens), with tp 2 and with
//     LoRA, and reach TensorBoard (eval/loss, eval/perplexity, text eval/samples);
//   - problems found when the run starts stop every rank with one message (exit 2).
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <algorithm>
#include <fstream>
#include <random>
#include <sstream>

#include "generate/generate.h"
#include "generate/sampler.h"
#include "hf/config.h"
#include "hf/export.h"
#include "model/lora.h"
#include "model/qwen3.h"
#include "qtrain/checkpoint.h"
#include "qtrain/data.h"
#include "qtrain/tokenizer.h"
#include "support/event_file_reader.h"
#include "train/backend.h"
#include "train/evaluation.h"
#include "training_harness.h"

namespace qt {
namespace {

namespace fs = std::filesystem;

constexpr int kT = 16;  // train.seq_len of these runs

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The metrics file's lines of one kind ("eval" or "samples").
std::vector<nlohmann::json> lines_of(const std::string& path, const std::string& kind) {
  return test::metrics_lines_of_kind(path, kind);
}

// A token file of random tokens below `vocab` in random documents, ~10 % of targets masked
// (rank 0 writes it; every rank returns after it exists).
void write_tokens(const std::string& path, std::int64_t n, int vocab, std::uint64_t seed) {
  test::write_random_tokens(path, n, vocab, seed);
}

class Evaluation : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = test::shared_temp_dir("eval");
    deck_ = read_text(QT_INPUTS_DIR "/tiny.ini");
    seed_ = test::run_seed();
  }
  void TearDown() override {
    MPI_Barrier(MPI_COMM_WORLD);
    if (test::world_rank() == 0) fs::remove_all(dir_);
  }
  std::string path(const std::string& name) const { return dir_ + "/" + name; }
  // The runs' common settings: 3 steps of 8 sequences of kT tokens, a checkpoint at the end.
  std::vector<std::string> common(const std::string& name) const {
    return {"--train.steps=3",          "--train.seq_len=" + std::to_string(kT),
            "--train.global_batch=8",   "--train.micro_batch=2",
            "--train.seed=" + std::to_string(seed_), "--optim.warmup_steps=0",
            "--log.every=1",            "--checkpoint.every=0",
            "--checkpoint.resume=none", "--checkpoint.dir=" + path(name)};
  }

  std::string dir_, deck_;
  std::uint64_t seed_ = 0;
};

// Rank 0: the mean loss of the checkpoint's model over every sequence of `sources`, one
// sequence at a time through the training model's forward; counted tokens into *tokens.
double direct_loss(const std::string& ckpt, const ModelConfig& cfg,
                   const std::vector<const DataSource*>& sources, std::int64_t* tokens) {
  Mesh self(MeshShape{}, std::make_shared<MpiComm>(MPI_COMM_SELF, "self", false));
  const ParamLayout layout(cfg);
  std::vector<float> params(layout.numel());
  float dummy = 0;
  checkpoint_read(ckpt, self, layout, params.data(), MomentShard{{0, 0}, &dummy, &dummy}, cfg);
  Qwen3Model model(cfg, 1, kT, false);
  std::vector<std::int32_t> in(kT), tg(kT);
  double sum = 0;
  *tokens = 0;
  for (const DataSource* s : sources)
    for (std::int64_t g = 0; g < s->epoch_size(); ++g) {
      s->sample(g, in.data(), tg.data(), nullptr, kT);
      for (std::int32_t t : tg) *tokens += t != -100;
      sum += model.forward(params.data(), in.data(), tg.data());
    }
  return sum / static_cast<double>(*tokens);
}

TEST_F(Evaluation, HeldOutLossIsTheSameOnEveryMeshAndEqualsADirectForward) {
  const int V = 256;
  // 40 training windows (8 held out by eval.split = 0.2) and a file of 15: 23 held-out
  // sequences, which no dp share of a step's shape divides (padding is exercised).
  write_tokens(path("train.h5"), 40 * kT + 1, V, seed_);
  write_tokens(path("val.h5"), 15 * kT + 1, V, seed_ + 1);
  struct Case {
    const char* name;
    int ranks;
    std::vector<std::string> mesh;
  };
  const std::vector<Case> cases = {
      {"dp1", 1, {}},
      {"dp2_zero3", 2, {"--optim.zero_stage=3"}},
      {"tp2", 2, {"--mesh.tp=2"}},
      {"pp2", 2, {"--mesh.pp=2"}},
      {"dp2_pp2", 4, {"--mesh.pp=2", "--mesh.dp=2"}},
  };
  std::vector<std::vector<nlohmann::json>> evals;
  for (const Case& c : cases) {
    if (c.ranks > test::world_size()) continue;
    std::vector<std::string> ov = common(c.name);
    ov.insert(ov.end(), {"--data.source=file", "--data.path=" + path("train.h5"),
                         "--eval.paths=" + path("val.h5"), "--eval.split=0.2",
                         "--eval.every=2"});
    ov.insert(ov.end(), c.mesh.begin(), c.mesh.end());
    const test::RunResult r = test::run(c.ranks, deck_, ov, path(std::string(c.name) + ".jsonl"));
    ASSERT_EQ(r.exit_code, 0) << c.name << ": " << r.error;
    ASSERT_EQ(r.steps.size(), 3u) << c.name;
    evals.push_back(lines_of(path(std::string(c.name) + ".jsonl"), "eval"));
    const std::vector<nlohmann::json>& e = evals.back();
    ASSERT_EQ(e.size(), 2u) << c.name << ": every 2 steps and at the end";
    EXPECT_EQ(e[0]["step"], 2);
    EXPECT_EQ(e[1]["step"], 3);
    for (std::size_t i = 0; i < e.size(); ++i) {
      const nlohmann::json& j = e[i];
      const nlohmann::json& ref = evals.front()[i];  // dp 1's at the same step
      EXPECT_EQ(j["eval_sequences"], 23) << c.name;
      EXPECT_NEAR(j["eval_ppl"].get<double>(), std::exp(j["eval_loss"].get<double>()), 1e-9);
      EXPECT_EQ(j["eval_tokens"], ref["eval_tokens"]) << c.name;
      const double a = j["eval_loss"].get<double>(), b = ref["eval_loss"].get<double>();
      EXPECT_LT(std::abs(a - b) / b, 2e-5) << c.name << " step " << j["step"] << ": " << a
                                           << " against dp 1's " << b;
    }
  }
  if (test::world_rank() == 0) {
    Deck deck = parse_deck_text(deck_, "tiny.ini", common("dp1"), 1);
    const auto val = open_token_file(path("val.h5"), V, kT, 1);
    const auto held = open_token_file(path("train.h5"), V, kT, 1, Packing::kConcat,
                                      {TokenSplit::Part::kHeldOut, 0.2});
    std::int64_t tokens = 0;
    const double direct = direct_loss(path("dp1/step_00000003.h5"), deck.model,
                                      {val.get(), held.get()}, &tokens);
    const nlohmann::json& last = evals.front().back();
    EXPECT_EQ(last["eval_tokens"].get<std::int64_t>(), tokens);
    EXPECT_LT(std::abs(last["eval_loss"].get<double>() - direct) / direct, 1e-5)
        << "eval " << last["eval_loss"] << " against a direct forward's " << direct;
  }
}

TEST_F(Evaluation, MaxSequencesTakesTheFirstOfTheOrder) {
  write_tokens(path("val.h5"), 30 * kT + 1, 256, seed_ + 2);
  std::vector<std::string> ov = common("capped");
  ov.insert(ov.end(), {"--eval.paths=" + path("val.h5"), "--eval.max_sequences=7"});
  const int ranks = std::min(2, test::world_size());
  const test::RunResult r = test::run(ranks, deck_, ov, path("capped.jsonl"));
  ASSERT_EQ(r.exit_code, 0) << r.error;
  const std::vector<nlohmann::json> e = lines_of(path("capped.jsonl"), "eval");
  ASSERT_EQ(e.size(), 1u) << "eval.every = 0: only at the end";
  EXPECT_EQ(e[0]["step"], 3);
  EXPECT_EQ(e[0]["eval_sequences"], 7);
  if (test::world_rank() == 0) {  // the first 7 of the file's order (its seed is fixed: 0)
    const auto val = open_token_file(path("val.h5"), 256, kT, 0);
    std::int64_t counted = 0;
    std::vector<std::int32_t> in(kT), tg(kT);
    for (int g = 0; g < 7; ++g) {
      val->sample(g, in.data(), tg.data(), nullptr, kT);
      for (std::int32_t t : tg) counted += t != -100;
    }
    EXPECT_EQ(e[0]["eval_tokens"].get<std::int64_t>(), counted);
  }
}

// Evaluating between steps leaves the training as it was: the same losses and gradient norms,
// bit for bit, with [eval] (loss every step, and samples on the tp case) as without, on the paths
// that evaluate differently: ZeRO-3's gathers (forward only), a pipeline with LoRA dropout (the
// default eval_loss, dropout off), tp with the model gathered for samples, and Qwen3-MoE with
// the router bias fed by the expert load (which an evaluation's forward also counts).
TEST_F(Evaluation, LeavesTrainingAsItWas) {
  write_tokens(path("val.h5"), 9 * kT + 1, 256, seed_ + 4);
  if (test::world_rank() == 0) {
    fs::create_directories(path("tok"));
    fs::copy_file(QT_SOURCE_DIR "/tests/fuzz/tokenizer_small.json", path("tok/tokenizer.json"));
    std::ofstream(path("prompts.txt")) << "hello\n";
  }
  MPI_Barrier(MPI_COMM_WORLD);
  const std::string moe = read_text(QT_INPUTS_DIR "/tiny-moe.ini");
  struct Case {
    std::string name, deck;
    int ranks;
    std::vector<std::string> ov;
  };
  const std::vector<Case> cases = {
      {"zero3", deck_, 2, {"--optim.zero_stage=3"}},
      {"pp_lora", deck_, 2, {"--mesh.pp=2", "--lora.r=4", "--lora.dropout=0.2"}},
      {"tp_samples", deck_, 2, {"--mesh.tp=2", "--model.vocab_size=272", "--eval.samples=" +
                                path("prompts.txt"), "--eval.tokenizer=" + path("tok"),
                                "--eval.samples_every=1", "--eval.max_new_tokens=4"}},
      {"moe_bias", moe, 2, {"--model.router_bias_update_rate=0.01", "--mesh.ep=2"}},
  };
  for (const Case& c : cases) {
    if (c.ranks > test::world_size()) continue;
    SCOPED_TRACE(c.name);
    std::vector<std::string> plain = common(c.name + "_plain");
    plain.insert(plain.end(), c.ov.begin(), c.ov.end());
    plain.erase(std::remove_if(plain.begin(), plain.end(),
                               [](const std::string& o) { return o.starts_with("--eval."); }),
                plain.end());
    std::vector<std::string> with = common(c.name + "_eval");
    with.insert(with.end(), c.ov.begin(), c.ov.end());
    with.insert(with.end(), {"--eval.paths=" + path("val.h5"), "--eval.every=1"});
    const test::RunResult a = test::run(c.ranks, c.deck, plain, path(c.name + "_plain.jsonl"));
    const test::RunResult b = test::run(c.ranks, c.deck, with, path(c.name + "_eval.jsonl"));
    ASSERT_EQ(a.exit_code, 0) << a.error;
    ASSERT_EQ(b.exit_code, 0) << b.error;
    EXPECT_EQ(lines_of(path(c.name + "_eval.jsonl"), "eval").size(), 3u);
    ASSERT_EQ(a.steps.size(), 3u);
    ASSERT_EQ(b.steps.size(), 3u);
    for (std::size_t i = 0; i < 3; ++i) {
      EXPECT_EQ(a.steps[i].loss, b.steps[i].loss) << "step " << a.steps[i].step;
      EXPECT_EQ(a.steps[i].grad_norm, b.steps[i].grad_norm) << "step " << a.steps[i].step;
    }
  }
}

// gather_model on rank 0 against the whole model built directly (bit for bit: the pieces are
// initialised from the same seed, element by element).
void check_gather(const std::string& deck_text, const std::vector<std::string>& ov, int ranks,
                  bool lora) {
  MPI_Comm sub;
  const int me = test::world_rank();
  MPI_Comm_split(MPI_COMM_WORLD, me < ranks ? 0 : MPI_UNDEFINED, me, &sub);
  if (sub == MPI_COMM_NULL) return;
  auto world = std::make_shared<MpiComm>(sub, "world", true);
  const Deck deck = parse_deck_text(deck_text, "tiny.ini", ov, ranks);
  Mesh mesh(deck.mesh, world);
  std::unique_ptr<TrainBackend> be = make_backend(deck, mesh);
  const ParamLayout& layout = be->layout();
  const std::uint64_t seed = deck.train.seed;
  init_params(deck.model, layout, seed, be->model_pieces());
  std::vector<float> adapters;
  if (lora) {  // adapters of random values (PEFT's B = 0 would hide the merge)
    adapters.resize(be->trained_layout().numel());
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> n(0.0f, 0.3f);
    for (float& a : adapters) a = n(rng);
    for (const FlatPiece& p : be->trained_pieces())
      std::copy(adapters.begin() + p.range.begin, adapters.begin() + p.range.end, p.data);
  }
  be->push_state();
  const std::vector<float> got = gather_model(*be, mesh, deck);
  if (world->rank() != 0) {
    EXPECT_TRUE(got.empty());
    return;
  }
  std::vector<float> want(layout.numel());
  init_params(deck.model, layout, seed, want.data());
  if (lora) lora_merge(deck.model, deck.lora, adapters.data(), layout, want.data());
  ASSERT_EQ(got.size(), want.size());
  std::size_t differ = 0;
  for (std::size_t i = 0; i < got.size(); ++i) differ += got[i] != want[i];
  EXPECT_EQ(differ, 0u) << "of " << got.size() << " elements";
}

TEST_F(Evaluation, GatherModelGivesRankZeroTheWholeModel) {
  const std::string seed = "--train.seed=" + std::to_string(seed_);
  const std::vector<std::pair<int, std::vector<std::string>>> meshes = {
      {2, {"--mesh.tp=2"}},
      {2, {"--optim.zero_stage=3"}},
      {2, {"--mesh.pp=2"}},
      {2, {"--lora.r=4", "--lora.targets=all-linear"}},
      {2, {"--lora.r=4", "--mesh.tp=2"}},
      {4, {"--lora.r=2", "--mesh.pp=2", "--mesh.tp=2"}},
      {4, {"--mesh.dp=2", "--mesh.tp=2", "--optim.zero_stage=3"}},
  };
  for (const auto& [ranks, mesh] : meshes) {
    if (ranks > test::world_size()) continue;
    std::vector<std::string> ov = mesh;
    ov.push_back(seed);
    const bool lora = ov.front().starts_with("--lora");
    SCOPED_TRACE(fmt::format("{} ranks: {}", ranks, fmt::join(ov, " ")));
    check_gather(deck_, ov, ranks, lora);
    MPI_Barrier(MPI_COMM_WORLD);
  }
}

// The samples test's tokenizer (tests/fuzz/tokenizer_small.json: 271 ids, <|endoftext|> and
// <|im_end|> stop tokens) and prompts.
class Samples : public Evaluation {
 protected:
  void SetUp() override {
    Evaluation::SetUp();
    if (test::world_rank() == 0) {
      fs::create_directories(path("tok"));
      fs::copy_file(QT_SOURCE_DIR "/tests/fuzz/tokenizer_small.json", path("tok/tokenizer.json"));
      std::ofstream(path("prompts.txt"))
          << "hello world\n\nThe quick brown fox\r\nzq\ntwo\\nlines \\\\ one \\t\n";
    }
    MPI_Barrier(MPI_COMM_WORLD);
  }
  // Logits spread widely (initializer_range 0.5), so that greedy continuations differ by model.
  std::vector<std::string> sampling(const std::string& name) const {
    std::vector<std::string> ov = common(name);
    ov.insert(ov.end(), {"--model.vocab_size=272", "--model.initializer_range=0.5",
                         "--eval.samples=" + path("prompts.txt"), "--eval.tokenizer=" + path("tok"),
                         "--eval.samples_every=2", "--eval.max_new_tokens=12"});
    return ov;
  }
};

// What `qtrain generate CKPT --tokenizer DIR --prompt P -n N` prints (in process, on this rank
// alone).
std::string generate_text(const std::string& ckpt, const std::string& tok, const std::string& prompt,
                          int n) {
  std::vector<std::string> args = {"generate", ckpt, "--tokenizer", tok, "--prompt", prompt,
                                   "-n", std::to_string(n)};
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  testing::internal::CaptureStdout();
  testing::internal::CaptureStderr();
  const int rc = generate_main(static_cast<int>(argv.size()), argv.data(),
                               std::make_shared<MpiComm>(MPI_COMM_SELF, "self", false));
  std::string out = testing::internal::GetCapturedStdout();
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_EQ(rc, 0) << err;
  return out;
}

// Rank 0's checks of a run's samples at its last step against generate on its checkpoint, and
// of its TensorBoard events.
void check_samples(const std::string& metrics, const std::string& ckpt, const std::string& tok,
                   const std::string& tb) {
  const std::vector<nlohmann::json> lines = lines_of(metrics, "samples");
  ASSERT_EQ(lines.size(), 2u) << "every 2 steps and at the end (3)";
  EXPECT_EQ(lines[0]["step"], 2);
  EXPECT_EQ(lines[1]["step"], 3);
  const nlohmann::json& samples = lines[1]["samples"];
  ASSERT_EQ(samples.size(), 4u) << "four prompts; the empty line skipped";
  EXPECT_EQ(samples[1]["prompt"], "The quick brown fox") << "the \\r of a CRLF line dropped";
  EXPECT_EQ(samples[3]["prompt"], "two\nlines \\ one \\t") << "\\n and \\\\ unescaped";
  const Tokenizer t = Tokenizer::from_dir(tok);
  std::size_t produced = 0;
  for (const nlohmann::json& s : samples) {
    const std::vector<std::int32_t> ids = s["ids"].get<std::vector<std::int32_t>>();
    produced += ids.size();
    // generate's stdout for these ids: whole UTF-8 (a dangling tail as U+FFFD), a newline.
    const std::string bytes = t.decode(ids);
    const std::size_t whole = gen::utf8_complete_prefix(bytes);
    const std::string want = bytes.substr(0, whole) + (whole < bytes.size() ? "\xEF\xBF\xBD" : "");
    EXPECT_EQ(generate_text(ckpt, tok, s["prompt"], 12), want + "\n")
        << "prompt " << s["prompt"];
  }
  EXPECT_GT(produced, 0u) << "every prompt stopped at once: nothing compared";
  // TensorBoard: the text at each sampled step names every prompt.
  std::vector<tensorboard::Event> events;
  for (const std::string& f : test::event_files(tb)) {
    const auto e = test::parse_events(test::read_records(f));
    events.insert(events.end(), e.begin(), e.end());
  }
  std::vector<std::int64_t> text_steps;
  for (const tensorboard::Event& x : events)
    for (const auto& v : x.summary().value()) {
      if (v.tag() != "eval/samples") continue;
      text_steps.push_back(x.step());
      ASSERT_EQ(v.tensor().string_val_size(), 1);
      for (const nlohmann::json& s : samples)
        EXPECT_NE(v.tensor().string_val(0).find(s["prompt"].get<std::string>()), std::string::npos);
    }
  EXPECT_EQ(text_steps, (std::vector<std::int64_t>{2, 3}));
}

TEST_F(Samples, EqualWhatGenerateWritesForACheckpointOfTheSameStep) {
  write_tokens(path("val.h5"), 6 * kT + 1, 272, seed_ + 3);
  for (const auto& [name, extra] : std::vector<std::pair<std::string, std::vector<std::string>>>{
           {"tp2", {"--mesh.tp=2"}},
           {"lora", {"--lora.r=4", "--lora.alpha=64", "--optim.lr=0.05",
                     "--lora.targets=all-linear"}}}) {
    std::vector<std::string> ov = sampling(name);
    ov.insert(ov.end(), extra.begin(), extra.end());
    ov.insert(ov.end(), {"--log.tensorboard=" + path(name + "-tb"), "--eval.paths=" + path("val.h5")});
    const int ranks = std::min(2, test::world_size());
    const test::RunResult r = test::run(ranks, deck_, ov, path(name + ".jsonl"));
    ASSERT_EQ(r.exit_code, 0) << name << ": " << r.error;
    if (test::world_rank() == 0) {
      SCOPED_TRACE(name);
      check_samples(path(name + ".jsonl"), path(name + "/step_00000003.h5"), path("tok"),
                    path(name + "-tb"));
      // eval/loss and eval/perplexity: the JSON lines' numbers as fp32.
      std::vector<tensorboard::Event> events;
      for (const std::string& f : test::event_files(path(name + "-tb"))) {
        const auto e = test::parse_events(test::read_records(f));
        events.insert(events.end(), e.begin(), e.end());
      }
      const test::ScalarSeries s = test::scalar_series(events);
      const std::vector<nlohmann::json> e = lines_of(path(name + ".jsonl"), "eval");
      ASSERT_EQ(e.size(), 1u);
      ASSERT_EQ(s.count("eval/loss"), 1u);
      ASSERT_EQ(s.at("eval/loss").size(), 1u);
      EXPECT_EQ(s.at("eval/loss")[0].first, 3);
      EXPECT_EQ(s.at("eval/loss")[0].second, static_cast<float>(e[0]["eval_loss"].get<double>()));
      EXPECT_EQ(s.at("eval/perplexity")[0].second,
                static_cast<float>(e[0]["eval_ppl"].get<double>()));
    }
    MPI_Barrier(MPI_COMM_WORLD);
  }
}

// A model.init directory whose config.json names an eos_token_id that is none of the tokenizer's
// stop tokens: the samples stop at it, as `qtrain generate` does for that directory (one rule,
// gen::stop_tokens). The eos id is one the first run's greedy samples produce; the second run
// (the same weights at every step: eos ids do not change training) must cut them there.
TEST_F(Samples, StopAtTheEosIdOfTheModelDirectorysConfigJson) {
  ModelConfig cfg;
  cfg.preset = "";
  cfg.vocab_size = 272;
  const std::string init = path("init");
  auto write_init = [&](const nlohmann::json& eos) {
    if (test::world_rank() == 0) {
      const ParamLayout layout(cfg);
      std::mt19937_64 rng(seed_ + 7);
      const std::vector<float> params = test::random_vector<float>(layout.numel(), rng, 0.5);
      fs::create_directories(init);
      hf::ConfigExtras extras;
      extras.eos_token_id = eos;
      hf::write_model_dir(init, cfg, layout, params.data(), 5'000'000'000, extras, "");
    }
    MPI_Barrier(MPI_COMM_WORLD);
  };
  // tiny.ini without its [model] keys: model.init defines the model.
  const std::size_t m = deck_.find("[model]"), mesh = deck_.find("[mesh]");
  ASSERT_TRUE(m != std::string::npos && mesh != std::string::npos);
  const std::string deck =
      deck_.substr(0, m) + "[model]\ninit = " + init + "\n" + deck_.substr(mesh);
  auto samples_of = [&](const std::string& name) {
    std::vector<std::string> ov = common(name);
    ov.insert(ov.end(), {"--eval.samples=" + path("prompts.txt"), "--eval.tokenizer=" + path("tok"),
                         "--eval.max_new_tokens=12"});
    const test::RunResult r = test::run(std::min(2, test::world_size()), deck, ov,
                                        path(name + ".jsonl"));
    EXPECT_EQ(r.exit_code, 0) << name << ": " << r.error;
    std::vector<std::vector<std::int32_t>> ids;
    if (test::world_rank() == 0) {
      const std::vector<nlohmann::json> lines = lines_of(path(name + ".jsonl"), "samples");
      EXPECT_EQ(lines.size(), 1u) << name << ": samples at the end only";
      if (!lines.empty())
        for (const nlohmann::json& s : lines.back()["samples"])
          ids.push_back(s["ids"].get<std::vector<std::int32_t>>());
    }
    return ids;
  };
  write_init(nullptr);
  const std::vector<std::vector<std::int32_t>> before = samples_of("eos_none");
  // The eos: an id that a sample produces after others, not among them (so that sample is cut).
  std::int32_t eos = -1;
  if (test::world_rank() == 0)
    for (const std::vector<std::int32_t>& ids : before)
      for (std::size_t k = 1; k < ids.size() && eos < 0; ++k)
        if (std::find(ids.begin(), ids.begin() + k, ids[k]) == ids.begin() + k) eos = ids[k];
  MPI_Bcast(&eos, 1, MPI_INT32_T, 0, MPI_COMM_WORLD);
  ASSERT_GE(eos, 0) << "no sample with a new id after its first to pick an eos from";
  write_init(nlohmann::json::array({eos}));
  const std::vector<std::vector<std::int32_t>> after = samples_of("eos_set");
  if (test::world_rank() == 0) {
    ASSERT_EQ(after.size(), before.size());
    const Tokenizer t = Tokenizer::from_dir(path("tok"));
    const nlohmann::json samples = lines_of(path("eos_set.jsonl"), "samples").back()["samples"];
    for (std::size_t i = 0; i < before.size(); ++i) {
      const auto cut = std::find(before[i].begin(), before[i].end(), eos);
      EXPECT_EQ(after[i], std::vector<std::int32_t>(before[i].begin(), cut))
          << "sample " << i << " must stop at config.json's eos_token_id " << eos;
      // qtrain generate on the run's checkpoint (its model.init: the same directory) agrees.
      const std::string bytes = t.decode(after[i]);
      const std::size_t whole = gen::utf8_complete_prefix(bytes);
      const std::string want =
          bytes.substr(0, whole) + (whole < bytes.size() ? "\xEF\xBF\xBD" : "");
      EXPECT_EQ(generate_text(path("eos_set/step_00000003.h5"), path("tok"),
                              samples[i]["prompt"], 12),
                want + "\n");
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

// Problems that the run finds when it starts (after the deck): one message, on every rank.
TEST_F(Samples, StartUpProblemsStopEveryRankWithOneMessage) {
  if (test::world_rank() == 0) {
    std::ofstream(path("blank.txt")) << "\n\n";
    std::ofstream(path("not_tokens.h5")) << "not HDF5";
    fs::create_directories(path("badtok"));
    std::ofstream(path("badtok/tokenizer.json")) << "{";
  }
  MPI_Barrier(MPI_COMM_WORLD);
  const int ranks = std::min(2, test::world_size());
  struct Case {
    std::vector<std::string> ov, parts;  // overrides; what the message must hold
  };
  const std::vector<Case> cases = {
      {{"--eval.samples=" + path("blank.txt"), "--eval.tokenizer=" + path("tok")},
       {"eval.samples = " + path("blank.txt") + ": no prompt (every line is empty)"}},
      {{"--eval.samples=" + path("prompts.txt"), "--eval.tokenizer=" + path("tok")},
       {"eval.samples = " + path("prompts.txt") + ", line 1: token id ",
        "is outside the model's vocabulary of 100: tokenizer " + path("tok")}},
      {{"--eval.samples=" + path("prompts.txt"), "--eval.tokenizer=" + path("badtok")},
       {"eval.samples' tokenizer (eval.tokenizer = " + path("badtok") + "): "}},
      {{"--eval.paths=" + path("not_tokens.h5")},
       {"eval.paths: token file " + path("not_tokens.h5") + ": cannot open it as HDF5"}},
  };
  for (const Case& c : cases) {
    std::vector<std::string> ov = common("bad");
    ov.push_back("--model.vocab_size=100");
    ov.insert(ov.end(), c.ov.begin(), c.ov.end());
    const test::RunResult r = test::run(ranks, deck_, ov, path("bad.jsonl"));
    EXPECT_EQ(r.exit_code, 2);
    for (const std::string& p : c.parts) EXPECT_NE(r.error.find(p), std::string::npos) << r.error;
  }
}

}  // namespace
}  // namespace qt
