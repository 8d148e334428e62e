"""Train a :class:`qkv.models.GPT` on bytes: ``qkv train`` and the function under it.

AdamW with linear warm-up and cosine decay, gradient clipping, a seed, validation loss at
intervals, and checkpoints that resume exactly. A checkpoint directory holds:

- ``model.safetensors``: the weights (safetensors, never pickle);
- ``optimizer.safetensors``: AdamW's moments and the random generators' states;
- ``config.json``: the model and training configuration, the preset, the corpus;
- ``state.json``: the step reached, the run's total, and the loss history;
- ``loss.png``: the loss curve (when matplotlib is installed).

Every file is written beside itself and renamed into place, and ``state.json`` last, so a
crash leaves the previous checkpoint whole. Ctrl-C (SIGINT) finishes the current step,
writes a checkpoint and stops; a second Ctrl-C stops at once.

Legend: B batch · T sequence length (block_size).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from .data import RepeatedSegments, check_context, eval_windows, load_corpus, random_batch
from .heads import head_scores
from .models import GPT, GPTConfig


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
            and the optimiser stay float32); None for float32 throughout.
        data: "text" (bytes of a corpus) or "repeated_segments" (random segments repeated,
            :class:`qkv.data.RepeatedSegments`: the induction experiment).
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
        if self.autocast not in (None, "bfloat16"):
            raise ValueError(f"autocast must be None or 'bfloat16'; got {self.autocast!r}")
        if self.data not in ("text", "repeated_segments"):
            raise ValueError(f"data must be 'text' or 'repeated_segments'; got {self.data!r}")


#: The induction preset's vocabulary: tokens 0 … 63.
INDUCTION_VOCAB = 64

#: name -> (model, training). Named for what they are; ``cpu-10min`` is the default.
PRESETS: dict[str, tuple[GPTConfig, TrainConfig]] = {
    # Seconds: for tests and a first look.
    "tiny": (GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32),
             TrainConfig(steps=20, batch_size=8, warmup=5, eval_interval=10, eval_windows=8)),
    # Sized for ten minutes on a 2-core CPU: 398 s measured (docs/training.md).
    "cpu-10min": (GPTConfig(block_size=256, n_layer=4, n_head=4, n_embd=128,
                            positions="rope"),
                  TrainConfig(steps=1800, batch_size=16, lr=3e-3, min_lr=3e-4, warmup=100,
                              eval_interval=200, eval_windows=64, autocast="bfloat16")),
    # The induction experiment (docs/induction.md): a 2-layer attention-only model, no
    # LayerNorm, untied, unit-scale init, on random segments repeated, until an induction
    # head forms; a constant learning rate after warm-up.
    "induction": (GPTConfig(vocab_size=INDUCTION_VOCAB, block_size=64, n_layer=2, n_head=4,
                            n_embd=64, attention_only=True, layer_norm=False,
                            tie_embeddings=False, init="fan_in"),
                  TrainConfig(steps=2000, batch_size=64, lr=1e-3, min_lr=1e-3, warmup=50,
                              weight_decay=0.0, eval_interval=100, eval_windows=256,
                              data="repeated_segments", segment_lengths=(12, 32),
                              snapshots=True)),
}
DEFAULT_PRESET = "cpu-10min"

_FILES = ("model.safetensors", "optimizer.safetensors", "config.json", "state.json")


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


def learning_rate(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to lr over ``warmup`` steps, then cosine decay to min_lr at ``steps``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def _optimizer(model: GPT, cfg: TrainConfig) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    # Positions are a table, not a map: they are not decayed (nanoGPT decays them; either
    # works). A tied embedding appears once in parameters().
    if model.wpe is not None:
        decay = [p for p in decay if p is not model.wpe.weight]
        rest.append(model.wpe.weight)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas)


def evaluate(model: GPT, data: torch.Tensor, windows: int, block_size: int,
             batch_size: int = 32, autocast: str | None = None) -> float:
    """Mean loss (nats per byte) over ``windows`` fixed windows of data."""
    return _loss_on(model, *eval_windows(data, windows, block_size), batch_size, autocast)


def _loss_on(model: GPT, x: torch.Tensor, y: torch.Tensor, batch_size: int = 32,
             autocast: str | None = None) -> float:
    """Mean next-token loss of inputs x against targets y, both (N, T)."""
    was_training = model.training
    model.eval()
    total = 0.0
    with torch.no_grad(), _autocast(autocast):
        for i in range(0, len(x), batch_size):
            logits = model(x[i:i + batch_size])
            total += F.cross_entropy(logits.flatten(0, 1).float(), y[i:i + batch_size].flatten(),
                                     reduction="sum").item()
    model.train(was_training)
    return total / y.numel()


def _autocast(kind: str | None) -> Any:
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=kind == "bfloat16")


def train(out: str | Path, *, preset: str = DEFAULT_PRESET, text: str | Path | None = None,
          steps: int | None = None, seed: int = 0, resume: bool = False,
          compile: bool = False, model_config: GPTConfig | None = None,
          train_config: TrainConfig | None = None, progress: bool = True,
          on_step: Callable[[int, float], None] | None = None) -> Result:
    """Train a GPT and keep its checkpoint in ``out``.

    Args:
        out: the checkpoint directory (created; an existing checkpoint there is refused
            unless ``resume``).
        preset: a name in :data:`PRESETS`.
        text: a UTF-8 file or folder; None for the standard library's sources.
        steps: the run's total number of steps (default: the preset's). With ``resume``
            this carries an earlier run on to ``steps``; the cosine decay is laid over the
            new total.
        seed: seeds the weights, the batches and dropout.
        resume: continue the checkpoint in ``out`` exactly where it stopped.
        compile: run the model under ``torch.compile``.
        model_config, train_config: replace the preset's.
        progress: draw a progress line and evaluation lines on stderr.
        on_step: called as ``on_step(step, loss)`` after every step.

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
    if resume:
        saved = _read_json(out / "config.json")
        state = _read_json(out / "state.json")
        _check_same_run(saved, wanted)
    elif any((out / f).exists() for f in _FILES):
        raise ValueError(f"--out {str(out)!r} already holds a checkpoint: pass --resume to "
                         "continue it, or choose another directory")
    if steps is not None:
        tcfg = dataclasses.replace(tcfg, steps=steps)
    if tcfg.steps < state["step"]:
        raise ValueError(f"--steps {tcfg.steps} is below the step the checkpoint reached "
                         f"({state['step']})")
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
    out.mkdir(parents=True, exist_ok=True)
    config_json = {**wanted, "train": dataclasses.asdict(tcfg)}
    bar = _Progress(tcfg.steps, state["step"], mcfg.block_size * tcfg.batch_size, progress)

    stop = {"asked": False}
    previous = _catch_sigint(stop)
    model.train()
    try:
        step = state["step"]
        while step < tcfg.steps and not stop["asked"]:
            lr = learning_rate(step, tcfg)
            for group in optimizer.param_groups:
                group["lr"] = lr
            x, y = data.batch(tcfg.batch_size, mcfg.block_size, batches)
            with _autocast(tcfg.autocast):
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
                record["val_loss"] = _loss_on(model, *held_out, autocast=tcfg.autocast)
                scores = ""
                if tcfg.data == "repeated_segments":  # the best head's, on held-out tokens
                    record["induction"] = induction_score(model)
                    scores = f", induction {record['induction']:.3f}"
                if tcfg.snapshots:
                    save_snapshot(out, model, step)
                bar.note(f"step {step}: train {record['loss']:.4f}, val "
                         f"{record['val_loss']:.4f} nats/{data.unit}{scores}")
            state["history"].append(record)
            state["step"] = step
            state["tokens"] += x.numel()
            bar.update(step, record["loss"])
            if on_step is not None:
                on_step(step, record["loss"])
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
        state["seconds"] += bar.elapsed()
        state["steps"] = tcfg.steps
        bar.close()
    save_checkpoint(out, model, optimizer, batches, config_json, state)
    if stop["asked"]:
        bar.note(f"interrupted: checkpoint at step {state['step']} in {out} "
                 "(continue with --resume)")
    return Result(model, state["step"], tcfg.steps, state["history"], stop["asked"], out,
                  data.unit)


