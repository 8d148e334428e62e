"""Multi-head attention for real models: GQA/MQA, rotary embeddings, a KV cache,
cross-attention, and conversion to and from ``torch.nn.MultiheadAttention``.

Legend: B batch · H query heads · H_kv key/value heads · T_q/T_k query/key length ·
E = d_in model width · d_head = d_out / H.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..distributed import Layout
from ..distributed import attention as distributed_attention
from ..functional import MaskLike, attention
from .cache import Cache, KVCache
from .modules import AttentionModule, check_input, split_heads
from .rope import RoPE


class MultiHeadAttention(AttentionModule):
    """Multi-head attention: queries split into ``num_heads`` heads of width
    ``d_out // num_heads``, keys and values into ``num_kv_heads`` (GQA; 1 = MQA), attended
    in parallel, concatenated, then mixed by ``out_proj`` (the W^O that seed 002 names but
    never applies; with a bias, as in ``nn.MultiheadAttention``).

    Weights are created in the seeds' order: ``W_query``, ``W_key``, ``W_value``, ``out_proj``.

    Args:
        d_in: width E of the input x.
        d_out: total width of the query heads and of the output; a multiple of num_heads.
        num_heads: H.
        num_kv_heads: H_kv, dividing H; None means H (plain multi-head attention).
        causal: each position attends only to itself and the past (bottom-right aligned,
            so it stays right with a cache).
        dropout: dropout on the attention weights, in training mode only.
        qkv_bias: give the query, key and value projections a bias.
        rope: a :class:`qkv.RoPE` of width d_head applied to queries and keys at their
            absolute positions (self-attention only); None for no rotary embedding.
        d_kv: width of the ``context`` for cross-attention; None means d_in.
        sinks: learn one attention-sink logit per head (``self.sinks``, (H,), starting at
            0), a key with no value in every row's softmax, as gpt-oss does
            (:func:`qkv.attention`'s ``sinks``).

    Example:
        >>> import torch, qkv
        >>> mha = qkv.MultiHeadAttention(64, 64, num_heads=8, num_kv_heads=2, causal=True,
        ...                              rope=qkv.RoPE(8))
        >>> mha(torch.rand(2, 10, 64)).shape
        torch.Size([2, 10, 64])
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        causal: bool = False,
        dropout: float = 0.0,
        qkv_bias: bool = False,
        rope: RoPE | None = None,
        d_kv: int | None = None,
        sinks: bool = False,
    ) -> None:
        super().__init__()
        if num_heads < 1 or d_out % num_heads != 0:
            raise ValueError(
                f"d_out must be a multiple of num_heads; got d_out={d_out}, num_heads={num_heads}"
            )
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_kv_heads < 1 or num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads must be a multiple of num_kv_heads; got "
                f"num_heads={num_heads}, num_kv_heads={num_kv_heads}"
            )
        head_dim = d_out // num_heads
        if rope is not None and rope.head_dim != head_dim:
            raise ValueError(
                f"rope must have head_dim = d_out / num_heads = {head_dim}; got {rope.head_dim}"
            )
        self.d_in, self.d_out, self.num_heads, self.num_kv_heads = (
            d_in,
            d_out,
            num_heads,
            num_kv_heads,
        )
        self.head_dim, self.d_kv = head_dim, d_in if d_kv is None else d_kv
        self.causal, self.dropout = causal, dropout
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(self.d_kv, num_kv_heads * head_dim, bias=qkv_bias)
        self.W_value = nn.Linear(self.d_kv, num_kv_heads * head_dim, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.rope = rope
        self.sinks = nn.Parameter(torch.zeros(num_heads)) if sinks else None

    def project(
        self,
        x: torch.Tensor,
        context: torch.Tensor | None = None,
        positions: torch.Tensor | int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries (B, H, T_q, d_head) from x. Keys and values (B, H_kv, T_k, d_head) from
        x or context, rotated by RoPE. ``positions`` are the absolute positions of x's tokens
        when they are not 0, 1, …: the first one's (after a cache's tokens), (T_q,) (a shard
        of a context-parallel sequence) or (B, T_q) (each row of a ragged batch its own)."""
        check_input("x", x, self.d_in, self.W_query.weight)
        if context is not None:
            check_input("context", context, self.d_kv, self.W_key.weight)
            if context.ndim != x.ndim or (x.ndim == 3 and context.shape[0] != x.shape[0]):
                raise ValueError(
                    f"context must have the layout and batch of x {tuple(x.shape)}; "
                    f"got {tuple(context.shape)}"
                )
            if self.rope is not None:
                raise ValueError("rope and cache apply to self-attention; pass context=None")
        source = x if context is None else context
        q = split_heads(self.W_query(x), self.num_heads)  # (B, H, T_q, d_head)
        k = split_heads(self.W_key(source), self.num_kv_heads)  # (B, H_kv, T_k, d_head)
        v = split_heads(self.W_value(source), self.num_kv_heads)
        if self.rope is not None:
            at = 0 if positions is None else positions
            q, k = self.rope(q, at), self.rope(k, at)
        return q, k, v

    def merge(self, context: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        B, H, T, d_head = context.shape
        out = self.out_proj(context.transpose(1, 2).reshape(B, T, H * d_head))  # (B, T, d_out)
        return out if like.ndim == 3 else out[0]

    # Cross-attention's context comes second, positionally (as nn.MultiheadAttention's key
    # and value do), so the signature extends AttentionModule.forward's rather than matching.
    def forward(  # type: ignore[override]
        self,
        x: torch.Tensor,
        context: torch.Tensor | None = None,
        *,
        mask: MaskLike = None,
        cache: Cache | None = None,
        layout: Layout | None = None,
        schedule: str = "allgather",
        group: Any = None,
    ) -> torch.Tensor:
        """x: (T_q, E) or (B, T_q, E) -> (…, T_q, d_out).

        Args:
            context: (…, T_k, d_kv) keys/values source for cross-attention; None attends
                over x itself.
            mask: a qkv mask (e.g. ``masks.padding(lengths)``) or a bool (T_q, T_k) /
                (B, T_q, T_k) / (B, H, T_q, T_k) tensor, True = may attend.
            cache: a :class:`qkv.KVCache` (see :meth:`new_cache`), or a batch of a
                :class:`qkv.PagedKVCache`, to decode token by token or in chunks: x holds
                only the new tokens. A :class:`qkv.serving.PackedBatch`: x (1, total, E) holds
                the prompts of new sequences one after another, each attending its own.
            layout: context parallelism: x holds this rank's positions of a sequence split
                by a :class:`qkv.distributed.Layout` (RoPE rotates them at their absolute
                positions); ``schedule`` ("allgather" or "ring") and ``group`` as in
                :func:`qkv.distributed.attention`. Self-attention only.
        """
        dropout_p = self.dropout if self.training else 0.0
        if layout is not None:
            if context is not None or cache is not None:
                raise ValueError(
                    "layout= (context parallelism) applies to self-attention "
                    "without a cache; pass context=None and cache=None"
                )
            positions = layout.positions(dist.get_rank(group)).to(x.device)
            q, k, v = self.project(x, positions=positions)
            out = distributed_attention(
                q,
                k,
                v,
                layout=layout,
                mask=self.attention_mask(mask),
                schedule=schedule,
                dropout_p=dropout_p,
                group=group,
                sinks=self.sinks,
            )
            return self.merge(out, like=x)
        if cache is None:
            q, k, v = self.project(x, context)
            mask = self.attention_mask(mask)
            out = attention(q, k, v, mask=mask, dropout_p=dropout_p, sinks=self.sinks)
            return self.merge(out, like=x)
        if context is not None:
            raise ValueError("rope and cache apply to self-attention; pass context=None")
        at = cache.positions(x.shape[-2])  # the cache says where the new tokens sit
        q, k, v = self.project(x, positions=at.to(x.device) if torch.is_tensor(at) else at)
        out = cache.attend(
            q, k, v, mask=mask, causal=self.causal, dropout_p=dropout_p, sinks=self.sinks
        )
        return self.merge(out, like=x)

    def new_cache(self, batch: int, max_len: int, dtype: torch.dtype | None = None) -> KVCache:
        """An empty :class:`qkv.KVCache` for this module, on its device, in its dtype or
        ``dtype`` (``torch.int8``, ``torch.float8_e4m3fn``: quantized, computing in the
        module's dtype)."""
        w = self.W_key.weight
        return KVCache(
            batch,
            self.num_kv_heads,
            max_len,
            self.head_dim,
            dtype=w.dtype if dtype is None else dtype,
            device=w.device,
            compute_dtype=w.dtype,
        )

    @classmethod
    def from_torch(cls, m: nn.MultiheadAttention) -> MultiHeadAttention:
        """The same attention as ``m``, its weights copied. Translate its masks with
        :func:`qkv.masks.from_torch`. Its inputs are (T, B, E) unless ``batch_first``."""
        if m.bias_k is not None or m.add_zero_attn:
            raise ValueError("add_bias_kv and add_zero_attn have no qkv equivalent")
        if m.kdim != m.vdim:
            raise ValueError(f"kdim and vdim must be equal; got {m.kdim} and {m.vdim}")
        E = m.embed_dim
        ours = cls(
            E,
            E,
            m.num_heads,
            qkv_bias=m.in_proj_bias is not None,
            dropout=m.dropout,
            d_kv=None if m.kdim == E else m.kdim,
        )
        ours.to(device=m.out_proj.weight.device, dtype=m.out_proj.weight.dtype)
        if m._qkv_same_embed_dim:
            weights = m.in_proj_weight.chunk(3)
        else:
            weights = (m.q_proj_weight, m.k_proj_weight, m.v_proj_weight)
        biases = m.in_proj_bias.chunk(3) if m.in_proj_bias is not None else (None,) * 3
        with torch.no_grad():
            for lin, w, b in zip((ours.W_query, ours.W_key, ours.W_value), weights, biases):
                lin.weight.copy_(w)
                if b is not None:
                    lin.bias.copy_(b)
            ours.out_proj.weight.copy_(m.out_proj.weight)
            if m.out_proj.bias is not None:
                ours.out_proj.bias.copy_(m.out_proj.bias)
            else:
                ours.out_proj.bias.zero_()
        return ours

    def to_torch(self, *, batch_first: bool = True) -> nn.MultiheadAttention:
        """An ``nn.MultiheadAttention`` computing the same function (GQA key/value heads
        repeated to H). Refused for what it cannot express: RoPE, d_in != d_out."""
        if self.rope is not None:
            raise ValueError("nn.MultiheadAttention has no rotary embedding")
        if self.d_in != self.d_out:
            raise ValueError(
                f"nn.MultiheadAttention needs d_in == d_out; got {self.d_in} and {self.d_out}"
            )
        w = self.out_proj.weight
        m = nn.MultiheadAttention(
            self.d_out,
            self.num_heads,
            dropout=self.dropout,
            bias=True,
            kdim=self.d_kv,
            vdim=self.d_kv,
            batch_first=batch_first,
            device=w.device,
            dtype=w.dtype,
        )
        groups = self.num_heads // self.num_kv_heads

        def repeat(t: torch.Tensor) -> torch.Tensor:  # kv head rows -> one copy per q head
            return (
                t.view(self.num_kv_heads, self.head_dim, *t.shape[1:])
                .repeat_interleave(groups, dim=0)
                .reshape(self.d_out, *t.shape[1:])
            )

        lins = (self.W_query, self.W_key, self.W_value)
        weights = [self.W_query.weight, repeat(self.W_key.weight), repeat(self.W_value.weight)]
        biases = [
            torch.zeros(self.d_out, dtype=w.dtype, device=w.device)
            if lin.bias is None
            else lin.bias
            if lin is self.W_query
            else repeat(lin.bias)
            for lin in lins
        ]
        with torch.no_grad():
            if m._qkv_same_embed_dim:
                m.in_proj_weight.copy_(torch.cat(weights))
            else:
                for t, src in zip((m.q_proj_weight, m.k_proj_weight, m.v_proj_weight), weights):
                    t.copy_(src)
            m.in_proj_bias.copy_(torch.cat(biases))
            m.out_proj.weight.copy_(self.out_proj.weight)
            m.out_proj.bias.copy_(self.out_proj.bias)
        return m
