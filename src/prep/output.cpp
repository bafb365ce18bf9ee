// The output of `qtrain prep` (output.h): checks before the work, and a parallel write that fails
// cleanly (every rank exits 2 with one message, nothing left behind): the HDF5 metadata is built
// in memory and every byte reaches the disk through MPI-IO (io/parallel_file.h).
#include "prep/output.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "io/hdf5_util.h"
#include "io/parallel_file.h"
#include "qtrain/comm.h"
#include "qtrain/error.h"

namespace qt::prep {

namespace {

namespace fs = std::filesystem;

// The files that reading the tokenizer `path` (a directory or a tokenizer.json) may open.
std::vector<fs::path> tokenizer_files(const std::string& path) {
  std::error_code ec;
  if (!fs::is_directory(path, ec)) return {path};
  return {fs::path(path) / "tokenizer.json", fs::path(path) / "tokenizer_config.json",
          fs::path(path) / "chat_template.jinja"};
}

// The HDF5 metadata of a token file for N tokens and D documents, built in memory
// (io/parallel_file.h), and where the datasets' values go.
struct Layout {
  std::string image;                                    // bytes [0, image.size()) of the file
  std::uint64_t tokens = 0, doc_offsets = 0, mask = 0;  // byte offsets of the datasets' values
};

Layout build_layout(std::int64_t N, std::int64_t D, std::int64_t vocab) {
  Layout l;
  l.image = h5::metadata_image([&](hid_t file) {
    h5::write_attr_i64(file, "vocab_size", vocab);
    h5::Handle dcpl = h5::early_contiguous_dcpl();
    auto create = [&](const char* name, hid_t type, std::int64_t n) {
      const hsize_t dim = static_cast<hsize_t>(n);
      h5::Handle space = QT_H5_OPEN(H5Screate_simple(1, &dim, nullptr), h5::close_space);
      h5::Handle ds = QT_H5_OPEN(
          H5Dcreate2(file, name, type, space, H5P_DEFAULT, dcpl, H5P_DEFAULT), h5::close_dataset);
      return h5::dataset_offset(ds);
    };
    l.tokens = create("tokens", H5T_STD_I32LE, N);
    l.doc_offsets = create("doc_offsets", H5T_STD_I64LE, D + 1);
    l.mask = create("loss_mask", H5T_STD_U8LE, N);
    return std::min({l.tokens, l.doc_offsets, l.mask});
  });
  return l;
}

}  // namespace

std::string output_problem(const std::string& output, const std::vector<std::string>& inputs,
                           const std::string& tokenizer) {
  std::error_code ec;
  const std::string tmp = output + ".tmp";
  if (fs::is_directory(output, ec)) return fmt::format("output {}: is a directory", output);
  if (fs::is_directory(tmp, ec))
    return fmt::format("output {}: {} (where it is written first) is a directory", output, tmp);
  const fs::path parent = fs::path(output).parent_path();
  const fs::path dir = parent.empty() ? fs::path(".") : parent;
  if (!fs::exists(dir, ec))
    return fmt::format("output {}: directory {} does not exist", output, dir.string());
  if (!fs::is_directory(dir, ec))
    return fmt::format("output {}: {} is not a directory", output, dir.string());
  if (access(dir.c_str(), W_OK | X_OK) != 0)
    return fmt::format("output {}: cannot create files in directory {} ({})", output,
                       dir.string(), std::strerror(errno));
  // std::filesystem::equivalent sees through other spellings, symbolic and hard links.
  for (const std::string& name : {output, tmp}) {
    const std::string what =
        name == output ? fmt::format("output {}", output)
                       : fmt::format("output {}: {} (where it is written first)", output, tmp);
    for (const std::string& in : inputs)
      if (fs::equivalent(name, in, ec))
        return fmt::format("{} is the input file {}; choose another output", what, in);
    for (const fs::path& t : tokenizer_files(tokenizer))
      if (fs::equivalent(name, t, ec))
        return fmt::format("{} is the tokenizer file {}; choose another output", what,
                           t.string());
  }
  return "";
}

void write_token_file_parallel(const std::string& path, const Documents& mine, std::int64_t vocab,
                               MpiComm& world) {
  static_assert(std::endian::native == std::endian::little,
                "the datasets' values are written as the little-endian bytes of memory");
  const int P = world.size(), me = world.rank();
  std::vector<std::int64_t> counts(2 * static_cast<std::size_t>(P));  // tokens, documents
  counts[2 * me] = static_cast<std::int64_t>(mine.tokens.size());
  counts[2 * me + 1] = static_cast<std::int64_t>(mine.lengths.size());
  world.all_gather(counts.data() + 2 * me, counts.data(), 2, DType::kI64);
  std::int64_t tok_off = 0, doc_off = 0, N = 0, D = 0;
  for (int r = 0; r < P; ++r) {
    if (r < me) tok_off += counts[2 * r], doc_off += counts[2 * r + 1];
    N += counts[2 * r];
    D += counts[2 * r + 1];
  }
  // This rank's entries of doc_offsets: its documents' starts, and N on the last rank.
  std::vector<std::int64_t> offsets;
  offsets.reserve(mine.lengths.size() + 1);
  std::int64_t at = tok_off;
  for (std::int64_t len : mine.lengths) offsets.push_back(at), at += len;
  if (me == P - 1) offsets.push_back(N);

  // Rank 0 builds the HDF5 metadata in memory; every rank learns where the values go.
  Layout layout;
  if (me == 0) layout = build_layout(N, D, vocab);
  std::uint64_t where[3] = {layout.tokens, layout.doc_offsets, layout.mask};
  world.broadcast(where, 3, DType::kU64, 0);
  const std::vector<h5::Piece> pieces = {
      {0, layout.image.data(), layout.image.size()},  // the metadata (empty except on rank 0)
      {where[0] + 4 * static_cast<std::uint64_t>(tok_off), mine.tokens.data(), 4 * mine.tokens.size()},
      {where[2] + static_cast<std::uint64_t>(tok_off), mine.mask.data(), mine.mask.size()},
      {where[1] + 8 * static_cast<std::uint64_t>(doc_off), offsets.data(), 8 * offsets.size()}};

  // A .tmp of an earlier run is removed first (the writes do not truncate). Every failure is
  // seen by every rank; a failed file is removed before every rank throws.
  const std::string tmp = path + ".tmp";
  std::error_code ec;
  if (me == 0) fs::remove(tmp, ec);
  agree(world, ec ? fmt::format("output {}: cannot remove the old {} ({})", path, tmp,
                                ec.message())
                  : "");
  const h5::WriteResult w = h5::write_pieces(tmp, pieces, world);
  std::string err;
  if (!w.ok()) err = fmt::format("output {}: {}; no token file was written", path, w.error);
  // The rename needs every rank's verdict; when one failed, rank 0 removes the .tmp.
  std::int64_t failed = err.empty() ? 0 : 1;
  world.all_reduce(&failed, 1, DType::kI64, ReduceOp::kMax);
  if (failed == 0 && me == 0) {
    fs::rename(tmp, path, ec);
    if (ec) err = fmt::format("output {}: cannot rename {} to it ({})", path, tmp, ec.message());
  }
  try {
    agree(world, err);
  } catch (const UserError&) {
    if (me == 0) fs::remove(tmp, ec);
    throw;
  }
}

}  // namespace qt::prep