class _Text:
    """Bytes of a corpus: random windows to train on, fixed validation windows."""

    unit = "byte"

    def __init__(self, text: str | Path | None, block_size: int) -> None:
        self.corpus = load_corpus(text)
        check_context(self.corpus, block_size)
        self.source = self.corpus.source

    def batch(self, batch_size: int, block_size: int, generator: torch.Generator
              ) -> tuple[torch.Tensor, torch.Tensor]:
        return random_batch(self.corpus.train, batch_size, block_size, generator)

    def held_out(self, count: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return eval_windows(self.corpus.val, count, block_size)


class _Repeats(RepeatedSegments):
    unit = "token"

    @property
    def source(self) -> str:
        return (f"random segments of {self.min_length}-{self.max_length} tokens (of "
                f"{self.vocab_size}), repeated")


def _data(tcfg: TrainConfig, mcfg: GPTConfig, text: Any) -> Any:
    if tcfg.data == "text":
        return _Text(text, mcfg.block_size)
    if text is not None:
        raise ValueError("--text does not apply to data='repeated_segments' (the induction "
                         "preset makes its own sequences)")
    return _Repeats(mcfg.vocab_size, *tcfg.segment_lengths)


def induction_score(model: GPT, seed: int = 0) -> float:
    """The highest induction score of any head (:func:`qkv.heads.head_scores`), on
    sequences of half the context repeated."""
    return head_scores(model, batch=16, seed=seed)["induction"].max().item()


def save_snapshot(out: Path, model: GPT, step: int) -> None:
    """The weights alone, as ``snapshots/step-NNNNNN.safetensors``."""
    from safetensors.torch import save_model

    folder = out / "snapshots"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step-{step:06d}.safetensors"
    _replace(path, lambda p: save_model(model, str(p), metadata={"step": str(step)}))


def snapshots(path: str | Path) -> list[tuple[int, Path]]:
    """(step, file) of each snapshot a run kept (``TrainConfig.snapshots``), in order."""
    folder = Path(path) / "snapshots"
    files = sorted(folder.glob("step-*.safetensors")) if folder.is_dir() else []
    return [(int(f.stem.split("-")[1]), f) for f in files]


def _catch_sigint(stop: dict[str, bool]) -> Any:
    """Make the first Ctrl-C ask the loop to stop after its step; a second one raises."""
    if not _main_thread():
        return None

    def handler(signum: int, frame: Any) -> None:
        if stop["asked"]:
            raise KeyboardInterrupt
        stop["asked"] = True

    return signal.signal(signal.SIGINT, handler)


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _config_json(preset: str, mcfg: GPTConfig, tcfg: TrainConfig, text: Any, seed: int
                 ) -> dict[str, Any]:
    return {"preset": preset, "model": mcfg.to_dict(), "train": dataclasses.asdict(tcfg),
            "data": {"text": None if text is None else str(Path(text).resolve())},
            "seed": seed}


def _check_same_run(saved: dict[str, Any], wanted: dict[str, Any]) -> None:
    """A resumed run must be the saved one: same model, corpus, seed and recipe (the total
    number of steps may change)."""
    drop_steps = lambda t: {k: v for k, v in t.items() if k != "steps"}  # noqa: E731
    checks = [("preset", saved["preset"], wanted["preset"]),
              ("model", saved["model"], wanted["model"]),
              ("training recipe", drop_steps(saved["train"]), drop_steps(
                  json.loads(json.dumps(wanted["train"])))),
              ("--text", saved["data"]["text"], wanted["data"]["text"]),
              ("--seed", saved["seed"], wanted["seed"])]
    for name, a, b in checks:
        if a != b:
            raise ValueError(f"the checkpoint was trained with another {name}: it has {a!r}, "
                             f"this run asks for {b!r}")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"no checkpoint: {path} is missing") from None
    except ValueError as err:
        raise ValueError(f"{path} is not valid JSON ({err})") from None


