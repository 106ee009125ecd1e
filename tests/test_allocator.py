"""PageAllocator: behaviour, edges and bad input (each bad input proves that nothing changed)."""

import gc
import threading
import tracemalloc

import numpy as np
import pytest

from pagekv import (
    InvalidPageError,
    InvariantError,
    OutOfPagesError,
    PageAllocator,
    PagekvError,
    PageStateError,
)
from wrong_values import MUTATIONS, refusal_problem

EDGE_POOL_SIZES = [1, 63, 64, 65, 127, 129, 2**16 + 1]


def snapshot(alloc):
    """Everything observable about a pool: free pages in hand-out order and every refcount."""
    everything = np.arange(alloc.num_pages)
    return (alloc.free_pages().tolist(), alloc.refcount(everything).tolist(),
            alloc.is_free(everything).tolist())


def _busy_pool():
    """A pool of 65 pages in a mixed state: shared, exclusive and free pages, a reordered stack."""
    alloc = PageAllocator(65)
    pages = alloc.allocate(40)
    alloc.incref(pages[:10])
    alloc.decref(pages[30:])  # 10 pages back on top of the stack, in a new order
    alloc.check()
    return alloc


@pytest.fixture
def busy():
    return _busy_pool()


# Every public call with valid arguments against _busy_pool() (page 3 is shared, 15 exclusive).
ALLOCATOR_CALLS = {
    "allocate": dict(n=2, after=3), "allocate_one": dict(after=3),
    "allocate_many": dict(counts=np.array([1, 2], np.int32), after=np.array([3, -1], np.int32)),
    "incref": dict(pages=np.array([3, 15], np.int32)), "incref_one": dict(page=15),
    "decref": dict(pages=np.array([3, 15], np.int32)), "decref_one": dict(page=15),
    "refcount": dict(pages=np.array([3, 15], np.int32)), "is_free": dict(pages=np.array([3, 15], np.int32)),
    "can_allocate": dict(n=2),
}
KEYWORD_ONLY = {"after"}


@pytest.mark.parametrize("method", sorted(ALLOCATOR_CALLS))
def test_every_wrong_argument_is_refused_cleanly_and_changes_nothing(method):
    """Each argument replaced by each wrong value (tests/wrong_values.py: floats, bools, huge and
    negative ints, strided, 2-D, float and complex arrays, ...): the call works, or raises
    ValueError/TypeError/PagekvError (MemoryError for too many pages) saying "expected ..." with
    the pool exactly as it was and its audit clean."""
    wrong = []
    for name, value in ALLOCATOR_CALLS[method].items():
        for label, applies, mutate in MUTATIONS:
            if not applies(value):
                continue
            alloc = _busy_pool()
            args = {**ALLOCATOR_CALLS[method], name: mutate(value)}
            positional = [v for k, v in args.items() if k not in KEYWORD_ONLY]
            keywords = {k: v for k, v in args.items() if k in KEYWORD_ONLY}
            problem = refusal_problem(lambda: getattr(alloc, method)(*positional, **keywords),
                                      lambda: snapshot(alloc))
            if problem:
                wrong.append(f"{name}={label}: {problem}")
            alloc.check()
    assert not wrong, "\n".join(wrong)


# ---------------------------------------------------------------- behaviour

def test_fresh_pool_starts_requests_far_apart_in_bit_reversed_order():
    assert PageAllocator(16).free_pages().tolist() == [0, 8, 4, 12, 2, 10, 6, 14,
                                                       1, 9, 5, 13, 3, 11, 7, 15]
    assert PageAllocator(10).free_pages().tolist() == [0, 8, 4, 2, 6, 1, 9, 5, 3, 7]
    assert PageAllocator(1).free_pages().tolist() == [0]
    alloc = PageAllocator(10)
    assert alloc.allocate(4).tolist() == [0, 1, 2, 3]  # one request: one run
    assert alloc.allocate_one() == 8
    assert (alloc.num_free, alloc.num_used) == (5, 5)
    alloc.check()


@pytest.mark.parametrize("num_pages", [1, 2, 3, 17, 63, 64, 65, 97, 1000])
def test_fresh_stack_is_a_permutation_for_any_size(num_pages):
    alloc = PageAllocator(num_pages)
    assert sorted(alloc.free_pages().tolist()) == list(range(num_pages))
    alloc.check()


