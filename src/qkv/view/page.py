"""An interactive view of what every head attends to: one self-contained HTML file.

:func:`view` runs a model whose attention runs on qkv over a prompt, records every call
(:func:`qkv.heads.record`) and writes what the page needs into it: per layer and head a
thumbnail of the pattern, each row's strongest keys (all of them up to ``top_k``), the head
scores of :func:`qkv.heads.head_scores`, and one query's computation step by step. The
JavaScript and CSS are inlined (no CDN, no require.js, no network request), patterns are drawn
on canvases (not one DOM node per cell), and several models (the snapshots of a training
run) become frames under a slider.

Weights are recomputed from each call's log-sum-exp a block of rows at a time, so a long
prompt never holds T × T per layer.

Legend: L layers · H heads · T prompt length · K keys kept per row · Z thumbnail side.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import html
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..heads import ROW_BLOCK, SCORES, ablate, head_scores, parse_heads, per_token_loss, run

#: the longest prompt a page can hold (key indices are 16-bit)
MAX_TOKENS = 65535


@dataclass
class Frame:
    """One model's view of the prompt (one snapshot of a run)."""

    label: str
    thumbs: np.ndarray  # (L, H, Z, Z) uint8, each thumbnail scaled to its maximum
    keys: np.ndarray  # (L, H, T, K) uint16: each row's strongest keys
    weights: np.ndarray  # (L, H, T, K) uint8: their weights × 255
    scores: dict[str, list[list[float]]]  # score name -> L × H
    steps: list[list[dict[str, Any]]] = field(default_factory=list)  # L × H
    losses: list[float | None] | None = None  # T: the loss of each token (None at 0)


@dataclass
class View:
    """The page of :func:`view`: ``save(path)``, ``html()``, and shown inline by Jupyter
    and VS Code (``_repr_html_``)."""

    tokens: list[str]
    frames: list[Frame]
    query: int
    title: str
    ablated: list[tuple[int, int]] = field(default_factory=list)
    ablation: str = "zero"
    opened: tuple[int, int] | None = None  # (layer, head) shown in full when the page opens

    def html(self) -> str:
        """The whole page: one file, no external resource."""
        first = self.frames[0]
        L, H, _T, K = first.keys.shape
        data = {
            "title": self.title,
            "tokens": self.tokens,
            "layers": L,
            "heads": H,
            "k": K,
            "thumb": first.thumbs.shape[-1],
            "query": self.query,
            "scoreNames": SCORES,
            "ablated": [list(a) for a in self.ablated],
            "ablation": self.ablation,
            "opened": None if self.opened is None else list(self.opened),
            "frames": [
                {
                    "label": f.label,
                    "scores": f.scores,
                    "steps": f.steps,
                    "losses": f.losses,
                    "thumbs": _b64(f.thumbs),
                    "keys": _b64(f.keys.astype("<u2")),
                    "weights": _b64(f.weights),
                }
                for f in self.frames
            ],
        }
        assets = resources.files("qkv.view") / "assets"
        css = (assets / "view.css").read_text(encoding="utf-8")
        js = (assets / "view.js").read_text(encoding="utf-8")
        return _PAGE.format(
            title=html.escape(self.title),
            css=css,
            css_hash=_sha256(css),
            data=script_json(data),
            js=js,
            js_hash=_sha256(js),
        )

    def save(self, path: str | Path) -> None:
        """Write the page to ``path``."""
        Path(path).write_text(self.html(), encoding="utf-8")

    def _repr_html_(self) -> str:
        # In an iframe: the page's script and styles stay apart from the notebook's.
        return (
            f'<iframe srcdoc="{html.escape(self.html(), quote=True)}" '
            'style="width:100%;height:860px;border:0" sandbox="allow-scripts"></iframe>'
        )


# The page's own script and style are allowed by their hashes, nothing else: no inline
# script or style a string in the data could smuggle in would run.
_PAGE = """<!DOCTYPE html>
<html lang="en" dir="ltr"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; \
script-src '{js_hash}'; style-src '{css_hash}'; img-src data:">
<title>{title}</title><style>{css}</style></head>
<body><script type="application/json" id="qkv-data">{data}</script>
<div id="qkv"></div><script>{js}</script></body></html>
"""


