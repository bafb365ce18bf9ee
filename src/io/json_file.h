// Reading a user's text and JSON files (config.json, tokenizer.json, ...) with one kind of error:
// a UserError that names the file and what is wrong with it.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

namespace qt::io {

// The whole file at `path`. UserError "[WHAT ]PATH: no such file", ": is a directory",
// ": cannot open it for reading" or ": read error"; `what` (e.g. "tokenizer file") may be "".
std::string read_text_file(const std::string& path, std::string_view what = {});

// `text` as JSON; UserError "WHERE: not valid JSON (...)" (also for a number like 1e999).
nlohmann::json parse_json(const std::string& text, const std::string& where);

// read_text_file, then parse_json: the file at `path` as JSON, the errors of both naming it.
nlohmann::json read_json_file(const std::string& path, std::string_view what = {});

}  // namespace qt::io
