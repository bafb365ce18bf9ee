#include "io/json_file.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include "qtrain/error.h"

namespace qt::io {

namespace {

// "WHAT PATH", or "PATH" without `what`.
std::string label(const std::string& path, std::string_view what) {
  return what.empty() ? path : fmt::format("{} {}", what, path);
}

}  // namespace

std::string read_text_file(const std::string& path, std::string_view what) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::exists(path, ec)) fail_user("{}: no such file", label(path, what));
  if (fs::is_directory(path, ec)) fail_user("{}: is a directory", label(path, what));
  std::ifstream in(path, std::ios::binary);
  if (!in) fail_user("{}: cannot open it for reading", label(path, what));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) fail_user("{}: read error", label(path, what));
  return ss.str();
}

nlohmann::json parse_json(const std::string& text, const std::string& where) {
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {  // parse_error, or out_of_range (1e999)
    fail_user("{}: not valid JSON ({})", where, e.what());
  }
}

nlohmann::json read_json_file(const std::string& path, std::string_view what) {
  return parse_json(read_text_file(path, what), label(path, what));
}

}  // namespace qt::io
