// The output of `qtrain prep` (output.h): checks before the work, and a parallel write that fails
// cleanly (every rank exits 2 with one message, nothing left behind). HDF5 builds the file's
// metadata in memory; every byte reaches the disk through MPI-IO calls whose failures are seen.
// (HDF5 1.10 cannot survive a failed H5Fclose: the file id stays valid, dangling, and the
// library crashes at MPI_Finalize. So HDF5 must never write to a disk that can be full.)
#include "prep/output.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "io/hdf5_util.h"
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

// The HDF5 part of a token file for N tokens and D documents: everything but the values of the
// datasets, built in memory (the core driver, no backing store), so that building it cannot fail
// on the disk. The metadata fills [0, image.size()); the datasets are contiguous, allocated early,
// each at its offset, all behind the metadata (the metadata block is reserved first).
struct Layout {
  std::string image;                                    // bytes [0, image.size()) of the file
  std::uint64_t tokens = 0, doc_offsets = 0, mask = 0;  // byte offsets of the datasets' values
};

constexpr std::size_t kMetadataBytes = std::size_t{64} << 10;  // reserved at the file's start

// The core driver's image buffer, kept when the file is closed instead of being freed.
struct ImageCapture {
  void* buf = nullptr;
  std::size_t size = 0;
  std::string kept;
};
void* image_malloc(std::size_t size, H5FD_file_image_op_t, void* ud) {
  auto* c = static_cast<ImageCapture*>(ud);
  c->buf = std::malloc(size);
  c->size = size;
  return c->buf;
}
void* image_memcpy(void* dest, const void* src, std::size_t size, H5FD_file_image_op_t, void*) {
  return std::memcpy(dest, src, size);
}
void* image_realloc(void* ptr, std::size_t size, H5FD_file_image_op_t, void* ud) {
  auto* c = static_cast<ImageCapture*>(ud);
  c->buf = std::realloc(ptr, size);
  c->size = size;
  return c->buf;
}
herr_t image_free(void* ptr, H5FD_file_image_op_t op, void* ud) {
  auto* c = static_cast<ImageCapture*>(ud);
  if (op == H5FD_FILE_IMAGE_OP_FILE_CLOSE && ptr == c->buf && ptr != nullptr)
    c->kept.assign(static_cast<const char*>(ptr), c->size);
  std::free(ptr);
  return 0;
}
void* image_udata_copy(void* ud) { return ud; }  // the capture outlives every copy of the fapl
herr_t image_udata_free(void*) { return 0; }

Layout build_layout(std::int64_t N, std::int64_t D, std::int64_t vocab) {
  ImageCapture capture;
  Layout l;
  {
    h5::Handle fapl = QT_H5_OPEN(H5Pcreate(H5P_FILE_ACCESS), h5::close_plist);
    QT_CHECK_HDF5(H5Pset_fapl_core(fapl, kMetadataBytes, /*backing_store=*/0));
    QT_CHECK_HDF5(H5Pset_meta_block_size(fapl, kMetadataBytes));
    H5FD_file_image_callbacks_t cb = {image_malloc,     image_memcpy,     image_realloc, image_free,
                                      image_udata_copy, image_udata_free, &capture};
    QT_CHECK_HDF5(H5Pset_file_image_callbacks(fapl, &cb));
    h5::Handle file = QT_H5_OPEN(H5Fcreate("qtrain-prep-layout", H5F_ACC_TRUNC, H5P_DEFAULT, fapl),
                                 h5::close_file);
    h5::write_attr_i64(file, "vocab_size", vocab);
    h5::Handle dcpl = QT_H5_OPEN(H5Pcreate(H5P_DATASET_CREATE), h5::close_plist);
    QT_CHECK_HDF5(H5Pset_alloc_time(dcpl, H5D_ALLOC_TIME_EARLY));
    QT_CHECK_HDF5(H5Pset_fill_time(dcpl, H5D_FILL_TIME_NEVER));
    auto create = [&](const char* name, hid_t type, std::int64_t n) {
      const hsize_t dim = static_cast<hsize_t>(n);
      h5::Handle space = QT_H5_OPEN(H5Screate_simple(1, &dim, nullptr), h5::close_space);
      h5::Handle ds = QT_H5_OPEN(
          H5Dcreate2(file, name, type, space, H5P_DEFAULT, dcpl, H5P_DEFAULT), h5::close_dataset);
      const haddr_t at = H5Dget_offset(ds);
      QT_CHECK(at != HADDR_UNDEF, "dataset /{} of {} elements has no storage", name, n);
      return static_cast<std::uint64_t>(at);
    };
    l.tokens = create("tokens", H5T_STD_I32LE, N);
    l.doc_offsets = create("doc_offsets", H5T_STD_I64LE, D + 1);
    l.mask = create("loss_mask", H5T_STD_U8LE, N);
    QT_CHECK_HDF5(file.close());
  }
  const std::uint64_t first = std::min({l.tokens, l.doc_offsets, l.mask});
  QT_CHECK(!capture.kept.empty() && capture.kept.size() <= first,
           "token file layout: {} bytes of metadata overlap the data at {}", capture.kept.size(),
           first);
  l.image = std::move(capture.kept);
  return l;
}

// This rank's share of a collective write: bytes at a file offset.
struct Piece {
  std::uint64_t at;
  const void* data;
  std::uint64_t bytes;
};

