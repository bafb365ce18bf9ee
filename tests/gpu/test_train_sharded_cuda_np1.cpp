// ZeRO-2/3 and offload on one GPU (issue 16): the sharded back end (src/cuda/
// backend_cuda_sharded.cpp; at dp 1 nothing is gathered or reduced, the host AdamW of offload
// runs) reproduces the flat ZeRO-0 back end's losses, and its checkpoints load in the other.
#include <cuda_runtime_api.h>

#include <filesystem>

#include "gpu_test.h"
#include "sharded_cases.h"

namespace qt {
namespace {

TEST(TrainShardedCuda, OneGpuStagesAndOffloadMatchZero0) {
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus < 1) {
    cudaGetLastError();
    GTEST_SKIP() << "needs a GPU";
  }
  const std::string tmp = test::shared_temp_dir("cuda-sharded1");
  auto deck = [&](const std::string& d) { return test::sharded_deck(tmp + "/" + d); };
  const auto ref = test::run(1, deck("z0"), {}, tmp + "/z0.jsonl");
  ASSERT_EQ(ref.exit_code, 0) << ref.error;
  ASSERT_EQ(ref.steps.size(), 20u);
  struct Case {
    const char* name;
    std::vector<std::string> overrides;
  };
  for (const Case& c : {Case{"z2", {"--optim.zero_stage=2"}},
                        Case{"z3", {"--optim.zero_stage=3"}},
                        Case{"z3_offload", {"--optim.zero_stage=3", "--optim.offload=cpu"}},
                        Case{"z3_recompute", {"--optim.zero_stage=3", "--train.recompute=true"}}}) {
    SCOPED_TRACE(c.name);
    const auto r = test::run(1, deck(c.name), c.overrides, tmp + "/" + c.name + ".jsonl");
    ASSERT_EQ(r.exit_code, 0) << r.error;
    ASSERT_EQ(r.steps.size(), 20u);
    EXPECT_LT(test::worst_loss_diff(c.name, r, ref), test::kShardedTol);
    EXPECT_LT(test::worst_norm_diff(c.name, r, ref), test::kShardedNormTol);
  }
  // A checkpoint of the offloaded run at step 10 continues in the flat back end, and back.
  const auto flat = test::run(1, deck("from_offload"),
                              {"--checkpoint.resume=" + tmp + "/z3_offload/step_00000010.h5"},
                              tmp + "/from_offload.jsonl");
  ASSERT_EQ(flat.exit_code, 0) << flat.error;
  EXPECT_LT(test::worst_loss_diff("offload checkpoint resumed at ZeRO-0", flat, ref, 11),
            test::kShardedTol);
  const auto back = test::run(1, deck("from_flat"),
                              {"--checkpoint.resume=" + tmp + "/z0/step_00000010.h5",
                               "--optim.zero_stage=3", "--optim.offload=cpu"},
                              tmp + "/from_flat.jsonl");
  ASSERT_EQ(back.exit_code, 0) << back.error;
  EXPECT_LT(test::worst_loss_diff("ZeRO-0 checkpoint resumed with offload", back, ref, 11),
            test::kShardedTol);
  if (test::world_rank() == 0) std::filesystem::remove_all(tmp);
}

}  // namespace
}  // namespace qt
