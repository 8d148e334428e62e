"""qkv train / qkv generate: the corpus, the loop, checkpoints, exact resume, Ctrl-C."""

import collections
import json
import math
import os
import signal
import subprocess
import sys

import pytest
import torch

from qkv.cli import main
from qkv.models import GPTConfig
from qkv.training import (
    PRESETS,
    TrainConfig,
    bigram_loss,
    checkpoint_dir,
    eval_windows,
    learning_rate,
    load_checkpoint,
    load_corpus,
    read_state,
    train,
)

FILES = {"model.safetensors", "optimizer.safetensors", "config.json", "state.json"}


@pytest.fixture
def text(tmp_path):
    """A small UTF-8 folder of three files."""
    root = tmp_path / "text"
    root.mkdir()
    for i in range(3):
        (root / f"f{i}.py").write_text("def add(a, b):\n    return a + b\n" * (20 + i))
    return root


def test_stdlib_corpus_splits_by_file_the_same_way_every_time():
    a, b = load_corpus(), load_corpus()
    assert torch.equal(a.val, b.val) and len(a.train) == len(b.train)
    assert a.files[0] > 100 * 8 and a.files[1] >= a.files[0] // 20
    assert len(a.val) > 10**6 and "standard library" in a.source


def test_text_file_folder_and_bad_paths(tmp_path, text):
    folder = load_corpus(text)
    assert folder.files == (3, 1)  # a tenth of the bytes: the first file in hash order, cut
    single = load_corpus(text / "f0.py")
    assert len(single.train) + len(single.val) == (text / "f0.py").stat().st_size
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(FileNotFoundError, match="--text .*no such file or folder"):
        load_corpus(tmp_path / "missing")
    with pytest.raises(ValueError, match="holds no text"):
        load_corpus(tmp_path / "empty.txt")
    with pytest.raises(ValueError, match="is not UTF-8"):
        load_corpus(tmp_path / "latin1.txt")


def test_eval_windows_are_fixed_and_shifted_by_one():
    data = torch.arange(100, dtype=torch.uint8)
    x, y = eval_windows(data, 4, 10)
    assert torch.equal(x, eval_windows(data, 4, 10)[0])
    assert torch.equal(x[:, 1:], y[:, :-1]) and x[0, 0] == 0 and y[-1, -1] == 99


def test_bigram_baseline_learns_a_deterministic_text(tmp_path):
    (tmp_path / "ab.txt").write_text("ab" * 100_000)  # smoothing costs ~128/90000
    assert bigram_loss(load_corpus(tmp_path / "ab.txt")) < 0.01


def test_learning_rate_warms_up_then_decays_to_min():
    cfg = TrainConfig(steps=100, warmup=10, lr=1.0, min_lr=0.1)
    assert learning_rate(0, cfg) == pytest.approx(0.1)
    assert learning_rate(9, cfg) == pytest.approx(1.0)
    assert learning_rate(55, cfg) == pytest.approx(0.55)
    assert learning_rate(100, cfg) == pytest.approx(0.1)


def test_tiny_preset_trains_and_writes_a_checkpoint(tmp_path):
    result = train(tmp_path / "run", preset="tiny", progress=False)
    assert result.step == 20 and not result.interrupted
    assert set(os.listdir(checkpoint_dir(tmp_path / "run"))) == FILES
    assert "loss.png" in os.listdir(tmp_path / "run")
    # From uniform guessing (ln 256 = 5.55 nats) the tiny model learns something in 20 steps.
    first = result.history[0]["loss"]
    assert abs(first - math.log(256)) < 0.3 and result.val_loss < first - 0.5
    state = read_state(tmp_path / "run")
    assert state["step"] == 20 and state["steps"] == 20
    model = load_checkpoint(tmp_path / "run")
    assert all(
        torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), result.model.state_dict().values())
    )


def stop_at(n):
    def on_step(step, loss):
        if step == n:
            signal.raise_signal(signal.SIGINT)  # the handler asks the loop to stop

    return on_step


