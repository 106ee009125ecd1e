"""The allocators pagekv's PageAllocator replaces, written for this project as benchmark baselines.

Each exposes the same five operations (``allocate(n)``, ``free(pages)``, ``allocate_one()``,
``free_one(page)``, ``allocate_many(counts)``) so that one registry (``registry.py``) can drive them
all through the same workloads and the same correctness checks.
"""

from collections import deque

__all__ = ["FirstFitAllocator", "DequeAllocator", "LinkedListAllocator"]


class OutOfPages(MemoryError):
    pass


# ------------------------------------------------------------------ (a) the design note's first fit
class _NotePage:
    """The design note's ``struct Page`` (the device pointer is not needed on a CPU)."""

    __slots__ = ("id", "allocated", "ref_count")

    def __init__(self, page_id):
        self.id = page_id
        self.allocated = False
        self.ref_count = 0


class FirstFitAllocator:
    """A faithful port of the design note's ``FindFreePage`` / ``AllocatePages`` / ``FreePages``.

    ``FindFreePage`` scans the pool from page 0 for the first unallocated page: O(pool) per page. Its
    flaws are kept on purpose, since they are what is being measured against: a failed allocation
    keeps the pages it already took (the note's leak), and nothing checks for a double free.
    """

    def __init__(self, num_pages):
        self.global_page_pool = [_NotePage(i) for i in range(num_pages)]
        self.total_pages = num_pages

    def _find_free_page(self):
        for i in range(self.total_pages):
            if not self.global_page_pool[i].allocated:
                return i
        return -1

    def allocate(self, n):
        page_ids = []
        for _ in range(n):
            page_id = self._find_free_page()
            if page_id == -1:
                raise OutOfPages(n)  # the note returns OUT_OF_MEMORY here, keeping page_ids taken
            page = self.global_page_pool[page_id]
            page.allocated = True
            page.ref_count = 1
            page_ids.append(page_id)
        return page_ids

    def free(self, page_ids):
        for page_id in page_ids:
            page = self.global_page_pool[page_id]
            page.ref_count -= 1
            if page.ref_count == 0:
                page.allocated = False

    def allocate_one(self):
        return self.allocate(1)[0]

    def free_one(self, page_id):
        self.free((page_id,))

    def allocate_many(self, counts):
        return [self.allocate(c) for c in counts]

    def free_many(self, requests):
        for pages in requests:
            self.free(pages)


# ------------------------------------------------------------------ (b) deque free list
class DequeAllocator:
    """A ``collections.deque`` of free ids plus a Python list of refcounts, as minimal engines do."""

    def __init__(self, num_pages):
        self.free_pages = deque(range(num_pages))
        self.ref_counts = [0] * num_pages

    def allocate(self, n):
        if n > len(self.free_pages):
            raise OutOfPages(n)
        popleft = self.free_pages.popleft
        ref_counts = self.ref_counts
        pages = [popleft() for _ in range(n)]
        for page in pages:
            ref_counts[page] = 1
        return pages

    def free(self, pages):
        ref_counts = self.ref_counts
        for page in pages:
            ref_counts[page] -= 1
            if ref_counts[page] == 0:
                self.free_pages.append(page)

    def allocate_one(self):
        if not self.free_pages:
            raise OutOfPages(1)
        page = self.free_pages.popleft()
        self.ref_counts[page] = 1
        return page

    def free_one(self, page):
        self.ref_counts[page] -= 1
        if self.ref_counts[page] == 0:
            self.free_pages.append(page)

    def allocate_many(self, counts):
        if sum(counts) > len(self.free_pages):
            raise OutOfPages(sum(counts))
        return [self.allocate(c) for c in counts]

    def free_many(self, requests):
        for pages in requests:
            self.free(pages)


# ------------------------------------------------------------------ (c) doubly linked block objects
class _Block:
    """One page as a Python object in an intrusive doubly linked list (vLLM v1's KVCacheBlock)."""

    __slots__ = ("block_id", "ref_cnt", "prev_free_block", "next_free_block")

    def __init__(self, block_id):
        self.block_id = block_id
        self.ref_cnt = 0
        self.prev_free_block = None
        self.next_free_block = None


class LinkedListAllocator:
    """A doubly linked free list of block objects with sentinels, as vLLM v1's block pool keeps.

    Allocation pops from the head, freeing appends at the tail; a linked list (not a deque) because
    the real pool also removes blocks from the middle on prefix-cache hits. Pages are block objects;
    ``allocate`` returns them and ``free`` takes them back.
    """

    def __init__(self, num_pages):
        self.blocks = [_Block(i) for i in range(num_pages)]
        self.head = _Block(-1)
        self.tail = _Block(-1)
        previous = self.head
        for block in self.blocks:
            previous.next_free_block = block
            block.prev_free_block = previous
            previous = block
        previous.next_free_block = self.tail
        self.tail.prev_free_block = previous
        self.num_free_blocks = num_pages

    def _popleft(self):
        block = self.head.next_free_block
        self.head.next_free_block = block.next_free_block
        block.next_free_block.prev_free_block = self.head
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1
        return block

    def _append(self, block):
        last = self.tail.prev_free_block
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self.tail
        self.tail.prev_free_block = block
        self.num_free_blocks += 1

    def allocate(self, n):
        if n > self.num_free_blocks:
            raise OutOfPages(n)
        blocks = [self._popleft() for _ in range(n)]
        for block in blocks:
            block.ref_cnt += 1
        return blocks

    def free(self, blocks):
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._append(block)

    def allocate_one(self):
        return self.allocate(1)[0]

    def free_one(self, block):
        self.free((block,))

    def allocate_many(self, counts):
        if sum(counts) > self.num_free_blocks:
            raise OutOfPages(sum(counts))
        return [self.allocate(c) for c in counts]

    def free_many(self, requests):
        for pages in requests:
            self.free(pages)
