"""The sdpa kernel: torch's fused ``scaled_dot_product_attention``.

The fastest dense path on CPU and GPU. It returns neither weights nor log-sum-exp and
draws dropout from torch's global generator, so the core sends those cases elsewhere.

Legend: B batch · H query heads · H_kv key/value heads · G = H / H_kv · T_q/T_k query/key
length · D head dim · D_v value head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .contract import Lowered, Result, sink_rows


def sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None,
    is_causal: bool,
    scale: float,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Args as :func:`qkv.kernels.reference.reference`; ``is_causal`` is torch's top-left
    causal mask, which equals ours only when T_q == T_k. Returns out (B, H, T_q, D_v)."""
    B, H, T_q, D = q.shape
    H_kv = k.shape[1]
    # A plain bool under torch.compile (a branch): H != H_kv would be a SymBool there.
    gqa = True if H_kv != H else False  # noqa: SIM210
    if gqa and mask is None and not is_causal:
        # GQA with no mask (every decode step): the G query heads sharing a key/value head
        # become G·T_q query rows of it, so each head of the cache is read once, not G times
        # as torch's enable_gqa reads it on the CPU (docs/benchmarks.md#decode-and-serving).
        rows = q.reshape(B, H_kv, (H // H_kv) * T_q, D)  # query head h = kv_head·G + g
        out = F.scaled_dot_product_attention(rows, k, v, dropout_p=dropout_p, scale=scale)
        return out.view(B, H, T_q, v.shape[-1])
    return F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        is_causal=is_causal,
        dropout_p=dropout_p,
        scale=scale,
        enable_gqa=gqa,
    )


def run(call: Lowered) -> Result:
    """The contract's entry: the call's float mask if it has one, else its bool mask or
    ``is_causal``. With sinks, :func:`with_sink_key`. On path "sdpa-float32", half-precision
    inputs run on float32 copies and the output is rounded back (the gradients flow back
    through the copies in the inputs' dtypes): where the CPU has no bfloat16 dot product,
    torch's half-precision backward runs several times slower than float32's."""
    q, k, v = call.q, call.k, call.v
    mask = call.bias if call.bias is not None else call.dense
    is_causal = call.is_causal
    if call.sinks is not None:
        k, v, mask = with_sink_key(call)
        is_causal = False
    dtype = q.dtype
    if call.path == "sdpa-float32":
        q, k, v = (x.float() for x in (q, k, v))
        mask = mask.float() if mask is not None and mask.is_floating_point() else mask
    out = sdpa(q, k, v, mask=mask, is_causal=is_causal, scale=call.scale, dropout_p=call.dropout_p)
    return Result(out.to(dtype))


def with_sink_key(call: Lowered) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sinks as torch's kernel can take them: one more key, zero in k and v, whose score is
    the sink's logit, given by a float mask column (SDPA adds the mask to the scaled
    scores, so ``0 · scale + sink``). Exact, gradients reach the sinks through the mask;
    the mask is (B, H, T_q, T_k + 1) floats, as any float mask of this kernel is."""
    q, k, v, sinks = call.q, call.k, call.v, call.sinks
    assert sinks is not None
    B, H, T_q, _ = q.shape
    T_k = k.shape[2]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    if call.bias is not None:
        scores = call.bias.to(acc)
    elif call.dense is not None or call.is_causal:
        allowed = call.dense
        if allowed is None:  # is_causal: top-left, T_q == T_k
            allowed = torch.ones(T_q, T_k, dtype=torch.bool, device=q.device).tril()
        scores = torch.zeros((), dtype=acc, device=q.device).masked_fill(~allowed, float("-inf"))
    else:
        scores = torch.zeros((), dtype=acc, device=q.device)
    scores = scores.expand(B, H, T_q, T_k)
    sink = sink_rows(sinks, acc)[..., None].expand(B, H, T_q, 1)
    mask = torch.cat([scores, sink], dim=-1)
    # A sink of +inf takes its whole row, so the row's output is 0: torch's softmax would
    # compute inf - inf there, so the row is given as fully masked, which SDPA returns as 0.
    mask = mask.masked_fill(sink == float("inf"), float("-inf")).to(q.dtype)
    zero_k = k.new_zeros(B, k.shape[1], 1, k.shape[3])
    zero_v = v.new_zeros(B, v.shape[1], 1, v.shape[3])
    return torch.cat([k, zero_k], dim=2), torch.cat([v, zero_v], dim=2), mask
