// A deck key's value as text and as its typed field (see field_text.h).
#include "config/field_text.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>
#include <type_traits>

#include "qtrain/error.h"

namespace qt {

namespace {

const std::vector<Schedule> kSchedules = {Schedule::kCosine, Schedule::kLinear,
                                          Schedule::kConstant};

template <class I>
void parse_integer(const std::string& raw, I* out, const std::string& what) {
  const char* b = raw.data();
  const char* e = b + raw.size();
  if (b != e && *b == '+') ++b;
  I v{};
  auto [p, ec] = std::from_chars(b, e, v);
  if (ec == std::errc::result_out_of_range) fail_user("{} is out of range", what);
  if (ec != std::errc() || p != e || b == e) {
    fail_user("{} is not {}", what,
              std::is_signed_v<I> ? "an integer" : "a non-negative integer");
  }
  *out = v;
}

}  // namespace

std::string join(const std::vector<std::string>& v, const char* sep) {
  std::string out;
  for (std::size_t i = 0; i < v.size(); ++i) out += (i ? sep : "") + v[i];
  return out;
}

std::string format_comma_list(const std::vector<int>& v) {
  std::string out;
  for (std::size_t i = 0; i < v.size(); ++i) out += fmt::format("{}{}", i ? ", " : "", v[i]);
  return out;
}

std::vector<int> parse_comma_list(const std::string& raw, const std::string& what) {
  std::vector<int> list;
  std::size_t at = 0;
  while (raw.find_first_not_of(" \t", at) != std::string::npos) {
    const std::size_t comma = std::min(raw.find(',', at), raw.size());
    std::string item = raw.substr(at, comma - at);
    item.erase(0, item.find_first_not_of(" \t"));
    item.erase(item.find_last_not_of(" \t") + 1);
    if (item.empty()) fail_user("{} is not a comma list of integers (an empty item)", what);
    int v = 0;
    parse_integer(item, &v, what + " (item '" + item + "')");
    list.push_back(v);
    at = comma + 1;
    if (comma == raw.size()) break;
  }
  return list;
}

std::vector<std::string> schedule_names() {
  std::vector<std::string> out;
  for (Schedule s : kSchedules) out.push_back(schedule_name(s));
  return out;
}

std::string format_value(FieldRef f) {
  return std::visit(
      [](auto* p) -> std::string {
        using V = std::remove_pointer_t<decltype(p)>;
        if constexpr (std::is_same_v<V, bool>) {
          return *p ? "true" : "false";
        } else if constexpr (std::is_same_v<V, Schedule>) {
          return schedule_name(*p);
        } else if constexpr (std::is_same_v<V, std::string>) {
          return *p;
        } else if constexpr (std::is_same_v<V, std::vector<int>>) {
          return format_comma_list(*p);
        } else {
          return fmt::format("{}", *p);  // doubles: shortest text that reads back exactly
        }
      },
      f);
}

void assign_value(FieldRef f, const std::string& raw, const std::string& what) {
  std::visit(
      [&](auto* p) {
        using V = std::remove_pointer_t<decltype(p)>;
        if constexpr (std::is_same_v<V, int> || std::is_same_v<V, std::uint64_t>) {
          parse_integer(raw, p, what);
        } else if constexpr (std::is_same_v<V, double>) {
          const char* b = raw.data();
          const char* e = b + raw.size();
          if (b != e && *b == '+') ++b;
          double v = 0;
          auto [q, ec] = std::from_chars(b, e, v);
          if (ec != std::errc() || q != e || b == e) fail_user("{} is not a number", what);
          if (!std::isfinite(v)) fail_user("{} is not a finite number", what);
          // Every such key ends up in fp32 arithmetic (weights, moments, norms): 1e39 would be
          // infinite there, 1e-39 zero.
          if (std::fabs(v) > std::numeric_limits<float>::max())
            fail_user("{} is beyond the range of a 32-bit float (about 3.4e38), the precision "
                      "it is used in",
                      what);
          if (v != 0 && std::fabs(v) < std::numeric_limits<float>::min())
            fail_user("{} is below the smallest normal 32-bit float (about 1.2e-38), the "
                      "precision it is used in",
                      what);
          *p = v;
        } else if constexpr (std::is_same_v<V, bool>) {
          std::string s = raw;
          std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
          if (s == "true" || s == "yes" || s == "on" || s == "1") {
            *p = true;
          } else if (s == "false" || s == "no" || s == "off" || s == "0") {
            *p = false;
          } else {
            fail_user("{} is not a boolean (true | false)", what);
          }
        } else if constexpr (std::is_same_v<V, Schedule>) {
          for (Schedule s : kSchedules) {
            if (raw == schedule_name(s)) {
              *p = s;
              return;
            }
          }
          fail_user("{} is not a schedule: {}", what, join(schedule_names(), " | "));
        } else if constexpr (std::is_same_v<V, std::vector<int>>) {
          *p = parse_comma_list(raw, what);
        } else {
          // A '#' would start a comment in the resolved deck; a line break would split it.
          if (raw.find_first_of("#\n\r") != std::string::npos) {
            fail_user("{}: a value cannot contain '#' or a line break", what);
          }
          *p = raw;
        }
      },
      f);
}

}  // namespace qt
