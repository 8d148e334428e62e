"""A small GPT written against FlashAttention's API, trained and sampled on a CPU through qkv.

    python examples/flash_attn_gpt.py [--steps 200] [--T 256]

The model's attention is written the way GPU projects write it (nanochat's, for one): queries,
keys and values in (B, T, H, D), a sliding window per layer, ``flash_attn_func`` in training,
``flash_attn_with_kvcache`` with the new keys appended in place during generation. It
imports ``flash_attn``; where that package is absent (every CPU), ``qkv.flash_attn.install()``
answers the import, and the code below runs unchanged.

``attention="dense"`` swaps in the fallback such projects ship for the CPU: torch's SDPA with
a dense (T, T) mask for the window, which costs what full attention costs. The two paths are
the same model: the tests check greedy generation token for token, and
``benchmarks/bench_flash_attn.py`` measures their memory and time.

Training text: the Python standard library's own sources, read as bytes.
"""

from __future__ import annotations

import argparse
import pathlib
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

try:
    from flash_attn import flash_attn_func, flash_attn_with_kvcache
except ImportError:  # no GPU package here: qkv answers FlashAttention's API on the CPU
    import qkv.flash_attn

    qkv.flash_attn.install()
    from flash_attn import flash_attn_func, flash_attn_with_kvcache


@dataclass
class Config:
    vocab: int = 256  # bytes
    layers: int = 3
    heads: int = 4
    kv_heads: int = 2
    dim: int = 128
    max_len: int = 8192
    #: each layer's window as FlashAttention's left bound; -1 is the whole causal past
    windows: tuple[int, ...] = (32, 32, -1)
    attention: str = "flash"  # or "dense": SDPA with a dense mask


def rotary(x: torch.Tensor, start: int) -> torch.Tensor:
    """Rotary embedding of x (B, T, H, D) at positions start .. start + T − 1 (the halves)."""
    T, D = x.shape[1], x.shape[3]
    freq = 10000.0 ** (-torch.arange(0, D, 2, dtype=torch.float32) / D)
    angle = torch.arange(start, start + T, dtype=torch.float32)[:, None] * freq  # (T, D/2)
    cos, sin = angle.cos()[None, :, None].to(x.dtype), angle.sin()[None, :, None].to(x.dtype)
    a, b = x[..., : D // 2], x[..., D // 2 :]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class Cache:
    """Keys and values of every layer, (layers, B, max_len, H_kv, D), and the tokens held."""

    def __init__(self, config: Config, batch: int, max_len: int, dtype: torch.dtype) -> None:
        D = config.dim // config.heads
        shape = (config.layers, batch, max_len, config.kv_heads, D)
        self.k = torch.zeros(shape, dtype=dtype)
        self.v = torch.zeros(shape, dtype=dtype)
        self.seqlens = torch.zeros(batch, dtype=torch.int32)


class Attention(nn.Module):
    def __init__(self, config: Config, layer: int) -> None:
        super().__init__()
        self.config, self.layer = config, layer
        self.D = config.dim // config.heads
        self.q = nn.Linear(config.dim, config.heads * self.D, bias=False)
        self.kv = nn.Linear(config.dim, 2 * config.kv_heads * self.D, bias=False)
        self.proj = nn.Linear(config.heads * self.D, config.dim, bias=False)

    def forward(self, x: torch.Tensor, cache: Cache | None) -> torch.Tensor:
        B, T, _ = x.shape
        c = self.config
        q = self.q(x).view(B, T, c.heads, self.D)
        k, v = self.kv(x).view(B, T, 2, c.kv_heads, self.D).unbind(2)
        start = 0 if cache is None else int(cache.seqlens[0])
        q, k = rotary(q, start), rotary(k, start)
        window = (c.windows[self.layer], 0)
        if cache is not None:  # appends k and v in place, attends over the filled cache
            y = flash_attn_with_kvcache(
                q,
                cache.k[self.layer],
                cache.v[self.layer],
                k=k,
                v=v,
                cache_seqlens=cache.seqlens,
                causal=True,
                window_size=window,
            )
        elif c.attention == "flash":
            y = flash_attn_func(q, k, v, causal=True, window_size=window)
        else:
            y = dense_attention(q, k, v, window[0])
        return self.proj(y.reshape(B, T, -1))


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, left: int) -> torch.Tensor:
    """The CPU fallback: SDPA with the window as a dense (T, T) bool mask."""
    T = q.shape[1]
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    mask = (j <= i) if left < 0 else (j <= i) & (j >= i - left)
    y = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, enable_gqa=True
    )
    return y.transpose(1, 2)


class Block(nn.Module):
    def __init__(self, config: Config, layer: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(config.dim), nn.RMSNorm(config.dim)
        self.attn = Attention(config, layer)
        self.mlp = nn.Sequential(
            nn.Linear(config.dim, 4 * config.dim, bias=False),
            nn.GELU(),
            nn.Linear(4 * config.dim, config.dim, bias=False),
        )

    def forward(self, x: torch.Tensor, cache: Cache | None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cache)
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab, config.dim)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.layers))
        self.norm = nn.RMSNorm(config.dim)
        self.head = nn.Linear(config.dim, config.vocab, bias=False)

    def forward(self, tokens: torch.Tensor, cache: Cache | None = None) -> torch.Tensor:
        """Logits (B, T, vocab) of tokens (B, T); with a cache, the tokens follow what it
        holds and are appended to it."""
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, cache)
        if cache is not None:
            cache.seqlens += tokens.shape[1]
        return self.head(self.norm(x))

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, new: int, cached: bool = True) -> torch.Tensor:
        """Greedy continuation of prompt (B, T): with the KV cache (prefill, then one token
        at a time) or by running the whole sequence again for every token."""
        tokens = prompt
        if not cached:
            for _ in range(new):
                nxt = self(tokens)[:, -1].argmax(-1, keepdim=True)
                tokens = torch.cat([tokens, nxt], dim=1)
            return tokens
        cache = Cache(self.config, prompt.shape[0], prompt.shape[1] + new, self.embed.weight.dtype)
        logits = self(prompt, cache)
        for _ in range(new):
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, nxt], dim=1)
            logits = self(nxt, cache)
        return tokens


def stdlib_bytes(limit: int = 2_000_000) -> torch.Tensor:
    """The standard library's sources as one byte sequence: text every machine has."""
    root = pathlib.Path(argparse.__file__).parent
    data = bytearray()
    for path in sorted(root.glob("*.py")):
        data += path.read_bytes()
        if len(data) >= limit:
            break
    return torch.tensor(list(data[:limit]), dtype=torch.long)


def train(
    model: GPT, data: torch.Tensor, steps: int, T: int, batch: int = 8, seed: int = 0
) -> list[float]:
    """AdamW on random windows of data; the loss of each step."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        at = torch.randint(0, len(data) - T - 1, (batch,), generator=g)
        x = torch.stack([data[a : a + T] for a in at.tolist()])
        y = torch.stack([data[a + 1 : a + T + 1] for a in at.tolist()])
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--T", type=int, default=256)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = GPT(Config())
    t0 = time.perf_counter()
    losses = train(model, stdlib_bytes(), args.steps, args.T)
    took = time.perf_counter() - t0
    print(f"{args.steps} steps in {took:.0f} s: loss {losses[0]:.2f} -> {losses[-1]:.2f}")
    prompt = torch.tensor([list(b"def ")])
    print(bytes(model.generate(prompt, 80)[0].tolist()).decode(errors="replace"))


if __name__ == "__main__":
    main()
