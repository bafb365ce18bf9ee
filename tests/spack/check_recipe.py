#!/usr/bin/env python3
"""What the Spack recipe and environment must keep saying (issue 15, case 16), checked without
Spack: the recipe parses as Python; it uses Spack 1.0's Package API v2 layout and imports; it needs
pkg-config at build time (CMake finds PCRE2 and utf8proc with it) and CUDA 13 with +cuda; its
cuda_arch=90 becomes QTRAIN_CUDA_ARCH=90a (the sm_90a attention kernels), checked by running the
recipe's own mapping function; spack.yaml lists pkgconf and names CUDA 13.

usage: check_recipe.py REPOSITORY_ROOT    (exit 0 when every check passes, 1 with the failures)
"""
import ast
import pathlib
import re
import sys


def calls(tree, name):
    """(positional string arguments, keyword string arguments) of every call of `name`."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == name:
            args = [a.value for a in node.args if isinstance(a, ast.Constant)]
            kwargs = {k.arg: k.value.value for k in node.keywords
                      if isinstance(k.value, ast.Constant)}
            out.append((args, kwargs))
    return out


def main(root):
    root = pathlib.Path(root)
    failures = []

    def check(ok, what):
        print(("ok      " if ok else "FAILED  ") + what)
        if not ok:
            failures.append(what)

    repo = root / "spack" / "spack_repo" / "qtrain"
    recipe_path = repo / "packages" / "qtrain" / "package.py"
    check(recipe_path.is_file(),
          f"the recipe is at {recipe_path.relative_to(root)} (Package API v2 layout)")
    repo_yaml = (repo / "repo.yaml").read_text() if (repo / "repo.yaml").is_file() else ""
    check(re.search(r"^\s*namespace:\s*qtrain\s*$", repo_yaml, re.M) is not None,
          "repo.yaml: namespace qtrain (the directory's name)")
    check(re.search(r"^\s*api:\s*v2\.\d+\s*$", repo_yaml, re.M) is not None, "repo.yaml: api v2.x")
    if not recipe_path.is_file():
        return failures
    text = recipe_path.read_text()
    try:
        tree = ast.parse(text, str(recipe_path))
    except SyntaxError as e:
        check(False, f"the recipe parses as Python: {e}")
        return failures
    check(True, "the recipe parses as Python")

    imports = {(n.module, a.name) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
               for a in n.names}
    check(("spack_repo.builtin.build_systems.cmake", "CMakePackage") in imports,
          "CMakePackage from spack_repo.builtin.build_systems.cmake")
    check(("spack_repo.builtin.build_systems.cuda", "CudaPackage") in imports,
          "CudaPackage from spack_repo.builtin.build_systems.cuda")

    deps = calls(tree, "depends_on")
    check(any(a and a[0] in ("pkgconfig", "pkgconf") and k.get("type") == "build"
              for a, k in deps),
          'depends_on("pkgconfig", type="build") (pkgconf provides it)')
    cuda = [(a[0], k.get("when")) for a, k in deps if a and a[0].startswith("cuda")]
    check(("cuda@13:", "+cuda") in cuda and all(spec == "cuda@13:" for spec, _ in cuda),
          f'depends_on("cuda@13:", when="+cuda") and no other CUDA version (found {cuda})')

    doc = next((ast.get_docstring(n) or "" for n in tree.body if isinstance(n, ast.ClassDef)), "")
    check("in progress" not in doc,
          "the package's description does not call the CUDA back end in progress")

    # The mapping of cuda_arch to QTRAIN_CUDA_ARCH, run as the recipe defines it.
    fn = next((n for n in tree.body
               if isinstance(n, ast.FunctionDef) and n.name == "qtrain_cuda_archs"), None)
    check(fn is not None, "the recipe defines qtrain_cuda_archs")
    if fn is not None:
        scope = {}
        exec(compile(ast.Module(body=[fn], type_ignores=[]), str(recipe_path), "exec"), scope)
        cases = ((["90"], "90a"), (["90a"], "90a"), (["80", "90"], "80;90a"), (["100"], "100"))
        for archs, want in cases:
            got = scope["qtrain_cuda_archs"](archs)
            check(got == want, f"cuda_arch={','.join(archs)} -> QTRAIN_CUDA_ARCH={want} (got {got})")
    check("qtrain_cuda_archs(" in text.split("def cmake_args", 1)[-1],
          "cmake_args passes cuda_arch through qtrain_cuda_archs")

    env = (root / "spack.yaml").read_text()
    specs = re.findall(r"^\s*-\s*\"?([A-Za-z0-9_+@:.-]+)", env, re.M)
    check("pkgconf" in specs, "spack.yaml lists pkgconf")
    check("cuda@13:" in env and "cuda@12" not in env, "spack.yaml names cuda@13:, not cuda@12")
    check("spack/spack_repo/qtrain" in env,
          "spack.yaml's repos line points at spack/spack_repo/qtrain")
    return failures


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    failed = main(sys.argv[1])
    print(f"{len(failed)} check(s) failed" if failed else "all checks passed")
    sys.exit(1 if failed else 0)
