// LoRA in a pipeline on two GPUs (issue 17): two stages, each holding the bf16 base of its own
// layers and training their adapters (backend_cuda_pipeline.cpp), reproduce one GPU's LoRA losses
// and first gradient norms (bf16 tolerance), dropout on: 1F1B, recompute, interleaved 1F1B and
// ZB-H1; a pp 2 checkpoint (global PEFT tensors) continues on one GPU as the one-GPU run does,
// and the reverse. Skips unless two GPUs are visible.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "gpu_test.h"
#include "lora_cases.h"
#include "sharded_cases.h"
#include "train/training_harness.h"

namespace qt {
namespace {

TEST(LoraTrainPipelineCuda, Pp2MatchesOneGpu) {
  if (const int gpus = test::visible_gpus(); gpus < 2)
    GTEST_SKIP() << "needs 2 GPUs, found " << gpus;
  ASSERT_EQ(test::world_size(), 2);
  const std::string tmp = test::shared_temp_dir("cuda-lora-pp2");
  auto one = test::run(1, test::lora_deck(tmp + "/one", 4, 8), {}, tmp + "/one.jsonl");
  ASSERT_EQ(one.exit_code, 0) << one.error;
  ASSERT_EQ(one.steps.size(), 16u);
  struct Case {
    const char* name;
    std::vector<std::string> overrides;
  };
  for (const Case& c :
       {Case{"pp2", {"--mesh.pp=2"}},
        Case{"pp2_recompute", {"--mesh.pp=2", "--train.recompute=true"}},
        // chunks 0 and 2 on stage 0, 1 and 3 on stage 1: two adapter ranges a stage
        Case{"pp2_v2", {"--mesh.pp=2", "--mesh.pp_chunks=2"}},
        // no base weight gradients: the weight halves are empty
        Case{"pp2_zb", {"--mesh.pp=2", "--mesh.pp_schedule=zb-h1"}},
        Case{"pp2_layers_3_1", {"--mesh.pp=2", "--mesh.pp_layers=3,1"}}}) {
    SCOPED_TRACE(c.name);
    const auto r = test::run(2, test::lora_deck(tmp + "/" + c.name, 4, 8), c.overrides,
                             tmp + "/" + c.name + ".jsonl");
    ASSERT_EQ(r.exit_code, 0) << r.error;
    ASSERT_EQ(r.steps.size(), 16u);
    const test::LoraDiffs d = test::lora_diffs(r, one);
    if (test::world_rank() == 0)
      std::printf("LoRA %s vs 1 GPU: worst relative loss difference %.3e, gradient norm (steps "
                  "1-3) %.3e\n", c.name, d.loss, d.norm);
    EXPECT_LT(d.loss, test::kShardedTol);
    EXPECT_LT(d.norm, 2e-2);
  }
  // Checkpoints hold the global adapters: one GPU continues pp 2's from step 9 as its own run
  // goes on, and pp 2 continues one GPU's.
  struct Resume {
    const char* name;
    const char* from;  // the run whose step 8 is resumed
    int ranks;
    std::vector<std::string> overrides;
  };
  for (const Resume& c : {Resume{"pp2_to_one", "pp2", 1, {}},
                          Resume{"pp2_v2_to_one", "pp2_v2", 1, {}},
                          Resume{"one_to_pp2", "one", 2, {"--mesh.pp=2"}}}) {
    SCOPED_TRACE(c.name);
    std::vector<std::string> ov = c.overrides;
    ov.push_back("--checkpoint.resume=" + tmp + "/" + c.from + "/step_00000008.h5");
    const auto r = test::run(c.ranks, test::lora_deck(tmp + "/" + c.name, 4, 8), ov,
                             tmp + "/" + c.name + ".jsonl");
    ASSERT_EQ(r.exit_code, 0) << r.error;
    ASSERT_EQ(r.steps.size(), 8u);
    EXPECT_EQ(r.steps.front().step, 9);
    const test::LoraDiffs d = test::lora_diffs(r, one, 9);
    if (test::world_rank() == 0)
      std::printf("LoRA %s (step 8 resumed): worst relative loss difference %.3e\n", c.name,
                  d.loss);
    EXPECT_LT(d.loss, test::kShardedTol);
  }
  if (test::world_rank() == 0) std::filesystem::remove_all(tmp);
}

}  // namespace
}  // namespace qt
