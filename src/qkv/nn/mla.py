"""Multi-head latent attention (MLA, DeepSeek-V2 and V3): keys and values rebuilt from one
small latent vector per token, which is all a cache has to hold.

Each token's keys and values come from a latent c of ``kv_lora_rank`` values (RMS-normed)
and one rotary key of ``qk_rope_head_dim`` values shared by every head: head h's key is
[W_UK[h] c, k_rope] and its value W_UV[h] c. A query is [q_nope, q_rope] per head. Two
forms compute the same attention:

- **expanded** (training, prefill): keys (B, H, T, nope + rope) and values (B, H, T, v) are
  built from the latents and attended as usual (D = 192, D_v = 128 in DeepSeek V3);
- **absorbed** (decode): W_UK is folded into the query (q_nope W_UK[h] is a vector in the
  latent space), so every head attends over the cached rows [c, k_rope] themselves — one
  key/value head (MQA) with D = kv_lora_rank + rope = 576 and D_v = kv_lora_rank = 512, the
  values being the first 512 columns of the keys — and W_UV is applied to the result.

Per token and layer the cache holds kv_lora_rank + qk_rope_head_dim values (576), against
2 · H · head_dim for multi-head attention (32,768 for DeepSeek V3's 128 heads of 128): a
:class:`qkv.nn.LatentCache` (:mod:`qkv.nn.cache`).

Legend: B batch · H heads · T_q/T_k query/key length · E model width · r = kv_lora_rank ·
nope, rope = the query/key head dim without and with rotary position · v = value head dim.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, ClassVar

import torch
from torch import nn

from .._checks import check_sizes
from ..core.call import Dispatch
from ..functional import MaskLike, attention, dispatch
from ..masks.library import with_causal
from ..serving.latent import PagedLatentBatch
from .cache import LatentCache
from .modules import check_input
from .rope import RoPE

FORMS = ("expanded", "absorbed")


class RMSNorm(nn.RMSNorm):
    """RMS norm computed in float32 at least and returned in the input's dtype, as
    DeepSeek's is (and without torch's warning when autocast hands it bfloat16 beside
    float32 weights)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype in (torch.float16, torch.bfloat16):
            return super().forward(x.float()).to(x.dtype)
        return super().forward(x)


