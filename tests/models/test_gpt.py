"""qkv.models.GPT: the model, cached generation, the context window, GPT-2 checkpoints."""

import pytest
import torch

from qkv.models import GPT, GPTConfig
from qkv.models.gpt import UniformAttention

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=61, block_size=24, n_layer=2, n_head=4, n_embd=32)


def model64(**kw):
    torch.manual_seed(0)
    return GPT(GPTConfig(**{**SMALL, **kw})).double().eval()


def prompt(B=2, T=7, V=61, seed=0):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"positions": "rope"},
        {"n_kv_head": 2},
        {"n_kv_head": 1, "positions": "rope"},
        {"attention_only": True},
        {"layer_norm": False, "tie_embeddings": False},
    ],
)
def test_cached_forward_equals_full_forward(kw):
    model, idx = model64(**kw), prompt(T=11)
    full = model(idx)  # (B, T, V)
    caches = model.new_caches(2)
    steps = [model(idx[:, :5], caches=caches)]
    steps += [model(idx[:, t : t + 1], caches=caches) for t in range(5, 11)]
    assert torch.allclose(torch.cat(steps, dim=1), full, atol=1e-10)


@pytest.mark.parametrize("kw", [{}, {"positions": "rope", "n_kv_head": 2}])
def test_greedy_with_and_without_cache_agree_past_the_window(kw):
    # block_size 24: 7 prompt tokens + 40 new ones slide the window 23 times.
    model, idx = model64(**kw), prompt()
    cached = model.generate(idx, 40, temperature=0.0)
    uncached = model.generate(idx, 40, temperature=0.0, use_cache=False)
    assert torch.equal(cached, uncached)
    # The documented window: each token is the argmax over the last block_size tokens.
    seq = idx
    for _ in range(40):
        nxt = model(seq[:, -model.config.block_size :])[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], dim=1)
    assert torch.equal(cached, seq)


def test_a_prompt_longer_than_the_window_is_cropped():
    model, idx = model64(), prompt(T=30)
    out = model.generate(idx, 3, temperature=0.0)
    assert torch.equal(out[:, :30], idx)
    assert torch.equal(out[:, 30], model(idx[:, -24:])[:, -1].argmax(-1))


def test_sampling_is_reproducible_and_top_k_1_is_greedy():
    model, idx = model64(), prompt()

    def sample(seed, **kw):
        return model.generate(idx, 12, generator=torch.Generator().manual_seed(seed), **kw)

    assert torch.equal(sample(3), sample(3))
    assert not torch.equal(sample(3), sample(4))
    greedy = model.generate(idx, 12, temperature=0.0)
    assert torch.equal(sample(5, top_k=1), greedy)
    assert torch.equal(sample(5, top_p=1e-9), greedy)
    assert torch.equal(
        sample(6, top_k=5, top_p=0.5, use_cache=False), sample(6, top_k=5, top_p=0.5)
    )


def test_top_p_keeps_the_smallest_set_reaching_p():
    from qkv.serving import sample as _sample

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    g = torch.Generator().manual_seed(0)
    drawn = {_sample(logits, 1.0, None, 0.75, g).item() for _ in range(300)}
    assert drawn == {0, 1}  # 0.5 < 0.75 <= 0.5 + 0.3


def test_generate_restores_training_mode_and_validates():
    model = model64().train()
    model.generate(prompt(), 2)
    assert model.training
    for bad in [
        dict(max_new_tokens=-1),
        dict(temperature=-1.0),
        dict(top_k=0),
        dict(top_p=0.0),
        dict(top_p=1.5),
    ]:
        args = {"max_new_tokens": 2, **bad}
        with pytest.raises(ValueError, match=next(iter(bad))):
            model.generate(prompt(), args.pop("max_new_tokens"), **args)
    with pytest.raises(ValueError, match="idx must be a"):
        model.generate(torch.zeros(2, 0, dtype=torch.long), 1)


def test_forward_errors_name_the_problem():
    model = model64()
    with pytest.raises(ValueError, match=r"idx must be a \(B, T\) integer tensor"):
        model(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="block_size=24 tokens; got 0 cached \\+ 25 new"):
        model(prompt(T=25))
    with pytest.raises(ValueError, match="one KVCache per layer"):
        model(prompt(), caches=[])


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(n_embd=30), "multiple of n_head"),
        (dict(n_kv_head=3), "multiple of n_kv_head"),
        (dict(positions="alibi"), "positions must be one of"),
        (dict(dropout=1.0), "dropout"),
        (dict(n_layer=0), "n_layer must be an int >= 1"),
    ],
)
def test_config_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**{**SMALL, **bad})
    with pytest.raises(ValueError, match="unknown GPTConfig fields: bogus"):
        GPTConfig.from_dict({**SMALL, "bogus": 1})


def test_structure_tied_head_and_gpt2_init():
    model = GPT(GPTConfig(n_layer=6, n_embd=64, n_head=2))
    assert model.lm_head.weight is model.wte.weight
    stds = [b.attn.out_proj.weight.std().item() for b in model.blocks]
    assert all(abs(s - 0.02 / 12**0.5) < 1e-3 for s in stds)  # 12 residual projections
    assert abs(model.blocks[0].attn.W_query.weight.std().item() - 0.02) < 2e-3
    only = GPT(GPTConfig(attention_only=True, n_layer=2))
    assert all(b.mlp is None for b in only.blocks)
    assert only.num_params() < GPT(GPTConfig(n_layer=2)).num_params()


