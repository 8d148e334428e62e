"""The commit-msg hook's rules (tools/commit_msg.py)."""

import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location(
    "commit_msg", Path(__file__).resolve().parents[2] / "tools" / "commit_msg.py"
)
commit_msg = importlib.util.module_from_spec(spec)
spec.loader.exec_module(commit_msg)


def test_a_short_subject_and_a_body_pass():
    assert commit_msg.problems("Break the import circles\n\nWhy, and what it measured.\n") == []
    assert commit_msg.problems("A one-line change\n# a comment git strips\n") == []


def test_a_long_subject_a_missing_blank_line_or_nothing_fail():
    assert "at most 72" in commit_msg.problems("x" * 73)[0]
    assert "blank line" in commit_msg.problems("Subject\nbody at once")[0]
    assert commit_msg.problems("\n\n") == ["the message is empty"]
