"""Heatmaps of attention weights. matplotlib is imported only when a picture is drawn
(install it with ``pip install "qkv[plot]"``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch


def _matplotlib() -> tuple[Any, Any]:
    try:
        from matplotlib import colormaps
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError('heatmaps need matplotlib: pip install "qkv[plot]"') from None
    return Figure, colormaps


def heatmap(weights: torch.Tensor, queries: Sequence[str], keys: Sequence[str], *,
            mask: torch.Tensor | None = None, title: str = "attention weights",
            path: str | Path | None = None) -> Any:
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
    fig = Figure(figsize=(H * (T_k * cell + 1.6) + 0.6, T_q * cell + 2.0),
                          layout="constrained")
    fig.suptitle(title)
    axes = fig.subplots(1, H, squeeze=False)[0]
    cmap = colormaps["viridis"].with_extremes(bad="0.85")  # masked cells: light grey
    for h, ax in enumerate(axes):
        shown = np.ma.masked_array(w[h].numpy(), mask=~allowed)
        image = ax.imshow(shown, cmap=cmap, vmin=0.0, vmax=1.0)
        ax.set_xticks(range(T_k), labels=list(keys), rotation=45, ha="right")
        ax.set_yticks(range(T_q), labels=list(queries))
        ax.set_xlabel("key (attended to)")
        ax.set_ylabel("query (attending)")
        if H > 1:
            ax.set_title(f"head {h}")
        if T_q * T_k <= 400:  # write each weight in its cell while they stay legible
            for i, j in zip(*np.nonzero(allowed)):
                value = float(w[h, i, j])
                ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=7,
                        color="black" if value > 0.6 else "white")
    fig.colorbar(image, ax=list(axes), label="attention weight", shrink=0.8)
    if path is not None:
        fig.savefig(path, dpi=150)
    return fig
