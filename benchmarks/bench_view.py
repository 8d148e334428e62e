"""The viewer at 2,048 tokens, 4 layers × 8 heads (docs/induction.md): file size, the time
to build it, and the time headless Chromium takes to load and draw it, then to draw a
clicked head's whole pattern — medians of 5 loads.

    python benchmarks/bench_view.py
"""

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from browser import Browser

from qkv.models import GPT, GPTConfig
from qkv.view import view


def main(T: int = 2048, layers: int = 4, heads: int = 8, repeats: int = 5) -> None:
    torch.manual_seed(0)
    model = GPT(
        GPTConfig(block_size=T, n_layer=layers, n_head=heads, n_embd=128, positions="rope")
    ).eval()
    tokens = torch.randint(0, 256, (T,), generator=torch.Generator().manual_seed(0))
    t0 = time.perf_counter()
    page = view(model, tokens)
    build = time.perf_counter() - t0
    path = Path(tempfile.mkdtemp()) / "view.html"
    page.save(path)
    loads, clicks = [], []
    with Browser(timeout=60) as b:
        for _ in range(repeats):
            loads.append(b.open(path))
            t0 = time.perf_counter()
            b.click(f"#qkv-cell-{layers - 1}-{heads - 1}")
            b.wait("qkvView.draws >= 1")
            clicks.append(time.perf_counter() - t0)
        requests = list(b.requests)
    print(
        "| T | layers × heads | file | build (Python) | load + draw (Chromium) | "
        "click a head | requests |"
    )
    print("|---|---|---|---|---|---|---|")
    print(
        f"| {T} | {layers} × {heads} | {path.stat().st_size / 1e6:.1f} MB | {build:.1f} s | "
        f"{statistics.median(loads):.2f} s | {statistics.median(clicks) * 1e3:.0f} ms | "
        f"{len(set(requests))} (the file itself) |"
    )


if __name__ == "__main__":
    main()
