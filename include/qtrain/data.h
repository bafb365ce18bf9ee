// Training data: sources of fixed-length sequences addressed by a global sample index.
//
// Sample g of the run is a window of T+1 tokens; inputs are tokens [0, T), targets are tokens
// [1, T] (the one-token shift), with -100 where the target is not counted (loss mask, or a
// target that belongs to no document), and positions: the RoPE position of each input token
// (0 at each document start when packing, see Packing). The order of samples is fixed by the
// seed, so the data position of a run is one number: samples consumed.
//
// Token file format (HDF5, docs/data.md):
//   /tokens       int32 [N]       token ids of all documents, concatenated
//   /doc_offsets  int64 [D + 1]   document d is tokens [doc_offsets[d], doc_offsets[d+1])
//   /loss_mask    uint8 [N]       optional; 0 = do not count this token as a target
//   attribute vocab_size (int64): every token id is below it
#pragma once

#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "qtrain/deck.h"

namespace qt {

// How documents of a token file fill the samples (docs/data.md, Packing; deck key data.packing).
//   kConcat: windows over the concatenated documents, positions 0..T-1, attention crosses
//            documents.
//   kPacked: the same windows in the same order; positions restart at 0 at every document start
//            (and at the window start); a target in another document than its input is -100.
//   kPadded: one document per sample: each split into chunks of up to T+1 tokens at stride T,
//            the rest of the sample padded (input kPadToken, target -100, positions continuing).
// Positions always form a valid row: pos[0] = 0, pos[t] = pos[t-1] + 1 or 0.
enum class Packing { kConcat, kPacked, kPadded };
// "concat" | "packed" | "padded" (validated by the deck).
Packing packing_from_name(const std::string& name);

class DataSource {
 public:
  virtual ~DataSource() = default;
  // Fills inputs[T], targets[T] and positions[T] of global sample `index` (any index >= 0;
  // sources cycle through epochs, each in a seed-fixed order). positions may be null (not
  // written).
  virtual void sample(std::int64_t index, std::int32_t* inputs, std::int32_t* targets,
                      std::int32_t* positions, int T) const = 0;
  // Samples of one epoch (each window or chunk once: indices [0, epoch_size()) cover them all),
  // 0 when unbounded (the synthetic source).
  virtual std::int64_t epoch_size() const { return 0; }
  // The best achievable mean loss per counted token (nats), NaN when unknown.
  virtual double loss_floor() const { return std::nan(""); }
  virtual std::string describe() const = 0;
};

// A random first-order Markov chain over `vocab` tokens: each token has `branching` successors
// with random probabilities. Each sample starts from the stationary distribution, so the loss
// floor is the chain's entropy rate  H = -sum_i pi_i sum_j P_ij log P_ij.
std::unique_ptr<DataSource> make_synthetic_source(int vocab, int branching, std::uint64_t seed);

// eval.split: a token file's units (windows, or chunks when padded) in two parts, fixed by the
// file alone (not by the seed): the held-out part is the first max(1, round(fraction x units))
// of token_window_order(units, kHoldoutSeed, 0), the training part the rest (at least one unit).
// A source of one part serves only its units, each once an epoch, in its seed's order.
struct TokenSplit {
  enum class Part { kAll, kTrain, kHeldOut };
  Part part = Part::kAll;
  double fraction = 0;  // in (0, 1) unless kAll
};
inline constexpr std::uint64_t kHoldoutSeed = 0x6576616c;  // "eval"

// Opens a token file; throws UserError naming the file and what is wrong (missing dataset, ids
// out of range for `vocab`, too few tokens for one sample of T + 1; padded: no document of two
// tokens; a split that leaves no unit to train on).
std::unique_ptr<DataSource> open_token_file(const std::string& path, int vocab, int T,
                                            std::uint64_t seed,
                                            Packing packing = Packing::kConcat,
                                            TokenSplit split = {});

// Writes a token file (serial; for tools and tests). loss_mask may be empty.
void write_token_file(const std::string& path, const std::vector<std::int32_t>& tokens,
                      const std::vector<std::int64_t>& doc_offsets,
                      const std::vector<std::uint8_t>& loss_mask, std::int64_t vocab_size);

// The deck's data source (with eval.split > 0, the training part of data.path).
std::unique_ptr<DataSource> make_data_source(const Deck& deck);

}  // namespace qt
