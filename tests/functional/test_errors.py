"""Every bad input gets a ValueError/TypeError naming the argument, the expected shape in
legend letters and the actual shape; the torch core and the NumPy oracle agree."""

import re

import numpy as np
import pytest
import torch

import qkv
from qkv import masks


def t(*shape, dtype=torch.float32):
    return torch.zeros(shape, dtype=dtype)


CASES = [
    # (id, (query, key, value), options, exception, exact message)
    (
        "D mismatch",
        (t(2, 8, 128, 64), t(2, 8, 128, 32), t(2, 8, 128, 32)),
        {},
        ValueError,
        "key must have shape (B, H_kv, T_k, D) with B=2, D=64 to match query; got (2, 8, 128, 32)",
    ),
    (
        "B mismatch",
        (t(2, 4, 5, 8), t(3, 4, 5, 8), t(3, 4, 5, 8)),
        {},
        ValueError,
        "key must have shape (B, H_kv, T_k, D) with B=2, D=8 to match query; got (3, 4, 5, 8)",
    ),
    (
        "T_k mismatch",
        (t(2, 4, 5, 8), t(2, 4, 7, 8), t(2, 4, 6, 8)),
        {},
        ValueError,
        "value must have shape (B, H_kv, T_k, D_v) with B=2, H_kv=4, T_k=7 to match key; "
        "got (2, 4, 6, 8)",
    ),
    (
        "H_kv mismatch",
        (t(2, 4, 5, 8), t(2, 2, 7, 8), t(2, 4, 7, 8)),
        {},
        ValueError,
        "value must have shape (B, H_kv, T_k, D_v) with B=2, H_kv=2, T_k=7 to match key; "
        "got (2, 4, 7, 8)",
    ),
    (
        "H not divisible",
        (t(1, 6, 5, 8), t(1, 4, 5, 8), t(1, 4, 5, 8)),
        {},
        ValueError,
        "query heads H=6 must be a multiple of key/value heads H_kv=4; "
        "got query (1, 6, 5, 8) and key (1, 4, 5, 8)",
    ),
    (
        "3-d D mismatch",
        (t(2, 5, 8), t(2, 5, 4), t(2, 5, 4)),
        {},
        ValueError,
        "key must have shape (B, T_k, D) with B=2, D=8 to match query; got (2, 5, 4)",
    ),
    (
        "2-d T_k mismatch",
        (t(5, 8), t(6, 8), t(5, 8)),
        {},
        ValueError,
        "value must have shape (T_k, D_v) with T_k=6 to match key; got (5, 8)",
    ),
    (
        "rank 1",
        (t(8), t(8), t(8)),
        {},
        ValueError,
        "query must have shape (T, D), (B, T, D) or (B, H, T, D); got (8,)",
    ),
    (
        "rank 5",
        (t(1, 1, 1, 2, 3),) * 3,
        {},
        ValueError,
        "query must have shape (T, D), (B, T, D) or (B, H, T, D); got (1, 1, 1, 2, 3)",
    ),
    (
        "ranks differ",
        (t(2, 5, 8), t(2, 1, 5, 8), t(2, 1, 5, 8)),
        {},
        ValueError,
        "key must have the same layout as query (B, T_q, D); got (2, 1, 5, 8) for query (2, 5, 8)",
    ),
    (
        "integer query",
        (t(2, 3, dtype=torch.int64),) * 3,
        {},
        TypeError,
        "query must be floating point (float16, bfloat16, float32 or float64); got int64",
    ),
    (
        "bool value",
        (t(2, 3), t(2, 3), t(2, 3, dtype=torch.bool)),
        {},
        TypeError,
        "value must be floating point (float16, bfloat16, float32 or float64); got bool",
    ),
    (
        "mixed dtypes",
        (t(2, 3), t(2, 3, dtype=torch.float64), t(2, 3)),
        {},
        TypeError,
        "key has dtype float64 but query has float32; cast them to one dtype",
    ),
    (
        "mixed devices",
        (t(2, 3), t(2, 3).to("meta"), t(2, 3)),
        {},
        ValueError,
        "key is on meta but query is on cpu",
    ),
    (
        "mask shape",
        (t(1, 2, 4, 8), t(1, 2, 6, 8), t(1, 2, 6, 8)),
        {"mask": torch.ones(4, 4, dtype=torch.bool)},
        ValueError,
        "mask must have shape (T_q, T_k) or (B, H, T_q, T_k) (size-1 dims broadcast) with "
        "(B, H, T_q, T_k) = (1, 2, 4, 6); got (4, 4)",
    ),
    (
        "mask rank",
        (t(4, 8), t(6, 8), t(6, 8)),
        {"mask": torch.ones(1, 4, 6, dtype=torch.bool)},
        ValueError,
        "mask must have shape (T_q, T_k) (size-1 dims broadcast) with (T_q, T_k) = (4, 6); "
        "got (1, 4, 6)",
    ),
    (
        "3-d mask not silently over heads",
        (t(2, 3, 4, 8), t(2, 3, 4, 8), t(2, 3, 4, 8)),
        {"mask": torch.ones(3, 4, 4, dtype=torch.bool)},
        ValueError,
        "mask must have shape (T_q, T_k) or (B, H, T_q, T_k) (size-1 dims broadcast) with "
        "(B, H, T_q, T_k) = (2, 3, 4, 4); got (3, 4, 4)",
    ),
    (
        "float mask",
        (t(4, 8),) * 3,
        {"mask": torch.zeros(4, 4)},
        TypeError,
        "mask must be bool (True = may attend) or a qkv mask; got dtype float32 (an additive "
        "float mask, 0 / -inf as SDPA and Hugging Face take it, goes in as "
        "score_mod=qkv.scores.bias(mask))",
    ),
    (
        "mask device",
        (t(4, 8),) * 3,
        {"mask": torch.ones(4, 4, dtype=torch.bool).to("meta")},
        ValueError,
        "mask is on meta but query is on cpu",
    ),
    (
        "float q_offset",
        (t(3, 8), t(5, 8), t(5, 8)),
        {"q_offset": 1.0},
        TypeError,
        "q_offset must be an int; got float",
    ),
    (
        "scale zero",
        (t(3, 8),) * 3,
        {"scale": 0.0},
        ValueError,
        "scale must be a finite number > 0; got 0.0",
    ),
    (
        "scale nan",
        (t(3, 8),) * 3,
        {"scale": float("nan")},
        ValueError,
        "scale must be a finite number > 0; got nan",
    ),
    (
        "dropout 1",
        (t(3, 8),) * 3,
        {"dropout_p": 1.0},
        ValueError,
        "dropout_p must be in [0, 1); got 1.0",
    ),
    (
        "dropout negative",
        (t(3, 8),) * 3,
        {"dropout_p": -0.1},
        ValueError,
        "dropout_p must be in [0, 1); got -0.1",
    ),
    (
        "padding batch",
        (t(2, 1, 4, 8),) * 3,
        {"mask": masks.padding([4, 4, 4])},
        ValueError,
        "padding lengths must have shape (B,) = (2,); got (3,)",
    ),
]


