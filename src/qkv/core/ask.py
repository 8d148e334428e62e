"""What the rules of ``backend="auto"`` (:mod:`qkv.core.rules`) are asked and answer: an
:class:`Ask` (one call, as the rules see it), a :class:`Dispatch` (the backend, the code of
the tiled kernel, the rule and why), and a :class:`Rule` itself.

Legend: B batch · H query heads · T_q/T_k query/key length · D head dim · D_v value head dim.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .._checks import Problem
from ..kernels.tiled import native
from ..kernels.tiled.plan import Plan
from ..masks import Mask, MaskLike
from ..scores import ScoreMod
from ..tuning import Tuning


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
    #: "tiled-native", "tiled-native-upcast" or "tiled-op" (:data:`qkv.kernels.PATHS`); the
    #: backend's name if not given.
    path: str = field(default="", compare=False)
    #: The rule of :data:`RULES` that decided ("requested" for an explicit backend).
    rule: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not self.path:
            object.__setattr__(self, "path", self.backend)

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}"


@dataclass(frozen=True, eq=False)
class Ask:
    """What one call asks for, as the rules read it."""

    p: Problem
    mask: MaskLike
    mod: ScoreMod | None
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dropout_p: float
    generator: Any
    return_weights: bool
    return_lse: bool
    tracing: bool
    tuning: Tuning
    #: While tracing, the recipe the compiled tiled op would receive (None: none can be made)
    recipe: tuple[Any, ...] | None = None
    #: attention sinks, (H,) logits, or None
    sinks: torch.Tensor | None = None

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
class Rule:
    """One rule of ``backend="auto"``: a name, when it applies ("always", "eager" or
    "tracing") and what it decides (None: it does not match)."""

    name: str
    when: str
    decide: Callable[[Ask], Dispatch | None]
