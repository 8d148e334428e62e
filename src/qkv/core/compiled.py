"""qkv inside ``torch.compile``: one graph, no data-dependent branch.

Eager dispatch reads values (is a key finite?) and plans blocks with NumPy from concrete
lengths; neither can happen while dynamo traces, and the tiled kernel's Python loops would
unroll into a graph that grows with T². So, while compiling:

- :func:`choose` decides from the mask's type, the call's options and size relations only
  (never from tensor values, never from a length's value, so ``dynamic=True`` keeps one
  graph for every length);
- the tiled kernel runs as the custom op ``qkv::tiled_attention``, opaque to the compiler:
  it receives the mask and the score modification as a *recipe* — a string of tokens plus
  the tensors they read — rebuilds them, validates them and plans its blocks at run time,
  with a fake implementation for tracing and an autograd formula (``qkv::tiled_attention_
  backward``) that carries gradients to q, k, v and the modification's tensors;
- a mask that cannot be rebuilt from a recipe (a user predicate) is lowered to a dense bool
  tensor inside the graph and reaches the op as ``dense``; a user score function runs on
  the reference kernel, traced into the graph.

Legend: B batch · H query heads · T_q/T_k query/key length · D_v value head dim.
"""

from __future__ import annotations

from typing import Any

import torch

from .._checks import Problem, check_attention
from ..kernels.reference import accumulation_dtype
from ..kernels.tiled import tiled_backward, tiled_forward
from ..masks import algebra as MA
from ..masks import library as M
from ..scores import base as SB
from ..scores import library as S
from .dispatch import Dispatch, MaskLike, _plan
from .lowering import dense_mask, mask_tile, mod_tile

_LEAVES = {M._Full: "full", M._Causal: "causal"}


def _int(ints: list, n: Any) -> str:
    """Keep an int parameter aside (symbolic under dynamic=True: no string of it)."""
    ints.append(n)
    return str(len(ints) - 1)


def mask_recipe(mask: Any, tensors: list, ints: list) -> list[str] | None:
    """Tokens (postfix) that rebuild ``mask`` from ``tensors`` and ``ints``; None for a
    predicate."""
    if type(mask) in _LEAVES:
        return [_LEAVES[type(mask)]]
    if isinstance(mask, M._SlidingWindow):
        return ["window:" + _int(ints, mask.window)]
    if isinstance(mask, M._PrefixLM):
        return ["prefix_lm:" + _int(ints, mask.prefix)]
    if isinstance(mask, (M._Padding, M._Document)):
        tensors.append(torch.as_tensor(mask.lengths if isinstance(mask, M._Padding) else mask.ids))
        return [f"{'padding' if isinstance(mask, M._Padding) else 'document'}:{len(tensors) - 1}"]
    if isinstance(mask, MA._Not):
        inner = mask_recipe(mask.inner, tensors, ints)
        return None if inner is None else [*inner, "not"]
    if isinstance(mask, (MA._And, MA._Or)):
        left = mask_recipe(mask.left, tensors, ints)
        right = mask_recipe(mask.right, tensors, ints)
        if left is None or right is None:
            return None
        return left + right + ["and" if isinstance(mask, MA._And) else "or"]
    if isinstance(mask, torch.Tensor):
        tensors.append(mask)
        return [f"dense:{len(tensors) - 1}"]
    return None


def mod_recipe(mod: Any, tensors: list, ints: list) -> list[str] | None:
    """Tokens that rebuild a score modification; None for a user function."""
    if isinstance(mod, S._Softcap):
        return [f"softcap:{mod.cap!r}"]
    if isinstance(mod, SB._Chain):
        parts = [mod_recipe(m, tensors, ints) for m in mod.mods]
        if any(p is None for p in parts):
            return None
        return [t for p in parts for t in p] + [f"chain:{len(mod.mods)}"]
    for kind, attr in ((S._Alibi, "slopes"), (S._RelativeBias, "table"), (S._Bias, "tensor")):
        if isinstance(mod, kind):
            tensors.append(getattr(mod, attr))
            token = f"{kind.__name__[1:].lower()}:{len(tensors) - 1}"
            if isinstance(mod, S._RelativeBias):
                token += f":{_int(ints, int(mod.bidirectional))}:{_int(ints, mod.max_distance)}"
            return [token]
    return None


