// The deck's one table of keys (key_table.cpp): for each key its "section.key", unit, one-line
// meaning and the Deck field it sets. The table drives parsing and validation (deck.cpp), --help,
// the resolved deck and deck_keys() (the docs test); the value lists below are what the choice
// keys accept.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "config/field_text.h"
#include "qtrain/deck.h"

namespace qt::config {

inline const std::vector<std::string> kSections = {"model", "mesh", "train", "optim", "lora",
                                                   "data", "checkpoint", "log", "eval",
                                                   "topology"};
inline const std::vector<std::string> kDataSources = {"synthetic", "file"};
inline const std::vector<std::string> kPackings = {"concat", "packed", "padded"};
inline const std::vector<std::string> kDevices = {"cpu", "cuda"};

struct KeySpec {
  std::string key;      // "section.key"
  std::string unit;     // empty when dimensionless
  std::string meaning;  // one line for --help and deck_keys()
  std::function<FieldRef(Deck&)> field;
};

// Every key, in section order; model.preset first (it is applied before the other model keys,
// which override it).
const std::vector<KeySpec>& key_table();
// The key's entry, or null when there is none.
const KeySpec* find_spec(const std::string& key);
std::vector<std::string> all_keys();
// The deck before any key is read: the struct defaults, except mesh.dp = 0 (auto).
Deck deck_defaults();

}  // namespace qt::config
