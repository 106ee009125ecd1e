"""TieredKVCache: swap sequences between the hot KV cache and an :class:`~pagekv.tier.OffloadTier`,
prefetch them back on a background thread, and spill evicted prefix pages to the tier.

The manager's page tables are only ever changed on the caller's thread, and every change is whole
before it is visible: ``swap_out`` copies a sequence's pages to the tier and only then detaches it;
``prefetch`` attaches it to fresh hot pages (all sequences or none) and then starts a background
copy that writes only into those pages. Until :meth:`TieredKVCache.wait` (or ``is_ready``) says the
copy is done, the caller must not read, fork, append to or truncate that sequence; every other
sequence can be appended to, truncated, freed, swapped, or computed on meanwhile. A sequence is
swapped out at rest: its slots written (the manager's contract). A page of it may still wait for
a queued copy-on-write copy (a sequence that ``discard`` cut back keeps tokens that only the copy
brings): ``swap_out`` reads such a page's KV from the copy's source and leaves the queue to the
step that takes it.

A full page the hot prefix cache holds (a shared prompt, or the sequence's own full pages) is not
copied at swap-out: it stays in the hot cache, evictable, with a tier page set aside for it, and
its KV is copied there only if it leaves the cache (evicted or cleared) before the sequence comes
back; ``prefetch`` shares it again if it has not (:class:`pagekv.setaside.SetAside`). Evicted
while the tier keeps spilled prefixes, it is kept as one on that same tier page (the prefix and the
swapped sequence each hold a reference), not copied a second time.
"""

import threading

import numpy as np

from pagekv.cache import KVCache
from pagekv.errors import InvariantError, UnknownSequenceError
from pagekv.kernels import cache_ops as _cache_ops
from pagekv.kernels import threads as _threads
from pagekv.manager import KVCacheManager, hashable_id, id_list
from pagekv.setaside import SetAside
from pagekv.spill import PrefixSpill, check_spill_policy
from pagekv.tier import OffloadTier

__all__ = ["TieredKVCache"]


class _Prefetch:
    """One background copy of tier pages to hot pages, and the tier references it gives back when
    it is collected (one per sequence using a page: ``tier_references`` may repeat a page)."""

    def __init__(self, src, dst, tier_pages, hot_pages, tier_references):
        self.tier_references = tier_references
        self.thread = threading.Thread(target=_cache_ops.copy_across_serial,
                                       args=(src, dst, tier_pages, hot_pages),
                                       name="pagekv-prefetch", daemon=True)
        self.thread.start()


