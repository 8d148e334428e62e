"""The page allocator keeps each sequence's pages in runs (qkv.serving.pages): a decode
step reads a sequence's pages in order, and from memory in runs as a stream."""

import itertools
import random

import pytest

from qkv.serving.pages import PageAllocator


def runs(table: list[int]) -> int:
    """How many runs of consecutive pages a block table is."""
    return 1 + sum(1 for x, y in itertools.pairwise(table) if y != x + 1) if table else 0


def test_a_sequence_grows_into_the_page_after_its_last():
    a = PageAllocator(64, 16)
    s, t = a.new_sequence(), a.new_sequence()
    a.reserve([s, t], [20, 20])
    assert a.table(s) == [0, 1]  # the first run starts at the pool's start
    assert a.table(t) == [33, 34]  # the next in the middle of the free pages: room for s
    a.reserve([s], [30])
    assert a.table(s) == [0, 1, 2, 3] and a.free_pages == 58


@pytest.mark.parametrize("spare", [0, 100])
def test_sequences_decoding_together_keep_their_pages_in_runs(spare):
    """32 sequences of different prompts growing a token a step, as a batch decodes: one
    free list handed out in turn put their pages 32 apart (a run a page)."""
    B, pages = 32, 64
    a = PageAllocator(B * pages + spare, 16)
    seqs = [a.new_sequence() for _ in range(B)]
    a.reserve(seqs, [random.Random(b).randint(1, 200) for b in range(B)])
    while min(a.length(s) for s in seqs) < pages * 16:
        a.reserve(seqs, [int(a.length(s) < pages * 16) for s in seqs])
    per_run = sum(len(a.table(s)) for s in seqs) / sum(runs(a.table(s)) for s in seqs)
    assert per_run >= 16, per_run
    assert a.free_pages == spare + B * pages - sum(len(a.table(s)) for s in seqs)


def test_runs_survive_sequences_coming_and_going():
    """Continuous batching: 16 live sequences of random lengths, each replaced when it
    ends; the finished sequences' pages still lie in long runs."""
    rnd, a, live, finished = random.Random(0), PageAllocator(1024, 16), {}, []
    for _ in range(3000):
        while len(live) < 16:
            s = a.new_sequence()
            a.reserve([s], [rnd.randint(10, 300)])
            live[s] = rnd.randint(100, 1500)
        a.reserve(list(live), [1] * len(live))
        for s in [s for s in live if a.length(s) >= live[s]]:
            finished.append(list(a.table(s)))
            a.release(s)
            del live[s]
    assert len(finished) > 50
    assert sum(map(len, finished)) / sum(map(runs, finished)) >= 8
    for s in live:
        a.release(s)
    assert a.free_pages == 1024 and not a.refs  # every page back, none counted twice
