"""Allocator benchmarks: pagekv's PageAllocator against the allocators it replaces.

Every result carries ``extra_info["pages_per_call"]``; ``report.py`` turns the JSON of a run into the
README's table of nanoseconds per page and ratios. Run:

    pytest benchmarks/bench_allocator.py --benchmark-only --benchmark-json=allocator.json
    python benchmarks/report.py allocator.json
"""

import subprocess
import sys

import pytest

from registry import ALLOCATORS, FIRST_FIT_MAX_POOL, Churn, batch_sizes, request_counts

POOL_SIZES = [2**10, 2**14, 2**18, 2**22]
FIRST_FIT_POOLS = [2**10, 2**12, 2**14, 2**16]


def cases(pools):
    for name in ALLOCATORS:
        for pool in pools:
            if name != "first_fit" or pool <= FIRST_FIT_MAX_POOL:
                yield pytest.param(name, pool, id=f"{name}-2^{pool.bit_length() - 1}")


def rounds_for(name, pool):
    """Rounds per timed call: first fit is O(pool) per page, so it gets fewer."""
    return max(1, 4096 // pool) if name == "first_fit" else 256


@pytest.mark.parametrize("kind", ["16", "1-64"])
@pytest.mark.parametrize("name, pool", list(cases(POOL_SIZES + FIRST_FIT_POOLS[1::2])))
def test_churn(benchmark, name, pool, kind):
    benchmark.group = f"churn {kind} pages|2^{pool.bit_length() - 1}"
    churn = Churn(ALLOCATORS[name](pool), pool, batch_sizes(kind, rounds_for(name, pool)))
    benchmark(churn)
    benchmark.extra_info["pages_per_call"] = churn.pages_taken / churn.calls
    benchmark.extra_info.update(allocator=name, pool=pool, workload=f"churn {kind}")


@pytest.mark.parametrize("name, pool", list(cases([2**14])))
def test_single_page_round_trip(benchmark, name, pool):
    benchmark.group = f"single page take+give|2^{pool.bit_length() - 1}"
    allocator = ALLOCATORS[name](pool)
    Churn(allocator, pool, batch_sizes("16", 1))  # half-full pool, as in serving
    take, give, trips = allocator.allocate_one, allocator.free_one, range(rounds_for(name, pool))

    def round_trips():
        for _ in trips:
            give(take())

    benchmark(round_trips)
    benchmark.extra_info["pages_per_call"] = len(trips)
    benchmark.extra_info.update(allocator=name, pool=pool, workload="single page")


@pytest.mark.parametrize("name, pool", list(cases([2**14])))
def test_decode_step_many_requests(benchmark, name, pool):
    """Pages for 256 requests of 1-4 pages in one step, then their release."""
    benchmark.group = f"256 requests x 1-4 pages|2^{pool.bit_length() - 1}"
    allocator = ALLOCATORS[name](pool)
    Churn(allocator, pool, batch_sizes("16", 1))
    counts = request_counts()
    counts_arg = counts if name == "pagekv" else counts.tolist()

    def step():
        allocator.free_many(allocator.allocate_many(counts_arg))

    benchmark(step)
    benchmark.extra_info["pages_per_call"] = int(counts.sum())
    benchmark.extra_info.update(allocator=name, pool=pool, workload="many requests")


_RSS_PROBE = """
import gc, sys, psutil
sys.path.insert(0, {folder!r})
from registry import ALLOCATORS
proc = psutil.Process()
gc.collect(); before = proc.memory_info().rss
allocator = ALLOCATORS[{name!r}]({pool})
allocator.allocate({pool})  # every page used: all bookkeeping touched
gc.collect(); print(proc.memory_info().rss - before)
"""


@pytest.mark.parametrize("name, pool", [("pagekv", 2**24), ("deque", 2**20), ("linked_list", 2**20)])
def test_bookkeeping_bytes_per_page(benchmark, name, pool):
    """Resident memory added by an allocator whose pages are all in use, per page (not a timing)."""
    import pathlib

    folder = str(pathlib.Path(__file__).parent)
    code = _RSS_PROBE.format(folder=folder, name=name, pool=pool)
    benchmark.group = "bookkeeping bytes per page"

    def measure():
        # -I: the working directory (the repository) must not shadow the installed package.
        return int(subprocess.run([sys.executable, "-I", "-c", code], check=True,
                                  capture_output=True, text=True).stdout)

    rss = benchmark.pedantic(measure, rounds=1, iterations=1)
    benchmark.extra_info.update(allocator=name, pool=pool, bytes_per_page=rss / pool)
    if name == "pagekv":
        assert rss / pool <= 9, f"expected <= 9 bytes per page, got {rss / pool:.2f}"
