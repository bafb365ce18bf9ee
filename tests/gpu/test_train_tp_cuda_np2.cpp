// Tensor parallelism on two GPUs (issue 17): heads, MLP columns and the vocabulary split over
// tp = 2 (the row-parallel outputs and column-parallel input gradients summed over NCCL, the
// embedding and the cross-entropy vocabulary-parallel), with and without sequence parallelism,
// reproduce one GPU's losses and gradient norms (bf16 tolerance), with recompute, one sequence
// a micro-batch and untied embeddings too, with the collectives whole after their GEMMs (the
// default) and in pieces beside them (mesh.tp_overlap);
// checkpoints move between tp 2 and one GPU both ways; one kv head shared by the two tp ranks.
// Skips unless two GPUs are visible.
#include <filesystem>

#include "gpu_test.h"
#include "sharded_cases.h"

namespace qt {
namespace {

TEST(TrainTensorParallelCuda, Tp2MatchesOneGpu) {
  if (const int gpus = test::visible_gpus(); gpus < 2) GTEST_SKIP() << "needs 2 GPUs, found " << gpus;
  ASSERT_EQ(test::world_size(), 2);
  const std::string tmp = test::shared_temp_dir("cuda-tp2");
  auto deck = [&](const std::string& d) { return test::sharded_deck(tmp + "/" + d); };
  const std::vector<std::string> untied = {"--model.tie_word_embeddings=false"};
  const auto ref = test::run(1, deck("one"), {}, tmp + "/one.jsonl");
  ASSERT_EQ(ref.exit_code, 0) << ref.error;
  const auto ref_untied = test::run(1, deck("one_untied"), untied, tmp + "/one_untied.jsonl");
  ASSERT_EQ(ref_untied.exit_code, 0) << ref_untied.error;
  struct Case {
    const char* name;
    std::vector<std::string> overrides;
    bool untied;
  };
  for (const Case& c :
       {Case{"tp2", {"--mesh.tp=2"}, false},
        Case{"tp2_recompute_micro1",
             {"--mesh.tp=2", "--train.recompute=true", "--train.micro_batch=1"}, false},
        Case{"tp2_untied", {"--mesh.tp=2", "--model.tie_word_embeddings=false"}, true},
        // sequence parallelism: norms and residuals on each rank's half of the rows
        Case{"tp2_sp", {"--mesh.tp=2", "--mesh.sequence_parallel=true"}, false},
        Case{"tp2_sp_recompute_micro1",
             {"--mesh.tp=2", "--mesh.sequence_parallel=true", "--train.recompute=true",
              "--train.micro_batch=1"},
             false},
        // the collectives in pieces beside the GEMMs (mesh.tp_overlap)
        Case{"tp2_overlap", {"--mesh.tp=2", "--mesh.tp_overlap=true"}, false},
        Case{"tp2_sp_overlap",
             {"--mesh.tp=2", "--mesh.sequence_parallel=true", "--mesh.tp_overlap=true"}, false},
        Case{"tp2_sp_untied",
             {"--mesh.tp=2", "--mesh.sequence_parallel=true", "--model.tie_word_embeddings=false"},
             true}}) {
    SCOPED_TRACE(c.name);
    const auto r = test::run(2, deck(c.name), c.overrides, tmp + "/" + c.name + ".jsonl");
    test::expect_matches(c.name, r, c.untied ? ref_untied : ref);
  }
  // Checkpoints hold global tensors: tp 2's continues on one GPU, one GPU's at tp 2.
  const auto to_one = test::run(1, deck("tp2_to_one"),
                                {"--checkpoint.resume=" + tmp + "/tp2/step_00000010.h5"},
                                tmp + "/tp2_to_one.jsonl");
  ASSERT_EQ(to_one.exit_code, 0) << to_one.error;
  EXPECT_LT(test::worst_loss_diff("tp 2 checkpoint resumed on one GPU", to_one, ref, 11),
            test::kShardedTol);
  const auto to_tp = test::run(2, deck("one_to_tp2"),
                               {"--mesh.tp=2", "--checkpoint.resume=" + tmp + "/one/step_00000010.h5"},
                               tmp + "/one_to_tp2.jsonl");
  ASSERT_EQ(to_tp.exit_code, 0) << to_tp.error;
  EXPECT_LT(test::worst_loss_diff("one GPU's checkpoint resumed at tp 2", to_tp, ref, 11),
            test::kShardedTol);
  if (test::world_rank() == 0) std::filesystem::remove_all(tmp);
}

// Fewer key/value heads than tp ranks (one kv head, tp 2): both ranks hold the head, each its
// query heads' part of the k/v gradients, summed over the two; the checkpoint holds the head once.
TEST(TrainTensorParallelCuda, SharedKvHeadMatchesOneGpu) {
  if (const int gpus = test::visible_gpus(); gpus < 2) GTEST_SKIP() << "needs 2 GPUs, found " << gpus;
  ASSERT_EQ(test::world_size(), 2);
  const std::string tmp = test::shared_temp_dir("cuda-tp2-kv1");
  auto deck = [&](const std::string& d) { return test::sharded_deck(tmp + "/" + d); };
  const std::string kv1 = "--model.num_kv_heads=1";
  const auto ref = test::run(1, deck("one"), {kv1}, tmp + "/one.jsonl");
  ASSERT_EQ(ref.exit_code, 0) << ref.error;
  for (const auto& [name, overrides] :
       {std::pair<const char*, std::vector<std::string>>{"tp2", {kv1, "--mesh.tp=2"}},
        {"tp2_sp_recompute", {kv1, "--mesh.tp=2", "--mesh.sequence_parallel=true",
                              "--train.recompute=true"}}}) {
    SCOPED_TRACE(name);
    const auto r = test::run(2, deck(name), overrides, tmp + "/" + name + ".jsonl");
    test::expect_matches(name, r, ref);
  }
  const auto to_one = test::run(1, deck("tp2_to_one"),
                                {kv1, "--checkpoint.resume=" + tmp + "/tp2/step_00000010.h5"},
                                tmp + "/tp2_to_one.jsonl");
  ASSERT_EQ(to_one.exit_code, 0) << to_one.error;
  EXPECT_LT(test::worst_loss_diff("tp 2 checkpoint (shared kv head) on one GPU", to_one, ref, 11),
            test::kShardedTol);
  if (test::world_rank() == 0) std::filesystem::remove_all(tmp);
}

}  // namespace
}  // namespace qt
