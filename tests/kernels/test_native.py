"""qkv's native step (src/qkv/kernels/tiled/_native.c), float32 and bfloat16, against the
NumPy float64 oracle on the same inputs: one call at odd sizes (rows and keys off its
tiles, calls starting inside a 32-key block, GQA rows, broadcast masks, rows with no key,
every head dim it takes), and through ``qkv.attention`` for every mask kind with T_q !=
T_k, forward and gradients, held to the output's own rounding (docs/semantics.md); and
where it must not run."""

import contextvars
import dataclasses
import math
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import qkv
from qkv import numpy as qnp
from qkv.core.call import Call
from qkv.core.dispatch import choose
from qkv.core.lowering import lower
from qkv.kernels import paged as paged_kernel
from qkv.kernels.tiled import flash, native, native_backward, profile, steps
from tests.helpers import grads, make_qkv, mask_zoo, oracle_with_lse, small_tiles
from tests.tolerances import LOW_PRECISION, rounding_tolerance

if os.environ.get("QKV_REQUIRE_NATIVE") and native._native is None:  # CI: it must build
    raise RuntimeError("QKV_REQUIRE_NATIVE is set, but the native kernel was not built")
pytestmark = pytest.mark.skipif(
    not steps.available(torch.float32), reason="native kernel not built, or no AVX-512/AVX2 here"
)
BF16 = pytest.mark.skipif(not steps.available(torch.bfloat16), reason="no AVX512-BF16 here")
STEPS = {
    "bf16": (torch.bfloat16, ""),
    "f32": (torch.float32, ""),
    "f32-avx2": (torch.float32, "avx2"),
}
BOTH = pytest.mark.parametrize("dtype", list(STEPS), indirect=True)


@pytest.fixture
def dtype(request):
    """The dtype a test runs the kernel in, and the step it runs on: "f32-avx2" pins float32
    to the AVX2 step (steps.use_isa), which a CPU with AVX-512 runs too — so that CI tests
    both steps on whichever CPU it has."""
    dtype, isa = STEPS[request.param]
    if not steps.available(dtype):
        pytest.skip(f"this CPU cannot run the kernel in {dtype}")
    if isa and isa not in steps.isas():
        pytest.skip(f"this CPU cannot run the {isa} step")
    with steps.use_isa(isa):
        assert not isa or steps.isa(dtype) == isa
        yield dtype


def random_mask(kind, B, H_kv, G, R, N, g):
    """A call's mask as the kernel takes it — a float bias (B|1, H_kv|1, G·R, N), or int32
    row bounds (B|1, R, 2) — and as allowed keys, broadcastable to (B, H_kv, G·R, N). Row 0
    has no key; bounds also run past the keys on either side, or lo > hi."""
    if kind.startswith("bounds"):
        lo, hi = (
            torch.randint(-3, N + 4, (B if kind.endswith("batch") else 1, R), generator=g)
            for _ in range(2)
        )
        hi[:, 0] = lo[:, 0]  # a row with no key
        keys = torch.arange(N)
        allowed = (keys >= lo[..., None]) & (keys < hi[..., None])  # (B|1, R, N)
        allowed = allowed[:, None, None].expand(-1, 1, G, R, N).reshape(-1, 1, G * R, N)
        return None, torch.stack([lo, hi], -1).int(), allowed
    shape = {"shared": (1, 1), "per_head": (1, H_kv), "per_batch": (B, 1)}[kind]
    allowed = torch.rand(*shape, G * R, N, generator=g) < 0.6
    allowed[..., 0, :] = False  # a row with no key
    return torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf")), None, allowed


def kernel_mod(name, H, g):
    """A modification the native kernel applies, as its keywords and as ``qkv.scores``'s:
    none, a soft-cap, ALiBi slopes (one per query head, H = H_kv · G), or ALiBi then a
    soft-cap."""
    if name == "softcap":
        return {"softcap": 2.5}, qkv.scores.softcap(2.5)
    if name.startswith("alibi"):
        slopes = torch.rand(H, generator=g) * 0.5
        if name == "alibi+softcap":  # the two in this order, both in the kernel
            return {"slopes": slopes, "softcap": 2.5}, qkv.scores.alibi(slopes).then(
                qkv.scores.softcap(2.5)
            )
        return {"slopes": slopes}, qkv.scores.alibi(slopes)
    return {}, None


def heads_layout(x5, mask, G):
    """A call's rows (B, H_kv, G, R, ·) as the oracle's query heads (B, H_kv · G, R, ·), its
    allowed keys (B|1, H_kv|1, G·R, N) likewise."""
    B, H_kv, _, R = x5.shape[:4]
    x = x5.reshape(B, H_kv * G, R, *x5.shape[4:])
    if mask is None:
        return x, None
    return x, mask.expand(B, H_kv, G * R, -1).reshape(B, H_kv * G, R, -1)


HEAD_SHAPES = [  # (D, D_v) of 2026's models, and sizes off the vectors
    (192, 128),  # multi-head latent attention, expanded (DeepSeek V3)
    (576, 512),  # ... absorbed, over the latent cache
    (512, 512),  # Gemma 4's global layers
    (256, 128),
    (320, 320),
    (80, 80),
    (112, 48),
    (60, 50),  # bfloat16's P·V ends 49 to 63 columns into a block of 64 (once skipped)
    (34, 17),  # off every vector, D_v < 16
]


