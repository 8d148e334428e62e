"""Where qkv meets a Hugging Face model: which families it runs (:func:`family`,
:func:`check`) and which keywords of an attention call it must refuse
(:func:`refused_keywords`); :class:`Unsupported` says why. Read by
:mod:`qkv.integrations.huggingface`, which re-exports all of it."""

from __future__ import annotations

import functools
import importlib
import inspect
import re
from dataclasses import dataclass
from typing import Any

import torch

NAME = "qkv"


class Unsupported(ValueError):
    """A model, or an argument it passes, that qkv cannot run exactly. The message says why
    and what to use instead."""


#: Tensors transformers passes along that it has already built into the mask it gives
#: (packed sequences from position ids, cache slots from cache positions).
_POSITIONS = frozenset({"position_ids", "cache_position"})
_OURS = frozenset({"output_attentions"})


def _backend_keywords() -> frozenset[str]:
    """The keywords that transformers' own attention functions (sdpa, flash, flex, …) take
    by name: what an attention function is expected to read. qkv's own is left out."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    functions = tuple(
        ALL_ATTENTION_FUNCTIONS[key]
        for key in ALL_ATTENTION_FUNCTIONS.valid_keys()
        if not getattr(ALL_ATTENTION_FUNCTIONS[key], "__module__", "").startswith("qkv.")
    )
    return _named(functions)


@functools.lru_cache(maxsize=8)
def _named(functions: tuple[Any, ...]) -> frozenset[str]:
    names: set[str] = set()
    for fn in functions:
        try:
            parameters = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):
            continue
        names |= {p.name for p in parameters if p.kind is not p.VAR_KEYWORD}
    return frozenset(names - {"module", "query", "key", "value", "attention_mask"})


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    return isinstance(value, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in value)


def refused_keywords(kwargs: dict[str, Any]) -> list[str]:
    """The keywords of an attention call that qkv cannot honour, by one rule: a keyword
    concerns the attention if one of transformers' attention functions takes it by name,
    or if it carries a tensor (other than the positions transformers has already built into
    the mask). Those qkv does not take are refused. Every other keyword (flags such as
    ``output_router_logits``, ints such as ``logits_to_keep``, cache objects) passes through
    every transformers backend unread, and qkv ignores it as they do."""
    concern = _backend_keywords()
    return sorted(
        k
        for k, v in kwargs.items()
        if v is not None
        and k not in _OURS
        and (k in concern or (_holds_tensor(v) and k not in _POSITIONS))
    )


@dataclass(frozen=True)
class Family:
    """What qkv needs to know of a model family's code (:func:`family`)."""

    #: its attention is computed in its own code, not through the AttentionInterface
    own_attention: bool = False
    #: it supports neither sdpa nor flex attention: its code was written for eager's
    #: additive float masks (and may do arithmetic on them)
    additive_masks: bool = False


def family(config: Any) -> Family:
    """What the modeling code of ``config``'s family does with attention, read from it.

    ``own_attention`` is transformers' own test (the one that decides whether a model's
    attention can be set at all): the modeling file defines an ``…Attention…(nn.Module)``
    class but never calls ``ALL_ATTENTION_FUNCTIONS.get_interface(``. ``additive_masks``:
    none of its models declares sdpa or flex support (transformers' ``_supports_sdpa`` and
    ``_supports_flex_attn`` flags, which model authors set). A family whose modeling file
    cannot be read gets the defaults (False, False)."""
    return Family() if config is None else _family(type(config).__module__)


@functools.cache
def _family(config_module: str) -> Family:
    modeling = config_module.replace(".configuration_", ".modeling_")
    if modeling == config_module:
        return Family()
    try:
        source = importlib.import_module(modeling)
    except ImportError:
        return Family()
    try:
        code = inspect.getsource(source)
    except (OSError, TypeError):
        return Family()
    has_attention = re.search(r"^class \w*Attention\w*\(nn\.Module\):", code, re.MULTILINE)
    own = bool(has_attention) and "ALL_ATTENTION_FUNCTIONS.get_interface(" not in code
    models = [
        c
        for c in vars(source).values()
        if isinstance(c, type) and c.__module__ == modeling and hasattr(c, "_supports_sdpa")
    ]
    additive = bool(models) and not any(
        getattr(c, "_supports_sdpa", False) or getattr(c, "_supports_flex_attn", False)
        for c in models
    )
    return Family(own_attention=own, additive_masks=additive)


def check(model_or_config: Any) -> None:
    """Raise :class:`Unsupported` if a model (or its config) cannot run on qkv: its family
    computes attention in its own code (:func:`family`), so ``attn_implementation="qkv"``
    would not run qkv — and where it builds masks through transformers, it would get one
    of the wrong kind. qkv's mask builder calls this on every model that builds a mask;
    call it yourself for the few that build none."""
    config = getattr(model_or_config, "config", model_or_config)
    if not family(config).own_attention:
        return
    raise Unsupported(
        f"{type(config).__name__.removesuffix('Config')} models compute attention in their "
        "own code, not through transformers' AttentionInterface, so "
        f'attn_implementation="{NAME}" would not run qkv (and would hand that code a mask '
        'of the wrong kind): use attn_implementation="eager" (or "sdpa" where the model '
        "supports it)"
    )
