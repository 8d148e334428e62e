"""Code written for the GPU attention APIs runs on qkv unchanged: FlexAttention's scalar
mask_mods and score_mods (lifted with torch.vmap), FlashAttention's symmetric ALiBi with
per-batch slopes; each against the float64 oracle on every backend."""

import numpy as np
import pytest
import torch

import qkv
from qkv import masks, scores
from tests.helpers import make_qkv, oracle, small_tiles

BACKENDS = ["reference", "sdpa", "tiled", "auto"]

# Written as attention-gym writes them: for one position at a time.
IMAGE_OF = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2])  # Flamingo-style: text -> image
SEES = IMAGE_OF[:, None] == IMAGE_OF[None, :]  # (T, T): which positions a position may see


def flamingo_mask(b, h, q_idx, kv_idx):
    """A position sees those of its own image: a table indexed one scalar at a time
    (``SEES[q_idx][kv_idx]``), which broadcast index arrays cannot do."""
    return SEES[q_idx][kv_idx]


def tanh_softcap(score, b, h, q_idx, kv_idx):
    return 20.0 * torch.tanh(score / 20.0)


def relative_positional(score, b, h, q_idx, kv_idx):
    return score + (q_idx - kv_idx) * 0.1


def test_a_scalar_mask_mod_fails_on_broadcast_arrays_and_runs_lifted():
    with pytest.raises(Exception):  # noqa: B017 - what happens without lifting, whatever it is
        masks.predicate(flamingo_mask).dense(1, 1, 13, 13)
    lifted = masks.predicate(flamingo_mask, vmap=True)
    want = SEES[None, None]
    assert torch.equal(lifted.dense(1, 1, 13, 13), want)
    assert np.array_equal(lifted.to_numpy(1, 1, 13, 13), want.numpy())
    assert repr(lifted) == "predicate(flamingo_mask)"


@pytest.mark.parametrize("backend", BACKENDS)
def test_lifted_flex_mods_equal_the_oracle(backend, tune):
    tune(**small_tiles())
    q, k, v = make_qkv(2, 4, 2, 13, 13, 8, 8)
    mask = masks.predicate(flamingo_mask, vmap=True) & masks.causal()
    dense = mask.dense(2, 4, 13, 13)
    for fn in (tanh_softcap, relative_positional):
        mod = scores.function(fn, vmap=True)
        want = oracle(q, k, v, mask=dense, score_mod=scores.function(fn, vmap=True))
        if backend == "sdpa":
            continue  # a score function: torch's kernel cannot take it (refused, as always)
        got = qkv.attention(q, k, v, mask=mask, score_mod=mod, backend=backend)
        assert np.abs(got.numpy() - want).max() < 1e-12, (fn.__name__, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("per_batch", [False, True])
def test_symmetric_alibi_is_flash_attentions(backend, per_batch):
    B, H, T = 2, 4, 11
    q, k, v = make_qkv(B, H, H, T, T, 8, 8)
    g = torch.Generator().manual_seed(3)
    slopes = torch.rand((B, H) if per_batch else (H,), generator=g, dtype=torch.float64)
    mod = scores.alibi(slopes, symmetric=True)
    i = torch.arange(T)
    bias = (
        -(slopes[..., None, None] if per_batch else slopes[None, :, None, None])
        * (i[:, None] - i[None, :]).abs()
    )  # FlashAttention's attn_bias
    want = oracle(q, k, v, score_mod=scores.bias(bias.expand(B, H, T, T)))
    got = qkv.attention(q, k, v, score_mod=mod, backend=backend)
    assert np.abs(got.numpy() - want).max() < 1e-12
    # on causal keys it equals the signed ALiBi
    signed = qkv.attention(
        q, k, v, mask=masks.causal(), score_mod=scores.alibi(slopes[-1] if per_batch else slopes)
    )
    same = qkv.attention(
        q[-1:],
        k[-1:],
        v[-1:],
        mask=masks.causal(),
        score_mod=scores.alibi(slopes[-1] if per_batch else slopes, symmetric=True),
    )
    assert torch.allclose(signed[-1:], same, atol=1e-12)


def test_symmetric_alibi_slopes_learn_on_the_tiled_kernel():
    B, H, T = 2, 2, 9
    q, k, v = make_qkv(B, H, H, T, T, 8, 8)
    grads = {}
    for backend in ("tiled", "reference"):
        slopes = torch.tensor([[0.5, 0.25], [0.1, 0.3]], dtype=torch.float64, requires_grad=True)
        out = qkv.attention(
            q, k, v, score_mod=scores.alibi(slopes, symmetric=True), backend=backend
        )
        (grads[backend],) = torch.autograd.grad(out.square().sum(), [slopes])
    assert (grads["tiled"] - grads["reference"]).abs().max() < 1e-10


def test_bad_symmetric_slopes_are_refused():
    q = torch.randn(2, 4, 3, 8)
    with pytest.raises(ValueError, match=r"\(B, H\) = \(2, 4\)"):
        qkv.attention(q, q, q, score_mod=scores.alibi(torch.ones(3, 4), symmetric=True))
    with pytest.raises(TypeError, match=r"\(H,\) or \(B, H\)"):
        scores.alibi(torch.ones(2, 4, 1), symmetric=True)
