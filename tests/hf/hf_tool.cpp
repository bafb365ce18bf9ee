// Helper for tests/reference/hf_export_check.py (run on the GPU machine, where transformers is):
//   qtrain_hf_tool logits <hf_dir> <input.safetensors> <output.safetensors>
//       imports <hf_dir> as `[model] init` does (dense or Qwen3-MoE), runs the CPU engine (fp32)
//       on "input_ids" (I64 or I32 [B, T]) and writes "logits" (F32 [B, T, V]) and "loss" (F32
//       scalar: mean cross-entropy of each token predicting the next, transformers' labels =
//       input_ids; a MoE model's load-balancing loss is not in it, as transformers' default).
//   qtrain_hf_tool lora-logits <checkpoint.h5> <input.safetensors> <output.safetensors>
//       the same for a LoRA run's checkpoint: its base (model.init or seed) with its adapters
//       applied (dropout off, as peft in eval mode); tests/reference/lora_peft_check.py
//   qtrain_hf_tool export <checkpoint.h5> <dir> [options]     same as `qtrain export`
#include <mpi.h>

#include <cstdio>
#include <cstring>
#include <memory>
#include <vector>

#include "hf/config.h"
#include "hf/export.h"
#include "hf/lora_export.h"
#include "hf/safetensors.h"
#include "hf/weights.h"
#include "model/lora.h"
#include "model/qwen3.h"
#include "qtrain/comm.h"
#include "qtrain/error.h"

namespace {

// "input_ids" (I64 or I32 [B, T]) of `input`, and transformers' labels: each token predicts the
// next, the last of each row is not counted.
struct Ids {
  int B = 0, T = 0;
  long counted = 0;
  std::vector<std::int32_t> ids, targets;
};

Ids read_ids(const char* input, int vocab) {
  using namespace qt::hf;
  SafetensorsFile in(input);
  const StTensor* t = in.find("input_ids");
  if (!t || t->shape.size() != 2 || (t->dtype != StDType::kI64 && t->dtype != StDType::kI32))
    qt::fail_user("{}: needs \"input_ids\", I64 or I32 [B, T]", input);
  Ids r;
  r.B = static_cast<int>(t->shape[0]), r.T = static_cast<int>(t->shape[1]);
  r.ids.resize(static_cast<std::size_t>(r.B) * r.T);
  r.targets.assign(r.ids.size(), -100);
  for (std::size_t i = 0; i < r.ids.size(); ++i) {
    std::int64_t v = 0;
    std::memcpy(&v, in.bytes(*t) + i * qt::hf::st_dtype_size(t->dtype), qt::hf::st_dtype_size(t->dtype));
    if (t->dtype == StDType::kI32) v = static_cast<std::int32_t>(v);
    if (v < 0 || v >= vocab) qt::fail_user("{}: input id {} out of range", input, v);
    r.ids[i] = static_cast<std::int32_t>(v);
  }
  for (int b = 0; b < r.B; ++b)
    for (int s = 0; s + 1 < r.T; ++s, ++r.counted) r.targets[b * r.T + s] = r.ids[b * r.T + s + 1];
  return r;
}

// Runs `model` (with whatever adapters it has) and writes "logits" and "loss".
int forward_and_write(qt::Qwen3Model& model, const float* params, const Ids& in, const char* output) {
  using namespace qt::hf;
  const int V = model.config().vocab_size;
  const float loss = static_cast<float>(
      model.forward(params, in.ids.data(), in.targets.data()) / in.counted);
  write_safetensors(output,
                    {{"logits", StDType::kF32, {in.B, in.T, V}, nullptr, model.logits()},
                     {"loss", StDType::kF32, {}, nullptr, &loss}},
                    {{"format", "pt"}});
  std::printf("wrote %s: logits [%d, %d, %d], loss %.7f\n", output, in.B, in.T, V, loss);
  return 0;
}

int logits_main(const char* dir, const char* input, const char* output, qt::Comm& world) {
  using namespace qt::hf;
  const qt::ModelConfig cfg = read_config(dir);
  const qt::ParamLayout layout(cfg);
  std::vector<float> params(layout.numel());
  std::printf("loaded %s\n",
              load_params(dir, layout, all_rows(layout, params.data()), cfg.tie_word_embeddings, world).c_str());
  const Ids in = read_ids(input, cfg.vocab_size);
  qt::Qwen3Model model(cfg, in.B, in.T, false);
  return forward_and_write(model, params.data(), in, output);
}

int lora_logits_main(const char* ckpt, const char* input, const char* output,
                     std::shared_ptr<qt::MpiComm> world) {
  using namespace qt::hf;
  CheckpointModel cm = read_checkpoint_model(ckpt);
  if (!cm.lora) qt::fail_user("{} is not a LoRA run's checkpoint", ckpt);
  cm.init_found = find_init_dir(cm, "");  // the base where the checkpoint says, as export finds it
  const qt::ParamLayout layout(cm.cfg);
  std::vector<float> params(layout.numel());
  load_lora_base(ckpt, cm, layout, params.data(), *world);
  const std::vector<float> adapters = read_lora_adapters(ckpt, cm, world);
  std::printf("loaded %s: LoRA r %d, alpha %g, targets %s on the base %s\n", ckpt,
              cm.lora->config.r, cm.lora->config.alpha, cm.lora->config.targets.c_str(),
              cm.lora->base.describe().c_str());
  const Ids in = read_ids(input, cm.cfg.vocab_size);
  qt::LoraConfig eval = cm.lora->config;
  eval.dropout = 0;  // inference, as peft in eval mode
  qt::Qwen3Model model(cm.cfg, in.B, in.T, false);
  qt::LoraAdapters lora(cm.cfg, eval, in.B, in.T);
  model.set_lora(&lora);
  lora.bind(adapters.data(), nullptr);
  return forward_and_write(model, params.data(), in, output);
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rc = 0;
  {
    auto world = std::make_shared<qt::MpiComm>(MPI_COMM_WORLD, "world", false);
    if (argc >= 2 && std::strcmp(argv[1], "export") == 0) {
      rc = qt::export_main(argc - 1, argv + 1, world);
    } else if (argc == 5 && (std::strcmp(argv[1], "logits") == 0 ||
                             std::strcmp(argv[1], "lora-logits") == 0)) {
      try {
        rc = std::strcmp(argv[1], "logits") == 0
                 ? logits_main(argv[2], argv[3], argv[4], *world)
                 : lora_logits_main(argv[2], argv[3], argv[4], world);
      } catch (const qt::UserError& e) {
        std::fprintf(stderr, "qtrain_hf_tool: error: %s\n", e.what());
        rc = qt::kExitBadInput;
      }
    } else {
      std::fprintf(stderr,
                   "usage: qtrain_hf_tool logits <hf_dir> <input.safetensors> <output.safetensors>\n"
                   "       qtrain_hf_tool lora-logits <checkpoint.h5> <input.safetensors> <output.safetensors>\n"
                   "       qtrain_hf_tool export <checkpoint.h5> <dir> [options]\n");
      rc = 64;
    }
  }
  MPI_Finalize();
  return rc;
}
