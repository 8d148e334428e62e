"""The qkv command: explain, mask, python -m qkv, --version; every bad input ends in one line
that names the argument: no traceback, no usage block (qkv train / generate have their own
in test_train.py, qkv bench in test_bench.py, qkv view in test_view.py)."""

import json
import subprocess
import sys

import pytest

from qkv.cli import main


@pytest.fixture
def files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ragged.json").write_text(
        json.dumps({"tokens": ["a", "b"], "embeddings": [[0.1, 0.2], [0.3]]})
    )
    (tmp_path / "words.json").write_text(json.dumps({"tokens": ["a"], "embeddings": [["x", "y"]]}))
    (tmp_path / "empty.json").write_text(json.dumps({"embeddings": []}))
    return tmp_path


BAD = [
    (["explain", "--png", "missing/dir/x.png"], "--png missing/dir/x.png: the folder missing/dir"),
    (
        ["explain", "--input", "ragged.json", "--no-png"],
        "--input ragged.json: embeddings must be rows of one width; "
        "row 0 has 2 numbers, row 1 has 1",
    ),
    (
        ["explain", "--embeddings", "1,2;3", "--no-png"],
        "--embeddings: embeddings must be rows of one width",
    ),
    (
        ["explain", "--input", "words.json", "--no-png"],
        "--input words.json: embeddings must hold numbers only",
    ),
    (
        ["explain", "--input", "empty.json", "--no-png"],
        "--input empty.json: embeddings must be a non-empty table",
    ),
    (["explain", "--input", "missing.json", "--no-png"], "--input missing.json: cannot read"),
    (["explain", "--heads", "0"], "argument --heads: must be a whole number >= 1"),
    (["explain", "--bogus"], "unrecognized arguments: --bogus"),
    (["mask", "sliding_window", "--window", "x"], "argument --window: must be a whole number"),
    (["mask", "nope"], "argument kind: invalid choice: 'nope'"),
    (["bench", "--T", "0"], "argument --T: must be a whole number >= 1"),
    (["bench", "--dtypes", "int8"], "argument --dtypes: invalid choice: 'int8'"),
    (["bench", "--masks", "diagonal"], "argument --masks: invalid choice: 'diagonal'"),
    (["bench", "--from-json", "missing.jsonl"], "qkv bench: error: [Errno 2] No such file"),
    (["train", "--steps", "-3"], "argument --steps: must be a whole number >= 1"),
    (["generate"], "the following arguments are required: --checkpoint"),
    (
        ["explain", "--simplified", "--heads", "2", "--no-png"],
        "--heads has no effect with --simplified",
    ),
    (
        ["explain", "--embeddings", "nan,1;2,3", "--no-png"],
        "embeddings must be finite; row 0 holds nan",
    ),
    (
        ["mask", "full", "--window", "3"],
        "--window is for sliding_window masks only; full takes none",
    ),
    (["mask", "padding"], "padding needs --length"),
    (
        ["mask", "causal", "--size", "20000"],
        "--size 20000 is too large for a picture (at most 1024)",
    ),
]


