"""Dispatch and the core's edges pinned exactly: threshold boundaries, what an explicit
backend receives, what a Dispatch prints and compares by, masks at their broadcast edges.
Written against the mutants that survived tools/mutate.py (docs/mutation.md)."""

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import qkv
from qkv import masks
from qkv.core.dispatch import Dispatch
from tests.helpers import grads, make_qkv, mask_zoo, oracle, small_tiles
from tests.tolerances import FLOAT64

BACKENDS = ["reference", "sdpa", "tiled", "auto"]


def test_small_scores_boundary_is_512_squared():
    q, k, v = make_qkv(1, 1, 1, 512, 512, 4, 4, dtype=torch.float32)
    window = masks.sliding_window(8)
    assert qkv.dispatch(q, k, v, mask=window).backend == "tiled"  # exactly 512²: not small
    assert "is small" in qkv.dispatch(q[:, :, :511], k, v, mask=window).reason


def test_dispatch_is_a_frozen_value_of_backend_and_reason():
    q, k, v = make_qkv(1, 1, 1, 4, 4, 4, 4)
    d = qkv.dispatch(q, k, v, mask=masks.causal(), backend="tiled")
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.backend = "sdpa"
    assert "plan" not in repr(d) and "sdpa_mask" not in repr(d)
    assert d == Dispatch(d.backend, d.reason)  # the plan is not compared
    assert Dispatch("sdpa", "r", sdpa_mask="none") == Dispatch("sdpa", "r", sdpa_mask="dense")


def test_explicit_sdpa_receives_the_cheapest_form_of_the_mask():
    q, k, v = make_qkv(1, 2, 2, 6, 6, 4, 4)
    mode = lambda m: qkv.dispatch(q, k, v, mask=m, backend="sdpa").sdpa_mask  # noqa: E731
    assert mode(None) == "none" and mode(masks.causal()) == "is_causal"
    assert mode(masks.full()) == "none" and mode(masks.padding([3])) == "dense"
    assert qkv.dispatch(q, k, v, mask=masks.causal(), backend="reference").sdpa_mask == "dense"


def test_a_generator_without_dropout_changes_nothing():
    q, k, v = make_qkv(1, 2, 2, 6, 6, 4, 4)
    d = qkv.dispatch(q, k, v, generator=torch.Generator())
    assert d.backend == "sdpa" and "dropout" not in d.reason
    for mask in (None, masks.causal(), masks.full()):
        assert "dropout" not in qkv.dispatch(q, k, v, mask=mask).reason
    assert "global generator" in qkv.dispatch(q, k, v, dropout_p=0.1).reason


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_queries_with_every_mask(backend):
    q, k, v = make_qkv(2, 2, 1, 0, 5, 4, 3)
    for name, mask in mask_zoo(2, 5, 0).items():
        assert qkv.attention(q, k, v, mask=mask, backend=backend).shape == (2, 2, 0, 3), name


@pytest.mark.parametrize(
    "shape", [(2, 1, 20, 1), (20, 1), (1, 2, 1, 30), (1, 30), (20, 2), (2, 1, 2, 2)], ids=str
)
def test_broadcast_dense_masks_across_many_tiles(tune, shape):
    # A mask of size 1 along T_q or T_k is read whole in every tile, wherever the tile
    # starts; one of size 2 is sliced like any other (tiles of 1 key, 1 query).
    T_q, T_k = (20, 30) if shape[-1] != 2 else (shape[-2], 2)
    block, chunk = (1, 1) if shape[-1] == 2 else (4, 8)
    tune(**small_tiles(block_q=block, block_k=block, chunk_k=chunk))
    q, k, v = make_qkv(2, 2, 1, T_q, T_k, 4, 3)
    mask = torch.rand(shape, generator=torch.Generator().manual_seed(3)) < 0.5
    out, lse = qkv.attention(q, k, v, mask=mask, backend="tiled", return_lse=True)
    want, _, lse_want = oracle(q, k, v, mask=mask, return_weights=True, return_lse=True)
    np.testing.assert_allclose(out.numpy(), want, atol=FLOAT64, rtol=0)
    np.testing.assert_allclose(lse.numpy(), lse_want, atol=FLOAT64, rtol=0)


