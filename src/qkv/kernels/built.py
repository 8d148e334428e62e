"""Whether the C kernels built at install, and if not, why: setup.py records each kernel
that failed to compile in ``_built.py`` beside them (pip shows a build's output only with
``-v``), and :func:`warn_if_failed` says so once, the first time qkv looks for a kernel.
An install that did not try (``QKV_BUILD_NATIVE=0``) records nothing and warns of nothing."""

from __future__ import annotations

import functools
import warnings


def failed() -> dict[str, str]:
    """The C kernels that failed to build at install, each with the error setup.py saw."""
    try:
        from ._built import FAILED  # type: ignore[import-not-found, unused-ignore]
    except ImportError:  # not built by setup.py (no compiler run): nothing is known
        return {}
    return dict(FAILED)


@functools.cache
def warn_if_failed() -> None:
    """One warning, per process, where a C kernel failed to build at install."""
    found = failed()
    if found:
        names = ", ".join(sorted(found))
        warnings.warn(
            f"qkv's C kernels did not build at install ({names}: {next(iter(found.values()))}); "
            "qkv runs its PyTorch paths instead, several times slower on long sequences. "
            "`pip install -v` shows the compiler's output (docs/kernels.md#the-native-kernel)",
            RuntimeWarning,
            stacklevel=3,
        )
