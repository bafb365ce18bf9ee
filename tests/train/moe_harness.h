// The Qwen3-MoE training tests' harness (tests/train/test_moe_*.cpp): the tiny MoE deck
// (inputs/tiny-moe.ini), its metrics (loss, aux loss, gradient norm, expert load) and the
// comparison of a mesh's run with the serial one, which allows for top-k's near ties.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "training_harness.h"

namespace qt::test {

inline constexpr double kTol = 1e-5, kNormTol = 1e-4;

inline std::string deck_text() {
  std::ifstream in(std::string(QT_INPUTS_DIR) + "/tiny-moe.ini");
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// A step of a metrics file: loss, aux_loss, grad_norm, the expert load and peak memory.
struct MoeStep {
  long step;
  double loss, aux, norm;
  std::vector<std::vector<double>> tokens;  // [sparse layers][E] token-slots routed
  double mem_params, mem_optimizer;         // bytes, the largest rank's peak
  // model.moe_capacity_factor > 0: [sparse layers] token-slots dropped, and the file's
  // dropped_fraction (else empty and NaN: the file has neither).
  std::vector<double> dropped = {};
  double dropped_fraction = NAN;
};
inline std::vector<MoeStep> read_moe_metrics(const std::string& path) {
  std::vector<MoeStep> out;
  std::ifstream f(path);
  std::string line;
  while (std::getline(f, line)) {
    const auto j = nlohmann::json::parse(line);
    out.push_back({j["step"].get<long>(), j["loss"].get<double>(),
                   j.contains("aux_loss") ? j["aux_loss"].get<double>() : NAN,
                   j["grad_norm"].get<double>(),
                   j.contains("expert_tokens")
                       ? j["expert_tokens"].get<std::vector<std::vector<double>>>()
                       : std::vector<std::vector<double>>{},
                   j["mem_params"].get<double>(), j["mem_optimizer"].get<double>()});
    if (j.contains("expert_dropped")) {
      out.back().dropped = j["expert_dropped"].get<std::vector<double>>();
      out.back().dropped_fraction = j["dropped_fraction"].get<double>();
    }
  }
  return out;
}

// Largest relative difference of a field at the steps both runs logged in [from, to]; infinity
// when a value is not finite or no step is shared.
template <class F>
double worst(const std::vector<MoeStep>& a, const std::vector<MoeStep>& b, F field,
             long from = 0, long to = 1L << 40) {
  double w = -1;
  for (const MoeStep& x : a)
    for (const MoeStep& y : b)
      if (x.step == y.step && x.step >= from && x.step <= to) {
        if (!std::isfinite(field(x))) return INFINITY;
        w = std::max(w, std::abs(field(x) - field(y)) / std::abs(field(y)));
      }
  return w < 0 ? INFINITY : w;
}

// The last n steps of a run.
inline std::vector<MoeStep> tail(const std::vector<MoeStep>& v, std::size_t n) {
  return {v.end() - static_cast<std::ptrdiff_t>(std::min(n, v.size())), v.end()};
}

// The first step whose expert load differs from the serial run's, or a step past both runs.
// Top-k routing is discontinuous: where two experts' scores tie within fp32 rounding, another
// mesh's sums (in another order) may pick the other expert, and from that step the runs differ
// by more than rounding (about one 4-rank run in eight did, with the deck's 10 steps).
inline long first_flip(const std::vector<MoeStep>& a, const std::vector<MoeStep>& b) {
  long flip = 1L << 40;
  for (const MoeStep& x : a)
    for (const MoeStep& y : b)
      if (x.step == y.step && x.tokens != y.tokens) flip = std::min(flip, x.step);
  return flip;
}

// A mesh's run against the serial one: every step's loss and load-balancing loss within 1e-5
// and gradient norm within norm_tol (1e-4 unless given) until the routing first differs
// (first_flip); after it, within 1e-3 (1e-2 the norms): one token-slot routed elsewhere, not a
// wrong model.
inline constexpr double kFlipTol = 1e-3, kFlipNormTol = 1e-2;
inline void expect_like_serial(const std::vector<MoeStep>& got, const std::vector<MoeStep>& serial,
                               const std::string& name, double norm_tol = kNormTol) {
  ASSERT_EQ(got.size(), serial.size()) << name;
  ASSERT_FALSE(got.empty()) << name;
  const long flip = first_flip(got, serial);
  auto loss = [](const MoeStep& s) { return s.loss; };
  auto aux = [](const MoeStep& s) { return s.aux; };
  auto norm = [](const MoeStep& s) { return s.norm; };
  if (flip > got.front().step) {
    const long to = flip - 1;
    const double l = worst(got, serial, loss, 0, to), a = worst(got, serial, aux, 0, to);
    const double n = worst(got, serial, norm, 0, to);
    if (world_rank() == 0)
      std::printf("%s: steps to %ld: losses within %.3g, aux losses %.3g, gradient norms %.3g of "
                  "the serial run\n", name.c_str(), std::min(to, got.back().step), l, a, n);
    EXPECT_LT(l, kTol) << name;
    EXPECT_LT(a, kTol) << name;
    EXPECT_LT(n, norm_tol) << name;
  }
  if (flip <= got.back().step) {
    const double l = worst(got, serial, loss, flip), a = worst(got, serial, aux, flip);
    const double n = worst(got, serial, norm, flip);
    if (world_rank() == 0)
      std::printf("%s: the routing differs from step %ld (a near tie): losses within %.3g, aux "
                  "losses %.3g, gradient norms %.3g after it\n", name.c_str(), flip, l, a, n);
    EXPECT_LT(l, kFlipTol) << name;
    EXPECT_LT(a, kFlipTol) << name;
    EXPECT_LT(n, kFlipNormTol) << name;
  }
}

class MoeTraining : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_GE(world_size(), 2) << "run under mpiexec -n 2";
    tmp_ = shared_temp_dir("moe");
  }
  void TearDown() override {
    MPI_Barrier(MPI_COMM_WORLD);
    if (world_rank() == 0) std::filesystem::remove_all(tmp_);
  }
  // A run of `text` (the tiny MoE deck unless given).
  std::vector<MoeStep> train(const std::string& name, int ranks, std::vector<std::string> ov,
                             const std::string& text = deck_text()) {
    ov.insert(ov.end(), {"--train.steps=10", "--log.every=1", "--checkpoint.every=5",
                         "--checkpoint.resume=none", "--checkpoint.dir=" + tmp_ + "/" + name,
                         "--train.seed=" + std::to_string(run_seed())});
    const RunResult r = run(ranks, text, ov, tmp_ + "/" + name + ".jsonl");
    EXPECT_EQ(r.exit_code, 0) << name << ": " << r.error;
    return read_moe_metrics(tmp_ + "/" + name + ".jsonl");
  }
  // A run of `ranks` resumed from the step-5 checkpoint of run `from`, to step 10.
  std::vector<MoeStep> resume(const std::string& name, int ranks, const std::string& from,
                              std::vector<std::string> ov,
                              const std::string& text = deck_text()) {
    ov.insert(ov.end(), {"--checkpoint.resume=" + tmp_ + "/" + from + "/step_00000005.h5",
                         "--checkpoint.dir=" + tmp_ + "/" + name, "--train.steps=10",
                         "--log.every=1", "--train.seed=" + std::to_string(run_seed())});
    const RunResult r = run(ranks, text, ov, tmp_ + "/" + name + ".jsonl");
    EXPECT_EQ(r.exit_code, 0) << name << ": " << r.error;
    const std::vector<MoeStep> got = read_moe_metrics(tmp_ + "/" + name + ".jsonl");
    EXPECT_EQ(got.size(), 5u) << name;
    if (!got.empty()) EXPECT_EQ(got.front().step, 6) << name;
    return got;
  }
  std::string tmp_;
};

}  // namespace qt::test
