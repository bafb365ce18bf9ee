// The sharded state (issue 16), tensor, sequence and pipeline parallelism (issue 17) on the CPU
// reference, whole trainings under mpiexec -n 4: every ZeRO stage on every dp size, with and
// without tp (with and without sequence parallelism) or pp, reproduces the serial run's losses,
// gradient norms and final parameters; checkpoints
// written at (dp 2, ZeRO-3), (dp 2, tp 2, ZeRO-3) and (dp 2, pp 2, ZeRO-3) resume on other meshes
// on the uninterrupted serial run's losses.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include "hf/export.h"
#include "qtrain/checkpoint.h"
#include "qtrain/params.h"
#include "runtime/memory.h"
#include "support/random.h"
#include "serial_compare.h"
#include "training_harness.h"

namespace qt {
namespace {

namespace fs = std::filesystem;
using test::run;
using test::run_seed;
using test::RunResult;
using test::StepRecord;

std::string deck_text(const std::string& dir) {
  return "[model]\npreset = tiny\n"
         "[train]\nseq_len = 16\nmicro_batch = 2\nglobal_batch = 8\nsteps = 10\nseed = " +
         std::to_string(run_seed()) + "\n"
         "[optim]\nlr = 3e-3\nmin_lr = 3e-4\nwarmup_steps = 3\ngrad_clip = 1.0\n"
         "[data]\nsource = synthetic\n"
         "[checkpoint]\ndir = " + dir + "\nevery = 5\nkeep = 4\nresume = none\n"
         "[log]\nevery = 1\n";
}

using test::expect_serial;
using test::kNormTol;
using test::kParamTol;
using test::kTol;
using test::max_rel;
using test::read_params;
using test::rel_norm_diff;

class ZeroStages : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_GE(test::world_size(), 4) << "run under mpiexec -n 4 (or 8)";
    tmp_ = test::shared_temp_dir("zero");
  }
  void TearDown() override {
    MPI_Barrier(MPI_COMM_WORLD);
    if (test::world_rank() == 0) fs::remove_all(tmp_);
  }
  std::string path(const std::string& name) const { return tmp_ + "/" + name; }
  // A run of 10 steps at dp `ranks` with `overrides`, in its own directory `name`.
  // A mesh to run the deck on: its name (the run's directory), ranks and overrides.
  struct Case {
    const char* name;
    int ranks;
    std::vector<std::string> overrides;
  };
  // Runs a case and checks its losses, norms and final parameters (tied, 2 layers) against the
  // serial run's.
  void check_against_serial(const Case& c, const RunResult& serial,
                            const std::vector<float>& want, int kv_heads = 0) {
    SCOPED_TRACE(c.name);
    const RunResult r = train(c.name, c.ranks, c.overrides);
    ASSERT_EQ(r.steps.size(), 10u);
    const double params =
        rel_norm_diff(read_params(path(std::string(c.name) + "/step_00000010.h5"), true, kv_heads),
                      want);
    if (test::world_rank() == 0)
      std::printf("%s: losses within %.3g, gradient norms %.3g (first %.3g), parameters %.3g of "
                  "the serial run\n",
                  c.name, max_rel(r.steps, serial.steps), max_rel(r.steps, serial.steps, 1, true),
                  max_rel(r.steps, serial.steps, 1, true, 1), params);
    expect_serial(r.steps, serial.steps);
    EXPECT_LT(params, kParamTol);
  }

  RunResult train(const std::string& name, int ranks, std::vector<std::string> overrides) {
    RunResult r = run(ranks, deck_text(path(name)), overrides, path(name + ".jsonl"));
    EXPECT_EQ(r.exit_code, 0) << name << ": " << r.error;
    return r;
  }
  std::string tmp_;
};

