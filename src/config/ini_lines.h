// Line-level scan of an INI deck: Boost.Program_options reads the values but reports no line
// numbers, so this scan maps every "section.key" to the line it was set on and catches syntax
// errors, duplicate keys and keys outside any section with file:line.
//
// Syntax: `[section]` headers; `key = value`; `#` starts a comment anywhere on a line (as in
// Program_options); `;` starts a comment only at the start of a line; blank lines are ignored.
#pragma once

#include <string>
#include <vector>

namespace qt::ini {

struct Entry {
  std::string key;    // "section.key"
  std::string value;  // trimmed, comment removed
  int line = 0;       // 1-based
};

struct Section {
  std::string name;
  int line = 0;       // line of the first header naming it
};

struct Scan {
  std::vector<Entry> entries;    // in file order
  std::vector<Section> sections; // distinct sections, in order of first appearance
  // The text with comments removed and the line structure kept, for Program_options.
  std::string cleaned;
};

// Throws UserError "path:line: ..." for a malformed line, a key before any section header, or a
// key set twice (naming both lines).
Scan scan(const std::string& text, const std::string& path);

// Whitespace-trimmed copy of s.
std::string trim(const std::string& s);

}  // namespace qt::ini
