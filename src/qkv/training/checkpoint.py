"""Checkpoints and snapshots of a training run: what is written, how it is read back, and the
checks that a resumed run is the same run.

A checkpoint is written as a set: its four files go into a new *generation* directory
(``out/gen-NNNNNN-K``), made complete and flushed to disk, and then swapped in with one
rename — the symbolic link ``out/latest`` replaced by one pointing at it. Only then is the
previous generation removed. A kill at any instant leaves ``latest`` pointing at a whole
generation (the new one, or the one before). Readers go through :func:`checkpoint_dir`. A
checkpoint written before generations (its files directly in ``out``) is read as it is.

Every way a checkpoint can be damaged or mismatched (a missing, empty or truncated file,
JSON that does not parse, weights that do not fit the configuration) raises
:class:`CheckpointError` with one line naming the file and the problem.

Legend: L layers."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..models import GPT, GPTConfig
from .presets import TrainConfig

_FILES = ("model.safetensors", "optimizer.safetensors", "config.json", "state.json")
#: the link to the newest whole generation
LATEST = "latest"


class CheckpointError(ValueError):
    """A checkpoint that cannot be read: one line naming the file and the problem."""


def checkpoint_dir(out: str | Path) -> Path:
    """Where the checkpoint files of a run directory are. They are in the generation
    ``out/latest`` points at, or in ``out/latest`` itself where it is a folder (a run copied
    with ``cp -rL``, which copies what a link points at), or in ``out`` for a checkpoint
    written before generations."""
    out = Path(out)
    link = out / LATEST
    if link.is_symlink():
        return out / os.readlink(link)
    return link if link.is_dir() else out


def has_checkpoint(out: str | Path) -> bool:
    """Whether ``out`` holds a checkpoint (whole or not)."""
    out = Path(out)
    latest = out / LATEST
    return latest.is_symlink() or latest.is_dir() or any((out / f).exists() for f in _FILES)


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


def _config_json(
    preset: str, mcfg: GPTConfig, tcfg: TrainConfig, text: Any, seed: int
) -> dict[str, Any]:
    return {
        "preset": preset,
        "model": mcfg.to_dict(),
        "train": dataclasses.asdict(tcfg),
        "data": {"text": None if text is None else str(Path(text).resolve())},
        "seed": seed,
    }


def _check_same_run(saved: dict[str, Any], wanted: dict[str, Any]) -> None:
    """A resumed run must be the saved one: same model, corpus, seed and recipe (the total
    number of steps may change)."""
    lacking = [k for k in ("preset", "model", "train", "data", "seed") if k not in saved]
    if lacking or not isinstance(saved.get("data"), dict):
        raise CheckpointError(
            f"config.json is damaged: it lacks {', '.join(lacking) or 'the data section'}"
        )
    drop_steps = lambda t: {k: v for k, v in t.items() if k != "steps"}  # noqa: E731
    checks = [
        ("preset", saved["preset"], wanted["preset"]),
        ("model", saved["model"], wanted["model"]),
        (
            "training recipe",
            drop_steps(saved["train"]),
            drop_steps(json.loads(json.dumps(wanted["train"]))),
        ),
        ("--text", saved["data"]["text"], wanted["data"]["text"]),
        ("--seed", saved["seed"], wanted["seed"]),
    ]
    for name, a, b in checks:
        if a != b:
            raise ValueError(
                f"the checkpoint was trained with another {name}: it has {a!r}, "
                f"this run asks for {b!r}"
            )


def read_config(out: str | Path) -> dict[str, Any]:
    """The ``config.json`` of a run's checkpoint (preset, model, recipe, data, seed)."""
    return _read_json(checkpoint_dir(out) / "config.json")


def read_state(out: str | Path) -> dict[str, Any]:
    """The ``state.json`` of a run's checkpoint (step, the run's total, history, …)."""
    return _read_json(checkpoint_dir(out) / "state.json")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        found = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"no checkpoint: {path} is missing") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path} is damaged: not valid JSON ({err})") from None
    if not isinstance(found, dict):
        raise CheckpointError(f"{path} is damaged: not a JSON object")
    return found


