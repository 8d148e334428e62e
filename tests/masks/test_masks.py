"""Masks: exact dense lowering, algebra laws, alignment, pictures and bad arguments."""

import itertools
import re

import numpy as np
import pytest
import torch

from qkv import masks

SIZES = [(1, 1), (4, 4), (3, 7), (7, 3), (17, 17)]


def loop_lowering(fn, B, H, T_q, T_k, q_offset):
    """The predicate evaluated one position at a time: the definition of dense()."""
    out = np.zeros((B, H, T_q, T_k), dtype=bool)
    for b, h, i, j in itertools.product(range(B), range(H), range(T_q), range(T_k)):
        out[b, h, i, j] = fn(b, h, q_offset + i, j)
    return out


DEFINITIONS = {
    "full": (masks.full(), lambda b, h, q, kv: True),
    "causal": (masks.causal(), lambda b, h, q, kv: kv <= q),
    "sliding_window": (masks.sliding_window(3), lambda b, h, q, kv: q - 3 < kv <= q),
    "padding": (masks.padding([1, 0]), lambda b, h, q, kv: kv < [1, 0][b]),
    "prefix_lm": (masks.prefix_lm(2), lambda b, h, q, kv: kv <= q or kv < 2),
}


@pytest.mark.parametrize("name", DEFINITIONS)
@pytest.mark.parametrize("T_q,T_k", SIZES)
def test_dense_matches_definition(name, T_q, T_k):
    mask, fn = DEFINITIONS[name]
    B, H = 2, 3
    want = loop_lowering(fn, B, H, T_q, T_k, T_k - T_q)
    np.testing.assert_array_equal(mask.to_numpy(B, H, T_q, T_k), want)
    np.testing.assert_array_equal(mask.dense(B, H, T_q, T_k).numpy(), want)


@pytest.mark.parametrize("T_q,T_k", [(4, 4), (2, 6), (6, 6)])
def test_document_matches_definition(T_q, T_k):
    ids = np.array([0, 0, 1, 1, 1, 2][:T_k])
    want = loop_lowering(
        lambda b, h, q, kv: 0 <= q < T_k and ids[q] == ids[kv], 1, 1, T_q, T_k, T_k - T_q
    )
    np.testing.assert_array_equal(masks.document(ids).to_numpy(1, 1, T_q, T_k), want)


def test_document_queries_before_the_first_key_see_nothing():
    # T_q > T_k with bottom-right alignment puts the first queries at negative positions.
    dense = masks.document([0, 1]).to_numpy(1, 1, 4, 2)[0, 0]
    np.testing.assert_array_equal(dense, [[0, 0], [0, 0], [1, 0], [0, 1]])


def test_batched_document_ids():
    ids = np.array([[0, 0, 1], [0, 1, 1]])
    dense = masks.document(ids).to_numpy(2, 1, 3, 3)
    np.testing.assert_array_equal(dense[0, 0], [[1, 1, 0], [1, 1, 0], [0, 0, 1]])
    np.testing.assert_array_equal(dense[1, 0], [[1, 0, 0], [0, 1, 1], [0, 1, 1]])


def test_default_alignment_is_bottom_right():
    # T_q = 2 queries against T_k = 5 keys sit at positions 3 and 4.
    np.testing.assert_array_equal(
        masks.causal().to_numpy(1, 1, 2, 5)[0, 0], [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    )
    np.testing.assert_array_equal(
        masks.causal().to_numpy(1, 1, 2, 5, q_offset=0)[0, 0], [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0]]
    )
    # T_q > T_k: the first queries have no key at all.
    np.testing.assert_array_equal(
        masks.causal().to_numpy(1, 1, 3, 2)[0, 0], [[0, 0], [1, 0], [1, 1]]
    )


def dense(m, T=9, B=2, H=2):
    return m.to_numpy(B, H, T, T)


