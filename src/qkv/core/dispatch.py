"""Dispatch: which kernel runs an attention call, and why, in words.

Rules for ``backend="auto"``, first match wins:

1. weights, dropout from a ``torch.Generator``, or dropout together with the log-sum-exp,
   asked for → ``reference`` (the only kernel that materialises them; tiled has no dropout);
2. the log-sum-exp asked for → ``tiled`` (it returns it without materialising T_q × T_k);
3. a score modification sdpa cannot take (not additive, or reading a tensor that needs a
   gradient) → ``tiled``, or ``reference`` with dropout; an additive one continues below as
   a float mask;
4. bfloat16 on a CPU that runs qkv's native bfloat16 kernel, no dropout or modification, a
   qkv mask or none, and at least ``NATIVE_SCORES`` scores → ``tiled``: its native steps
   compute in bfloat16, where torch's CPU kernel runs bfloat16 at float32's speed (measured
   from T = 1024, causal or no mask: the forward 1.26–1.38×, forward + backward 1.07–1.16×
   faster than SDPA);
5. no mask and no modification, or a mask that allows every position of this problem (e.g.
   causal for one query at the end of a KV cache) → ``sdpa`` without a mask;
6. a key holding NaN/inf under a mask or a modification → ``tiled`` (sdpa would spread it to
   rows that mask it), or ``reference`` with dropout (tiled has none);
7. dropout without a generator → ``sdpa`` with its mask (``is_causal``, dense or float),
   drawing from torch's global generator;
8. causal with T_q == T_k → ``sdpa`` with ``is_causal``;
9. few scores (T_q·T_k < ``SMALL_SCORES``) → ``sdpa`` with the mask lowered densely
   (planning blocks would cost more than it saves);
10. a qkv mask whose block map leaves less than ``SPARSE_DENSITY`` of the scores to compute,
   or a long sequence (T_q·T_k >= ``LONG_SCORES``) → ``tiled``;
11. otherwise → ``sdpa`` with the mask lowered densely.

On CUDA, where FlexAttention compiles once per mask structure and gives the backward and
the log-sum-exp, ``flex`` (torch's FlexAttention, :mod:`qkv.kernels.flex`) replaces ``tiled``
in rules 2, 3 and 10 for a qkv mask (or none, in rules 2 and 3): SDPA cannot skip a mask's
empty blocks there, and the tiled kernel's loop is written for the CPU. On CPU ``flex`` runs
only when asked for: it compiles for seconds per mask structure and has neither a backward
nor the log-sum-exp.

While ``torch.compile`` traces, ``qkv._compiled.choose`` decides instead, without values.

The thresholds were measured with ``benchmarks/bench_attention.py`` on the project's CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union

import numpy as np
import torch

from .._checks import Problem
from ..kernels.reference import all_finite
from ..kernels.tiled import native
from ..kernels.tiled.plan import BLOCK_K, BLOCK_Q, CHUNK_K, Plan, dense_to_sparse, make_plan
from ..masks import FULL, Mask
from ..masks.library import _Causal
from ..scores import ScoreMod

MaskLike = Union[Mask, torch.Tensor, np.ndarray, None]  # noqa: UP007 (a runtime alias on 3.10)
BACKENDS: tuple[str, ...] = ("auto", "reference", "sdpa", "tiled", "flex")
# Below this many scores per (batch, head), planning blocks costs more than it saves.
SMALL_SCORES = 512 * 512
# Below this fraction of scores, skipping blocks beats SDPA over a dense mask.
SPARSE_DENSITY = 0.5
# From this many scores per (batch, head) on, a dense mask costs more than tiling saves.
LONG_SCORES = 4096 * 4096
# From this many scores per (batch, head) on, bfloat16 runs faster in qkv's native kernel.
NATIVE_SCORES = 1024 * 1024


@dataclass(frozen=True)
class Dispatch:
    """Which kernel runs an attention call, and why, in words."""

    backend: str
    reason: str
    plan: Plan | None = field(default=None, repr=False, compare=False)
    #: How the sdpa kernel receives the mask: "none", "is_causal", "dense" or "bias".
    sdpa_mask: str = field(default="dense", repr=False, compare=False)
    #: While compiling, the tiled kernel's recipe: (mask tokens, modification tokens,
    #: tensors, ints) for the ``qkv::tiled_attention`` op (see ``qkv._compiled``).
    compiled: tuple | None = field(default=None, repr=False, compare=False)

    def __str__(self) -> str:
        return f"{self.backend}: {self.reason}"


def block_codes(mask: MaskLike, p: Problem) -> np.ndarray:
    """The (ceil(T_q / BLOCK_Q), ceil(T_k / BLOCK_K)) block map of any mask."""
    nq, nk = -(-p.T_q // BLOCK_Q), -(-p.T_k // BLOCK_K)
    if nq == 0 or nk == 0:  # no queries or no keys: nothing to plan
        return np.zeros((nq, nk), dtype=np.int8)
    if mask is None:
        return np.full((nq, nk), FULL, dtype=np.int8)
    if isinstance(mask, Mask):
        return mask.blocks(
            p.B, p.H, p.T_q, p.T_k, block_q=BLOCK_Q, block_k=BLOCK_K, q_offset=p.q_offset
        )
    # A dense mask is already materialised: reduce it tile by tile.
    m = mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape)).flatten(0, 1)  # (·, T_q|1, T_k|1)
    m = m.expand(m.shape[0], p.T_q, p.T_k)
    pad = torch.nn.functional.pad
    pad_q, pad_k = nq * BLOCK_Q - p.T_q, nk * BLOCK_K - p.T_k
    tiles = lambda x: x.view(-1, nq, BLOCK_Q, nk, BLOCK_K)  # noqa: E731
    any_ = tiles(pad(m, (0, pad_k, 0, pad_q), value=False)).any(4).any(2).any(0)
    all_ = tiles(pad(m, (0, pad_k, 0, pad_q), value=True)).all(4).all(2).all(0)
    codes = any_.to(torch.int8) + all_.to(torch.int8)  # 0 empty, 1 partial, 2 full
    return codes.cpu().numpy()


def _sdpa_mask(p: Problem, mask: MaskLike, mod: ScoreMod | None = None) -> str:
    """How SDPA should receive this mask: not at all ("none": no mask, or a qkv mask that is
    FULL over the whole problem, e.g. causal for one query at the end of a KV cache),
    as ``is_causal`` (top-left causal, T_q == T_k), as a dense bool tensor, or with an
    additive score modification as one float tensor ("bias")."""
    if mod is not None:
        return "bias"
    if mask is None:
        return "none"
    if isinstance(mask, _Causal) and p.q_offset == 0 and p.T_q == p.T_k:
        return "is_causal"
    if (
        isinstance(mask, Mask)
        and p.T_q > 0
        and (
            mask.blocks(p.B, p.H, p.T_q, p.T_k, block_q=p.T_q, block_k=p.T_k, q_offset=p.q_offset)
            == FULL
        ).all()
    ):
        return "none"
    return "dense"


def _flex_on_gpu(key: torch.Tensor, mask: MaskLike) -> bool:
    """Whether ``auto`` should take FlexAttention: CUDA inputs, a qkv mask or none, and a
    torch that has it."""
    if key.device.type != "cuda" or not (mask is None or isinstance(mask, Mask)):
        return False
    from importlib.util import find_spec

    return find_spec("torch.nn.attention.flex_attention") is not None


def _describe(mask: MaskLike, mod: ScoreMod | None = None) -> str:
    what = (
        []
        if mask is None
        else [f"mask {mask!r}" if isinstance(mask, Mask) else f"mask tensor{tuple(mask.shape)}"]
    )
    return " and ".join(what + ([f"score modification {mod!r}"] if mod is not None else []))


def _sdpa_takes(mod: ScoreMod) -> bool:
    """Whether torch's fused kernel can apply a score modification: as a float mask, if it
    is additive and nothing it reads needs a gradient (SDPA gives the mask none)."""
    return mod.additive and not any(t.requires_grad for t in mod.tensors())


def check_backend(
    backend: str,
    *,
    dropout_p: float,
    generator: Any,
    return_weights: bool,
    return_lse: bool,
    score_mod: ScoreMod | None,
) -> list[str]:
    """Raise if ``backend`` is unknown or cannot give what the call asks for; return what
    only the materialised reference kernel can give (empty if nothing)."""
    if backend not in BACKENDS:
        raise ValueError(
            f"backend must be one of {', '.join(map(repr, BACKENDS))}; got {backend!r}"
        )
    materialised = [
        what
        for what, asked in (
            ("the attention weights", return_weights),
            ("dropout from a torch.Generator", dropout_p > 0 and generator is not None),
            ("dropout with the log-sum-exp", dropout_p > 0 and generator is None and return_lse),
        )
        if asked
    ]
    mod = score_mod
    unfused = mod is not None and not _sdpa_takes(mod)
    cannot = {
        "sdpa": materialised
        + (["the log-sum-exp"] if return_lse else [])
        + ([f"{mod!r} (not additive, or it needs a gradient)"] if unfused else []),
        "tiled": materialised + (["dropout"] if dropout_p > 0 else []),
        "flex": materialised + (["dropout"] if dropout_p > 0 else []),
    }
    if cannot.get(backend):
        raise ValueError(
            f"backend={backend!r} cannot give {' and '.join(cannot[backend])}; "
            "use backend='reference' or 'auto'"
        )
    return materialised


def choose(
    p: Problem,
    mask: MaskLike,
    key: torch.Tensor,
    *,
    dropout_p: float,
    generator: Any,
    return_weights: bool,
    return_lse: bool,
    backend: str,
    score_mod: ScoreMod | None = None,
) -> Dispatch:
    """Apply the rules of this module's docstring; explicit backends are checked."""
    materialised = check_backend(
        backend,
        dropout_p=dropout_p,
        generator=generator,
        return_weights=return_weights,
        return_lse=return_lse,
        score_mod=score_mod,
    )
    mod = score_mod
    unfused = mod is not None and not _sdpa_takes(mod)
    if backend == "flex" and isinstance(mask, (torch.Tensor, np.ndarray)):
        raise ValueError(
            "backend='flex' takes a qkv mask (a predicate with a block map), not "
            "a dense tensor: use backend='sdpa', 'tiled' or 'auto' for a tensor mask"
        )
    if backend != "auto":
        plan = _plan(mask, p) if backend == "tiled" else None
        mode = _sdpa_mask(p, mask, mod) if backend == "sdpa" else "dense"
        return Dispatch(backend, f"requested with backend={backend!r}", plan, mode)
    if materialised:
        return Dispatch(
            "reference",
            f"{' and '.join(materialised)} asked for: only the "
            "materialised reference kernel provides them",
        )
    gpu = _flex_on_gpu(key, mask)
    if return_lse:
        if gpu:
            return Dispatch(
                "flex",
                "the log-sum-exp asked for, on CUDA: FlexAttention "
                "returns it, skipping the mask's empty blocks",
            )
        return Dispatch(
            "tiled",
            "the log-sum-exp asked for: the tiled kernel returns it "
            "without materialising T_q × T_k",
            _plan(mask, p),
        )
    if unfused:
        if dropout_p > 0:
            return Dispatch(
                "reference",
                f"score modification {mod!r} with dropout: torch's "
                "kernel cannot apply it and the tiled kernel has no dropout",
            )
        if gpu:
            return Dispatch(
                "flex",
                f"score modification {mod!r} is not additive or needs a "
                "gradient, on CUDA: FlexAttention applies it as its score_mod",
            )
        return Dispatch(
            "tiled",
            f"score modification {mod!r} is not additive or needs a "
            "gradient: torch's kernel cannot take it as a float mask; the tiled "
            "kernel applies it tile by tile",
            _plan(mask, p),
        )
    if (
        mod is None
        and dropout_p == 0
        and p.T_q * p.T_k >= NATIVE_SCORES
        and (mask is None or isinstance(mask, Mask))
        and native.fits(key.dtype, key.device, p.D, p.D_v)
    ):
        return Dispatch(
            "tiled",
            "bfloat16 on a CPU with AVX512-BF16: the tiled kernel's "
            "native bfloat16 steps beat torch's kernel, which computes bfloat16 "
            "at float32's speed",
            _plan(mask, p),
        )
    mode = _sdpa_mask(p, mask, mod)
    drawn = " (dropout drawn from torch's global generator)" if dropout_p > 0 else ""
    if mask is None and mod is None:
        return Dispatch(
            "sdpa",
            f"no mask: torch's fused kernel is the fastest dense path{drawn}",
            sdpa_mask=mode,
        )
    if mode == "none":
        return Dispatch(
            "sdpa",
            f"mask {mask!r} allows every position here: torch's fused kernel without a mask{drawn}",
            sdpa_mask=mode,
        )
    if not all_finite(key):
        why = (
            "key holds NaN or inf and a mask or score modification is given: torch's fused "
            "kernel would spread it into rows that mask that key out"
        )
        if dropout_p > 0:
            return Dispatch("reference", f"{why}; the tiled kernel has no dropout")
        return Dispatch("tiled", why, _plan(mask, p))
    if dropout_p > 0:
        how = {"is_causal": "is_causal", "bias": f"{_describe(mask, mod)} as a float mask"}.get(
            mode, f"the mask {_describe(mask, mod)} as a dense mask"
        )
        return Dispatch(
            "sdpa",
            f"dropout without a generator: torch's fused kernel with {how}{drawn}",
            sdpa_mask=mode,
        )
    if mode == "is_causal":
        return Dispatch(
            "sdpa", "causal with T_q == T_k: torch's fused kernel with is_causal", sdpa_mask=mode
        )
    kind = "float" if mod is not None else "bool"
    if p.T_q * p.T_k < SMALL_SCORES:
        return Dispatch(
            "sdpa",
            f"T_q × T_k = {p.T_q} × {p.T_k} is small: "
            f"{_describe(mask, mod)} passed to torch's fused kernel as a dense "
            f"{kind} mask",
            sdpa_mask=mode,
        )
    if isinstance(mask, Mask) and gpu:
        return Dispatch(
            "flex",
            f"mask {mask!r} on CUDA: FlexAttention skips its empty "
            "blocks and runs its partial ones fused (SDPA could take it only as a "
            f"dense {kind} mask)",
        )
    if (
        isinstance(mask, Mask) or (mask is None and p.T_q * p.T_k >= LONG_SCORES)
    ) and key.device.type != "cuda":  # SDPA's CUDA kernels hold no T_q × T_k
        plan = _plan(mask, p)
        if plan.density < SPARSE_DENSITY:
            return Dispatch(
                "tiled",
                f"mask {mask!r} leaves {plan.density:.1%} of the scores "
                "to compute: the tiled kernel skips the empty blocks (as would "
                "backend='flex', run only when asked for: it compiles per mask)",
                plan,
            )
        if p.T_q * p.T_k >= LONG_SCORES:
            return Dispatch(
                "tiled",
                f"T_q × T_k = {p.T_q} × {p.T_k}: torch's fused kernel "
                f"could take {_describe(mask, mod)} only as a dense {kind} mask",
                plan,
            )
    return Dispatch(
        "sdpa",
        f"{_describe(mask, mod)} passed to torch's fused kernel as a "
        f"dense {kind} mask of (B, H, T_q, T_k) = ({p.B}, {p.H}, {p.T_q}, {p.T_k})",
        sdpa_mask=mode,
    )


def _plan(mask: MaskLike, p: Problem) -> Plan:
    if isinstance(mask, Mask) and p.T_q and p.T_k:
        tiles = mask.sparse_blocks(
            p.B, p.H, p.T_q, p.T_k, block_q=BLOCK_Q, block_k=BLOCK_K, q_offset=p.q_offset
        )
    else:
        tiles = dense_to_sparse(block_codes(mask, p))
    return make_plan(*tiles, p.T_q, p.T_k, block_q=BLOCK_Q, block_k=BLOCK_K, chunk_k=CHUNK_K)
