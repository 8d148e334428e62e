"""qkv.distributed: layouts in one process, and context-parallel attention on real gloo
process groups over loopback (127.0.0.1), every process under a timeout: outputs and
gradients of each rank's shards equal one process attending over the whole sequence."""

import socket
import time
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import qkv
from qkv import distributed as qd
from qkv import masks

T = 37  # not divisible by 2 or 3


def mask_named(name, B=2):
    ids = np.repeat([0, 1, 2], [15, 9, 13])
    return {
        "none": None,
        "causal": masks.causal(),
        "window": masks.sliding_window(5),
        "document&causal": masks.document(ids) & masks.causal(),
        "padding (a row with no key)": masks.padding([0, 30]),
        "prefix_lm": masks.prefix_lm(7),
        "sinks|window": masks.padding([4, 4]) | masks.sliding_window(3),
        "predicate": masks.predicate(lambda b, h, q, kv: (q + 2 * kv + h) % 3 != 0, "mod3"),
        "dense": torch.rand(B, 1, T, T, generator=torch.Generator().manual_seed(5)) < 0.5,
    }[name]


MASKS = [
    "none",
    "causal",
    "window",
    "document&causal",
    "padding (a row with no key)",
    "prefix_lm",
    "sinks|window",
    "predicate",
    "dense",
]


def check_case(rank, world, mask_name, layout_kind, schedule):
    mask = mask_named(mask_name)
    layout = (
        qd.Layout.contiguous(T, world)
        if layout_kind == "contiguous" or not isinstance(mask, masks.Mask)
        else qd.Layout.balanced(T, world, mask, block_k=4)
    )
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, T, 5, generator=g, dtype=torch.float64)  # GQA: 4 heads on 2
    k = torch.randn(2, 2, T, 5, generator=g, dtype=torch.float64)
    v = torch.randn(2, 2, T, 3, generator=g, dtype=torch.float64)
    w = torch.randn(2, 4, T, 3, generator=g, dtype=torch.float64)  # the loss's weights
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    want = qkv.attention(*full, mask=mask)
    (want * w).sum().backward()
    local = [layout.shard(x, 2, rank).requires_grad_() for x in (q, k, v)]
    # The ring streams pieces of at most ring_piece positions: one piece a shard with the
    # contiguous layout, pieces that cut the balanced layout's runs with it.
    piece = {"contiguous": 2048, "balanced": 5}[layout_kind]
    out = qd.attention(*local, layout=layout, mask=mask, schedule=schedule, ring_piece=piece)
    (out * layout.shard(w, 2, rank)).sum().backward()
    what = f"rank {rank}/{world}, {mask_name}, {layout_kind}, {schedule}"
    torch.testing.assert_close(
        out, layout.shard(want.detach(), 2, rank), atol=1e-10, rtol=0, msg=lambda m: f"{what}: {m}"
    )
    for name, mine, ref in zip("qkv", local, full):
        torch.testing.assert_close(
            mine.grad,
            layout.shard(ref.grad, 2, rank),
            atol=1e-10,
            rtol=0,
            msg=lambda m, name=name: f"d{name}: {what}: {m}",
        )
    back = layout.gather(out.detach(), dim=2)
    torch.testing.assert_close(
        back, want.detach(), atol=1e-10, rtol=0, msg=lambda m: f"gather: {what}: {m}"
    )


def worker(rank, world, port):
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    try:
        for mask_name in MASKS:
            for layout_kind in ("contiguous", "balanced"):
                for schedule in ("allgather", "ring"):
                    check_case(rank, world, mask_name, layout_kind, schedule)
        for positions, schedule in (("learned", "allgather"), ("rope", "ring")):
            check_gpt(rank, world, positions, schedule)
        for mask_name in ("causal", "padding (a row with no key)", "document&causal"):
            for schedule in ("allgather", "ring"):
                check_sinks(rank, world, mask_name, schedule)
        check_errors(rank, world)
    finally:
        dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "world", [2, pytest.param(3, marks=[pytest.mark.slow, pytest.mark.distributed])]
)
def test_context_parallel_equals_one_process(world):
    run_ranks(worker, world, timeout=240)


def test_contiguous_layout_cuts_uneven_lengths():
    layout = qd.Layout.contiguous(10, 3)
    assert layout.runs == (((0, 4),), ((4, 7),), ((7, 10),))
    assert [layout.size(r) for r in range(3)] == [4, 3, 3]
    assert qd.Layout.contiguous(2, 3).runs[2] == ()  # more ranks than positions
    x = torch.arange(10)[None]
    assert layout.shard(x, 1, rank=1).tolist() == [[4, 5, 6]]


