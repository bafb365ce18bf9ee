// LoRA in a pipeline on the CPU back end (issue 17), whole trainings under mpiexec -n 4 on a
// 4-layer tiny model with dropout on: each stage trains the adapters of its own layers over the
// frozen base of its units. Every pipeline mesh (1F1B, ZB-H1, interleaved, recompute, an uneven
// split, dp 2, tp 2, four stages, an untied lm head) gives the serial run's losses and adapters;
// a pipeline's checkpoint holds the global adapter tensors, so it resumes without the pipeline
// (and the reverse) on the serial run's losses, and its PEFT export is the serial run's.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "hf/export.h"
#include "hf/lora_export.h"
#include "hf/safetensors.h"
#include "model/lora.h"
#include "serial_compare.h"
#include "training_harness.h"

namespace qt {
namespace {

namespace fs = std::filesystem;
using test::run;
using test::run_seed;
using test::RunResult;
using test::StepRecord;

// Losses: against the serial run, fp32 sums in another order (dp's and tp's reductions, the
// gradient norm's over the stages). Adapters: AdamW amplifies those differences over 10 steps
// (B starts at zero: at lr 2e-2 tp 2 alone moved them by up to 3.5e-4 of the serial run's), so
// each pipeline's are compared with the run on its mesh without the pipeline (dp 1, 2 or tp 2),
// which sums in the same order but for the norm's partial sums over the stages.
constexpr double kLossTol = 1e-5, kAdapterTol = 1e-6;

std::string deck_text(const std::string& dir) {
  return "[model]\npreset = tiny\nnum_layers = 4\n"
         "[train]\nseq_len = 16\nmicro_batch = 2\nglobal_batch = 8\nsteps = 10\nseed = " +
         std::to_string(run_seed()) +
         "\n"
         "[optim]\nlr = 5e-3\nmin_lr = 5e-4\nwarmup_steps = 2\nweight_decay = 0.01\n"
         "[lora]\nr = 4\nalpha = 8\ndropout = 0.1\ntargets = all-linear\n"
         "[data]\nsource = synthetic\n"
         "[checkpoint]\ndir = " +
         dir + "\nevery = 5\nkeep = 4\nresume = none\n[log]\nevery = 1\n";
}

std::shared_ptr<MpiComm> world_comm() {
  return std::make_shared<MpiComm>(MPI_COMM_WORLD, "world", false);
}

using test::max_rel;        // serial_compare.h: losses at the steps both runs logged
using test::rel_norm_diff;  // ||a - b|| / ||b||

// The global adapters of a LoRA checkpoint, on every world rank.
std::vector<float> read_adapters(const std::string& ckpt) {
  const hf::CheckpointModel cm = hf::read_checkpoint_model(ckpt);
  EXPECT_TRUE(cm.lora.has_value()) << ckpt;
  if (!cm.lora) return {};
  return hf::read_lora_adapters(ckpt, cm, world_comm());
}

class LoraPipeline : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(test::world_size(), 4) << "run under mpiexec -n 4";
    tmp_ = test::shared_temp_dir("lora-pp");
  }
  void TearDown() override {
    MPI_Barrier(MPI_COMM_WORLD);
    if (test::world_rank() == 0) fs::remove_all(tmp_);
  }
  std::string path(const std::string& name) const { return tmp_ + "/" + name; }
  RunResult train(const std::string& name, int ranks, const std::vector<std::string>& overrides) {
    RunResult r = run(ranks, deck_text(path(name)), overrides, path(name + ".jsonl"));
    EXPECT_EQ(r.exit_code, 0) << name << ": " << r.error;
    return r;
  }
  std::string tmp_;
};

