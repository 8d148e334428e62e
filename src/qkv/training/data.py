"""Training text every machine has: bytes, so the vocabulary is 256 and nothing needs a
tokenizer or a download.

By default the corpus is the source files of the running interpreter's Python standard
library (found with ``sysconfig``). ``load_corpus(path)`` takes any UTF-8 file or folder
instead. The split is by bytes and deterministic: files are taken in the order of a hash of
their path (CRC-32 of the path relative to the root), whole files go to validation until it
holds ``val_fraction`` of the bytes, and the file that crosses that line is cut there (its
tail to validation) — so validation holds its share of the bytes whatever the files' names
and sizes, and a given corpus always splits the same way. A single file is the same case:
its last ``val_fraction`` is validation.

Legend: B batch · T sequence length (block_size).
"""

from __future__ import annotations

import collections
import functools
import re
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

#: The byte that separates concatenated files.
SEPARATOR = b"\n"


@dataclass(frozen=True)
class Corpus:
    """Bytes split for training and validation.

    Attributes:
        train, val: uint8 tensors of bytes (each file followed by a newline).
        source: what the bytes are, in words (recorded in checkpoints).
        files: (files in train, files in validation); a file cut between them counts in both.
        skipped: (path, why) of each file of a folder that was not read (not UTF-8, empty).
    """

    train: torch.Tensor
    val: torch.Tensor
    source: str
    files: tuple[int, int]
    skipped: tuple[tuple[str, str], ...] = ()

    def describe(self) -> str:
        """What was read, in one line: files, bytes per split, skipped files and why."""
        skipped = ""
        if self.skipped:
            shown = ", ".join(f"{p} ({why})" for p, why in self.skipped[:3])
            more = f", … {len(self.skipped) - 3} more" if len(self.skipped) > 3 else ""
            skipped = f"; skipped {len(self.skipped)}: {shown}{more}"
        return (
            f"read {self.source}: {len(self.train):,} bytes to train on and {len(self.val):,} "
            f"held out ({self.files[0]} + {self.files[1]} files){skipped}"
        )


