"""The rules of ``backend="auto"``, each named, marked with when it applies, and written as
a function of one :class:`~qkv.core.call.Call` that returns a :class:`Dispatch` or None;
:data:`RULES` lists them in order. :mod:`qkv.core.dispatch` applies them (its docstring
says each in words).

Legend: B batch · H query heads · T_q/T_k query/key length · D head dim · D_v value head dim.
"""

from __future__ import annotations

import torch

from ..kernels import paged as paged_kernel
from ..kernels.tiled import native, profile
from ..kernels.tiled.plan import Plan
from ..masks import Mask, MaskLike
from ..scores import ScoreMod
from .call import Call, Dispatch, Rule
from .paths import (
    allows_everything,
    causal_at_the_end,
    native_causal,
    native_wins,
    needs_grad,
    sdpa_mode,
    sdpa_takes,
    tiled_path,
    widened,
)
from .planning import make_tiled_plan


def _materialised(a: Call) -> list[str]:
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


def _describe(mask: MaskLike, mod: ScoreMod | None = None) -> str:
    what = (
        []
        if mask is None
        else [f"mask {mask!r}" if isinstance(mask, Mask) else f"mask tensor{tuple(mask.shape)}"]
    )
    return " and ".join(what + ([f"score modification {mod!r}"] if mod is not None else []))


def _tiled(
    a: Call,
    why: str,
    rule: str,
    plan: Plan | None = None,
    code: tuple[str, str] | None = None,
) -> Dispatch:
    """The tiled kernel: its plan and the code that runs it (:func:`tiled_path`, which reads
    Q and V), each made here unless a rule that needed it first hands it over."""
    path, how = tiled_path(a) if code is None else code
    if a.tracing:
        return Dispatch(
            "tiled", f"compiling: {why}: {how}", compiled=a.recipe, path=path, rule=rule
        )
    plan = make_tiled_plan(a.mask, a.p, a.tuning) if plan is None else plan
    return Dispatch("tiled", f"{why}; {how}", plan, path=path, rule=rule)


def _sdpa(a: Call, why: str, rule: str, mode: str | None = None) -> Dispatch:
    drawn = " (dropout drawn from torch's global generator)" if a.dropout_p > 0 else ""
    prefix = "compiling: " if a.tracing else ""
    mode = sdpa_mode(a) if mode is None else mode
    path = "sdpa"
    if widened(a):
        path = "sdpa-float32"
        drawn += (
            f"; on float32 copies: torch's kernel ran {str(a.q.dtype).removeprefix('torch.')} "
            "slower than float32 on this CPU (measured once)"
        )
    return Dispatch("sdpa", f"{prefix}{why}{drawn}", sdpa_mask=mode, rule=rule, path=path)


def _reference(a: Call, why: str, rule: str) -> Dispatch:
    return Dispatch("reference", ("compiling: " if a.tracing else "") + why, rule=rule)


def _rule_materialised(a: Call) -> Dispatch | None:
    asked = _materialised(a)
    if not asked:
        return None
    return _reference(
        a,
        f"{' and '.join(asked)} asked for: only the materialised reference kernel provides them",
        "materialised",
    )


def _rule_user_function(a: Call) -> Dispatch | None:
    if a.mod is None or a.recipe is not None:
        return None
    return _reference(
        a, "a user score function runs traced on the reference kernel", "user function"
    )


def _rule_sinks(a: Call) -> Dispatch | None:
    if a.sinks is None:
        return None
    if a.dropout_p > 0 or a.tracing:
        why = "with dropout (the tiled kernel has none)" if a.dropout_p > 0 else "while compiling"
        return _reference(
            a, f"attention sinks {why}: the reference kernel applies them exactly", "sinks"
        )
    if a.gpu:
        return Dispatch(
            "flex",
            "attention sinks, on CUDA: FlexAttention's log-sum-exp gives them exactly",
            rule="sinks",
        )
    return _tiled(
        a,
        "attention sinks: the tiled kernel applies them from its log-sum-exp, exactly and "
        "without materialising T_q × T_k",
        "sinks",
    )


def _rule_lse(a: Call) -> Dispatch | None:
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


