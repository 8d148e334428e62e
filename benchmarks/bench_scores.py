"""Score modifications and torch.compile: the figures of docs/kernels.md.

    python benchmarks/bench_scores.py            # modification cost on the tiled kernel
    python benchmarks/bench_scores.py memory     # peak memory of the same calls (subprocesses)
    python benchmarks/bench_scores.py compile    # compiled vs eager MultiHeadAttention step
    python benchmarks/bench_scores.py sinks      # attention sinks' cost on the tiled kernel

Modifications: sliding_window(256) at T = 16K, float32, B = 1, H = 8, D = 64, forward, on
the tiled kernel: ALiBi + soft-capping against the same call without them, medians of
interleaved rounds (order alternating), ratio in the same run. Memory: each call in a fresh
process, peak resident memory above the process's baseline (inputs built). Compile: one
training step (forward, backward, AdamW) of a causal MultiHeadAttention with RoPE at
T = 1024, eager against torch.compile(fullgraph=True), after warm-up. Sinks: the same
window, forward and forward + backward (gradients to q, k, v and the sinks), float32 and
bfloat16, with per-head sinks against the same call without, interleaved rounds.
"""

import json
import statistics
import subprocess
import sys
import time

import torch

import qkv
from qkv import masks, scores

T, H, D, ROUNDS = 16384, 8, 64, 15


def _inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, H, T, D, generator=g) for _ in range(3)]


CASES = {
    "none": None,
    "alibi": scores.alibi(scores.alibi_slopes(H)),
    "softcap": scores.softcap(30.0),
    "alibi+softcap": scores.alibi(scores.alibi_slopes(H)).then(scores.softcap(30.0)),
}


def _call(q, k, v, mod):
    return qkv.attention(q, k, v, mask=masks.sliding_window(256), score_mod=mod, backend="tiled")


def modifications() -> None:
    q, k, v = _inputs()
    times = {name: [] for name in CASES}
    for r in range(ROUNDS):
        order = list(CASES) if r % 2 == 0 else list(reversed(CASES))
        for name in order:
            t0 = time.perf_counter()
            _call(q, k, v, CASES[name])
            times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["none"])
    print(
        f"| sliding_window(256), T={T}, H={H}, D={D}, float32, forward, tiled | median | "
        "÷ no modification |"
    )
    print("|---|---|---|")
    for name, ts in times.items():
        print(
            f"| {name} | {statistics.median(ts) * 1e3:.0f} ms | "
            f"{statistics.median(ts) / base:.2f} |"
        )


def _peak(name: str) -> None:
    def kb(field):
        return next(
            int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field)
        )

    q, k, v = _inputs()
    base = kb("VmRSS")
    _call(q, k, v, CASES[name])
    print(json.dumps({"case": name, "peak_mb": (kb("VmHWM") - base) / 1024}))


def memory() -> None:
    print(f"| sliding_window(256), T={T}, float32, forward | peak above baseline |")
    print("|---|---|")
    for name in CASES:
        out = subprocess.run(
            [sys.executable, __file__, "_peak", name], capture_output=True, text=True, check=True
        ).stdout
        r = json.loads(out.strip().splitlines()[-1])
        print(f"| {name} | {r['peak_mb']:.0f} MB |")
    scores_mb = H * T * T * 4 / 2**20
    print(f"(the (H, T, T) float32 score matrix alone would be {scores_mb:,.0f} MB)")


def compiled_step(rounds: int = 30) -> None:
    torch.manual_seed(0)
    E, B, Tc = 256, 4, 1024
    x = torch.randn(B, Tc, E)

    def make():
        torch.manual_seed(0)
        mha = qkv.MultiHeadAttention(E, E, num_heads=8, causal=True, rope=qkv.RoPE(E // 8))
        return mha, torch.optim.AdamW(mha.parameters(), lr=1e-3)

    steps = {}
    for name in ("eager", "compiled"):
        mha, opt = make()
        fwd = torch.compile(mha, fullgraph=True) if name == "compiled" else mha

        def step(fwd=fwd, opt=opt):
            opt.zero_grad(set_to_none=True)
            fwd(x).square().mean().backward()
            opt.step()

        t0 = time.perf_counter()
        step()
        print(f"{name}: first step {time.perf_counter() - t0:.1f} s", flush=True)
        for _ in range(3):
            step()
        steps[name] = step
    times = {name: [] for name in steps}
    for r in range(rounds):
        for name in list(steps) if r % 2 == 0 else list(reversed(steps)):
            t0 = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - t0)
    med = {n: statistics.median(ts) for n, ts in times.items()}
    ratio = [e / c for e, c in zip(times["eager"], times["compiled"])]
    q1, _, q3 = statistics.quantiles(ratio, n=4)
    print(
        f"| MultiHeadAttention step, B={B}, T={Tc}, E={E}, causal, RoPE | eager | compiled | "
        "eager ÷ compiled (IQR) |"
    )
    print("|---|---|---|---|")
    print(
        f"| forward + backward + AdamW | {med['eager'] * 1e3:.1f} ms | "
        f"{med['compiled'] * 1e3:.1f} ms | {med['eager'] / med['compiled']:.2f} "
        f"({q1:.2f}–{q3:.2f}) |"
    )


def sinks(rounds: int = 11) -> None:
    print(
        f"| sliding_window(256), T={T}, H={H}, D={D}, tiled | without | with sinks | "
        "with ÷ without (IQR) |"
    )
    print("|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = (x.to(dtype) for x in _inputs())
        logits = torch.randn(H)
        for grad in (False, True):

            def run(with_sinks, grad=grad, q=q, k=k, v=v):
                xs = [x.detach().requires_grad_(grad) for x in (q, k, v, logits)]
                out = qkv.attention(
                    *xs[:3],
                    mask=masks.sliding_window(256),
                    sinks=xs[3] if with_sinks else None,
                    backend="tiled",
                )
                if grad:
                    out.float().square().mean().backward()

            times: dict[bool, list[float]] = {False: [], True: []}
            run(False), run(True)  # warm-up
            for r in range(rounds):
                for case in (False, True) if r % 2 == 0 else (True, False):
                    t0 = time.perf_counter()
                    run(case)
                    times[case].append(time.perf_counter() - t0)
            ratio = [w / o for w, o in zip(times[True], times[False])]
            q1, _, q3 = statistics.quantiles(ratio, n=4)
            what = f"{str(dtype).removeprefix('torch.')}, {'fwd+bwd' if grad else 'forward'}"
            print(
                f"| {what} | {statistics.median(times[False]) * 1e3:.0f} ms | "
                f"{statistics.median(times[True]) * 1e3:.0f} ms | "
                f"{statistics.median(ratio):.3f} ({q1:.3f}–{q3:.3f}) |",
                flush=True,
            )


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["_peak"]:
        _peak(args[1])
    elif args == ["memory"]:
        memory()
    elif args == ["compile"]:
        compiled_step()
    elif args == ["sinks"]:
        sinks()
    else:
        modifications()
