#include "train/tensorboard_log.h"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "qtrain/error.h"

namespace qt {

std::vector<EventFileWriter::Scalar> tensorboard_scalars(const StepMetrics& m) {
  constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
  std::vector<EventFileWriter::Scalar> s = {
      {"train/loss", m.loss},
      {"train/lr", m.lr},
      {"train/grad_norm", m.grad_norm},
      {"train/tokens", static_cast<double>(m.tokens)},
      {"train/skipped_steps", static_cast<double>(m.skipped_steps)},
      {"perf/tokens_per_s", m.tokens_per_s},
  };
  if (m.loss_scale > 0)
    s.insert(s.end(), {{"train/loss_scale", m.loss_scale},
                       {"train/overflow_steps", static_cast<double>(m.overflow_steps)}});
  if (m.pipeline_idle >= 0) s.push_back({"perf/pipeline_idle", m.pipeline_idle});
  s.insert(s.end(), {{"time/data_s", m.time.data},
                     {"time/compute_s", m.time.compute},
                     {"time/optimizer_s", m.time.optimizer},
                     {"memory/params_gib", m.peak.params / kGiB},
                     {"memory/grads_gib", m.peak.grads / kGiB},
                     {"memory/optimizer_gib", m.peak.optimizer / kGiB},
                     {"memory/activations_gib", m.peak.activations / kGiB},
                     {"memory/workspace_gib", m.peak.workspace / kGiB},
                     {"memory/total_gib", m.peak.total() / kGiB}});
  for (const StepMetrics::CommTime& c : m.comm) s.push_back({"comm/" + c.name + "_ms", c.ms});
  if (m.aux_loss >= 0) s.push_back({"moe/aux_loss", m.aux_loss});
  const ExpertLoadSummary load = summarize_expert_load(m.expert_load, m.num_experts);
  if (!load.cv.empty())
    s.insert(s.end(), {{"moe/expert_cv", load.mean_cv},
                       {"moe/expert_cv_max", load.worst_cv},
                       {"moe/expert_max_over_mean", load.worst_max_over_mean}});
  if (!m.expert_dropped.empty())  // model.moe_capacity_factor > 0
    s.push_back({"moe/dropped_fraction", dropped_fraction(m.expert_load, m.expert_dropped)});
  return s;
}

TensorBoardLog::TensorBoardLog(const std::string& dir, Comm& world) : dir_(dir) {
  std::string err;
  if (world.rank() == 0 && !dir.empty()) {
    const std::string why = file_.open(dir);
    if (!why.empty()) err = fmt::format("log.tensorboard = {}: {}", dir, why);
  }
  agree(world, err);
}

void TensorBoardLog::write_deck(std::int64_t step, const std::string& resolved) {
  if (file_.is_open()) check(file_.write_text(step, "config/deck", "```\n" + resolved + "```\n"));
}

void TensorBoardLog::write(const StepMetrics& m) {
  if (file_.is_open()) check(file_.write_scalars(m.step, tensorboard_scalars(m)));
}

void TensorBoardLog::write_eval_loss(std::int64_t step, double eval_loss) {
  if (file_.is_open())
    check(file_.write_scalars(step, {{"eval/loss", eval_loss},
                                     {"eval/perplexity", std::exp(eval_loss)}}));
}

void TensorBoardLog::write_samples(std::int64_t step, const std::vector<EvalSample>& samples) {
  if (!file_.is_open() || samples.empty()) return;
  std::string text;
  for (std::size_t i = 0; i < samples.size(); ++i)
    text += fmt::format("{}**sample {}** ({} new tokens)\n\n```\n{}\n```\n\ncontinued:\n\n```\n{}\n```\n",
                        i ? "\n" : "", i, samples[i].ids.size(), samples[i].prompt,
                        samples[i].continuation);
  check(file_.write_text(step, "eval/samples", text));
}

void TensorBoardLog::check(bool written) {
  if (written || warned_) return;
  warned_ = true;
  std::fprintf(stderr,
               "qtrain: warning: log.tensorboard = %s: writing the event file failed (%s); the "
               "run goes on without TensorBoard events\n",
               dir_.c_str(), std::strerror(errno));
}

}  // namespace qt