def test_no_layer_norm_and_an_untied_head():
    model = GPT(GPTConfig(**SMALL, layer_norm=False, tie_embeddings=False))
    norms = [model.ln_f] + [b.ln_1 for b in model.blocks] + [b.ln_2 for b in model.blocks]
    assert all(isinstance(n, torch.nn.Identity) for n in norms)
    assert model.lm_head.weight is not model.wte.weight
    tied = GPT(GPTConfig(**SMALL, layer_norm=False))
    assert model.num_params() - tied.num_params() == SMALL["vocab_size"] * SMALL["n_embd"]
    assert GPTConfig.from_dict(model.config.to_dict()) == model.config


def test_fan_in_initialisation():
    model = GPT(GPTConfig(n_layer=2, n_embd=64, n_head=4, init="fan_in", tie_embeddings=False))
    assert abs(model.wte.weight.std().item() - 1.0) < 0.05
    tied = GPT(GPTConfig(n_layer=2, n_embd=64, n_head=4, init="fan_in"))
    assert abs(tied.wte.weight.std().item() * 8 - 1.0) < 0.05  # the LM head's N(0, 1/E)
    for lin in (
        model.blocks[0].attn.W_query,
        model.blocks[1].attn.out_proj,
        model.blocks[0].mlp.fc,
        model.blocks[0].mlp.proj,
        model.lm_head,
    ):
        assert abs(lin.weight.std().item() * lin.in_features**0.5 - 1.0) < 0.05
    with pytest.raises(ValueError, match="init must be one of"):
        GPTConfig(init="xavier")


def test_uniform_attention_averages_the_past():
    torch.manual_seed(0)
    attn = UniformAttention(8, 8, 2, causal=True).double()
    x = torch.randn(1, 5, 8, dtype=torch.float64)
    v = attn.W_value(x)  # (1, T, E)
    mean = v.cumsum(1) / torch.arange(1, 6, dtype=torch.float64)[:, None]
    assert torch.allclose(attn(x), attn.out_proj(mean), atol=1e-12)


GPT2_CONFIGS = [
    dict(vocab_size=97, n_positions=40, n_embd=48, n_layer=3, n_head=4),
    dict(
        vocab_size=50,
        n_positions=32,
        n_embd=16,
        n_layer=1,
        n_head=1,
        n_inner=40,
        activation_function="gelu",
    ),
    dict(
        vocab_size=128,
        n_positions=64,
        n_embd=64,
        n_layer=2,
        n_head=8,
        activation_function="gelu_pytorch_tanh",
    ),
]


def gpt2(**kw):
    torch.manual_seed(1)
    return transformers.GPT2LMHeadModel(
        transformers.GPT2Config(bos_token_id=0, eos_token_id=0, **kw)
    ).eval()


@pytest.mark.parametrize("kw", GPT2_CONFIGS)
def test_from_huggingface_matches_gpt2_logits_and_greedy_generate(kw):
    hf = gpt2(**kw)
    ours = GPT.from_huggingface(hf).eval()
    idx = torch.randint(0, kw["vocab_size"], (3, 13), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (ours(idx) - hf(idx).logits).abs().max() <= 1e-4
        # Greedy decoding of random weights can meet near-ties that float32 rounding
        # flips either way: compare token for token in float64. The explicit mask stops
        # transformers from treating the prompt's token 0 (pad_token_id) as padding.
        hf64 = hf.double()
        want = hf64.generate(
            idx,
            attention_mask=torch.ones_like(idx),
            max_new_tokens=12,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
    assert torch.equal(GPT.from_huggingface(hf64).generate(idx, 12, temperature=0.0), want)


def test_from_huggingface_reads_a_saved_directory(tmp_path):
    hf = gpt2(**GPT2_CONFIGS[0])
    hf.save_pretrained(tmp_path)
    ours = GPT.from_huggingface(tmp_path).eval()
    idx = prompt(V=97)
    with torch.no_grad():
        assert (ours(idx) - hf(idx).logits).abs().max() <= 1e-4


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(activation_function="relu"), "activation_function='relu'"),
        (dict(scale_attn_by_inverse_layer_idx=True), "scaled other than"),
        (dict(resid_pdrop=0.2), "unequal dropouts"),
    ],
)
def test_from_huggingface_refuses_what_it_cannot_reproduce(kw, match):
    with pytest.raises(ValueError, match=match):
        GPT.from_huggingface(gpt2(**{**GPT2_CONFIGS[1], **kw}))


def test_from_huggingface_bad_arguments(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing is downloaded"):
        GPT.from_huggingface(tmp_path / "missing")
    with pytest.raises(TypeError, match="GPT2LMHeadModel or a directory"):
        GPT.from_huggingface(torch.nn.Linear(2, 2))


def test_uniform_attention_runs_with_a_layout():
    # UniformAttention.project once dropped the positions a context-parallel layout passes
    # (found by mypy: its signature did not match MultiHeadAttention.project), so a uniform
    # GPT called with layout= raised TypeError. One rank on loopback: the same logits.
    import socket
    from datetime import timedelta

    import torch.distributed as dist

    from qkv.distributed import Layout

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=16, attention="uniform"))
    idx = torch.randint(0, 256, (1, 12))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=60),
    )
    try:
        sharded = model(idx, layout=Layout.contiguous(12, 1))
    finally:
        dist.destroy_process_group()
    torch.testing.assert_close(sharded, model(idx), atol=1e-6, rtol=1e-6)
