"""KVCacheManager: sequences of tokens -> page tables, with sharing, copy-on-write and prefix caching.

The policy layer over :class:`pagekv.PageAllocator` (DESIGN.md §4). It decides which pages a
sequence gets; it never moves KV data (the caller runs ``write_kv`` at the returned slots and
``copy_pages`` for the pending copies) and never touches the allocator's bits.

Reference counting: every page in a page table holds one reference per table, a page in the
prefix cache holds one more, owned by the cache, and a queued copy-on-write copy holds one on its
source until the caller takes it. Invariant (checked by :meth:`check`):
``refcount(page) == table references + (1 if cached) + queued copies from it``.
"""

from collections import Counter
from dataclasses import dataclass

import numpy as np

from pagekv._alloc import PageAllocator
from pagekv.errors import InvalidPageError, InvariantError, OutOfPagesError, UnknownSequenceError
from pagekv.prefix import KEY_BYTES, PrefixCache, chain_keys, check_cache_salt, page_key, salted_root
from pagekv.tables import csr_from_padded, slots_of_last_tokens

__all__ = ["KVCacheManager", "ManagerStats", "Batch", "DetachedSequence"]

_MAX_TOKEN = 2**31 - 1


@dataclass(frozen=True)
class ManagerStats:
    """A snapshot of a manager's occupancy (frozen and comparable).

    ``pages_cached`` counts pages held only by the prefix cache (evictable);
    ``fragmentation_tokens`` is allocated slots minus tokens over every table; ``sharing_factor`` is
    logical pages (summed over tables) per physical page referenced by a table (1.0 = no sharing).
    """

    num_seqs: int
    num_tokens: int
    pages_used: int
    pages_free: int
    pages_cached: int
    fragmentation_tokens: int
    prefix_hit_tokens: int
    prefix_query_tokens: int
    sharing_factor: float


@dataclass(frozen=True)
class Batch:
    """Kernel inputs for a batch of sequences (arrays are new: a gather of the manager's rows).

    block_table : int32 [num_seqs, max_pages_per_seq]; seq_lens : int32 [num_seqs]; with ``csr``:
    kv_indptr int32 [num_seqs + 1], kv_indices int32 [total pages], kv_last_page_len int32
    [num_seqs]; with ``num_new_tokens``: slot_mapping int32 [total new tokens].
    """

    block_table: np.ndarray
    seq_lens: np.ndarray
    kv_indptr: np.ndarray | None = None
    kv_indices: np.ndarray | None = None
    kv_last_page_len: np.ndarray | None = None
    slot_mapping: np.ndarray | None = None


@dataclass(frozen=True)
class DetachedSequence:
    """What :meth:`KVCacheManager.attach` needs to bring a detached sequence back (no pages).

    num_tokens : int; token_ids : int32 [num_tokens], its tokens (empty when the manager does not
    cache prefixes: it keeps no token ids then); cache_salt : bytes, str or None, the salt it was
    added with. They continue its prefix chain, so pages it fills after coming back are cached under the
    right keys, and it can be truncated anywhere.
    """

    num_tokens: int
    token_ids: np.ndarray
    cache_salt: bytes | str | None = None


