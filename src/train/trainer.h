// The training loop: deck -> model, data, optimizer, checkpoints -> optimizer steps.
#pragma once

#include "qtrain/deck.h"
#include "qtrain/mesh.h"

namespace qt {

// Runs (or resumes) the training the deck describes. Collective over the mesh. Returns the
// process exit code: 0 on success, 3 when the loss became NaN or infinite.
// Throws UserError (on every rank alike) for bad data files or checkpoints.
int run_training(const Deck& deck, Mesh& mesh);

}  // namespace qt
