"""Dispatch: the one place that decides which code runs an attention call, and says why.

:func:`choose` applies :data:`RULES` in order; the first that matches decides. Each rule is
named and marked with when it applies: ``always``, ``eager`` (it reads tensor values or
the lengths' values, which a ``torch.compile`` trace must not: under ``dynamic=True`` a
length is symbolic and reading it would specialise the graph) or ``tracing`` (its stand-in
while a graph is traced). The same list runs eagerly and while tracing.

For ``backend="auto"``:

1. ``materialised``: weights, dropout from a ``torch.Generator``, or dropout together with
   the log-sum-exp → ``reference`` (the only kernel that materialises them);
2. ``user function while tracing``: a score function qkv cannot rebuild inside the compiled
   tiled op → ``reference``, traced into the graph;
3. ``log-sum-exp`` → ``tiled`` (it returns it without materialising T_q × T_k; ``flex`` on
   CUDA);
4. ``modification sdpa cannot take`` (not additive, or reading a tensor that needs a
   gradient; any modification while tracing) → ``tiled``, ``flex`` on CUDA, or
   ``reference`` with dropout; an additive one continues below as a float mask;
5. ``native bfloat16`` (eager): bfloat16 on a CPU that runs qkv's native kernel, no dropout
   or modification, a qkv mask or none, at least :attr:`qkv.Tuning.native_scores` scores →
   ``tiled`` (measured from T = 1024: forward 1.26–1.38×, forward + backward 1.07–1.16×
   faster than SDPA, which computes bfloat16 at float32's speed on the CPU);
6. ``no mask`` → ``sdpa`` without a mask;
7. ``mask allows everything``: a qkv mask with no EMPTY or PARTIAL position here (eager; while
   tracing: causal for one query at the end of the keys) → ``sdpa`` without a mask;
8. ``non-finite key`` (eager): a key holding NaN/inf under a mask or modification → ``tiled``
   (sdpa would spread it into rows that mask it), or ``reference`` with dropout;
9. ``dropout`` → ``sdpa`` with the mask, drawing from torch's global generator (while
   tracing, where a key's finiteness cannot be read: ``reference``);
10. ``causal square`` → ``sdpa`` with ``is_causal`` (T_q == T_k, no offset);
11. ``small`` (eager): T_q·T_k < :attr:`qkv.Tuning.small_scores` → ``sdpa``, the mask lowered
    densely (planning blocks would cost more than skipping them saves);
12. ``sparse or long`` (eager): a qkv mask leaving less than
    :attr:`qkv.Tuning.sparse_density` of the scores, or T_q·T_k >=
    :attr:`qkv.Tuning.long_scores` → ``tiled`` (``flex`` on CUDA for a qkv mask);
13. ``otherwise`` → ``sdpa`` with the mask lowered densely; while tracing → ``tiled`` as one
    opaque op.

Where the tiled kernel runs, :func:`tiled_path` names its code: the PyTorch loop, torch's
flash kernel call by call, qkv's native bfloat16 kernel, or (while tracing) the compiled op,
which applies the same rules at run time. :func:`plain` is the decode fast path that
:func:`qkv.attention` takes before any of this, on the same kernel the rules would choose.

On CPU ``flex`` runs only when asked for: it compiles for seconds per mask structure and has
neither a backward nor the log-sum-exp there. The thresholds were measured with
``benchmarks/bench_attention.py`` (docs/kernels.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .._checks import Problem
from ..kernels.reference import all_finite
from ..kernels.tiled import flash, native
from ..kernels.tiled.plan import Plan, dense_to_sparse, make_plan
from ..masks import FULL, Mask, MaskLike
from ..scores import ScoreMod
from ..tuning import Tuning

BACKENDS: tuple[str, ...] = ("auto", "reference", "sdpa", "tiled", "flex")


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
    #: "tiled-native" or "tiled-op" (:data:`qkv.kernels.PATHS`); the backend's name if not
    #: given.
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

    @property
    def scores(self) -> int:
        return self.p.T_q * self.p.T_k

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


def _materialised(a: Ask) -> list[str]:
    return [
        what
        for what, asked in (
            ("the attention weights", a.return_weights),
            ("dropout from a torch.Generator", a.dropout_p > 0 and a.generator is not None),
            (
                "dropout with the log-sum-exp",
                a.dropout_p > 0 and a.generator is None and a.return_lse,
            ),
        )
        if asked
    ]


def sdpa_takes(mod: ScoreMod) -> bool:
    """Whether torch's fused kernel can apply a score modification: as a float mask, if it
    is additive and nothing it reads needs a gradient (SDPA gives the mask none)."""
    return mod.additive and not any(t.requires_grad for t in mod.tensors())


def _describe(mask: MaskLike, mod: ScoreMod | None = None) -> str:
    what = (
        []
        if mask is None
        else [f"mask {mask!r}" if isinstance(mask, Mask) else f"mask tensor{tuple(mask.shape)}"]
    )
    return " and ".join(what + ([f"score modification {mod!r}"] if mod is not None else []))


def _sdpa_mask(a: Ask) -> str:
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
        return "none" if _causal_at_the_end(a) else "dense"
    if isinstance(mask, Mask) and _allows_everything(mask, p):
        return "none"
    return "dense"


def _allows_everything(mask: Mask, p: Problem) -> bool:
    return p.T_q > 0 and bool(
        (
            mask.blocks(p.B, p.H, p.T_q, p.T_k, block_q=p.T_q, block_k=p.T_k, q_offset=p.q_offset)
            == FULL
        ).all()
    )


def _causal_at_the_end(a: Ask) -> bool:
    """Causal for one query at the end of the keys: it sees them all (decided from sizes'
    relations only, as a trace may)."""
    return (
        isinstance(a.mask, Mask)
        and a.mask.kind == "causal"
        and a.p.T_q == 1
        and a.p.q_offset == a.p.T_k - 1
    )


def tiled_path(a: Ask) -> tuple[str, str]:
    """Which code of the tiled kernel runs this call, and why: "tiled-op" while tracing (the
    op decides at run time, by this function); the PyTorch loop where a score modification
    is applied, the fused calls are turned off or torch's flash kernel cannot take the call;
    qkv's native kernel for bfloat16 where it can run it; else torch's flash kernel, call by
    call. Reads K (and for bfloat16 Q and V) once, to know they are finite."""
    if a.tracing:
        return "tiled-op", "the tiled kernel as one opaque op, which picks its code at run time"
    if a.mod is not None:
        return "tiled-loop", "the PyTorch loop applies the score modification tile by tile"
    if not a.tuning.fused:
        return "tiled-loop", "the PyTorch loop: fused calls turned off (Tuning.fused)"
    if not flash.supports(a.q, a.k, a.v):
        return "tiled-loop", (
            "the PyTorch loop: torch's flash kernel cannot take this call (not on the CPU, "
            "D_v != D, NaN/inf in the keys, or this torch lacks it)"
        )
    if a.q.dtype == torch.bfloat16 and a.tuning.native and native.supports(a.q, a.k, a.v):
        return "tiled-native", "qkv's native bfloat16 kernel runs the flash calls"
    return "tiled-flash", "torch's fused flash kernel runs the plan call by call"


def _tiled(a: Ask, why: str, rule: str, plan: Plan | None = None) -> Dispatch:
    """The tiled kernel: its plan (made here unless given), the code that runs it."""
    path, how = tiled_path(a)
    if a.tracing:
        return Dispatch(
            "tiled", f"compiling: {why}: {how}", compiled=a.recipe, path=path, rule=rule
        )
    plan = make_tiled_plan(a.mask, a.p, a.tuning) if plan is None else plan
    return Dispatch("tiled", f"{why}; {how}", plan, path=path, rule=rule)


def _sdpa(a: Ask, why: str, rule: str, mode: str | None = None) -> Dispatch:
    drawn = " (dropout drawn from torch's global generator)" if a.dropout_p > 0 else ""
    prefix = "compiling: " if a.tracing else ""
    mode = _sdpa_mask(a) if mode is None else mode
    return Dispatch("sdpa", f"{prefix}{why}{drawn}", sdpa_mask=mode, rule=rule)


def _reference(a: Ask, why: str, rule: str) -> Dispatch:
    return Dispatch("reference", ("compiling: " if a.tracing else "") + why, rule=rule)


def _rule_materialised(a: Ask) -> Dispatch | None:
    asked = _materialised(a)
    if not asked:
        return None
    return _reference(
        a,
        f"{' and '.join(asked)} asked for: only the materialised reference kernel provides them",
        "materialised",
    )


def _rule_user_function(a: Ask) -> Dispatch | None:
    if a.mod is None or a.recipe is not None:
        return None
    return _reference(
        a, "a user score function runs traced on the reference kernel", "user function"
    )


def _rule_lse(a: Ask) -> Dispatch | None:
    if not a.return_lse:
        return None
    if a.gpu:
        return Dispatch(
            "flex",
            "the log-sum-exp asked for, on CUDA: FlexAttention returns it, skipping the "
            "mask's empty blocks",
            rule="log-sum-exp",
        )
    return _tiled(
        a,
        "the log-sum-exp asked for: the tiled kernel returns it without materialising T_q × T_k",
        "log-sum-exp",
    )


def _rule_modification(a: Ask) -> Dispatch | None:
    mod = a.mod
    if mod is None or (not a.tracing and sdpa_takes(mod)):
        return None
    rule = "modification sdpa cannot take"
    if a.dropout_p > 0:
        return _reference(
            a,
            f"score modification {mod!r} with dropout: torch's kernel cannot apply it and "
            "the tiled kernel has no dropout",
            rule,
        )
    if a.gpu:
        return Dispatch(
            "flex",
            f"score modification {mod!r} is not additive or needs a gradient, on CUDA: "
            "FlexAttention applies it as its score_mod",
            rule=rule,
        )
    if a.tracing:
        return _tiled(a, f"score modification {mod!r}", rule)
    return _tiled(
        a,
        f"score modification {mod!r} is not additive or needs a gradient: torch's kernel "
        "cannot take it as a float mask",
        rule,
    )


def _rule_native(a: Ask) -> Dispatch | None:
    if not (
        a.mod is None
        and a.dropout_p == 0
        and a.tuning.native
        and a.scores >= a.tuning.native_scores
        and (a.mask is None or isinstance(a.mask, Mask))
        and native.shapes_fit(a.k.dtype, a.k.device, a.p.D, a.p.D_v)
    ):
        return None
    return _tiled(
        a,
        "bfloat16 on a CPU with AVX512-BF16: the tiled kernel's native bfloat16 steps beat "
        "torch's kernel, which computes bfloat16 at float32's speed",
        "native bfloat16",
    )


def _rule_no_mask(a: Ask) -> Dispatch | None:
    if a.mask is not None or a.mod is not None:
        return None
    why = "no mask" if a.tracing else "no mask: torch's fused kernel is the fastest dense path"
    return _sdpa(a, why, "no mask", "none")


def _rule_allows_everything(a: Ask) -> Dispatch | None:
    if a.mod is not None or not isinstance(a.mask, Mask):
        return None
    if a.tracing:
        if not _causal_at_the_end(a):
            return None
        return _sdpa(
            a, "one query at the end of the keys sees them all", "mask allows everything", "none"
        )
    if a.causal_square or not _allows_everything(a.mask, a.p):
        return None
    return _sdpa(
        a,
        f"mask {a.mask!r} allows every position here: torch's fused kernel without a mask",
        "mask allows everything",
        "none",
    )


def _rule_non_finite_key(a: Ask) -> Dispatch | None:
    if all_finite(a.k):
        return None
    why = (
        "key holds NaN or inf and a mask or score modification is given: torch's fused "
        "kernel would spread it into rows that mask that key out"
    )
    if a.dropout_p > 0:
        return _reference(a, f"{why}; the tiled kernel has no dropout", "non-finite key")
    return _tiled(a, why, "non-finite key")


def _rule_dropout(a: Ask) -> Dispatch | None:
    if a.dropout_p == 0:
        return None
    if a.tracing:  # a key's finiteness cannot be read: the reference is exact for any key
        if a.causal_square:
            return _sdpa(a, "causal with T_q == T_k", "dropout", "is_causal")
        return _reference(a, "a mask with dropout", "dropout")
    mode = _sdpa_mask(a)
    how = {"is_causal": "is_causal", "bias": f"{_describe(a.mask, a.mod)} as a float mask"}.get(
        mode, f"the mask {_describe(a.mask, a.mod)} as a dense mask"
    )
    return _sdpa(a, f"dropout without a generator: torch's fused kernel with {how}", "dropout")


def _rule_causal_square(a: Ask) -> Dispatch | None:
    if not a.causal_square or a.mod is not None:
        return None
    why = "causal with T_q == T_k"
    return _sdpa(
        a,
        why if a.tracing else f"{why}: torch's fused kernel with is_causal",
        "causal square",
        "is_causal",
    )


def _kind(a: Ask) -> str:
    return "float" if a.mod is not None else "bool"


def _rule_small(a: Ask) -> Dispatch | None:
    if a.scores >= a.tuning.small_scores:
        return None
    return _sdpa(
        a,
        f"T_q × T_k = {a.p.T_q} × {a.p.T_k} is small: {_describe(a.mask, a.mod)} passed to "
        f"torch's fused kernel as a dense {_kind(a)} mask",
        "small",
    )


def _rule_sparse_or_long(a: Ask) -> Dispatch | None:
    mask, p = a.mask, a.p
    if isinstance(mask, Mask) and a.gpu:
        return Dispatch(
            "flex",
            f"mask {mask!r} on CUDA: FlexAttention skips its empty blocks and runs its "
            f"partial ones fused (SDPA could take it only as a dense {_kind(a)} mask)",
            rule="sparse or long",
        )
    long = a.scores >= a.tuning.long_scores
    if not (isinstance(mask, Mask) or (mask is None and long)) or a.k.device.type == "cuda":
        return None  # SDPA's CUDA kernels hold no T_q × T_k
    plan = make_tiled_plan(mask, p, a.tuning)
    if plan.density < a.tuning.sparse_density:
        return _tiled(
            a,
            f"mask {mask!r} leaves {plan.density:.1%} of the scores to compute: the tiled "
            "kernel skips the empty blocks (as would backend='flex', run only when asked for: "
            "it compiles per mask)",
            "sparse or long",
            plan,
        )
    if long:
        return _tiled(
            a,
            f"T_q × T_k = {p.T_q} × {p.T_k}: torch's fused kernel could take "
            f"{_describe(mask, a.mod)} only as a dense {_kind(a)} mask",
            "sparse or long",
            plan,
        )
    return None


def _rule_otherwise(a: Ask) -> Dispatch | None:
    if a.tracing:
        kind = a.mask.kind if isinstance(a.mask, Mask) else "tensor"
        return _tiled(a, f"mask {kind}", "otherwise")
    p = a.p
    return _sdpa(
        a,
        f"{_describe(a.mask, a.mod)} passed to torch's fused kernel as a dense {_kind(a)} "
        f"mask of (B, H, T_q, T_k) = ({p.B}, {p.H}, {p.T_q}, {p.T_k})",
        "otherwise",
    )


#: The rules of ``backend="auto"``, in order (this module's docstring says each in words).
RULES: tuple[Rule, ...] = (
    Rule("materialised", "always", _rule_materialised),
    Rule("user function", "tracing", _rule_user_function),
    Rule("log-sum-exp", "always", _rule_lse),
    Rule("modification sdpa cannot take", "always", _rule_modification),
    Rule("native bfloat16", "eager", _rule_native),
    Rule("no mask", "always", _rule_no_mask),
    Rule("mask allows everything", "always", _rule_allows_everything),
    Rule("non-finite key", "eager", _rule_non_finite_key),
    Rule("dropout", "always", _rule_dropout),
    Rule("causal square", "always", _rule_causal_square),
    Rule("small", "eager", _rule_small),
    Rule("sparse or long", "eager", _rule_sparse_or_long),
    Rule("otherwise", "always", _rule_otherwise),
)


def check_backend(
    backend: str,
    *,
    dropout_p: float,
    generator: Any,
    return_weights: bool,
    return_lse: bool,
    score_mod: ScoreMod | None,
) -> None:
    """Raise if ``backend`` is unknown or cannot give what the call asks for."""
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
    unfused = mod is not None and not sdpa_takes(mod)
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


def choose(a: Ask, backend: str = "auto") -> Dispatch:
    """Check an explicit ``backend``, or apply :data:`RULES` (those of this mode: eager or
    tracing) for ``"auto"``."""
    check_backend(
        backend,
        dropout_p=a.dropout_p,
        generator=a.generator,
        return_weights=a.return_weights,
        return_lse=a.return_lse,
        score_mod=a.mod,
    )
    if backend == "flex" and isinstance(a.mask, (torch.Tensor, np.ndarray)):
        raise ValueError(
            "backend='flex' takes a qkv mask (a predicate with a block map), not "
            "a dense tensor: use backend='sdpa', 'tiled' or 'auto' for a tensor mask"
        )
    if backend != "auto":
        return _requested(a, backend)
    skip = "eager" if a.tracing else "tracing"
    for rule in RULES:
        if rule.when != skip:
            found = rule.decide(a)
            if found is not None:
                return found
    raise AssertionError("the last rule always matches")  # pragma: no cover


def _requested(a: Ask, backend: str) -> Dispatch:
    why = "requested" if a.tracing else f"requested with backend={backend!r}"
    if backend == "tiled":
        if a.tracing and a.mod is not None and a.recipe is None:
            return _reference(
                a, "a user score function runs traced on the reference kernel", "requested"
            )
        path, how = tiled_path(a)
        if a.tracing:
            return Dispatch(
                "tiled", f"compiling: {why}: {how}", compiled=a.recipe, path=path, rule="requested"
            )
        return Dispatch(
            "tiled", why, make_tiled_plan(a.mask, a.p, a.tuning), path=path, rule="requested"
        )
    if a.tracing:
        mode = "none" if a.mask is None else "is_causal" if a.causal_square else "dense"
        return Dispatch(backend, f"compiling: {why}", sdpa_mask=mode, rule="requested")
    mode = _sdpa_mask(a) if backend == "sdpa" else "dense"
    return Dispatch(backend, why, sdpa_mask=mode, rule="requested")


def block_codes(mask: MaskLike, p: Problem, block_q: int, block_k: int) -> np.ndarray:
    """The (ceil(T_q / block_q), ceil(T_k / block_k)) block map of any mask."""
    nq, nk = -(-p.T_q // block_q), -(-p.T_k // block_k)
    if nq == 0 or nk == 0:  # no queries or no keys: nothing to plan
        return np.zeros((nq, nk), dtype=np.int8)
    if mask is None:
        return np.full((nq, nk), FULL, dtype=np.int8)
    if isinstance(mask, Mask):
        return mask.blocks(
            p.B, p.H, p.T_q, p.T_k, block_q=block_q, block_k=block_k, q_offset=p.q_offset
        )
    # A dense mask is already materialised: reduce it tile by tile.
    m = torch.as_tensor(mask)
    m = m.reshape((1,) * (4 - m.ndim) + tuple(m.shape)).flatten(0, 1)  # (·, T_q|1, T_k|1)
    m = m.expand(m.shape[0], p.T_q, p.T_k)
    pad = torch.nn.functional.pad
    pad_q, pad_k = nq * block_q - p.T_q, nk * block_k - p.T_k

    def tiles(x: torch.Tensor) -> torch.Tensor:
        return x.view(-1, nq, block_q, nk, block_k)

    any_ = tiles(pad(m, (0, pad_k, 0, pad_q), value=False)).any(4).any(2).any(0)
    all_ = tiles(pad(m, (0, pad_k, 0, pad_q), value=True)).all(4).all(2).all(0)
    codes = any_.to(torch.int8) + all_.to(torch.int8)  # 0 empty, 1 partial, 2 full
    return codes.cpu().numpy()


def make_tiled_plan(mask: MaskLike, p: Problem, tuning: Tuning) -> Plan:
    """The tiled kernel's plan of this call: the mask's non-EMPTY tiles in chunks."""
    bq, bk = tuning.block_q, tuning.block_k
    if isinstance(mask, Mask) and p.T_q and p.T_k:
        tiles = mask.sparse_blocks(
            p.B, p.H, p.T_q, p.T_k, block_q=bq, block_k=bk, q_offset=p.q_offset
        )
    else:
        tiles = dense_to_sparse(block_codes(mask, p, bq, bk))
    return make_plan(*tiles, p.T_q, p.T_k, block_q=bq, block_k=bk, chunk_k=tuning.chunk_k)


_PLAIN_DTYPES = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16})


def plain(query: Any, key: Any, value: Any, mask: Any, scale: Any, tuning: Tuning) -> float | None:
    """The decode fast path, for the most common call — a decode step — with as little
    Python as it can have: (B, H, T, D) tensors of one float dtype and device whose sizes
    agree, and no mask, or causal with one query (which allows every key before it). It
    runs torch's fused kernel with no mask, which is what :data:`RULES` would choose ("no
    mask", "mask allows everything"), on the same arguments. Returns the scale to use, or
    None where the call must take the full path (which checks, explains and dispatches)."""
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
    if scale is None:
        return float(D**-0.5)
    if type(scale) is not float or not 0.0 < scale < math.inf:
        return None
    return scale
