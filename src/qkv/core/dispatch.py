"""Dispatch: the one place that decides which code runs an attention call, and says why.

:func:`choose` applies :data:`RULES` in order, and the first that matches decides. Each
rule is named and marked with when it applies. ``always`` rules apply everywhere. ``eager``
rules read tensor values or the values of lengths, which a ``torch.compile`` trace must not
do: under ``dynamic=True`` a length is symbolic, and reading it would specialise the graph.
``tracing`` rules stand in for them while a graph is traced. The same list runs eagerly and
while tracing.

For ``backend="auto"``, in order:

0. ``plain``: a decode step that :meth:`qkv.core.call.Call.of` checked alone (4-d tensors
   of one dtype, no mask or causal over one query, no option set) goes to ``sdpa`` without
   a mask, as rules 8 and 9 would choose — or, in bfloat16 with one query over
   :data:`qkv.core.rules.DECODE_KEYS` keys or more, to qkv's native paged decode kernel
   (path ``paged-native``), which reads each sequence's keys and values in place as one
   page: torch's kernel takes 3–10× its time there (docs/kernels.md).
1. ``materialised``: the weights, dropout from a ``torch.Generator``, or dropout together
   with the log-sum-exp go to ``reference``, the only kernel that materialises them.
2. ``user function while tracing``: a score function qkv cannot rebuild inside the compiled
   tiled op goes to ``reference``, traced into the graph.
3. ``sinks`` go to ``tiled``, which applies them exactly from its log-sum-exp (``flex`` on
   CUDA, ``reference`` with dropout or while tracing).
4. ``log-sum-exp`` goes to ``tiled``, which returns it without materialising T_q × T_k
   (``flex`` on CUDA).
5. ``modification sdpa cannot take`` (not additive, or reading a tensor that needs a
   gradient, or any modification while tracing) goes to ``tiled``, to ``flex`` on CUDA, or
   to ``reference`` with dropout. An additive one continues below as a float mask.
6. ``native bfloat16`` (eager): bfloat16 on a CPU that runs qkv's native kernel, with no
   dropout or modification, a qkv mask or none, and at least
   :attr:`qkv.Tuning.native_scores` scores, goes to ``tiled``. SDPA computes bfloat16 at
   float32's speed on the CPU, so the native kernel is faster from T = 1024, forward and
   backward (docs/benchmarks.md).
7. ``head dims differ`` (eager): D_v != D on the CPU with a qkv mask, no dropout, at least
   :attr:`qkv.Tuning.unequal_scores` scores and a call the native kernel runs goes to
   ``tiled``. torch's fused CPU kernel takes D_v == D only, and its math path builds the
   weights.
8. ``no mask`` goes to ``sdpa`` without a mask.
9. ``mask allows everything``: a qkv mask with no EMPTY or PARTIAL position here goes to
   ``sdpa`` without a mask (eager; while tracing, causal for one query at the end of the
   keys).
10. ``non-finite key`` (eager): a key holding NaN or inf under a mask or modification goes
    to ``tiled``, since SDPA would spread it into rows that mask it (``reference`` with
    dropout).
11. ``dropout`` goes to ``sdpa`` with the mask, drawing from torch's global generator (to
    ``reference`` while tracing, where a key's finiteness cannot be read).
12. ``causal square`` goes to ``sdpa`` with ``is_causal`` (T_q == T_k, no offset) —
    or, on the CPU, from :attr:`qkv.Tuning.native_scores` scores on, to ``tiled`` on
    qkv's native kernel where the machine's profile measured its causal pass under
    :data:`qkv.kernels.tiled.choices.CAUSAL_AT` × torch's time (half precision: under
    the time of the path it takes otherwise, ``Probe.causal_at``; with a gradient, or
    forward alone, as the call needs; never with the probe off).
13. ``small`` (eager): fewer than :attr:`qkv.Tuning.small_scores` scores go to ``sdpa``
    with the mask lowered densely. Planning blocks would cost more than skipping them
    saves.
14. ``sparse or long`` (eager): a qkv mask leaving less than
    :attr:`qkv.Tuning.sparse_density` of the scores, or at least
    :attr:`qkv.Tuning.long_scores` scores, goes to ``tiled`` (``flex`` on CUDA for a qkv
    mask).
15. ``otherwise`` goes to ``sdpa`` with the mask lowered densely, or while tracing to
    ``tiled`` as one opaque op.

Where the tiled kernel runs, :func:`tiled_path` names its code: the PyTorch loop, torch's
flash kernel call by call, qkv's native kernel (float32, bfloat16), or (while tracing) the
compiled op, which applies the same rules at run time.

On CPU ``flex`` runs only when asked for. It compiles for seconds per mask structure, and
there it has neither a backward nor the log-sum-exp. The thresholds were measured with
``benchmarks/bench_attention.py`` (docs/kernels.md).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..kernels import paged as paged_kernel
from ..kernels.quant import is_quantized
from ..kernels.tiled import profile
from ..scores import ScoreMod
from ..tuning import tuning
from .call import Call, Dispatch, Rule, fast_scale
from .paths import sdpa_mode, sdpa_takes, tiled_path
from .planning import block_codes, make_tiled_plan
from .record import editors, listeners
from .rules import RULES

__all__ = [
    "BACKENDS",
    "RULES",
    "Call",
    "Dispatch",
    "Rule",
    "block_codes",
    "check_backend",
    "choose",
    "make_tiled_plan",
    "sdpa_takes",
    "tiled_path",
]

BACKENDS: tuple[str, ...] = ("auto", "reference", "sdpa", "tiled", "flex")


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


def choose(a: Call) -> Dispatch:
    """Check an explicit ``backend``, or apply :data:`RULES` (those of this mode: eager or
    tracing) for ``"auto"``."""
    backend = a.backend
    if backend != "auto":  # "auto" can give everything: only a named backend is checked
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
        return _requested(a, backend)
    skip = "eager" if a.tracing else "tracing"
    for rule in RULES:
        if rule.when != skip:
            found = rule.decide(a)
            if found is not None:
                return found
    raise AssertionError("the last rule always matches")  # pragma: no cover


def _requested(a: Call, backend: str) -> Dispatch:
    why = "requested" if a.tracing else f"requested with backend={backend!r}"
    if backend == "tiled":
        if a.tracing and a.mod is not None and a.recipe is None:
            return Dispatch(
                "reference",
                "compiling: a user score function runs traced on the reference kernel",
                rule="requested",
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
    mode = sdpa_mode(a) if backend == "sdpa" else "dense"
    return Dispatch(backend, why, sdpa_mask=mode, rule="requested")


def paged(
    query: torch.Tensor,
    key_pages: torch.Tensor,
    value_pages: torch.Tensor,
    scale: Any,
    sinks: torch.Tensor | None,
) -> float | None:
    """Whether a decode step over pages (:func:`qkv.paged_attention`) runs the native paged
    kernel, which reads the pages in place: the scale to give it, or None where the pages
    are gathered and :func:`qkv.attention` runs instead — a ``heads.record()`` or
    ``ablate`` block open (the kernel keeps no weights and edits nothing), a graph being
    traced, a scale that is not a positive float, or tensors the kernel cannot take
    (:func:`qkv.kernels.paged.supports`: dtype, device, layout, a gradient to record)."""
    if listeners() or editors() or torch.compiler.is_compiling():
        return None
    scale_ = fast_scale(scale, query.shape[-1])
    if scale_ is None or not paged_kernel.supports(query, key_pages, value_pages, sinks):
        return None
    return scale_


def paged_dots(query: torch.Tensor, key_pages: torch.Tensor) -> bool:
    """Whether the native paged kernel scores these bfloat16 queries against int8 or float8
    keys with bfloat16 dot products (:func:`qkv.kernels.paged.decode`'s
    ``quantized_dots``): where the machine's profile found them the faster
    (:attr:`qkv.kernels.tiled.profile.Probe.paged_dots`: on one CPU they are, on another
    widened keys are); with the probe off, as the kernel does by itself (yes)."""
    quantized = query.dtype == torch.bfloat16 and is_quantized(key_pages.dtype)
    if not (quantized and tuning().native_probe and paged_kernel.dots()):
        return True
    return profile.probe().paged_dots