class TieredKVCache:
    """A hot KV cache (manager + KVCache) with a second tier of pages behind it.

    Parameters
    ----------
    manager : KVCacheManager
        Owns the hot pages' tables (``manager.allocator.num_pages == cache.num_pages``).
    cache : KVCache
        The hot pages.
    tier : OffloadTier
        The slower pages, of the same spec.
    spill_prefixes : {"reused", "all", "none"}
        Which prefix pages evicted from the hot prefix cache the tier keeps (:meth:`add_sequence`
        brings them back on a later hit): those a prompt added through :meth:`add_sequence` hit
        while they were hot (the default), all, or none. Anything but "none" needs prefix caching
        on the manager.

    Attributes
    ----------
    bytes_swapped_out, bytes_swapped_in, bytes_spilled, bytes_restored : int
        KV bytes moved each way so far.
    """

    def __init__(self, manager: KVCacheManager, cache: KVCache, tier: OffloadTier, *,
                 spill_prefixes="reused") -> None:
        if cache.spec != tier.spec or cache.spec.page_size != manager.page_size:
            raise ValueError(f"expected one spec for cache, tier and manager pages, got {cache.spec}, "
                             f"{tier.spec} and page_size {manager.page_size}")
        if manager.allocator.num_pages != cache.num_pages:
            raise ValueError(f"expected a manager of {cache.num_pages} pages (the cache's), "
                             f"got {manager.allocator.num_pages}")
        if check_spill_policy(spill_prefixes, "spill_prefixes") != "none" and manager.prefix is None:
            raise ValueError(f"expected a manager with prefix caching for spill_prefixes={spill_prefixes!r}")
        self.manager, self.cache, self.tier = manager, cache, tier
        self._hot = _planes(cache.data)
        self._cold = _planes(tier.data)
        self._swapped: dict = {}    # seq_id -> (DetachedSequence, tier pages int32)
        # hot cached pages swapped-out sequences left in the hot cache, with their tier pages
        self._set_aside = SetAside(manager, tier.allocator, self._to_tier)
        self.spill_prefixes = spill_prefixes
        self._inflight: dict = {}   # seq_id -> _Prefetch
        self._pages_out = 0  # copied at swap-out (pages set aside count as SetAside's)
        self.bytes_swapped_in = 0
        self._spill: PrefixSpill | None = None
        if manager.prefix is not None:  # a reopened tier file holds prefixes even if none spill
            spill = PrefixSpill(manager, tier, self._set_aside, copy_out=self._to_tier,
                                copy_in=self._from_tier, policy=spill_prefixes)
            manager.on_evict, manager.on_clear = spill.evicted, spill.cleared
            self._spill = spill

    # ------------------------------------------------------------------ swapping
    def swap_out(self, seq_ids) -> None:
        """Move each sequence's KV to the tier and free its hot pages (all or none). Full pages
        the hot prefix cache holds stay there (evictable) with a tier page set aside, copied only
        if they leave the cache before :meth:`prefetch`.

        Raises
        ------
        UnknownSequenceError
            An id the manager does not hold (a swapped or unknown one).
        ValueError
            A repeated id, an id swapped out already (a sequence added under it through the
            manager), or a sequence whose prefetch is still running.
        OutOfPagesError
            The tier has too few free pages even after dropping spilled prefixes; nothing changed.
        """
        seq_ids = id_list(seq_ids, distinct=True)
        if not seq_ids:
            return
        tables = [self.manager.page_table(seq_id) for seq_id in seq_ids]  # raises on unknown ids
        twice = [s for s in seq_ids if s in self._swapped]  # added to the manager under a swapped id
        if twice:
            raise ValueError(f"expected sequences not swapped out already, got {twice[0]!r}")
        busy = [s for s in seq_ids if s in self._inflight]
        if busy:
            raise ValueError(f"expected sequences at rest, got {busy[0]!r} with a prefetch running: wait() first")
        # A page the sequences share (forks, parallel samples) goes to the tier once, and holds a
        # tier reference per sequence: prefetching them together shares it again (attach_shared).
        hot, indices = _distinct_pages(tables)
        # a page still waiting for its copy-on-write copy holds nothing yet: read the copy's source
        sources, keys, known = self._set_aside.plan(hot)
        cold = self._set_aside.tier_pages(keys, known, self.tier.take(int((~known).sum())))
        now = np.array([key is None for key in keys], bool)  # the rest stays in the hot cache
        self._to_tier(sources[now], cold[now])
        self._pages_out += int(now.sum())
        # each use of a page by a sequence holds a tier reference (a new page comes with one)
        uses = np.bincount(np.concatenate(indices), minlength=len(hot)) - (~known).astype(np.int64)
        if uses.any():
            self.tier.allocator.incref(np.repeat(cold, uses))
        for seq_id, index in zip(seq_ids, indices):
            self._swapped[seq_id] = (self.manager.detach(seq_id), cold[index])

    def prefetch(self, seq_ids) -> None:
        """Bring swapped sequences back to fresh hot pages; the copy runs on a background thread.

        Full pages whose prefix key the hot prefix cache still holds (a prompt other sequences
        share, or pages of its own that were not evicted meanwhile) are shared again instead of
        copied back.

        The sequences are in the manager again at once (all or none); their KV is there after
        :meth:`wait` or when :meth:`is_ready` says so.

        Raises
        ------
        UnknownSequenceError
            An id that is not swapped out.
        OutOfPagesError, ValueError
            Too few hot pages or free rows for all of them; nothing changed.
        """
        seq_ids = id_list(seq_ids, distinct=True)
        if not seq_ids:
            return
        for seq_id in seq_ids:
            if seq_id not in self._swapped:
                raise UnknownSequenceError(f"expected a swapped-out sequence id, got {seq_id!r}")
        records = [self._swapped[seq_id][0] for seq_id in seq_ids]
        colds = [self._swapped[seq_id][1] for seq_id in seq_ids]
        # tier pages the sequences share (swapped out together) come back as one shared hot page;
        # full pages whose prefix the hot cache still holds (a shared prompt) are taken from it
        cold, indices = _distinct_pages(colds)
        hot, fresh = self.manager.attach_shared(seq_ids, records, indices, reuse_cached=True)
        for seq_id in seq_ids:
            del self._swapped[seq_id]
        self._set_aside.bring_in(cold[fresh])
        # the job gives back each sequence's tier references once the copy is done
        job = _Prefetch(self._cold, self._hot, cold[fresh], hot[fresh], np.concatenate(colds))
        for seq_id in seq_ids:
            self._inflight[seq_id] = job
        self.bytes_swapped_in += int(fresh.sum()) * self.cache.spec.bytes_per_page

    def is_ready(self, seq_id) -> bool:
        """Whether ``seq_id`` is in the hot cache with its KV in place (False while swapped out)."""
        job = self._inflight.get(hashable_id(seq_id))
        if job is None:
            return seq_id in self.manager
        if job.thread.is_alive():
            return False
        self._collect(job)
        return True

    def wait(self, seq_ids=None) -> None:
        """Block until the prefetches of ``seq_ids`` (default: all running ones) are done."""
        wanted = list(self._inflight) if seq_ids is None else id_list(seq_ids, distinct=True)
        for job in {id(self._inflight[s]): self._inflight[s] for s in wanted if s in self._inflight}.values():
            job.thread.join()
            self._collect(job)

    def free(self, seq_id) -> None:
        """Free a sequence wherever it is (hot, swapped, or being prefetched: waits for that first)."""
        if hashable_id(seq_id) in self._swapped:
            _, cold = self._swapped.pop(seq_id)
            self._set_aside.let_go(cold)
            return
        if seq_id in self._inflight:
            self.wait([seq_id])
        self.manager.free(seq_id)

    def is_swapped(self, seq_id) -> bool:
        return hashable_id(seq_id) in self._swapped

    def check(self) -> None:
        """Audit the manager, the tier's allocator and pages set aside, and the tier's reference
        counts: each tier page holds one reference per swapped-out sequence using it, per
        sequence of a prefetch not yet collected, and one if a spilled prefix is kept on it.
        O(num_pages); raises InvariantError."""
        self.manager.check()
        self.tier.allocator.check()
        self._set_aside.check()
        jobs = {id(job): job for job in self._inflight.values()}.values()
        held = ([cold for _, cold in self._swapped.values()] + [job.tier_references for job in jobs]
                + [np.fromiter(self.tier.prefixes.values(), np.int32, len(self.tier.prefixes))])
        expected = np.bincount(np.concatenate(held), minlength=self.tier.num_pages)
        actual = self.tier.allocator.refcount(np.arange(self.tier.num_pages))
        bad = np.flatnonzero(actual != expected)
        if len(bad):
            raise InvariantError(f"tier page {bad[0]}: refcount {actual[bad[0]]}, expected {expected[bad[0]]} "
                                 "(swapped and prefetching sequences using it + 1 if a spilled prefix)")

    # ------------------------------------------------------------------ prefix spill
    def add_sequence(self, seq_id, token_ids, *, cache_salt=None) -> int:
        """``manager.add_sequence``, after bringing back from the tier the prefix pages it would hit
        (those kept under the same ``cache_salt``: see ``manager.add_sequence``).

        Returns the prompt's cached tokens, as ``add_sequence`` does. Pages come back from the tier
        only for a call that will succeed (a new id, tokens the manager takes, room for the whole
        prompt: ``manager.can_add``), so a refused call changes nothing.

        Raises
        ------
        ValueError
            A ``seq_id`` that is swapped out, and what ``manager.add_sequence`` raises.
        """
        if hashable_id(seq_id) in self._swapped:
            raise ValueError(f"expected a new seq_id, got {seq_id!r}, which is swapped out")
        if self._spill is not None and seq_id not in self.manager:
            self._spill.restore(token_ids, cache_salt=cache_salt)
        return self.manager.add_sequence(seq_id, token_ids, cache_salt=cache_salt)

    # ------------------------------------------------------------------ traffic
    @property
    def bytes_swapped_out(self) -> int:
        return (self._pages_out + self._set_aside.pages_copied) * self.cache.spec.bytes_per_page

    @property
    def bytes_spilled(self) -> int:
        return self._spill.pages_spilled * self.cache.spec.bytes_per_page if self._spill else 0

    @property
    def bytes_restored(self) -> int:
        return self._spill.pages_restored * self.cache.spec.bytes_per_page if self._spill else 0

    # ------------------------------------------------------------------ helpers
    def _to_tier(self, hot, cold) -> None:
        """Copy hot pages' KV into tier pages (int32 [n] each)."""
        _threads.start()
        _cache_ops.copy_across(self._hot, self._cold, hot, cold)

    def _from_tier(self, cold, hot) -> None:
        """Copy tier pages' KV into hot pages (int32 [n] each), on this thread."""
        _threads.start()
        _cache_ops.copy_across(self._cold, self._hot, cold, hot)

    def _collect(self, job):
        """A finished prefetch: its tier pages go back to the tier, its sequences are at rest."""
        for seq_id in [s for s, j in self._inflight.items() if j is job]:
            del self._inflight[seq_id]
        self._set_aside.let_go(job.tier_references)


def _distinct_pages(tables):
    """The distinct pages of ``tables`` (one or more int32 arrays), and per table each entry's index
    into them (int64 arrays): the sharing between the tables, whatever the page ids."""
    pages, index = np.unique(np.concatenate(tables), return_inverse=True)
    return pages, np.split(index.reshape(-1), np.cumsum([len(t) for t in tables])[:-1])


def _planes(data):
    """[num_layers * 2, num_pages, page_elements] view of KV storage (float16 as its uint16 bits)."""
    layers, kv, pages = data.shape[:3]
    view = data.view(np.uint16) if data.dtype == np.float16 else data
    return view.reshape(layers * kv, pages, -1)
