# Spack recipe for qtrain (Spack 0.22 or newer: it uses the c/cxx language virtuals).
#
#   spack repo add spack                       # from the repository root
#   spack install qtrain@main                  # CPU back end
#   spack install qtrain@main +cuda cuda_arch=90
#   spack install --test=root qtrain@main      # also builds and runs the CTest suite
#
# qtrain has no public release yet: `git` points at the checkout this recipe sits in (the branch
# "main" is cloned from it). For work on a checkout, use the develop section of spack.yaml instead.
import os

from spack.package import *


def _checkout_root():
    # spack/packages/qtrain/package.py -> the repository root, three levels up.
    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.normpath(os.path.join(here, "..", "..", ".."))


class Qtrain(CMakePackage, CudaPackage):
    """C++20/CUDA training engine for Qwen3 language models, launched by mpirun or srun.
    A CPU reference back end (OpenBLAS) with data parallelism and ZeRO-1 over MPI, and
    checkpoints in parallel HDF5; the CUDA back end (+cuda) is in progress."""

    git = "file://" + _checkout_root()

    version("main", branch="main")

    variant("bench", default=False, description="Build the Google Benchmark programs")

    generator("ninja")

    depends_on("c", type="build")  # FindHDF5 compiles a C test program
    depends_on("cxx", type="build")
    depends_on("cmake@3.25:", type="build")
    depends_on("ninja", type="build")

    depends_on("mpi")
    depends_on("hdf5@1.10:+mpi")
    depends_on("boost+program_options")
    depends_on("fmt@9")
    depends_on("nlohmann-json")
    depends_on("openblas")
    depends_on("pcre2")     # tokenizer: pre-tokenizer regex
    depends_on("utf8proc")  # tokenizer: NFC normalisation
    depends_on("googletest+gmock", type="test")
    depends_on("benchmark", when="+bench")

    # The CUDA back end: CUDA from CudaPackage (variant cuda, cuda_arch), NCCL for its collectives.
    depends_on("cuda@12.4:", when="+cuda")
    depends_on("nccl", when="+cuda")
    conflicts("cuda_arch=none", when="+cuda", msg="+cuda needs a cuda_arch, e.g. cuda_arch=90")

    def cmake_args(self):
        args = [
            self.define("QTRAIN_TESTS", self.run_tests),
            self.define_from_variant("QTRAIN_BENCH", "bench"),
            self.define_from_variant("QTRAIN_CUDA", "cuda"),
        ]
        if self.spec.satisfies("+cuda"):
            archs = self.spec.variants["cuda_arch"].value
            args.append(self.define("QTRAIN_CUDA_ARCH", ";".join(archs)))
            args.append(self.define("CMAKE_CUDA_COMPILER", self.spec["cuda"].prefix.bin.nvcc))
        return args
