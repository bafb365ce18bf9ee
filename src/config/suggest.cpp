// "Did you mean" suggestions for misspelt keys, sections and names.
#include "config/suggest.h"

#include <algorithm>
#include <vector>

namespace qt {

namespace {

std::size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diag = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      std::size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] != b[j - 1] ? 1u : 0u)});
      diag = up;
    }
  }
  return row[b.size()];
}

}  // namespace

std::string suggestion(const std::string& word, const std::vector<std::string>& known) {
  // The same key name in another section is the likeliest slip ([train] lr = ...).
  if (std::size_t dot = word.find('.'); dot != std::string::npos) {
    for (const std::string& k : known) {
      if (k.substr(k.find('.') + 1) == word.substr(dot + 1)) return " (did you mean " + k + "?)";
    }
  }
  std::string best;
  std::size_t best_d = std::string::npos;
  for (const std::string& k : known) {
    std::size_t d = edit_distance(word, k);
    if (d < best_d) best_d = d, best = k;
  }
  if (best_d <= std::max<std::size_t>(2, word.size() / 4)) return " (did you mean " + best + "?)";
  return "";
}

}  // namespace qt