TEST_F(ZeroStages, EveryStageAndDpSizeReproducesTheSerialRun) {
  const RunResult serial = train("serial", 1, {"--optim.zero_stage=0"});
  ASSERT_EQ(serial.steps.size(), 10u);
  EXPECT_LT(serial.steps.back().loss, serial.steps.front().loss);  // it trains
  const std::vector<float> want = read_params(path("serial/step_00000010.h5"), true);
  const std::vector<Case> cases = {
      {"dp2_z1", 2, {"--optim.zero_stage=1"}},
      {"dp2_z2", 2, {"--optim.zero_stage=2"}},
      {"dp2_z3", 2, {"--optim.zero_stage=3"}},
      {"dp4_z3", 4, {"--optim.zero_stage=3"}},
      {"dp4_z2", 4, {"--optim.zero_stage=2"}},
      {"dp2_z3_offload", 2, {"--optim.zero_stage=3", "--optim.offload=cpu"}},
      {"dp2_z3_recompute", 2, {"--optim.zero_stage=3", "--train.recompute=true"}},
      {"dp4_z3_micro1", 4, {"--optim.zero_stage=3", "--train.micro_batch=1"}},
  };
  for (const Case& c : cases) check_against_serial(c, serial, want);
  // dp 3 leaves a remainder in every unit's shards: it must match its own serial run.
  const RunResult serial6 = train("serial6", 1, {"--train.global_batch=6"});
  const RunResult dp3 = train("dp3_z3", 3, {"--optim.zero_stage=3", "--train.global_batch=6"});
  ASSERT_EQ(dp3.steps.size(), 10u);
  expect_serial(dp3.steps, serial6.steps);
}

TEST_F(ZeroStages, UntiedEmbeddingsShardAlike) {
  const std::vector<std::string> untied = {"--model.tie_word_embeddings=false"};
  std::vector<std::string> z3 = untied;
  z3.push_back("--optim.zero_stage=3");
  const RunResult serial = train("serial", 1, untied);
  const RunResult sharded = train("dp4_z3", 4, z3);
  ASSERT_EQ(sharded.steps.size(), 10u);
  expect_serial(sharded.steps, serial.steps);
  EXPECT_LT(rel_norm_diff(read_params(path("dp4_z3/step_00000010.h5"), false),
                          read_params(path("serial/step_00000010.h5"), false)),
            kParamTol);
}

TEST_F(ZeroStages, CheckpointOfZero3ResumesAtOtherMeshesAndStages) {
  const RunResult serial = train("serial", 1, {});
  const RunResult first =
      train("z3", 2, {"--optim.zero_stage=3", "--train.stop_at=5"});
  ASSERT_EQ(first.steps.size(), 5u);
  const std::string ckpt = path("z3/step_00000005.h5");
  ASSERT_TRUE(fs::exists(ckpt));
  const RunResult at1 = train("to1", 1, {"--checkpoint.resume=" + ckpt, "--optim.zero_stage=0"});
  const RunResult at4 = train("to4", 4, {"--checkpoint.resume=" + ckpt, "--optim.zero_stage=2"});
  const RunResult at2 = train("to2", 2, {"--checkpoint.resume=" + ckpt, "--optim.zero_stage=3"});
  for (const RunResult* r : {&at1, &at4, &at2}) {
    ASSERT_EQ(r->steps.size(), 5u);
    EXPECT_EQ(r->steps.front().step, 6);
    expect_serial(r->steps, serial.steps, 6);
  }
}

