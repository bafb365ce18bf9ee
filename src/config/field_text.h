// A deck key's value as text and as its typed field: parsing with one clear message per mistake,
// and formatting that reads back exactly (the resolved deck, --help, the docs test).
#pragma once

#include <cstdint>
#include <string>
#include <variant>
#include <vector>

#include "qtrain/deck.h"

namespace qt {

// Where in a Deck one key's value lives.
// std::vector<int>: a comma list of integers ("1, 5"; empty: none).
using FieldRef = std::variant<int*, std::uint64_t*, double*, bool*, std::string*, Schedule*,
                              std::vector<int>*>;

// The value as a deck writes it (doubles: the shortest text that reads back exactly).
std::string format_value(FieldRef f);

// Sets the field from its text; `what` ("where key = raw") starts every error message, thrown as
// UserError: not a number, out of range, beyond fp32, not a boolean or schedule, a '#' or line
// break in a string.
void assign_value(FieldRef f, const std::string& raw, const std::string& what);

std::string join(const std::vector<std::string>& v, const char* sep);
// A comma list of integers as decks write it ("1, 5"; "" for none) and back; `what` starts the
// UserError of a bad item (an empty one, or not an integer).
std::string format_comma_list(const std::vector<int>& v);
std::vector<int> parse_comma_list(const std::string& raw, const std::string& what);
std::vector<std::string> schedule_names();  // every Schedule, as decks spell them

}  // namespace qt
