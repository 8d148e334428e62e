"""The tiled kernel's scratch buffers (qkv/kernels/tiled/scratch.py): what a call makes and
drops before it returns (native packs, a half-precision forward's float32 output, a
half-precision backward's float32 gradients) is kept from call to call where large. The
threshold is lowered here so that small calls take them: nothing a call returns may share
their memory, and the results are the same bits as with fresh buffers."""

import threading

import pytest
import torch

import qkv
from qkv.kernels.tiled import native, scratch
from tests.helpers import make_qkv

WIDEN = pytest.param(torch.float16, id="float16-widened")
DTYPES = [torch.float32, torch.bfloat16, WIDEN]


@pytest.fixture
def every_size(monkeypatch):
    """Every buffer through the scratch slots, this thread's freed before and after."""
    scratch.release()
    monkeypatch.setattr(scratch, "SCRATCH_BYTES", 0)
    yield
    scratch.release()


def step(q, k, v, mask, g):
    """out, and dQ, dK, dV of sum(out · g), through the native tiled kernel."""
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = qkv.attention(q, k, v, mask=mask, backend="tiled")
    return (out.detach(), *torch.autograd.grad((out * g).sum(), (q, k, v)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_results_neither_change_with_scratch_nor_share_its_memory(dtype, every_size, monkeypatch):
    if not native.available(torch.float32):
        pytest.skip("the native kernel does not run here")
    mask = qkv.masks.sliding_window(16)
    first = make_qkv(1, 4, 2, 45, 45, 32, 32, dtype=dtype, seed=1)
    g1 = torch.randn(1, 4, 45, 32).to(dtype)
    got = step(*first, mask, g1)
    kept = [x.clone() for x in got]
    step(*make_qkv(1, 4, 2, 45, 45, 32, 32, dtype=dtype, seed=2), mask, g1)  # reuses them
    for a, b in zip(got, kept):
        assert torch.equal(a, b), "a result shared a scratch buffer the next call rewrote"
    held = scratch.held_bytes()
    assert held > 0, "the calls took no scratch buffer"
    for x in got:
        start = x.data_ptr()
        for buffer in scratch._held.buffers.values():
            lo = buffer.data_ptr()
            assert not lo <= start < lo + buffer.numel() * buffer.element_size()
    monkeypatch.setattr(scratch, "SCRATCH_BYTES", 1 << 62)  # fresh buffers: the same bits
    for a, b in zip(step(*first, mask, g1), kept):
        assert torch.equal(a, b)


def test_a_slot_grows_is_reused_and_is_freed(every_size):
    a = scratch.take("t", 10, torch.float32, torch.device("cpu"))
    b = scratch.take("t", 6, torch.float32, torch.device("cpu"))
    assert b.data_ptr() == a.data_ptr() and scratch.held_bytes() == 40
    c = scratch.take("t", 20, torch.float32, torch.device("cpu"))
    assert c.numel() == 20 and scratch.held_bytes() == 80
    scratch.release()
    assert scratch.held_bytes() == 0


def test_small_buffers_are_not_held():
    scratch.release()
    scratch.take("t", 10, torch.float32, torch.device("cpu"))
    assert scratch.held_bytes() == 0


def test_each_thread_has_its_own(every_size):
    mine = scratch.take("t", 8, torch.float32, torch.device("cpu")).data_ptr()
    theirs = []
    worker = threading.Thread(
        target=lambda: theirs.append(scratch.take("t", 8, torch.float32, torch.device("cpu")))
    )
    worker.start()
    worker.join()
    assert theirs[0].data_ptr() != mine
