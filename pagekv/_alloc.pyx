"""PageAllocator: a fixed pool of page ids with a free list, a bitmap and reference counts.

This is the mechanism layer of pagekv (DESIGN.md §3). It knows nothing about sequences, tokens or
hashes; it hands out page ids, counts references and takes pages back.

Why this shape: the design note's allocator scanned the whole pool for the first free page on every
page (O(pool) per page, hours for a 2,097,152-page request) and kept a Python-visible struct per page.
Here a stack of free ids gives O(1) take and give, the bitmap answers "is this page free?" in O(1)
without trusting the stack, and the refcounts are a flat int32 array: no Python object per page.

Runs: an allocation grows each request onto the page after its previous one whenever that page is
free (the bitmap says so in one test; each free page's place in the stack, kept in the word that
holds a used page's refcount, takes it out of the middle in O(1), the bottom page filling a hole),
and a fresh pool's stack starts requests far apart (bit-reversed order), so sequences growing side
by side do not take each other's next pages. Attention reads a sequence's pages in table order, and
physically consecutive pages spare the memory system a jump per page (README, "Page runs"). 8.125
bytes of bookkeeping per page.

Thread safety: every read and write of the pool happens inside ``cython.critical_section(self)``,
which is a per-object mutex on free-threaded CPython and a no-op under the GIL. Under the GIL the
sections are still atomic because they contain only C code: every Python call (argument conversion,
creating result arrays, raising) happens before or after them, never inside, so no other thread can
run in the middle and no finalizer can re-enter the allocator.
"""

cimport cython
cimport numpy as cnp
from cpython.long cimport PyLong_AsLongLongAndOverflow, PyLong_Check
from cpython.mem cimport PyMem_Calloc, PyMem_Free, PyMem_Malloc
from libc.stdint cimport INT32_MAX, int32_t, int64_t, uint32_t, uint64_t
from libc.string cimport memcpy

import operator

import numpy as np

from pagekv.errors import InvalidPageError, InvariantError, OutOfPagesError, PageStateError

cnp.import_array()

__all__ = ["PageAllocator"]

ctypedef fused index_t:
    int32_t
    int64_t

cdef extern from *:
    int popcount64 "__builtin_popcountll"(unsigned long long) noexcept nogil

# Outcomes of the nogil batch loops; the Python wrappers turn them into exceptions.
cdef enum Status:
    OK = 0
    BAD_ID = 1          # page id outside [0, num_pages)
    BAD_STATE = 2       # incref/decref of a page with refcount 0
    OVERFLOW = 3        # incref past INT32_MAX
    OUT_OF_PAGES = 4

cdef object _EMPTY_PAGES = np.empty(0, dtype=np.int32)
_EMPTY_PAGES.flags.writeable = False


cdef inline bint _bit_is_set(const uint64_t* bitmap, int64_t page) noexcept nogil:
    return (bitmap[page >> 6] >> (page & 63)) & 1


cdef inline void _set_bit(uint64_t* bitmap, int64_t page) noexcept nogil:
    bitmap[page >> 6] |= (<uint64_t>1) << (page & 63)


cdef inline void _clear_bit(uint64_t* bitmap, int64_t page) noexcept nogil:
    bitmap[page >> 6] &= ~((<uint64_t>1) << (page & 63))


cdef inline uint32_t _reverse_bits(uint32_t x) noexcept nogil:
    x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1)
    x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2)
    x = ((x >> 4) & 0x0F0F0F0Fu) | ((x & 0x0F0F0F0Fu) << 4)
    x = ((x >> 8) & 0x00FF00FFu) | ((x & 0x00FF00FFu) << 8)
    return (x >> 16) | (x << 16)


cdef inline int32_t _free_word(int64_t index) noexcept nogil:
    """The word of a free page at ``index`` in the stack: -1 - index, never a refcount (>= 0)."""
    return <int32_t>(-1 - index)


cdef void _fill_spread(int32_t* stack, int32_t* word, int64_t n) noexcept nogil:
    """Fill a fresh stack so that it pops in bit-reversed order (0, n/2, n/4, 3n/4, ... for n a power
    of two; other sizes skip the reversed values >= n), recording each page's index in its word."""
    cdef int bits = 0
    cdef int64_t i, page, k = n - 1
    while (<int64_t>1 << bits) < n:
        bits += 1
    for i in range(<int64_t>1 << bits):
        page = _reverse_bits(<uint32_t>i) >> (32 - bits) if bits else 0
        if page < n:
            stack[k] = <int32_t>page
            word[page] = _free_word(k)
            k -= 1