@pytest.mark.parametrize(
    "B,H_kv,G,R,T_k,k0,k1,D,D_v",
    [
        (1, 2, 1, 37, 53, 0, 53, 32, 32),  # rows and keys off the tiles
        (2, 2, 2, 19, 100, 3, 91, 64, 64),  # GQA rows, a call starting inside a 32-key block
        (1, 1, 3, 8, 300, 33, 290, 96, 96),  # D % 64 == 32, several 128-key steps
        (1, 2, 1, 130, 161, 1, 160, 128, 128),
        (1, 1, 1, 5, 40, 31, 33, 256, 256),  # two keys
        *((1, 1, 2, 11, 150, 5, 141, D, D_v) for D, D_v in HEAD_SHAPES),
    ],
)
@pytest.mark.parametrize(
    "bias_kind", ["none", "shared", "per_head", "per_batch", "bounds", "bounds_per_batch"]
)
@pytest.mark.parametrize(
    "dtype,parts",
    [("bf16", 1), ("bf16", 2), ("f32", 2), ("f32-avx2", 2)],
    ids=["bf16-p1", "bf16-p2", "f32", "f32-avx2"],
    indirect=["dtype"],
)
@pytest.mark.parametrize("mod", ["", "softcap", "alibi", "alibi+softcap"])
def test_one_call_equals_the_oracle(
    B, H_kv, G, R, T_k, k0, k1, D, D_v, bias_kind, dtype, parts, mod
):
    """With a modification: the soft-cap's scores up to ~±10 (well into the cap); ALiBi's
    first query at q_idx k0 + 5 (kv_idx: a key's index in K). Any head dims to 576, V's
    apart from Q's and K's."""
    if dtype == torch.bfloat16 and (D % 2 or D_v % 2):
        pytest.skip("bfloat16 takes even head dims")
    g = torch.Generator().manual_seed(B * 1000 + R)
    q5 = torch.randn(B, H_kv, G, R, D, generator=g).to(dtype)
    k = torch.randn(B, H_kv, T_k, D, generator=g).to(dtype)
    v = torch.randn(B, H_kv, T_k, D_v, generator=g).to(dtype)
    N = k1 - k0
    bias = bounds = allowed = None
    if bias_kind != "none":
        bias, bounds, allowed = random_mask(bias_kind, B, H_kv, G, R, N, g)
    scale = (3 if "softcap" in mod else 1) / math.sqrt(D)
    kw, score_mod = kernel_mod(mod, H_kv * G, g)
    packed = native.pack(k, v)
    out, lse = native.attend(
        q5, packed, k0, k1, bias, scale, parts, bounds=bounds, qpos=k0 + 5, **kw
    )
    q, mask = heads_layout(q5, allowed, G)
    want, want_lse = qnp.attention(
        *(
            x.double().numpy()
            for x in (q, *(t[:, :, k0:k1].repeat_interleave(G, 1) for t in (k, v)))
        ),
        mask=None if mask is None else mask.numpy(),
        scale=scale,
        q_offset=5,
        score_mod=score_mod,
        return_lse=True,
    )
    got, got_lse = (
        out.reshape(B, H_kv * G, R, D_v).double().numpy(),
        lse.reshape(B, H_kv * G, R).double().numpy(),
    )
    # float32 arithmetic (on bfloat16 inputs: with P as hi + lo, ~16 bits, the default, the
    # error is float32's; with P rounded once to bfloat16, p_parts = 1, it is up to about
    # the bfloat16 output's own rounding, 0.7× here, before out is rounded). The lse is
    # float32's either way (its sum is of the unrounded P).
    atol = {1: rounding_tolerance(want, torch.bfloat16, 1.0), 2: 2e-5}[parts]
    if dtype == torch.float32:  # float32 inputs, float32 arithmetic: a few ulps
        atol = 4e-6
    if "softcap" in kw:  # tanh near 0 as 1 - 2/(e^2x + 1): a few of 1's ulps, times the cap
        atol += 2.5 * 4 * 2**-24
    if "slopes" in kw:  # a score as large as its term rounds as float32 does at that size
        atol += 4 * 2**-24 * float(kw["slopes"].max()) * (T_k + 5)
    np.testing.assert_allclose(got, want, atol=atol, rtol=0)
    empty = np.isneginf(want_lse)
    assert np.array_equal(np.isneginf(got_lse), empty)
    np.testing.assert_allclose(got_lse[~empty], want_lse[~empty], atol=3e-5, rtol=1e-6)
    assert not got[empty].any()  # a row with no key: 0


def calls(monkeypatch):
    """Record the native calls ``qkv.attention`` makes, forward and backward."""
    seen = []
    for module, name in (
        (native, "attend"),
        (native, "attend_many"),
        (native_backward, "backward"),
        (native_backward, "backward_many"),
    ):
        real = getattr(module, name)
        monkeypatch.setattr(
            module, name, lambda *a, real=real, **kw: seen.append(1) or real(*a, **kw)
        )
    return seen


def tolerance(want, dtype):
    """bfloat16 held to its own rounding; float32 to the suite's float32 bound."""
    return rounding_tolerance(want, dtype) if dtype == torch.bfloat16 else LOW_PRECISION[dtype]


@BOTH
@pytest.mark.parametrize("small", [False, True], ids=["blocks", "small_tiles"])
@pytest.mark.parametrize("name", list(mask_zoo(2, 75, 61)))
def test_attention_runs_natively_within_its_own_rounding(name, small, dtype, monkeypatch, tune):
    if small:  # many blocks and calls; spans cut into stretches
        tune(**small_tiles(), fused_span=24, group=4, shared_min=8)
    T_q, T_k = 61, 75
    mask = mask_zoo(2, T_k, T_q)[name]
    q, k, v = make_qkv(2, 4, 2, T_q, T_k, 32, 32, dtype=dtype, seed=11)
    seen = calls(monkeypatch)
    out, lse = qkv.attention(q, k, v, mask=mask, backend="tiled", return_lse=True)
    assert seen, "the call did not run natively"
    want, want_lse = oracle_with_lse(q, k, v, mask)
    assert out.dtype == dtype and lse.dtype == torch.float32
    np.testing.assert_allclose(out.double().numpy(), want, rtol=0, atol=tolerance(want, dtype))
    finite = np.isfinite(want_lse)
    assert np.array_equal(np.isfinite(lse.numpy()), finite)
    atol = 1e-4 if dtype == torch.bfloat16 else 1e-5
    np.testing.assert_allclose(lse.double().numpy()[finite], want_lse[finite], atol=atol)


@BOTH
@pytest.mark.parametrize("name", ["causal", "sliding_window", "document"])
def test_a_forward_pass_is_one_native_call_with_the_same_bits_at_any_thread_count(
    name, dtype, monkeypatch, tune
):
    """Every call of the pass goes to the kernel at once (one parallel region: a busy
    machine's descheduled thread holds up one work item, not one barrier per call); each
    output row is one work item's, so the bits do not depend on the threads."""
    tune(**small_tiles(), fused_span=24, group=4, shared_min=8)  # many calls, some merged
    q, k, v = make_qkv(2, 4, 2, 61, 75, 32, 32, dtype=dtype, seed=3)
    mask = mask_zoo(2, 75, 61)[name]
    batches = []
    real = native.attend_many
    monkeypatch.setattr(
        native, "attend_many", lambda jobs, *a: batches.append(len(jobs)) or real(jobs, *a)
    )
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = qkv.attention(q, k, v, mask=mask, backend="tiled", return_lse=True)
        torch.set_num_threads(2)
        two = qkv.attention(q, k, v, mask=mask, backend="tiled", return_lse=True)
    finally:
        torch.set_num_threads(threads)
    assert len(batches) == 2 and batches[0] > 1  # one native call a pass, of many calls
    assert all(torch.equal(a, b) for a, b in zip(one, two))


@BF16
def test_long_rows_stay_within_their_own_rounding(monkeypatch):
    """T = 2048 keys per row, where a kernel rounding P to bfloat16 drifts."""
    q, k, v = make_qkv(1, 2, 2, 256, 2048, 64, 64, dtype=torch.bfloat16, seed=4)
    seen = calls(monkeypatch)
    out = qkv.attention(q, k, v, backend="tiled")
    assert seen
    want, _ = oracle_with_lse(q, k, v, None)
    np.testing.assert_allclose(
        out.double().numpy(), want, rtol=0, atol=rounding_tolerance(want, torch.bfloat16)
    )


