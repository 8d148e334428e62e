"""qkv.explain, the heatmap and the qkv command."""

import json

import pytest
import torch

import qkv
from qkv import masks, tutorial

X = tutorial.sentence_embeddings()


def test_trace_steps_are_the_real_computation():
    torch.manual_seed(0)
    mha = qkv.MultiHeadAttention(3, 4, num_heads=2, causal=True)
    t = qkv.explain(X, tokens=tutorial.SENTENCE, module=mha)
    assert t.queries.shape == (2, 6, 2) and t.weights.shape == (2, 6, 6)
    torch.testing.assert_close(t.scaled_scores, t.scores * 2**-0.5)
    masked = t.scaled_scores.masked_fill(~t.mask, float("-inf"))
    torch.testing.assert_close(t.weights, torch.softmax(masked, -1))
    torch.testing.assert_close(t.context, t.weights @ t.values)
    torch.testing.assert_close(t.output, mha(X).detach())
    assert [name for name, _, _ in t.steps()] == [
        "inputs",
        "queries",
        "keys",
        "values",
        "scores",
        "scaled_scores",
        "mask",
        "weights",
        "context",
        "output",
    ]


def test_simplified_trace_has_no_weights_and_no_scaling():
    t = qkv.explain(X, mask=masks.causal())
    assert t.scale == 1.0 and torch.equal(t.queries[0], X)
    # Causal row 1 ("journey") sees "Your" and itself, with unscaled dot products.
    want = torch.softmax(torch.stack([X[1] @ X[0], X[1] @ X[1]]), -1)
    torch.testing.assert_close(t.weights[0, 1, :2], want)
    assert (t.weights[0].triu(1) == 0).all()


def test_text_and_json():
    t = qkv.explain(X, tokens=tutorial.SENTENCE)
    text = t.to_text()
    assert "weights — softmax of each row" in text and "journey" in text
    assert "0.4419" in text  # seed 004's context vector of "journey"
    data = json.loads(json.dumps(t.to_dict()))
    assert data["tokens"] == list(tutorial.SENTENCE)
    assert len(data["steps"]["weights"][0]) == 6


def test_heatmap_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "w.png"
    fig = qkv.explain(X, tokens=tutorial.SENTENCE, mask=masks.causal()).heatmap(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == list(tutorial.SENTENCE)
    assert len(fig.axes) == 2  # the panel and its colour bar


def test_heatmap_colours_are_on_0_to_1_and_long_labels_are_shortened(tmp_path):
    # Near-uniform weights (random weights over similar embeddings) must look near-uniform:
    # a scale fitted to their own narrow range made one column glow as if it mattered.
    pytest.importorskip("matplotlib")
    from qkv.learn.viz import heatmap

    w = torch.full((4, 4), 0.25) + torch.arange(16).view(4, 4) * 1e-3
    long = "a_rather_long_identifier_name"
    fig = heatmap(w, ["a", "b", "c", long], ["a", "b", "c", long], path=tmp_path / "u.png")
    assert fig.axes[0].get_images()[0].get_clim() == (0.0, 1.0)
    assert "0–1" in fig.axes[1].get_ylabel()
    ticks = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert ticks[3] == long[:15] + "…" and len(ticks[3]) == 16
    assert any(long in t.get_text() for t in fig.texts)  # the whole label, below


def test_explain_errors():
    with pytest.raises(ValueError, match="x must be a \\(T, E\\) tensor"):
        qkv.explain(X[None])
    with pytest.raises(ValueError, match="tokens must have one label per row of x: T=6; got 2"):
        qkv.explain(X, tokens=["a", "b"])


@pytest.mark.parametrize("variant", ["gqa", "mqa", "mla", "window", "sinks", "sparse"])
def test_every_variant_trace_matches_the_float64_oracle(variant, capsys):
    """``qkv explain --variant``: the weights and context the trace prints are those the
    float64 oracle computes from the trace's own queries, keys and values (query heads
    sharing key/value heads expanded; the sink's logit 1 in every row; the window's and the
    indexer's masks as the trace shows them)."""
    import numpy as np

    from qkv import numpy as qnp
    from qkv.cli.main import main

    assert main(["explain", "--variant", variant, "--json", "--no-png"]) == 0
    trace = json.loads(capsys.readouterr().out)
    steps = {k: np.array(v, dtype=np.float64) for k, v in trace["steps"].items()}
    q, k, v = steps["queries"], steps["keys"], steps["values"]
    H, H_kv = q.shape[0], k.shape[0]
    assert H_kv == {"gqa": 2, "mqa": 1, "mla": 1}.get(variant, H)
    mask = steps["mask"].astype(bool)
    T = q.shape[1]
    assert not (mask & ~np.tri(T, dtype=bool)).any()  # causal, whatever else
    if variant == "window":
        assert mask.sum(-1).max() == 2
    if variant == "sparse":
        assert mask.sum(-1).max() <= 2
    want = qnp.attention(
        q[None],
        np.repeat(k, H // H_kv, 0)[None],
        np.repeat(v, H // H_kv, 0)[None],
        mask=mask,
        scale=trace["scale"],
        sinks=np.full(H, 1.0) if variant == "sinks" else None,
        return_weights=True,
    )
    np.testing.assert_allclose(steps["context"], want[0][0], atol=1e-5)
    np.testing.assert_allclose(steps["weights"], want[1][0], atol=1e-5)
    assert variant in trace["title"] and "untrained" in trace["title"]
