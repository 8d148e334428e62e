"""qkv.learn.pretrained: the induction model trained here once from its recorded recipe, held
to the head scores recorded for it, kept and reused; and the commands that open it when given
no checkpoint."""

import json
import os

import numpy as np
import pytest
import torch

import qkv
from qkv import heads
from qkv.cli import main
from qkv.learn import trained
from qkv.learn.trained import RECIPES, Recipe, pretrained, pretrained_run
from qkv.training import load_checkpoint, read_config, read_state
from tests.browser import needs_browser, page_data


@pytest.fixture(scope="module")
def induction():
    """The pretrained induction run, in the test run's cache directory (tests/conftest.py):
    trained here by the first test that asks (about 40 s), then reused."""
    return pretrained_run("induction", progress=False)


def test_the_pretrained_model_is_its_recipe_and_holds_its_recorded_scores(induction):
    recipe = RECIPES["induction"]
    config, state = read_config(induction), read_state(induction)
    assert (config["preset"], config["seed"], state["step"]) == (
        recipe.preset,
        recipe.seed,
        recipe.steps,
    )
    assert recipe.command == "qkv train --preset induction --seed 0 --steps 1200"
    model = pretrained("induction", progress=False)
    scores = heads.head_scores(model)["induction"].numpy()
    # Recorded on an AMD EPYC Zen 4 and equal to 3 decimals when pinned to AVX2; another CPU
    # rounds the 1,200 steps differently, so each head may move a little, not its role.
    np.testing.assert_allclose(scores, np.array(recipe.induction), atol=0.08)
    assert (scores[1] >= 0.4).all() and (scores[0] <= 0.1).all()
    # An induction head on sequences the run never saw (another seed, more of them).
    held_out = heads.head_scores(model, batch=32, seed=123)["induction"]
    assert held_out.max() >= 0.4


def test_a_kept_run_is_loaded_not_trained_again(induction, monkeypatch):
    monkeypatch.setattr(trained, "train", lambda *a, **k: pytest.fail("trained again"))
    assert pretrained_run("induction") == induction
    assert isinstance(pretrained("induction"), qkv.models.GPT)


@pytest.fixture
def tiny_recipe(monkeypatch, tmp_path):
    """A recipe that trains in a second (the tiny preset), in a cache directory of its own."""
    monkeypatch.setenv("QKV_CACHE_DIR", str(tmp_path))
    recipe = Recipe(preset="tiny", seed=3, steps=4, induction=((0.0,) * 2,) * 2, about="a test")
    monkeypatch.setitem(RECIPES, "tiny-test", recipe)
    return tmp_path / "pretrained" / "tiny-test-seed3-4"


def test_the_first_call_trains_and_says_so_then_keeps_the_run(tiny_recipe, capsys):
    run = pretrained_run("tiny-test")
    assert run == tiny_recipe and read_state(run)["step"] == 4
    assert "training the pretrained 'tiny-test' model once" in capsys.readouterr().err
    # nothing but the kept run is left beside it (the scratch folder is gone)
    assert [p.name for p in run.parent.iterdir()] == [run.name]
    pretrained_run("tiny-test")
    assert "training" not in capsys.readouterr().err


def test_an_unfinished_or_damaged_run_is_trained_again(tiny_recipe):
    run = pretrained_run("tiny-test", progress=False)
    state = run / "latest" / "state.json"
    state.write_text(json.dumps({**json.loads(state.read_text()), "step": 2}))
    assert read_state(pretrained_run("tiny-test", progress=False))["step"] == 4
    before = load_checkpoint(run).wte.weight
    weights = run / "latest" / "model.safetensors"
    weights.write_bytes(os.urandom(weights.stat().st_size))
    model = pretrained("tiny-test", progress=False)  # damaged weights: trained again, the same
    assert torch.equal(model.wte.weight, before)


def test_an_unknown_name_is_refused():
    with pytest.raises(ValueError, match="no pretrained model 'gpt5'"):
        pretrained("gpt5")


def test_heads_and_view_open_the_pretrained_model_without_a_checkpoint(induction, tmp_path, capsys):
    assert main(["heads", "--json", "--no-png"]) == 0
    captured = capsys.readouterr()
    assert str(induction) in captured.err
    assert max(json.loads(captured.out)["induction"][1]) >= 0.4
    html = tmp_path / "v.html"
    assert main(["view", "--out", str(html)]) == 0
    data = page_data(html.read_text())
    final = np.array(data["frames"][-1]["scores"]["induction"])
    assert data["opened"] == list(divmod(int(final.argmax()), final.shape[1]))
    assert data["opened"][0] == 1
    assert len(data["frames"]) == 12  # the 11 snapshots before the end, then the final model


def test_explain_traces_the_pretrained_induction_layer(induction, tmp_path, capsys):
    assert main(["explain", "--pretrained", "induction", "--json", "--no-png"]) == 0
    trace = json.loads(capsys.readouterr().out)
    assert trace["title"].startswith("the pretrained induction model, layer 1,")
    weights = np.array(trace["steps"]["weights"])  # (heads, T, T) over 8 tokens, then the same 8
    assert weights.shape == (4, 16, 16)
    hits = [weights[:, i].mean(0).argmax() == i - 7 for i in range(8, 16)]
    assert sum(hits) >= 6  # the second copy looks one place past the first occurrence


@pytest.mark.parametrize(
    "argv, message",
    [
        (["explain", "--pretrained", "induction", "--prompt", "abc"], "not text"),
        (["explain", "--pretrained", "induction", "--layer", "2"], "--layer must be 0 .. 1"),
        (["explain", "--pretrained", "induction", "--heads", "2"], "do not apply"),
        (["explain", "--layer", "1"], "give --checkpoint DIR or --pretrained"),
    ],
)
def test_explain_pretrained_errors(induction, argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--no-png"])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


@needs_browser
def test_the_viewer_opens_on_the_strongest_induction_head(induction, tmp_path):
    from qkv.view import view
    from tests.browser import Browser

    model = pretrained("induction")
    tokens = heads.repeated_tokens(model.config.vocab_size, 16, batch=1, seed=1)[0]
    path = tmp_path / "heads.html"
    page = view(model, tokens)
    page.save(path)
    with Browser() as b:
        b.open(path)
        assert b.eval("JSON.stringify([qkvView.state.layer, qkvView.state.head])") == (
            json.dumps(list(page.opened)).replace(" ", "")
        )
        title = b.eval("document.getElementById('qkv-detail-title').textContent")
        assert title.startswith(f"layer {page.opened[0]}, head {page.opened[1]}")
        assert b.eval("document.querySelector('#qkv-steps table').rows.length") > 1
