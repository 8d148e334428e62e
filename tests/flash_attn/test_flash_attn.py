"""qkv.flash_attn: FlashAttention 2's API on a CPU, every function against a float64
reference written from FlashAttention's documented semantics (tests/flash_attn/flash_ref.py),
gradients included; the KV cache contiguous and paged, rotary, left padding; its errors; and
``install()``."""

import sys
import types
import warnings

import pytest
import torch

import qkv
from qkv import flash_attn as fa
from tests.flash_attn.flash_ref import attention_ref
from tests.tolerances import FLOAT64

WINDOWS = [(-1, -1), (3, 2), (4, 0), (0, 3), (-1, 2), (2, -1)]
LENGTHS = [(7, 7), (5, 11), (11, 5), (1, 9)]  # T_q, T_k: T_q > T_k leaves rows with no key


def rand(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def options(case):
    """A case's score changes and head counts, varied over the grid: soft-cap, ALiBi per
    head or per batch row, GQA and MQA."""
    H, H_kv = [(4, 4), (4, 2), (4, 1)][case % 3]
    softcap = [0.0, 3.0][case % 2]
    alibi = [None, rand(H, seed=9).abs(), rand(2, H, seed=8).abs()][(case // 2) % 3]
    return H, H_kv, softcap, alibi


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("lengths", LENGTHS)
def test_func_equals_the_reference_with_gradients(causal, window, lengths):
    case = WINDOWS.index(window) + 6 * LENGTHS.index(lengths) + causal
    H, H_kv, softcap, alibi = options(case)
    T_q, T_k = lengths
    q, k, v = (
        rand(2, T_q, H, 8, seed=1),
        rand(2, T_k, H_kv, 8, seed=2),
        rand(2, T_k, H_kv, 6, seed=3),
    )
    kw = dict(causal=causal, window_size=window, softcap=softcap, alibi_slopes=alibi)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = fa.flash_attn_func(*leaves, **kw)
    ref_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    want, _, _ = attention_ref(*ref_leaves, **kw)
    assert out.shape == (2, T_q, H, 6)
    assert (out - want).abs().max() < FLOAT64
    g = rand(*out.shape, seed=4)
    got = torch.autograd.grad((out * g).sum(), leaves)
    ref = torch.autograd.grad((want * g).sum(), ref_leaves)
    for a, b in zip(got, ref):
        assert (a - b).abs().max() < FLOAT64


def test_alibi_slopes_receive_their_gradient():
    q, k, v = rand(2, 6, 4, 8, seed=1), rand(2, 9, 2, 8, seed=2), rand(2, 9, 2, 8, seed=3)
    for slopes in (rand(4, seed=5).abs(), rand(2, 4, seed=6).abs()):
        mine, theirs = slopes.clone().requires_grad_(), slopes.clone().requires_grad_()
        out = fa.flash_attn_func(q, k, v, causal=True, window_size=(3, 0), alibi_slopes=mine)
        want, _, _ = attention_ref(q, k, v, causal=True, window_size=(3, 0), alibi_slopes=theirs)
        (got,) = torch.autograd.grad(out.sum(), mine)
        (ref,) = torch.autograd.grad(want.sum(), theirs)
        assert (got - ref).abs().max() < FLOAT64


def test_packed_forms_equal_the_func_and_reach_the_packed_tensor():
    qkv_ = rand(2, 9, 3, 4, 8, seed=1).requires_grad_()
    out = fa.flash_attn_qkvpacked_func(qkv_, causal=True, window_size=(2, 0), softcap=4.0)
    q, k, v = qkv_.detach().unbind(2)
    assert torch.equal(
        out, fa.flash_attn_func(q, k, v, causal=True, window_size=(2, 0), softcap=4.0)
    )
    out.sum().backward()
    assert qkv_.grad is not None and qkv_.grad[:, :, 1].abs().sum() > 0
    kv = rand(2, 11, 2, 2, 8, seed=2)
    got = fa.flash_attn_kvpacked_func(q, kv, causal=True)
    assert torch.equal(got, fa.flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], causal=True))


def test_return_attn_probs_gives_the_lse_and_the_weights():
    q, k, v = rand(2, 5, 4, 8, seed=1), rand(2, 8, 2, 8, seed=2), rand(2, 8, 2, 8, seed=3)
    out, lse, probs = fa.flash_attn_func(
        q, k, v, causal=True, window_size=(3, 1), softcap=2.0, return_attn_probs=True
    )
    want, want_lse, want_w = attention_ref(q, k, v, causal=True, window_size=(3, 1), softcap=2.0)
    assert lse.shape == (2, 4, 5) and probs.shape == (2, 4, 5, 8)
    assert (lse - want_lse).abs().max() < FLOAT64 and (probs - want_w).abs().max() < FLOAT64
    assert (out - want).abs().max() < FLOAT64


def test_learnable_sinks_equal_the_reference_with_their_gradient():
    q, k, v = rand(2, 6, 4, 8, seed=1), rand(2, 6, 4, 8, seed=2), rand(2, 6, 4, 8, seed=3)
    sinks = rand(4, seed=7)
    mine, theirs = sinks.clone().requires_grad_(), sinks.clone().requires_grad_()
    out = fa.flash_attn_func(q, k, v, causal=True, learnable_sink=mine)
    want, _, _ = attention_ref(q, k, v, causal=True, sinks=theirs)
    assert (out - want).abs().max() < FLOAT64
    (got,) = torch.autograd.grad(out.sum(), mine)
    (ref,) = torch.autograd.grad(want.sum(), theirs)
    assert (got - ref).abs().max() < FLOAT64


def test_dropout_is_reproducible_with_a_generator_and_acts_on_the_weights():
    q, k, v = rand(1, 16, 2, 8, seed=1), rand(1, 16, 2, 8, seed=2), rand(1, 16, 2, 8, seed=3)

    def run(seed):
        g = torch.Generator().manual_seed(seed)
        return fa.flash_attn_func(q, k, v, 0.3, causal=True, generator=g, return_attn_probs=True)

    (a, _, wa), (b, _, wb), (c, _, _) = run(0), run(0), run(1)
    assert torch.equal(a, b) and not torch.equal(a, c)
    # out is the dropped weights times v, kept weights scaled by 1 / (1 − p)
    assert (a - torch.einsum("bhij,bjhd->bihd", wa, v)).abs().max() < FLOAT64
    assert torch.equal(wa, wb) and (wa == 0).sum() > (torch.ones(16, 16).tril() == 0).sum() * 2


def test_low_precision_inputs_run_and_stay_near_the_reference():
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2), (torch.float16, 5e-3)):
        q, k, v = (rand(2, 64, 4, 32, seed=s).to(dtype) for s in (1, 2, 3))
        out = fa.flash_attn_func(q, k, v, causal=True, window_size=(16, 0))
        want, _, _ = attention_ref(q, k, v, causal=True, window_size=(16, 0))
        assert out.dtype == dtype and (out.double() - want).abs().max() < tol


