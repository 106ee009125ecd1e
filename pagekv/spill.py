"""PrefixSpill: prefix pages the hot prefix cache evicts kept in a tier, and brought back on a hit.

The tier is a second-level prefix cache: an evicted full page's KV is copied to a tier page (the
oldest spilled pages make room) instead of vanishing, and a prompt whose next pages the hot cache
no longer holds but the tier does gets them copied back before the manager looks it up, so they
count as hits and are not recomputed. A page set aside at swap-out (:class:`pagekv.setaside.SetAside`)
is copied to its tier page as it is evicted, and kept there as the spilled prefix too.

This module keeps the bookkeeping; the caller moves the bytes (``copy_out(hot, cold)``,
``copy_in(cold, hot)``), so :class:`pagekv.swap.TieredKVCache` and the simulator's paged+swap
policy count the same copies.
"""

import numpy as np

from pagekv.prefix import chain_keys

__all__ = ["PrefixSpill"]


class PrefixSpill:
    """Evicted hot prefix pages kept in a tier's pages, by prefix key.

    Parameters
    ----------
    manager : KVCacheManager
        The hot pages' manager, with prefix caching; make :meth:`evicted` its ``on_evict`` hook.
    tier : TierPages
        The tier's pages and the prefixes kept on them (an :class:`pagekv.tier.OffloadTier`).
    set_aside : SetAside
        Pages set aside at swap-out: copied to their tier pages first as they are evicted.
    copy_out, copy_in : callable
        ``copy_out(hot, cold)`` and ``copy_in(cold, hot)`` with int32 [n] page arrays: copy KV
        from hot pages to tier pages, and back.

    Attributes
    ----------
    pages_spilled, pages_restored : int
        Pages copied to the tier as they were evicted (a page set aside counts as SetAside's), and
        copied back on a hit, so far.
    """

    def __init__(self, manager, tier, set_aside, *, copy_out, copy_in) -> None:
        self.manager = manager
        self.tier = tier
        self.set_aside = set_aside
        self.copy_out = copy_out
        self.copy_in = copy_in
        self.pages_spilled = self.pages_restored = 0

    def evicted(self, keys, pages) -> None:
        """The manager's ``on_evict`` hook: hot ``pages`` (int32 [n]) under prefix ``keys`` leave
        the hot cache, their KV still in them. Pages set aside are copied to their tier pages and
        kept there (a second reference on the page); the rest are copied to tier pages of their
        own, the oldest spilled pages making room, and what does not fit is dropped. A key the tier
        holds already (its prefix was recomputed while spilled) is not kept again."""
        copied = self.set_aside.leave_cache(keys, pages)
        fresh = [i for i, key in enumerate(keys) if key not in self.tier.prefixes]
        for key in [keys[i] for i in fresh if keys[i] in copied]:
            self.tier.allocator.incref([copied[key]])
            self.tier.keep_prefix(key, copied[key])
        fresh = [i for i in fresh if keys[i] not in copied]
        keys, pages = [keys[i] for i in fresh], np.asarray(pages)[fresh]
        room = self.tier.room()
        if not keys or not room:
            return
        keys, pages = keys[-room:], pages[-room:]
        cold = self.tier.take(len(keys))
        self.copy_out(pages, cold)
        for key, page in zip(keys, cold.tolist()):
            self.tier.keep_prefix(key, page)
        self.pages_spilled += len(keys)

    def restore(self, token_ids) -> int:
        """Bring back the spilled pages a prompt would hit next, before ``manager.add_sequence``
        looks it up; only when the manager can take the whole prompt (``manager.can_add``), so a
        prompt it would refuse changes nothing. Returns the pages brought back.

        Parameters
        ----------
        token_ids : array_like of int, shape (n,)
            The prompt.
        """
        manager = self.manager
        if not self.tier.prefixes or not manager.can_add(token_ids):
            return 0
        tokens = np.asarray(token_ids)
        # the pages add_sequence can hit: not one holding the last token, which it computes
        keys = chain_keys(tokens, manager.page_size)[:(len(tokens) - 1) // manager.page_size]
        hot = manager.prefix.lookup(keys)
        # The hot cache may hold pages past its first miss (the head of a chain evicted before its
        # tail): those become hits too once the gap comes back, and must not be evicted for it.
        run = []
        for key in keys[len(hot):]:
            page = manager.prefix.page_of.get(key)
            if page is not None:
                hot.append(page)
            elif key in self.tier.prefixes:
                run.append(key)
            else:
                break
        if not run:
            return 0
        cold = np.array([self.tier.take_prefix(key) for key in run], np.int32)  # now ours
        # can_add found room for the whole prompt, with its hits kept: so for these pages too
        pages = manager.restore_cached(run, keep=hot)
        self.copy_in(cold, pages)
        self.tier.allocator.decref(cold)
        self.pages_restored += len(run)
        return len(run)
