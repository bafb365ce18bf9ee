// The deck parser (src/config: parse_deck_text, what `qtrain deck.ini --key=value` runs).
// Input: one byte for the world size (1..8), the deck text up to the first NUL byte, then
// command-line overrides separated by NUL bytes. A deck may only be accepted or refused with a
// UserError; an accepted deck's resolved text must parse again to the same resolved text.
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "fuzz_util.h"
#include "qtrain/deck.h"
#include "qtrain/error.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  qt::fuzz::Bytes in(data, size);
  const int world = 1 + in.u8() % 8;
  const std::string text(in.until('\0'));
  std::vector<std::string> overrides;
  while (in.left() > 0 && overrides.size() < 16) overrides.emplace_back(in.until('\0'));
  qt::Deck deck;
  try {
    deck = qt::parse_deck_text(text, "fuzz.ini", overrides, world);
  } catch (const qt::UserError&) {
    return 0;
  }
  // The resolved deck is what checkpoints store and a resumed run reads back.
  qt::Deck again;
  try {
    again = qt::parse_deck_text(deck.resolved, "fuzz.ini", {}, world);
  } catch (const qt::UserError& e) {
    QT_FUZZ_ASSERT(false, std::string("the resolved deck does not parse: ") + e.what() +
                              "\n--- resolved deck:\n" + deck.resolved);
  }
  if (again.resolved != deck.resolved) {
    // The first line that differs.
    std::istringstream a(deck.resolved), b(again.resolved);
    std::string la, lb;
    while (std::getline(a, la) && std::getline(b, lb) && la == lb) {
    }
    QT_FUZZ_ASSERT(
        false, "the resolved deck changes when parsed again: '" + la + "' becomes '" + lb + "'");
  }
  return 0;
}