def rebuild(recipe: str, tensors: list[torch.Tensor], ints: list[int]) -> Any:
    """The mask or modification (or None, for an empty recipe) a recipe describes."""
    stack: list[Any] = []
    for token in recipe.split():
        name, *args = token.split(":")
        if name in ("and", "or"):
            right, left = stack.pop(), stack.pop()
            stack.append(left & right if name == "and" else left | right)
        elif name == "not":
            stack.append(~stack.pop())
        elif name == "chain":
            n = int(args[0])
            mods, stack = stack[-n:], stack[:-n]
            stack.append(SB.chain(*mods))
        elif name in ("full", "causal"):
            stack.append(getattr(M, name)())
        elif name in ("window", "prefix_lm"):
            stack.append(
                (M.sliding_window if name == "window" else M.prefix_lm)(ints[int(args[0])])
            )
        elif name == "softcap":
            stack.append(S.softcap(float(args[0])))
        else:
            t = tensors[int(args[0])]
            build = {
                "padding": M.padding,
                "document": M.document,
                "dense": lambda x: x,
                "alibi": S.alibi,
                "bias": S.bias,
                "relativebias": lambda x: S.relative_bias(
                    x, bidirectional=bool(ints[int(args[1])]), max_distance=ints[int(args[2])]
                ),
            }
            stack.append(build[name](t))
    return stack[0] if stack else None


def _rebuilt(q, k, v, mask_recipe_: str, mod_recipe_: str, tensors, ints, scale, q_offset):
    """The problem, mask, modification and plan of one op call, validated here, at run time."""
    mask, mod = rebuild(mask_recipe_, tensors, ints), rebuild(mod_recipe_, tensors, ints)
    p = check_attention(q, k, v, mask=mask, scale=scale, q_offset=q_offset)
    if mod is not None:
        mod.validate(p.B, p.H, p.T_q, p.T_k)
    return (
        p,
        _plan(mask, p),
        mask_tile(mask, p, q.device),
        mod_tile(mod, p, q.device),
        mod.tensors() if mod is not None else (),
    )


@torch.library.custom_op("qkv::tiled_attention", mutates_args=())
def _tiled_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: str,
    mod: str,
    tensors: list[torch.Tensor],
    ints: list[int],
    scale: float,
    q_offset: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    p, plan, mtile, stile, _ = _rebuilt(q, k, v, mask, mod, tensors, ints, scale, q_offset)
    out, lse = tiled_forward(q, k, v, plan, mtile, p.scale, stile)
    return out.to(q.dtype), lse


@_tiled_op.register_fake
def _(q, k, v, mask, mod, tensors, ints, scale, q_offset):
    B, H, T_q, _ = q.shape
    return (
        q.new_empty(B, H, T_q, v.shape[-1]),
        q.new_empty(B, H, T_q, dtype=accumulation_dtype(q.dtype)),
    )


@torch.library.custom_op("qkv::tiled_attention_backward", mutates_args=())
def _tiled_backward_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    dlse: torch.Tensor,
    mask: str,
    mod: str,
    tensors: list[torch.Tensor],
    ints: list[int],
    scale: float,
    q_offset: int,
) -> list[torch.Tensor]:
    p, plan, mtile, stile, mod_tensors = _rebuilt(
        q, k, v, mask, mod, tensors, ints, scale, q_offset
    )
    dq, dk, dv, *dmod = tiled_backward(
        q, k, v, out, lse, dout, dlse, plan, mtile, p.scale, stile, mod_tensors, need=True
    )
    # One gradient per recipe tensor: the modification's (zeros where none), the mask's zero.
    by_id = {id(t): d for t, d in zip(mod_tensors, dmod) if d is not None}
    return [
        dq,
        dk,
        dv,
        *[
            by_id.get(id(t), torch.zeros_like(t)) if t.is_floating_point() else torch.zeros_like(t)
            for t in tensors
        ],
    ]


@_tiled_backward_op.register_fake
def _(q, k, v, out, lse, dout, dlse, mask, mod, tensors, ints, scale, q_offset):
    return [
        torch.empty_like(q),
        torch.empty_like(k),
        torch.empty_like(v),
        *[torch.empty_like(t) for t in tensors],
    ]