@pytest.mark.parametrize(
    "m",
    [
        masks.causal(),
        masks.sliding_window(2),
        masks.prefix_lm(3),
        masks.padding([4, 9]),
        masks.document([0, 0, 0, 1, 1, 2, 2, 2, 2]),
    ],
)
def test_algebra_laws(m):
    full, causal = masks.full(), masks.causal()
    np.testing.assert_array_equal(dense(m & full), dense(m))
    np.testing.assert_array_equal(dense(m | ~m), dense(full))
    np.testing.assert_array_equal(dense(m & ~m), ~dense(full))
    np.testing.assert_array_equal(dense(~~m), dense(m))
    np.testing.assert_array_equal(dense(m & causal), dense(causal & m))
    np.testing.assert_array_equal(dense(~(m & causal)), dense(~m | ~causal))  # De Morgan


def test_named_identities():
    np.testing.assert_array_equal(dense(masks.causal() & masks.full()), dense(masks.causal()))
    np.testing.assert_array_equal(dense(masks.sliding_window(9)), dense(masks.causal()))
    np.testing.assert_array_equal(
        dense(masks.sliding_window(1)), np.broadcast_to(np.eye(9, dtype=bool), (2, 2, 9, 9))
    )
    np.testing.assert_array_equal(dense(masks.prefix_lm(0)), dense(masks.causal()))
    np.testing.assert_array_equal(dense(masks.prefix_lm(9)), dense(masks.full()))
    np.testing.assert_array_equal(dense(masks.padding([9, 9])), dense(masks.full()))
    np.testing.assert_array_equal(dense(masks.document([0] * 9)), dense(masks.full()))


def test_dense_is_a_broadcast_view():
    d = masks.causal().dense(8, 16, 64, 64)
    assert d.shape == (8, 16, 64, 64) and d.dtype == torch.bool
    assert d.stride()[:2] == (0, 0)  # no copy over B and H


def test_repr_and_picture():
    m = (masks.causal() | masks.prefix_lm(2)) & ~masks.padding([3])
    assert repr(m) == "(causal() | prefix_lm(2)) & ~padding([3])"
    assert repr(~(masks.causal() & masks.full())) == "~(causal() & full())"
    assert repr(masks.document(np.arange(100))) == "document([ 0,  1,  2, ..., 97, 98, 99])"
    assert masks.sliding_window(2).picture(3) == "█ · ·\n█ █ ·\n· █ █"
    assert masks.causal().picture(2, 3) == "█ █ ·\n█ █ █"


@pytest.mark.parametrize(
    "make,exc,words",
    [
        (lambda: masks.sliding_window(-1), ValueError, "window must be >= 1; got -1"),
        (lambda: masks.sliding_window(0), ValueError, "window must be >= 1; got 0"),
        (lambda: masks.sliding_window(2.5), TypeError, "window must be an int; got float"),
        (lambda: masks.prefix_lm(-2), ValueError, "prefix must be >= 0; got -2"),
        (lambda: masks.padding([3, -1]), ValueError, "lengths must be >= 0"),
        (lambda: masks.padding([[1, 2]]), TypeError, "lengths must be integers of 1 dims"),
        (lambda: masks.padding([1.5]), TypeError, "lengths must be integers"),
        (
            lambda: masks.document(np.zeros((1, 1, 2), int)),
            TypeError,
            "ids must be integers of 1 dims or 2 dims",
        ),
        (lambda: masks.predicate(3), TypeError, "predicate must be callable"),
        (
            lambda: masks.padding([2, 3]).to_numpy(3, 1, 4, 4),
            ValueError,
            "padding lengths must have shape (B,) = (3,); got (2,)",
        ),
        (
            lambda: masks.padding([2, 5]).to_numpy(2, 1, 4, 4),
            ValueError,
            "padding lengths must be <= T_k=4",
        ),
        (
            lambda: masks.document([0, 1]).to_numpy(1, 1, 4, 4),
            ValueError,
            "document ids must have shape (T_k,) = (4,); got (2,)",
        ),
        (
            lambda: masks.document([[0, 1, 1, 1]]).to_numpy(2, 1, 4, 4),
            ValueError,
            "document ids must have shape (B, T_k) = (2, 4); got (1, 4)",
        ),
        (
            lambda: masks.predicate(lambda b, h, q, kv: q - kv, "diff").to_numpy(1, 1, 3, 3),
            TypeError,
            "mask predicate(diff) must return bool",
        ),
        (
            lambda: masks.predicate(lambda b, h, q, kv: (q >= 0)[..., :2, :], "cut").to_numpy(
                1, 1, 3, 3
            ),
            ValueError,
            "returned shape (1, 1, 2, 1), which does not broadcast to "
            "(B, H, T_q, T_k) = (1, 1, 3, 3)",
        ),
        (lambda: masks.causal() & np.ones((2, 2), bool), TypeError, ""),
    ],
)
def test_bad_mask_arguments(make, exc, words):
    with pytest.raises(exc) as info:
        make()
    assert words in str(info.value)


