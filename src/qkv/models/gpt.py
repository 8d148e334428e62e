"""A GPT built on qkv: decoder-only, pre-LayerNorm, every attention a
:class:`qkv.MultiHeadAttention` with ``causal=True``.

The model is GPT-2's: token embedding (+ learned positions, or rotary ones inside each
attention), ``n_layer`` blocks of ``x + attn(ln_1(x))`` and ``x + mlp(ln_2(x))``, a final
LayerNorm, and an LM head tied to the token embedding. :meth:`GPT.generate` prefills the
prompt into one :class:`qkv.KVCache` per layer and decodes one token at a time;
:meth:`GPT.from_huggingface` converts a ``transformers`` ``GPT2LMHeadModel``.

Legend: B batch · T sequence length · V vocabulary · E model width (n_embd) · H heads ·
H_kv key/value heads · d_head = E / H.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any, cast, overload

import torch
import torch.distributed as dist
from torch import nn

from ..distributed import Layout
from ..nn.cache import Cache, KVCache, LatentCache
from ..nn.mha import MultiHeadAttention
from ..nn.mla import MultiHeadLatentAttention
from ..nn.rope import RoPE
from ..nn.streaming import StreamingCache
from ..serving import Batcher, PackedBatch, PagedBatch, PagedCaches, PagedKVCache
from ..serving.sampling import sample
from .config import GPTConfig
from .gpt2 import config_from_gpt2, copy_gpt2_weights


class UniformAttention(MultiHeadAttention):
    """Causal attention whose queries are zero: every score is equal, so each position
    averages the values of its past uniformly (seed 001's ``xbow``) — attention with
    nothing learned about *where* to look."""

    def project(
        self,
        x: torch.Tensor,
        context: torch.Tensor | None = None,
        positions: torch.Tensor | int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super().project(x, context, positions)
        return torch.zeros_like(q), k, v


def _output_projection(attn: nn.Module) -> nn.Linear:
    """The projection an attention layer writes into the residual stream with."""
    proj = attn.o_proj if isinstance(attn, MultiHeadLatentAttention) else attn.out_proj
    assert isinstance(proj, nn.Linear)
    return proj


def _norm(config: GPTConfig) -> nn.Module:
    E = config.n_embd
    return nn.LayerNorm(E, eps=config.layer_norm_eps) if config.layer_norm else nn.Identity()


class MLP(nn.Module):
    """E -> mlp_width -> GELU -> E."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        width = config.mlp_width or 4 * config.n_embd
        self.fc = nn.Linear(config.n_embd, width)
        self.act = nn.GELU(approximate="tanh" if config.gelu == "tanh" else "none")
        self.proj = nn.Linear(width, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))