def packed_sequences(lengths_q, lengths_k, H=4, H_kv=2, D=8, seed=0):
    q = rand(sum(lengths_q), H, D, seed=seed)
    k = rand(sum(lengths_k), H_kv, D, seed=seed + 1)
    v = rand(sum(lengths_k), H_kv, D, seed=seed + 2)
    cu = lambda ns: torch.tensor([0, *torch.tensor(ns).cumsum(0).tolist()], dtype=torch.int32)  # noqa: E731
    return q, k, v, cu(lengths_q), cu(lengths_k)


def varlen_ref(q, k, v, cu_q, cu_k, alibi=None, **kw):
    """Each sequence through the reference alone: out (total_q, H, D_v), lse (H, total_q)."""
    outs, lses = [], []
    for s in range(len(cu_q) - 1):
        a, b, c, d = int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s]), int(cu_k[s + 1])
        slopes = None if alibi is None else alibi[s] if alibi.ndim == 2 else alibi
        o, lse, _ = attention_ref(
            q[None, a:b], k[None, c:d], v[None, c:d], alibi_slopes=slopes, **kw
        )
        outs.append(o[0])
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=-1)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [(-1, -1), (2, 0), (1, 3)])
@pytest.mark.parametrize("score", ["plain", "softcap", "alibi per sequence"])
def test_varlen_equals_the_reference_per_sequence_with_gradients(causal, window, score):
    lengths_q, lengths_k = [4, 3, 0, 2, 6], [4, 9, 0, 0, 6]
    q, k, v, cu_q, cu_k = packed_sequences(lengths_q, lengths_k)
    softcap = 2.5 if score == "softcap" else 0.0
    alibi = rand(5, 4, seed=11).abs() if score == "alibi per sequence" else None
    kw = dict(causal=causal, window_size=window, softcap=softcap)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse, probs = fa.flash_attn_varlen_func(
        *leaves, cu_q, cu_k, 6, 9, alibi_slopes=alibi, return_attn_probs=True, **kw
    )
    ref_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    want, want_lse = varlen_ref(*ref_leaves, cu_q, cu_k, alibi=alibi, **kw)
    assert probs is None and lse.shape == (4, sum(lengths_q))
    assert (out - want).abs().max() < FLOAT64
    finite = want_lse.isfinite()
    assert torch.equal(finite, lse.isfinite()) and (lse - want_lse)[finite].abs().max() < FLOAT64
    g = rand(*out.shape, seed=5)
    for a, b in zip(
        torch.autograd.grad((out * g).sum(), leaves),
        torch.autograd.grad((want * g).sum(), ref_leaves),
    ):
        assert (a - b).abs().max() < FLOAT64


