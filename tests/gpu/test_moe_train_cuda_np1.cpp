// Qwen3-MoE trainings on the GPU (train.device = cuda) against the CPU reference: a small model
// with two sparse layers around a dense one follows the CPU's losses and load-balancing losses,
// reports every sparse layer's expert load, and gives the same bits with activation recompute
// (whose second forward must not count the load statistics again). One rank, one GPU.
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

constexpr int kSteps = 12;

std::string deck_text(const std::string& dir) {
  return "[model]\npreset = tiny\nvocab_size = 256\nhidden_size = 128\nintermediate_size = 256\n"
         "num_layers = 3\nnum_heads = 4\nnum_kv_heads = 2\nhead_dim = 64\n"
         "num_experts = 8\nnum_experts_per_tok = 2\nmoe_intermediate_size = 64\n"
         "mlp_only_layers = 1\nrouter_aux_loss_coef = 0.01\n"
         "[train]\nseq_len = 64\nmicro_batch = 2\nglobal_batch = 8\nsteps = " +
         std::to_string(kSteps) + "\nseed = 5\n"
         "[optim]\nlr = 3e-3\nmin_lr = 3e-4\nwarmup_steps = 3\n"
         "[data]\nsource = synthetic\n"
         "[checkpoint]\ndir = " + dir + "\nevery = 1000\nresume = none\n"
         "[log]\nevery = 1\n";
}

struct MoeStep {
  double loss, aux;
  std::vector<std::vector<double>> tokens;  // [sparse layers][E]
};

std::vector<MoeStep> read_moe_metrics(const std::string& path) {
  std::vector<MoeStep> out;
  std::ifstream f(path);
  std::string line;
  while (std::getline(f, line)) {
    const auto j = nlohmann::json::parse(line);
    MoeStep s{j["loss"].get<double>(), j.value("aux_loss", -1.0), {}};
    if (j.contains("expert_tokens"))
      s.tokens = j["expert_tokens"].get<std::vector<std::vector<double>>>();
    out.push_back(s);
  }
  return out;
}

TEST(MoeTrainCuda, FollowsTheCpuReferenceWithAndWithoutRecompute) {
  QT_REQUIRE_GPU();
  const std::string tmp = test::shared_temp_dir("moe-cuda-train");
  std::printf("deck seed 5 (fixed: the data and initialisation)\n");
  auto cpu = test::run(1, deck_text(tmp + "/cpu"), {"--train.device=cpu"}, tmp + "/cpu.jsonl");
  auto gpu = test::run(1, deck_text(tmp + "/gpu"), {"--train.device=cuda"}, tmp + "/gpu.jsonl");
  auto rec = test::run(1, deck_text(tmp + "/rec"), {"--train.device=cuda", "--train.recompute=true"},
                       tmp + "/rec.jsonl");
  ASSERT_EQ(cpu.exit_code, 0) << cpu.error;
  ASSERT_EQ(gpu.exit_code, 0) << gpu.error;
  ASSERT_EQ(rec.exit_code, 0) << rec.error;
  const auto c = read_moe_metrics(tmp + "/cpu.jsonl"), g = read_moe_metrics(tmp + "/gpu.jsonl");
  const auto r = read_moe_metrics(tmp + "/rec.jsonl");
  ASSERT_EQ(c.size(), static_cast<std::size_t>(kSteps));
  ASSERT_EQ(g.size(), c.size());
  ASSERT_EQ(r.size(), c.size());
  double worst_loss = 0, worst_aux = 0;
  for (std::size_t i = 0; i < c.size(); ++i) {
    ASSERT_TRUE(std::isfinite(g[i].loss) && std::isfinite(g[i].aux)) << "step " << i + 1;
    ASSERT_GT(g[i].aux, 0) << "step " << i + 1;
    worst_loss = std::max(worst_loss, std::abs(g[i].loss - c[i].loss) / c[i].loss);
    worst_aux = std::max(worst_aux, std::abs(g[i].aux - c[i].aux) / c[i].aux);
    // Every sparse layer's load: the step's token-slots, 8 x 64 tokens x 2 slots.
    ASSERT_EQ(g[i].tokens.size(), 2u) << "step " << i + 1;
    for (const auto& layer : g[i].tokens) {
      double sum = 0;
      for (double t : layer) sum += t;
      EXPECT_EQ(sum, 8.0 * 64 * 2) << "step " << i + 1;
    }
    // Recompute: the same bits, the statistics counted once.
    EXPECT_EQ(r[i].loss, g[i].loss) << "step " << i + 1;
    EXPECT_EQ(r[i].aux, g[i].aux) << "step " << i + 1;
    EXPECT_EQ(r[i].tokens, g[i].tokens) << "step " << i + 1;
  }
  std::printf("loss: cpu %.5f -> %.5f, cuda %.5f -> %.5f, worst relative difference %.3e; aux "
              "cpu %.5f cuda %.5f, worst %.3e\n",
              c.front().loss, c.back().loss, g.front().loss, g.back().loss, worst_loss,
              c.back().aux, g.back().aux, worst_aux);
  EXPECT_LT(worst_loss, 2e-2);
  EXPECT_LT(worst_aux, 2e-2);
  EXPECT_LT(g.back().loss, g.front().loss - 0.3);
  std::filesystem::remove_all(tmp);
}

}  // namespace
}  // namespace qt
