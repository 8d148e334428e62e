"""The benchmark harness: its memory probe and the ratios it reports (timings themselves
are never asserted)."""

import math

import pytest
import torch

from qkv import bench
from qkv.cli import main


def result(candidate, median_s, mask="sliding_window", **kw):
    return bench.Result("float32", 4096, mask, "fwd", candidate, median_s, median_s,
                        kw.pop("peak_mb", 10.0), **kw)


def test_table_ratios_come_from_the_same_run():
    rows = [result("qkv auto", 0.05), result("qkv tiled", 0.04), result("sdpa dense mask", 0.32),
            result("flex (compiled)", 0.02), result("naive torch", 1.0),
            result("flex (compiled)", math.nan, mask="prefix_lm", error="InductorError: x"),
            result("qkv tiled", 0.2, mask="prefix_lm")]
    table = bench.table(rows).splitlines()
    window = next(line for line in table if "| sliding_window |" in line)
    assert "| 8.0× |" in window  # 0.32 / 0.04: sdpa dense over tiled
    assert "| 2.00 |" in window  # tiled / flex
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
