"""Recording attention calls: who is listening. :func:`qkv.heads.record` opens a block, and
:func:`qkv.attention` hands every call it makes inside one to each open block.

Editing them: inside an :func:`editing` block (:func:`qkv.heads.ablate` opens one) every call's
output passes through each open editor before it is returned. This is the public hook on
attention output that ablations use, with no model code patched.

The open blocks live in a :class:`contextvars.ContextVar`. A block opened in one thread (or
asyncio task) records that thread's calls only, nested blocks each get every call, and a
block closed by an exception is closed all the same.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any, Protocol

import torch


class Listener(Protocol):
    """What a recording block receives for each call: its inputs as given and its (B, H, T_q)
    log-sum-exp in the caller's layout (None where the backend gives none)."""

    def add(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        lse: torch.Tensor | None,
        *,
        mask: Any,
        scale: float | None,
        q_offset: int | None,
        score_mod: Any,
    ) -> None: ...


_LISTENERS: ContextVar[tuple[Listener, ...]] = ContextVar("qkv_listeners", default=())


def listeners() -> tuple[Listener, ...]:
    """The open blocks here, outermost first (none while ``torch.compile`` traces: a graph
    has no side effects)."""
    return () if torch.compiler.is_compiling() else _LISTENERS.get()


@contextlib.contextmanager
def listening(listener: Listener) -> Iterator[Listener]:
    """Hand every attention call made in this block (this thread, this task) to
    ``listener``."""
    token = _LISTENERS.set((*_LISTENERS.get(), listener))
    try:
        yield listener
    finally:
        _LISTENERS.reset(token)


#: An editor: called with each call's output in the (B, H, T_q, D_v) layout, returns the
#: output to use instead (the same shape).
Editor = Callable[[torch.Tensor], torch.Tensor]

_EDITORS: ContextVar[tuple[Editor, ...]] = ContextVar("qkv_editors", default=())


def editors() -> tuple[Editor, ...]:
    """The open editing blocks here, outermost first.

    Raises:
        RuntimeError: a block is open (in any thread) while ``torch.compile`` traces: a
            compiled graph would leave the edit out, giving silently unedited outputs.
    """
    if torch.compiler.is_compiling():  # a ContextVar cannot be read there: the count can
        if _OPEN_EDITS["blocks"]:
            raise RuntimeError(
                "attention outputs cannot be edited (qkv.heads.ablate) inside "
                "torch.compile: run the model uncompiled in the block"
            )
        return ()
    return _EDITORS.get()


#: editing blocks open in every thread, which torch.compile can read
_OPEN_EDITS = {"blocks": 0}


@contextlib.contextmanager
def editing(editor: Editor) -> Iterator[Editor]:
    """Pass the output of every attention call made in this block (this thread, this task)
    through ``editor``. Nested blocks apply outermost first."""
    token = _EDITORS.set((*_EDITORS.get(), editor))
    _OPEN_EDITS["blocks"] += 1
    try:
        yield editor
    finally:
        _OPEN_EDITS["blocks"] -= 1
        _EDITORS.reset(token)


def served(
    out: torch.Tensor,
    lse: torch.Tensor | None,
    args: dict[str, Any],
    restore: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """One call's output (B, H, T_q, D_v) after the open blocks: each listener gets the
    call's ``args`` (query, key, value and the options, as given) and its lse in the
    caller's layout (``restore``), then each editor edits ``out``. What
    :func:`qkv.attention` returns inside a :func:`qkv.heads.record` or
    :func:`qkv.heads.ablate` block."""
    for listener in listeners():
        listener.add(
            args["query"],
            args["key"],
            args["value"],
            None if lse is None else restore(lse),
            mask=args["mask"],
            scale=args["scale"],
            q_offset=args["q_offset"],
            score_mod=args["score_mod"],
        )
    for edit in editors():  # qkv.heads.ablate and other editors of the heads' outputs
        edited = edit(out)
        if edited.shape != out.shape:
            raise ValueError(
                f"an attention output editor returned shape {tuple(edited.shape)}; "
                f"it must keep the output's {tuple(out.shape)}"
            )
        out = edited
    return out
