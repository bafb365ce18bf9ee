// Token files: fixed-length windows over concatenated documents, or per-document chunks
// (include/qtrain/data.h, docs/data.md). Every rank opens the file on its own (serial HDF5
// driver, read only).
#include "data/token_file.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>
#include <optional>
#include <mutex>

#include "io/hdf5_util.h"
#include "qtrain/error.h"
#include "runtime/rng.h"

namespace qt {

namespace {

constexpr std::int32_t kIgnore = -100;            // target not counted
constexpr hsize_t kScanChunk = hsize_t{1} << 22;  // elements per read while validating

const char* class_name(H5T_class_t c) {
  switch (c) {
    case H5T_INTEGER:
      return "integer";
    case H5T_FLOAT:
      return "float";
    case H5T_STRING:
      return "string";
    case H5T_COMPOUND:
      return "compound";
    default:
      return "non-numeric";
  }
}

// An open 1-D integer dataset, its length and signedness.
struct Column {
  h5::Handle ds;
  hsize_t n = 0;
  bool is_unsigned = false;
};

// Opens /name as a 1-D dataset of integers of up to 64 bits; throws UserError naming file and
// dataset otherwise.
Column open_column(hid_t file, const std::string& path, const char* name) {
  if (!h5::has_link(file, name)) fail_user("token file {}: dataset /{} is missing", path, name);
  Column c;
  c.ds = h5::Handle(H5Dopen2(file, name, H5P_DEFAULT), h5::close_dataset);
  if (!c.ds.valid()) fail_user("token file {}: /{} is not a dataset", path, name);
  h5::Handle type(H5Dget_type(c.ds), h5::close_type);
  const H5T_class_t cls = type.valid() ? H5Tget_class(type) : H5T_NO_CLASS;
  if (cls != H5T_INTEGER)
    fail_user("token file {}: /{} must hold integers, it holds {} values", path, name,
              class_name(cls));
  if (H5Tget_precision(type) > 64)
    fail_user("token file {}: /{} must hold integers of at most 64 bits, it holds {}-bit ones",
              path, name, H5Tget_precision(type));
  c.is_unsigned = H5Tget_sign(type) == H5T_SGN_NONE;
  const auto dims = h5::dataset_dims(c.ds);
  if (!dims || dims->size() != 1)
    fail_user("token file {}: /{} must be 1-D, it is {}-D", path, name,
              dims ? dims->size() : std::size_t{0});
  c.n = (*dims)[0];
  // Entries never written read as the fill value: a sparse or unfinished dataset, which may also
  // declare far more entries than the file holds (2^40 in a file of a few KiB, whose reading
  // would allocate or scan terabytes).
  H5D_space_status_t stored = H5D_SPACE_STATUS_ERROR;
  if (c.n > 0 &&
      (H5Dget_space_status(c.ds, &stored) < 0 || stored != H5D_SPACE_STATUS_ALLOCATED))
    fail_user("token file {}: /{} declares {} entries but not all of them were written "
              "(a sparse or unfinished dataset)",
              path, name, c.n);
  return c;
}

// Reads elements [lo, lo + n) of a 1-D dataset, converted to `mem_type`. Returns < 0 on failure.
herr_t read_slice(hid_t ds, hid_t mem_type, hsize_t lo, hsize_t n, void* out) {
  if (n == 0) return 0;
  h5::Handle fspace(H5Dget_space(ds), h5::close_space);
  h5::Handle mspace(H5Screate_simple(1, &n, nullptr), h5::close_space);
  if (!fspace.valid() || !mspace.valid()) return -1;
  if (H5Sselect_hyperslab(fspace, H5S_SELECT_SET, &lo, nullptr, &n, nullptr) < 0) return -1;
  return H5Dread(ds, mem_type, mspace, fspace, H5P_DEFAULT, out);
}

template <typename T>
void read_or_fail(const Column& c, hid_t mem_type, hsize_t lo, hsize_t n, T* out,
                  const std::string& path, const char* name) {
  if (read_slice(c.ds, mem_type, lo, n, out) < 0)
    fail_user("token file {}: cannot read /{} ({})", path, name, h5::last_error());
}

// Elements [lo, lo + n) as their exact values: HDF5 clips what does not fit the memory type
// (3000000000 read as int32 is 2147483647), so every column is read as 64-bit integers of its
// own signedness, and an unsigned value above INT64_MAX is an error naming it.
void read_exact(const Column& c, hsize_t lo, hsize_t n, std::int64_t* out,
                const std::string& path, const char* name) {
  if (!c.is_unsigned) return read_or_fail(c, H5T_NATIVE_INT64, lo, n, out, path, name);
  auto* u = reinterpret_cast<std::uint64_t*>(out);  // same size; signed/unsigned may alias
  read_or_fail(c, H5T_NATIVE_UINT64, lo, n, u, path, name);
  for (hsize_t k = 0; k < n; ++k)
    if (u[k] > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
      fail_user("token file {}: /{}[{}] = {} is out of range", path, name, lo + k, u[k]);
}

// The vocab_size attribute, if present, as written; throws UserError when it is not an integer
// scalar or does not fit int64.
std::optional<std::int64_t> read_vocab_attr(hid_t file, const std::string& path) {
  if (H5Aexists(file, "vocab_size") <= 0) return std::nullopt;
  h5::Handle attr(H5Aopen(file, "vocab_size", H5P_DEFAULT), h5::close_attr);
  h5::Handle type(attr.valid() ? H5Aget_type(attr) : -1, h5::close_type);
  const bool is_unsigned = type.valid() && H5Tget_class(type) == H5T_INTEGER &&
                           H5Tget_sign(type) == H5T_SGN_NONE;
  if (is_unsigned) {
    const auto u = h5::try_read_attr_u64(file, "vocab_size");
    if (u && *u > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
      fail_user("token file {}: attribute vocab_size = {} is out of range", path, *u);
  }
  const auto v = h5::try_read_attr_i64(file, "vocab_size");
  if (!v) fail_user("token file {}: attribute vocab_size must be an integer scalar", path);
  return v;
}

class TokenFileSource final : public DataSource {
 public:
  TokenFileSource(std::string path, int T, std::uint64_t seed, Packing packing, TokenSplit split)
      : path_(std::move(path)), T_(T), seed_(seed), packing_(packing), split_(split) {}

  // Opens and validates; throws UserError.
  void open(int vocab, std::size_t max_resident_bytes) {
    h5::QuietErrors quiet;
    std::error_code ec;
    if (!std::filesystem::exists(path_, ec)) fail_user("token file {}: no such file", path_);
    file_ = h5::Handle(H5Fopen(path_.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), h5::close_file);
    if (!file_.valid())
      fail_user("token file {}: cannot open it as HDF5 ({})", path_, h5::last_error());

    tokens_ = open_column(file_, path_, "tokens");
    const hsize_t N = tokens_.n;
    Column offsets = open_column(file_, path_, "doc_offsets");
    has_mask_ = h5::has_link(file_, "loss_mask");
    if (has_mask_) {
      mask_ = open_column(file_, path_, "loss_mask");
      if (mask_.n != N)
        fail_user("token file {}: /loss_mask has {} entries but /tokens has {}", path_, mask_.n, N);
    }
    // Token ids lie below `limit`: the model's vocabulary, or the file's own when smaller.
    std::int64_t limit = vocab;
    const auto file_vocab = read_vocab_attr(file_, path_);
    if (file_vocab && *file_vocab > vocab)
      fail_user("token file {}: attribute vocab_size = {} exceeds the model's vocab_size {}",
                path_, *file_vocab, vocab);
    if (file_vocab) limit = *file_vocab;

    // Documents: offsets run from 0 to N and never decrease.
    if (offsets.n < 1)
      fail_user("token file {}: /doc_offsets is empty (needs D + 1 entries)", path_);
    std::vector<std::int64_t> off(offsets.n);
    read_exact(offsets, 0, offsets.n, off.data(), path_, "doc_offsets");
    if (off.front() != 0 || off.back() != static_cast<std::int64_t>(N))
      fail_user(
          "token file {}: /doc_offsets must run from 0 to the token count {}, it runs from "
          "{} to {}",
          path_, N, off.front(), off.back());
    for (std::size_t d = 1; d < off.size(); ++d)
      if (off[d] < off[d - 1])
        fail_user("token file {}: /doc_offsets decreases at index {} ({} after {})", path_, d,
                  off[d], off[d - 1]);
    docs_ = static_cast<std::int64_t>(off.size()) - 1;
    n_ = static_cast<std::int64_t>(N);

    if (packing_ == Packing::kPadded) {
      // Document d of L tokens gives ceil((L - 1) / T) chunks (none when L < 2: no target).
      chunk_prefix_.assign(off.size(), 0);
      for (std::int64_t d = 0; d < docs_; ++d) {
        const std::int64_t L = off[d + 1] - off[d];
        chunk_prefix_[d + 1] = chunk_prefix_[d] + (L >= 2 ? (L - 2) / T_ + 1 : 0);
      }
      units_ = chunk_prefix_.back();
      if (units_ == 0)
        fail_user("token file {}: data.packing = padded needs a document of at least 2 tokens; "
                  "all {} documents are shorter",
                  path_, docs_);
    } else {
      if (N < static_cast<hsize_t>(T_) + 1)
        fail_user("token file {}: /tokens holds {} tokens, one sample needs seq_len + 1 = {}",
                  path_, N, T_ + 1);
      units_ = (n_ - 1) / T_;
    }
    if (packing_ != Packing::kConcat) offsets_ = std::move(off);
    select_part();

    // Token ids in [0, limit), mask values 0 or 1, checked on their exact values; kept in memory
    // when small enough (as int32 and uint8, which then hold them exactly).
    resident_ = N * (sizeof(std::int32_t) + (has_mask_ ? 1 : 0)) <= max_resident_bytes;
    if (resident_) tokens_mem_.resize(N);
    if (resident_ && has_mask_) mask_mem_.resize(N);
    std::vector<std::int64_t> chunk(std::min(kScanChunk, N));
    for (hsize_t lo = 0; lo < N; lo += kScanChunk) {
      const hsize_t n = std::min(kScanChunk, N - lo);
      read_exact(tokens_, lo, n, chunk.data(), path_, "tokens");
      for (hsize_t k = 0; k < n; ++k)
        if (chunk[k] < 0 || chunk[k] >= limit)
          fail_user("token file {}: /tokens[{}] = {} is outside the vocabulary [0, {}){}", path_,
                    lo + k, chunk[k], limit,
                    limit < vocab ? " of the file's vocab_size attribute" : "");
      if (resident_) std::copy_n(chunk.data(), n, tokens_mem_.data() + lo);
      if (!has_mask_) continue;
      read_exact(mask_, lo, n, chunk.data(), path_, "loss_mask");
      for (hsize_t k = 0; k < n; ++k)
        if (chunk[k] != 0 && chunk[k] != 1)
          fail_user("token file {}: /loss_mask[{}] = {} must be 0 or 1", path_, lo + k, chunk[k]);
      if (resident_) std::copy_n(chunk.data(), n, mask_mem_.data() + lo);
    }
    if (resident_) {  // nothing more to read from the file
      tokens_.ds.close();
      mask_.ds.close();
      file_.close();
    }
  }

  void sample(std::int64_t index, std::int32_t* inputs, std::int32_t* targets,
              std::int32_t* positions, int T) const override {
    QT_CHECK(T == T_, "token file {} was opened for seq_len {}, asked for {}", path_, T_, T);
    QT_CHECK(index >= 0, "negative sample index {}", index);
    std::lock_guard<std::mutex> lock(mu_);
    const std::int64_t n = epoch_size();
    const std::int64_t epoch = index / n;
    if (epoch != order_epoch_) {
      order_ = token_window_order(n, seed_, epoch);
      order_epoch_ = epoch;
    }
    const std::int64_t at = order_[index % n];
    const std::int64_t unit = part_.empty() ? at : part_[at];
    if (packing_ == Packing::kPadded) {
      padded_sample(unit, inputs, targets, positions);
      return;
    }
    const std::int64_t start = unit * T_;  // window = tokens [start, start+T]
    read_tokens(start, static_cast<std::size_t>(T_) + 1);
    // new_doc[t]: token start + t begins a document (packed only; t = 0 always does).
    new_doc_.assign(static_cast<std::size_t>(T_) + 1, 0);
    if (packing_ == Packing::kPacked) {
      new_doc_[0] = 1;
      // offsets_.back() = N > start + T, so the scan stops inside the vector.
      for (auto it = std::upper_bound(offsets_.begin(), offsets_.end(), start);
           *it <= start + T_; ++it)
        new_doc_[static_cast<std::size_t>(*it - start)] = 1;
    }
    for (int t = 0; t < T; ++t) {
      inputs[t] = window_[t];
      targets[t] = window_mask_[t + 1] != 0 && !new_doc_[t + 1] ? window_[t + 1] : kIgnore;
      if (positions) positions[t] = new_doc_[t] || t == 0 ? 0 : positions[t - 1] + 1;
    }
  }

  std::int64_t epoch_size() const override {
    return part_.empty() ? units_ : static_cast<std::int64_t>(part_.size());
  }

  std::string describe() const override {
    std::string what;
    if (packing_ == Packing::kPadded)
      what = fmt::format("{} chunks of up to {} tokens, one document per sample, padded", units_,
                         T_ + 1);
    else
      what = fmt::format("{} windows of {} tokens{}", units_, T_ + 1,
                         packing_ == Packing::kPacked ? ", documents packed (no attention across)"
                                                      : "");
    std::string part;
    if (split_.part == TokenSplit::Part::kTrain)
      part = fmt::format("; {} of them train, {} held out (eval.split = {})", part_.size(),
                         units_ - static_cast<std::int64_t>(part_.size()), split_.fraction);
    else if (split_.part == TokenSplit::Part::kHeldOut)
      part = fmt::format("; the {} held out (eval.split = {})", part_.size(), split_.fraction);
    return fmt::format("token file {}: {} tokens in {} documents, {}{}{}{}", path_, n_, docs_,
                       what, has_mask_ ? ", loss mask" : "", resident_ ? "" : ", read on demand",
                       part);
  }

 private:
  // part_: the units of split_'s part, ascending (TokenSplit); empty for Part::kAll.
  void select_part() {
    if (split_.part == TokenSplit::Part::kAll) return;
    QT_CHECK(split_.fraction > 0 && split_.fraction < 1, "eval.split {} outside (0, 1)",
             split_.fraction);
    const std::int64_t held = std::max<std::int64_t>(
        1, std::llround(split_.fraction * static_cast<double>(units_)));
    if (held >= units_)
      fail_user("token file {}: eval.split = {} holds out {} of its {} {}, which leaves none to "
                "train on; lower eval.split or use eval.paths",
                path_, split_.fraction, held, units_,
                packing_ == Packing::kPadded ? "chunks" : "windows");
    const std::vector<std::int64_t> perm = token_window_order(units_, kHoldoutSeed, 0);
    const bool train = split_.part == TokenSplit::Part::kTrain;
    part_.assign(perm.begin() + (train ? held : 0), train ? perm.end() : perm.begin() + held);
    std::sort(part_.begin(), part_.end());
  }

  // Chunk `unit` of the padded order: document d, tokens [c T, c T + T] of it (cut at its end).
  void padded_sample(std::int64_t unit, std::int32_t* inputs, std::int32_t* targets,
                     std::int32_t* positions) const {
    const auto d = std::upper_bound(chunk_prefix_.begin(), chunk_prefix_.end(), unit) -
                   chunk_prefix_.begin() - 1;  // chunk_prefix_[d] <= unit < chunk_prefix_[d+1]
    const std::int64_t start = offsets_[d] + (unit - chunk_prefix_[d]) * T_;
    const auto len = static_cast<int>(std::min<std::int64_t>(T_ + 1, offsets_[d + 1] - start));
    QT_CHECK(len >= 2, "padded chunk of {} tokens", len);
    read_tokens(start, static_cast<std::size_t>(len));
    for (int t = 0; t < T_; ++t) {
      inputs[t] = t < len ? window_[t] : kPadToken;
      targets[t] = t + 1 < len && window_mask_[t + 1] != 0 ? window_[t + 1] : kIgnore;
      if (positions) positions[t] = t;  // pads continue the document's positions
    }
  }

  // window_, window_mask_ = tokens and mask [start, start + W).
  void read_tokens(std::int64_t start, std::size_t W) const {
    window_.resize(W);
    window_mask_.assign(W, 1);
    if (resident_) {
      std::copy_n(tokens_mem_.data() + start, W, window_.data());
      if (has_mask_) std::copy_n(mask_mem_.data() + start, W, window_mask_.data());
    } else {
      h5::QuietErrors quiet;
      if (read_slice(tokens_.ds, H5T_NATIVE_INT32, start, W, window_.data()) < 0 ||
          (has_mask_ && read_slice(mask_.ds, H5T_NATIVE_UINT8, start, W, window_mask_.data()) < 0))
        fatal_one(__FILE__, __LINE__,
                  fmt::format("token file {}: read of tokens [{}, {}) failed "
                              "after a successful open ({})",
                              path_, start, start + W, h5::last_error()));
    }
  }

  std::string path_;
  int T_;
  std::uint64_t seed_;
  Packing packing_;
  TokenSplit split_;
  std::vector<std::int64_t> part_;  // select_part()
  // units_: windows, or chunks when padded (the samples of an epoch without a split).
  std::int64_t n_ = 0, docs_ = 0, units_ = 0;
  std::vector<std::int64_t> offsets_;       // [D + 1] doc_offsets (packed, padded)
  std::vector<std::int64_t> chunk_prefix_;  // [D + 1] chunks before document d (padded)
  bool has_mask_ = false, resident_ = false;
  std::vector<std::int32_t> tokens_mem_;  // [N] when resident
  std::vector<std::uint8_t> mask_mem_;    // [N] when resident and the file has a mask
  h5::Handle file_;                       // kept open when not resident
  Column tokens_, mask_;
  // Guards the epoch order cache, the window buffers and HDF5 (not thread-safe here).
  mutable std::mutex mu_;
  mutable std::int64_t order_epoch_ = -1;
  mutable std::vector<std::int64_t> order_;
  mutable std::vector<std::int32_t> window_;
  mutable std::vector<std::uint8_t> window_mask_;
  mutable std::vector<std::uint8_t> new_doc_;  // [T + 1]
};

}  // namespace

std::vector<std::int64_t> token_window_order(std::int64_t windows, std::uint64_t seed,
                                             std::int64_t epoch) {
  std::vector<std::int64_t> order(static_cast<std::size_t>(windows));
  for (std::int64_t i = 0; i < windows; ++i) order[i] = i;
  // splitmix64: output k is mix(state0 + k * golden); rng::mix adds the golden step itself.
  std::uint64_t state = rng::hash_combine(seed, static_cast<std::uint64_t>(epoch));
  for (std::int64_t i = windows - 1; i > 0; --i) {
    const std::uint64_t x = rng::mix(state);
    state += 0x9E3779B97F4A7C15ull;
    // j uniform in [0, i] by the high half of a 64x64 product (bias below i / 2^64).
    const auto j = static_cast<std::int64_t>(
        (static_cast<unsigned __int128>(x) * static_cast<std::uint64_t>(i + 1)) >> 64);
    std::swap(order[i], order[j]);
  }
  return order;
}

std::unique_ptr<DataSource> open_token_file_limited(const std::string& path, int vocab, int T,
                                                    std::uint64_t seed,
                                                    std::size_t max_resident_bytes,
                                                    Packing packing, TokenSplit split) {
  QT_CHECK(vocab > 0 && T > 0, "token file needs vocab > 0 and seq_len > 0, got {} and {}", vocab,
           T);
  auto src = std::make_unique<TokenFileSource>(path, T, seed, packing, split);
  src->open(vocab, max_resident_bytes);
  return src;
}

std::unique_ptr<DataSource> open_token_file(const std::string& path, int vocab, int T,
                                            std::uint64_t seed, Packing packing,
                                            TokenSplit split) {
  return open_token_file_limited(path, vocab, T, seed, kTokenFileResidentBytes, packing, split);
}

Packing packing_from_name(const std::string& name) {
  if (name == "packed") return Packing::kPacked;
  if (name == "padded") return Packing::kPadded;
  QT_CHECK(name == "concat", "unknown data.packing {}", name);
  return Packing::kConcat;
}

void write_token_file(const std::string& path, const std::vector<std::int32_t>& tokens,
                      const std::vector<std::int64_t>& doc_offsets,
                      const std::vector<std::uint8_t>& loss_mask, std::int64_t vocab_size) {
  const auto N = static_cast<std::int64_t>(tokens.size());
  if (doc_offsets.empty() || doc_offsets.front() != 0 || doc_offsets.back() != N)
    fail_user("cannot write token file {}: doc_offsets must run from 0 to {}", path, N);
  for (std::size_t d = 1; d < doc_offsets.size(); ++d)
    if (doc_offsets[d] < doc_offsets[d - 1])
      fail_user("cannot write token file {}: doc_offsets decreases at index {}", path, d);
  if (!loss_mask.empty() && loss_mask.size() != tokens.size())
    fail_user("cannot write token file {}: loss_mask has {} entries, tokens {}", path,
              loss_mask.size(), tokens.size());
  for (std::size_t i = 0; i < tokens.size(); ++i)
    if (tokens[i] < 0 || tokens[i] >= vocab_size)
      fail_user("cannot write token file {}: token {} = {} is outside [0, {})", path, i, tokens[i],
                vocab_size);

  h5::Handle file;
  {
    h5::QuietErrors quiet;
    file = h5::Handle(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT),
                      h5::close_file);
    if (!file.valid()) fail_user("cannot create token file {} ({})", path, h5::last_error());
  }
  auto column = [&](const char* name, hid_t file_type, hid_t mem_type, const void* data,
                    hsize_t n) {
    h5::Handle space = QT_H5_OPEN(H5Screate_simple(1, &n, nullptr), h5::close_space);
    h5::Handle ds =
        QT_H5_OPEN(H5Dcreate2(file, name, file_type, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT),
                   h5::close_dataset);
    if (n > 0) QT_CHECK_HDF5(H5Dwrite(ds, mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, data));
  };
  column("tokens", H5T_STD_I32LE, H5T_NATIVE_INT32, tokens.data(), tokens.size());
  column("doc_offsets", H5T_STD_I64LE, H5T_NATIVE_INT64, doc_offsets.data(), doc_offsets.size());
  if (!loss_mask.empty())
    column("loss_mask", H5T_STD_U8LE, H5T_NATIVE_UINT8, loss_mask.data(), loss_mask.size());
  h5::write_attr_i64(file, "vocab_size", vocab_size);
  QT_CHECK_HDF5(file.close());
}

}  // namespace qt