def test_interrupted_and_resumed_run_ends_with_the_same_weights(tmp_path):
    # Dropout on: the resumed run must also restore the random generators exactly.
    mcfg = GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32, dropout=0.1)
    kw = dict(preset="tiny", model_config=mcfg, steps=12, progress=False)
    straight = train(tmp_path / "a", **kw)
    stopped = train(tmp_path / "b", on_step=stop_at(5), **kw)
    assert stopped.interrupted and stopped.step == 5
    assert read_state(tmp_path / "b")["step"] == 5
    resumed = train(tmp_path / "b", resume=True, **kw)
    assert resumed.step == 12 and resumed.history == straight.history
    for (name, a), b in zip(
        straight.model.state_dict().items(), resumed.model.state_dict().values()
    ):
        assert torch.equal(a, b), name


def test_resume_with_more_steps_carries_the_run_on(tmp_path):
    train(tmp_path / "r", preset="tiny", steps=6, progress=False)
    more = train(tmp_path / "r", preset="tiny", steps=9, resume=True, progress=False)
    assert more.step == 9 and [h["step"] for h in more.history] == list(range(1, 10))
    with pytest.raises(ValueError, match="below the step the checkpoint reached"):
        train(tmp_path / "r", preset="tiny", steps=4, resume=True, progress=False)


def test_bad_input_gets_one_clear_error_and_writes_nothing(tmp_path, text):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "short.txt").write_text("x" * 300)  # validation part: 30 bytes < 33
    cases = [
        (dict(text=tmp_path / "missing"), FileNotFoundError, "no such file"),
        (dict(text=tmp_path / "empty.txt"), ValueError, "holds no text"),
        (dict(text=tmp_path / "short.txt"), ValueError, "longer than the validation"),
        (dict(preset="huge"), ValueError, "--preset must be one of"),
        (dict(resume=True), FileNotFoundError, "no checkpoint"),
    ]
    for i, (kw, error, match) in enumerate(cases):
        out = tmp_path / f"out{i}"
        with pytest.raises(error, match=match):
            train(out, **{"preset": "tiny", "progress": False, **kw})
        assert not out.exists() or not os.listdir(out)
    train(tmp_path / "ok", preset="tiny", steps=2, text=text, progress=False)
    with pytest.raises(ValueError, match="already holds a checkpoint"):
        train(tmp_path / "ok", preset="tiny", progress=False, text=text)
    with pytest.raises(ValueError, match="another preset"):
        train(tmp_path / "ok", preset="cpu-10min", resume=True, progress=False, text=text)
    with pytest.raises(ValueError, match="another --text"):
        train(tmp_path / "ok", preset="tiny", resume=True, progress=False)
    with pytest.raises(ValueError, match="another --seed"):
        train(tmp_path / "ok", preset="tiny", resume=True, seed=1, progress=False, text=text)


def test_inconsistent_checkpoint_is_refused(tmp_path):
    train(tmp_path / "c", preset="tiny", steps=3, progress=False)
    state = read_state(tmp_path / "c")
    (checkpoint_dir(tmp_path / "c") / "state.json").write_text(json.dumps({**state, "step": 2}))
    with pytest.raises(ValueError, match="inconsistent"):
        train(tmp_path / "c", preset="tiny", resume=True, progress=False)


def test_cli_train_then_generate_is_reproducible(tmp_path, capsys):
    out = str(tmp_path / "cli")
    assert main(["train", "--preset", "tiny", "--out", out, "--steps", "4", "--quiet"]) == 0
    assert "trained to step 4" in capsys.readouterr().out
    assert main(["train", "--resume", "--out", out, "--steps", "6", "--quiet"]) == 0
    assert "trained to step 6" in capsys.readouterr().out
    args = ["generate", "--checkpoint", out, "--prompt", "def ", "--tokens", "30"]
    samples = []
    for extra in (["--seed", "7"], ["--seed", "7"], ["--seed", "7", "--no-cache"], ["--seed", "8"]):
        main(args + extra)
        samples.append(capsys.readouterr().out)
    assert samples[0] == samples[1] == samples[2] != samples[3]
    assert samples[0].startswith("def ")