def test_a_request_grows_onto_the_page_after_its_last_one():
    alloc = PageAllocator(64)
    a, b = alloc.allocate(3).tolist(), alloc.allocate(3).tolist()
    assert (a, b) == ([0, 1, 2], [32, 33, 34])
    for _ in range(5):  # side by side, a page each in turn, as decode steps take them
        a.append(alloc.allocate_one(after=a[-1]))
        b.append(alloc.allocate_one(after=b[-1]))
    assert a == list(range(8)) and b == list(range(32, 40))
    assert alloc.allocate(2, after=b[-1]).tolist() == [40, 41]
    alloc.check()


def test_a_taken_next_page_falls_back_to_the_top_and_the_run_goes_on_from_there():
    alloc = PageAllocator(16)
    first = alloc.allocate(4).tolist()              # 0..3
    other = alloc.allocate_one(after=first[-1])     # 4: the page after the run
    assert other == 4
    top = alloc.free_pages()[0]
    assert alloc.allocate(3, after=first[-1]).tolist() == [top, top + 1, top + 2]
    alloc.check()


def test_the_last_page_of_the_pool_has_no_next_page():
    alloc = PageAllocator(4)
    top = alloc.free_pages()[0]
    assert alloc.allocate_one(after=3) == top
    alloc.check()


def test_freeing_a_run_last_page_first_hands_it_out_again_in_order():
    alloc = PageAllocator(64)
    run = alloc.allocate(6)
    alloc.allocate(5)
    alloc.decref(run[::-1].copy())
    assert alloc.allocate(6).tolist() == run.tolist()
    alloc.check()


def test_allocate_many_grows_each_request_after_its_own_page():
    alloc = PageAllocator(64)
    a, b = alloc.allocate(2), alloc.allocate(2)
    pages, indptr = alloc.allocate_many([2, 0, 1], after=np.array([b[-1], -1, a[-1]]))
    assert pages.tolist() == [b[-1] + 1, b[-1] + 2, a[-1] + 1] and indptr.tolist() == [0, 2, 2, 3]
    alloc.check()


@pytest.mark.parametrize("call", [
    lambda alloc: alloc.allocate(1, after=64),
    lambda alloc: alloc.allocate(1, after=-2),
    lambda alloc: alloc.allocate_one(after=2**40),
    lambda alloc: alloc.allocate_many([1, 1], after=[0, 64]),
])
def test_after_outside_the_pool_raises_and_takes_nothing(call):
    alloc = PageAllocator(64)
    alloc.allocate(3)
    before = alloc.free_pages().tolist()
    with pytest.raises(InvalidPageError, match=r"expected after in \[-1, 64\)"):
        call(alloc)
    assert alloc.free_pages().tolist() == before
    alloc.check()


def test_after_of_the_wrong_shape_or_type_raises_and_takes_nothing():
    alloc = PageAllocator(8)
    with pytest.raises(ValueError, match=r"expected after of shape \(2,\)"):
        alloc.allocate_many([1, 1], after=[0])
    with pytest.raises(TypeError, match="expected an integer for after"):
        alloc.allocate(1, after=1.0)
    with pytest.raises(TypeError, match="expected an integer dtype for after"):
        alloc.allocate_many([1], after=[0.5])
    assert alloc.num_free == 8
    alloc.check()


def test_allocate_returns_int32_with_refcount_one():
    alloc = PageAllocator(100)
    pages = alloc.allocate(17)
    assert pages.dtype == np.int32 and pages.shape == (17,)
    assert len(set(pages.tolist())) == 17
    assert alloc.refcount(pages).tolist() == [1] * 17
    assert not alloc.is_free(pages).any()


def test_lifo_reuses_most_recently_freed_page_first():
    alloc = PageAllocator(10)
    pages = alloc.allocate(6)
    assert alloc.decref([pages[1], pages[4]]).tolist() == [1, 4]
    assert alloc.allocate(2).tolist() == [4, 1]


def test_decref_returns_only_pages_that_reached_zero():
    alloc = PageAllocator(8)
    alloc.allocate(4)
    alloc.incref([0, 0, 2])
    assert alloc.decref([0, 1, 2, 3]).tolist() == [1, 3]
    assert alloc.refcount([0, 1, 2, 3]).tolist() == [2, 0, 1, 0]
    assert alloc.decref([0, 0, 2]).tolist() == [0, 2]
    assert alloc.decref(np.empty(0, np.int32)).tolist() == []
    assert alloc.num_free == 8


