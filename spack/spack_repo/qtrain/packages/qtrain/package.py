# Spack recipe for qtrain (Spack 1.0 or newer: Package API v2, build systems from
# spack_repo.builtin, the c/cxx language virtuals).
#
#   spack repo add spack/spack_repo/qtrain         # from the repository root
#   spack install qtrain@main                      # CPU back end
#   spack install qtrain@main +cuda cuda_arch=90   # CUDA back end for H100/H200 (built as sm_90a)
#   spack install --test=root qtrain@main          # also builds and runs the CTest suite
#
# qtrain has no public release yet: `git` points at the checkout this recipe sits in (the branch
# "main" is cloned from it). For work on a checkout, use the develop section of spack.yaml instead.
# tests/spack/check_recipe.py (CTest spack_recipe) checks what this recipe must keep saying.
import os

from spack_repo.builtin.build_systems.cmake import CMakePackage, generator
from spack_repo.builtin.build_systems.cuda import CudaPackage

from spack.package import *


def _checkout_root():
    # spack/spack_repo/qtrain/packages/qtrain/package.py -> the repository root, five levels up.
    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.normpath(os.path.join(here, "..", "..", "..", "..", ".."))


def qtrain_cuda_archs(archs):
    """QTRAIN_CUDA_ARCH for the cuda_arch values: 90 becomes 90a, the architecture-specific target
    that the warp-specialised (wgmma, TMA) attention kernels need; a plain sm_90 build would
    silently run the slower mma.sync path. Other values are passed as they are."""
    return ";".join("90a" if a == "90" else a for a in archs)


class Qtrain(CMakePackage, CudaPackage):
    """C++20/CUDA training engine for Qwen3 language models, launched by mpirun or srun.
    A CPU reference back end (OpenBLAS) and a CUDA back end (+cuda: bf16 compute, cuBLASLt,
    fused kernels, NCCL), data parallelism and ZeRO-1 over MPI, LoRA, checkpoints in parallel
    HDF5, Qwen3's tokenizer, Hugging Face import and export, and text generation."""

    git = "file://" + _checkout_root()

    version("main", branch="main")

    variant("bench", default=False, description="Build the Google Benchmark programs")

    generator("ninja")

    depends_on("c", type="build")  # FindHDF5 compiles a C test program
    depends_on("cxx", type="build")
    depends_on("cmake@3.25:", type="build")
    depends_on("ninja", type="build")
    depends_on("pkgconfig", type="build")  # pkg_check_modules finds PCRE2 and utf8proc (pkgconf)

    depends_on("mpi")
    depends_on("hdf5@1.10:+mpi")
    depends_on("boost+program_options")
    depends_on("fmt@9")
    depends_on("nlohmann-json")
    depends_on("openblas")
    depends_on("pcre2")  # tokenizer: pre-tokenizer regex (libpcre2-8.pc)
    depends_on("utf8proc")  # tokenizer: NFC normalisation (libutf8proc.pc)
    depends_on("protobuf")  # TensorBoard event files: protoc at build time, the library at run time
    depends_on("libjpeg-turbo")  # Qwen3-VL images: JPEG decoding
    depends_on("libpng")  # Qwen3-VL images: PNG decoding
    depends_on("googletest+gmock", type="test")
    depends_on("benchmark", when="+bench")

    # The CUDA back end: CUDA from CudaPackage (variant cuda, cuda_arch), NCCL for its
    # collectives. The build needs nvcc 13 (its C++20 dialect, CMakeLists.txt).
    depends_on("cuda@13:", when="+cuda")
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
            args.append(self.define("QTRAIN_CUDA_ARCH", qtrain_cuda_archs(archs)))
            args.append(self.define("CMAKE_CUDA_COMPILER", self.spec["cuda"].prefix.bin.nvcc))
        return args
