"""What each head does: attention recorded through qkv, and the scores that name heads.

Inside a :func:`record` block every :func:`qkv.attention` call keeps its inputs and its
log-sum-exp, whether it comes from a :class:`qkv.models.GPT`, any
:class:`qkv.MultiHeadAttention`, or a Hugging Face model with qkv registered as its
attention. No ``output_attentions`` is needed.
Weights are recomputed afterwards from the log-sum-exp for the rows asked for
(:func:`qkv.attention_weights`), so a long prompt never holds T × T per layer.

:func:`head_scores` feeds a model a random token sequence repeated twice and scores every
layer and head on what it attends to from the second copy (Olsson et al. 2022):

- ``previous_token``, the token just before (i - 1).
- ``duplicate_token``, the earlier occurrence of the same token (i - M).
- ``induction``, the token after that earlier occurrence (i - M + 1). A head that copies a
  repeated sequence forward looks there.
- ``first_token``, position 0, where heads park attention they do not need (an "attention
  sink").

Each is a mean attention weight in [0, 1]: 1 means the head puts all of its attention there.

Legend: B batch · H heads · M the repeated segment's length · T = 2M.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..core.record import listening
from ..functional import problem, torch_inputs
from ..lse import attention_weights, row_scores

SCORES = ("previous_token", "duplicate_token", "induction", "first_token")

#: query rows whose weights are recomputed at once
ROW_BLOCK = 256


@dataclass
class Call:
    """One recorded :func:`qkv.attention` call: its inputs (detached) and log-sum-exp."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    lse: torch.Tensor | None
    mask: Any
    scale: float | None
    q_offset: int | None
    score_mod: Any

    @property
    def heads(self) -> int:
        return self.query.shape[1] if self.query.ndim == 4 else 1

    def weights(
        self, rows: Sequence[int] | slice | None = None, heads: Sequence[int] | None = None
    ) -> torch.Tensor:
        """The attention weights of the chosen rows and heads, (…, heads, rows, T_k),
        recomputed from the log-sum-exp."""
        if self.lse is None:
            raise ValueError(
                "this call ran on a backend that gives no log-sum-exp "
                "(backend='sdpa'): record calls made with backend='auto'"
            )
        return attention_weights(
            self.query,
            self.key,
            self.lse,
            mask=self.mask,
            scale=self.scale,
            q_offset=self.q_offset,
            heads=heads,
            rows=rows,
            score_mod=self.score_mod,
        )

    def step(self, row: int, head: int, batch: int = 0) -> dict[str, torch.Tensor]:
        """One query's computation, step by step (what :func:`qkv.explain` prints), for one
        head: ``q`` (D,), the keys' ``q·k`` (T_k,), ``scaled`` (× scale), ``modified``
        (after the score modification; = scaled without one), ``allowed`` (the mask,
        bool), ``weights`` (the softmax) and ``out`` = weights · V (D_v,)."""
        mask = torch_inputs(self.mask, query=self.query, key=self.key)
        p = problem(
            self.query, self.key, self.value, mask=mask, scale=self.scale, q_offset=self.q_offset
        )
        if not (0 <= row < p.T_q and 0 <= head < p.H and 0 <= batch < p.B):
            raise ValueError(
                f"no query row {row}, head {head}, batch {batch} here: "
                f"(B, H, T_q) = ({p.B}, {p.H}, {p.T_q})"
            )
        scaled, modified, allowed, _, _ = row_scores(
            self.query,
            self.key,
            p,
            mask,
            self.score_mod,
            [head] if p.rank == 4 else None,
            [row],
            dtype=torch.float64,
        )
        scaled, modified = scaled[batch, 0, 0], modified[batch, 0, 0]  # (T_k,)
        allowed = (
            torch.ones_like(scaled, dtype=torch.bool) if allowed is None else allowed[batch, 0, 0]
        )
        weights = torch.softmax(modified.masked_fill(~allowed, float("-inf")), dim=-1)
        weights = weights.nan_to_num(0.0)  # a fully masked row attends to nothing
        value = p.to4d(self.value)[batch, head // (p.H // p.H_kv)].double()  # (T_k, D_v)
        return {
            "q": p.to4d(self.query)[batch, head, row].double(),
            "q·k": scaled / p.scale,
            "scale": torch.tensor(p.scale),
            "scaled": scaled,
            "modified": modified,
            "allowed": allowed,
            "weights": weights,
            "out": weights @ value,
        }


class Recorder:
    """The calls made inside a :func:`record` block, in order (one per layer for a model's
    forward pass)."""

    def __init__(self) -> None:
        self.calls: list[Call] = []

    def add(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        lse: torch.Tensor | None,
        *,
        mask: Any,
        scale: float | None,
        q_offset: int | None,
        score_mod: Any,
    ) -> None:
        self.calls.append(
            Call(
                query.detach(),
                key.detach(),
                value.detach(),
                None if lse is None else lse.detach(),
                mask,
                scale,
                q_offset,
                score_mod,
            )
        )

    def __len__(self) -> int:
        return len(self.calls)

    def __getitem__(self, i: int) -> Call:
        return self.calls[i]

    def __iter__(self) -> Iterator[Call]:
        return iter(self.calls)


@contextlib.contextmanager
def record() -> Iterator[Recorder]:
    """Record every :func:`qkv.attention` call made inside the block.

    Example:
        >>> import torch, qkv
        >>> from qkv.models import GPT, GPTConfig
        >>> model = GPT(GPTConfig(block_size=32, n_layer=2, n_head=4, n_embd=32)).eval()
        >>> with qkv.heads.record() as calls:
        ...     _ = model(torch.randint(0, 256, (1, 20)))
        >>> len(calls), calls[0].weights(rows=[19]).shape   # layers; (B, H, rows, T_k)
        (2, torch.Size([1, 4, 1, 20]))
    """
    recorder = Recorder()
    with listening(recorder):
        yield recorder


def repeated_tokens(
    vocab_size: int,
    length: int,
    *,
    batch: int = 8,
    seed: int = 0,
    choices: torch.Tensor | None = None,
) -> torch.Tensor:
    """(batch, 2 · length) token ids: a uniformly random segment, then the same again.

    Tokens are drawn from 0 … vocab_size - 1, or from ``choices`` (1-D ids) when given —
    e.g. the bytes a text model has seen, so that no segment holds a byte it never met.
    """
    if length < 2:
        raise ValueError(f"the repeated segment needs length >= 2; got {length}")
    g = torch.Generator().manual_seed(seed)
    if choices is None:
        segment = torch.randint(0, vocab_size, (batch, length), generator=g)
    else:
        if choices.ndim != 1 or not len(choices):
            raise ValueError("choices must be a non-empty 1-D tensor of token ids")
        segment = choices[torch.randint(0, len(choices), (batch, length), generator=g)]
    return torch.cat([segment, segment], dim=1)


def scores_from_weights(
    weights: torch.Tensor, length: int, start: int | None = None
) -> dict[str, torch.Tensor]:
    """The four scores of each head from the weights of rows of the second copy.

    Args:
        weights: (B, H, r, T) — the rows of positions start … start + r - 1 over all T keys.
        length: M.
        start: the first row's position, in M … 2M - 1; default M (all of the second copy).

    Returns:
        score name -> (H,) mean weights over those rows.
    """
    M = length
    start = M if start is None else start
    i = torch.arange(start, start + weights.shape[2])  # query positions
    j = i - M  # their earlier occurrences
    targets = {
        "previous_token": i - 1,
        "duplicate_token": j,
        "induction": j + 1,
        "first_token": torch.zeros_like(j),
    }
    rows = torch.arange(len(i))
    return {name: weights[:, :, rows, t].mean(dim=(0, 2)) for name, t in targets.items()}


def head_scores(
    model: Any,
    *,
    length: int | None = None,
    batch: int = 8,
    seed: int = 0,
    vocab_size: int | None = None,
    tokens: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Score every layer and head of a model whose attention runs on qkv.

    Weights are recomputed a block of :data:`ROW_BLOCK` rows at a time, so memory stays
    O(B · H · ROW_BLOCK · T) per layer at any length.

    Args:
        model: a :class:`qkv.models.GPT`, or any module called as ``model(ids)`` whose
            attention calls :func:`qkv.attention` (a Hugging Face model with qkv
            registered: :mod:`qkv.integrations.huggingface`).
        length: M, the repeated segment; default: half the context (GPT), else 64.
        batch: sequences averaged over.
        seed: draws the random segments.
        vocab_size: tokens are drawn from 0 … vocab_size - 1; default: the model's.
        tokens: (B, 2M) ids to use instead of drawing them (each row a segment repeated).

    Returns:
        score name (:data:`SCORES`) -> (layers, H) tensor of mean attention weights.
    """
    if tokens is None:
        vocab_size = vocab_size or _vocab_size(model)
        length = length or _default_length(model)
        tokens = repeated_tokens(vocab_size, length, batch=batch, seed=seed)
    elif (
        tokens.ndim != 2
        or tokens.shape[1] % 2
        or not torch.equal(tokens[:, : tokens.shape[1] // 2], tokens[:, tokens.shape[1] // 2 :])
    ):
        raise ValueError("tokens must be (B, 2M): each row a segment followed by itself")
    M = tokens.shape[1] // 2
    per_layer = []
    for call in run(model, tokens):
        total: dict[str, torch.Tensor] = {name: torch.tensor(0.0) for name in SCORES}
        for r0 in range(M, 2 * M, ROW_BLOCK):
            r1 = min(2 * M, r0 + ROW_BLOCK)
            part = scores_from_weights(call.weights(rows=slice(r0, r1)).float(), M, r0)
            for name in SCORES:
                total[name] = total[name] + part[name] * (r1 - r0) / M
        per_layer.append(total)
    return {name: torch.stack([s[name] for s in per_layer]) for name in SCORES}


@contextlib.contextmanager
def evaluating(model: Any) -> Iterator[None]:
    """The block runs ``model`` in eval mode without gradients. Its mode is restored after."""
    was_training = getattr(model, "training", False)
    if hasattr(model, "eval"):
        model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        if was_training:
            model.train()


def run(model: Any, tokens: torch.Tensor) -> Recorder:
    """Run ``model(tokens)`` in eval mode without gradients and record its attention."""
    with evaluating(model), record() as calls:
        model(tokens.to(_device(model)))
    if not len(calls):
        raise ValueError(
            f"{type(model).__name__} made no qkv.attention call: its attention "
            "does not run on qkv (for Hugging Face models, register qkv first)"
        )
    return calls


def _vocab_size(model: Any) -> int:
    config = getattr(model, "config", None)
    size = getattr(config, "vocab_size", None)
    if not isinstance(size, int):
        raise ValueError("the model's vocabulary size is unknown: pass vocab_size=")
    return size


def _default_length(model: Any) -> int:
    block = getattr(getattr(model, "config", None), "block_size", None)
    return max(2, block // 2) if isinstance(block, int) else 64


def _device(model: Any) -> torch.device:
    try:
        return next(model.parameters()).device
    except (AttributeError, StopIteration):
        return torch.device("cpu")


__all__ = [
    "SCORES",
    "Call",
    "Recorder",
    "evaluating",
    "head_scores",
    "record",
    "repeated_tokens",
    "run",
    "scores_from_weights",
]
