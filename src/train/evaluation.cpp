// Evaluation during training (evaluation.h): the held-out loss over dp, the gathered model's
// greedy samples on rank 0.
#include "train/evaluation.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>

#include "generate/decode.h"
#include "generate/kv_decoder.h"
#include "generate/sampler.h"
#include "io/redistribute.h"
#include "model/lora.h"
#include "qtrain/error.h"

namespace qt {

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// The order of a held-out file's sequences (DataSource::sample's seed): fixed, so that runs of any
// train.seed evaluate the same sequences, also under eval.max_sequences.
constexpr std::uint64_t kEvalOrderSeed = 0;

// Rank 0 of `world`: the buffer of `numel` elements from every rank's pieces (flat ranges; where
// two ranks hold an element they hold the same value); empty elsewhere.
std::vector<float> gathered(const std::vector<ConstFlatPiece>& mine, std::size_t numel,
                            Comm& world, const char* what) {
  std::vector<float> out(world.rank() == 0 ? numel : 0);
  gather_pieces(world, numel, mine, out.data(), what);
  return out;
}

// A line of eval.samples as its prompt: `\n` a newline (a chat template's turns), `\\` a
// backslash; any other backslash stays as it is.
std::string prompt_of_line(const std::string& line) {
  std::string out;
  for (std::size_t i = 0; i < line.size(); ++i) {
    const char next = i + 1 < line.size() ? line[i + 1] : '\0';
    if (line[i] == '\\' && (next == 'n' || next == '\\')) {
      out += next == 'n' ? '\n' : '\\';
      ++i;
    } else {
      out += line[i];
    }
  }
  return out;
}

}  // namespace

std::vector<float> gather_model(TrainBackend& backend, Mesh& mesh, const Deck& deck) {
  backend.pull_state();
  Comm& world = mesh.world();
  // The trained state's pieces: over all ranks each element once.
  auto trained = [&backend] {
    std::vector<ConstFlatPiece> out;
    for (const StatePiece& p : backend.checkpoint_pieces()) out.push_back({p.range, p.params});
    return out;
  };
  if (!deck.lora.enabled()) return gathered(trained(), backend.layout().numel(), world, "the model");
  // LoRA: the frozen base, whole on each expert-data-parallel group's first rank (the dense
  // weights also on every ep rank, the same values); then the adapters, merged on rank 0.
  std::vector<ConstFlatPiece> base;
  if (mesh.edp().rank() == 0)
    for (const FlatPiece& p : backend.model_pieces()) base.push_back({p.range, p.data});
  std::vector<float> model = gathered(base, backend.layout().numel(), world, "the LoRA base");
  const std::vector<float> adapters =
      gathered(trained(), backend.trained_layout().numel(), world, "the adapters");
  if (world.rank() == 0)
    lora_merge(deck.model, deck.lora, adapters.data(), backend.layout(), model.data());
  return model;
}

