"""Quantized KV caches (int8, float8 e4m3; src/qkv/kernels/quant.py): the rounding is what
it says, attention over a quantized cache equals attention over its dequantized values to
float32 rounding — the native paged kernel reading pages in place, the gather path, the
contiguous cache, a model decoding through each — and bad input gets a clear error."""

import contextlib
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import qkv
from qkv import numpy as qnp
from qkv.kernels import paged as paged_kernel
from qkv.kernels.quant import QUANTIZED, dequantize, quantize
from qkv.kernels.tiled import profile

DTYPES = pytest.mark.parametrize("dtype", list(QUANTIZED), ids=["int8", "fp8"])


@DTYPES
def test_a_row_rounds_within_its_format_and_zeros_stay_zero(dtype):
    """int8: within half a step (scale / 2) of the row; e4m3: within 2^-4 of each value
    relative (3 mantissa bits) or half its smallest step near 0. A row of zeros has scale
    0 and comes back as zeros, no NaN."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 50, 64, dtype=torch.float64, generator=g)
    x = x * torch.rand(3, 4, 50, 1, generator=g, dtype=torch.float64) * 10
    x[0, 0, 0] = 0.0
    stored, scale = quantize(x, dtype)
    assert stored.dtype == dtype and scale.dtype == torch.float32 and scale.shape == x.shape[:3]
    back = dequantize(stored, scale, torch.float64)
    err = (back - x).abs()
    if dtype == torch.int8:
        assert bool((err <= scale[..., None] * 0.5 * (1 + 1e-6) + 1e-12).all())
    else:
        # (plus float32's rounding of x / scale and back: a few parts in 10^7)
        assert bool((err <= (x.abs() * 2**-4 + scale[..., None] * 2**-10) * (1 + 1e-5)).all())
    assert scale[0, 0, 0] == 0 and not back[0, 0, 0].any() and torch.isfinite(back).all()


def pages_and_queries(H, H_kv, D, D_v, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(12, 8, H_kv, D, generator=g) * 2
    v = torch.randn(12, 8, H_kv, D_v, generator=g)
    (kq, ks), (vq, vs) = quantize(k, dtype), quantize(v, dtype)
    q = torch.randn(3, H, D, generator=g)
    table = torch.tensor([[3, 7, 0, 1], [5, 1, 2, 9], [11, 4, 6, 8]])
    lengths = torch.tensor([13, 30, 0])  # one sequence holds no token
    return q, kq, vq, ks, vs, table, lengths


def over_dequantized(q, kq, ks, vq, vs, pages, n, sinks=None):
    """One sequence's outputs (H, D_v) by the float64 oracle over its first n tokens of the
    dequantized pages (pages: its block table row), q (H, D)."""
    k64, v64 = dequantize(kq, ks, torch.float64), dequantize(vq, vs, torch.float64)
    H, H_kv = q.shape[0], k64.shape[2]
    keys = k64[pages].flatten(0, 1)[:n].transpose(0, 1).numpy()
    values = v64[pages].flatten(0, 1)[:n].transpose(0, 1).numpy()
    return qnp.attention(
        q[None, :, None].double().numpy(),
        np.repeat(keys, H // H_kv, 0)[None],
        np.repeat(values, H // H_kv, 0)[None],
        sinks=None if sinks is None else sinks.double().numpy(),
    )[0, :, 0]


@DTYPES
@pytest.mark.parametrize("H,H_kv,D,D_v", [(4, 2, 64, 64), (4, 4, 40, 24), (32, 2, 64, 48)])
@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("isa", ["", "avx2"])
def test_paged_attention_reads_quantized_pages_in_place(
    H, H_kv, D, D_v, sinks, isa, dtype, monkeypatch
):
    """The native kernel (its vector item — AVX-512, or AVX2 pinned — for D, D_v multiples
    of 16, many query heads per key/value head too; plain C otherwise) against the float64
    oracle over the dequantized pages; the gather path (a gradient recorded) likewise."""
    q, kq, vq, ks, vs, table, lengths = pages_and_queries(H, H_kv, D, D_v, dtype)
    sink = torch.randn(H) if sinks else None
    calls = []
    real = paged_kernel.decode
    monkeypatch.setattr(paged_kernel, "decode", lambda *a: calls.append(1) or real(*a))
    if isa and (not paged_kernel.available() or isa not in paged_kernel.isas()):
        pytest.skip(f"the paged kernel's {isa} code does not run here")
    with paged_kernel.use_isa(isa) if isa else contextlib.nullcontext():
        got = qkv.paged_attention(
            q, kq, vq, table, lengths, sinks=sink, key_scale=ks, value_scale=vs
        )
    if paged_kernel.available():
        assert calls, "the native kernel did not run"
    for b in range(3):
        want = over_dequantized(q[b], kq, ks, vq, vs, table[b], int(lengths[b]), sink)
        np.testing.assert_allclose(got[b].double().numpy(), want, atol=2e-6, rtol=1e-5)
    with torch.enable_grad():  # a gradient to record: the gather path, dequantizing
        gathered = qkv.paged_attention(
            q.requires_grad_(), kq, vq, table, lengths, sinks=sink, key_scale=ks, value_scale=vs
        )
    torch.testing.assert_close(gathered.detach(), got, rtol=1e-5, atol=2e-6)


@DTYPES
@pytest.mark.parametrize("isa", ["", "avx2"])
def test_long_quantized_pages_are_read_in_parts_with_their_scales(isa, dtype):
    """Pages of 320 keys, which the vector item takes 256 and 64 at a time: each part's
    rows keep their own scales (slot t0 + t of the page), against the float64 oracle over
    the dequantized pages."""
    if not paged_kernel.available() or (isa and isa not in paged_kernel.isas()):
        pytest.skip(f"the paged kernel's {isa or 'vector'} code does not run here")
    H, H_kv, D, P = 8, 2, 64, 320
    g = torch.Generator().manual_seed(3)
    (kq, ks), (vq, vs) = (quantize(torch.randn(5, P, H_kv, D, generator=g), dtype) for _ in "kv")
    q = torch.randn(3, H, D, generator=g)
    table, lengths = torch.tensor([[4, 0, 2], [1, 3, 0], [2, 0, 0]]), torch.tensor([700, 300, 0])
    with paged_kernel.use_isa(isa) if isa else contextlib.nullcontext():
        got = qkv.paged_attention(q, kq, vq, table, lengths, key_scale=ks, value_scale=vs)
    for b in range(2):
        want = over_dequantized(q[b], kq, ks, vq, vs, table[b], int(lengths[b]))
        np.testing.assert_allclose(got[b].double().numpy(), want, atol=2e-6, rtol=1e-5)
    assert (got[2] == 0).all()


@pytest.mark.parametrize("storage", ["bfloat16", "int8", "fp8"])
@pytest.mark.parametrize(
    "H,H_kv,D,D_v", [(8, 2, 128, 128), (10, 2, 64, 48), (4, 4, 64, 64), (6, 3, 48, 32)]
)
@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("quantized_dots", [True, False], ids=["dots", "widened"])
def test_bfloat16_queries_score_their_pages_to_float32_rounding(
    storage, H, H_kv, D, D_v, sinks, quantized_dots
):
    """bfloat16 queries over bfloat16, int8 and e4m3 pages: with AVX512-BF16 the kernel
    scores them with bfloat16 dot products where D is a multiple of 32 and 2+ query heads
    share a key/value head (G = 4 and 5 here: whole and partial blocks of heads; 30 and 13
    tokens: partial blocks of keys), with float32 FMAs otherwise (G = 1, D = 48), and for
    quantized keys where told so (``quantized_dots=False``: the profile's choice on a CPU
    where widened keys are the faster). Every way the lse is the float64 oracle's over the
    queries' bfloat16 values to float32 rounding, and the output its value rounded once to
    bfloat16."""
    if not paged_kernel.available():
        pytest.skip("the native paged kernel is not built")
    dtype = {"bfloat16": torch.bfloat16, "int8": torch.int8, "fp8": torch.float8_e4m3fn}[storage]
    q, kq, vq, ks, vs, table, lengths = pages_and_queries(H, H_kv, D, D_v, torch.int8)
    if dtype == torch.bfloat16:
        k, v = dequantize(kq, ks, torch.float32), dequantize(vq, vs, torch.float32)
        kq, vq, ks, vs = k.to(dtype), v.to(dtype), None, None
        k64, v64 = kq.double(), vq.double()
    else:
        k, v = dequantize(kq, ks, torch.float32), dequantize(vq, vs, torch.float32)
        (kq, ks), (vq, vs) = quantize(k, dtype), quantize(v, dtype)
        k64, v64 = dequantize(kq, ks, torch.float64), dequantize(vq, vs, torch.float64)
    q = q.to(torch.bfloat16)
    sink = torch.randn(H) if sinks else None
    scale = D**-0.5
    found = paged_kernel.decode(q, kq, vq, table, lengths, scale, sink, ks, vs, quantized_dots)
    assert found is not None
    out, lse = found
    for b in range(3):
        n = int(lengths[b])
        keys = np.repeat(
            k64[table[b]].reshape(-1, H_kv, D)[:n].transpose(0, 1).numpy(), H // H_kv, 0
        )
        values = np.repeat(
            v64[table[b]].reshape(-1, H_kv, D_v)[:n].transpose(0, 1).numpy(), H // H_kv, 0
        )
        want, want_lse = qnp.attention(
            q[b, None, :, None].double().numpy(),
            keys[None],
            values[None],
            sinks=None if sink is None else sink.double().numpy(),
            return_lse=True,
        )
        np.testing.assert_allclose(lse[b].double().numpy(), want_lse[0, :, 0], atol=2e-6, rtol=1e-6)
        got = out[b].double().numpy()
        np.testing.assert_allclose(got, want[0, :, 0], atol=1e-6, rtol=2**-8)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_nan_or_infinite_bfloat16_key_makes_its_rows_nan_with_dot_products(bad):
    """As plain arithmetic would: the query heads of that key/value head in that sequence
    are NaN, every other row finite (bfloat16 pages, G = 4, D = 64: the dot products' item
    where the CPU has them)."""
    if not paged_kernel.available():
        pytest.skip("the native paged kernel is not built")
    q, kq, vq, ks, vs, table, lengths = pages_and_queries(8, 2, 64, 64, torch.int8)
    k = dequantize(kq, ks, torch.float32).to(torch.bfloat16)
    v = dequantize(vq, vs, torch.float32).to(torch.bfloat16)
    k[table[1, 2], 5, 1, 7] = bad  # sequence 1, token 21 of 30, key/value head 1
    found = paged_kernel.decode(q.to(torch.bfloat16), k, v, table, lengths, 0.125)
    assert found is not None
    out, lse = found
    nan = torch.zeros(3, 8, dtype=torch.bool)
    nan[1, 4:] = True
    assert bool(out.isnan().any(-1).eq(nan).all()) and bool(lse.isnan().eq(nan).all())
    assert bool(out[~nan].isfinite().all())


@pytest.mark.parametrize("isa", ["", "avx2"])
@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16])
def test_every_e4m3_value_is_widened_exactly(isa, qdtype):
    """Each of e4m3's 254 values (its two NaNs left out) as a key and as a value, one page
    of one token per sequence, scale 1: the lse is the key's value and the output the
    value's, exactly — through the vector loads (float16's bits, then the hardware's
    widening; subnormals included), with bfloat16 queries through the dot products too."""
    if not paged_kernel.available() or (isa and isa not in paged_kernel.isas()):
        pytest.skip(f"the paged kernel's {isa or 'vector'} code does not run here")
    bits = torch.arange(256, dtype=torch.uint8)
    bits = bits[(bits & 0x7F) != 0x7F]
    B, H, D = len(bits), 2, 32  # two query heads a key/value head, D = 32: the dot products'
    k = torch.zeros(B, 1, 1, D, dtype=torch.uint8)
    k[:, 0, 0, 5] = bits
    k = k.view(torch.float8_e4m3fn)
    v = k.flip(0)
    q = torch.zeros(B, H, D, dtype=qdtype)
    q[:, :, 5] = 1.0
    ones = torch.ones(B, 1, 1)
    table, lengths = torch.arange(B)[:, None], torch.ones(B, dtype=torch.int64)
    with paged_kernel.use_isa(isa) if isa else contextlib.nullcontext():
        found = paged_kernel.decode(q, k, v, table, lengths, 1.0, None, ones, ones)
    assert found is not None
    out, lse = found
    values = k[:, 0, 0, 5].float()
    assert torch.equal(lse, values[:, None].expand(B, H))
    assert torch.equal(
        out[:, :, 5].float(), values.flip(0)[:, None].expand(B, H).to(qdtype).float()
    )


def test_the_bfloat16_dot_products_are_said_where_they_run():
    """paged.dots() is this CPU's answer (AVX512-BF16), and pinned to AVX2 it is False."""
    if not paged_kernel.available():
        pytest.skip("the native paged kernel is not built")
    cpuinfo = Path("/proc/cpuinfo")
    flags = cpuinfo.read_text() if sys.platform == "linux" and cpuinfo.exists() else ""
    expect = "avx512_bf16" in flags and paged_kernel.isa() == "avx512"
    assert paged_kernel.dots() == expect
    if "avx2" in paged_kernel.isas():
        with paged_kernel.use_isa("avx2"):
            assert not paged_kernel.dots()


