"""A step-by-step trace of one attention computation, for learners.

:func:`explain` runs a module (or the weightless simplified attention) on one sequence and
keeps every intermediate: inputs, queries, keys, values, raw scores, scaled scores, mask,
weights, context vectors and output. The weights and context come from
:func:`qkv.attention` itself, so the trace shows the real computation, not a re-enactment.

Legend: H heads · T_q/T_k query/key length · E input width · d_head head width.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..functional import MaskLike, attention
from ..masks import Mask
from ..scores import ScoreMod, as_score_mod


@dataclass
class Trace:
    """Every step of one attention computation. Per-head tensors lead with H."""

    tokens: list[str]
    inputs: torch.Tensor  # (T, E)
    queries: torch.Tensor  # (H, T_q, d_head)
    keys: torch.Tensor  # (H_kv, T_k, d_head): H_kv < H where query heads share key heads
    values: torch.Tensor  # (H_kv, T_k, d_v)
    scores: torch.Tensor  # (H, T_q, T_k): Q Kᵀ
    scale: float
    scaled_scores: torch.Tensor  # (H, T_q, T_k): Q Kᵀ · scale
    mask: torch.Tensor | None  # (T_q, T_k) bool, True = may attend
    weights: torch.Tensor  # (H, T_q, T_k): softmax of the masked, scaled scores
    context: torch.Tensor  # (H, T_q, d_v): weights · V
    output: torch.Tensor  # (T_q, d_out): the module's output (heads merged)
    title: str = "attention"
    notes: dict[str, str] = field(default_factory=dict)
    modified_scores: torch.Tensor | None = None  # (H, T_q, T_k): score_mod(scaled scores)

    def steps(self) -> list[tuple[str, str, torch.Tensor]]:
        """(name, what it is, tensor) for each step, in order."""
        s = self.scale
        scale_text = "× 1 (no scaling)" if s == 1.0 else f"/ √{1 / s**2:g} = × {s:.4f}"
        steps = [
            ("inputs", "x: one row per token", self.inputs),
            (
                "queries",
                self.notes.get("queries", "Q = x · W_query: what each token looks for"),
                self.queries,
            ),
            ("keys", self.notes.get("keys", "K = x · W_key: what each token offers"), self.keys),
            (
                "values",
                self.notes.get("values", "V = x · W_value: what each token passes on"),
                self.values,
            ),
            ("scores", "Q · Kᵀ: row i scores every key for query i", self.scores),
            ("scaled_scores", f"Q · Kᵀ {scale_text}", self.scaled_scores),
        ]
        if self.modified_scores is not None:
            steps.append(
                (
                    "modified_scores",
                    f"{self.notes['score_mod']} applied to each scaled score, before the mask",
                    self.modified_scores,
                )
            )
        if self.mask is not None:
            steps.append(("mask", "█ may attend · masked (its weight will be 0)", self.mask))
        steps += [
            (
                "weights",
                self.notes.get("sinks", "softmax of each row of scaled scores: each row sums to 1"),
                self.weights,
            ),
            ("context", "weights · V: each token's weighted mix of the values", self.context),
        ]
        if "output" in self.notes:  # heads merged by an output projection
            steps.append(("output", self.notes["output"], self.output))
        return steps

    def to_text(self, precision: int = 4) -> str:
        """Aligned tables with token labels, one per step."""
        lines = [f"Attention, step by step: {self.title}", ""]
        for n, (name, what, t) in enumerate(self.steps(), 1):
            shape = tuple(t.shape[1:] if t.ndim == 3 and t.shape[0] == 1 else t.shape)
            lines.append(f"{n}. {name} — {what}  {shape}")
            rows = self.tokens
            square = ("scores", "scaled_scores", "modified_scores", "mask", "weights")
            cols = self.tokens if name in square else None
            if name == "mask":
                lines.append(_picture(t, rows))
            elif t.ndim == 3:
                for h in range(t.shape[0]):
                    if t.shape[0] > 1:
                        lines.append(f"   head {h}")
                    lines.append(_table(t[h], rows, cols, precision))
            else:
                lines.append(_table(t, rows, cols, precision))
            lines.append("")
        return "\n".join(lines).rstrip() + "\n"

    def to_dict(self) -> dict[str, Any]:
        """Plain lists and numbers, ready for ``json.dumps``."""
        return {
            "title": self.title,
            "tokens": self.tokens,
            "scale": self.scale,
            "steps": {name: t.detach().tolist() for name, _, t in self.steps()},
        }

    def heatmap(self, path: str | Path | None = None) -> Any:
        """A heatmap of the weights, one panel per head. Written as PNG if ``path`` given."""
        from .viz import heatmap

        return heatmap(
            self.weights, self.tokens, self.tokens, mask=self.mask, title=self.title, path=path
        )


def _fmt(x: float, precision: int) -> str:
    return "-inf" if x == -math.inf else f"{x:.{precision}f}"


def _table(m: torch.Tensor, rows: Sequence[str], cols: Sequence[str] | None, precision: int) -> str:
    m = m.detach().double()
    cols = list(cols) if cols is not None else [f"[{j}]" for j in range(m.shape[1])]
    cells = [[_fmt(float(x), precision) for x in row] for row in m]
    width = max([len(c) for c in cols] + [len(c) for row in cells for c in row])
    label = max(len(r) for r in rows)
    head = " " * (label + 3) + " ".join(c.rjust(width) for c in cols)
    body = [
        f"   {r.ljust(label)} " + " ".join(c.rjust(width) for c in row)
        for r, row in zip(rows, cells)
    ]
    return "\n".join([head, *body])


def _picture(mask: torch.Tensor, rows: Sequence[str]) -> str:
    label = max(len(r) for r in rows)
    return "\n".join(
        f"   {r.ljust(label)} " + " ".join("█" if a else "·" for a in row)
        for r, row in zip(rows, mask.tolist())
    )


def explain(
    x: torch.Tensor,
    *,
    tokens: Sequence[str] | None = None,
    module: nn.Module | None = None,
    mask: MaskLike = None,
    score_mod: ScoreMod | Callable[..., Any] | None = None,
    title: str | None = None,
) -> Trace:
    """Trace one attention computation over one sequence.

    Args:
        x: (T, E), one sequence of embeddings.
        tokens: a label per row of x (default "0", "1", …).
        module: a qkv module with ``project``/``merge`` (SelfAttention, CausalAttention,
            MultiHeadAttention (GQA and MQA included, its keys and values then traced
            per key/value head), MultiHeadLatentAttention in its absorbed form,
            tutorial.SelfAttention_v1); None traces the simplified, weightless attention
            of the first stage (Q = K = V = x, no scaling). A module may name its steps
            (``trace_notes``) and its scale (``scale``).
        mask: a qkv mask or a bool (T, T) tensor; a causal module adds its own.
        score_mod: a :mod:`qkv.scores` modification; the trace shows the modified scores
            as a step of their own.
        title: a heading for the text and the heatmap.

    Returns:
        A :class:`Trace`.

    Example:
        >>> import qkv
        >>> t = qkv.explain(qkv.tutorial.sentence_embeddings(), tokens=qkv.tutorial.SENTENCE)
        >>> t.weights.sum(-1)
        tensor([[1.0000, 1.0000, 1.0000, 1.0000, 1.0000, 1.0000]])
    """
    if not isinstance(x, torch.Tensor) or x.ndim != 2:
        raise ValueError(f"x must be a (T, E) tensor; got {getattr(x, 'shape', type(x))}")
    T = x.shape[0]
    tokens = [str(t) for t in (tokens if tokens is not None else range(T))]
    if len(tokens) != T:
        raise ValueError(f"tokens must have one label per row of x: T={T}; got {len(tokens)}")
    notes: dict[str, str] = {}
    with torch.no_grad():
        if module is None:
            q = k = v = x[None, None]  # (1, 1, T, E)
            scale = 1.0
            for name in ("queries", "keys", "values"):
                notes[name] = f"{name} = x itself: no trainable weights"
            merge = lambda context: context[0, 0]  # noqa: E731
        else:
            m: Any = module  # a qkv module: project, merge, maybe attention_mask
            q, k, v = m.project(x)  # (1, H, T, d_head) and (1, H_kv, T, ·)
            scale = getattr(module, "scale", None) or 1.0 / math.sqrt(q.shape[-1])
            if hasattr(module, "attention_mask"):
                mask = m.attention_mask(mask)
            if hasattr(module, "out_proj"):
                notes["output"] = "heads concatenated, then out_proj"
            H, H_kv = q.shape[1], k.shape[1]
            if H_kv != H:
                shared = f"{H_kv} key/value head{'s' if H_kv > 1 else ''}"
                notes["keys"] = f"K = x · W_key: {shared}, each shared by {H // H_kv} query heads"
                notes["values"] = f"V = x · W_value: {shared}, shared as the keys are"
            notes |= getattr(module, "trace_notes", {})
            merge = lambda context: m.merge(context, like=x)  # noqa: E731
        sinks = getattr(module, "sinks", None)  # MultiHeadAttention(sinks=True)
        if sinks is not None:
            notes["sinks"] = (
                "softmax of each row of scaled scores and the head's sink (a key with no "
                "value): each row sums to 1 less the sink's share"
            )
        context, weights = attention(
            q,
            k,
            v,
            mask=mask,
            scale=scale,
            return_weights=True,
            score_mod=score_mod,
            sinks=sinks,
        )
        H = q.shape[1]
        shared_k = k.repeat_interleave(H // k.shape[1], dim=1)  # each query head's keys
        scores = q @ shared_k.transpose(-2, -1)  # (1, H, T, T)
        modified = None
        if score_mod is not None:
            mod = as_score_mod(score_mod)
            assert mod is not None
            notes["score_mod"] = repr(mod)
            i = torch.arange(T)
            modified = mod.apply(
                scores * scale,
                torch.zeros(1, 1, 1, 1, dtype=torch.long),
                torch.arange(H).view(1, H, 1, 1),
                i.view(1, 1, T, 1),
                i.view(1, 1, 1, T),
                i.view(1, 1, T, 1),
            )[0]  # (H, T, T)
        dense: torch.Tensor | None = None
        if isinstance(mask, Mask):
            dense = mask.dense(1, H, T, T)[0, 0]
        elif mask is not None:  # any broadcastable shape -> (T, T)
            dense = torch.as_tensor(mask).expand(1, 1, T, T)[0, 0]
        return Trace(
            tokens=tokens,
            inputs=x,
            queries=q[0],
            keys=k[0],
            values=v[0],
            scores=scores[0],
            scale=scale,
            scaled_scores=scores[0] * scale,
            mask=dense,
            weights=weights[0],
            context=context[0],
            output=merge(context),
            modified_scores=modified,
            title=title or (type(module).__name__ if module is not None else "simplified"),
            notes=notes,
        )
