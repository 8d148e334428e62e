"""What each head does and what it contributes.

``patterns`` records attention through qkv (:func:`record`) and scores heads by where they
look (:func:`head_scores`). The scores are previous-token, duplicate-token, induction (the
paper's prefix matching) and first-token. ``circuits`` measures what heads contribute, as
Olsson et al. (2022) measure it. It gives the loss at each position
(:func:`per_token_loss`), the in-context-learning score (:func:`icl_score`), copying
(:func:`copying_scores`) and ablation (:func:`ablate`, through qkv's public hook on
attention output).
"""

from .circuits import (
    ablate,
    copying_scores,
    head_means,
    icl_band,
    icl_positions,
    icl_score,
    logits_of,
    parse_heads,
    per_token_loss,
)
from .patterns import (
    ROW_BLOCK,
    SCORES,
    Call,
    Recorder,
    evaluating,
    head_scores,
    record,
    repeated_tokens,
    run,
    scores_from_weights,
)

__all__ = [
    "ROW_BLOCK",
    "SCORES",
    "Call",
    "Recorder",
    "ablate",
    "copying_scores",
    "evaluating",
    "head_means",
    "head_scores",
    "icl_band",
    "icl_positions",
    "icl_score",
    "logits_of",
    "parse_heads",
    "per_token_loss",
    "record",
    "repeated_tokens",
    "run",
    "scores_from_weights",
]
