"""Multi-head latent attention (src/qkv/nn/mla.py): its two forms agree, decoding through
the latent cache equals the whole causal forward, and transformers' DeepseekV3Attention
converts to a module equal to its eager output."""

import dataclasses

import pytest
import torch

import qkv
from qkv.nn import LatentCache, MultiHeadLatentAttention

SMALL = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)
DEEPSEEK = dict(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)


def make(q_lora_rank=None, sizes=SMALL, E=48, H=4, dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    mla = MultiHeadLatentAttention(E, H, q_lora_rank=q_lora_rank, **sizes).to(dtype)
    with torch.no_grad():  # the RMS norms' gains away from 1, so that a gain left out shows
        for p in mla.parameters():
            if p.ndim == 1:
                p.uniform_(0.5, 1.5)
    return mla


@pytest.mark.parametrize("q_lora_rank", [None, 20])
@pytest.mark.parametrize("mask", ["none", "window", "dense"])
def test_the_two_forms_are_one_attention(q_lora_rank, mask):
    """Forward and gradients: absorbing W_UK into the query and W_UV into the output only
    regroups the products (float64, to rounding)."""
    mla = make(q_lora_rank)
    x = torch.randn(2, 9, 48, dtype=torch.float64)
    m = {
        "none": None,
        "window": qkv.masks.sliding_window(3),
        "dense": torch.rand(2, 9, 9, generator=torch.Generator().manual_seed(1)) < 0.7,
    }[mask]
    outs, grads = [], []
    for form in ("expanded", "absorbed"):
        out = mla(x, mask=m, form=form)
        (out * torch.linspace(-1, 1, 48, dtype=torch.float64)).sum().backward()
        outs.append(out.detach())
        grads.append([p.grad.clone() for p in mla.parameters()])
        mla.zero_grad()
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-12)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11)


@pytest.mark.parametrize("form", [None, "expanded", "absorbed"])
def test_decoding_through_the_latent_cache_equals_the_causal_forward(form):
    """A prompt of 5 tokens, then one token at a time: each step's output equals the whole
    sequence's causal forward at that position."""
    mla = make(20)
    x = torch.randn(2, 12, 48, dtype=torch.float64)
    want = mla(x)
    cache = mla.new_cache(batch=2, max_len=12)
    got = [mla(x[:, :5], cache=cache, form=form)]
    got += [mla(x[:, t : t + 1], cache=cache, form=form) for t in range(5, 12)]
    torch.testing.assert_close(torch.cat(got, 1), want, rtol=0, atol=1e-12)
    assert cache.length == 12


def test_the_module_chooses_its_form_and_dispatch_says_which():
    """No cache: expanded; a decode step over the cache: absorbed — one key/value head of
    D = r + rope over the cached rows, the values a view of their first r columns."""
    mla = make(sizes=DEEPSEEK, E=64, H=2, dtype=torch.float32)
    x = torch.randn(1, 40, 64)
    assert mla.choose(40, None)[0] == "expanded"
    assert mla.dispatch(x).reason.startswith("expanded form (no cache")
    cache = mla.new_cache(1, 64)
    mla(x, cache=cache)
    assert mla.choose(1, cache)[0] == "absorbed"
    assert mla.choose(200, cache)[0] == "expanded"  # 200 · (1024 - 256) > 512 · 256
    d = mla.dispatch(x[:, :1], cache=cache)
    assert d.reason.startswith("absorbed form") and "D = 576, D_v = 512" in d.reason
    assert cache.length == 40  # dispatch stores nothing


def test_the_deepseek_head_shapes_run_natively_and_agree():
    """DeepSeek V3's sizes (2 of its heads): the expanded form attends D = 192 / D_v = 128
    and the absorbed one D = 576 / D_v = 512 over one key/value head; under a sliding window
    both run in qkv's native kernel where it is built, and agree in float32."""
    from qkv.kernels.tiled import steps

    mla = make(sizes=DEEPSEEK, E=64, H=2, dtype=torch.float32)
    x = torch.randn(1, 1100, 64)  # enough scores for the tiled kernel
    window = qkv.masks.sliding_window(32)
    paths = {f: mla.dispatch(x, mask=window, form=f).path for f in ("expanded", "absorbed")}
    if steps.available(torch.float32):
        assert paths == {"expanded": "tiled-native", "absorbed": "tiled-native"}
    a = mla(x, mask=window, form="expanded")
    b = mla(x, mask=window, form="absorbed")
    torch.testing.assert_close(a, b, rtol=0, atol=2e-5)


def test_the_latent_cache_holds_r_plus_rope_values_per_token():
    mla = make(sizes=DEEPSEEK, E=64, H=2, dtype=torch.float32)
    cache = mla.new_cache(batch=3, max_len=8)
    assert {n: tuple(t.shape) for n, t in cache.tensors().items()} == {"rows": (3, 1, 8, 576)}
    assert cache.bytes_per_token() == 576 * 4
    assert "LatentCache(batch=3" in repr(cache)


