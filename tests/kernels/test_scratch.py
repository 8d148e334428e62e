"""The tiled kernel's scratch buffer (qkv/kernels/tiled/scratch.py): what a call makes and
drops before it returns (native packs, a half-precision forward's float32 output, a
half-precision backward's float32 gradients) is kept from call to call where large, one
buffer per thread, a scope per call. The threshold is lowered here so that small calls
take it: nothing a call returns may share its memory, and the results are the same bits as
with fresh buffers."""

import threading

import pytest
import torch

import qkv
from qkv.kernels.tiled import scratch, steps
from tests.helpers import make_qkv

WIDEN = pytest.param(torch.float16, id="float16-widened")
DTYPES = [torch.float32, torch.bfloat16, WIDEN]


@pytest.fixture
def every_size(monkeypatch):
    """Every piece through the scratch buffer, this thread's freed before and after."""
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
    if not steps.available(torch.float32):
        pytest.skip("the native kernel does not run here")
    mask = qkv.masks.sliding_window(16)
    first = make_qkv(1, 4, 2, 45, 45, 32, 32, dtype=dtype, seed=1)
    g1 = torch.randn(1, 4, 45, 32).to(dtype)
    step(*first, mask, g1)  # the buffer sized
    got = step(*first, mask, g1)
    kept = [x.clone() for x in got]
    step(*make_qkv(1, 4, 2, 45, 45, 32, 32, dtype=dtype, seed=2), mask, g1)  # reuses them
    for a, b in zip(got, kept):
        assert torch.equal(a, b), "a result shared a scratch buffer the next call rewrote"
    held = scratch._arena.buffer
    if dtype == torch.float32:  # its backward returns its gradients and frees the buffer
        assert held is None
    else:
        assert held is not None, "the calls took no scratch buffer"
        lo, hi = held.data_ptr(), held.data_ptr() + held.numel()
        for x in got:
            assert not lo <= x.data_ptr() < hi
    monkeypatch.setattr(scratch, "SCRATCH_BYTES", 1 << 62)  # fresh buffers: the same bits
    for a, b in zip(step(*first, mask, g1), kept):
        assert torch.equal(a, b)


def test_a_scope_takes_pieces_in_turn_and_the_next_reuses_them(every_size):
    cpu = torch.device("cpu")
    scratch.start()
    first = scratch.take(10, torch.float32, cpu)  # no buffer yet: fresh tensors
    scratch.take(3, torch.bfloat16, cpu)
    assert scratch.held_bytes() == 0
    scratch.start()  # grown to what the last scope took: 40 bytes, then 6 at 64
    a, b = scratch.take(10, torch.float32, cpu), scratch.take(3, torch.bfloat16, cpu)
    assert scratch.held_bytes() == 70 and b.data_ptr() - a.data_ptr() == 64
    assert first.data_ptr() != a.data_ptr()
    scratch.start()  # the same memory again
    assert scratch.take(4, torch.float32, cpu).data_ptr() == a.data_ptr()
    scratch.take(100, torch.float32, cpu)  # past the buffer: fresh now, room next scope
    scratch.start()
    assert scratch.held_bytes() == 64 + 400  # the 4 floats, a line, then the 100
    scratch.release()
    assert scratch.held_bytes() == 0


def test_small_pieces_are_not_held():
    scratch.release()
    scratch.start()
    scratch.take(10, torch.float32, torch.device("cpu"))
    scratch.start()
    assert scratch.held_bytes() == 0


def test_each_thread_has_its_own(every_size):
    cpu = torch.device("cpu")
    for _ in range(2):
        scratch.start()
        mine = scratch.take(8, torch.float32, cpu).data_ptr()
    theirs = []

    def other():
        for _ in range(2):
            scratch.start()
            theirs.append(scratch.take(8, torch.float32, cpu).data_ptr())

    worker = threading.Thread(target=other)
    worker.start()
    worker.join()
    assert theirs[-1] != mine


def test_a_buffer_made_under_inference_mode_serves_training_calls(every_size):
    """The buffer is a normal tensor even when made under inference_mode: an inference
    tensor refuses in-place updates outside it (the sinks' forward scales its float32
    output in place; a view in another dtype happens to pass today, not a thing to rely
    on)."""
    if not steps.available(torch.float32):
        pytest.skip("the native kernel does not run here")
    mask = qkv.masks.causal()
    q, k, v = make_qkv(1, 4, 4, 300, 300, 32, 32, dtype=torch.bfloat16, seed=3)
    with torch.inference_mode():
        for _ in range(2):  # the second call's scope takes the buffer the first sized
            qkv.attention(q, k, v, mask=mask, backend="tiled")
    assert scratch.held_bytes() and not scratch._arena.buffer.is_inference()
    sinks = torch.zeros(4, requires_grad=True)
    q, k, v = (x[:, :, :100].clone().requires_grad_() for x in (q, k, v))
    out = qkv.attention(q, k, v, mask=mask, backend="tiled", sinks=sinks)
    out.float().sum().backward()
    assert q.grad is not None and sinks.grad is not None
