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
    small = dict(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return {
        # A cap small enough to matter at these score sizes (Gemma 2 uses 50 on real ones).
        "gemma2": (
            t.Gemma2Model,
            t.Gemma2Config(**small, head_dim=8, sliding_window=5, attn_logit_softcapping=0.5),
        ),
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
    monkeypatch.setattr(
        huggingface, "attention", lambda *a, **kw: calls.append(kw) or qkv.attention(*a, **kw)
    )
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
    config = transformers.T5Config(
        vocab_size=100,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
    )
    ours, eager = pair(transformers.T5Model, config)
    ids, mask = batch()
    decoder_ids = torch.randint(0, 100, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = ours(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids)
        want = eager(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids)
    keep = mask.bool()
    assert (got.encoder_last_hidden_state - want.encoder_last_hidden_state)[keep].abs().max() < TOL
    assert (got.last_hidden_state - want.last_hidden_state).abs().max() < TOL


def test_keywords_are_refused_or_ignored_by_one_rule():
    """Refused: a keyword one of transformers' attention functions takes by name (here
    ``cache``) or a tensor (``cu_seq_lens_q``); ignored: flags and ints that no attention
    function reads (``output_router_logits``, ``logits_to_keep``) and the positions
    transformers has already built into the mask."""

    class Module(torch.nn.Module):
        is_causal = True

    q = torch.randn(1, 2, 3, 4)
    for kwargs, refused in [
        ({"cache": object()}, "cache"),
        ({"cu_seq_lens_q": torch.zeros(2)}, "cu_seq_lens_q"),
    ]:
        with pytest.raises(huggingface.Unsupported, match=rf"cannot honour .*{refused}"):
            huggingface.qkv_attention_forward(Module(), q, q, q, None, **kwargs)
    out, _ = huggingface.qkv_attention_forward(
        Module(),
        q,
        q,
        q,
        None,
        position_ids=torch.arange(3)[None],
        output_router_logits=True,
        logits_to_keep=0,
        sliding_window=2,
    )
    assert out.shape == (1, 3, 2, 4)


def spy_masks(monkeypatch):
    """The masks qkv's attention function receives, as their reprs."""
    seen = []

    def spy(*args, **kwargs):
        seen.append(repr(kwargs["mask"]))
        return qkv.attention(*args, **kwargs)

    monkeypatch.setattr(huggingface, "attention", spy)
    return seen


def test_masks_transformers_asks_for_stay_structural(monkeypatch):
    """Causal, sliding-window and padded masks reach qkv as qkv masks, never T_q × T_k."""
    seen = spy_masks(monkeypatch)
    ours, _ = pair(*configs()["gemma2"])  # layers: sliding window, then full causal
    ids, mask = batch()
    with torch.no_grad():
        ours(input_ids=ids, attention_mask=mask)
    assert seen == ["sliding_window(5) & ~padding([0, 4])", "causal() & ~padding([0, 4])"]


@pytest.mark.parametrize("name", ["gemma2", "mistral"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generation_with_caches_matches_eager(name, cache, monkeypatch):
    """Decoding through transformers' dynamic and static caches (key buffers longer than
    the tokens seen: the structural mask carries the queries' offset), padded batch."""
    seen = spy_masks(monkeypatch)
    model_class = {
        "gemma2": transformers.Gemma2ForCausalLM,
        "mistral": transformers.MistralForCausalLM,
    }[name]
    ours, eager = pair(model_class, configs()[name][1])
    ids, mask = batch()
    kw = dict(
        max_new_tokens=8,
        do_sample=False,
        pad_token_id=0,
        cache_implementation=cache,
        output_logits=True,
        return_dict_in_generate=True,
    )
    got = ours.generate(input_ids=ids, attention_mask=mask, **kw)
    want = eager.generate(input_ids=ids, attention_mask=mask, **kw)
    assert torch.equal(got.sequences, want.sequences)
    assert max((a - b).abs().max() for a, b in zip(got.logits, want.logits)) < TOL
    assert seen and all("tensor" not in s for s in seen)


def test_a_structural_mask_is_the_dense_mask_to_any_torch_operation():
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    padding = torch.ones(2, 9, dtype=torch.bool)
    padding[1, :3] = False
    args = dict(
        batch_size=2,
        q_length=4,
        kv_length=9,
        q_offset=5,
        attention_mask=padding,
        mask_function=causal_mask_function,
        allow_is_causal_skip=False,
    )
    ours = huggingface.qkv_mask(**args)
    assert type(ours) is huggingface.StructuralMask and ours.shape == (2, 1, 4, 9)
    want = sdpa_mask(**args)
    assert torch.equal(ours.contiguous(), want) and torch.equal(ours & True, want)
    gaps = padding.clone()
    gaps[0, 4] = False  # a row whose valid keys are not one run: transformers' dense mask
    dense = huggingface.qkv_mask(**{**args, "attention_mask": gaps})
    assert type(dense) is torch.Tensor
    assert torch.equal(dense, sdpa_mask(**{**args, "attention_mask": gaps}))


def gpt_oss_pair():
    """A random gpt-oss (sliding and full layers, learned sinks) under qkv and eager; the
    sinks set away from 0 so that they matter."""
    config = transformers.GptOssConfig(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        pad_token_id=0,
    )
    ours, eager = pair(transformers.GptOssForCausalLM, config)
    with torch.no_grad():
        for model in (ours, eager):
            for layer in model.model.layers:
                layer.self_attn.sinks.copy_(torch.linspace(-1.0, 2.0, 4))
    return ours, eager


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_gpt_oss_with_sinks_matches_eager_logits_generation_and_attentions(cache):
    ours, eager = gpt_oss_pair()
    ids, mask = batch()
    with torch.no_grad():
        got = ours(input_ids=ids, attention_mask=mask, output_attentions=True)
        want = eager(input_ids=ids, attention_mask=mask, output_attentions=True)
    keep = mask.bool()
    assert (got.logits - want.logits)[keep].abs().max() < TOL
    rows = keep[:, None, :].expand(-1, 4, -1)  # (B, H, T_q): the unpadded queries
    for a, b in zip(got.attentions, want.attentions):  # weights without the sink's share
        assert (a - b)[rows].abs().max() < TOL
        assert (a[0].sum(-1) < 0.9).any()  # rows where the sinks took a share
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, cache_implementation=cache)
    assert torch.equal(
        ours.generate(input_ids=ids, attention_mask=mask, **kw),
        eager.generate(input_ids=ids, attention_mask=mask, **kw),
    )


def test_gpt_oss_sinks_learn_as_under_eager():
    """Training: the gradients of the sinks (and of every weight) equal eager's."""
    ours, eager = gpt_oss_pair()
    ids, mask = batch()
    for model in (ours, eager):
        model.train()
        model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
    for (name, a), (_, b) in zip(ours.named_parameters(), eager.named_parameters()):
        if a.grad is not None:
            assert (a.grad - b.grad).abs().max() < 1e-5, name
    assert ours.model.layers[0].self_attn.sinks.grad.abs().max() > 1e-4


def test_check_refuses_families_that_compute_attention_themselves():
    assert huggingface.family(transformers.CodeGenConfig()).own_attention
    with pytest.raises(huggingface.Unsupported, match=r"CodeGen models compute attention"):
        huggingface.check(transformers.CodeGenConfig())
    huggingface.check(transformers.LlamaConfig())  # through the interface: no error
    assert huggingface.family(transformers.DeepseekV4Config()).additive_masks
    assert not huggingface.family(transformers.LlamaConfig()).additive_masks
    assert huggingface.family(None) == huggingface.Family()
