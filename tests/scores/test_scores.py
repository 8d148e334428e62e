"""Score modifications (qkv.scores): every backend against the NumPy oracle, gradients,
where they apply (scaled scores, before the mask), dispatch and errors."""

import math

import numpy as np
import pytest
import torch

import qkv
from qkv import masks, scores
from tests.helpers import SCORE_SHAPE, make_qkv, mask_zoo, oracle, score_zoo
from tests.tolerances import FLOAT64, LOW_PRECISION

B, H, T_Q, T_K = SCORE_SHAPE  # the sizes score_zoo's tensors are made for
H_KV, D = 2, 8


MODS = list(score_zoo())
MASKS = [
    "none",
    "causal",
    "sliding_window",
    "padding",
    "document&causal",
    "prefix_lm",
    "predicate",
    "dense_rows",
]


def backends(mod):
    fused = mod.additive and not any(t.requires_grad for t in mod.tensors())
    return ["reference", "tiled", "auto"] + (["sdpa"] if fused else [])


@pytest.mark.parametrize("mask_name", MASKS)
@pytest.mark.parametrize("mod_name", MODS)
def test_every_backend_matches_the_oracle(mod_name, mask_name):
    q, k, v = make_qkv(B, H, H_KV, T_Q, T_K, D, 5)
    mod, mask = score_zoo()[mod_name], mask_zoo(B, T_K, T_Q)[mask_name]
    want, want_lse = oracle(q, k, v, mask=mask, score_mod=mod, return_lse=True)
    for backend in backends(mod):
        out = qkv.attention(q, k, v, mask=mask, score_mod=mod, backend=backend)
        np.testing.assert_allclose(out.numpy(), want, atol=FLOAT64, err_msg=backend)
    for backend in ("reference", "tiled"):
        _, lse = qkv.attention(q, k, v, mask=mask, score_mod=mod, backend=backend, return_lse=True)
        np.testing.assert_allclose(lse.numpy(), want_lse, atol=FLOAT64, err_msg=backend)


@pytest.mark.parametrize("mod_name", MODS)
def test_float32_within_1e6_of_the_oracle(mod_name):
    q, k, v = make_qkv(B, H, H_KV, T_Q, T_K, D, 5, dtype=torch.float32)
    mod = score_zoo(torch.float32)[mod_name]
    for mask in (None, masks.sliding_window(9) & masks.padding([40, 53])):
        want = oracle(q, k, v, mask=mask, score_mod=mod)
        for backend in backends(mod):
            out = qkv.attention(q, k, v, mask=mask, score_mod=mod, backend=backend)
            assert np.abs(out.double().numpy() - want).max() < 1e-6, backend


@pytest.mark.parametrize("mod_name", MODS)
def test_tiled_gradients_equal_reference(mod_name):
    """Gradients of q, k, v and of the modification's tensors, through out and lse."""
    mod = score_zoo()[mod_name]
    for t in mod.tensors():
        t.requires_grad_()
    grads = {}
    for backend in ("reference", "tiled"):
        q, k, v = (x.requires_grad_() for x in make_qkv(B, H, H_KV, T_Q, T_K, D, 5))
        out, lse = qkv.attention(
            q, k, v, mask=masks.sliding_window(11), score_mod=mod, backend=backend, return_lse=True
        )
        loss = out.sin().sum() + lse.masked_fill(lse == -math.inf, 0.0).cos().sum()
        leaves = [q, k, v, *mod.tensors()]
        grads[backend] = torch.autograd.grad(loss, leaves)
    for a, b in zip(grads["reference"], grads["tiled"]):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(b, a, atol=FLOAT64, rtol=0)


