// "Did you mean" suggestions for misspelt deck keys, sections and option values.
#pragma once

#include <string>
#include <vector>

namespace qt {

// " (did you mean X?)" for the closest of `known` (the same key in another section first, then
// the smallest edit distance), or "" when nothing is close.
std::string suggestion(const std::string& word, const std::vector<std::string>& known);

}  // namespace qt