TEST_F(LoraPipeline, EveryScheduleReproducesTheSerialRun) {
  const RunResult serial = train("serial", 1, {});
  ASSERT_EQ(serial.steps.size(), 10u);
  // The meshes without the pipeline whose adapters the pipelines' are compared with.
  const RunResult dp2 = train("dp2", 2, {});
  const RunResult tp2 = train("tp2", 2, {"--mesh.tp=2"});
  const RunResult tp2_sp = train("tp2_sp", 2, {"--mesh.tp=2", "--mesh.sequence_parallel=true"});
  for (const RunResult* r : {&dp2, &tp2, &tp2_sp})
    EXPECT_LT(max_rel(r->steps, serial.steps), kLossTol);
  const std::string untied = "--model.tie_word_embeddings=false";
  const RunResult serial_untied = train("serial_untied", 1, {untied});
  struct Case {
    const char* name;
    int ranks;
    std::vector<std::string> overrides;
    const char* like = "serial";  // the run without the pipeline on the same dp and tp
  };
  const std::vector<Case> cases = {
      {"pp2", 2, {"--mesh.pp=2"}},
      {"pp2_zb", 2, {"--mesh.pp=2", "--mesh.pp_schedule=zb-h1"}},
      {"pp2_recompute", 2, {"--mesh.pp=2", "--train.recompute=true"}},
      // interleaved: chunks 0 and 2 on stage 0, 1 and 3 on stage 1 (two adapter ranges each)
      {"pp2_v2", 2, {"--mesh.pp=2", "--mesh.pp_chunks=2"}},
      {"pp2_v2_zb", 2, {"--mesh.pp=2", "--mesh.pp_chunks=2", "--mesh.pp_schedule=zb-h1"}},
      {"pp2_layers_3_1", 2, {"--mesh.pp=2", "--mesh.pp_layers=3,1"}},
      {"dp2_pp2", 4, {"--mesh.pp=2"}, "dp2"},
      {"dp2_pp2_z1", 4, {"--mesh.pp=2", "--optim.zero_stage=1"}, "dp2"},
      {"tp2_pp2", 4, {"--mesh.pp=2", "--mesh.tp=2"}, "tp2"},
      {"tp2_pp2_sp", 4, {"--mesh.pp=2", "--mesh.tp=2", "--mesh.sequence_parallel=true"}, "tp2_sp"},
      {"pp4", 4, {"--mesh.pp=4"}},
      // the lm head on the last stage only (tied: a copy of the table there, frozen alike)
      {"pp2_untied", 2, {"--mesh.pp=2", untied}, "serial_untied"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const RunResult r = train(c.name, c.ranks, c.overrides);
    ASSERT_EQ(r.steps.size(), 10u);
    const bool is_untied = std::string(c.like) == "serial_untied";
    const double losses = max_rel(r.steps, is_untied ? serial_untied.steps : serial.steps);
    const double adapters =
        rel_norm_diff(read_adapters(path(std::string(c.name) + "/step_00000010.h5")),
                      read_adapters(path(std::string(c.like) + "/step_00000010.h5")));
    if (test::world_rank() == 0)
      std::printf("%s: losses within %.3g of the serial run, adapters %.3g of the %s run\n",
                  c.name, losses, adapters, c.like);
    EXPECT_LT(losses, kLossTol);
    EXPECT_LT(adapters, kAdapterTol);
  }
}

// A pp 2 checkpoint (each stage wrote its layers' adapters and moments as global tensors)
// resumes on one rank, a serial one at dp 2 x pp 2, both on the serial run's losses; the pp 2
// run's PEFT export holds the serial run's tensors under the same names and shapes.
TEST_F(LoraPipeline, CheckpointsAndExportsAreTheSerialRuns) {
  const RunResult serial = train("serial", 1, {});
  const RunResult pp = train("pp", 2, {"--mesh.pp=2", "--mesh.pp_chunks=2"});
  ASSERT_EQ(serial.steps.size(), 10u);
  ASSERT_EQ(pp.steps.size(), 10u);
  const RunResult to_serial =
      train("to_serial", 1, {"--checkpoint.resume=" + path("pp/step_00000005.h5")});
  const RunResult to_pp = train("to_pp", 4, {"--checkpoint.resume=" +
                                                 path("serial/step_00000005.h5"),
                                             "--mesh.pp=2", "--optim.zero_stage=1"});
  for (const RunResult* r : {&to_serial, &to_pp}) {
    ASSERT_EQ(r->steps.size(), 5u);
    EXPECT_EQ(r->steps.front().step, 6);
    EXPECT_LT(max_rel(r->steps, serial.steps), kLossTol);
  }

  std::vector<std::vector<float>> exported(2);
  std::vector<std::string> names[2];
  for (int k = 0; k < 2; ++k) {
    hf::ExportOptions o;
    o.checkpoint = path(k == 0 ? "serial/step_00000010.h5" : "pp/step_00000010.h5");
    o.out_dir = path(k == 0 ? "out_serial" : "out_pp");
    hf::export_checkpoint(o, world_comm());
    hf::SafetensorsFile st(o.out_dir + "/adapter_model.safetensors");
    const hf::CheckpointModel cm = hf::read_checkpoint_model(o.checkpoint);
    ASSERT_TRUE(cm.lora.has_value());
    const ParamLayout lay = lora_layout(cm.cfg, cm.lora->config);
    for (const ParamInfo& p : lay.params()) {
      const hf::StTensor* t = st.find(p.name);
      ASSERT_NE(t, nullptr) << p.name;
      EXPECT_EQ(t->shape, p.shape) << p.name;
      std::vector<float> v(p.numel);
      st.read_rows_f32(*t, 0, t->rows(), v.data());
      exported[k].insert(exported[k].end(), v.begin(), v.end());
      names[k].push_back(p.name);
    }
    EXPECT_EQ(st.tensors().size(), lay.params().size());
  }
  EXPECT_EQ(names[0], names[1]);
  EXPECT_LT(rel_norm_diff(exported[1], exported[0]), kAdapterTol);
  // The pipeline's export is its checkpoint's adapters exactly.
  EXPECT_EQ(exported[1], read_adapters(path("pp/step_00000010.h5")));
}

}  // namespace
}  // namespace qt
