"""Correctness of every allocator in the benchmark registry, pagekv's and the baselines alike.

Benchmarks only mean something if every contestant does the same job: each must hand out distinct
pages, take them back, and keep the count of free pages.
"""

import numpy as np
import pytest

from registry import ALLOCATORS, Churn, batch_sizes, page_ids, request_counts


@pytest.mark.parametrize("name", ALLOCATORS)
def test_churn_keeps_pages_distinct_and_conserved(name):
    allocator = ALLOCATORS[name](1024)
    churn = Churn(allocator, 1024, batch_sizes("1-64", 50, seed=3), seed=3)
    for _ in range(3):
        churn()
        held = [p for batch in churn.held for p in page_ids(batch)]
        assert len(held) == len(set(held)), "a page was handed out twice"
        assert all(0 <= p < 1024 for p in held)
    for batch in churn.held:
        allocator.free(batch)
    assert sorted(page_ids(allocator.allocate(1024))) == list(range(1024))


@pytest.mark.parametrize("name", ALLOCATORS)
def test_single_pages_and_many_requests(name):
    allocator = ALLOCATORS[name](2048)
    page = allocator.allocate_one()
    allocator.free_one(page)
    counts = request_counts(seed=1)
    result = allocator.allocate_many(counts if name == "pagekv" else counts.tolist())
    if name == "pagekv":
        pages, indptr = result
        assert np.diff(indptr).tolist() == counts.tolist()
    else:
        assert [len(r) for r in result] == counts.tolist()
        pages = [p for r in result for p in page_ids(r)]
    assert len(set(page_ids(pages))) == counts.sum()
    allocator.free_many(result)
    assert sorted(page_ids(allocator.allocate(2048))) == list(range(2048))


@pytest.mark.parametrize("name", ALLOCATORS)
def test_freed_batch_returns_to_the_pool(name):
    allocator = ALLOCATORS[name](8)
    pages = allocator.allocate(4)
    allocator.free(pages)
    again = allocator.allocate(8)
    assert sorted(page_ids(again)) == list(range(8))