def test_balanced_causal_is_head_tail():
    layout = qd.Layout.balanced(16, 2, masks.causal(), chunks_per_rank=2, block_k=2)
    assert layout.runs == (((0, 4), (12, 16)), ((4, 12),))
    layout = qd.Layout.balanced(24, 3, masks.causal(), chunks_per_rank=2, block_k=1)
    assert layout.runs == (((0, 4), (20, 24)), ((4, 8), (16, 20)), ((8, 16),))
    assert layout.positions(1).tolist() == [4, 5, 6, 7, 16, 17, 18, 19]


@pytest.mark.parametrize(
    "mask",
    [
        masks.causal(),
        masks.sliding_window(8),
        masks.document(np.repeat([0, 1, 2], [60, 20, 48])),
        masks.prefix_lm(32),
        None,
    ],
    ids=repr,
)
def test_balanced_layouts_even_the_work(mask):
    # Work = (query, key) pairs the mask leaves, per rank: within 10% of the mean.
    T, world = 128, 4
    layout = qd.Layout.balanced(T, world, mask, block_k=8)
    allowed = np.ones((T, T), bool) if mask is None else mask.to_numpy(1, 1, T, T)[0, 0]
    work = [allowed[layout.positions(r).numpy()].sum() for r in range(world)]
    assert max(work) <= 1.1 * np.mean(work), work
    contiguous = qd.Layout.contiguous(T, world)
    if repr(mask) == "causal()":  # where contiguous sharding is far off balance
        base = [allowed[contiguous.positions(r).numpy()].sum() for r in range(world)]
        assert max(base) > 1.5 * np.mean(base)


def test_layout_and_call_errors():
    with pytest.raises(ValueError, match="every position of T=4"):
        qd.Layout(4, (((0, 2),), ((1, 4),)))
    with pytest.raises(ValueError, match="world_size must be an int >= 1"):
        qd.Layout.contiguous(4, 0)
    with pytest.raises(TypeError, match="a dense mask has no structure"):
        qd.Layout.balanced(4, 2, torch.ones(4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="T=4 positions along dim 1"):
        qd.Layout.contiguous(4, 2).shard(torch.zeros(1, 5), 1, rank=0)


def check_sinks(rank, world, mask_name, schedule):
    """Sinks split across ranks: outputs, q/k/v gradients and the sinks' gradient summed
    over ranks equal one process's."""
    mask = mask_named(mask_name)
    layout = qd.Layout.balanced(T, world, mask, block_k=4)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, n, T, 5, generator=g, dtype=torch.float64) for n in (4, 2, 2))
    w = torch.randn(2, 4, T, 5, generator=g, dtype=torch.float64)
    sinks = torch.randn(4, generator=g, dtype=torch.float64)
    full = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
    want = qkv.attention(*full[:3], mask=mask, sinks=full[3])
    (want * w).sum().backward()
    local = [layout.shard(x, 2, rank).requires_grad_() for x in (q, k, v)]
    mine = sinks.clone().requires_grad_()
    out = qd.attention(
        *local, layout=layout, mask=mask, schedule=schedule, ring_piece=5, sinks=mine
    )
    (out * layout.shard(w, 2, rank)).sum().backward()
    what = f"sinks: rank {rank}/{world}, {mask_name}, {schedule}"
    torch.testing.assert_close(out, layout.shard(want.detach(), 2, rank), atol=1e-10, rtol=0)
    for name, x, ref in zip("qkv", local, full):
        torch.testing.assert_close(
            x.grad, layout.shard(ref.grad, 2, rank), atol=1e-10, rtol=0, msg=f"d{name}: {what}"
        )
    dsinks = mine.grad.clone()
    dist.all_reduce(dsinks)  # a replicated parameter: its gradient summed over ranks
    torch.testing.assert_close(dsinks, full[3].grad, atol=1e-10, rtol=0, msg=what)


