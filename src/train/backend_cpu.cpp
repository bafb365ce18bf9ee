// The CPU reference back end: Qwen3Model (fp32, BLAS) and AdamW over MPI. With [lora] the fp32
// base is frozen (no gradients, no moments) and AdamW trains the adapters' own flat buffer.
#include <fmt/format.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "model/lora.h"
#include "model/qwen3.h"
#include "qtrain/error.h"
#include "train/backend.h"

namespace qt {

namespace {

class CpuBackend final : public TrainBackend {
 public:
  CpuBackend(const Deck& deck, Mesh& mesh)
      : model_(deck.model, deck.train.micro_batch, deck.train.seq_len, deck.train.recompute),
        lora_(deck.lora.enabled() ? std::make_unique<LoraAdapters>(deck.model, deck.lora,
                                                                   deck.train.micro_batch,
                                                                   deck.train.seq_len)
                                  : nullptr),
        optim_(deck.optim, lora_ ? lora_->layout() : model_.layout(), mesh.dp(), deck.train.steps),
        params_(lora_ ? model_.layout().numel() : optim_.padded_numel(), 0.0f),
        grads_(optim_.padded_numel(), 0.0f),
        adapters_(lora_ ? optim_.padded_numel() : 0, 0.0f),
        seed_(deck.train.seed) {
    if (lora_) model_.set_lora(lora_.get());
  }

  const ParamLayout& layout() const override { return model_.layout(); }
  std::string describe() const override {
    if (!lora_) return "cpu: fp32 reference (OpenBLAS)";
    return fmt::format("cpu: fp32 reference (OpenBLAS); LoRA: fp32 base frozen (no gradients or "
                       "moments), {} adapter parameters trained",
                       lora_->layout().numel());
  }
  float* host_params() override { return params_.data(); }
  const ParamLayout& trained_layout() const override {
    return lora_ ? lora_->layout() : model_.layout();
  }
  float* host_trained() override { return lora_ ? adapters_.data() : params_.data(); }
  void set_first_sample(std::int64_t first) override { first_sample_ = first; }
  MomentShard host_moments() override { return optim_.moments(); }
  void push_state() override {}  // the host buffers are the live state
  void pull_state() override {}
  void zero_grads() override { std::fill(grads_.begin(), grads_.end(), 0.0f); }
  double micro_step(const std::int32_t* inputs, const std::int32_t* targets,
                    const std::int32_t* positions, float loss_scale) override {
    if (lora_) {
      lora_->bind(adapters_.data(), grads_.data());
      lora_->set_dropout_key(seed_, first_sample_);
    }
    const double loss = model_.forward(params_.data(), inputs, targets, positions);
    model_.backward(params_.data(), lora_ ? nullptr : grads_.data(), loss_scale);
    return loss;
  }
  OptimStepStats optimizer_step(std::int64_t step) override {
    return optim_.step(host_trained(), grads_.data(), step);
  }

 private:
  Qwen3Model model_;
  std::unique_ptr<LoraAdapters> lora_;  // null without [lora]
  AdamW optim_;                         // over trained_layout()
  std::vector<float> params_;           // the model: [padded numel], or [numel] when frozen
  std::vector<float> grads_;            // of the trained parameters: [padded trained numel]
  std::vector<float> adapters_;         // LoRA adapters: [padded trained numel], else empty
  std::uint64_t seed_;
  std::int64_t first_sample_ = 0;
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
