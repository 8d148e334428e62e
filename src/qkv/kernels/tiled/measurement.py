"""What the machine's profile times (:mod:`qkv.kernels.tiled.profile` stores it and decides
from it): the tiled kernel's passes through each of its paths, torch's fused kernel in half
precision and on float32 copies, the paged decode kernel over int8 pages with and without
bfloat16 dot products, and a bfloat16 decode step through the paged kernel and through
torch's, each a median of interleaved runs (:func:`times`).

Legend: B batch · H heads · T queries (and keys) · D head dim.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from ...masks import FULL, causal
from ...tuning import Tuning
from .. import paged
from ..contract import Lowered, PredicateTiles
from ..sdpa import sdpa
from . import backward as tiled_backward
from . import forward, steps
from .plan import dense_to_sparse, make_plan

#: The probe's pass: (T, window): T queries, each over the keys from ``window`` before it to
#: itself, in the tiled kernel's blocks, every tile whole (a sliding window's tiles without
#: its partial ones' masking).
BANDED = (2048, 256)


#: The probe's causal pass: its queries (and keys), of 4 heads, D = 64, float32. The native
#: kernel's lead over torch's shrinks as sequences grow (its row tiles read a longer key
#: span each), so the pass is of the middle of the lengths it decides: on an Intel Xeon held
#: to AVX2, 1,024 queries measured 0.90–0.93× torch's time where causal T = 4,096 took
#: 1.07×; 2,048 measured 0.96–1.05× (2026-11-28)
CAUSAL = 2048

#: The probe's paged decode step: (sequences, tokens each, query heads, key/value heads, D),
#: int8 pages of 16 tokens and bfloat16 queries.
PAGED = (8, 1024, 16, 4, 128)

#: The probe's bfloat16 decode step over a cache's rows: (sequences, query heads, keys, D),
#: one key/value head per query head, and one per 4 (GQA).
DECODE = (4, 8, 1024, 64)


def times() -> dict[str, float]:
    """Every pass the profile times, each a median of 7 runs (interleaved, in alternating
    order, after one round to warm up), in ms by the :class:`~qkv.kernels.tiled.profile.Probe`
    field it fills; a pass this CPU cannot run is left out."""
    g = torch.Generator().manual_seed(0)
    x32 = [torch.randn(1, 4, BANDED[0], 64, generator=g) for _ in range(3)]
    x16 = [x.to(torch.bfloat16) for x in x32]
    calls: dict[str, Callable[[], object]] = {
        "float32": _banded_pass("tiled-flash", *x32),
        **{
            f"sdpa_{name}{'' if backward else '_fwd'}": _sdpa_step(dtype, widen, backward)
            for name, dtype, widen in (
                ("bfloat16", torch.bfloat16, False),
                ("float16", torch.float16, False),
                ("widened", torch.bfloat16, True),
            )
            for backward in (True, False)
        },
    }
    natives = (
        ("native", "tiled-native", x16, torch.bfloat16),
        ("native32", "tiled-native", x32, torch.float32),
        ("native_widen", "tiled-native-widen", x16, torch.float32),
    )
    for name, path, xs, compute in natives:
        if steps.available(compute):
            calls[name] = _in_blocking(0, _banded_pass(path, *xs))
    if steps.available(torch.float32):  # each step compiled in two blockings
        calls["native32_second"] = _in_blocking(1, _banded_pass("tiled-native", *x32))
    for backward in (True, False):
        fwd = "" if backward else "_fwd"
        calls[f"causal_sdpa{fwd}"] = _sdpa_step(torch.float32, False, backward, CAUSAL)
        if steps.available(torch.float32):
            calls[f"causal_native{fwd}"] = _in_blocking(0, _causal_pass(backward))
    if steps.available(torch.float32):  # the backward in its second blocking
        second = _in_blocking(1, _causal_pass(True), backward=True)
        calls["causal_native_second"] = _in_blocking(0, second)
    if paged.available():
        for groups, gqa in ((1, ""), (4, "_gqa")):
            calls[f"decode_paged{gqa}"] = _decode_step(True, groups)
            calls[f"decode_sdpa{gqa}"] = _decode_step(False, groups)
        if paged.dots():
            calls["paged_dots"] = _paged_step(quantized_dots=True)
            calls["paged_widen"] = _paged_step(quantized_dots=False)
    runs: dict[str, list[float]] = {name: [] for name in calls}
    for i in range(8):
        for name in calls if i % 2 else reversed(list(calls)):
            t0 = time.perf_counter()
            calls[name]()
            if i:  # the first round warms up
                runs[name].append(time.perf_counter() - t0)
    return {f"{name}_ms": statistics.median(t) * 1e3 for name, t in runs.items()}


def _banded_pass(
    path: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> Callable[[], object]:
    """The probe's pass (:data:`BANDED`) over q, k, v (B, H, T, D) as the tiled kernel runs it
    forward on ``path`` ("tiled-flash", "tiled-native", "tiled-native-widen"): every call of
    the pass, with the merging and writing of their results, as a masked call pays them."""
    T, W = BANDED
    tuning = Tuning()
    bq, bk = tuning.block_q, tuning.block_k
    nq, nk = -(-T // bq), -(-T // bk)
    first = np.maximum(0, np.arange(nq) * bq - W) // bk  # each query block's first key block
    last = np.minimum(nk - 1, ((np.arange(nq) + 1) * bq - 1) // bk)
    codes = np.zeros((nq, nk), np.int8)
    for i in range(nq):
        codes[i, first[i] : last[i] + 1] = FULL
    plan = make_plan(*dense_to_sparse(codes), T, T, block_q=bq, block_k=bk, chunk_k=tuning.chunk_k)
    call = Lowered(q, k, v, 0.125, 0, path, tuning, plan=plan)
    return functools.partial(forward, call)


def _causal_pass(backward: bool) -> Callable[[], object]:
    """A causal pass over :data:`CAUSAL` queries (4 heads, D = 64, float32) of the native
    kernel ("tiled-native"), forward and, with ``backward``, backward (torch's kernel over
    the same: :func:`_sdpa_step`)."""
    g = torch.Generator().manual_seed(2)
    q, k, v, dout = (torch.randn(1, 4, CAUSAL, 64, generator=g) for _ in range(4))
    tuning = Tuning()
    bq, bk = tuning.block_q, tuning.block_k
    mask = causal()
    tiles = mask.sparse_blocks(1, 4, CAUSAL, CAUSAL, block_q=bq, block_k=bk, q_offset=0)
    plan = make_plan(*tiles, CAUSAL, CAUSAL, block_q=bq, block_k=bk, chunk_k=tuning.chunk_k)
    call = Lowered(
        q,
        k,
        v,
        0.125,
        0,
        "tiled-native",
        tuning,
        plan=plan,
        tiles=PredicateTiles(mask, 1, 1, 0, q.device),
    )

    def native_pass() -> object:
        out, lse = forward(call)
        return tiled_backward(call, out, lse, dout) if backward else out

    return native_pass


def _paged_step(quantized_dots: bool) -> Callable[[], object]:
    """One decode step of the paged kernel over :data:`PAGED`'s int8 pages, their keys
    scored by bfloat16 dot products (``quantized_dots``) or widened for float32 FMAs."""
    B, L, H, H_kv, D = PAGED
    P = 16  # tokens a page
    g = torch.Generator().manual_seed(3)
    pages = B * L // P
    k, v = (
        torch.randint(-127, 128, (H_kv, pages, P, D), generator=g, dtype=torch.int8).permute(
            1, 2, 0, 3
        )
        for _ in "kv"
    )
    ks, vs = (torch.rand(pages, P, H_kv, generator=g) * 0.05 for _ in "kv")
    q = torch.randn(B, H, D, generator=g).bfloat16()
    table, lengths = torch.arange(pages).view(B, L // P), torch.full((B,), L)

    def step() -> object:
        return paged.decode(q, k, v, table, lengths, D**-0.5, None, ks, vs, quantized_dots)

    return step


def _decode_step(native: bool, groups: int) -> Callable[[], object]:
    """One bfloat16 decode step over :data:`DECODE`'s rows, ``groups`` query heads a
    key/value head: through the paged kernel, each sequence's rows one page (``native``:
    the path ``paged-native``), or through torch's fused kernel as qkv calls it (``sdpa``)."""
    B, H, T, D = DECODE
    g = torch.Generator().manual_seed(4)
    q = torch.randn(B, H, 1, D, generator=g).bfloat16()
    k, v = (torch.randn(B, H // groups, T, D, generator=g).bfloat16() for _ in "kv")

    def step() -> object:
        with torch.no_grad():
            if native:
                return paged.decode_rows(q, k, v, D**-0.5)
            return sdpa(q, k, v, mask=None, is_causal=False, scale=D**-0.5)

    return step


def _in_blocking(
    n: int, call: Callable[[], object], backward: bool | None = None
) -> Callable[[], object]:
    """``call`` with the steps in blocking ``n`` (:data:`steps.BLOCKINGS`): the forward's
    (``backward`` False), the backward's (True) or both (None)."""

    def timed() -> object:
        with steps.use_blocking(n, backward):
            return call()

    return timed


def _sdpa_step(
    dtype: torch.dtype, widen: bool, backward: bool, queries: int = 512
) -> Callable[[], object]:
    """One forward (and ``backward``) of torch's fused kernel, causal over ``queries``
    queries (4 heads, D = 64) of ``dtype``, or on float32 copies of them (``widen``)."""
    g = torch.Generator().manual_seed(1)
    x = [torch.randn(1, 4, queries, 64, generator=g).to(dtype) for _ in range(3)]

    def step() -> object:
        with torch.set_grad_enabled(backward):
            inputs = [t.requires_grad_(backward) for t in x]
            q, k, v = (t.float() for t in inputs) if widen else inputs
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            return torch.autograd.grad(out.to(dtype).sum(), inputs) if backward else out

    return step
