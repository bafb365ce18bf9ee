// Runs whole trainings in-process on sub-groups of MPI_COMM_WORLD, so one mpiexec can compare
// meshes of different sizes. Every world rank must call run() (it splits the world).
#pragma once

#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "qtrain/comm.h"
#include "qtrain/data.h"
#include "qtrain/deck.h"
#include "qtrain/error.h"
#include "qtrain/mesh.h"
#include "support/mpi_world.h"
#include "support/random.h"
#include "train/trainer.h"

namespace qt::test {

// Deck overrides: a's, then b's (a later one wins).
inline std::vector<std::string> with(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// A fresh training seed every run (printed; QT_TEST_SEED repeats one), the same on every rank.
inline std::uint64_t run_seed() {
  static const std::uint64_t seed = [] {
    std::uint64_t s = test_seed() % 1000000007;
    MPI_Bcast(&s, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
    if (world_rank() == 0)
      std::printf("train.seed = %llu (rank 0's QT_TEST_SEED mod 1000000007)\n",
                  static_cast<unsigned long long>(s));
    return s;
  }();
  return seed;
}

// Rank 0 writes a token file (qtrain/data.h) of n random tokens below `vocab`, about one in ten
// masked out of the loss, in documents of 5 to 44 tokens; every rank waits for it.
inline void write_random_tokens(const std::string& path, std::int64_t n, int vocab,
                                std::uint64_t seed) {
  if (world_rank() == 0) {
    std::mt19937_64 rng(seed);
    std::vector<std::int32_t> tokens(n);
    std::vector<std::uint8_t> mask(n);
    std::vector<std::int64_t> off = {0};
    for (std::int64_t i = 0; i < n; ++i) {
      tokens[i] = static_cast<std::int32_t>(rng() % vocab);
      mask[i] = rng() % 10 != 0;
    }
    while (off.back() < n) off.push_back(std::min<std::int64_t>(n, off.back() + 5 + rng() % 40));
    write_token_file(path, tokens, off, mask, vocab);
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

// The metrics file's lines of one kind ("eval", "samples"; "" for the step lines), in order.
inline std::vector<nlohmann::json> metrics_lines_of_kind(const std::string& path,
                                                         const std::string& kind) {
  std::vector<nlohmann::json> out;
  std::ifstream f(path);
  std::string line;
  while (std::getline(f, line)) {
    nlohmann::json j = nlohmann::json::parse(line);
    if (j.value("kind", "") == kind) out.push_back(j);
  }
  return out;
}

struct StepRecord {
  long step;
  double loss, grad_norm;
};

// A fresh directory, the same name on every rank.
inline std::string shared_temp_dir(const std::string& tag) {
  char buf[256] = {};
  if (world_rank() == 0) {
    std::string t = (std::filesystem::temp_directory_path() / ("qtrain-" + tag + "-XXXXXX")).string();
    std::snprintf(buf, sizeof buf, "%s", t.c_str());
    if (!mkdtemp(buf)) buf[0] = 0;
  }
  MPI_Bcast(buf, sizeof buf, MPI_CHAR, 0, MPI_COMM_WORLD);
  return buf;
}

inline std::vector<StepRecord> read_metrics(const std::string& path) {
  std::vector<StepRecord> out;
  std::ifstream f(path);
  std::string line;
  while (std::getline(f, line)) {
    auto j = nlohmann::json::parse(line);
    if (j.contains("kind")) continue;  // [eval]'s lines ("eval", "samples"): not a step's
    out.push_back({j["step"].get<long>(), j["loss"].is_null() ? NAN : j["loss"].get<double>(),
                   j["grad_norm"].is_null() ? NAN : j["grad_norm"].get<double>()});
  }
  return out;
}

// The largest |a - b| / |b| of the losses of two runs' steps; infinity when the runs' steps
// differ in number or step, none was logged, or a loss of `a` is not finite.
inline double max_rel_loss_diff(const std::vector<StepRecord>& a, const std::vector<StepRecord>& b) {
  if (a.size() != b.size() || a.empty()) return INFINITY;
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i].loss) || a[i].step != b[i].step) return INFINITY;
    worst = std::max(worst, std::abs(a[i].loss - b[i].loss) / std::abs(b[i].loss));
  }
  return worst;
}

struct RunResult {
  int exit_code = 0;          // run_training's code, 2 for UserError (same on every rank)
  std::string error;          // the UserError's message
  std::vector<StepRecord> steps;
};

// Trains with the first `ranks` ranks of the world on `deck_text` + overrides; the rest wait.
// The result (read from the metrics file) is returned on every rank.
inline RunResult run(int ranks, const std::string& deck_text,
                     const std::vector<std::string>& overrides, const std::string& metrics) {
  RunResult res;
  MPI_Comm sub;
  const int me = world_rank();
  MPI_Comm_split(MPI_COMM_WORLD, me < ranks ? 0 : MPI_UNDEFINED, me, &sub);
  if (sub != MPI_COMM_NULL) {
    auto world = std::make_shared<MpiComm>(sub, "world", true);
    std::vector<std::string> ov = overrides;
    ov.push_back("--log.metrics=" + metrics);
    try {
      Deck deck = parse_deck_text(deck_text, "test.ini", ov, ranks);
      Mesh mesh(deck.mesh, world);
      res.exit_code = run_training(deck, mesh);
    } catch (const UserError& e) {
      res.exit_code = 2;
      res.error = e.what();
    }
  }
  MPI_Bcast(&res.exit_code, 1, MPI_INT, 0, MPI_COMM_WORLD);
  int len = static_cast<int>(res.error.size());
  MPI_Bcast(&len, 1, MPI_INT, 0, MPI_COMM_WORLD);
  res.error.resize(len);
  MPI_Bcast(res.error.data(), len, MPI_CHAR, 0, MPI_COMM_WORLD);
  MPI_Barrier(MPI_COMM_WORLD);
  res.steps = read_metrics(metrics);
  return res;
}

}  // namespace qt::test
