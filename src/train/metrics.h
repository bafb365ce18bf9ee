// Step log: one line per log.every steps on rank 0's stdout, and the same fields as JSON lines.
#pragma once

#include <cmath>
#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

#include "qtrain/comm.h"
#include "qtrain/mesh.h"
#include "runtime/memory.h"

namespace qt {

struct StepMetrics {
  std::int64_t step = 0;       // optimizer steps completed
  std::int64_t steps = 0;      // steps of the run
  double loss = 0;             // mean cross-entropy over counted tokens of the global batch (nats)
  double lr = 0;
  double grad_norm = 0;
  bool skipped = false;        // this step updated nothing: its loss or gradient norm was not
                               // finite (train.max_consecutive_skips)
  std::int64_t skipped_steps = 0;  // such steps of the run so far (checkpoints carry it)
  double loss_scale = 0;       // train.precision = fp16: the step's loss scale; 0: none
  bool overflow = false;       // fp16: skipped because its gradients overflowed (the loss was finite)
  std::int64_t overflow_steps = 0;  // fp16: such steps of the run so far
  double loss_spike_mean = 0;  // > 0: the loss spiked against this recent mean
                               // (train.loss_spike_factor)
  double tokens_per_s = 0;     // counted tokens per second over the last log interval
  double elapsed_s = 0;        // since this process started training
  double eta_s = 0;
  std::int64_t tokens = 0;     // counted tokens consumed by the run so far
  std::string memory;          // back end's memory report (e.g. GPU current/peak), may be empty
  MemorySplit peak;            // the largest rank's peak memory by kind (bytes)
  double pipeline_idle = -1;   // the last step's pipeline bubble (TrainBackend::pipeline_idle), or
                               // < 0: none measured
  double aux_loss = -1;        // Qwen3-MoE: the step's mean load-balancing loss (k when
                               // balanced), or < 0: a dense model
  int num_experts = 0;         // Qwen3-MoE: E; with expert_load [sparse layers x E], the step's
  std::vector<double> expert_load;  // token-slots routed to each expert, all dp ranks
  std::vector<double> expert_dropped;  // model.moe_capacity_factor > 0: [sparse layers] the
                                       // token-slots the capacity dropped, all dp ranks; else
                                       // empty
  std::vector<float> router_bias;   // auxiliary-loss-free balancing: [sparse layers x E] after
                                    // the step, or empty
  struct StepTime {            // rank 0's host seconds per step over the last log interval
    double data = 0;           // the batch: sampling and the count of its targets
    double compute = 0;        // the micro-batches' forward and backward
    double optimizer = 0;      // the optimizer step (reduction, norm, update, gathers it waits for)
  } time;
  struct CommTime {            // one communicator's calls of one kind, per step over the interval
    std::string name;          // "<communicator>.<kind>", e.g. "dp.reduce_scatter"
    double ms = 0;             // the slowest rank's time in them (device: kernel time, overlapping
                               // computation)
    double calls = 0, mb = 0;  // calls and MB (10^6 bytes, comm.h's sizes) on that rank
    double bus_gbs = 0;        // bus bandwidth, GB/s (comm.h's bus_bytes / time)
  };
  std::vector<CommTime> comm;  // kinds with calls only
};

// An evaluation of the held-out loss (train/evaluation.h).
struct EvalMetrics {
  std::int64_t step = 0;       // optimizer steps completed
  double loss = 0;             // mean cross-entropy over the held-out counted tokens (nats)
  std::int64_t tokens = 0;     // counted tokens evaluated
  std::int64_t sequences = 0;  // held-out sequences evaluated
  double seconds = 0;          // wall time of the evaluation
  double perplexity() const { return std::exp(loss); }
};

// A prompt of eval.samples and its greedy continuation: the tokens' bytes (not always whole
// UTF-8) and their ids.
struct EvalSample {
  std::string prompt, continuation;
  std::vector<std::int32_t> ids;
};

// Every communicator's time per step since the last call, over `steps` steps: the mesh's
// take_collective_times, the largest value of each figure over the world's ranks. Collective
// over mesh.world().
std::vector<StepMetrics::CommTime> take_comm_times(Mesh& mesh, double steps);

// The balance of each sparse layer's expert load: the coefficient of variation (population std /
// mean) and max / mean of the tokens per expert; load [layers x experts] flat.
struct ExpertLoadSummary {
  std::vector<double> cv, max_over_mean;  // [layers]
  double mean_cv = 0, worst_cv = 0;       // over the layers (0 without any)
  double worst_max_over_mean = 0;
};
ExpertLoadSummary summarize_expert_load(const std::vector<double>& load, int experts);

// The share of the routed token-slots (load, every layer's) that were dropped (dropped, every
// layer's); 0 when none were routed.
double dropped_fraction(const std::vector<double>& load, const std::vector<double>& dropped);

class MetricsLog {
 public:
  // Collective over `world`: rank 0 opens `path` (append: keep an existing file, for resumed
  // runs); when it cannot, every rank throws the same UserError. Only rank 0 writes.
  MetricsLog(const std::string& path, Comm& world, bool append);
  // The step line (and, on the run's first logged step, a line with the peak memory by kind) on
  // stdout, and the JSON line with every field (mem_params, mem_grads, mem_optimizer,
  // mem_activations, mem_workspace in bytes; time_data_s, time_compute_s, time_optimizer_s;
  // pipeline_idle, a fraction, when measured; comm, {name: {ms, calls, mb, bus_gbs}} per step;
  // for Qwen3-MoE aux_loss and, per sparse layer, expert_tokens, expert_cv and
  // expert_max_over_mean, and router_bias with auxiliary-loss-free balancing; the step line adds
  // the mean and the worst layer's cv and the largest max / mean). With expert_dropped, the
  // file's expert_dropped per sparse layer and dropped_fraction (dropped / routed token-slots,
  // all layers), and the step line's "dropped X.XX%". Numerical safety: skipped (bool) and
  // skipped_steps (the run's so far), loss_spike_mean with a spike; a non-finite loss or norm is
  // written as null. fp16: loss_scale, overflow (bool) and overflow_steps; the step line's
  // "loss scale S" and, on an overflow, "SKIPPED: fp16 overflow".
  void write(const StepMetrics& m);
  // The evaluation line on stdout ("eval step S: loss L ppl P over N tokens in K sequences
  // (X s)") and a JSON line {"step", "kind": "eval", "eval_loss", "eval_ppl", "eval_tokens",
  // "eval_sequences", "eval_s"}.
  void write_eval(const EvalMetrics& e);
  // One stdout line a sample (prompt and continuation as JSON strings) and a JSON line
  // {"step", "kind": "samples", "samples": [{"prompt", "continuation", "ids"}],
  // "samples_s"}.
  void write_samples(std::int64_t step, const std::vector<EvalSample>& samples, double seconds);

 private:
  bool root_;
  bool memory_line_written_ = false;
  std::ofstream file_;
};

std::string format_duration(double seconds);

}  // namespace qt
