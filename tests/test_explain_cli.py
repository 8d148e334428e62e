"""qkv.explain, the heatmap and the qkv command."""

import json
import subprocess
import sys

import pytest
import torch

import qkv
from qkv import masks, tutorial
from qkv.cli import main

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


def test_explain_errors():
    with pytest.raises(ValueError, match="x must be a \\(T, E\\) tensor"):
        qkv.explain(X[None])
    with pytest.raises(ValueError, match="tokens must have one label per row of x: T=6; got 2"):
        qkv.explain(X, tokens=["a", "b"])


def test_cli_explain_default(tmp_path, capsys):
    png = tmp_path / "a.png"
    assert main(["explain", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "SelfAttention(d_in=3, d_out=2), seed 789" in out
    assert "-0.0739" in out  # seed 004's SelfAttention_v2 output, first token
    assert png.exists()  # matplotlib is in the dev extra


def test_cli_explain_options(tmp_path, capsys):
    data = tmp_path / "in.json"
    data.write_text(json.dumps({"tokens": ["a", "b", "c"], "embeddings": [[1, 0], [0, 1], [1, 1]]}))
    assert (
        main(
            [
                "explain",
                "--input",
                str(data),
                "--heads",
                "2",
                "--d-out",
                "4",
                "--causal",
                "--json",
                "--no-png",
            ]
        )
        == 0
    )
    trace = json.loads(capsys.readouterr().out)
    assert trace["tokens"] == ["a", "b", "c"] and len(trace["steps"]["weights"]) == 2
    assert (
        main(["explain", "--tokens", "x y", "--embeddings", "1,2;3,4", "--simplified", "--no-png"])
        == 0
    )
    assert "simplified attention" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv,words",
    [
        (["explain", "--heads", "3", "--no-png"], "d_out must be a multiple of num_heads"),
        (["explain", "--tokens", "a b", "--no-png"], "2 tokens but 6 embedding rows"),
        (["explain", "--embeddings", "1,x"], "embeddings must be rows of comma-separated numbers"),
        (["explain", "--heads", "0"], "must be a whole number >= 1"),
        (
            ["explain", "--input", "/nonexistent.json", "--no-png"],
            "cannot read tokens and embeddings",
        ),
        (["mask", "sliding_window", "--window", "-2"], "must be a whole number >= 1"),
        (["mask", "nope"], "invalid choice"),
    ],
)
def test_cli_bad_options_get_a_message_not_a_traceback(argv, words, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err


def test_cli_mask_picture(capsys):
    assert main(["mask", "causal", "--size", "3"]) == 0
    assert capsys.readouterr().out.splitlines()[1:] == ["█ · ·", "█ █ ·", "█ █ █"]
    assert main(["mask", "document", "--size", "4", "--ids", "0,0,1,1"]) == 0
    assert "document([0, 0, 1, 1])" in capsys.readouterr().out


def test_python_dash_m(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "qkv", "mask", "sliding_window", "--size", "4", "--window", "2"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert r.returncode == 0 and "· █ █ ·" in r.stdout