cdef inline cnp.ndarray _new_int32(Py_ssize_t n):
    cdef cnp.npy_intp dims = n
    return cnp.PyArray_EMPTY(1, &dims, cnp.NPY_INT32, 0)


cdef int64_t _as_integer(object value, str name) except? -1:
    """``value`` as a C integer; a bool, float or other non-integer raises TypeError."""
    cdef int overflow = 0
    cdef long long result
    if not PyLong_Check(value) or isinstance(value, bool):
        if isinstance(value, (bool, np.bool_)):
            raise TypeError(f"expected an integer for {name}, got bool {value!r}")
        try:
            value = operator.index(value)
        except TypeError:
            raise TypeError(
                f"expected an integer for {name}, got {type(value).__name__} {value!r}"
            ) from None
    result = PyLong_AsLongLongAndOverflow(value, &overflow)
    if overflow:
        # Beyond 64 bits: clamp so the caller's range check reports it.
        return INT32_MAX + <int64_t>1 if overflow > 0 else -(INT32_MAX + <int64_t>2)
    return result


cdef cnp.ndarray _as_index_array(object values, str name):
    """``values`` as a 1-D C-contiguous int32 or int64 ndarray, without a copy where it already is one.

    Accepts any 1-D integer array-like (lists, tuples, numpy arrays of any integer dtype, objects with
    ``__array__`` such as torch tensors). Floats and bools raise TypeError; other ranks ValueError.
    """
    cdef cnp.ndarray fast
    cdef int type_num
    if type(values) is cnp.ndarray:  # the C type: no module attribute lookup on the hot path
        fast = <cnp.ndarray>values
        type_num = cnp.PyArray_TYPE(fast)
        if (cnp.PyArray_NDIM(fast) == 1 and (type_num == cnp.NPY_INT32 or type_num == cnp.NPY_INT64)
                and cnp.PyArray_IS_C_CONTIGUOUS(fast) and cnp.PyArray_ISNOTSWAPPED(fast)):
            return fast  # the fast path: no conversion, no copy
    arr = np.asarray(values)
    if arr.size == 0 and arr.ndim == 1 and not isinstance(values, np.ndarray):
        return _new_int32(0)  # [] and () arrive as float64
    if arr.ndim != 1:
        raise ValueError(f"expected a 1-D array for {name}, got {arr.ndim}-D with shape {arr.shape}")
    if arr.dtype.kind not in "iu":  # bool is kind "b": rejected too
        raise TypeError(f"expected an integer dtype for {name}, got {arr.dtype}")
    if arr.dtype == np.uint64 and arr.size and arr.max() > np.iinfo(np.int64).max:
        raise InvalidPageError(f"expected {name} below 2**63, got {int(arr.max())}")
    if arr.dtype == np.int32:
        return np.ascontiguousarray(arr, dtype=np.dtype("=i4"))  # native byte order
    return np.ascontiguousarray(arr, dtype=np.int64)


cdef inline void* _data(cnp.ndarray arr) noexcept:
    return cnp.PyArray_DATA(arr)


