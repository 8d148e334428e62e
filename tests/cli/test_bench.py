"""The benchmark harness: its memory probe and the ratios it reports (timings themselves
are never asserted)."""

import math

import pytest
import torch

from qkv.cli import bench, main


def result(candidate, median_s, mask="sliding_window", **kw):
    return bench.Result(
        "float32", 4096, mask, "fwd", candidate, median_s, median_s, kw.pop("peak_mb", 10.0), **kw
    )


def test_table_ratios_come_from_the_same_run():
    rows = [
        result("qkv auto", 0.05),
        result("qkv tiled", 0.04),
        result("sdpa dense mask", 0.32),
        result("flex (compiled)", 0.02),
        result("qkv flex", 0.021),
        result("naive torch", 1.0),
        result("flex (compiled)", math.nan, mask="prefix_lm", error="InductorError: x"),
        result("qkv tiled", 0.2, mask="prefix_lm"),
    ]
    table = bench.table(rows).splitlines()
    window = next(line for line in table if "| sliding_window |" in line)
    assert "| 8.0× |" in window  # 0.32 / 0.04: sdpa dense over tiled
    assert "| 2.00 |" in window  # tiled / flex
    assert "| 1.05 |" in window  # qkv's flex backend / hand-written Flex
    assert "| 0.16 |" in window  # auto / the best sdpa that ran
    prefix = next(line for line in table if "| prefix_lm |" in line)
    assert "failed" in prefix and "nan" not in prefix


def test_peak_rss_sees_a_fresh_allocation():
    with bench.PeakRSS() as mem:
        x = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
        del x
    assert mem.above >= 60 * 2**20 and mem.process >= mem.above


def test_qkv_bench_is_reachable_from_the_cli(capsys):
    with pytest.raises(SystemExit) as info:
        main(["bench", "--help"])
    assert info.value.code == 0 and "--decode" in capsys.readouterr().out


def test_a_cpu_run_with_flex_times_qkv_flex_beside_hand_written_flex():
    q, k, v = (torch.randn(1, 2, 256, 16) for _ in range(3))
    names = bench.candidates(
        "sliding_window", 256, q, k, v, flex=True, naive_max_T=0, dense_max_T=0
    )
    assert {"qkv flex", "flex (compiled)"} <= set(names)
    q.requires_grad_()  # torch's Flex has no backward on CPU: neither is timed
    names = bench.candidates(
        "sliding_window", 256, q, k, v, flex=True, naive_max_T=0, dense_max_T=0
    )
    assert not {"qkv flex", "flex (compiled)"} & set(names)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without a GPU")
def test_device_cuda_without_a_gpu_is_a_clear_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(["bench", "--device", "cuda", "--T", "128"])
    assert info.value.code == 2 and "no CUDA device" in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bench_runs_on_cuda(capsys):
    main(
        [
            "bench",
            "--device",
            "cuda",
            "--T",
            "256",
            "--masks",
            "sliding_window",
            "--dtypes",
            "float32",
            "--repeats",
            "1",
            "--flex",
        ]
    )
    out = capsys.readouterr().out
    assert "| sliding_window |" in out and "failed" not in out


@pytest.mark.e2e
@pytest.mark.parametrize(
    "script,args,rows",
    [  # rows: header and rule, then one per call (the native ones where the CPU runs them)
        ("bench_peak.py", ["--T", "256", "--rounds", "1"], 2 + 3),
        ("bench_load.py", ["--T", "512", "--rounds", "1", "--busy", "1"], 2 + 8),
    ],
)
def test_issue_25_benchmarks_run_and_print_their_tables(script, args, rows):
    """The scripts behind docs/benchmarks.md's peak and busy-machine tables run at a small
    size and print a row per call (their timings are not asserted)."""
    import pathlib
    import subprocess
    import sys

    path = pathlib.Path(__file__).parents[2] / "benchmarks" / script
    done = subprocess.run(
        [sys.executable, str(path), *args], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    table = [line for line in done.stdout.splitlines() if line.startswith("|")]
    assert len(table) >= rows and all(line.count("|") >= 5 for line in table)


def test_kv_memory_reads_the_bytes_from_the_caches(capsys):
    """``qkv bench --kv-memory``: bytes per token and layer of each cache, from its buffers:
    MHA 2 · H · D values, GQA 2 · H_kv · D, MQA 2 · D, MLA r + rope, a window W/T of MHA's."""
    from qkv.cli.main import main as cli

    cli(["bench", "--kv-memory", "--H", "4", "--D", "8", "--kv-heads", "2",
         "--kv-lora-rank", "12", "--rope-dim", "4", "--window", "16", "--context", "64",
         "--layers", "2", "--dtypes", "float32"])  # fmt: skip
    rows = {
        line.split("|")[1].strip(): line.split("|")[2].strip()
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("| ") and "---" not in line and "bytes per token" not in line
    }
    assert rows == {
        "MHA (H_kv = 4)": "256",
        "GQA (H_kv = 2)": "128",
        "MQA (H_kv = 1)": "64",
        "MLA (r = 12, rope = 4)": "64",
        "MHA, sliding window of 16": "64 (over the sequence)",
    }


@pytest.mark.e2e
@pytest.mark.parametrize(
    "script,args,lines",
    [  # lines: what each prints per row
        ("bench_head_shapes.py", ["--T", "96", "--window", "16", "--rounds", "1"], 36),
        ("bench_mla.py", ["--context", "64", "--heads", "2", "--rounds", "2"], 3),
        ("bench_kv_quant.py", ["--only", "bytes"], 4),
        ("bench_pages.py", ["--batch", "4", "--tokens", "128", "--rounds", "1"], 8),
        ("bench_pages.py", ["--batch", "2", "--tokens", "64", "--rounds", "1", "--huge"], 4),
    ],
)
def test_the_head_shape_and_cache_benchmarks_run(script, args, lines):
    """The scripts behind docs/head-shapes.md run at a small size and print their rows
    (their timings are not asserted)."""
    import pathlib
    import subprocess
    import sys

    path = pathlib.Path(__file__).parents[2] / "benchmarks" / script
    done = subprocess.run(
        [sys.executable, str(path), *args], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if "×" in line]
    assert len(rows) >= lines, done.stdout


@pytest.mark.e2e
def test_the_streaming_paper_script_runs(tmp_path):
    """benchmarks/streaming_paper.py at a tiny size (two models of 4 steps, a stream of 300
    bytes): its two tables and the plot (the figures are docs/streaming.md's, not asserted)."""
    import pathlib
    import subprocess
    import sys

    path = pathlib.Path(__file__).parents[2] / "benchmarks" / "streaming_paper.py"
    plot = tmp_path / "s.png"
    args = ["--out", str(tmp_path / "runs"), "--steps", "4", "--stream", "300", "--plot", str(plot)]
    done = subprocess.run(
        [sys.executable, str(path), *args], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("| (") == 5 and "| 4 |" in done.stdout and plot.exists()
