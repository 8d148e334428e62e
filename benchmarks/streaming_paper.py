"""The attention-sink paper (Xiao et al., *Efficient Streaming Language Models with Attention
Sinks*, 2023) measured on a CPU with qkv's GPT.

    python benchmarks/streaming_paper.py [--out runs/streaming] [--steps 600] [--stream 4096]
                                         [--plot docs/streaming.png]

Two models of ``cpu-10min``'s shape (4 layers, E = 128, RoPE, a context of 256 bytes) are
trained ``--steps`` steps on the standard library's sources: one plain, one with a learned
sink logit per head (``GPTConfig(attention_sinks=True)``, gpt-oss's form), each keeping a
snapshot every 100 steps. Then ``--stream`` bytes of held-out text — far past the 256 the
models saw — are read four ways, and each byte's negative log-likelihood kept:

(a) dense with re-computation: each byte predicted from the 256 before it, re-encoded;
(b) a window cache: ``qkv.nn.StreamingCache(sinks=0, window=256)``, one byte at a time;
(c) the window plus the first 4 bytes kept: ``StreamingCache(sinks=4, window=252)``;
(d) the sink model with a window cache alone (and, for reference, re-computed).

Printed: the perplexity of each over the bytes past the first 256 (where a cache evicts),
and over the whole stream; and, at each snapshot, the plain and the sink model's mean
attention weight on the first byte of 256-byte windows (rows past the 16th), through
``qkv.heads.record``. ``--plot`` draws each way's NLL along the stream (a rolling mean).
"""

import argparse
import dataclasses
import math
from pathlib import Path

import torch

import qkv
from qkv.models import GPT
from qkv.training import PRESETS, load_checkpoint, load_corpus, snapshots, train

CONTEXT = 256


def trained(out: Path, steps: int, sinks: bool) -> Path:
    """A model of cpu-10min's shape trained ``steps`` steps (kept in ``out``)."""
    model_config, train_config = PRESETS["cpu-10min"]
    model_config = dataclasses.replace(model_config, attention_sinks=sinks)
    train_config = dataclasses.replace(train_config, eval_interval=100, snapshots=True)
    if not (out / "latest").exists():
        train(out, steps=steps, model_config=model_config, train_config=train_config,
              progress=False)  # fmt: skip
    return out


def dense(model: GPT, ids: torch.Tensor) -> torch.Tensor:
    """(a): each byte's NLL from the CONTEXT bytes before it, re-encoded for each."""
    nll = torch.empty(len(ids) - 1)
    with torch.no_grad():
        first = torch.log_softmax(model(ids[None, :CONTEXT])[0], -1)
        n = min(CONTEXT, len(ids)) - 1
        nll[:n] = -first[torch.arange(n), ids[1 : n + 1]]
        ends = list(range(CONTEXT, len(ids)))  # predict ids[e] from ids[e - CONTEXT : e]
        for i in range(0, len(ends), 32):
            chunk = ends[i : i + 32]
            windows = torch.stack([ids[e - CONTEXT : e] for e in chunk])
            logp = torch.log_softmax(model(windows)[:, -1], -1)
            nll[torch.tensor(chunk) - 1] = -logp[torch.arange(len(chunk)), ids[chunk]]
    return nll


def streamed(model: GPT, ids: torch.Tensor, sinks: int) -> torch.Tensor:
    """(b), (c), (d): the stream read one byte at a time through streaming caches."""
    caches = model.new_streaming_caches(1, window=CONTEXT - sinks, sinks=sinks)
    nll = torch.empty(len(ids) - 1)
    with torch.no_grad():
        for t in range(len(ids) - 1):
            logp = torch.log_softmax(model(ids[None, t : t + 1], caches=caches)[0, -1], -1)
            nll[t] = -logp[ids[t + 1]]
    return nll


def first_byte_mass(model: GPT, windows: torch.Tensor) -> float:
    """The mean attention weight on a window's first byte, over every layer, head and row
    past the 16th."""
    with torch.no_grad(), qkv.heads.record() as calls:
        model(windows)
    rows = list(range(16, windows.shape[1]))
    return float(torch.stack([c.weights(rows=rows)[..., 0].mean() for c in calls]).mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/streaming"))
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--stream", type=int, default=4096)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    plain = load_checkpoint(trained(args.out / "plain", args.steps, False))
    sink = load_checkpoint(trained(args.out / "sink", args.steps, True))
    val = load_corpus().val
    ids = val[: args.stream].long()
    ways = {
        "(a) dense, re-computed": dense(plain, ids),
        "(b) window cache": streamed(plain, ids, 0),
        "(c) window + 4 first bytes": streamed(plain, ids, 4),
        "(d) learned sink, window cache": streamed(sink, ids, 0),
        "(d') learned sink, re-computed": dense(sink, ids),
    }
    print(f"## {args.stream} bytes of held-out text, models trained {args.steps} steps")
    print("| reading | perplexity past byte 256 | over the whole stream |")
    print("|---|---|---|")
    for name, nll in ways.items():
        past = math.exp(float(nll[CONTEXT:].mean()))
        print(f"| {name} | {past:.3f} | {math.exp(float(nll.mean())):.3f} |")
    windows = torch.stack([val[i : i + CONTEXT].long() for i in range(0, 16 * 4096, 4096)])
    print("\n## Mean attention weight on the first byte of a 256-byte window (rows 16..255)")
    print(
        f"(uniform over a row's keys would be {sum(1 / (r + 1) for r in range(16, 256)) / 240:.4f})"
    )
    print("| step | plain model | learned-sink model |")
    print("|---|---|---|")
    for (step, _), (_, _) in zip(snapshots(args.out / "plain"), snapshots(args.out / "sink")):
        a = first_byte_mass(load_checkpoint(args.out / "plain", step), windows)
        b = first_byte_mass(load_checkpoint(args.out / "sink", step), windows)
        print(f"| {step} | {a:.4f} | {b:.4f} |")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4))
        kernel = torch.ones(1, 1, 128) / 128
        for name, nll in ways.items():
            smooth = torch.nn.functional.conv1d(nll[None, None], kernel)[0, 0]
            ax.plot(range(64, 64 + len(smooth)), smooth.numpy(), label=name, lw=1.2)
        ax.axvline(CONTEXT, color="gray", ls=":", lw=1)
        ax.set_xlabel("byte of the stream")
        ax.set_ylabel("NLL (nats, mean of 128)")
        ax.set_title("Reading past the context: the attention-sink paper on a CPU model")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"\nplot written to {args.plot}")


if __name__ == "__main__":
    main()
