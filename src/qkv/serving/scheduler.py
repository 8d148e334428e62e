"""The scheduler of continuous batching: prompts of different lengths decoded together on a
paged KV cache.

A :class:`Batcher` holds the requests in flight. :meth:`Batcher.add` prefills a prompt into
its own pages, and :meth:`Batcher.extend` many prompts packed in one forward pass. Requests
can join between any two steps. :meth:`Batcher.step` gives every request in flight its next
token in one forward pass over the ragged batch, each sequence at its own positions. A
request leaves at its own end token or length, and its pages go back to the pool.

Legend: B requests in flight · V vocabulary · T tokens.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from .batch import PagedCaches
from .sampling import sample


class Context(Protocol):
    """A model's config as far as a :class:`Batcher` reads it: the longest context."""

    @property
    def block_size(self) -> int: ...


class Decoder(Protocol):
    """What a :class:`Batcher` needs of its model (:class:`qkv.models.GPT` has it): the
    config's ``block_size``, the head whose device the tokens go to, paged caches for its
    layers, and a forward pass over tokens with those caches."""

    lm_head: nn.Linear

    @property
    def config(self) -> Context: ...

    def new_paged_caches(
        self, num_pages: int, page_size: int = 16, kv_dtype: torch.dtype | None = None
    ) -> PagedCaches: ...

    def __call__(self, idx: torch.Tensor, *, caches: Any) -> Any: ...


@dataclass
class _Request:
    seq: int
    tokens: list[int]
    new: int  # tokens still to generate
    logits: torch.Tensor  # (V,) the next token's
    done: bool = False
    generated: list[int] = field(default_factory=list)


class Batcher:
    """Requests decoded together on one GPT, each to its own end.

    Args:
        model: a :class:`qkv.models.GPT` (in eval mode for reproducible tokens).
        num_pages: pages per layer's pool; default enough for 32 sequences of the whole
            context. A pool too small is an error when a request would need a page more.
        page_size: tokens per page.
        temperature, top_k, top_p, generator: sampling, as in :meth:`GPT.generate`
            (temperature 0 is greedy); one generator draws for the whole batch in request
            order, so a run is reproducible from its seed and its requests.
        stop_token: a request ends after producing this token (kept in its output).
        kv_dtype: the paged caches' storage: None (the model's dtype), ``torch.int8`` or
            ``torch.float8_e4m3fn`` (quantized, read in place by the decode kernel).

    Example:
        >>> import torch, qkv
        >>> from qkv.models import GPT, GPTConfig
        >>> from qkv.serving import Batcher
        >>> model = GPT(GPTConfig(vocab_size=50, block_size=32, n_layer=1, n_head=2,
        ...                       n_embd=16)).eval()
        >>> batcher = Batcher(model)
        >>> a = batcher.add(torch.tensor([1, 2, 3]), max_new_tokens=4)
        >>> _ = batcher.step()                          # a's first token
        >>> b = batcher.add(torch.tensor([5, 6, 7, 8, 9]), max_new_tokens=2)   # b joins
        >>> batcher.run()
        >>> len(batcher.result(a)), len(batcher.result(b))
        (7, 7)
    """

    def __init__(
        self,
        model: Decoder,
        *,
        num_pages: int | None = None,
        page_size: int = 16,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        generator: torch.Generator | None = None,
        stop_token: int | None = None,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        window = model.config.block_size
        pages = 32 * -(-window // page_size) if num_pages is None else num_pages
        self.model, self.caches = model, model.new_paged_caches(pages, page_size, kv_dtype)
        self.sampling = (temperature, top_k, top_p, generator)
        self.stop_token = stop_token
        self._requests: dict[int, _Request] = {}
        self._next = 0

    def add(self, prompt: torch.Tensor, max_new_tokens: int) -> int:
        """Prefill a prompt ((T,) token ids, T >= 1) into its own pages, and return its id."""
        return self.extend([prompt], max_new_tokens)[0]

    @torch.no_grad()
    def extend(self, prompts: Sequence[torch.Tensor], max_new_tokens: int) -> list[int]:
        """Prefill prompts ((T_i,) token ids, each T_i >= 1) together, packed in one forward
        pass (:class:`qkv.serving.PackedBatch`: each attends its own tokens), and return
        their ids."""
        window = self.model.config.block_size
        for prompt in prompts:
            if not isinstance(prompt, torch.Tensor) or prompt.ndim != 1 or len(prompt) == 0:
                raise ValueError(
                    f"a prompt must be a non-empty (T,) tensor of token ids; got "
                    f"{tuple(getattr(prompt, 'shape', ()))}"
                )
            if len(prompt) + max_new_tokens > window:
                raise ValueError(
                    f"a prompt of {len(prompt)} tokens and {max_new_tokens} new ones exceed "
                    f"the context window of {window} (a paged batch does not slide it)"
                )
        if not prompts:
            return []
        seqs = [self.caches.new_sequence() for _ in prompts]
        lengths = [len(p) for p in prompts]
        packed = torch.cat(list(prompts))[None].to(self.model.lm_head.weight.device)
        try:
            logits = self.model(packed, caches=self.caches.packed(seqs, lengths))[0]
        except Exception:
            for seq in seqs:  # nothing half-made stays in the pool
                self.caches.free(seq)
            raise
        ids = []
        for seq, prompt, end in zip(seqs, prompts, itertools.accumulate(lengths)):
            rid, self._next = self._next, self._next + 1
            self._requests[rid] = _Request(seq, prompt.tolist(), max_new_tokens, logits[end - 1])
            if max_new_tokens == 0:
                self._finish(self._requests[rid])
            ids.append(rid)
        return ids

    @property
    def active(self) -> list[int]:
        """The ids of the requests still generating."""
        return [rid for rid, r in self._requests.items() if not r.done]

    @torch.no_grad()
    def step(self) -> dict[int, int]:
        """One token for every request in flight: {id: token}. Requests that reach their
        end leave (their pages are freed). The others are run forward together."""
        live = [self._requests[rid] for rid in self.active]
        if not live:
            return {}
        logits = torch.stack([r.logits for r in live])  # (B, V)
        tokens = sample(logits, *self.sampling)[:, 0].tolist()
        out = {}
        for rid, r, token in zip(self.active, live, tokens):
            out[rid] = token
            r.generated.append(token)
            r.new -= 1
            if r.new == 0 or token == self.stop_token:
                self._finish(r)
        going = [r for r in live if not r.done]
        if going:
            idx = torch.tensor([[r.generated[-1]] for r in going])
            batch = self.caches.batch([r.seq for r in going])
            logits = self.model(idx.to(self.model.lm_head.weight.device), caches=batch)
            for r, row in zip(going, logits[:, -1]):
                r.logits = row
        return out

    def run(self) -> None:
        """Step until every request has ended."""
        while self.active:
            self.step()

    def result(self, rid: int) -> torch.Tensor:
        """A request's prompt and the tokens generated so far, (T,)."""
        r = self._requests[rid]
        return torch.tensor(r.tokens + r.generated, dtype=torch.long)

    def _finish(self, r: _Request) -> None:
        r.done = True
        self.caches.free(r.seq)
