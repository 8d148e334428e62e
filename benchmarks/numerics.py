"""Numerics report: the max error of each backend against the float64 NumPy oracle, for
float32, bfloat16 and float16 inputs. Prints the markdown table kept in docs/semantics.md.

    python benchmarks/numerics.py

The oracle runs on the *same* rounded inputs cast to float64, so the table measures what
each kernel adds, not the rounding of the inputs. Inputs: B=2, H=8, H_kv=4, T=257, D=64,
standard normal; masks none, causal, sliding_window(64), document (4 documents). The last
kernel column is the native bfloat16 kernel with P rounded once to bfloat16
(``qkv.tuned(p_parts=1)``, docs/kernels.md#the-native-kernel): bfloat16 only.
"""

from __future__ import annotations

import numpy as np
import torch

import qkv
from qkv import masks
from qkv.kernels.tiled import native

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
BACKENDS = ["reference", "sdpa", "tiled"]
MASKS = {
    "none": None,
    "causal": masks.causal(),
    "sliding_window(64)": masks.sliding_window(64),
    "document": masks.document(np.arange(257) * 4 // 257),
}


def report() -> str:
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(2, h, 257, 64, generator=g, dtype=torch.float64) for h in (8, 4, 4)]
    lines = [
        "| dtype | mask | " + " | ".join(BACKENDS) + " | tiled, P rounded once "
        "| output's own rounding |",
        "|---|---|" + "---|" * (len(BACKENDS) + 2),
    ]
    for dtype in DTYPES:
        q, k, v = (x.to(dtype) for x in base)
        for name, mask in MASKS.items():
            want = qkv.numpy.attention(*(x.double().numpy() for x in (q, k, v)), mask=mask)

            def error(b):
                return np.abs(
                    qkv.attention(q, k, v, mask=mask, backend=b).double().numpy() - want
                ).max()

            errors = [f"{error(b):.1e}" for b in BACKENDS]
            errors.append("—")
            if dtype == torch.bfloat16 and native.supports(q, k, v):
                with qkv.tuned(p_parts=1):
                    errors[-1] = f"{error('tiled'):.1e}"
            # The least any kernel can do: round the exact answer to the dtype once.
            floor = np.abs(torch.from_numpy(want).to(dtype).double().numpy() - want).max()
            lines.append(
                f"| {str(dtype).replace('torch.', '')} | {name} | "
                + " | ".join(errors)
                + f" | {floor:.1e} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    print(report())
