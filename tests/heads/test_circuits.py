"""qkv.heads' circuit measurements: per-token loss, the ICL score, copying scores, ablation."""

import copy

import pytest
import torch
import torch.nn.functional as F

from qkv import heads
from qkv.models import GPT, GPTConfig
from tests.helpers import tiny_llama


def gpt(**kw):
    torch.manual_seed(0)
    cfg = {"block_size": 24, "n_layer": 2, "n_head": 4, "n_embd": 32, "vocab_size": 40, **kw}
    return GPT(GPTConfig(**cfg)).eval()


def tokens(n=6, t=24, vocab=40, seed=1):
    return torch.randint(0, vocab, (n, t), generator=torch.Generator().manual_seed(seed))


def llama():
    return tiny_llama("LlamaForCausalLM", vocab_size=40)


def test_per_token_loss_is_the_cross_entropy_at_each_position():
    model, x = gpt(), tokens()
    with torch.no_grad():
        logits = model(x[:, :-1])
    expected = F.cross_entropy(logits.transpose(1, 2), x[:, 1:], reduction="none").mean(0)
    found = heads.per_token_loss(model, x, batch_size=4)  # two batches, one partial
    assert found.shape == (23,)
    torch.testing.assert_close(found, expected.double(), rtol=1e-6, atol=1e-6)
    with_targets = heads.per_token_loss(model, x[:, :-1], x[:, 1:])
    torch.testing.assert_close(with_targets, found)


def test_per_token_loss_reads_hugging_face_logits():
    model, x = llama(), tokens()
    with torch.no_grad():
        logits = model(x[:, :-1]).logits
    expected = F.cross_entropy(logits.transpose(1, 2), x[:, 1:], reduction="none").mean(0)
    torch.testing.assert_close(
        heads.per_token_loss(model, x), expected.double(), rtol=1e-6, atol=1e-6
    )


def test_icl_score_is_late_minus_early():
    losses = torch.arange(11, dtype=torch.float64)  # loss = position
    assert heads.icl_positions(11) == (1, 10)
    assert heads.icl_score(losses) == 9.0
    assert heads.icl_score(losses, early=2, late=5) == 3.0
    assert heads.icl_score(losses, early=2, late=8, band=1) == 6.0  # 8 - 2 on averages
    long = torch.arange(64, dtype=torch.float64) ** 2  # the default band: 64 // 32 = 2
    assert heads.icl_score(long) == pytest.approx(
        long[61:64].mean().item() - long[4:9].mean().item()
    )
    assert heads.icl_score(long, band=0) == long[63].item() - long[6].item()
    for bad in ({"early": 5, "late": 5}, {"early": 0, "late": 11}, {"band": -1}):
        with pytest.raises(ValueError):
            heads.icl_score(losses, **bad)


def eigen_score(full):
    """The score from the full (V, V) circuit (float64: its V - D zero eigenvalues stay ~0)."""
    eig = torch.linalg.eigvals(full)
    return (eig.sum().real / eig.abs().sum()).item()


def layer_norm_map(norm, width):
    """LayerNorm's linear part: centre, then the gain."""
    centre = torch.eye(width, dtype=torch.float64) - 1.0 / width
    return torch.diag(norm.weight.detach().double()) @ centre