def _rule_modification(a: Call) -> Dispatch | None:
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


def _rule_native(a: Call) -> Dispatch | None:
    if not (
        a.k.dtype == torch.bfloat16
        and a.mod is None
        and a.dropout_p == 0
        and a.tuning.native
        and a.scores >= a.tuning.native_scores
        and (a.mask is None or isinstance(a.mask, Mask))
        and native.shapes_fit(a.k.dtype, a.k.device, a.p.D, a.p.D_v)
        and native_wins(a, torch.bfloat16)
    ):
        return None
    if a.tuning.native_probe:
        found = profile.probe()
        measured = (
            f"measured once on this machine: {found.native_ms:.2f} ms against float32's "
            f"{found.float32_ms:.2f} ms through torch's kernel, {found.native32_ms:.2f} ms native, "
            f"{found.native_widen_ms:.2f} ms widening bfloat16"
        )
    else:
        measured = "pinned by Tuning.native_probe=False, not measured"
    return _tiled(
        a,
        "bfloat16 on a CPU with bfloat16 dot products: the tiled kernel's native bfloat16 steps "
        f"beat float32 through torch's kernel ({measured})",
        "native bfloat16",
    )


def _rule_head_dims_differ(a: Call) -> Dispatch | None:
    if not (
        a.p.D_v != a.p.D
        and isinstance(a.mask, Mask)
        and a.dropout_p == 0
        and a.q.device.type == "cpu"
        and a.scores >= a.tuning.unequal_scores
    ):
        return None
    code = tiled_path(a)
    if not code[0].startswith("tiled-native"):
        return None
    return _tiled(
        a,
        f"D = {a.p.D}, D_v = {a.p.D_v}: torch's fused CPU kernel takes D_v == D only, and its "
        "math path builds the T_q × T_k weights",
        "head dims differ",
        code=code,
    )


def _rule_no_mask(a: Call) -> Dispatch | None:
    if a.mask is not None or a.mod is not None:
        return None
    why = "no mask" if a.tracing else "no mask: torch's fused kernel is the fastest dense path"
    return _sdpa(a, why, "no mask", "none")


def _rule_allows_everything(a: Call) -> Dispatch | None:
    if a.mod is not None or not isinstance(a.mask, Mask):
        return None
    if a.tracing:
        if not causal_at_the_end(a):
            return None
        return _sdpa(
            a, "one query at the end of the keys sees them all", "mask allows everything", "none"
        )
    if a.causal_square or not allows_everything(a.mask, a.p):
        return None
    return _sdpa(
        a,
        f"mask {a.mask!r} allows every position here: torch's fused kernel without a mask",
        "mask allows everything",
        "none",
    )


def _rule_non_finite_key(a: Call) -> Dispatch | None:
    if a.key_finite:
        return None
    why = (
        "key holds NaN or inf and a mask or score modification is given: torch's fused "
        "kernel would spread it into rows that mask that key out"
    )
    if a.dropout_p > 0:
        return _reference(a, f"{why}; the tiled kernel has no dropout", "non-finite key")
    return _tiled(a, why, "non-finite key")


def _rule_dropout(a: Call) -> Dispatch | None:
    if a.dropout_p == 0:
        return None
    if a.tracing:  # a key's finiteness cannot be read: the reference is exact for any key
        if a.causal_square:
            return _sdpa(a, "causal with T_q == T_k", "dropout", "is_causal")
        return _reference(a, "a mask with dropout", "dropout")
    mode = sdpa_mode(a)
    how = {"is_causal": "is_causal", "bias": f"{_describe(a.mask, a.mod)} as a float mask"}.get(
        mode, f"the mask {_describe(a.mask, a.mod)} as a dense mask"
    )
    return _sdpa(a, f"dropout without a generator: torch's fused kernel with {how}", "dropout")


