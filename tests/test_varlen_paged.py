"""qkv.paged_attention: a decode step over pages read in place (the native kernel) equals the
float64 oracle on each sequence's keys, and equals the gather path, for float32 and bfloat16,
GQA/MQA, odd sizes, D_v != D, sinks, empty sequences, pages in any order; bad tables are
errors; the result does not depend on the thread count."""

import os

import numpy as np
import pytest
import torch

import qkv
from qkv.kernels import paged
from tests.helpers import oracle
from tests.tolerances import LOW_PRECISION

if os.environ.get("QKV_REQUIRE_NATIVE") and not paged.available():  # CI: it must build
    raise RuntimeError("QKV_REQUIRE_NATIVE is set, but the native paged kernel was not built")
native = pytest.mark.skipif(not paged.available(), reason="native paged kernel not built")


def problem(B=5, H=6, H_kv=2, D=24, D_v=24, P=4, lengths=(0, 1, 4, 9, 13), seed=0, layout="torch"):
    """Random pages and a block table that scatters each sequence over the pool; the
    padding entries of the table are -1 (never read)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // P) for n in lengths]
    num_pages = sum(need) + 3
    order = torch.randperm(num_pages, generator=g).tolist()
    table = torch.full((B, max(need) + 1), -1, dtype=torch.long)
    for b, n in enumerate(need):
        table[b, :n] = torch.tensor(order[:n])
        order = order[n:]
    if layout == "torch":  # (pages, P, H_kv, ·)
        k = torch.randn(num_pages, P, H_kv, D, generator=g, dtype=torch.float64)
        v = torch.randn(num_pages, P, H_kv, D_v, generator=g, dtype=torch.float64)
    else:  # qkv's pool (H_kv, pages, P, ·), read through a permuted view
        k = torch.randn(H_kv, num_pages, P, D, generator=g, dtype=torch.float64)
        v = torch.randn(H_kv, num_pages, P, D_v, generator=g, dtype=torch.float64)
        k, v = k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)
    q = torch.randn(B, H, D, generator=g, dtype=torch.float64)
    return q, k, v, table, torch.tensor(lengths)


def expected(q, k, v, table, lengths, **kw):
    """Each sequence alone: its pages' tokens in order, through the float64 oracle."""
    outs, lses = [], []
    P = k.shape[1]
    for b, n in enumerate(lengths.tolist()):
        pages = table[b, : -(-n // P)]
        ks = k[pages].reshape(-1, *k.shape[2:])[:n].transpose(0, 1)[None]  # (1, H_kv, n, D)
        vs = v[pages].reshape(-1, *v.shape[2:])[:n].transpose(0, 1)[None]
        out, lse = oracle(q[b : b + 1, :, None], ks, vs, return_lse=True, **kw)
        outs.append(out[0, :, 0])
        lses.append(lse[0, :, 0])
    return np.stack(outs), np.stack(lses)


@native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "shape",
    [
        dict(H=6, H_kv=2, D=24, D_v=24, P=4),  # GQA, odd-ish D
        dict(H=4, H_kv=1, D=7, D_v=5, P=3),  # MQA, odd D, D_v != D, odd page
        dict(H=8, H_kv=2, D=32, D_v=16, P=5, lengths=(40, 3, 0, 18, 21)),  # vector path, GQA
        dict(H=32, H_kv=2, D=32, D_v=32, P=4),  # 16 query heads a key/value head: wide path
        dict(H=20, H_kv=1, D=16, D_v=48, P=7, lengths=(30, 2, 0, 7, 8)),  # wide, a tail of 4
        dict(H=3, H_kv=3, D=64, D_v=64, P=16, lengths=(17, 64, 1, 100, 33)),
        # in torch's layout an item takes several key/value heads: all 4 (12 sequences), or
        # 2 of them on 2 threads (6 sequences)
        dict(B=12, H=8, H_kv=4, D=32, D_v=48, P=5, lengths=(9, 0, 31, 5, 12, 40, 1) + (7,) * 5),
        dict(B=6, H=8, H_kv=4, D=32, D_v=32, P=4, lengths=(9, 0, 31, 5, 12, 40)),
        # pages longer than the vector item takes at a time (PAGE_PART, 256 keys): each in
        # parts of 256, 256 and 88, the last page cut short, a fold (2,048 keys) mid-page
        dict(B=3, H=8, H_kv=2, D=32, D_v=48, P=600, lengths=(599, 2500, 0)),
    ],
)
@pytest.mark.parametrize("layout", ["torch", "qkv"])
@pytest.mark.parametrize("isa", ["", "avx2"])
def test_native_equals_the_oracle(dtype, shape, layout, isa):
    """Plain C for head dims off 16, the vector item (AVX-512, or AVX2 pinned) on them."""
    if isa and isa not in paged.isas():
        pytest.skip(f"this CPU has no {isa}")
    with paged.use_isa(isa):
        q, k, v, table, lengths = problem(**shape, layout=layout)
        q_, k_, v_ = (x.to(dtype) for x in (q, k, v))
        assert paged.supports(q_, k_, v_)
        out, lse = qkv.paged_attention(q_, k_, v_, table, lengths, return_lse=True)
    # the oracle on the same rounded inputs: only the kernel's own rounding is left
    want, want_lse = expected(q_, k_, v_, table, lengths)
    assert out.dtype == dtype and out.shape == want.shape
    tol = LOW_PRECISION[dtype] if dtype != torch.float32 else 1e-5
    np.testing.assert_allclose(out.double().numpy(), want, atol=tol)
    np.testing.assert_allclose(lse.double().numpy(), want_lse, atol=1e-5)
    empty = lengths == 0
    assert (out[empty] == 0).all() and (lse[empty] == float("-inf")).all()


@native
@pytest.mark.parametrize("isa", ["", "avx2"])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(
    "G, D", [(4, 64), (16, 64), (4, 40)], ids=["vector-item", "many-heads-item", "plain-c-item"]
)
def test_a_long_context_keeps_float32_accuracy(isa, seed, G, D):
    """65,536 keys, with each item (the vector item; AVX-512's for 16 query heads or more
    per key/value head; the plain C one, for head dims off the vectors): an item sums a
    stretch of about 2,048 keys apart (512 in plain C), page by page, and folds it into its
    totals. Error against float64 in units of float32's epsilon times the largest output,
    1.9–5.0 over the three items; with the pages summed into one sum 15–26 (the plain C
    item's key by key 56–94), torch's SDPA 44–63 on the same problem (torch 2.13, this
    CPU)."""
    if isa and isa not in paged.isas():
        pytest.skip(f"this CPU has no {isa}")
    L, P = 65536, 16
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(L // P, P, 1, D, generator=g) for _ in range(2))
    q = torch.randn(1, G, D, generator=g)
    table, lengths = torch.arange(L // P)[None], torch.tensor([L])
    with paged.use_isa(isa):
        out = qkv.paged_attention(q, k, v, table, lengths)
    want, _ = expected(q.double(), k.double(), v.double(), table, lengths)
    error = np.abs(out.double().numpy() - want).max() / np.abs(want).max()
    assert error < 10 * torch.finfo(torch.float32).eps, error


@native
def test_native_equals_the_gather_path_and_takes_sinks():
    q, k, v, table, lengths = problem()
    q, k, v = (x.float() for x in (q, k, v))
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0, -3.0, 1.0])
    out, lse = qkv.paged_attention(q, k, v, table, lengths, sinks=sinks, return_lse=True)
    with qkv.heads.record():  # a record block takes the gather path (qkv.attention)
        ref, ref_lse = qkv.paged_attention(q, k, v, table, lengths, sinks=sinks, return_lse=True)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-6, rtol=0)
    want, want_lse = expected(q, k, v, table, lengths, sinks=sinks.double().numpy())
    np.testing.assert_allclose(out.double().numpy(), want, atol=1e-5)
    np.testing.assert_allclose(lse.double().numpy(), want_lse, atol=1e-5)
    assert lse[0].tolist() == sinks.tolist()  # the empty sequence: lse is the sink


