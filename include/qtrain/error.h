// Error handling for the whole engine.
//
// Two kinds of error, as in LAMMPS:
//  * UserError: something every rank sees alike (a bad deck, a missing data file, a corrupt
//    checkpoint). It is thrown, caught in main(), printed once by rank 0, and every rank exits
//    with code 2. No rank hangs because every rank throws at the same point.
//  * Internal failure seen by one rank (a failed MPI or HDF5 call, a broken invariant): it is
//    reported with file:line, rank and host, and MPI_Abort ends the job.
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace qt {

// Exit code for bad input of any kind (deck, data, checkpoint).
inline constexpr int kExitBadInput = 2;

// An error in what the user gave us. `where` is "file:line" or a key name, may be empty.
class UserError : public std::runtime_error {
 public:
  explicit UserError(const std::string& msg) : std::runtime_error(msg) {}
};

// Throws UserError with a formatted message. Every rank must reach the same throw.
template <typename... Args>
[[noreturn]] void fail_user(fmt::format_string<Args...> f, Args&&... args) {
  throw UserError(fmt::format(f, std::forward<Args>(args)...));
}

// Reports an internal error on one rank and aborts all ranks. Never returns.
[[noreturn]] void fatal_one(const char* file, int line, const std::string& msg);

// Called by the QT_CHECK_* macros.
[[noreturn]] void fail_mpi(const char* file, int line, const char* expr, int code);
[[noreturn]] void fail_hdf5(const char* file, int line, const char* expr);

}  // namespace qt

// Invariant check: on failure reports file:line and aborts all ranks.
#define QT_CHECK(cond, ...)                                                   \
  do {                                                                        \
    if (!(cond)) {                                                            \
      ::qt::fatal_one(__FILE__, __LINE__,                                     \
                      std::string("check failed: " #cond ": ") +              \
                          ::fmt::format(__VA_ARGS__));                        \
    }                                                                         \
  } while (0)

// MPI call check; MPI_ERRORS_RETURN is set on every engine communicator so codes are real.
#define QT_CHECK_MPI(expr)                                                    \
  do {                                                                        \
    int qt_mpi_rc_ = (expr);                                                  \
    if (qt_mpi_rc_ != 0) ::qt::fail_mpi(__FILE__, __LINE__, #expr, qt_mpi_rc_); \
  } while (0)

// HDF5 call check: negative return (herr_t or hid_t) means failure.
#define QT_CHECK_HDF5(expr)                                                   \
  do {                                                                        \
    if ((expr) < 0) ::qt::fail_hdf5(__FILE__, __LINE__, #expr);               \
  } while (0)