class MultiHeadLatentAttention(nn.Module):
    """Multi-head latent attention in DeepSeek's form (V2, V3, Kimi K2).

    Args:
        d_model: width E of the input and the output.
        num_heads: H.
        kv_lora_rank: r, the width of each token's latent (what the cache holds, with the
            rotary key).
        qk_nope_head_dim, qk_rope_head_dim: a query's and a key's width per head without
            and with rotary position; the rotary key is one per token, shared by the heads.
        v_head_dim: a value's width per head.
        q_lora_rank: queries through a low-rank bottleneck of this width (RMS-normed), as
            DeepSeek V3; None: one projection.
        causal: each token attends to itself and the past (bottom-right aligned, so it stays
            right with a cache), as the decoder runs it.
        rope: the rotary embedding of the rope part (``qk_rope_head_dim`` wide); None: a
            plain :class:`qkv.RoPE` with base 10000.
        scale: the softmax scale; None: 1 / sqrt(nope + rope).
        bias: biases on the latent projections and the output, as ``attention_bias``.
        norm_eps: the RMS norms' epsilon.
        dropout: on the attention weights, in training mode only.

    Example:
        >>> import torch, qkv
        >>> mla = qkv.nn.MultiHeadLatentAttention(
        ...     64, 4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
        >>> x = torch.randn(2, 5, 64)
        >>> torch.allclose(mla(x, form="expanded"), mla(x, form="absorbed"), atol=1e-5)
        True
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        q_lora_rank: int | None = None,
        causal: bool = True,
        rope: RoPE | None = None,
        scale: float | None = None,
        bias: bool = False,
        norm_eps: float = 1e-6,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        check_sizes(
            d_model=d_model,
            num_heads=num_heads,
            kv_lora_rank=kv_lora_rank,
            qk_nope_head_dim=qk_nope_head_dim,
            qk_rope_head_dim=qk_rope_head_dim,
            v_head_dim=v_head_dim,
        )
        if q_lora_rank is not None:
            check_sizes(q_lora_rank=q_lora_rank)
        rope = RoPE(qk_rope_head_dim) if rope is None else rope
        if rope.head_dim != qk_rope_head_dim:
            raise ValueError(
                f"rope must have head_dim = qk_rope_head_dim = {qk_rope_head_dim}; "
                f"got {rope.head_dim}"
            )
        H, qk = num_heads, qk_nope_head_dim + qk_rope_head_dim
        self.d_model, self.num_heads, self.causal, self.dropout = d_model, H, causal, dropout
        self.kv_lora_rank, self.q_lora_rank = kv_lora_rank, q_lora_rank
        self.nope, self.rope_dim, self.v_head_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.scale = qk**-0.5 if scale is None else float(scale)
        if q_lora_rank is None:
            self.q_proj: nn.Module = nn.Linear(d_model, H * qk, bias=False)
        else:
            self.q_proj = nn.Sequential(
                nn.Linear(d_model, q_lora_rank, bias=bias),
                RMSNorm(q_lora_rank, eps=norm_eps),
                nn.Linear(q_lora_rank, H * qk, bias=False),
            )
        self.kv_a_proj = nn.Linear(d_model, kv_lora_rank + qk_rope_head_dim, bias=bias)
        self.kv_a_norm = RMSNorm(kv_lora_rank, eps=norm_eps)
        self.kv_b_proj = nn.Linear(kv_lora_rank, H * (qk_nope_head_dim + v_head_dim), bias=False)
        self.o_proj = nn.Linear(H * v_head_dim, d_model, bias=bias)
        self.rope = rope

    def choose(self, T_q: int, cache: LatentCache | PagedLatentBatch | None) -> tuple[str, str]:
        """The form that computes T_q new tokens with fewer multiplications, and why.
        Without a cache (training, a whole sequence) the form is expanded. With one,
        expanding costs r · H · (nope + v) per cached token whatever T_q is, and absorbing
        costs H · T_q · (2r + rope − nope − rope − v) more per cached token in the
        attention. So the form is absorbed while T_q · (2r − nope − v) < r · (nope + v)
        (DeepSeek V3: T_q < 171)."""
        if cache is None:
            return "expanded", "no cache: keys and values expanded from the latents"
        r, H, nope, v = self.kv_lora_rank, self.num_heads, self.nope, self.v_head_dim
        extra, saved = H * T_q * (2 * r - nope - v), r * H * (nope + v)
        if extra < saved:
            return "absorbed", (
                f"{T_q} new token(s) over a latent cache: attending the cached rows directly "
                f"(MQA, D = {r + self.rope_dim}, D_v = {r}) saves expanding them"
            )
        return "expanded", (
            f"{T_q} new tokens: expanding the cached latents costs less than attending "
            "them absorbed"
        )

    def _project(
        self, x: torch.Tensor, positions: int | torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, T, E) -> q_nope (B, H, T, nope) and q_rope (B, H, T, rope), rotated at
        ``positions`` (the first token's, or (B, T): a ragged paged batch), and the new rows
        (B, 1, T, r + rope): the normed latent, then the rotated shared key."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, -1).transpose(1, 2)
        q_nope, q_rope = q.split([self.nope, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_a_proj(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        rows = torch.cat(
            [self.kv_a_norm(latent)[:, None], self.rope(k_rope[:, None], positions)], dim=-1
        )
        return q_nope, self.rope(q_rope, positions), rows

    #: What each step of :func:`qkv.explain` holds for this module (its absorbed form).
    trace_notes: ClassVar[dict[str, str]] = {
        "queries": "q_nope · W_UK[h] beside the rotated q_rope: each head's query in the "
        "latent space",
        "keys": "each token's row: its latent c (normed), then its rotary key — one row "
        "for every head",
        "values": "the latent c itself (the rows' first kv_lora_rank columns): W_UV comes after",
        "output": "each head's context · W_UV[h]ᵀ, heads concatenated, then o_proj",
    }

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The absorbed form's attention inputs for x (B, T, E) or (T, E), positions from 0:
        queries (B, H, T, r + rope), keys (B, 1, T, r + rope), which are the rows, and
        values (B, 1, T, r), a view of the keys (:func:`qkv.explain` traces them)."""
        x3 = x if x.ndim == 3 else x[None]
        q_nope, q_rope, rows = self._project(x3, 0)
        return self._absorbed_query(q_nope, q_rope), rows, rows[..., : self.kv_lora_rank]

    def merge(self, context: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """The absorbed form's context (B, H, T, r) as the module's output (B, T, E): W_UV per
        head, then o_proj; (T, E) for a (T, E) ``like``."""
        out = torch.einsum("bhtr,hvr->bhtv", context, self._up()[1])
        B, H, T, v = out.shape
        out = self.o_proj(out.transpose(1, 2).reshape(B, T, H * v))
        return out if like.ndim == 3 else out[0]

    def attention_mask(self, mask: MaskLike = None) -> MaskLike:
        """The mask this module attends with: the caller's, and-ed with causal() if causal."""
        return with_causal(mask, self.causal)

    def _up(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK (H, nope, r) and W_UV (H, v, r): kv_b_proj's weight per head."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_head_dim, -1)
        return w[:, : self.nope], w[:, self.nope :]

    def _expanded(
        self, q_nope: torch.Tensor, q_rope: torch.Tensor, rows: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries (B, H, T_q, nope + rope), keys (B, H, T_k, nope + rope) and values
        (B, H, T_k, v) rebuilt from the rows."""
        B, _, T_k, _ = rows.shape
        kv = self.kv_b_proj(rows[:, 0, :, : self.kv_lora_rank])  # (B, T_k, H · (nope + v))
        kv = kv.view(B, T_k, self.num_heads, -1).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_head_dim], dim=-1)
        k_rope = rows[..., self.kv_lora_rank :].expand(B, self.num_heads, T_k, self.rope_dim)
        return torch.cat([q_nope, q_rope], -1), torch.cat([k_nope, k_rope], -1), v

    def _absorbed_query(self, q_nope: torch.Tensor, q_rope: torch.Tensor) -> torch.Tensor:
        """[q_nope W_UK[h], q_rope] per head: (B, H, T_q, r + rope)."""
        w_uk, _ = self._up()
        return torch.cat([torch.einsum("bhtn,hnr->bhtr", q_nope, w_uk), q_rope], dim=-1)

    def forward(
        self,
        x: torch.Tensor,
        *,
        mask: MaskLike = None,
        cache: LatentCache | PagedLatentBatch | None = None,
        form: str | None = None,
    ) -> torch.Tensor:
        """x (B, T_q, E) -> (B, T_q, E).

        Args:
            mask: a qkv mask or a bool (T_q, T_k) / (B, T_q, T_k) / (B, H, T_q, T_k)
                tensor, True = may attend; and-ed with causal() for a causal module.
            cache: a :class:`LatentCache` (:meth:`new_cache`), or a batch of a
                :class:`qkv.serving.PagedLatentCache` (sequences at their own positions): x
                holds the new tokens only.
            form: "expanded" or "absorbed"; None: :meth:`choose` picks.
        """
        check_input("x", x, self.d_model, self.kv_a_proj.weight)
        if x.ndim != 3:
            raise ValueError(f"x must have shape (B, T, E); got {tuple(x.shape)}")
        T_q = x.shape[1]
        form = self.choose(T_q, cache)[0] if form is None else form
        if form not in FORMS:
            raise ValueError(f"form must be one of {FORMS} or None; got {form!r}")
        dropout_p = self.dropout if self.training else 0.0
        q_nope, q_rope, rows = self._project(x, 0 if cache is None else cache.positions(T_q))
        if form == "absorbed":
            query = self._absorbed_query(q_nope, q_rope)
            values = rows[..., : self.kv_lora_rank]
            if cache is None:
                latent = attention(
                    query,
                    rows,
                    values,
                    mask=with_causal(mask, self.causal),
                    dropout_p=dropout_p,
                    scale=self.scale,
                )
            else:
                latent = cache.attend(
                    query,
                    rows,
                    values,
                    mask=mask,
                    causal=self.causal,
                    dropout_p=dropout_p,
                    sinks=None,
                    scale=self.scale,
                )
            out = torch.einsum("bhtr,hvr->bhtv", latent, self._up()[1])
        else:
            every = rows if cache is None else cache.append(rows)
            q, k, v = self._expanded(q_nope, q_rope, every)
            mask = with_causal(mask, self.causal)
            out = attention(q, k, v, mask=mask, dropout_p=dropout_p, scale=self.scale)
        B, H, _, v_dim = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(B, T_q, H * v_dim))

    def dispatch(
        self,
        x: torch.Tensor,
        *,
        mask: MaskLike = None,
        cache: LatentCache | PagedLatentBatch | None = None,
        form: str | None = None,
    ) -> Dispatch:
        """What a call of :meth:`forward` would run, without running it (nor touching the
        cache): :func:`qkv.dispatch` of its attention, the form and why first in the
        reason."""
        T_q = x.shape[1]
        chosen, why = self.choose(T_q, cache) if form is None else (form, "asked for")
        if chosen == "absorbed" and cache is not None and cache.reads_in_place(T_q, mask, 0.0):
            return Dispatch(
                "paged",
                f"absorbed form ({why}); the cache's rows read where they lie by the native "
                "paged decode kernel (qkv.paged_attention), one key/value head",
                path="paged",
            )
        with torch.no_grad():
            start = 0 if cache is None else cache.positions(T_q)
            q_nope, q_rope, rows = self._project(x, start)
            if cache is not None:  # the keys it would attend: the cached rows, then these
                rows = torch.cat([cache.held(), rows], dim=2)
            if chosen == "absorbed":
                q, k, v = self._absorbed_query(q_nope, q_rope), rows, rows[..., : self.kv_lora_rank]
            else:
                q, k, v = self._expanded(q_nope, q_rope, rows)
            found = dispatch(q, k, v, mask=with_causal(mask, self.causal), scale=self.scale)
        return dataclasses.replace(found, reason=f"{chosen} form ({why}); {found.reason}")

    def new_cache(self, batch: int, max_len: int, dtype: torch.dtype | None = None) -> LatentCache:
        """An empty :class:`LatentCache` for this layer, on its device, in its dtype or
        ``dtype`` (``torch.int8``, ``torch.float8_e4m3fn``: quantized)."""
        w = self.kv_a_proj.weight
        return LatentCache(
            batch,
            max_len,
            self.kv_lora_rank,
            self.rope_dim,
            dtype=w.dtype if dtype is None else dtype,
            device=w.device,
            compute_dtype=w.dtype,
        )

    @classmethod
    def from_huggingface(cls, module: Any) -> MultiHeadLatentAttention:
        """This layer from transformers' ``DeepseekV3Attention`` (``module``), with its
        weights, scale (YaRN's mscale included) and rotary embedding (its config's
        ``rope_parameters``, interleaved or not), causal as the decoder runs it. The
        result equals the module's eager output under a causal mask. The rotary frequencies
        and YaRN's attention factor are read from the model's own rotary embedding class
        (its ``…RotaryEmbedding``, built from the config), so no RoPE scaling rule of
        transformers is written twice."""
        namespace = vars(sys.modules[type(module).__module__])
        found = [c for n, c in namespace.items() if n.endswith("RotaryEmbedding")]
        if len(found) != 1:
            raise TypeError(
                f"from_huggingface: no single rotary embedding class beside "
                f"{type(module).__name__} in {type(module).__module__}"
            )
        config = module.config
        rotary = found[0](config)
        rope = RoPE(
            module.qk_rope_head_dim,
            interleaved=bool(getattr(config, "rope_interleave", False)),
            inv_freq=rotary.inv_freq.detach().cpu(),
            scaling=float(rotary.attention_scaling),
        )
        q_lora = getattr(module, "q_lora_rank", None)
        mla = cls(
            config.hidden_size,
            module.num_heads,
            kv_lora_rank=module.kv_lora_rank,
            qk_nope_head_dim=module.qk_nope_head_dim,
            qk_rope_head_dim=module.qk_rope_head_dim,
            v_head_dim=module.v_head_dim,
            q_lora_rank=q_lora,
            rope=rope,
            scale=module.scaling,
            bias=module.kv_a_proj_with_mqa.bias is not None,
            norm_eps=module.kv_a_layernorm.variance_epsilon,
        )
        pairs = [
            (mla.kv_a_proj, module.kv_a_proj_with_mqa),
            (mla.kv_a_norm, module.kv_a_layernorm),
            (mla.kv_b_proj, module.kv_b_proj),
            (mla.o_proj, module.o_proj),
        ]
        if q_lora is None:
            pairs.append((mla.q_proj, module.q_proj))
        else:
            assert isinstance(mla.q_proj, nn.Sequential)
            pairs += zip(mla.q_proj, (module.q_a_proj, module.q_a_layernorm, module.q_b_proj))
        for mine, theirs in pairs:
            mine.load_state_dict(theirs.state_dict())
        w = module.kv_a_proj_with_mqa.weight
        return mla.to(dtype=w.dtype, device=w.device)

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, num_heads={self.num_heads}, "
            f"kv_lora_rank={self.kv_lora_rank}, q_lora_rank={self.q_lora_rank}, "
            f"qk_nope_head_dim={self.nope}, qk_rope_head_dim={self.rope_dim}, "
            f"v_head_dim={self.v_head_dim}, causal={self.causal}"
        )
