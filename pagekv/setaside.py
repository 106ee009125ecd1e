"""SetAside: hot prefix-cache pages left in place at swap-out, each with a tier page set aside.

A swapped-out sequence's full pages that the hot prefix cache holds need not cross to the tier at
swap-out: they stay in the hot cache (evictable), and the prefetch shares them again if they are
still there. Each gets a tier page set aside (so the swap-out is still all-or-nothing and the KV
has a place to go), and its KV is copied there only when the page leaves the hot cache (evicted or
cleared: the manager's ``on_evict``/``on_clear`` hooks call :meth:`SetAside.leave_cache`). A
prefix key names the same tokens, so sequences swapped out at different times share one tier
page per key (one tier reference each).

This module keeps the bookkeeping; the caller moves the bytes (``copy(hot, cold)``), so
:class:`pagekv.swap.TieredKVCache` and the simulator's paged+swap policy count the same copies.
"""

import numpy as np

from pagekv.errors import InvariantError

__all__ = ["SetAside"]


class SetAside:
    """Tier pages set aside for hot cached pages, by prefix key.

    Parameters
    ----------
    manager : KVCacheManager
        The hot pages' manager (its prefix cache says which pages can stay).
    tier_allocator : PageAllocator
        The tier's pages.
    copy : callable
        ``copy(hot, cold)`` with int32 [n] page arrays: copy hot pages' KV into tier pages.

    Attributes
    ----------
    pages_copied : int
        Pages copied to their tier page as they left the hot cache, so far.
    """

    def __init__(self, manager, tier_allocator, copy) -> None:
        self.manager = manager
        self.tier_allocator = tier_allocator
        self.copy = copy
        self.cold_of: dict[bytes, int] = {}  # prefix key -> its tier page, until copied or let go
        self.key_of: dict[int, bytes] = {}   # the reverse
        self.pages_copied = 0

    def plan(self, pages):
        """Which of a swap-out's distinct hot ``pages`` (int32 [n]) stay in the hot cache.

        Returns
        -------
        sources : int32 [n]
            Where each page's KV is now (``manager.kv_sources``): a page that waits for a
            copy-on-write copy is not the cache's to keep, its KV is not there yet.
        keys : list of (bytes or None) [n]
            The prefix key of each page that stays (None: it crosses now).
        known : bool [n]
            Pages that have a tier page set aside already (another sequence left them first).
        """
        sources = self.manager.kv_sources(pages)
        prefix = self.manager.prefix
        key_of = prefix.key_of if prefix is not None else {}
        keys = [key_of.get(page) if page == source else None
                for page, source in zip(pages.tolist(), sources.tolist())]
        return sources, keys, np.array([key in self.cold_of for key in keys], bool)

    def tier_pages(self, keys, known, fresh):
        """The tier page of each planned page: a page set aside already, or one of ``fresh``
        (int32, one per page not ``known``, each with its allocation's reference), recorded as
        set aside for the pages that stay. Returns int32 [n]."""
        cold = np.empty(len(keys), np.int32)
        cold[~known] = fresh
        cold[known] = [self.cold_of[key] for key, k in zip(keys, known) if k]
        for key, page, k in zip(keys, cold.tolist(), known):
            if key is not None and not k:
                self.cold_of[key] = page
                self.key_of[page] = key
        return cold

    def leave_cache(self, keys, pages) -> dict:
        """Hot cached ``pages`` (int32) under ``keys`` leave the hot cache (the manager's
        ``on_evict``/``on_clear``): copy those set aside to their tier pages while they hold
        their KV. Returns {prefix key: tier page} of the pages copied (now plain tier pages)."""
        todo = [(key, page) for key, page in zip(keys, pages.tolist()) if key in self.cold_of]
        copied = {key: self.cold_of.pop(key) for key, _ in todo}
        if not copied:
            return copied
        hot = np.array([page for _, page in todo], np.int32)
        cold = np.fromiter(copied.values(), np.int32, len(copied))
        for page in cold.tolist():
            del self.key_of[page]
        self.copy(hot, cold)
        self.pages_copied += len(copied)
        return copied

    def bring_in(self, cold) -> None:
        """Tier pages ``cold`` (int32) are about to be copied back: those whose KV is still only
        in the hot cache (set aside and not shared again, e.g. a page the sequence fills only
        partly) get it first."""
        keys = [self.key_of[page] for page in cold.tolist() if page in self.key_of]
        if keys:
            self.leave_cache(keys, self._hot_pages(keys))

    def let_go(self, cold) -> None:
        """Drop a tier reference on each of ``cold`` (int32); a page set aside that returns to
        the tier's pool is no longer set aside."""
        if len(cold):
            for page in self.tier_allocator.decref(cold).tolist():
                key = self.key_of.pop(page, None)
                if key is not None:
                    del self.cold_of[key]

    def check(self) -> None:
        """Audit: the two maps are each other's inverse, every page set aside is held in the tier,
        and the hot prefix cache holds every key set aside (its KV is nowhere else). Raises
        InvariantError."""
        if {page: key for key, page in self.cold_of.items()} != self.key_of:
            raise InvariantError(f"expected the set-aside maps to be inverses, got {len(self.cold_of)} keys "
                                 f"and {len(self.key_of)} pages")
        cold = np.fromiter(self.key_of, np.int32, len(self.key_of))
        free = cold[self.tier_allocator.refcount(cold) == 0]
        if len(free):
            raise InvariantError(f"expected tier pages set aside to be held, got free page {free[0]}")
        if self.cold_of:
            self._hot_pages(list(self.cold_of))

    def _hot_pages(self, keys):
        """The hot cached pages (int32) of set-aside ``keys``; InvariantError if any is gone (only
        a discard of tokens whose KV was written takes such a page out, against the contract)."""
        page_of = self.manager.prefix.page_of
        lost = [key for key in keys if key not in page_of]
        if lost:
            raise InvariantError(f"expected the hot prefix cache to hold every page set aside, got "
                                 f"{len(lost)} gone uncopied")
        return np.array([page_of[key] for key in keys], np.int32)
