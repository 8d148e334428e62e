"""benchmarks/induction_paper.py: the paper's experiment reads its runs and ablates heads as
the docs say (on a tiny run; the real runs take an hour: docs/induction.md)."""

import importlib.util
from pathlib import Path

import pytest
import torch

from qkv.heads import ablate, icl_score, per_token_loss
from qkv.training import PRESETS, load_checkpoint, train, validation_windows

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "induction_paper.py"


@pytest.fixture(scope="module")
def paper():
    spec = importlib.util.spec_from_file_location("induction_paper", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_run_is_a_preset(paper):
    assert set(paper.RUNS.values()) <= set(PRESETS)
    model, cfg = PRESETS["paper-words-2l"]
    assert cfg.data == "words" and model.n_layer == 2 and model.attention_only
    assert PRESETS["paper-repeats-1l"][0].n_layer == 1
    assert PRESETS["paper-words-2l-mlp"][0].attention_only is False


def test_a_run_is_summarised_and_ablated_as_the_docs_say(paper, tmp_path):
    out = tmp_path / "run"
    train(out, preset="tiny", progress=False)
    found = paper.summarise(out)
    assert found["steps"] == [10, 20] and len(found["icl"]) == 2
    assert found["formed_at"] is None  # 20 steps form no induction head
    a = paper.ablation(out, seed=0)
    assert len(a["top"]) == len(a["random"]) == 2 and not set(a["top"]) & set(a["random"])
    model = load_checkpoint(out)
    x, y = validation_windows(out, paper.WINDOWS)
    with ablate(model, a["top"]):
        expected = icl_score(per_token_loss(model, x, y))
    assert a["icl_without_top"] == pytest.approx(expected)
    assert a["icl"] == pytest.approx(icl_score(per_token_loss(model, x, y)))
    assert paper.spread([1.0, 3.0]) == "+2.000 ± 1.414 (n=2)"
    assert torch.isfinite(torch.tensor(a["copying_top"])).all()
