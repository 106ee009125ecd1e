"""ReferencePageAllocator: the plain-Python twin of :class:`pagekv.PageAllocator`.

Same contract and the same page-choice policy (a free stack that a fresh pool fills in bit-reversed
order; each page taken is the page after the previous one of its request if that is free, else the
top, a page out of the middle (not the top) leaving its place to the bottom one; pages freed by one
decref are pushed in the order they reached refcount 0), so a test can demand that both return
identical page ids, not merely equally many.
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
        bits = (num_pages - 1).bit_length()
        spread = [int(format(i, f"0{bits}b")[::-1], 2) if bits else 0 for i in range(1 << bits)]
        self.free_stack = [page for page in spread if page < num_pages][::-1]  # top is the end
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

    def allocate(self, n: int, *, after=None) -> list[int]:
        n = _integer(n, "n")
        prev = self._after(after)
        if n < 1:
            raise ValueError(f"expected n >= 1, got {n}")
        if n > self.num_free:
            raise OutOfPagesError(n, self.num_free)
        return self._take(n, prev)

    def allocate_many(self, counts, *, after=None) -> tuple[list[int], list[int]]:
        counts = [_integer(c, "counts") for c in counts]
        follows = [-1] * len(counts) if after is None else [_integer(a, "after") for a in after]
        if len(follows) != len(counts):
            raise ValueError(f"expected after of shape ({len(counts)},), got ({len(follows)},)")
        for i, a in enumerate(follows):
            if not -1 <= a < self.num_pages:
                raise InvalidPageError(f"expected after in [-1, {self.num_pages}), got {a} at index {i}")
        for i, c in enumerate(counts):
            if c < 0:
                raise ValueError(f"expected counts >= 0, got {c} at index {i}")
        total = sum(counts)
        if total > self.num_free:
            raise OutOfPagesError(total, self.num_free)
        indptr = [0]
        for c in counts:
            indptr.append(indptr[-1] + c)
        return [page for c, a in zip(counts, follows) for page in self._take(c, a)], indptr

    def _take(self, n: int, prev: int) -> list[int]:
        pages = []
        for _ in range(n):
            if prev >= 0 and prev + 1 in self.free:
                page = prev + 1
                index = self.free_stack.index(page)  # from the bottom
                if index == len(self.free_stack) - 1:  # on top: a pop
                    self.free_stack.pop()
                else:
                    bottom = self.free_stack.pop(0)  # the last page due fills its place
                    if index:
                        self.free_stack[index - 1] = bottom
            else:
                page = self.free_stack.pop()
            self.free.remove(page)
            self.refcounts[page] = 1
            pages.append(page)
            prev = page
        return pages

    def _after(self, after) -> int:
        if after is None:
            return -1
        after = _integer(after, "after")
        if not -1 <= after < self.num_pages:
            raise InvalidPageError(f"expected after in [-1, {self.num_pages}), got {after}")
        return after

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
