"""Converting Hugging Face's GPT-2 into a qkv GPT: its configuration, and its Conv1D weights
(in, out) transposed into our linear maps. Used by :meth:`qkv.models.GPT.from_huggingface`."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .config import GPTConfig

_GPT2_GELU = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "erf"}


def config_from_gpt2(c: Any) -> GPTConfig:
    refuse = []
    if c.activation_function not in _GPT2_GELU:
        refuse.append(f"activation_function={c.activation_function!r}")
    if not c.scale_attn_weights or c.scale_attn_by_inverse_layer_idx:
        refuse.append("attention scaled other than by 1/sqrt(d_head)")
    if getattr(c, "add_cross_attention", False):
        refuse.append("add_cross_attention=True")
    if not getattr(c, "tie_word_embeddings", True):
        refuse.append("tie_word_embeddings=False")
    dropouts = {c.resid_pdrop, c.embd_pdrop, c.attn_pdrop}
    if len(dropouts) != 1:
        refuse.append(
            f"unequal dropouts (resid {c.resid_pdrop}, embd {c.embd_pdrop}, attn {c.attn_pdrop})"
        )
    if refuse:
        raise ValueError(f"this GPT-2 cannot be reproduced by qkv's GPT: {'; '.join(refuse)}")
    return GPTConfig(
        vocab_size=c.vocab_size,
        block_size=c.n_positions,
        n_layer=c.n_layer,
        n_head=c.n_head,
        n_embd=c.n_embd,
        mlp_width=c.n_inner,
        dropout=dropouts.pop(),
        positions="learned",
        gelu=_GPT2_GELU[c.activation_function],
        layer_norm_eps=c.layer_norm_epsilon,
    )


@torch.no_grad()
def copy_gpt2_weights(hf: Any, model: Any) -> None:
    """GPT-2 stores its linear maps as Conv1D, weight (in, out): ours is the transpose."""

    def linear(ours: nn.Linear, weight: torch.Tensor, bias: torch.Tensor) -> None:
        ours.weight.copy_(weight.T)
        ours.bias.copy_(bias)

    t = hf.transformer
    model.wte.weight.copy_(t.wte.weight)
    assert model.wpe is not None  # GPT-2's positions are learned
    model.wpe.weight.copy_(t.wpe.weight)
    for ours, theirs in zip(model.layers, t.h):
        assert ours.mlp is not None and ours.ln_2 is not None  # GPT-2 has MLPs
        E = model.config.n_embd
        w, b = theirs.attn.c_attn.weight, theirs.attn.c_attn.bias  # (E, 3E), (3E,)
        for i, lin in enumerate((ours.attn.W_query, ours.attn.W_key, ours.attn.W_value)):
            linear(lin, w[:, i * E : (i + 1) * E], b[i * E : (i + 1) * E])
        linear(ours.attn.out_proj, theirs.attn.c_proj.weight, theirs.attn.c_proj.bias)
        linear(ours.mlp.fc, theirs.mlp.c_fc.weight, theirs.mlp.c_fc.bias)
        linear(ours.mlp.proj, theirs.mlp.c_proj.weight, theirs.mlp.c_proj.bias)
        for ln_ours, ln_theirs in ((ours.ln_1, theirs.ln_1), (ours.ln_2, theirs.ln_2)):
            ln_ours.load_state_dict(ln_theirs.state_dict())
    model.ln_f.load_state_dict(t.ln_f.state_dict())
