#include "config/ini_lines.h"

#include <map>
#include <sstream>

#include "qtrain/error.h"

namespace qt::ini {

std::string trim(const std::string& s) {
  const char* ws = " \t\r\n\f\v";
  std::size_t b = s.find_first_not_of(ws);
  if (b == std::string::npos) return "";
  std::size_t e = s.find_last_not_of(ws);
  return s.substr(b, e - b + 1);
}

Scan scan(const std::string& text, const std::string& path) {
  Scan out;
  std::map<std::string, int> seen;          // key -> line of first setting
  std::map<std::string, int> section_seen;  // section -> line of first header
  std::string section;
  std::istringstream in(text);
  std::string raw;
  int line = 0;
  while (std::getline(in, raw)) {
    ++line;
    std::string s = raw;
    if (!s.empty() && s.back() == '\r') s.pop_back();
    if (std::size_t h = s.find('#'); h != std::string::npos) s.resize(h);
    s = trim(s);
    if (!s.empty() && s.front() == ';') s.clear();
    out.cleaned += s;
    out.cleaned += '\n';
    if (s.empty()) continue;

    if (s.front() == '[') {
      if (s.back() != ']') fail_user("{}:{}: malformed section header '{}': expected [section]", path, line, s);
      section = trim(s.substr(1, s.size() - 2));
      if (section.empty() || section.find_first_of(" \t=[]") != std::string::npos) {
        fail_user("{}:{}: malformed section header '{}': expected [section]", path, line, s);
      }
      if (section_seen.emplace(section, line).second) out.sections.push_back({section, line});
      continue;
    }
    std::size_t eq = s.find('=');
    if (eq == std::string::npos) {
      fail_user("{}:{}: cannot read '{}': expected `key = value` or `[section]`", path, line, s);
    }
    std::string key = trim(s.substr(0, eq));
    if (key.empty()) fail_user("{}:{}: '{}' has no key before '='", path, line, s);
    if (section.empty()) {
      fail_user("{}:{}: key '{}' comes before any [section] header", path, line, key);
    }
    std::string full = section + "." + key;
    auto [it, fresh] = seen.emplace(full, line);
    if (!fresh) {
      fail_user("{}:{}: {} is set twice (first at {}:{}); keep one", path, line, full, path,
                it->second);
    }
    out.entries.push_back({full, trim(s.substr(eq + 1)), line});
  }
  return out;
}

}  // namespace qt::ini