def check_gpt(rank, world, positions, schedule):
    # A GPT split across ranks: each rank's logits, and the parameter gradients summed over
    # ranks, equal one process's (learned positions, or RoPE, at absolute positions).
    from qkv.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(
        GPTConfig(
            vocab_size=50,
            block_size=T,
            n_layer=2,
            n_head=4,
            n_kv_head=2,
            n_embd=16,
            positions=positions,
        )
    ).double()
    idx = torch.randint(0, 50, (2, T), generator=torch.Generator().manual_seed(1))
    layout = qd.Layout.balanced(T, world, masks.causal(), block_k=4)
    want = model(idx)
    want.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    out = model(layout.shard(idx, 1, rank), layout=layout, schedule=schedule)
    torch.testing.assert_close(out, layout.shard(want.detach(), 1, rank), atol=1e-10, rtol=0)
    out.sum().backward()
    for name, p in model.named_parameters():
        dist.all_reduce(p.grad)
        torch.testing.assert_close(p.grad, grads[name], atol=1e-10, rtol=0, msg=name)


@pytest.mark.distributed
def test_the_torchrun_example_runs_on_two_processes():
    import pathlib
    import subprocess
    import sys

    example = pathlib.Path(__file__).parents[2] / "examples" / "context_parallel.py"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(example),
            "--T",
            "512",
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "2 ranks, T=512: max |distributed - one process|" in r.stdout


def check_errors(rank, world):
    # Bad input on one rank, or calls that differ between ranks, end in a clear error on
    # every rank at the same point (no hang), and the group stays usable afterwards.
    layout = qd.Layout.contiguous(40, world)
    n = layout.size(rank)
    x = torch.zeros(1, 2, n, 4, dtype=torch.float64)
    cases = [
        (dict(schedule="zigzag"), "schedule must be one of"),
        (dict(schedule="ring", dropout_p=0.1), "the ring schedule has no dropout"),
        (dict(schedule="ring", ring_piece=0), "ring_piece must be an int >= 1; got 0"),
        (dict(schedule="ring", ring_piece=8 if rank else 16), "differ in ring_piece"),
        (dict(mask=masks.causal() if rank else masks.sliding_window(3)), "differ in mask"),
        (dict(query=x.float() if rank == 0 else x), "differ in dtype"),
        (dict(layout=qd.Layout.contiguous(40, world + 1)), "the layout is for"),
        (
            dict(query=x[:, :, :-1] if rank == 0 else x),
            "holds T_r=" if rank == 0 else r"rank\(s\) \[0\] passed invalid input",
        ),
    ]
    if world == 2:  # same shard sizes, other positions
        other = qd.Layout.balanced(40, 2, masks.causal(), chunks_per_rank=2)
        cases.append((dict(layout=other if rank else layout), "differ in layout"))
    for change, words in cases:
        kw = {"query": x, "key": x, "value": x, "layout": layout, **change}
        with pytest.raises(ValueError, match=words):
            qd.attention(kw.pop("query"), kw.pop("key"), kw.pop("value"), **kw)
    out = qd.attention(x, x, x, layout=layout, mask=masks.causal())  # still in step
    assert out.shape == x.shape


FLOAT32_MASKS = ["causal", "window", "documents", "prefix_lm", "padding", "composition"]


