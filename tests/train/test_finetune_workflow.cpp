// docs/finetune.md's workflow end to end under mpiexec -n 2, in process, with Qwen3's tokenizer
// (the qwen3_tokenizer CTest fixture): a Hugging Face directory (random weights, Qwen3's
// vocabulary) and a chat JSONL; `qtrain prep` turns the chat into a token file with loss masks;
// a LoRA run with `[model] init` = the directory trains on it, packed, on 2 ranks; `qtrain export`
// writes the PEFT adapter directory and, with --merge, a model directory that loads back as
// bf16(base + scale * B A) of the run's adapters. The run also evaluates ([eval]: a split of
// the token file and a chat prompt), seen in the metrics file and TensorBoard.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "hf/config.h"
#include "hf/export.h"
#include "hf/lora_export.h"
#include "hf/safetensors.h"
#include "hf/weights.h"
#include "model/lora.h"
#include "prep/prep.h"
#include "prep/records.h"
#include "qtrain/comm.h"
#include "support/event_file_reader.h"
#include "support/random.h"
#include "tokenizer/qwen3_tokenizer.h"
#include "train/training_harness.h"

namespace qt {
namespace {

namespace fs = std::filesystem;

ModelConfig small_model() {
  ModelConfig c;
  c.preset = "";
  c.vocab_size = 151936;  // Qwen3's embedding rows (the tokenizer has 151669 ids)
  c.hidden_size = 32;
  c.intermediate_size = 64;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 16;
  c.tie_word_embeddings = true;
  c.max_position_embeddings = 4096;
  return c;
}

// Every rank calls a sub-command's main with `args` on `world`.
template <typename Main>
int run_main(const char* name, std::vector<std::string> args, Main&& main) {
  args.insert(args.begin(), name);
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  return main(static_cast<int>(argv.size()), argv.data());
}

// Conversations whose assistant turns repeat a few fixed answers: learnable in a few steps.
void write_chat(const std::string& path, std::mt19937_64& rng) {
  const std::vector<std::string> questions = {"What is the capital of France?", "Say hello.",
                                              "Count to three.", "Name a colour."};
  const std::vector<std::string> answers = {"Paris.", "Hello!", "One, two, three.", "Blue."};
  std::ofstream out(path);
  for (int i = 0; i < 96; ++i) {
    const std::size_t k = rng() % questions.size();
    nlohmann::json msgs = nlohmann::json::array();
    if (i % 3 == 0) msgs.push_back({{"role", "system"}, {"content", "Be brief."}});
    msgs.push_back({{"role", "user"}, {"content", questions[k]}});
    msgs.push_back({{"role", "assistant"}, {"content", answers[k]}});
    out << nlohmann::json{{"messages", msgs}}.dump() << "\n";
  }
  out << "{\"messages\": [broken\n";  // one malformed record: counted and skipped, not fatal
}

// Rank 0: the run's evaluations (steps 8 and 16) and its sample (step 16) in the metrics file and
// TensorBoard.
void check_eval(const std::string& metrics, const std::string& tb) {
  std::vector<nlohmann::json> evals, samples;
  std::ifstream f(metrics);
  for (std::string line; std::getline(f, line);) {
    const nlohmann::json j = nlohmann::json::parse(line);
    if (j.value("kind", "") == "eval") evals.push_back(j);
    if (j.value("kind", "") == "samples") samples.push_back(j);
  }
  ASSERT_EQ(evals.size(), 2u);
  ASSERT_EQ(samples.size(), 1u);
  EXPECT_EQ(samples[0]["step"], 16);
  ASSERT_EQ(samples[0]["samples"].size(), 1u);
  const std::string prompt = samples[0]["samples"][0]["prompt"];
  EXPECT_EQ(prompt, "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                    "<|im_start|>assistant\n");
  std::vector<tensorboard::Event> events;
  for (const std::string& file : test::event_files(tb)) {
    const auto e = test::parse_events(test::read_records(file));
    events.insert(events.end(), e.begin(), e.end());
  }
  const test::ScalarSeries s = test::scalar_series(events);
  ASSERT_EQ(s.count("eval/loss"), 1u);
  ASSERT_EQ(s.at("eval/loss").size(), 2u);
  for (std::size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(s.at("eval/loss")[i].first, evals[i]["step"].get<std::int64_t>());
    EXPECT_EQ(s.at("eval/loss")[i].second, static_cast<float>(evals[i]["eval_loss"].get<double>()));
    EXPECT_TRUE(std::isfinite(evals[i]["eval_loss"].get<double>()));
  }
  int texts = 0;
  for (const tensorboard::Event& x : events)
    for (const auto& v : x.summary().value())
      if (v.tag() == "eval/samples") {
        ++texts;
        EXPECT_EQ(x.step(), 16);
        EXPECT_NE(v.tensor().string_val(0).find("What is the capital of France?"),
                  std::string::npos);
      }
  EXPECT_EQ(texts, 1);
}

TEST(FinetuneWorkflow, ChatPrepLoraFromHfDirectoryExportAndMerge) {
  ASSERT_EQ(test::world_size(), 2);
  const std::string tok_dir = test::qwen3_tokenizer_dir();
  ASSERT_FALSE(tok_dir.empty());
  auto world = std::make_shared<MpiComm>(MPI_COMM_WORLD, "world", false);
  const std::string tmp = test::shared_temp_dir("finetune");
  const std::string base = tmp + "/base", chat = tmp + "/chat.jsonl", tokens = tmp + "/chat.h5";
  const ModelConfig cfg = small_model();
  const ParamLayout layout(cfg);

  // 1. The pretrained model: an HF directory with the tokenizer files, and a chat data set.
  if (test::world_rank() == 0) {
    std::mt19937_64 rng(test::test_seed());
    std::vector<float> params = test::random_vector<float>(layout.numel(), rng, 0.05);
    for (const ParamInfo& p : layout.params())
      if (p.shape.size() == 1) std::fill_n(params.begin() + p.offset, p.numel, 1.0f);
    fs::create_directories(base);
    hf::write_model_dir(base, cfg, layout, params.data(), 5'000'000'000, hf::default_extras(cfg),
                        "");
    for (const char* f : {"tokenizer.json", "tokenizer_config.json"})
      fs::copy_file(fs::path(tok_dir) / f, fs::path(base) / f);
    write_chat(chat, rng);
  }
  MPI_Barrier(MPI_COMM_WORLD);

  // 2. qtrain prep on both ranks, the tokenizer taken from the model directory.
  PrepStats stats;
  ASSERT_EQ(run_main("prep", {"--tokenizer", base, "--output", tokens, "--progress", "0", chat},
                     [&](int argc, char** argv) { return prep_main(argc, argv, *world, &stats); }),
            0);
  EXPECT_EQ(stats.records, 97);
  EXPECT_EQ(stats.documents, 96);
  EXPECT_EQ(stats.skipped[static_cast<int>(prep::Skip::kMalformed)], 1);

  // 3. LoRA on the prepared file, packed, dp = 2, from the HF directory, with 10% of the windows
  // held out and evaluated (every 8 steps) and a chat prompt continued at the end with the
  // directory's tokenizer (docs/monitoring.md, "Evaluation"), all in TensorBoard too.
  const std::string ck = tmp + "/ck", prompts = tmp + "/prompts.txt", tb = tmp + "/tb";
  if (test::world_rank() == 0)
    std::ofstream(prompts) << "<|im_start|>user\\nWhat is the capital of France?<|im_end|>\\n"
                              "<|im_start|>assistant\\n\n";
  MPI_Barrier(MPI_COMM_WORLD);
  const std::string deck =
      "[model]\ninit = " + base +
      "\n[train]\nseq_len = 128\nmicro_batch = 2\nglobal_batch = 4\nsteps = 16\nseed = 3\n"
      "[optim]\nlr = 2e-2\nmin_lr = 2e-3\nwarmup_steps = 2\nweight_decay = 0\n"
      "[data]\nsource = file\npath = " + tokens + "\npacking = packed\n"
      "[lora]\nr = 4\nalpha = 8\ntargets = all-linear\n"
      "[checkpoint]\ndir = " + ck + "\nevery = 16\nresume = none\n[log]\nevery = 1\n"
      "tensorboard = " + tb + "\n[eval]\nsplit = 0.1\nevery = 8\nsamples = " + prompts +
      "\nmax_new_tokens = 8\n";
  const test::RunResult r = test::run(2, deck, {}, tmp + "/metrics.jsonl");
  ASSERT_EQ(r.exit_code, 0) << r.error;
  ASSERT_EQ(r.steps.size(), 16u);
  double first = 0, last = 0;
  for (int i = 0; i < 3; ++i) first += r.steps[i].loss, last += r.steps[13 + i].loss;
  for (const test::StepRecord& s : r.steps) ASSERT_TRUE(std::isfinite(s.loss));
  // From a random base (about ln V = 11.9 nats) the fixed answers are learnable: seen 11.6 -> 10.6
  // (means of the first and last 3 steps).
  EXPECT_LT(last / 3, first / 3 - 0.5) << "the loss must fall";
  if (test::world_rank() == 0) check_eval(tmp + "/metrics.jsonl", tb);

  // 4. Export: PEFT's adapter directory, and the merged model.
  const std::string ckpt = ck + "/step_00000016.h5";
  const std::string adapter = tmp + "/adapter", merged = tmp + "/merged";
  auto export_main_on = [&](int argc, char** argv) { return export_main(argc, argv, world); };
  ASSERT_EQ(run_main("export", {ckpt, adapter}, export_main_on), 0);
  ASSERT_EQ(run_main("export", {ckpt, merged, "--merge"}, export_main_on), 0);

  const LoraConfig lora{4, 8.0, 0.0, "all-linear"};
  if (test::world_rank() == 0) {
    const nlohmann::json ac = nlohmann::json::parse(std::ifstream(adapter + "/adapter_config.json"));
    EXPECT_EQ(ac["r"], 4);
    EXPECT_EQ(ac["lora_alpha"], 8);
    EXPECT_EQ(ac["target_modules"].size(), 7u);
    hf::SafetensorsFile st(adapter + "/adapter_model.safetensors");
    EXPECT_EQ(st.tensors().size(), static_cast<std::size_t>(cfg.num_layers) * 7 * 2);
  }

  // The merged directory = bf16(base + scale B A) with the checkpoint's adapters.
  const hf::CheckpointModel cm = hf::read_checkpoint_model(ckpt);
  ASSERT_TRUE(cm.lora.has_value());
  const std::vector<float> adapters = hf::read_lora_adapters(ckpt, cm, world);
  std::vector<float> want(layout.numel()), got(layout.numel());
  hf::load_params(base, layout, hf::all_rows(layout, want.data()), cfg.tie_word_embeddings, *world);
  lora_merge(cfg, lora, adapters.data(), layout, want.data());
  EXPECT_EQ(hf::read_config(merged).hidden_size, cfg.hidden_size);
  hf::load_params(merged, layout, hf::all_rows(layout, got.data()), cfg.tie_word_embeddings,
                  *world);
  std::size_t differ = 0, changed = 0;
  std::vector<float> base_params(layout.numel());
  hf::load_params(base, layout, hf::all_rows(layout, base_params.data()), cfg.tie_word_embeddings,
                  *world);
  for (std::size_t i = 0; i < want.size(); ++i) {
    ASSERT_FALSE(std::isnan(got[i]));
    differ += hf::bf16_to_f32(hf::f32_to_bf16(want[i])) != got[i];
    changed += got[i] != base_params[i];
  }
  EXPECT_EQ(differ, 0u) << "merged weights != bf16(base + scale B A)";
  EXPECT_GT(changed, 0u) << "the adapters trained: the merge must change some weights";
  if (test::world_rank() == 0) fs::remove_all(tmp);
}

}  // namespace
}  // namespace qt
