// log.tensorboard: the step log's figures as a TensorBoard event file (io/event_file.h) that rank
// 0 writes in a directory beside the JSON lines; `tensorboard --logdir DIR` shows them
// (docs/monitoring.md lists the tags).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "io/event_file.h"
#include "qtrain/comm.h"
#include "train/metrics.h"

namespace qt {

// The scalars of one logged step, TensorBoard tag and value: train/loss, train/lr,
// train/grad_norm, train/tokens, train/skipped_steps, train/loss_scale and train/overflow_steps
// (train.precision = fp16), perf/tokens_per_s, perf/pipeline_idle (when measured),
// time/{data,compute,optimizer}_s, memory/{params,grads,optimizer,activations,workspace,total}_gib
// (the largest rank's peak, GiB), comm/<communicator.kind>_ms for each kind of call made, and for
// Qwen3-MoE moe/aux_loss, moe/expert_cv (the mean over sparse layers), moe/expert_cv_max and
// moe/expert_max_over_mean (the largest).
std::vector<EventFileWriter::Scalar> tensorboard_scalars(const StepMetrics& m);

class TensorBoardLog {
 public:
  // Collective over `world`: with a non-empty `dir`, rank 0 creates it when missing and a new
  // event file in it (a resumed run adds a file; TensorBoard merges them); when it cannot, every
  // rank throws the same UserError. An empty `dir` writes nothing. Only rank 0 writes.
  TensorBoardLog(const std::string& dir, Comm& world);

  // The resolved deck as text, tag config/deck, at `step` (the run's first: 0, or the step it
  // resumed from), in a Markdown code block so that TensorBoard shows it verbatim.
  void write_deck(std::int64_t step, const std::string& resolved);
  // tensorboard_scalars(m) at m.step.
  void write(const StepMetrics& m);

  // The evaluation (train/evaluation.h): the held-out loss as eval/loss and its perplexity as
  // eval/perplexity; the prompts of eval.samples with their continuations as text eval/samples.
  void write_eval_loss(std::int64_t step, double eval_loss);
  void write_samples(std::int64_t step, const std::vector<EvalSample>& samples);

 private:
  void check(bool written);  // warns once, on rank 0, when a write failed

  std::string dir_;
  EventFileWriter file_;
  bool warned_ = false;
};

}  // namespace qt
