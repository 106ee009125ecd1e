"""ReferencePageAllocator: the plain-Python twin of :class:`pagekv.PageAllocator`.

Same contract and the same page-choice policy (a LIFO free list; a fresh pool hands out 0, 1, 2, ...;
pages freed by one decref are pushed in the order they reached refcount 0), so a test can demand that
both return identical page ids, not merely equally many.
"""

import operator

from pagekv.errors import InvalidPageError, OutOfPagesError, PageStateError

__all__ = ["ReferencePageAllocator"]

_REFCOUNT_MAX = 2**31 - 1


class ReferencePageAllocator:
    """A pool of ``num_pages`` page ids, kept in a list (the free stack), a set and a dict.

    Parameters
    ----------
    num_pages : int
        Size of the pool, ``1 <= num_pages <= 2**31 - 1``.
    """

    def __init__(self, num_pages: int) -> None:
        num_pages = _integer(num_pages, "num_pages")
        if not 1 <= num_pages <= _REFCOUNT_MAX:
            raise ValueError(f"expected num_pages in [1, 2**31 - 1], got {num_pages}")
        self.num_pages = num_pages
        self.free_stack = list(range(num_pages - 1, -1, -1))  # top is the end: page 0 first
        self.free = set(self.free_stack)
        self.refcounts: dict[int, int] = {}  # used pages only

    @property
    def num_free(self) -> int:
        return len(self.free_stack)

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free

    def can_allocate(self, n: int) -> bool:
        n = _integer(n, "n")
        if n < 0:
            raise ValueError(f"expected n >= 0, got {n}")
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        n = _integer(n, "n")
        if n < 1:
            raise ValueError(f"expected n >= 1, got {n}")
        if n > self.num_free:
            raise OutOfPagesError(n, self.num_free)
        pages = [self.free_stack.pop() for _ in range(n)]
        for page in pages:
            self.free.remove(page)
            self.refcounts[page] = 1
        return pages

    def allocate_many(self, counts) -> tuple[list[int], list[int]]:
        counts = [_integer(c, "counts") for c in counts]
        for i, c in enumerate(counts):
            if c < 0:
                raise ValueError(f"expected counts >= 0, got {c} at index {i}")
        total = sum(counts)
        if total > self.num_free:
            raise OutOfPagesError(total, self.num_free)
        indptr = [0]
        for c in counts:
            indptr.append(indptr[-1] + c)
        return (self.allocate(total) if total else []), indptr

    def incref(self, pages) -> None:
        # Elements are checked in order: the first bad one names the error, as in the fast allocator.
        after = dict(self.refcounts)
        for i, page in enumerate(self._ids(pages)):
            self._check_range(page, i)
            if page not in after:
                raise PageStateError(f"expected pages in use, got free page {page} at index {i}")
            if after[page] == _REFCOUNT_MAX:
                raise PageStateError(f"expected a refcount below 2**31 - 1 for page {page}")
            after[page] += 1
        self.refcounts = after

    def decref(self, pages) -> list[int]:
        after = dict(self.refcounts)
        freed = []
        for i, page in enumerate(self._ids(pages)):
            self._check_range(page, i)
            if after.get(page, 0) == 0:
                raise PageStateError(f"expected pages in use, got page {page} at index {i} "
                                     "with no reference left")
            after[page] -= 1
            if after[page] == 0:
                freed.append(page)
        for page in freed:
            del after[page]
            self.free_stack.append(page)
            self.free.add(page)
        self.refcounts = after
        return freed

    def refcount(self, pages) -> list[int]:
        return [self.refcounts.get(p, 0) for p in self._checked_ids(pages)]

    def is_free(self, pages) -> list[bool]:
        return [p in self.free for p in self._checked_ids(pages)]

    def check(self) -> None:
        """Raise ValueError if the twin's own bookkeeping disagrees with itself."""
        if len(self.free) != len(self.free_stack):
            raise ValueError("free stack holds a page twice")
        if self.free & self.refcounts.keys():
            raise ValueError("a page is both free and in use")
        if len(self.free) + len(self.refcounts) != self.num_pages:
            raise ValueError("a page is neither free nor in use")
        if any(c < 1 for c in self.refcounts.values()):
            raise ValueError("a used page has a refcount below 1")

    def _checked_ids(self, pages) -> list[int]:
        ids = self._ids(pages)
        for i, page in enumerate(ids):
            self._check_range(page, i)
        return ids

    @staticmethod
    def _ids(pages) -> list[int]:
        return [_integer(p, "pages") for p in pages]

    def _check_range(self, page: int, index: int) -> None:
        if not 0 <= page < self.num_pages:
            raise InvalidPageError(
                f"expected page ids in [0, {self.num_pages}), got {page} at index {index}"
            )


def _integer(value, name: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"expected an integer for {name}, got bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"expected an integer for {name}, got {type(value).__name__}") from None
