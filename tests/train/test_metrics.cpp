// The step metrics' derived figures: the balance of each sparse layer's expert load, and the
// TensorBoard scalars of a step (log.tensorboard); the evaluation's lines ([eval]).
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "train/metrics.h"
#include "train/tensorboard_log.h"

namespace qt {
namespace {

TEST(ExpertLoad, CoefficientOfVariationAndMaxOverMean) {
  // Two layers of four experts: even, then 8 tokens on one expert of four (mean 2).
  const std::vector<double> load = {5, 5, 5, 5, 8, 0, 0, 0};
  const ExpertLoadSummary s = summarize_expert_load(load, 4);
  ASSERT_EQ(s.cv.size(), 2u);
  EXPECT_DOUBLE_EQ(s.cv[0], 0.0);
  EXPECT_DOUBLE_EQ(s.max_over_mean[0], 1.0);
  // population std of {8, 0, 0, 0}: sqrt((36 + 3 x 4) / 4) = sqrt(12); / mean 2
  EXPECT_NEAR(s.cv[1], std::sqrt(12.0) / 2.0, 1e-12);
  EXPECT_DOUBLE_EQ(s.max_over_mean[1], 4.0);
  // No tokens: zeros, not NaN; no experts or a ragged tail: nothing.
  const ExpertLoadSummary z = summarize_expert_load({0, 0, 0}, 3);
  ASSERT_EQ(z.cv.size(), 1u);
  EXPECT_EQ(z.cv[0], 0.0);
  EXPECT_TRUE(summarize_expert_load(load, 0).cv.empty());
  EXPECT_EQ(summarize_expert_load(load, 3).cv.size(), 2u);  // 8 values: two whole layers of 3
}

std::map<std::string, double> scalar_map(const StepMetrics& m) {
  std::map<std::string, double> out;
  for (const EventFileWriter::Scalar& s : tensorboard_scalars(m)) {
    EXPECT_EQ(out.count(s.tag), 0u) << s.tag << " twice";
    out[s.tag] = s.value;
  }
  return out;
}

TEST(TensorBoardScalars, DenseStepHasTheJsonFieldsInTheirUnits) {
  StepMetrics m;
  m.step = 40;
  m.loss = 2.5;
  m.lr = 3e-4;
  m.grad_norm = 0.75;
  m.tokens_per_s = 12345;
  m.tokens = 1 << 20;
  m.skipped_steps = 3;
  m.peak = {1.5 * (1 << 30), 2.0 * (1 << 30), 3.0 * (1 << 30), 0.25 * (1 << 30), 0};
  m.time = {0.01, 0.5, 0.125};
  m.comm = {{"dp.reduce_scatter", 4.5, 2, 10, 100}, {"mpi.world.all_reduce", 0.25, 1, 0, 0}};
  const std::map<std::string, double> s = scalar_map(m);
  const std::map<std::string, double> want = {
      {"train/loss", 2.5}, {"train/lr", 3e-4}, {"train/grad_norm", 0.75},
      {"train/tokens", 1 << 20}, {"train/skipped_steps", 3}, {"perf/tokens_per_s", 12345},
      {"time/data_s", 0.01}, {"time/compute_s", 0.5}, {"time/optimizer_s", 0.125},
      {"memory/params_gib", 1.5}, {"memory/grads_gib", 2}, {"memory/optimizer_gib", 3},
      {"memory/activations_gib", 0.25}, {"memory/workspace_gib", 0}, {"memory/total_gib", 6.75},
      {"comm/dp.reduce_scatter_ms", 4.5}, {"comm/mpi.world.all_reduce_ms", 0.25}};
  EXPECT_EQ(s, want);  // no pipeline_idle (not measured), no moe/* (dense)
}

TEST(TensorBoardScalars, MoeAndPipelineFiguresWhenPresent) {
  StepMetrics m;
  m.pipeline_idle = 0.2;
  m.aux_loss = 2.1;
  m.num_experts = 4;
  m.expert_load = {5, 5, 5, 5, 8, 0, 0, 0};  // cv 0 and sqrt(12) / 2; max/mean 1 and 4
  const std::map<std::string, double> s = scalar_map(m);
  EXPECT_EQ(s.at("perf/pipeline_idle"), 0.2);
  EXPECT_EQ(s.at("moe/aux_loss"), 2.1);
  EXPECT_NEAR(s.at("moe/expert_cv"), std::sqrt(12.0) / 4.0, 1e-12);  // the mean of the layers'
  EXPECT_NEAR(s.at("moe/expert_cv_max"), std::sqrt(12.0) / 2.0, 1e-12);
  EXPECT_EQ(s.at("moe/expert_max_over_mean"), 4.0);
  EXPECT_EQ(s.count("moe/dropped_fraction"), 0u);  // dropless: no capacity factor
  m.expert_dropped = {1, 3};                        // of 20 and 8 token-slots routed
  EXPECT_NEAR(scalar_map(m).at("moe/dropped_fraction"), 4.0 / 28.0, 1e-12);
}

// [eval]'s stdout lines and JSON lines (rank 0 of a one-rank world): one line a sample whatever
// its text holds, kinds that tell them from the step lines.
TEST(EvalLines, StdoutAndJsonLines) {
  const std::string path = std::filesystem::temp_directory_path() /
                           ("qtrain_eval_lines_" + std::to_string(::getpid()) + ".jsonl");
  MpiComm self(MPI_COMM_SELF, "self", false);
  {
    MetricsLog log(path, self, false);
    testing::internal::CaptureStdout();
    log.write_eval({20, 2.0, 300, 7, 0.5});
    log.write_samples(20, {{"a\nb", "c\"d\xff", {5, 6}}}, 0.25);
    const std::string out = testing::internal::GetCapturedStdout();
    EXPECT_EQ(out,
              "eval step 20: loss 2.00000 ppl 7.389 over 300 tokens in 7 sequences (0.50 s)\n"
              "sample 0 at step 20: \"a\\nb\" -> \"c\\\"d\xEF\xBF\xBD\"\n");
  }
  std::ifstream in(path);
  std::string line;
  std::vector<nlohmann::json> j;
  while (std::getline(in, line)) j.push_back(nlohmann::json::parse(line));
  std::filesystem::remove(path);
  ASSERT_EQ(j.size(), 2u);
  EXPECT_EQ(j[0]["kind"], "eval");
  EXPECT_EQ(j[0]["step"], 20);
  EXPECT_EQ(j[0]["eval_loss"], 2.0);
  EXPECT_NEAR(j[0]["eval_ppl"].get<double>(), 7.38905609893065, 1e-12);
  EXPECT_EQ(j[0]["eval_tokens"], 300);
  EXPECT_EQ(j[0]["eval_sequences"], 7);
  EXPECT_EQ(j[0]["eval_s"], 0.5);
  EXPECT_FALSE(j[0].contains("loss")) << "not a step line";
  EXPECT_EQ(j[1]["kind"], "samples");
  EXPECT_EQ(j[1]["samples_s"], 0.25);
  ASSERT_EQ(j[1]["samples"].size(), 1u);
  EXPECT_EQ(j[1]["samples"][0]["prompt"], "a\nb");
  EXPECT_EQ(j[1]["samples"][0]["continuation"], "c\"d\xEF\xBF\xBD");  // invalid UTF-8 replaced
  EXPECT_EQ(j[1]["samples"][0]["ids"], (std::vector<int>{5, 6}));
}

}  // namespace
}  // namespace qt
