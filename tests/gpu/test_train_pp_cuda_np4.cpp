// Pipeline parallelism combined on four GPUs (issue 17): two stages, each over a dp group of two
// (ZeRO-0 and 1: each stage's gradients reduced over its dp group in the step; interleaved with
// untied embeddings too) or over a tp group of two (with and without sequence parallelism), 1F1B
// and ZB-H1; tp 4 with each of the 2 kv heads shared by 2 ranks;
// reproduce one GPU's losses and gradient norms (bf16 tolerance); a checkpoint of (dp, pp) =
// (2, 2) continues on one GPU. Skips unless four GPUs are visible.
#include <filesystem>

#include "gpu_test.h"
#include "sharded_cases.h"

namespace qt {
namespace {

TEST(TrainPipelineCuda, Pp2WithDp2OrTp2MatchesOneGpu) {
  if (const int gpus = test::visible_gpus(); gpus < 4) GTEST_SKIP() << "needs 4 GPUs, found " << gpus;
  ASSERT_EQ(test::world_size(), 4);
  const std::string tmp = test::shared_temp_dir("cuda-pp2x2");
  auto deck = [&](const std::string& d) { return test::sharded_deck(tmp + "/" + d); };
  const auto with = test::four_layers;  // test::four_layers says why
  const test::PipelineRefs refs = test::pipeline_refs(tmp);
  ASSERT_FALSE(HasFailure());
  const test::RunResult &ref = refs.tied, &ref_untied = refs.untied;
  struct Case {
    const char* name;
    std::vector<std::string> overrides;
    bool untied;
  };
  for (const Case& c :
       {Case{"dp2_pp2_zero1", {"--mesh.dp=2", "--mesh.pp=2", "--optim.zero_stage=1"}, false},
        Case{"dp2_pp2_zero0", {"--mesh.dp=2", "--mesh.pp=2", "--optim.zero_stage=0"}, false},
        Case{"dp2_pp2_v2_untied",
             {"--mesh.dp=2", "--mesh.pp=2", "--mesh.pp_chunks=2", "--optim.zero_stage=1",
              "--model.tie_word_embeddings=false"},
             true},
        Case{"tp2_pp2", {"--mesh.dp=1", "--mesh.tp=2", "--mesh.pp=2"}, false},
        Case{"tp2_pp2_sp",
             {"--mesh.dp=1", "--mesh.tp=2", "--mesh.pp=2", "--mesh.sequence_parallel=true"},
             false},
        Case{"dp2_pp2_zb", {"--mesh.dp=2", "--mesh.pp=2", "--mesh.pp_schedule=zb-h1",
                            "--optim.zero_stage=1"}, false},
        Case{"tp2_pp2_sp_zb",
             {"--mesh.dp=1", "--mesh.tp=2", "--mesh.pp=2", "--mesh.sequence_parallel=true",
              "--mesh.pp_schedule=zb-h1"},
             false}}) {
    SCOPED_TRACE(c.name);
    const auto r = test::run(4, deck(c.name), with(c.overrides), tmp + "/" + c.name + ".jsonl");
    test::expect_matches(c.name, r, c.untied ? ref_untied : ref);
  }
  const auto to_one = test::run(
      1, deck("dp2_pp2_to_one"),
      with({"--checkpoint.resume=" + tmp + "/dp2_pp2_zero1/step_00000010.h5"}),
      tmp + "/dp2_pp2_to_one.jsonl");
  ASSERT_EQ(to_one.exit_code, 0) << to_one.error;
  EXPECT_LT(test::worst_loss_diff("(dp, pp) = (2, 2) checkpoint resumed on one GPU", to_one, ref, 11),
            test::kShardedTol);
  if (test::world_rank() == 0) std::filesystem::remove_all(tmp);
}

// tp 4 over the model's 2 kv heads: each shared by a pair of ranks, its k/v gradients summed
// over the pair only (not over all four), with and without sequence parallelism; tp 2 x pp 2
// over one kv head.
TEST(TrainTensorParallelCuda, SharedKvHeadsMatchOneGpu) {
  if (const int gpus = test::visible_gpus(); gpus < 4) GTEST_SKIP() << "needs 4 GPUs, found " << gpus;
  ASSERT_EQ(test::world_size(), 4);
  const std::string tmp = test::shared_temp_dir("cuda-tp4-kv2");
  auto deck = [&](const std::string& d) { return test::sharded_deck(tmp + "/" + d); };
  const auto ref = test::run(1, deck("one"), test::four_layers(), tmp + "/one.jsonl");
  ASSERT_EQ(ref.exit_code, 0) << ref.error;
  for (const auto& [name, overrides] :
       {std::pair<const char*, std::vector<std::string>>{"tp4", {"--mesh.tp=4"}},
        {"tp4_sp", {"--mesh.tp=4", "--mesh.sequence_parallel=true"}}}) {
    SCOPED_TRACE(name);
    const auto r = test::run(4, deck(name), test::four_layers(overrides),
                             tmp + "/" + name + ".jsonl");
    test::expect_matches(name, r, ref);
  }
  // One kv head shared by a tp pair in each of two pipeline stages.
  const std::string kv1 = "--model.num_kv_heads=1";
  const auto ref_kv1 = test::run(1, deck("one_kv1"), test::four_layers({kv1}),
                                 tmp + "/one_kv1.jsonl");
  ASSERT_EQ(ref_kv1.exit_code, 0) << ref_kv1.error;
  const auto r = test::run(4, deck("tp2_pp2_kv1"),
                           test::four_layers({kv1, "--mesh.tp=2", "--mesh.pp=2"}),
                           tmp + "/tp2_pp2_kv1.jsonl");
  // This model's gradient norm climbs to a spike from step 14 (7.2 at step 17 on one GPU), where
  // bf16 rounding differences grow to 4% of the norm: the norms are compared before it.
  ASSERT_EQ(r.exit_code, 0) << r.error;
  ASSERT_EQ(r.steps.size(), 20u);
  EXPECT_LT(test::worst_loss_diff("tp2_pp2_kv1", r, ref_kv1), test::kShardedTol);
  EXPECT_LT(test::worst_norm_diff("tp2_pp2_kv1 (steps 1-12)", r, ref_kv1, 12),
            test::kShardedNormTol);
  if (test::world_rank() == 0) std::filesystem::remove_all(tmp);
}

}  // namespace
}  // namespace qt
