// The deck tests' helpers (test_deck.cpp, test_deck_moe.cpp): parse a deck's text as file
// "deck.ini", and expect one UserError whose message names every given part.
#pragma once

#include <gtest/gtest.h>

#include <exception>
#include <initializer_list>
#include <string>
#include <vector>

#include "qtrain/deck.h"
#include "qtrain/error.h"

namespace qt::deck_test {

inline constexpr const char* kPath = "deck.ini";

inline Deck parse(const std::string& text, std::vector<std::string> overrides = {},
                  int world = 2) {
  return parse_deck_text(text, kPath, overrides, world);
}

// Parsing must throw one UserError whose message contains every one of `parts`.
inline void expect_error(const std::string& text, const std::vector<std::string>& overrides,
                         int world, std::initializer_list<std::string> parts) {
  try {
    parse(text, overrides, world);
  } catch (const UserError& e) {
    const std::string msg = e.what();
    for (const std::string& p : parts)
      EXPECT_NE(msg.find(p), std::string::npos) << "message: " << msg << "\nmissing: " << p;
    return;
  } catch (const std::exception& e) {
    FAIL() << "not a UserError: " << e.what();
  }
  ADD_FAILURE() << "no error for deck:\n" << text;
}

inline void expect_error(const std::string& text, std::initializer_list<std::string> parts) {
  expect_error(text, {}, 2, parts);
}

}  // namespace qt::deck_test