def test_varlen_packed_and_paged_forms():
    lengths = [5, 2, 7]
    q, k, v, cu, _ = packed_sequences(lengths, lengths, H=2, H_kv=2)
    want = fa.flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, causal=True)
    qkv_ = torch.stack([q, k, v], dim=1)
    assert torch.equal(fa.flash_attn_varlen_qkvpacked_func(qkv_, cu, 7, causal=True), want)
    kv = torch.stack([k, v], dim=1)
    assert torch.equal(fa.flash_attn_varlen_kvpacked_func(q, kv, cu, cu, 7, 7, causal=True), want)
    # the keys in pages of 3, scattered through a pool, named by a block table
    pool_k, pool_v = (
        torch.zeros(12, 3, 2, 8, dtype=torch.float64),
        torch.zeros(12, 3, 2, 8, dtype=torch.float64),
    )
    table = torch.tensor([[7, 2, 0], [5, 0, 0], [1, 9, 4]])
    for s, n in enumerate(lengths):
        for t in range(n):
            pool_k[table[s, t // 3], t % 3] = k[int(cu[s]) + t]
            pool_v[table[s, t // 3], t % 3] = v[int(cu[s]) + t]
    got = fa.flash_attn_varlen_func(q, pool_k, pool_v, cu, cu, 7, 7, causal=True, block_table=table)
    assert (got - want).abs().max() < FLOAT64


def rotary(seqlen, half, seed=0):
    angles = rand(seqlen, half, seed=seed)
    return angles.cos(), angles.sin()


def rotate_ref(x, cos, sin, positions, interleaved):
    """Rotary embedding written out pair by pair: (x_a, x_b) turned by the angle at p."""
    out = x.clone()
    half = cos.shape[1]
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            c, s = cos[positions[b][t]], sin[positions[b][t]]
            for i in range(half):
                a, bb = (2 * i, 2 * i + 1) if interleaved else (i, i + half)
                xa, xb = x[b, t, :, a], x[b, t, :, bb]
                out[b, t, :, a], out[b, t, :, bb] = xa * c[i] - xb * s[i], xa * s[i] + xb * c[i]
    return out


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("T_q", [1, 3])
@pytest.mark.parametrize(
    "causal,window", [(True, (-1, -1)), (True, (3, 0)), (False, (-1, -1)), (False, (2, 1))]
)
@pytest.mark.parametrize("interleaved", [True, False])
def test_kvcache_appends_rotates_and_attends_as_the_reference(
    paged, T_q, causal, window, interleaved
):
    B, S, H, H_kv, D = 3, 12, 4, 2, 8
    cache_k, cache_v = rand(4, S, H_kv, D, seed=1), rand(4, S, H_kv, D, seed=2)
    seqlens = torch.tensor([5, 0, 8], dtype=torch.int32)
    leftpad = torch.tensor([2, 0, 0], dtype=torch.int32)
    batch_idx = torch.tensor([2, 0, 3])
    q, k, v = (
        rand(B, T_q, H, D, seed=3),
        rand(B, T_q, H_kv, D, seed=4),
        rand(B, T_q, H_kv, D, seed=5),
    )
    cos, sin = rotary(20, 3, seed=6)
    # what each sequence holds before the step, slot by slot
    before_k, before_v = cache_k[batch_idx].clone(), cache_v[batch_idx].clone()
    kw = dict(causal=causal, window_size=window, softcap=1.5, alibi_slopes=rand(B, H, seed=7).abs())
    if paged:  # the same slots in pages of 4, scattered through a pool
        P, pool = 4, 16
        table = torch.randperm(pool, generator=torch.Generator().manual_seed(0))[: B * 3].view(B, 3)
        k_cache = torch.zeros(pool, P, H_kv, D, dtype=torch.float64)
        v_cache = torch.zeros_like(k_cache)
        for b in range(B):
            k_cache[table[b]] = before_k[b].view(3, P, H_kv, D)
            v_cache[table[b]] = before_v[b].view(3, P, H_kv, D)
        call = dict(block_table=table)
    else:
        k_cache, v_cache, call = cache_k.clone(), cache_v.clone(), dict(cache_batch_idx=batch_idx)
    out, lse = fa.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, cos, sin, cache_seqlens=seqlens, cache_leftpad=leftpad,
        rotary_interleaved=interleaved, return_softmax_lse=True, num_splits=4, **call, **kw,
    )  # fmt: skip
    for b in range(B):
        n, lp = int(seqlens[b]), int(leftpad[b])
        first = n - lp
        k_pos = [[first + t for t in range(T_q)]]
        q_pos = k_pos if (causal or window != (-1, -1)) else [[first] * T_q]
        k_new = rotate_ref(k[b : b + 1], cos, sin, k_pos, interleaved)
        q_rot = rotate_ref(q[b : b + 1], cos, sin, q_pos, interleaved)
        keys = torch.cat([before_k[b, lp:n], k_new[0]])[None]
        values = torch.cat([before_v[b, lp:n], v[b]])[None]
        slopes = kw["alibi_slopes"][b]
        want, want_lse, _ = attention_ref(q_rot, keys, values, **{**kw, "alibi_slopes": slopes})
        assert (out[b] - want[0]).abs().max() < FLOAT64, b
        assert (lse[b] - want_lse[0]).abs().max() < FLOAT64, b
        # the new keys and values were written in place at slots n .. n + T_q − 1
        if paged:
            slots = [(int(table[b, t // 4]), t % 4) for t in range(n, n + T_q)]
            written = torch.stack([k_cache[p, o] for p, o in slots])
        else:
            written = k_cache[batch_idx[b], n : n + T_q]
        assert (written - k_new[0]).abs().max() < FLOAT64


def test_a_decode_step_reads_pages_in_place_and_equals_the_gathered_path():
    """float32, one query, no window: qkv's paged kernel (native where built) is what runs;
    equal to the general path to rounding."""
    B, S, H, H_kv, D = 3, 40, 8, 2, 64
    g = torch.Generator().manual_seed(0)
    k_cache, v_cache = (
        torch.randn(B, S, H_kv, D, generator=g),
        torch.randn(B, S, H_kv, D, generator=g),
    )
    q = torch.randn(B, 1, H, D, generator=g)
    seqlens = torch.tensor([17, 0, 39], dtype=torch.int32)
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, causal=True)
    for b in range(B):
        n = int(seqlens[b])
        want, _, _ = attention_ref(
            q[b : b + 1], k_cache[b : b + 1, :n], v_cache[b : b + 1, :n], causal=True
        )
        assert (out[b].double() - want[0]).abs().max() < 1e-5


def r(*shape):
    return rand(*shape)


def kvcache(**kw):
    """A 2-sequence cache of 6 slots, H = H_kv = 2, D = 8, with kw changed."""
    args = dict(q=r(2, 1, 2, 8), k_cache=r(2, 6, 2, 8), v_cache=r(2, 6, 2, 8), cache_seqlens=1)
    return lambda: fa.flash_attn_with_kvcache(**{**args, **kw})


def pages(**kw):
    """4 pages of 2 slots for 2 sequences, with kw changed."""
    return kvcache(k_cache=r(4, 2, 2, 8), v_cache=r(4, 2, 2, 8), **kw)


BAD = {
    "3-d q": (
        lambda: fa.flash_attn_func(r(2, 4, 8), r(2, 4, 8), r(2, 4, 8)),
        r"q must have shape \(B, T_q, H, D\)",
    ),
    "heads do not divide": (
        lambda: fa.flash_attn_func(r(1, 4, 6, 8), r(1, 4, 4, 8), r(1, 4, 4, 8)),
        "dividing q's H = 6",
    ),
    "k and v heads differ": (
        lambda: fa.flash_attn_func(r(1, 4, 4, 8), r(1, 4, 2, 8), r(1, 4, 1, 8)),
        "H_kv = 2 for k and 1 for v",
    ),
    "window not a pair": (
        lambda: fa.flash_attn_func(*[r(1, 4, 2, 8)] * 3, window_size=4),
        "window_size must be",
    ),
    "negative softcap": (
        lambda: fa.flash_attn_func(*[r(1, 4, 2, 8)] * 3, softcap=-1.0),
        "softcap must be",
    ),
    "qkv unpacked": (
        lambda: fa.flash_attn_qkvpacked_func(r(1, 4, 2, 2, 8)),
        r"qkv must have shape \(B, T, 3, H, D\)",
    ),
    "seqlens past the cache": (
        kvcache(k=r(2, 2, 2, 8), v=r(2, 2, 2, 8), cache_seqlens=5),
        "must fit the cache's 6 slots",
    ),
    "block table too short": (
        pages(cache_seqlens=torch.tensor([3, 1]), block_table=torch.tensor([[0], [1]])),
        "must fit the cache's 2 slots",
    ),
    "page outside the pool": (
        pages(cache_seqlens=torch.tensor([3, 1]), block_table=torch.tensor([[0, 9], [1, 2]])),
        "block_table names a page outside",
    ),
    "seqlens of the wrong size": (
        kvcache(cache_seqlens=torch.tensor([3])),
        r"cache_seqlens must be an int or \(B,\)",
    ),
    "k without v": (kvcache(k=r(2, 1, 2, 8)), "give both or neither"),
    "rotary too short": (
        kvcache(cache_seqlens=5, rotary_cos=r(4, 2), rotary_sin=r(4, 2)),
        "this step needs position",
    ),
    "batch index with pages": (
        pages(block_table=torch.tensor([[0], [1]]), cache_batch_idx=torch.tensor([0, 1])),
        "cache_batch_idx applies",
    ),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_refused_naming_the_argument(case):
    call, match = BAD[case]
    with pytest.raises(ValueError, match=match):
        call()


def test_install_makes_import_flash_attn_resolve_to_qkv():
    assert "flash_attn" not in sys.modules
    fa.install()
    try:
        import flash_attn
        from flash_attn import flash_attn_func, flash_attn_with_kvcache  # noqa: F401
        from flash_attn.flash_attn_interface import flash_attn_varlen_func

        assert flash_attn is qkv.flash_attn and flash_attn_func is fa.flash_attn_func
        assert flash_attn_varlen_func is fa.flash_attn_varlen_func
        fa.install()  # twice is once
    finally:
        fa.uninstall()
    assert "flash_attn" not in sys.modules and "flash_attn.flash_attn_interface" not in sys.modules


def test_install_warns_when_a_real_flash_attn_is_imported_and_uninstall_restores_it():
    real = types.ModuleType("flash_attn")
    sys.modules["flash_attn"] = real
    try:
        with pytest.warns(UserWarning, match="already imported"):
            fa.install()
        assert sys.modules["flash_attn"] is qkv.flash_attn
        fa.uninstall()
        assert sys.modules["flash_attn"] is real
    finally:
        sys.modules.pop("flash_attn", None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fa.install()  # nothing there: no warning
        fa.uninstall()