def _load_weights(model: torch.nn.Module, path: Path) -> None:
    """Load a safetensors file into a model, or raise one line saying what is wrong."""
    from safetensors.torch import load_model

    if not path.exists():
        raise CheckpointError(f"no checkpoint: {path} is missing")
    try:
        missing, unexpected = load_model(model, str(path), strict=False)
    except RuntimeError as err:  # torch's load_state_dict: weights of other shapes
        lines = [x.strip() for x in str(err).splitlines() if x.strip()]
        raise CheckpointError(
            f"{path} does not fit the model its config.json describes ({lines[-1]})"
        ) from None
    except Exception as err:  # safetensors' own error types: a damaged or truncated file
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise CheckpointError(f"{path} is damaged or truncated ({first})") from None
    if missing or unexpected:
        raise CheckpointError(
            f"{path} does not fit the model its config.json describes: "
            f"{len(missing)} weight(s) missing (e.g. {sorted(missing)[:2]}), "
            f"{len(unexpected)} unexpected (e.g. {sorted(unexpected)[:2]})"
        )
    broken = [
        name
        for name, t in model.state_dict().items()
        if t.is_floating_point() and not bool(torch.isfinite(t).all())
    ]
    if broken:  # read as they are, they would give NaN logits: blank text or a sampler error
        raise CheckpointError(
            f"{path} holds NaN or infinite weights ({len(broken)} tensor(s), e.g. "
            f"{broken[:2]}): the file is damaged, or the run that wrote it diverged"
        )


