"""Swap bandwidth of the RAM tier against a plain memory copy of the same bytes, in one run.

    pytest benchmarks/bench_swap.py --benchmark-only --benchmark-json=swap.json
    python benchmarks/report.py swap.json

Each round moves one 2,048-token sequence (128 pages of 1 MiB: 4 layers, 8 KV heads, head_dim 128,
bfloat16; 128 MiB, far beyond the last-level cache) between the hot cache and the tier: swap_out
(a parallel copy, then the pages are freed) and prefetch + wait (a one-core copy on a background
thread). The baseline is ``numpy.copyto`` of one contiguous 128 MiB buffer into another.
"""

import numpy as np
import pytest

from pagekv import KVCache, KVCacheManager, KVCacheSpec
from pagekv.swap import TieredKVCache
from pagekv.tier import OffloadTier

SPEC = KVCacheSpec(num_layers=4, num_kv_heads=8, head_dim=128, page_size=16, dtype="bfloat16")
TOKENS = 2048
PAGES = TOKENS // SPEC.page_size
NBYTES = PAGES * SPEC.bytes_per_page


@pytest.fixture(scope="module")
def tiered():
    manager = KVCacheManager(num_pages=2 * PAGES, page_size=SPEC.page_size, max_seqs=4,
                             max_pages_per_seq=PAGES, enable_prefix_caching=False)
    t = TieredKVCache(manager, KVCache(SPEC, 2 * PAGES), OffloadTier(SPEC, 2 * PAGES), spill_prefixes="none")
    manager.add_sequence("s", list(range(TOKENS)))
    t.cache.data[...] = 1  # touch every page once, so no round pays for first-touch page faults
    t.tier.data[...] = 1
    return t


def _info(benchmark, op):
    benchmark.group = f"swap|{NBYTES >> 20} MiB"
    benchmark.extra_info.update(kind="swap", op=op, nbytes=NBYTES)


def test_plain_copy(benchmark):
    src = np.ones(NBYTES // 2, np.uint16)
    dst = np.zeros_like(src)
    _info(benchmark, "numpy copyto")
    benchmark.pedantic(np.copyto, args=(dst, src), rounds=20, warmup_rounds=2)


def test_swap_out(benchmark, tiered):
    def back_in():
        if tiered.is_swapped("s"):
            tiered.prefetch(["s"])
            tiered.wait()
        return (["s"],), {}

    _info(benchmark, "swap_out")
    benchmark.pedantic(tiered.swap_out, setup=back_in, rounds=20, warmup_rounds=2)


def test_prefetch(benchmark, tiered):
    def out():
        if not tiered.is_swapped("s"):
            tiered.swap_out(["s"])
        return (), {}

    def prefetch_and_wait():
        tiered.prefetch(["s"])
        tiered.wait()

    _info(benchmark, "prefetch + wait")
    benchmark.pedantic(prefetch_and_wait, setup=out, rounds=20, warmup_rounds=2)
