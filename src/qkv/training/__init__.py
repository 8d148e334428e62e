"""Training a :class:`qkv.models.GPT` on bytes on a CPU: ``qkv train`` and what it stands on.

``presets`` (sizes, steps, schedules), ``data`` (corpora, batches, the repeated-segment
task), ``loop`` (the training loop), ``checkpoint`` (what a run writes and reads back) and
``progress`` (what it shows while it runs).
"""

from .checkpoint import (
    CheckpointError,
    checkpoint_dir,
    has_checkpoint,
    load_checkpoint,
    read_config,
    read_state,
    save_checkpoint,
    save_snapshot,
    snapshots,
)
from .data import (
    Corpus,
    RepeatedSegments,
    Words,
    bigram_loss,
    check_context,
    eval_windows,
    load_corpus,
    load_words,
    random_batch,
    stdlib_root,
)
from .loop import Result, evaluate, induction_score, train, validation_windows
from .presets import DEFAULT_PRESET, INDUCTION_VOCAB, PRESETS, TrainConfig, learning_rate

__all__ = [
    "DEFAULT_PRESET",
    "INDUCTION_VOCAB",
    "PRESETS",
    "CheckpointError",
    "Corpus",
    "RepeatedSegments",
    "Result",
    "TrainConfig",
    "Words",
    "bigram_loss",
    "check_context",
    "checkpoint_dir",
    "eval_windows",
    "evaluate",
    "has_checkpoint",
    "induction_score",
    "learning_rate",
    "load_checkpoint",
    "load_corpus",
    "load_words",
    "random_batch",
    "read_config",
    "read_state",
    "save_checkpoint",
    "save_snapshot",
    "snapshots",
    "stdlib_root",
    "train",
    "validation_windows",
]
