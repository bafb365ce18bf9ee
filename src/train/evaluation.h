// [eval] during training (docs/monitoring.md, "Evaluation"):
//   - the held-out loss: the mean cross-entropy over every counted token of the held-out
//     sequences (eval.paths' token files, data.path's windows that eval.split holds out of
//     training), capped at eval.max_sequences, forward only (TrainBackend::eval_loss). Held-out
//     sequence g of the fixed order goes to dp rank g / ceil(n / dp); each rank runs its share in
//     the training step's micro-batch shape, padded with sequences of no counted target, and the
//     sums over dp make the number the same on any mesh (up to the order of fp sums);
//   - samples: the greedy continuation of each prompt of eval.samples (one a line; `\n` in a line
//     a newline, `\\` a backslash) by the current weights,
//     gathered on rank 0 in fp32 (a LoRA run's adapters merged into the base) and decoded there
//     by qtrain generate's CPU decoder (generate/decode.h); the other ranks wait.
// Both run every eval.every / eval.samples_every steps (0: neither) and at the run's last step,
// after the step's log line, and report to the step log, the metrics file and TensorBoard.
#pragma once

#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "qtrain/data.h"
#include "qtrain/deck.h"
#include "qtrain/mesh.h"
#include "qtrain/tokenizer.h"
#include "train/backend.h"
#include "train/metrics.h"
#include "train/tensorboard_log.h"

namespace qt {

// Collective over mesh.world(): the model's fp32 parameters, a flat buffer of
// ParamLayout(deck.model), on world rank 0 (empty elsewhere), from the pieces each rank holds
// (backend.pull_state() first); with [lora] the base with scale * B A added.
std::vector<float> gather_model(TrainBackend& backend, Mesh& mesh, const Deck& deck);

class Evaluation {
 public:
  // Collective over mesh.world(): opens the held-out token files (every rank) and, on rank 0,
  // reads and tokenizes the prompts; a problem is the same UserError on every rank.
  Evaluation(const Deck& deck, Mesh& mesh);

  // Start-up line(s) for the banner, "" when [eval] is off.
  std::string describe() const;
  // True when the loss or samples are due after `step` steps (`last`: the run's last step).
  bool due(std::int64_t step, std::int64_t last) const;
  // Collective: what is due after `step` steps, reported to `log` and `tensorboard`. Returns
  // the seconds it took (this rank's), for the trainer to leave out of the throughput.
  double run(std::int64_t step, std::int64_t last, TrainBackend& backend, MetricsLog& log,
             TensorBoardLog& tensorboard);

  // The held-out loss alone (collective), as run() reports it.
  EvalMetrics loss(std::int64_t step, TrainBackend& backend);
  // The samples alone (collective), on rank 0 (empty elsewhere).
  std::vector<EvalSample> samples(TrainBackend& backend);

 private:
  bool loss_due(std::int64_t step, std::int64_t last) const;
  bool samples_due(std::int64_t step, std::int64_t last) const;
  // Held-out sequence g of the fixed order: the files in eval.paths' order, then eval.split's
  // part of data.path, each in its own order (DataSource::sample of 0 .. epoch_size() - 1).
  void sequence(std::int64_t g, std::int32_t* inputs, std::int32_t* targets,
                std::int32_t* positions) const;

  const Deck& deck_;
  Mesh& mesh_;
  std::vector<std::unique_ptr<DataSource>> sources_;
  std::vector<std::int64_t> first_;  // [sources + 1] the order's first sequence of each source
  std::int64_t count_ = 0;           // sequences evaluated (max_sequences applied)
  // Samples (rank 0): the tokenizer, each prompt and its ids, the stop tokens (generate's).
  std::unique_ptr<Tokenizer> tokenizer_;
  std::string tokenizer_dir_;
  std::vector<std::string> prompts_;
  std::vector<std::vector<std::int32_t>> prompt_ids_;
  std::set<std::int32_t> stop_;
};

}  // namespace qt