def _setup(ctx, inputs, output):
    q, k, v, mask, mod, tensors, ints, scale, q_offset = inputs
    ctx.save_for_backward(q, k, v, *output, *tensors)
    ctx.recipe = (mask, mod, ints, scale, q_offset)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, *tensors = ctx.saved_tensors
    mask, mod, ints, scale, q_offset = ctx.recipe
    dlse = torch.zeros_like(lse) if dlse is None else dlse
    dout = torch.zeros_like(out) if dout is None else dout
    dq, dk, dv, *dt = _tiled_backward_op(
        q, k, v, out, lse, dout, dlse, mask, mod, tensors, ints, scale, q_offset
    )
    dt = [d if t.requires_grad else None for d, t in zip(dt, tensors)]
    # torch's autograd for custom ops sees a non-empty int list as one input, an empty one
    # as an empty list: the gradient mirrors that structure.
    return dq, dk, dv, None, None, dt, None if ints else [], None, None


_tiled_op.register_autograd(_backward, setup_context=_setup)


def tiled_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, recipe: tuple, p: Problem
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tiled kernel as one opaque op: out (B, H, T_q, D_v) and lse (B, H, T_q)."""
    mask, mod, tensors, ints = recipe
    return _tiled_op(q, k, v, mask, mod, tensors, ints, p.scale, p.q_offset)


def choose(
    p: Problem,
    mask: MaskLike,
    mod: Any,
    device: torch.device,
    *,
    dropout_p: float,
    generator: Any,
    return_weights: bool,
    return_lse: bool,
    backend: str,
) -> Dispatch:
    """Dispatch while compiling: from the mask's type and size relations, never from values.

    Rules, first match wins: weights, generator dropout or dropout with the log-sum-exp, or a
    user score function → reference (traced); a score modification or the log-sum-exp →
    the tiled op; no mask → sdpa; causal with T_q == T_k → sdpa ``is_causal``; causal for
    one query at the end of the keys → sdpa with no mask; other masks with dropout →
    reference (exact for non-finite keys, which cannot be checked here); other masks → the
    tiled op.
    """
    tensors: list[torch.Tensor] = []
    ints: list[int] = []
    mod_tokens = [] if mod is None else mod_recipe(mod, tensors, ints)
    mask_tokens = [] if mask is None else mask_recipe(mask, tensors, ints)
    if mask_tokens is None:  # a predicate: lowered densely, here in the graph
        mask_tokens = mask_recipe(dense_mask(mask, p, device), tensors, ints)
    recipe = (" ".join(mask_tokens), " ".join(mod_tokens or []), tensors, ints)

    def tiled(why: str) -> Dispatch:
        return Dispatch(
            "tiled", f"compiling: {why}: the tiled kernel as one opaque op", compiled=recipe
        )

    causal = isinstance(mask, M._Causal)
    if backend == "reference" or backend == "sdpa":
        mode = (
            "none"
            if mask is None
            else "is_causal"
            if causal and p.q_offset == 0 and p.T_q == p.T_k
            else "dense"
        )
        return Dispatch(backend, "compiling: requested", sdpa_mask=mode)
    if backend == "tiled":
        return (
            tiled("requested")
            if mod_tokens is not None
            else Dispatch(
                "reference", "compiling: a user score function runs traced on the reference kernel"
            )
        )
    if (
        return_weights
        or (dropout_p > 0 and (generator is not None or return_lse))
        or mod_tokens is None
    ):
        return Dispatch(
            "reference",
            "compiling: weights, generator dropout, dropout with the "
            "log-sum-exp, or a user score function: the reference kernel, traced",
        )
    if mod is not None or return_lse:
        if dropout_p > 0:
            return Dispatch("reference", "compiling: a score modification with dropout")
        return tiled("a score modification or the log-sum-exp")
    if mask is None:
        return Dispatch("sdpa", "compiling: no mask", sdpa_mask="none")
    if causal and p.q_offset == 0 and p.T_q == p.T_k:
        return Dispatch("sdpa", "compiling: causal with T_q == T_k", sdpa_mask="is_causal")
    if causal and p.T_q == 1 and p.q_offset == p.T_k - 1:
        return Dispatch(
            "sdpa", "compiling: one query at the end of the keys sees them all", sdpa_mask="none"
        )
    if dropout_p > 0:
        return Dispatch("reference", "compiling: a mask with dropout")
    return tiled(f"mask {type(mask).__name__.lstrip('_').lower()}")