def test_bad_input_gets_a_clear_error():
    mla = make()
    x = torch.randn(1, 4, 48, dtype=torch.float64)
    with pytest.raises(ValueError, match="form must be one of"):
        mla(x, form="compressed")
    with pytest.raises(ValueError, match=r"\(B, T, E\)"):
        mla(x[0])
    cache = mla.new_cache(1, 5)
    mla(x, cache=cache)
    with pytest.raises(ValueError, match="overflow"):
        mla(x[:, :2], cache=cache)
    rows = torch.zeros(1, 1, 1, 40, dtype=torch.float64)
    with pytest.raises(ValueError, match="a view of the rows"):
        cache.attend(
            torch.zeros(1, 4, 1, 40, dtype=torch.float64),
            rows,
            torch.zeros(1, 1, 1, 32, dtype=torch.float64),
            mask=None,
            causal=True,
            dropout_p=0.0,
            sinks=None,
        )
    with pytest.raises(TypeError, match="holds torch.float64"):
        LatentCache(1, 4, 32, 8, dtype=torch.float64).append(torch.zeros(1, 1, 1, 40))
    with pytest.raises(ValueError, match="qk_rope_head_dim"):
        MultiHeadLatentAttention(48, 4, rope=qkv.RoPE(4), **SMALL)


