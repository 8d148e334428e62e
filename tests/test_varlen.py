"""qkv.varlen_attention: packed sequences of different lengths, each equal to attending it
alone (the NumPy float64 oracle on that sequence), forward and backward, on every backend
that can take it; torch's varlen_attn conventions; bad offsets get clear errors."""

import numpy as np
import pytest
import torch
from torch.nn.attention.varlen import AuxRequest

import qkv
from tests.helpers import oracle

# Query and key lengths per sequence: equal, shorter queries (a chunk after a cache), an
# empty sequence, a sequence with queries but no key, one token.
LENGTHS_Q = [7, 3, 0, 2, 1, 13]
LENGTHS_K = [7, 11, 0, 0, 1, 13]


def packed(lengths_q, lengths_k, H=4, H_kv=2, D=8, D_v=5, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lengths_q), H, D, generator=g, dtype=dtype)
    k = torch.randn(sum(lengths_k), H_kv, D, generator=g, dtype=dtype)
    v = torch.randn(sum(lengths_k), H_kv, D_v, generator=g, dtype=dtype)
    cu = lambda ns: torch.tensor([0, *np.cumsum(ns)], dtype=torch.int32)  # noqa: E731
    return q, k, v, cu(lengths_q), cu(lengths_k)


def alone(q, k, v, cu_q, cu_k, s, **kw):
    """Sequence s attended alone by the oracle: (len_q, H, D_v) and (len_q, H)."""
    a, b, c, d = int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s]), int(cu_k[s + 1])
    if d == c:  # no key: out 0, lse -inf
        return np.zeros((b - a, q.shape[1], v.shape[2])), np.full((b - a, q.shape[1]), -np.inf)
    out, lse = oracle(
        q[a:b].transpose(0, 1)[None],
        k[c:d].transpose(0, 1)[None],
        v[c:d].transpose(0, 1)[None],
        return_lse=True,
        **kw,
    )
    return out[0].transpose(1, 0, 2), lse[0].T


WINDOWS = {
    (-1, -1): None,
    (-1, 0): qkv.masks.causal(),
    (2, 0): qkv.masks.sliding_window(3),
    (1, 1): qkv.masks.predicate(lambda b, h, q, kv: (kv >= q - 1) & (kv <= q + 1), "band"),
    (-1, 2): qkv.masks.predicate(lambda b, h, q, kv: kv <= q + 2, "ahead"),
    (2, -1): qkv.masks.predicate(lambda b, h, q, kv: kv >= q - 2, "behind"),
}


@pytest.mark.parametrize("backend", ["reference", "sdpa", "tiled", "auto"])
@pytest.mark.parametrize("window", list(WINDOWS))
def test_each_sequence_equals_attending_it_alone(backend, window):
    q, k, v, cu_q, cu_k = packed(LENGTHS_Q, LENGTHS_K)
    aux = None if backend == "sdpa" else AuxRequest(lse=True)  # torch's kernel: no lse
    result = qkv.varlen_attention(
        q,
        k,
        v,
        cu_q,
        cu_k,
        max(LENGTHS_Q),
        max(LENGTHS_K),
        window_size=window,
        enable_gqa=True,
        return_aux=aux,
        backend=backend,
    )
    out, lse = result if aux else (result, None)
    assert out.shape == (sum(LENGTHS_Q), 4, 5)
    for s in range(len(LENGTHS_Q)):
        want, want_lse = alone(q, k, v, cu_q, cu_k, s, mask=WINDOWS[window])
        a, b = int(cu_q[s]), int(cu_q[s + 1])
        np.testing.assert_allclose(out[a:b].numpy(), want, atol=1e-12, err_msg=str(s))
        if lse is not None:
            np.testing.assert_allclose(lse[a:b].numpy(), want_lse, atol=1e-12, err_msg=str(s))


@pytest.mark.parametrize("backend", ["reference", "tiled", "auto"])
def test_gradients_equal_attending_each_sequence_alone(backend):
    q, k, v, cu_q, cu_k = packed(LENGTHS_Q, LENGTHS_K)
    g = torch.randn(sum(LENGTHS_Q), 4, 5, generator=torch.Generator().manual_seed(3))
    g = g.double()
    xs = [x.clone().requires_grad_() for x in (q, k, v)]
    out = qkv.varlen_attention(
        *xs, cu_q, cu_k, 13, 13, window_size=(-1, 0), enable_gqa=True, backend=backend
    )
    got = torch.autograd.grad((out * g).sum(), xs)
    ys = [x.clone().requires_grad_() for x in (q, k, v)]
    parts = []
    for s in range(len(LENGTHS_Q)):
        a, b, c, d = (int(x) for x in (cu_q[s], cu_q[s + 1], cu_k[s], cu_k[s + 1]))
        one = qkv.attention(
            *(y[r0:r1].transpose(0, 1)[None] for y, (r0, r1) in zip(ys, [(a, b), (c, d), (c, d)])),
            mask=qkv.masks.causal(),
            backend="reference",
        )
        parts.append(one[0].transpose(0, 1))
    want = torch.autograd.grad((torch.cat(parts) * g).sum(), ys)
    for name, x, y in zip("qkv", got, want):
        assert (x - y).abs().max() < 1e-10, name


def test_self_attention_defaults_and_score_modifications_within_each_sequence():
    lengths = [5, 9, 4]
    q, k, v, cu, _ = packed(lengths, lengths, H=2, H_kv=2, D_v=8)
    mod = qkv.scores.alibi(qkv.scores.alibi_slopes(2))
    sinks = torch.tensor([0.5, -1.0], dtype=torch.float64)
    out = qkv.varlen_attention(
        q, k, v, cu, None, 9, 9, window_size=(-1, 0), score_mod=mod, sinks=sinks
    )
    for s in range(3):
        want, _ = alone(
            q, k, v, cu, cu, s, mask=qkv.masks.causal(), score_mod=mod, sinks=sinks.numpy()
        )
        a, b = int(cu[s]), int(cu[s + 1])
        np.testing.assert_allclose(out[a:b].numpy(), want, atol=1e-12)


