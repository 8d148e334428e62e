"""torch's fused CPU flash kernel, forward and backward, as the tiled kernel calls it
span by span: ``softmax(Q Kᵀ · scale + mask) V`` and its log-sum-exp, the online softmax in
float32 (float64 for float64) and the matmuls in the inputs' dtype. Private torch ops:
None where this torch lacks them, and the callers then take another path."""

from __future__ import annotations

from typing import Any

import torch

FLASH: Any = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
FLASH_BACKWARD: Any = getattr(
    torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None
)
