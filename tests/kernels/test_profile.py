"""One kernel choice per machine: the native kernel's probe measured once, stored in the
cache directory, read by every process after; a re-measurement that keeps a choice near
its threshold; damaged files and unwritable directories measured around with one warning;
``qkv doctor``; and the profiled dispatch itself (the rest of the suite pins it)."""

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

import qkv
from qkv import masks
from qkv.kernels.tiled import choices, native, profile, steps

needs_native = pytest.mark.skipif(
    not steps.available(torch.float32), reason="the native kernel is not built here"
)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("QKV_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / profile.FILE


def counting(monkeypatch, *probes):
    """profile.measure giving these probes in turn, counting its calls."""
    calls = []

    def measure():
        calls.append(1)
        return probes[min(len(calls), len(probes)) - 1]

    monkeypatch.setattr(profile, "measure", measure)
    return calls


@needs_native
def test_measured_once_then_read_by_every_later_load(cache, monkeypatch):
    measured = profile.Probe(
        1.0, 2.0, 1.5, 5.0, 5.0, 6.0, 2.0, 2.0, 4.0, native_widen_ms=1.6, native32_second_ms=1.8,
        causal_native_ms=3.0, causal_sdpa_ms=4.0, causal_native_fwd_ms=1.0, causal_sdpa_fwd_ms=1.5,
        causal_native_second_ms=3.5, paged_dots_ms=0.5, paged_widen_ms=1.0, decode_paged_ms=0.5,
        decode_sdpa_ms=1.0, decode_paged_gqa_ms=0.5, decode_sdpa_gqa_ms=1.0,
    )  # fmt: skip
    calls = counting(monkeypatch, measured)
    found, where = profile.load()
    assert where.startswith("measured and stored") and found.float32 and found.faster
    again, where = profile.load()
    assert where.startswith("stored") and again == found and len(calls) == 1
    entry = json.loads(cache.read_text())["machines"][profile.machine_key()]
    assert entry["use_float32"] is True and entry["float32_ms"] == 2.0


@needs_native
def test_a_profile_is_kept_per_limit_on_torchs_matrix_products(cache, monkeypatch):
    """The probe times torch's kernels, and MKL runs AVX-512 code on an Intel CPU unless
    MKL_ENABLE_INSTRUCTIONS holds it back: a profile measured with torch held to AVX2 is not
    read by a process whose torch is not, and the other way round."""
    monkeypatch.delenv("MKL_ENABLE_INSTRUCTIONS", raising=False)
    free, held = profile.Probe(1.0, 2.0, 1.5), profile.Probe(1.0, 2.0, 3.0)
    calls = counting(monkeypatch, free)
    assert profile.load()[0].native32_ms == 1.5 and "mkl" not in profile.machine_key()
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    calls = counting(monkeypatch, held)
    found, where = profile.load()
    assert where.startswith("measured") and found.native32_ms == 3.0 and len(calls) == 1
    assert profile.machine_key().endswith(" mkl AVX2")
    monkeypatch.delenv("MKL_ENABLE_INSTRUCTIONS")
    found, where = profile.load()
    assert where.startswith("stored") and found.native32_ms == 1.5 and len(calls) == 1


def test_quantized_keys_take_dot_products_where_they_were_the_faster():
    """The paged decode step over int8 pages with bfloat16 dot products ÷ with widened
    keys decides; not measured (a CPU without AVX512-BF16): the kernel's own way."""
    assert profile.Probe(1.0, 1.0, paged_dots_ms=0.9, paged_widen_ms=1.0).paged_dots
    assert not profile.Probe(1.0, 1.0, paged_dots_ms=1.12, paged_widen_ms=1.0).paged_dots
    assert profile.Probe(1.0, 1.0).paged_dots
    # a re-measurement near the line keeps the stored choice; one clear of it changes it
    stored = profile.Probe(1.0, 1.0, use_paged_dots=False)
    near = profile.Probe(1.0, 1.0, paged_dots_ms=0.95, paged_widen_ms=1.0)
    assert not profile._decide(near, stored).use_paged_dots
    clear = profile.Probe(1.0, 1.0, paged_dots_ms=0.85, paged_widen_ms=1.0)
    assert profile._decide(clear, stored).use_paged_dots


def test_a_bfloat16_decode_step_takes_the_faster_kernel_with_gqa_and_without():
    """The paged kernel ÷ torch's, each way: under 1.0 the paged kernel; not measured (the
    paged kernel not built): the paged kernel, as with the probe off."""
    found = profile.Probe(
        1.0, 1.0, decode_paged_ms=0.62, decode_sdpa_ms=0.52,
        decode_paged_gqa_ms=0.25, decode_sdpa_gqa_ms=0.30,
    )  # fmt: skip
    assert not found.paged_decode(gqa=False) and found.paged_decode(gqa=True)
    assert profile.Probe(1.0, 1.0).paged_decode(gqa=False)
    decided = profile._decide(found, None)
    assert (decided.use_paged_decode, decided.use_paged_decode_gqa) == (False, True)


@needs_native
def test_a_first_measurement_near_a_threshold_is_the_median_of_three(cache, monkeypatch):
    """The first choice is the one the machine keeps: where a ratio lands within the margin
    of its threshold, two more measurements are made and each time's median decides."""
    near, slower = profile.Probe(1.0, 2.0, 2.1), profile.Probe(1.0, 2.0, 2.6)
    calls = counting(monkeypatch, near, slower)  # 1.05× (near 1.1), then 1.3× twice
    found = profile.load()[0]
    assert len(calls) == 3 and found.native32_ms == 2.6 and not found.float32
    calls = counting(monkeypatch, profile.Probe(1.0, 2.0, 1.0))  # 0.5×: far from it
    assert profile.load(remeasure=True)[0].float32 and len(calls) == 1


@needs_native
def test_a_remeasurement_near_the_threshold_keeps_the_stored_choice(cache, monkeypatch):
    counting(monkeypatch, profile.Probe(1.0, 2.0, 1.8), profile.Probe(1.0, 2.0, 2.3))
    assert profile.load()[0].float32  # 0.9× torch's time: native
    kept = profile.load(remeasure=True)[0]
    assert kept.native32_ms == 2.3 and kept.float32  # 1.15×: within the margin, kept
    counting(monkeypatch, profile.Probe(1.0, 2.0, 3.0))
    assert not profile.load(remeasure=True)[0].float32  # 1.5×: past it, changed


@needs_native
def test_the_half_precision_choice_keeps_its_stored_value_near_the_threshold(cache, monkeypatch):
    """Whether torch's half-precision backward runs on float32 copies: measured, stored,
    kept on a re-measurement within the margin, changed past it."""
    slow, near, fast = (profile.Probe(1.0, 2.0, 1.5, ms, ms, 10.0) for ms in (30.0, 10.5, 5.0))
    counting(monkeypatch, slow, near, fast)
    found = profile.load()[0]
    assert found.widen_bfloat16 and found.widens(torch.float16)
    assert profile.load(remeasure=True)[0].widens(torch.bfloat16)  # 1.05×: kept
    assert not profile.load(remeasure=True)[0].widens(torch.bfloat16)  # 0.5×: changed


@needs_native
def test_the_causal_choice_keeps_its_stored_value_near_the_threshold(cache, monkeypatch):
    """Whether a causal call with T_q == T_k runs natively, with a gradient and without:
    measured against torch's kernel, stored, kept on a re-measurement within the margin,
    changed past it; not measured (an older probe, no native kernel): torch's kernel."""

    def timed(native_ms, native_fwd_ms):
        return profile.Probe(
            1.0, 2.0, 1.5, causal_native_ms=native_ms, causal_sdpa_ms=10.0,
            causal_native_fwd_ms=native_fwd_ms, causal_sdpa_fwd_ms=10.0,
        )  # fmt: skip

    counting(monkeypatch, timed(7.0, 12.0), timed(9.5, 9.5), timed(12.0, 6.0))
    found = profile.load()[0]  # 0.7×: native; 1.2× forward: torch's
    assert found.use_causal and not found.use_causal_fwd and found.causal_ratio() == 0.7
    kept = profile.load(remeasure=True)[0]  # 0.95× both: within the margin, both kept
    assert kept.causal(backward=True) and not kept.causal(backward=False)
    changed = profile.load(remeasure=True)[0]  # 1.2× and 0.6×: past it, both changed
    assert not changed.causal(backward=True) and changed.causal(backward=False)
    assert not profile.Probe(1.0, 2.0, 1.5).causal()  # not measured


def test_half_precision_causal_is_held_against_the_path_it_takes_otherwise():
    """A half-precision causal call runs natively where the native pass beats the path half
    precision takes otherwise: torch's kernel on float32 copies (line CAUSAL_HALF_AT, as
    float32's time) or, where torch's kernel in the dtype was the faster, that kernel (the
    line scaled by its time ÷ the copies'). float32 keeps CAUSAL_AT."""

    def timed(native_ms, bf16_ms):  # causal 0.95 of torch's; torch's bfloat16 ÷ copies
        return profile.Probe(
            1.0, 2.0, 1.5, sdpa_bfloat16_ms=bf16_ms, sdpa_widened_ms=10.0,
            sdpa_bfloat16_fwd_ms=bf16_ms, sdpa_widened_fwd_ms=10.0,
            causal_native_ms=native_ms, causal_sdpa_ms=10.0,
            causal_native_fwd_ms=native_ms, causal_sdpa_fwd_ms=10.0,
        )  # fmt: skip

    slow = timed(9.5, 20.0)  # torch's bfloat16 2× its copies: bfloat16 runs on copies
    assert slow.causal_at(torch.float32) == choices.CAUSAL_AT and not slow.causal()
    assert slow.causal_at(torch.bfloat16) == choices.CAUSAL_HALF_AT
    assert slow.causal(torch.bfloat16, True) and slow.causal(torch.bfloat16, False)
    assert slow.causal(torch.float16, True)  # float16 not measured: as on copies
    fast = timed(9.5, 6.0)  # torch's bfloat16 0.6× its copies: the native pass must beat it
    assert fast.causal_at(torch.bfloat16) == pytest.approx(0.6 * choices.CAUSAL_HALF_AT)
    assert not fast.causal(torch.bfloat16) and timed(5.0, 6.0).causal(torch.bfloat16)
    decided = profile._decide(slow, None)  # stored per dtype, forward and with a gradient
    assert decided.use_causal_bfloat16 and decided.use_causal_float16_fwd
    assert decided.use_causal is False
    kept = profile._decide(timed(10.2, 20.0), decided)  # 1.02: within the margin, kept
    assert kept.use_causal_bfloat16 and kept.use_causal_float16
    assert not profile._decide(timed(11.5, 20.0), decided).use_causal_bfloat16  # past it


@needs_native
def test_the_steps_blocking_is_measured_kept_near_the_line_and_applied(cache, monkeypatch):
    """The probe times the float32 step in each of its blockings: the faster is stored
    (float32's choice then reads its time), kept on a re-measurement within the margin,
    changed past it, and the process's steps take it once the profile is read."""
    second_faster = profile.Probe(1.0, 2.0, 2.4, native32_second_ms=1.6)  # 0.67×
    near, slower = (profile.Probe(1.0, 2.0, 1.6, native32_second_ms=ms) for ms in (1.7, 2.4))
    counting(monkeypatch, second_faster, near, slower)
    found = profile.load()[0]
    assert found.use_blocking == 1 and found.float32_ratio() == 0.8 and found.float32
    assert profile.load(remeasure=True)[0].blocking == 1  # 1.06×: within the margin, kept
    assert profile.load(remeasure=True)[0].blocking == 0  # 1.5×: past it, changed
    assert profile.Probe(1.0, 2.0, 1.5).blocking == 0  # not measured (no step): the first
    monkeypatch.setattr(profile, "load", lambda: (second_faster, "stored"))
    profile.probe.cache_clear()
    try:
        assert profile.probe().blocking == 1 and steps.blocking() == 1
    finally:
        profile.probe.cache_clear()
        steps.set_blocking(steps.BLOCKINGS[0])


@needs_native
def test_the_backwards_blocking_is_measured_apart_and_its_time_decides_causal(cache, monkeypatch):
    """The causal pass is timed with the backward in each blocking: the faster is stored for
    the backward alone (the forward's is the banded pass's), kept within the margin, and the
    causal choice with a gradient reads the pass in the blocking chosen."""
    causal = dict(causal_sdpa_ms=10.0, causal_sdpa_fwd_ms=4.0, causal_native_fwd_ms=6.0)
    second_faster, near, slower = (
        profile.Probe(1.0, 2.0, 1.6, native32_second_ms=2.0, causal_native_ms=9.5,
                      causal_native_second_ms=ms, **causal)
        for ms in (7.5, 9.9, 11.0)
    )  # fmt: skip
    counting(monkeypatch, second_faster, near, slower)
    found = profile.load()[0]
    assert found.use_blocking == 0 and found.use_backward_blocking == 1
    assert found.causal_ratio() == pytest.approx(0.75) and found.use_causal  # 7.5 ÷ 10
    assert found.causal_ratio(backward=False) == 1.5 and not found.use_causal_fwd
    assert profile.load(remeasure=True)[0].backward_blocking == 1  # 1.04×: within the margin
    assert profile.load(remeasure=True)[0].backward_blocking == 0  # 1.16×: past it
    assert profile.Probe(1.0, 2.0, 1.5).backward_blocking == 0  # not measured: the first
    monkeypatch.setattr(profile, "load", lambda: (second_faster, "stored"))
    profile.probe.cache_clear()
    try:
        assert profile.probe().backward_blocking == 1
        assert steps.blocking(backward=True) == 1 and steps.blocking() == 0
    finally:
        profile.probe.cache_clear()
        steps.set_blocking(steps.BLOCKINGS[0], backward=True)


@needs_native
def test_a_profile_of_an_older_format_is_measured_again_silently(cache, monkeypatch):
    calls = counting(monkeypatch, profile.Probe(1.0, 2.0, 1.5))
    cache.parent.mkdir(parents=True)
    cache.write_text(json.dumps({"format": profile.FORMAT - 1, "machines": {}}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, where = profile.load()
    assert where.startswith("measured and stored") and len(calls) == 1
    assert json.loads(cache.read_text())["format"] == profile.FORMAT


@needs_native
def test_a_damaged_profile_is_measured_again_with_one_warning(cache, monkeypatch):
    counting(monkeypatch, profile.Probe(1.0, 2.0, 1.5))
    cache.parent.mkdir(parents=True)
    cache.write_text("{ not json")
    with pytest.warns(UserWarning, match="damaged"):
        _, where = profile.load()
    assert where.startswith("measured and stored")
    assert json.loads(cache.read_text())["format"] == profile.FORMAT


@needs_native
def test_an_unwritable_cache_directory_measures_in_the_process(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("QKV_CACHE_DIR", str(blocker / "cache"))  # under a file: unwritable
    counting(monkeypatch, profile.Probe(1.0, 2.0, 1.5))
    with pytest.warns(UserWarning, match="QKV_CACHE_DIR"):
        found, where = profile.load()
    assert where.startswith("measured in this process") and found.float32


@pytest.mark.e2e
@needs_native
def test_every_process_on_the_machine_names_the_same_path(tmp_path):
    """Three fresh processes, the probe on (the default): one measures and stores, the
    others read; all name the same code for the same call."""
    env = {**os.environ, "QKV_CACHE_DIR": str(tmp_path / "cache")}
    code = (
        "import torch, qkv; x = torch.randn(1, 4, 2048, 64);"
        "print(qkv.dispatch(x, x, x, mask=qkv.masks.sliding_window(128)).path)"
    )
    paths = [
        subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
        ).stdout.strip()
        for _ in range(3)
    ]
    assert len(set(paths)) == 1 and paths[0].startswith("tiled-"), paths
    assert (tmp_path / "cache" / profile.FILE).exists()


@pytest.mark.parametrize("name", ["avx9000", "other"], ids=["unknown", "other-architecture"])
def test_a_bad_isa_pin_is_an_error_when_the_kernel_is_first_asked_for(name):
    """A name qkv does not know, and one it knows that this CPU cannot run (the other
    architecture's narrower step: NEON's on x86-64, AVX2's on ARM64), each an error naming
    the variable at the first call."""
    if name == "other":
        name = "neon" if os.uname().machine == "x86_64" else "avx2"
    env = {**os.environ, "QKV_NATIVE_ISA": name}
    code = "import qkv.kernels.tiled.steps as n; print('imported'); n.available()"
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert "imported" in done.stdout  # no environment read at import
    if native._native is not None:
        assert done.returncode != 0 and f"QKV_NATIVE_ISA={name!r}" in done.stderr
        assert "lacks" in done.stderr or "pins float32" in done.stderr


@needs_native
def test_the_profiled_dispatch_follows_the_stored_choice(cache, monkeypatch, tune):
    tune(native_probe=True)
    cases = [
        (profile.Probe(1.0, 2.0, 1.5), "tiled-native"),
        (profile.Probe(1.0, 2.0, 9), "tiled-flash"),
    ]
    for verdict, want in cases:
        monkeypatch.setattr(profile, "probe", lambda v=verdict: v)
        x = torch.randn(1, 2, 1024, 64)
        assert qkv.dispatch(x, x, x, mask=masks.sliding_window(64)).path == want


@needs_native
def test_causal_runs_natively_where_the_profile_measured_it_faster(monkeypatch, tune):
    """A causal call with T_q == T_k takes the native kernel where the machine's profile
    found its causal pass faster than torch's (the verdict with a gradient for a call that
    needs one), torch's kernel where slower, below Tuning.native_scores, and with the probe
    off; the two agree within float32 rounding, gradients too."""
    tune(native_probe=True)

    def verdict(with_grad, forward):
        return profile.Probe(
            1.0, 2.0, 1.5, use_float32=True, use_bfloat16=False, use_causal=with_grad,
            use_causal_fwd=forward, causal_native_ms=1.0, causal_sdpa_ms=2.0,
            causal_native_fwd_ms=1.0, causal_sdpa_fwd_ms=2.0,
        )  # fmt: skip

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 1024, 64, generator=g) for _ in range(3))
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    causal = masks.causal()
    monkeypatch.setattr(profile, "probe", lambda: verdict(False, True))
    chosen = qkv.dispatch(q, k, v, mask=causal)
    assert (chosen.path, chosen.rule) == ("tiled-native", "causal square")
    assert qkv.dispatch(qg, kg, vg, mask=causal).path == "sdpa"  # the verdict with a gradient
    assert qkv.dispatch(q[:, :, :512], k[:, :, :512], v[:, :, :512], mask=causal).path == "sdpa"
    if steps.available(torch.float32) and native.supports(
        q.bfloat16(), k.bfloat16(), v.bfloat16(), torch.float32
    ):
        assert qkv.dispatch(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask=causal).path in (
            "tiled-native-widen",
            "tiled-native",
        )
    monkeypatch.setattr(profile, "probe", lambda: verdict(True, False))
    assert qkv.dispatch(q, k, v, mask=causal).path == "sdpa"
    assert qkv.dispatch(qg, kg, vg, mask=causal).path == "tiled-native"
    out = qkv.attention(qg, kg, vg, mask=causal)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    out.sum().backward()
    ref = [x.clone().requires_grad_() for x in (q, k, v)]
    torch.nn.functional.scaled_dot_product_attention(*ref, is_causal=True).sum().backward()
    for got, exp in zip((qg, kg, vg), ref):
        torch.testing.assert_close(got.grad, exp.grad, atol=1e-4, rtol=1e-4)
    with qkv.tuned(native_probe=False):  # no measurement: torch's kernel
        assert qkv.dispatch(qg, kg, vg, mask=causal).path == "sdpa"


def test_qkv_doctor_prints_the_machine_and_its_choices(cache, capsys):
    from qkv.cli import main

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a writable cache: no warning
        assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "CPU:" in out and "threads:" in out and "which code runs" in out
    assert "sliding_window(256)" in out
    pools = next(line for line in out.splitlines() if line.startswith("paged KV pools: "))
    assert "huge pages (transparent huge pages: " in pools or "4 KiB pages" in pools
    if steps.available(torch.float32):
        assert "profile: measured and stored" in out
        assert main(["doctor"]) == 0 and "profile: stored in" in capsys.readouterr().out


def test_a_call_the_native_kernel_cannot_run_never_measures_the_profile(cache, monkeypatch, tune):
    """The dispatch asks what reads no values (the dtype, head dims, strides) before the
    machine's profile: a float64 call under a mask never measures it (the context-parallel
    ranks, all float64, measured it mid-ring once the profile came first)."""

    def measure():
        raise AssertionError("measured the profile for a float64 call")

    monkeypatch.setattr(profile, "measure", measure)
    profile.probe.cache_clear()
    tune(native_probe=True)
    try:
        q, k, v = (torch.randn(1, 2, 40, 8, dtype=torch.float64) for _ in range(3))
        window = masks.sliding_window(4)
        assert qkv.dispatch(q, k, v, mask=window, backend="tiled").path == "tiled-flash"
        qkv.attention(q, k, v, mask=window, backend="tiled")
        assert not cache.exists()
    finally:
        profile.probe.cache_clear()
