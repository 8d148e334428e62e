"""Hugging Face models whose attention needs more than a mask — Gemma 2 (soft-capping,
alternating sliding-window layers), Mistral (sliding window), Qwen2 (GQA), T5 (relative
position bias) — run on qkv and agree with transformers' eager attention. Small random
configs built here; nothing is downloaded."""

import copy

import pytest
import torch

import qkv

transformers = pytest.importorskip("transformers")

from qkv.integrations import huggingface  # noqa: E402

TOL = 1e-5  # float32, last hidden state, the bound


def configs():
    t = transformers
    small = dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2)
    return {
        # A cap small enough to matter at these score sizes (Gemma 2 uses 50 on real ones).
        "gemma2": (t.Gemma2Model, t.Gemma2Config(**small, head_dim=8, sliding_window=5,
                                                  attn_logit_softcapping=0.5)),
        "mistral": (t.MistralModel, t.MistralConfig(**small, sliding_window=5)),
        "qwen2": (t.Qwen2Model, t.Qwen2Config(**small)),
    }


def pair(model_class, config):
    """The same random weights under qkv and under eager attention."""
    huggingface.register()
    torch.manual_seed(0)
    # Each model its own config: _from_config sets the implementation on the config object.
    ours = model_class._from_config(copy.deepcopy(config), attn_implementation="qkv").eval()
    with torch.no_grad():  # scores of order 1, not the ~1e-3 of a fresh init: caps bite
        for name, param in ours.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight", ".q.weight", ".k.weight")):
                param.mul_(20.0)
    eager = model_class._from_config(copy.deepcopy(config), attn_implementation="eager").eval()
    eager.load_state_dict(ours.state_dict())
    assert ours.config._attn_implementation == "qkv" != eager.config._attn_implementation
    return ours, eager


def batch(T=13):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 100, (2, T), generator=g)
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, :4] = 0  # left padding
    return ids, mask


@pytest.mark.parametrize("name", ["gemma2", "mistral", "qwen2"])
def test_decoder_models_match_eager_on_a_padded_batch(name, monkeypatch):
    model_class, config = configs()[name]
    ours, eager = pair(model_class, config)
    ids, mask = batch()
    calls = []  # proof that qkv ran: one call per layer per forward
    monkeypatch.setattr(huggingface, "attention",
                        lambda *a, **kw: calls.append(kw) or qkv.attention(*a, **kw))
    with torch.no_grad():
        got = ours(input_ids=ids, attention_mask=mask).last_hidden_state
        want = eager(input_ids=ids, attention_mask=mask).last_hidden_state
        plain = ours(input_ids=ids).last_hidden_state  # no padding: transformers skips masks
        plain_want = eager(input_ids=ids).last_hidden_state
    keep = mask.bool()
    assert (got - want)[keep].abs().max() < TOL
    assert (plain - plain_want).abs().max() < TOL
    assert len(calls) == 2 * config.num_hidden_layers
    if name == "gemma2":
        assert repr(calls[0]["score_mod"]) == "softcap(0.5)"


def test_gemma2_softcap_is_applied_not_ignored():
    """The cap changes the answer here, so agreeing with eager means qkv applied it."""
    model_class, config = configs()["gemma2"]
    ours, eager = pair(model_class, config)
    uncapped_config = type(config)(**{**config.to_dict(), "attn_logit_softcapping": None})
    uncapped = model_class._from_config(uncapped_config, attn_implementation="eager").eval()
    assert ours.config._attn_implementation == "qkv"
    uncapped.load_state_dict(ours.state_dict())
    ids, _ = batch()
    with torch.no_grad():
        want = eager(input_ids=ids).last_hidden_state
        assert (uncapped(input_ids=ids).last_hidden_state - want).abs().max() > 1e-3
        assert (ours(input_ids=ids).last_hidden_state - want).abs().max() < TOL


def test_t5_relative_position_bias_matches_eager():
    config = transformers.T5Config(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                   num_heads=4, relative_attention_num_buckets=8,
                                   relative_attention_max_distance=16)
    ours, eager = pair(transformers.T5Model, config)
    ids, mask = batch()
    decoder_ids = torch.randint(0, 100, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = ours(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids)
        want = eager(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids)
    keep = mask.bool()
    assert (got.encoder_last_hidden_state - want.encoder_last_hidden_state)[keep].abs().max() < TOL
    assert (got.last_hidden_state - want.last_hidden_state).abs().max() < TOL


def test_an_argument_qkv_cannot_honour_is_refused():
    class Module(torch.nn.Module):
        is_causal = True

    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match=r"cannot honour the attention argument\(s\) s_aux"):
        huggingface.qkv_attention_forward(Module(), q, q, q, None, s_aux=torch.zeros(2))
    out, _ = huggingface.qkv_attention_forward(Module(), q, q, q, None, position_ids=None,
                                               sliding_window=2)
    assert out.shape == (1, 3, 2, 4)
