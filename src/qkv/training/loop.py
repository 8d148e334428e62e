"""Train a :class:`qkv.models.GPT` on bytes: ``qkv train`` and the function under it.

AdamW with linear warm-up and cosine decay, gradient clipping, a seed, validation loss at
intervals, and checkpoints that resume exactly. A checkpoint directory holds:

- ``model.safetensors``, the weights (safetensors, never pickle).
- ``optimizer.safetensors``, AdamW's moments and the random generators' states.
- ``config.json``, the model and training configuration, the preset and the corpus.
- ``state.json``, the step reached, the run's total and the loss history.
- ``loss.png``, the loss curve (when matplotlib is installed), redrawn by the first save
  after each evaluation and by the last.

The set is written as a new generation and swapped in with one rename
(:mod:`qkv.training.checkpoint`), every ``save_every`` steps and at the end, so a crash at any
instant leaves the previous checkpoint whole. Ctrl-C (SIGINT) or SIGTERM (a scheduler, a
logout, ``docker stop``) finishes the current step, writes a checkpoint and stops. A second
one stops at once (``KeyboardInterrupt``), and the last checkpoint is still whole.

Legend: B batch · T sequence length (block_size)."""

from __future__ import annotations

import dataclasses
import signal
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..heads import copying_scores, head_scores, icl_score, per_token_loss, repeated_tokens
from ..models import GPT, GPTConfig
from .checkpoint import (
    _check_same_run,
    _config_json,
    _load_training_state,
    _read_json,
    checkpoint_dir,
    has_checkpoint,
    read_config,
    save_checkpoint,
    save_snapshot,
)
from .data import (
    RepeatedSegments,
    check_context,
    eval_windows,
    load_corpus,
    load_words,
    random_batch,
)
from .presets import DEFAULT_PRESET, PRESETS, TrainConfig, learning_rate
from .progress import _catch_stops, _Progress


@dataclass
class Result:
    """What a call to :func:`train` did."""

    model: GPT
    step: int
    steps: int
    history: list[dict[str, float]]
    interrupted: bool
    out: Path
    unit: str = "byte"  # what the loss is per: "byte" (text) or "token"

    @property
    def val_loss(self) -> float | None:
        """The last validation loss, nats per byte."""
        vals = [h["val_loss"] for h in self.history if "val_loss" in h]
        return vals[-1] if vals else None


def _optimizer(model: GPT, cfg: TrainConfig) -> torch.optim.AdamW:
    decay: list[torch.Tensor] = [p for p in model.parameters() if p.ndim >= 2]
    rest: list[torch.Tensor] = [p for p in model.parameters() if p.ndim < 2]
    # Positions are a table, not a map: they are not decayed (nanoGPT decays them; either
    # works). A tied embedding appears once in parameters().
    if model.wpe is not None:
        decay = [p for p in decay if p is not model.wpe.weight]
        rest.append(model.wpe.weight)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": rest, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas)


def evaluate(
    model: GPT,
    data: torch.Tensor,
    windows: int,
    block_size: int,
    batch_size: int = 32,
    autocast: str | None = None,
) -> float:
    """Mean loss (nats per byte) over ``windows`` fixed windows of data."""
    return _loss_on(model, *eval_windows(data, windows, block_size), batch_size, autocast)


def _loss_on(
    model: GPT, x: torch.Tensor, y: torch.Tensor, batch_size: int = 32, autocast: str | None = None
) -> float:
    """Mean next-token loss of inputs x against targets y, both (N, T): the mean of
    :func:`qkv.heads.per_token_loss` (every position holds N windows)."""
    with _autocast(autocast):
        return per_token_loss(model, x, y, batch_size=batch_size).mean().item()


def _autocast(kind: str | None) -> Any:
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=kind == "bfloat16")