@pytest.mark.parametrize("stored", [True, False])
def test_paged_attention_asks_the_profile_how_to_score_quantized_keys(stored, monkeypatch):
    """Which is the faster over int8 and float8 keys, bfloat16 dot products or widened keys,
    depends on the CPU (on one Zen 4 the dot products, on one Intel Xeon widened keys): the
    machine's profile measures it, and paged_attention gives the kernel its choice where the
    probe is on and the CPU has the dot products; otherwise the kernel's own (dot products)."""
    if not paged_kernel.available():
        pytest.skip("the native paged kernel is not built")
    seen = []
    real = paged_kernel.decode
    monkeypatch.setattr(paged_kernel, "decode", lambda *a: seen.append(a[-1]) or real(*a))
    monkeypatch.setattr(profile, "probe", lambda: profile.Probe(1.0, 1.0, use_paged_dots=stored))
    q, kq, vq, ks, vs, table, lengths = pages_and_queries(8, 2, 64, 64, torch.int8)
    for probe in (True, False):
        with qkv.tuned(native_probe=probe):
            qkv.paged_attention(q.bfloat16(), kq, vq, table, lengths, key_scale=ks, value_scale=vs)
    assert seen == [stored if paged_kernel.dots() else True, True]


@DTYPES
def test_a_quantized_kv_cache_gives_back_its_dequantized_rows(dtype):
    cache = qkv.KVCache(2, 2, 10, 16, dtype=dtype)
    k, v = torch.randn(2, 2, 4, 16), torch.randn(2, 2, 4, 16)
    keys, values = cache.append(k, v)
    for got, x in ((keys, k), (values, v)):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, dequantize(*quantize(x, dtype)), rtol=0, atol=0)
    assert set(cache.tensors()) == {"keys", "values", "key_scale", "value_scale"}
    assert cache.tensors()["keys"].dtype == dtype


