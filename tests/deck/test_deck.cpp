// Deck parsing: values, precedence, the resolved round trip, presets, and every class of error
// (each must name the key and file:line or "(command line)").
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "config/deck_keys.h"
#include "deck_test_util.h"
#include "qtrain/deck.h"
#include "qtrain/error.h"
#include "qtrain/shard_plan.h"
#include "support/random.h"

namespace {

namespace fs = std::filesystem;
using qt::Deck;
using qt::parse_deck_text;

using qt::deck_test::expect_error;
using qt::deck_test::kPath;
using qt::deck_test::parse;

// A scratch directory unique to this process, removed at exit.
class Scratch {
 public:
  Scratch() {
    dir_ = fs::temp_directory_path() /
           ("qtrain_deck_" + std::to_string(::getpid()) + "_" + std::to_string(qt::test::test_seed()));
    fs::create_directories(dir_);
  }
  ~Scratch() {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  std::string write(const std::string& name, const std::string& text) const {
    fs::path p = dir_ / name;
    std::ofstream(p) << text;
    return p.string();
  }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }

 private:
  fs::path dir_;
};

TEST(Deck, GoodDeckParsesEveryKind) {
  const std::string text =
      "# a comment line\n"
      "; another comment\n"
      "\n"
      "[model]\n"
      "preset = tiny\n"
      "hidden_size = 96   # inline comment\n"
      "num_heads = 6\n"
      "num_kv_heads = 3\n"
      "tie_word_embeddings = false\r\n"
      "rope_theta = 10000.5\n"
      "[mesh]\n"
      "dp = 2\n"
      "[train]\n"
      "seq_len=32\n"
      "micro_batch = 2\n"
      "global_batch = 12\n"
      "steps = 40\n"
      "stop_at = 20\n"
      "seed = 18446744073709551615\n"
      "recompute = yes\n"
      "[optim]\n"
      "lr = 3e-3\n"
      "min_lr = 0\n"
      "schedule = linear\n"
      "beta2 = 0.99\n"
      "zero_stage = 1\n"
      "[data]\n"
      "synthetic_branching = 7\n"
      "[checkpoint]\n"
      "dir = runs/a b\n"
      "every = 10\n"
      "keep = 2\n"
      "resume = none\n"
      "[log]\n"
      "every = 5\n"
      "metrics =\n";
  Deck d = parse(text);
  EXPECT_EQ(d.path, kPath);
  EXPECT_EQ(d.model.preset, "tiny");
  EXPECT_EQ(d.model.hidden_size, 96);
  EXPECT_EQ(d.model.num_heads, 6);
  EXPECT_EQ(d.model.num_kv_heads, 3);
  EXPECT_EQ(d.model.num_layers, 2);  // from the preset
  EXPECT_FALSE(d.model.tie_word_embeddings);
  EXPECT_EQ(d.model.rope_theta, 10000.5);
  EXPECT_EQ(d.mesh.dp, 2);
  EXPECT_EQ(d.mesh.tp, 1);
  EXPECT_EQ(d.train.seq_len, 32);
  EXPECT_EQ(d.train.micro_batch, 2);
  EXPECT_EQ(d.train.global_batch, 12);
  EXPECT_EQ(d.train.steps, 40);
  EXPECT_EQ(d.train.stop_at, 20);
  EXPECT_EQ(d.train.seed, 18446744073709551615ull);
  EXPECT_TRUE(d.train.recompute);
  EXPECT_EQ(d.optim.lr, 3e-3);
  EXPECT_EQ(d.optim.min_lr, 0.0);
  EXPECT_EQ(d.optim.schedule, qt::Schedule::kLinear);
  EXPECT_EQ(d.optim.beta1, 0.9);  // default
  EXPECT_EQ(d.optim.beta2, 0.99);
  EXPECT_EQ(d.optim.zero_stage, 1);
  EXPECT_EQ(d.data.source, "synthetic");
  EXPECT_EQ(d.data.synthetic_branching, 7);
  EXPECT_EQ(d.checkpoint.dir, "runs/a b");
  EXPECT_EQ(d.checkpoint.every, 10);
  EXPECT_EQ(d.checkpoint.keep, 2);
  EXPECT_EQ(d.checkpoint.resume, "none");
  EXPECT_EQ(d.log.every, 5);
  EXPECT_EQ(d.log.metrics, "");
}

TEST(Deck, EmptyDeckGivesDefaultsAndAutoDp) {
  Deck d = parse("", {"--train.global_batch=16"}, 4);
  Deck ref;
  EXPECT_EQ(d.mesh.dp, 4);  // 0 = auto: world / (tp * pp)
  EXPECT_EQ(d.train.micro_batch, ref.train.micro_batch);
  EXPECT_EQ(d.model.hidden_size, ref.model.hidden_size);
  EXPECT_EQ(d.optim.schedule, ref.optim.schedule);
  EXPECT_EQ(d.checkpoint.resume, "auto");
}

TEST(Deck, PresetIsAppliedBeforeOverridesWhateverTheOrder) {
  Deck d = parse("[model]\nnum_layers = 3\npreset = qwen3-0.6b\n[train]\nglobal_batch = 8\n");
  EXPECT_EQ(d.model.preset, "qwen3-0.6b");
  EXPECT_EQ(d.model.hidden_size, 1024);
  EXPECT_EQ(d.model.intermediate_size, 3072);
  EXPECT_EQ(d.model.num_layers, 3);
  EXPECT_EQ(d.model.vocab_size, 151936);
  EXPECT_EQ(d.model.head_dim, 128);
}

TEST(Deck, CommandLineWinsOverFile) {
  const std::string text = "[train]\nseq_len = 32\nsteps = 50\n[model]\npreset = qwen3-1.7b\n";
  Deck d = parse(text, {"--train.seq_len=16", "--model.num_layers=1", "optim.lr= 0.25 "});
  EXPECT_EQ(d.train.seq_len, 16);
  EXPECT_EQ(d.train.steps, 50);
  EXPECT_EQ(d.model.hidden_size, 2048);  // preset from the file
  EXPECT_EQ(d.model.num_layers, 1);      // override from the command line
  EXPECT_EQ(d.optim.lr, 0.25);
  // The command line can also choose the preset; a file override of a model key still applies.
  Deck e = parse("[model]\nnum_layers = 5\n", {"--model.preset=qwen3-4b"});
  EXPECT_EQ(e.model.hidden_size, 2560);
  EXPECT_EQ(e.model.num_layers, 5);
}

TEST(Deck, ResolvedDeckRoundTripsExactly) {
  std::mt19937_64 rng(qt::test::test_seed());
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (int rep = 0; rep < 20; ++rep) {
    const double lr = 1e-5 + u(rng) * 1e-2;  // arbitrary doubles must read back bit for bit
    const double min_lr = lr * u(rng);
    const double beta2 = u(rng) * 0.999;
    const std::uint64_t seed = rng();
    std::vector<std::string> ov = {
        fmt::format("--optim.lr={:.17g}", lr), fmt::format("--optim.min_lr={:.17g}", min_lr),
        fmt::format("--optim.beta2={:.17g}", beta2), fmt::format("--train.seed={}", seed),
        "--model.preset=qwen3-8b", "--model.rms_norm_eps=1e-5", "--optim.schedule=constant",
        "--checkpoint.dir=ck pts/x", "--log.metrics="};
    Deck a = parse("[train]\nglobal_batch = 16\n", ov, 4);
    Deck b = parse_deck_text(a.resolved, "resolved.ini", {}, 4);
    EXPECT_EQ(b.optim.lr, lr);
    EXPECT_EQ(b.optim.min_lr, min_lr);
    EXPECT_EQ(b.optim.beta2, beta2);
    EXPECT_EQ(b.train.seed, seed);
    EXPECT_EQ(b.model.hidden_size, 4096);
    EXPECT_FALSE(b.model.tie_word_embeddings);
    EXPECT_EQ(b.model.rms_norm_eps, 1e-5);
    EXPECT_EQ(b.optim.schedule, qt::Schedule::kConstant);
    EXPECT_EQ(b.checkpoint.dir, "ck pts/x");
    EXPECT_EQ(b.log.metrics, "");
    EXPECT_EQ(b.mesh.dp, 4);
    // Same text apart from the header comment naming the source.
    EXPECT_EQ(a.resolved.substr(a.resolved.find('\n')), b.resolved.substr(b.resolved.find('\n')));
  }
}

TEST(Deck, ResolvedDeckListsEveryKeyInSectionOrder) {
  Deck d = parse("");
  std::size_t last = 0;
  for (const char* sec : {"[model]", "[mesh]", "[train]", "[optim]", "[lora]", "[data]", "[checkpoint]", "[log]"}) {
    std::size_t at = d.resolved.find(std::string("\n") + sec + "\n");
    ASSERT_NE(at, std::string::npos) << sec;
    EXPECT_GT(at, last) << sec;
    last = at;
  }
  for (const qt::DeckKeyInfo& k : qt::deck_keys()) {
    std::string sec = k.key.substr(0, k.key.find('.'));
    std::string name = k.key.substr(sec.size() + 1);
    std::size_t s = d.resolved.find("[" + sec + "]");
    std::size_t e = d.resolved.find("\n[", s + 1);
    std::string body = d.resolved.substr(s, e == std::string::npos ? std::string::npos : e - s);
    EXPECT_NE(body.find("\n" + name + " = "), std::string::npos) << k.key;
  }
}

// ---- errors from the file: each names the key and file:line -------------------------------

TEST(DeckErrors, SyntaxAndUnknownNames) {
  expect_error("[train]\nseq_lenn = 4\n", {"deck.ini:2:", "train.seq_lenn", "did you mean train.seq_len"});
  expect_error("[train]\nlr = 0.1\n", {"deck.ini:2:", "train.lr", "did you mean optim.lr"});
  expect_error("[model]\nhidden = 8\n[trian]\nsteps = 3\n", {"deck.ini:2:", "model.hidden"});
  expect_error("[model]\n[trian]\nsteps = 3\n", {"deck.ini:2:", "[trian]", "did you mean [train]"});
  expect_error("seq_len = 4\n", {"deck.ini:1:", "seq_len", "before any [section]"});
  expect_error("[train]\nseq_len 4\n", {"deck.ini:2:", "seq_len 4"});
  expect_error("[train\n", {"deck.ini:1:", "[train"});
  expect_error("[train]\n = 4\n", {"deck.ini:2:", "no key"});
}

TEST(DeckErrors, DuplicateKeyNamesBothLines) {
  expect_error("[train]\nsteps = 3\n\n[optim]\nlr = 1\n[train]\nsteps = 4\n",
               {"deck.ini:7:", "train.steps", "deck.ini:2"});
}

TEST(DeckErrors, WrongTypes) {
  expect_error("[train]\nsteps = ten\n", {"deck.ini:2:", "train.steps = ten is not an integer"});
  expect_error("[train]\nsteps = 3.5\n", {"deck.ini:2:", "train.steps = 3.5 is not an integer"});
  expect_error("[train]\nsteps = 99999999999\n", {"deck.ini:2:", "train.steps", "out of range"});
  expect_error("[train]\nseed = -1\n", {"deck.ini:2:", "train.seed = -1", "non-negative integer"});
  expect_error("[optim]\nlr = fast\n", {"deck.ini:2:", "optim.lr = fast is not a number"});
  expect_error("[optim]\nlr = nan\n", {"deck.ini:2:", "optim.lr = nan", "finite"});
  expect_error("[optim]\n\nlr = inf\n", {"deck.ini:3:", "optim.lr = inf", "finite"});
  expect_error("[train]\nrecompute = maybe\n", {"deck.ini:2:", "train.recompute = maybe", "boolean"});
  expect_error("[train]\nsteps =\n", {"deck.ini:2:", "train.steps", "not an integer"});
}

TEST(DeckErrors, NamesOutsideTheirSet) {
  expect_error("[optim]\nschedule = cosin\n", {"deck.ini:2:", "optim.schedule = cosin", "cosine | linear | constant"});
  expect_error("[model]\npreset = qwen3-0.6B\n", {"deck.ini:2:", "model.preset = qwen3-0.6B", "did you mean qwen3-0.6b"});
  expect_error("[data]\nsource = files\n", {"deck.ini:2:", "data.source = files", "synthetic | file"});
}

TEST(DeckErrors, OutOfRange) {
  expect_error("[model]\nhidden_size = 0\n", {"deck.ini:2:", "model.hidden_size = 0", ">= 1"});
  expect_error("[model]\nnum_heads = -4\n", {"deck.ini:2:", "model.num_heads = -4", ">= 1"});
  expect_error("[model]\nhead_dim = 15\n", {"deck.ini:2:", "model.head_dim = 15", "even"});
  expect_error("[model]\nrms_norm_eps = 0\n", {"deck.ini:2:", "model.rms_norm_eps"});
  expect_error("[train]\nseq_len = 0\n", {"deck.ini:2:", "train.seq_len = 0"});
  expect_error("[train]\nmicro_batch = 0\n", {"deck.ini:2:", "train.micro_batch = 0"});
  expect_error("[train]\nsteps = 10\nstop_at = 11\n", {"deck.ini:3:", "train.stop_at = 11", "train.steps = 10"});
  expect_error("[optim]\nbeta1 = 1\n", {"deck.ini:2:", "optim.beta1 = 1", "[0, 1)"});
  expect_error("[optim]\nbeta2 = -0.1\n", {"deck.ini:2:", "optim.beta2 = -0.1", "[0, 1)"});
  expect_error("[optim]\nlr = -0.001\n", {"deck.ini:2:", "optim.lr = -0.001", "> 0"});
  expect_error("[optim]\nlr = 0.01\nmin_lr = 0.1\n", {"deck.ini:3:", "optim.min_lr = 0.1", "optim.lr = 0.01"});
  expect_error("[optim]\nwarmup_steps = -1\n", {"deck.ini:2:", "optim.warmup_steps = -1", ">= 0"});
  expect_error("[optim]\neps = 0\n", {"deck.ini:2:", "optim.eps = 0"});
  expect_error("[optim]\nweight_decay = -1\n", {"deck.ini:2:", "optim.weight_decay = -1"});
  expect_error("[optim]\ngrad_clip = -1\n", {"deck.ini:2:", "optim.grad_clip = -1"});
  expect_error("[optim]\nzero_stage = 4\n", {"deck.ini:2:", "optim.zero_stage = 4", "0, 1, 2 or 3"});
  expect_error("[optim]\noffload = gpu\n", {"deck.ini:2:", "optim.offload = gpu", "none or cpu"});
  expect_error("[model]\nhead_dim = 64\n[train]\ndevice = cuda\n[optim]\noffload = cpu\n",
               {"optim.offload = cpu", "needs optim.zero_stage = 2 or 3"});
  expect_error("[model]\nhead_dim = 64\n[train]\ndevice = cuda\n[optim]\nzero_stage = 2\n"
               "grad_reduce = bf16\n",
               {"optim.grad_reduce = bf16", "not available with optim.zero_stage = 2 or 3"});
  expect_error("[lora]\nr = 4\n[optim]\nzero_stage = 2\n",
               {"optim.zero_stage = 2", "a LoRA run trains only its adapters"});
  expect_error("[optim]\ngrad_reduce = fp16\n", {"deck.ini:2:", "optim.grad_reduce = fp16", "fp32 or bf16"});
  expect_error("[optim]\ngrad_reduce = bf16\n", {"deck.ini:2:", "optim.grad_reduce = bf16", "cuda"});
  expect_error("[optim]\nreduce_bucket_mb = 0\n", {"deck.ini:2:", "optim.reduce_bucket_mb = 0", "> 0"});
  expect_error("[data]\nsynthetic_branching = 0\n", {"deck.ini:2:", "data.synthetic_branching = 0"});
  expect_error("[data]\nsynthetic_branching = 257\n", {"deck.ini:2:", "data.synthetic_branching = 257", "vocab_size = 256"});
  expect_error("[checkpoint]\nkeep = 0\n", {"deck.ini:2:", "checkpoint.keep = 0", ">= 1"});
  expect_error("[checkpoint]\nevery = -2\n", {"deck.ini:2:", "checkpoint.every = -2"});
  expect_error("[checkpoint]\ndir =\n", {"deck.ini:2:", "checkpoint.dir"});
  expect_error("[log]\nevery = 0\n", {"deck.ini:2:", "log.every = 0", ">= 1"});
  expect_error("[log]\nmetrics = out/m\ntensorboard = out/m\n",
               {"deck.ini:3:", "log.tensorboard = out/m", "is also log.metrics"});
  expect_error("", {"--log.tensorboard=metrics.jsonl"}, 2,
               {"(command line)", "log.tensorboard = metrics.jsonl", "is also log.metrics"});
}

// log.tensorboard: off by default, a directory as given (relative to where qtrain runs), kept
// by the resolved deck.
TEST(Deck, TensorboardDirectory) {
  EXPECT_EQ(parse("").log.tensorboard, "");
  const Deck d = parse("[log]\ntensorboard = runs/tb a\n");
  EXPECT_EQ(d.log.tensorboard, "runs/tb a");
  EXPECT_NE(d.resolved.find("\n[log]\n"), std::string::npos);
  EXPECT_EQ(parse_deck_text(d.resolved, "resolved.ini", {}, 2).log.tensorboard, "runs/tb a");
  EXPECT_EQ(parse("[log]\ntensorboard = tb\n", {"--log.tensorboard="}).log.tensorboard, "");
}

// Issue 15, case 2: every real-valued key is used in fp32, so it must be a normal fp32 value
// (1e39 was accepted and wrote infinite weights into a checkpoint).
TEST(DeckErrors, RealValuesMustFitFp32) {
  expect_error("[optim]\nlr = 1e39\n", {"deck.ini:2:", "optim.lr = 1e39", "32-bit float"});
  expect_error("", {"--optim.weight_decay=-4e38"}, 2,
               {"(command line)", "optim.weight_decay = -4e38", "32-bit float"});
  expect_error("[optim]\neps = 1e-40\n", {"deck.ini:2:", "optim.eps = 1e-40", "smallest normal"});
  expect_error("[model]\nrope_theta = 3.5e38\n", {"model.rope_theta", "32-bit float"});
  EXPECT_EQ(parse("[optim]\nlr = 3e38\nmin_lr = 0\n").optim.lr, 3e38);
}

// Issue 15, case 8: the CUDA kernels' head widths are a deck error, not an internal abort.
TEST(DeckErrors, CudaHeadDim) {
  expect_error("[model]\nhead_dim = 32\n[train]\ndevice = cuda\n",
               {"deck.ini:2:", "model.head_dim = 32", "train.device = cuda", "64 and 128"});
  EXPECT_EQ(parse("[model]\nhead_dim = 128\n[train]\ndevice = cuda\n").model.head_dim, 128);
  EXPECT_EQ(parse("[model]\nhead_dim = 32\n").model.head_dim, 32);  // the CPU takes any
}

TEST(DeckErrors, InconsistentValues) {
  expect_error("[train]\nmicro_batch = 4\nglobal_batch = 6\n",
               {"deck.ini:3:", "train.global_batch = 6", "multiple of train.micro_batch (4) x mesh.dp (2)"});
  expect_error("[model]\nnum_heads = 6\nnum_kv_heads = 4\n", {"deck.ini:2:", "model.num_heads = 6", "model.num_kv_heads = 4"});
  expect_error("[model]\nmax_position_embeddings = 16\n[train]\nseq_len = 32\n",
               {"deck.ini:4:", "train.seq_len = 32", "max_position_embeddings = 16"});
  expect_error("[mesh]\ndp = 4\n[train]\nglobal_batch = 16\n", {"deck.ini:2:", "mesh.dp = 4", "2 MPI ranks"});
  expect_error("[mesh]\nep = 3\n", {"deck.ini:2:", "mesh.ep = 3", "does not divide mesh.dp = 2"});
}

// LoRA dropout on the GPU masks 8 columns at a time: each targeted adapter's input width (a tp
// rank's share for o_proj and down_proj) must be a multiple of 8; untargeted sites do not count.
TEST(Deck, LoraDropoutWidthsOnCuda) {
  const std::string model = "[train]\ndevice = cuda\n[model]\nhead_dim = 64\nintermediate_size = 260\n";
  const std::string lora = "[lora]\nr = 4\ndropout = 0.1\n";
  EXPECT_EQ(parse(model + lora + "[mesh]\ntp = 2\n").lora.r, 4);  // q, k, v, o: 128 and 128
  expect_error(model + lora + "targets = q_proj,down_proj\n[mesh]\ntp = 2\n",
               {"lora.dropout = 0.1 > 0 on train.device = cuda needs the input width of each "
                "adapter a multiple of 8; down_proj reads 130 columns a tp rank "
                "(model.intermediate_size / mesh.tp)"});
  EXPECT_EQ(parse(model + "[lora]\nr = 4\ndropout = 0\ntargets = down_proj\n[mesh]\ntp = 2\n")
                .lora.r,
            4);  // no dropout: any width
}

// mesh.tp_overlap: off unless the deck turns it on; a bool like every switch.
TEST(Deck, TpOverlap) {
  EXPECT_FALSE(parse("[mesh]\ntp = 2\n").mesh.tp_overlap);
  EXPECT_TRUE(parse("[mesh]\ntp = 2\ntp_overlap = true\n").mesh.tp_overlap);
  expect_error("[mesh]\ntp_overlap = sometimes\n", {"deck.ini:2:", "mesh.tp_overlap"});
}

// mesh.cp: the world is pp x dp x cp x tp (dp auto divides by cp too); with tp and sequence
// parallelism each cp rank's rows (micro_batch x its tokens of a sequence) must split over tp.
TEST(Deck, ContextParallel) {
  const Deck cp = parse("[mesh]\ncp = 2\n", {}, 4);
  EXPECT_EQ(cp.mesh.cp, 2);
  EXPECT_EQ(cp.mesh.dp, 2);  // auto: 4 / cp
  EXPECT_EQ(parse("[mesh]\ncp = 2\ntp = 2\n", {}, 4).mesh.dp, 1);
  // 18 tokens over cp 2: chunks 5, 5, 4, 4, so 9 a rank; one sequence a micro-batch gives each
  // cp rank 9 rows, which tp 2 does not divide (the whole micro-batch's 18 it does).
  const std::string sp =
      "[mesh]\ncp = 2\ntp = 2\nsequence_parallel = true\n[train]\nseq_len = 18\n";
  EXPECT_EQ(parse(sp, {}, 4).mesh.seq_parallel(), 2);  // micro_batch 2: 18 rows a rank
  expect_error(sp + "micro_batch = 1\nglobal_batch = 1\n", {}, 4,
               {"deck.ini:4: mesh.sequence_parallel = true splits each cp rank's rows over "
                "mesh.tp = 2 ranks, but cp rank 0 of mesh.cp = 2 holds train.micro_batch x 9 = 9 "
                "rows (9 of the train.seq_len = 18 tokens of each sequence), which 2 does not "
                "divide"});
  expect_error("[mesh]\ncp = 3\n", {}, 4, {"mesh.dp = 0 (default) means auto, which needs the "
                                            "world size 4 to be a multiple of mesh.tp x mesh.pp "
                                            "x mesh.cp = 3"});
}

// mesh.sequence_parallel splits each micro-batch's rows over tp; with tp 1 it changes nothing.
TEST(Deck, SequenceParallel) {
  const Deck off = parse("[mesh]\nsequence_parallel = true\n");
  EXPECT_TRUE(off.mesh.sequence_parallel);
  EXPECT_EQ(off.mesh.seq_parallel(), 1);
  const Deck on = parse("[mesh]\ntp = 2\nsequence_parallel = true\n");
  EXPECT_EQ(on.mesh.seq_parallel(), 2);
  EXPECT_EQ(parse("[mesh]\ntp = 2\n").mesh.seq_parallel(), 1);
  expect_error("[mesh]\ntp = 2\nsequence_parallel = true\n[train]\nmicro_batch = 1\n"
               "seq_len = 15\nglobal_batch = 1\n",
               {"deck.ini:3: mesh.sequence_parallel = true splits the train.micro_batch x "
                "train.seq_len = 1 x 15 = 15 rows of a micro-batch over mesh.tp = 2 ranks, which "
                "does not divide them"});
  // The same rows without tp: nothing to split.
  EXPECT_EQ(parse("[mesh]\nsequence_parallel = true\n[train]\nmicro_batch = 1\nseq_len = 15\n"
                  "global_batch = 2\n")
                .mesh.seq_parallel(),
            1);
}

TEST(Deck, LoraSection) {
  Deck off = parse("");
  EXPECT_FALSE(off.lora.enabled());
  Deck d = parse("[lora]\nr = 8\nalpha = 32\ndropout = 0.05\ntargets = q_proj, v_proj\n");
  EXPECT_EQ(d.lora.r, 8);
  EXPECT_EQ(d.lora.scale(), 4.0);
  EXPECT_EQ(d.lora.dropout, 0.05);
  EXPECT_EQ(d.lora.targets, "q_proj, v_proj");
  EXPECT_EQ(parse_deck_text(d.resolved, "resolved.ini", {}, 2).lora.targets, "q_proj, v_proj");
  EXPECT_EQ(parse("", {"--lora.r=4", "--lora.targets=all-linear"}).lora.r, 4);
  // Both back ends train LoRA, with ZeRO-1 and (cuda) a bf16 gradient reduction.
  Deck gpu = parse("[model]\nhead_dim = 64\n[lora]\nr = 8\n[train]\ndevice = cuda\n"
                   "[optim]\nzero_stage = 1\ngrad_reduce = bf16\n");
  EXPECT_TRUE(gpu.lora.enabled());
  EXPECT_EQ(gpu.train.device, "cuda");
}

TEST(DeckErrors, Lora) {
  expect_error("[lora]\nr = -1\n", {"deck.ini:2:", "lora.r = -1", ">= 0"});
  expect_error("[lora]\nr = 4\nalpha = 0\n", {"deck.ini:3:", "lora.alpha = 0", "> 0"});
  expect_error("[lora]\ndropout = 1\n", {"deck.ini:2:", "lora.dropout = 1", "[0, 1)"});
  expect_error("[lora]\nr = 4\ntargets = q_proj, lm_head\n",
               {"deck.ini:3:", "lora.targets = q_proj, lm_head: unknown target lm_head", "down_proj"});
  expect_error("[lora]\ntargets = q_proj,q_proj\n", {"deck.ini:2:", "q_proj is given twice"});
  expect_error("[lora]\ntargets =\n", {"deck.ini:2:", "lora.targets", "empty name"});
  expect_error("[lora]\nrank = 8\n", {"deck.ini:2:", "unknown key lora.rank"});
}

TEST(DeckErrors, ParallelismNotBuiltYet) {
  expect_error("[mesh]\ntp = 3\n", {"deck.ini:2: mesh.tp = 3 does not divide model.num_heads = "});
  expect_error("[model]\nvocab_size = 255\n[mesh]\ntp = 2\n",
               {"deck.ini:4: mesh.tp = 2 does not divide model.vocab_size = 255"});
  // LoRA under tensor parallelism on both back ends, also with more tp ranks than kv heads.
  EXPECT_EQ(parse("[train]\ndevice = cuda\n[model]\nhead_dim = 64\n[lora]\nr = 4\n[mesh]\n"
                  "tp = 2\n").mesh.tp, 2);
  EXPECT_EQ(parse("[train]\ndevice = cuda\n[model]\nnum_kv_heads = 1\nhead_dim = 64\n[lora]\n"
                  "r = 4\n[mesh]\ntp = 2\n").mesh.tp, 2);
  // More tp ranks than key/value heads: a multiple of them on both back ends (no error, with
  // [lora] too), else refused.
  EXPECT_EQ(parse("[model]\nnum_kv_heads = 1\n[mesh]\ntp = 4\n", {}, 4).mesh.tp, 4);
  EXPECT_EQ(parse("[model]\nnum_kv_heads = 1\n[lora]\nr = 4\n[mesh]\ntp = 2\n").mesh.tp, 2);
  expect_error("[model]\nnum_heads = 12\nnum_kv_heads = 4\nvocab_size = 258\n[mesh]\ntp = 6\n",
               {}, 6, {"deck.ini:6: mesh.tp = 6 neither divides nor is a multiple of "
                       "model.num_kv_heads = 4"});
  EXPECT_EQ(parse("[train]\ndevice = cuda\n[model]\nnum_kv_heads = 1\nhead_dim = 64\n[mesh]\n"
                  "tp = 2\n").mesh.tp, 2);
  EXPECT_EQ(parse("[train]\ndevice = cuda\n[model]\nhead_dim = 64\n[mesh]\npp = 2\ndp = 2\n"
                  "[optim]\nzero_stage = 1\n", {}, 4)
                .mesh.dp,
            2);
  expect_error("[train]\ndevice = cuda\n[mesh]\npp = 2\ndp = 2\n[optim]\nzero_stage = 2\n", {}, 4,
               {"mesh.pp = 2: pipeline parallelism on train.device = cuda with mesh.dp = 2 runs "
                "optim.zero_stage 0 or 1 so far (optim.zero_stage = 2)"});
  EXPECT_EQ(parse("[train]\ndevice = cuda\n[model]\nhead_dim = 64\n[mesh]\npp = 2\n"
                  "pp_schedule = zb-h1\n").mesh.pp_schedule,
            "zb-h1");
  expect_error("[train]\ndevice = cuda\nrecompute = true\n[model]\nhead_dim = 64\n[mesh]\npp = 2\n"
               "pp_schedule = zb-h1\n",
               {"mesh.pp_schedule = zb-h1 keeps each layer's activations", "train.recompute"});
  expect_error("[model]\nnum_layers = 2\n[mesh]\npp = 3\n",
               {"deck.ini:4: mesh.pp = 3 is more than model.num_layers = 2"});
  expect_error("[mesh]\npp_schedule = gpipe\n", {"deck.ini:2: mesh.pp_schedule = gpipe must be 1f1b or zb-h1"});
  expect_error("[train]\nrecompute = true\n[mesh]\npp_schedule = zb-h1\n",
               {"deck.ini:4: mesh.pp_schedule = zb-h1 keeps each layer's activations", "train.recompute"});
  expect_error("[mesh]\npp_chunks = 2\n", {"deck.ini:2: mesh.pp_chunks = 2 > 1 interleaves a pipeline: needs mesh.pp > 1"});
  expect_error("[model]\nnum_layers = 2\n[mesh]\npp = 2\npp_chunks = 2\n",
               {"deck.ini:5: mesh.pp_chunks = 2 x mesh.pp = 4 chunks is more than model.num_layers = 2"});
  // Interleaving with split backwards (interleaved ZB-H1): both pipelines run it.
  EXPECT_NO_THROW(parse("[model]\nnum_layers = 4\n[mesh]\npp = 2\npp_chunks = 2\npp_schedule = zb-h1\n"));
  EXPECT_NO_THROW(parse("[train]\ndevice = cuda\n[model]\nhead_dim = 64\nnum_layers = 4\n[mesh]\n"
                        "pp = 2\npp_chunks = 2\npp_schedule = zb-h1\n"));
  expect_error("[model]\nnum_layers = 4\n[mesh]\npp = 2\npp_layers = 1,2\n",
               {"deck.ini:5: mesh.pp_layers = 1,2 gives 3 layers in all, the model has 4"});
  expect_error("[model]\nnum_layers = 4\n[mesh]\npp = 2\npp_layers = 4\n",
               {"deck.ini:5: mesh.pp_layers = 4 gives 1 stage layer counts for 2 chunks"});
  expect_error("[model]\nnum_layers = 4\n[mesh]\npp = 2\npp_layers = 3,x\n",
               {"deck.ini:5: mesh.pp_layers = 3,x 'x' is not a positive layer count"});
  expect_error("[model]\nnum_layers = 4\n[mesh]\npp = 2\npp_layers = 4,0\n",
               {"'0' is not a positive layer count"});
  expect_error("[mesh]\npp_layers = 2\n", {"deck.ini:2: mesh.pp_layers = 2 splits a pipeline: needs mesh.pp > 1"});
  // LoRA in a pipeline: both back ends run it, every schedule.
  EXPECT_EQ(parse("[lora]\nr = 4\n[model]\nnum_layers = 4\n[mesh]\npp = 2\npp_chunks = 2\n"
                  "pp_schedule = zb-h1\n").lora.r, 4);
  EXPECT_EQ(parse("[train]\ndevice = cuda\n[model]\nhead_dim = 64\n[lora]\nr = 4\n[mesh]\n"
                  "pp = 2\n").lora.r, 4);
  // ... at ZeRO 0 or 1, as without the pipeline.
  expect_error("[lora]\nr = 4\n[mesh]\npp = 2\n[optim]\nzero_stage = 2\n",
               {"deck.ini:6: optim.zero_stage = 2", "use 0 or 1 with [lora]"});
  expect_error("[mesh]\nep = 2\n", {"deck.ini:2:", "mesh.ep = 2", "this model is dense"});
}

TEST(DeckErrors, DataAndResumeFiles) {
  Scratch s;
  expect_error("[data]\nsource = file\n", {"deck.ini:", "data.path is not set"});
  expect_error("[data]\nsource = file\npath = " + s.path("none.h5") + "\n", {"deck.ini:3:", "data.path", "no such file"});
  fs::create_directories(s.path("adir"));
  expect_error("[data]\nsource = file\npath = " + s.path("adir") + "\n", {"deck.ini:3:", "data.path", "directory"});
  std::string tokens = s.write("tokens.h5", "x");
  EXPECT_EQ(parse("[data]\nsource = file\npath = " + tokens + "\n").data.path, tokens);
  // A data.path is ignored by the synthetic source, so a file deck can be smoke-tested.
  EXPECT_NO_THROW(parse("[data]\npath = " + s.path("none.h5") + "\n"));

  // Packing: three modes; packed and padded need documents, i.e. a token file.
  EXPECT_EQ(parse("").data.packing, "concat");
  for (const char* mode : {"concat", "packed", "padded"}) {
    EXPECT_EQ(parse("[data]\nsource = file\npath = " + tokens + "\npacking = " + mode + "\n")
                  .data.packing, mode);
  }
  expect_error("[data]\nsource = file\npath = " + tokens + "\npacking = pack\n",
               {"deck.ini:4:", "data.packing = pack", "is not a packing mode: concat | packed | padded"});
  expect_error("[data]\npacking = packed\n",
               {"deck.ini:2:", "data.packing = packed", "needs data.source = file"});
  expect_error("[data]\npacking = padded\n", {"deck.ini:2:", "data.packing = padded", "needs data.source = file"});

  expect_error("[checkpoint]\nresume = " + s.path("step_1.h5") + "\n",
               {"deck.ini:2:", "checkpoint.resume", "no such file", "auto, none"});
  std::string ck = s.write("step_2.h5", "x");
  EXPECT_EQ(parse("[checkpoint]\nresume = " + ck + "\n").checkpoint.resume, ck);
}

// ---- errors from the command line and from defaults ----------------------------------------

TEST(DeckErrors, CommandLine) {
  expect_error("", {"--train.seq_lenn=4"}, 2, {"(command line)", "train.seq_lenn", "did you mean train.seq_len"});
  expect_error("", {"--train.steps=ten"}, 2, {"(command line)", "train.steps = ten is not an integer"});
  expect_error("", {"--train.steps"}, 2, {"(command line)", "--train.steps", "--section.key=value"});
  expect_error("", {"--train.steps=3", "--train.steps=4"}, 2, {"(command line)", "train.steps", "twice"});
  expect_error("", {"--mesh.tp=3"}, 2, {"(command line): mesh.tp = 3 does not divide model.num_heads"});
  expect_error("", {"--checkpoint.dir=a#b"}, 2, {"(command line)", "checkpoint.dir", "'#'"});
  // The command line wins, so the bad file value is never read.
  EXPECT_EQ(parse("[train]\nsteps = ten\n", {"--train.steps=17"}).train.steps, 17);
  // The file line is named for the value that is wrong even when another key was overridden.
  expect_error("[train]\nglobal_batch = 8\n", {"--train.micro_batch=3"}, 2,
               {"deck.ini:2:", "train.global_batch = 8", "train.micro_batch (3)"});
}

TEST(DeckErrors, DefaultValuesAreMarked) {
  expect_error("", {"--train.micro_batch=3"}, 2, {"deck.ini: train.global_batch = 8 (default)", "micro_batch (3)"});
  expect_error("[model]\npreset = qwen3-0.6b\n[train]\nseq_len = 50000\n",
               {"deck.ini:4:", "train.seq_len = 50000", "40960"});
  // Default global_batch 8 against the auto dp of 3 ranks.
  expect_error("", {}, 3, {"deck.ini: train.global_batch = 8 (default)", "mesh.dp (3)"});
}

TEST(DeckErrors, WorldSizeMustBePositive) {
  expect_error("", {}, 0, {"world size 0"});
}

// ---- parse_deck: argv handling and the deck file ---------------------------------------------

Deck parse_argv(std::vector<std::string> args, int world = 2) {
  std::vector<const char*> argv = {"qtrain"};
  for (const std::string& a : args) argv.push_back(a.c_str());
  return qt::parse_deck(static_cast<int>(argv.size()), argv.data(), world);
}

void expect_argv_error(std::vector<std::string> args, std::initializer_list<std::string> parts) {
  try {
    parse_argv(args);
  } catch (const qt::UserError& e) {
    for (const std::string& p : parts) {
      EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what() << "\nmissing: " << p;
    }
    return;
  }
  ADD_FAILURE() << "no error";
}

TEST(DeckArgv, FileAndOverrides) {
  Scratch s;
  std::string deck = s.write("a.ini", "[train]\nsteps = 30   # optimizer steps\nseq_len = 8\n");
  Deck d = parse_argv({"--train.seq_len=4", deck, "--log.every=3"});
  EXPECT_EQ(d.path, deck);
  EXPECT_EQ(d.train.steps, 30);
  EXPECT_EQ(d.train.seq_len, 4);
  EXPECT_EQ(d.log.every, 3);
  std::string bad = s.write("b.ini", "[train]\n\nsteps = 0\n");
  expect_argv_error({bad}, {bad + ":3:", "train.steps = 0"});
}

// Issue 15, case 11: a UTF-8 byte-order mark (Windows editors) before the first line.
TEST(DeckArgv, ByteOrderMarkIsIgnored) {
  Scratch s;
  std::string deck = s.write("bom.ini", "\xEF\xBB\xBF[train]\nsteps = 30\n");
  EXPECT_EQ(parse_argv({deck}).train.steps, 30);
  EXPECT_EQ(parse("\xEF\xBB\xBF# a comment\n[train]\nsteps = 31\n").train.steps, 31);
}

TEST(DeckArgv, PositionalArgumentsAndFiles) {
  Scratch s;
  std::string a = s.write("a.ini", "");
  std::string b = s.write("b.ini", "");
  expect_argv_error({}, {"(command line)", "no deck file"});
  expect_argv_error({"--train.steps=3"}, {"no deck file"});
  expect_argv_error({a, b}, {"(command line)", "one deck file", a, b});
  expect_argv_error({s.path("missing.ini")}, {s.path("missing.ini"), "no such file"});
  expect_argv_error({s.path("")}, {"directory"});
  expect_argv_error({"-x", a}, {"-x"});
}

// ---- presets, help and documentation ----------------------------------------------------------

TEST(ModelPresets, ParameterCountsMatchTheSpecTable) {
  const std::vector<std::pair<std::string, std::int64_t>> expected = {
      {"qwen3-0.6b", 596049920LL},     {"qwen3-1.7b", 1720574976LL},
      {"qwen3-4b", 4022468096LL},      {"qwen3-8b", 8190735360LL},
      {"qwen3-14b", 14768307200LL},    {"qwen3-32b", 32762123264LL}};
  for (const auto& [name, total] : expected) {
    auto m = qt::model_preset(name);
    ASSERT_TRUE(m.has_value()) << name;
    EXPECT_EQ(m->preset, name);
    EXPECT_EQ(m->num_params(), total) << name;
    EXPECT_EQ(m->head_dim, 128);
    EXPECT_EQ(m->vocab_size, 151936);
    EXPECT_EQ(m->max_position_embeddings, 40960);
  }
  EXPECT_FALSE(qt::model_preset("qwen3-7b").has_value());
}

TEST(ModelPresets, TinyIsTheStructDefault) {
  auto t = qt::model_preset("tiny");
  ASSERT_TRUE(t.has_value());
  qt::ModelConfig d;
  EXPECT_EQ(t->hidden_size, d.hidden_size);
  EXPECT_EQ(t->num_params(), d.num_params());
  // Hand count of the tiny model: V*H + L*(attn + 2H + 3HI) + H, tied.
  const std::int64_t attn = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 2 * 16;
  EXPECT_EQ(d.num_params(), 256 * 64 + 2 * (attn + 2 * 64 + 3 * 64 * 192) + 64);
  std::vector<std::string> names = qt::model_preset_names();
  EXPECT_EQ(names.front(), "tiny");
  EXPECT_EQ(names.size(), 9u);
}

TEST(DeckDocs, HelpListsEveryKeyWithItsDefault) {
  std::string help = qt::deck_help();
  EXPECT_NE(help.find("usage: qtrain"), std::string::npos);
  for (const qt::DeckKeyInfo& k : qt::deck_keys()) {
    EXPECT_FALSE(k.meaning.empty()) << k.key;
    std::string line = "  " + k.key + " = " + (k.default_value.empty() ? "\"\"" : k.default_value);
    EXPECT_NE(help.find(line), std::string::npos) << line;
  }
}

TEST(DeckDocs, DecksMdListsEveryKey) {
  std::ifstream in(QT_DECKS_MD);
  ASSERT_TRUE(in) << "cannot read " << QT_DECKS_MD;
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string doc = ss.str();
  for (const qt::DeckKeyInfo& k : qt::deck_keys()) {
    EXPECT_NE(doc.find("`" + k.key + "`"), std::string::npos) << k.key << " is missing from " << QT_DECKS_MD;
  }
}

TEST(DeckDocs, ExampleDecksParse) {
  Scratch s;
  const std::string tokens = s.write("tokens.h5", "");
  int n = 0;
  for (const auto& e : fs::directory_iterator(QT_INPUTS_DIR)) {
    if (e.path().extension() != ".ini") continue;
    ++n;
    std::ifstream in(e.path());
    std::stringstream ss;
    ss << in.rdbuf();
    // File decks name a token file that need not exist here, an empty file stands in (the parser
    // checks that it is readable, not what it holds); a model directory to fine-tune neither:
    // the preset stands in.
    // The 32B job's deck fixes its mesh of 32 ranks (dp 4 x tp 4 x pp 2).
    const std::vector<int> worlds =
        e.path().stem() == "qwen3_32b" ? std::vector<int>{32} : std::vector<int>{1, 2, 4};
    for (int world : worlds) {
      EXPECT_NO_THROW(parse_deck_text(ss.str(), e.path().string(),
                                      {"--data.path=" + tokens, "--model.init="}, world))
          << e.path() << " on " << world << " ranks";
    }
  }
  EXPECT_GE(n, 3);
}

// The Qwen3-32B deck on the 32 ranks of its batch scripts (4 nodes x 8 GPUs), with a token file
// standing in for its data and the preset for its model directory: the layout its comments argue.
TEST(DeckDocs, Qwen3_32bDeckFitsFourNodesOfEightGpus) {
  Scratch s;
  const std::string tokens = s.write("tokens.h5", "");
  const Deck d = parse_argv({std::string(QT_INPUTS_DIR) + "/qwen3_32b.ini", "--data.path=" + tokens,
                             "--model.init="},
                            32);
  EXPECT_EQ(d.model.num_layers, 64);
  EXPECT_EQ(d.model.hidden_size, 5120);
  EXPECT_EQ(d.mesh.dp, 4);  // dp 4 x tp 4 (inside a node) x pp 2, the planner's fastest
  EXPECT_EQ(d.mesh.tp, 4);
  EXPECT_EQ(d.mesh.pp, 2);
  EXPECT_EQ(d.mesh.pp_schedule, "1f1b");
  // The split its comments state: the embedding and layers 0-32, then layers 33-63 and the head.
  EXPECT_EQ(qt::pipeline_layer_bounds(d.model, d.mesh), (std::vector<int>{0, 33, 64}));
  EXPECT_EQ(d.optim.zero_stage, 1);
  EXPECT_EQ(d.train.device, "cuda");
  EXPECT_FALSE(d.train.recompute);
  EXPECT_EQ(d.train.global_batch / (d.train.micro_batch * d.mesh.dp), 32);  // micro-batches a step
  EXPECT_EQ(d.checkpoint.resume, "auto");
  EXPECT_GT(d.checkpoint.every, 0);
  EXPECT_EQ(d.data.source, "file");
  EXPECT_EQ(d.data.path, tokens);
  // The file names the model directory to fine-tune; absent here, it is an error naming the key.
  try {
    parse_argv({std::string(QT_INPUTS_DIR) + "/qwen3_32b.ini", "--data.path=" + tokens}, 32);
    ADD_FAILURE() << "expected an error about model.init";
  } catch (const qt::UserError& e) {
    EXPECT_NE(std::string(e.what()).find("model.init"), std::string::npos) << e.what();
  }
}

}  // namespace

