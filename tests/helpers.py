"""Shared test helpers: inputs and one mask of every kind."""

import numpy as np
import torch

from qkv import masks


def make_qkv(B, H, H_kv, T_q, T_k, D, D_v, *, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T_q, D, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(B, H_kv, T_k, D, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(B, H_kv, T_k, D_v, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v


def mask_zoo(B, T_k, T_q=None, seed=0):
    """One of every mask kind, and combinations, for batch B, key length T_k and query
    length T_q (default T_k; only the dense masks with rows depend on it)."""
    T_q = T_k if T_q is None else T_q
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, T_k + 1, size=B)
    ids = np.sort(rng.integers(0, 3, size=(B, T_k)), axis=-1)
    return {
        "none": None,
        "full": masks.full(),
        "causal": masks.causal(),
        "sliding_window": masks.sliding_window(3),
        "padding": masks.padding(lengths),
        "document": masks.document(ids),
        "document_1d": masks.document(ids[0]),
        "prefix_lm": masks.prefix_lm(2),
        "causal&padding": masks.causal() & masks.padding(lengths),
        "document&causal": masks.document(ids) & masks.causal(),
        "window|prefix": masks.sliding_window(2) | masks.prefix_lm(1),
        "~causal": ~masks.causal(),
        "predicate": masks.predicate(lambda b, h, q, kv: (q + kv + h) % 3 != 0, "mod3"),
        "dense": torch.from_numpy(rng.random((B, 1, 1, T_k)) < 0.7),
        # Rows too, so kernels must offset the mask per query block.
        "dense_rows": torch.from_numpy(rng.random((B, 1, T_q, T_k)) < 0.6),
        "dense_2d": torch.from_numpy(rng.random((T_q, T_k)) < 0.6),
    }


def oracle_with_lse(q, k, v, mask, scale=None):
    """The NumPy float64 oracle's out and lse on the same (rounded) inputs."""
    from qkv import numpy as qnp

    if isinstance(mask, torch.Tensor):
        mask = mask.numpy()
    return qnp.attention(
        *(x.double().numpy() for x in (q, k, v)), mask=mask, scale=scale, return_lse=True
    )


def grads(q, k, v, g, mask, **kw):
    """dQ, dK, dV of sum(attention(q, k, v) · g) through ``qkv.attention(**kw)``."""
    import qkv

    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = qkv.attention(q, k, v, mask=mask, **kw)
    return torch.autograd.grad((out * g).sum(), (q, k, v))


def small_tiles(block_q=8, block_k=8, chunk_k=16):
    """The knobs (for ``qkv.tuned`` or the ``tune`` fixture) that make the tiled kernel use
    tiny tiles, so small inputs span many blocks and chunks, and let auto consider it for
    small inputs too."""
    return dict(small_scores=0, block_q=block_q, block_k=block_k, chunk_k=chunk_k)
