"""Every bad input to the command line ends in one line that names the argument: no
traceback, no usage block (qkv train / generate have their own in test_train.py)."""

import json

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
    ([], "the following arguments are required: command"),
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
