"""Checkpoints and snapshots of a training run: what is written, how it is read back, and the
checks that a resumed run is the same run.

Legend: L layers."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..models import GPT, GPTConfig
from .presets import TrainConfig

_FILES = ("model.safetensors", "optimizer.safetensors", "config.json", "state.json")


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


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"no checkpoint: {path} is missing") from None
    except ValueError as err:
        raise ValueError(f"{path} is not valid JSON ({err})") from None


def _replace(path: Path, write: Callable[[Path], object]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def save_checkpoint(
    out: Path,
    model: GPT,
    optimizer: torch.optim.Optimizer,
    batches: torch.Generator,
    config: dict[str, Any],
    state: dict[str, Any],
) -> None:
    """Write the checkpoint files of :mod:`qkv.training.loop`'s docstring into ``out``."""
    from safetensors.torch import save_file, save_model

    meta = {"step": str(state["step"])}
    _replace(out / "model.safetensors", lambda p: save_model(model, str(p), metadata=meta))
    tensors = {"rng.torch": torch.get_rng_state(), "rng.batches": batches.get_state()}
    index = {id(p): i for i, p in enumerate(model.parameters())}
    for group in optimizer.param_groups:
        for p in group["params"]:
            for name, value in optimizer.state.get(p, {}).items():
                tensors[f"adamw.{index[id(p)]}.{name}"] = (
                    value.reshape(-1) if value.ndim == 0 else value
                )
    _replace(out / "optimizer.safetensors", lambda p: save_file(tensors, str(p), metadata=meta))
    _replace(out / "config.json", lambda p: p.write_text(json.dumps(config, indent=2) + "\n"))
    _replace(out / "state.json", lambda p: p.write_text(json.dumps(state) + "\n"))
    _plot(out, state["history"], "token" if config["train"]["data"] != "text" else "byte")


def _load_training_state(
    out: Path, model: GPT, optimizer: torch.optim.Optimizer, batches: torch.Generator
) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file, load_model

    step = str(_read_json(out / "state.json")["step"])
    for name in ("model.safetensors", "optimizer.safetensors"):
        with safe_open(str(out / name), "pt") as f:
            if (f.metadata() or {}).get("step") != step:
                raise ValueError(
                    f"{out / name} does not belong to step {step} of state.json: "
                    "the checkpoint is inconsistent"
                )
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
            raise ValueError(
                f"{path} kept no snapshot at step {step}; it has {sorted(kept) or 'none'}"
            )
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