def _replace(path: Path, write: Callable[[Path], object]) -> None:
    """Write a file beside itself, then rename it into place (a snapshot, the loss plot)."""
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def _flushed(path: Path) -> None:
    """Force a file (or directory entry) to disk, so a rename after it publishes data that is
    really there after a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    out: Path,
    model: GPT,
    optimizer: torch.optim.Optimizer,
    batches: torch.Generator,
    config: dict[str, Any],
    state: dict[str, Any],
    *,
    fault: Callable[[str], None] | None = None,
    plot: bool = True,
) -> Path:
    """Write a checkpoint (the files of :mod:`qkv.training.loop`'s docstring) as a new
    generation of ``out`` and swap it in with one rename. Returns its directory. ``fault``
    (tests) is called with the name of each stage, so a test can stop a save anywhere.
    ``plot``: redraw ``loss.png`` (a tenth of a second; the loop redraws it at evaluations
    and at the end, not at every save of a run saving every step)."""
    from safetensors.torch import save_file, save_model

    at = fault or (lambda stage: None)
    out.mkdir(parents=True, exist_ok=True)
    number = max([int(p.name.split("-")[2]) for p in out.glob("gen-*-*")] + [-1]) + 1
    gen = out / f"gen-{state['step']:06d}-{number}"
    for stale in out.glob(".gen-*.partial"):  # what a save killed half-way left
        shutil.rmtree(stale, ignore_errors=True)
    part = out / f".{gen.name}.partial"
    part.mkdir()
    at("begin")
    meta = {"step": str(state["step"])}
    save_model(model, str(part / "model.safetensors"), metadata=meta)
    at("model")
    tensors = {"rng.torch": torch.get_rng_state(), "rng.batches": batches.get_state()}
    index = {id(p): i for i, p in enumerate(model.parameters())}
    for group in optimizer.param_groups:
        for p in group["params"]:
            for name, value in optimizer.state.get(p, {}).items():
                tensors[f"adamw.{index[id(p)]}.{name}"] = (
                    value.reshape(-1) if value.ndim == 0 else value
                )
    save_file(tensors, str(part / "optimizer.safetensors"), metadata=meta)
    at("optimizer")
    (part / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (part / "state.json").write_text(json.dumps(state) + "\n")
    at("json")
    for name in _FILES:
        _flushed(part / name)
    os.replace(part, gen)  # the generation, whole, under its name
    _flushed(out)
    at("generation")
    link = out / f".{LATEST}.new"
    if link.is_symlink() or link.exists():
        link.unlink()
    os.symlink(gen.name, link)
    latest = out / LATEST
    if latest.is_dir() and not latest.is_symlink():  # a run copied with cp -rL: a folder
        # moved aside as a generation (removed below); only this first save after the copy
        # has an instant with no `latest`
        os.replace(latest, out / f"gen-copied-{number}")
    os.replace(link, latest)  # the one rename that swaps the checkpoint in
    _flushed(out)
    at("swapped")
    for old in out.glob("gen-*-*"):  # the previous generations, now that this one is whole
        if old != gen:
            shutil.rmtree(old, ignore_errors=True)
    for legacy in _FILES:  # a checkpoint from before generations, now superseded
        (out / legacy).unlink(missing_ok=True)
    at("cleaned")
    if plot:
        _plot(out, state["history"], "token" if config["train"]["data"] != "text" else "byte")
    return gen


def _load_training_state(
    out: Path, model: GPT, optimizer: torch.optim.Optimizer, batches: torch.Generator
) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    out = checkpoint_dir(out)
    step = str(_read_json(out / "state.json").get("step"))
    for name in ("model.safetensors", "optimizer.safetensors"):
        try:
            with safe_open(str(out / name), "pt") as f:
                found = (f.metadata() or {}).get("step")
        except FileNotFoundError:
            raise CheckpointError(f"no checkpoint: {out / name} is missing") from None
        except Exception as err:
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise CheckpointError(f"{out / name} is damaged or truncated ({first})") from None
        if found != step:
            raise CheckpointError(
                f"{out / name} does not belong to step {step} of state.json: "
                "the checkpoint is inconsistent"
            )
    _load_weights(model, out / "model.safetensors")
    tensors = load_file(str(out / "optimizer.safetensors"))
    torch.set_rng_state(tensors.pop("rng.torch"))
    batches.set_state(tensors.pop("rng.batches"))
    params = list(model.parameters())
    for key, value in tensors.items():
        _, i, name = key.split(".")
        p = params[int(i)]
        optimizer.state[p][name] = value.reshape(()) if name == "step" else value


def load_checkpoint(path: str | Path, step: int | None = None) -> GPT:
    """The trained :class:`qkv.models.GPT` of a checkpoint directory, in eval mode. With
    ``step``, the snapshot kept at that step instead."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"no checkpoint: {str(path)!r} is not a directory")
    files = checkpoint_dir(path)
    config = _read_json(files / "config.json")
    try:
        model = GPT(GPTConfig.from_dict(config["model"]))
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(
            f"{files / 'config.json'} is damaged: no valid model configuration ({err})"
        ) from None
    weights = files / "model.safetensors"
    if step is not None:
        kept = dict(snapshots(path))
        if step not in kept:
            raise ValueError(
                f"{path} kept no snapshot at step {step}; it has {sorted(kept) or 'none'}"
            )
        weights = kept[step]
    _load_weights(model, weights)
    return model.eval()


def _plot(out: Path, history: list[dict[str, float]], unit: str = "byte") -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(
        [h["step"] for h in history], [h["loss"] for h in history], lw=0.8, alpha=0.6, label="train"
    )
    val = [h for h in history if "val_loss" in h]
    ax.plot([h["step"] for h in val], [h["val_loss"] for h in val], "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel(f"loss (nats per {unit})")
    ax.grid(alpha=0.3)
    scored = [h for h in history if "induction" in h]
    if scored:  # the induction experiment: the best head's score on a second axis
        right = ax.twinx()
        right.plot(
            [h["step"] for h in scored],
            [h["induction"] for h in scored],
            "s-",
            color="tab:green",
            ms=3,
            label="induction score",
        )
        right.set_ylabel("best induction score")
        right.set_ylim(0, 1)
        fig.legend(loc="upper right", bbox_to_anchor=(0.85, 0.9))
    else:
        ax.legend()
    fig.tight_layout()
    _replace(out / "loss.png", lambda p: fig.savefig(p, format="png", dpi=100))
    plt.close(fig)
