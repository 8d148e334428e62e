"""Run Hugging Face transformers (>= 5) models on qkv's attention.

    >>> from qkv.integrations import huggingface          # doctest: +SKIP
    >>> huggingface.register()                            # doctest: +SKIP
    >>> model = AutoModel.from_pretrained(path, attn_implementation="qkv")  # doctest: +SKIP

``register`` adds qkv to transformers' ``AttentionInterface`` *and* its mask builder
(:func:`qkv_mask`) to ``AttentionMaskInterface``: without the second, transformers would
build no mask for an unknown implementation, and padded batches would silently attend to
padding. The builder keeps the masks qkv recognises (causal, bidirectional, a causal
sliding window, with padding that leaves each row one run of keys) as qkv masks at the
queries' place in the key buffer (:class:`StructuralMask`: block-sparse, never T_q × T_k);
others are transformers' dense bool masks (``sdpa_mask``: ``True`` = may attend, qkv's
polarity). The score modifications models pass to the
attention function become :mod:`qkv.scores` modifications: Gemma 2's ``softcap``, T5's
``position_bias``, a model's own additive float mask. Gpt-oss's ``s_aux`` (and Inkling's
``sinks``) become qkv's ``sinks``, DeepSeek's sparse ``indices`` a
:func:`qkv.masks.key_indices` mask. A keyword qkv cannot honour (:func:`refused_keywords`)
and a family that computes attention in its own code (:func:`check`) raise
:class:`Unsupported`. docs/huggingface.md has every family's status against eager.

Legend: B batch · H query heads · H_kv key/value heads · T_q/T_k query/key length · D head dim.
"""

from __future__ import annotations

from typing import Any

import torch

from ..functional import attention
from ..masks import Mask, MaskLike, causal, full, key_indices
from ..masks import padding as padding_mask
from ..masks import sliding_window as sliding_window_mask
from ..scores import bias, chain
from ..scores import softcap as scores_softcap
from .hf_boundary import (
    NAME,
    Family,
    Unsupported,
    check,
    family,
    refused_keywords,
)

__all__ = [
    "NAME",
    "Family",
    "StructuralMask",
    "Unsupported",
    "check",
    "family",
    "qkv_attention_forward",
    "qkv_mask",
    "refused_keywords",
    "register",
]


