"""Shared fixtures: ``tune`` (qkv's knobs changed for one test), the native kernel pinned
(``Tuning.native_probe=False`` for every test: which code runs must not hang on a timing
made on a busy CI machine; tests/core/test_dispatch.py tests the probe itself), and the
hypothesis profiles: the default run stays fast; `--hypothesis-profile=slow` runs thousands
of examples per property."""

import contextlib
import os
import tempfile

import pytest
from hypothesis import HealthCheck, settings

import qkv

# The machine profile the dispatch stores (qkv.kernels.tiled.profile) goes to a directory of
# the test run's own, never the user's cache.
os.environ.setdefault("QKV_CACHE_DIR", tempfile.mkdtemp(prefix="qkv-test-cache-"))


@pytest.fixture(autouse=True)
def _native_pinned():
    with qkv.tuned(native_probe=False):
        yield


@pytest.fixture
def tune():
    """``tune(**knobs)`` changes qkv's :class:`qkv.Tuning` for the rest of the test (calls
    stack); the previous knobs are back after it."""
    with contextlib.ExitStack() as stack:
        yield lambda **knobs: stack.enter_context(qkv.tuned(**knobs))


settings.register_profile(
    "default",
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
settings.register_profile(
    "slow",
    max_examples=2000,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
settings.load_profile("default")
