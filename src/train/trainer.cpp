// The training loop. Per optimizer step, on each dp rank:
//   1. its global_batch / dp sequences, in micro-batches of micro_batch;
//   2. the counted tokens of the whole global batch (all-reduced) fix the loss normalisation, so
//      the loss is the mean over all counted tokens, whatever the mesh and micro-batching;
//   3. forward + backward per micro-batch, gradients accumulated;
//   4. AdamW: dp reduction (all-reduce, or reduce-scatter + all-gather under ZeRO-1), clipping;
//   5. log line, evaluation ([eval], train/evaluation.h), checkpoint every `checkpoint.every`
//      steps and at the end.
#include "train/trainer.h"

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fmt/format.h>
#include <vector>

#include "hf/weights.h"
#include "model/lora.h"
#include "model/qwen3.h"
#include "ops/moe_router.h"
#include "train/backend.h"
#include "train/evaluation.h"
#include "qtrain/checkpoint.h"
#include "qtrain/data.h"
#include "qtrain/error.h"
#include "train/host_memory.h"
#include "train/loss_scaling.h"
#include "train/loss_spike.h"
#include "train/metrics.h"
#include "train/run_checkpoints.h"
#include "train/tensorboard_log.h"

namespace qt {

namespace {

volatile std::sig_atomic_t g_stop_signal = 0;
// SIGTERM, SIGUSR1 and SIGINT ask for a checkpoint at the end of the step, then a clean stop. A
// second SIGINT (Ctrl-C twice) ends the process at once, as an interactive user expects; a
// second SIGTERM does not (batch systems may send one to every process of a job).
extern "C" void on_stop_signal(int sig) {
  if (sig == SIGINT && g_stop_signal == SIGINT) {
    std::signal(SIGINT, SIG_DFL);
    std::raise(SIGINT);
    return;
  }
  g_stop_signal = sig;
}

// QTRAIN_TEST_NONFINITE_STEPS = "S[@R],...": for tests, the gradients of step S (1-based, as the
// step log counts) become NaN, on world rank R only or on every rank (the micro-batches' loss
// scale is NaN there; the loss stays finite). Read once, before the first step: the steps this
// rank poisons.
std::vector<std::int64_t> poisoned_steps_for_test(int rank) {
  const char* env = std::getenv("QTRAIN_TEST_NONFINITE_STEPS");
  if (env == nullptr) return {};
  const std::string text = env;
  std::vector<std::int64_t> steps;
  for (std::size_t at = 0; at <= text.size();) {
    std::size_t end = text.find(',', at);
    if (end == std::string::npos) end = text.size();
    long long s = -1, r = -1;
    int used = 0;
    const std::string item = text.substr(at, end - at);
    const bool ok = (std::sscanf(item.c_str(), "%lld@%lld%n", &s, &r, &used) == 2 ||
                     std::sscanf(item.c_str(), "%lld%n", &s, &used) == 1) &&
                    used == static_cast<int>(item.size()) && s >= 1;
    if (!ok)
      fail_user("QTRAIN_TEST_NONFINITE_STEPS = '{}': expected S[@R],... with steps S >= 1", text);
    if (r < 0 || r == rank) steps.push_back(s);
    at = end + 1;
  }
  return steps;
}

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

}  // namespace

int run_training(const Deck& deck, Mesh& mesh) {
  const bool root = mesh.world_rank() == 0;
  Comm& dp = mesh.dp();
  const TrainConfig& tc = deck.train;
  const int B = tc.micro_batch, T = tc.seq_len;
  const int local_seqs = tc.global_batch / dp.size();
  const int micro_steps = local_seqs / B;
  QT_CHECK(local_seqs * dp.size() == tc.global_batch && micro_steps * B == local_seqs,
           "global batch {} does not split into dp {} x micro_batch {}", tc.global_batch,
           dp.size(), B);

  // Sizes that cannot be allocated stop here, with the numbers, on every rank.
  check_host_memory(mesh.world(), training_host_memory(deck, dp.size()), "this run");
  // A full checkpoint disk makes a write fail (and the run stop with exit 2) instead of killing
  // the process with SIGXFSZ where a file size limit (ulimit -f) applies.
  std::signal(SIGXFSZ, SIG_IGN);
  // The checkpoint directory is locked for the run before anything in it is read.
  RunCheckpoints checkpoints(deck, mesh);
  std::unique_ptr<TrainBackend> backend = make_backend(deck, mesh);
  const ParamLayout& layout = backend->layout();
  // What trains and what checkpoints hold: the model, or with [lora] its adapters alone (the
  // checkpoint then names the frozen base: model.init, or the model of train.seed).
  const ParamLayout& trained = backend->trained_layout();
  const LoraCheckpointInfo lora_info{deck.lora, LoraBase::of(deck.model_init, tc.seed)};
  const LoraCheckpointInfo* lora = deck.lora.enabled() ? &lora_info : nullptr;
  std::unique_ptr<DataSource> data = make_data_source(deck);
  Evaluation evaluation(deck, mesh);

  if (root) {
    const std::string model_name =
        deck.model_init.empty() ? deck.model.preset : "Hugging Face " + deck.model_init;
    std::printf("%s", mesh.describe(tc.device == "cuda").c_str());
    std::printf("model: %s, %lld parameters (%d layers, hidden %d, heads %d/%d, vocab %d)\n",
                model_name.c_str(), static_cast<long long>(layout.numel()),
                deck.model.num_layers, deck.model.hidden_size, deck.model.num_heads,
                deck.model.num_kv_heads, deck.model.vocab_size);
    if (deck.model.is_moe())
      std::printf("moe: %d of %d layers sparse, %d experts of width %d, %d a token%s; %.4g "
                  "parameters active a token; load-balancing loss weight %g%s\n",
                  deck.model.num_moe_layers(), deck.model.num_layers, deck.model.num_experts,
                  deck.model.moe_intermediate_size, deck.model.num_experts_per_tok,
                  deck.model.norm_topk_prob ? " (weights renormalised)" : "",
                  deck.model.active_params_f64(), deck.model.router_aux_loss_coef,
                  deck.model.moe_capacity_factor > 0
                      ? fmt::format("; capacity factor {:g}, overflow dropped",
                                    deck.model.moe_capacity_factor).c_str()
                      : "");
    if (lora)
      std::printf("lora: r %d, alpha %g (scale %g), dropout %g, targets %s: %lld trainable "
                  "parameters (%.3g%% of the model), base frozen\n",
                  deck.lora.r, deck.lora.alpha, deck.lora.scale(), deck.lora.dropout,
                  deck.lora.targets.c_str(), static_cast<long long>(trained.numel()),
                  100.0 * static_cast<double>(trained.numel()) / static_cast<double>(layout.numel()));
    std::printf("data: %s\n", data->describe().c_str());
    std::printf("%s", evaluation.describe().c_str());
    std::printf("back end: %s\n", backend->describe().c_str());
    std::printf("batch: %d sequences x %d tokens per step = %d micro-batches of %d on each of %d dp ranks; ZeRO-%d\n",
                tc.global_batch, T, micro_steps, B, dp.size(), deck.optim.zero_stage);
  } else {
    mesh.describe(tc.device == "cuda");  // collective
  }

  TrainState state;
  state.seed = tc.seed;
  const bool resumed = checkpoints.resume(trained, backend->checkpoint_targets(), state, lora);
  // A checkpoint wins over model.init: the HF weights start a run only at step 0. A LoRA
  // checkpoint holds only the adapters, so the frozen base is loaded every time.
  const bool load_base = !resumed || lora;
  if (load_base && !deck.model_init.empty()) {
    const std::string from = hf::load_params(deck.model_init, layout,
                                             backend->model_pieces(),
                                             deck.model.tie_word_embeddings, mesh.world());
    if (root) std::printf("initialised parameters from %s\n", from.c_str());
  } else if (load_base) {
    const unsigned threads = init_params_threads(layout);
    // Billions of parameters on one core take minutes (Qwen3-8B: over 6 under mpirun -np 1).
    if (root && layout.numel() > (std::size_t{1} << 30)) {
      std::printf("initialising %.2fB parameters on %u host thread(s)%s\n", layout.numel() * 1e-9,
                  threads,
                  threads > 1 ? ""
                              : " (this rank may run on one core only: mpirun binds ranks to cores "
                                "by default; --bind-to none or --map-by slot:PE=<cores> gives it more)");
      std::fflush(stdout);
    }
    init_params(deck.model, layout, tc.seed, backend->model_pieces());
    if (root) std::printf("initialised parameters from seed %llu\n", static_cast<unsigned long long>(tc.seed));
  } else if (root && !deck.model_init.empty()) {
    std::printf("model.init %s not loaded: the checkpoint's weights continue the run\n",
                deck.model_init.c_str());
  }
  if (lora && !resumed) {
    // The whole adapter buffer from the seed (small), then the pieces this rank holds.
    std::vector<float> adapters(trained.numel());
    lora_init(trained, tc.seed, adapters.data());
    for (const FlatPiece& p : backend->trained_pieces())
      std::copy(adapters.begin() + p.range.begin, adapters.begin() + p.range.end, p.data);
    if (root) std::printf("initialised LoRA adapters as PEFT does (B = 0: the base model's output)\n");
  }
  backend->push_state();
  // Auxiliary-loss-free balancing (docs/moe.md): the routers' bias [sparse layers, E] is
  // training state kept in `state` (checkpoints hold it); the host updates it after each step
  // from the global batch's expert load and hands it to the back end, so every rank holds the
  // same values. Zero at the start and when a checkpoint has none.
  const double bias_rate = deck.model.is_moe() ? deck.model.router_bias_update_rate : 0.0;
  const int bias_layers = deck.model.num_moe_layers(), E = deck.model.num_experts;
  if (bias_rate > 0) {
    if (state.router_bias.empty())
      state.router_bias.assign(static_cast<std::size_t>(bias_layers) * E, 0.0f);
    backend->set_router_bias(state.router_bias);
    if (root)
      std::printf("moe: auxiliary-loss-free balancing, router bias step %g a step (%s)\n",
                  bias_rate, resumed ? "bias from the checkpoint, zero if it had none" : "from 0");
  } else if (!state.router_bias.empty()) {
    if (root)
      std::printf("moe: the checkpoint's router bias is dropped (model.router_bias_update_rate "
                  "= 0): the routers choose by their probabilities alone\n");
    state.router_bias.clear();
  }
  const std::int64_t last = tc.stop_at > 0 ? std::min(tc.stop_at, tc.steps) : tc.steps;
  if (state.step >= last) {
    if (root) std::printf("nothing to do: step %lld already reached\n", static_cast<long long>(state.step));
    return 0;
  }

  for (int sig : {SIGTERM, SIGUSR1, SIGINT}) std::signal(sig, on_stop_signal);
  MetricsLog log(deck.log.metrics, mesh.world(), resumed);
  TensorBoardLog tensorboard(deck.log.tensorboard, mesh.world());
  tensorboard.write_deck(state.step, deck.resolved);
  // What a stop without a new checkpoint leaves, for its message.
  auto newest_kept = [&]() {
    return checkpoints.newest().empty() ? std::string("there is no earlier one")
                                        : "the newest, " + checkpoints.newest() + ", is kept";
  };
  // Writes the checkpoint of the current step; false (and a message) when the state is not
  // finite, in which case nothing was written or deleted.
  auto save = [&]() {
    backend->pull_state();
    try {
      const std::string path = checkpoints.save(trained, backend->checkpoint_pieces(), state,
                                                deck.model, deck.resolved, lora);
      if (root) std::printf("checkpoint written: %s\n", path.c_str());
      return true;
    } catch (const NonFiniteState& e) {
      if (root)
        std::fprintf(stderr,
                     "qtrain: error: %s; stopping without a checkpoint (%s): lower optim.lr or "
                     "check the data\n",
                     e.what(), newest_kept().c_str());
      return false;
    }
  };

  std::vector<std::int32_t> inputs(static_cast<std::size_t>(local_seqs) * T);
  std::vector<std::int32_t> targets(inputs.size());
  // RoPE positions [local_seqs, T]; passed on only when packing (null: plain causal, positions
  // 0..T-1, so the concat path is unchanged).
  std::vector<std::int32_t> positions(inputs.size());
  const bool packing = deck.data.packing != "concat";
  const auto t_start = Clock::now();
  auto t_log = t_start;
  std::int64_t tokens_since_log = 0;
  // Host seconds of each phase of the steps since the last log line (rank 0's): the batch (data,
  // counted tokens), the forward and backward of the micro-batches, the optimizer step.
  double data_s = 0, compute_s = 0, optimizer_s = 0;
  std::int64_t steps_since_log = 0;
  const std::int64_t first_step = state.step;

  // train.precision = fp16: the gradients' loss scale, from the checkpoint's state or afresh.
  LossScaling scaling(tc, state);
  if (root && scaling.on()) std::printf("%s\n", scaling.describe().c_str());
  int consecutive_skips = 0;  // steps skipped in a row (train.max_consecutive_skips; a dynamic
                              // loss scale's overflows are the scaler's to count)
  LossSpikeWatch spikes(tc.loss_spike_factor);
  const std::vector<std::int64_t> poisoned = poisoned_steps_for_test(mesh.world_rank());
  mesh.take_collective_times();  // the step log counts the steps' calls, not the start-up's
  while (state.step < last) {
    const std::int64_t step = state.step;
    auto phase = Clock::now();
    auto end_phase = [&phase](double& total) {
      const auto now = Clock::now();
      total += std::chrono::duration<double>(now - phase).count();
      phase = now;
    };
    // 1. This rank's sequences of the global batch.
    const std::int64_t base = state.samples_consumed + static_cast<std::int64_t>(dp.rank()) * local_seqs;
    for (int s = 0; s < local_seqs; ++s) {
      const std::size_t at = static_cast<std::size_t>(s) * T;
      data->sample(base + s, &inputs[at], &targets[at], &positions[at], T);
    }
    // 2. Counted tokens of the global batch.
    std::int64_t counted = 0;
    for (auto t : targets) counted += t != -100;
    counted = dp.sum(counted);
    end_phase(data_s);
    // 3. Forward and backward, gradients of S x sum(loss) / counted (S: fp16's loss scale, or 1).
    backend->zero_grads();
    double loss_sum = 0;
    const double S = scaling.scale();
    if (scaling.on()) backend->set_loss_scaling(S);
    float scale = counted > 0 ? static_cast<float>(S) * (1.0f / static_cast<float>(counted)) : 0.0f;
    if (std::find(poisoned.begin(), poisoned.end(), step + 1) != poisoned.end())
      scale = std::nanf("");
    loss_sum = backend->micro_batches({inputs.data(), targets.data(),
                                       packing ? positions.data() : nullptr, micro_steps, B, T,
                                       base},
                                      scale);
    end_phase(compute_s);
    // 4. Optimizer: nothing is updated when the loss or the gradient norm is not finite (both
    // are sums over the mesh, so every rank skips alike); AdamW's bias correction counts only
    // the updates applied.
    const double loss = counted > 0 ? dp.sum(loss_sum) / static_cast<double>(counted) : 0.0;
    const OptimStepStats os = backend->optimizer_step(
        {step, step + 1 - state.skipped_steps, std::isfinite(loss), S});
    const LossScaling::Outcome scaled = scaling.after_step(os.skipped, std::isfinite(loss));
    end_phase(optimizer_s);
    ++steps_since_log;
    // The batch counts as consumed either way: a resumed run does not see it again.
    state.step = step + 1;
    state.samples_consumed += tc.global_batch;
    state.tokens_consumed += counted;
    tokens_since_log += counted;
    if (scaled.overflow) {
      ++state.skipped_steps;
      if (!scaling.dynamic()) ++consecutive_skips;  // a static scale cannot mend it
      if (root)
        std::fprintf(stderr, "qtrain: warning: %s\n",
                     LossScaling::overflow_text(state.step, scaled).c_str());
    } else if (os.skipped) {
      ++state.skipped_steps;
      ++consecutive_skips;
      if (root)
        std::fprintf(stderr,
                     "qtrain: warning: step %lld skipped: the loss is %g and the gradient norm %g "
                     "(parameters and optimizer state unchanged; %d in a row, %lld in the run; "
                     "train.max_consecutive_skips = %d)\n",
                     static_cast<long long>(state.step), loss, os.grad_norm, consecutive_skips,
                     static_cast<long long>(state.skipped_steps), tc.max_consecutive_skips);
    } else {
      consecutive_skips = 0;
    }
    const bool spike = !os.skipped && spikes.observe(loss);
    if (spike && root)
      std::fprintf(stderr,
                   "qtrain: warning: loss spike at step %lld: %.5f against a recent mean of %.5f "
                   "(%.2fx; train.loss_spike_factor = %g)\n",
                   static_cast<long long>(state.step), loss, spikes.mean_before(),
                   loss / spikes.mean_before(), tc.loss_spike_factor);
    // 5. Log, checkpoint, stop on request.
    // Every log.every steps, the first step of the process (the loss at the start), the last, and
    // every skipped step or spike.
    const bool log_now = state.step % deck.log.every == 0 || state.step == first_step + 1 ||
                         state.step == last || os.skipped || spike;
    // The step's expert load summed over dp (each rank's own tokens; a pipeline's stages already
    // summed): read every step for the bias, else only for the log.
    std::vector<double> load;
    if (bias_rate > 0 || log_now) {
      load = backend->moe_load();
      if (!load.empty()) dp.all_reduce(load.data(), load.size(), DType::kF64, ReduceOp::kSum);
    }
    if (bias_rate > 0 && !os.skipped) {  // a skipped step changes no state, the bias neither
      QT_CHECK(load.size() == state.router_bias.size(), "expert load of {} values, bias of {}",
               load.size(), state.router_bias.size());
      cpu::router_bias_update(state.router_bias.data(), load.data(), bias_layers, E, bias_rate);
      backend->set_router_bias(state.router_bias);
    }
    if (log_now) {
      StepMetrics sm;
      sm.step = state.step;
      sm.steps = tc.steps;
      sm.loss = loss;
      sm.lr = os.lr;
      sm.grad_norm = os.grad_norm;
      sm.skipped = os.skipped;
      sm.skipped_steps = state.skipped_steps;
      sm.loss_scale = scaling.on() ? S : 0;
      sm.overflow = scaled.overflow;
      sm.overflow_steps = state.overflow_steps;
      if (spike) sm.loss_spike_mean = spikes.mean_before();
      sm.elapsed_s = seconds_since(t_start);
      sm.tokens_per_s = tokens_since_log / std::max(1e-9, seconds_since(t_log));
      sm.eta_s = sm.elapsed_s / static_cast<double>(state.step - first_step) * static_cast<double>(last - state.step);
      sm.tokens = state.tokens_consumed;
      sm.memory = backend->memory_report();
      sm.pipeline_idle = backend->pipeline_idle();
      // Qwen3-MoE: the mean load-balancing loss of the step's micro-batches on every dp rank.
      const double aux_sum = backend->moe_aux_loss_sum();
      sm.aux_loss =
          aux_sum >= 0 ? dp.sum(aux_sum) / static_cast<double>(micro_steps * dp.size()) : -1;
      sm.expert_load = std::move(load);  // this step's, summed over dp
      if (!sm.expert_load.empty()) sm.num_experts = deck.model.num_experts;
      if (deck.model.is_moe() && deck.model.moe_capacity_factor > 0) {  // summed over dp too
        sm.expert_dropped = backend->moe_dropped();
        if (!sm.expert_dropped.empty())
          dp.all_reduce(sm.expert_dropped.data(), sm.expert_dropped.size(), DType::kF64,
                        ReduceOp::kSum);
      }
      sm.router_bias = state.router_bias;
      const MemorySplit mine = backend->memory_split();
      double peak[5] = {mine.params, mine.grads, mine.optimizer, mine.activations, mine.workspace};
      mesh.world().all_reduce(peak, 5, DType::kF64, ReduceOp::kMax);  // the largest rank's
      sm.peak = {peak[0], peak[1], peak[2], peak[3], peak[4]};
      const double n = static_cast<double>(steps_since_log);
      sm.time = {data_s / n, compute_s / n, optimizer_s / n};
      sm.comm = take_comm_times(mesh, n);
      log.write(sm);
      tensorboard.write(sm);
      t_log = Clock::now();
      tokens_since_log = 0;
      data_s = compute_s = optimizer_s = 0;
      steps_since_log = 0;
    }
    if (scaled.change == LossScaler::Change::kStuck) {
      if (root)
        std::fprintf(stderr,
                     "qtrain: error: the fp16 gradients overflow at the minimum loss scale "
                     "train.min_loss_scale = %g; stopping at step %lld without a new checkpoint "
                     "(%s): lower optim.lr, check the data, or train in bf16\n",
                     tc.min_loss_scale, static_cast<long long>(state.step), newest_kept().c_str());
      return 3;
    }
    if (consecutive_skips >= tc.max_consecutive_skips) {
      if (root)
        std::fprintf(stderr,
                     "qtrain: error: %d steps in a row had a non-finite loss or gradient norm "
                     "(train.max_consecutive_skips = %d); stopping at step %lld without a new "
                     "checkpoint (%s): lower optim.lr, check the data, or resume from it\n",
                     consecutive_skips, tc.max_consecutive_skips,
                     static_cast<long long>(state.step), newest_kept().c_str());
      return 3;
    }
    double stop_requested = g_stop_signal;
    stop_requested = mesh.world().max(stop_requested);
    const bool periodic = deck.checkpoint.every > 0 && state.step % deck.checkpoint.every == 0;
    const bool saving = deck.checkpoint.every >= 0;
    if (saving && (periodic || state.step == last || stop_requested > 0) && !save()) return 3;
    // Evaluation after the step's checkpoint, so that a failing evaluation (rank 0's memory for
    // the gathered model, a decoding error) cannot cost the step's work; not in tokens/s.
    if (evaluation.due(state.step, last))
      t_log += std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(
          evaluation.run(state.step, last, *backend, log, tensorboard)));
    if (stop_requested > 0) {
      if (root) std::printf("stopping at step %lld on signal %d; resume with checkpoint.resume = auto\n",
                            static_cast<long long>(state.step), static_cast<int>(stop_requested));
      return 0;
    }
  }
  if (root && state.skipped_steps > 0)
    std::printf("%lld of the run's %lld steps were skipped (non-finite loss or gradient norm%s)\n",
                static_cast<long long>(state.skipped_steps), static_cast<long long>(state.step),
                state.overflow_steps > 0
                    ? fmt::format("; {} of them fp16 overflows", state.overflow_steps).c_str()
                    : "");
  if (root && !std::isnan(data->loss_floor()))
    std::printf("loss floor of the synthetic data: %.5f nats\n", data->loss_floor());
  return 0;
}

}  // namespace qt