Evaluation::Evaluation(const Deck& deck, Mesh& mesh) : deck_(deck), mesh_(mesh) {
  const EvalConfig& e = deck.eval;
  std::string err;
  try {
    // Every rank opens the held-out files itself, as it does data.path.
    const int V = deck.model.vocab_size, T = deck.train.seq_len;
    const Packing packing = packing_from_name(deck.data.packing);
    for (const std::string& p : split_eval_paths(e.paths)) {
      try {
        sources_.push_back(open_token_file(p, V, T, kEvalOrderSeed, packing));
      } catch (const UserError& x) {
        fail_user("eval.paths: {}", x.what());
      }
    }
    // data.path's held-out part opens the file again on purpose: each source owns its handle,
    // order and lock (none shared with the trainer's), for a second validating scan at start-up.
    if (e.split > 0)
      sources_.push_back(open_token_file(deck.data.path, V, T, kEvalOrderSeed, packing,
                                         {TokenSplit::Part::kHeldOut, e.split}));
    first_.push_back(0);
    for (const auto& s : sources_) first_.push_back(first_.back() + s->epoch_size());
    count_ = e.max_sequences > 0 ? std::min<std::int64_t>(e.max_sequences, first_.back())
                                 : first_.back();
    if (e.samples_on() && mesh.world_rank() == 0) {
      tokenizer_dir_ = e.tokenizer.empty() ? deck.model_init : e.tokenizer;
      const std::string key = e.tokenizer.empty() ? "model.init" : "eval.tokenizer";
      try {
        tokenizer_ = std::make_unique<Tokenizer>(Tokenizer::from_dir(tokenizer_dir_));
        stop_ = gen::stop_tokens(*tokenizer_, deck.model_init, tokenizer_dir_);
      } catch (const UserError& x) {
        fail_user("eval.samples' tokenizer ({} = {}): {}", key, tokenizer_dir_, x.what());
      }
      std::ifstream in(e.samples, std::ios::binary);
      std::string line;
      for (int n = 1; std::getline(in, line); ++n) {
        if (!line.empty() && line.back() == '\r') line.pop_back();
        if (line.empty()) continue;
        line = prompt_of_line(line);
        std::vector<std::int32_t> ids = tokenizer_->encode(line);
        const std::string at = fmt::format("eval.samples = {}, line {}", e.samples, n);
        if (ids.empty()) fail_user("{}: the prompt has no tokens", at);
        for (std::int32_t id : ids)
          if (id >= deck.model.vocab_size)
            fail_user("{}: token id {} is outside the model's vocabulary of {}: tokenizer {} "
                      "does not belong to this model (eval.tokenizer)",
                      at, id, deck.model.vocab_size, tokenizer_dir_);
        if (static_cast<std::int64_t>(ids.size()) >= deck.model.max_position_embeddings)
          fail_user("{}: the prompt has {} tokens; the model allows {} positions "
                    "(model.max_position_embeddings)",
                    at, ids.size(), deck.model.max_position_embeddings);
        prompts_.push_back(line);
        prompt_ids_.push_back(std::move(ids));
      }
      if (in.bad()) fail_user("eval.samples = {}: read error", e.samples);
      if (prompts_.empty()) fail_user("eval.samples = {}: no prompt (every line is empty)", e.samples);
    }
  } catch (const UserError& x) {
    err = x.what();
  }
  agree(mesh.world(), err);  // rank 0's prompt check reaches every rank
}

std::string Evaluation::describe() const {
  const EvalConfig& e = deck_.eval;
  std::string out;
  if (e.loss_on()) {
    out += fmt::format("eval: the loss over {} held-out sequences of {} tokens{}, ", count_,
                       deck_.train.seq_len,
                       count_ < first_.back()
                           ? fmt::format(" (of {}; eval.max_sequences)", first_.back())
                           : "");
    out += e.every > 0 ? fmt::format("every {} steps and at the end\n", e.every)
                       : std::string("at the end\n");
    for (const auto& s : sources_) out += "  " + s->describe() + "\n";
  }
  if (e.samples_on())
    out += fmt::format("eval: greedy samples of {} prompt(s) from {} (up to {} new tokens, "
                       "tokenizer {}), {}\n",
                       prompts_.size(), e.samples, e.max_new_tokens, tokenizer_dir_,
                       e.samples_every > 0
                           ? fmt::format("every {} steps and at the end", e.samples_every)
                           : std::string("at the end"));
  return out;
}

bool Evaluation::loss_due(std::int64_t step, std::int64_t last) const {
  const EvalConfig& e = deck_.eval;
  return e.loss_on() && ((e.every > 0 && step % e.every == 0) || step == last);
}

bool Evaluation::samples_due(std::int64_t step, std::int64_t last) const {
  const EvalConfig& e = deck_.eval;
  return e.samples_on() && ((e.samples_every > 0 && step % e.samples_every == 0) || step == last);
}

bool Evaluation::due(std::int64_t step, std::int64_t last) const {
  return loss_due(step, last) || samples_due(step, last);
}

double Evaluation::run(std::int64_t step, std::int64_t last, TrainBackend& backend,
                       MetricsLog& log, TensorBoardLog& tensorboard) {
  const auto t0 = Clock::now();
  if (loss_due(step, last)) {
    const EvalMetrics m = loss(step, backend);
    log.write_eval(m);
    tensorboard.write_eval_loss(step, m.loss);
  }
  if (samples_due(step, last)) {
    const auto t1 = Clock::now();
    const std::vector<EvalSample> s = samples(backend);
    log.write_samples(step, s, seconds_since(t1));
    tensorboard.write_samples(step, s);
  }
  return seconds_since(t0);
}