std::string mpi_error_text(int code) {
  char text[MPI_MAX_ERROR_STRING] = "";
  int len = 0;
  MPI_Error_string(code, text, &len);
  return text;
}

// Why a write failed: the OS error (ENOSPC: the disk is full), else `otherwise`.
std::string os_failure(int os_error, const std::string& otherwise) {
  if (os_error == 0) return otherwise;
  return std::string(std::strerror(os_error)) +
         (os_error == ENOSPC || os_error == EDQUOT ? " (the disk is full)" : "");
}

// The OS error of writing `n` bytes at `at` of `path` with pwrite(2); 0 when they are written.
// Open MPI's ompio reports a failed write as a short count and leaves no errno: writing the rest
// directly tells why (the file is removed afterwards).
int os_error_of_pwrite(const std::string& path, std::uint64_t at, const char* data,
                       std::uint64_t n) {
  const int fd = ::open(path.c_str(), O_WRONLY);
  if (fd < 0) return errno;
  int err = 0;
  while (n > 0 && err == 0) {
    const ssize_t w = ::pwrite(fd, data, n, static_cast<off_t>(at));
    if (w <= 0) {
      err = w < 0 ? errno : EIO;
    } else {
      at += static_cast<std::uint64_t>(w), data += w, n -= static_cast<std::uint64_t>(w);
    }
  }
  ::close(fd);
  return err;
}

// Collective: writes every rank's pieces into the open file `path`, in rounds of at most 1 GiB
// per call (MPI counts are int), and stops on every rank as soon as a call failed on any rank.
// Returns whether any rank failed; `mine` is this rank's reason ("" when it saw none).
bool write_pieces(MPI_File fh, const std::string& path, const std::vector<Piece>& pieces,
                  MpiComm& world, std::string& mine) {
  constexpr std::uint64_t kRound = std::uint64_t{1} << 30;
  for (const Piece& p : pieces) {
    std::int64_t rounds = static_cast<std::int64_t>((p.bytes + kRound - 1) / kRound);
    world.all_reduce(&rounds, 1, DType::kI64, ReduceOp::kMax);
    for (std::int64_t k = 0; k < rounds; ++k) {
      const std::uint64_t lo = std::min(p.bytes, k * kRound), n = std::min(p.bytes - lo, kRound);
      const char* data = static_cast<const char*>(p.data) + lo;
      MPI_Status status;
      errno = 0;
      const int rc = MPI_File_write_at_all(fh, static_cast<MPI_Offset>(p.at + lo), data,
                                           static_cast<int>(n), MPI_BYTE, &status);
      const int errno_after = errno;
      int written = 0;
      if (rc == MPI_SUCCESS) MPI_Get_count(&status, MPI_BYTE, &written);
      if (rc != MPI_SUCCESS) {
        mine = os_failure(errno_after, mpi_error_text(rc));
      } else if (static_cast<std::uint64_t>(written) != n) {
        const auto w = static_cast<std::uint64_t>(std::max(written, 0));
        mine = os_failure(os_error_of_pwrite(path, p.at + lo + w, data + w, n - w),
                          fmt::format("{} of {} bytes written", w, n));
      }
      std::int64_t failed = mine.empty() ? 0 : 1;
      world.all_reduce(&failed, 1, DType::kI64, ReduceOp::kMax);
      if (failed != 0) return true;
    }
  }
  return false;
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
  std::vector<Piece> pieces = {
      {0, layout.image.data(), layout.image.size()},  // the metadata (empty except on rank 0)
      {where[0] + 4 * static_cast<std::uint64_t>(tok_off), mine.tokens.data(), 4 * mine.tokens.size()},
      {where[2] + static_cast<std::uint64_t>(tok_off), mine.mask.data(), mine.mask.size()},
      {where[1] + 8 * static_cast<std::uint64_t>(doc_off), offsets.data(), 8 * offsets.size()}};

  // Every write is an MPI-IO call whose failure every rank learns of; the file is closed on every
  // rank in any case, and a failed file is removed before every rank throws. A .tmp of an
  // earlier run is removed first (the open does not truncate).
  const std::string tmp = path + ".tmp";
  std::error_code ec;
  if (me == 0) fs::remove(tmp, ec);
  agree(world, ec ? fmt::format("output {}: cannot remove the old {} ({})", path, tmp,
                                ec.message())
                  : "");
  std::string err;
  MPI_File fh = MPI_FILE_NULL;
  errno = 0;
  const int rc = MPI_File_open(world.mpi(), tmp.c_str(), MPI_MODE_WRONLY | MPI_MODE_CREATE,
                               MPI_INFO_NULL, &fh);
  if (rc != MPI_SUCCESS) {
    err = fmt::format("output {}: cannot create {} ({})", path, tmp,
                      os_failure(errno, mpi_error_text(rc)));
  } else {
    std::string failure;
    const bool failed = write_pieces(fh, tmp, pieces, world, failure);
    if (!failure.empty())
      err = fmt::format("output {}: writing {} failed: {}; no token file was written", path, tmp,
                        failure);
    const int close_rc = MPI_File_close(&fh);
    if (close_rc != MPI_SUCCESS && !failed)
      err = fmt::format("output {}: closing {} failed: {}", path, tmp, mpi_error_text(close_rc));
  }
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
