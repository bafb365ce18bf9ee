// The deck's key table as data, for tests (docs/decks.md must list every key) and tools.
#pragma once

#include <string>
#include <vector>

namespace qt {

struct DeckKeyInfo {
  std::string key;            // "section.key"
  std::string unit;           // empty when dimensionless
  std::string meaning;        // one line
  std::string default_value;  // as written in a deck
};

// Every key, in section order (model, mesh, train, optim, lora, data, checkpoint, log, eval,
// topology).
std::vector<DeckKeyInfo> deck_keys();

}  // namespace qt
