"""The training presets of ``qkv train`` and its configuration: sizes, steps, learning-rate
schedule and the data each preset reads."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..models import GPTConfig


@dataclass(frozen=True)
class TrainConfig:
    """How to train: the optimiser, its schedule, batches and evaluation.

    Args:
        steps: the run's total number of optimiser steps (the cosine decay ends there).
        batch_size: windows of block_size bytes per step.
        lr, min_lr: peak and final learning rate.
        warmup: steps of linear warm-up from 0 to lr.
        weight_decay: AdamW's, on matrices only (not biases, LayerNorms or positions).
        betas: AdamW's.
        grad_clip: largest global gradient norm; 0 for none.
        eval_interval: steps between validation losses.
        eval_windows: validation windows per evaluation (the same ones every time).
        autocast: "bfloat16" runs the matmuls under CPU autocast in bfloat16 (the weights
            and the optimiser stay float32); None for float32 throughout; "auto" measures
            both on this CPU at the start of a run and takes bfloat16 only where its steps
            are faster (a CPU without a bfloat16 dot product runs them slower).
        data: "text" (bytes of a corpus), "words" (the corpus cut into words, the model's
            vocab_size of them: :func:`qkv.training.load_words`) or "repeated_segments"
            (random segments repeated, :class:`qkv.training.RepeatedSegments`: the
            induction experiment).
        segment_lengths: (shortest, longest) segment for "repeated_segments".
        snapshots: also keep the weights at every evaluation, in ``snapshots/`` (a few KB
            for small models: the viewer's slider over training).
    """

    steps: int = 2000
    batch_size: int = 32
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup: int = 100
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    eval_interval: int = 250
    eval_windows: int = 64
    autocast: str | None = None
    data: str = "text"
    segment_lengths: tuple[int, int] = (4, 32)
    snapshots: bool = False

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_size < 1 or self.eval_interval < 1:
            raise ValueError("steps, batch_size and eval_interval must be >= 1")
        if self.autocast not in (None, "bfloat16", "auto"):
            raise ValueError(f"autocast must be None, 'bfloat16' or 'auto'; got {self.autocast!r}")
        if self.data not in ("text", "words", "repeated_segments"):
            raise ValueError(
                f"data must be 'text', 'words' or 'repeated_segments'; got {self.data!r}"
            )


#: The induction preset's vocabulary: tokens 0 … 63.
INDUCTION_VOCAB = 64


#: cpu-10min's training: sized for ten minutes on a 2-core CPU.
_TEN_MINUTES = TrainConfig(
    steps=1800,
    batch_size=16,
    lr=3e-3,
    min_lr=3e-4,
    warmup=100,
    eval_interval=200,
    eval_windows=64,
    autocast="auto",
)

#: name -> (model, training). Named for what they are; ``cpu-10min`` is the default.
PRESETS: dict[str, tuple[GPTConfig, TrainConfig]] = {
    # Seconds: for tests and a first look.
    "tiny": (
        GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32),
        TrainConfig(steps=20, batch_size=8, warmup=5, eval_interval=10, eval_windows=8),
    ),
    # Sized for ten minutes on a 2-core CPU (docs/training.md has its measured time).
    "cpu-10min": (
        GPTConfig(block_size=256, n_layer=4, n_head=4, n_embd=128, positions="rope"),
        _TEN_MINUTES,
    ),
    # cpu-10min's model with multi-head latent attention (DeepSeek's form, docs/head-shapes.md):
    # heads of 32, a rotary key of 16, a latent of 128; its cache holds 144 values per token
    # and layer against multi-head attention's 256.
    "mla": (
        GPTConfig(
            block_size=256, n_layer=4, n_head=4, n_embd=128, positions="rope", attention="mla"
        ),
        _TEN_MINUTES,
    ),
    # The induction experiment (docs/induction.md): a 2-layer attention-only model, no
    # LayerNorm, untied, unit-scale init, on random segments repeated, until an induction
    # head forms; a constant learning rate after warm-up.
    "induction": (
        GPTConfig(
            vocab_size=INDUCTION_VOCAB,
            block_size=64,
            n_layer=2,
            n_head=4,
            n_embd=64,
            attention_only=True,
            layer_norm=False,
            tie_embeddings=False,
            init="fan_in",
        ),
        TrainConfig(
            steps=2000,
            batch_size=64,
            lr=1e-3,
            min_lr=1e-3,
            warmup=50,
            weight_decay=0.0,
            eval_interval=100,
            eval_windows=256,
            data="repeated_segments",
            segment_lengths=(12, 32),
            snapshots=True,
        ),
    ),
}


def _paper_words(n_layer: int, attention_only: bool = True) -> tuple[GPTConfig, TrainConfig]:
    """A run of the induction-heads paper's experiment on words of the standard library's
    sources (benchmarks/induction_paper.py, docs/induction.md)."""
    return (
        GPTConfig(
            vocab_size=PAPER_WORDS,
            block_size=256,
            n_layer=n_layer,
            n_head=4,
            n_embd=64,
            attention_only=attention_only,
            tie_embeddings=False,
        ),
        TrainConfig(
            steps=20000,
            batch_size=8,
            lr=1e-3,
            min_lr=1e-3,
            warmup=100,
            weight_decay=0.0,
            eval_interval=500,
            eval_windows=128,
            data="words",
        ),
    )


#: The word vocabulary of the paper presets: "<unk>" and the 2,047 most frequent words.
PAPER_WORDS = 2048

# The induction-heads paper's experiment (benchmarks/induction_paper.py): 1- and 2-layer
# attention-only models and a 2-layer model with MLPs on words; the induction preset with one
# layer, where no induction head can form (it needs a previous-token head below it).
PRESETS["paper-words-1l"] = _paper_words(1)
PRESETS["paper-words-2l"] = _paper_words(2)
PRESETS["paper-words-2l-mlp"] = _paper_words(2, attention_only=False)
PRESETS["paper-repeats-1l"] = (
    dataclasses.replace(PRESETS["induction"][0], n_layer=1),
    PRESETS["induction"][1],
)


DEFAULT_PRESET = "cpu-10min"


def learning_rate(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to lr over ``warmup`` steps, then cosine decay to min_lr at ``steps``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))