@pytest.mark.parametrize(
    "argv, match",
    [
        (["generate", "--checkpoint", "nowhere"], "qkv generate: error: no checkpoint"),
        (["generate", "--checkpoint", ".", "--prompt", ""], "--prompt must not be empty"),
        (["train", "--resume", "--out", "nowhere"], "--out 'nowhere' holds no checkpoint"),
        (["train", "--preset", "huge", "--out", "x"], "--preset must be one of"),
    ],
)
def test_cli_errors_are_one_line(argv, match, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and match in err and err.count("\n") == 1


@pytest.mark.e2e
@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_stop_writes_a_checkpoint_and_exits_130(tmp_path, stop):
    # SIGTERM is what a scheduler, a logout or `docker stop` sends: it saves as Ctrl-C does.
    out = tmp_path / "stopped"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "qkv",
            "train",
            "--preset",
            "tiny",
            "--steps",
            "100000",
            "--out",
            str(out),
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for line in proc.stderr:  # the first validation line: training is under way
            if line.startswith("step 10:"):
                break
        proc.send_signal(stop)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130 and "Traceback" not in err
    state = read_state(out)
    assert 10 <= state["step"] < 100000
    assert load_checkpoint(out).config == PRESETS["tiny"][0]


class Crash(Exception):
    """A process dying at a chosen instant of a save."""


STAGES = ("begin", "model", "optimizer", "json", "generation", "swapped", "cleaned")


def test_a_crash_at_any_instant_of_any_save_leaves_a_checkpoint_that_resumes_exactly(
    tmp_path, monkeypatch
):
    # A run of 6 steps saves at steps 2, 4 and 6: a crash at each of the 7 stages of each
    # save (21 instants). Every time, what is left loads, and resuming it ends with exactly
    # the weights of the run that was never stopped.
    import qkv.training.loop as loop

    want = train(tmp_path / "whole", preset="tiny", steps=6, save_every=2, progress=False)
    real = loop.save_checkpoint
    instants = 0
    for instant in range(3 * len(STAGES)):
        seen = [0]

        def crashing(*args, instant=instant, seen=seen, **kw):
            def fault(stage):
                if seen[0] == instant:
                    raise Crash(stage)
                seen[0] += 1

            return real(*args, fault=fault, **kw)

        out = tmp_path / f"crash{instant}"
        monkeypatch.setattr(loop, "save_checkpoint", crashing)
        with pytest.raises(Crash):
            train(out, preset="tiny", steps=6, save_every=2, progress=False)
        monkeypatch.setattr(loop, "save_checkpoint", real)
        instants += 1
        if instant < STAGES.index("swapped"):  # the first save never swapped in: none yet
            assert not (out / "latest").exists()
            continue
        step = read_state(out)["step"]
        assert step in (2, 4, 6), instant
        model = load_checkpoint(out)
        assert sum(p.numel() for p in model.parameters()) > 0
        got = train(out, preset="tiny", resume=True, progress=False)
        assert got.step == 6
        for a, b in zip(got.model.state_dict().values(), want.model.state_dict().values()):
            assert torch.equal(a, b), instant
    assert instants == 21


@pytest.mark.e2e
def test_a_kill_9_mid_run_leaves_a_checkpoint_that_resumes_exactly(tmp_path):
    # The real thing: SIGKILL (an out-of-memory kill) at three instants of a run saving every
    # step; each time the checkpoint loads and resumes to the uninterrupted run's weights.
    want = train(tmp_path / "whole", preset="tiny", steps=60, save_every=1, progress=False)
    for wait in (10, 20, 40):  # the evaluation lines seen before the kill
        out = tmp_path / f"killed{wait}"
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "qkv",
                "train",
                "--preset",
                "tiny",
                "--steps",
                "60",
                "--save-every",
                "1",
                "--out",
                str(out),
            ],
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            for line in proc.stderr:  # the progress line counts steps
                if line.startswith(f"step {wait}:"):
                    break
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=60)
        finally:
            proc.kill()
        assert 1 <= read_state(out)["step"] <= 60
        load_checkpoint(out)
        got = train(out, preset="tiny", resume=True, progress=False)
        for a, b in zip(got.model.state_dict().values(), want.model.state_dict().values()):
            assert torch.equal(a, b), wait