def _replace(path: Path, write: Callable[[Path], None]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def save_checkpoint(out: Path, model: GPT, optimizer: torch.optim.Optimizer,
                    batches: torch.Generator, config: dict[str, Any],
                    state: dict[str, Any]) -> None:
    """Write the checkpoint files of :mod:`qkv.train`'s docstring into ``out``."""
    from safetensors.torch import save_file, save_model

    meta = {"step": str(state["step"])}
    _replace(out / "model.safetensors", lambda p: save_model(model, str(p), metadata=meta))
    tensors = {"rng.torch": torch.get_rng_state(), "rng.batches": batches.get_state()}
    index = {id(p): i for i, p in enumerate(model.parameters())}
    for group in optimizer.param_groups:
        for p in group["params"]:
            for name, value in optimizer.state.get(p, {}).items():
                tensors[f"adamw.{index[id(p)]}.{name}"] = value.reshape(-1) if value.ndim == 0 \
                    else value
    _replace(out / "optimizer.safetensors", lambda p: save_file(tensors, str(p), metadata=meta))
    _replace(out / "config.json", lambda p: p.write_text(json.dumps(config, indent=2) + "\n"))
    _replace(out / "state.json", lambda p: p.write_text(json.dumps(state) + "\n"))
    _plot(out, state["history"], "token" if config["train"]["data"] != "text" else "byte")


def _load_training_state(out: Path, model: GPT, optimizer: torch.optim.Optimizer,
                         batches: torch.Generator) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file, load_model

    step = str(_read_json(out / "state.json")["step"])
    for name in ("model.safetensors", "optimizer.safetensors"):
        with safe_open(str(out / name), "pt") as f:
            if (f.metadata() or {}).get("step") != step:
                raise ValueError(f"{out / name} does not belong to step {step} of state.json: "
                                 "the checkpoint is inconsistent")
    load_model(model, str(out / "model.safetensors"))
    tensors = load_file(str(out / "optimizer.safetensors"))
    torch.set_rng_state(tensors.pop("rng.torch"))
    batches.set_state(tensors.pop("rng.batches"))
    params = list(model.parameters())
    for key, value in tensors.items():
        _, i, name = key.split(".")
        p = params[int(i)]
        optimizer.state[p][name] = value.reshape(()) if name == "step" else value


def load_checkpoint(path: str | Path, step: int | None = None) -> GPT:
    """The trained :class:`qkv.models.GPT` of a checkpoint directory, in eval mode; with
    ``step``, the snapshot kept at that step instead."""
    from safetensors.torch import load_model

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"no checkpoint: {str(path)!r} is not a directory")
    config = _read_json(path / "config.json")
    model = GPT(GPTConfig.from_dict(config["model"]))
    weights = path / "model.safetensors"
    if step is not None:
        kept = dict(snapshots(path))
        if step not in kept:
            raise ValueError(f"{path} kept no snapshot at step {step}; it has "
                             f"{sorted(kept) or 'none'}")
        weights = kept[step]
    if not weights.exists():
        raise FileNotFoundError(f"no checkpoint: {weights} is missing")
    load_model(model, str(weights))
    return model.eval()


