// What the checkpoint tests (test_checkpoint.cpp, test_checkpoint_pieces.cpp) write and read.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <random>
#include <vector>

#include "qtrain/checkpoint.h"
#include "qtrain/model_config.h"
#include "support/mpi_world.h"
#include "support/random.h"

namespace qt::test {

// A model whose tensor sizes are not multiples of anything, so partitions cut rows mid-way.
inline ModelConfig odd_model() {
  ModelConfig m;
  m.preset = "custom";
  m.vocab_size = 37;
  m.hidden_size = 12;
  m.intermediate_size = 20;
  m.num_layers = 2;
  m.num_heads = 2;
  m.num_kv_heads = 1;
  m.head_dim = 6;
  m.tie_word_embeddings = false;
  m.rope_theta = 12345.5;
  return m;
}

inline TrainState some_state() {
  TrainState s;
  s.step = 17;
  s.samples_consumed = 1088;
  s.tokens_consumed = 69632;
  s.seed = 0xFEDCBA9876543210ull;
  s.rng_counter = 4242;
  return s;
}

// Rank 0's test seed (printed once), on every rank.
inline std::uint64_t shared_seed() {
  std::uint64_t seed = world_rank() == 0 ? test_seed() : 0;
  MPI_Bcast(&seed, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
  return seed;
}

// A whole trained state: parameters and both moments.
struct StateTensors {
  std::vector<float> params, exp_avg, exp_avg_sq;
  const std::vector<float>& group(int g) const {
    return g == 0 ? params : g == 1 ? exp_avg : exp_avg_sq;
  }
};

// Random values from `seed` (identical on every rank given the same seed); second moments >= 0.
inline StateTensors random_state(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  StateTensors s;
  s.params = random_vector<float>(n, rng, 0.5);
  s.exp_avg = random_vector<float>(n, rng, 1e-3);
  s.exp_avg_sq = random_vector<float>(n, rng, 1e-6);
  for (auto& x : s.exp_avg_sq) x = x * x;
  return s;
}

}  // namespace qt::test
