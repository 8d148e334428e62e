"""Rule "plain" sends a bfloat16 decode step over DECODE_KEYS keys or more to qkv's native
paged decode kernel, each sequence's keys and values read in place as one page
(torch's fused kernel took 4–10× its time there): checked against the float64 oracle."""

import numpy as np
import pytest
import torch

import qkv
from qkv import masks
from qkv.core.rules import DECODE_KEYS
from qkv.kernels import paged
from qkv.kernels.tiled import profile
from tests.helpers import oracle

needs_kernel = pytest.mark.skipif(not paged.available(), reason="paged kernel not built")


def rows(B, H, H_kv, T, D, D_v, spare=0, seed=0):
    """q (B, H, 1, D) and k, v as a cache holds them: the first T of T + spare rows."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, 1, D, generator=g).bfloat16()
    k = torch.randn(B, H_kv, T + spare, D, generator=g).bfloat16()[:, :, :T]
    v = torch.randn(B, H_kv, T + spare, D_v, generator=g).bfloat16()[:, :, :T]
    return q, k, v


@needs_kernel
@pytest.mark.parametrize(
    "B, H, H_kv, T, D, D_v, spare",
    [
        (1, 8, 8, 256, 64, 64, 0),
        (2, 8, 2, 300, 64, 64, 64),  # GQA, a cache's view (rows D·(T + spare) apart)
        (3, 4, 1, 257, 128, 128, 5),  # MQA, odd T
        (2, 6, 3, 511, 40, 40, 0),  # D off the vectors: the plain C item
        (1, 16, 1, 260, 80, 48, 3),  # D != D_v, 16 query heads a key head
        (2, 4, 4, 1024, 576, 512, 0),  # the absorbed latent form's sizes
    ],
)
@pytest.mark.parametrize("mask", [None, "causal"])
def test_a_bfloat16_decode_step_reads_the_keys_in_place(B, H, H_kv, T, D, D_v, spare, mask):
    q, k, v = rows(B, H, H_kv, T, D, D_v, spare)
    m = masks.causal() if mask else None  # one query at the end: every key
    choice = qkv.dispatch(q, k, v, mask=m, scale=0.2)
    assert (choice.path, choice.rule) == ("paged-native", "plain")
    out = qkv.attention(q, k, v, mask=m, scale=0.2)
    assert out.shape == (B, H, 1, D_v) and out.dtype == torch.bfloat16
    want = oracle(q, k, v, scale=0.2)
    np.testing.assert_allclose(out.double().numpy(), want, atol=1.5e-2, rtol=1.5e-2)
    # the same bits as qkv.paged_attention over the rows as one page each
    pages = qkv.paged_attention(
        q[:, :, 0], k.transpose(1, 2), v.transpose(1, 2),
        torch.arange(B)[:, None], torch.full((B,), T), scale=0.2,
    )  # fmt: skip
    assert torch.equal(out[:, :, 0], pages)


@needs_kernel
def test_what_the_decode_kernel_does_not_take_keeps_its_path():
    q, k, v = rows(2, 4, 2, DECODE_KEYS, 32, 32)
    assert qkv.dispatch(q, k, v).path == "paged-native"
    short = rows(2, 4, 2, DECODE_KEYS - 1, 32, 32)
    assert qkv.dispatch(*short).path == "sdpa"  # a few keys: torch's kernel is the quicker
    assert qkv.dispatch(q.float(), k.float(), v.float()).path == "sdpa"  # float32: as before
    assert qkv.dispatch(q, k, v, mask=masks.sliding_window(64)).path != "paged-native"
    qg = q.clone().requires_grad_()
    assert qkv.dispatch(qg, k, v).path != "paged-native"  # a gradient: the kernel has none
    out = qkv.attention(qg, k, v)
    out.float().sum().backward()
    assert qg.grad is not None
    with qkv.heads.record() as seen:  # a recording block keeps weights: the full path
        qkv.attention(q, k, v)
    assert len(seen) == 1
    sinks = torch.zeros(4)
    assert qkv.dispatch(q, k, v, sinks=sinks).path != "paged-native"


@needs_kernel
@pytest.mark.parametrize("mha, gqa", [(True, False), (False, True), (False, False)])
def test_the_profile_decides_between_the_paged_kernel_and_torchs(mha, gqa, monkeypatch):
    """torch's bfloat16 decode step took several times its float32 time on a Zen 4 and half
    of it on an Intel Xeon with one key/value head per query head: with the probe on, the
    machine's profile decides, apart for GQA; with it off (the rest of the suite), the
    paged kernel. Either way the same numbers to bfloat16 rounding."""
    choice = profile.Probe(1.0, 1.0, use_paged_decode=mha, use_paged_decode_gqa=gqa)
    monkeypatch.setattr(profile, "probe", lambda: choice)
    one, grouped = rows(2, 8, 8, 300, 64, 64), rows(2, 8, 2, 300, 64, 64)
    with qkv.tuned(native_probe=True):
        paths = [qkv.dispatch(*x).path for x in (one, grouped)]
        outs = [qkv.attention(*x) for x in (one, grouped)]
    assert paths == ["paged-native" if mha else "sdpa", "paged-native" if gqa else "sdpa"]
    for x, out in zip((one, grouped), outs):
        np.testing.assert_allclose(out.double().numpy(), oracle(*x), atol=1.5e-2, rtol=1.5e-2)
    assert qkv.dispatch(*one).path == "paged-native"  # the probe off
