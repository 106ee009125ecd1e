"""PrefixSpill: prefix pages the hot prefix cache evicts kept in a tier, and brought back on a hit.

The tier is a second-level prefix cache: an evicted full page's KV is copied to a tier page (the
oldest spilled pages make room) instead of vanishing, and a prompt whose next pages the hot cache
no longer holds but the tier does gets them copied back before the manager looks it up, so they
count as hits and are not recomputed. A page set aside at swap-out (:class:`pagekv.setaside.SetAside`)
is copied to its tier page as it is evicted, and kept there as the spilled prefix too.

Which evicted pages are worth the copy: ``"all"``, or only ``"reused"`` ones, those a prompt hit
while they were hot (a shared system prompt, an earlier turn of a conversation). Replayed through
the simulator, copying all cost more than it gave back where prefixes return only after the tier
has turned over (a slice of Mooncake's conversations: 500 GiB copied, none asked for again), and
where they do return, the reused pages brought back nearly the same hits for a thirteenth of the
copies (README, "What `pagekv simulate` shows").

This module keeps the bookkeeping; the caller moves the bytes (``copy_out(hot, cold)``,
``copy_in(cold, hot)``), so :class:`pagekv.swap.TieredKVCache` and the simulator's paged+swap
policy count the same copies.
"""

import numpy as np

from pagekv.prefix import chain_keys, salted_root

__all__ = ["PrefixSpill", "SPILL_POLICIES", "check_spill_policy"]

SPILL_POLICIES = ("reused", "all", "none")


def check_spill_policy(policy, name="policy") -> str:
    """``policy`` if it is one of SPILL_POLICIES; else ValueError naming the argument ``name``."""
    if not isinstance(policy, str) or policy not in SPILL_POLICIES:
        raise ValueError(f"expected {name} in {SPILL_POLICIES}, got {policy!r}")
    return policy


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
    policy : {"reused", "all", "none"}
        Which evicted pages the tier keeps: those a prompt hit while hot (seen by :meth:`restore`,
        which the caller runs before each ``add_sequence``), all of them, or none (a tier reopened
        from a file may still hold prefixes to bring back).

    Attributes
    ----------
    pages_spilled, pages_restored : int
        Pages copied to the tier as they were evicted (a page set aside counts as SetAside's), and
        copied back on a hit, so far.
    """

    def __init__(self, manager, tier, set_aside, *, copy_out, copy_in, policy) -> None:
        self.manager = manager
        self.tier = tier
        self.set_aside = set_aside
        self.copy_out = copy_out
        self.copy_in = copy_in
        self.policy = check_spill_policy(policy)
        self.reused: set[bytes] = set()  # keys of hot cached pages a prompt hit ("reused")
        self.pages_spilled = self.pages_restored = 0

    def evicted(self, keys, pages) -> None:
        """The manager's ``on_evict`` hook: hot ``pages`` (int32 [n]) under prefix ``keys`` leave
        the hot cache, their KV still in them. Pages set aside are copied to their tier pages and
        kept there (a second reference on the page); the rest are copied to tier pages of their
        own, the oldest spilled pages making room, and what does not fit is dropped. A key the tier
        holds already (its prefix was recomputed while spilled) is not kept again. Under the
        "reused" policy pages no prompt hit are let go, but for pages set aside (their copy is
        made for the swapped-out sequence anyway); under "none" all are."""
        copied = self.set_aside.leave_cache(keys, pages)
        if self.policy == "none":
            return
        if self.policy == "reused":
            wanted = [i for i, key in enumerate(keys) if key in self.reused or key in copied]
            self.reused.difference_update(keys)
            keys, pages = [keys[i] for i in wanted], np.asarray(pages)[wanted]
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

    def cleared(self, keys, pages) -> None:
        """The manager's ``on_clear`` hook: pages set aside are copied to their tier pages; the
        rest are not kept (a clear is a caller's choice to forget them)."""
        self.set_aside.leave_cache(keys, pages)
        self.reused.difference_update(keys)

    def restore(self, token_ids, *, cache_salt=None) -> int:
        """Bring back the spilled pages a prompt would hit next, before ``manager.add_sequence``
        looks it up; only when the manager can take the whole prompt (``manager.can_add``), so a
        prompt it would refuse changes nothing. Notes the pages the prompt will hit as reused.
        Returns the pages brought back.

        Parameters
        ----------
        token_ids : array_like of int, shape (n,)
            The prompt.
        cache_salt : bytes or str, optional
            The salt it is added under (``manager.add_sequence``).
        """
        manager = self.manager
        if not manager.can_add(token_ids, cache_salt=cache_salt) or \
                not (self.tier.prefixes or self.policy == "reused"):
            return 0
        tokens = np.asarray(token_ids)
        # the pages add_sequence can hit: not one holding the last token, which it computes
        root = salted_root(cache_salt)
        keys = chain_keys(tokens, manager.page_size, root)[:(len(tokens) - 1) // manager.page_size]
        hot = manager.prefix.lookup(keys)
        # The hot cache may hold pages past its first miss (the head of a chain evicted before its
        # tail): those become hits too once the gap comes back, and must not be evicted for it.
        run = []
        for key in keys[len(hot):] if self.tier.prefixes else ():
            page = manager.prefix.page_of.get(key)
            if page is not None:
                hot.append(page)
            elif key in self.tier.prefixes:
                run.append(key)
            else:
                break
        if self.policy == "reused":
            self._note_reused(keys[:len(hot) + len(run)])
        if not run:
            return 0
        cold = np.array([self.tier.take_prefix(key) for key in run], np.int32)  # now ours
        # can_add found room for the whole prompt, with its hits kept: so for these pages too
        pages = manager.restore_cached(run, keep=hot)
        self.copy_in(cold, pages)
        self.tier.allocator.decref(cold)
        self.pages_restored += len(run)
        return len(run)

    def _note_reused(self, keys) -> None:
        """Note hot cached pages' ``keys`` as hit. Keys leave the set as their pages are evicted or
        cleared; those a ``discard`` uncached (no hook) are pruned once they are half of it."""
        self.reused.update(keys)
        if len(self.reused) > 2 * len(self.manager.prefix) + 64:
            self.reused &= self.manager.prefix.page_of.keys()
