// The CPU reference back end: Qwen3Model (fp32, BLAS) and AdamW over MPI.
#include <algorithm>
#include <vector>

#include "model/qwen3.h"
#include "qtrain/error.h"
#include "train/backend.h"

namespace qt {

namespace {

class CpuBackend final : public TrainBackend {
 public:
  CpuBackend(const Deck& deck, Mesh& mesh)
      : model_(deck.model, deck.train.micro_batch, deck.train.seq_len, deck.train.recompute),
        optim_(deck.optim, model_.layout(), mesh.dp(), deck.train.steps),
        params_(optim_.padded_numel(), 0.0f),
        grads_(optim_.padded_numel(), 0.0f) {}

  const ParamLayout& layout() const override { return model_.layout(); }
  std::string describe() const override { return "cpu: fp32 reference (OpenBLAS)"; }
  float* host_params() override { return params_.data(); }
  MomentShard host_moments() override { return optim_.moments(); }
  void push_state() override {}  // the host buffers are the live state
  void pull_state() override {}
  void zero_grads() override { std::fill(grads_.begin(), grads_.end(), 0.0f); }
  double micro_step(const std::int32_t* inputs, const std::int32_t* targets,
                    float loss_scale) override {
    const double loss = model_.forward(params_.data(), inputs, targets);
    model_.backward(params_.data(), grads_.data(), loss_scale);
    return loss;
  }
  OptimStepStats optimizer_step(std::int64_t step) override {
    return optim_.step(params_.data(), grads_.data(), step);
  }

 private:
  Qwen3Model model_;
  AdamW optim_;
  std::vector<float> params_, grads_;  // [padded numel]
};

}  // namespace

std::unique_ptr<TrainBackend> make_cpu_backend(const Deck& deck, Mesh& mesh) {
  return std::make_unique<CpuBackend>(deck, mesh);
}

#ifndef QTRAIN_HAVE_CUDA
std::unique_ptr<TrainBackend> make_cuda_backend(const Deck&, Mesh&) {
  fail_user("train.device = cuda, but this qtrain was built without the CUDA back end; build it "
            "with `cmake --preset cuda` (needs CUDA 13 and NCCL)");
}
#endif

}  // namespace qt