@pytest.mark.parametrize("backend", ["reference", "tiled"])
def test_gradcheck_learnable_tables(backend):
    g = torch.Generator().manual_seed(2)
    q, k, v = (x.requires_grad_() for x in make_qkv(1, 2, 1, 9, 12, 3, 2))
    table = torch.randn(8, 2, generator=g, dtype=torch.float64, requires_grad=True)
    slopes = torch.tensor([0.3, 0.7], dtype=torch.float64, requires_grad=True)
    bias = torch.randn(1, 2, 9, 12, generator=g, dtype=torch.float64, requires_grad=True)

    def f(q, k, v, table, slopes, bias):
        mod = scores.chain(
            scores.relative_bias(table, max_distance=5),
            scores.alibi(slopes),
            scores.bias(bias),
            scores.softcap(3.0),
        )
        out, lse = qkv.attention(
            q, k, v, mask=masks.causal(), score_mod=mod, backend=backend, return_lse=True
        )
        return out, lse

    assert torch.autograd.gradcheck(f, (q, k, v, table, slopes, bias))


def test_the_modification_sees_scaled_scores_before_the_mask():
    q, k, v = make_qkv(1, 1, 1, 4, 4, 2, 2)
    seen = []

    def spy(s, b, h, q_idx, kv_idx):
        seen.append(s.clone())
        return s

    qkv.attention(q, k, v, mask=masks.causal(), scale=0.3, score_mod=spy, backend="reference")
    torch.testing.assert_close(seen[0], q @ k.transpose(-2, -1) * 0.3)  # no -inf yet
    # softcap of a masked score: the mask applies after it, so the weight stays 0.
    _, w = qkv.attention(
        q, k, v, mask=masks.causal(), score_mod=scores.softcap(1.0), return_weights=True
    )
    assert (w[0, 0].triu(1) == 0).all()


def test_a_bias_minus_inf_is_a_mask_and_a_fully_masked_row_is_zero():
    q, k, v = make_qkv(1, 2, 2, 5, 6, 4, 3)
    allowed = torch.rand(1, 1, 5, 6, generator=torch.Generator().manual_seed(3)) < 0.5
    allowed[..., 2, :] = False
    bias = torch.zeros(1, 1, 5, 6, dtype=torch.float64).masked_fill(~allowed, -math.inf)
    for backend in ("reference", "sdpa", "tiled"):
        out = qkv.attention(q, k, v, score_mod=scores.bias(bias), backend=backend)
        torch.testing.assert_close(out, qkv.attention(q, k, v, mask=allowed), atol=FLOAT64, rtol=0)
        assert (out[0, :, 2] == 0).all() and not out.isnan().any()
        if backend != "sdpa":
            _, lse = qkv.attention(
                q, k, v, score_mod=scores.bias(bias), backend=backend, return_lse=True
            )
            assert (lse[0, :, 2] == -math.inf).all()
    # softcap keeps a bias's -inf masked, in either order of the chain
    capped = scores.chain(scores.bias(bias), scores.softcap(2.0))
    _, w = qkv.attention(q, k, v, score_mod=capped, return_weights=True)
    assert (w.masked_select(~allowed.expand_as(w)) == 0).all()


def test_attention_weights_and_lse_account_for_the_modification():
    q, k, v = make_qkv(1, 4, 2, 300, 300, 8, 8)
    mod = scores.alibi(scores.alibi_slopes(4)).then(scores.softcap(5.0))
    mask = masks.sliding_window(40)
    _, lse = qkv.attention(q, k, v, mask=mask, score_mod=mod, return_lse=True)
    w = qkv.attention_weights(q, k, lse, mask=mask, score_mod=mod, heads=[1, 3], rows=[0, 150, 299])
    _, full = qkv.attention(q, k, v, mask=mask, score_mod=mod, return_weights=True)
    torch.testing.assert_close(w, full[:, [1, 3]][:, :, [0, 150, 299]], atol=FLOAT64, rtol=0)


