"""The GPT's figures (docs/training.md): run on an otherwise idle machine.

    python benchmarks/bench_gpt.py train --out runs/bench     # ~15 min: the preset + xbow
    python benchmarks/bench_gpt.py figure --out runs/bench docs/gpt-loss.png
    python benchmarks/bench_gpt.py speed                      # ~5 min: step and decode ratios

``train`` trains the default preset and the same GPT with uniform attention (seed 001's
xbow) for the same steps, and reports both validation losses beside a byte-bigram model's,
all on the same held-out standard-library files (1024 fixed windows). ``speed`` reports
same-run ratios: a training step through qkv against the same model calling torch's SDPA
directly (interleaved medians), torch.compile against eager, and cached against uncached
generation (256-token prompt, 256 new tokens).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from qkv.models import GPT
from qkv.training import DEFAULT_PRESET, PRESETS, bigram_loss, evaluate, load_corpus, train

FINAL_WINDOWS = 1024


def run_train(out: Path, steps: int | None) -> dict:
    mcfg, tcfg = PRESETS[DEFAULT_PRESET]
    corpus = load_corpus()
    report = {"preset": DEFAULT_PRESET, "bigram_val": bigram_loss(corpus)}
    for name, cfg in (("gpt", mcfg), ("xbow", dataclasses.replace(mcfg, attention="uniform"))):
        t0 = time.perf_counter()
        result = train(out / name, preset=DEFAULT_PRESET, model_config=cfg, steps=steps)
        seconds = time.perf_counter() - t0
        final = evaluate(
            result.model, corpus.val, FINAL_WINDOWS, cfg.block_size, autocast=tcfg.autocast
        )
        report[name] = {
            "seconds": seconds,
            "steps": result.step,
            "val": final,
            "params": result.model.num_params(),
            "curve": [(h["step"], h["val_loss"]) for h in result.history if "val_loss" in h],
        }
        print(json.dumps({name: report[name]}), flush=True)
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def figure(report: dict, path: Path) -> None:
    """Validation curves of the GPT and of uniform attention, beside the bigram model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for name, label in (("gpt", "GPT (qkv attention)"), ("xbow", "same GPT, uniform attention")):
        steps, vals = zip(*report[name]["curve"])
        ax.plot(steps, vals, "o-", ms=3, label=f"{label}: {report[name]['val']:.3f}")
    ax.axhline(
        report["bigram_val"],
        color="grey",
        ls="--",
        label=f"byte bigram: {report['bigram_val']:.3f}",
    )
    ax.set_xlabel("step (16 x 256 bytes)")
    ax.set_ylabel("validation loss, nats per byte")
    ax.set_title(f"preset {report['preset']}: held-out standard-library files")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _sdpa_twin(model: GPT) -> GPT:
    """The same GPT whose attention calls torch's SDPA directly (is_causal=True)."""
    twin = GPT(model.config)
    twin.load_state_dict(model.state_dict())
    for block in twin.blocks:
        attn = block.attn

        def forward(
            x,
            context=None,
            *,
            mask=None,
            cache=None,
            layout=None,
            attn=attn,
            **_unused_context_parallel,
        ):  # one process: layout is None here
            if context is not None or mask is not None or cache is not None or layout:
                raise ValueError("the SDPA twin runs plain causal self-attention only")
            q, k, v = attn.project(x)
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1]
            )
            return attn.merge(out, like=x)

        attn.forward = forward
    return twin


def _step_timer(model: GPT, x: torch.Tensor, autocast: str | None):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> float:
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast == "bfloat16"):
            logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), x.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return time.perf_counter() - t0

    return step


def _interleaved(timers: dict, rounds: int) -> dict:
    """Median seconds per candidate, the candidates alternating (A B, then B A) so that
    neither always runs first; the median of the per-round ratios goes under "ratio"."""
    times = {name: [] for name in timers}
    for t in timers.values():  # warm-up (and compilation)
        t()
        t()
    names = list(timers)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            times[name].append(timers[name]())
    a, b = (times[n] for n in names)
    ratios = sorted(x / y for x, y in zip(a, b))
    out = {name: statistics.median(ts) for name, ts in times.items()}
    out["ratio"] = statistics.median(ratios)
    out["ratio_iqr"] = (ratios[len(ratios) // 4], ratios[3 * len(ratios) // 4])
    return out


def run_speed(rounds: int) -> dict:
    mcfg, tcfg = PRESETS[DEFAULT_PRESET]
    torch.manual_seed(0)
    model = GPT(mcfg)
    x = torch.randint(0, 256, (tcfg.batch_size, mcfg.block_size))
    med = _interleaved(
        {
            "qkv": _step_timer(model, x, tcfg.autocast),
            "sdpa": _step_timer(_sdpa_twin(model), x, tcfg.autocast),
        },
        rounds,
    )
    report = {
        "step_qkv_ms": med["qkv"] * 1e3,
        "step_sdpa_ms": med["sdpa"] * 1e3,
        "step_ratio_qkv_over_sdpa": med["ratio"],
        "step_ratio_iqr": med["ratio_iqr"],
    }
    print(json.dumps(report), flush=True)

    t0 = time.perf_counter()
    compiled = torch.compile(GPT(mcfg))
    compile_timer = _step_timer(compiled, x, tcfg.autocast)
    compile_timer()
    first = time.perf_counter() - t0
    med = _interleaved(
        {"eager": _step_timer(GPT(mcfg), x, tcfg.autocast), "compiled": compile_timer}, rounds
    )
    report.update(
        {
            "compile_first_step_s": first,
            "step_eager_ms": med["eager"] * 1e3,
            "step_compiled_ms": med["compiled"] * 1e3,
            "compile_speedup": med["ratio"],
            "compile_speedup_iqr": med["ratio_iqr"],
        }
    )
    print(json.dumps(report), flush=True)

    gen = GPT(dataclasses.replace(mcfg, block_size=512)).eval()
    prompt = torch.randint(0, 256, (1, 256), generator=torch.Generator().manual_seed(0))
    times = {True: [], False: []}
    for _ in range(3):
        for use_cache in (True, False):
            t0 = time.perf_counter()
            gen.generate(prompt, 256, temperature=0.0, use_cache=use_cache)
            times[use_cache].append(time.perf_counter() - t0)
    cached, uncached = statistics.median(times[True]), statistics.median(times[False])
    report.update(
        {
            "generate_cached_s": cached,
            "generate_uncached_s": uncached,
            "generate_speedup": uncached / cached,
            "threads": torch.get_num_threads(),
        }
    )
    print(json.dumps(report), flush=True)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    tr = sub.add_parser("train", help="train the default preset and the xbow baseline")
    tr.add_argument("--out", type=Path, default=Path("runs/bench"))
    tr.add_argument("--steps", type=int, help="fewer steps, for a quick check")
    fg = sub.add_parser("figure", help="draw the loss curves of a train run")
    fg.add_argument("--out", type=Path, default=Path("runs/bench"))
    fg.add_argument("png", type=Path)
    sp = sub.add_parser("speed", help="same-run ratios: qkv vs SDPA, compile, KV cache")
    sp.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    if args.what == "figure":
        figure(json.loads((args.out / "report.json").read_text()), args.png)
        return
    report = run_train(args.out, args.steps) if args.what == "train" else run_speed(args.rounds)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
