"""Which code runs a call once a rule has picked its kernel: how torch's fused kernel takes
the mask (:func:`sdpa_mode`) and whether it runs half precision on float32 copies
(:func:`widened`). Which code of the tiled kernel runs the plan (:func:`tiled_path`: qkv's
native kernel, the same widening its inputs, torch's flash kernel call by call, or the PyTorch
loop), from what each kernel can take and what the machine's profile measured.

Legend: T_q/T_k query/key length · D head dim · D_v value head dim.
"""

from __future__ import annotations

import torch

from .._checks import Problem
from ..kernels.tiled import flash, native, profile, steps
from ..masks import FULL, Mask
from ..scores import ScoreMod
from .call import Call


def sdpa_takes(mod: ScoreMod) -> bool:
    """Whether torch's fused kernel can apply a score modification: as a float mask, if it
    is additive and nothing it reads needs a gradient (SDPA gives the mask none)."""
    return mod.additive and not any(t.requires_grad for t in mod.tensors())


def sdpa_mode(a: Call) -> str:
    """How SDPA should receive this mask: not at all ("none": no mask, or a qkv mask that is
    FULL over the whole problem, e.g. causal for one query at the end of a KV cache),
    as ``is_causal`` (top-left causal, T_q == T_k), as a dense bool tensor, or with an
    additive score modification as one float tensor ("bias")."""
    p, mask = a.p, a.mask
    if a.mod is not None:
        return "bias"
    if mask is None:
        return "none"
    if a.causal_square:
        return "is_causal"
    if a.tracing:
        return "none" if causal_at_the_end(a) else "dense"
    if isinstance(mask, Mask) and allows_everything(mask, p):
        return "none"
    return "dense"


def allows_everything(mask: Mask, p: Problem) -> bool:
    return (
        p.T_q > 0
        and p.T_k > 0
        and bool(
            (
                mask.blocks(
                    p.B, p.H, p.T_q, p.T_k, block_q=p.T_q, block_k=p.T_k, q_offset=p.q_offset
                )
                == FULL
            ).all()
        )
    )


def causal_at_the_end(a: Call) -> bool:
    """Causal for one query at the end of the keys: it sees them all (decided from sizes'
    relations only, as a trace may)."""
    return (
        isinstance(a.mask, Mask)
        and a.mask.kind == "causal"
        and a.p.T_q == 1
        and a.p.q_offset == a.p.T_k - 1
    )


def widened(a: Call) -> bool:
    """Whether torch's fused kernel should run this half-precision call on float32 copies:
    on the CPU, where the machine's profile found torch's kernel slower in its dtype than on
    copies. That is forward and backward for a call that needs a gradient, the forward for
    one that does not (:meth:`qkv.kernels.tiled.profile.Probe.widens`). Never while the
    probe is off, nor while tracing."""
    if a.q.dtype not in (torch.bfloat16, torch.float16) or a.q.device.type != "cpu":
        return False
    if a.tracing or not a.tuning.native_probe:
        return False
    return profile.probe().widens(a.q.dtype, backward=needs_grad(a))


def needs_grad(a: Call) -> bool:
    """Whether the call will be differentiated: grad mode on and one of Q, K, V needing it."""
    return torch.is_grad_enabled() and any(x.requires_grad for x in (a.q, a.k, a.v))


def native_causal(a: Call) -> bool:
    """Whether this causal call with T_q == T_k runs faster through the native kernel than
    through torch's fused kernel here: on the CPU, from :attr:`qkv.Tuning.native_scores`
    scores on, where the machine's profile runs float32 natively and found its causal pass
    under its line for the call's dtype × torch's time (float32:
    :data:`~qkv.kernels.tiled.choices.CAUSAL_AT`; half precision: against the path it takes
    otherwise, :meth:`~qkv.kernels.tiled.profile.Probe.causal_at`) — forward and backward
    for a call that needs a gradient, the forward for one that does not
    (:meth:`qkv.kernels.tiled.profile.Probe.causal`). Never while tracing, nor with the probe
    off (torch's kernel then, unmeasured)."""
    if a.tracing or not (a.tuning.native and a.tuning.native_probe) or a.q.device.type != "cpu":
        return False
    if a.scores < a.tuning.native_scores:
        return False
    found = profile.probe()
    return found.float32 and found.causal(a.q.dtype, needs_grad(a))


