// The directory an export writes: refused targets, staging and replacement (see export_dir.h).
#include "hf/export_dir.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <fstream>

#include "qtrain/error.h"

namespace qt::hf {

namespace fs = std::filesystem;

namespace {

// Absolute, normal, with the symbolic links of its existing part resolved.
fs::path resolved(const fs::path& p) {
  std::error_code ec;
  fs::path r = fs::weakly_canonical(fs::absolute(p, ec), ec);
  if (ec) r = fs::absolute(p).lexically_normal();
  if (r.has_filename() || r == r.root_path()) return r;
  return r.parent_path();  // "dir/" -> "dir"
}

// True when `inner` is `outer` or lies below it (both resolved).
bool within(const fs::path& inner, const fs::path& outer) {
  auto i = inner.begin();
  for (auto o = outer.begin(); o != outer.end(); ++o, ++i)
    if (i == inner.end() || *i != *o) return false;
  return true;
}

// HDF5's signature: 8 bytes at offset 0 (or at 512, 1024, ... after a user block; a file
// written by HDF5 itself starts with it).
bool is_hdf5(const fs::path& p) {
  static const char kSignature[8] = {'\x89', 'H', 'D', 'F', '\r', '\n', '\x1a', '\n'};
  std::ifstream in(p, std::ios::binary);
  char head[8] = {};
  for (std::streamoff at = 0; in && at <= 4096; at = at == 0 ? 512 : 2 * at) {
    in.seekg(at);
    if (in.read(head, 8) && std::memcmp(head, kSignature, 8) == 0) return true;
  }
  return false;
}

// The first file under `dir` that an export never writes and --force must not delete: a
// checkpoint by name (step_*.h5, complete or not) or any HDF5 file. "" when none.
std::string irreplaceable_file(const fs::path& dir) {
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(dir, ec); !ec && it != fs::end(it);
       it.increment(ec)) {
    if (!it->is_regular_file(ec)) continue;
    const std::string name = it->path().filename().string();
    if (name.rfind("step_", 0) == 0 && name.find(".h5") != std::string::npos) {
      return fmt::format("{} (a qtrain checkpoint)", it->path().string());
    }
    if (is_hdf5(it->path())) {
      return fmt::format("{} (an HDF5 file: a checkpoint or a token file?)", it->path().string());
    }
  }
  if (ec) return fmt::format("{} (cannot be listed: {})", dir.string(), ec.message());
  return "";
}

}  // namespace

std::string export_target_problem(const std::string& out_dir, bool force,
                                  const std::vector<std::string>& keep) {
  const fs::path out(out_dir);
  if (out.filename().empty() || out.filename() == "." || out.filename() == "..")
    return fmt::format("export directory {}: give a directory name", out_dir);
  const fs::path target = resolved(out);
  std::vector<std::pair<std::string, std::string>> guarded;  // (path, what it is)
  for (const std::string& k : keep)
    if (!k.empty()) guarded.emplace_back(k, "");
  std::error_code ec;
  guarded.emplace_back(fs::current_path(ec).string(), "the working directory");
  if (const char* home = std::getenv("HOME")) guarded.emplace_back(home, "the home directory");
  for (const auto& [path, what] : guarded) {
    if (path.empty() || !within(resolved(path), target)) continue;
    const std::string name = what.empty() ? path : fmt::format("{} ({})", path, what);
    return resolved(path) == target
               ? fmt::format("export directory {} is {}; give a new directory", out_dir, name)
               : fmt::format("export directory {} contains {}; give a new directory", out_dir, name);
  }
  if (fs::exists(out, ec) && !fs::is_directory(out, ec))
    return fmt::format("export directory {} exists and is not a directory", out_dir);
  if (!fs::is_directory(out, ec) || fs::is_empty(out, ec)) return "";
  if (!force)
    return fmt::format("export directory {} exists and is not empty; pass --force to replace it",
                       out_dir);
  if (const std::string f = irreplaceable_file(out); !f.empty())
    return fmt::format(
        "export directory {} holds {}, which no export writes: --force does not replace it; give "
        "a new directory",
        out_dir, f);
  return "";
}

namespace {

// ".<name>.qtrain-export-<what>" beside `out_dir`.
fs::path beside(const std::string& out_dir, const char* what) {
  const fs::path out(out_dir);
  return out.parent_path() / fmt::format(".{}.qtrain-export-{}", out.filename().string(), what);
}

}  // namespace

fs::path export_staging_dir(const std::string& out_dir) { return beside(out_dir, "tmp"); }

void install_export_dir(const fs::path& staging, const std::string& out_dir) {
  const fs::path out(out_dir);
  const fs::path old = beside(out_dir, "old");
  std::error_code ec;
  // An empty directory is replaced by rename(2) itself; a non-empty one (--force, checked by
  // export_target_problem) is moved aside first and deleted after.
  const bool replace = fs::is_directory(out, ec) && !fs::is_empty(out, ec);
  if (replace) {
    fs::remove_all(old, ec);
    fs::rename(out, old, ec);
    if (ec) fail_user("cannot move {} aside: {}", out_dir, ec.message());
  }
  fs::rename(staging, out, ec);
  if (ec) fail_user("cannot rename {} to {}: {}", staging.string(), out_dir, ec.message());
  if (replace) fs::remove_all(old, ec);
}

}  // namespace qt::hf
