// The training loop: deck -> model, data, optimizer, checkpoints -> optimizer steps.
#pragma once

#include "qtrain/deck.h"
#include "qtrain/mesh.h"

namespace qt {

// Runs (or resumes) the training the deck describes. Collective over the mesh. Returns the
// process exit code: 0 on success, 3 when train.max_consecutive_skips steps in a row had a NaN
// or infinite loss or gradient norm, when fp16 gradients overflow at train.min_loss_scale (or a
// checkpoint would have held a non-finite value).
// Throws UserError (on every rank alike) for bad data files or checkpoints.
int run_training(const Deck& deck, Mesh& mesh);

}  // namespace qt
