"""The page allocator of a paged KV cache: which pages each sequence holds, and what one
forward pass appends.

A :class:`PageAllocator` holds one pool's block tables, lengths, page reference counts and
free list. It serves every layer's pool of a model at once, since their sequences hold the
same pages in every layer. A :class:`Pass` is a forward pass over a batch of sequences. Each
of its appends is reserved once (an :class:`Append` holds the slots, the lengths before and
after, and the prefix tree and block tables attention reads) and used by every layer.

Legend: B sequences in a batch · P page size.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch

Node = tuple[list[int], list[int]]  # rows of a batch, the full pages they all hold there
_FREE_RUN = re.compile(b"\x01+")  # a stretch of free pages in PageAllocator.free


class PageAllocator:
    """Which pages each sequence holds: block tables, lengths, reference counts and the
    free pages. One allocator serves one pool, or the pools of every layer of a model at
    once, since they move in step (:class:`PagedCaches`).

    A sequence's pages are kept in runs, side by side in the pool, wherever they can be: its
    next page is the one after its last, if free; else (a first page, or the next one
    taken) a new run starts in the middle of the longest stretch of free pages (at its
    start, if nothing lies before it), leaving the sequence before it room to grow. A decode
    step reads each sequence's pages in order, and from memory in runs it reads them as a
    stream; sequences decoding together that each take their next page in turn from one
    free list (as this allocator did before) hold runs of one page, and the step then takes
    several times as long (docs/benchmarks.md, "Page runs")."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.num_pages, self.page_size = num_pages, page_size
        self.refs: dict[int, int] = {}  # page -> how many sequences hold it
        self.free = bytearray(b"\x01") * num_pages  # 1: page i is free
        self.free_pages = num_pages
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}
        self.next = 0

    def table(self, seq: int) -> list[int]:
        if seq not in self.tables:
            raise KeyError(f"no live sequence {seq} in this PagedKVCache")
        return self.tables[seq]

    def length(self, seq: int) -> int:
        self.table(seq)
        return self.lengths[seq]

    def new_sequence(self) -> int:
        seq, self.next = self.next, self.next + 1
        self.tables[seq], self.lengths[seq] = [], 0
        return seq

    def release(self, seq: int) -> None:
        for page in reversed(self.table(seq)):
            self.refs[page] -= 1
            if self.refs[page] == 0:
                del self.refs[page]
                self.free[page] = 1
                self.free_pages += 1
        del self.tables[seq], self.lengths[seq]

    def take(self, after: int | None = None) -> int:
        """A free page for a sequence whose last page is ``after`` (None: it holds none):
        the page after it if free, else a new run's first (the class's docstring). The
        caller has checked that a page is free."""
        if after is not None and after + 1 < self.num_pages and self.free[after + 1]:
            page = after + 1
        else:
            a, b = max((m.span() for m in _FREE_RUN.finditer(self.free)), key=lambda r: r[1] - r[0])
            page = a if a == 0 else a + (b - a) // 2
        self.free[page] = 0
        self.free_pages -= 1
        self.refs[page] = 1
        return page

    def fork(self, seq: int) -> tuple[int, tuple[int, int] | None]:
        """A child sharing seq's full pages, and (from, to) when its partly filled last
        page must be copied into a page of the child's own."""
        table, length = self.table(seq), self.length(seq)
        full = length // self.page_size
        if len(table) > full and not self.free_pages:
            raise ValueError("PagedKVCache full: no page free to copy the forked last page into")
        child = self.new_sequence()
        self.tables[child] = list(table[:full])
        for page in table[:full]:
            self.refs[page] += 1
        copy = None
        if len(table) > full:
            copy = (table[full], self.take(table[full - 1] if full else None))
            self.tables[child].append(copy[1])
        self.lengths[child] = length
        return child, copy

    def shared_prefix(self, seqs: Sequence[int]) -> int:
        if not seqs:
            return 0
        # only full pages count: at most the shortest sequence's
        full = min(self.lengths[s] for s in seqs) // self.page_size
        return _common([self.table(s) for s in seqs], 0, full)

    def reserve(self, seqs: Sequence[int], counts: Sequence[int]) -> list[int]:
        """Reserve counts[b] more tokens for sequence seqs[b], taking pages as needed and
        advancing lengths, and return the slots (page · P + offset) the new tokens go to,
        sequence by sequence.
        A pool too small raises and changes nothing."""
        if len(set(seqs)) != len(seqs):
            raise ValueError(f"a sequence appears twice in {list(seqs)}")
        P, tables, lengths = self.page_size, self.tables, self.lengths
        for s in seqs:
            self.table(s)
        needed = sum(-(-(lengths[s] + n) // P) - len(tables[s]) for s, n in zip(seqs, counts))
        if needed > self.free_pages:
            raise ValueError(
                f"PagedKVCache full: appending {sum(counts)} tokens to {len(seqs)} sequences "
                f"needs {needed} more pages of {P} tokens; {self.free_pages} of "
                f"{self.num_pages} are free (free finished sequences, or make the pool larger)"
            )
        slots: list[int] = []
        for s, n in zip(seqs, counts):
            table, start = tables[s], lengths[s]
            while len(table) * P < start + n:
                table.append(self.take(table[-1] if table else None))
            slots += [table[i // P] * P + i % P for i in range(start, start + n)]
            lengths[s] = start + n
        return slots

    def block_tables(self, seqs: Sequence[int], skip: int | Sequence[int] = 0) -> list[list[int]]:
        skips = [skip] * len(seqs) if isinstance(skip, int) else skip
        tables = [self.table(s)[k:] for s, k in zip(seqs, skips)]
        n = max((len(t) for t in tables), default=0)
        return [t + [0] * (n - len(t)) for t in tables]

    def prefix_tree(self, seqs: Sequence[int]) -> tuple[list[Node], list[int]]:
        """The prefixes these sequences share, as a tree: nodes (rows of seqs, the full pages
        they all hold there, in order), and for each row the page its own keys start at
        (past every node it is in). All of them sharing a system prompt is one node, and
        groups sharing more below it are nodes of their own."""
        P = self.page_size
        tables = [self.table(s) for s in seqs]
        full = [self.lengths[s] // P for s in seqs]  # only full pages are shared
        nodes: list[Node] = []
        starts = [0] * len(seqs)

        def split(rows: list[int], depth: int) -> None:
            end = _common([tables[r] for r in rows], depth, min(full[r] for r in rows))
            if end > depth:
                nodes.append((rows, tables[rows[0]][depth:end]))
            groups: dict[int, list[int]] = {}
            for r in rows:
                starts[r] = end
                if full[r] > end:
                    groups.setdefault(tables[r][end], []).append(r)
            for group in groups.values():
                if len(group) > 1:
                    split(group, end)

        if len(seqs) > 1:
            split(list(range(len(seqs))), 0)
        return nodes, starts


def _common(tables: list[list[int]], depth: int, end: int) -> int:
    """Where the run of pages every table holds alike, from ``depth`` up to at most ``end``,
    ends."""
    first = tables[0][depth:end]
    for t in tables[1:]:
        mine = t[depth:end]
        if mine != first:  # (a list comparison: one C loop per table)
            end = depth + next(i for i, (a, b) in enumerate(zip(mine, first)) if a != b)
            first = first[: end - depth]
    return end


class Append:
    """One append of ``counts[b]`` tokens to each sequence b, reserved once for
    every layer: the lengths before and after, the slots the tokens go to, and (made when
    first asked) the block tables attention reads."""

    def __init__(self, allocator: PageAllocator, seqs: list[int], counts: tuple[int, ...]) -> None:
        self.allocator, self.seqs, self.counts = allocator, seqs, counts
        self.before = torch.tensor([allocator.length(s) for s in seqs], dtype=torch.long)
        self.slots = torch.tensor(allocator.reserve(seqs, counts), dtype=torch.long)
        self.after = self.before + torch.tensor(counts, dtype=torch.long)
        self._tree: tuple[list[Node], list[int]] | None = None
        self._own: tuple[torch.Tensor, torch.Tensor] | None = None

    def tree(self) -> tuple[list[Node], list[int]]:
        """:meth:`PageAllocator.prefix_tree` of the batch after this append (made once)."""
        if self._tree is None:
            self._tree = self.allocator.prefix_tree(self.seqs)
        return self._tree

    def own(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sequence's pages past the prefixes it shares, as a (B, max_pages) block table,
        and their tokens (B,), both int32 and made once for every layer."""
        if self._own is None:
            _, starts = self.tree()
            table = torch.tensor(self.allocator.block_tables(self.seqs, starts), dtype=torch.int32)
            held = self.after - torch.tensor(starts) * self.allocator.page_size
            self._own = table.view(len(self.seqs), -1), held.to(torch.int32)
        return self._own


class Pass:
    """The bookkeeping of a forward pass over a paged batch, done once for every layer:
    each layer's k-th append uses the k-th :class:`Append` (made by the first layer that
    gets there), so the layers' pools, which share one allocator, stay in step."""

    def __init__(self, allocator: PageAllocator, seqs: list[int]) -> None:
        self.allocator, self.seqs = allocator, seqs
        self.appends: list[Append] = []

    def append(self, k: int, counts: tuple[int, ...]) -> Append:
        if k < len(self.appends):
            done = self.appends[k]
            if done.counts != counts:
                raise ValueError(
                    f"the layers of a paged batch went out of step: append {k} was of "
                    f"{sum(done.counts)} tokens in one layer and {sum(counts)} in another"
                )
            return done
        self.appends.append(Append(self.allocator, self.seqs, counts))
        return self.appends[-1]

    def held(self, k: int) -> torch.Tensor:
        """The tokens each sequence holds in a layer that has made k appends."""
        if k < len(self.appends):
            return self.appends[k].before
        return torch.tensor([self.allocator.length(s) for s in self.seqs], dtype=torch.long)