def qkv_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    softcap: float | None = None,
    sliding_window: int | None = None,
    position_bias: torch.Tensor | None = None,
    s_aux: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    indices: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' attention-function signature on top of :func:`qkv.attention`.

    Args:
        query: (B, H, T_q, D); key, value: (B, H_kv, T_k, D) — GQA is native in qkv.
        attention_mask: bool (B, 1, T_q, T_k), True = may attend (a :class:`StructuralMask`
            from :func:`qkv_mask`, or transformers' dense one); a float additive mask (a
            model's own, or eager's for families written for it), added to the scores after
            any soft-cap as eager adds it; or None (transformers skipped it: plain causal, or
            a sliding window no longer than the keys).
        softcap: Gemma 2's soft-capping of the scaled scores (:func:`qkv.scores.softcap`).
        sliding_window: the layer's window; transformers has already built it into
            ``attention_mask`` when there is one, and qkv builds it structurally when not.
        position_bias: T5's relative-position bias, added to the (unscaled: ``scaling``
            is 1) scores (:func:`qkv.scores.bias`).
        s_aux: learned attention sinks, one logit per head (gpt-oss): qkv's ``sinks``.
        sinks: sinks per row, (B, H, T_q, 1) (Inkling's, computed from the input).
        indices: (B, T_q, k) key positions per query (DeepSeek's sparse attention):
            :func:`qkv.masks.key_indices`, combined with the mask.

    Other keywords follow :func:`refused_keywords`: one that concerns the attention and
    that qkv does not take raises :class:`Unsupported`; the rest are ignored, as
    transformers' own attention functions ignore them.

    Returns:
        ``(out (B, T_q, H, D), weights (B, H, T_q, T_k) or None)``; weights only when
        attentions are asked for (``output_attentions``).
    """
    unknown = refused_keywords(kwargs)
    if unknown:
        raise Unsupported(
            f"qkv cannot honour the attention argument(s) {', '.join(unknown)} "
            f"that {type(module).__name__} passes; use another attn_implementation"
        )
    T_q, q_offset = query.shape[2], None
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    mask: MaskLike = attention_mask
    additive: torch.Tensor | None = None
    if type(mask) is torch.Tensor:
        mask = mask[..., : key.shape[2]]  # a static cache's mask may cover more slots
        if mask.is_floating_point():  # a model's own additive mask: added as eager adds it
            additive, mask = mask, None
    if type(mask) is StructuralMask and (mask.shape[-2], mask.shape[-1]) != (T_q, key.shape[2]):
        # Built for other sizes (an encoder-decoder's decoder given a one-key mask while its
        # cache holds more): eager and sdpa broadcast its size-1 dims, and so does qkv.
        if any(m not in (1, n) for m, n in zip(mask.shape[-2:], (T_q, key.shape[2]))):
            raise Unsupported(
                f"the mask was built for (T_q, T_k) = {tuple(mask.shape[-2:])}; "
                f"{type(module).__name__} passes ({T_q}, {key.shape[2]})"
            )
        mask = mask.dense()
    if type(mask) is StructuralMask:  # built by qkv_mask: used as the qkv mask it holds
        structural: StructuralMask = mask
        mask, q_offset = structural.qkv_mask, structural.q_offset
    elif mask is None and additive is None and is_causal and T_q > 1:
        # transformers skipped building a causal mask: it expects is_causal with keys aligned
        # to the queries, and drops cache slots past them (as its sdpa path does).
        key, value = key[:, :, :T_q], value[:, :, :T_q]
        mask = sliding_window_mask(sliding_window) if sliding_window else causal()
    if indices is not None:
        first = key.shape[2] - T_q if q_offset is None else q_offset
        sparse = key_indices(indices, first=first)
        if mask is None or isinstance(mask, Mask):
            mask = sparse if mask is None else mask & sparse
        else:
            B = query.shape[0]
            mask = torch.as_tensor(mask) & sparse.dense(
                B, 1, T_q, key.shape[2], q_offset=first, device=query.device
            )
    mods = (
        ([bias(position_bias)] if position_bias is not None else [])
        + ([scores_softcap(softcap)] if softcap is not None else [])
        + ([bias(additive)] if additive is not None else [])
    )
    config = getattr(module, "config", None)
    want_weights = bool(
        kwargs.get("output_attentions", getattr(config, "output_attentions", False))
    )
    result = attention(
        query,
        key,
        value,
        mask=mask,
        scale=scaling,
        q_offset=q_offset,
        dropout_p=dropout if module.training else 0.0,
        return_weights=want_weights,
        score_mod=chain(*mods) if mods else None,
        sinks=_sinks(s_aux, sinks),
    )
    out, weights = result if isinstance(result, tuple) else (result, None)
    return out.transpose(1, 2).contiguous(), weights


def _sinks(s_aux: torch.Tensor | None, sinks: torch.Tensor | None) -> torch.Tensor | None:
    """qkv's sinks from the two ways models pass them: ``s_aux`` (H,) or ``sinks``
    (B, H, T_q, 1), one logit per row, concatenated to the scores in eager."""
    if s_aux is not None and sinks is not None:
        raise Unsupported("a model passed both s_aux and sinks; qkv takes one of them")
    if sinks is not None and sinks.ndim == 4 and sinks.shape[-1] == 1:
        return sinks[..., 0]
    return s_aux if sinks is None else sinks


def _densified(x: Any) -> Any:
    """x with every StructuralMask inside it (in lists, tuples and dicts, as a torch op's
    arguments come) replaced by its dense tensor."""
    if isinstance(x, StructuralMask):
        return x.dense()
    if isinstance(x, (list, tuple)):
        return type(x)(_densified(item) for item in x)
    if isinstance(x, dict):
        return {k: _densified(v) for k, v in x.items()}
    return x


class StructuralMask(torch.Tensor):
    """The (B, 1, T_q, T_k) bool mask transformers asked for, held as a qkv mask: the qkv
    attention function reads the mask underneath (block-sparse, never T_q × T_k). Any torch
    operation on it (transformers preparing it for generation, another implementation)
    sees the dense bool mask it stands for, built then. So it is never wrong, only lazy."""

    @staticmethod
    def __new__(cls, qkv_mask: Mask, q_offset: int, shape: tuple, device: Any) -> Any:
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=torch.bool, device=device)

    def __init__(self, qkv_mask: Mask, q_offset: int, shape: tuple, device: Any) -> None:
        self.qkv_mask, self.q_offset = qkv_mask, q_offset

    def dense(self) -> torch.Tensor:
        B, _, T_q, T_k = self.shape
        return self.qkv_mask.dense(B, 1, T_q, T_k, q_offset=self.q_offset, device=self.device)

    def __repr__(self, **kwargs: Any) -> str:  # type: ignore[override]
        return (
            f"StructuralMask({self.qkv_mask!r}, q_offset={self.q_offset}, "
            f"shape={tuple(self.shape)})"
        )

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        return func(*_densified(args), **_densified(kwargs or {}))


def _structure(mask_function: Any) -> Mask | None:
    """The qkv mask equal to one of transformers' mask functions, if it is one qkv knows:
    causal, bidirectional, or a causal sliding window (recognised by its closure)."""
    from transformers import masking_utils as mu

    if mask_function is mu.causal_mask_function:
        return causal()
    if mask_function is mu.bidirectional_mask_function:
        return full()
    parts = _closure(mask_function, "mask_functions")  # and_masks(overlay, causal)
    if (
        getattr(mask_function, "__qualname__", "").startswith("and_masks.")
        and isinstance(parts, tuple)
        and len(parts) == 2
        and parts[1] is mu.causal_mask_function
        and getattr(parts[0], "__qualname__", "").startswith("sliding_window_overlay.")
    ):
        window = _closure(parts[0], "sliding_window")
        if isinstance(window, int) and window >= 1:
            return sliding_window_mask(window)
    return None


def _closure(fn: Any, name: str) -> Any:
    cells = dict(
        zip(
            getattr(getattr(fn, "__code__", None), "co_freevars", ()),
            getattr(fn, "__closure__", None) or (),
        )
    )
    return cells[name].cell_contents if name in cells else None


def _valid_keys(padding: torch.Tensor) -> list[Mask] | None:
    """A (B, T_k) key-validity mask as qkv masks to combine (none if every key is valid), if
    each row's valid keys are one run [start, end): ``~padding(start)``, ``padding(end)``;
    None if some row's are not."""
    valid = padding.bool()
    T_k = valid.shape[-1]
    count = valid.sum(-1)
    start = torch.where(count > 0, valid.int().argmax(-1), 0)
    end = torch.where(count > 0, T_k - valid.flip(-1).int().argmax(-1), 0)
    if not bool((end - start == count).all()):
        return None
    return ([~padding_mask(start)] if bool(start.any()) else []) + (
        [padding_mask(end)] if bool((end < T_k).any()) else []
    )


def qkv_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: Any = 0,
    kv_offset: Any = 0,
    mask_function: Any = None,
    attention_mask: Any = None,
    allow_is_causal_skip: bool = True,
    device: Any = "cpu",
    **kwargs: Any,
) -> Any:
    """transformers' mask builder for qkv: a causal, bidirectional or causal sliding-window
    mask whose padding leaves each row one run of keys becomes a :class:`StructuralMask`;
    anything else (and everything while compiling) is transformers' own ``sdpa_mask``."""
    from transformers.masking_utils import causal_mask_function, eager_mask, sdpa_mask

    config = kwargs.get("config")
    check(config)
    mask_function = causal_mask_function if mask_function is None else mask_function
    args = (batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask)
    if family(config).additive_masks:  # the mask its code was written for; qkv adds it
        return eager_mask(*args, device=device, **kwargs)
    dense = lambda: sdpa_mask(  # noqa: E731
        *args, allow_is_causal_skip=allow_is_causal_skip, device=device, **kwargs
    )
    structure = _structure(mask_function)
    if structure is None or torch.compiler.is_compiling():
        return dense()
    offset = int(q_offset) - int(kv_offset)  # the queries' place in the layer's key buffer
    if not 0 <= offset <= kv_length - q_length:
        return dense()
    if attention_mask is not None:
        padding = attention_mask[:, int(kv_offset) : int(kv_offset) + kv_length]
        if padding.shape[-1] < kv_length:  # key slots past the 2D mask (a static cache)
            padding = torch.nn.functional.pad(padding, (0, kv_length - padding.shape[-1]))
        valid = _valid_keys(padding)
        if valid is None:
            return dense()
        for part in valid:
            structure = structure & part
    return StructuralMask(structure, offset, (batch_size, 1, q_length, kv_length), device)


def register(name: str = NAME) -> None:
    """Make ``attn_implementation=name`` run on qkv in every transformers model."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as err:  # transformers is an optional extra
        raise ImportError(
            'the Hugging Face integration needs transformers >= 5: pip install "qkv[huggingface]"'
        ) from err
    AttentionInterface.register(name, qkv_attention_forward)
    AttentionMaskInterface.register(name, qkv_mask)
