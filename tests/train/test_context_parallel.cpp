// Context parallelism (mesh.cp, issue 24) on the CPU reference, whole trainings under mpiexec -n 4:
// each sequence split over the cp ranks in load-balanced chunks, attention by ring. cp 2 and 4,
// alone, with dp 2 at ZeRO-1 and ZeRO-3, with tp 2 (with and without sequence parallelism) and with
// pp 2 (1F1B, ZB-H1), and [lora] with dropout, reproduce the serial run's losses, gradient norms
// and final parameters with packed documents (crossing the chunk boundaries) and a sequence length
// that the chunk count does not divide, and the held-out loss; cp 2 checkpoints (with dp 2, with tp
// 2, with pp 2) resume at cp 1 and a cp 1 one at cp 2 on the serial run's losses.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <string>
#include <tuple>
#include <vector>

#include "serial_compare.h"
#include "training_harness.h"

namespace qt {
namespace {

namespace fs = std::filesystem;
using test::expect_serial;
using test::max_rel;
using test::read_params;
using test::rel_norm_diff;
using test::run;
using test::run_seed;
using test::RunResult;

constexpr int kVocab = 256;  // the tiny preset's

// 19 tokens a sequence: 2 cp = 4 chunks of 5, 5, 5, 4 (cp 2), 8 chunks of 3, 3, 3, 2, ... (cp 4),
// so the ranks hold different numbers of tokens. AdamW's eps is 1e-6: some gradient components
// (embedding rows of tokens a step barely uses) are near zero, and with eps 1e-8 AdamW turns the
// last-bit differences of their sums into whole lr-sized steps of either sign (seen over a seed
// sweep: norms 2e-5 to 3e-5 apart by step 10 from 1e-8 at step 1); eps 1e-6 keeps those updates
// proportional to the gradient, so the comparison stays about the attention's math (as the
// tensor-parallel test does for its untied head).
std::string deck_text(const std::string& dir, const std::string& tokens) {
  return "[model]\npreset = tiny\n"
         "[train]\nseq_len = 19\nmicro_batch = 2\nglobal_batch = 8\nsteps = 10\nseed = " +
         std::to_string(run_seed()) + "\n"
         "[optim]\nlr = 3e-3\nmin_lr = 3e-4\nwarmup_steps = 3\ngrad_clip = 1.0\neps = 1e-6\n"
         "[data]\nsource = file\npath = " + tokens + "\npacking = packed\n"
         "[checkpoint]\ndir = " + dir + "\nevery = 5\nkeep = 4\nresume = none\n"
         "[log]\nevery = 1\n";
}

class ContextParallel : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_GE(test::world_size(), 4) << "run under mpiexec -n 4";
    tmp_ = test::shared_temp_dir("cp");
    tokens_ = tmp_ + "/tokens.h5";
    // Documents of 5 to 44 tokens (several a sequence, most crossing a chunk boundary), about
    // one target in ten masked out of the loss.
    test::write_random_tokens(tokens_, 4000, kVocab, run_seed());
  }
  void TearDown() override {
    MPI_Barrier(MPI_COMM_WORLD);
    if (test::world_rank() == 0) fs::remove_all(tmp_);
  }
  std::string path(const std::string& name) const { return tmp_ + "/" + name; }
  RunResult train(const std::string& name, int ranks, const std::vector<std::string>& overrides) {
    RunResult r = run(ranks, deck_text(path(name), tokens_), overrides, path(name + ".jsonl"));
    EXPECT_EQ(r.exit_code, 0) << name << ": " << r.error;
    return r;
  }
  std::string tmp_, tokens_;
};