def test_explain_shows_the_modified_scores_as_a_step():
    x = qkv.tutorial.sentence_embeddings()
    t = qkv.explain(
        x,
        tokens=qkv.tutorial.SENTENCE,
        mask=masks.causal(),
        score_mod=scores.alibi(torch.tensor([0.5])),
    )
    names = [name for name, _, _ in t.steps()]
    assert names.index("scaled_scores") + 1 == names.index("modified_scores") < names.index("mask")
    i = torch.arange(6)
    torch.testing.assert_close(
        t.modified_scores[0], t.scaled_scores[0] + 0.5 * (i[None, :] - i[:, None])
    )
    assert "alibi(1 heads) applied" in t.to_text()


def test_alibi_slopes_are_the_standard_ones():
    assert torch.equal(scores.alibi_slopes(8), 2.0 ** -torch.arange(1, 9, dtype=torch.float32))
    # 12 heads: the 8 of the power of two below, then every other slope of 16 heads.
    sixteen = 2.0 ** (-0.5 * torch.arange(1, 17, dtype=torch.float64))
    want = torch.cat([2.0 ** -torch.arange(1, 9, dtype=torch.float64), sixteen[0::2][:4]])
    torch.testing.assert_close(scores.alibi_slopes(12), want.float())


def test_alibi_slopes_equal_bloom():
    bloom = pytest.importorskip("transformers.models.bloom.modeling_bloom")
    for heads in (1, 4, 6, 12, 16):
        mask = torch.ones(1, 3)
        alibi = bloom.build_alibi_tensor(mask, heads, torch.float32)  # (heads, 1, 3): slope·j
        torch.testing.assert_close(alibi[:, 0, 1], scores.alibi_slopes(heads))


@pytest.mark.parametrize("bidirectional", [True, False])
def test_relative_buckets_equal_t5(bidirectional):
    t5 = pytest.importorskip("transformers.models.t5.modeling_t5")
    rel = torch.arange(-300, 301)
    want = t5.T5Attention._relative_position_bucket(
        rel, bidirectional=bidirectional, num_buckets=32, max_distance=128
    )
    got = scores.relative_position_bucket(rel, bidirectional=bidirectional)
    assert torch.equal(got, want)
    assert (
        scores.relative_position_bucket(rel.numpy(), bidirectional=bidirectional) == want.numpy()
    ).all()


def test_dispatch_says_where_each_modification_runs():
    q, k, v = make_qkv(1, 4, 4, 64, 64, 8, 8)
    additive = scores.alibi(scores.alibi_slopes(4))
    assert qkv.dispatch(q, k, v, score_mod=additive).backend == "sdpa"
    assert qkv.dispatch(q, k, v, score_mod=scores.softcap(5.0)).backend == "tiled"
    learnable = scores.relative_bias(torch.zeros(32, 4, dtype=torch.float64).requires_grad_())
    assert qkv.dispatch(q, k, v, score_mod=learnable).backend == "tiled"
    assert (
        qkv.dispatch(q, k, v, score_mod=scores.softcap(5.0), dropout_p=0.1).backend == "reference"
    )
    k_nan = k.clone()
    k_nan[0, 0, 3, 0] = math.nan
    assert qkv.dispatch(q, k_nan, v, score_mod=additive).backend == "tiled"
    with pytest.raises(ValueError, match="backend='sdpa' cannot give softcap"):
        qkv.attention(q, k, v, score_mod=scores.softcap(5.0), backend="sdpa")


def test_long_sliding_window_keeps_the_tiled_kernel_with_a_modification():
    q, k, v = make_qkv(1, 2, 2, 4096, 4096, 8, 8, dtype=torch.float32)
    d = qkv.dispatch(
        q, k, v, mask=masks.sliding_window(256), score_mod=scores.alibi(scores.alibi_slopes(2))
    )
    assert d.backend == "tiled" and d.plan.density < 0.1