def test_float64_and_gradients_take_the_gather_path():
    q, k, v, table, lengths = problem()
    want, _ = expected(q, k, v, table, lengths)
    out = qkv.paged_attention(q, k, v, table, lengths)  # float64: no native kernel
    np.testing.assert_allclose(out.numpy(), want, atol=1e-10)
    q.requires_grad_()
    out = qkv.paged_attention(q.float(), k.float(), v.float(), table, lengths)
    out.sum().backward()
    assert q.grad is not None and q.grad[lengths > 0].abs().sum() > 0


@native
@pytest.mark.parametrize("H", [6, 48])  # 3 and 24 query heads a key/value head
def test_a_nan_key_reaches_its_own_sequence_only(H):
    q, k, v, table, lengths = problem(H=H, D=32, D_v=32)
    q, k, v = (x.float() for x in (q, k, v))
    k[table[3, 1], 0, 0, 0] = float("nan")  # sequence 3's 5th token, kv head 0
    out = qkv.paged_attention(q, k, v, table, lengths)
    G = H // 2
    assert out[3, :G].isnan().all()  # the query heads of kv head 0
    assert not out[3, G:].isnan().any() and not out[[0, 1, 2, 4]].isnan().any()


@native
def test_same_bits_whatever_the_thread_count():
    q, k, v, table, lengths = problem(B=9, lengths=(5, 30, 2, 17, 40, 3, 8, 0, 21))
    q, k, v = (x.float() for x in (q, k, v))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = qkv.paged_attention(q, k, v, table, lengths)
        torch.set_num_threads(2)
        two = qkv.paged_attention(q, k, v, table, lengths)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_varlen_with_a_block_table_and_one_query_each_is_paged_attention():
    q, k, v, table, lengths = problem()
    q, k, v = (x.float() for x in (q, k, v))
    cu = torch.arange(6)
    out, lse = qkv.varlen_attention(
        q,
        k,
        v,
        cu,
        None,
        1,
        13,
        seqused_k=lengths,
        block_table=table.clamp(min=0),
        enable_gqa=True,
        return_aux=type("Aux", (), {"lse": True})(),
    )
    ref, ref_lse = qkv.paged_attention(q, k, v, table, lengths, return_lse=True)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, ref_lse)
    with pytest.raises(ValueError, match="enable_gqa"):
        qkv.varlen_attention(q, k, v, cu, None, 1, 13, seqused_k=lengths, block_table=table)


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda a: {**a, "lengths": torch.tensor([0, 1, 4, 9, 99])}, "lengths must be 0 .. max"),
        (lambda a: {**a, "lengths": torch.tensor([0, 1, 4, 9])}, r"lengths must be \(B,\)"),
        (lambda a: {**a, "block_table": a["block_table"].float()}, "block_table must be"),
        (lambda a: {**a, "block_table": a["block_table"].clamp(max=2) * 50}, "outside the pool"),
        (lambda a: {**a, "block_table": torch.full((5, 5), -1)}, "outside the pool"),
        (lambda a: {**a, "query": a["query"][:, :5]}, "H_kv dividing H"),
        (lambda a: {**a, "query": a["query"][:, :, None]}, r"query must be \(B, H, D\)"),
        (lambda a: {**a, "value_pages": a["value_pages"][:, :2]}, "value_pages"),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])  # the gather path, the kernel
def test_bad_inputs_are_clear_errors(change, match, dtype):
    q, k, v, table, lengths = problem()
    q, k, v = (x.to(dtype) for x in (q, k, v))
    args = dict(query=q, key_pages=k, value_pages=v, block_table=table, lengths=lengths)
    with pytest.raises(ValueError, match=match):
        qkv.paged_attention(**change(args))
