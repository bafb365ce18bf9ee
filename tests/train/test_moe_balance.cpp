// Auxiliary-loss-free balancing on the CPU reference (model.router_bias_update_rate; issue 18,
// docs/moe.md) under mpiexec -n 2, on the tiny MoE deck (inputs/tiny-moe.ini):
//   - with the rate on, the expert load's coefficient of variation over the last steps is well
//     below the run without it (both without the load-balancing loss, DeepSeek-V3's setting);
//   - dp 2, ep 2 (also at ZeRO-3), tp 2 and pp 2 reproduce the serial run's losses and its bias
//     after every step (the update uses the whole global batch's load, so every rank takes the
//     same one);
//   - a checkpoint holds the bias and a resumed run continues on the uninterrupted run's losses
//     and bias; a checkpoint without a bias (rate 0) resumes with the bias at zero.
#include <gtest/gtest.h>
#include <hdf5.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "moe_harness.h"

namespace qt {
namespace {

using test::MoeStep;
using test::run;
using test::run_seed;
using test::RunResult;

// The tiny deck's sparse layers (mlp_only_layers = 1) and experts.
constexpr int kSparse[] = {0, 2};
constexpr int kE = 8;

// The router bias of a checkpoint, [sparse layers x E]; empty when it has none.
std::vector<float> checkpoint_bias(const std::string& path) {
  std::vector<float> out;
  const hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  EXPECT_GE(f, 0) << path;
  if (f < 0) return out;
  if (H5Lexists(f, "/router_bias", H5P_DEFAULT) > 0) {
    for (int l : kSparse) {
      const std::string name =
          "/router_bias/model.layers." + std::to_string(l) + ".mlp.gate.expert_bias";
      std::vector<float> row(kE, NAN);
      const hid_t ds = H5Dopen2(f, name.c_str(), H5P_DEFAULT);
      EXPECT_GE(ds, 0) << name;
      if (ds >= 0) {
        EXPECT_GE(H5Dread(ds, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, row.data()), 0);
        H5Dclose(ds);
      }
      out.insert(out.end(), row.begin(), row.end());
    }
  }
  H5Fclose(f);
  return out;
}

// Each logged step's router bias (the metrics' router_bias, [sparse layers][E] flattened).
std::vector<std::vector<double>> logged_bias(const std::string& metrics) {
  std::vector<std::vector<double>> out;
  std::ifstream f(metrics);
  std::string line;
  while (std::getline(f, line)) {
    const auto j = nlohmann::json::parse(line);
    std::vector<double> r;
    if (j.contains("router_bias"))
      for (const auto& layer : j["router_bias"])
        for (const auto& v : layer) r.push_back(v.get<double>());
    out.push_back(r);
  }
  return out;
}

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return INFINITY;
  double w = 0;
  for (std::size_t i = 0; i < a.size(); ++i) w = std::max(w, std::abs(double(a[i]) - b[i]));
  return w;
}

// The mean over steps [from, to] and sparse layers of the load's coefficient of variation.
double mean_cv(const std::vector<MoeStep>& run, long from, long to) {
  double sum = 0;
  int n = 0;
  for (const MoeStep& s : run) {
    if (s.step < from || s.step > to) continue;
    for (const std::vector<double>& layer : s.tokens) {
      double mean = 0, sq = 0;
      for (double t : layer) mean += t;
      mean /= static_cast<double>(layer.size());
      for (double t : layer) sq += (t - mean) * (t - mean);
      sum += std::sqrt(sq / static_cast<double>(layer.size())) / mean;
      ++n;
    }
  }
  return n > 0 ? sum / n : NAN;
}

class MoeBalance : public test::MoeTraining {
 protected:
  // `steps` steps with checkpoints every 5 (and at the end) in tmp_/name.
  std::vector<MoeStep> train_for(const std::string& name, int ranks, int steps,
                                 std::vector<std::string> ov) {
    ov.insert(ov.end(), {"--train.steps=" + std::to_string(steps), "--log.every=1",
                         "--checkpoint.every=5",
                         "--checkpoint.resume=none", "--checkpoint.dir=" + dir(name),
                         "--train.seed=" + std::to_string(run_seed())});
    const RunResult r = run(ranks, test::deck_text(), ov, tmp_ + "/" + name + ".jsonl");
    EXPECT_EQ(r.exit_code, 0) << name << ": " << r.error;
    return test::read_moe_metrics(tmp_ + "/" + name + ".jsonl");
  }
  std::string dir(const std::string& name) const { return tmp_ + "/" + name; }
  std::string ckpt(const std::string& name, int step) const {
    char file[32];
    std::snprintf(file, sizeof file, "/step_%08d.h5", step);
    return dir(name) + file;
  }
};

const std::string kRate = "--model.router_bias_update_rate=0.01";
const std::string kNoAux = "--model.router_aux_loss_coef=0";

TEST_F(MoeBalance, TheBiasEvensTheExpertLoad) {
  // 60 steps of 32 sequences (2048 token-slots a layer a step: the load's sampling noise alone
  // gives a cv of about 0.06); the cv over the last 30. Without the aux loss the tiny router's
  // load has a cv of about 0.17-0.30; the bias, 0.001 a step against probabilities of 1/8 on
  // average, brings it to about 0.08-0.09 (6 seeds: ratios 0.32-0.50). A rate of 0.01
  // overshoots (the load then swings around the mean by about the rate's effect each step).
  const std::vector<std::string> common = {kNoAux, "--train.global_batch=32"};
  std::vector<std::string> off = common, on = common;
  on.push_back("--model.router_bias_update_rate=0.001");
  const std::vector<MoeStep> a = train_for("off", 1, 60, off);
  const std::vector<MoeStep> b = train_for("on", 1, 60, on);
  ASSERT_EQ(a.size(), 60u);
  ASSERT_EQ(b.size(), 60u);
  const double cv_off = mean_cv(a, 31, 60), cv_on = mean_cv(b, 31, 60);
  if (test::world_rank() == 0)
    std::printf("seed %llu: expert load cv over steps 31-60: %.3f without the bias, %.3f with "
                "rate 0.001 (ratio %.2f; loss %.4f and %.4f at step 60)\n",
                static_cast<unsigned long long>(run_seed()), cv_off, cv_on, cv_on / cv_off,
                a.back().loss, b.back().loss);
  EXPECT_LT(cv_on, 0.65 * cv_off);
  EXPECT_LT(b.back().loss, b.front().loss);  // it still trains
}

TEST_F(MoeBalance, DpAndEpReproduceTheSerialRunAndItsBias) {
  const std::vector<MoeStep> serial = train_for("serial", 1, 10, {kRate});
  const std::vector<float> bias = checkpoint_bias(ckpt("serial", 10));
  ASSERT_EQ(bias.size(), 2u * kE);
  double range = 0;
  for (float b : bias) range = std::max(range, std::abs(double(b)));
  EXPECT_GT(range, 0.0) << "the bias moved";
  for (const auto& [name, ov] :
       std::vector<std::pair<std::string, std::vector<std::string>>>{
           {"dp2", {kRate}}, {"ep2", {kRate, "--mesh.ep=2"}},
           {"ep2_z3", {kRate, "--mesh.ep=2", "--optim.zero_stage=3"}},
           {"tp2", {kRate, "--mesh.tp=2", "--mesh.dp=1"}},
           {"pp2", {kRate, "--mesh.pp=2", "--mesh.dp=1"}}}) {
    SCOPED_TRACE(name);
    const std::vector<MoeStep> got = train_for(name, 2, 10, ov);
    test::expect_like_serial(got, serial, name);
    const double d = max_abs_diff(checkpoint_bias(ckpt(name, 10)), bias);
    const long flip = test::first_flip(got, serial);
    if (test::world_rank() == 0)
      std::printf("%s: bias within %.3g of the serial run's (largest |b| %.3g)%s\n", name.c_str(),
                  d, range, flip <= 10 ? ", the routing differing from a near tie" : "");
    // The bias after every step until the routing first differs (a near tie, which then may move
    // an expert's bias by a step of the rate): the same as the serial run's. A bias that differed
    // (another load) would make the routing differ only after it.
    const auto rs = logged_bias(tmp_ + "/serial.jsonl");
    const auto rg = logged_bias(tmp_ + "/" + name + ".jsonl");
    ASSERT_EQ(rs.size(), rg.size());
    ASSERT_EQ(rs.front().size(), 2u * kE);
    ASSERT_EQ(rg.front().size(), 2u * kE);
    for (std::size_t i = 0; i < rs.size() && static_cast<long>(i) + 1 < flip; ++i)
      for (std::size_t v = 0; v < rs[i].size(); ++v)
        EXPECT_NEAR(rg[i][v], rs[i][v], 1e-6) << "step " << i + 1;
    if (flip > got.back().step) EXPECT_LE(d, 1e-5);
  }
}

TEST_F(MoeBalance, ACheckpointResumesTheBias) {
  const std::vector<MoeStep> whole = train_for("whole", 1, 10, {kRate});
  const std::vector<float> b5 = checkpoint_bias(ckpt("whole", 5));
  ASSERT_EQ(b5.size(), 2u * kE);
  // Resumed at step 5, serially and on two ranks at ep 2: the uninterrupted run's steps 6-10.
  for (const auto& [name, ranks, ov] :
       std::vector<std::tuple<std::string, int, std::vector<std::string>>>{
           {"resumed", 1, {kRate}}, {"resumed_ep2", 2, {kRate, "--mesh.ep=2"}}}) {
    SCOPED_TRACE(name);
    const std::vector<MoeStep> got = resume(name, ranks, "whole", ov);
    test::expect_like_serial(got, test::tail(whole, 5), name);
    if (ranks == 1) {
      ASSERT_EQ(got.size(), 5u);
      for (std::size_t i = 0; i < got.size(); ++i)  // the same rank count: the same bits
        EXPECT_EQ(got[i].loss, whole[5 + i].loss) << "step " << got[i].step;
      EXPECT_EQ(checkpoint_bias(ckpt(name, 10)), checkpoint_bias(ckpt("whole", 10)));
    }
  }
  // A checkpoint without a bias (rate 0) resumes with the rate on from a zero bias: its first
  // step routes as the rate-0 run's did.
  const std::vector<MoeStep> plain = train_for("plain", 1, 10, {});
  EXPECT_TRUE(checkpoint_bias(ckpt("plain", 5)).empty());
  const std::vector<MoeStep> from_plain = resume("from_plain", 1, "plain", {kRate});
  ASSERT_FALSE(from_plain.empty());
  EXPECT_EQ(from_plain.front().loss, plain[5].loss);
  EXPECT_EQ(from_plain.front().tokens, plain[5].tokens);
  EXPECT_EQ(checkpoint_bias(ckpt("from_plain", 10)).size(), 2u * kE);
}

}  // namespace
}  // namespace qt