def test_bad_modifications_raise_clear_errors():
    q, k, v = make_qkv(1, 4, 4, 5, 5, 8, 8)
    cases = [
        (
            lambda: qkv.attention(q, k, v, score_mod=scores.alibi(torch.ones(3))),
            r"alibi slopes must have shape \(H,\) = \(4,\); got \(3,\)",
        ),
        (
            lambda: qkv.attention(q, k, v, score_mod=scores.bias(torch.zeros(5, 6))),
            r"bias must broadcast to \(B, H, T_q, T_k\) = \(1, 4, 5, 5\); got \(1, 1, 5, 6\)",
        ),
        (
            lambda: qkv.attention(q, k, v, score_mod=scores.bias(torch.full((5, 5), math.nan))),
            "bias holds NaN or \\+inf",
        ),
        (
            lambda: qkv.attention(q, k, v, score_mod=scores.relative_bias(torch.zeros(32, 2))),
            r"relative_bias table must have shape \(num_buckets, H\) with H=4; got \(32, 2\)",
        ),
        (lambda: scores.softcap(0.0), "softcap cap must be a finite number > 0; got 0.0"),
        (lambda: qkv.attention(q, k, v, score_mod=3), "score_mod must be a qkv.scores"),
        (
            lambda: qkv.attention(q, k, v, score_mod=lambda s, b, h, qi, kv: s[..., :2]),
            r"must return the score's shape \(1, 4, 5, 5\); got \(1, 4, 5, 2\)",
        ),
    ]
    for call, message in cases:
        with pytest.raises((ValueError, TypeError), match=message):
            call()


def test_a_function_reading_an_undeclared_learnable_tensor_is_refused():
    q, k, v = (x.requires_grad_() for x in make_qkv(1, 2, 2, 6, 6, 4, 4))
    w = torch.tensor(0.5, dtype=torch.float64, requires_grad=True)
    out = qkv.attention(q, k, v, score_mod=lambda s, b, h, qi, kv: s * w, backend="tiled")
    with pytest.raises(ValueError, match="requires a gradient but is not listed"):
        out.sum().backward()
    declared = scores.function(lambda s, b, h, qi, kv: s * w, tensors=[w])
    qkv.attention(q, k, v, score_mod=declared, backend="tiled").sum().backward()
    want = torch.autograd.grad(
        qkv.attention(q, k, v, score_mod=declared, backend="reference").sum(), w
    )[0]
    torch.testing.assert_close(w.grad, want, atol=FLOAT64, rtol=0)


def test_low_precision_applies_the_modification_in_float32():
    q, k, v = make_qkv(1, 4, 4, 200, 200, 16, 16, dtype=torch.bfloat16)
    mod = scores.alibi(scores.alibi_slopes(4)).then(scores.softcap(3.0))
    want = oracle(q, k, v, mask=masks.causal(), score_mod=mod)
    for backend in ("reference", "tiled"):
        out = qkv.attention(q, k, v, mask=masks.causal(), score_mod=mod, backend=backend)
        assert out.dtype == torch.bfloat16
        assert np.abs(out.double().numpy() - want).max() < LOW_PRECISION[torch.bfloat16]


def test_a_function_reading_float64_computes_in_the_call_s_dtype_on_every_backend():
    # A float64 table read by a float32 call's score function: every backend computes the
    # modified scores in float32 (it once failed with torch's raw dtype error on some).
    q, k, v = (x.float() for x in make_qkv(1, 2, 2, 9, 11, 4, 4))
    table = torch.randn(9, 11, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    mod = scores.function(lambda s, b, h, qi, kv: s + table[qi - 2, kv], "table")
    # (the oracle indexes with NumPy arrays: float64 reference stands in, itself held to the
    # oracle by test_every_backend_matches_the_oracle)
    want = qkv.attention(q.double(), k.double(), v.double(), score_mod=mod, backend="reference")
    for backend in ("reference", "tiled", "auto"):
        got = qkv.attention(q, k, v, score_mod=mod, backend=backend)
        assert got.dtype == torch.float32, backend
        np.testing.assert_allclose(got.double().numpy(), want.numpy(), atol=1e-5, err_msg=backend)