def test_a_latent_attention_gpt_trains_and_decodes_through_its_caches():
    """GPTConfig(attention="mla"): a few steps of training lower the loss; greedy decoding
    through the latent caches equals decoding without a cache; paged caches and context
    parallelism are refused, not run wrongly."""
    from qkv.models import GPT, GPTConfig

    torch.manual_seed(0)
    config = GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32, attention="mla")
    model = GPT(config)
    assert isinstance(model.layers[0].attn, MultiHeadLatentAttention)
    assert model.layers[0].attn.kv_lora_rank == 64  # 4 · head width
    data = torch.arange(33).repeat(8, 1) % 7  # a repeating pattern
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        logits = model(data[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), data[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    prompt = data[:2, :6]
    cached = model.generate(prompt, 12, temperature=0.0)
    assert torch.equal(cached, model.generate(prompt, 12, temperature=0.0, use_cache=False))
    assert all(isinstance(c, LatentCache) for c in model.new_caches(1))
    with pytest.raises(ValueError, match="no paged caches"):
        model.new_paged_caches(8)
    assert GPT(GPTConfig.from_dict(config.to_dict())).config == config


@pytest.mark.parametrize(
    "bad",
    [dict(n_kv_head=1), dict(n_head=4, n_embd=24), dict(kv_lora_rank=0)],
)
def test_a_latent_attention_gpt_config_says_what_it_cannot_take(bad):
    from qkv.models import GPTConfig

    with pytest.raises(ValueError, match="mla|kv_lora_rank"):
        GPTConfig(**{"n_head": 2, "n_embd": 32, "attention": "mla", **bad})
    with pytest.raises(ValueError, match="kv_lora_rank"):
        GPTConfig(kv_lora_rank=16)  # only for attention="mla"


transformers = pytest.importorskip("transformers")


def deepseek(q_lora_rank, interleave, yarn, seed=0):
    """A one-layer DeepseekV3Attention with random weights (norm gains away from 1), eager,
    and its model's rotary embedding."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if yarn:  # DeepSeek V3's own scaling: YaRN with mscale over every dim
        rope = {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 40.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        }
    config = transformers.DeepseekV3Config(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        max_position_embeddings=2560,
        rope_parameters=rope,
        rope_interleave=interleave,
        attention_bias=False,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    attn = hf.DeepseekV3Attention(config, layer_idx=0).eval()
    with torch.no_grad():
        for p in attn.parameters():
            if p.ndim == 1:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.1)
    return attn, hf.DeepseekV3RotaryEmbedding(config)


def eager(attn, rotary, x):
    T = x.shape[1]
    positions = torch.arange(T)[None]
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        return attn(x, rotary(x, positions), mask)[0]


@pytest.mark.parametrize("q_lora_rank", [None, 24])
@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("yarn", [False, True])
def test_from_huggingface_equals_deepseek_v3_eager(q_lora_rank, interleave, yarn):
    attn, rotary = deepseek(q_lora_rank, interleave, yarn)
    mla = MultiHeadLatentAttention.from_huggingface(attn)
    assert mla.causal and mla.scale == attn.scaling
    x = torch.randn(2, 11, 64)
    want = eager(attn, rotary, x)
    with torch.no_grad():
        for form in ("expanded", "absorbed"):
            torch.testing.assert_close(mla(x, form=form), want, rtol=0, atol=2e-5)
        cache = mla.new_cache(2, 11)
        steps = [mla(x[:, :4], cache=cache)] + [
            mla(x[:, t : t + 1], cache=cache) for t in range(4, 11)
        ]
    torch.testing.assert_close(torch.cat(steps, 1), want, rtol=0, atol=2e-5)


def test_from_huggingface_keeps_the_dtype_and_refuses_what_it_cannot_read():
    attn, _ = deepseek(None, False, False)
    assert MultiHeadLatentAttention.from_huggingface(
        attn.to(torch.bfloat16)
    ).kv_b_proj.weight.dtype == (torch.bfloat16)
    with pytest.raises(TypeError, match="rotary embedding"):
        MultiHeadLatentAttention.from_huggingface(dataclasses.make_dataclass("Fake", [])())


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8, torch.float8_e4m3fn])
def test_a_paged_latent_cache_decodes_like_the_whole_forward(dtype):
    """Two sequences in one pool of pages: a prompt each, then one token at a time, each
    step's rows read where they lie (dispatch says so); float32 equals the causal forward
    to rounding, int8 and e4m3 within their rounding of the latents."""
    from qkv.serving import PagedLatentCache

    torch.manual_seed(0)
    mla = make(sizes=dict(SMALL, qk_rope_head_dim=16), E=48, dtype=torch.float32)
    x = torch.randn(2, 10, 48)
    pool = PagedLatentCache(16, 4, 32, 16, dtype=dtype)
    seqs = [pool.new_sequence(), pool.new_sequence()]
    with torch.no_grad():
        want = mla(x)
        steps = [mla(x[:, :3], cache=pool.batch(seqs))]
        assert mla.dispatch(x[:, 3:4], cache=pool.batch(seqs)).path == "paged"
        steps += [mla(x[:, t : t + 1], cache=pool.batch(seqs)) for t in range(3, 10)]
    err = (torch.cat(steps, 1) - want).abs().max()
    assert err < (1e-5 if dtype == torch.float32 else 0.05 * want.abs().max())
    assert pool.lengths(seqs).tolist() == [10, 10] and pool.pages_in_use == 6
    assert set(pool.tensors()) == ({"rows"} if dtype == torch.float32 else {"rows", "scales"})


def test_a_ragged_paged_latent_batch_keeps_each_sequence_to_its_own_rows():
    """Sequences of 3 and 6 rows (one forked from a shared prompt) decode together, a
    token and then a chunk of two (gathered, each to its own rows): each equals decoding
    alone. The expanded form over a ragged batch is refused, as are bad rows."""
    from qkv.serving import PagedLatentCache

    torch.manual_seed(1)
    mla = make(sizes=dict(SMALL, qk_rope_head_dim=16), E=48, dtype=torch.float32)
    x = torch.randn(2, 9, 48)
    pool = PagedLatentCache(16, 4, 32, 16)
    a = pool.new_sequence()
    with torch.no_grad():
        mla(x[:1, :3], cache=pool.batch([a]))
        b = pool.fork(a)
        mla(x[1:, 3:6], cache=pool.batch([b]))  # b: the shared 3, then 3 of its own
        ax, bx = x[0, :3], torch.cat([x[0, :3], x[1, 3:6]])
        step = mla(torch.stack([x[0, 3:4], x[1, 6:7]]), cache=pool.batch([a, b]))
        chunk = mla(torch.stack([x[0, 4:6], x[1, 7:9]]), cache=pool.batch([a, b]), form="absorbed")
        alone_a = mla(torch.cat([ax, x[0, 3:6]])[None])
        alone_b = mla(torch.cat([bx, x[1, 6:9]])[None])
        torch.testing.assert_close(step[0], alone_a[0, 3:4], rtol=0, atol=2e-6)
        torch.testing.assert_close(step[1], alone_b[0, 6:7], rtol=0, atol=2e-6)
        torch.testing.assert_close(chunk[0], alone_a[0, 4:6], rtol=0, atol=2e-6)
        torch.testing.assert_close(chunk[1], alone_b[0, 7:9], rtol=0, atol=2e-6)
        with pytest.raises(ValueError, match="different numbers of rows"):
            mla(torch.randn(2, 1, 48), cache=pool.batch([a, b]), form="expanded")
    q = torch.zeros(1, 1, 1, 48)
    bad = torch.zeros(1, 1, 1, 48)
    with pytest.raises(ValueError, match="a view of the rows"):
        pool.batch([a]).attend(q, bad, torch.zeros(1, 1, 1, 32), mask=None, causal=True,
                               dropout_p=0.0, sinks=None)  # fmt: skip
    with pytest.raises(TypeError, match="holds torch.float32"):
        pool.batch([a]).store(bad.double())
    quantized = PagedLatentCache(4, 4, 32, 16, dtype=torch.int8)
    s = quantized.new_sequence()
    bad[0, 0, 0, 3] = float("inf")
    with pytest.raises(ValueError, match=f"latent row of sequence {s} at position 0"):
        quantized.batch([s]).store(bad)


def test_a_latent_attention_gpt_trains_through_qkv_train_and_its_heads_score(tmp_path):
    """The training loop's evaluation scores every head, copying included: for latent
    attention each head's value path is W_UV[h] after the latent's norm (its gain)."""
    from qkv.heads import copying_scores
    from qkv.models import GPTConfig
    from qkv.training import load_checkpoint, train

    config = GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32, attention="mla")
    train(tmp_path / "run", preset="tiny", model_config=config, steps=3, progress=False)
    model = load_checkpoint(tmp_path / "run")
    scores = copying_scores(model)
    assert scores.shape == (2, 2) and torch.isfinite(scores).all()