def script_json(data: Any) -> str:
    """JSON that no string inside can end or change: every ``<``, ``>`` and ``&`` (and the
    two line separators JavaScript once read as line ends) written as a ``\\uXXXX`` escape,
    so a label like ``<!--<script>`` or ``</script>`` stays text inside the data block — the
    HTML parser never sees a tag, a comment or a script-data state change in it."""
    text = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    for char in "<>&\u2028\u2029":
        text = text.replace(char, f"\\u{ord(char):04x}")
    return text


def _sha256(text: str) -> str:
    """A Content-Security-Policy source for exactly this inline text."""
    return "sha256-" + base64.b64encode(hashlib.sha256(text.encode("utf-8")).digest()).decode()


def _b64(a: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(a).tobytes()).decode("ascii")


def view(
    model: Any,
    tokens: torch.Tensor | Sequence[int],
    *,
    labels: Sequence[str] | None = None,
    snapshots: Sequence[tuple[str, Any]] | None = None,
    query: int | None = None,
    top_k: int = 32,
    thumb: int = 64,
    title: str = "qkv: what the heads attend to",
    scores: bool = True,
    ablated: str | Sequence[tuple[int, int]] | None = None,
    ablation: str = "zero",
    reference: torch.Tensor | None = None,
    opened: tuple[int, int] | None = None,
) -> View:
    """Build the interactive view of a model's heads on a prompt.

    Args:
        model: a :class:`qkv.models.GPT`, or any module called as ``model(ids)`` whose
            attention runs on qkv (a Hugging Face model with qkv registered).
        tokens: the prompt's token ids, (T,) or (1, T).
        labels: one label per token; default the ids (a GPT on bytes: use
            :func:`byte_labels`).
        snapshots: (label, model) pairs (a training run's snapshots) shown as frames under
            a slider, ``model`` last (labelled "final").
        query: the position whose computation is shown step by step; default the last.
        top_k: keys kept per row (every key when T <= top_k).
        thumb: thumbnail side in cells (the pattern averaged into thumb × thumb).
        scores: compute the head scores (:func:`qkv.heads.head_scores`) of every frame.
        ablated: heads to remove ("1.0,1.3" or (layer, head) pairs) in every frame, through
            :func:`qkv.heads.ablate`: the page marks them, and its patterns, scores and
            per-token losses are those of the model without them.
        ablation, reference: :func:`qkv.heads.ablate`'s ``mode`` and ``reference``.
        opened: the (layer, head) whose whole pattern the page shows when it opens; default
            the head with the highest induction score in the final model (with ``scores``).

    Under each token the page shows its loss (nats): how well the model, having read the
    tokens before it, predicted it — for models that return logits.

    Raises:
        ValueError: an empty prompt, a prompt longer than the model's context, labels of
            another length, a query outside the prompt.
    """
    ids = torch.as_tensor(tokens).reshape(1, -1).long()
    T = ids.shape[1]
    if T == 0:
        raise ValueError("the prompt is empty: give at least one token")
    if T > MAX_TOKENS:  # key indices travel as 16-bit integers
        raise ValueError(f"the viewer shows at most {MAX_TOKENS} tokens; got {T}")
    block = getattr(getattr(model, "config", None), "block_size", None)
    if isinstance(block, int) and block < T:
        raise ValueError(f"the prompt has {T} tokens; the model's context holds block_size={block}")
    labels = [str(int(t)) for t in ids[0]] if labels is None else list(labels)
    if len(labels) != T:
        raise ValueError(f"labels must give one label per token ({T}); got {len(labels)}")
    query = T - 1 if query is None else query
    if not 0 <= query < T:
        raise ValueError(f"query must be a position of the prompt, 0 … {T - 1}; got {query}")
    models = [*(snapshots or []), ("final", model)]
    removed = parse_heads(ablated) if isinstance(ablated, str) else list(ablated or [])
    frames = []
    for label, m in models:
        with contextlib.ExitStack() as stack:
            if removed:
                stack.enter_context(ablate(m, removed, mode=ablation, reference=reference))
            frames.append(_frame(label, m, ids, query, min(top_k, T), min(thumb, T), scores))
    L, H = frames[-1].keys.shape[:2]
    if opened is None and scores:
        induction = np.asarray(frames[-1].scores["induction"])
        opened = divmod(int(induction.argmax()), H)
    if opened is not None and not (0 <= opened[0] < L and 0 <= opened[1] < H):
        raise ValueError(f"opened must be a (layer, head) of {L} layers × {H} heads; got {opened}")
    return View(labels, frames, query, title, removed, ablation, opened)