def test_chunks_never_span_an_empty_block(tune):
    # Attention sinks (the first 8 keys) and a window (StreamingLLM's mask) leave a gap of
    # EMPTY blocks in every late row: a chunk across it would compute them unmasked.
    tune(**small_tiles(block_q=4, block_k=4, chunk_k=16))
    q, k, v = make_qkv(1, 2, 2, 64, 64, 4, 3)
    mask = masks.padding([8]) | masks.sliding_window(4)
    plan = qkv.dispatch(q, k, v, mask=mask, backend="tiled").plan
    codes = mask.blocks(1, 2, 64, 64, block_q=4, block_k=4)
    for i, (_, _, chunks) in enumerate(plan.rows):
        for c in chunks:
            assert (codes[i, c.k0 // 4 : -(-c.k1 // 4)] != masks.EMPTY).all(), (i, c)
    out = qkv.attention(q, k, v, mask=mask, backend="tiled")
    np.testing.assert_allclose(out.numpy(), oracle(q, k, v, mask=mask), atol=FLOAT64, rtol=0)


def _plan_by_rows(codes, T_q, T_k, bq, bk, chunk):
    """The plan, written row by row: runs of non-empty blocks, each cut into
    ceil(n / per) near-equal chunks; the mask applies from the first PARTIAL block to the
    last."""
    per, out = max(1, chunk // bk), []
    for i, row in enumerate(codes):
        blocks = np.flatnonzero(row != masks.EMPTY)
        runs = np.split(blocks, np.flatnonzero(np.diff(blocks) != 1) + 1) if len(blocks) else []
        chunks = []
        for run in runs:
            for piece in np.array_split(run, -(-len(run) // per)):
                part = piece[row[piece] == masks.PARTIAL]
                chunks.append(
                    (
                        int(piece[0]) * bk,
                        min((int(piece[-1]) + 1) * bk, T_k),
                        (int(part[0]) * bk, min((int(part[-1]) + 1) * bk, T_k))
                        if len(part)
                        else None,
                    )
                )
        out.append((i * bq, min((i + 1) * bq, T_q), chunks))
    return out


@pytest.mark.parametrize("T_q,T_k", [(37, 37), (13, 50), (300, 900), (1, 1)])
@pytest.mark.parametrize("bq,bk,chunk", [(4, 4, 16), (8, 5, 20), (3, 2, 7)])
def test_plan_equals_the_row_by_row_plan(T_q, T_k, bq, bk, chunk):
    from qkv.kernels.tiled.plan import make_plan

    for name, m in mask_zoo(2, T_k).items():
        if not isinstance(m, masks.Mask):
            continue
        codes = m.blocks(2, 3, T_q, T_k, block_q=bq, block_k=bk)
        plan = make_plan(
            *m.sparse_blocks(2, 3, T_q, T_k, block_q=bq, block_k=bk),
            T_q,
            T_k,
            block_q=bq,
            block_k=bk,
            chunk_k=chunk,
        )
        got = [(q0, q1, [tuple(c) for c in chunks]) for q0, q1, chunks in plan.rows]
        assert got == _plan_by_rows(codes, T_q, T_k, bq, bk, chunk), name
        done = sum((q1 - q0) * (c[1] - c[0]) for q0, q1, cs in got for c in cs)
        assert plan.density == pytest.approx(done / (T_q * T_k)), name


def test_plans_are_immutable_values():
    q, k, v = make_qkv(1, 1, 1, 8, 8, 4, 4)
    plan = qkv.dispatch(q, k, v, mask=masks.causal(), backend="tiled").plan
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.rows = ()
    with pytest.raises(AttributeError):  # a Chunk is a named tuple
        plan.rows[0][2][0].k0 = 1
    with pytest.raises(ValueError):  # its arrays are read-only
        plan.k0[0] = 1


def test_causal_tiles_are_evaluated_once_per_diagonal(monkeypatch, tune):
    # causal() is shift-invariant: every diagonal tile has the same pattern, so the tiled
    # kernel evaluates it once per call, not once per tile.
    tune(**small_tiles(block_q=8, block_k=8, chunk_k=8))
    calls = []
    mask = masks.causal()
    block = type(mask).block
    monkeypatch.setattr(
        type(mask), "block", lambda self, *a, **kw: calls.append(a) or block(self, *a, **kw)
    )
    q, k, v = make_qkv(1, 1, 1, 64, 64, 4, 4)
    qkv.attention(q, k, v, mask=mask, backend="tiled")
    assert mask.shift_invariant and len(calls) == 1


@pytest.mark.parametrize(
    "H, H_kv, T_q, mask",
    [(8, 8, 1, None), (8, 8, 1, "causal"), (32, 8, 1, "causal"), (4, 2, 5, None), (4, 1, 3, None)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_the_plain_decode_path_is_the_full_path(H, H_kv, T_q, mask, dtype, monkeypatch):
    # A decode step skips the full checks and dispatch (issue: ~15 µs of Python); it must
    # give exactly what they give: torch's fused kernel on the same arguments.
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, H, T_q, 16, generator=g).to(dtype)
    k, v = (torch.randn(2, H_kv, 37, 16, generator=g).to(dtype) for _ in range(2))
    m = masks.causal() if mask == "causal" else None
    full = qkv.attention(q, k, v, mask=m, backend="sdpa", scale=0.3)
    assert qkv.dispatch(q, k, v, mask=m, scale=0.3).rule == "plain"
    # the plain path runs neither the full checks nor lowering
    monkeypatch.setattr(qkv.core.call, "check_attention", None)
    monkeypatch.setattr(qkv.functional, "lower", None)
    fast = qkv.attention(q, k, v, mask=m, scale=0.3)
    assert torch.equal(fast, full)
    expected = oracle(q.float(), k.float(), v.float(), mask=m, scale=0.3)
    np.testing.assert_allclose(
        fast.double().numpy(), expected, atol=1e-5 if dtype != torch.bfloat16 else 2e-2
    )


@pytest.mark.parametrize(
    "case, error",
    [
        (lambda q, k, v: (q, k.double(), v.double()), TypeError),  # mixed dtypes
        (lambda q, k, v: (q, k[:, :, :, :8], v), ValueError),  # D differs
        (lambda q, k, v: (q, k[:1], v[:1]), ValueError),  # B differs
        (lambda q, k, v: (q[:, :3], k, v), ValueError),  # H not a multiple of H_kv
        (lambda q, k, v: (q, k, v[:, :, :5]), ValueError),  # T_k differs
        (lambda q, k, v: (q.int(), k.int(), v.int()), TypeError),  # not floating point
    ],
)
def test_decode_calls_the_plain_path_refuses_still_get_their_errors(case, error):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 1, 16, generator=g)
    k, v = (torch.randn(2, 2, 9, 16, generator=g) for _ in range(2))
    with pytest.raises(error):
        qkv.attention(*case(q, k, v), mask=masks.causal())
    with pytest.raises(ValueError, match="scale must be a finite number > 0"):
        qkv.attention(q, k, v, scale=float("nan"))


def test_calls_the_plain_path_does_not_take_go_the_full_way():
    # A causal mask with more than one query, a q_offset, a padding mask: dispatched.
    q, k, v = make_qkv(1, 2, 2, 3, 9, 8, 8, dtype=torch.float32)
    for kw in (
        {"mask": masks.causal()},
        {"mask": masks.causal(), "q_offset": 2},
        {"mask": masks.padding([5])},
    ):
        out = qkv.attention(q, k, v, **kw)
        expected = oracle(q, k, v, **kw)
        np.testing.assert_allclose(out.double().numpy(), expected, atol=1e-5)


def _ran(monkeypatch, call):
    """The code that ``call()`` ran, as a path name: the kernel by the backend that
    qkv.functional.KERNELS ran, the tiled kernel's code by the function it entered."""
    import qkv.kernels.tiled as T

    ran = []
    for backend, run in list(qkv.functional.KERNELS.items()):
        monkeypatch.setitem(
            qkv.functional.KERNELS,
            backend,
            lambda c, run=run, backend=backend: ran.append(backend) or run(c),
        )
    fused, loop = T.flash.fused_forward, T.loop_forward
    monkeypatch.setattr(
        T.flash,
        "fused_forward",
        lambda c, *, native, transient=False, rounded=False: (
            ran.append(
                "tiled-flash"
                if native is None
                else "tiled-native"
                if native == c.q.dtype
                else "tiled-native-widen"
            )
            or fused(c, native=native, transient=transient, rounded=rounded)
        ),
    )
    monkeypatch.setattr(T, "loop_forward", lambda c: ran.append("tiled-loop") or loop(c))
    call()
    return ran[-1] if ran and ran[-1].startswith("tiled-") else (ran[0] if ran else "plain")


def test_dispatch_names_the_code_that_runs(monkeypatch, tune):
    # For a call of each kind: the path qkv.dispatch names is the code qkv.attention runs,
    # and the rule that chose it is named.
    from qkv.kernels.tiled import steps

    q, k, v = make_qkv(1, 2, 2, 700, 700, 16, 16, dtype=torch.float32)
    k_nan = k.clone()
    k_nan[0, 0, 600] = float("nan")
    window = masks.sliding_window(64)
    cases = {
        "sdpa": dict(mask=masks.causal()),
        "reference": dict(return_weights=True),
        "tiled-flash": dict(mask=window),
        "tiled-loop": dict(mask=window, score_mod=qkv.scores.softcap(5.0)),
    }
    wide = make_qkv(1, 2, 2, 700, 700, 600, 600, dtype=torch.float32)  # past the native kernel
    for want, kw in cases.items():
        x = wide if want.startswith("tiled") else (q, k, v)
        d = qkv.dispatch(*x, **kw)
        assert d.path == want and d.rule, (want, d)
        assert _ran(monkeypatch, lambda kw=kw, x=x: qkv.attention(*x, **kw)) == want, want
    d = qkv.dispatch(q, k_nan, v, mask=window)
    assert (d.path, d.rule) == ("tiled-loop", "non-finite key")
    assert _ran(monkeypatch, lambda: qkv.attention(q, k_nan, v, mask=window)) == "tiled-loop"
    with qkv.tuned(fused=False):
        assert qkv.dispatch(q, k, v, mask=window).path == "tiled-loop"
        assert _ran(monkeypatch, lambda: qkv.attention(q, k, v, mask=window)) == "tiled-loop"
    if steps.available():
        qb, kb, vb = make_qkv(1, 2, 2, 1024, 1024, 32, 32, dtype=torch.bfloat16)
        d = qkv.dispatch(qb, kb, vb, mask=masks.causal())
        assert (d.path, d.rule) == ("tiled-native", "native bfloat16")
        ran = _ran(monkeypatch, lambda: qkv.attention(qb, kb, vb, mask=masks.causal()))
        assert ran == "tiled-native"
        tune(native=False)
        assert qkv.dispatch(qb, kb, vb, mask=masks.causal()).path == "sdpa"


def test_the_native_kernel_runs_only_where_the_probe_measured_it_worth_it(monkeypatch, tune):
    """Rule "native bfloat16" and the tiled kernel's path follow a measurement made once
    per machine and stored (an Intel Xeon with the instructions ran the native bfloat16
    kernel at 0.71× float32's speed): where the probe says slower, bfloat16 takes the
    float32 path, and float32 torch's flash kernel; pinned (native_probe=False) it runs
    wherever the CPU can; qkv.dispatch says which."""
    from qkv.kernels.tiled import profile, steps

    if not steps.available():
        pytest.skip("native kernel not built, or no AVX512-BF16 here")
    found = profile.probe()
    assert profile.probe() is found  # read once per process
    assert found.native_ms > 0 and found.float32_ms > 0 and found.native32_ms > 0
    qb, kb, vb = make_qkv(1, 2, 2, 1024, 1024, 32, 32, dtype=torch.bfloat16)
    q32, k32, v32 = (x.float() for x in (qb, kb, vb))
    window = masks.sliding_window(64)
    tune(native_probe=True)
    verdicts = [
        profile.Probe(1.0, 2.0),  # float32 not measured natively
        profile.Probe(2.0, 1.0),
        profile.Probe(1.1, 1.0),  # 1.1×: not faster (a tie, 1.0×, goes to bfloat16's step)
        profile.Probe(1.0, 2.0, 2.1),  # float32 native within its margin (1.1×)
        profile.Probe(1.6, 3.0, 1.5),  # float32 native faster, bfloat16 not faster than it
        profile.Probe(1.1, 1.0, 1.2),  # float32 native slower
        # slower than float32's native step, faster than the widened one bfloat16 takes
        profile.Probe(1.8, 3.0, 1.7, native_widen_ms=2.0),
        profile.Probe(2.0, 4.0, 2.0),  # as fast as float32's native step: a tie, bfloat16's
    ]
    for verdict in verdicts:
        monkeypatch.setattr(profile, "probe", lambda v=verdict: v)
        assert verdict.float32 == (verdict in (*verdicts[3:5], *verdicts[6:]))
        assert verdict.faster == (verdict in (verdicts[0], verdicts[3], *verdicts[6:]))
        f = qkv.dispatch(q32, k32, v32, mask=window)
        assert f.path == ("tiled-native" if verdict.float32 else "tiled-flash")
        assert _ran(monkeypatch, lambda: qkv.attention(q32, k32, v32, mask=window)) == f.path
        d = qkv.dispatch(qb, kb, vb, mask=masks.causal())
        w = qkv.dispatch(qb, kb, vb, mask=window)
        if verdict.faster:
            assert (d.path, d.rule) == ("tiled-native", "native bfloat16")
            said = f"{verdict.native_ms:.2f} ms against float32's {verdict.float32_ms:.2f} ms"
            assert said in d.reason
            assert w.path == "tiled-native"
        else:
            # bfloat16 then runs as float32 does: natively on float32 copies, or torch's
            want = "tiled-native-widen" if verdict.float32 else "tiled-flash"
            assert d.rule != "native bfloat16" and w.path == want
            assert _ran(monkeypatch, lambda: qkv.attention(qb, kb, vb, mask=window)) == want
    tune(native_probe=False)  # pinned: the CPU flag alone, whatever was measured
    d = qkv.dispatch(qb, kb, vb, mask=masks.causal())
    assert (d.path, d.rule) == ("tiled-native", "native bfloat16") and "pinned" in d.reason


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_with_a_gradient_runs_sdpa_on_float32_copies_where_measured_faster(
    dtype, monkeypatch, tune
):
    """Where the machine's profile found torch's half-precision backward slower than on
    float32 copies (an AVX2-only CPU: 5.7× slower causal at T = 4096), a half-precision
    call to torch's fused kernel that needs a gradient runs on float32 copies: the output
    and gradients in the inputs' dtype, equal to float32's rounded. Without a gradient, or
    where the profile found no slowdown, it runs in its own dtype; float32 is untouched."""
    from qkv.kernels.tiled import profile

    tune(native_probe=True)
    slow = profile.Probe(1.0, 1.0, 1.0, 50.0, 50.0, 10.0)
    monkeypatch.setattr(profile, "probe", lambda: slow)
    q, k, v = (x.requires_grad_() for x in make_qkv(2, 4, 2, 40, 40, 32, 32, dtype=dtype))
    causal = masks.causal()
    d = qkv.dispatch(q, k, v, mask=causal)
    assert (d.backend, d.path, d.rule) == ("sdpa", "sdpa-float32", "causal square")
    assert "float32 copies" in d.reason
    decode = qkv.dispatch(q[:, :, -1:], k, v, mask=causal, q_offset=39)  # no fast path
    assert decode.path == "sdpa-float32"
    out = qkv.attention(q, k, v, mask=causal)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    got = torch.autograd.grad(out, (q, k, v), g)
    x32 = [x.detach().float().requires_grad_() for x in (q, k, v)]
    out32 = F.scaled_dot_product_attention(*x32, is_causal=True, enable_gqa=True)
    want = torch.autograd.grad(out32, x32, g.float())
    assert out.dtype == dtype and torch.equal(out, out32.to(dtype))
    for a, b in zip(got, want):
        assert a.dtype == dtype and torch.equal(a, b.to(dtype))
    with torch.no_grad():
        assert qkv.dispatch(q, k, v, mask=causal).path == "sdpa"
    assert qkv.dispatch(q.detach(), k.detach(), v.detach(), mask=causal).path == "sdpa"
    f32 = [x.detach().float().requires_grad_() for x in (q, k, v)]
    assert qkv.dispatch(*f32, mask=causal).path == "sdpa"
    monkeypatch.setattr(profile, "probe", lambda: profile.Probe(1.0, 1.0, 1.0, 9.0, 9.0, 10.0))
    assert qkv.dispatch(q, k, v, mask=causal).path == "sdpa"
    tune(native_probe=False)  # pinned: never measured, never copied
    monkeypatch.setattr(profile, "probe", lambda: slow)
    assert qkv.dispatch(q, k, v, mask=causal).path == "sdpa"


def test_every_rule_is_named_once_and_has_a_known_mode():
    from qkv.core.dispatch import RULES

    names = [r.name for r in RULES]
    assert len(set(names)) == len(names)
    assert {r.when for r in RULES} <= {"always", "eager", "tracing"}
    assert RULES[-1].when == "always"  # the last rule always matches, in either mode


def test_dispatch_sends_long_dense_ish_masks_to_tiled(tune):

    tune(**small_tiles(), long_scores=64 * 64)
    q, k, v = make_qkv(1, 1, 1, 64, 64, 4, 4)
    mask = masks.padding([60])  # computes 15/16 of the scores: not sparse
    choice = qkv.dispatch(q, k, v, mask=mask)
    assert choice.backend == "tiled" and "T_q × T_k = 64 × 64" in choice.reason
    short = make_qkv(1, 1, 1, 63, 64, 4, 4)[0]
    assert qkv.dispatch(short, k, v, mask=mask).backend == "sdpa"
    np.testing.assert_allclose(
        qkv.attention(q, k, v, mask=mask).numpy(), oracle(q, k, v, mask=mask), atol=FLOAT64
    )


def test_dispatch_reasons():
    q, k, v = make_qkv(1, 2, 2, 8, 8, 4, 4)
    assert qkv.dispatch(q, k, v).backend == "sdpa"
    assert "is_causal" in qkv.dispatch(q, k, v, mask=masks.causal()).reason
    assert "dense bool mask" in qkv.dispatch(q, k, v, mask=masks.padding([5])).reason


def test_dispatch_drops_a_mask_that_allows_everything():
    q, k, v = make_qkv(1, 2, 2, 1, 9, 4, 4)  # one query at the end of the keys: a decode step
    d = qkv.dispatch(q, k, v, mask=masks.causal())
    assert d.backend == "sdpa" and "allows every position" in d.reason
    q2 = make_qkv(1, 2, 2, 2, 9, 4, 4)[0]
    assert "allows every position" not in qkv.dispatch(q2, k, v, mask=masks.causal()).reason


def test_dispatch_small_inputs_skip_planning(tune):

    tune(small_scores=512 * 512)
    q, k, v = make_qkv(1, 1, 1, 256, 256, 4, 4)
    d_ = qkv.dispatch(q, k, v, mask=masks.sliding_window(8))
    assert d_.backend == "sdpa" and "is small" in d_.reason
    d = qkv.dispatch(q, k, v, return_lse=True)
    assert d.backend == "tiled" and "log-sum-exp" in d.reason
    d = qkv.dispatch(q, k, v, return_weights=True, return_lse=True)
    assert d.backend == "reference" and "weights" in d.reason
    d = qkv.dispatch(q, k, v, dropout_p=0.1, generator=torch.Generator())
    assert d.backend == "reference" and "Generator" in d.reason
    assert qkv.dispatch(q, k, v, dropout_p=0.1).backend == "sdpa"
    assert qkv.dispatch(q, k, v, backend="reference").reason == "requested with backend='reference'"
    assert str(qkv.dispatch(q, k, v)).startswith("sdpa: ")


def test_head_dims_that_differ_run_the_native_kernel_under_a_qkv_mask(monkeypatch, tune):
    """Rule "head dims differ": torch's fused CPU kernel takes D_v == D only (its math path
    builds the weights), so from Tuning.unequal_scores a qkv mask runs the native kernel —
    equal to the float64 oracle, output and gradients, for every qkv mask of the zoo, with
    T_q != T_k, GQA and odd head dims; a tensor mask, no mask, dropout, D == D_v and fewer
    scores stay with the rules below."""
    from qkv.kernels.tiled import steps

    if not steps.available():
        pytest.skip("no native kernel here")
    tune(native_probe=False, unequal_scores=30 * 41)
    B, T_q, T_k = 2, 30, 41
    q, k, v = make_qkv(B, 4, 2, T_q, T_k, 24, 17, dtype=torch.float32)
    g = torch.randn(B, 4, T_q, 17, generator=torch.Generator().manual_seed(1))
    for name, mask in mask_zoo(B, T_k, T_q).items():
        d = qkv.dispatch(q, k, v, mask=mask)
        if not isinstance(mask, masks.Mask):
            assert d.rule != "head dims differ", name
            continue
        assert (d.rule, d.path) == ("head dims differ", "tiled-native"), name
        assert _ran(monkeypatch, lambda: qkv.attention(q, k, v, mask=mask)) == "tiled-native"
        want = oracle(q, k, v, mask=mask)
        got = qkv.attention(q, k, v, mask=mask)
        np.testing.assert_allclose(got.double().numpy(), want, atol=1e-5, err_msg=name)
        q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
        out64 = qkv.attention(q64, k64, v64, mask=mask, backend="reference")
        want_grads = torch.autograd.grad((out64 * g.double()).sum(), (q64, k64, v64))
        for got_g, want_g in zip(grads(q, k, v, g, mask), want_grads):
            np.testing.assert_allclose(got_g.double(), want_g, atol=2e-5, err_msg=name)
    causal = masks.causal()
    assert qkv.dispatch(q, k, v).rule != "head dims differ"
    assert qkv.dispatch(q, k, v, mask=causal, dropout_p=0.1).rule == "dropout"
    v24 = torch.randn(*v.shape[:-1], 24)
    assert qkv.dispatch(q, k, v24, mask=causal).rule != "head dims differ"
    tune(unequal_scores=30 * 41 + 1)
    assert qkv.dispatch(q, k, v, mask=causal).rule != "head dims differ"
