// Shared by the fuzz targets that describe an HDF5 file instead of taking its bytes
// (fuzz_checkpoint.cpp, fuzz_token_file.cpp): an attribute of a type and value the input chose.
#pragma once

#include <hdf5.h>

#include <cstdint>
#include <string>

#include "fuzz_util.h"
#include "io/hdf5_util.h"

namespace qt::fuzz {

// The file type of an attribute.
enum class AttrType { kI8, kU8, kI64, kU64, kF32, kF64, kFixedString, kVarString };

struct Attr {
  AttrType type = AttrType::kI64;
  bool pair = false;       // a [2] of the value instead of a scalar (numbers only)
  std::uint64_t bits = 0;  // an integer's: given to HDF5 as uint64 for kU64, else as int64
                           // (HDF5 converts, clipping what the type cannot hold)
  double real = 0;         // a float's (kF32: rounded to float first)
  std::string text;        // a string's: a fixed string holds exactly these bytes (no NUL added)
};

// Writes attribute `name` of `loc` as `a`, replacing one of that name. What HDF5 refuses is left
// unwritten (the reader sees the attribute missing or empty).
inline void write_attr(hid_t loc, const char* name, const Attr& a) {
  using T = AttrType;
  const bool is_string = a.type == T::kFixedString || a.type == T::kVarString;
  QT_FUZZ_ASSERT(!(is_string && a.pair), std::string("a pair of strings for ") + name);
  if (H5Aexists(loc, name) > 0) H5Adelete(loc, name);
  const hsize_t two = 2;
  const h5::Handle space(a.pair ? H5Screate_simple(1, &two, nullptr) : H5Screate(H5S_SCALAR),
                         H5Sclose);
  const hid_t file_type = a.type == T::kI8    ? H5T_STD_I8LE
                          : a.type == T::kU8  ? H5T_STD_U8LE
                          : a.type == T::kI64 ? H5T_STD_I64LE
                          : a.type == T::kU64 ? H5T_STD_U64LE
                          : a.type == T::kF32 ? H5T_IEEE_F32LE
                          : a.type == T::kF64 ? H5T_IEEE_F64LE
                                              : H5T_C_S1;
  const h5::Handle type(H5Tcopy(file_type), H5Tclose);
  if (a.type == T::kVarString) H5Tset_size(type, H5T_VARIABLE);
  if (a.type == T::kFixedString) H5Tset_size(type, a.text.size());
  const h5::Handle attr(H5Acreate2(loc, name, type, space, H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
  if (!attr.valid()) return;
  const std::uint64_t ints[2] = {a.bits, a.bits};
  const double reals[2] = {a.real, a.real};
  const float floats[2] = {static_cast<float>(a.real), static_cast<float>(a.real)};
  const char* s = a.text.c_str();
  switch (a.type) {
    case T::kF32:
      H5Awrite(attr, H5T_NATIVE_FLOAT, floats);
      break;
    case T::kF64:
      H5Awrite(attr, H5T_NATIVE_DOUBLE, reals);
      break;
    case T::kVarString:
      H5Awrite(attr, type, &s);
      break;
    case T::kFixedString:
      H5Awrite(attr, type, a.text.data());
      break;
    default:
      H5Awrite(attr, a.type == T::kU64 ? H5T_NATIVE_UINT64 : H5T_NATIVE_INT64, ints);
  }
}

}  // namespace qt::fuzz