// Tensor parallelism (issue 17, first part: the CPU back end; heads, MLP columns and the
// vocabulary split over tp) on its own and under every ZeRO stage over dp, and with sequence
// parallelism (norms and residual adds on each tp rank's half of the rows; the norm weights'
// gradients summed over tp): the serial run's losses, gradient norms and final parameters (the
// checkpoint holds global tensors).
TEST_F(ZeroStages, TensorParallelReproducesTheSerialRun) {
  const RunResult serial = train("serial", 1, {});
  const std::vector<float> want = read_params(path("serial/step_00000010.h5"), true);
  const std::string sp = "--mesh.sequence_parallel=true";
  const std::vector<Case> cases = {
      {"tp2", 2, {"--mesh.tp=2"}},
      {"tp2_recompute", 2, {"--mesh.tp=2", "--train.recompute=true"}},
      {"dp2_tp2_z1", 4, {"--mesh.tp=2", "--optim.zero_stage=1"}},
      {"dp2_tp2_z2", 4, {"--mesh.tp=2", "--optim.zero_stage=2"}},
      {"dp2_tp2_z3", 4, {"--mesh.tp=2", "--optim.zero_stage=3"}},
      {"tp2_sp", 2, {"--mesh.tp=2", sp}},
      {"tp2_sp_recompute", 2, {"--mesh.tp=2", sp, "--train.recompute=true"}},
      {"dp2_tp2_z1_sp", 4, {"--mesh.tp=2", "--optim.zero_stage=1", sp}},
      // one sequence a micro-batch: each tp rank holds half of its positions
      {"tp2_sp_micro1", 2, {"--mesh.tp=2", "--train.micro_batch=1", sp}},
  };
  for (const Case& c : cases) check_against_serial(c, serial, want);
  // Untied: the lm head is a tensor of its own (vocabulary-parallel too). Its rows of tokens the
  // synthetic data never uses get gradients near zero, whose sign AdamW turns into a whole
  // lr-sized step: with eps 1e-8 the last-bit differences of tp's reordered sums flip some of
  // them (seen: losses 6e-6 and norms 3e-4 apart after step 4, from 7e-9 at step 1). eps 1e-6
  // keeps those updates proportional to the gradient, so the comparison stays about the math.
  const std::vector<std::string> untied = {"--model.tie_word_embeddings=false",
                                           "--optim.eps=1e-6"};
  const RunResult serial_untied = train("serial_untied", 1, untied);
  const RunResult tp_untied =
      train("tp2_untied", 4, {"--model.tie_word_embeddings=false", "--optim.eps=1e-6",
                              "--mesh.tp=2", "--optim.zero_stage=3"});
  const RunResult sp_untied =
      train("tp2_untied_sp", 4, {"--model.tie_word_embeddings=false", "--optim.eps=1e-6",
                                 "--mesh.tp=2", "--optim.zero_stage=2", sp});
  for (const char* name : {"tp2_untied", "tp2_untied_sp"}) {
    SCOPED_TRACE(name);
    const RunResult& r = std::string(name) == "tp2_untied" ? tp_untied : sp_untied;
    ASSERT_EQ(r.steps.size(), 10u);
    expect_serial(r.steps, serial_untied.steps);
    EXPECT_LT(rel_norm_diff(read_params(path(std::string(name) + "/step_00000010.h5"), false),
                            read_params(path("serial_untied/step_00000010.h5"), false)),
              kParamTol);
  }
}

// More tp ranks than key/value heads (Megatron's replication): with one kv head at tp 2, and two
// at tp 4, each rank holds its group's kv head, whose k/v projection gradients are summed over
// the group only; alone, with sequence parallelism, with ZeRO-1 and 3 over dp and in a pipeline
// (1F1B, and ZB-H1 at ZeRO-2: the per-unit reduction); its checkpoint (global tensors, one copy
// of each kv head) resumes serially and the reverse. Cases of more ranks than the world's skip.
TEST_F(ZeroStages, TensorParallelSharesKeyValueHeads) {
  for (const int kv : {1, 2}) {
    const std::string heads = "--model.num_kv_heads=" + std::to_string(kv);
    const std::string tag = "kv" + std::to_string(kv) + "_";
    const RunResult serial = train(tag + "serial", 1, {heads});
    const std::vector<float> want = read_params(path(tag + "serial/step_00000010.h5"), true, kv);
    const std::string tp = "--mesh.tp=" + std::to_string(2 * kv);  // two ranks a kv head
    for (const auto& [name, dp_pp, extra] :
         std::vector<std::tuple<std::string, int, std::vector<std::string>>>{
             {"tp", 1, {}},
             {"tp_sp", 1, {"--mesh.sequence_parallel=true"}},
             {"dp2_tp_z1", 2, {"--optim.zero_stage=1"}},
             {"dp2_tp_z3", 2, {"--optim.zero_stage=3"}},
             {"pp2_tp", 2, {"--mesh.pp=2"}},
             {"pp2_tp_zb_z2", 2,
              {"--mesh.pp=2", "--mesh.pp_schedule=zb-h1", "--optim.zero_stage=2"}}}) {
      const int ranks = 2 * kv * dp_pp;
      if (ranks > test::world_size()) continue;
      const std::string dir = tag + name;
      std::vector<std::string> o = {heads, tp};
      o.insert(o.end(), extra.begin(), extra.end());
      check_against_serial({dir.c_str(), ranks, o}, serial, want, kv);
    }
    const RunResult to_serial = train(tag + "to_serial", 1,
                                      {heads, "--checkpoint.resume=" + path(tag + "tp/step_00000005.h5")});
    const RunResult to_tp = train(tag + "to_tp", 2 * kv,
                                  {heads, tp, "--checkpoint.resume=" + path(tag + "serial/step_00000005.h5")});
    for (const RunResult* r : {&to_serial, &to_tp}) {
      ASSERT_EQ(r->steps.size(), 5u);
      EXPECT_EQ(r->steps.front().step, 6);
      expect_serial(r->steps, serial.steps, 6);
    }
  }
}

