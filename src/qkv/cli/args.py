"""What every ``qkv`` subcommand's parser shares: one-line errors and whole-number options."""

from __future__ import annotations

import argparse
from typing import NoReturn


def positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1; got {text!r}")
    return int(text)


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: the message names the argument and points to --help
    (argparse's usage block would bury it)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")
