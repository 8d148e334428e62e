"""The native bfloat16 kernel (src/qkv/kernels/tiled/_bf16.c), built at install with the system C
compiler. Optional: where it cannot build, qkv installs without it and runs the float32 path
(docs/kernels.md#native-bfloat16). Everything else is in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "qkv.kernels.tiled._bf16",
            ["src/qkv/kernels/tiled/_bf16.c"],
            extra_compile_args=["-O3", "-fopenmp"],
            extra_link_args=["-fopenmp"],
            optional=True,
        )
    ]
)
