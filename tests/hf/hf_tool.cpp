// Helper for tests/reference/hf_export_check.py (run on the GPU machine, where transformers is):
//   qtrain_hf_tool logits <hf_dir> <input.safetensors> <output.safetensors>
//       imports <hf_dir> as `[model] init` does, runs the CPU engine (fp32) on "input_ids"
//       (I64 or I32 [B, T]) and writes "logits" (F32 [B, T, V]) and "loss" (F32 scalar: mean
//       cross-entropy of each token predicting the next, transformers' labels = input_ids).
//   qtrain_hf_tool export <checkpoint.h5> <dir> [options]     same as `qtrain export`
#include <mpi.h>

#include <cstdio>
#include <cstring>
#include <memory>
#include <vector>

#include "hf/config.h"
#include "hf/export.h"
#include "hf/safetensors.h"
#include "hf/weights.h"
#include "model/qwen3.h"
#include "qtrain/comm.h"
#include "qtrain/error.h"

namespace {

int logits_main(const char* dir, const char* input, const char* output, qt::Comm& world) {
  using namespace qt::hf;
  const qt::ModelConfig cfg = read_config(dir);
  const qt::ParamLayout layout(cfg);
  std::vector<float> params(layout.numel());
  std::printf("loaded %s\n",
              load_params(dir, layout, all_rows(layout, params.data()), cfg.tie_word_embeddings, world).c_str());
  SafetensorsFile in(input);
  const StTensor* t = in.find("input_ids");
  if (!t || t->shape.size() != 2 || (t->dtype != StDType::kI64 && t->dtype != StDType::kI32))
    qt::fail_user("{}: needs \"input_ids\", I64 or I32 [B, T]", input);
  const int B = static_cast<int>(t->shape[0]), T = static_cast<int>(t->shape[1]);
  std::vector<std::int32_t> ids(static_cast<std::size_t>(B) * T), targets(ids.size(), -100);
  for (std::size_t i = 0; i < ids.size(); ++i) {
    std::int64_t v = 0;
    std::memcpy(&v, in.bytes(*t) + i * qt::hf::st_dtype_size(t->dtype), qt::hf::st_dtype_size(t->dtype));
    if (t->dtype == StDType::kI32) v = static_cast<std::int32_t>(v);
    if (v < 0 || v >= cfg.vocab_size) qt::fail_user("{}: input id {} out of range", input, v);
    ids[i] = static_cast<std::int32_t>(v);
  }
  long counted = 0;
  for (int b = 0; b < B; ++b)
    for (int s = 0; s + 1 < T; ++s, ++counted) targets[b * T + s] = ids[b * T + s + 1];
  qt::Qwen3Model model(cfg, B, T, false);
  const float loss = static_cast<float>(model.forward(params.data(), ids.data(), targets.data()) / counted);
  write_safetensors(output,
                    {{"logits", StDType::kF32, {B, T, cfg.vocab_size}, model.logits(), nullptr},
                     {"loss", StDType::kF32, {}, &loss, nullptr}},
                    {{"format", "pt"}});
  std::printf("wrote %s: logits [%d, %d, %d], loss %.7f\n", output, B, T, cfg.vocab_size, loss);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rc = 0;
  {
    auto world = std::make_shared<qt::MpiComm>(MPI_COMM_WORLD, "world", false);
    if (argc >= 2 && std::strcmp(argv[1], "export") == 0) {
      rc = qt::export_main(argc - 1, argv + 1, world);
    } else if (argc == 5 && std::strcmp(argv[1], "logits") == 0) {
      try {
        rc = logits_main(argv[2], argv[3], argv[4], *world);
      } catch (const qt::UserError& e) {
        std::fprintf(stderr, "qtrain_hf_tool: error: %s\n", e.what());
        rc = qt::kExitBadInput;
      }
    } else {
      std::fprintf(stderr,
                   "usage: qtrain_hf_tool logits <hf_dir> <input.safetensors> <output.safetensors>\n"
                   "       qtrain_hf_tool export <checkpoint.h5> <dir> [options]\n");
      rc = 64;
    }
  }
  MPI_Finalize();
  return rc;
}