def test_decref_of_an_int32_batch_freed_whole_returns_it_without_copy():
    alloc = PageAllocator(300)
    for n in (16, 200):  # small batches use a stack buffer, large ones the heap
        pages = alloc.allocate(n)
        assert alloc.decref(pages) is pages
        as_list = alloc.allocate(n).tolist()
        freed = alloc.decref(as_list)
        assert freed.dtype == np.int32 and freed.tolist() == as_list
    shared = alloc.allocate(3)
    alloc.incref(shared[:1])
    freed = alloc.decref(shared)
    assert freed is not shared and freed.tolist() == shared[1:].tolist()
    alloc.incref(shared[:1])
    empty = alloc.decref(shared[:1])  # refcount 2 -> 1: nothing freed
    assert empty.tolist() == [] and not empty.flags.writeable


def test_repeats_in_one_batch_are_legal_where_counts_allow():
    alloc = PageAllocator(4)
    page = alloc.allocate_one()
    alloc.incref([page, page, page])
    assert alloc.refcount([page]).tolist() == [4]
    assert alloc.decref([page, page, page, page]).tolist() == [page]
    assert alloc.num_free == 4


def test_single_page_fast_paths():
    alloc = PageAllocator(3)
    page = alloc.allocate_one()
    assert isinstance(page, int)
    alloc.incref_one(page)
    assert alloc.decref_one(page) is False
    assert alloc.decref_one(np.int64(page)) is True
    assert alloc.num_free == 3


def test_allocate_many_is_csr_with_empty_requests():
    alloc = PageAllocator(20)
    pages, indptr = alloc.allocate_many(np.array([3, 0, 1, 4], dtype=np.int64))
    assert indptr.dtype == np.int32 and pages.dtype == np.int32
    assert indptr.tolist() == [0, 3, 3, 4, 8]
    assert pages.tolist() == [0, 1, 2, 16, 8, 9, 10, 11]  # each request a run, far apart
    pages, indptr = alloc.allocate_many([])
    assert pages.tolist() == [] and indptr.tolist() == [0]
    alloc.check()


@pytest.mark.parametrize("pages", [
    [1, 2], (1, 2), np.array([1, 2], np.uint8), np.array([1, 2], np.int16),
    np.array([1, 2], np.uint64), np.array([9, 1, 9, 2])[1::2],  # non-contiguous view
    np.array([1, 2], dtype=">i4"),  # big-endian
])
def test_any_1d_integer_array_like_is_accepted(pages):
    alloc = PageAllocator(4)
    alloc.allocate(4)
    alloc.incref(pages)
    assert alloc.refcount(pages).tolist() == [2, 2]


def test_can_allocate_answers_without_acting():
    alloc = PageAllocator(5)
    alloc.allocate(3)
    assert alloc.can_allocate(2) and alloc.can_allocate(0) and not alloc.can_allocate(3)
    assert alloc.num_free == 2


def test_nbytes_is_under_nine_bytes_per_page():
    alloc = PageAllocator(2**20)
    assert alloc.nbytes == 2**20 * 8 + 2**20 // 8  # stack, refcount or stack index; bitmap
    assert alloc.nbytes / alloc.num_pages <= 9


def test_repr_names_the_state():
    assert repr(PageAllocator(7)) == "PageAllocator(num_pages=7, num_free=7)"


# ---------------------------------------------------------------- edges

@pytest.mark.parametrize("num_pages", EDGE_POOL_SIZES)
def test_edge_pool_emptied_completely_and_refilled(num_pages):
    alloc = PageAllocator(num_pages)
    for _ in range(2):
        pages = alloc.allocate(num_pages)
        assert sorted(pages.tolist()) == list(range(num_pages))
        assert alloc.num_free == 0 and not alloc.can_allocate(1)
        with pytest.raises(OutOfPagesError):
            alloc.allocate_one()
        alloc.check()
        rng = np.random.default_rng(num_pages)
        freed = alloc.decref(rng.permutation(pages))
        assert sorted(freed.tolist()) == list(range(num_pages))
        assert alloc.num_free == num_pages
        alloc.check()