def zoo_for(B, T_k):
    from tests.helpers import mask_zoo

    return {k: m for k, m in mask_zoo(B, T_k).items() if isinstance(m, masks.Mask)}


@pytest.mark.parametrize(
    "T_q,T_k,q_offset",
    [(37, 37, None), (13, 50, None), (50, 13, None), (20, 41, 7), (64, 64, None)],
)
@pytest.mark.parametrize("bq,bk", [(4, 4), (8, 5), (16, 16)])
def test_block_map_agrees_with_dense(T_q, T_k, q_offset, bq, bk):
    B, H = 2, 3
    for name, m in zoo_for(B, T_k).items():
        dense = m.to_numpy(B, H, T_q, T_k, q_offset=q_offset)
        codes = m.blocks(B, H, T_q, T_k, block_q=bq, block_k=bk, q_offset=q_offset)
        assert codes.shape == (-(-T_q // bq), -(-T_k // bk))
        for i, j in np.ndindex(codes.shape):
            tile = dense[:, :, i * bq : (i + 1) * bq, j * bk : (j + 1) * bk]
            if codes[i, j] == masks.FULL:
                assert tile.all(), (name, i, j)
            elif codes[i, j] == masks.EMPTY:
                assert not tile.any(), (name, i, j)


@pytest.mark.parametrize(
    "T_q,T_k,q_offset",
    [(37, 37, None), (13, 50, None), (50, 13, None), (20, 41, 7), (5, 40, -20), (5, 40, 60)],
)
@pytest.mark.parametrize("bq,bk", [(4, 4), (8, 5), (3, 2)])
def test_sparse_block_map_equals_the_dense_one(T_q, T_k, q_offset, bq, bk):
    # sparse_blocks reaches only the tiles a mask's structure may leave non-empty; it must
    # find every one of them, with the same code. Ids out of order keep the full reach.
    B, H = 2, 3
    rng = np.random.default_rng(T_q * T_k)
    zoo = zoo_for(B, T_k) | {
        "ids_descending": masks.document(np.sort(rng.integers(0, 5, T_k))[::-1].copy()),
        "ids_shuffled": masks.document(rng.integers(0, 3, T_k)),
        "ids_per_row": masks.document(np.sort(rng.integers(0, 5, (B, T_k)), -1)),
        "not_window_and_causal": ~masks.sliding_window(5) & masks.causal(),
        "window_at_an_offset": masks.sliding_window(6).shifted(9, 3, 200),
    }
    for name, m in zoo.items():
        dense = m.blocks(B, H, T_q, T_k, block_q=bq, block_k=bk, q_offset=q_offset)
        rows, cols, codes = m.sparse_blocks(
            B, H, T_q, T_k, block_q=bq, block_k=bk, q_offset=q_offset
        )
        want_rows, want_cols = np.nonzero(dense)
        np.testing.assert_array_equal(rows, want_rows, err_msg=name)
        np.testing.assert_array_equal(cols, want_cols, err_msg=name)
        np.testing.assert_array_equal(codes, dense[want_rows, want_cols], err_msg=name)


@pytest.mark.parametrize(
    "T_q,T_k,q_offset", [(37, 37, None), (13, 50, None), (50, 13, None), (5, 40, -20), (5, 40, 60)]
)
def test_intervals_are_exactly_the_mask_or_none(T_q, T_k, q_offset):
    # What the native kernel masks by instead of a tile: every row's keys [lo, hi), where
    # they are one interval; None (a tile then) where they are not, or are not known.
    B = 2
    rng = np.random.default_rng(T_q + T_k)
    ids = np.repeat([4, 1, 7, 2], [3, T_k - 10, 5, 2])  # runs of distinct ids, unsorted
    zoo = zoo_for(B, T_k) | {
        "runs": masks.document(ids),
        "runs&window": masks.document(ids) & masks.sliding_window(4),
        "id_in_two_runs": masks.document(np.r_[ids[:-2], 4, 4]),
        "window_at_an_offset": masks.sliding_window(6).shifted(9, 3, 200),
        "prefix&padding": masks.prefix_lm(3) & masks.padding(rng.integers(0, T_k + 1, B)),
    }
    not_intervals = {"window|prefix", "~causal", "predicate", "key_indices", "id_in_two_runs"}
    offset = T_k - T_q if q_offset is None else q_offset
    for name, m in zoo.items():
        found = m.intervals(np.arange(T_q) + offset)
        if name in not_intervals:
            assert found is None, name
            continue
        assert found is not None, name
        lo, hi = found
        assert lo.ndim == hi.ndim == 2 and lo.shape[1] == hi.shape[1] == T_q, name
        keys = np.arange(T_k)
        got = (keys >= lo[..., None]) & (keys < hi[..., None])  # (B|1, T_q, T_k)
        want = m.to_numpy(B, 1, T_q, T_k, q_offset=q_offset)[:, 0]
        np.testing.assert_array_equal(np.broadcast_to(got, want.shape), want, err_msg=name)
    lo, hi = masks.document(np.zeros(0, int)).intervals(np.arange(3))  # no ids: no keys
    assert (lo == hi).all()


def test_sparse_block_map_scales_with_what_is_attended():
    # A window over 4M positions: its band is ~200K tiles, the dense map 2 G cells.
    import tracemalloc

    T = 1 << 22
    tracemalloc.start()
    try:
        rows, _cols, _codes = masks.sliding_window(256).sparse_blocks(
            1, 1, T, T, block_q=128, block_k=64
        )
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(rows) == 196_602  # 32768 rows × 6 tiles, less the first rows' missing keys
    assert peak < 50e6, peak


def test_block_map_is_tight_for_structured_masks():
    # Exactly the diagonal tiles are partial for causal; a window of 8 over 8-wide tiles
    # touches two tiles per row; documents aligned to tiles leave nothing partial.
    codes = masks.causal().blocks(1, 1, 64, 64, block_q=8, block_k=8)
    assert (codes == np.tril(np.full((8, 8), masks.FULL), -1) + np.eye(8, dtype=int)).all()
    codes = masks.sliding_window(8).blocks(1, 1, 64, 64, block_q=8, block_k=8)
    assert ((codes != masks.EMPTY).sum(1) <= 2).all()
    ids = np.repeat(np.arange(4), 16)
    codes = (masks.document(ids)).blocks(1, 1, 64, 64, block_q=8, block_k=8)
    assert set(np.unique(codes)) == {masks.EMPTY, masks.FULL}
    assert (
        masks.predicate(lambda b, h, q, kv: q >= kv).blocks(1, 1, 9, 9, block_q=4, block_k=4)
        == masks.PARTIAL
    ).all()


@pytest.mark.parametrize(
    "T_q,T_k,q_offset", [(37, 37, None), (13, 50, None), (50, 13, None), (20, 41, 7), (9, 9, None)]
)
@pytest.mark.parametrize("bq,bk", [(1, 1), (1, 3), (4, 4), (8, 5)])
def test_block_map_is_exact_for_structured_leaf_masks(T_q, T_k, q_offset, bq, bk):
    # Not only sound: a structured mask knows its tiles exactly (FULL iff every entry may
    # attend, EMPTY iff none), so the tiled kernel never evaluates what it could skip.
    B, H = 2, 3
    rng = np.random.default_rng(T_k)
    leaves = [
        masks.full(),
        masks.causal(),
        masks.sliding_window(3),
        masks.prefix_lm(5),
        masks.padding(rng.integers(0, T_k + 1, size=B)),
        masks.document(np.sort(rng.integers(0, 4, size=(B, T_k)), axis=-1)),
        masks.document(np.sort(rng.integers(0, 3, size=T_k))),
    ]
    for m in leaves:
        dense = m.to_numpy(B, H, T_q, T_k, q_offset=q_offset)
        codes = m.blocks(B, H, T_q, T_k, block_q=bq, block_k=bk, q_offset=q_offset)
        for i, j in np.ndindex(codes.shape):
            tile = dense[:, :, i * bq : (i + 1) * bq, j * bk : (j + 1) * bk]
            want = masks.FULL if tile.all() else masks.EMPTY if not tile.any() else masks.PARTIAL
            assert codes[i, j] == want, (m, i, j)


def test_picture_of_any_batch_row_of_a_per_row_mask():
    m = masks.causal() & masks.padding([1, 3])
    assert m.batch == 2 and masks.causal().batch is None
    assert m.picture(3) == m.picture(3, b=0) != m.picture(3, b=1)
    assert m.picture(3).splitlines()[-1] == "█ · ·"
    assert m.picture(3, b=1).splitlines()[-1] == "█ █ █"
    with pytest.raises(ValueError, match=r"b must be in \[0, 2\)"):
        m.picture(3, b=2)
    by_head = masks.predicate(lambda b, h, q, kv: (q + kv + h) % 2 == 0)
    assert by_head.picture(3) == by_head.picture(3, h=0) != by_head.picture(3, h=1)


def test_document_blocks_read_exactly_their_own_ids():
    # Unsorted ids, and a last key that is a document of its own: a block that read one id
    # beyond its edge would turn FULL and EMPTY tiles PARTIAL.
    ids = [1, 1, 0, 0, 2, 2]
    codes = masks.document(ids).blocks(1, 1, 6, 6, block_q=2, block_k=2)
    assert (codes == np.where(np.eye(3, dtype=bool), masks.FULL, masks.EMPTY)).all()
    codes = masks.document([0] * 6 + [1]).blocks(1, 1, 7, 7, block_q=1, block_k=1)
    assert codes[6, 6] == masks.FULL and codes[6, 5] == codes[5, 6] == masks.EMPTY


def test_long_arrays_are_summarised_in_reprs():
    assert repr(masks.document(list(range(8)))) == "document([0, 1, 2, 3, 4, 5, 6, 7])"
    assert repr(masks.document(list(range(9)))) == "document([0, 1, 2, ..., 6, 7, 8])"


def test_key_indices_attend_exactly_the_keys_listed():
    """Each query its own keys, rows at ``first`` on, -1 unused; tiles with no listed key
    are EMPTY (the block map is exact, so the tiled kernel visits only those)."""
    rng = np.random.default_rng(0)
    B, T_rows, T_k, first = 2, 9, 23, 5
    idx = rng.integers(-1, T_k, size=(B, T_rows, 4))
    m = masks.key_indices(idx, first=first)
    want = np.zeros((B, 1, 14, T_k), dtype=bool)  # queries at positions 0..13
    for b, r, j in np.ndindex(B, T_rows, 4):
        if idx[b, r, j] >= 0:
            want[b, 0, first + r, idx[b, r, j]] = True
    got = m.to_numpy(B, 1, 14, T_k, q_offset=0)
    np.testing.assert_array_equal(got, want)
    assert torch.equal(m.dense(B, 1, 14, T_k, q_offset=0), torch.from_numpy(want))
    codes = m.blocks(B, 1, 14, T_k, block_q=4, block_k=4, q_offset=0)
    for i, j in np.ndindex(codes.shape):
        tile = want[:, :, i * 4 : (i + 1) * 4, j * 4 : (j + 1) * 4]
        assert (codes[i, j] == masks.EMPTY) == (not tile.any())
    assert repr(m) == "key_indices((2, 9, 4), first=5)"


@pytest.mark.parametrize(
    "indices, B, T_k, exc, words",
    [
        (np.zeros((2, 3, 1), int), 3, 8, ValueError, "shape (B, T_rows, k) with B = 3"),
        (np.full((1, 3, 1), 8), 1, 8, ValueError, "must be < T_k=8; got 8"),
        (np.zeros((3, 1)), 1, 8, TypeError, "integers of 3 dims"),
    ],
)
def test_bad_key_indices(indices, B, T_k, exc, words):
    with pytest.raises(exc, match=re.escape(words)):
        masks.key_indices(indices).dense(B, 1, 3, T_k)
