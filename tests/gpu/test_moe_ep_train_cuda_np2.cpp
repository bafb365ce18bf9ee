// Qwen3-MoE with expert parallelism on two GPUs (cuda_ops_moe_ep.cpp): ep 2 (dp 2, each rank 4 of
// the 8 experts of each sparse layer, its tokens' rows sent to their experts' rank and back) at
// ZeRO 0, 1 and 2, ZeRO-2 with offload and ZeRO-1 with recompute reproduces one GPU's losses,
// load-balancing losses and gradient norms for the same global batch and micro-batch, within
// bf16 tolerance (the experts' rows and the gradient sums come in another order); and the ep 2
// run's step-5 checkpoint (experts as global tensors) resumes on one GPU at ep 1 on the
// uninterrupted run's losses. Skips unless two GPUs are visible.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "gpu_test.h"
#include "moe_cases.h"
#include "train/training_harness.h"

namespace qt {
namespace {

constexpr int kSteps = 10;
constexpr double kLossTol = 1e-2, kAuxTol = 2e-2, kNormTol = 2e-2;  // relative, bf16 compute

struct EpRun {
  std::vector<test::MoeStep> moe;      // loss, aux
  std::vector<test::StepRecord> steps;  // step, loss, grad norm
};

EpRun train(int ranks, const std::string& tmp, const std::string& tag,
          std::vector<std::string> ov) {
  ov.push_back("--checkpoint.every=5");
  const std::string metrics = tmp + "/" + tag + ".jsonl";
  auto r = test::run(ranks, test::moe_deck(tmp + "/" + tag, kSteps), ov, metrics);
  EXPECT_EQ(r.exit_code, 0) << tag << ": " << r.error;
  return {test::read_moe_metrics(metrics), r.steps};
}

// The worst relative differences of `got` from `ref`'s steps [first, first + got's steps).
void expect_close(const EpRun& got, const EpRun& ref, std::size_t first, const std::string& tag) {
  ASSERT_EQ(got.moe.size(), got.steps.size()) << tag;
  ASSERT_EQ(first + got.moe.size(), ref.moe.size()) << tag;
  double loss = 0, aux = 0, norm = 0;
  for (std::size_t i = 0; i < got.moe.size(); ++i) {
    const test::MoeStep &g = got.moe[i], &r = ref.moe[first + i];
    ASSERT_EQ(got.steps[i].step, ref.steps[first + i].step) << tag;
    ASSERT_TRUE(std::isfinite(g.loss) && g.aux > 0 && std::isfinite(got.steps[i].grad_norm))
        << tag << " step " << got.steps[i].step;
    loss = std::max(loss, std::abs(g.loss - r.loss) / r.loss);
    aux = std::max(aux, std::abs(g.aux - r.aux) / r.aux);
    norm = std::max(norm, std::abs(got.steps[i].grad_norm - ref.steps[first + i].grad_norm) /
                              ref.steps[first + i].grad_norm);
  }
  if (test::world_rank() == 0)
    std::printf("%s vs 1 GPU: worst relative difference of the losses %.3e, aux losses %.3e, "
                "gradient norms %.3e\n",
                tag.c_str(), loss, aux, norm);
  EXPECT_LT(loss, kLossTol) << tag;
  EXPECT_LT(aux, kAuxTol) << tag;
  EXPECT_LT(norm, kNormTol) << tag;
}

TEST(MoeTrainCudaEp2, ReproducesOneGpuAndResumesAtEp1) {
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus < 2) {
    cudaGetLastError();
    GTEST_SKIP() << "needs 2 GPUs, found " << gpus;
  }
  ASSERT_EQ(test::world_size(), 2);
  const std::string tmp = test::shared_temp_dir("moe-cuda-ep2");
  const EpRun one = train(1, tmp, "one", {});
  ASSERT_EQ(one.moe.size(), static_cast<std::size_t>(kSteps));
  EXPECT_LT(one.moe.back().loss, one.moe.front().loss);  // it trains
  const std::vector<std::pair<std::string, std::vector<std::string>>> meshes = {
      {"ep2_z0", {"--optim.zero_stage=0"}},
      {"ep2_z1", {"--optim.zero_stage=1"}},
      {"ep2_z2", {"--optim.zero_stage=2"}},
      {"ep2_z2_offload", {"--optim.zero_stage=2", "--optim.offload=cpu"}},
      {"ep2_z1_recompute", {"--optim.zero_stage=1", "--train.recompute=true"}},
  };
  for (const auto& [tag, ov] : meshes) {
    std::vector<std::string> o = ov;
    o.push_back("--mesh.ep=2");
    expect_close(train(2, tmp, tag, o), one, 0, tag);
  }
  // ep 2's checkpoint holds every expert at its global row: it resumes on one GPU (ep 1).
  const std::string from = tmp + "/ep2_z1/step_00000005.h5";
  ASSERT_TRUE(std::filesystem::exists(from)) << from;
  const EpRun resumed = train(1, tmp, "ep1_resumed", {"--checkpoint.resume=" + from});
  ASSERT_EQ(resumed.moe.size(), 5u);
  EXPECT_EQ(resumed.steps.front().step, 6);
  expect_close(resumed, one, 5, "ep 2 checkpoint resumed at ep 1");
  MPI_Barrier(MPI_COMM_WORLD);
  if (test::world_rank() == 0) std::filesystem::remove_all(tmp);
}

}  // namespace
}  // namespace qt
