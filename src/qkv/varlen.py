"""Variable-length attention over packed sequences, with torch's ``varlen_attn`` signature.

A ragged batch is packed: the tokens of every sequence one after the other, ``(total, H, D)``,
with cumulative offsets ``cu_seq_q``/``cu_seq_k`` (``N + 1`` of them, from 0) saying where
each sequence starts. :func:`varlen_attention` attends each sequence to its own keys only, at
its own positions (query ``i`` of a sequence sits at ``i + len_k − len_q``: bottom-right, as
a KV cache needs), forward and backward, on the CPU.

Legend: N sequences · H query heads · H_kv key/value heads · D head dim · D_v value head dim.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch

from .core import dispatch
from .functional import Backend, attention
from .kernels import paged
from .kernels.quant import dequantize, is_quantized
from .masks import Mask, causal, padding, predicate, sliding_window
from .scores import ScoreMod, as_score_mod

__all__ = ["paged_attention", "pages_needed", "varlen_attention", "window_mask"]


def varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor | None,
    max_q: int,
    max_k: int,
    *,
    return_aux: Any = None,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    enable_gqa: bool = False,
    seqused_k: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    num_splits: int | None = None,
    dropout_p: float = 0.0,
    generator: torch.Generator | None = None,
    mask: Mask | None = None,
    score_mod: ScoreMod | Callable[..., Any] | None = None,
    sinks: torch.Tensor | None = None,
    backend: Backend = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention over packed sequences of different lengths: torch's ``varlen_attn`` (and
    FlashAttention's ``flash_attn_varlen_func``) on a CPU, forward and backward.

    Args:
        query: (total_q, H, D), the queries of every sequence, packed.
        key: (total_k, H_kv, D); value: (total_k, H_kv, D_v).
        cu_seq_q: (N + 1,) integers: sequence ``s`` holds queries
            ``cu_seq_q[s] .. cu_seq_q[s + 1] − 1``; starts at 0, never decreases, ends at
            total_q.
        cu_seq_k: (N + 1,) the same for keys and values; None: equal to ``cu_seq_q``
            (self-attention).
        max_q, max_k: the longest query and key sequence (an upper bound, checked).
        return_aux: torch's ``AuxRequest``: with ``lse=True``, also return the
            (total_q, H) log-sum-exp.
        scale: multiplies the scores; default 1/sqrt(D).
        window_size: (left, right), FlashAttention's convention, at each sequence's own
            bottom-right positions: query ``p`` attends keys ``p − left .. p + right``; -1 is
            unbounded. (-1, -1): every key of the sequence; (-1, 0): causal; (w, 0): causal
            within the last w + 1 keys (``qkv.masks.sliding_window(w + 1)``).
        enable_gqa: allow H_kv < H (H % H_kv == 0), as torch requires it said.
        seqused_k: (N,): only the first ``seqused_k[s]`` keys of sequence ``s`` take part
            (a cache slot larger than what it holds).
        block_table: a paged cache's block table (N, max_pages) of integers: ``key`` and
            ``value`` are then a pool of pages (num_pages, page_size, H_kv, ·), sequence
            ``s`` holds the first ``seqused_k[s]`` slots of its pages in table order
            (``seqused_k`` required, ``cu_seq_k`` None); its pages are gathered, then
            attended as packed keys.
        num_splits: torch's split-KV knob for GPUs; qkv attends each sequence in one call,
            so results never depend on the other sequences of the batch (batch-invariant)
            whatever it is.
        dropout_p, generator: dropout on the attention weights, as in :func:`qkv.attention`
            (the generator draws for the sequences in order).
        mask, score_mod, sinks: as in :func:`qkv.attention`, applied within each sequence
            at its own positions (a mask with a batch dimension does not apply: each
            sequence is a batch of one). A score modification with one row per sequence,
            such as ``scores.alibi(slopes, symmetric=True)`` with slopes (N, H)
            (FlashAttention 2's per-sequence ``alibi_slopes``), gives sequence ``s`` its
            row ``s``.
        backend: as in :func:`qkv.attention`.

    Returns:
        out (total_q, H, D_v), or ``(out, lse)`` with lse (total_q, H) when asked for. A
        sequence with no key gives out 0 and lse -inf; an empty sequence gives nothing.

    Raises:
        ValueError, TypeError: bad offsets (not starting at 0, decreasing, not ending at the
            total, a length past ``max_q``/``max_k``), shapes or options.

    Example:
        >>> import torch, qkv
        >>> lengths = [3, 5, 2]
        >>> cu = torch.tensor([0, 3, 8, 10])
        >>> q = k = v = torch.randn(10, 4, 8)
        >>> out = qkv.varlen_attention(q, k, v, cu, cu, 5, 5, window_size=(-1, 0))
        >>> alone = qkv.attention(q[3:8].transpose(0, 1), k[3:8].transpose(0, 1),
        ...                       v[3:8].transpose(0, 1), mask=qkv.masks.causal())
        >>> torch.allclose(out[3:8], alone.transpose(0, 1), atol=1e-6)
        True
    """
    if block_table is not None:
        if cu_seq_k is not None:
            raise ValueError(
                "with block_table the keys are pages: give seqused_k and cu_seq_k=None"
            )
        if (
            mask is None
            and score_mod is None
            and backend == "auto"
            and not dropout_p
            and seqused_k is not None
            and tuple(window_size) in ((-1, -1), (-1, 0))
            and _one_query_each(query, cu_seq_q, max_q)
        ):  # a decode step: one query per sequence, at its end, sees every key it holds
            _check_tensors(query, key[0], value[0], enable_gqa)
            lse_too = bool(getattr(return_aux, "lse", False))
            return paged_attention(
                query,
                key,
                value,
                block_table,
                seqused_k,
                scale=scale,
                sinks=sinks,
                return_lse=lse_too,
            )
        key, value, cu_seq_k = _unpaged(key, value, block_table, seqused_k)
        seqused_k = None
    _check_tensors(query, key, value, enable_gqa)
    cu_seq_k = cu_seq_q if cu_seq_k is None else cu_seq_k
    starts_q = _offsets("cu_seq_q", cu_seq_q, query.shape[0], max_q, "max_q")
    starts_k = _offsets("cu_seq_k", cu_seq_k, key.shape[0], max_k, "max_k")
    if len(starts_q) != len(starts_k):
        raise ValueError(
            f"cu_seq_q and cu_seq_k must give the same number of sequences; "
            f"got {len(starts_q) - 1} and {len(starts_k) - 1}"
        )
    used = _used(seqused_k, starts_k)
    window = window_mask(window_size)
    if window is not None and mask is not None:
        mask = window & mask
    elif window is not None:
        mask = window
    if mask is not None and mask.batch not in (None, 1):
        raise ValueError(
            f"mask {mask!r} is bound to a batch of {mask.batch}; here each sequence is a "
            "batch of one"
        )
    mod = as_score_mod(score_mod)
    if mod is not None and mod.batch not in (None, len(starts_q) - 1):
        raise ValueError(
            f"score_mod {mod!r} is bound to a batch of {mod.batch}; here there are "
            f"N = {len(starts_q) - 1} sequences (one row per sequence, as FlashAttention's "
            "alibi_slopes (N, H))"
        )
    want_lse = bool(getattr(return_aux, "lse", False))
    outs, lses = [], []
    for s in range(len(starts_q) - 1):
        q0, q1 = starts_q[s], starts_q[s + 1]
        k0 = starts_k[s]
        k1 = k0 + used[s]
        if q1 == q0:
            continue
        q = query[q0:q1].transpose(0, 1)[None]  # (1, H, len_q, D)
        k = key[k0:k1].transpose(0, 1)[None]  # (1, H_kv, len_k, D)
        v = value[k0:k1].transpose(0, 1)[None]
        result = attention(
            q,
            k,
            v,
            mask=mask,
            scale=scale,
            score_mod=None if mod is None else mod.select(s),
            sinks=sinks,
            dropout_p=dropout_p,
            generator=generator,
            backend=backend,
            return_lse=want_lse,
        )
        out, lse = result if isinstance(result, tuple) else (result, None)
        outs.append(out[0].transpose(0, 1))  # (len_q, H, D_v)
        if lse is not None:
            lses.append(lse[0].transpose(0, 1))  # (len_q, H)
    if outs:
        out = torch.cat(outs, dim=0)
    else:
        out = query.new_zeros(0, query.shape[1], value.shape[2])
    if not want_lse:
        return out
    if lses:
        lse_all = torch.cat(lses, dim=0)
    else:
        lse_all = torch.zeros(0, query.shape[1], device=query.device)
    return out, lse_all