@pytest.mark.parametrize("argv, words", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_every_cli_error_is_one_line_naming_the_argument(files, capsys, argv, words):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err if exit_.value.code == 2 else str(exit_.value.code) + "\n"
    assert words in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_every_bench_flag_has_help(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = capsys.readouterr().out
    for flag in (
        "--T",
        "--H",
        "--D",
        "--dtypes",
        "--masks",
        "--passes",
        "--repeats",
        "--naive-max-T",
        "--dense-max-T",
        "--flex",
        "--long",
        "--decode",
        "--json",
        "--from-json",
    ):
        block = text.split(flag, 1)[1].split("\n  -", 1)[0]
        assert len(block.split()) > 2, flag  # the flag's metavar and some words of help


def test_cli_explain_default(tmp_path, capsys):
    png = tmp_path / "a.png"
    assert main(["explain", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "SelfAttention(d_in=3, d_out=2), seed 789" in out
    assert "-0.0739" in out  # seed 004's SelfAttention_v2 output, first token
    assert png.exists()  # matplotlib is in the dev extra


def test_cli_explain_options(tmp_path, capsys):
    data = tmp_path / "in.json"
    data.write_text(json.dumps({"tokens": ["a", "b", "c"], "embeddings": [[1, 0], [0, 1], [1, 1]]}))
    assert (
        main(
            [
                "explain",
                "--input",
                str(data),
                "--heads",
                "2",
                "--d-out",
                "4",
                "--causal",
                "--json",
                "--no-png",
            ]
        )
        == 0
    )
    trace = json.loads(capsys.readouterr().out)
    assert trace["tokens"] == ["a", "b", "c"] and len(trace["steps"]["weights"]) == 2
    assert (
        main(["explain", "--tokens", "x y", "--embeddings", "1,2;3,4", "--simplified", "--no-png"])
        == 0
    )
    assert "simplified attention" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv,words",
    [
        (
            ["explain", "--heads", "3", "--d-out", "2", "--no-png"],
            "--d-out 2 must be a multiple of --heads 3",
        ),
        (["explain", "--tokens", "a b", "--no-png"], "2 tokens but 6 embedding rows"),
        (["explain", "--embeddings", "1,x"], "embeddings must be rows of comma-separated numbers"),
        (["explain", "--heads", "0"], "must be a whole number >= 1"),
        (
            ["explain", "--input", "/nonexistent.json", "--no-png"],
            "cannot read tokens and embeddings",
        ),
        (["mask", "sliding_window", "--window", "-2"], "must be a whole number >= 1"),
        (["mask", "nope"], "invalid choice"),
    ],
)
def test_cli_bad_options_get_a_message_not_a_traceback(argv, words, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err


def test_cli_mask_picture(capsys):
    assert main(["mask", "causal", "--size", "3"]) == 0
    assert capsys.readouterr().out.splitlines()[1:] == ["█ · ·", "█ █ ·", "█ █ █"]
    assert main(["mask", "document", "--size", "4", "--ids", "0,0,1,1"]) == 0
    assert "document([0, 0, 1, 1])" in capsys.readouterr().out


def test_python_dash_m(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "qkv", "mask", "sliding_window", "--size", "4", "--window", "2"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert r.returncode == 0 and "· █ █ ·" in r.stdout


def _damaged(tmp_path, how):
    """A two-step tiny run, then one kind of damage to its checkpoint."""
    import json

    from qkv.training import checkpoint_dir, train

    out = tmp_path / how
    train(out, preset="tiny", steps=2, progress=False)
    files = checkpoint_dir(out)
    weights = files / "model.safetensors"
    if how == "truncated_weights":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif how == "empty_weights":
        weights.write_bytes(b"")
    elif how == "missing_weights":
        weights.unlink()
    elif how == "config_disagrees":  # the weights of another shape
        config = json.loads((files / "config.json").read_text())
        config["model"]["n_embd"] = 64
        (files / "config.json").write_text(json.dumps(config))
    elif how == "config_missing_key":
        config = json.loads((files / "config.json").read_text())
        del config["model"]
        (files / "config.json").write_text(json.dumps(config))
    elif how == "config_not_json":
        (files / "config.json").write_text("{ not json")
    elif how == "state_not_json":
        (files / "state.json").write_text("")
    elif how == "nan_weights":  # bytes overwritten inside the tensor data: 0xFFFFFFFF is NaN
        data = bytearray(weights.read_bytes())
        data[-256:-128] = b"\xff" * 128
        weights.write_bytes(bytes(data))
    return out


DAMAGE = [
    ("truncated_weights", "model.safetensors is damaged or truncated"),
    ("empty_weights", "model.safetensors is damaged or truncated"),
    ("missing_weights", "model.safetensors is missing"),
    ("config_disagrees", "does not fit the model its config.json describes"),
    ("config_missing_key", "config.json is damaged: no valid model configuration"),
    ("config_not_json", "config.json is damaged: not valid JSON"),
    ("nan_weights", "model.safetensors holds NaN or infinite weights"),
]


@pytest.mark.parametrize("how, words", DAMAGE, ids=[d[0] for d in DAMAGE])
@pytest.mark.parametrize("command", ["generate", "heads", "view", "resume"])
def test_a_damaged_checkpoint_gets_one_line_in_every_command(tmp_path, capsys, how, words, command):
    out = _damaged(tmp_path, how)
    argv = {
        "generate": ["generate", "--checkpoint", str(out), "--prompt", "a", "--tokens", "2"],
        "heads": ["heads", "--checkpoint", str(out)],
        "view": ["view", "--checkpoint", str(out), "--out", str(tmp_path / "v.html")],
        "resume": ["train", "--preset", "tiny", "--out", str(out), "--resume", "--quiet"],
    }[command]
    if command == "resume" and how in ("config_missing_key", "config_disagrees"):
        words = {  # --resume compares the configuration before it reads any weight
            "config_missing_key": "config.json is damaged",
            "config_disagrees": "the checkpoint was trained with another model",
        }[how]
    with pytest.raises(SystemExit) as stop:
        main(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2, err
    assert words in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_a_run_copied_with_its_links_followed_still_loads(tmp_path, capsys):
    """``cp -rL`` turns the ``latest`` link into a folder: it is the checkpoint all the same."""
    import shutil

    from qkv.training import train

    out = tmp_path / "run"
    train(out, preset="tiny", steps=2, progress=False)
    copy = tmp_path / "copy"
    shutil.copytree(out, copy, symlinks=False)  # what cp -rL does
    assert (copy / "latest").is_dir() and not (copy / "latest").is_symlink()
    assert main(["generate", "--checkpoint", str(copy), "--prompt", "a", "--tokens", "2"]) == 0
    assert main(["train", "--preset", "tiny", "--out", str(copy), "--resume", "--quiet"]) == 0


def test_cli_explain_says_its_weights_are_untrained_and_gives_each_head_two_dims(capsys):
    assert main(["explain", "--causal", "--heads", "2", "--no-png"]) == 0
    out = capsys.readouterr().out
    assert "d_out=4, heads=2" in out and "random weights, untrained" in out


def test_generate_refuses_a_prompt_outside_the_vocabulary(tmp_path, capsys):
    from qkv.models import GPTConfig
    from qkv.training import PRESETS, TrainConfig, train

    tcfg = PRESETS["induction"][1]
    out = tmp_path / "induction"
    small = TrainConfig(**{**tcfg.__dict__, "steps": 2, "eval_interval": 2, "eval_windows": 4})
    train(out, preset="induction", train_config=small, progress=False)
    with pytest.raises(SystemExit) as stop:
        main(["generate", "--checkpoint", str(out), "--prompt", "hello"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "trained on 'repeated_segments', not bytes" in err
    # A byte model with a vocabulary of 128 (trained on ASCII) refuses bytes past it.
    text = tmp_path / "ascii.txt"
    text.write_text("def add(a, b):\n    return a + b\n" * 40)
    ascii_model = GPTConfig(vocab_size=128, block_size=16, n_layer=1, n_head=2, n_embd=16)
    cfg = TrainConfig(steps=2, batch_size=4, warmup=1, eval_interval=2, eval_windows=4)
    out = tmp_path / "ascii"
    train(out, text=text, model_config=ascii_model, train_config=cfg, progress=False)
    with pytest.raises(SystemExit) as stop:
        main(["generate", "--checkpoint", str(out), "--prompt", "café"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "outside this model's vocabulary of 128 tokens" in err


def test_a_bare_qkv_prints_help_and_version(capsys):
    assert main([]) == 0
    assert "usage: qkv" in capsys.readouterr().out
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0 and capsys.readouterr().out.startswith("qkv ")


def test_mask_document_takes_its_size_from_the_ids(capsys):
    main(["mask", "document", "--ids", "0,0,1,1,1"])
    out = capsys.readouterr().out
    assert "T_q=5, T_k=5" in out and len(out.strip().splitlines()) == 6


def test_a_truncated_snapshot_gets_one_line_in_view(tmp_path, capsys):
    from qkv.training import PRESETS, TrainConfig, snapshots, train

    tcfg = PRESETS["induction"][1]
    out = tmp_path / "induction"
    small = TrainConfig(**{**tcfg.__dict__, "steps": 4, "eval_interval": 2, "eval_windows": 4})
    train(out, preset="induction", train_config=small, progress=False)
    first = snapshots(out)[0][1]
    first.write_bytes(first.read_bytes()[:100])
    with pytest.raises(SystemExit) as stop:
        main(["view", "--checkpoint", str(out), "--out", str(tmp_path / "v.html")])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert f"{first.name} is damaged or truncated" in err


def test_generate_decodes_several_prompts_together(tmp_path, capsys):
    """Several --prompt (and a file of them): each continued as it would be alone."""
    out = tmp_path / "tiny"
    main(["train", "--preset", "tiny", "--out", str(out), "--steps", "2", "--quiet"])
    capsys.readouterr()
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("ab\n", encoding="utf-8")
    common = ["--checkpoint", str(out), "--tokens", "5", "--temperature", "0"]
    main(["generate", *common, "--prompt", "hello", "--prompts-file", str(prompts)])
    together = capsys.readouterr().out
    main(["generate", *common, "--prompt", "hello"])
    alone = capsys.readouterr().out.rstrip("\n")
    assert together.startswith("--- 0: 'hello'\n") and "--- 1: 'ab'\n" in together
    assert together.split("\n")[1] == alone


def test_generate_takes_a_quantized_kv_cache(tmp_path, capsys):
    """--kv-dtype int8 / fp8: the caches quantized (one prompt, and several on the paged
    cache); a tiny model's greedy bytes are the float cache's here; with --no-cache it is a
    one-line error."""
    out = tmp_path / "tiny"
    main(["train", "--preset", "tiny", "--out", str(out), "--steps", "2", "--quiet"])
    capsys.readouterr()
    common = ["--checkpoint", str(out), "--tokens", "8", "--temperature", "0"]
    main(["generate", *common, "--prompt", "hello"])
    plain = capsys.readouterr().out
    for kv in ("int8", "fp8"):
        main(["generate", *common, "--prompt", "hello", "--kv-dtype", kv])
        assert capsys.readouterr().out == plain
        main(["generate", *common, "--prompt", "hello", "--prompt", "ab", "--kv-dtype", kv])
        assert "--- 1: 'ab'" in capsys.readouterr().out
    with pytest.raises(SystemExit) as stop:
        main(["generate", *common, "--prompt", "hello", "--kv-dtype", "int8", "--no-cache"])
    assert stop.value.code == 2 and "--no-cache uses none" in capsys.readouterr().err


def test_cli_explain_traces_a_trained_layer(tmp_path, capsys):
    """--checkpoint: one attention layer of a trained run over --prompt's bytes, its input
    what the model computes there; the weights are the module's own (checked against the
    module called on the same input)."""
    import torch

    from qkv.training import load_checkpoint, train

    out = tmp_path / "run"
    train(out, preset="tiny", steps=3, progress=False)
    argv = ["explain", "--checkpoint", str(out), "--layer", "1", "--prompt", "ab a", "--json"]
    assert main([*argv, "--no-png"]) == 0
    trace = json.loads(capsys.readouterr().out)
    assert trace["tokens"] == ["a", "b", "␣", "a"] and "layer 1, trained 3 steps" in trace["title"]
    model = load_checkpoint(out).eval()
    seen = []
    model.blocks[1].ln_1.register_forward_hook(lambda m, i, o: seen.append(o))
    with torch.no_grad():
        model(torch.tensor([list(b"ab a")]))
        want = model.blocks[1].attn(seen[0])[0]
    got = torch.tensor(trace["steps"]["output"], dtype=want.dtype)
    assert got.shape == want.shape and (got - want).abs().max() < 1e-4
    with pytest.raises(SystemExit):
        main(["explain", "--checkpoint", str(out), "--layer", "9", "--no-png"])
    assert "--layer must be 0 .. 1; got 9" in capsys.readouterr().err