@BF16
@given(
    T_q=st.sampled_from([1, 2, 7, 31, 33, 100]),
    T_k=st.sampled_from([1, 3, 32, 65, 200]),
    H_kv=st.integers(1, 2),
    D=st.sampled_from([32, 64]),
    sharp=st.sampled_from([1, 4, 16]),
    seed=st.integers(0, 2**16),
    mask=st.sampled_from(
        [
            None,
            qkv.masks.causal(),
            qkv.masks.sliding_window(3),
            qkv.masks.prefix_lm(2) | ~qkv.masks.causal(),
        ]
    ),
)
def test_native_output_within_its_own_rounding_on_random_problems(
    T_q, T_k, H_kv, D, sharp, seed, mask
):
    """qkv's accuracy promise for half precision (docs/semantics.md): within 1.5× the
    output's own rounding of the exact answer on the same inputs — here for the native
    kernel, P rounded once to bfloat16, over sizes, masks and sharper softmaxes (scores
    scaled up to 16×)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (
        torch.randn(*s, generator=g).bfloat16()
        for s in [(1, 2 * H_kv, T_q, D), (1, H_kv, T_k, D), (1, H_kv, T_k, D)]
    )
    scale = sharp / math.sqrt(D)
    assert native.supports(q, k, v)
    assert qkv.dispatch(q, k, v, mask=mask, backend="tiled").path == "tiled-native"
    got = qkv.attention(q, k, v, mask=mask, backend="tiled", scale=scale)
    want = qnp.attention(*(x.double().numpy() for x in (q, k, v)), mask=mask, scale=scale)
    np.testing.assert_allclose(
        got.double().numpy(), want, rtol=0, atol=rounding_tolerance(want, torch.bfloat16, 1.5)
    )


@pytest.mark.parametrize(
    "B,H_kv,G,R,T_k,k0,k1,D,D_v",
    [
        (1, 2, 1, 37, 53, 0, 53, 32, 32),
        (2, 2, 2, 19, 100, 3, 91, 64, 64),  # GQA rows, a call starting inside a 32-key block
        (1, 1, 3, 8, 300, 33, 290, 96, 96),  # D % 64 == 32, several key blocks (KB)
        (1, 1, 1, 5, 40, 31, 33, 256, 256),
        *((1, 1, 2, 11, 150, 5, 141, D, D_v) for D, D_v in HEAD_SHAPES),
    ],
)
@pytest.mark.parametrize("bias_kind", ["none", "shared", "per_head", "bounds_per_batch"])
@pytest.mark.parametrize("mod", ["", "softcap", "alibi", "alibi+softcap"])
@BOTH
def test_one_backward_call_equals_float64_autograd(
    B, H_kv, G, R, T_k, k0, k1, D, D_v, bias_kind, dtype, mod
):
    """dQ, dK, dV of one call from the exact lse and Delta = rowsum(dO ∘ O): float32
    arithmetic (on bfloat16 inputs, dS enters ·K as hi + lo), so float32's error; with a
    soft-cap, through its derivative 1 - tanh²; with ALiBi, whose term passes dS through.
    Any head dims to 576, V's apart from Q's and K's."""
    if dtype == torch.bfloat16 and (D % 2 or D_v % 2):
        pytest.skip("bfloat16 takes even head dims")
    g = torch.Generator().manual_seed(7 * R + D)
    q5 = torch.randn(B, H_kv, G, R, D, generator=g).to(dtype)
    do5 = torch.randn(B, H_kv, G, R, D_v, generator=g).to(dtype)
    k = torch.randn(B, H_kv, T_k, D, generator=g).to(dtype)
    v = torch.randn(B, H_kv, T_k, D_v, generator=g).to(dtype)
    N, scale = k1 - k0, (3 if "softcap" in mod else 1) / math.sqrt(D)
    kw, score_mod = kernel_mod(mod, H_kv * G, g)
    bias = bounds = allowed = None
    if bias_kind != "none":
        bias, bounds, allowed = random_mask(bias_kind, B, H_kv, G, R, N, g)
    q, mask = heads_layout(q5, allowed, G)
    qd, kd, vd = (x.double().requires_grad_() for x in (q, k[:, :, k0:k1], v[:, :, k0:k1]))
    out, lse = qkv.attention(
        qd,
        *(x.repeat_interleave(G, 1) for x in (kd, vd)),
        mask=mask,
        scale=scale,
        q_offset=5,
        backend="reference",
        score_mod=score_mod,
        return_lse=True,
    )
    dout = heads_layout(do5, None, G)[0].double()
    want = torch.autograd.grad((out * dout).sum(), (qd, kd, vd))
    with torch.no_grad():  # a row with no key: lse -inf
        lse, delta = lse.detach(), (dout * out).sum(-1)
    dk, dv = torch.zeros(B, H_kv, N, D), torch.zeros(B, H_kv, N, D_v)
    dq = torch.zeros(B, H_kv, G, R, D)
    native_backward.backward(
        q5,
        do5,
        k,
        v,
        k0,
        k1,
        bias,
        lse.float().reshape(B, H_kv, G, R),
        delta.float().reshape(B, H_kv, G, R),
        scale,
        dq,
        dk,
        dv,
        bounds,
        qpos=k0 + 5,
        **kw,
    )
    atol = 1e-4 if dtype == torch.bfloat16 else 1e-5
    if "slopes" in kw:  # the scores round as float32 does at the term's size
        atol += 2**-24 * 64 * float(kw["slopes"].max()) * (T_k + 5)
    for got, exp in zip((dq.reshape(B, H_kv * G, R, D), dk, dv), want):
        np.testing.assert_allclose(got.double().numpy(), exp.numpy(), atol=atol, rtol=1e-4)


@BOTH
@pytest.mark.parametrize("small", [False, True], ids=["blocks", "small_tiles"])
@pytest.mark.parametrize("name", ["causal", "sliding_window", "document", "padding"])
@pytest.mark.parametrize("D,D_v", [(192, 128), (80, 48), (34, 18), (17, 33)])
def test_every_head_shape_runs_natively_through_attention(D, D_v, name, small, dtype, tune):
    """Head dims off the vectors and V narrower or wider than Q and K: both passes in the
    native kernel (qkv.dispatch says so), T_q != T_k, GQA, against float64 autograd."""
    if dtype == torch.bfloat16 and (D % 2 or D_v % 2):
        pytest.skip("bfloat16 takes even head dims")
    if small:
        tune(**small_tiles(), fused_span=24, group=4, shared_min=8, backward_span=16)
    else:
        tune(small_scores=0)
    T_q, T_k = 61, 75
    mask = mask_zoo(2, T_k, T_q)[name]
    q, k, v = make_qkv(2, 4, 2, T_q, T_k, D, D_v, dtype=dtype, seed=12)
    g = torch.randn(2, 4, T_q, D_v, generator=torch.Generator().manual_seed(13)).to(dtype)
    assert qkv.dispatch(q, k, v, mask=mask, backend="tiled").path == "tiled-native"
    got = grads(q, k, v, g, mask, backend="tiled")
    want = grads(q.double(), k.double(), v.double(), g.double(), mask, backend="reference")
    for a, b in zip(got, want):
        atol = 1e-5 if dtype == torch.float32 else rounding_tolerance(b.numpy(), dtype, 2.0)
        np.testing.assert_allclose(a.double().numpy(), b.numpy(), atol=atol, rtol=1e-5)


@BOTH
def test_gradients_have_the_same_bits_run_to_run_and_at_any_thread_count(dtype):
    """dQ's share of each key block is added in the blocks' order, whichever thread ran it:
    the gradients do not depend on scheduling (they did, with one dQ buffer per thread), nor
    on whether a work item is a key block (8 heads on 3 threads) or a whole head (on 2 and
    1: HEADS_PER_THREAD in _native.c)."""
    q, k, v = make_qkv(1, 8, 8, 1024, 1024, 64, 64, dtype=dtype, seed=5)
    g = torch.randn(1, 8, 1024, 64).to(dtype)
    threads = torch.get_num_threads()
    runs = []
    try:
        for n in (2, 2, 3, 3, 1):
            torch.set_num_threads(n)
            runs.append(grads(q, k, v, g, qkv.masks.sliding_window(256), backend="tiled"))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for run in runs[1:] for a, b in zip(runs[0], run))


@pytest.mark.parametrize("dtype", ["f32", "f32-avx2"], indirect=True)
def test_a_long_row_keeps_float32_accuracy(dtype):
    """A row over 4,096 keys: each 256-key step's P·V summed apart, then added to the
    output. Summed into the output key by key its error against float64 was 21.8 units of
    float32's epsilon times the largest output (torch's kernel: 6.1); now 7.2 (7.7 AVX2)."""
    q, k, v = make_qkv(1, 4, 1, 4096, 4096, 64, 64, dtype=torch.float32, seed=0)
    out = qkv.attention(q, k, v, backend="tiled")
    assert qkv.dispatch(q, k, v, backend="tiled").path == "tiled-native"
    want = qkv.attention(q.double(), k.double(), v.double(), backend="reference")
    error = (out.double() - want).abs().max().item() / want.abs().max().item()
    assert error < 12 * torch.finfo(torch.float32).eps, error