namespace qt {
namespace {

using deck_test::expect_error;
using deck_test::parse;

// [eval] with files that exist (docs/decks.md and a deck stand in for token files: the deck
// checks only that they are readable; the run opens them). Samples: tests/train/test_evaluation.cpp.
TEST(Deck, EvalSection) {
  const std::string md = QT_DECKS_MD, ini = QT_INPUTS_DIR "/tiny.ini";
  EXPECT_FALSE(parse("").eval.loss_on());
  EXPECT_FALSE(parse("").eval.samples_on());
  const Deck d = parse("[eval]\npaths = " + md + " , " + ini + "\nevery = 5\nmax_sequences = 7\n");
  EXPECT_EQ(split_eval_paths(d.eval.paths), (std::vector<std::string>{md, ini}));
  EXPECT_EQ(d.eval.every, 5);
  EXPECT_EQ(d.eval.max_sequences, 7);
  EXPECT_TRUE(d.eval.loss_on());
  EXPECT_NE(d.resolved.find("[eval]\npaths = " + md), std::string::npos) << d.resolved;
  const Deck s = parse("[data]\nsource = file\npath = " + md + "\n[eval]\nsplit = 0.25\n");
  EXPECT_EQ(s.eval.split, 0.25);
  EXPECT_TRUE(s.eval.loss_on());
  EXPECT_EQ(split_eval_paths(""), std::vector<std::string>{});
  EXPECT_EQ(split_eval_paths("a,,b"), (std::vector<std::string>{"a", "", "b"}));
}

TEST(DeckErrors, Eval) {
  const std::string md = QT_DECKS_MD;
  expect_error("[eval]\npaths = no/such.h5\n",
               {"deck.ini:2:", "eval.paths = no/such.h5: no/such.h5: no such file"});
  expect_error("[eval]\npaths = " + md + ",\n", {"deck.ini:2:", "has an empty entry"});
  expect_error("[eval]\nsplit = 0.1\n",
               {"deck.ini:2:", "eval.split = 0.1", "needs data.source = file"});
  expect_error("[data]\nsource = file\npath = " + md + "\n[eval]\nsplit = 1\n",
               {"deck.ini:5:", "eval.split = 1 must be in [0, 1)"});
  expect_error("[eval]\nevery = 10\n",
               {"deck.ini:2:", "eval.every = 10 is set, but nothing is evaluated", "eval.paths"});
  expect_error("[eval]\nmax_sequences = 3\n", {"deck.ini:2:", "eval.max_sequences = 3 is set"});
  expect_error("[eval]\npaths = " + md + "\nevery = -1\n",
               {"deck.ini:3:", "eval.every = -1 must be >= 0"});
  expect_error("[eval]\nsamples_every = 3\n",
               {"deck.ini:2:", "eval.samples_every = 3 is set, but there are no prompts"});
  expect_error("[eval]\nmax_new_tokens = 3\n", {"deck.ini:2:", "eval.max_new_tokens = 3 is set"});
  expect_error("[eval]\nsamples = no/prompts.txt\n",
               {"deck.ini:2:", "eval.samples = no/prompts.txt: no such file"});
  expect_error("[eval]\nsamples = " + md + "\n",
               {"deck.ini:2:", "eval.samples = " + md + " needs a tokenizer", "eval.tokenizer"});
  expect_error("[eval]\nsamples = " + md + "\ntokenizer = no/dir\n",
               {"deck.ini:3:", "eval.tokenizer = no/dir: no/dir/tokenizer.json: no such file"});
  expect_error("[eval]\nsamples = " + md + "\nmax_new_tokens = 0\n",
               {"deck.ini:3:", "eval.max_new_tokens = 0 must be >= 1"});
  expect_error("[train]\ndevice = cuda\n[model]\nhead_dim = 64\n[lora]\nr = 4\ndropout = 0.1\n"
               "[eval]\npaths = " + md + "\n",
               {"deck.ini:9:", "eval.paths", "lora.dropout = 0.1 on train.device = cuda is not built"});
  expect_error("[eval]\nsample = x\n", {"deck.ini:2:", "unknown key eval.sample"});
}

}  // namespace
}  // namespace qt
