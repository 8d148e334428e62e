"""Shared test helpers: inputs and one mask of every kind."""

import numpy as np
import torch

from qkv import masks

#: the backends that give the log-sum-exp on the CPU
LSE_BACKENDS = ["reference", "tiled", "auto"]


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
        # Each query its own keys (-1: an unused slot), rows at the queries' positions.
        "key_indices": masks.key_indices(rng.integers(-1, T_k, size=(B, T_q, 3)), first=T_k - T_q),
        "dense": torch.from_numpy(rng.random((B, 1, 1, T_k)) < 0.7),
        # Rows too, so kernels must offset the mask per query block.
        "dense_rows": torch.from_numpy(rng.random((B, 1, T_q, T_k)) < 0.6),
        "dense_2d": torch.from_numpy(rng.random((T_q, T_k)) < 0.6),
    }


def oracle(q, k, v, **kw):
    """The NumPy float64 oracle (``qkv.numpy.attention``) on the same (rounded) inputs; a
    tensor mask goes as an array, other keywords as given."""
    from qkv import numpy as qnp

    arrays = [x.detach().cpu().double().numpy() for x in (q, k, v)]
    if isinstance(kw.get("mask"), torch.Tensor):
        kw["mask"] = kw["mask"].cpu().numpy()
    return qnp.attention(*arrays, **kw)


def oracle_with_lse(q, k, v, mask, scale=None):
    """The NumPy float64 oracle's out and lse on the same (rounded) inputs."""
    return oracle(q, k, v, mask=mask, scale=scale, return_lse=True)


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


def mha(**kw):
    """A float64 qkv.MultiHeadAttention, 16 → 16 with 4 heads unless told otherwise."""
    import qkv

    kw = {"num_heads": 4, **kw}
    return qkv.MultiHeadAttention(kw.pop("d_in", 16), kw.pop("d_out", 16), **kw).double()


def x_(B=2, T=9, E=16, seed=1):
    """(B, T, E) float64 inputs for a module."""
    return torch.randn(B, T, E, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


#: (B, H, T_q, T_k) of score_zoo's modifications
SCORE_SHAPE = (2, 4, 37, 53)


def score_zoo(dtype=torch.float64):
    """One of every modification, and compositions, for (B, H, T_q, T_k) = SCORE_SHAPE;
    tensors in ``dtype``."""
    import math

    from qkv import scores

    B, H, T_Q, T_K = SCORE_SHAPE
    g = torch.Generator().manual_seed(1)
    table = torch.randn(32, H, generator=g, dtype=dtype)
    bias = torch.randn(B, 1, T_Q, T_K, generator=g, dtype=dtype)
    bias[0, 0, 3] = -math.inf  # a row the bias masks entirely
    bias[1, 0, :, 5] = -math.inf  # a key the bias masks for every query
    slopes = scores.alibi_slopes(H).to(dtype)
    return {
        "alibi": scores.alibi(slopes),
        "softcap": scores.softcap(2.0),
        "relative_bias": scores.relative_bias(table, bidirectional=False, max_distance=20),
        "relative_bias_bidirectional": scores.relative_bias(table, max_distance=16),
        "bias": scores.bias(bias),
        "bias_2d": scores.bias(bias[0, 0, 10:11].expand(T_Q, T_K) * 0.5),
        "function": scores.function(
            lambda s, b, h, q, kv: s * (1 + h) / 2 - (q - kv) / 8, "by_head"
        ),
        "alibi>softcap": scores.alibi(slopes).then(scores.softcap(1.5)),
        "bias>alibi": scores.chain(scores.bias(bias), scores.alibi(slopes)),
    }


def tiny_llama(model_class: str, vocab_size: int, attn_implementation: str = "qkv"):
    """A 2-layer Llama of width 32 with GQA (4 query heads, 2 key/value heads), seeded, in
    eval mode, qkv registered: ``model_class`` names a transformers class (``LlamaModel``,
    ``LlamaForCausalLM``)."""
    import copy

    import pytest

    transformers = pytest.importorskip("transformers")
    from qkv.integrations import huggingface

    huggingface.register()
    config = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    cls = getattr(transformers, model_class)
    return cls._from_config(copy.deepcopy(config), attn_implementation=attn_implementation).eval()
