// A step of a training back end driven by hand, for the LoRA tests that check the frozen base
// bit for bit (test_lora_train.cpp, test_moe_lora_train.cpp): each rank samples its `local`
// sequences from `first`, the batch's counted tokens are summed over `world`, and the
// micro-batches of B run with the loss scale 1 / counted. The caller runs the optimizer step.
#pragma once

#include <cstdint>
#include <vector>

#include "qtrain/comm.h"
#include "qtrain/data.h"
#include "train/backend.h"

namespace qt::test {

struct BackendStep {
  double loss = 0;           // this rank's summed (counted) loss
  std::int64_t counted = 0;  // the batch's counted tokens over all ranks
};

inline BackendStep backend_step(TrainBackend& be, DataSource& data, Comm& world,
                                std::int64_t first, int local, int B, int T) {
  std::vector<std::int32_t> in(static_cast<std::size_t>(local) * T), tg(in.size());
  for (int s = 0; s < local; ++s) data.sample(first + s, &in[s * T], &tg[s * T], nullptr, T);
  BackendStep r;
  for (auto t : tg) r.counted += t != -100;
  r.counted = world.sum(r.counted);
  be.zero_grads();
  for (int m = 0; m < local / B; ++m) {
    be.set_first_sample(first + m * B);
    r.loss += be.micro_step(&in[m * B * T], &tg[m * B * T], nullptr,
                            1.0f / static_cast<float>(r.counted));
  }
  return r;
}

}  // namespace qt::test