TEST_F(ContextParallel, ReproducesTheSerialRun) {
  const RunResult serial = train("serial", 1, {});
  ASSERT_EQ(serial.steps.size(), 10u);
  struct Case {
    const char* name;
    int ranks;
    std::vector<std::string> overrides;
  };
  const std::vector<Case> cases = {
      {"cp2", 2, {"--mesh.cp=2"}},
      {"cp2_recompute", 2, {"--mesh.cp=2", "--train.recompute=true"}},
      {"cp4", 4, {"--mesh.cp=4"}},
      {"dp2_cp2_z1", 4, {"--mesh.cp=2", "--optim.zero_stage=1"}},
      {"dp2_cp2_z3", 4, {"--mesh.cp=2", "--optim.zero_stage=3"}},
      // tensor parallelism inside each cp rank: its local heads through the ring
      {"cp2_tp2", 4, {"--mesh.cp=2", "--mesh.tp=2"}},
      {"cp2_tp2_sp_z2", 4,
       {"--mesh.cp=2", "--mesh.tp=2", "--mesh.sequence_parallel=true", "--optim.zero_stage=2"}},
      // pipeline stages over each cp rank's tokens (the tied embedding's copies on both stages)
      {"cp2_pp2", 4, {"--mesh.cp=2", "--mesh.pp=2"}},
      {"cp2_pp2_zb_z3", 4,
       {"--mesh.cp=2", "--mesh.pp=2", "--mesh.pp_schedule=zb-h1", "--optim.zero_stage=3"}},
      // one sequence a micro-batch, plain causal attention across the documents
      {"cp2_concat", 2, {"--mesh.cp=2", "--train.micro_batch=1", "--data.packing=concat"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const bool concat = std::string(c.name) == "cp2_concat";
    const RunResult& base = concat ? train("serial_concat", 1, {"--data.packing=concat"}) : serial;
    const RunResult r = train(c.name, c.ranks, c.overrides);
    ASSERT_EQ(r.steps.size(), 10u);
    const double params = rel_norm_diff(
        read_params(path(std::string(c.name) + "/step_00000010.h5"), true),
        read_params(path(concat ? "serial_concat/step_00000010.h5" : "serial/step_00000010.h5"),
                    true));
    if (test::world_rank() == 0)
      std::printf("%s: losses within %.3g, gradient norms %.3g (first %.3g), parameters %.3g of "
                  "the serial run\n",
                  c.name, max_rel(r.steps, base.steps), max_rel(r.steps, base.steps, 1, true),
                  max_rel(r.steps, base.steps, 1, true, 1), params);
    expect_serial(r.steps, base.steps);
    // The ring changes only the order of the attention's sums: the norms stay as close as the
    // losses (seen: 1e-7), closer than expect_serial's bound for meshes that reorder more.
    EXPECT_LT(max_rel(r.steps, base.steps, 1, true), test::kTol) << "gradient norms";
    EXPECT_LT(params, test::kParamTol);
  }
}

// [lora] with dropout: each token's mask is keyed by its place in the whole sequence, so cp 2
// (alone, with dp 2 at ZeRO-1, with tp 2) trains the serial run's adapters.
TEST_F(ContextParallel, LoraReproducesTheSerialRun) {
  const std::vector<std::string> lora = {"--lora.r=4", "--lora.dropout=0.1",
                                         "--lora.targets=q_proj, v_proj, o_proj, down_proj"};
  const RunResult serial = train("serial_lora", 1, lora);
  ASSERT_EQ(serial.steps.size(), 10u);
  for (const auto& [name, ranks, mesh] :
       std::vector<std::tuple<const char*, int, std::vector<std::string>>>{
           {"cp2_lora", 2, {"--mesh.cp=2"}},
           {"dp2_cp2_lora_z1", 4, {"--mesh.cp=2", "--optim.zero_stage=1"}},
           {"cp2_tp2_lora", 4, {"--mesh.cp=2", "--mesh.tp=2"}}}) {
    SCOPED_TRACE(name);
    const RunResult r = train(name, ranks, test::with(lora, mesh));
    ASSERT_EQ(r.steps.size(), 10u);
    if (test::world_rank() == 0)
      std::printf("%s: losses within %.3g, gradient norms %.3g of the serial run\n", name,
                  max_rel(r.steps, serial.steps), max_rel(r.steps, serial.steps, 1, true));
    expect_serial(r.steps, serial.steps);
    EXPECT_LT(max_rel(r.steps, serial.steps, 1, true), test::kTol) << "gradient norms";
  }
}

// [eval]: the held-out loss of a cp 2 run (each rank's tokens, summed over cp) is the serial
// run's at every evaluation.
TEST_F(ContextParallel, HeldOutLossIsTheSerialOne) {
  const std::vector<std::string> eval = {"--eval.split=0.2", "--eval.every=5"};
  const RunResult serial = train("serial_eval", 1, eval);
  const RunResult cp = train("cp_eval", 4, test::with(eval, {"--mesh.cp=2"}));
  const auto want = test::metrics_lines_of_kind(path("serial_eval.jsonl"), "eval");
  const auto got = test::metrics_lines_of_kind(path("cp_eval.jsonl"), "eval");
  ASSERT_EQ(want.size(), 2u);  // steps 5 and 10
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double a = got[i]["eval_loss"].get<double>(), b = want[i]["eval_loss"].get<double>();
    EXPECT_LT(std::abs(a - b) / b, test::kTol) << "evaluation " << i << ": " << a << " vs " << b;
    EXPECT_EQ(got[i]["eval_tokens"], want[i]["eval_tokens"]);
  }
}

// Checkpoints hold global tensors: cp 2 checkpoints (dp 2 at ZeRO-3; tp 2; pp 2) resume at cp 1
// and a serial one at cp 2, all on the uninterrupted serial run's losses.
TEST_F(ContextParallel, CheckpointsMoveBetweenContextParallelAndSerial) {
  const RunResult serial = train("serial", 1, {});
  const RunResult first =
      train("cp", 4, {"--mesh.cp=2", "--optim.zero_stage=3", "--train.stop_at=5"});
  ASSERT_EQ(first.steps.size(), 5u);
  const RunResult to_serial =
      train("to_serial", 1, {"--checkpoint.resume=" + path("cp/step_00000005.h5")});
  const RunResult to_cp = train("to_cp", 2, {"--checkpoint.resume=" +
                                                 path("serial/step_00000005.h5"),
                                             "--mesh.cp=2", "--optim.zero_stage=2"});
  const RunResult first_tp = train("cp_tp", 4, {"--mesh.cp=2", "--mesh.tp=2", "--train.stop_at=5"});
  ASSERT_EQ(first_tp.steps.size(), 5u);
  const RunResult tp_to_serial =
      train("tp_to_serial", 1, {"--checkpoint.resume=" + path("cp_tp/step_00000005.h5")});
  const RunResult first_pp = train("cp_pp", 4, {"--mesh.cp=2", "--mesh.pp=2", "--train.stop_at=5"});
  ASSERT_EQ(first_pp.steps.size(), 5u);
  const RunResult pp_to_serial =
      train("pp_to_serial", 1, {"--checkpoint.resume=" + path("cp_pp/step_00000005.h5")});
  for (const RunResult* r : {&to_serial, &to_cp, &tp_to_serial, &pp_to_serial}) {
    ASSERT_EQ(r->steps.size(), 5u);
    EXPECT_EQ(r->steps.front().step, 6);
    expect_serial(r->steps, serial.steps, 6);
  }
}

}  // namespace
}  // namespace qt
