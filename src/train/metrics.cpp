#include "train/metrics.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "qtrain/error.h"

namespace qt {

MetricsLog::MetricsLog(const std::string& path, Comm& world, bool append)
    : root_(world.rank() == 0) {
  std::string err;
  if (root_ && !path.empty()) {
    std::error_code ec;
    if (std::filesystem::is_directory(path, ec)) {
      err = fmt::format("log.metrics = {} is a directory; name a file (or leave it empty for none)",
                        path);
    } else {
      errno = 0;
      file_.open(path, append ? std::ios::app : std::ios::trunc);
      if (!file_)
        err = fmt::format("log.metrics = {}: cannot open it for writing{}{}", path,
                          errno != 0 ? ": " : "", errno != 0 ? std::strerror(errno) : "");
    }
  }
  agree(world, err);
}

std::vector<StepMetrics::CommTime> take_comm_times(Mesh& mesh, double steps) {
  const std::vector<Mesh::CommTimes> slots = mesh.take_collective_times();
  constexpr int kFields = 4;  // seconds, calls, bytes, bus_bytes
  std::vector<double> flat;
  for (const Mesh::CommTimes& s : slots)
    for (const CollectiveTime& t : s.times)
      flat.insert(flat.end(), {t.seconds, t.calls, t.bytes, t.bus_bytes});
  mesh.world().all_reduce(flat.data(), flat.size(), DType::kF64, ReduceOp::kMax);
  std::vector<StepMetrics::CommTime> out;
  const double n = std::max(1.0, steps);
  for (std::size_t i = 0; i < slots.size(); ++i)
    for (int k = 0; k < kNumCollectiveKinds; ++k) {
      const double* f = flat.data() + (i * kNumCollectiveKinds + k) * kFields;
      if (f[1] <= 0) continue;
      out.push_back({fmt::format("{}.{}", slots[i].name,
                                 collective_kind_name(static_cast<CollectiveKind>(k))),
                     1e3 * f[0] / n, f[1] / n, 1e-6 * f[2] / n, f[0] > 0 ? 1e-9 * f[3] / f[0] : 0});
    }
  return out;
}

std::string format_duration(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  const long t = std::lround(s);
  if (t >= 3600) return fmt::format("{}h{:02}m", t / 3600, (t / 60) % 60);
  if (t >= 60) return fmt::format("{}m{:02}s", t / 60, t % 60);
  return fmt::format("{}s", t);
}

namespace {
// [sparse layers x E] flat as rows of E, one a layer.
template <typename T>
nlohmann::json layer_rows(const std::vector<T>& v, int experts) {
  nlohmann::json rows = nlohmann::json::array();
  for (std::size_t at = 0; at + experts <= v.size(); at += experts)
    rows.push_back(std::vector<T>(v.begin() + at, v.begin() + at + experts));
  return rows;
}
}  // namespace

ExpertLoadSummary summarize_expert_load(const std::vector<double>& load, int experts) {
  ExpertLoadSummary s;
  if (experts < 1) return s;
  for (std::size_t at = 0; at + experts <= load.size(); at += experts) {
    double sum = 0, sq = 0, hi = 0;
    for (int e = 0; e < experts; ++e) {
      sum += load[at + e];
      hi = std::max(hi, load[at + e]);
    }
    const double mean = sum / experts;
    for (int e = 0; e < experts; ++e) sq += (load[at + e] - mean) * (load[at + e] - mean);
    s.cv.push_back(mean > 0 ? std::sqrt(sq / experts) / mean : 0.0);
    s.max_over_mean.push_back(mean > 0 ? hi / mean : 0.0);
    s.worst_cv = std::max(s.worst_cv, s.cv.back());
    s.worst_max_over_mean = std::max(s.worst_max_over_mean, s.max_over_mean.back());
  }
  for (double c : s.cv) s.mean_cv += c / static_cast<double>(s.cv.size());
  return s;
}

double dropped_fraction(const std::vector<double>& load, const std::vector<double>& dropped) {
  double routed = 0, lost = 0;
  for (double v : load) routed += v;
  for (double v : dropped) lost += v;
  return routed > 0 ? lost / routed : 0.0;
}

void MetricsLog::write(const StepMetrics& m) {
  if (!root_) return;
  const ExpertLoadSummary load = summarize_expert_load(m.expert_load, m.num_experts);
  const double dropped =
      m.expert_dropped.empty() ? 0.0 : dropped_fraction(m.expert_load, m.expert_dropped);
  std::string experts;
  if (!load.cv.empty()) {
    experts = fmt::format(" | expert load cv {:.3f} (worst layer {:.3f}), max/mean {:.2f}",
                          load.mean_cv, load.worst_cv, load.worst_max_over_mean);
    if (!m.expert_dropped.empty()) experts += fmt::format(", dropped {:.2f}%", 100 * dropped);
  }
  std::string safety = m.loss_scale > 0 ? fmt::format(" | loss scale {:g}", m.loss_scale) : "";
  if (m.overflow)
    safety += fmt::format(" | SKIPPED: fp16 overflow, nothing updated ({} of the run)",
                          m.overflow_steps);
  else if (m.skipped)
    safety += fmt::format(" | SKIPPED: not finite, nothing updated ({} of the run)",
                          m.skipped_steps);
  else if (m.loss_spike_mean > 0)
    safety += fmt::format(" | loss spike: {:.2f}x the recent mean {:.5f}",
                         m.loss / m.loss_spike_mean, m.loss_spike_mean);
  const std::string idle =
      safety + (m.aux_loss >= 0 ? fmt::format(" | aux {:.4f}", m.aux_loss) : "") + experts +
      (m.pipeline_idle >= 0 ? fmt::format(" | pipeline idle {:.1f}%", 100 * m.pipeline_idle) : "");
  std::printf("step %6lld/%lld | loss %.5f | lr %.3e | grad norm %.4f | %.0f tok/s | %s elapsed | ETA %s%s%s%s\n",
              static_cast<long long>(m.step), static_cast<long long>(m.steps), m.loss, m.lr,
              m.grad_norm, m.tokens_per_s, format_duration(m.elapsed_s).c_str(),
              format_duration(m.eta_s).c_str(), idle.c_str(), m.memory.empty() ? "" : " | ",
              m.memory.c_str());
  if (!memory_line_written_) {
    std::printf("peak memory per rank: %s (%s in all)\n", m.peak.describe().c_str(),
                format_bytes(m.peak.total()).c_str());
    memory_line_written_ = true;
  }
  std::fflush(stdout);
  if (!file_.is_open()) return;
  nlohmann::json j = {{"step", m.step},           {"loss", m.loss},
                      {"lr", m.lr},               {"grad_norm", m.grad_norm},
                      {"tokens_per_s", m.tokens_per_s}, {"elapsed_s", m.elapsed_s},
                      {"eta_s", m.eta_s},         {"tokens", m.tokens},
                      {"skipped", m.skipped},     {"skipped_steps", m.skipped_steps}};
  if (m.loss_spike_mean > 0) j["loss_spike_mean"] = m.loss_spike_mean;
  if (m.loss_scale > 0) {
    j["loss_scale"] = m.loss_scale;
    j["overflow"] = m.overflow;
    j["overflow_steps"] = m.overflow_steps;
  }
  if (!m.memory.empty()) j["memory"] = m.memory;
  if (m.pipeline_idle >= 0) j["pipeline_idle"] = m.pipeline_idle;
  if (m.aux_loss >= 0) j["aux_loss"] = m.aux_loss;
  if (!load.cv.empty()) {
    j["expert_tokens"] = layer_rows(m.expert_load, m.num_experts);
    j["expert_cv"] = load.cv;
    j["expert_max_over_mean"] = load.max_over_mean;
    if (!m.expert_dropped.empty()) {
      j["expert_dropped"] = m.expert_dropped;
      j["dropped_fraction"] = dropped;
    }
  }
  if (!m.router_bias.empty() && m.num_experts > 0)  // [sparse layers][E], as expert_tokens
    j["router_bias"] = layer_rows(m.router_bias, m.num_experts);
  j["mem_params"] = m.peak.params;
  j["mem_grads"] = m.peak.grads;
  j["mem_optimizer"] = m.peak.optimizer;
  j["mem_activations"] = m.peak.activations;
  j["mem_workspace"] = m.peak.workspace;
  j["time_data_s"] = m.time.data;
  j["time_compute_s"] = m.time.compute;
  j["time_optimizer_s"] = m.time.optimizer;
  if (!m.comm.empty()) {
    nlohmann::json comm = nlohmann::json::object();
    for (const StepMetrics::CommTime& c : m.comm)
      comm[c.name] = {{"ms", c.ms}, {"calls", c.calls}, {"mb", c.mb}, {"bus_gbs", c.bus_gbs}};
    j["comm"] = comm;
  }
  file_ << j.dump() << '\n';
  file_.flush();
}

void MetricsLog::write_eval(const EvalMetrics& e) {
  if (!root_) return;
  std::printf("eval step %lld: loss %.5f ppl %.4g over %lld tokens in %lld sequences (%.2f s)\n",
              static_cast<long long>(e.step), e.loss, e.perplexity(),
              static_cast<long long>(e.tokens), static_cast<long long>(e.sequences), e.seconds);
  std::fflush(stdout);
  if (!file_.is_open()) return;
  const nlohmann::json j = {{"step", e.step},         {"kind", "eval"},
                            {"eval_loss", e.loss},    {"eval_ppl", e.perplexity()},
                            {"eval_tokens", e.tokens}, {"eval_sequences", e.sequences},
                            {"eval_s", e.seconds}};
  file_ << j.dump() << '\n';
  file_.flush();
}

void MetricsLog::write_samples(std::int64_t step, const std::vector<EvalSample>& samples,
                               double seconds) {
  if (!root_) return;
  nlohmann::json list = nlohmann::json::array();
  for (std::size_t i = 0; i < samples.size(); ++i) {
    const EvalSample& s = samples[i];
    // JSON strings keep a sample on one line whatever its text holds (invalid UTF-8 replaced).
    const nlohmann::json p = s.prompt, c = s.continuation;
    using nlohmann::json;
    std::printf("sample %zu at step %lld: %s -> %s\n", i, static_cast<long long>(step),
                p.dump(-1, ' ', false, json::error_handler_t::replace).c_str(),
                c.dump(-1, ' ', false, json::error_handler_t::replace).c_str());
    list.push_back({{"prompt", s.prompt}, {"continuation", s.continuation}, {"ids", s.ids}});
  }
  std::fflush(stdout);
  if (!file_.is_open()) return;
  const nlohmann::json j = {
      {"step", step}, {"kind", "samples"}, {"samples", list}, {"samples_s", seconds}};
  file_ << j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << '\n';
  file_.flush();
}

}  // namespace qt
