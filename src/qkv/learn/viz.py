"""Heatmaps of attention weights. matplotlib is imported only when a picture is drawn
(install it with ``pip install "qkv[plot]"``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch


def _matplotlib() -> tuple[Any, Any]:
    try:
        from matplotlib import colormaps
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError('heatmaps need matplotlib: pip install "qkv[plot]"') from None
    return Figure, colormaps


def heatmap(
    weights: torch.Tensor,
    queries: Sequence[str],
    keys: Sequence[str],
    *,
    mask: torch.Tensor | None = None,
    title: str = "attention weights",
    path: str | Path | None = None,
) -> Any:
    """Draw attention weights, one panel per head, token labels on both axes.

    Args:
        weights: (H, T_q, T_k) or (T_q, T_k), values in [0, 1].
        queries, keys: labels of the T_q rows and the T_k columns.
        mask: (T_q, T_k) bool, True = may attend; masked cells are drawn grey and blank.
        title: the figure's title.
        path: if given, the PNG is written there.

    Returns:
        The ``matplotlib.figure.Figure`` (no pyplot state is touched).
    """
    Figure, colormaps = _matplotlib()
    w = weights.detach().float().cpu()
    w = w[None] if w.ndim == 2 else w  # (H, T_q, T_k)
    H, T_q, T_k = w.shape
    allowed = np.ones((T_q, T_k), bool) if mask is None else mask.detach().cpu().numpy()
    cell = 0.55
    fig = Figure(figsize=(H * (T_k * cell + 1.6) + 0.6, T_q * cell + 2.0), layout="constrained")
    fig.suptitle(title)
    axes = fig.subplots(1, H, squeeze=False)[0]
    cmap = colormaps["viridis"].with_extremes(bad="0.85")  # masked cells: light grey
    # On 0–1, the scale every softmax row shares: near-uniform weights look near-uniform
    # (a scale fitted to their own narrow range made one column glow as if it mattered).
    lo, hi = 0.0, 1.0
    for h, ax in enumerate(axes):
        shown = np.ma.masked_array(w[h].numpy(), mask=~allowed)
        image = ax.imshow(shown, cmap=cmap, vmin=lo, vmax=hi)
        ax.set_xticks(range(T_k), labels=[shorten(t) for t in keys], rotation=45, ha="right")
        ax.set_yticks(range(T_q), labels=[shorten(t) for t in queries])
        ax.set_xlabel("key (attended to)")
        ax.set_ylabel("query (attending)")
        if H > 1:
            ax.set_title(f"head {h}")
        if T_q * T_k <= 400:  # write each weight in its cell while they stay legible
            _label_cells(ax, w[h].numpy(), allowed, lo, hi)
    fig.colorbar(
        image,
        ax=list(axes),
        label="attention weight (0–1)",
        shrink=0.8,
    )
    long = [(i, t) for i, t in enumerate(list(dict.fromkeys([*queries, *keys]))) if shorten(t) != t]
    if long:  # the whole text of every label shortened on the axes
        fig.text(
            0.01,
            0.0,
            "labels shortened: "
            + "; ".join(f"{shorten(t)} = {t!r}" for _, t in long[:8])
            + (f"; … {len(long) - 8} more" if len(long) > 8 else ""),
            fontsize=7,
            ha="left",
            va="bottom",
            wrap=True,
        )
    if path is not None:
        fig.savefig(path, dpi=150)
    return fig


#: the longest label drawn on an axis; longer ones end in "…"
LABEL_CHARS = 16


def shorten(label: str) -> str:
    """A label as an axis shows it: at most :data:`LABEL_CHARS` characters."""
    label = str(label)
    return label if len(label) <= LABEL_CHARS else label[: LABEL_CHARS - 1] + "…"


def _label_cells(
    ax: Any, values: np.ndarray, where: np.ndarray, lo: float = 0.0, hi: float = 1.0
) -> None:
    """Write each value in its cell (where ``where`` is True), legible on viridis scaled
    from ``lo`` to ``hi``."""
    for i, j in zip(*np.nonzero(where)):
        value = float(values[i, j])
        ax.text(
            j,
            i,
            f"{value:.2f}",
            ha="center",
            va="center",
            fontsize=7,
            color="black" if (value - lo) / (hi - lo) > 0.6 else "white",
        )


def head_scores_heatmap(
    scores: dict[str, torch.Tensor], *, title: str = "head scores", path: str | Path | None = None
) -> Any:
    """Draw :func:`qkv.heads.head_scores`: one layers × heads panel per score, 0 to 1,
    each cell labelled with its value.

    Returns:
        The ``matplotlib.figure.Figure``; written to ``path`` as PNG when given.
    """
    Figure, colormaps = _matplotlib()
    names = list(scores)
    L, H = scores[names[0]].shape
    fig = Figure(
        figsize=(len(names) * (H * 0.55 + 1.2) + 0.8, L * 0.55 + 1.6), layout="constrained"
    )
    fig.suptitle(title)
    axes = fig.subplots(1, len(names), squeeze=False)[0]
    for ax, name in zip(axes, names):
        values = scores[name].detach().float().cpu().numpy()
        image = ax.imshow(values, cmap=colormaps["viridis"], vmin=0.0, vmax=1.0)
        ax.set_title(name.replace("_", " "))
        ax.set_xticks(range(H))
        ax.set_yticks(range(L))
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        if L * H <= 256:
            _label_cells(ax, values, np.ones_like(values, dtype=bool))
    fig.colorbar(image, ax=list(axes), label="mean attention weight", shrink=0.8)
    if path is not None:
        fig.savefig(path, dpi=150)
    return fig
