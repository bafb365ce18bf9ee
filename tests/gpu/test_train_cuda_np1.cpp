// Whole trainings on the GPU (train.device = cuda) against the CPU reference, and exact
// resumption on the GPU. One rank, one GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>

#include "gpu_test.h"
#include "train/training_harness.h"

namespace qt {
namespace {

std::string deck_text(const std::string& dir) {
  return "[model]\npreset = tiny\nvocab_size = 256\nhidden_size = 128\nintermediate_size = 256\n"
         "num_heads = 4\nnum_kv_heads = 2\nhead_dim = 64\n"
         "[train]\nseq_len = 128\nmicro_batch = 4\nglobal_batch = 8\nsteps = 30\nseed = 3\n"
         "[optim]\nlr = 3e-3\nmin_lr = 3e-4\nwarmup_steps = 5\n"
         "[data]\nsource = synthetic\n"
         "[checkpoint]\ndir = " + dir + "\nevery = 15\nresume = none\n"
         "[log]\nevery = 1\n";
}

TEST(TrainCuda, FollowsTheCpuReferenceAndResumesExactly) {
  QT_REQUIRE_GPU();
  const std::string tmp = test::shared_temp_dir("cuda-train");
  auto cpu = test::run(1, deck_text(tmp + "/cpu"), {"--train.device=cpu"}, tmp + "/cpu.jsonl");
  auto gpu = test::run(1, deck_text(tmp + "/gpu"), {"--train.device=cuda"}, tmp + "/gpu.jsonl");
  ASSERT_EQ(gpu.exit_code, 0) << gpu.error;
  ASSERT_EQ(cpu.steps.size(), 30u);
  ASSERT_EQ(gpu.steps.size(), 30u);
  double worst = 0;
  for (int i = 0; i < 30; ++i) {
    ASSERT_TRUE(std::isfinite(gpu.steps[i].loss));
    worst = std::max(worst, std::abs(gpu.steps[i].loss - cpu.steps[i].loss) / cpu.steps[i].loss);
  }
  std::printf("loss: cpu %.5f -> %.5f, cuda %.5f -> %.5f, worst relative difference %.3e\n",
              cpu.steps.front().loss, cpu.steps.back().loss, gpu.steps.front().loss,
              gpu.steps.back().loss, worst);
  EXPECT_LT(worst, 2e-2);
  EXPECT_LT(gpu.steps.back().loss, gpu.steps.front().loss - 0.5);

  // Stop at 15 and resume: the same bits as the uninterrupted GPU run.
  auto first = test::run(1, deck_text(tmp + "/split"), {"--train.device=cuda", "--train.stop_at=15"},
                         tmp + "/split.jsonl");
  ASSERT_EQ(first.steps.size(), 15u);
  auto rest = test::run(1, deck_text(tmp + "/split"),
                        {"--train.device=cuda", "--checkpoint.resume=auto"}, tmp + "/split.jsonl");
  ASSERT_EQ(rest.exit_code, 0) << rest.error;
  ASSERT_EQ(rest.steps.size(), 30u);
  for (int i = 15; i < 30; ++i) EXPECT_EQ(rest.steps[i].loss, gpu.steps[i].loss) << "step " << i + 1;

  // Activation recompute changes where activations live, not what is computed: the same bits.
  auto rec = test::run(1, deck_text(tmp + "/rec"), {"--train.device=cuda", "--train.recompute=true"},
                       tmp + "/rec.jsonl");
  ASSERT_EQ(rec.exit_code, 0) << rec.error;
  ASSERT_EQ(rec.steps.size(), 30u);
  for (int i = 0; i < 30; ++i) EXPECT_EQ(rec.steps[i].loss, gpu.steps[i].loss) << "step " << i + 1;
  std::filesystem::remove_all(tmp);
}

}  // namespace
}  // namespace qt
