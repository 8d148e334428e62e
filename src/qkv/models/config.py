"""The configuration of a qkv GPT: sizes, attention kind, positions, norms and
initialisation, checked when made, and read back from a dict strictly."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass(frozen=True)
class GPTConfig:
    """The shape of a :class:`GPT`.

    Args:
        vocab_size: V (256 for bytes).
        block_size: the context window: the most tokens the model attends over.
        n_layer, n_head, n_embd: depth, H and E (E divisible by H).
        n_kv_head: H_kv for grouped-query attention; None means n_head.
        mlp_width: hidden width of the MLP; None means 4 · n_embd.
        dropout: on the embeddings, the attention weights and both residual branches.
        positions: "learned" (GPT-2: a table of block_size positions) or "rope".
        attention_only: no MLPs (the models interpretability studies train).
        attention: "softmax", or "uniform": every position averages its past equally
            (seed 001's ``xbow``), the baseline that shows what attention adds; or "mla":
            multi-head latent attention (:class:`qkv.nn.MultiHeadLatentAttention`), heads of
            n_embd / n_head for queries, keys and values, a shared rotary key half that
            wide, and a cache of kv_lora_rank + that half per token.
        kv_lora_rank: the latent width of "mla"; None: 4 · n_embd / n_head (DeepSeek V3's
            512 for its heads of 128).
        attention_sinks: each head learns a sink logit, a key with no value in every row's
            softmax (gpt-oss; docs/streaming.md).
        gelu: "tanh" (GPT-2's approximation) or "erf" (exact).
        layer_norm: LayerNorm before each branch and at the end; False for none (the
            attention-only models of interpretability studies have none).
        tie_embeddings: the LM head reads the token embedding's table; False gives it its own.
        init: "gpt2" (N(0, 0.02) weights, residual projections scaled by 1/sqrt(their
            number)) or "fan_in" (embeddings N(0, 1), each Linear N(0, 1/fan_in), a tied table
            the LM head's: activations of unit scale from the start; a small model on a
            synthetic task leaves its loss
            plateau far sooner — the induction preset's head forms at ~700 steps with it and
            not within 8,000 with "gpt2", docs/induction.md).
        layer_norm_eps: epsilon of every LayerNorm.
        rope_base: RoPE's wavelength base, when positions = "rope".
    """

    vocab_size: int = 256
    block_size: int = 256
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    n_kv_head: int | None = None
    mlp_width: int | None = None
    dropout: float = 0.0
    positions: str = "learned"
    attention_only: bool = False
    attention: str = "softmax"
    gelu: str = "tanh"
    layer_norm: bool = True
    tie_embeddings: bool = True
    init: str = "gpt2"
    layer_norm_eps: float = 1e-5
    rope_base: float = 10000.0
    kv_lora_rank: int | None = None
    attention_sinks: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be an int >= 1; got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"GPTConfig.n_embd must be a multiple of n_head; got "
                f"n_embd={self.n_embd}, n_head={self.n_head}"
            )
        if self.n_kv_head is not None and (self.n_kv_head < 1 or self.n_head % self.n_kv_head):
            raise ValueError(
                f"GPTConfig.n_head must be a multiple of n_kv_head; got "
                f"n_head={self.n_head}, n_kv_head={self.n_kv_head}"
            )
        choices = {
            "positions": ("learned", "rope"),
            "attention": ("softmax", "uniform", "mla"),
            "gelu": ("tanh", "erf"),
            "init": ("gpt2", "fan_in"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"GPTConfig.{name} must be one of {allowed}; got {getattr(self, name)!r}"
                )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1); got {self.dropout}")
        if self.positions == "rope" and (self.n_embd // self.n_head) % 2:
            raise ValueError(
                f"rope needs an even head width n_embd / n_head; got {self.n_embd // self.n_head}"
            )
        if self.attention == "mla" and (
            self.n_kv_head not in (None, self.n_head) or (self.n_embd // self.n_head) % 4
        ):
            raise ValueError(
                "GPTConfig.attention='mla' takes no n_kv_head (its keys and values come from "
                "one latent) and a head width n_embd / n_head divisible by 4 (its rotary key "
                f"is half a head, an even width); got n_kv_head={self.n_kv_head}, head width "
                f"{self.n_embd // self.n_head}"
            )
        if not isinstance(self.attention_sinks, bool) or (
            self.attention_sinks and self.attention == "mla"
        ):
            raise ValueError(
                "GPTConfig.attention_sinks is a bool, for softmax or uniform attention; got "
                f"{self.attention_sinks!r} with attention={self.attention!r}"
            )
        if self.kv_lora_rank is not None and (
            isinstance(self.kv_lora_rank, bool)
            or not isinstance(self.kv_lora_rank, int)
            or self.kv_lora_rank < 1
            or self.attention != "mla"
        ):
            raise ValueError(
                "GPTConfig.kv_lora_rank is an int >= 1 for attention='mla'; got "
                f"{self.kv_lora_rank!r} with attention={self.attention!r}"
            )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GPTConfig:
        """The inverse of :meth:`to_dict`. Unknown keys are an error, not ignored."""
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown GPTConfig fields: {', '.join(sorted(unknown))}")
        return cls(**data)
