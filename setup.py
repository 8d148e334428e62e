"""The native kernels, built at install with the system C compiler (gcc or clang): the tiled
step in float32 and bfloat16 (src/qkv/kernels/tiled/_native.c, the step per instruction set
in _step512.c, _step256.c, _step128.c and _step_sve.c) and the decode step over a paged KV
cache (src/qkv/kernels/_paged.c). Optional: where they cannot build, qkv installs without them and
runs its PyTorch paths (docs/kernels.md#the-native-kernel, docs/ragged.md), and says so
when it first needs them: pip shows a build's output only with -v, so the build records what
failed in qkv/kernels/_built.py.
QKV_BUILD_NATIVE=0 builds none of them (a pure-Python install, what CI tests as the
fallback). A compiler without OpenMP builds them single-threaded, with a warning
(QKV_OPENMP=0 asks for that build). On ARM64, where the compiler takes SVE with
fixed-length vectors, the SVE steps are built too (sve_flags).
Everything else is in pyproject.toml."""

import os
import re
import subprocess
import sys
import sysconfig
import tempfile

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

NATIVE = os.environ.get("QKV_BUILD_NATIVE", "1") != "0"


def openmp_flags() -> list[str]:
    """["-fopenmp"] where the C compiler builds and links an OpenMP program, else [] (the
    kernels then run their passes in one thread: docs/kernels.md#the-native-kernel)."""
    if os.environ.get("QKV_OPENMP") == "0":  # asked for: a single-threaded build
        return []
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "omp.c")
        with open(src, "w") as f:
            f.write("#include <omp.h>\nint main(void) { return omp_get_max_threads() < 1; }\n")
        try:
            done = subprocess.run(
                [*cc.split(), "-fopenmp", src, "-o", os.path.join(tmp, "omp")],
                capture_output=True,
            )
        except OSError:
            return []
    if done.returncode != 0:
        print("qkv: no OpenMP with this C compiler: the native kernels run in one thread",
              file=sys.stderr)  # fmt: skip
        return []
    return ["-fopenmp"]


#: a unit compiled as the SVE steps are (src/qkv/kernels/tiled/_step_sve.c): SVE switched on
#: for the file alone, vectors of a fixed 256 bits
SVE_PROBE = """#ifndef __aarch64__
#error "not ARM64"
#endif
#pragma GCC target("arch=armv8.2-a+sve")
#include <arm_sve.h>
typedef svfloat32_t v8 __attribute__((arm_sve_vector_bits(256)));
typedef struct { v8 lo, hi; } pair;
pair twice(pair x) { return (pair){svadd_f32_x(svptrue_b32(), x.lo, x.lo), x.hi}; }
"""


def sve_flags() -> tuple[list[str], list[tuple[str, str]]]:
    """The flags and macro that build the SVE steps (-msve-vector-bits=256 and QKV_SVE)
    where the C compiler targets ARM64 and compiles SVE_PROBE with them (GCC; clang takes
    neither the pragma nor, on macOS, SVE at all); else none, and ARM64 runs NEON."""
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    flags = ["-msve-vector-bits=256"]
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "sve.c")
        with open(src, "w") as f:
            f.write(SVE_PROBE)
        try:
            done = subprocess.run(
                [*cc.split(), *flags, "-Werror", "-c", src, "-o", os.path.join(tmp, "sve.o")],
                capture_output=True,
            )
        except OSError:
            return [], []
    return (flags, [("QKV_SVE", "1")]) if done.returncode == 0 else ([], [])


class BuildExt(build_ext):
    """setuptools' build_ext, which also writes ``qkv/kernels/_built.py`` beside the kernels:
    each one that failed to build and the error, read by ``qkv.kernels.built`` to warn at run
    time (an optional extension that fails is otherwise silent under pip). The two
    extensions compile side by side where the machine has two cores or more (``-j`` /
    ``--parallel`` overrides)."""

    def finalize_options(self) -> None:
        super().finalize_options()
        if self.parallel is None:
            self.parallel = min(2, os.cpu_count() or 1)

    def run(self) -> None:
        self.failed: dict[str, str] = {}
        super().run()
        where = os.path.dirname(self.get_ext_fullpath("qkv.kernels._paged"))
        os.makedirs(where, exist_ok=True)
        with open(os.path.join(where, "_built.py"), "w") as f:
            f.write('"""Written by setup.py at build: the C kernels that failed, and why."""\n\n')
            f.write("FAILED: dict[str, str] = {\n")
            f.writelines(f"    {name!r}: {why!r},\n" for name, why in self.failed.items())
            f.write("}\n")

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as err:  # recorded, then setuptools warns and goes on (optional)
            lines = str(err).strip().splitlines()
            why = lines[-1] if lines else type(err).__name__
            # "Command '['gcc', ...]' returned non-zero exit status 1.": the compiler and status
            found = re.match(r"Command '\['([^']+)'.*(exit status \d+)", why)
            self.failed[ext.name] = (
                f"the C compiler {found[1]!r} failed ({found[2]})" if found else why[:200]
            )
            raise


OPENMP = openmp_flags() if NATIVE else []
SVE, SVE_MACROS = sve_flags() if NATIVE else ([], [])

setup(
    cmdclass={"build_ext": BuildExt},
    ext_modules=[
        Extension(
            "qkv.kernels.tiled._native",
            [
                f"src/qkv/kernels/tiled/{name}.c"
                for name in (
                    "_native",
                    "_step512",
                    "_step512_rows16",
                    "_step256",
                    "_step256_rows2",
                    "_step128",
                    "_step128_rows2",
                    "_step_sve",
                    "_step_sve_rows2",
                )
            ],
            depends=[
                "src/qkv/kernels/_cpu.h",
                "src/qkv/kernels/_exp.h",
                "src/qkv/kernels/_fields.h",
                "src/qkv/kernels/_lanes.h",
                *(f"src/qkv/kernels/tiled/{h}.h" for h in ("_kernel", "_simd", "_bf16", "_step")),
            ],
            extra_compile_args=["-O3", *OPENMP, *SVE],
            extra_link_args=OPENMP,
            define_macros=SVE_MACROS,
            optional=True,
        ),
        Extension(
            "qkv.kernels._paged",
            [
                f"src/qkv/kernels/{name}.c"
                for name in (
                    "_paged",
                    "_paged512",
                    "_paged512_dots",
                    "_paged256",
                    "_paged128",
                    "_paged_sve",
                )
            ],
            depends=[
                *(
                    f"src/qkv/kernels/{h}.h"
                    for h in ("_cpu", "_exp", "_fields", "_lanes", "_paged", "_paged_step")
                ),
                "src/qkv/kernels/tiled/_simd.h",
            ],
            extra_compile_args=["-O3", *OPENMP, *SVE],
            extra_link_args=OPENMP,
            define_macros=SVE_MACROS,
            optional=True,
        ),
    ]
    if NATIVE
    else [],
)
