"""The native kernels, built at install with the system C compiler: the tiled step in float32
and bfloat16 (src/qkv/kernels/tiled/_native.c) and the decode step over a paged KV cache
(src/qkv/kernels/_paged.c). Optional: where they cannot build, qkv installs without them and
runs its PyTorch paths (docs/kernels.md#the-native-kernel, docs/ragged.md). Everything else is
in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "qkv.kernels.tiled._native",
            ["src/qkv/kernels/tiled/_native.c"],
            depends=["src/qkv/kernels/_exp.h"],
            extra_compile_args=["-O3", "-fopenmp"],
            extra_link_args=["-fopenmp"],
            optional=True,
        ),
        Extension(
            "qkv.kernels._paged",
            ["src/qkv/kernels/_paged.c"],
            depends=["src/qkv/kernels/_exp.h"],
            extra_compile_args=["-O3", "-fopenmp"],
            extra_link_args=["-fopenmp"],
            optional=True,
        ),
    ]
)