class Block(nn.Module):
    """One pre-LayerNorm transformer block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    def __init__(self, config: GPTConfig, rope: RoPE | None) -> None:
        super().__init__()
        E = config.n_embd
        self.ln_1 = _norm(config)
        self.attn: MultiHeadAttention | MultiHeadLatentAttention
        if config.attention == "mla":
            head = E // config.n_head
            self.attn = MultiHeadLatentAttention(
                E,
                config.n_head,
                kv_lora_rank=config.kv_lora_rank or 4 * head,
                qk_nope_head_dim=head,
                qk_rope_head_dim=head // 2,
                v_head_dim=head,
                causal=True,
                rope=RoPE(head // 2, base=config.rope_base),
                dropout=config.dropout,
            )
        else:
            attention = UniformAttention if config.attention == "uniform" else MultiHeadAttention
            self.attn = attention(
                E,
                E,
                config.n_head,
                num_kv_heads=config.n_kv_head,
                causal=True,
                dropout=config.dropout,
                qkv_bias=True,
                rope=rope,
                sinks=config.attention_sinks,
            )
        self.drop = nn.Dropout(config.dropout)
        self.ln_2: nn.Module | None = None
        self.mlp: MLP | None = None
        if not config.attention_only:
            self.ln_2, self.mlp = _norm(config), MLP(config)

    def forward(
        self,
        x: torch.Tensor,
        cache: Cache | None = None,
        layout: Layout | None = None,
        schedule: str = "allgather",
        group: Any = None,
    ) -> torch.Tensor:
        if isinstance(self.attn, MultiHeadLatentAttention):
            if layout is not None or not isinstance(cache, (LatentCache, type(None))):
                raise ValueError(
                    "a latent-attention GPT (attention='mla') runs without layout= and with "
                    "its own caches (new_caches), not paged or packed ones"
                )
            out = self.attn(self.ln_1(x), cache=cache)
        else:
            out = self.attn(
                self.ln_1(x), cache=cache, layout=layout, schedule=schedule, group=group
            )
        x = x + self.drop(out)
        if self.mlp is not None and self.ln_2 is not None:
            x = x + self.drop(self.mlp(self.ln_2(x)))
        return x


class GPT(nn.Module):
    """A decoder-only language model whose attention is qkv's.

    Example:
        >>> import torch
        >>> from qkv.models import GPT, GPTConfig
        >>> model = GPT(GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=32))
        >>> idx = torch.randint(0, 256, (3, 10))            # (B, T) token ids
        >>> model(idx).shape                                # (B, T, V) logits
        torch.Size([3, 10, 256])
        >>> model.generate(idx, 5, temperature=0.0).shape   # greedy, with the KV cache
        torch.Size([3, 15])
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        E = config.n_embd
        self.wte = nn.Embedding(config.vocab_size, E)
        self.wpe = nn.Embedding(config.block_size, E) if config.positions == "learned" else None
        # One RoPE module shared by every layer: it holds no weights, only frequencies.
        rope = (
            RoPE(E // config.n_head, base=config.rope_base) if config.positions == "rope" else None
        )
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, rope) for _ in range(config.n_layer))
        self.ln_f = _norm(config)
        self.lm_head = nn.Linear(E, config.vocab_size, bias=False)
        if config.tie_embeddings:  # one (V, E) table reads and writes tokens
            self.lm_head.weight = self.wte.weight
        self._init_weights()

    def _init_weights(self) -> None:
        """GPT-2's initialisation: N(0, 0.02) weights, zero biases, and the projections
        that write into the residual stream scaled by 1/sqrt(their number), or "fan_in"
        (:class:`GPTConfig`)."""
        fan_in = self.config.init == "fan_in"
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                std = 0.02
                if fan_in:
                    std = 1.0 if isinstance(module, nn.Embedding) else module.in_features**-0.5
                nn.init.normal_(module.weight, mean=0.0, std=std)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        if fan_in:
            return
        residual = [_output_projection(b.attn) for b in self.layers]
        residual += [b.mlp.proj for b in self.layers if b.mlp is not None]
        for proj in residual:
            nn.init.normal_(proj.weight, mean=0.0, std=0.02 / math.sqrt(len(residual)))

    def num_params(self) -> int:
        """Number of parameters (the tied embedding counted once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(
        self,
        idx: torch.Tensor,
        *,
        caches: Sequence[Cache] | None = None,
        layout: Layout | None = None,
        schedule: str = "allgather",
        group: Any = None,
    ) -> torch.Tensor:
        """idx: (B, T) token ids -> (B, T, V) logits.

        Args:
            caches: one :class:`qkv.KVCache` per layer (:meth:`new_caches`), or one batch of
                a :class:`qkv.PagedKVCache` per layer (:meth:`new_paged_caches`); idx then holds
                only the tokens after the cached ones, at positions ``cache.length`` on.
            layout: context parallelism: idx holds this rank's positions of a sequence split
                by a :class:`qkv.distributed.Layout`, and the logits are those positions';
                ``schedule`` and ``group`` as in :func:`qkv.distributed.attention`.
        """
        if not isinstance(idx, torch.Tensor) or idx.ndim != 2 or idx.dtype.is_floating_point:
            raise ValueError(
                f"idx must be a (B, T) integer tensor of token ids; got "
                f"{getattr(idx, 'dtype', type(idx).__name__)} of shape "
                f"{tuple(getattr(idx, 'shape', ()))}"
            )
        V = self.config.vocab_size
        if idx.numel() and not torch.compiler.is_compiling():  # (a graph reads no values)
            low, high = int(idx.min()), int(idx.max())
            if low < 0 or high >= V:
                bad = high if high >= V else low
                raise ValueError(
                    f"token ids must be 0 .. vocab_size - 1 = {V - 1}; got {bad} (a tokenizer "
                    "other than the model's, or a model with a smaller vocabulary)"
                )
        if caches is not None and len(caches) != len(self.blocks):
            raise ValueError(
                f"caches must hold one KVCache per layer ({len(self.blocks)}); got {len(caches)}"
            )
        B, T = idx.shape
        first = None if caches is None else caches[0]
        ragged = isinstance(first, (PagedBatch, PackedBatch))
        if isinstance(first, PagedBatch):  # each sequence at its own positions
            rows = first.positions(T).to(idx.device)  # (B, T)
            start = int(first.row_lengths.max())
        elif isinstance(first, PackedBatch):  # prompts one after another: (1, total)
            if B != 1:
                raise ValueError(f"a packed prefill takes idx (1, total); got {tuple(idx.shape)}")
            rows = first.positions(T).to(idx.device)  # (1, total)
            start, T = 0, first.longest
        else:  # where the cache puts the new tokens (a streaming cache: their slots)
            start = 0 if first is None else int(first.positions(T))
        end = start + T if layout is None else layout.T
        if end > self.config.block_size:
            raise ValueError(
                f"the context window holds block_size={self.config.block_size} "
                f"tokens; got {start} cached + {end - start} new"
            )
        if ragged:
            positions = rows
        elif layout is None:
            positions = torch.arange(start, start + T, device=idx.device)
        else:
            positions = layout.positions(dist.get_rank(group)).to(idx.device)
        x = self.wte(idx)  # (B, T, E)
        if self.wpe is not None:
            x = x + self.wpe(positions)  # (T, E) broadcast over B, or (B, T, E)
        x = self.drop(x)
        for i, block in enumerate(self.blocks):
            x = block(x, None if caches is None else caches[i], layout, schedule, group)
        return self.lm_head(self.ln_f(x))  # (B, T, V)

    def new_caches(
        self, batch: int, kv_dtype: torch.dtype | None = None
    ) -> list[KVCache] | list[LatentCache]:
        """One empty cache per layer, each of block_size tokens: a :class:`qkv.KVCache`, or
        for latent attention a :class:`qkv.nn.LatentCache`; ``kv_dtype`` ``torch.int8`` or
        ``torch.float8_e4m3fn`` quantizes them (None: the model's dtype)."""
        size = self.config.block_size
        return [b.attn.new_cache(batch, size, kv_dtype) for b in self.layers]  # type: ignore[return-value]

    def new_streaming_caches(self, batch: int, window: int, sinks: int = 4) -> list[StreamingCache]:
        """One :class:`qkv.nn.StreamingCache` per layer — the first ``sinks`` tokens and the
        last ``window`` — to read a stream longer than the context token by token, at the
        positions the attention-sink paper assigns (slots in the cache; docs/streaming.md)."""
        if sinks + window > self.config.block_size:
            raise ValueError(
                f"sinks + window must fit the context window block_size="
                f"{self.config.block_size}; got {sinks} + {window}"
            )
        w = self.lm_head.weight
        caches = []
        for block in self.layers:
            attn = block.attn
            if not isinstance(attn, MultiHeadAttention):
                raise ValueError("streaming caches hold multi-head attention's keys and values")
            caches.append(
                StreamingCache(
                    batch,
                    attn.num_kv_heads,
                    attn.head_dim,
                    window=window,
                    sinks=sinks,
                    rope=attn.rope,
                    dtype=w.dtype,
                    device=w.device,
                )
            )
        return caches

    def new_paged_caches(
        self, num_pages: int, page_size: int = 16, kv_dtype: torch.dtype | None = None
    ) -> PagedCaches:
        """One empty :class:`qkv.PagedKVCache` per layer (pools of ``num_pages`` pages of
        ``page_size`` tokens), on the model's device and dtype, or quantized to
        ``kv_dtype``; ``caches.batch(seqs)`` is what the model takes as ``caches``."""
        w = self.lm_head.weight
        attn = self.layers[0].attn
        if isinstance(attn, MultiHeadLatentAttention):
            raise ValueError(
                "a latent-attention GPT (attention='mla') has no paged caches yet: decode "
                "through new_caches (generate with a (B, T) tensor)"
            )
        return PagedCaches(
            [
                PagedKVCache(
                    num_pages,
                    page_size,
                    attn.num_kv_heads,
                    attn.head_dim,
                    dtype=w.dtype if kv_dtype is None else kv_dtype,
                    device=w.device,
                    compute_dtype=w.dtype,
                )
                for _ in self.layers
            ]
        )

    def _generate_ragged(
        self,
        prompts: Sequence[torch.Tensor],
        max_new_tokens: int,
        temperature: float,
        top_k: int | None,
        top_p: float | None,
        generator: torch.Generator | None,
        stop_token: int | None,
        kv_dtype: torch.dtype | None,
    ) -> list[torch.Tensor]:
        was_training = self.training
        self.eval()
        try:
            batcher = Batcher(
                self,
                kv_dtype=kv_dtype,
                num_pages=len(prompts) * -(-self.config.block_size // 16),
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                generator=generator,
                stop_token=stop_token,
            )
            ids = batcher.extend(prompts, max_new_tokens)
            batcher.run()
            return [batcher.result(i) for i in ids]
        finally:
            self.train(was_training)

    @property
    def layers(self) -> list[Block]:
        """The blocks, typed (``self.blocks`` is the ``nn.ModuleList`` holding them)."""
        return [cast(Block, b) for b in self.blocks]

    @overload
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        generator: torch.Generator | None = None,
        use_cache: bool = True,
        stop_token: int | None = None,
        kv_dtype: torch.dtype | None = None,
    ) -> torch.Tensor: ...

    @overload
    def generate(
        self,
        idx: Sequence[torch.Tensor],
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        generator: torch.Generator | None = None,
        use_cache: bool = True,
        stop_token: int | None = None,
        kv_dtype: torch.dtype | None = None,
    ) -> list[torch.Tensor]: ...

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor | Sequence[torch.Tensor],
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        generator: torch.Generator | None = None,
        use_cache: bool = True,
        stop_token: int | None = None,
        kv_dtype: torch.dtype | None = None,
    ) -> torch.Tensor | list[torch.Tensor]:
        """Continue each sequence of idx (B, T) by max_new_tokens tokens: (B, T + new).

        Given a list of prompts ((T_i,) tensors of different lengths), they are prefilled
        together, packed (varlen), and decoded together on a paged KV cache
        (:class:`qkv.serving.Batcher`), each at its own positions, each stopping at its own
        ``stop_token`` or after max_new_tokens. The result is a list of (T_i + new_i,)
        tensors, the same greedy tokens as generating each alone. The prompt and its new
        tokens must fit the context window there.

        With ``use_cache`` the prompt is prefilled into one KV cache per layer and every
        later step feeds one token. Without, every step recomputes the whole context (the
        nanoGPT way). Both give the same tokens.

        The context window: each prediction sees the last ``block_size`` tokens at most.
        Once the sequence outgrows the window, every step re-encodes the last block_size
        tokens from position 0, with or without the cache (a cache cannot be reused there:
        each kept token moves to a new position, and every later layer's keys depend on
        the tokens that fell out).

        Args:
            temperature: divides the logits; 0 means greedy (argmax).
            top_k: sample among the k most likely tokens only.
            top_p: sample among the smallest set of tokens whose probability reaches p.
            generator: the source of randomness: the same seed gives the same tokens.
            use_cache: decode with KV caches (default) or recompute every step.
            stop_token: for a list of prompts, a prompt ends after producing it.
            kv_dtype: the caches' storage: None (the model's dtype), or ``torch.int8`` or
                ``torch.float8_e4m3fn`` (quantized: a quarter of float32's bytes, the
                logits within the rounding docs/head-shapes.md measures).
        """
        if isinstance(idx, (list, tuple)):
            return self._generate_ragged(
                idx, max_new_tokens, temperature, top_k, top_p, generator, stop_token, kv_dtype
            )
        if stop_token is not None:
            raise ValueError("stop_token applies to a list of prompts (each stops on its own)")
        if not isinstance(idx, torch.Tensor) or idx.ndim != 2 or idx.shape[1] < 1:
            raise ValueError(
                f"idx must be a (B, T) tensor of token ids with T >= 1; got "
                f"shape {tuple(getattr(idx, 'shape', ()))}"
            )
        if (
            isinstance(max_new_tokens, bool)
            or not isinstance(max_new_tokens, int)
            or max_new_tokens < 0
        ):
            raise ValueError(f"max_new_tokens must be an int >= 0; got {max_new_tokens!r}")
        if not temperature >= 0:
            raise ValueError(f"temperature must be >= 0; got {temperature}")
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k must be >= 1 or None; got {top_k}")
        if top_p is not None and not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] or None; got {top_p}")
        was_training = self.training
        self.eval()
        window, caches = self.config.block_size, None
        try:
            for _ in range(max_new_tokens):
                context = idx[:, -window:]  # (B, ≤ block_size)
                if not use_cache:
                    logits = self(context)
                elif caches is not None and caches[0].length < window:
                    logits = self(idx[:, -1:], caches=caches)  # one new token
                else:  # first step, or the window slid: prefill from position 0
                    caches = self.new_caches(idx.shape[0], kv_dtype)
                    logits = self(context, caches=caches)
                nxt = sample(logits[:, -1], temperature, top_k, top_p, generator)  # (B, 1)
                idx = torch.cat([idx, nxt], dim=1)
        finally:
            self.train(was_training)
        return idx

    @classmethod
    def from_huggingface(cls, model_or_path: Any) -> GPT:
        """A qkv GPT with the weights of a ``transformers`` ``GPT2LMHeadModel``: the model
        object, or a local directory written by its ``save_pretrained``. Configurations qkv
        cannot reproduce exactly (other activations, scaled-by-layer attention, unequal
        dropouts, an untied head) are refused, not approximated."""
        try:
            from transformers import GPT2LMHeadModel
        except ImportError as err:  # pragma: no cover - transformers is a dev dependency
            raise ImportError(
                "GPT.from_huggingface needs transformers: pip install 'qkv[huggingface]'"
            ) from err
        hf = model_or_path
        if isinstance(model_or_path, (str, os.PathLike)):
            if not os.path.isdir(model_or_path):
                raise FileNotFoundError(
                    f"model_or_path: no directory {str(model_or_path)!r} "
                    "(nothing is downloaded: give a save_pretrained folder)"
                )
            hf = GPT2LMHeadModel.from_pretrained(model_or_path, local_files_only=True)
        if not isinstance(hf, GPT2LMHeadModel):
            raise TypeError(
                f"model_or_path must be a GPT2LMHeadModel or a directory; got {type(hf).__name__}"
            )
        config = config_from_gpt2(hf.config)
        model = cls(config).to(hf.lm_head.weight.dtype)
        copy_gpt2_weights(hf, model)
        return model.train(hf.training)
