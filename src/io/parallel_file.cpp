#include "io/parallel_file.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "qtrain/error.h"

namespace qt::h5 {

namespace {

// The core driver's image buffer, kept when the in-memory file is closed instead of freed.
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

constexpr std::size_t kStep = 4096;  // growth of the in-memory file, bytes

// The image of one attempt with `reserve` bytes kept for the metadata; "" when it outgrew them.
std::string try_image(std::size_t reserve, const std::function<std::uint64_t(hid_t)>& populate) {
  ImageCapture capture;
  std::uint64_t first = 0;
  {
    Handle fapl = QT_H5_OPEN(H5Pcreate(H5P_FILE_ACCESS), close_plist);
    // The memory grows in steps of kStep; nothing is ever written to a backing file.
    QT_CHECK_HDF5(H5Pset_fapl_core(fapl, kStep, /*backing_store=*/0));
    QT_CHECK_HDF5(H5Pset_meta_block_size(fapl, reserve));
    // No aggregation of small datasets: each is placed at the end of the file, in order.
    QT_CHECK_HDF5(H5Pset_small_data_block_size(fapl, 0));
    H5FD_file_image_callbacks_t cb = {image_malloc,     image_memcpy,     image_realloc, image_free,
                                      image_udata_copy, image_udata_free, &capture};
    QT_CHECK_HDF5(H5Pset_file_image_callbacks(fapl, &cb));
    // No object times (HDF5 records them by default, to the second): the same state gives the
    // same bytes whenever it is written.
    Handle fcpl = QT_H5_OPEN(H5Pcreate(H5P_FILE_CREATE), close_plist);
    QT_CHECK_HDF5(H5Pset_obj_track_times(fcpl, 0));
    Handle file = QT_H5_OPEN(H5Fcreate("qtrain-metadata-image", H5F_ACC_TRUNC, fcpl, fapl),
                             close_file);
    first = populate(file);
    QT_CHECK_HDF5(file.close());
  }
  // The image grows only where something was written: the values are not, so metadata placed
  // after a dataset (an outgrown block) makes it end beyond the step that holds `first`. The
  // block, and the heap of string attributes behind it, end at or before `first`.
  const std::uint64_t limit =
      first == UINT64_MAX ? first : (first + kStep - 1) / kStep * kStep;  // no dataset: no limit
  if (capture.kept.empty() || capture.kept.size() > limit) return "";
  capture.kept.resize(std::min<std::uint64_t>(capture.kept.size(), first));
  return std::move(capture.kept);
}

std::string mpi_error_text(int code) {
  char text[MPI_MAX_ERROR_STRING] = "";
  int len = 0;
  MPI_Error_string(code, text, &len);
  return std::string(text, static_cast<std::size_t>(len));
}

// errno of writing `n` bytes at `at` of `path` with pwrite(2); 0 when they are written. Open
// MPI's ompio reports a failed write as a short count and leaves no errno: writing the rest
// directly tells why.
int os_error_of_pwrite(const std::string& path, std::uint64_t at, const char* data,
                       std::uint64_t n) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
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

std::string os_text(int os_error) {
  return std::string(std::strerror(os_error)) +
         (os_error == ENOSPC || os_error == EDQUOT ? " (the disk is full)" : "");
}

}  // namespace

Handle early_contiguous_dcpl() {
  Handle dcpl = QT_H5_OPEN(H5Pcreate(H5P_DATASET_CREATE), close_plist);
  QT_CHECK_HDF5(H5Pset_layout(dcpl, H5D_CONTIGUOUS));
  QT_CHECK_HDF5(H5Pset_alloc_time(dcpl, H5D_ALLOC_TIME_EARLY));
  QT_CHECK_HDF5(H5Pset_fill_time(dcpl, H5D_FILL_TIME_NEVER));
  QT_CHECK_HDF5(H5Pset_obj_track_times(dcpl, 0));  // no times: the same values, the same bytes
  return dcpl;
}

Handle untimed_gcpl() {
  Handle gcpl = QT_H5_OPEN(H5Pcreate(H5P_GROUP_CREATE), close_plist);
  QT_CHECK_HDF5(H5Pset_obj_track_times(gcpl, 0));
  return gcpl;
}

std::uint64_t dataset_offset(hid_t dataset) {
  const haddr_t at = H5Dget_offset(dataset);
  QT_CHECK(at != HADDR_UNDEF, "a dataset has no storage (not contiguous or not allocated)");
  return static_cast<std::uint64_t>(at);
}

std::string metadata_image(const std::function<std::uint64_t(hid_t file)>& populate) {
  for (std::size_t reserve = std::size_t{64} << 10; reserve <= (std::size_t{1} << 32);
       reserve *= 4) {
    std::string image = try_image(reserve, populate);
    if (!image.empty()) return image;
  }
  fatal_one(__FILE__, __LINE__, "HDF5 metadata does not fit before the datasets' values");
}

WriteResult write_pieces(const std::string& path, const std::vector<Piece>& pieces,
                         MpiComm& world) {
  WriteResult res;
  std::string mine;  // this rank's failure
  int mine_os = 0;
  MPI_File fh = MPI_FILE_NULL;
  errno = 0;
  const int open_rc =
      MPI_File_open(world.mpi(), path.c_str(), MPI_MODE_WRONLY | MPI_MODE_CREATE, MPI_INFO_NULL, &fh);
  if (open_rc != MPI_SUCCESS) {
    mine_os = errno;
    mine = fmt::format("creating {} failed: {}", path,
                       mine_os != 0 ? os_text(mine_os) : mpi_error_text(open_rc));
  }
  // Every rank makes the same calls: as many pieces as the rank with most, as many 1 GiB rounds
  // per piece as the largest of that piece's index.
  constexpr std::uint64_t kRound = std::uint64_t{1} << 30;
  std::int64_t n_pieces = static_cast<std::int64_t>(pieces.size());
  world.all_reduce(&n_pieces, 1, DType::kI64, ReduceOp::kMax);
  std::int64_t failed = mine.empty() ? 0 : 1;
  world.all_reduce(&failed, 1, DType::kI64, ReduceOp::kMax);
  for (std::int64_t i = 0; i < n_pieces && failed == 0; ++i) {
    const Piece p = i < static_cast<std::int64_t>(pieces.size()) ? pieces[i] : Piece{};
    std::int64_t rounds = static_cast<std::int64_t>((p.bytes + kRound - 1) / kRound);
    world.all_reduce(&rounds, 1, DType::kI64, ReduceOp::kMax);
    for (std::int64_t k = 0; k < rounds && failed == 0; ++k) {
      const std::uint64_t lo = std::min(p.bytes, static_cast<std::uint64_t>(k) * kRound);
      const std::uint64_t n = std::min(p.bytes - lo, kRound);
      const char* data = static_cast<const char*>(p.data) + lo;
      MPI_Status status;
      errno = 0;
      const int rc = MPI_File_write_at_all(fh, static_cast<MPI_Offset>(p.at + lo), data,
                                           static_cast<int>(n), MPI_BYTE, &status);
      const int errno_after = errno;
      int written = 0;
      if (rc == MPI_SUCCESS) MPI_Get_count(&status, MPI_BYTE, &written);
      if (rc != MPI_SUCCESS) {
        mine_os = errno_after;
        mine = fmt::format("writing {} failed: {}", path,
                           mine_os != 0 ? os_text(mine_os) : mpi_error_text(rc));
      } else if (static_cast<std::uint64_t>(written) != n) {
        const auto w = static_cast<std::uint64_t>(std::max(written, 0));
        mine_os = os_error_of_pwrite(path, p.at + lo + w, data + w, n - w);
        mine = fmt::format("writing {} failed: {}", path,
                           mine_os != 0 ? os_text(mine_os)
                                        : fmt::format("{} of {} bytes written", w, n));
      }
      failed = mine.empty() ? 0 : 1;
      world.all_reduce(&failed, 1, DType::kI64, ReduceOp::kMax);
    }
  }
  if (fh != MPI_FILE_NULL) {
    const int close_rc = MPI_File_close(&fh);
    if (close_rc != MPI_SUCCESS && mine.empty())
      mine = fmt::format("closing {} failed: {}", path, mpi_error_text(close_rc));
  }
  // The message and the OS error of the lowest failing rank, on every rank.
  std::int64_t first = mine.empty() ? world.size() : world.rank();
  world.all_reduce(&first, 1, DType::kI64, ReduceOp::kMin);
  if (first == world.size()) return res;
  std::int64_t os = mine_os;
  world.broadcast(&os, 1, DType::kI64, static_cast<int>(first));
  broadcast_string(world, mine, static_cast<int>(first));
  res.error = mine;
  res.os_error = static_cast<int>(os);
  return res;
}

}  // namespace qt::h5
