"""A float64 reference of FlashAttention's documented semantics, written from its docstrings
and independent of qkv's kernels: dense scores in FA's (B, T, H, D) layout, the soft-cap,
then ALiBi ``−slope · |i + T_k − T_q − j|``, then the window ``[p − left, p + right]`` (causal
sets right = 0) and each sequence's valid keys. Autograd runs through it."""

import torch


def attention_ref(
    q,
    k,
    v,
    *,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    softmax_scale=None,
    key_lengths=None,
    sinks=None,
):
    """q (B, T_q, H, D), k (B, T_k, H_kv, D), v (B, T_k, H_kv, D_v); key_lengths (B,): keys
    0 .. L_b − 1 are valid and query i sits at i + L_b − T_q (FA's bottom-right per
    sequence). Returns out (B, T_q, H, D_v), lse (B, H, T_q) and weights (B, H, T_q, T_k),
    all float64."""
    q, k, v = (x.double() for x in (q, k, v))
    B, T_q, H, D = q.shape
    T_k, H_kv = k.shape[1], k.shape[2]
    k = k.repeat_interleave(H // H_kv, dim=2)
    v = v.repeat_interleave(H // H_kv, dim=2)
    scale = D**-0.5 if softmax_scale is None else softmax_scale
    s = torch.einsum("bihd,bjhd->bhij", q, k) * scale  # (B, H, T_q, T_k)
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    lengths = torch.full((B,), T_k) if key_lengths is None else torch.as_tensor(key_lengths)
    i = torch.arange(T_q).view(1, 1, T_q, 1)
    j = torch.arange(T_k).view(1, 1, 1, T_k)
    p = i + lengths.view(B, 1, 1, 1) - T_q  # each query's position
    if alibi_slopes is not None:
        slopes = alibi_slopes.double()
        slopes = slopes.view(1, H, 1, 1) if slopes.ndim == 1 else slopes.view(B, H, 1, 1)
        s = s - slopes * (p - j).abs()
    left, right = window_size
    if causal:
        right = 0
    allowed = j < lengths.view(B, 1, 1, 1)
    if left >= 0:
        allowed = allowed & (j >= p - left)
    if right >= 0:
        allowed = allowed & (j <= p + right)
    s = s.masked_fill(~allowed, float("-inf"))
    # One more column: the sink's logit, or -inf (no sink; a row of T_k = 0 keys then
    # still has a column to reduce over). It is dropped from the weights below.
    sink = float("-inf") if sinks is None else sinks.double().view(1, H, 1, 1)
    s = torch.cat([s, torch.zeros(B, H, T_q, 1, dtype=s.dtype) + sink], dim=-1)
    m = s.amax(dim=-1, keepdim=True).detach()
    m = m.masked_fill(m == float("-inf"), 0.0)
    e = torch.exp(s - m)
    total = e.sum(dim=-1, keepdim=True)
    w = e / total.masked_fill(total == 0, 1.0)
    lse = (m + torch.log(total)).squeeze(-1)
    w = w[..., :-1]
    out = torch.einsum("bhij,bjhd->bihd", w, v)
    return out, lse, w
