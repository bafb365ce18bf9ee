// Small HDF5 helpers shared by checkpoints and token files: RAII handles, quiet error handling,
// attributes, and the selection of a flat element range of a row-major dataset.
//
// Two error styles: QT_H5_OPEN / QT_CHECK_HDF5 abort (writes: the file is ours), the try_* readers
// return nullopt or false so that the caller can turn a bad user file into a UserError.
#pragma once

#include <hdf5.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "qtrain/error.h"

namespace qt::h5 {

// Owns one hid_t and closes it with the matching H5*close function.
class Handle {
 public:
  using Closer = herr_t (*)(hid_t);
  Handle() = default;
  Handle(hid_t id, Closer close) : id_(id), close_(close) {}
  ~Handle() { close(); }
  Handle(Handle&& o) noexcept : id_(std::exchange(o.id_, -1)), close_(o.close_) {}
  Handle& operator=(Handle&& o) noexcept {
    if (this != &o) {
      close();
      id_ = std::exchange(o.id_, -1);
      close_ = o.close_;
    }
    return *this;
  }
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;

  hid_t get() const { return id_; }
  operator hid_t() const { return id_; }  // NOLINT: pass straight to H5* calls
  bool valid() const { return id_ >= 0; }
  // Closes now; returns the closer's status (0 when there was nothing to close).
  herr_t close() {
    herr_t rc = 0;
    if (id_ >= 0 && close_ != nullptr) rc = close_(id_);
    id_ = -1;
    return rc;
  }

 private:
  hid_t id_ = -1;
  Closer close_ = nullptr;
};

// Wraps an id that must be valid; aborts with the expression and file:line otherwise.
inline Handle checked_handle(hid_t id, Handle::Closer close, const char* expr, const char* file,
                             int line) {
  if (id < 0) fail_hdf5(file, line, expr);
  return Handle(id, close);
}

// Closer of each kind of id.
inline herr_t close_file(hid_t id) { return H5Fclose(id); }
inline herr_t close_group(hid_t id) { return H5Gclose(id); }
inline herr_t close_dataset(hid_t id) { return H5Dclose(id); }
inline herr_t close_space(hid_t id) { return H5Sclose(id); }
inline herr_t close_type(hid_t id) { return H5Tclose(id); }
inline herr_t close_attr(hid_t id) { return H5Aclose(id); }
inline herr_t close_plist(hid_t id) { return H5Pclose(id); }

// Turns off HDF5's automatic printing of the error stack for its lifetime (and restores the
// previous handler after), so that a bad user file shows only our message.
class QuietErrors {
 public:
  QuietErrors();
  ~QuietErrors();
  QuietErrors(const QuietErrors&) = delete;
  QuietErrors& operator=(const QuietErrors&) = delete;

 private:
  H5E_auto2_t func_ = nullptr;
  void* data_ = nullptr;
};

// The most specific message on the current thread's error stack (e.g. "truncated file: eof =
// 1024, ..."), then clears the stack. "unknown HDF5 error" when the stack is empty.
std::string last_error();

// True when `name` is a link directly inside `loc` (never an error when it is not).
bool has_link(hid_t loc, const std::string& name);

// Root or object attributes. write_* abort on failure; every rank of a parallel file must write
// the same value. Strings are variable-length UTF-8.
void write_attr_i64(hid_t loc, const char* name, std::int64_t v);
void write_attr_u64(hid_t loc, const char* name, std::uint64_t v);
void write_attr_f64(hid_t loc, const char* name, double v);
void write_attr_string(hid_t loc, const char* name, const std::string& v);

// Scalar attribute readers: nullopt when absent, not scalar, or of the wrong class (integer for
// i64/u64, float for f64, string for string). Never print.
std::optional<std::int64_t> try_read_attr_i64(hid_t loc, const char* name);
std::optional<std::uint64_t> try_read_attr_u64(hid_t loc, const char* name);
std::optional<double> try_read_attr_f64(hid_t loc, const char* name);
std::optional<std::string> try_read_attr_string(hid_t loc, const char* name);

// Dimensions of a dataset's simple dataspace; nullopt if it is not simple (e.g. scalar, null).
std::optional<std::vector<hsize_t>> dataset_dims(hid_t dataset);

// One rectangle of a hyperslab selection.
struct Block {
  std::vector<hsize_t> start, count;
};

// The rectangles (in row-major order) that cover the flat elements [lo, hi) of a row-major array
// of shape `dims`: at most 2 * rank - 1 of them (3 for a matrix: a partial first row, whole rows,
// a partial last row). Empty when lo == hi.
std::vector<Block> flat_range_blocks(const std::vector<hsize_t>& dims, hsize_t lo, hsize_t hi);

// Selects flat elements [lo, hi) in `space` (of shape `dims`) as the OR of flat_range_blocks;
// selects none when lo == hi. Returns a negative value on failure.
herr_t select_flat_range(hid_t space, const std::vector<hsize_t>& dims, hsize_t lo, hsize_t hi);

}  // namespace qt::h5

// Wraps the id returned by `expr` in a Handle closed by `closer`; aborts if `expr` failed.
#define QT_H5_OPEN(expr, closer) \
  ::qt::h5::checked_handle((expr), (closer), #expr, __FILE__, __LINE__)
