"""qkv inside ``torch.compile``: one graph, no data-dependent branch.

Eager dispatch reads values (is a key finite?) and plans blocks with NumPy from concrete
lengths. Neither can happen while dynamo traces, and the tiled kernel's Python loops would
unroll into a graph that grows with T². So, while compiling:

- the dispatch (:mod:`qkv.core.dispatch`) applies the rules that read neither tensor
  values nor a length's value, so ``dynamic=True`` keeps one graph for every length;
- the tiled kernel runs as the custom op ``qkv::tiled_attention``, opaque to the compiler:
  it receives the mask and the score modification as a *recipe* (a string of tokens plus
  the tensors they read), rebuilds them, validates them and plans its blocks at run time,
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

from .. import masks, scores
from .._checks import Problem
from ..kernels import Lowered, tiled
from ..kernels.reference import accumulation_dtype
from .call import Call
from .dispatch import choose
from .lowering import lower


def rebuild(recipe: str, tensors: list[torch.Tensor], ints: list[int]) -> Any:
    """The mask or modification (or None, for an empty recipe) a recipe describes, made
    with the public constructors of :mod:`qkv.masks` and :mod:`qkv.scores`."""
    stack: list[Any] = []
    for token in recipe.split():
        name, *args = token.split(":")
        at = [int(a) for a in args] if name != "softcap" else []
        if name in ("and", "or"):
            right, left = stack.pop(), stack.pop()
            stack.append(left & right if name == "and" else left | right)
        elif name == "not":
            stack.append(~stack.pop())
        elif name == "chain":
            mods, stack = stack[-at[0] :], stack[: -at[0]]
            stack.append(scores.chain(*mods))
        elif name in ("full", "causal"):
            stack.append(getattr(masks, name)())
        elif name in ("sliding_window", "prefix_lm"):
            stack.append(getattr(masks, name)(ints[at[0]]))
        elif name == "softcap":
            stack.append(scores.softcap(float(args[0])))
        elif name == "relative_bias":
            stack.append(
                scores.relative_bias(
                    tensors[at[0]], bidirectional=bool(ints[at[1]]), max_distance=ints[at[2]]
                )
            )
        elif name == "dense":
            stack.append(tensors[at[0]])
        else:  # padding, document, alibi, bias: a constructor of one tensor
            build = getattr(masks, name, None) or getattr(scores, name)
            stack.append(build(tensors[at[0]]))
    return stack[0] if stack else None


def _rebuilt(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask_recipe: str,
    mod_recipe: str,
    tensors: list[torch.Tensor],
    ints: list[int],
    scale: float,
    q_offset: int,
) -> Lowered:
    """One op call, rebuilt, validated, dispatched (to the tiled kernel's code for these
    tensors, by the eager rules) and lowered, here, at run time."""
    mask, mod = rebuild(mask_recipe, tensors, ints), rebuild(mod_recipe, tensors, ints)
    call = Call.of(
        q, k, v, mask=mask, scale=scale, q_offset=q_offset, score_mod=mod, backend="tiled",
        return_lse=True,
    )  # fmt: skip
    return lower(call, choose(call))


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
    out, lse = tiled.forward(_rebuilt(q, k, v, mask, mod, tensors, ints, scale, q_offset))
    return out.to(q.dtype), lse


@_tiled_op.register_fake
def _(
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
    call = _rebuilt(q, k, v, mask, mod, tensors, ints, scale, q_offset)
    mod_tensors = call.mod_tensors
    dq, dk, dv, *dmod = tiled.backward(call, out, lse, dout, dlse, need_mod=True)
    assert dq is not None and dk is not None and dv is not None
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
def _(
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
    return [
        torch.empty_like(q),
        torch.empty_like(k),
        torch.empty_like(v),
        *[torch.empty_like(t) for t in tensors],
    ]


def _setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    q, k, v, mask, mod, tensors, ints, scale, q_offset = inputs
    ctx.save_for_backward(q, k, v, *output, *tensors)
    ctx.recipe = (mask, mod, ints, scale, q_offset)


def _backward(ctx: Any, dout: torch.Tensor, dlse: torch.Tensor) -> tuple[Any, ...]:
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
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, recipe: tuple[Any, ...], p: Problem
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tiled kernel as one opaque op: out (B, H, T_q, D_v) and lse (B, H, T_q)."""
    mask, mod, tensors, ints = recipe
    return _tiled_op(q, k, v, mask, mod, tensors, ints, p.scale, p.q_offset)