@DTYPES
@pytest.mark.parametrize("kind", ["contiguous", "paged", "paged_forked"])
def test_decoding_through_a_quantized_cache_equals_attention_over_its_values(dtype, kind):
    """Decode steps through a quantized cache equal attention over the dequantized keys
    and values (float32 rounding): the cache changes what is stored, nothing else. Paged:
    one query per sequence read in place; forked: a 4-token prompt shared by two sequences
    (its pages read once for both, merged by log-sum-exp)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 9, 8, generator=g) for h in (4, 2, 2))
    kd, vd = (dequantize(*quantize(x, dtype)) for x in (k, v))
    first = 0
    if kind == "contiguous":
        cache = qkv.KVCache(2, 2, 9, 8, dtype=dtype)
    else:
        pool = qkv.PagedKVCache(16, 4, 2, 8, dtype=dtype)
        seqs = [pool.new_sequence(), pool.new_sequence()]
        if kind == "paged_forked":
            first = 4
            pool.append(seqs[:1], k[:1, :, :4], v[:1, :, :4])
            pool.free(seqs[1])
            seqs[1] = pool.fork(seqs[0])
            kd[1, :, :4], vd[1, :, :4] = kd[0, :, :4], vd[0, :, :4]
    with torch.no_grad():
        for t in range(first, 9):
            step = dict(mask=None, causal=True, dropout_p=0.0, sinks=None)
            at = slice(t, t + 1)
            where = cache if kind == "contiguous" else pool.batch(seqs)
            got = where.attend(q[:, :, at], k[:, :, at], v[:, :, at], **step)
            want = qkv.attention(q[:, :, at], kd[:, :, : t + 1], vd[:, :, : t + 1])
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_quantized_pages_hold_under_a_third_of_float32s_bytes():
    """Pages with their scales, per token and key/value head at D = 64: int8 and e4m3
    68 bytes against float32's 256 (0.27×) and bfloat16's 128 (0.53×)."""

    def per_token(pool):
        held = [pool.keys, pool.values, *(s for s in pool.scales() if s is not None)]
        return sum(x.numel() * x.element_size() for x in held) / (8 * 16)

    f32 = per_token(qkv.PagedKVCache(8, 16, 1, 64))
    bf16 = per_token(qkv.PagedKVCache(8, 16, 1, 64, dtype=torch.bfloat16))
    for dtype in QUANTIZED:
        q = per_token(qkv.PagedKVCache(8, 16, 1, 64, dtype=dtype))
        assert q <= 0.3 * f32 and q <= 0.55 * bf16


@DTYPES
def test_bad_input_to_a_quantized_cache_gets_a_clear_error(dtype):
    pool = qkv.PagedKVCache(8, 4, 2, 8, dtype=dtype)
    a, b = pool.new_sequence(), pool.new_sequence()
    pool.append([a, b], torch.randn(2, 2, 3, 8), torch.randn(2, 2, 3, 8))
    k = torch.randn(2, 2, 2, 8)
    k[1, 0, 1, 5] = float("inf")
    before = pool.tokens, pool.pages_in_use
    with pytest.raises(ValueError, match=f"key of sequence {b} at position 4 holds NaN or inf"):
        pool.append([a, b], k, torch.randn(2, 2, 2, 8))
    assert (pool.tokens, pool.pages_in_use) == before  # nothing stored
    cache = qkv.KVCache(1, 2, 8, 8, dtype=dtype)
    with pytest.raises(ValueError, match="value of sequence 0 at position 1"):
        nan = torch.tensor([0.0, float("nan")])[None, None, :, None].expand(1, 2, 2, 8)
        cache.append(torch.randn(1, 2, 2, 8), nan)
    assert cache.length == 0
    with pytest.raises(ValueError, match="holds no gradient"):
        cache.append(torch.randn(1, 2, 1, 8, requires_grad=True), torch.randn(1, 2, 1, 8))
    with pytest.raises(TypeError, match="holds torch.float32"):
        cache.append(torch.zeros(1, 2, 1, 8, dtype=dtype), torch.zeros(1, 2, 1, 8, dtype=dtype))
    q, kq, vq, ks, vs, table, lengths = pages_and_queries(4, 2, 16, 16, dtype)
    with pytest.raises(ValueError, match="key_scale is needed"):
        qkv.paged_attention(q, kq, vq, table, lengths)
    with pytest.raises(ValueError, match="for quantized pages"):
        qkv.paged_attention(q, kq.float(), vq.float(), table, lengths, key_scale=ks)
    with pytest.raises(ValueError, match="float32 \\(num_pages, P, H_kv\\)"):
        qkv.paged_attention(q, kq, vq, table, lengths, key_scale=ks[:3], value_scale=vs)


@DTYPES
def test_a_quantized_latent_cache_attends_its_rows_in_place(dtype, monkeypatch):
    """The absorbed decode step over an int8 / e4m3 latent cache reads the stored rows in
    place (keys and values one row, one scale) and equals attention over the dequantized
    rows; a multi-head latent attention layer decodes through it close to the float cache
    (the rounding of its latents)."""
    g = torch.Generator().manual_seed(0)
    cache = qkv.nn.LatentCache(2, 10, 32, 16, dtype=dtype)
    cache.append(torch.randn(2, 1, 6, 48, generator=g))
    calls = []
    real = paged_kernel.decode
    monkeypatch.setattr(paged_kernel, "decode", lambda *a: calls.append(1) or real(*a))
    q, row = torch.randn(2, 4, 1, 48, generator=g), torch.randn(2, 1, 1, 48, generator=g)
    with torch.no_grad():
        got = cache.attend(
            q, row, row[..., :32], mask=None, causal=True, dropout_p=0.0, sinks=None, scale=0.2
        )
    held = cache.held()
    want = qkv.attention(q, held, held[..., :32], scale=0.2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert calls or not paged_kernel.available()
    torch.manual_seed(0)
    mla = qkv.nn.MultiHeadLatentAttention(
        64, 4, kv_lora_rank=64, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16
    )
    x = torch.randn(2, 12, 64)
    with torch.no_grad():
        full = mla(x)
        cache = mla.new_cache(2, 12, dtype)
        steps = [mla(x[:, :4], cache=cache)] + [
            mla(x[:, t : t + 1], cache=cache) for t in range(4, 12)
        ]
    assert set(cache.tensors()) == {"rows", "scales"} and cache.rows.dtype == dtype
    assert (torch.cat(steps, 1) - full).abs().max() < 0.05 * full.abs().max()


@DTYPES
def test_a_gpt_decodes_through_quantized_caches(dtype):
    """GPT.new_caches(batch, kv_dtype) and new_paged_caches(..., kv_dtype): the logits of a
    prefill then decode steps stay within a few per cent of the float caches' (a random
    model; the trained-model figures are in docs/head-shapes.md)."""
    from qkv.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, n_layer=2, n_head=4, n_embd=32, n_kv_head=2)).eval()
    idx = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        want = model(idx)
        caches = model.new_caches(2, kv_dtype=dtype)
        assert caches[0].keys.dtype == dtype
        got = [model(idx[:, :6], caches=caches)]
        got += [model(idx[:, t : t + 1], caches=caches) for t in range(6, 12)]
        pools = model.new_paged_caches(16, 4, kv_dtype=dtype)
        seqs = [pools.new_sequence(), pools.new_sequence()]
        paged = [model(idx[:, :6], caches=pools.batch(seqs))]
        paged += [model(idx[:, t : t + 1], caches=pools.batch(seqs)) for t in range(6, 12)]
    for steps in (got, paged):
        err = (torch.cat(steps, 1) - want).abs().max()
        assert err < 0.05 * want.abs().max(), err