@pytest.mark.parametrize("dtype", ["f32", "f32-avx2"], indirect=True)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dk_and_dv_summed_over_a_long_call_keep_float32_accuracy(dtype, seed):
    """Keys every query sees (a prefix) get dK and dV summed over all G·R rows of a call:
    8,192 here (16 query heads on one key/value head, 512 queries). Summed as one float32
    chain, their error against float64 was 6.0–8.0 units of float32's epsilon times the
    largest gradient on these inputs (torch's blocked backward: 1.6–4.0); summed 512 rows
    at a time (FOLD), each sum then added in, 0.8–1.8 (AVX-512 and AVX2 alike)."""
    T, H, D = 512, 16, 16
    q, k, v = make_qkv(1, H, 1, T, T, D, D, dtype=torch.float32, seed=seed)
    g = torch.ones(1, H, T, D)
    mask = qkv.masks.prefix_lm(T // 4)
    got = grads(q, k, v, g, mask, backend="tiled")
    want = grads(q.double(), k.double(), v.double(), g.double(), mask, backend="reference")
    assert qkv.dispatch(q, k, v, mask=mask, backend="tiled").path == "tiled-native"
    eps = torch.finfo(torch.float32).eps
    for name, a, b in zip(("dK", "dV"), got[1:], want[1:]):
        error = (a.double() - b).abs().max().item() / (eps * b.abs().max().item())
        assert error < 3.5, (name, error)


@BOTH
def test_python_threads_may_run_it_at_once(dtype, monkeypatch):
    """Several Python threads inside the native kernel at once (it releases the GIL; each
    call has its own work list and buffers, and each calling thread its own OpenMP team):
    every problem gets, forward and backward, the bits it gets alone."""
    seen = []
    real = native.attend_many
    monkeypatch.setattr(native, "attend_many", lambda *a: seen.append(1) or real(*a))
    mask = qkv.masks.sliding_window(37) & qkv.masks.padding([190, 250])
    problems = []
    for i in range(4):
        q, k, v = make_qkv(2, 4, 2, 200 + 9 * i, 250, 32, 32, dtype=dtype, seed=20 + i)
        problems.append((q, k, v, torch.randn(2, 4, 200 + 9 * i, 32).to(dtype)))

    def run(p):
        q, k, v, _ = p
        return (
            qkv.attention(q, k, v, mask=mask, backend="tiled"),
            *grads(*p, mask, backend="tiled"),
        )

    alone = [run(p) for p in problems]
    with ThreadPoolExecutor(4) as pool:  # each in this context (the suite's qkv.Tuning)
        runs = [pool.submit(contextvars.copy_context().run, run, p) for p in problems * 3]
        together = [r.result() for r in runs]
    assert seen, "it did not run natively"
    for i, got in enumerate(together):
        assert all(torch.equal(a, b) for a, b in zip(alone[i % 4], got)), i


@BOTH
@pytest.mark.parametrize("small", [False, True], ids=["blocks", "small_tiles"])
@pytest.mark.parametrize("name", list(mask_zoo(2, 75, 61)))
def test_gradients_run_natively(name, small, dtype, monkeypatch, tune):
    """Both passes native, every mask kind, T_q != T_k, GQA: against float64 autograd on
    the same inputs, and against torch's flash kernel in float32 (``Tuning.native`` off;
    for bfloat16 on upcasts, only its results rounded). With small tiles a pass is many
    calls whose keys overlap (their shares of dK and dV meet in one native call)."""
    if small:
        tune(**small_tiles(), fused_span=24, group=4, shared_min=8, backward_span=16)
    T_q, T_k = 61, 75
    mask = mask_zoo(2, T_k, T_q)[name]
    q, k, v = make_qkv(2, 4, 2, T_q, T_k, 32, 32, dtype=dtype, seed=12)
    g = torch.randn(2, 4, T_q, 32, generator=torch.Generator().manual_seed(13)).to(dtype)
    seen = []
    real = native_backward.backward_many
    monkeypatch.setattr(
        native_backward, "backward_many", lambda *a, **kw: seen.append(len(a[0])) or real(*a, **kw)
    )
    got = grads(q, k, v, g, mask, backend="tiled")
    assert seen == [seen[0]], "the backward did not run natively, in one call"
    want = grads(q.double(), k.double(), v.double(), g.double(), mask, backend="reference")
    if small:
        tune(**small_tiles(), fused_span=24, group=4, shared_min=8, backward_span=16, native=False)
    else:
        tune(native=False)
    upcast = grads(q, k, v, g, mask, backend="tiled")
    for a, b, c in zip(got, want, upcast):
        if dtype == torch.float32:  # float32 arithmetic both ways
            np.testing.assert_allclose(a.double().numpy(), b.numpy(), atol=1e-5, rtol=1e-5)
            np.testing.assert_allclose(a.numpy(), c.numpy(), atol=1e-5, rtol=1e-5)
            continue
        np.testing.assert_allclose(a.double().numpy(), b.numpy(), atol=3e-2, rtol=3e-2)
        np.testing.assert_allclose(
            a.double().numpy(),
            c.double().numpy(),
            rtol=0,
            atol=rounding_tolerance(b.numpy(), torch.bfloat16, 2.0),
        )


@BOTH
@pytest.mark.parametrize("small", [False, True], ids=["blocks", "small_tiles"])
@pytest.mark.parametrize("name", list(mask_zoo(2, 75, 61)))
@pytest.mark.parametrize("which", ["softcap", "alibi", "alibi+softcap"])
def test_a_modification_runs_natively(which, name, small, dtype, monkeypatch, tune):
    """The modifications the native kernel applies — ``scores.softcap`` (Gemma 2's),
    ``scores.alibi`` with fixed slopes, and the two in that order: both passes native,
    every mask kind, T_q != T_k (the queries' positions from q_offset), GQA, against
    float64 autograd through the reference on the same inputs; out within its own
    rounding, gradients within 2e-4 of their scale (bfloat16: within two units of their
    rounding of the PyTorch loop's on the same inputs; both backward passes read the
    rounded out for Delta, which against float64 costs up to ~2.2 units here, native or
    not)."""
    if small:
        tune(**small_tiles(), fused_span=24, group=4, shared_min=8, backward_span=16)
    T_q, T_k = 61, 75
    mask = mask_zoo(2, T_k, T_q)[name]
    cap, alibi = qkv.scores.softcap(2.0), qkv.scores.alibi(qkv.scores.alibi_slopes(4))
    cap = {"softcap": cap, "alibi": alibi, "alibi+softcap": alibi.then(cap)}[which]
    q, k, v = make_qkv(2, 4, 2, T_q, T_k, 32, 32, dtype=dtype, seed=15)
    q = (q.float() * 2).to(dtype)  # scores up to ~±8: well into the cap
    g = torch.randn(2, 4, T_q, 32, generator=torch.Generator().manual_seed(16)).to(dtype)
    assert qkv.dispatch(q, k, v, mask=mask, score_mod=cap, backend="tiled").path == "tiled-native"
    seen = calls(monkeypatch)
    out = qkv.attention(q, k, v, mask=mask, score_mod=cap, backend="tiled")
    got = grads(q, k, v, g, mask, backend="tiled", score_mod=cap)
    assert len(seen) == 3, "forward, and forward + backward, natively"
    exact = [x.double() for x in (q, k, v, g)]
    mod64 = cap  # the slopes in float64 for the float64 reference
    if which.startswith("alibi"):
        mod64 = qkv.scores.alibi(qkv.scores.alibi_slopes(4).double())
        mod64 = mod64.then(qkv.scores.softcap(2.0)) if which == "alibi+softcap" else mod64
    want_out = qkv.attention(*exact[:3], mask=mask, score_mod=mod64, backend="reference")
    want = grads(*exact, mask, backend="reference", score_mod=mod64)
    np.testing.assert_allclose(
        out.double().numpy(), want_out.numpy(), rtol=0, atol=tolerance(want_out.numpy(), dtype)
    )
    if dtype == torch.bfloat16:  # against the loop's, which rounds out as this pass does
        tune(native=False)
        want = grads(q, k, v, g, mask, backend="tiled", score_mod=cap)
    for a, b in zip(got, want):
        b = b.double().numpy()
        atol = rounding_tolerance(b, dtype, 2.0) if dtype == torch.bfloat16 else 2e-4 * abs(b).max()
        np.testing.assert_allclose(a.double().numpy(), b, rtol=0, atol=atol)


def test_a_modification_the_native_kernel_cannot_run_takes_the_loop(monkeypatch, tune):
    """Native off (or a call it cannot take), a soft-cap runs in the PyTorch loop — never
    in torch's flash kernel, which has no soft-cap — and the dispatch says why; ALiBi slopes
    that need a gradient run there too (the kernel computes none for them)."""
    tune(native=False)
    cap = qkv.scores.softcap(2.0)
    q, k, v = make_qkv(1, 4, 2, 40, 50, 32, 32, dtype=torch.float32, seed=17)
    d = qkv.dispatch(q, k, v, mask=qkv.masks.causal(), score_mod=cap, backend="tiled")
    assert d.path == "tiled-loop"
    seen = calls(monkeypatch)
    out = qkv.attention(q, k, v, mask=qkv.masks.causal(), score_mod=cap, backend="tiled")
    assert not seen
    want = qkv.attention(
        *(x.double() for x in (q, k, v)),
        mask=qkv.masks.causal(),
        score_mod=cap,
        backend="reference",
    )
    np.testing.assert_allclose(out.double().numpy(), want.numpy(), atol=1e-5, rtol=0)
    asked = Call.of(q, k, v, mask=qkv.masks.causal(), backend="tiled", score_mod=cap)
    call = dataclasses.replace(lower(asked, choose(asked)), path="tiled-flash")
    with pytest.raises(ValueError, match="soft-cap"):  # refused, not dropped
        flash.fused_forward(call, native=None)
    tune(native=True)  # ALiBi slopes that need a gradient: the loop computes it
    slopes = qkv.scores.alibi_slopes(4).requires_grad_()
    alibi = qkv.scores.alibi(slopes)
    assert qkv.dispatch(q, k, v, score_mod=alibi, backend="tiled").path == "tiled-loop"
    qkv.attention(q, k, v, score_mod=alibi, backend="tiled").sum().backward()
    assert not seen and slopes.grad is not None and slopes.grad.abs().sum() > 0


@pytest.mark.parametrize("isa", ["", "avx2", "neon"])
def test_the_dispatch_names_the_step_that_runs(isa, tune):
    """``qkv.dispatch`` says which instruction set's step runs float32, and pinning it to
    AVX2 (``QKV_NATIVE_ISA=avx2`` / ``use_isa``; NEON on a CPU with SVE) changes what it
    says and what runs."""
    if isa and isa not in steps.isas():
        pytest.skip(f"this CPU cannot run the {isa} step")
    tune(native_probe=False)
    q, k, v = make_qkv(1, 2, 2, 1024, 1024, 64, 64, dtype=torch.float32, seed=3)
    with steps.use_isa(isa):
        want = isa or steps.isa()
        d = qkv.dispatch(q, k, v, mask=qkv.masks.sliding_window(64))
        assert d.path == "tiled-native" and f"native float32 kernel ({want})" in d.reason
    assert steps.isa() == steps.isas()[0]  # the pin is undone after the block
    with pytest.raises(ValueError, match="avx2"):
        native._native.use_isa("sse")


@pytest.mark.parametrize("small", [False, True], ids=["blocks", "small_tiles"])
@pytest.mark.parametrize("name", list(mask_zoo(2, 75, 61)))
def test_interval_masks_reach_the_kernel_as_row_bounds_not_tiles(name, small, monkeypatch, tune):
    """A mask whose every row sees one interval of keys (Mask.intervals) is masked by each
    row's bounds, forward and backward: no tile is evaluated (the tiles' torch ops, each a
    parallel region of its own, were most of a pass's time on a busy machine); the others
    still reach the kernel as a float bias."""
    if small:
        tune(**small_tiles(), fused_span=24, group=4, shared_min=8, backward_span=16)
    T_q, T_k = 61, 75
    mask = mask_zoo(2, T_k, T_q)[name]
    intervals = isinstance(mask, qkv.masks.Mask) and mask.intervals(np.arange(T_q)) is not None
    tiles, masked = [], []
    real_bias, real_fwd, real_bwd = (
        flash._call_bias,
        native.attend_many,
        native_backward.backward_many,
    )
    monkeypatch.setattr(flash, "_call_bias", lambda *a: tiles.append(1) or real_bias(*a))
    monkeypatch.setattr(
        native,
        "attend_many",
        lambda jobs, *a: masked.extend(r[2:] for j in jobs for r in j.ranges) or real_fwd(jobs, *a),
    )
    monkeypatch.setattr(
        native_backward,
        "backward_many",
        lambda jobs, *a, **kw: (
            masked.extend((j.bias, j.bounds) for j in jobs) or real_bwd(jobs, *a, **kw)
        ),
    )
    q, k, v = make_qkv(2, 4, 2, T_q, T_k, 32, 32, dtype=torch.float32, seed=14)
    grads(q, k, v, torch.ones(2, 4, T_q, 32), mask, backend="tiled")
    assert masked, "it did not run natively"
    if intervals:
        assert not tiles and all(bias is None for bias, _ in masked)
        assert any(bounds is not None for _, bounds in masked) or name == "full"
    elif isinstance(mask, (qkv.masks.Mask, torch.Tensor)):
        assert tiles and all(bounds is None for _, bounds in masked)


@pytest.mark.parametrize(
    "case",
    [
        "nan_query",
        "inf_value",
        "head_dim_600",  # past the widest head
        "float64",
        "native_off",
        "float32_nan_query",
        "float32_head_dim_600",
    ],
)
def test_where_it_does_not_run_torchs_kernel_answers(case, monkeypatch, tune):
    """Forward and backward: neither native call is made."""
    D = int(case.rsplit("_", 1)[1]) if "head_dim" in case else 32
    dtype = torch.float64 if case == "float64" else torch.bfloat16
    dtype = torch.float32 if case.startswith("float32") else dtype
    q, k, v = make_qkv(1, 2, 2, 40, 40, D, D, dtype=dtype, seed=2)
    if case.endswith("nan_query"):
        q[0, 1, 5, 3] = float("nan")
    if case == "inf_value":
        v[0, 0, 7, 1] = float("inf")
    if case == "native_off":
        tune(native=False)
    else:
        assert not native.supports(q, k, v)
    assert qkv.dispatch(q, k, v, mask=qkv.masks.causal(), backend="tiled").path != "tiled-native"
    seen = calls(monkeypatch)
    mask = qkv.masks.causal()
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = qkv.attention(q, k, v, mask=mask, backend="tiled")
    out.float().sum().backward()
    assert not seen
    want = qkv.attention(q.double(), k.double(), v.double(), mask=mask, backend="reference")
    np.testing.assert_allclose(
        out.detach().double().numpy(), want.detach().numpy(), atol=2e-2, equal_nan=True
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["causal", "sliding_window", "document"])
def test_half_precision_runs_natively_widened(dtype, name, monkeypatch, tune):
    """float16 (which this kernel does not compute in), and bfloat16 where its own native
    path is off: the native kernel in float32, widening the inputs as it loads them, forward
    and backward, within
    the output's own rounding; the gradients within two units of their rounding of float32's
    on the same inputs (the half-precision pass's Delta reads the rounded out)."""
    if dtype == torch.bfloat16:
        tune(native=True)
        monkeypatch.setattr(profile, "probe", lambda: profile.Probe(2.0, 1.0, 1.0))
        tune(native_probe=True)
    q, k, v = make_qkv(2, 4, 2, 61, 75, 32, 32, dtype=dtype, seed=21)
    mask = mask_zoo(2, 75, 61)[name]
    assert qkv.dispatch(q, k, v, mask=mask, backend="tiled").path == "tiled-native-widen"
    seen = calls(monkeypatch)
    g = torch.randn(2, 4, 61, 32, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = qkv.attention(q, k, v, mask=mask, backend="tiled")
    got = grads(q, k, v, g, mask, backend="tiled")
    assert len(seen) == 3  # forward, and forward + backward
    want, _ = oracle_with_lse(q, k, v, mask)
    np.testing.assert_allclose(out.double().numpy(), want, rtol=0, atol=tolerance(want, dtype))
    f32 = grads(q.float(), k.float(), v.float(), g.float(), mask, backend="tiled")
    for a, b in zip(got, f32):
        assert a.dtype == dtype
        atol = rounding_tolerance(b.numpy(), dtype, 2.0)
        np.testing.assert_allclose(a.double().numpy(), b.double().numpy(), rtol=0, atol=atol)


@pytest.mark.parametrize("source", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("isa", ["", "avx2"])
@pytest.mark.parametrize(
    "B,H_kv,G,R,T_k,k0,k1,D,D_v",
    [
        (2, 2, 2, 19, 100, 3, 91, 64, 64),  # GQA rows, a call starting inside a 32-key block
        (1, 1, 2, 11, 150, 5, 141, 192, 128),
        (1, 1, 2, 11, 150, 5, 141, 80, 48),
        (1, 2, 1, 37, 53, 0, 53, 17, 33),  # off every vector, odd (bfloat16's own step: even)
    ],
)
@pytest.mark.parametrize("bias_kind", ["none", "per_head", "bounds_per_batch"])
@pytest.mark.parametrize("mod", ["", "alibi+softcap"])
def test_half_precision_is_widened_as_it_is_loaded_with_float32s_bits(
    B, H_kv, G, R, T_k, k0, k1, D, D_v, bias_kind, mod, isa, source
):
    """The float32 step on bfloat16 or float16 inputs reads them as they are and widens each
    value as it loads it (exact; the forward's V once, as it is packed, into float32 rows):
    its forward and backward equal, bit for bit, the float32 step on float32 copies of the
    same values — which the tests above hold to the float64 oracle — on both steps, at any
    head dims, with masks and modifications."""
    if isa and isa not in steps.isas():
        pytest.skip(f"this CPU cannot run the {isa} step")
    g = torch.Generator().manual_seed(R + D)
    q5 = torch.randn(B, H_kv, G, R, D, generator=g).to(source)
    do5 = torch.randn(B, H_kv, G, R, D_v, generator=g).to(source)
    k = torch.randn(B, H_kv, T_k, D, generator=g).to(source)
    v = torch.randn(B, H_kv, T_k, D_v, generator=g).to(source)
    N, scale = k1 - k0, 1 / math.sqrt(D)
    kw, _ = kernel_mod(mod, H_kv * G, g)
    bias = bounds = None
    if bias_kind != "none":
        bias, bounds, _ = random_mask(bias_kind, B, H_kv, G, R, N, g)
    runs = []
    with steps.use_isa(isa):
        for x in ((q5, do5, k, v), tuple(t.float() for t in (q5, do5, k, v))):
            packed = native.pack(x[2], x[3], torch.float32)
            if x[3].dtype == torch.float32:  # V read in place
                assert packed.v.data_ptr() == x[3].data_ptr()
            else:  # V widened once into float32 rows
                assert packed.v.dtype == torch.float32 and torch.equal(packed.v, x[3].float())
            out, lse = native.attend(
                x[0], packed, k0, k1, bias, scale, bounds=bounds, qpos=k0 + 5, **kw
            )
            delta = (out * x[1].float()).sum(-1)
            dq = torch.zeros(B, H_kv, G, R, D)
            dk, dv = torch.zeros(B, H_kv, N, D), torch.zeros(B, H_kv, N, D_v)
            native_backward.backward(
                x[0],
                x[1],
                x[2],
                x[3],
                k0,
                k1,
                bias,
                lse,
                delta,
                scale,
                dq,
                dk,
                dv,
                bounds,
                qpos=k0 + 5,
                dtype=torch.float32,
                **kw,
            )
            runs.append((out, lse, dq, dk, dv))
    for widened, copied in zip(*runs):
        assert torch.equal(widened, copied)


@pytest.mark.parametrize("source", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("computed", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("isa", ["", "avx2"])
@pytest.mark.parametrize("D,D_v", [(64, 64), (40, 18), (192, 128), (96, 34)])
def test_half_precision_output_is_rounded_by_the_kernel_as_torch_rounds(
    source, computed, isa, D, D_v
):
    """Given an output in the inputs' half precision, the forward rounds each value as it
    writes it: the same bits as the float32 output rounded by ``.to()`` (to nearest even),
    ties and float16's subnormals included, at head dims on and off the vectors, on every
    step; its log-sum-exp unchanged. Ties: two keys with equal scores average two
    neighbouring values, a float32 exactly between two half-precision ones."""
    if computed == torch.bfloat16 and source != torch.bfloat16:
        pytest.skip("the bfloat16 step takes bfloat16")
    if not steps.available(computed) or (isa and isa not in steps.isas()):
        pytest.skip("the native kernel cannot run this step here")
    if isa and computed == torch.bfloat16:
        pytest.skip("the AVX2 step computes in float32")
    g = torch.Generator().manual_seed(D + D_v)
    B, H_kv, G, R, T_k = 2, 2, 3, 21, 2
    q5 = torch.randn(B, H_kv, G, R, D, generator=g).to(source)
    k = torch.randn(B, H_kv, 1, D, generator=g).to(source).expand(B, H_kv, T_k, D).contiguous()
    tiny = 2.0**-20 if source == torch.float16 else 1.0  # float16's subnormals below 2^-14
    v = (torch.randn(B, H_kv, 1, D_v, generator=g) * tiny).to(source)
    step = v.float().abs() * 2.0**-7 + (2.0**-24 if source == torch.float16 else 0.0)
    v = torch.cat([v, (v.float() + step).to(source)], 2)  # each pair: neighbours or near
    with steps.use_isa(isa):
        packed = native.pack(k, v, computed)
        want, lse = native.attend(q5, packed, 0, T_k, None, D**-0.5)
        got = torch.empty(B, H_kv, G, R, D_v, dtype=source)
        got, lse2 = native.attend(q5, packed, 0, T_k, None, D**-0.5, out=got)
    assert got.dtype == source
    assert torch.equal(got.view(torch.int16), want.to(source).view(torch.int16))
    assert torch.equal(lse, lse2)
    ties = (want * 2).to(source).float() / 2 == want  # exactly between two neighbours
    assert bool(ties.any())


def test_half_precision_attention_writes_its_output_in_its_dtype(monkeypatch, tune):
    """qkv.attention on half precision through the native kernel hands it an output in
    the inputs' dtype (no float32 output to round in a second pass), except with sinks,
    which scale the float32 output before it is rounded; the results equal the float32
    path's rounded, bit for bit."""
    tune(native=True, native_probe=False)
    seen = []
    real = native._native.attend_many
    monkeypatch.setattr(
        native._native,
        "attend_many",
        lambda **kw: seen.extend(c["out_dtype"] for c in kw["calls"]) or real(**kw),
    )
    q, k, v = make_qkv(1, 4, 2, 70, 90, 32, 32, dtype=torch.float16, seed=5)
    mask = qkv.masks.sliding_window(16)
    out = qkv.attention(q, k, v, mask=mask, backend="tiled")
    assert out.dtype == torch.float16 and set(seen) == {"float16"}
    seen.clear()
    sinks = torch.randn(4)
    qkv.attention(q, k, v, mask=mask, backend="tiled", sinks=sinks)
    assert set(seen) == {"float32"}
    want = qkv.attention(q.float(), k.float(), v.float(), mask=mask, backend="tiled")
    assert torch.equal(out, want.to(torch.float16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [1, 5, 16, 37, 64, 576])
@pytest.mark.parametrize("isa", ["", "avx2"])
def test_the_backwards_delta_reads_half_precision_as_it_is(dtype, D, isa):
    """native.row_dot: rowsum(a ∘ b) of bfloat16 or float16 rows, widened as read, equal to
    float64's sum of the same values within float32 rounding, at head dims on and off the
    vectors, on both steps; None for what it does not take."""
    if not steps.available(torch.float32) or (isa and isa not in steps.isas()):
        pytest.skip("the native kernel cannot run this step here")
    g = torch.Generator().manual_seed(D)
    a, b = (torch.randn(2, 3, 7, D, generator=g).to(dtype) for _ in range(2))
    with steps.use_isa(isa):
        got = native.row_dot(a, b)
    assert got is not None and got.dtype == torch.float32 and got.shape == (2, 3, 7)
    want = (a.double() * b.double()).sum(-1)
    scale = (a.double() * b.double()).abs().sum(-1)
    assert ((got.double() - want).abs() <= 1e-6 * scale + 1e-30).all()
    assert native.row_dot(a.float(), b.float()) is None  # float32: the batched matmul
    assert native.row_dot(a.transpose(1, 2), b.transpose(1, 2)) is None  # not contiguous
    assert native.row_dot(a, b.to(torch.float32)) is None


def test_the_half_precision_backward_takes_its_delta_from_the_kernel(monkeypatch, tune):
    """The widened backward's Delta comes from native.row_dot on the half-precision dO and
    out, not from float32 copies of them."""
    tune(native=True, native_probe=False)
    seen = []
    real = native.row_dot
    monkeypatch.setattr(native, "row_dot", lambda a, b: seen.append(a.dtype) or real(a, b))
    q, k, v = make_qkv(1, 2, 2, 70, 90, 32, 32, dtype=torch.float16, seed=4)
    mask = qkv.masks.sliding_window(16)
    assert qkv.dispatch(q, k, v, mask=mask, backend="tiled").path == "tiled-native-widen"
    grads(q, k, v, torch.ones(1, 2, 70, 32, dtype=torch.float16), mask, backend="tiled")
    assert seen == [torch.float16]


def test_half_precision_reaches_the_kernel_as_it_is(monkeypatch, tune):
    """qkv.attention on float16 inputs (bfloat16 too where its own step is off): the
    float32 step receives the half-precision tensors, not float32 copies, forward and
    backward."""
    tune(native=True, native_probe=False)
    seen = []
    real_pack, real_backward = native.pack, native_backward.backward_many
    monkeypatch.setattr(
        native,
        "pack",
        lambda k, v, dtype=None, **kw: seen.append(k.dtype) or real_pack(k, v, dtype, **kw),
    )
    monkeypatch.setattr(
        native_backward,
        "backward_many",
        lambda jobs, k, *a, **kw: seen.append(k.dtype) or real_backward(jobs, k, *a, **kw),
    )
    q, k, v = make_qkv(1, 2, 2, 70, 90, 32, 32, dtype=torch.float16, seed=3)
    mask = qkv.masks.sliding_window(16)
    assert qkv.dispatch(q, k, v, mask=mask, backend="tiled").path == "tiled-native-widen"
    grads(q, k, v, torch.ones(1, 2, 70, 32, dtype=torch.float16), mask, backend="tiled")
    assert seen and set(seen) == {torch.float16}


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(mask_zoo(2, 75, 61)))
def test_each_steps_two_blockings_give_the_same_bits(name, dtype, isa, monkeypatch, tune):
    """Each step compiled in two blockings (the profile measures which is faster) — AVX-512
    with tiles of 8 and of 16 query rows, AVX2 with 3 and 2 rows in registers: the same
    output, lse and gradients, bit for bit, in float32 and bfloat16 (AVX-512's dot products
    where the CPU has them, else widened), with every mask, odd sizes (122 rows a head: tiles
    of 16 end part-full), T_q != T_k, D_v != D; the first blocking is held to the float64
    oracle above."""
    if isa not in steps.isas():
        pytest.skip(f"this CPU cannot run the {isa} step")
    tune(native=True, native_probe=False)
    mask = mask_zoo(2, 75, 61)[name]
    q, k, v = make_qkv(2, 4, 2, 61, 75, 40, 24, dtype=dtype, seed=5)
    g = torch.randn(2, 4, 61, 24, generator=torch.Generator().manual_seed(2)).to(dtype)
    runs, before = [], steps.blocking()  # (the profile's, once a test has read it)
    with steps.use_isa("" if isa == "avx512" else isa):  # (the CPU's choice: AVX-512)
        assert steps.isa(torch.float32) == isa
        assert qkv.dispatch(q, k, v, mask=mask, backend="tiled").path.startswith("tiled-native")
        for n in steps.BLOCKINGS:
            with steps.use_blocking(n):
                assert steps.blocking() == n
                out, lse = qkv.attention(q, k, v, mask=mask, backend="tiled", return_lse=True)
                runs.append((out, lse, *grads(q, k, v, g, mask, backend="tiled")))
        with steps.use_blocking(1, backward=True):  # the backward's alone: forward's first
            assert steps.blocking() == before and steps.blocking(backward=True) == 1
            runs.append((*runs[0][:2], *grads(q, k, v, g, mask, backend="tiled")))
    assert steps.blocking() == before  # undone after the block
    for first, *others in zip(*runs):
        assert all(torch.equal(first, other) for other in others)
    with pytest.raises(ValueError, match="one of"):
        steps.set_blocking(2)


def test_float32_reads_values_in_place_at_any_row_stride():
    """float32 V is not copied: its rows are read where they lie — here from a (B, T, H, D)
    layout (rows H·D apart), T off the 32-key blocks, a call ending at the last key — and
    never past the call's keys (the tail of a 32-key block is not read)."""
    g = torch.Generator().manual_seed(5)
    B, H, T, D = 2, 3, 45, 64
    k = torch.randn(B, T, H, D, generator=g).transpose(1, 2)
    v = torch.randn(B, T, H, D, generator=g).transpose(1, 2)
    q5 = torch.randn(B, H, 1, 19, D, generator=g)
    packed = native.pack(k, v)
    assert packed.v.data_ptr() == v.data_ptr() and packed.values()[3] == H * D
    out, lse = native.attend(q5, packed, 3, T, None, 0.125)
    want, want_lse = oracle_with_lse(q5[:, :, 0], k[:, :, 3:], v[:, :, 3:], None, 0.125)
    np.testing.assert_allclose(out[:, :, 0].double().numpy(), want, atol=4e-6, rtol=0)
    np.testing.assert_allclose(lse[:, :, 0].double().numpy(), want_lse, atol=4e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("at", [0, 16383, 16384, 40000 - 1, 40006])
@pytest.mark.parametrize("isa", ["avx512", "avx2", "neon", "sve"])
def test_the_one_thread_finiteness_check_finds_nan_and_inf_anywhere(dtype, value, at, isa):
    """native.finite (the dispatch's check of Q, K and V, in one thread, on each step's
    vectors) against all_finite: the first and last elements, either side of its
    16,384-value chunks, in the last whole 64 values and in the part-vector tail after them;
    the largest finite values are finite; a non-contiguous tensor takes all_finite."""
    from qkv.kernels.reference import all_finite

    if isa not in steps.isas():
        pytest.skip(f"this CPU cannot run the {isa} step")
    big = torch.finfo(dtype).max
    x = torch.randn(40007).clamp(-1, 1).to(dtype) * big
    with steps.use_isa("" if isa in ("avx512", "sve") else isa):
        assert steps.isa(torch.float32) == isa
        assert native.finite(x) and all_finite(x)
        for n in (1, 15, 17, 64, 40000):  # whole vectors, part ones
            assert native.finite(x[:n])
        x[at] = value
        assert not native.finite(x) and not all_finite(x)
        assert native.finite(x[:at]) and not native.finite(x[: at + 1])
    y = torch.randn(200, 200).to(dtype).t()
    y[3, 7] = value
    assert not y.is_contiguous() and not native.finite(y)
    assert native.finite(torch.zeros(0, dtype=dtype))
    y = torch.randn(200, 200).to(dtype).t()
    y[3, 7] = value
    assert not y.is_contiguous() and not native.finite(y)
    assert native.finite(torch.zeros(0, dtype=dtype))


@BF16
def test_mismatched_shapes_raise_instead_of_reading_past_the_tensors():
    q5 = torch.zeros(1, 2, 1, 8, 32, dtype=torch.bfloat16)
    k = torch.zeros(1, 2, 40, 32, dtype=torch.bfloat16)
    packed = native.pack(k, k)
    with pytest.raises(ValueError, match="mismatched"):
        native.attend(q5, packed, 0, 40, torch.zeros(1, 1, 8, 39), 1.0)  # bias too short
    with pytest.raises(ValueError, match="mismatched"):
        native.attend(q5[:, :1], packed, 0, 40, None, 1.0)  # heads differ
    with pytest.raises(ValueError, match="mismatched"):
        native.attend(q5, packed, 10, 10, None, 1.0)  # no keys
    with pytest.raises(ValueError, match="packed"):
        native.attend(q5, packed, 0, 100, None, 1.0)  # keys past the packed buffer
    with pytest.raises(ValueError, match="mismatched"):
        native.attend(q5.float(), packed, 0, 40, None, 1.0)  # float32 rows, bfloat16 keys
    with pytest.raises(ValueError, match="length and dtype"):
        native.pack(k.float(), k)
    with pytest.raises(ValueError, match="length and dtype"):
        native.pack(k, k[:, :, :39])
    rows, dq, dkv = torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 1, 8, 32), torch.zeros(1, 2, 41, 32)
    with pytest.raises(ValueError, match="past T_k"):  # the backward reads K and V as they are
        native_backward.backward(
            q5.float(), q5.float(), k.float(), k.float(), 0, 41, None, rows, rows, 1.0, dq, dkv, dkv
        )


@BF16
def test_auto_runs_bfloat16_natively_from_1024_squared_scores():
    """``auto`` takes the native kernel for bfloat16 calls of 1024 × 1024 scores or more,
    forward or training (faster than SDPA here: docs/kernels.md#the-native-kernel), and keeps
    SDPA below that size and where the head dim does not fit the kernel."""
    q, k, v = make_qkv(1, 2, 2, 1024, 1024, 64, 64, dtype=torch.bfloat16)
    causal = qkv.masks.causal()
    d = qkv.dispatch(q, k, v, mask=causal)
    assert d.backend == "tiled" and "native bfloat16" in d.reason
    assert qkv.dispatch(q, k, v).backend == "tiled"
    assert qkv.dispatch(q.requires_grad_(), k, v, mask=causal).backend == "tiled"
    q = q.detach()
    assert qkv.dispatch(q[:, :, :512], k[:, :, :1024], v, mask=causal).backend == "sdpa"
    assert qkv.dispatch(q.float(), k.float(), v.float(), mask=causal).backend == "sdpa"
    wide = make_qkv(1, 2, 2, 1024, 1024, 600, 600, dtype=torch.bfloat16)  # past the widest
    assert qkv.dispatch(*wide, mask=causal).backend == "sdpa"


def test_the_boundary_to_c_is_named_fields(monkeypatch):
    """Every native call passes named fields: their order changes nothing (bit for bit), and
    a field that is missing, renamed, extra or passed by position is a TypeError, where a
    positional tuple would have read one pointer as another without a word."""
    q, k, v = make_qkv(1, 2, 2, 40, 40, 32, 32, dtype=torch.float32)
    packed = native.pack(k, v)
    seen = []
    real = native._native.attend_many
    monkeypatch.setattr(
        native._native, "attend_many", lambda **kw: (seen.append(kw), real(**kw))[1]
    )
    q5 = q.view(1, 2, 1, 40, 32)
    want, lse = native.attend(q5, packed, 0, 40, None, 0.2)  # both alive: C writes to them
    want = want.clone()
    (fields,) = seen[-1]["calls"]
    out = torch.zeros_like(want)

    def run(call):
        real(calls=[{**call, "out": (out.data_ptr(), *out.stride()[:4])}], threads=1)
        return out.clone()

    assert torch.equal(run(dict(reversed(list(fields.items())))), want)
    assert bool(torch.isfinite(lse).all())
    missing = {n: x for n, x in fields.items() if n != "lse"}
    with pytest.raises(TypeError, match="lse"):
        run(missing)
    renamed = {("keys" if n == "k" else n): x for n, x in fields.items()}
    with pytest.raises(TypeError, match="missing required argument 'k'"):
        run(renamed)
    extra = {**fields, "keys": fields["k"]}
    with pytest.raises(TypeError, match="at most 15 keyword arguments"):
        run(extra)
    with pytest.raises(TypeError):
        real([tuple(fields.values())], 1)  # the old positional form


@pytest.mark.skipif(not paged_kernel.available(), reason="the native paged kernel is not built")
def test_the_paged_kernel_takes_named_fields_only():
    with pytest.raises(TypeError, match="named fields"):
        paged_kernel._paged.decode((0, 0, 0), (0, 0, 0, 0))
    with pytest.raises(TypeError, match="missing required argument 'v'"):
        paged_kernel._paged.decode(q=(0, 0, 0), k=(0, 0, 0, 0))  # the rest missing