def stdlib_root() -> Path:
    """The running interpreter's standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


@functools.cache
def _stdlib_files(root: Path) -> tuple[Path, ...]:
    """The standard library's Python files: walked once per process (about a second over
    its 13,000 paths), as they do not change while it runs."""
    return tuple(
        p
        for p in root.rglob("*.py")
        if "site-packages" not in p.relative_to(root).parts and p.is_file()
    )


def _text_files(root: Path) -> tuple[list[Path], list[tuple[str, str]]]:
    """Every file under root that is not hidden and reads as UTF-8, and why each other
    file was skipped."""
    out, skipped = [], []
    for p in sorted(root.rglob("*")):
        if not p.is_file() or any(part.startswith(".") for part in p.relative_to(root).parts):
            continue
        where = p.relative_to(root).as_posix()
        try:
            p.read_bytes().decode("utf-8")
        except UnicodeDecodeError as err:
            skipped.append((where, f"not UTF-8 at byte {err.start}"))
            continue
        except OSError as err:
            skipped.append((where, f"unreadable: {err.strerror}"))
            continue
        out.append(p)
    return out, skipped


def _bytes(parts: list[bytes]) -> torch.Tensor:
    return torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8)


def _split_files(
    root: Path, paths: list[Path], val_fraction: float, source: str, skipped: list
) -> Corpus:
    """Split by bytes (the module's docstring): whole files to validation in hash order until
    it holds ``val_fraction`` of the bytes, the file crossing the line cut there."""
    single = len(paths) == 1
    order = sorted(
        paths, key=lambda p: (zlib.crc32(p.relative_to(root).as_posix().encode()), p.as_posix())
    )
    texts = {p: p.read_bytes() + (b"" if single else SEPARATOR) for p in order}
    total = sum(len(t) for t in texts.values())
    target = max(1, int(total * val_fraction))
    train: dict[Path, bytes] = {}
    val: dict[Path, bytes] = {}
    held = 0
    for p in order:
        data, need = texts[p], target - held
        if need <= 0:
            train[p] = data
        elif len(data) <= need and not single:
            val[p], held = data, held + len(data)
        else:  # the file that crosses the line: its head to train, its tail held out
            cut = len(data) - need
            train[p], val[p], held = data[:cut], data[cut:], target
    train = {p: t for p, t in train.items() if t}
    return Corpus(
        _bytes([train[p] for p in sorted(train)]),
        _bytes([val[p] for p in sorted(val)]),
        source,
        (len(train), len(val)),
        tuple(sorted(skipped)),
    )


def load_corpus(text: str | Path | None = None, *, val_fraction: float = 0.1) -> Corpus:
    """Load and split a corpus.

    Args:
        text: a UTF-8 file or a folder of them (hidden files and files that are not UTF-8
            are skipped); None for the Python standard library's sources.
        val_fraction: the share of the bytes held out for validation.

    Raises:
        FileNotFoundError: ``text`` does not exist.
        ValueError: nothing to train on (an empty file, a folder with no UTF-8 file, a
            file that is not UTF-8).

    Example:
        >>> from qkv.training import load_corpus
        >>> corpus = load_corpus()                    # the standard library's sources
        >>> round(len(corpus.val) / (len(corpus.train) + len(corpus.val)), 2)  # bytes held out
        0.1
    """
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1); got {val_fraction}")
    skipped: list[tuple[str, str]] = []
    if text is None:
        root = stdlib_root()
        paths = list(_stdlib_files(root))
        source = f"Python {sysconfig.get_python_version()} standard library ({root})"
    else:
        root = Path(text)
        if not root.exists():
            raise FileNotFoundError(f"--text {str(text)!r}: no such file or folder")
        source = str(root.resolve())
        if root.is_file():
            try:
                root.read_bytes().decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(
                    f"--text {str(text)!r} is not UTF-8 text ({err.reason} at byte {err.start})"
                ) from None
            paths, root = [root], root.parent
        else:
            paths, skipped = _text_files(root)
    skipped += [(p.relative_to(root).as_posix(), "empty") for p in paths if not p.stat().st_size]
    paths = [p for p in paths if p.stat().st_size > 0]
    if not paths:
        raise ValueError(f"the corpus {source} holds no text to train on")
    if len(paths) == 1 and paths[0].stat().st_size < 2:
        raise ValueError(f"the corpus {source} is too small to split (1 byte)")
    return _split_files(root, sorted(paths), val_fraction, source, skipped)


def check_context(corpus: Corpus, block_size: int) -> None:
    """Raise ValueError if either split is too short for one window of block_size + 1."""
    for name, data in (("training", corpus.train), ("validation", corpus.val)):
        if len(data) < block_size + 1:
            raise ValueError(
                f"the context (block_size={block_size}) is longer than the "
                f"{name} data ({len(data)} bytes) of {corpus.source}: give more text, "
                "or a preset with a smaller context (--preset tiny: 32 bytes)"
            )


def random_batch(
    data: torch.Tensor, batch_size: int, block_size: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """batch_size windows at random offsets: inputs (B, T) and targets (B, T), the inputs
    shifted by one byte, as int64."""
    starts = torch.randint(0, len(data) - block_size, (batch_size,), generator=generator)
    return _windows(data, starts, block_size)


def eval_windows(
    data: torch.Tensor, count: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` windows at evenly spaced offsets over all of data: the same windows every
    time, so validation losses compare across steps and models."""
    count = max(1, min(count, len(data) - block_size))
    starts = torch.linspace(0, len(data) - block_size - 1, count).long()
    return _windows(data, starts, block_size)


def _windows(
    data: torch.Tensor, starts: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    offsets = starts[:, None] + torch.arange(block_size + 1)  # (B, T + 1)
    chunk = data[offsets].long()
    return chunk[:, :-1], chunk[:, 1:]  # (B, T) each


def bigram_loss(corpus: Corpus, smoothing: float = 0.5) -> float:
    """The validation loss (nats per byte) of a byte-bigram model counted on the training
    bytes, with ``smoothing`` added to every count: the baseline any model must beat."""
    train, val = corpus.train.long(), corpus.val.long()
    counts = torch.zeros(256 * 256, dtype=torch.float64)
    counts.index_add_(
        0, train[:-1] * 256 + train[1:], torch.ones(len(train) - 1, dtype=torch.float64)
    )
    counts = counts.view(256, 256) + smoothing
    logp = counts.log() - counts.sum(dim=1, keepdim=True).log()  # (prev, next)
    return -logp[val[:-1], val[1:]].mean().item()


@dataclass(frozen=True)
class RepeatedSegments:
    """Synthetic sequences for the induction experiment: each a uniformly random segment of
    tokens, its length drawn from [min_length, max_length], repeated to fill the window. The
    first copy cannot be predicted. Every later token can, by looking back one segment — what
    an induction head learns. Random lengths leave no positional shortcut.

    Example:
        >>> import torch
        >>> from qkv.training import RepeatedSegments
        >>> x, y = RepeatedSegments(16, 3, 3).batch(1, 8, torch.Generator().manual_seed(0))
        >>> x[0, :3].tolist() == x[0, 3:6].tolist(), torch.equal(x[0, 1:], y[0, :-1])
        (True, True)
    """

    vocab_size: int
    min_length: int
    max_length: int
    #: seeds the held-out sequences, the same for every run
    held_out_seed: int = 1_000_003

    def __post_init__(self) -> None:
        if not 1 <= self.min_length <= self.max_length:
            raise ValueError(
                f"segment lengths must satisfy 1 <= min <= max; got "
                f"({self.min_length}, {self.max_length})"
            )
        if self.vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2; got {self.vocab_size}")

    def batch(
        self, batch_size: int, block_size: int, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs (B, T) and targets (B, T), the inputs shifted by one token, int64."""
        lengths = torch.randint(
            self.min_length, self.max_length + 1, (batch_size, 1), generator=generator
        )
        segments = torch.randint(
            0, self.vocab_size, (batch_size, self.max_length), generator=generator
        )
        seq = segments.gather(1, torch.arange(block_size + 1) % lengths)  # (B, T + 1)
        return seq[:, :-1], seq[:, 1:]

    def held_out(self, count: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``count`` fixed sequences drawn from their own generator: never trained on."""
        return self.batch(count, block_size, torch.Generator().manual_seed(self.held_out_seed))


#: A word: an identifier or a number with the space before it, a newline with the
#: indentation after it, a run of spaces, or any other single character.
WORD = re.compile(r" ?[A-Za-z_][A-Za-z0-9_]*| ?[0-9]+|\n *| +|.", re.DOTALL)

#: the id of every word outside the vocabulary
UNKNOWN = 0


@dataclass(frozen=True)
class Words:
    """A corpus cut into words (:data:`WORD`), each mapped to an id of a vocabulary of the
    most frequent words of the training split. Every other word is :data:`UNKNOWN` (id 0).

    Closer than bytes to the tokens the induction-heads paper trained on: a name that
    recurs in a file is one token, which an induction head can copy forward.

    Attributes:
        train, val: int32 tensors of word ids.
        vocab: id -> word (``vocab[0]`` is ``"<unk>"``).
        unknown: the fraction of training words outside the vocabulary.
    """

    train: torch.Tensor
    val: torch.Tensor
    vocab: tuple[str, ...]
    source: str
    unknown: float

    def describe(self) -> str:
        return (
            f"words of {self.source}: {len(self.train):,} to train on and {len(self.val):,} "
            f"held out, a vocabulary of {len(self.vocab):,} ({self.unknown:.1%} of words "
            "outside it)"
        )

    def decode(self, ids: torch.Tensor | list[int]) -> str:
        """The text of word ids (``<unk>`` for unknown words)."""
        return "".join(self.vocab[int(i)] for i in ids)


def load_words(text: str | Path | None, vocab_size: int) -> Words:
    """The corpus of :func:`load_corpus` cut into words, with a vocabulary of
    ``vocab_size`` ids: ``<unk>`` and the ``vocab_size - 1`` most frequent training words
    (ties broken by first appearance, so the same corpus gives the same vocabulary)."""
    if vocab_size < 2:
        raise ValueError(f"a word vocabulary needs vocab_size >= 2; got {vocab_size}")
    corpus = load_corpus(text)
    train = WORD.findall(bytes(corpus.train.numpy()).decode("utf-8", "replace"))
    val = WORD.findall(bytes(corpus.val.numpy()).decode("utf-8", "replace"))
    counts = collections.Counter(train)
    vocab = ("<unk>", *(w for w, _ in counts.most_common(vocab_size - 1)))
    ids = {w: i for i, w in enumerate(vocab)}
    unknown = 1 - sum(counts[w] for w in vocab[1:]) / max(1, len(train))

    def encode(words: list[str]) -> torch.Tensor:
        return torch.tensor([ids.get(w, UNKNOWN) for w in words], dtype=torch.int32)

    return Words(encode(train), encode(val), vocab, corpus.source, unknown)