// A checkpoint written under tensor parallelism resumes without it and the reverse.
TEST_F(ZeroStages, CheckpointsMoveBetweenTensorParallelAndSerial) {
  const RunResult serial = train("serial", 1, {});
  const RunResult first =
      train("tp", 4, {"--mesh.tp=2", "--optim.zero_stage=3", "--train.stop_at=5"});
  ASSERT_EQ(first.steps.size(), 5u);
  const RunResult to_serial =
      train("to_serial", 1, {"--checkpoint.resume=" + path("tp/step_00000005.h5")});
  const RunResult to_tp = train("to_tp", 4, {"--checkpoint.resume=" +
                                                 path("serial/step_00000005.h5"),
                                             "--mesh.tp=2", "--optim.zero_stage=2"});
  for (const RunResult* r : {&to_serial, &to_tp}) {
    ASSERT_EQ(r->steps.size(), 5u);
    EXPECT_EQ(r->steps.front().step, 6);
    expect_serial(r->steps, serial.steps, 6);
  }
}

// Pipeline parallelism (mesh.pp): each stage runs its layers and sends activations and their
// gradients to its neighbours in 1F1B order; the tied embedding's two copies (first and last
// stage) sum their gradients. Every mesh reproduces the serial run.
TEST_F(ZeroStages, PipelineReproducesTheSerialRun) {
  const RunResult serial = train("serial", 1, {});
  const std::vector<float> want = read_params(path("serial/step_00000010.h5"), true);
  const std::vector<Case> cases = {
      {"pp2", 2, {"--mesh.pp=2"}},
      {"pp2_recompute", 2, {"--mesh.pp=2", "--train.recompute=true"}},
      {"pp2_micro1", 2, {"--mesh.pp=2", "--train.micro_batch=1"}},  // 8 micro-batches a step
      {"dp2_pp2_z1", 4, {"--mesh.pp=2", "--optim.zero_stage=1"}},
      {"dp2_pp2_z3", 4, {"--mesh.pp=2", "--optim.zero_stage=3"}},
      {"tp2_pp2", 4, {"--mesh.pp=2", "--mesh.tp=2"}},
      // ZB-H1: each backward split, its weight half later (from saved output gradients)
      {"pp2_zb", 2, {"--mesh.pp=2", "--mesh.pp_schedule=zb-h1"}},
      {"dp2_pp2_zb_z1", 4, {"--mesh.pp=2", "--mesh.pp_schedule=zb-h1", "--optim.zero_stage=1"}},
      // ZeRO-2/3: each layer's reduce-scatter after the last weight half owed to it
      {"dp2_pp2_zb_z2", 4, {"--mesh.pp=2", "--mesh.pp_schedule=zb-h1", "--optim.zero_stage=2"}},
      {"dp2_pp2_zb_z3", 4, {"--mesh.pp=2", "--mesh.pp_schedule=zb-h1", "--optim.zero_stage=3"}},
      {"tp2_pp2_zb", 4, {"--mesh.pp=2", "--mesh.tp=2", "--mesh.pp_schedule=zb-h1"}},
      // sequence parallelism: each tp rank sends its own rows to its peer of the next stage
      {"tp2_pp2_sp", 4, {"--mesh.pp=2", "--mesh.tp=2", "--mesh.sequence_parallel=true"}},
      {"tp2_pp2_zb_sp", 4, {"--mesh.pp=2", "--mesh.tp=2", "--mesh.pp_schedule=zb-h1",
                            "--mesh.sequence_parallel=true"}},
  };
  for (const Case& c : cases) check_against_serial(c, serial, want);
  // Untied: the lm head on the last stage, the embedding on the first (eps as in the tp test).
  const std::vector<std::string> untied = {"--model.tie_word_embeddings=false",
                                           "--optim.eps=1e-6"};
  const RunResult serial_untied = train("serial_untied", 1, untied);
  const RunResult pp_untied =
      train("pp2_untied", 4, {"--model.tie_word_embeddings=false", "--optim.eps=1e-6",
                              "--mesh.pp=2", "--optim.zero_stage=2"});
  ASSERT_EQ(pp_untied.steps.size(), 10u);
  expect_serial(pp_untied.steps, serial_untied.steps);
  EXPECT_LT(rel_norm_diff(read_params(path("pp2_untied/step_00000010.h5"), false),
                          read_params(path("serial_untied/step_00000010.h5"), false)),
            kParamTol);
}

