// Qwen3-MoE with data parallelism on two GPUs: dp = 2 at every ZeRO stage (the experts are
// ordinary parameters of the flat layout, sharded and reduced like the rest) reproduces one GPU's
// losses and load-balancing losses for the same global batch and micro-batch (the aux loss pools
// a micro-batch's tokens, so train.micro_batch stays 2). Skips unless two GPUs are visible.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "gpu_test.h"
#include "train/training_harness.h"

namespace qt {
namespace {

constexpr int kSteps = 10;

std::string deck_text(const std::string& dir) {
  return "[model]\npreset = tiny\nvocab_size = 256\nhidden_size = 128\nintermediate_size = 256\n"
         "num_layers = 3\nnum_heads = 4\nnum_kv_heads = 2\nhead_dim = 64\n"
         "num_experts = 8\nnum_experts_per_tok = 2\nmoe_intermediate_size = 64\n"
         "mlp_only_layers = 1\nrouter_aux_loss_coef = 0.01\n"
         "[train]\nseq_len = 64\nmicro_batch = 2\nglobal_batch = 8\nsteps = " +
         std::to_string(kSteps) + "\nseed = 5\ndevice = cuda\n"
         "[optim]\nlr = 3e-3\nmin_lr = 3e-4\nwarmup_steps = 3\n"
         "[data]\nsource = synthetic\n"
         "[checkpoint]\ndir = " + dir + "\nevery = -1\nresume = none\n"
         "[log]\nevery = 1\n";
}

// (loss, aux_loss) of each logged step.
std::vector<std::pair<double, double>> read_losses(const std::string& path) {
  std::vector<std::pair<double, double>> out;
  std::ifstream f(path);
  std::string line;
  while (std::getline(f, line)) {
    const auto j = nlohmann::json::parse(line);
    out.emplace_back(j["loss"].get<double>(), j.value("aux_loss", -1.0));
  }
  return out;
}

TEST(MoeTrainCudaDp2, ReproducesOneGpuAtEveryZeroStage) {
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus < 2) {
    cudaGetLastError();
    GTEST_SKIP() << "needs 2 GPUs, found " << gpus;
  }
  ASSERT_EQ(test::world_size(), 2);
  const std::string tmp = test::shared_temp_dir("moe-cuda-dp2");
  auto one = test::run(1, deck_text(tmp + "/one"), {}, tmp + "/one.jsonl");
  ASSERT_EQ(one.exit_code, 0) << one.error;
  const auto ref = read_losses(tmp + "/one.jsonl");
  ASSERT_EQ(ref.size(), static_cast<std::size_t>(kSteps));
  for (int zero = 0; zero <= 3; ++zero) {
    const std::string tag = "z" + std::to_string(zero);
    auto two = test::run(2, deck_text(tmp + "/" + tag), {"--optim.zero_stage=" + std::to_string(zero)},
                         tmp + "/" + tag + ".jsonl");
    ASSERT_EQ(two.exit_code, 0) << tag << ": " << two.error;
    const auto got = read_losses(tmp + "/" + tag + ".jsonl");
    ASSERT_EQ(got.size(), ref.size()) << tag;
    double worst = 0, worst_aux = 0;
    for (std::size_t i = 0; i < ref.size(); ++i) {
      ASSERT_TRUE(std::isfinite(got[i].first) && got[i].second > 0) << tag << " step " << i + 1;
      worst = std::max(worst, std::abs(got[i].first - ref[i].first) / ref[i].first);
      worst_aux = std::max(worst_aux, std::abs(got[i].second - ref[i].second) / ref[i].second);
    }
    if (test::world_rank() == 0)
      std::printf("dp 2 ZeRO-%d vs 1 GPU: worst relative loss difference %.3e, aux %.3e\n", zero,
                  worst, worst_aux);
    EXPECT_LT(worst, 5e-3) << tag;
    EXPECT_LT(worst_aux, 1e-2) << tag;
  }
  if (test::world_rank() == 0) std::filesystem::remove_all(tmp);
}

}  // namespace
}  // namespace qt
