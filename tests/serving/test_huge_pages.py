"""The paged pools' storage (qkv._memory, which qkv.serving's pools take): zeros like
torch.zeros, and large CPU buffers on transparent huge pages where Linux gives them."""

import gc
import sys
from pathlib import Path

import pytest
import torch

import qkv
from qkv import _memory

LINUX = sys.platform.startswith("linux")
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_bytes_at(address: int) -> int:
    """The bytes on huge pages of the mapping holding `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1]) * 1024
    return 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("shape", [(3, 5, 7), (4, 1024, 1024), (2, 0, 8)])
def test_zeros_are_torch_zeros(shape, dtype):
    x = _memory.zeros(shape, dtype)
    assert x.shape == shape and x.dtype == dtype and x.is_contiguous()
    assert torch.equal(x.float(), torch.zeros(shape))


def test_large_buffers_start_on_a_huge_page_and_outlive_the_call():
    x = _memory.zeros((_memory.HUGE_FROM // 4 + 3,), torch.float32)
    if LINUX:
        assert x.data_ptr() % _memory.HUGE_PAGE == 0
    x[::1000] = torch.arange(len(range(0, x.numel(), 1000)), dtype=torch.float32)
    gc.collect()  # the mapping is held by the tensor, not by a name in zeros()
    assert torch.equal(x[::1000], torch.arange(len(range(0, x.numel(), 1000)), dtype=x.dtype))
    assert float(x.sum()) == float(sum(range(len(range(0, x.numel(), 1000)))))


def test_small_and_non_cpu_buffers_are_torch_s_own():
    small = _memory.zeros((1024,), torch.float32)
    assert small.untyped_storage().nbytes() == 4096  # no mapping, no slack
    meta = _memory.zeros((1 << 24,), torch.float32, device="meta")
    assert meta.device.type == "meta"


@pytest.mark.skipif(
    not LINUX or not THP.exists() or "[never]" in THP.read_text(),
    reason="transparent huge pages are off or absent here",
)
def test_a_written_cache_sits_on_huge_pages():
    pool = qkv.PagedKVCache(1024, 16, 8, 128, dtype=torch.bfloat16)  # 32 MiB of keys
    pool.keys.fill_(1.0)  # pages are taken as they are written
    assert huge_bytes_at(pool.keys.data_ptr()) >= _memory.HUGE_PAGE


def test_the_paged_pools_keep_their_storage_on_huge_pages_where_large():
    big = qkv.PagedKVCache(2048, 16, 8, 128, dtype=torch.int8)  # 32 MiB of keys
    small = qkv.PagedKVCache(4, 16, 2, 8)
    if LINUX:
        assert big.keys.data_ptr() % _memory.HUGE_PAGE == 0
        assert big.values.data_ptr() % _memory.HUGE_PAGE == 0
    assert small.keys.untyped_storage().nbytes() == small.keys.numel() * 4
    latent = qkv.serving.PagedLatentCache(2048, 16, 512, 64)  # 18 MiB of rows
    if LINUX:
        assert latent.rows.data_ptr() % _memory.HUGE_PAGE == 0
    contiguous = qkv.KVCache(4, 8, 4096, 128, dtype=torch.int8)  # read in long runs: not
    assert contiguous.keys.untyped_storage().nbytes() == contiguous.keys.numel()