def _fastest_autocast(model: Any, batch_size: int, mcfg: GPTConfig) -> str:
    """ "bfloat16" where a training step of this model (forward and backward on random
    tokens) runs under 0.9× the float32 step's time on this CPU, else "float32": bfloat16
    is faster only where the CPU has a bfloat16 dot product. Interleaved medians of 3 steps
    each after a warm-up. The random state, the weights and their gradients are left as
    they were."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, mcfg.vocab_size, (batch_size, mcfg.block_size), generator=g)
    times: dict[str, list[float]] = {"float32": [], "bfloat16": []}
    with torch.random.fork_rng():
        for r in range(4):
            for kind in ("float32", "bfloat16") if r % 2 else ("bfloat16", "float32"):
                t0 = time.perf_counter()
                with _autocast(kind):
                    logits = model(x)
                logits.float().logsumexp(-1).mean().backward()
                if r:  # the first round warms up
                    times[kind].append(time.perf_counter() - t0)
    model.zero_grad(set_to_none=True)
    fast = statistics.median(times["bfloat16"]) < 0.9 * statistics.median(times["float32"])
    return "bfloat16" if fast else "float32"


def train(
    out: str | Path,
    *,
    preset: str = DEFAULT_PRESET,
    text: str | Path | None = None,
    steps: int | None = None,
    seed: int = 0,
    resume: bool = False,
    compile: bool = False,
    model_config: GPTConfig | None = None,
    train_config: TrainConfig | None = None,
    progress: bool = True,
    on_step: Callable[[int, float], None] | None = None,
    save_every: int | None = None,
) -> Result:
    """Train a GPT and keep its checkpoint in ``out``.

    Args:
        out: the checkpoint directory (created; an existing checkpoint there is refused
            unless ``resume``).
        preset: a name in :data:`PRESETS`.
        text: a UTF-8 file or folder; None for the standard library's sources.
        steps: the run's total number of steps (default: the preset's; with ``resume``, the
            run's own). With ``resume``, another total extends (or shortens) the run: the
            cosine decay is laid over the new total, and the progress line says so.
        seed: seeds the weights, the batches and dropout.
        resume: continue the checkpoint in ``out`` exactly where it stopped.
        compile: run the model under ``torch.compile``.
        model_config, train_config: replace the preset's.
        progress: draw a progress line and evaluation lines on stderr.
        on_step: called as ``on_step(step, loss)`` after every step.
        save_every: write a checkpoint every this many steps (default: at each evaluation,
            ``eval_interval``), as well as at the end and on a stop.

    Raises:
        FileNotFoundError, ValueError: a missing path, an empty corpus, a context longer than
            the data, a checkpoint of another configuration. Raised before anything is
            written.
    """
    out = Path(out)
    if preset not in PRESETS:
        raise ValueError(f"--preset must be one of {', '.join(PRESETS)}; got {preset!r}")
    mcfg, tcfg = PRESETS[preset]
    mcfg, tcfg = model_config or mcfg, train_config or tcfg
    state: dict[str, Any] = {"step": 0, "history": [], "tokens": 0, "seconds": 0.0}
    wanted = _config_json(preset, mcfg, tcfg, text, seed)
    extended = ""
    if resume:
        if not has_checkpoint(out):
            raise FileNotFoundError(f"no checkpoint: {str(out)!r} holds none to resume")
        saved = _read_json(checkpoint_dir(out) / "config.json")
        state = _read_json(checkpoint_dir(out) / "state.json")
        _check_same_run(saved, wanted)
        own = int(state.get("steps", saved["train"]["steps"]))  # the run's own total
        if steps is None:
            steps = own
        elif steps != own:
            extended = f"the run's total goes from {own} to {steps} steps"
    elif has_checkpoint(out):
        raise ValueError(
            f"--out {str(out)!r} already holds a checkpoint: pass --resume to "
            "continue it, or choose another directory"
        )
    if steps is not None:
        tcfg = dataclasses.replace(tcfg, steps=steps)
    if tcfg.steps < state["step"]:
        raise ValueError(
            f"--steps {tcfg.steps} is below the step the checkpoint reached ({state['step']})"
        )
    data = _data(tcfg, mcfg, text)
    wanted["data"]["source"] = data.source
    held_out = data.held_out(tcfg.eval_windows, mcfg.block_size)

    torch.manual_seed(seed)
    model = GPT(mcfg)
    optimizer = _optimizer(model, tcfg)
    batches = torch.Generator().manual_seed(seed)
    if resume:
        _load_training_state(out, model, optimizer, batches)
    runner = torch.compile(model) if compile else model
    autocast = tcfg.autocast
    if autocast == "auto":  # measured once per run; a resumed run keeps its choice
        autocast = state.get("autocast") or _fastest_autocast(runner, tcfg.batch_size, mcfg)
        state["autocast"] = autocast
    out.mkdir(parents=True, exist_ok=True)
    config_json = {**wanted, "train": dataclasses.asdict(tcfg)}
    state["steps"] = tcfg.steps  # the run's own total, which --resume goes on to
    bar = _Progress(tcfg.steps, state["step"], mcfg.block_size * tcfg.batch_size, progress)
    corpus = getattr(data, "corpus", None)
    if corpus is not None:  # what the run reads: files, bytes, and what it skipped
        bar.note(corpus.describe())
    if extended:
        bar.note(f"resuming at step {state['step']}: {extended}")
    if tcfg.autocast == "auto":
        bar.note(f"dtype auto: {autocast} (the faster of float32 and bfloat16 on this CPU)")
    every = tcfg.eval_interval if save_every is None else save_every
    if every < 1:
        raise ValueError(f"save_every must be >= 1; got {every}")

    stop = {"asked": False}
    previous = _catch_stops(stop)
    model.train()
    try:
        step = state["step"]
        evaluated = plotted = step  # the steps of the last evaluation and the last loss.png
        while step < tcfg.steps and not stop["asked"]:
            lr = learning_rate(step, tcfg)
            for group in optimizer.param_groups:
                group["lr"] = lr
            x, y = data.batch(tcfg.batch_size, mcfg.block_size, batches)
            with _autocast(autocast):
                logits = runner(x)  # (B, T, V)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if tcfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), tcfg.grad_clip)
            optimizer.step()
            step += 1
            record: dict[str, float] = {"step": step, "loss": loss.item(), "lr": lr}
            if step % tcfg.eval_interval == 0 or step == tcfg.steps:
                evaluation = _evaluate(model, held_out, autocast, step)
                evaluated = step
                state.setdefault("evaluations", []).append(evaluation)
                record.update(
                    val_loss=evaluation["val_loss"],
                    icl=evaluation["icl"],
                    induction=max(max(row) for row in evaluation["scores"]["induction"]),
                )
                if tcfg.snapshots:
                    save_snapshot(out, model, step)
                bar.note(
                    f"step {step}: train {record['loss']:.4f}, val "
                    f"{record['val_loss']:.4f} nats/{data.unit}, ICL {record['icl']:+.3f}, "
                    f"induction {record['induction']:.3f}"
                )
            state["history"].append(record)
            state["step"] = step
            state["tokens"] += x.numel()
            bar.update(step, record["loss"])
            if step % every == 0 and step < tcfg.steps and not stop["asked"]:
                save_checkpoint(
                    out,
                    model,
                    optimizer,
                    batches,
                    config_json,
                    _saved(state, bar),
                    plot=evaluated > plotted,  # an evaluation since loss.png was drawn
                )
                plotted = evaluated
            if on_step is not None:
                on_step(step, record["loss"])
        save_checkpoint(out, model, optimizer, batches, config_json, _saved(state, bar))
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        bar.close()
    if stop["asked"]:
        bar.note(
            f"interrupted: checkpoint at step {state['step']} in {out} (continue with --resume)"
        )
    return Result(model, state["step"], tcfg.steps, state["history"], stop["asked"], out, data.unit)


def _evaluate(
    model: GPT, held_out: tuple[torch.Tensor, torch.Tensor], autocast: str | None, step: int
) -> dict[str, Any]:
    """What a run keeps at each evaluation (``state.json``'s ``evaluations``): the
    validation loss, the loss at each position (:func:`qkv.heads.per_token_loss`), the ICL
    score, and every head's scores (:func:`qkv.heads.head_scores` on random segments of
    half the context repeated, drawn from the tokens of the held-out windows, and
    :func:`qkv.heads.copying_scores`) — the data of the induction-heads paper's pictures
    (docs/induction.md)."""
    x_val, y_val = held_out
    with _autocast(autocast):
        losses = per_token_loss(model, x_val, y_val)
    tokens = repeated_tokens(  # drawn from the tokens the held-out windows hold
        model.config.vocab_size, model.config.block_size // 2, batch=16, choices=x_val.unique()
    )
    scores = {name: s.tolist() for name, s in head_scores(model, tokens=tokens).items()}
    scores["copying"] = copying_scores(model).tolist()
    return {
        "step": step,
        "val_loss": losses.mean().item(),
        "icl": icl_score(losses),
        "token_loss": [round(v, 5) for v in losses.tolist()],
        "scores": scores,
    }


def _saved(state: dict[str, Any], bar: _Progress) -> dict[str, Any]:
    """The state as a checkpoint records it: the wall time spent so far added up."""
    return {**state, "seconds": state["seconds"] + bar.elapsed()}


class _Windows:
    """A corpus split in two: random windows of ``train`` to train on, fixed windows of
    ``val`` held out."""

    train: torch.Tensor
    val: torch.Tensor

    def batch(
        self, batch_size: int, block_size: int, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return random_batch(self.train, batch_size, block_size, generator)

    def held_out(self, count: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return eval_windows(self.val, count, block_size)


class _Text(_Windows):
    """Bytes of a corpus."""

    unit = "byte"

    def __init__(self, text: str | Path | None, block_size: int) -> None:
        self.corpus = load_corpus(text)
        check_context(self.corpus, block_size)
        self.source = self.corpus.source
        self.train, self.val = self.corpus.train, self.corpus.val


class _Words(_Windows):
    """Words of a corpus (:func:`load_words`)."""

    unit = "token"

    def __init__(self, text: str | Path | None, block_size: int, vocab_size: int) -> None:
        self.corpus = load_words(text, vocab_size)
        if len(self.corpus.val) <= block_size or len(self.corpus.train) <= block_size:
            raise ValueError(
                f"the corpus has {len(self.corpus.val):,} held-out words: too few for "
                f"a context of {block_size}"
            )
        self.source = f"words of {self.corpus.source}"
        self.train, self.val = self.corpus.train, self.corpus.val


class _Repeats(RepeatedSegments):
    unit = "token"

    @property
    def source(self) -> str:
        return (
            f"random segments of {self.min_length}-{self.max_length} tokens (of "
            f"{self.vocab_size}), repeated"
        )


def _data(tcfg: TrainConfig, mcfg: GPTConfig, text: Any) -> Any:
    if tcfg.data == "text":
        return _Text(text, mcfg.block_size)
    if tcfg.data == "words":
        return _Words(text, mcfg.block_size, mcfg.vocab_size)
    if text is not None:
        raise ValueError(
            "--text does not apply to data='repeated_segments' (the induction "
            "preset makes its own sequences)"
        )
    return _Repeats(mcfg.vocab_size, *tcfg.segment_lengths)


def validation_windows(
    out: str | Path, count: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The held-out windows of a run's own data, rebuilt from its ``config.json``: (inputs,
    targets), each (count, block_size) — what the run evaluated on (``count`` default: its
    ``eval_windows``)."""
    config = read_config(out)
    train = dict(config["train"])
    for name in ("betas", "segment_lengths"):  # JSON keeps tuples as lists
        train[name] = tuple(train[name])
    tcfg = TrainConfig(**train)
    mcfg = GPTConfig.from_dict(config["model"])
    data = _data(tcfg, mcfg, config["data"]["text"])
    return data.held_out(count or tcfg.eval_windows, mcfg.block_size)


def induction_score(model: GPT, seed: int = 0) -> float:
    """The highest induction score of any head (:func:`qkv.heads.head_scores`), on
    sequences of half the context repeated."""
    return head_scores(model, batch=16, seed=seed)["induction"].max().item()