def paged_attention(
    query: torch.Tensor,
    key_pages: torch.Tensor,
    value_pages: torch.Tensor,
    block_table: torch.Tensor,
    lengths: torch.Tensor,
    *,
    scale: float | None = None,
    sinks: torch.Tensor | None = None,
    return_lse: bool = False,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """A decode step over a paged KV cache: each sequence's newest query attends every key
    the sequence holds, read in its pages through the block table — vLLM's PagedAttention
    and FlashAttention's ``block_table``, on a CPU. Pages may be quantized (int8 or float8
    e4m3, a float32 scale per token and key/value head: :class:`qkv.PagedKVCache` with
    ``dtype=torch.int8``): the native kernel reads them in place, with no dequantized copy.

    float32 and bfloat16 run qkv's native kernel (``kernels/_paged.c``), which reads each
    page where it lies. Elsewhere — another dtype, a gradient to record, the kernel not
    built, a :func:`qkv.heads.record` or :func:`qkv.heads.ablate` block open — the pages are
    gathered into one padded tensor and :func:`qkv.attention` runs on it with
    ``masks.padding(lengths)``. Both give the same numbers to rounding (tested against the
    float64 oracle).

    Args:
        query: (B, H, D), one query per sequence, the last of its tokens (it sees all of
            them: a causal mask changes nothing here).
        key_pages: (num_pages, P, H_kv, D), pages of P tokens (torch's and FlashAttention's
            layout; any strides with D contiguous, so :class:`qkv.PagedKVCache`'s pool
            ``pool.keys.permute(1, 2, 0, 3)`` is read as it is). value_pages: (…, D_v).
        block_table: (B, max_pages) integers: sequence b's pages in order; entries past the
            pages its length needs are not read (any value).
        lengths: (B,) integers, 0 .. max_pages · P: the tokens each sequence holds
            (``seqused_k``).
        scale, sinks: as in :func:`qkv.attention`.
        return_lse: also return the (B, H) log-sum-exp.
        key_scale, value_scale: for quantized pages, their scales, float32
            (num_pages, P, H_kv) (``pool.scales()``); a row is its stored values times its
            scale. None for float pages.

    Returns:
        out (B, H, D_v), and lse (B, H) with ``return_lse``. A sequence with no token gives
        out 0 and lse -inf (the sink's logit with sinks).

    Example:
        >>> import torch, qkv
        >>> pages_k, pages_v = torch.randn(10, 4, 2, 8), torch.randn(10, 4, 2, 8)
        >>> table = torch.tensor([[3, 7, 0], [5, 1, 2]])   # two sequences' pages
        >>> lengths = torch.tensor([6, 11])
        >>> q = torch.randn(2, 4, 8)                        # 4 query heads over 2 kv heads
        >>> out = qkv.paged_attention(q, pages_k, pages_v, table, lengths)
        >>> k0 = pages_k[[3, 7]].reshape(8, 2, 8)[:6].transpose(0, 1)   # sequence 0's keys
        >>> v0 = pages_v[[3, 7]].reshape(8, 2, 8)[:6].transpose(0, 1)
        >>> alone = qkv.attention(q[:1, :, None], k0[None], v0[None])[0, :, 0]
        >>> torch.allclose(out[0], alone, atol=1e-6)
        True
    """
    table, lengths = _page_shapes(query, key_pages, value_pages, block_table, lengths)
    _page_scales(key_pages, key_scale, value_scale)
    native = dispatch.paged(query, key_pages, value_pages, scale, sinks)
    if native is not None:  # the kernel checks the lengths and pages it reads
        dots = dispatch.paged_dots(query, key_pages)
        done = paged.decode(
            query, key_pages, value_pages, table, lengths, native, sinks, key_scale, value_scale,
            dots,
        )  # fmt: skip
        if done is not None:
            return done if return_lse else done[0]
        # a length or a page out of range: the checks below say which
    needed = pages_needed(table, lengths, key_pages.shape[0], key_pages.shape[1])
    # The gather: each sequence's pages, in order, into one padded (B, H_kv, L, ·) tensor.
    P = key_pages.shape[1]
    longest = int(lengths.max()) if len(lengths) else 0
    n = -(-longest // P)
    index = torch.where(needed, table, 0)[:, :n].to(key_pages.device)

    def gathered(pages: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
        x = pages[index]  # (B, n, P, H_kv, ·)
        if scales is not None:  # quantized: widened and scaled as gathered
            x = dequantize(x, scales[index], query.dtype)
        return x.reshape(x.shape[0], n * P, *x.shape[3:])[:, :longest].transpose(1, 2)

    k, v = gathered(key_pages, key_scale), gathered(value_pages, value_scale)
    mask = padding(lengths) if bool((lengths < longest).any()) else None
    out, lse = attention(
        query[:, :, None], k, v, mask=mask, scale=scale, sinks=sinks, return_lse=True
    )
    return (out[:, :, 0], lse[:, :, 0]) if return_lse else out[:, :, 0]


def _unpaged(
    key: Any, value: Any, block_table: Any, seqused_k: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pages (num_pages, P, H_kv, ·) and a block table as packed keys and values with their
    offsets: each sequence's pages gathered in table order, cut at its used length."""
    if not (isinstance(key, torch.Tensor) and key.ndim == 4 and value.ndim == 4):
        raise ValueError(
            "with block_table, key and value must be pages (num_pages, page_size, H_kv, D); "
            f"got {tuple(getattr(key, 'shape', ()))}"
        )
    if seqused_k is None:
        raise ValueError("block_table needs seqused_k: the tokens each sequence holds")
    table = torch.as_tensor(block_table)
    used = [int(n) for n in torch.as_tensor(seqused_k).reshape(-1).tolist()]
    P = key.shape[1]
    if table.ndim != 2 or table.shape[0] != len(used) or table.is_floating_point():
        raise ValueError(
            f"block_table must be (N, max_pages) integers with N = {len(used)} sequences; "
            f"got {tuple(table.shape)}"
        )
    pages_needed(table, torch.tensor(used, dtype=torch.long), key.shape[0], P, "seqused_k")
    pages = [table[s, : -(-n // P)].long().to(key.device) for s, n in enumerate(used)]
    ks = [key[p].reshape(-1, *key.shape[2:])[:n] for p, n in zip(pages, used)]
    vs = [value[p].reshape(-1, *value.shape[2:])[:n] for p, n in zip(pages, used)]
    cu = torch.tensor([0, *itertools.accumulate(used)])
    return torch.cat(ks), torch.cat(vs), cu


def _one_query_each(query: Any, cu_seq_q: Any, max_q: int) -> bool:
    """Whether cu_seq_q gives every sequence exactly one query (a decode step)."""
    return (
        isinstance(query, torch.Tensor)
        and isinstance(cu_seq_q, torch.Tensor)
        and query.ndim == 3
        and cu_seq_q.shape == (query.shape[0] + 1,)
        and max_q >= 1
        and bool((cu_seq_q == torch.arange(len(cu_seq_q), device=cu_seq_q.device)).all())
    )


def _page_shapes(
    query: Any, key_pages: Any, value_pages: Any, block_table: Any, lengths: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Check a paged call's shapes (reading no values), and return the block table and
    lengths as tensors."""
    if not (isinstance(query, torch.Tensor) and query.ndim == 3):
        raise ValueError(
            f"query must be (B, H, D), one query per sequence; got "
            f"{tuple(getattr(query, 'shape', ()))}"
        )
    B, H, D = query.shape
    for name, x in (("key_pages", key_pages), ("value_pages", value_pages)):
        if not (isinstance(x, torch.Tensor) and x.ndim == 4):
            raise ValueError(
                f"{name} must be pages (num_pages, page_size, H_kv, ·); got "
                f"{tuple(getattr(x, 'shape', ()))}"
            )
    _, _, H_kv, D_k = key_pages.shape
    if value_pages.shape[:3] != key_pages.shape[:3] or D_k != D or H % H_kv:
        raise ValueError(
            f"key_pages must be (num_pages, P, H_kv, {D}) with H_kv dividing H = {H}, and "
            f"value_pages (num_pages, P, H_kv, D_v); got {tuple(key_pages.shape)} and "
            f"{tuple(value_pages.shape)}"
        )
    table = torch.as_tensor(block_table)
    lengths = torch.as_tensor(lengths)
    if table.ndim != 2 or table.shape[0] != B or table.is_floating_point():
        raise ValueError(
            f"block_table must be (B, max_pages) integers with B = {B}; got "
            f"{tuple(table.shape)} {table.dtype}"
        )
    if lengths.shape != (B,) or lengths.is_floating_point():
        raise ValueError(f"lengths must be (B,) = ({B},) integers; got {tuple(lengths.shape)}")
    return table, lengths


def _page_scales(
    key_pages: torch.Tensor, key_scale: torch.Tensor | None, value_scale: torch.Tensor | None
) -> None:
    """Quantized pages come with their scales (float32, (num_pages, P, H_kv)), float pages
    without: a ValueError saying which otherwise (a missing scale would read raw integers
    as values)."""
    quantized = is_quantized(key_pages.dtype)
    for name, s in (("key_scale", key_scale), ("value_scale", value_scale)):
        if quantized and s is None:
            raise ValueError(
                f"{name} is needed: the pages are {key_pages.dtype}, each row stored with a "
                "scale (pool.scales())"
            )
        if not quantized and s is not None:
            raise ValueError(f"{name} is for quantized pages; these are {key_pages.dtype}")
        if s is not None and (s.dtype != torch.float32 or s.shape != key_pages.shape[:3]):
            raise ValueError(
                f"{name} must be float32 (num_pages, P, H_kv) = {tuple(key_pages.shape[:3])}; "
                f"got {s.dtype} {tuple(s.shape)}"
            )


def pages_needed(
    table: torch.Tensor, lengths: torch.Tensor, num_pages: int, P: int, name: str = "lengths"
) -> torch.Tensor:
    """Which entries of the block table the lengths need, (B, max_pages), each checked to
    be a page of the pool (and each length, ``name`` in the error, to fit its table)."""
    if len(lengths) and (int(lengths.min()) < 0 or int(lengths.max()) > table.shape[1] * P):
        raise ValueError(
            f"{name} must be 0 .. max_pages · page_size = {table.shape[1] * P}; "
            f"got {lengths.tolist()}"
        )
    pages_used = (lengths.to(table.device) + P - 1) // P
    needed = torch.arange(table.shape[1], device=table.device)[None, :] < pages_used[:, None]
    if bool((needed & ((table < 0) | (table >= num_pages))).any()):
        raise ValueError(
            f"block_table names a page outside the pool's {num_pages} for a token a sequence holds"
        )
    return needed


def _check_tensors(query: Any, key: Any, value: Any, enable_gqa: bool) -> None:
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not isinstance(x, torch.Tensor) or x.ndim != 3:
            raise ValueError(
                f"{name} must be a packed (total, heads, dim) tensor; "
                f"got {getattr(x, 'shape', type(x).__name__)}"
            )
    H, H_kv = query.shape[1], key.shape[1]
    if key.shape[0] != value.shape[0] or value.shape[1] != H_kv or key.shape[2] != query.shape[2]:
        raise ValueError(
            f"key must be (total_k, H_kv, D) with D = {query.shape[2]} and value "
            f"(total_k, H_kv, D_v); got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    if H_kv != H and not enable_gqa:
        raise ValueError(
            f"query has {H} heads and key/value {H_kv}: pass enable_gqa=True for grouped "
            "query attention"
        )
    if H % H_kv:
        raise ValueError(f"query heads ({H}) must be a multiple of key/value heads ({H_kv})")


def _offsets(name: str, cu: Any, total: int, longest: int, longest_name: str) -> list[int]:
    """The offsets as a list of ints, checked: 1-d integers, from 0, never decreasing, to
    ``total``, no sequence longer than ``longest``."""
    if not isinstance(cu, torch.Tensor) or cu.ndim != 1 or cu.is_floating_point() or len(cu) < 1:
        raise TypeError(
            f"{name} must be a 1-d integer tensor of N + 1 offsets; "
            f"got {getattr(cu, 'shape', type(cu).__name__)}"
        )
    offsets = [int(x) for x in cu.tolist()]
    lengths = [b - a for a, b in itertools.pairwise(offsets)]
    if offsets[0] != 0 or any(n < 0 for n in lengths) or offsets[-1] != total:
        raise ValueError(
            f"{name} must start at 0, never decrease and end at the packed length {total}; "
            f"got {offsets if len(offsets) <= 12 else [*offsets[:6], '…', *offsets[-3:]]}"
        )
    if lengths and max(lengths) > longest:
        s = lengths.index(max(lengths))
        raise ValueError(
            f"sequence {s} has {lengths[s]} tokens in {name}, more than {longest_name}={longest}"
        )
    return offsets


def _used(seqused_k: Any, starts_k: list[int]) -> list[int]:
    lengths = [b - a for a, b in itertools.pairwise(starts_k)]
    if seqused_k is None:
        return lengths
    used = [int(x) for x in torch.as_tensor(seqused_k).reshape(-1).tolist()]
    if len(used) != len(lengths) or any(not 0 <= u <= n for u, n in zip(used, lengths)):
        raise ValueError(
            f"seqused_k must give, per sequence, 0 .. its key length {lengths}; got {used}"
        )
    return used


def window_mask(window_size: Any) -> Mask | None:
    """FlashAttention's ``window_size=(left, right)`` as a qkv mask at each call's own
    (bottom-right) positions: query ``p`` attends keys ``p − left .. p + right``, -1 unbounded;
    None for (-1, -1), every key."""
    try:
        left, right = (int(x) for x in window_size)
    except (TypeError, ValueError):
        raise ValueError(f"window_size must be (left, right) ints; got {window_size!r}") from None
    if left < -1 or right < -1:
        raise ValueError(f"window_size entries must be >= -1 (-1: unbounded); got {window_size}")
    if right == 0:
        return causal() if left == -1 else sliding_window(left + 1)
    if left == right == -1:
        return None
    # A band with a look-ahead: no structured mask has it, so a named predicate.
    lo = None if left == -1 else left
    hi = None if right == -1 else right

    def band(b: Any, h: Any, q: Any, kv: Any) -> Any:
        if lo is None:
            return kv <= q + hi
        if hi is None:
            return kv >= q - lo
        return (kv >= q - lo) & (kv <= q + hi)

    return predicate(band, f"window({left}, {right})")
