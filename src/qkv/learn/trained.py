"""Trained models to look at on first open, made on this machine the first time they are asked
for and kept in qkv's cache directory.

qkv ships no weights: a model is its recipe (a preset, a seed, a number of steps) and the head
scores that recipe reached when it was recorded. The first call trains the recipe once —
exactly ``qkv train --preset induction --seed 0 --steps 1200``, about 40 seconds on a 2-core
CPU — into ``QKV_CACHE_DIR`` (else ``$XDG_CACHE_HOME/qkv`` or ``~/.cache/qkv``), under
``pretrained/``. Every later call loads that run. The run is an ordinary ``qkv train``
directory, snapshots included, so ``qkv heads``, ``qkv view`` and ``qkv explain`` read it as
they read any run (and do so when given no ``--checkpoint``).

Example:
    >>> import qkv
    >>> model = qkv.learn.pretrained("induction")  # doctest: +SKIP
    >>> qkv.heads.head_scores(model)["induction"]  # doctest: +SKIP
    tensor([[0.0230, 0.0190, 0.0170, 0.0200],
            [0.5270, 0.5620, 0.5790, 0.5720]])
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..kernels.tiled.profile import cache_dir
from ..models import GPT
from ..training import CheckpointError, has_checkpoint, load_checkpoint, read_state, train

__all__ = ["RECIPES", "Recipe", "pretrained", "pretrained_run"]


@dataclass(frozen=True)
class Recipe:
    """How a pretrained model is made, and what it scored when it was recorded.

    Attributes:
        preset: the training preset (:data:`qkv.training.PRESETS`).
        seed: the run's seed.
        steps: the steps trained.
        induction: the induction score of every layer and head (:func:`qkv.heads.head_scores`,
            its default sequences), as recorded on an AMD EPYC Zen 4 and, pinned to AVX2, the
            same to three decimals.
        about: what the model is for, one sentence.
    """

    preset: str
    seed: int
    steps: int
    induction: tuple[tuple[float, ...], ...]
    about: str

    @property
    def command(self) -> str:
        """The ``qkv train`` command that makes the same run."""
        return f"qkv train --preset {self.preset} --seed {self.seed} --steps {self.steps}"


#: name -> recipe.
RECIPES: dict[str, Recipe] = {
    "induction": Recipe(
        preset="induction",
        seed=0,
        steps=1200,
        induction=((0.023, 0.019, 0.017, 0.020), (0.527, 0.562, 0.579, 0.572)),
        about="a 2-layer attention-only GPT on random token segments repeated; every head of "
        "layer 1 is an induction head (docs/induction.md)",
    ),
}


def pretrained_run(name: str = "induction", *, progress: bool = True) -> Path:
    """The run directory of a pretrained model, trained here first if it is not kept yet.

    Args:
        name: a name in :data:`RECIPES`.
        progress: say on stderr that the model is being trained, and show the run's progress.

    Raises:
        ValueError: an unknown name.
    """
    if name not in RECIPES:
        raise ValueError(f"no pretrained model {name!r}: the names are {', '.join(RECIPES)}")
    recipe = RECIPES[name]
    kept = cache_dir() / "pretrained" / f"{name}-seed{recipe.seed}-{recipe.steps}"
    if _whole(kept, recipe):
        return kept
    if progress:
        print(
            f"qkv: training the pretrained {name!r} model once ({recipe.command}; about 40 s "
            f"on a 2-core CPU); it is kept in {kept}",
            file=sys.stderr,
        )
    kept.parent.mkdir(parents=True, exist_ok=True)
    # Trained beside its place and moved there in one rename, so that a run stopped half way,
    # or a second process training at the same time, never leaves a partial model in place.
    scratch = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=kept.parent))
    try:
        train(
            scratch / "run",
            preset=recipe.preset,
            seed=recipe.seed,
            steps=recipe.steps,
            progress=progress,
        )
        if kept.exists() and not _whole(kept, recipe):
            shutil.rmtree(kept, ignore_errors=True)
        try:
            os.rename(scratch / "run", kept)
        except OSError:  # another process put a whole run there first: it is used
            if not _whole(kept, recipe):
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return kept


def pretrained(name: str = "induction", *, progress: bool = True) -> GPT:
    """A pretrained :class:`qkv.models.GPT` (eval mode), trained here first if it is not kept
    yet (:func:`pretrained_run`). A kept run whose files were damaged is trained again."""
    run = pretrained_run(name, progress=progress)
    try:
        return load_checkpoint(run)
    except CheckpointError:
        shutil.rmtree(run, ignore_errors=True)
        return load_checkpoint(pretrained_run(name, progress=progress))


def _whole(run: Path, recipe: Recipe) -> bool:
    """Whether ``run`` holds the recipe's finished run (a damaged one is trained again)."""
    if not has_checkpoint(run):
        return False
    try:
        return int(read_state(run).get("step", -1)) == recipe.steps
    except (CheckpointError, OSError, ValueError):
        return False