class KVCacheManager:
    """Page tables for many sequences over one pool of pages.

    Parameters
    ----------
    num_pages : int
        Size of the page pool.
    page_size : int
        Tokens per page.
    max_seqs, max_pages_per_seq : int
        Shape of the preallocated page tables.
    enable_prefix_caching : bool
        Reuse full pages whose token prefix was seen before.

    Attributes
    ----------
    block_table : int32 [max_seqs, max_pages_per_seq]
        Updated in place; a sequence's row is fixed while it lives. Entries past its pages are stale.
    seq_lens : int32 [max_seqs]
        Tokens of each row (0 for a free row).
    on_evict, on_clear : callable or None
        Called as ``f(keys, pages)`` (list of bytes, int32 [n]) just before cached pages are
        evicted, or dropped by :meth:`clear_prefix_cache`, their KV still in place (a second tier
        keeps what it needs: :class:`pagekv.swap.TieredKVCache` sets both).

    Notes
    -----
    Contract with the caller, each step: run the copies ``take_pending_copies`` returns, then write
    the KV of every slot that ``add_sequence``/``append``/``append_tokens`` handed out, before a
    forward pass reads them; ``take_pending_copies`` is called once a step, right before its
    forward (it marks where a step begins). Fork, truncate, free or detach a sequence only once
    its slots are written: a full page enters the prefix cache when it is handed out, and a
    copy-on-write copies what a page holds. Slots that will not be written (a forward that
    failed) are taken back with :meth:`discard`. A queued copy holds a reference on its source
    until it is taken, so the source is not handed out again (nor written by a second tier's
    restore or swap-in) before the copy runs; a queued copy into a page released before it runs
    is dropped. A new sequence's full prompt pages enter the prefix cache at once, so a second
    sequence with the same prompt in the same batch shares them.

    Examples
    --------
    >>> m = KVCacheManager(num_pages=64, page_size=4, max_seqs=8, max_pages_per_seq=16)
    >>> m.add_sequence("a", [1, 2, 3, 4, 5, 6])
    0
    >>> m.add_sequence("b", [1, 2, 3, 4, 9])          # first page (4 tokens) is cached
    4
    >>> m.append_tokens(["a", "b"], [7, 10]).tolist()  # slots of the two new tokens
    [6, 129]
    >>> m.page_table("a").tolist(), m.page_table("b").tolist()  # b's own pages start far away
    ([0, 1], [0, 32])
    """

    def __init__(self, *, num_pages, page_size=16, max_seqs, max_pages_per_seq,
                 enable_prefix_caching=True):
        for name, value in (("num_pages", num_pages), ("page_size", page_size),
                            ("max_seqs", max_seqs), ("max_pages_per_seq", max_pages_per_seq)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"expected {name} a positive integer, got {value!r}")
        if not isinstance(enable_prefix_caching, (bool, np.bool_)):
            raise ValueError(f"expected enable_prefix_caching a bool, got {enable_prefix_caching!r}")
        if (num_pages - 1) * page_size + page_size - 1 > _MAX_TOKEN:
            raise ValueError(f"expected num_pages * page_size below 2**31 (int32 slots), "
                             f"got {num_pages} * {page_size}")
        self.page_size = int(page_size)
        self.max_pages_per_seq = int(max_pages_per_seq)
        self.allocator = PageAllocator(num_pages)
        self.block_table = np.zeros((max_seqs, max_pages_per_seq), np.int32)
        self.seq_lens = np.zeros(max_seqs, np.int32)
        self.prefix = PrefixCache() if enable_prefix_caching else None
        # Per-sequence state lives in rows, like the page tables, so a decode step is array work:
        self._rows: dict = {}                                   # seq_id -> row
        self._free_rows = list(range(max_seqs - 1, -1, -1))
        # With prefix caching: the token id in every slot (4 bytes beside each slot's KV, written
        # where the KV is; shared pages share them, a copied page takes its source's) and each row's
        # prefix key of each full page (a page that fills is keyed from the one before it and its
        # slots' tokens; truncate resumes the chain at any page).
        self._slot_tokens = np.zeros(num_pages * page_size, np.int32) if enable_prefix_caching else None
        self._page_keys: list[list[bytes]] = [[] for _ in range(max_seqs)]
        self._salts: list[bytes | None] = [None] * max_seqs  # each row's cache salt
        # Per row, the first page whose prefix-cache entry the row made by handing the page out:
        # the pages before it came written (prefix hits, a fork's source, an attach). discard
        # takes out of the cache only entries the row made.
        self._own_from = np.zeros(max_seqs, np.int32)
        # Queued copy-on-write copies, dst -> src in queue order; each src keeps a reference
        # (the one the copying table gave up) until the copies are taken.
        self._pending: dict[int, int] = {}
        # Steps begun (take_pending_copies calls), and for each page the step whose forward writes
        # its KV if it entered the prefix cache when handed out (-1: its KV was there when cached).
        # attach(reuse_cached=True) leaves pages of the coming step alone: that forward may fail.
        self._steps = 0
        self._cached_in_step = np.full(num_pages, -1, np.int64)
        self.on_evict = None
        self.on_clear = None
        self._hit_tokens = 0
        self._query_tokens = 0

    # ------------------------------------------------------------------ queries
    def __contains__(self, seq_id) -> bool:
        return seq_id in self._rows

    def __len__(self) -> int:
        return len(self._rows)

    def seq_ids(self) -> list:
        """Ids of the held sequences, in the order they were added."""
        return list(self._rows)

    def seq_len(self, seq_id) -> int:
        """Tokens of ``seq_id``."""
        return int(self.seq_lens[self._row(seq_id)])

    def page_table(self, seq_id) -> np.ndarray:
        """int32 [num_pages_of_seq]: the physical page of each logical page (a copy)."""
        row = self._row(seq_id)
        return self.block_table[row, :self._num_pages(self.seq_lens[row])].copy()

    def can_add(self, token_ids, *, cache_salt=None) -> bool:
        """Whether ``add_sequence`` of ``token_ids`` (under ``cache_salt``) would get its pages and a
        row now."""
        tokens, salt = _tokens(token_ids), check_cache_salt(cache_salt)
        pages = self._num_pages(len(tokens))
        if not self._free_rows or pages > self.max_pages_per_seq:
            return False
        hit = self._hit_pages(self._keys(tokens, salt), len(tokens))
        return pages - len(hit) <= self._obtainable(set(hit))

    def can_append(self, seq_id, num_tokens=1) -> bool:
        """Whether ``append`` of ``num_tokens`` tokens to ``seq_id`` would get its pages now."""
        row = self._row(seq_id)
        if (isinstance(num_tokens, (bool, np.bool_)) or not isinstance(num_tokens, (int, np.integer))
                or num_tokens < 1):
            raise ValueError(f"expected num_tokens an integer >= 1, got {num_tokens!r}")
        try:
            needed, _ = self._pages_for_append(row, int(num_tokens))
        except ValueError:
            return False
        return needed <= self._obtainable(())

    @property
    def free_rows(self) -> int:
        """Sequences that can still be added (rows of the page tables not in use)."""
        return len(self._free_rows)

    def pages_obtainable(self, *, keep=()) -> int:
        """Pages an allocation could get now: free ones plus cached ones no sequence uses (those in
        ``keep`` excepted)."""
        return self._obtainable(_page_set(keep, self.allocator.num_pages))

    def stats(self) -> ManagerStats:
        """Occupancy and prefix-cache figures (see :class:`ManagerStats`)."""
        lens = self.seq_lens[list(self._rows.values())].astype(np.int64)
        logical = int(((lens + self.page_size - 1) // self.page_size).sum())
        cached_only = len(self.prefix.evictable) if self.prefix is not None else 0
        physical = self.allocator.num_used - cached_only
        return ManagerStats(
            num_seqs=len(self._rows), num_tokens=int(lens.sum()),
            pages_used=self.allocator.num_used, pages_free=self.allocator.num_free,
            pages_cached=cached_only, fragmentation_tokens=logical * self.page_size - int(lens.sum()),
            prefix_hit_tokens=self._hit_tokens, prefix_query_tokens=self._query_tokens,
            sharing_factor=logical / physical if physical else 1.0)

    def batch(self, seq_ids, *, csr=False, num_new_tokens=None) -> Batch:
        """Kernel inputs for ``seq_ids``, in that order.

        Parameters
        ----------
        seq_ids : sequence of ids
        csr : bool
            Also build FlashInfer's CSR page tables.
        num_new_tokens : int or int array [num_seqs], optional
            Also build the slot_mapping of each sequence's last ``num_new_tokens`` tokens; the
            ids must then be distinct (a repeated one would write its slots twice).
        """
        rows = self._rows_of(id_list(seq_ids, distinct=num_new_tokens is not None))
        if not isinstance(csr, (bool, np.bool_)):
            raise ValueError(f"expected csr a bool, got {csr!r:.80}")
        lens = self.seq_lens[rows]
        table = self.block_table[rows]
        extra: dict[str, np.ndarray] = {}
        if csr:
            extra.update(zip(("kv_indptr", "kv_indices", "kv_last_page_len"),
                             csr_from_padded(table, lens, self.page_size)))
        if num_new_tokens is not None:
            extra["slot_mapping"] = slots_of_last_tokens(table, lens, num_new_tokens, self.page_size)
        return Batch(table, lens, **extra)

    def take_pending_copies(self):
        """The copy-on-write copies queued since the last call, and clear the queue.

        Returns
        -------
        src, dst : int32 [num_copies]
            Run ``copy_pages(k_cache, v_cache, src, dst)`` for every layer now, before writing KV
            and before the next call that can hand out pages: the sources' references are
            released here. No page is both a source and a destination (a copy from a page that
            waits for its own copy reads that copy's source), so the copies can run in parallel.
        """
        pending, self._pending = self._pending, {}
        self._steps += 1
        dst = np.fromiter(pending.keys(), np.int32, len(pending))
        src = np.fromiter(pending.values(), np.int32, len(pending))
        self._let_go(src)
        return src, dst

    def kv_sources(self, pages) -> np.ndarray:
        """Where the KV of ``pages`` is now: for a page waiting for a queued copy-on-write copy,
        that copy's source (it holds everything the page will hold: no slot of it is written
        before the copy runs), for any other page the page itself. The queue is left as it is.

        For reading a sequence's KV between steps (a second tier's swap-out) without running the
        copies ahead of the step that takes them.

        Parameters
        ----------
        pages : int array [n]
            Page ids in [0, num_pages).

        Returns
        -------
        int32 [n]

        Raises
        ------
        ValueError
            Not a 1-D array of integers.
        InvalidPageError
            A page id outside the pool.
        """
        pages = np.asarray(pages)
        if pages.ndim != 1 or (pages.size and pages.dtype.kind not in "iu"):
            raise ValueError(f"expected a 1-D array of page ids, got {pages!r:.80}")
        bad = (pages < 0) | (pages >= self.allocator.num_pages)
        if bad.any():
            raise InvalidPageError(f"expected page ids in [0, {self.allocator.num_pages}), "
                                   f"got {int(pages[bad][0])}")
        pending = self._pending
        return np.array([pending.get(page, page) for page in pages.tolist()], np.int32)

    # ------------------------------------------------------------------ actions
    def add_sequence(self, seq_id, token_ids, *, cache_salt=None) -> int:
        """Give a new sequence the pages of its prompt.

        Parameters
        ----------
        seq_id : hashable
            A new id.
        token_ids : array_like of int, shape (n,), n >= 1
            The prompt's token ids, in [0, 2**31 - 1].
        cache_salt : bytes or str, optional
            What the prompt's KV depends on besides its token ids (a LoRA adapter's name, a hash of
            a multimodal prompt's images, a tenant that must not share pages with others). With
            prefix caching, only sequences added under the same salt share cached pages, and the
            pages this one fills are cached under it (forks and detached records keep it). None:
            the KV depends on the token ids alone.

        Returns
        -------
        int
            Leading tokens whose KV is already cached (a prefix hit: skip computing them). Always
            less than the prompt's length: the last token is computed, for its logits.

        Raises
        ------
        ValueError
            ``seq_id`` already held, no free row, a prompt longer than ``max_pages_per_seq`` pages,
            or bad tokens.
        OutOfPagesError
            Not enough pages even after evicting the prefix cache; nothing changed.
        """
        if _new_id(self._rows, seq_id, "seq_id"):
            raise ValueError(f"expected a new seq_id, got {seq_id!r}, which is already held")
        tokens, salt = _tokens(token_ids), check_cache_salt(cache_salt)
        num_pages = self._num_pages(len(tokens))
        self._check_capacity(num_pages, len(tokens))
        if not self._free_rows:
            raise ValueError(f"expected at most max_seqs={len(self.seq_lens)} sequences, got one more")
        keys = self._keys(tokens, salt)
        hit = self._hit_pages(keys, len(tokens))
        fresh = self._take_pages(num_pages - len(hit), keep=set(hit), after=hit[-1] if hit else -1)
        if hit:
            self.allocator.incref(hit)
            for page in hit:
                self.prefix.evictable.pop(page, None)
        row = self._free_rows.pop()
        self.block_table[row, :len(hit)] = hit
        self.block_table[row, len(hit):num_pages] = fresh
        self.seq_lens[row] = len(tokens)
        self._cache_pages(keys[len(hit):], self.block_table[row, len(hit):len(keys)])
        self._own_from[row] = len(hit)
        if self.prefix is not None:  # hit pages get them too: restored pages came without any
            self._slot_tokens[self._slots(row, 0, len(tokens))] = tokens
            self._page_keys[row] = keys
        self._salts[row] = salt
        self._rows[seq_id] = row
        self._hit_tokens += len(hit) * self.page_size
        self._query_tokens += len(tokens)
        return len(hit) * self.page_size

    def append(self, seq_id, token_ids) -> np.ndarray:
        """Grow ``seq_id`` by ``token_ids``; returns int32 [num_tokens] slots to write their KV at.

        A partly filled last page shared with another sequence is first replaced by a fresh page,
        and a (src, dst) copy is queued (:meth:`take_pending_copies`): a shared page is never a
        write slot.
        """
        row = self._row(seq_id)
        tokens = _tokens(token_ids)
        length = int(self.seq_lens[row])
        needed, cow_src = self._pages_for_append(row, len(tokens))
        first_new = self._num_pages(length)
        # The new pages (the copy of a shared last page first) follow the page before them.
        follows = first_new - 1 - (cow_src is not None)
        fresh = self._take_pages(needed, keep=(),
                                 after=int(self.block_table[row, follows]) if follows >= 0 else -1)
        if cow_src is not None:
            self._redirect(row, first_new - 1, cow_src, int(fresh[0]))
            fresh = fresh[1:]
        end = self._num_pages(length + len(tokens))
        self.block_table[row, first_new:end] = fresh
        slots = self._slots(row, length, length + len(tokens))
        self.seq_lens[row] = length + len(tokens)
        if self.prefix is not None:
            self._slot_tokens[slots] = tokens
            filled = np.arange(length // self.page_size, (length + len(tokens)) // self.page_size)
            if len(filled):
                self._pages_filled(np.full(len(filled), row), filled)
        return slots.astype(np.int32)

    def append_tokens(self, seq_ids, token_ids) -> np.ndarray:
        """The decode step: one new token for each of ``seq_ids``, all-or-nothing.

        Pages for the sequences that cross a page boundary (and for copy-on-write) are taken with
        one allocator call. Returns int32 [num_seqs] slots, in ``seq_ids`` order.
        """
        seq_ids = id_list(seq_ids)
        rows = self._rows_of(seq_ids)
        if len(rows) and np.bincount(rows).max() > 1:
            raise ValueError("expected distinct seq_ids in one decode step, got a repeated id")
        tokens = _tokens(token_ids, allow_empty=True)
        if len(tokens) != len(rows):
            raise ValueError(f"expected one token per sequence ({len(rows)}), got {len(tokens)}")
        lens = self.seq_lens[rows].astype(np.int64)
        ps = self.page_size
        crossing = np.flatnonzero(lens % ps == 0)
        if len(crossing) and (lens[crossing] // ps).max() >= self.max_pages_per_seq:
            i = crossing[np.argmax(lens[crossing] // ps)]
            raise ValueError(f"expected sequences within max_pages_per_seq={self.max_pages_per_seq} "
                             f"pages, got {seq_ids[i]!r} needing page {lens[i] // ps + 1}")
        shared = self._sharers_to_copy(rows, lens)
        # Each new page follows the page before it in its table: a page after the last one for a
        # sequence crossing into a new page, after the one before the copied page for a sharer.
        before = np.concatenate([lens[crossing] // ps - 1, (lens[shared] - 1) // ps - 1])
        requests = np.concatenate([rows[crossing], rows[shared]])
        after = np.where(before >= 0, self.block_table[requests, np.maximum(before, 0)], -1)
        fresh = self._take_pages(len(crossing) + len(shared), keep=(), after=after)
        self.block_table[rows[crossing], lens[crossing] // ps] = fresh[:len(crossing)]
        for i, dst in zip(shared, fresh[len(crossing):]):
            self._redirect(rows[i], (lens[i] - 1) // ps, int(self.block_table[rows[i], (lens[i] - 1) // ps]),
                           int(dst))
        slots = self.block_table[rows, lens // ps] * ps + (lens % ps).astype(np.int32)
        self.seq_lens[rows] += 1
        if self.prefix is not None:
            self._slot_tokens[slots] = tokens
            filled = np.flatnonzero(lens % ps == ps - 1)  # sequences whose page this token filled
            if len(filled):
                self._pages_filled(rows[filled], lens[filled] // ps)
        return slots.astype(np.int32)

    def fork(self, src_id, dst_id) -> None:
        """Make ``dst_id`` a copy of ``src_id`` that shares every page (refcounts up, no copy)."""
        src = self._row(src_id)
        if _new_id(self._rows, dst_id, "dst_id"):
            raise ValueError(f"expected a new dst_id, got {dst_id!r}, which is already held")
        if not self._free_rows:
            raise ValueError(f"expected at most max_seqs={len(self.seq_lens)} sequences, got one more")
        length = self.seq_lens[src]
        pages = self.block_table[src, :self._num_pages(length)]
        self.allocator.incref(pages)
        row = self._free_rows.pop()
        self.block_table[row, :len(pages)] = pages
        self.seq_lens[row] = length
        self._page_keys[row] = list(self._page_keys[src])
        self._salts[row] = self._salts[src]
        self._own_from[row] = length // self.page_size
        self._rows[dst_id] = row

    def free(self, seq_id) -> None:
        """Release ``seq_id``'s pages; cached pages no sequence uses become evictable."""
        row = self._row(seq_id)
        self._release(self.block_table[row, :self._num_pages(self.seq_lens[row])])
        del self._rows[seq_id]
        self.seq_lens[row] = 0
        self._page_keys[row] = []
        self._free_rows.append(row)

    def truncate(self, seq_id, num_tokens) -> None:
        """Keep the first ``num_tokens`` tokens of ``seq_id``; release the pages past them.

        The rollback of speculative decoding (the drafts the target model rejected) or of any
        tokens appended ahead. The kept tokens' KV stays where it is and the next append writes
        after it. A kept, partly filled last page that someone else holds too (a fork, or the
        prefix cache, which keeps a full page's tokens) is copied before that write, as any shared
        page is; released pages that the prefix cache holds become evictable.

        Parameters
        ----------
        seq_id : hashable
        num_tokens : int
            Tokens to keep, 1 .. ``seq_len(seq_id)`` (the whole length: nothing changes).

        Raises
        ------
        UnknownSequenceError
            ``seq_id`` is not held.
        ValueError
            ``num_tokens`` is not an integer in that range; nothing changed.
        """
        row, num_tokens = self._tokens_of(seq_id, num_tokens, "num_tokens", 1, "to keep")
        self._cut(row, num_tokens)

    def discard(self, seq_id, num_written) -> None:
        """Drop the tokens of ``seq_id`` past its first ``num_written``: tokens whose KV was never
        written (a forward that failed before writing them). With 0 the sequence is freed.

        As :meth:`truncate`, and the full pages the prefix cache took from those tokens when they
        were handed out leave the cache: it would hand later prompts KV that is not there. Pages
        the sequence did not hand out itself (prefix hits, a fork's source's, an attach's) stay
        cached: a sequence added in the failed step can be freed (0) whatever it found cached.
        Pages it found cached that another sequence of that step was to write hold nothing, so
        it is freed, not cut back to its hit (the other sequence's discard takes them out).

        Raises
        ------
        UnknownSequenceError
            ``seq_id`` is not held.
        ValueError
            ``num_written`` is not an integer in [0, ``seq_len(seq_id)``]; nothing changed.
        """
        row, num_written = self._tokens_of(seq_id, num_written, "num_written", 0, "whose KV is written")
        if self.prefix is not None:
            first = max(num_written // self.page_size, int(self._own_from[row]))
            pages = self.block_table[row, first:len(self._page_keys[row])].tolist()
            taken = [page for key, page in zip(self._page_keys[row][first:], pages)
                     if self.prefix.page_of.get(key) == page]
            for page in taken:
                self.prefix.remove(page)
            if taken:
                self.allocator.decref(taken)  # the cache's references; the table still holds them
        if num_written == 0:
            self.free(seq_id)
        else:
            self._cut(row, num_written)

    def detach(self, seq_id) -> DetachedSequence:
        """Release ``seq_id``'s pages like :meth:`free`, keeping what :meth:`attach` needs.

        For swapping: copy the sequence's KV out of ``page_table(seq_id)`` first — once detached,
        its pages may be handed to anyone.
        """
        row = self._row(seq_id)
        length = int(self.seq_lens[row])
        tokens = self._slot_tokens[self._slots(row, 0, length)] if self.prefix is not None \
            else np.empty(0, np.int32)
        record = DetachedSequence(length, tokens, self._salts[row])
        self.free(seq_id)
        return record

    def attach(self, seq_id, record: DetachedSequence, *, reuse_cached=False):
        """Bring a detached sequence back as ``seq_id`` on fresh pages, all-or-nothing.

        Returns
        -------
        int32 [num_pages_of_seq]
            Its new page table: copy its KV into these pages before a forward reads them. They
            are not offered to the prefix cache (their KV is not there yet); pages it fills later
            are. With ``reuse_cached``, also bool [num_pages_of_seq], which pages to copy into
            (see :meth:`attach_shared`).

        Raises
        ------
        ValueError
            ``seq_id`` already held, no free row, or too long for ``max_pages_per_seq``.
        OutOfPagesError
            Not enough pages even after evicting the prefix cache; nothing changed.
        """
        if not isinstance(record, DetachedSequence):
            raise TypeError(f"expected a DetachedSequence from detach(), got {type(record).__name__}")
        pages = np.arange(self._num_pages(record.num_tokens), dtype=np.int64)
        return self.attach_shared([seq_id], [record], [pages], reuse_cached=reuse_cached)

    def attach_shared(self, seq_ids, records, page_indices, *, reuse_cached=False):
        """Bring detached sequences back at once, on fresh pages they share as ``page_indices``
        says (forks and parallel samples swapped out together come back sharing their pages
        again), all-or-nothing.

        Parameters
        ----------
        seq_ids : list
            New, distinct ids.
        records : list of DetachedSequence
            From :meth:`detach`, one per id.
        page_indices : list of int arrays
            Per sequence, for each of its pages the index (0 .. U - 1) of the fresh page it takes:
            sequences naming the same index share that page. Every index is named, none twice by
            one sequence.
        reuse_cached : bool
            Take a full page whose prefix key is still cached (a shared prompt, or the sequence's
            own pages the cache kept) instead of a fresh one: it holds the KV already, so less is
            copied back and the page is shared again. Needs prefix caching to find any. A page
            handed out since the last :meth:`take_pending_copies` is not taken: its KV comes with
            the coming forward, and if that fails (:meth:`discard`), with nothing.

        Returns
        -------
        int32 [U]
            The pages, by index: copy their KV in before a forward reads them. A page taken by
            k sequences has k references, so the first write to a shared, partly filled last page
            copies it (copy-on-write), as after :meth:`fork`. Fresh pages are not offered to the
            prefix cache.
        bool [U]
            Only with ``reuse_cached``: which pages are fresh (copy into these; the others are
            cached pages, which must not be written).

        Raises
        ------
        ValueError
            An id held or repeated, too few free rows, a sequence too long for
            ``max_pages_per_seq``, or page indices other than the above.
        OutOfPagesError
            Fewer than U pages even after evicting the prefix cache; nothing changed.
        """
        seq_ids = id_list(seq_ids, distinct=True)
        if not isinstance(reuse_cached, (bool, np.bool_)):
            raise ValueError(f"expected reuse_cached a bool, got {reuse_cached!r:.80}")
        try:
            records, page_indices = list(records), list(page_indices)
        except TypeError:
            raise TypeError(f"expected records and page_indices lists, got {type(records).__name__} "
                            f"and {type(page_indices).__name__}") from None
        if not len(records) == len(page_indices) == len(seq_ids):
            raise ValueError(f"expected one record and one page index array per seq_id ({len(seq_ids)}), "
                             f"got {len(records)} and {len(page_indices)}")
        salts = []
        for seq_id, record in zip(seq_ids, records):
            if not isinstance(record, DetachedSequence):
                raise TypeError(f"expected a DetachedSequence from detach(), got {type(record).__name__}")
            if self.prefix is not None and len(record.token_ids) != record.num_tokens:
                raise ValueError(f"expected a record holding its {record.num_tokens} token ids (detach() of "
                                 f"a manager that caches prefixes), got {len(record.token_ids)}")
            if _new_id(self._rows, seq_id, "seq_id"):
                raise ValueError(f"expected a new seq_id, got {seq_id!r}, which is already held")
            salts.append(check_cache_salt(record.cache_salt))
        indices = []
        for record, index in zip(records, page_indices):
            num_pages = self._num_pages(record.num_tokens)
            self._check_capacity(num_pages, record.num_tokens)
            index = np.asarray(index)
            if (index.shape != (num_pages,) or (num_pages and index.dtype.kind not in "iu")
                    or len(np.unique(index)) != num_pages or (num_pages and index.min() < 0)):
                raise ValueError(f"expected {num_pages} distinct page indices >= 0 for a sequence of "
                                 f"{record.num_tokens} tokens, got {index!r:.80}")
            indices.append(index.astype(np.int64))
        uses = np.bincount(np.concatenate(indices)) if indices else np.zeros(0, np.int64)
        if not uses.all():
            raise ValueError(f"expected page indices 0 .. {len(uses) - 1} each named, got index "
                             f"{int(np.argmin(uses))} unnamed")
        if len(seq_ids) > len(self._free_rows):
            raise ValueError(f"expected at most max_seqs={len(self.seq_lens)} sequences, got "
                             f"{len(seq_ids) - len(self._free_rows)} more")
        keys = [self._keys(record.token_ids, salt) for record, salt in zip(records, salts)]
        hits = {}  # page index -> the cached page holding its KV
        if reuse_cached and self.prefix is not None:
            page_of = self.prefix.page_of
            for chain, index in zip(keys, indices):
                for i, key in zip(index.tolist(), chain):
                    if key in page_of and self._cached_in_step[page_of[key]] != self._steps:
                        hits.setdefault(i, page_of[key])
        fresh = np.ones(len(uses), bool)
        fresh[list(hits)] = False
        pages = np.empty(len(uses), np.int32)
        pages[fresh] = self._take_pages(int(fresh.sum()), keep=set(hits.values()))
        pages[list(hits)] = list(hits.values())
        for page in hits.values():  # held by the tables now: no longer evictable
            self.prefix.evictable.pop(page, None)
        if (uses > fresh).any():  # an allocation holds one reference: a page needs one per use
            self.allocator.incref(np.repeat(pages, uses - fresh))
        for seq_id, record, index, chain, salt in zip(seq_ids, records, indices, keys, salts):
            row = self._free_rows.pop()
            self.block_table[row, :len(index)] = pages[index]
            self.seq_lens[row] = record.num_tokens
            if self.prefix is not None:
                self._slot_tokens[self._slots(row, 0, record.num_tokens)] = record.token_ids
                self._page_keys[row] = chain
            self._salts[row] = salt
            self._own_from[row] = record.num_tokens // self.page_size
            self._rows[seq_id] = row
        return (pages, fresh) if reuse_cached else pages

    def restore_cached(self, keys, *, keep=()) -> np.ndarray:
        """Put full pages back into the prefix cache under ``keys``, on fresh pages (all-or-nothing).

        For a second tier that kept evicted prefix pages: the restored pages are cached and
        evictable (most recently released), so a following ``add_sequence`` of a prompt with
        these keys hits them.

        Parameters
        ----------
        keys : list of bytes
            Prefix keys, none of them cached now.
        keep : iterable of int
            Cached pages that must not be evicted to make room (e.g. the prompt's hot hits).

        Returns
        -------
        int32 [len(keys)]
            The pages: copy their KV in before a forward reads them.
        """
        if self.prefix is None:
            raise ValueError("expected a manager with prefix caching, got enable_prefix_caching=False")
        keys, keep = _prefix_keys(keys), _page_set(keep, self.allocator.num_pages)
        cached = [key for key in keys if key in self.prefix.page_of]
        if cached or len(set(keys)) != len(keys):
            raise ValueError(f"expected distinct keys not cached yet, got {len(cached)} cached or repeated")
        pages = self._take_pages(len(keys), keep=keep)
        for key, page in zip(keys, pages.tolist()):
            self.prefix.insert(key, page)  # the allocation's reference becomes the cache's
            self.prefix.evictable[page] = None
        self._cached_in_step[pages] = -1  # the caller copies their KV in at once
        return pages

    def clear_prefix_cache(self) -> None:
        """Drop every cached page; pages no sequence uses return to the pool."""
        if self.prefix is not None:
            if self.on_clear is not None and len(self.prefix):
                self.on_clear(list(self.prefix.key_of.values()),
                              np.fromiter(self.prefix.key_of, np.int32, len(self.prefix)))
            pages = self.prefix.clear()
            if pages:
                self._drop_copies_into(self.allocator.decref(pages))

    def check(self) -> None:
        """Audit the reference-count invariant and the allocator in O(num_pages); raise InvariantError."""
        self.allocator.check()
        expected = np.zeros(self.allocator.num_pages, np.int64)
        for row in self._rows.values():
            np.add.at(expected, self.block_table[row, :self._num_pages(self.seq_lens[row])], 1)
        np.add.at(expected, list(self._pending.values()), 1)
        chained = self._pending.keys() & set(self._pending.values())
        if chained:
            raise InvariantError(f"page {min(chained)} is the source and the destination of queued copies")
        if self.prefix is not None:
            expected[list(self.prefix.key_of)] += 1
            unused = {page for page in self.prefix.key_of if expected[page] == 1}
            if unused != self.prefix.evictable.keys():
                page = min(unused ^ self.prefix.evictable.keys())
                raise InvariantError(f"cached page {page} is {'not ' * (page in unused)}evictable "
                                     f"with {expected[page] - 1} other holders")
            for seq_id, row in self._rows.items():
                if len(self._page_keys[row]) != self.seq_lens[row] // self.page_size:
                    raise InvariantError(f"sequence {seq_id!r} has {len(self._page_keys[row])} page keys "
                                         f"for {self.seq_lens[row] // self.page_size} full pages")
        into_free = [dst for dst in self._pending if expected[dst] == 0]
        if into_free:
            raise InvariantError(f"a copy into page {into_free[0]}, which nothing holds, is queued")
        actual = self.allocator.refcount(np.arange(self.allocator.num_pages))
        bad = np.flatnonzero(actual != expected)
        if len(bad):
            raise InvariantError(f"page {bad[0]}: refcount {actual[bad[0]]}, expected {expected[bad[0]]} "
                                 "(table references + 1 if cached + queued copies from it)")

    # ------------------------------------------------------------------ internals
    def _row(self, seq_id) -> int:
        try:
            return self._rows[seq_id]
        except (KeyError, TypeError):
            raise UnknownSequenceError(f"expected a held sequence id, got {seq_id!r}") from None

    def _tokens_of(self, seq_id, count, name, low, meaning):
        """(row, count as int) for a count of ``seq_id``'s first tokens in [low, its length];
        UnknownSequenceError or ValueError ("expected <name> an integer in [low, L] (the tokens of
        <seq_id> <meaning>)") otherwise."""
        row = self._row(seq_id)
        length = int(self.seq_lens[row])
        if (isinstance(count, (bool, np.bool_)) or not isinstance(count, (int, np.integer))
                or not low <= count <= length):
            raise ValueError(f"expected {name} an integer in [{low}, {length}] (the tokens of "
                             f"{seq_id!r} {meaning}), got {count!r:.80}")
        return row, int(count)

    def _rows_of(self, seq_ids: list) -> np.ndarray:
        """int64 [len(seq_ids)] rows, or UnknownSequenceError naming the first unknown id."""
        try:
            return np.fromiter(map(self._rows.__getitem__, seq_ids), np.int64, len(seq_ids))
        except (KeyError, TypeError):
            unknown = next(s for s in seq_ids if not _is_held(self._rows, s))
            raise UnknownSequenceError(f"expected a held sequence id, got {unknown!r}") from None

    def _num_pages(self, num_tokens) -> int:
        return -(-int(num_tokens) // self.page_size)

    def _check_capacity(self, num_pages, num_tokens):
        if num_pages > self.max_pages_per_seq:
            raise ValueError(f"expected at most {self.max_pages_per_seq * self.page_size} tokens "
                             f"(max_pages_per_seq={self.max_pages_per_seq}), got {num_tokens}")

    def _keys(self, tokens, salt):
        """Prefix keys of the full pages of a new sequence under cache salt ``salt`` (bytes or
        None); none without prefix caching."""
        return chain_keys(tokens, self.page_size, salted_root(salt)) if self.prefix is not None else []

    def _hit_pages(self, keys, num_tokens):
        hit = self.prefix.lookup(keys) if self.prefix is not None else []
        if len(hit) * self.page_size == num_tokens:
            hit = hit[:-1]  # recompute the last page: the caller needs the last token's logits
        return hit

    def _obtainable(self, keep) -> int:
        """Pages an allocation could get: free ones plus evictable ones outside ``keep``."""
        evictable = len(self.prefix.evictable) - len(keep & self.prefix.evictable.keys()) \
            if self.prefix is not None else 0
        return self.allocator.num_free + evictable

    def _take_pages(self, count, *, keep, after=-1):
        """Allocate ``count`` pages, evicting cached pages (never those in ``keep``) if needed.

        ``after``: the page the new ones follow (one run), or an int32 array of one such page per
        page taken (a run each); -1 for none. A cached page that no sequence uses and that a run
        would grow onto is evicted for it even while other pages are free (as a free list that
        holds cached pages hands them out); more are evicted, in runs, only if pages are short.
        Raises before changing anything when even eviction cannot supply them.
        """
        if count == 0:
            return np.empty(0, np.int32)
        shortfall = count - self.allocator.num_free
        grow_onto = self._cached_successors(after, count, keep)
        if shortfall > 0 or grow_onto:
            obtainable = self._obtainable(keep)
            if count > obtainable:
                raise OutOfPagesError(count, obtainable)
            victims = self.prefix.evict(max(shortfall, len(grow_onto)), keep=keep, prefer=grow_onto)
            if self.on_evict is not None:
                self.on_evict([key for key, _ in victims], np.array([p for _, p in victims], np.int32))
            self._drop_copies_into(self.allocator.decref([page for _, page in victims]))
        if isinstance(after, np.ndarray):
            return self.allocator.allocate_many(np.ones(count, np.int32), after=after)[0]
        return self.allocator.allocate(count, after=after)

    def _cached_successors(self, after, count, keep):
        """The cached, unused pages (outside ``keep``) that ``allocate(count, after=after)`` would
        grow onto if they were free: for one run, those among its next pages up to the first page
        that is neither free nor evictable; for one page per value of an array, each next page."""
        if self.prefix is None or not self.prefix.evictable:
            return []
        evictable = self.prefix.evictable
        if isinstance(after, np.ndarray):
            return [page for page in (after[after >= 0] + 1).tolist() if page in evictable and page not in keep]
        if after < 0:
            return []
        ahead = np.arange(after + 1, min(after + 1 + count, self.allocator.num_pages))
        pages = []
        for page, free in zip(ahead.tolist(), self.allocator.is_free(ahead).tolist()):
            if page in evictable and page not in keep:
                pages.append(page)
            elif not free:
                break
        return pages

    def _pages_for_append(self, row, num_tokens):
        """(pages to take, the shared partial last page to copy first or None) for an append."""
        length = int(self.seq_lens[row])
        end = self._num_pages(length + num_tokens)
        self._check_capacity(end, length + num_tokens)
        cow_src = self._shared_partial_page(row, length)
        return end - self._num_pages(length) + (cow_src is not None), cow_src

    def _shared_partial_page(self, row, length):
        """The last page if it is partly filled and shared (it must be copied before a write)."""
        if length % self.page_size == 0:
            return None
        page = self.block_table[row, length // self.page_size:length // self.page_size + 1]
        return int(page[0]) if self._holders(page)[0] > 1 else None

    def _sharers_to_copy(self, rows, lens):
        """Indices of the batch whose partly filled last page is shared and must be copied.

        Sharers are taken in batch order and the page's last holder keeps it: a page that r
        tables (or the cache) hold, shared by k sequences of the batch, is copied min(k, r - 1)
        times, never r times (which would leave the page to no one but its copies).
        """
        partial = np.flatnonzero(lens % self.page_size != 0)
        last_pages = self.block_table[rows[partial], (lens[partial] - 1) // self.page_size]
        counts = self._holders(last_pages)
        shared = counts > 1
        partial, last_pages, counts = partial[shared], last_pages[shared], counts[shared]
        copies_left = {}
        chosen = []
        for i, page, count in zip(partial.tolist(), last_pages.tolist(), counts.tolist()):
            left = copies_left.setdefault(page, count - 1)
            if left:
                chosen.append(i)
                copies_left[page] = left - 1
        return np.array(chosen, np.int64)

    def _redirect(self, row, index, src, dst):
        """Copy-on-write: table entry ``index`` moves from shared page src to fresh page dst, and
        the table's reference on src passes to the queued copy."""
        self.block_table[row, index] = dst
        origin = self._pending.get(src)
        if origin is None:
            self._pending[dst] = src
        else:  # src still waits for its own copy, which runs alongside: copy from that copy's source
            self._pending[dst] = origin
            self.allocator.incref_one(origin)
            self._let_go(np.array([src], np.int32))
        if self.prefix is not None:
            ps = self.page_size
            self._slot_tokens[dst * ps:(dst + 1) * ps] = self._slot_tokens[src * ps:(src + 1) * ps]

    def _cache_pages(self, keys, pages):
        """Offer full pages to the prefix cache; the cache takes a reference on each it keeps."""
        if self.prefix is None:
            return
        insert = self.prefix.insert
        taken = [p for key, p in zip(keys, map(int, pages)) if insert(key, p)]
        if taken:
            self.allocator.incref(taken)
            self._cached_in_step[taken] = self._steps

    def _cut(self, row, num_tokens):
        """Keep the first ``num_tokens`` (>= 1) tokens of ``row``; release its pages past them."""
        self._release(self.block_table[row, self._num_pages(num_tokens):self._num_pages(self.seq_lens[row])])
        self.seq_lens[row] = num_tokens
        del self._page_keys[row][num_tokens // self.page_size:]
        self._own_from[row] = min(self._own_from[row], num_tokens // self.page_size)

    def _slots(self, row, start, end):
        """int64 [end - start]: the slots of positions start .. end - 1 of ``row``."""
        positions = np.arange(start, end)
        return self.block_table[row, positions // self.page_size].astype(np.int64) * self.page_size \
            + positions % self.page_size

    def _pages_filled(self, rows, indices):
        """Page ``indices[i]`` of ``rows[i]`` just became full, in order (a row's pages ascending):
        key each from the key of the page before it and its tokens, and offer them to the prefix cache."""
        ps = self.page_size
        filled = self.block_table[rows, indices]
        slots = filled.astype(np.int64)[:, None] * ps + np.arange(ps)
        pages = np.ascontiguousarray(self._slot_tokens[slots], dtype="<i4").tobytes()
        keys = []
        for i, row in enumerate(rows.tolist()):
            chain = self._page_keys[row]
            parent = chain[-1] if chain else salted_root(self._salts[row])
            chain.append(page_key(parent, pages[4 * ps * i:4 * ps * (i + 1)]))
            keys.append(chain[-1])
        self._cache_pages(keys, filled.tolist())

    def _release(self, pages):
        """Drop a table's reference on each of ``pages`` (int32 [n], a table's run), last page
        first, so the LRU evicts a prefix's deep pages first."""
        self._drop_copies_into(self._let_go(pages[::-1].copy()))

    def _let_go(self, pages):
        """Drop one reference on each of ``pages`` (int32 [n], in order); cached pages left to the
        cache alone become evictable. Returns the pages freed, int32."""
        freed = self.allocator.decref(pages)
        if self.prefix is not None and len(self.prefix):
            counts = self.allocator.refcount(pages)
            for page, count in zip(pages.tolist(), counts.tolist()):
                if count == 1 and page in self.prefix.key_of:
                    self.prefix.evictable[page] = None
        return freed

    def _drop_copies_into(self, freed):
        """Queued copies into pages that returned to the pool are moot (the page may be handed out
        and written before the caller runs them): drop them and let go of their sources."""
        moot = [dst for dst in freed.tolist() if dst in self._pending] if self._pending else ()
        if moot:
            self._let_go(np.array([self._pending.pop(dst) for dst in moot], np.int32))

    def _holders(self, pages):
        """int32 [n]: the references on ``pages`` not held for queued copies (tables and cache)."""
        counts = self.allocator.refcount(pages)
        if self._pending:
            held = Counter(self._pending.values())
            counts -= np.array([held[page] for page in pages.tolist()], counts.dtype)
        return counts


def id_list(seq_ids, *, distinct=False) -> list:
    """``seq_ids`` (a list, tuple or array of sequence ids) as a list; TypeError for anything else,
    a str included (it would read as one id per letter); ``distinct``: the ids hashable and
    distinct, else TypeError or ValueError."""
    if isinstance(seq_ids, (str, bytes)) or not hasattr(seq_ids, "__len__"):
        raise TypeError(f"expected seq_ids a list of sequence ids, got {seq_ids!r:.80}")
    try:
        ids = list(seq_ids)
    except TypeError:  # a 0-d array has __len__ but no length
        raise TypeError(f"expected seq_ids a list of sequence ids, got {seq_ids!r:.80}") from None
    if distinct:
        try:
            unique = len(set(ids))
        except TypeError:
            bad = next(s for s in ids if not _is_hashable(s))
            raise TypeError(f"expected hashable sequence ids, got {type(bad).__name__} {bad!r:.80}") from None
        if unique != len(ids):
            raise ValueError("expected distinct seq_ids, got a repeated id")
    return ids


def hashable_id(seq_id, name="seq_id"):
    """``seq_id`` itself, or TypeError saying a sequence id must be hashable (a dict key)."""
    if not _is_hashable(seq_id):
        raise TypeError(f"expected a hashable {name}, got {type(seq_id).__name__} {seq_id!r:.80}")
    return seq_id


def _is_hashable(value) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def _is_held(rows, seq_id):
    try:
        return seq_id in rows
    except TypeError:
        return False


def _new_id(rows, seq_id, name) -> bool:
    """Whether a hashable ``seq_id`` is held already; TypeError if it cannot be a dict key."""
    return hashable_id(seq_id, name) in rows


def _page_set(keep, num_pages) -> set:
    """``keep`` (page ids in [0, num_pages)) as a set of ints."""
    try:
        pages = {int(page) for page in keep}
    except (TypeError, ValueError):
        raise TypeError(f"expected keep an iterable of page ids, got {keep!r}") from None
    outside = sorted(page for page in pages if not 0 <= page < num_pages)
    if outside:
        raise InvalidPageError(f"expected keep's page ids in [0, {num_pages}), got {outside[0]}")
    return pages


def _prefix_keys(keys) -> list:
    """``keys`` as a list of bytes prefix keys (pagekv.prefix.chain_keys makes them)."""
    keys = list(keys) if isinstance(keys, (list, tuple)) else keys
    if not isinstance(keys, list) or not all(isinstance(key, bytes) for key in keys):
        raise TypeError(f"expected keys a list of bytes prefix keys, got {keys!r:.80}")
    short = [key for key in keys if len(key) != KEY_BYTES]
    if short:
        raise ValueError(f"expected {KEY_BYTES}-byte prefix keys, got {short[0]!r:.80}")
    return keys


def _tokens(token_ids, *, allow_empty=False):
    """token_ids as an int32 array, checked: 1-D, integers, within [0, 2**31 - 1]."""
    array = np.asarray(token_ids)
    if array.ndim != 1:
        raise ValueError(f"expected a 1-D sequence of token ids, got shape {array.shape}")
    if array.size == 0:
        if allow_empty:
            return np.empty(0, np.int32)
        raise ValueError("expected at least one token id, got none")
    if array.dtype.kind not in "iu":
        raise TypeError(f"expected integer token ids, got dtype {array.dtype}")
    low, high = int(array.min()), int(array.max())
    if low < 0 or high > _MAX_TOKEN:
        raise ValueError(f"expected token ids in [0, 2**31 - 1], got {low if low < 0 else high}")
    return array.astype(np.int32, copy=False)
