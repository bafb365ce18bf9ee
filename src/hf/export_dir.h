// The directory `qtrain export` writes (docs/finetune.md, "Export"): which targets it refuses,
// and how it replaces one. An export is written under a staging name beside the target
// (.<name>.qtrain-export-tmp) and renamed when complete; with --force a non-empty target is moved
// aside (.<name>.qtrain-export-old) and deleted only after the rename. Since --force deletes
// a directory, targets that hold anything the export did not write and cannot rebuild are
// refused before any work.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

namespace qt::hf {

// Serial (rank 0): "" when `out_dir` may be written, else the reason (for a UserError). Refused:
// a name without a last component ("", ".", "..", "/"); an existing file; a non-empty directory
// without `force`; a directory that is, or contains, one of `keep` (the checkpoint file, the
// tokenizer and model.init directories, ...) or the working, home or root directory; with
// `force`, a directory whose tree holds a qtrain checkpoint (step_*.h5) or any other HDF5 file
// (a checkpoint under another name, a token file), which no export writes. Paths are compared
// absolute, with symbolic links resolved.
std::string export_target_problem(const std::string& out_dir, bool force,
                                  const std::vector<std::string>& keep);

// The staging directory of an export to `out_dir` (beside it; may be left over from an
// interrupted export, and is then replaced).
std::filesystem::path export_staging_dir(const std::string& out_dir);

// Serial: renames the complete `staging` directory to `out_dir`, replacing an existing one
// (moved aside first, deleted after). UserError when a rename fails.
void install_export_dir(const std::filesystem::path& staging, const std::string& out_dir);

}  // namespace qt::hf