@pytest.mark.parametrize("num_pages", EDGE_POOL_SIZES)
def test_edge_pool_last_page_of_the_bitmap(num_pages):
    alloc = PageAllocator(num_pages)
    alloc.allocate(num_pages)
    last = num_pages - 1
    assert alloc.decref([last]).tolist() == [last]
    assert alloc.is_free([last]).tolist() == [True]
    alloc.check()
    with pytest.raises(InvalidPageError):
        alloc.is_free([num_pages])


def test_million_rounds_end_all_free_without_memory_growth():
    alloc = PageAllocator(1024)
    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 65, size=1000)
    held = []
    gc.collect()
    tracemalloc.start()
    try:
        for round_ in range(10**6):
            if held and (len(held) > 8 or round_ % 3 == 0):
                alloc.decref(held.pop(int(sizes[round_ % 1000]) % len(held)))
            elif alloc.can_allocate(int(sizes[round_ % 1000])):
                held.append(alloc.allocate(int(sizes[round_ % 1000])))
            if round_ == 1000:
                gc.collect()
                baseline, _ = tracemalloc.get_traced_memory()
        while held:
            alloc.decref(held.pop())
        gc.collect()
        current, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert alloc.num_free == alloc.num_pages
    alloc.check()
    assert current - baseline < 64 * 1024, f"memory grew by {current - baseline} bytes"


def test_eight_threads_never_corrupt_the_pool():
    import sys

    alloc = PageAllocator(4099)
    held_by_thread = [[] for _ in range(8)]
    errors = []

    def worker(index):
        rng = np.random.default_rng(index)
        mine = held_by_thread[index]
        try:
            for _ in range(3000):
                action = rng.integers(4)
                if action == 0 and mine:
                    alloc.decref(mine.pop(rng.integers(len(mine))))
                elif action == 1 and mine:
                    pages = mine[rng.integers(len(mine))]
                    alloc.incref(pages)
                    alloc.decref(pages)
                else:
                    try:
                        mine.append(alloc.allocate(int(rng.integers(1, 65))))
                    except OutOfPagesError:
                        if mine:
                            alloc.decref(mine.pop(0))
                if len(mine) > 20:
                    alloc.decref(mine.pop(0))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter allows
    try:
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
    assert not errors
    alloc.check()
    held = np.concatenate([p for mine in held_by_thread for p in mine] or [np.empty(0, np.int32)])
    assert len(set(held.tolist())) == len(held), "a page was handed to two holders"
    assert len(held) + alloc.num_free == alloc.num_pages
    assert alloc.refcount(held).tolist() == [1] * len(held)
    assert set(held.tolist()).isdisjoint(alloc.free_pages().tolist())


# ---------------------------------------------------------------- bad input: error and no change

@pytest.mark.parametrize("n", [0, -1, -(2**70)])
def test_allocate_non_positive_n(busy, n):
    before = snapshot(busy)
    with pytest.raises(ValueError, match=r"expected n >= 1, got"):
        busy.allocate(n)
    assert snapshot(busy) == before


@pytest.mark.parametrize("n", [1.0, 2.5, "3", True, None, np.float64(2)])
def test_allocate_non_integer_n(busy, n):
    before = snapshot(busy)
    with pytest.raises(TypeError, match=r"expected an integer for n, got"):
        busy.allocate(n)
    assert snapshot(busy) == before


@pytest.mark.parametrize("n", [36, 65, 2**40, 10**30])
def test_allocate_more_than_free_is_all_or_nothing(busy, n):
    before = snapshot(busy)
    with pytest.raises(OutOfPagesError) as info:
        busy.allocate(n)
    assert (info.value.requested, info.value.available) == (n, 35)
    assert isinstance(info.value, MemoryError) and isinstance(info.value, PagekvError)
    assert snapshot(busy) == before


def test_allocate_many_over_budget_is_all_or_nothing(busy):
    before = snapshot(busy)
    with pytest.raises(OutOfPagesError) as info:
        busy.allocate_many([10, 20, 6])
    assert (info.value.requested, info.value.available) == (36, 35)
    with pytest.raises(OutOfPagesError) as info:
        busy.allocate_many([40, 50])  # more than the pool: the sum saturates inside, not here
    assert info.value.requested == 90
    with pytest.raises(OutOfPagesError) as info:
        busy.allocate_many([2**62, 2**62, 2**62])  # sums that would overflow int64
    assert info.value.requested == 3 * 2**62
    assert snapshot(busy) == before


def test_allocate_many_negative_count(busy):
    before = snapshot(busy)
    with pytest.raises(ValueError, match=r"expected counts >= 0, got -1 at index 2"):
        busy.allocate_many([1, 2, -1])
    assert snapshot(busy) == before


