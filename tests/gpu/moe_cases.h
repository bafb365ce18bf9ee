// The Qwen3-MoE GPU training tests' model and metrics (test_moe_train_cuda_np1/np2): a small
// model with two sparse layers (8 experts, 2 a token) around a dense one, on cuda unless
// overridden, and each logged step's loss, load-balancing loss and expert load.
#pragma once

#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace qt::test {

inline std::string moe_deck(const std::string& dir, int steps) {
  return "[model]\npreset = tiny\nvocab_size = 256\nhidden_size = 128\nintermediate_size = 256\n"
         "num_layers = 3\nnum_heads = 4\nnum_kv_heads = 2\nhead_dim = 64\n"
         "num_experts = 8\nnum_experts_per_tok = 2\nmoe_intermediate_size = 64\n"
         "mlp_only_layers = 1\nrouter_aux_loss_coef = 0.01\n"
         "[train]\nseq_len = 64\nmicro_batch = 2\nglobal_batch = 8\nsteps = " +
         std::to_string(steps) +
         "\nseed = 5\ndevice = cuda\n"
         "[optim]\nlr = 3e-3\nmin_lr = 3e-4\nwarmup_steps = 3\n"
         "[data]\nsource = synthetic\n"
         "[checkpoint]\ndir = " +
         dir +
         "\nevery = -1\nresume = none\n"
         "[log]\nevery = 1\n";
}

struct MoeStep {
  double loss, aux;
  std::vector<std::vector<double>> tokens;  // [sparse layers][E]
};

// Each logged step of a metrics file (aux -1 where it has none).
inline std::vector<MoeStep> read_moe_metrics(const std::string& path) {
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

}  // namespace qt::test
