"""qkv under torch.compile: one graph for every mask kind and score modification, forward
and backward; no recompilation for a new length with dynamic=True; modules and the GPT."""

import math

import numpy as np
import pytest
import torch
import torch._dynamo as dynamo
from torch._dynamo.testing import CompileCounter

import qkv
from qkv import masks, scores
from qkv.models import GPT, GPTConfig
from tests.helpers import make_qkv, mask_zoo

MASKS = [
    "none",
    "causal",
    "sliding_window",
    "padding",
    "document",
    "prefix_lm",
    "document&causal",
    "~causal",
    "predicate",
    "dense_rows",
]
MODS = {
    "none": None,
    "alibi": scores.alibi(scores.alibi_slopes(4)),
    "softcap": scores.softcap(3.0),
    "relative_bias": scores.relative_bias(torch.randn(32, 4), bidirectional=False),
    "bias": scores.bias(torch.randn(1, 4, 19, 23)),
    "alibi>softcap": scores.alibi(scores.alibi_slopes(4)).then(scores.softcap(3.0)),
    "function": lambda s, b, h, q, kv: s - 0.1 * (q - kv).abs(),
}


def inputs(T_q=19, T_k=23, grad=True):
    q, k, v = make_qkv(2, 4, 2, T_q, T_k, 8, 8, dtype=torch.float32)
    return [x.requires_grad_(grad) for x in (q, k, v)]


def breaks(fn, *args):
    dynamo.reset()
    return dynamo.explain(fn)(*args).graph_break_count


@pytest.mark.parametrize("mask_name", MASKS)
def test_every_mask_compiles_to_one_graph_forward_and_backward(mask_name):
    mask = mask_zoo(2, 23, 19)[mask_name]

    def f(q, k, v):
        return qkv.attention(q, k, v, mask=mask)

    q, k, v = inputs()
    assert breaks(f, q, k, v) == 0
    out = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    want = f(q, k, v)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=0)
    for g, w in zip(grads, torch.autograd.grad(want.square().sum(), (q, k, v))):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0)


@pytest.mark.parametrize("mod_name", list(MODS))
@pytest.mark.parametrize(
    "mask_name",
    [
        "causal",
        "predicate",
        *[pytest.param(m, marks=pytest.mark.slow) for m in ("none", "document&causal")],
    ],
)
def test_every_modification_compiles_to_one_graph(mod_name, mask_name):
    mask, mod = mask_zoo(2, 23, 19)[mask_name], MODS[mod_name]

    def f(q, k, v):
        out, lse = qkv.attention(q, k, v, mask=mask, score_mod=mod, return_lse=True)
        return out, lse

    q, k, v = inputs()
    assert breaks(f, q, k, v) == 0
    out, lse = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    want, want_lse = f(q, k, v)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=0)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=0)
    loss = lambda o, l_: o.square().sum() + l_.masked_fill(l_ == -math.inf, 0).sum()  # noqa
    for g, w in zip(
        torch.autograd.grad(loss(out, lse), (q, k, v)),
        torch.autograd.grad(loss(want, want_lse), (q, k, v)),
    ):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0)


def test_a_learnable_table_gets_its_gradient_through_the_compiled_op():
    table = torch.randn(32, 4, requires_grad=True)

    def f(q, k, v):
        mod = scores.relative_bias(table).then(scores.softcap(4.0))
        return qkv.attention(q, k, v, mask=masks.sliding_window(5), score_mod=mod)

    q, k, v = inputs()
    out = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    got = torch.autograd.grad(out.square().sum(), table)[0]
    want = torch.autograd.grad(f(q, k, v).square().sum(), table)[0]
    assert got.abs().sum() > 0
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("case", ["causal", "sliding_window+alibi", "padding"])
def test_dynamic_shapes_do_not_recompile_for_a_new_length(case):
    mask, mod = {
        "causal": (masks.causal(), None),
        "sliding_window+alibi": (masks.sliding_window(7), scores.alibi(scores.alibi_slopes(4))),
        "padding": (masks.padding([11, 17]), None),
    }[case]

    def f(q, k, v):
        return qkv.attention(q, k, v, mask=mask, score_mod=mod)

    dynamo.reset()
    counter = CompileCounter()
    g = torch.compile(f, backend=counter, dynamic=True, fullgraph=True)
    for T in (17, 40, 57):
        q, k, v = inputs(T, T, grad=False)
        torch.testing.assert_close(g(q, k, v), f(q, k, v), atol=1e-6, rtol=0)
    assert counter.frame_count == 1


