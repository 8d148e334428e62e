"""``qkv bench --kv-memory``: the bytes a KV cache holds per token, for MHA, GQA, MQA,
multi-head latent attention and a sliding window side by side, measured from the caches qkv
builds rather than estimated by formula.

Legend: H heads · D head dim.
"""

from __future__ import annotations

import torch

from ..nn import KVCache, LatentCache


def kv_memory(
    H: int,
    D: int,
    kv_heads: int,
    kv_lora_rank: int,
    rope_dim: int,
    window: int,
    layers: int,
    context: int,
    dtype: torch.dtype,
) -> str:
    """The bytes a KV cache holds per token for one model shape, measured from the caches
    qkv builds (a :class:`qkv.KVCache` per kind of attention, a :class:`qkv.nn.LatentCache`
    for multi-head latent attention): their buffers' bytes over their capacity in tokens,
    and what one sequence of ``context`` tokens then holds over ``layers`` layers. A
    sliding window's cache keeps its last ``window`` tokens alone."""
    n = 64  # tokens of capacity: bytes per token do not depend on it

    def per_token(cache: KVCache | LatentCache, tokens: int = n) -> float:
        held = (
            cache.tensors().values()
            if isinstance(cache, LatentCache)
            else (cache.keys, cache.values)
        )
        return sum(t.numel() * t.element_size() for t in held) / tokens

    kinds = {
        f"MHA (H_kv = {H})": per_token(KVCache(1, H, n, D, dtype=dtype)),
        f"GQA (H_kv = {kv_heads})": per_token(KVCache(1, kv_heads, n, D, dtype=dtype)),
        "MQA (H_kv = 1)": per_token(KVCache(1, 1, n, D, dtype=dtype)),
        f"MLA (r = {kv_lora_rank}, rope = {rope_dim})": per_token(
            LatentCache(1, n, kv_lora_rank, rope_dim, dtype=dtype)
        ),
    }
    window_cache = KVCache(1, H, min(window, context), D, dtype=dtype)
    mha = kinds[f"MHA (H_kv = {H})"]
    name = str(dtype).removeprefix("torch.")
    lines = [
        f"# H = {H} heads of {D}, {layers} layers, {name}; one sequence of {context} tokens",
        "| cache | bytes per token and layer | per token, all layers | one sequence | ÷ MHA |",
        "|---|---|---|---|---|",
    ]
    for kind, b in kinds.items():
        total = b * layers * context
        lines.append(
            f"| {kind} | {b:,.0f} | {b * layers / 1024:,.1f} KiB | {total / 2**20:,.1f} MiB | "
            f"{b / mha:.4f} |"
        )
    held = per_token(window_cache, context) * context * layers  # a window keeps W tokens
    lines.append(
        f"| MHA, sliding window of {window} | {held / layers / context:,.0f} (over the "
        f"sequence) | {held / context / 1024:,.1f} KiB | {held / 2**20:,.1f} MiB | "
        f"{held / layers / context / mha:.4f} |"
    )
    return "\n".join(lines)