def test_copying_scores_are_the_eigenvalue_score_of_the_full_ov_circuit():
    model = gpt(n_kv_head=2)  # GQA: query head h reads value head h // 2
    with torch.no_grad():  # gains of both signs: folding them in must matter
        for norm in [model.ln_f, *(b.ln_1 for b in model.blocks)]:
            norm.weight.copy_(torch.randn(32))
    found = heads.copying_scores(model)
    assert found.shape == (2, 4)
    D = 8
    unembed = model.lm_head.weight.detach().double() @ layer_norm_map(model.ln_f, 32)
    for layer, block in enumerate(model.blocks):
        w_v = block.attn.W_value.weight.detach().double() @ layer_norm_map(block.ln_1, 32)
        w_o = block.attn.out_proj.weight.detach().double()
        for h in range(4):
            v = w_v[(h // 2) * D : (h // 2 + 1) * D]
            o = w_o[:, h * D : (h + 1) * D]
            full = unembed @ o @ v @ model.wte.weight.detach().double().T  # (V, V)
            assert found[layer, h] == pytest.approx(eigen_score(full), abs=1e-9)


def test_copying_scores_tell_a_copying_head_from_an_anti_copying_one():
    model = gpt(n_layer=1, n_head=2, n_embd=16, vocab_size=16, tie_embeddings=False)
    with torch.no_grad():
        model.wte.weight.copy_(torch.eye(16))
        model.lm_head.weight.copy_(torch.eye(16))
        attn = model.blocks[0].attn
        attn.W_value.weight.copy_(torch.eye(16))  # head 0 reads dims 0-7, head 1 dims 8-15
        attn.out_proj.weight.copy_(torch.diag(torch.tensor([1.0] * 8 + [-1.0] * 8)))
    found = heads.copying_scores(model)[0]
    assert found[0] > 0.85 and found[1] < -0.85  # centring takes a little off each


def test_copying_scores_of_a_hugging_face_model():
    model = llama()
    with torch.no_grad():  # RMSNorm gains of both signs
        model.model.norm.weight.copy_(torch.randn(32))
        model.model.layers[1].input_layernorm.weight.copy_(torch.randn(32))
    found = heads.copying_scores(model)
    attn = model.model.layers[1].self_attn
    gain_1 = torch.diag(model.model.layers[1].input_layernorm.weight.detach().double())
    gain_f = torch.diag(model.model.norm.weight.detach().double())
    v = (attn.v_proj.weight.detach().double() @ gain_1)[8:16]  # query head 3 reads value
    o = attn.o_proj.weight.detach().double()[:, 24:32]  # head 1 (groups of 2); D = 8
    full = (
        model.lm_head.weight.detach().double()
        @ gain_f
        @ o
        @ v
        @ model.model.embed_tokens.weight.detach().double().T
    )
    assert found[1, 3] == pytest.approx(eigen_score(full), abs=1e-9)
    with pytest.raises(ValueError, match="neither"):
        heads.copying_scores(torch.nn.Linear(2, 2))


def zeroed_columns(model, layer, head_list, D, means=None):
    """The model with those heads' output-projection columns removed (their mean output
    folded into the bias instead, for mean ablation)."""
    edited = copy.deepcopy(model)
    proj = edited.blocks[layer].attn.out_proj
    with torch.no_grad():
        for h in head_list:
            cols = slice(h * D, (h + 1) * D)
            if means is not None:
                proj.bias += proj.weight[:, cols] @ means[layer][h]
            proj.weight[:, cols] = 0
    return edited


def test_zero_ablation_equals_removing_the_heads_output_columns():
    model, x = gpt(), tokens()
    with heads.ablate(model, "1.2,1.0") as chosen, torch.no_grad():
        found = model(x)
        again = model(x[:2])  # every forward pass in the block starts again at layer 0
    assert chosen == [(1, 2), (1, 0)]
    with torch.no_grad():
        expected = zeroed_columns(model, 1, [0, 2], 8)(x)
        assert not torch.allclose(found, model(x), atol=1e-4)  # the block is closed
    torch.testing.assert_close(found, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(again, expected[:2], rtol=1e-5, atol=1e-5)


def test_mean_ablation_puts_in_each_heads_mean_output():
    model, x, ref = gpt(), tokens(), tokens(seed=2)
    means = heads.head_means(model, ref, batch_size=4)
    assert len(means) == 2 and means[0].shape == (4, 8)
    with heads.ablate(model, [(0, 3)], mode="mean", reference=ref), torch.no_grad():
        found = model(x)
    with torch.no_grad():
        expected = zeroed_columns(model, 0, [3], 8, means)(x)
    torch.testing.assert_close(found, expected, rtol=1e-5, atol=1e-5)


def test_ablation_keeps_gradients_for_the_other_heads():
    model, x = gpt(), tokens()
    model.train()
    with heads.ablate(model, "0.1"):
        model(x).logsumexp(-1).mean().backward()
    grad = model.blocks[0].attn.W_value.weight.grad  # rows 8-15 feed head 1 only
    assert grad[8:16].abs().max() == 0 and grad[:8].abs().max() > 0


def test_ablation_of_a_hugging_face_model_through_qkv():
    model, x = llama(), tokens()
    with heads.ablate(model, "0.1"), torch.no_grad():
        found = model(x).logits
    edited = copy.deepcopy(model)
    with torch.no_grad():
        edited.model.layers[0].self_attn.o_proj.weight[:, 8:16] = 0
        expected = edited(x).logits
    torch.testing.assert_close(found, expected, rtol=1e-5, atol=1e-5)


def test_bad_ablations_are_refused():
    model, x = gpt(), tokens()
    with pytest.raises(ValueError, match="no layer 2"), heads.ablate(model, "2.0"):
        model(x)
    with pytest.raises(ValueError, match="no head 4"), heads.ablate(model, "1.4"):
        model(x)
    with pytest.raises(ValueError, match="mode must be"), heads.ablate(model, "0.0", mode="x"):
        pass
    with (
        pytest.raises(ValueError, match="needs reference"),
        heads.ablate(model, "0.0", mode="mean"),
    ):
        pass
    with pytest.raises(ValueError, match="LAYER.HEAD"):
        heads.parse_heads("1:2")


def test_ablation_under_torch_compile_is_applied_or_refused():
    model, x = gpt(), tokens(n=2)
    with heads.ablate(model, "0.0"), torch.no_grad():
        eager = model(x)
        broken = torch.compile(model, backend="eager")(x)  # the graph breaks: run eagerly
    torch.testing.assert_close(broken, eager)
    torch.compiler.reset()  # a fresh trace, not the cached one with its graph break
    whole = torch.compile(model, backend="eager", fullgraph=True)
    with pytest.raises(Exception, match="cannot be edited"), heads.ablate(model, "0.0"):
        whole(x)