def test_resume_goes_on_to_the_run_s_own_total_and_says_when_it_changes(tmp_path, capsys):
    train(tmp_path / "r", preset="tiny", steps=15, progress=False)
    # A 15-step run of a 20-step preset: --resume alone has nothing left to do.
    assert train(tmp_path / "r", preset="tiny", resume=True, progress=False).step == 15
    result = train(tmp_path / "r", preset="tiny", resume=True, steps=18, progress=True)
    assert result.step == 18 and read_state(tmp_path / "r")["steps"] == 18
    assert "the run's total goes from 15 to 18 steps" in capsys.readouterr().err


def test_a_folder_splits_by_bytes_whatever_its_files_and_says_what_it_read(tmp_path, capsys):
    # A 65 KB file beside a 41-byte one once trained on the 41 bytes (the big file held out
    # whole): validation now holds its share of the bytes, the big file cut at the line.
    root = tmp_path / "notes"
    root.mkdir()
    (root / "big.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 1500)
    (root / "small.txt").write_text("a short note that is forty-one bytes long")
    (root / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (root / "empty.txt").write_text("")
    corpus = load_corpus(root)
    total = len(corpus.train) + len(corpus.val)
    assert total == sum(
        p.stat().st_size + 1 for p in root.iterdir() if p.name in ("big.txt", "small.txt")
    )
    assert abs(len(corpus.val) / total - 0.1) < 0.001 and len(corpus.train) > 50_000
    assert corpus.skipped == (("empty.txt", "empty"), ("latin1.txt", "not UTF-8 at byte 3"))
    assert load_corpus(root).val.equal(corpus.val)  # deterministic
    assert "skipped 2: empty.txt (empty), latin1.txt (not UTF-8 at byte 3)" in corpus.describe()
    train(tmp_path / "run", preset="tiny", steps=1, text=root)
    assert f"read {root.resolve()}: " in capsys.readouterr().err


def test_each_evaluation_keeps_the_paper_s_measurements(tmp_path):
    from qkv.heads import copying_scores, head_scores, icl_score, per_token_loss, repeated_tokens
    from qkv.training import validation_windows

    result = train(tmp_path / "run", preset="tiny", progress=False)
    state = read_state(tmp_path / "run")
    evaluations = state["evaluations"]
    assert [e["step"] for e in evaluations] == [10, 20]
    last = evaluations[-1]
    x, y = validation_windows(tmp_path / "run")
    assert x.shape == (8, 32)  # the tiny preset's eval_windows × block_size
    losses = per_token_loss(result.model, x, y)
    assert last["token_loss"] == pytest.approx(losses.tolist(), abs=1e-4)
    assert last["val_loss"] == pytest.approx(result.val_loss) == pytest.approx(losses.mean().item())
    assert last["icl"] == pytest.approx(icl_score(losses)) == result.history[-1]["icl"]
    drawn = repeated_tokens(256, 16, batch=16, choices=x.unique())  # bytes the text holds
    assert set(drawn.unique().tolist()) <= set(x.unique().tolist())
    expected = head_scores(result.model, tokens=drawn)
    for name, s in expected.items():
        torch.testing.assert_close(torch.tensor(last["scores"][name]), s, atol=1e-6, rtol=0)
    copying = torch.tensor(last["scores"]["copying"], dtype=torch.float64)
    torch.testing.assert_close(copying, copying_scores(result.model))


def test_cli_heads_reports_an_ablation(tmp_path, capsys):
    out = str(tmp_path / "run")
    assert main(["train", "--preset", "tiny", "--out", out, "--steps", "4", "--quiet"]) == 0
    capsys.readouterr()
    assert main(["heads", "--checkpoint", out, "--no-png", "--ablate", "1.0,1.1"]) == 0
    text = capsys.readouterr().out
    assert "copying: best layer" in text and "zero-ablated 1.0,1.1: loss" in text
    argv = ["heads", "--checkpoint", out, "--no-png", "--json", "--ablate", "0.1"]
    assert main([*argv, "--ablation", "mean"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = report["ablation"]["rows"]
    assert set(rows) == {"model", "mean-ablated 0.1"} and report["ablation"]["windows"] == 4
    assert rows["model"]["loss"] != rows["mean-ablated 0.1"]["loss"]
    with pytest.raises(SystemExit):
        main(["heads", "--checkpoint", out, "--no-png", "--ablate", "2.0"])
    assert "no layer 2 to ablate" in capsys.readouterr().err


def test_words_cut_a_corpus_into_a_vocabulary_of_the_most_frequent(text):
    from qkv.training import load_words
    from qkv.training.data import WORD

    words = load_words(text, vocab_size=8)
    corpus = load_corpus(text)
    counts = collections.Counter(WORD.findall(bytes(corpus.train.numpy()).decode()))
    kept = [counts[w] for w in words.vocab[1:]]
    assert words.vocab[0] == "<unk>" and len(words.vocab) == 8
    assert kept == sorted(kept, reverse=True)  # the most frequent, in order
    assert all(c <= kept[-1] for w, c in counts.items() if w not in words.vocab)
    assert words.train.dtype == torch.int32 and int(words.train.max()) < 8
    decoded = words.decode(words.train[:12])
    assert decoded.startswith("def add(a, b):") or "<unk>" in decoded  # "def" may be unknown
    assert 0 < words.unknown < 1
    full = load_words(text, vocab_size=1000)  # every word known: the text comes back
    assert full.unknown == 0 and full.decode(full.train).startswith("def add(a, b):\n    return")
    with pytest.raises(ValueError, match="vocab_size >= 2"):
        load_words(text, vocab_size=1)


def test_a_run_on_words_trains_and_generate_refuses_it(tmp_path, text, capsys):
    model = GPTConfig(vocab_size=32, block_size=16, n_layer=1, n_head=2, n_embd=16)
    cfg = TrainConfig(
        steps=4, batch_size=4, warmup=1, eval_interval=2, eval_windows=4, data="words"
    )
    result = train(tmp_path / "w", text=text, model_config=model, train_config=cfg, progress=False)
    assert result.unit == "token" and result.val_loss is not None
    assert "icl" in result.history[-1]
    with pytest.raises(SystemExit):
        main(["generate", "--checkpoint", str(tmp_path / "w"), "--prompt", "def "])
    assert "trained on 'words', not bytes" in capsys.readouterr().err


def test_dtype_auto_is_measured_once_and_kept_on_resume(tmp_path, monkeypatch, capsys):
    """--dtype auto takes the faster of float32 and bfloat16 on this CPU, says which, and a
    resumed run keeps that choice rather than measuring again (one run, one dtype)."""
    from qkv.training import loop

    calls = []

    def measured(model, batch_size, mcfg):
        calls.append(batch_size)
        return "bfloat16"

    monkeypatch.setattr(loop, "_fastest_autocast", measured)
    out = tmp_path / "run"
    assert (
        main(["train", "--preset", "tiny", "--out", str(out), "--steps", "2", "--dtype", "auto"])
        == 0
    )
    assert "dtype auto: bfloat16" in capsys.readouterr().err
    assert json.loads((out / "latest" / "state.json").read_text())["autocast"] == "bfloat16"
    assert (
        main(
            [
                "train",
                "--preset",
                "tiny",
                "--out",
                str(out),
                "--steps",
                "4",
                "--dtype",
                "auto",
                "--resume",
            ]
        )
        == 0
    )
    assert len(calls) == 1  # measured for the new run, not again on --resume
    assert "dtype auto: bfloat16" in capsys.readouterr().err


def test_the_measured_dtype_is_one_of_the_two_and_leaves_the_model_as_it_was():
    from qkv.models import GPT, GPTConfig
    from qkv.training import loop

    torch.manual_seed(0)
    config = GPTConfig(vocab_size=32, block_size=16, n_layer=1, n_head=2, n_embd=16)
    model = GPT(config)
    before = [p.detach().clone() for p in model.parameters()]
    rng = torch.get_rng_state()
    assert loop._fastest_autocast(model, 4, config) in ("float32", "bfloat16")
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)


def test_progress_prints_plain_lines_where_stderr_is_not_a_terminal(tmp_path, monkeypatch, capsys):
    from qkv.training import progress, train

    monkeypatch.setattr(progress, "PLAIN_EVERY", 0.0)
    train(tmp_path / "run", preset="tiny", steps=3)
    lines = [x for x in capsys.readouterr().err.splitlines() if "steps/s" in x]
    assert len(lines) == 3 and all("left" in x and "tok/s" in x for x in lines)
    assert lines[-1].startswith("step 3/3")
