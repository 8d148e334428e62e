"""The native kernels, built at install with the system C compiler: the tiled step in float32
and bfloat16 (src/qkv/kernels/tiled/_native.c, the step per instruction set in _step512.c and
_step256.c) and the decode step over a paged KV cache
(src/qkv/kernels/_paged.c). Optional: where they cannot build, qkv installs without them and
runs its PyTorch paths (docs/kernels.md#the-native-kernel, docs/ragged.md).
QKV_BUILD_NATIVE=0 builds none of them (a pure-Python install, what CI tests as the
fallback). Everything else is in pyproject.toml."""

import os

from setuptools import Extension, setup

NATIVE = os.environ.get("QKV_BUILD_NATIVE", "1") != "0"

setup(
    ext_modules=[
        Extension(
            "qkv.kernels.tiled._native",
            [f"src/qkv/kernels/tiled/{name}.c" for name in ("_native", "_step512", "_step256")],
            depends=[
                "src/qkv/kernels/_exp.h",
                "src/qkv/kernels/_fields.h",
                *(f"src/qkv/kernels/tiled/{h}.h" for h in ("_kernel", "_simd", "_bf16", "_step")),
            ],
            extra_compile_args=["-O3", "-fopenmp"],
            extra_link_args=["-fopenmp"],
            optional=True,
        ),
        Extension(
            "qkv.kernels._paged",
            ["src/qkv/kernels/_paged.c"],
            depends=["src/qkv/kernels/_exp.h", "src/qkv/kernels/_fields.h"],
            extra_compile_args=["-O3", "-fopenmp"],
            extra_link_args=["-fopenmp"],
            optional=True,
        ),
    ]
    if NATIVE
    else []
)