void Evaluation::sequence(std::int64_t g, std::int32_t* inputs, std::int32_t* targets,
                          std::int32_t* positions) const {
  const auto s = std::upper_bound(first_.begin(), first_.end(), g) - first_.begin() - 1;
  sources_.at(static_cast<std::size_t>(s))
      ->sample(g - first_[static_cast<std::size_t>(s)], inputs, targets, positions,
               deck_.train.seq_len);
}

EvalMetrics Evaluation::loss(std::int64_t step, TrainBackend& backend) {
  const auto t0 = Clock::now();
  Comm& dp = mesh_.dp();
  const TrainConfig& tc = deck_.train;
  const int B = tc.micro_batch, T = tc.seq_len;
  // Rounds in the shape of a training step on this dp rank: `local` sequences, micro-batches of B.
  const int local = tc.global_batch / dp.size();
  const std::int64_t share = (count_ + dp.size() - 1) / dp.size();
  const std::int64_t begin = std::min(count_, share * dp.rank());
  const std::int64_t end = std::min(count_, begin + share);
  const std::int64_t rounds = (share + local - 1) / local;  // the same on every rank
  const std::size_t n = static_cast<std::size_t>(local) * T;
  std::vector<std::int32_t> inputs(n), targets(n), positions(n);  // [local, T]
  const bool packing = deck_.data.packing != "concat";
  double loss_sum = 0;
  std::int64_t counted = 0;
  for (std::int64_t r = 0; r < rounds; ++r) {
    for (int s = 0; s < local; ++s) {
      const std::int64_t g = begin + r * local + s;
      const std::size_t at = static_cast<std::size_t>(s) * T;
      if (g < end) {
        sequence(g, &inputs[at], &targets[at], &positions[at]);
        continue;
      }
      // Padding beyond this rank's share: no counted target, a valid row of positions.
      for (int t = 0; t < T; ++t) inputs[at + t] = 0, targets[at + t] = -100, positions[at + t] = t;
    }
    for (std::int32_t t : targets) counted += t != -100;
    loss_sum += backend.eval_loss(
        {inputs.data(), targets.data(), packing ? positions.data() : nullptr, local / B, B, T, 0});
  }
  EvalMetrics m;
  m.step = step;
  m.tokens = dp.sum(counted);
  m.loss = m.tokens > 0 ? dp.sum(loss_sum) / static_cast<double>(m.tokens)
                        : std::numeric_limits<double>::quiet_NaN();
  m.sequences = count_;
  m.seconds = seconds_since(t0);
  return m;
}

std::vector<EvalSample> Evaluation::samples(TrainBackend& backend) {
  const std::vector<float> params = gather_model(backend, mesh_, deck_);
  std::vector<EvalSample> out;
  if (mesh_.world_rank() == 0) {
    const ModelConfig& cfg = deck_.model;
    const std::int64_t max_new = deck_.eval.max_new_tokens;
    // Ids past the tokenizer's (padding rows of the embedding) are never drawn, as in generate.
    const int allowed = std::min(cfg.vocab_size, tokenizer_->vocab_size());
    for (std::size_t i = 0; i < prompts_.size(); ++i) {
      const std::vector<std::int32_t>& prompt = prompt_ids_[i];
      const std::int64_t room =
          cfg.max_position_embeddings - static_cast<std::int64_t>(prompt.size());
      gen::KvDecoder dec(cfg, params.data(),
                         static_cast<int>(prompt.size() + std::min(room, max_new)));
      gen::Sampler greedy(0.0, 1.0, 0);
      std::vector<std::int32_t> ids;
      gen::decode(dec, greedy, prompt, max_new, stop_, allowed,
                  [&ids](std::int32_t t) { ids.push_back(t); });
      out.push_back({prompts_[i], tokenizer_->decode(ids), std::move(ids)});
    }
  }
  mesh_.world().barrier();  // the other ranks wait for rank 0's decoding
  return out;
}

}  // namespace qt
