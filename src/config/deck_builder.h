// The deck being built (config/deck.cpp): the Deck with where each key's value came from, and
// the checks that refuse a bad value with file:line. Internal to src/config: deck.cpp reads and
// checks the core sections, deck_features.cpp the feature sections ([lora], [eval], Qwen3-MoE).
#pragma once

#include <fmt/format.h>

#include <map>
#include <string>
#include <utility>
#include <variant>

#include "config/field_text.h"
#include "config/key_table.h"
#include "qtrain/deck.h"
#include "qtrain/error.h"

namespace qt::deck_build {

using namespace config;  // the key table and the value lists

struct Origin {
  enum class Kind { kDefault, kFile, kCommandLine };
  Kind kind = Kind::kDefault;
  int line = 0;
};

// The deck being built, with where each key's value came from, for error messages.
class Builder {
 public:
  Builder(std::string path, int world)
      : path_(std::move(path)), world_(world), deck_(deck_defaults()) {
    deck_.path = path_;
  }

  Deck& deck() { return deck_; }
  void set_origin(const std::string& key, Origin o) { origin_[key] = o; }
  // True when the file or the command line sets `key`.
  bool given(const std::string& key) const {
    auto it = origin_.find(key);
    return it != origin_.end() && it->second.kind != Origin::Kind::kDefault;
  }

  // Error prefix for a key: "file:line: ", "(command line): ", or "file: " for a default.
  std::string at(const std::string& key) const {
    auto it = origin_.find(key);
    Origin o = it == origin_.end() ? Origin{} : it->second;
    switch (o.kind) {
      case Origin::Kind::kFile: return fmt::format("{}:{}: ", path_, o.line);
      case Origin::Kind::kCommandLine: return "(command line): ";
      case Origin::Kind::kDefault: break;
    }
    return path_.empty() ? std::string() : path_ + ": ";
  }

  // "key = value", marked when the value was not written by the user.
  std::string kv(const std::string& key) {
    std::string s = key + " = " + format_value(find_spec(key)->field(deck_));
    auto it = origin_.find(key);
    if (it == origin_.end() || it->second.kind == Origin::Kind::kDefault) {
      if (key == "mesh.dp" && dp_auto_) return s + " (auto)";
      if (init_resolved_ && key.rfind("model.", 0) == 0 && key != "model.preset" &&
          key != "model.init") {
        return s + " (from " + deck_.model_init + "/config.json)";
      }
      if (key.rfind("model.", 0) == 0 && key != "model.preset" && key != "model.init") {
        return s + " (from preset " + deck_.model.preset + ")";
      }
      return s + " (default)";
    }
    return s;
  }

  int& ival(const std::string& key) { return *std::get<int*>(find_spec(key)->field(deck_)); }
  double& dval(const std::string& key) {
    return *std::get<double*>(find_spec(key)->field(deck_));
  }
  std::string& sval(const std::string& key) {
    return *std::get<std::string*>(find_spec(key)->field(deck_));
  }

  // Fails with "<where><key> = <value> <rest>" unless ok (no space before a rest that starts
  // with ':').
  template <typename... Args>
  void need(bool ok, const std::string& key, fmt::format_string<Args...> rest, Args&&... args) {
    if (!ok) {
      std::string r = fmt::format(rest, std::forward<Args>(args)...);
      fail_user("{}{}{}{}", at(key), kv(key), r.starts_with(':') ? "" : " ", r);
    }
  }

  void resolve_init(bool preset_given);
  void validate();

 private:
  void validate_model();
  void validate_mesh();
  void validate_context_parallel();  // mesh.cp (from validate_mesh)
  void validate_train_optim();
  void validate_lora();
  void validate_moe_lora();
  void validate_data_checkpoint_log();
  void validate_topology();
  void validate_eval();
  void validate_precision();
  void validate_moe();

  std::string path_;
  int world_;
  Deck deck_;
  std::map<std::string, Origin> origin_;
  bool dp_auto_ = false;
  bool init_resolved_ = false;  // the model comes from model.init's config.json
};

// What is wrong with `path` as a file to read, or "" when it is a readable regular file.
std::string file_problem(const std::string& path);

}  // namespace qt::deck_build