def test_seqused_k_keeps_only_the_first_keys_of_each_sequence():
    q, k, v, cu_q, cu_k = packed([2, 3], [6, 8], H=2, H_kv=2)
    used = torch.tensor([4, 8])
    out = qkv.varlen_attention(q, k, v, cu_q, cu_k, 3, 8, seqused_k=used)
    shorter = torch.cat([k[:4], k[6:]]), torch.cat([v[:4], v[6:]])
    want = qkv.varlen_attention(q, *shorter, cu_q, torch.tensor([0, 4, 12]), 3, 8)
    assert torch.equal(out, want)


def test_results_do_not_depend_on_the_other_sequences():
    """Batch-invariant: a sequence's output is bit-identical whatever it is packed with."""
    q, k, v, cu, _ = packed([9, 30], [9, 30], H=2, H_kv=2)
    both = qkv.varlen_attention(q, k, v, cu, cu, 30, 30, window_size=(-1, 0))
    first = qkv.varlen_attention(q[:9], k[:9], v[:9], cu[:2], cu[:2], 9, 9, window_size=(-1, 0))
    assert torch.equal(both[:9], first)


@pytest.mark.parametrize(
    "cu_q, max_q, match",
    [
        (torch.tensor([1, 3, 5]), 5, "must start at 0"),
        (torch.tensor([0, 4, 3, 5]), 5, "never decrease"),
        (torch.tensor([0, 2, 4]), 5, "end at the packed length 5"),
        (torch.tensor([0, 1, 5]), 3, "sequence 1 has 4 tokens in cu_seq_q, more than max_q=3"),
        (torch.tensor([0.0, 5.0]), 5, "1-d integer tensor"),
    ],
)
def test_bad_offsets_are_refused(cu_q, max_q, match):
    x = torch.randn(5, 2, 4)
    with pytest.raises((ValueError, TypeError), match=match):
        qkv.varlen_attention(x, x, x, cu_q, None, max_q, 5)


def test_bad_calls_are_refused():
    x, kv = torch.randn(5, 4, 8), torch.randn(5, 2, 8)
    cu = torch.tensor([0, 5])
    with pytest.raises(ValueError, match="enable_gqa=True"):
        qkv.varlen_attention(x, kv, kv, cu, cu, 5, 5)
    with pytest.raises(ValueError, match="seqused_k and cu_seq_k=None"):
        qkv.varlen_attention(
            x, x, x, cu, cu, 5, 5, block_table=torch.zeros(1, 1, dtype=torch.int32)
        )
    with pytest.raises(ValueError, match="same number of sequences"):
        qkv.varlen_attention(x, x, x, cu, torch.tensor([0, 2, 5]), 5, 5)
    with pytest.raises(ValueError, match="packed"):
        qkv.varlen_attention(x[0], x, x, cu, cu, 5, 5)
    with pytest.raises(ValueError, match="window_size"):
        qkv.varlen_attention(x, x, x, cu, cu, 5, 5, window_size=(-2, 0))
    with pytest.raises(ValueError, match="seqused_k"):
        qkv.varlen_attention(x, x, x, cu, cu, 5, 5, seqused_k=torch.tensor([6]))
    pages, q = torch.randn(4, 4, 4, 8), torch.randn(4, 4, 8)  # a prefill chunk: gathered
    two = dict(cu_seq_k=None, max_q=2, max_k=4, block_table=torch.tensor([[0], [7]]))
    with pytest.raises(ValueError, match="seqused_k must be 0 .. max_pages · page_size = 4"):
        qkv.varlen_attention(
            q, pages, pages, torch.tensor([0, 2, 4]), **two, seqused_k=torch.tensor([3, 9])
        )
    with pytest.raises(ValueError, match="names a page outside the pool's 4"):
        qkv.varlen_attention(
            q, pages, pages, torch.tensor([0, 2, 4]), **two, seqused_k=torch.tensor([3, 2])
        )


def test_a_block_table_of_pages_equals_the_packed_keys():
    """torch's paged form: keys in a pool of pages in any order, a block table per
    sequence, seqused_k; equal to the same keys packed."""
    lengths_q, lengths_k, P = [2, 1, 3], [9, 4, 7], 4
    q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k, H=2, H_kv=2)
    order = torch.randperm(12, generator=torch.Generator().manual_seed(0))  # pages, shuffled
    pool_k, pool_v = (
        torch.zeros(12, P, 2, 8, dtype=torch.float64),
        torch.zeros(12, P, 2, 5).double(),
    )
    table = torch.zeros(3, 3, dtype=torch.int32)
    used = 0
    for s, n in enumerate(lengths_k):
        a = int(cu_k[s])
        for j in range(-(-n // P)):
            page = int(order[used])
            used += 1
            table[s, j] = page
            part = slice(a + j * P, min(a + (j + 1) * P, a + n))
            pool_k[page, : part.stop - part.start] = k[part]
            pool_v[page, : part.stop - part.start] = v[part]
    want = qkv.varlen_attention(q, k, v, cu_q, cu_k, 3, 9, window_size=(-1, 0))
    got = qkv.varlen_attention(
        q,
        pool_k,
        pool_v,
        cu_q,
        None,
        3,
        9,
        window_size=(-1, 0),
        block_table=table,
        seqused_k=torch.tensor(lengths_k),
    )
    assert torch.equal(got, want)
