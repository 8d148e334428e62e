"""The induction experiment's figures (docs/induction.md), from a run of
``qkv train --preset induction``:

    qkv train --preset induction --out runs/induction      # ~N minutes here
    python benchmarks/induction.py runs/induction            # the table and two PNGs

Prints the transition (the first evaluation whose best induction score reaches 0.4: its step
and the run's wall time there) and writes docs/induction-loss.png (the loss with the best
head's induction score), docs/induction-head.png (that head's pattern on a repeated random
segment, at the first snapshot and at the end) and docs/viewer.png (`qkv view` of the run in
headless Chromium, the best head clicked and a token of the second copy hovered).
"""

import sys
from pathlib import Path

from qkv.heads import head_scores, repeated_tokens, run
from qkv.training import load_checkpoint, read_state, snapshots

DOCS = Path(__file__).resolve().parent.parent / "docs"
THRESHOLD = 0.4


def main(out: Path) -> None:
    state = read_state(out)
    history = state["history"]
    evals = [h for h in history if "induction" in h]
    first = next((h for h in evals if h["induction"] >= THRESHOLD), None)
    seconds_per_step = state["seconds"] / state["step"]
    model = load_checkpoint(out)
    scores = head_scores(model, batch=64, seed=1)  # fresh held-out sequences
    best = int(scores["induction"].argmax())
    layer, head = divmod(best, scores["induction"].shape[1])
    print(
        f"run: {state['step']} steps in {state['seconds']:.0f} s "
        f"({seconds_per_step * 1e3:.0f} ms/step, evaluations included)"
    )
    if first is None:
        print(f"no evaluation reached an induction score of {THRESHOLD}")
    else:
        print(
            f"transition: induction score {first['induction']:.2f} >= {THRESHOLD} at step "
            f"{first['step']} (~{first['step'] * seconds_per_step:.0f} s into the run)"
        )
    print(
        f"final, 64 held-out sequences: best head layer {layer} head {head}: "
        + ", ".join(f"{k} {v[layer, head]:.2f}" for k, v in scores.items())
    )
    print(
        "every head's induction score:",
        [[round(x, 2) for x in r] for r in scores["induction"].tolist()],
    )
    _plot_loss(evals, history)
    _plot_head(out, model, layer, head)
    _screenshot(out, layer, head)


def _screenshot(out, layer, head) -> None:
    import subprocess
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from browser import Browser

    page = Path(tempfile.mkdtemp()) / "view.html"
    subprocess.run(["qkv", "view", "--checkpoint", str(out), "--out", str(page)], check=True)
    with Browser(width=1300, height=900) as b:
        b.open(page)
        b.click(f"#qkv-cell-{layer}-{head}")
        b.hover('.qkv-tok[data-i="45"]')
        (DOCS / "viewer.png").write_bytes(b.screenshot())


def _plot_loss(evals, history) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.plot(
        [h["step"] for h in history],
        [h["loss"] for h in history],
        lw=0.6,
        alpha=0.5,
        label="training loss",
    )
    ax.plot(
        [h["step"] for h in evals],
        [h["val_loss"] for h in evals],
        "o-",
        ms=3,
        label="held-out loss",
    )
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per token)")
    right = ax.twinx()
    right.plot(
        [h["step"] for h in evals],
        [h["induction"] for h in evals],
        "s-",
        ms=3,
        color="tab:green",
        label="best induction score",
    )
    right.axhline(THRESHOLD, color="tab:green", lw=0.6, ls="--")
    right.set_ylim(0, 1)
    right.set_ylabel("best induction score")
    fig.legend(loc="upper center", ncol=3, fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout(rect=(0, 0, 1, 0.92))
    fig.savefig(DOCS / "induction-loss.png", dpi=110)
    plt.close(fig)


def _plot_head(out, model, layer, head) -> None:
    from matplotlib.figure import Figure

    kept = snapshots(out)
    early = load_checkpoint(out, kept[0][0]) if kept else None
    L = 16
    tokens = repeated_tokens(model.config.vocab_size, L, batch=1, seed=2)
    models = ([(f"step {kept[0][0]}", early)] if early is not None else []) + [
        (f"step {read_state(out)['step']}", model)
    ]
    fig = Figure(figsize=(4.2 * len(models), 4.2), layout="constrained")
    axes = fig.subplots(1, len(models), squeeze=False)[0]
    for ax, (name, m) in zip(axes, models):
        w = run(m, tokens)[layer].weights()[0, head]  # (T, T)
        ax.imshow(w.numpy(), cmap="viridis", vmin=0, vmax=1)
        ax.set_title(f"layer {layer} head {head}, {name}")
        ax.set_xlabel("key")
        ax.set_ylabel("query")
        ax.axhline(L - 0.5, color="white", lw=0.5)
        ax.axvline(L - 0.5, color="white", lw=0.5)
    fig.suptitle(
        f"a random segment of {L} tokens, then the same again: the induction "
        "stripe sits one right of the duplicate diagonal",
        fontsize=9,
    )
    fig.savefig(DOCS / "induction-head.png", dpi=110)


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/induction"))