def test_a_new_mask_of_the_same_kind_does_not_recompile():
    """A training loop passes a new padding or document mask every step."""
    dynamo.reset()
    counter = CompileCounter()
    g = torch.compile(
        lambda q, k, v, m: qkv.attention(q, k, v, mask=m), backend=counter, fullgraph=True
    )
    q, k, v = inputs(30, 30, grad=False)
    rng = np.random.default_rng(0)
    for _ in range(3):
        for m in (
            masks.padding(rng.integers(1, 31, 2)),
            masks.document(np.sort(rng.integers(0, 4, 30))) & masks.causal(),
        ):
            torch.testing.assert_close(
                g(q, k, v, m), qkv.attention(q, k, v, mask=m), atol=1e-6, rtol=0
            )
    assert counter.frame_count == 2  # one graph per mask kind


def test_inductor_runs_a_tiled_call_with_modifications_forward_and_backward():
    mod = scores.alibi(scores.alibi_slopes(4)).then(scores.softcap(3.0))

    def f(q, k, v):
        return qkv.attention(q, k, v, mask=masks.sliding_window(6), score_mod=mod)

    q, k, v = inputs(40, 40)
    dynamo.reset()
    out = torch.compile(f, fullgraph=True)(q, k, v)
    want = f(q, k, v)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=0)
    for g, w in zip(
        torch.autograd.grad(out.sum(), (q, k, v)), torch.autograd.grad(want.sum(), (q, k, v))
    ):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0)


def test_a_masked_nan_key_reaches_no_other_row_when_compiled():
    q, k, v = inputs(8, 8, grad=False)
    k[:, :, 6] = math.nan  # rows 0..5 mask key 6 out under causal
    for mask in (masks.causal(), masks.sliding_window(3), masks.padding([6, 6])):
        out = torch.compile(
            lambda q, k, v: qkv.attention(q, k, v, mask=mask), fullgraph=True, backend="aot_eager"
        )(q, k, v)
        assert torch.isfinite(out[:, :, :6]).all(), mask


def test_multi_head_attention_training_step_and_kv_cache_decode_compile():
    torch.manual_seed(0)
    mha = qkv.MultiHeadAttention(32, 32, num_heads=4, num_kv_heads=2, causal=True, rope=qkv.RoPE(8))
    x = torch.randn(2, 20, 32)
    assert breaks(lambda x: mha(x).square().mean(), x) == 0
    step = torch.compile(lambda x: mha(x).square().mean(), fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(step(x), list(mha.parameters()))
    want = torch.autograd.grad(mha(x).square().mean(), list(mha.parameters()))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0)

    decode = torch.compile(
        lambda x, cache: mha(x, cache=cache), fullgraph=True, backend="aot_eager"
    )
    with torch.no_grad():
        cache, eager_cache = mha.new_cache(2, 32), mha.new_cache(2, 32)
        outs = [decode(x[:, :12], cache)] + [decode(x[:, t : t + 1], cache) for t in range(12, 20)]
        eager = [mha(x[:, :12], cache=eager_cache)] + [
            mha(x[:, t : t + 1], cache=eager_cache) for t in range(12, 20)
        ]
    torch.testing.assert_close(torch.cat(outs, 1), torch.cat(eager, 1), atol=1e-6, rtol=0)
    torch.testing.assert_close(torch.cat(outs, 1), mha(x), atol=1e-5, rtol=0)


@pytest.mark.parametrize("positions", ["learned", "rope"])
def test_the_gpt_compiles_to_one_graph(positions):
    torch.manual_seed(0)
    model = GPT(
        GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=32, positions=positions)
    )
    idx = torch.randint(0, 64, (2, 32))

    def loss(idx):
        logits = model(idx)
        logits = logits[0] if isinstance(logits, tuple) else logits
        return torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, 64), idx[:, 1:].reshape(-1)
        )

    assert breaks(loss, idx) == 0
    got = torch.autograd.grad(
        torch.compile(loss, fullgraph=True, backend="aot_eager")(idx), list(model.parameters())
    )
    want = torch.autograd.grad(loss(idx), list(model.parameters()))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0)


def test_an_explicit_backend_that_cannot_apply_a_modification_still_refuses_when_compiled():
    q, _, _ = inputs(8, 8, grad=False)
    f = torch.compile(
        lambda q: qkv.attention(q, q, q, score_mod=scores.softcap(2.0), backend="sdpa"),
        backend="aot_eager",
    )
    with pytest.raises(ValueError, match="backend='sdpa' cannot give softcap"):
        f(q)
