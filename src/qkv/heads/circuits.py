"""What heads contribute, measured as Olsson et al. (2022) measure it: the loss at each
position, the in-context-learning score, each head's copying score, and ablations.

- :func:`per_token_loss`, the next-token loss at each position averaged over windows. Its
  late end drops when a model learns in context.
- :func:`icl_score`, the loss at a late position minus the loss at an early one (the
  paper's token 500 − token 50). It is negative when later tokens are predicted better.
- :func:`copying_scores`, per layer and head, says whether the head's OV circuit raises the
  logit of the token it attends to (the eigenvalue score of W_U W_O W_V W_E).
- :func:`ablate` opens a block in which chosen heads' outputs are zeroed or replaced by
  their mean, through qkv's public hook on attention output
  (:func:`qkv.core.record.editing`). No model code is patched.

"Layer" here is the index of the :func:`qkv.attention` call within one forward pass of the
model, which is the layer for a :class:`qkv.models.GPT` and for a Hugging Face model with
qkv registered. The prefix-matching score is :func:`qkv.heads.head_scores`' ``induction``.

Legend: B windows · T window length · L layers · H heads · D head width · E model width ·
V vocabulary.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from ..core.record import editing
from .patterns import _device, evaluating

#: how heads are named on a command line: "1.2,1.3" is layer 1 head 2 and layer 1 head 3
Heads = Iterable[tuple[int, int]]


def logits_of(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    """``model(tokens)``'s (B, T, V) logits: a qkv GPT returns them, a Hugging Face model
    returns an output whose ``.logits`` they are."""
    out = model(tokens)
    logits = out if isinstance(out, torch.Tensor) else getattr(out, "logits", None)
    if not isinstance(logits, torch.Tensor):
        raise TypeError(
            f"{type(model).__name__}(tokens) returned {type(out).__name__}: expected logits "
            "or an output with .logits"
        )
    return logits


def per_token_loss(
    model: Any,
    tokens: torch.Tensor,
    targets: torch.Tensor | None = None,
    *,
    batch_size: int = 32,
) -> torch.Tensor:
    """The next-token loss at each position, averaged over the windows (eval mode, no
    gradients).

    Args:
        model: a qkv GPT or a Hugging Face causal LM.
        tokens: (B, T) ids. Without ``targets`` the model reads ``tokens[:, :-1]`` and
            predicts ``tokens[:, 1:]``.
        targets: (B, T) ids: what each position of ``tokens`` should predict.
        batch_size: windows per forward pass.

    Returns:
        (P,) float64: entry i is the loss (nats) of the prediction made at position i,
        having read i + 1 tokens; P = T, or T - 1 without targets.
    """
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be (B, T); got shape {tuple(tokens.shape)}")
    if targets is None:
        tokens, targets = tokens[:, :-1], tokens[:, 1:]
    elif targets.shape != tokens.shape:
        raise ValueError(
            f"targets must have the shape of tokens {tuple(tokens.shape)}; got "
            f"{tuple(targets.shape)}"
        )
    if tokens.shape[1] < 1:
        raise ValueError("windows need at least two tokens")
    device = _device(model)
    total = torch.zeros(tokens.shape[1], dtype=torch.float64)
    with evaluating(model):
        for i in range(0, len(tokens), batch_size):
            x, y = tokens[i : i + batch_size].to(device), targets[i : i + batch_size]
            logits = logits_of(model, x).float().cpu()
            loss = F.cross_entropy(logits.transpose(1, 2), y, reduction="none")
            total += loss.double().sum(dim=0)
    return total / len(tokens)


def icl_positions(positions: int) -> tuple[int, int]:
    """The default (early, late) positions for ``positions`` losses: the last one, and a
    tenth of the way to it (the paper's 50 and 500, scaled to the context)."""
    late = positions - 1
    return max(0, round(late / 10)), late


def icl_band(positions: int) -> int:
    """The default band of :func:`icl_score` for ``positions`` losses: positions // 32."""
    return positions // 32


def icl_score(
    losses: torch.Tensor,
    *,
    early: int | None = None,
    late: int | None = None,
    band: int | None = None,
) -> float:
    """The in-context-learning score: ``losses[late] − losses[early]`` (negative: the
    model predicts better with more context).

    Args:
        losses: (P,) from :func:`per_token_loss`.
        early, late: positions; default :func:`icl_positions`.
        band: average each end over the positions within ``band`` of it, which takes the
            noise of single positions off the score; default :func:`icl_band` (0 below
            32 positions; 0 is the paper's single positions).
    """
    P = losses.shape[-1]
    band = icl_band(P) if band is None else band
    e, l_ = icl_positions(P)
    early, late = e if early is None else early, l_ if late is None else late
    if not 0 <= early < late < P:
        raise ValueError(
            f"need 0 <= early < late < {P} (the losses' positions); got {early}, {late}"
        )
    if band < 0:
        raise ValueError(f"band must be >= 0; got {band}")

    def around(p: int) -> float:
        return losses[..., max(0, p - band) : min(P, p + band + 1)].mean().item()

    return around(late) - around(early)


def copying_scores(model: Any) -> torch.Tensor:
    """Per layer and head, how much the head's OV circuit copies: the eigenvalues λ of
    W_U · W_O^h · W_V^h · W_E (V × V: the logits a head adds for each token it attends to,
    through the embedding and the unembedding), scored as Σ λ / Σ |λ| (Elhage et al. 2021,
    used by Olsson et al. 2022): +1 when every eigenvalue is positive (attending to a token
    raises that token's logit), −1 when it lowers it, near 0 for a circuit that does neither.

    Computed from the D × D matrix W_V^h · W_E · W_U · W_O^h, which has the same nonzero
    eigenvalues, in float64. A layer norm before the head and the one before the
    unembedding are folded in as the linear maps they are up to a positive scale per token
    (centring, then the gain: RMSNorm's gain alone). Biases are left out.

    Args:
        model: a :class:`qkv.models.GPT`, or a Hugging Face model whose attention modules
            have ``v_proj`` and ``o_proj`` linear layers (Llama, Mistral, Qwen, … — GQA
            included; their ``input_layernorm`` and final ``norm`` gains folded in).

    Returns:
        (L, H) float64 tensor in [−1, 1].
    """
    with torch.no_grad():
        embed, unembed, layers = _ov_weights(model)
        rows = []
        for w_v, w_o in layers:  # per head: (D, E), (E, D)
            row = []
            for v, o in zip(w_v, w_o, strict=True):
                eig = torch.linalg.eigvals(v @ embed.T @ unembed @ o)
                row.append((eig.sum().real / eig.abs().sum().clamp_min(1e-300)).item())
            rows.append(row)
    return torch.tensor(rows, dtype=torch.float64)


def _norm_map(norm: Any, width: int) -> torch.Tensor:
    """The (E, E) linear part of a norm, up to its positive per-token scale: LayerNorm
    centres then multiplies by its gain, RMSNorm only multiplies. Anything else (none,
    Identity) is the identity."""
    eye = torch.eye(width, dtype=torch.float64)
    weight = getattr(norm, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.shape != (width,):
        return eye
    gain = torch.diag(weight.double())
    if isinstance(norm, torch.nn.LayerNorm):
        return gain @ (eye - torch.full((width, width), 1.0 / width, dtype=torch.float64))
    return gain


def _latent_ov(attn: Any, norm_in: torch.Tensor) -> tuple[list, list]:
    """Multi-head latent attention's heads as W_V (v, E) and W_O (E, v) each: the value of
    head h is W_UV[h] · (the latent's RMS norm, its gain alone, as for the block norms) ·
    the latent projection · the layer's norm."""
    r, H, v = attn.kv_lora_rank, attn.num_heads, attn.v_head_dim
    down = attn.kv_a_proj.weight.double()[:r] @ norm_in  # (r, E)
    latent = torch.diag(attn.kv_a_norm.weight.double()) @ down
    w_uv = attn.kv_b_proj.weight.double().view(H, attn.nope + v, r)[:, attn.nope :]  # (H, v, r)
    w_o = attn.o_proj.weight.double()  # (E, H · v)
    return [w_uv[h] @ latent for h in range(H)], [w_o[:, h * v : (h + 1) * v] for h in range(H)]


def _ov_weights(model: Any) -> tuple[torch.Tensor, torch.Tensor, list[tuple[list, list]]]:
    """(W_E (V, E), W_U (V, E) after the final norm, per layer (each head's W_V (D, E) after
    the layer's norm, each head's W_O (E, D))), float64."""
    blocks = getattr(model, "blocks", None)
    if blocks is not None and hasattr(model, "wte"):  # a qkv GPT
        E = model.wte.weight.shape[1]
        layers = []
        for block in blocks:
            attn = block.attn
            if hasattr(attn, "kv_b_proj"):  # latent attention: each head's value from c
                layers.append(_latent_ov(attn, _norm_map(block.ln_1, E)))
                continue
            if not hasattr(attn, "W_value"):
                raise ValueError(f"{type(attn).__name__} has no value projection to score")
            w_v = attn.W_value.weight.double() @ _norm_map(block.ln_1, E)
            layers.append(
                _split(
                    w_v,
                    attn.out_proj.weight.double(),
                    attn.num_heads,
                    attn.num_kv_heads,
                    attn.head_dim,
                )
            )
        unembed = model.lm_head.weight.double() @ _norm_map(model.ln_f, E)
        return model.wte.weight.double(), unembed, layers
    config = getattr(model, "config", None)
    owners = [
        m for m in model.modules() if hasattr(m, "self_attn") and hasattr(m.self_attn, "v_proj")
    ]
    attns = [m for m in model.modules() if hasattr(m, "v_proj") and hasattr(m, "o_proj")]
    if config is None or not attns or not hasattr(model, "get_output_embeddings"):
        raise ValueError(
            f"copying scores read a qkv GPT or a Hugging Face model whose attention "
            f"has v_proj and o_proj; {type(model).__name__} is neither"
        )
    embed = model.get_input_embeddings().weight.double()
    E = embed.shape[1]
    norms = {id(m.self_attn): getattr(m, "input_layernorm", None) for m in owners}
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    layers = [
        _split(
            a.v_proj.weight.double() @ _norm_map(norms.get(id(a)), E),
            a.o_proj.weight.double(),
            heads,
            kv_heads,
            dim,
        )
        for a in attns
    ]
    final = getattr(getattr(model, "base_model", model), "norm", None)
    return embed, model.get_output_embeddings().weight.double() @ _norm_map(final, E), layers


def _split(
    w_v: torch.Tensor, w_o: torch.Tensor, heads: int, kv_heads: int, dim: int
) -> tuple[list, list]:
    """Each query head's value rows (the key/value head it reads: GQA) and output columns."""
    group = heads // kv_heads
    vs = [w_v[(h // group) * dim : (h // group + 1) * dim] for h in range(heads)]
    os_ = [w_o[:, h * dim : (h + 1) * dim] for h in range(heads)]
    return vs, os_


def parse_heads(text: str) -> list[tuple[int, int]]:
    """``"1.2,0.3"`` -> [(1, 2), (0, 3)]: heads named layer.head, comma-separated."""
    heads = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)\.(\d+)\s*", part)
        if match is None:
            raise ValueError(
                f"heads are named LAYER.HEAD, comma-separated (e.g. 1.2,1.3); got {text!r}"
            )
        heads.append((int(match[1]), int(match[2])))
    return heads


def head_means(model: Any, tokens: torch.Tensor, *, batch_size: int = 32) -> list[torch.Tensor]:
    """Each head's output averaged over the windows and positions of ``tokens`` (B, T):
    a list over layers of (H, D_v) float32 tensors — what mean ablation puts in."""
    sums: list[torch.Tensor] = []
    count = 0
    calls = {"n": 0}

    def collect(out: torch.Tensor) -> torch.Tensor:
        layer = calls["n"]
        calls["n"] += 1
        part = out.detach().float().sum(dim=(0, 2)).cpu()  # (H, D_v)
        if layer == len(sums):
            sums.append(part)
        else:
            sums[layer] += part
        return out

    with evaluating(model), editing(collect):
        for i in range(0, len(tokens), batch_size):
            calls["n"] = 0
            x = tokens[i : i + batch_size]
            logits_of(model, x.to(_device(model)))
            count += x.numel()
    if not sums:
        raise ValueError(f"{type(model).__name__} made no qkv.attention call")
    return [s / count for s in sums]


@contextlib.contextmanager
def ablate(
    model: Any,
    heads: Heads | str,
    *,
    mode: str = "zero",
    reference: torch.Tensor | None = None,
) -> Iterator[list[tuple[int, int]]]:
    """Remove heads from every forward pass of ``model`` made in the block.

    Each chosen head's output (before the output projection) is replaced: ``"zero"`` by
    zeros, ``"mean"`` by its mean output over the windows and positions of ``reference``
    (:func:`head_means`, measured before the block starts, with no head removed).
    Gradients flow through the heads left alone.

    Example:
        >>> import torch, qkv
        >>> from qkv.models import GPT, GPTConfig
        >>> model = GPT(GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=16)).eval()
        >>> x = torch.randint(0, 256, (1, 16))
        >>> with qkv.heads.ablate(model, "1.0,1.1"):     # layer 1, both heads
        ...     removed = model(x)
        >>> bool((removed - model(x)).abs().max() > 0)
        True

    Raises:
        ValueError: an unknown mode, ``"mean"`` without ``reference``, a layer the forward
            pass never reached, or a head the layer does not have.
    """
    chosen = parse_heads(heads) if isinstance(heads, str) else [(int(a), int(b)) for a, b in heads]
    if mode not in ("zero", "mean"):
        raise ValueError(f"mode must be 'zero' or 'mean'; got {mode!r}")
    if mode == "mean" and reference is None:
        raise ValueError("mode='mean' needs reference= tokens (B, T) to take each head's mean over")
    means = head_means(model, reference) if reference is not None and mode == "mean" else None
    by_layer: dict[int, list[int]] = {}
    for layer, head in chosen:
        by_layer.setdefault(layer, []).append(head)
    calls = {"n": 0}

    def edit(out: torch.Tensor) -> torch.Tensor:
        layer = calls["n"]
        calls["n"] += 1
        picked = by_layer.get(layer)
        if not picked:
            return out
        if max(picked) >= out.shape[1]:
            raise ValueError(
                f"layer {layer} has {out.shape[1]} heads: no head {max(picked)} to ablate"
            )
        keep = torch.ones(out.shape[1], 1, 1, dtype=out.dtype, device=out.device)
        keep[picked] = 0
        out = out * keep
        if means is not None:
            fill = torch.zeros(out.shape[1], out.shape[-1], dtype=out.dtype, device=out.device)
            fill[picked] = means[layer][picked].to(out)
            out = out + fill[:, None, :] * (1 - keep)
        return out

    def start(*_: Any) -> None:
        calls["n"] = 0

    def finish(*_: Any) -> None:
        if by_layer and max(by_layer) >= calls["n"]:
            raise ValueError(
                f"no layer {max(by_layer)} to ablate: a forward pass of "
                f"{type(model).__name__} made {calls['n']} qkv.attention calls"
            )

    handles = [model.register_forward_pre_hook(start), model.register_forward_hook(finish)]
    try:
        with editing(edit):
            yield chosen
    finally:
        for handle in handles:
            handle.remove()


__all__ = [
    "ablate",
    "copying_scores",
    "head_means",
    "icl_band",
    "icl_positions",
    "icl_score",
    "logits_of",
    "parse_heads",
    "per_token_loss",
]