def float32_mask(name, T):
    rng = np.random.default_rng(T)
    ids = np.searchsorted(
        np.sort(rng.choice(np.arange(1, T), 5, replace=False)), np.arange(T), side="right"
    )  # 6 documents of random lengths
    return {
        "causal": masks.causal(),
        "window": masks.sliding_window(T // 8),
        "documents": masks.document(ids) & masks.causal(),
        "prefix_lm": masks.prefix_lm(T // 5),
        "padding": masks.padding([T - T // 3]),
        "composition": (masks.document(ids) & masks.causal()) | masks.prefix_lm(7),
    }[name]


class ByteCounter:
    """Bytes this rank hands to torch.distributed to send, by collective."""

    def __init__(self, monkeypatch_like):
        self.sent = {"all_gather": 0, "all_reduce": 0, "isend": 0}
        for name in self.sent:
            original = getattr(dist, name)

            def counting(tensor_or_list, *args, _name=name, _original=original, **kw):
                t = args[0] if _name == "all_gather" else tensor_or_list
                self.sent[_name] += t.numel() * t.element_size()
                return _original(tensor_or_list, *args, **kw)

            monkeypatch_like.setattr(dist, name, counting)


def worker_float32(rank, world, port, T, names):
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),
    )
    try:
        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, 4, T, 16, generator=g)
        k, v = (torch.randn(1, 2, T, 16, generator=g) for _ in range(2))
        for name in names:
            mask = float32_mask(name, T)
            full = [x.clone().requires_grad_() for x in (q, k, v)]
            want = qkv.attention(*full, mask=mask)
            want.sum().backward()
            layout = qd.Layout.balanced(T, world, mask)
            for schedule in ("allgather", "ring"):
                local = [layout.shard(x, 2).requires_grad_() for x in (q, k, v)]
                with pytest.MonkeyPatch.context() as mp_:
                    counter = ByteCounter(mp_)
                    out = qd.attention(
                        *local,
                        layout=layout,
                        mask=mask,
                        schedule=schedule,
                        check=False,
                        ring_piece=max(50, T // 16),
                    )
                    out.sum().backward()
                what = f"{name}, {schedule}, rank {rank}/{world}, T={T}"
                torch.testing.assert_close(
                    out, layout.shard(want.detach(), 2), atol=1e-5, rtol=0, msg=what
                )
                for x, ref in zip(local, full):
                    torch.testing.assert_close(
                        x.grad, layout.shard(ref.grad, 2), atol=1e-5, rtol=0, msg=what
                    )
                # Bytes against docs/distributed.md: e = B·H_kv·(D + D_v)·4 bytes a position.
                e, longest = 1 * 2 * 32 * 4, max(layout.size(r) for r in range(world))
                if schedule == "allgather":  # a padded shard out, the full gradient reduced
                    assert counter.sent == {
                        "all_gather": longest * e,
                        "all_reduce": T * e,
                        "isend": 0,
                    }, what
                else:  # forward: every shard but rank r+1's; backward: those shards
                    # again, and every shard's dK/dV accumulator (one extra pass home)
                    passed = 3 * T - 2 * layout.size((rank + 1) % world)
                    assert counter.sent == {
                        "all_gather": 0,
                        "all_reduce": 0,
                        "isend": passed * e,
                    }, what
    finally:
        dist.destroy_process_group()


def run_ranks(fn, world, *args, timeout=300):
    ctx = mp.start_processes(
        fn, args=(world, free_port(), *args), nprocs=world, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=1):  # raises if a rank failed
            if time.monotonic() > deadline:
                pytest.fail(f"{world} ranks did not finish in {timeout} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()


@pytest.mark.distributed
def test_four_ranks_float32_and_the_bytes_they_send():
    run_ranks(worker_float32, 4, 512, ["composition"])


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("T", [1000, 4096])
def test_float32_every_mask(T, world):
    """The issue's matrix: every mask kind, T in {1000, 4096}, 2 and 4 ranks, both
    schedules (the ring in pieces of T/16 positions), outputs, gradients and bytes."""
    run_ranks(worker_float32, world, T, FLOAT32_MASKS, timeout=900)


def worker_bfloat16(rank, world, port, T):
    """bfloat16 through the ring, where each rank's calls run qkv's native kernel (on a
    CPU that has it): out and gradients against one process's, which runs it too."""
    from qkv.kernels.tiled import native, steps

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),
    )
    try:
        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, 4, T, 64, generator=g).bfloat16()
        k, v = (torch.randn(1, 2, T, 64, generator=g).bfloat16() for _ in range(2))
        w = torch.randn(1, 4, T, 64, generator=g).bfloat16()
        assert native.supports(q, k, v) == steps.available()
        for mask in (masks.causal(), masks.sliding_window(100)):
            full = [x.clone().requires_grad_() for x in (q, k, v)]
            want = qkv.attention(*full, mask=mask, backend="tiled")
            (want.float() * w.float()).sum().backward()
            layout = qd.Layout.balanced(T, world, mask)
            local = [layout.shard(x, 2).requires_grad_() for x in (q, k, v)]
            out = qd.attention(*local, layout=layout, mask=mask, schedule="ring", ring_piece=T // 8)
            (out.float() * layout.shard(w, 2).float()).sum().backward()
            # The ring merges the same float32 partial results in another order: within a
            # unit or two of bfloat16's rounding of each result.
            what = f"{mask!r}, rank {rank}/{world}"
            torch.testing.assert_close(
                out.float(), layout.shard(want.detach(), 2).float(), atol=2e-2, rtol=2e-2, msg=what
            )
            for x, ref in zip(local, full):
                torch.testing.assert_close(
                    x.grad.float(),
                    layout.shard(ref.grad, 2).float(),
                    atol=6e-2,
                    rtol=3e-2,
                    msg=what,
                )
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_bfloat16_through_the_ring():
    run_ranks(worker_bfloat16, 2, 512)