@pytest.mark.parametrize(
    "args,options,exc,message", [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_bad_input_torch(args, options, exc, message):
    with pytest.raises(exc, match=re.escape(message)):
        qkv.attention(*args, **options)
    with pytest.raises(exc, match=re.escape(message)):
        qkv.dispatch(*args, **options)


NUMPY_CASES = [
    c for c in CASES if "device" not in c[0] and "bool value" not in c[0] and "dropout" not in c[0]
]


@pytest.mark.parametrize(
    "args,options,exc,message", [c[1:] for c in NUMPY_CASES], ids=[c[0] for c in NUMPY_CASES]
)
def test_bad_input_numpy_oracle_agrees(args, options, exc, message):
    args = [x.numpy() for x in args]
    options = {k: (v.numpy() if isinstance(v, torch.Tensor) else v) for k, v in options.items()}
    with pytest.raises(exc, match=re.escape(message)):
        qkv.numpy.attention(*args, **options)


def test_not_a_tensor():
    with pytest.raises(TypeError, match="query must be a torch.Tensor .* got list"):
        qkv.attention([[1.0]], t(1, 1), t(1, 1))
    with pytest.raises(
        TypeError,
        match="key is a ndarray but query is a list|query must be a tensor or array; got list",
    ):
        qkv.numpy.attention([[1.0]], np.ones((1, 1)), np.ones((1, 1)))
    with pytest.raises(TypeError, match="key is a Tensor but query is a ndarray"):
        qkv.numpy.attention(np.ones((1, 1)), t(1, 1), t(1, 1))
    with pytest.raises(TypeError, match="mask must be a qkv mask or a bool tensor; got list"):
        qkv.attention(t(2, 2), t(2, 2), t(2, 2), mask=[[True, True], [True, True]])


def test_backend_errors():
    q = t(1, 1, 3, 4)
    with pytest.raises(
        ValueError,
        match="backend must be one of 'auto', 'reference', 'sdpa', 'tiled', 'flex'; got 'flash'",
    ):
        qkv.attention(q, q, q, backend="flash")
    with pytest.raises(
        ValueError,
        match="backend='sdpa' cannot give the attention weights; use backend='reference' or 'auto'",
    ):
        qkv.attention(q, q, q, backend="sdpa", return_weights=True)


@pytest.mark.parametrize("name", ["attention", "dispatch"])
def test_arguments_that_do_not_bind_name_the_public_function(name):
    # Both take their parameters from Call.of; an unknown keyword or a missing tensor is
    # still the caller's mistake with qkv.attention or qkv.dispatch, and says so.
    q = t(1, 1, 3, 4)
    f = getattr(qkv, name)
    with pytest.raises(
        TypeError, match=rf"^qkv\.{name}\(\) got an unexpected keyword argument 'causal'$"
    ):
        f(q, q, q, causal=True)
    with pytest.raises(
        TypeError, match=rf"^qkv\.{name}\(\) missing 1 required positional argument: 'value'$"
    ):
        f(q, q)
    with pytest.raises(TypeError, match="mask must be a qkv mask"):  # raised inside: as it was
        f(q, q, q, mask="causal")
