// Training on the synthetic Markov data gets within 5% of its known loss floor (entropy rate).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>

#include "qtrain/data.h"
#include "training_harness.h"

namespace qt {
namespace {

TEST(Learning, SyntheticTrainingReachesTheLossFloor) {
  const std::string dir = test::shared_temp_dir("learn");
  const std::string deck =
      "[model]\npreset = tiny\nvocab_size = 64\n"
      "[train]\nseq_len = 32\nmicro_batch = 8\nglobal_batch = 16\nsteps = 300\nseed = 7\n"
      "[optim]\nlr = 1e-2\nmin_lr = 1e-3\nwarmup_steps = 20\nweight_decay = 0.0\n"
      "[data]\nsource = synthetic\nsynthetic_branching = 4\n"
      "[checkpoint]\ndir = " + dir + "/ckpt\nevery = 0\nresume = none\n"
      "[log]\nevery = 1\n";
  const int ranks = std::min(2, test::world_size());
  auto res = test::run(ranks, deck, {}, dir + "/metrics.jsonl");
  ASSERT_EQ(res.exit_code, 0) << res.error;
  ASSERT_EQ(res.steps.size(), 300u);
  const double floor = make_data_source(parse_deck_text(deck, "learn.ini", {}, ranks))->loss_floor();
  ASSERT_TRUE(std::isfinite(floor));
  ASSERT_GT(floor, 0.5);  // a non-trivial chain
  double last = 0;
  for (std::size_t i = res.steps.size() - 20; i < res.steps.size(); ++i) last += res.steps[i].loss / 20;
  if (test::world_rank() == 0)
    std::printf("loss floor %.4f, mean loss of the last 20 steps %.4f (%.2f%% above)\n", floor, last,
                100 * (last / floor - 1));
  EXPECT_GT(last, floor * 0.97);  // cannot beat the entropy rate (up to sampling noise)
  EXPECT_LT(last, floor * 1.05);
  MPI_Barrier(MPI_COMM_WORLD);
  if (test::world_rank() == 0) std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace qt