def tiled_path(a: Call) -> tuple[str, str]:
    """Which code of the tiled kernel runs this call, and why. While tracing it is
    "tiled-op", and the op decides at run time by this function. The PyTorch loop runs
    where a score modification the native kernel does not apply (:func:`native_mod`) is
    applied, where the fused calls are turned off, or where torch's flash kernel cannot
    take the call. qkv's native kernel runs float32 and bfloat16 where it can and the probe
    found it worth it. Otherwise torch's flash kernel runs call by call, or the loop for a
    modification. This reads K (and for the native kernel Q and V) once, to know they are
    finite."""
    if a.tracing:
        return "tiled-op", "the tiled kernel as one opaque op, which picks its code at run time"
    loop = "the PyTorch loop applies the score modification tile by tile"
    mod = native_mod(a.mod)
    if a.mod is not None and mod is None:
        return "tiled-loop", loop
    if not a.tuning.fused:
        return "tiled-loop", "the PyTorch loop: fused calls turned off (Tuning.fused)"
    capped = "" if mod is None else f", {mod} applied in it"
    if a.tuning.native and a.key_finite:
        name = str(a.q.dtype).removeprefix("torch.")
        # what reads nothing first, then whether the native kernel wins (the machine's
        # profile: measured once), then supports, which reads Q and V: a half-precision call
        # that read them for its dtype's step and then for the widened one paid two more
        # passes over them (timed in docs/benchmarks.md, "measurements behind code choices")
        fits = native.fits(a.q, a.k, a.v)
        if fits and native_wins(a, a.q.dtype) and native.supports(a.q, a.k, a.v):
            on = steps.isa(a.q.dtype)
            return "tiled-native", (
                f"qkv's native {name} kernel ({on}) runs the plan in one call{capped}"
            )
        half = a.q.dtype in (torch.bfloat16, torch.float16)
        f32 = torch.float32
        widen = half and native.fits(a.q, a.k, a.v, f32)
        if widen and native_wins(a, f32) and native.supports(a.q, a.k, a.v, f32):
            return "tiled-native-widen", (
                f"qkv's native float32 kernel ({steps.isa()}) runs the plan in one call, "
                f"widening {name} as it loads it{capped}"
            )
    if not flash.supports(a.q, a.k, a.v, key_finite=a.key_finite):
        return "tiled-loop", (
            "the PyTorch loop: neither the native kernel nor torch's flash kernel can take "
            "this call (not on the CPU, NaN/inf in the keys, head dims past the native "
            "kernel's with D_v != D, or this torch lacks it)"
        )
    if a.mod is not None:
        return "tiled-loop", f"{loop} (the native kernel cannot run this call)"
    return "tiled-flash", "torch's fused flash kernel runs the plan call by call"


def native_mod(mod: ScoreMod | None) -> str | None:
    """The modification the native kernel applies itself, in words, else None. It applies
    ALiBi whose slopes need no gradient (the kernel computes none for them), a soft-cap, or
    the two in that order (:attr:`qkv.scores.ScoreMod.alibi`)."""
    if mod is None or (mod.alibi is None and mod.softcap is None):
        return None
    if mod.alibi is not None and mod.alibi.requires_grad:
        return None
    parts = ["the ALiBi slopes"] if mod.alibi is not None else []
    parts += [f"the soft-cap ({mod.softcap:g})"] if mod.softcap is not None else []
    return " then ".join(parts)


def native_wins(a: Call, dtype: torch.dtype) -> bool:
    """Whether the native kernel is worth it in ``dtype`` here: in bfloat16 it must be
    faster than the float32 path, in float32 no slower than torch's flash kernel (see
    :class:`qkv.kernels.tiled.profile.Probe`). This is measured once per machine and stored
    (:func:`qkv.kernels.tiled.profile.probe`), or taken as given when the probe is off."""
    if not a.tuning.native_probe:
        return True
    found = profile.probe()
    return found.float32 if dtype == torch.float32 else found.faster