@pytest.mark.parametrize("op", ["incref", "decref", "refcount", "is_free"])
@pytest.mark.parametrize("bad", [-1, 65, 2**31, 2**40])
def test_out_of_range_page_id_last_in_batch(busy, op, bad):
    valid = busy.refcount(np.arange(65)).nonzero()[0][:5].tolist()
    before = snapshot(busy)
    with pytest.raises(InvalidPageError, match=rf"expected page ids in \[0, 65\), got {bad} at index 5"):
        getattr(busy, op)(np.array(valid + [bad], dtype=np.int64))
    assert snapshot(busy) == before


@pytest.mark.parametrize("op", ["incref_one", "decref_one"])
@pytest.mark.parametrize("bad", [-1, 65, 2**100])
def test_out_of_range_single_page(busy, op, bad):
    before = snapshot(busy)
    with pytest.raises(InvalidPageError, match=r"expected a page id in \[0, 65\), got"):
        getattr(busy, op)(bad)
    assert snapshot(busy) == before


def test_decref_of_free_page_is_a_double_free(busy):
    used = busy.refcount(np.arange(65)).nonzero()[0][:3].tolist()
    free = busy.free_pages()[0]
    before = snapshot(busy)
    with pytest.raises(PageStateError, match=rf"got free page {free} at index 3 \(double free\)"):
        busy.decref(used + [free])
    with pytest.raises(PageStateError, match="double free"):
        busy.decref_one(free)
    assert snapshot(busy) == before


def test_incref_of_free_page(busy):
    used = busy.refcount(np.arange(65)).nonzero()[0][:3].tolist()
    free = int(busy.free_pages()[-1])
    before = snapshot(busy)
    with pytest.raises(PageStateError, match=r"incref of a free page"):
        busy.incref(used + [free])
    with pytest.raises(PageStateError):
        busy.incref_one(free)
    assert snapshot(busy) == before


def test_decref_more_times_than_refcount_in_one_batch(busy):
    exclusive = int(np.flatnonzero(busy.refcount(np.arange(65)) == 1)[0])
    before = snapshot(busy)
    with pytest.raises(PageStateError, match=rf"expected at most 1 decrefs of page {exclusive}"):
        busy.decref([exclusive, exclusive])
    assert snapshot(busy) == before


def test_refcount_overflow_is_refused(busy):
    page = int(np.flatnonzero(busy.refcount(np.arange(65)) == 1)[0])
    busy._unsafe_set_refcount(page, 2**31 - 2)
    before = snapshot(busy)
    with pytest.raises(PageStateError, match=r"refcount below 2\*\*31 - 1"):
        busy.incref([page, page])
    assert snapshot(busy) == before


@pytest.mark.parametrize("pages, error", [
    (np.array([1.0, 2.0]), TypeError),
    ([1.5], TypeError),
    (np.array([True, False]), TypeError),
    (np.zeros((2, 2), np.int32), ValueError),
    (np.int32(3), ValueError),
    (["a"], TypeError),
])
@pytest.mark.parametrize("op", ["incref", "decref", "allocate_many"])
def test_non_integer_or_wrong_rank_pages(busy, op, pages, error):
    before = snapshot(busy)
    with pytest.raises(error, match="expected"):
        getattr(busy, op)(pages)
    assert snapshot(busy) == before


@pytest.mark.parametrize("num_pages, error", [
    (0, ValueError), (-5, ValueError), (2**31, ValueError), (2**80, ValueError),
    (1.0, TypeError), ("8", TypeError), (True, TypeError),
])
def test_construction_rejects_bad_sizes(num_pages, error):
    with pytest.raises(error, match="expected"):
        PageAllocator(num_pages)


# ---------------------------------------------------------------- the audit can fail

@pytest.mark.parametrize("corruption, message", [
    (lambda a, used, free: a._unsafe_set_refcount(free, 5), "not where the stack's index says"),
    (lambda a, used, free: a._unsafe_set_refcount(used, 0), "refcount below 1"),
])
def test_check_detects_corruption(busy, corruption, message):
    used = int(np.flatnonzero(busy.refcount(np.arange(65)))[0])
    free = int(busy.free_pages()[0])
    corruption(busy, used, free)
    with pytest.raises(InvariantError, match=message):
        busy.check()
