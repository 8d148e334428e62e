"""Benchmark qkv's attention against torch SDPA, naive PyTorch and (optionally) Flex
(``qkv bench``, or ``python benchmarks/bench_attention.py``).

Every number is measured in the same run: the median of ``--repeats`` timed calls after one
warm-up call, and the peak resident memory above what was resident just before the call
(the kernel's exact high-water mark, reset before each call). Ratios compare candidates of
one run.

    qkv bench --flex                     # the docs/benchmarks.md table
    qkv bench --T 1024 4096 --masks causal --repeats 5
    qkv bench --long                     # causal T=65536, H=2, fwd+bwd through tiled
    qkv bench --kv-memory                # cache bytes per token: MHA, GQA, MQA, MLA, window

Legend: B batch · H heads · T sequence length · D head dim.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from math import nan
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import masks
from ..functional import attention
from ..nn import MultiHeadAttention
from .args import Parser, positive
from .kv_memory import kv_memory


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        found = re.search(rf"{field}:\s+(\d+)", f.read())
    if found is None:
        raise RuntimeError(f"no {field} in /proc/self/status")
    return int(found.group(1)) * 1024


class PeakRSS:
    """Peak resident memory above the level at entry: the kernel's high-water mark
    (VmHWM), reset on entry by writing 5 to /proc/self/clear_refs (Linux)."""

    def __enter__(self) -> PeakRSS:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        self.base = _status("VmRSS")
        return self

    def __exit__(self, *exc: object) -> None:
        self.process = _status("VmHWM")  # the whole process: libraries, inputs, the call
        self.above = self.process - self.base


class PeakCUDA:
    """On a GPU: the peak of torch's CUDA allocator above what it held at entry, and its
    peak overall (what the device's memory is for), after the device finished its work."""

    def __enter__(self) -> PeakCUDA:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self.base = torch.cuda.memory_allocated()
        return self

    def __exit__(self, *exc: object) -> None:
        torch.cuda.synchronize()  # the call's kernels are asynchronous: wait for them
        self.process = torch.cuda.max_memory_allocated()
        self.above = self.process - self.base


@dataclass
class Result:
    dtype: str
    T: int
    mask: str
    pass_: str  # "fwd" or "fwd+bwd"
    candidate: str
    first_s: float
    median_s: float
    peak_mb: float  # resident memory above inputs, during the call
    error: str = ""  # why the candidate could not run, if it could not
    process_peak_mb: float = nan  # the process's peak resident memory during the call


MASK_NAMES: dict[str, Callable[[int], masks.Mask | None]] = {
    "none": lambda T: None,
    "causal": lambda T: masks.causal(),
    "sliding_window": lambda T: masks.sliding_window(256),
    "document": lambda T: masks.document(torch.arange(T) * 8 // T),
    "prefix_lm": lambda T: masks.prefix_lm(T // 4),
}


def make_mask(name: str, T: int) -> masks.Mask | None:
    return MASK_NAMES[name](T)


def candidates(
    name: str,
    T: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    flex: bool,
    naive_max_T: int,
    dense_max_T: int,
) -> dict[str, Callable[[], torch.Tensor]]:
    """What to time for one mask: qkv (auto and tiled) and the baselines that apply."""
    mask = make_mask(name, T)
    out: dict[str, Callable[[], torch.Tensor]] = {
        "qkv auto": lambda: attention(q, k, v, mask=mask),
    }
    if mask is not None:
        out["qkv tiled"] = lambda: attention(q, k, v, mask=mask, backend="tiled")
    if mask is None:
        out["sdpa"] = lambda: F.scaled_dot_product_attention(q, k, v)
    if name == "causal":
        out["sdpa is_causal"] = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if mask is not None and dense_max_T >= T:
        # The dense mask is built inside the call, as a user without qkv must do.
        out["sdpa dense mask"] = lambda: F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask.dense(1, 1, T, T)[0, 0]
        )
    if naive_max_T >= T:

        def naive() -> torch.Tensor:
            s = (q @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5
            if mask is not None:
                s = s.masked_fill(~mask.dense(1, 1, T, T), float("-inf"))
            return torch.softmax(s, dim=-1) @ v

        out["naive torch"] = naive
    cpu = q.device.type == "cpu"
    if flex and mask is not None and not (cpu and q.requires_grad):  # no backward on CPU
        out["qkv flex"] = lambda: attention(q, k, v, mask=mask, backend="flex")
        out["flex (compiled)"] = flex_candidate(mask, T, q, k, v)
    return out


def flex_candidate(
    mask: masks.Mask, T: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> Callable[[], torch.Tensor]:
    """Compiled FlexAttention. Its first call includes building the block mask and
    compiling, as a user meets them."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from ..kernels.flex import run_compiled

    compiled = torch.compile(flex_attention)
    state: dict[str, object] = {}

    def call() -> torch.Tensor:
        if "block_mask" not in state:
            state["block_mask"] = create_block_mask(
                lambda b, h, qi, ki: mask(b, h, qi, ki), 1, 1, T, T, device=q.device
            )
        return run_compiled(compiled, q, k, v, block_mask=state["block_mask"])

    return call


def measure(
    fn: Callable[[], torch.Tensor], backward: bool, repeats: int, leaves: list[torch.Tensor]
) -> tuple[float, float, float, float]:
    """(first call s, median of repeats s, peak MB above entry, process peak MB)."""

    def call() -> None:
        out = fn()
        if backward:
            out.backward(torch.ones_like(out))
            for x in leaves:
                x.grad = None
        del out

    times, peak, process = [], 0, 0
    on_gpu = leaves[0].device.type == "cuda"
    for _ in range(repeats + 1):
        with PeakCUDA() if on_gpu else PeakRSS() as mem:
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
        peak, process = max(peak, mem.above), max(process, mem.process)
    return times[0], statistics.median(times[1:]), peak / 2**20, process / 2**20


def run(args: argparse.Namespace) -> list[Result]:
    results = []
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        for T in args.T:
            for pass_ in args.passes:
                backward = pass_ == "fwd+bwd"
                g = torch.Generator().manual_seed(0)
                leaves = [
                    torch.randn(1, args.H, T, args.D, generator=g)
                    .to(device=args.device, dtype=dtype)
                    .requires_grad_(backward)
                    for _ in range(3)
                ]
                for name in args.masks:
                    for cand, fn in candidates(
                        name,
                        T,
                        *leaves,
                        flex=args.flex,
                        naive_max_T=args.naive_max_T,
                        dense_max_T=args.dense_max_T,
                    ).items():
                        try:
                            first, med, peak, proc = measure(fn, backward, args.repeats, leaves)
                            r = Result(
                                dtype_name,
                                T,
                                name,
                                pass_,
                                cand,
                                first,
                                med,
                                peak,
                                process_peak_mb=proc,
                            )
                        except Exception as err:  # e.g. a Flex compile error: report, go on
                            msg = f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
                            r = Result(dtype_name, T, name, pass_, cand, nan, nan, nan, msg)
                        results.append(r)
                        print(json.dumps(asdict(r)), flush=True)
    return results


def table(results: list[Result]) -> str:
    """Markdown: one row per (dtype, pass, T, mask), ratios against SDPA of the same run."""
    rows: dict[tuple[str, str, int, str], dict[str, Result]] = {}
    for r in results:
        rows.setdefault((r.dtype, r.pass_, r.T, r.mask), {})[r.candidate] = r
    lines = [
        "| dtype | pass | T | mask | qkv auto | qkv tiled | sdpa (fastest valid) | "
        "sdpa dense mask | naive | flex | qkv flex | tiled speed-up vs sdpa dense | "
        "tiled / flex | qkv flex / flex | auto / best sdpa | tiled first call | "
        "peak MB tiled / sdpa dense |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    fmt = lambda r: ("failed" if r.error else f"{r.median_s * 1e3:.0f} ms") if r else "—"  # noqa: E731
    for (dtype, pass_, T, mask), c in rows.items():
        ok = {name: r for name, r in c.items() if not r.error}  # ratios only of what ran
        sdpa = ok.get("sdpa is_causal") or ok.get("sdpa") or ok.get("sdpa dense mask")
        tiled, dense, auto = ok.get("qkv tiled"), ok.get("sdpa dense mask"), ok.get("qkv auto")
        speedup = f"{dense.median_s / tiled.median_s:.1f}×" if tiled and dense else "—"
        vs_sdpa = f"{auto.median_s / sdpa.median_s:.2f}" if auto and sdpa else "—"
        flex = ok.get("flex (compiled)")
        vs_flex = f"{tiled.median_s / flex.median_s:.2f}" if tiled and flex else "—"
        ours = ok.get("qkv flex")
        lowered = f"{ours.median_s / flex.median_s:.2f}" if ours and flex else "—"
        first = f"{tiled.first_s:.2f} s" if tiled else "—"
        mem = (
            f"{tiled.peak_mb:.0f} / {dense.peak_mb:.0f}"
            if tiled and dense
            else f"{tiled.peak_mb:.0f} / —"
            if tiled
            else "—"
        )
        lines.append(
            f"| {dtype} | {pass_} | {T} | {mask} | {fmt(auto)} | {fmt(tiled)} | "
            f"{fmt(sdpa)} | {fmt(dense)} | {fmt(c.get('naive torch'))} | "
            f"{fmt(c.get('flex (compiled)'))} | {fmt(c.get('qkv flex'))} | {speedup} | "
            f"{vs_flex} | {lowered} | {vs_sdpa} | {first} | {mem} |"
        )
    return "\n".join(lines)


def decode(lengths: list[int], repeats: int) -> str:
    """One decode step (T_q = 1, causal) against KV caches of each length: qkv.attention vs
    a bare SDPA call on the same tensors, for MHA (H = H_kv) and GQA (H = 32, H_kv = 8)."""
    lines = [
        "| L (cached tokens) | heads H / H_kv | cache read per step | qkv.attention | "
        "bare sdpa | qkv / sdpa | qkv through MultiHeadAttention + KVCache |",
        "|---|---|---|---|---|---|---|",
    ]
    D = 64
    for L in lengths:
        for H, H_kv in ((8, 8), (32, 32), (32, 8)):
            g = torch.Generator().manual_seed(0)
            q = torch.randn(1, H, 1, D, generator=g)
            k, v = (torch.randn(1, H_kv, L, D, generator=g) for _ in range(2))
            mask = masks.causal()
            ours = lambda: attention(q, k, v, mask=mask)  # noqa: E731
            bare = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=H_kv != H)  # noqa: E731
            mha = MultiHeadAttention(H * D, H * D, H, num_kv_heads=H_kv, causal=True)
            cache = mha.new_cache(1, L + 1)
            cache.keys[:, :, :L], cache.values[:, :, :L] = k, v
            x = torch.randn(1, 1, H * D, generator=g)

            def module_step() -> torch.Tensor:
                cache.length = L  # the same step each time: L cached, one appended
                with torch.no_grad():
                    return mha(x, cache=cache)

            t_ours, t_bare, t_mod = _interleaved([ours, bare, module_step], repeats)
            mb = 2 * L * H_kv * D * 4 / 2**20
            lines.append(
                f"| {L} | {H} / {H_kv} | {mb:.1f} MB | {t_ours * 1e3:.3f} ms | "
                f"{t_bare * 1e3:.3f} ms | {t_ours / t_bare:.2f} | "
                f"{t_mod * 1e3:.3f} ms |"
            )
            print(lines[-1], flush=True)
    return "\n".join(lines)


def _interleaved(fns: list[Callable[[], torch.Tensor]], repeats: int) -> list[float]:
    """Median time of each function, the functions taking turns within every repeat so
    that a drift in the machine's speed reaches all of them alike, in an order rotated at
    each repeat so that none always runs after the same one (whose memory traffic leaves
    the caches warm or cold for it)."""
    times: list[list[float]] = [[] for _ in fns]
    for fn in fns:
        fn()  # warm-up
    for r in range(repeats):
        for i in range(len(fns)):
            j = (i + r) % len(fns)
            t0 = time.perf_counter()
            fns[j]()
            times[j].append(time.perf_counter() - t0)
    return [statistics.median(ts) for ts in times]


def main(argv: list[str] | None = None) -> None:
    parser = Parser(
        prog="qkv bench",
        description="Time qkv against torch SDPA, naive PyTorch and Flex; ratios within one run.",
    )
    parser.add_argument(
        "--T",
        type=positive,
        nargs="+",
        default=[1024, 4096, 16384],
        help="sequence lengths T_q = T_k (default 1024 4096 16384)",
    )
    parser.add_argument(
        "--H", type=positive, help="heads (default 8; --kv-memory: 128, DeepSeek V3's)"
    )
    parser.add_argument(
        "--D", type=positive, help="head dim (default 64; --kv-memory: 128, DeepSeek V3's)"
    )
    parser.add_argument(
        "--dtypes",
        nargs="+",
        choices=["float32", "bfloat16", "float16", "float64"],
        help="dtypes to time (default float32 bfloat16; --kv-memory: bfloat16)",
    )
    parser.add_argument(
        "--masks",
        nargs="+",
        choices=list(MASK_NAMES),
        default=list(MASK_NAMES),
        help="masks to time (default: all)",
    )
    parser.add_argument(
        "--passes",
        nargs="+",
        default=["fwd", "fwd+bwd"],
        choices=["fwd", "fwd+bwd"],
        help="forward, or forward and backward",
    )
    parser.add_argument(
        "--repeats",
        type=positive,
        default=3,
        help="timed calls per candidate; the median is reported (default 3)",
    )
    parser.add_argument(
        "--naive-max-T",
        type=int,
        default=4096,
        help="longest T for the naive PyTorch baseline (default 4096)",
    )
    parser.add_argument(
        "--dense-max-T",
        type=int,
        default=16384,
        help="longest T for baselines that need a dense T x T mask (16384)",
    )
    parser.add_argument(
        "--flex",
        action="store_true",
        help="also time qkv's flex backend and hand-written compiled Flex",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="where the inputs live (default cpu); on cuda, memory is the CUDA allocator's peak",
    )
    parser.add_argument(
        "--long", action="store_true", help="only causal T=65536, H=2, fwd+bwd through tiled"
    )
    parser.add_argument(
        "--decode",
        action="store_true",
        help="only the decode-step table: KV caches of 1k, 8k and 32k tokens",
    )
    parser.add_argument(
        "--kv-memory",
        action="store_true",
        help="only the cache bytes per token of MHA, GQA, MQA, MLA and a sliding window, for "
        "the shape of --H, --D, --kv-heads, --kv-lora-rank, --rope-dim, --window, --layers, "
        "--context and the first of --dtypes (default: DeepSeek V3's, bfloat16)",
    )
    parser.add_argument("--kv-heads", type=positive, default=8, help="GQA's H_kv (default 8)")
    parser.add_argument("--kv-lora-rank", type=positive, default=512, help="MLA's r (512)")
    parser.add_argument("--rope-dim", type=positive, default=64, help="MLA's rotary key (64)")
    parser.add_argument("--window", type=positive, default=4096, help="window (4096)")
    parser.add_argument("--layers", type=positive, default=61, help="layers (61)")
    parser.add_argument("--context", type=positive, default=32768, help="tokens (32768)")
    parser.add_argument("--json", type=Path, help="append results as JSON lines here")
    parser.add_argument(
        "--from-json",
        type=Path,
        nargs="+",
        help="print the table of earlier runs' JSON lines; run nothing",
    )
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    if args.from_json:
        lines = [line for path in args.from_json for line in path.read_text().splitlines()]
        print(table([Result(**json.loads(line)) for line in lines if line.startswith("{")]))
        return
    if args.decode:
        print(decode([1024, 8192, 32768], max(args.repeats, 50)))
        return
    if args.kv_memory:
        dtype = getattr(torch, (args.dtypes or ["bfloat16"])[0])
        print(
            kv_memory(
                args.H or 128,
                args.D or 128,
                args.kv_heads,
                args.kv_lora_rank,
                args.rope_dim,
                args.window,
                args.layers,
                args.context,
                dtype,
            )
        )
        return
    args.H, args.D = args.H or 8, args.D or 64
    args.dtypes = args.dtypes or ["float32", "bfloat16"]
    if args.long:
        args.T, args.H, args.dtypes, args.masks, args.passes = (
            [65536],
            2,
            ["float32"],
            ["causal"],
            ["fwd+bwd"],
        )
        args.dense_max_T = args.naive_max_T = 0
    gpu = f", {torch.cuda.get_device_name()}" if args.device == "cuda" else ""
    print(
        f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}, threads {torch.get_num_threads()}{gpu}",
        flush=True,
    )
    results = run(args)
    if args.json:
        with args.json.open("a") as f:
            f.writelines(json.dumps(asdict(r)) + "\n" for r in results)
    print(table(results))


if __name__ == "__main__":
    main()
