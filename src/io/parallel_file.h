// Writing an HDF5 file from every rank so that a failure (a full disk, a quota, a file size
// limit, an I/O error) ends cleanly: every rank learns of it, the file is closed everywhere, and
// the caller removes it and throws one UserError. Used by checkpoints and by `qtrain prep`.
//
// HDF5 never writes to the disk here. HDF5 1.10 cannot survive a write that fails half-way: a
// failed H5Fclose leaves a dangling file id, and the library crashes in MPI_Finalize. So rank 0
// builds the file's metadata in memory (the core driver, no backing store), with every dataset
// contiguous, allocated early and never filled, behind a block reserved for the metadata; then
// every rank writes the metadata image (rank 0) and its share of the values with MPI-IO.
#pragma once

#include <hdf5.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "io/hdf5_util.h"
#include "qtrain/comm.h"

namespace qt::h5 {

// Dataset creation properties of such files: contiguous, space allocated at creation, no fill.
Handle early_contiguous_dcpl();
// Group creation without object modification times (files of the same state are byte-equal).
Handle untimed_gcpl();

// The byte offset of a dataset's values in its file (created with early_contiguous_dcpl()).
std::uint64_t dataset_offset(hid_t dataset);

// The metadata of a file, built in memory on one rank: `populate` creates groups, attributes and
// datasets (early_contiguous_dcpl) in the in-memory file it is given and returns the smallest
// byte offset of a dataset's values (UINT64_MAX when it made none). The datasets are allocated in
// the order created, behind a block kept for the metadata; string attributes must
// be written before the first dataset (their heap is allocated like data). Returns the bytes of
// the file before the first dataset's values: its metadata. The block grows until it holds all
// the metadata (populate may run more than once).
std::string metadata_image(const std::function<std::uint64_t(hid_t file)>& populate);

// This rank's share of a file: `bytes` bytes from `data` at byte offset `at`.
struct Piece {
  std::uint64_t at = 0;
  const void* data = nullptr;
  std::uint64_t bytes = 0;
};

// The outcome of write_pieces, the same on every rank.
struct WriteResult {
  std::string error;  // "" on success, else what failed ("File too large (...)")
  int os_error = 0;   // errno of the failure where known (ENOSPC, EDQUOT, EFBIG, EIO), else 0
  bool ok() const { return error.empty(); }
};

// Collective over `world`: creates `path` (or writes into an existing file without truncating
// it), writes every rank's pieces with MPI_File_write_at_all in rounds of at most 1 GiB per rank
// (ranks may have different numbers of pieces), checks every call's status and byte count, stops
// on every rank after the first call that failed on any, and closes the file on every rank. Does
// not remove the file.
WriteResult write_pieces(const std::string& path, const std::vector<Piece>& pieces,
                         MpiComm& world);

}  // namespace qt::h5
