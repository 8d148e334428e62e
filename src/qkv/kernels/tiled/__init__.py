"""The tiled kernel: block-sparse attention with its own backward, O(T·D) memory.

``plan`` turns a mask's block map into chunks of keys per query block. ``loop`` is the
readable PyTorch kernel over them, and the fallback. ``flash`` runs the same plan as calls
of torch's fused CPU flash kernel, and ``native`` runs it in qkv's own C kernel, in float32
or bfloat16. Which of them runs is the dispatch's choice (``call.path``, named by
:func:`qkv.dispatch`). This module runs it and holds the autograd function.

Legend: B batch · H query heads · H_kv key/value heads · T_q/T_k query/key length ·
D head dim · D_v value head dim.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..contract import Lowered, Result, sink_factor, sink_grad
from ..reference import accumulation_dtype
from . import flash
from .loop import loop_backward, loop_forward
from .plan import row_dot


def forward(
    call: Lowered, *, transient: bool = False, rounded: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """out (B, H, T_q, D_v) and lse (B, H, T_q), both in the accumulation dtype, without
    autograd: the call's flash calls (torch's kernel, or qkv's native one) or the PyTorch
    loop, as ``call.path`` says. ``transient``: the caller copies out and drops it before
    this thread's next kernel call; ``rounded``: out may come in the inputs' dtype, rounded
    by the native kernel (:func:`flash.fused_forward`)."""
    if call.path in FUSED:
        native = _native_dtype(call)
        return flash.fused_forward(call, native=native, transient=transient, rounded=rounded)
    return loop_forward(call)


FUSED = ("tiled-flash", "tiled-native", "tiled-native-widen")


def _native_dtype(call: Lowered) -> torch.dtype | None:
    """The dtype the native kernel computes the call in — the inputs' ("tiled-native") or
    float32 on half-precision inputs widened as loaded ("tiled-native-widen") — or None:
    torch's flash kernel."""
    return {"tiled-native": call.q.dtype, "tiled-native-widen": torch.float32}.get(call.path)


def backward(
    call: Lowered,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    dlse: torch.Tensor | None = None,
    *,
    delta: torch.Tensor | None = None,
    need_mod: bool = False,
) -> tuple[torch.Tensor | None, ...]:
    """dq, dk, dv (and, with ``need_mod``, the gradients of ``call.mod_tensors``; else
    Nones) given the forward's out and lse and the gradients reaching them (``dlse`` None:
    nothing reaches the log-sum-exp). The flash calls' backward where the forward ran them
    and nothing reaches the log-sum-exp or a modification's tensors, and the modification
    is none or one the native kernel applies itself, and the loop's otherwise. ``delta``
    (rowsum(dout ∘ out), accumulation dtype) is computed here unless given."""
    if dlse is None and not need_mod and _fused_mod(call) and call.path in FUSED:
        native = _native_dtype(call)
        grads = flash.fused_backward(call, out, lse, dout, native=native, delta=delta)
        return (*grads, *(None for _ in call.mod_tensors))  # (ALiBi's slopes: no gradient)
    return loop_backward(call, out, lse, dout, dlse, delta=delta, need_mod=need_mod)


def _fused_mod(call: Lowered) -> bool:
    """Whether the fused steps take the call's modification: none, or a soft-cap or ALiBi
    in the native kernel."""
    mod = call.mod_tiles
    native = _native_dtype(call) is not None
    return mod is None or (native and (mod.softcap is not None or mod.alibi is not None))


class _TiledAttention(torch.autograd.Function):
    """The tiled kernel under autograd. Sinks are applied to the forward's result (a sink
    is a key with no value), so the saved out and lse already include them and the
    backward is the plain one on those: P = exp(S - lse) is the sink-aware softmax and the
    sink, having no value, adds no term. The sinks' own gradient is
    ``Σ_rows exp(sink - lse) · (dlse - rowsum(dout ∘ out))``."""

    @staticmethod
    def forward(
        ctx: Any,
        call: Any,
        sinks: torch.Tensor | None,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *mod_tensors: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Half precision: the native kernel rounds out as it writes it, unless sinks scale
        # it after; otherwise out is rounded below (a copy of the float32 one).
        half = q.dtype != accumulation_dtype(q.dtype)
        out, lse = forward(call, transient=half, rounded=half and sinks is None)
        if sinks is not None:  # in place: out is the forward's own buffer
            factor, lse = sink_factor(lse, sinks)
            out.mul_(factor[..., None].to(out.dtype))
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks, *mod_tensors)
        ctx.call = call
        # An output nothing reads gets no gradient (None), not zeros to fill and check:
        # each is a parallel region, and a busy machine makes every region dear.
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor | None, dlse: torch.Tensor | None) -> tuple[Any, ...]:
        q, k, v, out, lse, sinks, *mod_tensors = ctx.saved_tensors
        call = dataclasses.replace(ctx.call, q=q, k=k, v=v, mod_tensors=tuple(mod_tensors))
        if dout is None:  # only the log-sum-exp is read
            dout = torch.zeros_like(out)
        if dlse is not None and not bool(dlse.any()):
            dlse = None  # nothing reaches the log-sum-exp: the cheaper backward applies
        need_sinks = sinks is not None and ctx.needs_input_grad[1]
        # rowsum(dout ∘ out), (B, H, T_q): the sinks' gradient reads it; computed once
        delta = row_dot(dout, out, lse.dtype) if need_sinks else None
        need_mod = any(ctx.needs_input_grad[5:])
        grads = backward(call, out, lse, dout, dlse, delta=delta, need_mod=need_mod)
        dsinks = None
        if need_sinks:
            assert delta is not None
            d_lse = delta.neg() if dlse is None else dlse.to(lse.dtype) - delta
            dsinks = sink_grad(sinks, lse, d_lse)
        return (None, dsinks, *grads)


def run(call: Lowered) -> Result:
    """The contract's entry: block-sparse attention with its own backward, the call's
    sinks applied. out in q's dtype and lse in the accumulation dtype. Gradients flow
    through both to q, k, v, the sinks and the tensors the score modification reads."""
    out, lse = _TiledAttention.apply(call, call.sinks, call.q, call.k, call.v, *call.mod_tensors)
    return Result(out, lse)
