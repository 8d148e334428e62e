"""One attention call as one value: :class:`Call`, built once by :meth:`Call.of` from the
public arguments, validated there and nowhere else. The dispatch reads it
(:func:`qkv.core.dispatch.choose` gives a :class:`Dispatch`), lowering reads it
(:func:`qkv.core.lowering.lower`), and so do the recorders (:mod:`qkv.core.record`).

Legend: B batch · H query heads · H_kv key/value heads · T_q/T_k query/key length · D head
dim · D_v value head dim.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from .._checks import Problem, check_attention
from ..kernels.tiled import native
from ..kernels.tiled.plan import Plan
from ..masks import Mask, MaskLike
from ..scores import ScoreMod, as_score_mod
from ..tuning import Tuning, tuning
from .recipe import recipe
from .record import editors, listeners

Backend = Literal["auto", "reference", "sdpa", "tiled", "flex"]


@dataclass(frozen=True, eq=False)
class Call:
    """One validated attention call: its sizes ``p``, q, k, v in the (B, H|H_kv, T, ·)
    layout, the mask and score modification, and what it asks for. ``fast_scale`` is set
    on a decode step that takes the fast path (rule ``plain``): then the checks were those
    of :func:`plain`, which covers every way such a call could fail."""

    p: Problem
    mask: MaskLike
    mod: ScoreMod | None
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dropout_p: float = 0.0
    generator: Any = None
    return_weights: bool = False
    #: the kernel must give the log-sum-exp: asked for, or a recorder is listening
    return_lse: bool = False
    backend: str = "auto"
    tracing: bool = False
    tuning: Tuning = field(default_factory=Tuning)
    #: While tracing, the recipe the compiled tiled op would receive (None: none can be made)
    recipe: tuple[Any, ...] | None = None
    #: attention sinks, (H,) or (B|1, H|1, T_q|1) logits, or None
    sinks: torch.Tensor | None = None
    fast_scale: float | None = None

    @classmethod
    def of(
        cls,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        mask: MaskLike = None,
        scale: float | None = None,
        q_offset: int | None = None,
        dropout_p: float = 0.0,
        generator: torch.Generator | None = None,
        return_weights: bool = False,
        return_lse: bool = False,
        backend: Backend = "auto",
        score_mod: ScoreMod | Callable[..., Any] | None = None,
        sinks: torch.Tensor | None = None,
    ) -> Call:
        """The call :func:`qkv.attention` receives, validated: the torch side (tensors, the
        mask's type), the shared checks of :func:`qkv._checks.check_attention`, the score
        modification's and the sinks' sizes. A decode step with no option set, which no
        :func:`qkv.heads.record` or :func:`qkv.heads.ablate` block sees, is checked by
        :func:`plain` alone. These are the public arguments of :func:`qkv.attention` and
        :func:`qkv.dispatch`, written here once for both."""
        if (
            backend == "auto"
            and not (dropout_p or return_weights or return_lse)
            and score_mod is None
            and q_offset is None
            and sinks is None
            and not torch.compiler.is_compiling()  # (a graph cannot read the knobs)
            and not (listeners() or editors())
        ):
            knobs = tuning()
            fast_scale = plain(query, key, value, mask, scale, knobs)
            if fast_scale is not None:
                (B, H, T_q, D), (H_kv, T_k), D_v = query.shape, key.shape[1:3], value.shape[3]
                p = Problem(4, B, H, H_kv, T_q, T_k, D, D_v, T_k - T_q, fast_scale)
                return cls(p, mask, None, query, key, value, tuning=knobs, fast_scale=fast_scale)
        mask = torch_inputs(mask, query=query, key=key, value=value)
        mod = as_score_mod(score_mod)
        tracing = torch.compiler.is_compiling()
        p = check_attention(
            query,
            key,
            value,
            mask=mask,
            scale=scale,
            q_offset=q_offset,
            dropout_p=dropout_p,
            validate_mask=not tracing,
        )
        if mod is not None:
            mod.validate(p.B, p.H, p.T_q, p.T_k)
        check_sinks(sinks, p, query)
        if tracing and backend == "flex":
            raise ValueError(
                "backend='flex' plans its BlockMask from the mask's values, "
                "which a torch.compile trace cannot read: call it outside the "
                "compiled function, or use backend='auto' inside"
            )
        return cls(
            p,
            mask,
            mod,
            p.to4d(query),
            p.to4d(key),
            p.to4d(value),
            dropout_p=dropout_p,
            generator=generator,
            return_weights=return_weights,
            return_lse=return_lse,
            backend=backend,
            tracing=tracing,
            # While tracing, the rules that read knobs are skipped, and the compiled op
            # reads the knobs in force when it runs (a graph cannot read a ContextVar).
            tuning=Tuning() if tracing else tuning(),
            recipe=recipe(mask, mod, p, query.device) if tracing else None,
            sinks=sinks,
        )

    @property
    def scores(self) -> int:
        return self.p.T_q * self.p.T_k

    @functools.cached_property
    def key_finite(self) -> bool:
        """Whether K holds no NaN/inf: read once per call, however many rules ask (each read
        is a pass over K, and on a busy machine a parallel region that can wait for a
        descheduled thread)."""
        return native.finite(self.k)

    @property
    def gpu(self) -> bool:
        """CUDA inputs, a qkv mask or none, and a torch with FlexAttention: ``flex`` replaces
        ``tiled`` where the rules say so (never while tracing: flex plans its block mask
        from the mask's values)."""
        if (
            self.tracing
            or self.k.device.type != "cuda"
            or not (self.mask is None or isinstance(self.mask, Mask))
        ):
            return False
        from importlib.util import find_spec

        return find_spec("torch.nn.attention.flex_attention") is not None

    @property
    def causal_square(self) -> bool:
        return (
            isinstance(self.mask, Mask)
            and self.mask.kind == "causal"
            and self.p.q_offset == 0
            and self.p.T_q == self.p.T_k
        )


@dataclass(frozen=True)
class Dispatch:
    """Which kernel runs an attention call, which code of it (``path``), and why, in words."""

    backend: str
    reason: str
    plan: Plan | None = field(default=None, repr=False, compare=False)
    #: How the sdpa kernel receives the mask: "none", "is_causal", "dense" or "bias".
    sdpa_mask: str = field(default="dense", repr=False, compare=False)
    #: While compiling, the tiled kernel's recipe: (mask tokens, modification tokens,
    #: tensors, ints) for the ``qkv::tiled_attention`` op (see ``qkv.core.compiled``).
    compiled: tuple[Any, ...] | None = field(default=None, repr=False, compare=False)
    #: The code that runs: "reference", "sdpa", "flex", "tiled-loop", "tiled-flash",
    #: "tiled-native", "tiled-native-widen", "tiled-op" or "paged-native" (a bfloat16 decode
    #: step, rule "plain") (:data:`qkv.kernels.PATHS`); the backend's name if not given.
    path: str = field(default="", compare=False)
    #: The rule of :data:`RULES` that decided ("requested" for an explicit backend).
    rule: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not self.path:
            object.__setattr__(self, "path", self.backend)

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}"


@dataclass(frozen=True)
class Rule:
    """One rule of ``backend="auto"``: a name, when it applies ("always", "eager" or
    "tracing") and what it decides (None: it does not match)."""

    name: str
    when: str
    decide: Callable[[Call], Dispatch | None]


def torch_inputs(mask: Any, **tensors: Any) -> MaskLike:
    """The checks only the torch entry points need: tensors, not arrays, and a mask that is
    a qkv mask or a bool tensor (a NumPy bool array is moved to the first tensor's device)."""
    for name, x in tensors.items():
        if not isinstance(x, torch.Tensor):
            raise TypeError(
                f"{name} must be a torch.Tensor (use qkv.numpy for arrays); got {type(x).__name__}"
            )
    if isinstance(mask, np.ndarray):
        mask = torch.from_numpy(mask).to(next(iter(tensors.values())).device)
    if mask is not None and not isinstance(mask, (Mask, torch.Tensor)):
        raise TypeError(f"mask must be a qkv mask or a bool tensor; got {type(mask).__name__}")
    return mask


def check_sinks(sinks: Any, p: Problem, query: torch.Tensor) -> None:
    """Sinks are a floating tensor on the query's device: (H,), one logit per query head,
    or (B|1, H|1, T_q|1), one per row."""
    if sinks is None:
        return
    want = f"(H,) = ({p.H},) or (B|1, H|1, T_q|1) = ({p.B}|1, {p.H}|1, {p.T_q}|1)"
    if not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point():
        got = type(sinks).__name__ + (
            f" of {sinks.dtype}" if isinstance(sinks, torch.Tensor) else ""
        )
        raise TypeError(f"sinks must be a floating torch.Tensor of shape {want}; got {got}")
    shape = tuple(sinks.shape)
    fits = shape == (p.H,) or (
        len(shape) == 3 and all(n in (1, full) for n, full in zip(shape, (p.B, p.H, p.T_q)))
    )
    if not fits:
        raise ValueError(f"sinks must have shape {want}; got {shape}")
    if sinks.device != query.device:
        raise ValueError(f"sinks are on {sinks.device}, the query on {query.device}")


_PLAIN_DTYPES = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16})


