"""The native kernels, built at install with the system C compiler: the bfloat16 tiled step
(src/qkv/kernels/tiled/_bf16.c) and the decode step over a paged KV cache
(src/qkv/kernels/_paged.c). Optional: where they cannot build, qkv installs without them and
runs its PyTorch paths (docs/kernels.md#native-bfloat16, docs/ragged.md). Everything else is
in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "qkv.kernels.tiled._bf16",
            ["src/qkv/kernels/tiled/_bf16.c"],
            extra_compile_args=["-O3", "-fopenmp"],
            extra_link_args=["-fopenmp"],
            optional=True,
        ),
        Extension(
            "qkv.kernels._paged",
            ["src/qkv/kernels/_paged.c"],
            extra_compile_args=["-O3", "-fopenmp"],
            extra_link_args=["-fopenmp"],
            optional=True,
        ),
    ]
)
