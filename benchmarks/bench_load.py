"""The headline calls on a quiet machine and on a busy one (issue 25's figures).

    python benchmarks/bench_load.py [--rounds 7] [--busy 2] [--T 8192]
    python benchmarks/bench_load.py --parts    # where the window forward's time goes
    python benchmarks/bench_load.py --isa avx2 # float32 on the native AVX2 step
    python benchmarks/bench_load.py --only +alibi  # the cases whose name holds "+alibi"

Each case — ``sliding_window(256)`` at T (B = 1, H = 8, D = 64) forward and forward +
backward, float32 and bfloat16 (float32 also with ``Tuning.native`` off: torch's flash
kernel call by call, what float32 ran before the native kernel took it), and causal at
T = 4096 through the tiled kernel (``auto`` gives it to SDPA), and the window with Gemma 2's
soft-cap and with ALiBi (native, and the PyTorch loop; SDPA times the plain window) — runs
through
``qkv.attention`` and through torch's SDPA (the dense bool mask for the window,
``is_causal`` for causal), first on a quiet machine, then while ``--busy`` CPU-bound
processes (a Python busy loop each) run beside it. Medians of interleaved rounds; the
slowdown of each is busy ÷ quiet, and the table's last column is qkv's slowdown ÷ SDPA's
(the issue's target: ≤ 1.25). torch keeps its default thread count. Name the CPU beside
the figures (``lscpu``). ``--isa avx2`` runs the float32 cases alone, on the native
kernel's AVX2 step (what a CPU without AVX-512 runs; ``qkv.kernels.tiled.steps.use_isa``);
add ``ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2`` to the
environment to hold torch (SDPA, and the "native off" rows) to AVX2 as well.
"""

import argparse
import functools
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

import qkv

H, D = 8, 64


def cases(T: int, dtypes=(torch.float32, torch.bfloat16)):
    """name -> (qkv call, SDPA call), each a function of nothing that runs one pass."""
    g = torch.Generator().manual_seed(0)
    out: dict = {}
    window = qkv.masks.sliding_window(256)
    for dtype in dtypes:
        q, k, v = (torch.randn(1, H, T, D, generator=g).to(dtype) for _ in range(3))
        for native in (True, False) if dtype == torch.float32 else (True,):
            name = str(dtype).removeprefix("torch.") + ("" if native else " (native off)")
            ours = functools.partial(_qkv, mask=window, native=native)
            _window(out, f"sliding_window(256) T={T} {name}", ours, q, k, v)
    # Gemma 2's soft-cap and ALiBi on the window: the native kernel applies them (the loop,
    # native off); SDPA times the plain window as the baseline.
    q, k, v = (torch.randn(1, H, T, D, generator=g) for _ in range(3))
    mods = {
        "softcap(50)": qkv.scores.softcap(50.0),
        "alibi": qkv.scores.alibi(qkv.scores.alibi_slopes(H)),
    }
    for mod_name, mod in mods.items():
        for native in (True, False):
            name = f"sliding_window(256)+{mod_name} T={T} float32" + ("" if native else " (loop)")
            ours = functools.partial(_qkv, mask=window, native=native, score_mod=mod)
            _window(out, name, ours, q, k, v)
    q, k, v = (torch.randn(1, H, 4096, D, generator=g) for _ in range(3))
    causal = functools.partial(_qkv, mask=qkv.masks.causal(), backend="tiled")
    out["causal T=4096 float32 forward (tiled)"] = (
        lambda: causal(q, k, v),
        lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
    )
    out["causal T=4096 float32 fwd+bwd (tiled)"] = (
        _backward(causal, q, k, v),
        _backward(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), q, k, v),
    )
    return out


def _window(out: dict, name: str, ours, q, k, v) -> None:
    """A window case, forward and forward + backward, beside SDPA with the dense mask."""
    dense = qkv.masks.sliding_window(256).dense(1, 1, q.shape[2], k.shape[2]).contiguous()

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=dense)

    out[f"{name} forward"] = (lambda: ours(q, k, v), lambda: sdpa(q, k, v))
    out[f"{name} fwd+bwd"] = (_backward(ours, q, k, v), _backward(sdpa, q, k, v))


def _qkv(q, k, v, *, mask, native=True, backend="auto", score_mod=None):
    with qkv.tuned(native=native):
        return qkv.attention(q, k, v, mask=mask, backend=backend, score_mod=score_mod)


def _backward(fn, q, k, v):
    xs = [x.detach().requires_grad_() for x in (q, k, v)]

    def run():
        out = fn(*xs)
        out.float().sum().backward()
        for x in xs:
            x.grad = None

    return run


def measure(calls, rounds: int) -> dict[str, float]:
    """Median seconds of each call over interleaved rounds (after one warm-up round)."""
    times: dict[str, list[float]] = {n: [] for n in calls}
    names = list(calls)
    for r in range(rounds + 1):
        for name in names if r % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            calls[name]()
            if r:
                times[name].append(time.perf_counter() - t0)
    return {n: statistics.median(t) for n, t in times.items()}