def byte_labels(data: bytes) -> list[str]:
    """A printable label per byte: the character, ␣ for a space, ↵ for a newline."""
    special = {32: "␣", 10: "↵", 9: "⇥"}
    return [special.get(b, chr(b) if 33 <= b < 127 else f"\\x{b:02x}") for b in data]


def _frame(
    label: str, model: Any, ids: torch.Tensor, query: int, K: int, Z: int, with_scores: bool
) -> Frame:
    calls = run(model, ids)
    T = ids.shape[1]
    bins = torch.arange(T) * Z // T  # cell -> thumbnail cell
    counts = torch.bincount(bins, minlength=Z).double()
    thumbs, keys, weights, steps = [], [], [], []
    for call in calls:
        H = call.heads
        pooled = torch.zeros(H, Z, Z, dtype=torch.float64)
        top_k, top_w = [], []
        for r0 in range(0, T, ROW_BLOCK):
            rows = slice(r0, min(T, r0 + ROW_BLOCK))
            w = call.weights(rows=rows)[0].double().reshape(H, -1, T)  # (H, r, T)
            cols = torch.zeros(H, w.shape[1], Z, dtype=torch.float64).index_add_(2, bins, w)
            pooled.index_add_(1, bins[rows], cols)
            v, i = w.topk(K, dim=-1)
            top_k.append(i)
            top_w.append((v * 255).round())
        pooled /= counts[:, None] * counts[None, :]
        peak = pooled.amax(dim=(1, 2), keepdim=True).clamp_min(1e-12)
        thumbs.append((pooled / peak * 255).round().to(torch.uint8))
        keys.append(torch.cat(top_k, dim=1).to(torch.int32))
        weights.append(torch.cat(top_w, dim=1).to(torch.uint8))
        steps.append([_steps(call, query, h) for h in range(H)])
    if with_scores:
        found = head_scores(model)
        scores = {
            name: [[round(float(x), 4) for x in row] for row in found[name]] for name in SCORES
        }
    else:
        scores = {}
    return Frame(
        label,
        torch.stack(thumbs).numpy(),
        torch.stack(keys).numpy().astype(np.uint16),
        torch.stack(weights).numpy(),
        scores,
        steps,
        _losses(model, ids),
    )


def _losses(model: Any, ids: torch.Tensor) -> list[float | None] | None:
    """Each token's loss given the tokens before it (None for the first); None for a model
    that returns no logits, or a prompt of one token."""
    if ids.shape[1] < 2:
        return None
    try:
        losses = per_token_loss(model, ids)
    except TypeError:  # the model returns something other than logits
        return None
    return [None, *(round(float(x), 3) for x in losses)]


def _steps(call: Any, query: int, head: int, shown: int = 12) -> dict[str, Any]:
    """The step-by-step computation of one query in one head, for the keys it weighs most."""
    s = call.step(query, head)
    order = s["weights"].argsort(descending=True)[:shown].tolist()
    r = lambda t: [round(float(x), 4) for x in t]  # noqa: E731
    return {
        "keys": order,
        "qk": r(s["q·k"][order]),
        "scaled": r(s["scaled"][order]),
        "modified": None if torch.equal(s["modified"], s["scaled"]) else r(s["modified"][order]),
        "allowed": [bool(a) for a in s["allowed"][order]],
        "weights": r(s["weights"][order]),
        "scale": round(float(s["scale"]), 6),
        "masked": int((~s["allowed"]).sum()),
        "q": r(s["q"][:8]),
        "out": r(s["out"][:8]),
        "d": int(s["q"].numel()),
        "d_v": int(s["out"].numel()),
    }


__all__ = ["Frame", "View", "byte_labels", "view"]
