"""The induction-heads paper's claims checked on this machine (docs/induction.md, "The
induction-heads paper on a CPU"): small models trained from scratch, then measured.

    python benchmarks/induction_paper.py train runs/paper          # every run, seeds 0-2
    python benchmarks/induction_paper.py train runs/paper --only repeats-2l --seeds 0
    python benchmarks/induction_paper.py report runs/paper         # the claims table + figures

The runs are the presets ``paper-*`` of ``qkv train`` (:data:`qkv.training.PRESETS`), so each
is also one command: ``qkv train --preset paper-words-2l --seed 1 --out runs/paper/...``.
``report`` reads every run's ``state.json`` (the loss by position, the ICL score and the
head scores kept at each evaluation), ablates the final models' heads, prints the table of
claims and writes docs/paper-phase-change.png and docs/paper-loss-by-position.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from qkv.heads import ablate, copying_scores, icl_score, per_token_loss
from qkv.training import load_checkpoint, read_state, train, validation_windows

DOCS = Path(__file__).resolve().parent.parent / "docs"
#: run name -> the qkv train preset it is
RUNS = {
    "repeats-1l": "paper-repeats-1l",
    "repeats-2l": "induction",
    "words-1l": "paper-words-1l",
    "words-2l": "paper-words-2l",
    "words-2l-mlp": "paper-words-2l-mlp",
}
SEEDS = (0, 1, 2)
#: the prefix-matching (induction) score above which a head is called an induction head
THRESHOLD = 0.4
#: held-out windows the ablations are measured on
WINDOWS = 256


def icl(losses: torch.Tensor | list[float]) -> float:
    """The ICL score with its default band (each end averaged over ±P/32 positions)."""
    return icl_score(torch.as_tensor(losses, dtype=torch.float64))


def run_dir(root: Path, name: str, seed: int) -> Path:
    return root / name / f"seed-{seed}"


def do_train(root: Path, names: list[str], seeds: list[int]) -> None:
    for name in names:
        for seed in seeds:
            out = run_dir(root, name, seed)
            if (out / "latest").exists():
                print(f"{out}: done already", file=sys.stderr)
                continue
            t0 = time.monotonic()
            train(out, preset=RUNS[name], seed=seed, progress=False)
            print(f"{out}: {time.monotonic() - t0:.0f} s", file=sys.stderr)


def _best(scores: list[list[float]]) -> float:
    return max(max(row) for row in scores)


def summarise(out: Path) -> dict:
    """One run: when its induction heads formed and what changed around it."""
    state = read_state(out)
    evals = state["evaluations"]
    steps = [e["step"] for e in evals]
    pm = [_best(e["scores"]["induction"]) for e in evals]
    icls = [icl(e["token_loss"]) for e in evals]
    formed = next((i for i, s in enumerate(pm) if s >= THRESHOLD), None)
    return {
        "seconds": state["seconds"],
        "steps": steps,
        "prefix_matching": pm,
        "icl": icls,
        "val_loss": [e["val_loss"] for e in evals],
        "formed_at": None if formed is None else steps[formed],
        "icl_before": icls[formed - 1] if formed else None,
        "icl_after": icls[formed] if formed is not None else None,
        "icl_final": icls[-1],
        "pm_final": pm[-1],
        "history": state["history"],
    }


def ablation(out: Path, seed: int) -> dict:
    """The ICL score lost by zero-ablating the two heads with the highest prefix-matching
    score, against two other heads drawn at random (the same draw for every run of a seed)."""
    state = read_state(out)
    last = state["evaluations"][-1]["scores"]
    pm = torch.tensor(last["induction"])
    H = pm.shape[1]
    order = pm.flatten().argsort(descending=True).tolist()
    top = [divmod(i, H) for i in order[:2]]
    rest = order[2:]
    g = torch.Generator().manual_seed(seed)
    drawn = [divmod(rest[i], H) for i in torch.randperm(len(rest), generator=g)[:2].tolist()]
    model = load_checkpoint(out)
    copying = copying_scores(model)
    x, y = validation_windows(out, WINDOWS)
    base = icl(per_token_loss(model, x, y))
    # every head called an induction head, against as many of the others (all, if fewer)
    induction = [divmod(i, H) for i in order if pm.flatten()[i] >= THRESHOLD]
    others = [divmod(i, H) for i in order if pm.flatten()[i] < THRESHOLD]
    others = [others[i] for i in torch.randperm(len(others), generator=g)[: len(induction)]]
    found = {"icl": base, "top": top, "random": drawn, "induction": induction, "others": others}
    for name, heads in (
        ("top", top),
        ("random", drawn),
        ("induction", induction),
        ("others", others),
    ):
        if heads:
            with ablate(model, heads):
                found[f"icl_without_{name}"] = icl(per_token_loss(model, x, y))
    found["copying_top"] = [copying[layer, head].item() for layer, head in top]
    found["copying_rest"] = statistics.fmean(copying.flatten()[i].item() for i in rest)
    return found


def spread(values: list[float]) -> str:
    if not values:
        return "—"
    if len(values) == 1:
        return f"{values[0]:+.3f}"
    return f"{statistics.fmean(values):+.3f} ± {statistics.stdev(values):.3f} (n={len(values)})"


def do_report(root: Path) -> None:
    runs = {
        name: {
            seed: summarise(run_dir(root, name, seed))
            for seed in SEEDS
            if (run_dir(root, name, seed) / "latest").exists()
        }
        for name in RUNS
    }
    print(
        "run | seeds | minutes each | formed at step (PM >= 0.4) | ICL before → after | "
        "ICL final | best PM final"
    )
    for name, seeds in runs.items():
        if not seeds:
            continue
        s = list(seeds.values())
        formed = [r["formed_at"] for r in s]
        before = [r["icl_before"] for r in s if r["icl_before"] is not None]
        after = [r["icl_after"] for r in s if r["icl_after"] is not None]
        print(
            f"{name} | {len(s)} | {statistics.fmean(r['seconds'] for r in s) / 60:.1f} | "
            f"{formed} | {spread(before)} → {spread(after)} | "
            f"{spread([r['icl_final'] for r in s])} | "
            f"{spread([r['pm_final'] for r in s])}"
        )
    print()
    print("ablation (zero) of the 2 highest prefix-matching heads vs 2 random others")
    report = {}
    for name in ("repeats-2l", "words-2l", "words-2l-mlp"):
        for seed in runs.get(name, {}):
            a = ablation(run_dir(root, name, seed), seed)
            report[f"{name}/{seed}"] = a
            line = (
                f"{name} seed {seed}: ICL {a['icl']:+.3f}; without top {a['top']}: "
                f"{a['icl_without_top']:+.3f}; without random {a['random']}: "
                f"{a['icl_without_random']:+.3f}; copying of top "
                f"{[round(c, 3) for c in a['copying_top']]}, mean of the others "
                f"{a['copying_rest']:+.3f}"
            )
            if a["induction"]:
                line += (
                    f"; without all {len(a['induction'])} induction heads: "
                    f"{a['icl_without_induction']:+.3f}, without as many others "
                    f"{a['others']}: {a['icl_without_others']:+.3f}"
                )
            print(line)
    (root / "report.json").write_text(json.dumps({"runs": runs, "ablation": report}, default=str))
    _plot_phase_change(runs)
    _plot_loss_by_position(root, runs)


def _plot_phase_change(runs: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [n for n in ("words-1l", "words-2l", "repeats-1l", "repeats-2l") if runs.get(n)]
    fig, axes = plt.subplots(3, len(shown), figsize=(3.6 * len(shown), 7.2), squeeze=False)
    for col, name in enumerate(shown):
        for seed, r in runs[name].items():
            hist = r["history"]
            every = max(1, len(hist) // 400)  # the training loss averaged over this many steps
            losses = torch.tensor([h["loss"] for h in hist])
            kept = len(losses) // every * every
            axes[0, col].plot(
                [hist[i + every - 1]["step"] for i in range(0, kept, every)],
                losses[:kept].reshape(-1, every).mean(1).tolist(),
                lw=0.7,
                label=f"seed {seed}",
            )
            axes[1, col].plot(r["steps"], r["icl"], "o-", ms=2)
            axes[2, col].plot(r["steps"], r["prefix_matching"], "o-", ms=2)
        axes[0, col].set_title(name)
        axes[0, col].set_ylabel("training loss")
        axes[1, col].set_ylabel("ICL score")
        axes[1, col].axhline(0, color="k", lw=0.5)
        axes[2, col].set_ylabel("best prefix matching")
        axes[2, col].axhline(THRESHOLD, color="k", lw=0.5, ls="--")
        axes[2, col].set_ylim(0, 1)
        axes[2, col].set_xlabel("step")
        axes[0, col].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(DOCS / "paper-phase-change.png", dpi=100)
    plt.close(fig)


def _plot_loss_by_position(root: Path, runs: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [n for n in ("words-1l", "words-2l", "repeats-2l") if runs.get(n)]
    if not shown:
        return
    fig, axes = plt.subplots(1, len(shown), figsize=(5 * len(shown), 3.8), squeeze=False)
    for ax, name in zip(axes[0], shown):
        evals = read_state(run_dir(root, name, min(runs[name])))["evaluations"]
        picked = [*evals[:: max(1, len(evals) // 8)], evals[-1]]
        cmap = plt.get_cmap("viridis")
        # positions in bins of equal width on the log scale: one point per bin, the mean
        edges = sorted({round(v) for v in torch.logspace(0, 8, 25, base=2).tolist()})
        for i, e in enumerate(picked):
            t = torch.tensor(e["token_loss"])
            bins = [(a, b) for a, b in zip([0, *edges], edges) if b <= len(t) and b > a]
            ax.plot(
                [(a + b - 1) / 2 + 1 for a, b in bins],
                [t[a:b].mean().item() for a, b in bins],
                "o-",
                ms=2,
                lw=0.8,
                color=cmap(i / max(1, len(picked) - 1)),
                label=f"step {e['step']}",
            )
        ax.set_xscale("log")
        ax.set_xlabel("token index (mean over bins of equal log width)")
        ax.set_ylabel("held-out loss (nats)")
        ax.set_title(f"{name}, seed {min(runs[name])}")
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(DOCS / "paper-loss-by-position.png", dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    tr = sub.add_parser("train")
    tr.add_argument("root", type=Path)
    tr.add_argument("--only", nargs="*", choices=list(RUNS), default=list(RUNS))
    tr.add_argument("--seeds", nargs="*", type=int, default=list(SEEDS))
    rp = sub.add_parser("report")
    rp.add_argument("root", type=Path)
    args = parser.parse_args()
    if args.command == "train":
        do_train(args.root, args.only, args.seeds)
    else:
        do_report(args.root)


if __name__ == "__main__":
    main()
