// HDF5 helpers (see hdf5_util.h).
#include "io/hdf5_util.h"

#include <algorithm>
#include <cstring>

namespace qt::h5 {

QuietErrors::QuietErrors() {
  H5Eget_auto2(H5E_DEFAULT, &func_, &data_);
  H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
}

QuietErrors::~QuietErrors() { H5Eset_auto2(H5E_DEFAULT, func_, data_); }

namespace {

herr_t first_error(unsigned n, const H5E_error2_t* e, void* out) {
  auto* s = static_cast<std::string*>(out);
  if (n == 0 && e->desc != nullptr) *s = e->desc;
  return 0;
}

// Scalar (or one-element) attribute `name` of `loc` with its file type; invalid handles when
// absent.
struct AttrAndType {
  Handle attr, type;
};

std::optional<AttrAndType> open_scalar_attr(hid_t loc, const char* name) {
  QuietErrors quiet;
  if (H5Aexists(loc, name) <= 0) return std::nullopt;
  AttrAndType a{Handle(H5Aopen(loc, name, H5P_DEFAULT), close_attr), Handle()};
  if (!a.attr.valid()) return std::nullopt;
  Handle space(H5Aget_space(a.attr), close_space);
  if (!space.valid() || H5Sget_simple_extent_npoints(space) != 1) return std::nullopt;
  a.type = Handle(H5Aget_type(a.attr), close_type);
  if (!a.type.valid()) return std::nullopt;
  return a;
}

template <typename T>
std::optional<T> read_number(hid_t loc, const char* name, hid_t mem_type, bool allow_int,
                             bool allow_float) {
  auto a = open_scalar_attr(loc, name);
  if (!a) return std::nullopt;
  const H5T_class_t c = H5Tget_class(a->type);
  if (!((allow_int && c == H5T_INTEGER) || (allow_float && c == H5T_FLOAT))) return std::nullopt;
  T v{};
  QuietErrors quiet;
  if (H5Aread(a->attr, mem_type, &v) < 0) return std::nullopt;
  return v;
}

void write_scalar(hid_t loc, const char* name, hid_t file_type, hid_t mem_type, const void* v) {
  Handle space = QT_H5_OPEN(H5Screate(H5S_SCALAR), close_space);
  Handle attr =
      QT_H5_OPEN(H5Acreate2(loc, name, file_type, space, H5P_DEFAULT, H5P_DEFAULT), close_attr);
  QT_CHECK_HDF5(H5Awrite(attr, mem_type, v));
  QT_CHECK_HDF5(attr.close());
}

}  // namespace

std::string last_error() {
  std::string s;
  H5Ewalk2(H5E_DEFAULT, H5E_WALK_UPWARD, first_error, &s);
  H5Eclear2(H5E_DEFAULT);
  return s.empty() ? std::string("unknown HDF5 error") : s;
}

bool has_link(hid_t loc, const std::string& name) {
  QuietErrors quiet;
  return H5Lexists(loc, name.c_str(), H5P_DEFAULT) > 0;
}

void write_attr_i64(hid_t loc, const char* name, std::int64_t v) {
  write_scalar(loc, name, H5T_STD_I64LE, H5T_NATIVE_INT64, &v);
}

void write_attr_u64(hid_t loc, const char* name, std::uint64_t v) {
  write_scalar(loc, name, H5T_STD_U64LE, H5T_NATIVE_UINT64, &v);
}

void write_attr_f64(hid_t loc, const char* name, double v) {
  write_scalar(loc, name, H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, &v);
}

void write_attr_string(hid_t loc, const char* name, const std::string& v) {
  Handle type = QT_H5_OPEN(H5Tcopy(H5T_C_S1), close_type);
  QT_CHECK_HDF5(H5Tset_size(type, H5T_VARIABLE));
  QT_CHECK_HDF5(H5Tset_cset(type, H5T_CSET_UTF8));
  const char* p = v.c_str();
  write_scalar(loc, name, type, type, &p);
}

std::optional<std::int64_t> try_read_attr_i64(hid_t loc, const char* name) {
  return read_number<std::int64_t>(loc, name, H5T_NATIVE_INT64, true, false);
}

std::optional<std::uint64_t> try_read_attr_u64(hid_t loc, const char* name) {
  return read_number<std::uint64_t>(loc, name, H5T_NATIVE_UINT64, true, false);
}

std::optional<double> try_read_attr_f64(hid_t loc, const char* name) {
  return read_number<double>(loc, name, H5T_NATIVE_DOUBLE, true, true);
}

std::optional<std::string> try_read_attr_string(hid_t loc, const char* name) {
  auto a = open_scalar_attr(loc, name);
  if (!a || H5Tget_class(a->type) != H5T_STRING) return std::nullopt;
  QuietErrors quiet;
  Handle mem = QT_H5_OPEN(H5Tcopy(H5T_C_S1), close_type);
  if (H5Tis_variable_str(a->type) > 0) {
    QT_CHECK_HDF5(H5Tset_size(mem, H5T_VARIABLE));
    QT_CHECK_HDF5(H5Tset_cset(mem, H5Tget_cset(a->type)));
    char* p = nullptr;
    if (H5Aread(a->attr, mem, &p) < 0) return std::nullopt;
    std::string s = p != nullptr ? std::string(p) : std::string();
    H5free_memory(p);
    return s;
  }
  const std::size_t n = H5Tget_size(a->type);
  if (n == 0) return std::nullopt;
  QT_CHECK_HDF5(H5Tset_size(mem, n));
  QT_CHECK_HDF5(H5Tset_cset(mem, H5Tget_cset(a->type)));
  QT_CHECK_HDF5(H5Tset_strpad(mem, H5T_STR_NULLPAD));
  std::string s(n, '\0');
  if (H5Aread(a->attr, mem, s.data()) < 0) return std::nullopt;
  s.resize(std::strlen(s.c_str()));
  return s;
}

std::optional<std::vector<hsize_t>> dataset_dims(hid_t dataset) {
  QuietErrors quiet;
  Handle space(H5Dget_space(dataset), close_space);
  if (!space.valid() || H5Sget_simple_extent_type(space) != H5S_SIMPLE) return std::nullopt;
  const int rank = H5Sget_simple_extent_ndims(space);
  if (rank < 0) return std::nullopt;
  std::vector<hsize_t> dims(static_cast<std::size_t>(rank));
  if (H5Sget_simple_extent_dims(space, dims.data(), nullptr) < 0) return std::nullopt;
  return dims;
}

namespace {

// Appends the blocks of flat range [lo, hi) of the sub-array dims[axis..], whose leading indices
// are fixed to `prefix` (one per axis before `axis`).
void append_blocks(const std::vector<hsize_t>& dims, std::size_t axis, std::vector<hsize_t>& prefix,
                   hsize_t lo, hsize_t hi, std::vector<Block>& out) {
  if (lo >= hi) return;
  const std::size_t rank = dims.size();
  auto block = [&](hsize_t first, hsize_t n) {  // rows [first, first+n) of this axis, all after
    Block b;
    b.start = prefix;
    b.count.assign(prefix.size(), 1);
    b.start.push_back(first);
    b.count.push_back(n);
    for (std::size_t a = axis + 1; a < rank; ++a) {
      b.start.push_back(0);
      b.count.push_back(dims[a]);
    }
    out.push_back(std::move(b));
  };
  if (axis + 1 == rank) {
    block(lo, hi - lo);
    return;
  }
  hsize_t inner = 1;
  for (std::size_t a = axis + 1; a < rank; ++a) inner *= dims[a];
  hsize_t row = lo / inner;
  if (lo % inner != 0 || hi - lo < inner) {  // partial first row (possibly also the last)
    const hsize_t row_end = std::min(hi, (row + 1) * inner);
    prefix.push_back(row);
    append_blocks(dims, axis + 1, prefix, lo - row * inner, row_end - row * inner, out);
    prefix.pop_back();
    lo = row_end;
    row += 1;
  }
  if (lo >= hi) return;
  const hsize_t full_end = hi / inner;  // rows [row, full_end) are whole
  if (full_end > row) block(row, full_end - row);
  if (hi % inner != 0) {  // partial last row
    prefix.push_back(full_end);
    append_blocks(dims, axis + 1, prefix, 0, hi - full_end * inner, out);
    prefix.pop_back();
  }
}

}  // namespace

std::vector<Block> flat_range_blocks(const std::vector<hsize_t>& dims, hsize_t lo, hsize_t hi) {
  std::vector<Block> out;
  if (dims.empty()) {  // scalar dataspace: one element
    return out;
  }
  std::vector<hsize_t> prefix;
  append_blocks(dims, 0, prefix, lo, hi, out);
  return out;
}

herr_t select_flat_range(hid_t space, const std::vector<hsize_t>& dims, hsize_t lo, hsize_t hi) {
  if (lo >= hi) return H5Sselect_none(space);
  const auto blocks = flat_range_blocks(dims, lo, hi);
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    const herr_t rc =
        H5Sselect_hyperslab(space, i == 0 ? H5S_SELECT_SET : H5S_SELECT_OR, blocks[i].start.data(),
                            nullptr, blocks[i].count.data(), nullptr);
    if (rc < 0) return rc;
  }
  return 0;
}

}  // namespace qt::h5