def plain(query: Any, key: Any, value: Any, mask: Any, scale: Any, tuning: Tuning) -> float | None:
    """Whether a call is a decode step the fast path takes, with as little Python as it can
    have: (B, H, T, D) tensors of one float dtype and device whose sizes agree, and no mask,
    or causal with one query (which allows every key before it). Rule ``plain`` then runs
    torch's fused kernel with no mask, which is what the later rules would choose ("no
    mask", "mask allows everything") on the same arguments. Returns the scale to use, or
    None where the call takes the full checks and rules."""
    if (
        type(query) is not torch.Tensor
        or type(key) is not torch.Tensor
        or type(value) is not torch.Tensor
        or query.ndim != 4
        or key.ndim != 4
        or value.ndim != 4
        or torch.compiler.is_compiling()
    ):
        return None
    B, H, T_q, D = query.shape
    B_k, H_kv, T_k, D_k = key.shape
    B_v, H_v, T_v, _ = value.shape
    if not (mask is None or (isinstance(mask, Mask) and mask.kind == "causal" and T_q == 1)):
        return None
    if (
        not (B == B_k == B_v and H_kv == H_v and T_k == T_v and D_k == D and T_q and T_k and D)
        or H % H_kv
    ):
        return None
    dtype = query.dtype
    if (
        dtype not in _PLAIN_DTYPES
        or key.dtype != dtype
        or value.dtype != dtype
        or key.device != query.device
        or value.device != query.device
    ):
        return None
    if dtype is torch.bfloat16 and T_q * T_k >= tuning.native_scores:  # rule "native bfloat16"
        return None
    if dtype is torch.float16 or (
        dtype is torch.bfloat16
        and (query.requires_grad or key.requires_grad or value.requires_grad)
        and torch.is_grad_enabled()
    ):  # the rules decide whether torch's kernel runs it on float32 copies (paths.widened)
        return None
    return fast_scale(scale, D)


def fast_scale(scale: Any, D: int) -> float | None:
    """The scale a fast path gives its kernel: 1/sqrt(D) by default, a given positive
    finite float as it is; None for anything else (the full path checks and explains)."""
    if scale is None:
        return float(D**-0.5)
    if type(scale) is not float or not 0.0 < scale < math.inf:
        return None
    return scale