// A 4-layer model: four stages of one layer each (1F1B and ZB-H1), and interleaved 1F1B with two
// chunks a stage on two stages (chunk c on stage c % 2: activations wrap from the last stage
// back to the first), alone, with dp 2 at ZeRO-3 and with tp 2 (with and without sequence
// parallelism); against its serial run.
TEST_F(ZeroStages, FourPipelineStagesReproduceTheSerialRun) {
  const std::vector<std::string> four = {"--model.num_layers=4"};
  const RunResult serial = train("serial4", 1, four);
  const std::vector<Case> cases = {
      {"pp4_1f1b", 4, {"--mesh.pp=4"}},
      {"pp4_zb", 4, {"--mesh.pp=4", "--mesh.pp_schedule=zb-h1"}},
      {"pp2_v2", 2, {"--mesh.pp=2", "--mesh.pp_chunks=2"}},
      // interleaved with split backwards: weight halves in the interleaved order's bubbles
      {"pp2_v2_zb", 2, {"--mesh.pp=2", "--mesh.pp_chunks=2", "--mesh.pp_schedule=zb-h1"}},
      {"dp2_pp2_v2_zb_z3", 4,
       {"--mesh.pp=2", "--mesh.pp_chunks=2", "--mesh.pp_schedule=zb-h1", "--optim.zero_stage=3"}},
      {"dp2_pp2_v2_z3", 4, {"--mesh.pp=2", "--mesh.pp_chunks=2", "--optim.zero_stage=3"}},
      {"tp2_pp2_v2", 4, {"--mesh.pp=2", "--mesh.pp_chunks=2", "--mesh.tp=2"}},
      {"tp2_pp2_v2_sp", 4,
       {"--mesh.pp=2", "--mesh.pp_chunks=2", "--mesh.tp=2", "--mesh.sequence_parallel=true"}},
      // the split from the deck, uneven: 3 layers on the first stage, 1 with the head
      {"pp2_layers_3_1", 2, {"--mesh.pp=2", "--mesh.pp_layers=3,1"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    std::vector<std::string> o = four;
    o.insert(o.end(), c.overrides.begin(), c.overrides.end());
    const RunResult r = train(c.name, c.ranks, o);
    ASSERT_EQ(r.steps.size(), 10u);
    if (test::world_rank() == 0)
      std::printf("%s: losses within %.3g, gradient norms %.3g of the serial run\n", c.name,
                  max_rel(r.steps, serial.steps), max_rel(r.steps, serial.steps, 1, true));
    expect_serial(r.steps, serial.steps);
  }
}

// (dp, tp, pp, ZeRO) = (2, 2, 2, 3) on eight ranks (its own CTest entry, train_pipeline_np8),
// with and without sequence parallelism, 1F1B and ZB-H1: the serial losses and parameters, and
// its checkpoint resumes serially and the reverse.
TEST_F(ZeroStages, PipelineWithTensorParallelOnEightRanks) {
  if (test::world_size() < 8) GTEST_SKIP() << "needs mpiexec -n 8 (train_pipeline_np8)";
  const RunResult serial = train("serial", 1, {});
  const std::vector<float> want = read_params(path("serial/step_00000010.h5"), true);
  const std::vector<std::string> mesh = {"--mesh.pp=2", "--mesh.tp=2", "--optim.zero_stage=3"};
  std::vector<std::string> sp = mesh;
  sp.push_back("--mesh.sequence_parallel=true");
  check_against_serial({"dp2_tp2_pp2_z3", 8, mesh}, serial, want);
  check_against_serial({"dp2_tp2_pp2_z3_sp", 8, sp}, serial, want);
  // ZB-H1: each layer's tp reductions and reduce-scatter after its last weight half owed
  std::vector<std::string> zb = mesh, zb_sp = sp;
  zb.push_back("--mesh.pp_schedule=zb-h1");
  zb_sp.push_back("--mesh.pp_schedule=zb-h1");
  check_against_serial({"dp2_tp2_pp2_zb_z3", 8, zb}, serial, want);
  check_against_serial({"dp2_tp2_pp2_zb_z3_sp", 8, zb_sp}, serial, want);
  const RunResult to_serial =
      train("to_serial", 1, {"--checkpoint.resume=" + path("dp2_tp2_pp2_z3/step_00000005.h5")});
  std::vector<std::string> back = mesh;
  back.push_back("--checkpoint.resume=" + path("serial/step_00000005.h5"));
  const RunResult to_mesh = train("to_mesh", 8, back);
  for (const RunResult* x : {&to_serial, &to_mesh}) {
    ASSERT_EQ(x->steps.size(), 5u);
    EXPECT_EQ(x->steps.front().step, 6);
    expect_serial(x->steps, serial.steps, 6);
  }
}

// A checkpoint written by a pipeline resumes without one and the reverse.
TEST_F(ZeroStages, CheckpointsMoveBetweenPipelineAndSerial) {
  const RunResult serial = train("serial", 1, {});
  const RunResult first =
      train("pp", 4, {"--mesh.pp=2", "--optim.zero_stage=3", "--train.stop_at=5"});
  ASSERT_EQ(first.steps.size(), 5u);
  const RunResult to_serial =
      train("to_serial", 1, {"--checkpoint.resume=" + path("pp/step_00000005.h5")});
  const RunResult to_pp = train("to_pp", 2, {"--checkpoint.resume=" +
                                                 path("serial/step_00000005.h5"),
                                             "--mesh.pp=2", "--optim.zero_stage=1"});
  for (const RunResult* r : {&to_serial, &to_pp}) {
    ASSERT_EQ(r->steps.size(), 5u);
    EXPECT_EQ(r->steps.front().step, 6);
    expect_serial(r->steps, serial.steps, 6);
  }
}

// Hugging Face weights (`[model] init`) reach a tensor-parallel run through the same global
// pieces: exported from a checkpoint, they start tp 2 on the serial run's losses.
TEST_F(ZeroStages, TensorParallelRunsStartFromHuggingFaceWeights) {
  train("first", 1, {"--train.stop_at=5"});
  const std::string hf = path("hf");
  auto world = std::make_shared<MpiComm>(MPI_COMM_WORLD, "world", false);
  std::vector<std::string> args = {"export", path("first/step_00000005.h5"), hf};
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  ASSERT_EQ(export_main(static_cast<int>(argv.size()), argv.data(), world), 0);
  const std::vector<std::string> init = {"--model.preset=", "--model.init=" + hf};
  std::vector<std::string> tp = init;
  tp.push_back("--mesh.tp=2");
  const RunResult serial = train("hf_serial", 1, init);
  const RunResult sharded = train("hf_tp", 2, tp);
  ASSERT_EQ(sharded.steps.size(), 10u);
  expect_serial(sharded.steps, serial.steps);
}

// The peak memory by kind of the last metrics line of `path` (mem_* fields, bytes).
MemorySplit memory_of(const std::string& path) {
  std::ifstream f(path);
  std::string line, last;
  while (std::getline(f, line)) last = line;
  const auto j = nlohmann::json::parse(last);
  return {j.at("mem_params").get<double>(), j.at("mem_grads").get<double>(),
          j.at("mem_optimizer").get<double>(), j.at("mem_activations").get<double>(),
          j.at("mem_workspace").get<double>()};
}

// The step log's memory report: ZeRO-3 over 4 ranks holds about a quarter of the serial run's
// optimizer state, and much less of its parameters and gradients (a shard plus the units in
// use: with 8 layers about 0.4 of the whole); the activations do not change.
TEST_F(ZeroStages, MemoryReportShowsTheShards) {
  // Eight layers: a shard plus one whole layer and the embedding is well under the whole model.
  train("serial", 1, {"--model.num_layers=8"});
  train("dp4_z3", 4, {"--model.num_layers=8", "--optim.zero_stage=3"});
  const MemorySplit one = memory_of(path("serial.jsonl")), four = memory_of(path("dp4_z3.jsonl"));
  if (test::world_rank() == 0)
    std::printf("serial: %s\nZeRO-3 dp 4: %s\n", one.describe().c_str(), four.describe().c_str());
  EXPECT_GT(one.params, 0);
  EXPECT_GT(one.activations, 0);
  EXPECT_NEAR(four.optimizer, one.optimizer / 4, 0.05 * one.optimizer);
  EXPECT_LT(four.params, 0.6 * one.params);
  EXPECT_LT(four.grads, 0.6 * one.grads);
  EXPECT_EQ(four.activations, one.activations);
}

// The metrics say where each step's time went: the batch, the forward and backward, the
// optimizer; on the first logged step (an interval of one step) together no more than the
// seconds since training began.
TEST_F(ZeroStages, MetricsSplitTheStepTime) {
  train("timed", 2, {"--optim.zero_stage=2"});
  std::ifstream f(path("timed.jsonl"));
  std::string first;
  ASSERT_TRUE(std::getline(f, first));
  const auto j = nlohmann::json::parse(first);
  ASSERT_EQ(j.at("step").get<int>(), 1);
  const double data = j.at("time_data_s").get<double>();
  const double compute = j.at("time_compute_s").get<double>();
  const double optimizer = j.at("time_optimizer_s").get<double>();
  EXPECT_GE(data, 0);
  EXPECT_GT(compute, 0);
  EXPECT_GT(optimizer, 0);
  EXPECT_LE(data + compute + optimizer, j.at("elapsed_s").get<double>());
}

// The metrics name each communicator's calls per step: ZeRO-2 reduce-scatters each unit's
// gradients every micro-batch and all-gathers its updated weights once a step over dp: the same
// bytes a call each way.
TEST_F(ZeroStages, MetricsTimeTheCollectives) {
  train("comm", 2, {"--optim.zero_stage=2", "--train.steps=2", "--log.every=2"});
  std::ifstream f(path("comm.jsonl"));
  std::string line, last;
  while (std::getline(f, line)) last = line;
  const auto comm = nlohmann::json::parse(last).at("comm");
  const auto& rs = comm.at("mpi.dp.reduce_scatter");
  const auto& ag = comm.at("mpi.dp.all_gather");
  EXPECT_GE(rs.at("calls").get<double>(), 1);
  EXPECT_GT(rs.at("ms").get<double>(), 0);
  EXPECT_GT(rs.at("mb").get<double>(), 0);
  EXPECT_DOUBLE_EQ(rs.at("mb").get<double>() / rs.at("calls").get<double>(),
                   ag.at("mb").get<double>() / ag.at("calls").get<double>());
  EXPECT_GT(rs.at("bus_gbs").get<double>(), 0);
}

// tests/train/fixtures/checkpoint_v1: a checkpoint written before the sharded state, and the
// losses of the run that wrote it. Resumed at any (dp, ZeRO), it continues that run.
TEST_F(ZeroStages, CheckpointWrittenBeforeTheShardedStateStillLoads) {
  const std::string dir = QT_FIXTURE_DIR "/checkpoint_v1";
  std::ifstream f(dir + "/deck.ini");
  ASSERT_TRUE(f) << dir << "/deck.ini";
  const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const std::vector<StepRecord> old = test::read_metrics(dir + "/old_run_metrics.jsonl");
  ASSERT_EQ(old.size(), 10u);
  struct Case {
    const char* name;
    int dp, zero;
  };
  for (const Case c : {Case{"dp1_z0", 1, 0}, Case{"dp2_z3", 2, 3}, Case{"dp4_z2", 4, 2}}) {
    SCOPED_TRACE(c.name);
    const RunResult r = run(c.dp, text,
                            {"--checkpoint.dir=" + path(c.name),
                             "--checkpoint.resume=" + dir + "/step_00000005.h5",
                             "--optim.zero_stage=" + std::to_string(c.zero),
                             "--train.micro_batch=" + std::to_string(4 / std::max(2, c.dp))},
                            path(std::string(c.name) + ".jsonl"));
    ASSERT_EQ(r.exit_code, 0) << r.error;
    ASSERT_EQ(r.steps.size(), 5u);
    EXPECT_EQ(r.steps.front().step, 6);
    expect_serial(r.steps, old, 6);
  }
}

}  // namespace
}  // namespace qt
