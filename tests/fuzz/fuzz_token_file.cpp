// The token-file checks (src/data/token_file.*: open_token_file, what data.source = file opens).
// HDF5's own decoder of a corrupt file is not ours to fuzz, so the input describes a token file
// that the HDF5 library writes: each of /tokens, /doc_offsets, /loss_mask present or not, its
// type (integers of 8 to 64 bits, signed or not, float, string, 2-D, a group), its values, a
// chunked extent larger than what was written (a sparse file claiming up to 2^40 entries), and
// the vocab_size attribute (integer, unsigned, float, string, array); then the model's vocab,
// seq_len, packing, seed and whether the tokens stay in memory. A file may only be refused with
// a UserError; an accepted one must give samples whose inputs, targets and positions are valid.
#include <hdf5.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "data/token_file.h"
#include "fuzz_hdf5.h"
#include "fuzz_util.h"
#include "io/hdf5_util.h"
#include "qtrain/data.h"
#include "qtrain/error.h"

namespace {

using qt::fuzz::Bytes;

struct TypeChoice {
  hid_t file;  // the dataset's type in the file
  bool is_float = false, is_string = false;
};

TypeChoice pick_type(Bytes& in) {
  switch (in.u8() % 12) {
    case 0:
      return {H5T_STD_I8LE};
    case 1:
      return {H5T_STD_U8LE};
    case 2:
      return {H5T_STD_I16BE};
    case 3:
      return {H5T_STD_U16LE};
    case 4:
      return {H5T_STD_U32LE};
    case 5:
      return {H5T_STD_I64LE};
    case 6:
      return {H5T_STD_U64LE};
    case 7:
      return {H5T_IEEE_F32LE, true};
    case 8:
      return {H5T_C_S1, false, true};
    default:
      return {in.flag() ? H5T_STD_I64LE : H5T_STD_I32LE};
  }
}

// Writes /name: `values` as the chosen type, maybe 2-D, maybe chunked with a larger extent, or
// a group of that name instead.
void write_column(hid_t file, const char* name, const std::vector<std::int64_t>& values,
                  Bytes& in) {
  const std::uint8_t shape = in.u8();
  if (shape % 16 == 15) {  // a group where a dataset should be
    H5Gclose(H5Gcreate2(file, name, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT));
    return;
  }
  TypeChoice t = pick_type(in);
  const qt::h5::Handle type(H5Tcopy(t.file), H5Tclose);
  if (t.is_string) H5Tset_size(type, 4);
  const hsize_t n = values.size();
  const qt::h5::Handle dcpl(H5Pcreate(H5P_DATASET_CREATE), H5Pclose);
  hsize_t dims[2] = {n, 1};
  int rank = 1;
  if (shape % 16 == 14) rank = 2;  // [n, 1]
  hsize_t extent = n;
  if (shape % 16 >= 11 && shape % 16 <= 13) {
    // Chunked, declared longer than written: the rest reads as the fill value.
    extent = n + (hsize_t{1} << in.range(0, 40));
    const hsize_t chunk = 64;
    H5Pset_chunk(dcpl, 1, &chunk);
  }
  dims[0] = extent;
  const qt::h5::Handle space(H5Screate_simple(rank, dims, nullptr), H5Sclose);
  const qt::h5::Handle ds(H5Dcreate2(file, name, type, space, H5P_DEFAULT, dcpl, H5P_DEFAULT),
                      H5Dclose);
  if (n > 0 && ds.valid()) {
    const qt::h5::Handle fsel(H5Dget_space(ds), H5Sclose);
    const hsize_t start[2] = {0, 0}, count[2] = {n, 1};
    H5Sselect_hyperslab(fsel, H5S_SELECT_SET, start, nullptr, count, nullptr);
    const qt::h5::Handle mspace(H5Screate_simple(1, &n, nullptr), H5Sclose);
    if (t.is_string) {
      std::vector<char> s(n * 4, '7');
      H5Dwrite(ds, type, mspace, fsel, H5P_DEFAULT, s.data());
    } else if (t.is_float) {
      std::vector<float> f(values.begin(), values.end());
      H5Dwrite(ds, H5T_NATIVE_FLOAT, mspace, fsel, H5P_DEFAULT, f.data());
    } else {
      // Converted by HDF5 into the file type (values that do not fit are clipped).
      H5Dwrite(ds, H5T_NATIVE_INT64, mspace, fsel, H5P_DEFAULT, values.data());
    }
  }
}

// The vocab_size attribute: none, or a type and value chosen by the input.
void write_vocab_attr(hid_t file, Bytes& in) {
  using T = qt::fuzz::AttrType;
  constexpr T kTypes[] = {T::kI64,         T::kI64, T::kU64, T::kF64,
                          T::kFixedString, T::kU8,  T::kI64, T::kI64};
  const std::uint8_t kind = in.u8() % 8;
  if (kind == 0) return;
  qt::fuzz::Attr a;
  a.type = kTypes[kind];
  a.pair = kind == 6;
  const std::int64_t v = in.flag() ? static_cast<std::int64_t>(in.u64()) : in.range(0, 400);
  a.bits = static_cast<std::uint64_t>(v);
  a.real = static_cast<double>(v) + 0.5;
  a.text = "12345678";  // no NUL
  qt::fuzz::write_attr(file, "vocab_size", a);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  Bytes in(data, size);
  const int vocab = static_cast<int>(in.range(1, 300));
  const int T = static_cast<int>(in.range(1, 16));
  const auto packing = static_cast<qt::Packing>(in.u8() % 3);
  const std::uint64_t seed = in.u8();
  const std::size_t resident = in.flag() ? 0 : qt::kTokenFileResidentBytes;
  const std::uint8_t present = in.u8();  // bits: tokens, doc_offsets, loss_mask

  // Token ids mostly inside [0, vocab + 2); documents as lengths, or raw offsets.
  const auto N = static_cast<std::size_t>(in.range(0, 200));
  std::vector<std::int64_t> tokens(N), offsets, mask(N);
  for (auto& t : tokens) {
    const std::uint8_t b = in.u8();
    t = b < 250 ? b % (vocab + 2) : static_cast<std::int64_t>(in.u64());
  }
  if (in.u8() % 8 != 0) {  // valid offsets: documents of the given lengths, cut at N
    offsets.push_back(0);
    for (std::int64_t at = 0; at < static_cast<std::int64_t>(N) && offsets.size() < 64;) {
      at = std::min<std::int64_t>(static_cast<std::int64_t>(N), at + in.u8() % 40);
      offsets.push_back(at);
    }
    if (offsets.back() != static_cast<std::int64_t>(N))
      offsets.push_back(static_cast<std::int64_t>(N));
  } else {
    offsets.resize(in.range(0, 20));
    for (auto& o : offsets) o = static_cast<std::int64_t>(in.u64() % 512) - 16;
  }
  for (auto& m : mask) m = in.u8() % 3 == 0 ? 0 : 1;
  if (N > 0 && in.u8() == 0xFF) mask[0] = 7;  // a mask value other than 0 or 1

  const std::string path = (qt::fuzz::scratch_dir() / "tokens.h5").string();
  H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
  hid_t file = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
  QT_FUZZ_ASSERT(file >= 0, "cannot create " + path);
  if (!(present & 1)) write_column(file, "tokens", tokens, in);
  if (!(present & 2)) write_column(file, "doc_offsets", offsets, in);
  if (present & 4) write_column(file, "loss_mask", mask, in);
  write_vocab_attr(file, in);
  H5Fclose(file);

  std::unique_ptr<qt::DataSource> src;
  try {
    src = qt::open_token_file_limited(path, vocab, T, seed, resident, packing);
  } catch (const qt::UserError&) {
    return 0;
  }
  (void)src->describe();
  std::vector<std::int32_t> inputs(T), targets(T), positions(T);
  for (std::int64_t g = 0; g < 12; ++g) {
    src->sample(g * 7, inputs.data(), targets.data(), positions.data(), T);
    for (int t = 0; t < T; ++t) {
      QT_FUZZ_ASSERT(inputs[t] >= 0 && inputs[t] < vocab, "an input id outside the vocabulary");
      QT_FUZZ_ASSERT(targets[t] == -100 || (targets[t] >= 0 && targets[t] < vocab),
                     "a target outside the vocabulary");
      QT_FUZZ_ASSERT(
          t == 0 ? positions[0] == 0 : positions[t] == 0 || positions[t] == positions[t - 1] + 1,
          "positions are not a valid row");
    }
  }
  return 0;
}