def _rule_causal_square(a: Call) -> Dispatch | None:
    if not a.causal_square or a.mod is not None:
        return None
    why = "causal with T_q == T_k"
    if native_causal(a):
        code = tiled_path(a)  # the native kernel, unless it cannot take these inputs
        if code[0] in ("tiled-native", "tiled-native-widen"):
            ratio = profile.probe().causal_ratio(backward=needs_grad(a))
            return _tiled(
                a,
                f"{why}: the native kernel's causal pass took {ratio:.2f}× the time of torch's "
                "fused kernel with is_causal on this machine (measured once)",
                "causal square",
                code=code,
            )
    return _sdpa(
        a,
        why if a.tracing else f"{why}: torch's fused kernel with is_causal",
        "causal square",
        "is_causal",
    )


def _kind(a: Call) -> str:
    return "float" if a.mod is not None else "bool"


def _rule_small(a: Call) -> Dispatch | None:
    if a.scores >= a.tuning.small_scores:
        return None
    return _sdpa(
        a,
        f"T_q × T_k = {a.p.T_q} × {a.p.T_k} is small: {_describe(a.mask, a.mod)} passed to "
        f"torch's fused kernel as a dense {_kind(a)} mask",
        "small",
    )


def _rule_sparse_or_long(a: Call) -> Dispatch | None:
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


def _rule_otherwise(a: Call) -> Dispatch | None:
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
#: What rule "plain" decides, with no mask and with causal over one query: a decode step
#: that :meth:`Call.of` checked by :func:`qkv.core.call.plain` alone goes to torch's fused
#: kernel without a mask, as rules "no mask" and "mask allows everything" would send it.
PLAIN = {
    mask: Dispatch(
        "sdpa",
        f"{why}: torch's fused kernel without a mask, by the decode fast path's checks alone",
        sdpa_mask="none",
        rule="plain",
    )
    for mask, why in (
        (False, "no mask"),
        (True, "mask causal() allows every position for one query at the end of the keys"),
    )
}


#: What rule "plain" decides for a bfloat16 decode step (one query) over DECODE_KEYS keys or
#: more that qkv's native paged decode kernel takes, where the machine's profile found that
#: kernel the faster (with GQA or without: :meth:`Probe.paged_decode
#: <qkv.kernels.tiled.profile.Probe.paged_decode>`; with the probe off, always): that kernel,
#: reading each sequence's keys and values in place as one page. torch's fused kernel
#: computes such a step at several times its own float32 time on some CPUs and at half of
#: it on others; over a few dozen keys it is the quicker (the paged kernel's Python costs
#: more than the keys), hence the bound. Measured in docs/kernels.md ("The decode fast
#: path").
DECODE_KEYS = 256
DECODE = Dispatch(
    "paged",
    "a decode step in bfloat16: qkv's native paged decode kernel, each sequence's keys and "
    "values read in place as one page, by the decode fast path's checks alone",
    path="paged-native",
    rule="plain",
)


def _rule_plain(a: Call) -> Dispatch | None:
    if a.fast_scale is None:
        return None
    p = a.p
    if (
        p.T_q == 1
        and p.T_k >= DECODE_KEYS
        and a.q.dtype is torch.bfloat16
        and paged_kernel.supports(a.q, a.k, a.v)
        and (not a.tuning.native_probe or profile.probe().paged_decode(gqa=p.H_kv != p.H))
    ):
        return DECODE
    return PLAIN[a.mask is not None]


RULES: tuple[Rule, ...] = (
    Rule("plain", "eager", _rule_plain),
    Rule("materialised", "always", _rule_materialised),
    Rule("user function", "tracing", _rule_user_function),
    Rule("sinks", "always", _rule_sinks),
    Rule("log-sum-exp", "always", _rule_lse),
    Rule("modification sdpa cannot take", "always", _rule_modification),
    Rule("native bfloat16", "eager", _rule_native),
    Rule("head dims differ", "eager", _rule_head_dims_differ),
    Rule("no mask", "always", _rule_no_mask),
    Rule("mask allows everything", "always", _rule_allows_everything),
    Rule("non-finite key", "eager", _rule_non_finite_key),
    Rule("dropout", "always", _rule_dropout),
    Rule("causal square", "always", _rule_causal_square),
    Rule("small", "eager", _rule_small),
    Rule("sparse or long", "eager", _rule_sparse_or_long),
    Rule("otherwise", "always", _rule_otherwise),
)
