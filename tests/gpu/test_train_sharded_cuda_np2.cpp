// ZeRO-2/3 and offload on two GPUs (issue 16): gathers and reduce-scatters over NCCL reproduce
// one GPU's ZeRO-0 losses (bf16 tolerance), with recompute and untied embeddings too, and a
// ZeRO-3 checkpoint of two GPUs continues on one. Skips unless two GPUs are visible.
#include <filesystem>

#include "gpu_test.h"
#include "sharded_cases.h"

namespace qt {
namespace {

TEST(TrainShardedCudaDp2, StagesAndOffloadMatchOneGpu) {
  if (const int gpus = test::visible_gpus(); gpus < 2) GTEST_SKIP() << "needs 2 GPUs, found " << gpus;
  ASSERT_EQ(test::world_size(), 2);
  const std::string tmp = test::shared_temp_dir("cuda-sharded2");
  auto deck = [&](const std::string& d) { return test::sharded_deck(tmp + "/" + d); };
  // untied: against ref_untied (vocabulary 256: 2 x 256 tokens outnumber its rows, so the
  // embedding's gradient is reduce-scattered whole); rows: vocabulary 1024, the untied
  // embedding's gradient taken as the micro-batch's rows (EmbeddingRows).
  enum Ref { kTied, kUntied, kRows };
  struct Case {
    const char* name;
    std::vector<std::string> overrides;
    Ref ref;
  };
  const std::vector<std::string> rows = {"--model.tie_word_embeddings=false",
                                         "--model.vocab_size=1024"};
  const auto ref = test::run(1, deck("one"), {}, tmp + "/one.jsonl");
  const auto ref_untied = test::run(1, deck("one_untied"), {"--model.tie_word_embeddings=false"},
                                    tmp + "/one_untied.jsonl");
  ASSERT_EQ(ref.exit_code, 0) << ref.error;
  const auto ref_rows = test::run(1, deck("one_rows"), rows, tmp + "/one_rows.jsonl");
  ASSERT_EQ(ref_untied.exit_code, 0) << ref_untied.error;
  ASSERT_EQ(ref_rows.exit_code, 0) << ref_rows.error;
  auto with_rows = [&](std::vector<std::string> o) {
    o.insert(o.end(), rows.begin(), rows.end());
    return o;
  };
  for (const Case& c :
       {Case{"z2", {"--optim.zero_stage=2"}, kTied},
        Case{"z3", {"--optim.zero_stage=3"}, kTied},
        Case{"z3_offload", {"--optim.zero_stage=3", "--optim.offload=cpu"}, kTied},
        Case{"z2_offload", {"--optim.zero_stage=2", "--optim.offload=cpu"}, kTied},
        Case{"z3_recompute_micro1",
             {"--optim.zero_stage=3", "--train.recompute=true", "--train.micro_batch=1"}, kTied},
        Case{"z3_untied", {"--optim.zero_stage=3", "--model.tie_word_embeddings=false"}, kUntied},
        Case{"z2_rows", with_rows({"--optim.zero_stage=2"}), kRows},
        Case{"z3_rows_micro1", with_rows({"--optim.zero_stage=3", "--train.micro_batch=1"}), kRows},
        Case{"z3_rows_offload", with_rows({"--optim.zero_stage=3", "--optim.offload=cpu"}),
             kRows}}) {
    SCOPED_TRACE(c.name);
    const auto r = test::run(2, deck(c.name), c.overrides, tmp + "/" + c.name + ".jsonl");
    test::expect_matches(c.name, r, c.ref == kTied ? ref : c.ref == kUntied ? ref_untied : ref_rows);
  }
  const auto at1 = test::run(1, deck("z3_to_one"),
                             {"--checkpoint.resume=" + tmp + "/z3/step_00000010.h5"},
                             tmp + "/z3_to_one.jsonl");
  ASSERT_EQ(at1.exit_code, 0) << at1.error;
  EXPECT_LT(test::worst_loss_diff("dp 2 ZeRO-3 checkpoint resumed on one GPU", at1, ref, 11),
            test::kShardedTol);
  if (test::world_rank() == 0) std::filesystem::remove_all(tmp);
}

}  // namespace
}  // namespace qt
