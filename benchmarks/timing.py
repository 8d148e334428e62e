"""What the benchmark scripts share: their timing loop (imported as ``timing`` by the scripts
run from this folder)."""

import statistics
import time
from collections.abc import Callable


def interleaved(calls: dict[str, Callable[[], object]] | dict, rounds: int) -> dict:
    """Median ms of each call over ``rounds`` runs after one warm-up round, the calls taking
    turns in a rotating order (so that a slow stretch of a shared machine falls on each)."""
    times: dict = {name: [] for name in calls}
    names = list(calls)
    for r in range(rounds + 1):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            t0 = time.perf_counter()
            calls[name]()
            if r:
                times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}