def _plot(out: Path, history: list[dict[str, float]], unit: str = "byte") -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([h["step"] for h in history], [h["loss"] for h in history], lw=0.8, alpha=0.6,
            label="train")
    val = [h for h in history if "val_loss" in h]
    ax.plot([h["step"] for h in val], [h["val_loss"] for h in val], "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel(f"loss (nats per {unit})")
    ax.grid(alpha=0.3)
    scored = [h for h in history if "induction" in h]
    if scored:  # the induction experiment: the best head's score on a second axis
        right = ax.twinx()
        right.plot([h["step"] for h in scored], [h["induction"] for h in scored], "s-",
                   color="tab:green", ms=3, label="induction score")
        right.set_ylabel("best induction score")
        right.set_ylim(0, 1)
        fig.legend(loc="upper right", bbox_to_anchor=(0.85, 0.9))
    else:
        ax.legend()
    fig.tight_layout()
    _replace(out / "loss.png", lambda p: fig.savefig(p, format="png", dpi=100))
    plt.close(fig)


class _Progress:
    """One line on stderr: step, loss, tokens per second and time left."""

    def __init__(self, steps: int, start: int, tokens_per_step: int, enabled: bool) -> None:
        self.steps, self.start, self.tokens = steps, start, tokens_per_step
        self.enabled, self.t0, self.last = enabled, time.perf_counter(), 0.0
        self.tty = sys.stderr.isatty()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def update(self, step: int, loss: float) -> None:
        now = self.elapsed()
        if not self.enabled or not self.tty or (now - self.last < 0.25 and step < self.steps):
            return
        self.last = now
        done = step - self.start
        rate = done / now if now > 0 else 0.0
        left = (self.steps - step) / rate if rate > 0 else 0.0
        bar = "#" * int(20 * step / self.steps)
        sys.stderr.write(f"\r[{bar:<20}] step {step}/{self.steps}  loss {loss:.4f}  "
                         f"{rate * self.tokens / 1e3:.1f}k tok/s  {_clock(left)} left ")
        sys.stderr.flush()

    def note(self, text: str) -> None:
        if self.enabled:
            sys.stderr.write(("\r\033[K" if self.tty else "") + text + "\n")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            sys.stderr.write("\n")


def _clock(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m}:{s:02d}"


__all__ = ["DEFAULT_PRESET", "PRESETS", "Result", "TrainConfig", "evaluate", "induction_score",
           "learning_rate", "load_checkpoint", "save_checkpoint", "save_snapshot", "snapshots",
           "train"]
