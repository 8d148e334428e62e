"""A GPT written against FlashAttention's API (examples/flash_attn_gpt.py) trains and generates
on a CPU through qkv.flash_attn; its windowed attention equals the dense-mask fallback such
projects ship, greedy generation through the KV cache equals the dense path token for token,
and at T = 8192 with a 256-token window its attention's peak memory is at most 1/8 of the
fallback's."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import qkv.flash_attn
from qkv.cli.bench import PeakRSS

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "flash_attn_gpt.py"


@pytest.fixture(scope="module")
def example():
    """The example module, imported as a script imports it (its ``import flash_attn`` is
    answered by ``qkv.flash_attn.install()``); the install undone after."""
    spec = importlib.util.spec_from_file_location("flash_attn_gpt", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["flash_attn_gpt"] = module  # its dataclass looks its module up there
    try:
        spec.loader.exec_module(module)
        assert module.flash_attn_func is qkv.flash_attn.flash_attn_func
        yield module
    finally:
        qkv.flash_attn.uninstall()
        sys.modules.pop("flash_attn_gpt", None)


@pytest.fixture(scope="module")
def trained(example):
    torch.manual_seed(0)
    model = example.GPT(example.Config())
    losses = example.train(model, example.stdlib_bytes(200_000), steps=40, T=128)
    return model, losses


def test_it_trains_on_the_standard_library(trained):
    _, losses = trained
    last = sum(losses[-10:]) / 10
    # from about ln 256 = 5.5 (a byte at random) to under half of it
    assert losses[0] > 5.0 and last < 2.75


def test_the_flash_path_equals_the_dense_mask_fallback(example, trained):
    model, _ = trained
    tokens = example.stdlib_bytes(1000)[None, :300]  # longer than every window
    flash = model(tokens)
    model.config.attention = "dense"
    try:
        dense = model(tokens)
    finally:
        model.config.attention = "flash"
    assert (flash - dense).abs().max() < 1e-4


def test_greedy_generation_through_the_cache_equals_the_dense_path(example, trained):
    """Prefill, then one token at a time through flash_attn_with_kvcache (keys appended in
    place), against the whole sequence run again per token with SDPA and a dense mask: past
    every layer's window of 32."""
    model, _ = trained
    prompt = torch.stack([example.stdlib_bytes(4000)[a : a + 20] for a in (0, 1500)])
    cached = model.generate(prompt, 60)
    model.config.attention = "dense"
    try:
        dense = model.generate(prompt, 60, cached=False)
    finally:
        model.config.attention = "flash"
    assert torch.equal(cached, dense)


def test_window_attention_at_8k_takes_an_eighth_of_the_dense_fallbacks_memory(example):
    """One layer's attention, forward and backward, T = 8192, window 256: qkv through FA's
    API against SDPA with a dense mask. Peak resident memory above the call's start (Linux's
    high-water mark); figures in docs/flash-attn.md."""
    T = 8192
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, T, 4, 32, generator=g, requires_grad=True)
    k = torch.randn(1, T, 2, 32, generator=g, requires_grad=True)
    v = torch.randn(1, T, 2, 32, generator=g, requires_grad=True)

    def peak(fn):
        with PeakRSS() as mem:
            fn().sum().backward()
        q.grad = k.grad = v.grad = None
        return mem.above

    flash = peak(lambda: example.flash_attn_func(q, k, v, causal=True, window_size=(256, 0)))
    dense = peak(lambda: example.dense_attention(q, k, v, 256))
    assert dense > 200 * 2**20  # the (T, T) mask is there: the measure sees it
    assert flash * 8 <= dense, (flash / 2**20, dense / 2**20)
