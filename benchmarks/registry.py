"""One registry of allocators and workloads: it drives both the benchmarks and their correctness tests.

Every allocator is reached through the same names (``allocate``, ``free``, ``allocate_one``,
``free_one``, ``allocate_many``, ``free_many``); pagekv's are bound methods of the compiled object, so
the benchmarks time pagekv itself, not an adapter.
"""

import numpy as np

from baselines import DequeAllocator, FirstFitAllocator, LinkedListAllocator
from pagekv import PageAllocator


class PagekvAllocator:
    """pagekv's PageAllocator under the baselines' names."""

    def __init__(self, num_pages):
        self.impl = PageAllocator(num_pages)
        self.allocate = self.impl.allocate
        self.free = self.impl.decref
        self.allocate_one = self.impl.allocate_one
        self.free_one = self.impl.decref_one
        self.allocate_many = self.impl.allocate_many

    def free_many(self, result):
        self.impl.decref(result[0])  # (pages, indptr): every request's pages in one call


ALLOCATORS = {
    "pagekv": PagekvAllocator,
    "deque": DequeAllocator,
    "linked_list": LinkedListAllocator,
    "first_fit": FirstFitAllocator,
}

# First fit costs O(pool) per page: measured up to 2**16 to show that growth, not at 2**18 and 2**22
# where one benchmark round would take minutes.
FIRST_FIT_MAX_POOL = 2**16


def page_ids(pages):
    """Integer ids of whatever an allocator returns (ints, an ndarray, or block objects)."""
    return [p if isinstance(p, (int, np.integer)) else p.block_id for p in pages]


class Churn:
    """Serving-like churn at a half-full pool: release a random held batch, allocate a new one.

    Parameters
    ----------
    allocator : one of ALLOCATORS' instances
    batch_sizes : ndarray of int64, shape (rounds,)
        Pages per allocation, in the order they are taken; also sets the starting fill.
    seed : int
    """

    def __init__(self, allocator, num_pages, batch_sizes, *, seed=0):
        self.allocator = allocator
        self.sizes = [int(s) for s in batch_sizes]
        rng = np.random.default_rng(seed)
        num_held = max(1, int(num_pages // 2 // np.mean(self.sizes)))
        self.held = [allocator.allocate(self.sizes[i % len(self.sizes)]) for i in range(num_held)]
        self.victims = rng.integers(0, num_held, size=len(self.sizes)).tolist()
        self.pages_taken = 0
        self.calls = 0

    def __call__(self):
        allocate, free, held, victims = self.allocator.allocate, self.allocator.free, self.held, self.victims
        for size, victim in zip(self.sizes, victims):
            free(held[victim])
            held[victim] = allocate(size)
        self.pages_taken += sum(self.sizes)
        self.calls += 1


def batch_sizes(kind, rounds, *, seed=0):
    """``rounds`` allocation sizes: ``"16"`` (all 16) or ``"1-64"`` (uniform)."""
    if kind == "16":
        return np.full(rounds, 16)
    return np.random.default_rng(seed).integers(1, 65, size=rounds)


def request_counts(num_requests=256, *, seed=0):
    """Pages wanted by each request of a decode step: 1 to 4."""
    return np.random.default_rng(seed).integers(1, 5, size=num_requests)