def parts(T: int) -> dict[str, object]:
    """The native window forward's pieces, float32 and bfloat16, each timed alone: the whole
    ``qkv.attention`` call, the dispatch, packing K (and V), the kernel's one call over the
    prepared jobs, and bfloat16's rounding of the output."""
    from qkv.kernels.tiled import flash, native, scratch
    from qkv.kernels.tiled.plan import _blocked

    def transient_pack(k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> object:
        scratch.start()  # in the thread's scratch buffer, as the call packs
        return native.pack(k, v, dtype, transient=True)

    window, out = qkv.masks.sliding_window(256), {}
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = (torch.randn(1, H, T, D).to(dtype) for _ in range(3))
        seen = []
        real = flash.fused_forward
        flash.fused_forward = lambda c, **kw: seen.append(c) or real(c, **kw)
        try:
            qkv.attention(q, k, v, mask=window)
        finally:
            flash.fused_forward = real
        c = seen[0]
        q5, o, lse = _blocked(c.q, H), torch.empty(1, H, 1, T, D), torch.empty(1, H, 1, T)
        jobs = flash.native_jobs(c.plan, q5, o, lse, c.tiles, {})
        computed = torch.float32 if c.path == "tiled-native-widen" else dtype  # as the call
        packed, name = native.pack(c.k, c.v, computed), str(dtype).removeprefix("torch.")
        out[f"{name} attention"] = lambda q=q, k=k, v=v: qkv.attention(q, k, v, mask=window)
        out[f"{name} dispatch"] = lambda q=q, k=k, v=v: qkv.dispatch(q, k, v, mask=window)
        out[f"{name} pack"] = lambda c=c, d=computed: transient_pack(c.k, c.v, d)
        out[f"{name} kernel"] = lambda j=jobs, p=packed, c=c: native.attend_many(j, p, c.scale)
        if dtype != torch.float32:
            out[f"{name} output rounding"] = lambda o=o, d=dtype: o.to(d)
    return out


def busy(n: int) -> list[subprocess.Popen]:
    """n CPU-bound processes (a Python busy loop each)."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--busy", type=int, default=2)
    parser.add_argument("--T", type=int, default=8192)
    parser.add_argument("--parts", action="store_true", help="time the forward's pieces")
    parser.add_argument("--isa", choices=["", "avx2"], default="", help="pin float32's step")
    parser.add_argument("--only", default="", help="the cases whose name holds this text")
    args = parser.parse_args()
    from qkv.kernels.tiled import steps

    with steps.use_isa(args.isa):
        run(args, steps.isa())


def run(args, isa: str) -> None:
    calls = {}
    if args.parts:
        calls = parts(args.T)
    dtypes = (torch.float32,) if args.isa else (torch.float32, torch.bfloat16)
    for name, (ours, sdpa) in ({} if args.parts else cases(args.T, dtypes)).items():
        if args.only in name:
            calls[f"qkv|{name}"], calls[f"sdpa|{name}"] = ours, sdpa
    quiet = measure(calls, args.rounds)
    load_quiet = os.getloadavg()[0]
    others = busy(args.busy)
    try:
        time.sleep(2.0)
        loaded = measure(calls, args.rounds)
        load_busy = os.getloadavg()[0]
    finally:
        for p in others:
            p.kill()
    print(
        f"torch threads {torch.get_num_threads()}, {args.busy} busy processes; load average "
        f"{load_quiet:.1f} quiet, {load_busy:.1f} busy; medians of {args.rounds} rounds; "
        f"native float32 step: {isa or 'none'}; torch: {torch.backends.cpu.get_cpu_capability()}"
    )
    if args.parts:
        print("| piece | quiet | busy | slowdown |")
        print("|---|---|---|---|")
        for name in calls:
            a, b = quiet[name], loaded[name]
            print(f"| {name} | {a * 1e3:.1f} ms | {b * 1e3:.1f} ms | {b / a:.2f}× |")
        return
    print(
        "| case | qkv quiet | qkv busy | qkv slowdown | SDPA quiet | SDPA busy | SDPA slowdown "
        "| qkv ÷ SDPA slowdown |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name in cases_names(calls):
        a, b = quiet[f"qkv|{name}"], loaded[f"qkv|{name}"]
        c, d = quiet[f"sdpa|{name}"], loaded[f"sdpa|{name}"]
        print(
            f"| {name} | {a * 1e3:.0f} ms | {b * 1e3:.0f} ms | {b / a:.2f}× | {c * 1e3:.0f} ms "
            f"| {d * 1e3:.0f} ms | {d / c:.2f}× | {(b / a) / (d / c):.2f} |"
        )


def cases_names(calls) -> list[str]:
    return [n.removeprefix("qkv|") for n in calls if n.startswith("qkv|")]


if __name__ == "__main__":
    main()
