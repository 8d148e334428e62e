"""The whole run's hooks (tests, doctests in src/, README.md and docs/)."""

import gc
import sys


def pytest_sessionfinish(session, exitstatus):
    """Drop torch.compile's caches while the interpreter still runs, and with them the one
    known piece of teardown noise: dynamo's guards on a doctest's namespace (which doctest
    clears) delete a ``__builtins_dict__`` entry that is already gone, and Python prints that
    KeyError after the summary, where it reads as a failure. Every other exception still
    reaches the usual hook."""
    import torch

    usual = sys.unraisablehook

    def hook(unraisable):
        if not (
            unraisable.exc_type is KeyError and "__builtins_dict_" in str(unraisable.exc_value)
        ):
            usual(unraisable)

    sys.unraisablehook = hook
    try:
        torch.compiler.reset()
        gc.collect()
    finally:
        sys.unraisablehook = usual