@cython.final
cdef class PageAllocator:
    """A fixed pool of ``num_pages`` page ids ``0 .. num_pages-1`` with reference counts.

    Parameters
    ----------
    num_pages : int
        Size of the pool, ``1 <= num_pages <= 2**31 - 1``.

    Notes
    -----
    State: a stack of free page ids (a ring buffer), a bitmap with one bit per page (1 = free),
    which is the truth for every state check, and one int32 word per page: a used page's reference
    count, a free page's index in the stack.

    Which pages an allocation takes: a request's first page is the page after ``after`` if that one
    is free, else the top of the stack (the most recently freed page); each further page is the page
    after the one before it if free, else the top again. So a sequence that passes its last page as
    ``after`` keeps growing in one physical run while the pages after it are free. A page taken
    that is on top is popped; one taken from the middle of the stack leaves its place to the bottom
    page, the last one due, so the order of the pages due next is kept. A fresh stack holds the
    pages in bit-reversed order (0, num_pages/2, num_pages/4, 3*num_pages/4, ... for a power of
    two): separate requests start far apart and each has room to grow. Pages freed by one
    :meth:`decref` are pushed in order, so freeing a run last page first hands it out again first
    page first.

    Invariants (audited by :meth:`check`):

    - a page is either free (bit 1, on the stack exactly once, where its word says; refcount 0)
      or used (bit 0, refcount >= 1, not on the stack);
    - ``num_free == stack size == popcount(bitmap)``.

    Every operation costs O(1) per page; only :meth:`check` scans the pool. Every operation is
    all-or-nothing: one that raises leaves the pool exactly as it was. Safe to share between Python
    threads.

    Examples
    --------
    >>> from pagekv import PageAllocator
    >>> alloc = PageAllocator(8)
    >>> pages = alloc.allocate(3)
    >>> pages
    array([0, 1, 2], dtype=int32)
    >>> alloc.allocate(2)                    # another request starts far away
    array([4, 5], dtype=int32)
    >>> alloc.allocate(1, after=2)           # the first request grows onto page 3
    array([3], dtype=int32)
    >>> alloc.incref(pages[:1])              # page 0 is now shared by two holders
    >>> alloc.decref(pages)                  # pages 1 and 2 return to the pool
    array([1, 2], dtype=int32)
    >>> alloc.num_free, alloc.refcount([0]).tolist()
    (4, [1])
    """

    cdef int32_t* _stack       # free page ids in a ring: from _bottom up, _num_free of them
    cdef int64_t _bottom
    # Per page, one word: a used page's refcount (>= 1), a free page's index i in _stack stored as
    # -1 - i (a free page's refcount is 0 and a used page is on no stack: one word holds either,
    # and its sign says which, so the reference counting needs no bitmap read).
    cdef int32_t* _count_or_index
    cdef uint64_t* _bitmap     # 1 bit per page, 1 = free; bits past num_pages stay 0
    cdef int64_t _num_words
    cdef int32_t _num_pages
    cdef int32_t _num_free

    def __cinit__(self, num_pages):
        cdef int64_t n = _as_integer(num_pages, "num_pages")
        cdef int64_t i
        if n < 1 or n > INT32_MAX:
            raise ValueError(f"expected num_pages in [1, 2**31 - 1], got {num_pages!r}")
        self._num_pages = <int32_t>n
        self._num_words = (n + 63) // 64
        self._stack = <int32_t*>PyMem_Malloc(n * sizeof(int32_t))
        self._count_or_index = <int32_t*>PyMem_Malloc(n * sizeof(int32_t))
        self._bitmap = <uint64_t*>PyMem_Calloc(self._num_words, sizeof(uint64_t))
        if self._stack == NULL or self._count_or_index == NULL or self._bitmap == NULL:
            raise MemoryError(f"cannot allocate the bookkeeping of {n} pages ({n * 8.125:.0f} bytes)")
        with nogil:
            _fill_spread(self._stack, self._count_or_index, n)
            for i in range(n // 64):
                self._bitmap[i] = ~(<uint64_t>0)
            if n % 64:
                self._bitmap[n // 64] = ((<uint64_t>1) << (n % 64)) - 1
        self._num_free = <int32_t>n
        self._bottom = 0

    def __dealloc__(self):
        PyMem_Free(self._stack)
        PyMem_Free(self._count_or_index)
        PyMem_Free(self._bitmap)

    def __repr__(self):
        return f"PageAllocator(num_pages={self._num_pages}, num_free={self._num_free})"

    # ------------------------------------------------------------------ queries
    @property
    def num_pages(self):
        """int : Size of the pool."""
        return self._num_pages

    @property
    def num_free(self):
        """int : Pages on the free list."""
        return self._num_free

    @property
    def num_used(self):
        """int : Pages with a refcount of at least 1."""
        return self._num_pages - self._num_free

    @property
    def nbytes(self):
        """int : Bytes of bookkeeping: free stack, refcounts or stack indices, bitmap (~8.125/page)."""
        return 2 * self._num_pages * sizeof(int32_t) + self._num_words * sizeof(uint64_t)

    def can_allocate(self, n):
        """Whether ``allocate(n)`` would succeed now.

        Parameters
        ----------
        n : int
            Number of pages, ``n >= 0``.

        Returns
        -------
        bool
        """
        cdef int64_t k = _as_integer(n, "n")
        if k < 0:
            raise ValueError(f"expected n >= 0, got {n!r}")
        return k <= self._num_free

    def free_pages(self):
        """The free pages, in the order the next allocations will hand them out. O(num_free).

        Returns
        -------
        ndarray of int32, shape (num_free,)
        """
        cdef cnp.ndarray out
        cdef int32_t* dst
        cdef int64_t i, n
        cdef bint copied = False
        while not copied:  # another thread may change num_free between sizing and copying
            n = self._num_free
            out = _new_int32(n)
            dst = <int32_t*>_data(out)
            with cython.critical_section(self):
                if n == self._num_free:
                    for i in range(n):
                        dst[i] = self._stack[self._at(n - 1 - i)]
                    copied = True
        return out

    def refcount(self, pages):
        """Reference counts of ``pages``.

        Parameters
        ----------
        pages : array_like of int, shape (n,)
            Page ids.

        Returns
        -------
        ndarray of int32, shape (n,)
            0 for a free page.
        """
        return self._read(pages, False)

    def is_free(self, pages):
        """Whether each of ``pages`` is free (read from the bitmap).

        Parameters
        ----------
        pages : array_like of int, shape (n,)
            Page ids.

        Returns
        -------
        ndarray of bool, shape (n,)
        """
        return self._read(pages, True)

    cdef cnp.ndarray _read(self, object pages, bint bits):
        """Refcounts (int32) or free bits (bool) of ``pages``; InvalidPageError for a bad id."""
        cdef cnp.ndarray ids = _as_index_array(pages, "pages")
        cdef Py_ssize_t n = cnp.PyArray_SIZE(ids)
        cdef cnp.ndarray out = np.empty(n, dtype=np.bool_ if bits else np.int32)
        cdef Py_ssize_t bad = 0
        cdef Status status
        cdef bint int32_ids = cnp.PyArray_TYPE(ids) == cnp.NPY_INT32
        with cython.critical_section(self):
            if int32_ids:
                status = self._read_state(<int32_t*>_data(ids), n, _data(out), bits, &bad)
            else:
                status = self._read_state(<int64_t*>_data(ids), n, _data(out), bits, &bad)
        if status != OK:
            self._raise_invalid(ids, bad)
        return out

    # ------------------------------------------------------------------ allocation
    # The four hot methods are plain C methods (binding False) rather than Cython function
    # objects: the call is cheaper (a 16-page allocate + decref round trip went from 152 to 141 ns,
    # a single-page one from 62 to 45 ns); embedsignature's "clinic" format keeps their signatures
    # visible to inspect and stubtest.
    @cython.binding(False)
    def allocate(self, n, *, after=None):
        """Take ``n`` distinct free pages, each with refcount 1, in one run where the pool allows.

        Parameters
        ----------
        n : int
            Number of pages, ``n >= 1``.
        after : int or None, optional
            The page the new ones follow (a sequence's last page): the first page taken is
            ``after + 1`` if that page is free. None or -1: no such page.

        Returns
        -------
        ndarray of int32, shape (n,)
            The pages: each the page after the one before it where that page was free, otherwise
            the most recently freed page.

        Raises
        ------
        OutOfPagesError
            Fewer than ``n`` pages are free; nothing was taken.
        InvalidPageError
            ``after`` outside ``[-1, num_pages)``.
        """
        cdef int64_t k = _as_integer(n, "n")
        cdef int64_t prev = self._as_after(after)
        cdef int32_t available
        cdef int32_t offsets[2]
        cdef bint ok
        if k < 1:
            raise ValueError(f"expected n >= 1, got {n!r}")
        if k > self._num_pages:  # the caller's n, not k: k is clamped beyond 64 bits
            raise OutOfPagesError(operator.index(n), self._num_free)
        cdef cnp.ndarray out = _new_int32(k)
        offsets[0], offsets[1] = 0, <int32_t>k
        with cython.critical_section(self):
            ok = self._take(<int32_t*>_data(out), offsets, 1, &prev)
            available = self._num_free
        if not ok:
            raise OutOfPagesError(k, available)
        return out

    @cython.binding(False)
    def allocate_one(self, *, after=None):
        """Take one free page with refcount 1: the single-page fast path of :meth:`allocate`.

        Parameters
        ----------
        after : int or None, optional
            As in :meth:`allocate`: the page ``after + 1`` is taken if it is free.

        Returns
        -------
        int
            The page id.

        Raises
        ------
        OutOfPagesError
            No page is free.
        InvalidPageError
            ``after`` outside ``[-1, num_pages)``.
        """
        cdef int64_t prev = self._as_after(after)
        cdef int32_t page
        cdef int32_t offsets[2]
        cdef bint ok
        offsets[0], offsets[1] = 0, 1
        with cython.critical_section(self):
            ok = self._take(&page, offsets, 1, &prev)
        if not ok:
            raise OutOfPagesError(1, 0)
        return page

    def allocate_many(self, counts, *, after=None):
        """Take ``counts[i]`` pages for each request ``i`` in one all-or-nothing call.

        Parameters
        ----------
        counts : array_like of int, shape (num_requests,)
            Pages wanted by each request, each ``>= 0``.
        after : array_like of int, shape (num_requests,), optional
            For each request, the page its new ones follow, as in :meth:`allocate` (-1: none).
            Requests are served in order, each a run of its own.

        Returns
        -------
        pages : ndarray of int32, shape (sum(counts),)
            All pages; request ``i`` owns ``pages[indptr[i]:indptr[i + 1]]``.
        indptr : ndarray of int32, shape (num_requests + 1,)
            CSR offsets into ``pages``.

        Raises
        ------
        OutOfPagesError
            The requests need more pages than are free; nothing was taken.
        InvalidPageError
            A value of ``after`` outside ``[-1, num_pages)``.

        Examples
        --------
        >>> from pagekv import PageAllocator
        >>> pages, indptr = PageAllocator(16).allocate_many([2, 0, 3])
        >>> pages.tolist(), indptr.tolist()
        ([0, 1, 8, 9, 10], [0, 2, 2, 5])
        """
        cdef cnp.ndarray wanted = _as_index_array(counts, "counts")
        cdef Py_ssize_t m = cnp.PyArray_SIZE(wanted)
        cdef cnp.ndarray indptr = _new_int32(m + 1)
        cdef cnp.ndarray follows = self._as_after_array(after, m)
        cdef int64_t total
        cdef Py_ssize_t bad = 0
        cdef int32_t available
        cdef bint ok
        if cnp.PyArray_TYPE(wanted) == cnp.NPY_INT32:
            total = _prefix_sum(<int32_t*>_data(wanted), m, self._num_pages,
                                <int32_t*>_data(indptr), &bad)
        else:
            total = _prefix_sum(<int64_t*>_data(wanted), m, self._num_pages,
                                <int32_t*>_data(indptr), &bad)
        if total == -1:
            raise ValueError(f"expected counts >= 0, got {int(wanted[bad])} at index {bad}")
        if total > self._num_pages:  # total saturates there: report the true sum
            raise OutOfPagesError(sum(wanted.tolist()), self._num_free)
        cdef cnp.ndarray out = _new_int32(total)
        cdef int32_t* pages = <int32_t*>_data(out)
        cdef int32_t* offsets = <int32_t*>_data(indptr)
        cdef const int64_t* prev = NULL
        if follows is not None:
            prev = <int64_t*>_data(follows)
        with cython.critical_section(self):
            ok = self._take(pages, offsets, m, prev)
            available = self._num_free
        if not ok:
            raise OutOfPagesError(total, available)
        return out, indptr

    # ------------------------------------------------------------------ reference counts
    def incref(self, pages):
        """Add one reference to each of ``pages`` (a page listed twice gets two).

        Parameters
        ----------
        pages : array_like of int, shape (n,)
            Pages in use.

        Raises
        ------
        InvalidPageError
            A page id outside ``[0, num_pages)``.
        PageStateError
            A page is free, or its refcount would pass 2**31 - 1.
        """
        cdef cnp.ndarray ids = _as_index_array(pages, "pages")
        cdef Py_ssize_t n = cnp.PyArray_SIZE(ids)
        cdef Py_ssize_t bad = 0
        cdef Status status
        with cython.critical_section(self):
            if cnp.PyArray_TYPE(ids) == cnp.NPY_INT32:
                status = self._incref(<int32_t*>_data(ids), n, &bad)
            else:
                status = self._incref(<int64_t*>_data(ids), n, &bad)
        if status != OK:
            self._raise_batch_error(status, ids, bad, "incref")

    def incref_one(self, page):
        """Add one reference to ``page``: the single-page fast path of :meth:`incref`."""
        cdef int64_t p = self._as_page(page)
        cdef Py_ssize_t bad = 0
        cdef Status status
        with cython.critical_section(self):
            status = self._incref(<int64_t*>&p, 1, &bad)
        if status != OK:
            self._raise_batch_error(status, np.array([p]), 0, "incref")

    @cython.binding(False)
    def decref(self, pages):
        """Drop one reference from each of ``pages``; pages that reach 0 return to the pool.

        Parameters
        ----------
        pages : array_like of int, shape (n,)
            Pages in use; a page may repeat as often as its refcount allows.

        Returns
        -------
        ndarray of int32, shape (k,)
            The pages that reached refcount 0, in the order they did; the last one is handed out
            first by the next allocation. When every page of an int32 ndarray ``pages`` reached 0,
            this is ``pages`` itself (the same values in the same order; no copy is made); when
            none did, it is a shared read-only empty array.

        Raises
        ------
        InvalidPageError
            A page id outside ``[0, num_pages)``.
        PageStateError
            A page is free (a double free), or is listed more times than its refcount.
        """
        cdef cnp.ndarray ids = _as_index_array(pages, "pages")
        cdef Py_ssize_t n = cnp.PyArray_SIZE(ids)
        cdef Py_ssize_t bad = 0, num_freed = 0
        cdef Status status
        cdef int32_t small[64]  # freed pages of a small batch: no heap allocation on the fast path
        cdef int32_t* scratch = small
        if n > 64:
            scratch = <int32_t*>PyMem_Malloc(n * sizeof(int32_t))
            if scratch == NULL:
                raise MemoryError(f"cannot allocate scratch space for {n} pages")
        try:
            with cython.critical_section(self):
                if cnp.PyArray_TYPE(ids) == cnp.NPY_INT32:
                    status = self._decref(<int32_t*>_data(ids), n, scratch, &num_freed, &bad)
                else:
                    status = self._decref(<int64_t*>_data(ids), n, scratch, &num_freed, &bad)
            if status != OK:
                self._raise_batch_error(status, ids, bad, "decref")
            if num_freed == 0:
                return _EMPTY_PAGES
            if num_freed == n and ids is pages and cnp.PyArray_TYPE(ids) == cnp.NPY_INT32:
                # Every page reached 0, so the freed pages are `pages`, element for element.
                return pages
            freed = _new_int32(num_freed)
            memcpy(_data(freed), scratch, num_freed * sizeof(int32_t))
            return freed
        finally:
            if scratch != small:
                PyMem_Free(scratch)

    @cython.binding(False)
    def decref_one(self, page):
        """Drop one reference from ``page``: the single-page fast path of :meth:`decref`.

        Returns
        -------
        bool
            Whether the page reached refcount 0 and returned to the pool.
        """
        cdef int64_t p = self._as_page(page)
        cdef int32_t freed_page
        cdef Py_ssize_t bad = 0, num_freed = 0
        cdef Status status
        with cython.critical_section(self):
            status = self._decref(<int64_t*>&p, 1, &freed_page, &num_freed, &bad)
        if status != OK:
            self._raise_batch_error(status, np.array([p]), 0, "decref")
        return num_freed == 1

    # ------------------------------------------------------------------ audit
    def check(self):
        """Audit every invariant in O(num_pages); raise :class:`InvariantError` on the first violation.

        Checks that the free stack holds ``num_free`` distinct in-range pages whose bits are set and
        whose refcounts are 0, that every other page has its bit clear and a refcount >= 1, and that
        the bitmap's popcount equals ``num_free`` (with no bits set past ``num_pages``).
        """
        cdef uint64_t* seen = <uint64_t*>PyMem_Calloc(self._num_words, sizeof(uint64_t))
        cdef int64_t problem = 0, where = 0
        if seen == NULL:
            raise MemoryError("cannot allocate the audit's scratch bitmap")
        try:
            with cython.critical_section(self):
                problem = self._audit(seen, &where)
        finally:
            PyMem_Free(seen)
        if problem:
            raise InvariantError(_AUDIT_MESSAGES[problem].format(where=where, self=self))

    def _unsafe_set_refcount(self, page, value):
        """Overwrite one page's word (a used page's refcount, a free page's index in the stack),
        bypassing every rule. A testing hook that breaks invariants on purpose, so tests can prove
        that :meth:`check` notices; never call it otherwise."""
        cdef int64_t p = self._as_page(page)
        self._count_or_index[p] = <int32_t>_as_integer(value, "value")

    # ------------------------------------------------------------------ nogil cores
    cdef inline int64_t _at(self, int64_t k) noexcept nogil:
        """Index in the ring of the k-th free page from the bottom."""
        k += self._bottom
        return k - self._num_pages if k >= self._num_pages else k

    cdef bint _take(self, int32_t* out, const int32_t* offsets, Py_ssize_t m,
                    const int64_t* after) noexcept nogil:
        """Move ``offsets[m]`` free pages to ``out`` with refcount 1, or do nothing. Request ``r``
        gets ``out[offsets[r]:offsets[r + 1]]``: each page the page after the one before it (the
        first: after ``after[r]``; none if ``after`` is NULL or -1) if that page is free, else the
        top of the stack. One loop for every request: a call per request cost as much as the pages."""
        # Locals, not self->fields: the stores below go through int32 pointers that C must assume
        # may alias the fields, which would force a reload of every field on every page.
        cdef int32_t* stack = self._stack
        cdef int32_t* word = self._count_or_index
        cdef uint64_t* bitmap = self._bitmap
        cdef int64_t num_pages = self._num_pages
        cdef int64_t bottom = self._bottom
        cdef int64_t top = bottom + self._num_free - 1  # may pass the ring's end: wrapped on use
        cdef int64_t prev, hole
        cdef Py_ssize_t r, i
        cdef int32_t page, moved
        if offsets[m] > self._num_free:
            return False
        for r in range(m):
            prev = after[r] if after != NULL else -1
            for i in range(offsets[r], offsets[r + 1]):
                if 0 <= prev < num_pages - 1 and _bit_is_set(bitmap, prev + 1):
                    page = <int32_t>(prev + 1)
                    hole = -1 - word[page]
                    if hole == (top - num_pages if top >= num_pages else top):
                        top -= 1  # on top already (a freed run taken again in order): a pop
                    else:
                        # Out of the middle: the bottom page (the last one due) fills the hole,
                        # so the pages due next keep their order (filled from the top, the page
                        # due next would sink: a fresh pool's next far-apart start).
                        moved = stack[bottom]
                        stack[hole] = moved
                        word[moved] = _free_word(hole)
                        bottom += 1
                        if bottom == num_pages:
                            bottom = 0
                else:
                    page = stack[top - num_pages if top >= num_pages else top]
                    top -= 1
                out[i] = page
                _clear_bit(bitmap, page)
                word[page] = 1  # its refcount from now on
                prev = page
        self._bottom = bottom
        self._num_free -= offsets[m]
        return True

    cdef Status _incref(self, const index_t* pages, Py_ssize_t n, Py_ssize_t* bad) noexcept nogil:
        cdef Py_ssize_t i, j
        cdef index_t page
        cdef Status status = OK
        cdef int32_t* refcount = self._count_or_index  # of used pages, the only ones changed
        for i in range(n):
            page = pages[i]
            if page < 0 or page >= self._num_pages:
                status = BAD_ID
            elif refcount[page] <= 0:  # free
                status = BAD_STATE
            elif refcount[page] == INT32_MAX:
                status = OVERFLOW
            else:
                refcount[page] += 1
                continue
            for j in range(i):  # undo: the batch is all-or-nothing
                refcount[pages[j]] -= 1
            bad[0] = i
            return status
        return OK

    cdef Status _decref(self, const index_t* pages, Py_ssize_t n, int32_t* freed,
                        Py_ssize_t* num_freed, Py_ssize_t* bad) noexcept nogil:
        # Two passes: decrement everything (undoing on the first bad element), and only then release
        # the pages that reached 0, so that a failed batch never touches the stack or the bitmap.
        cdef int32_t* word = self._count_or_index  # locals: see _take
        cdef uint64_t* bitmap = self._bitmap
        cdef int32_t* stack = self._stack
        cdef int64_t num_pages = self._num_pages
        cdef int64_t slot = self._bottom + self._num_free  # above the top, wrapped below
        cdef Py_ssize_t i, j, k = 0
        cdef index_t page
        for i in range(n):
            page = pages[i]
            # A free page (< 0), or one this batch already took to 0.
            if page < 0 or page >= num_pages or word[page] <= 0:
                for j in range(i):
                    word[pages[j]] += 1
                bad[0] = i
                return BAD_ID if (page < 0 or page >= num_pages) else BAD_STATE
            word[page] -= 1
            if word[page] == 0:
                freed[k] = <int32_t>page
                k += 1
        for j in range(k):
            if slot >= num_pages:
                slot -= num_pages
            stack[slot] = freed[j]
            word[freed[j]] = _free_word(slot)
            _set_bit(bitmap, freed[j])
            slot += 1
        self._num_free += <int32_t>k
        num_freed[0] = k
        return OK

    cdef Status _read_state(self, const index_t* pages, Py_ssize_t n, void* out, bint bits,
                            Py_ssize_t* bad) noexcept nogil:
        cdef Py_ssize_t i
        for i in range(n):
            if pages[i] < 0 or pages[i] >= self._num_pages:
                bad[0] = i
                return BAD_ID
            if bits:
                (<cnp.npy_bool*>out)[i] = _bit_is_set(self._bitmap, pages[i])
            else:
                (<int32_t*>out)[i] = max(self._count_or_index[pages[i]], 0)
        return OK

    cdef int64_t _audit(self, uint64_t* seen, int64_t* where) noexcept nogil:
        cdef int64_t i, page, popcount = 0
        if self._num_free < 0 or self._num_free > self._num_pages:
            where[0] = self._num_free
            return 1
        if self._bottom < 0 or self._bottom >= self._num_pages:
            where[0] = self._bottom
            return 10
        for i in range(self._num_free):
            page = self._stack[self._at(i)]
            where[0] = page
            if page < 0 or page >= self._num_pages:
                return 2
            if _bit_is_set(seen, page):
                return 3
            _set_bit(seen, page)
            if not _bit_is_set(self._bitmap, page):
                return 4
            if self._count_or_index[page] != _free_word(self._at(i)):
                return 9
        for page in range(self._num_pages):
            where[0] = page
            if _bit_is_set(self._bitmap, page) and not _bit_is_set(seen, page):
                return 6
            if not _bit_is_set(self._bitmap, page) and self._count_or_index[page] < 1:
                return 7
        for i in range(self._num_words):
            popcount += popcount64(self._bitmap[i])
        where[0] = popcount
        if popcount != self._num_free:
            return 8
        return 0

    # ------------------------------------------------------------------ error reporting
    cdef int64_t _as_page(self, object page) except? -1:
        cdef int64_t p = _as_integer(page, "page")
        if p < 0 or p >= self._num_pages:
            raise InvalidPageError(f"expected a page id in [0, {self._num_pages}), got {page!r}")
        return p

    cdef int64_t _as_after(self, object after) except? -2:
        """``after`` (None or a page id or -1) as a C integer, -1 for none."""
        if after is None:
            return -1
        cdef int64_t p = _as_integer(after, "after")
        if p < -1 or p >= self._num_pages:
            raise InvalidPageError(f"expected after in [-1, {self._num_pages}) (a page id, or -1 for "
                                   f"none), got {after!r}")
        return p

    cdef object _as_after_array(self, object after, Py_ssize_t m):
        """``after`` for ``m`` requests as a C-contiguous int64 array, or None for none."""
        if after is None:
            return None
        cdef cnp.ndarray ids = np.ascontiguousarray(_as_index_array(after, "after"), dtype=np.int64)
        if cnp.PyArray_SIZE(ids) != m:
            raise ValueError(f"expected after of shape ({m},) (one per request), got "
                             f"({cnp.PyArray_SIZE(ids)},)")
        if m:
            bad = np.flatnonzero((ids < -1) | (ids >= self._num_pages))
            if len(bad):
                raise InvalidPageError(f"expected after in [-1, {self._num_pages}) (a page id, or -1 "
                                       f"for none), got {int(ids[bad[0]])} at index {int(bad[0])}")
        return ids

    cdef void _raise_invalid(self, cnp.ndarray ids, Py_ssize_t bad) except *:
        raise InvalidPageError(
            f"expected page ids in [0, {self._num_pages}), got {int(ids[bad])} at index {bad}"
        )

    cdef void _raise_batch_error(self, Status status, cnp.ndarray ids, Py_ssize_t bad,
                                 str op) except *:
        if status == BAD_ID:
            self._raise_invalid(ids, bad)
        page = int(ids[bad])
        if status == OVERFLOW:
            raise PageStateError(f"expected a refcount below 2**31 - 1 for page {page}, "
                                 f"got an incref past it at index {bad}")
        if op == "incref":
            raise PageStateError(f"expected pages in use, got free page {page} at index {bad} "
                                 f"(incref of a free page)")
        if _bit_is_set(self._bitmap, page):
            raise PageStateError(f"expected pages in use, got free page {page} at index {bad} "
                                 f"(double free)")
        raise PageStateError(f"expected at most {self._count_or_index[page]} decrefs of page {page} "
                             f"(its refcount), got more: the extra one is at index {bad}")


cdef int64_t _prefix_sum(const index_t* counts, Py_ssize_t m, int64_t limit, int32_t* indptr,
                         Py_ssize_t* bad) noexcept nogil:
    """Fill ``indptr`` with the running sums of ``counts``; return the total, ``limit + 1`` once it
    passes ``limit`` (the offsets then stop mattering), or -1 for a negative count (index in bad)."""
    cdef Py_ssize_t i
    cdef int64_t total = 0
    indptr[0] = 0
    for i in range(m):
        if counts[i] < 0:
            bad[0] = i
            return -1
        if total <= limit:  # saturate at limit + 1: no overflow, however large the counts
            total = total + counts[i] if counts[i] <= limit - total else limit + 1
        indptr[i + 1] = <int32_t>total if total <= limit else 0
    return total


_AUDIT_MESSAGES = {
    1: "num_free is {where}, outside [0, num_pages]",
    2: "free stack holds page id {where}, outside the pool",
    3: "page {where} is on the free stack twice",
    4: "page {where} is on the free stack but its bitmap bit says used",
    6: "page {where} has its bitmap bit set (free) but is not on the free stack",
    7: "page {where} is used (bitmap bit clear) with a refcount below 1",
    8: "bitmap popcount is {where}, expected num_free = {self.num_free}",
    9: "free page {where} is not where the stack's index says it is",
    10: "the free stack's bottom is at {where}, outside the pool",
}
