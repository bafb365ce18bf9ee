// Numerical safety (issue 19) on two GPUs: a step whose gradients are NaN (on one rank, or all)
// is skipped on one GPU, at dp 2 with ZeRO-1, ZeRO-3 and offload, at tp 2 and pp 2, with the
// checkpointed state unchanged element for element (tests/train/skip_cases.h); two in a row with
// train.max_consecutive_skips = 2 stop the run with exit 3. Skips unless two GPUs are visible.
#include <filesystem>

#include "gpu_test.h"
#include "sharded_cases.h"
#include "train/skip_cases.h"

namespace qt {
namespace {

TEST(NumericalSafetyCuda, SkippedStepChangesNothingOnEveryMesh) {
  QT_REQUIRE_GPUS(2);
  ASSERT_EQ(test::world_size(), 2);
  const std::string tmp = test::shared_temp_dir("cuda-skip");
  const std::string deck = test::sharded_deck(tmp + "/unused");
  test::expect_skips_change_nothing(
      {{"one GPU", 1, {}, -1},
       {"dp2 ZeRO-1, rank 1 only", 2, {"--optim.zero_stage=1"}, 1},
       {"dp2 ZeRO-3, rank 0 only", 2, {"--optim.zero_stage=3"}, 0},
       {"dp2 ZeRO-3 offload", 2, {"--optim.zero_stage=3", "--optim.offload=cpu"}, 1},
       {"tp2", 2, {"--mesh.tp=2"}, 0},
       {"pp2", 2, {"--mesh.pp=2"}, 1}},
      deck, tmp);
  test::expect_stop_after_consecutive_skips("dp2 ZeRO-3 stop", 2, deck, {"--optim.zero_stage=3"},
                                            tmp + "/stop");
  if (test::world_rank() == 0) std::filesystem::remove_all(tmp);
}

}  // namespace
}  // namespace qt
