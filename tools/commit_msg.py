"""The commit-msg hook (.pre-commit-config.yaml): a subject of at most 72 characters that
says what changed, then a blank line and a body that says why and what it measured, for
anything beyond a one-line change. Usage: python tools/commit_msg.py MESSAGE_FILE."""

import sys
from pathlib import Path

LIMIT = 72


def problems(message: str) -> list[str]:
    """What is wrong with a commit message, one line each (none: it is fine)."""
    lines = [x for x in message.splitlines() if not x.startswith("#")]
    while lines and not lines[-1].strip():
        lines.pop()
    if not lines or not lines[0].strip():
        return ["the message is empty"]
    found = []
    if len(lines[0]) > LIMIT:
        found.append(f"the subject has {len(lines[0])} characters; at most {LIMIT}")
    if len(lines) > 1 and lines[1].strip():
        found.append("a blank line goes between the subject and the body")
    return found


def main() -> int:
    found = problems(Path(sys.argv[1]).read_text(encoding="utf-8"))
    for line in found:
        print(f"commit message: {line}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
