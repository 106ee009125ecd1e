"""ReferenceKVCacheManager: the plain-Python twin of :class:`pagekv.KVCacheManager`.

Page tables are lists, every sequence keeps all its tokens, prefix keys are recomputed from those
tokens, and the LRU is a list: slow and obvious. It follows the same policy (which pages are hits,
which cached page is evicted first, when copy-on-write happens), so a test can demand the same
answers, with page ids equal up to renaming.
"""

import hashlib

from pagekv.errors import OutOfPagesError, UnknownSequenceError
from pagekv.reference.allocator import ReferencePageAllocator

__all__ = ["ReferenceKVCacheManager"]

ROOT_KEY = b"pagekv-prefix-v1"


def root_key(cache_salt):
    """The key before a sequence's first page: ROOT_KEY, or a blake2b-128 of the salt (bytes, or a
    str as UTF-8) personalised as b"pagekv-salt-v1"."""
    if cache_salt is None:
        return ROOT_KEY
    if isinstance(cache_salt, str):
        cache_salt = cache_salt.encode()
    if not isinstance(cache_salt, bytes):
        raise TypeError("expected cache_salt None, bytes or str")
    return hashlib.blake2b(cache_salt, digest_size=16, person=b"pagekv-salt-v1").digest()


def prefix_keys(tokens, page_size, root=ROOT_KEY):
    """Key of every full page: blake2b-128 of (previous key + the page's int32 little-endian ids),
    the first page's previous key ``root``."""
    keys, key = [], root
    for start in range(0, len(tokens) - page_size + 1, page_size):
        page = b"".join(int(t).to_bytes(4, "little") for t in tokens[start:start + page_size])
        key = hashlib.blake2b(key + page, digest_size=16).digest()
        keys.append(key)
    return keys


class ReferenceKVCacheManager:
    def __init__(self, *, num_pages, page_size=16, max_seqs, max_pages_per_seq,
                 enable_prefix_caching=True):
        self.allocator = ReferencePageAllocator(num_pages)
        self.page_size = page_size
        self.max_seqs = max_seqs
        self.max_pages_per_seq = max_pages_per_seq
        self.caching = enable_prefix_caching
        self.tables: dict = {}       # seq_id -> [page, ...]
        self.tokens: dict = {}       # seq_id -> [token, ...]
        self.roots: dict = {}        # seq_id -> the key before its first page (its cache salt's)
        self.offered: dict = {}      # seq_id -> full pages already offered to the cache
        self.own_from: dict = {}     # seq_id -> first page it handed out itself (not come written)
        self.page_of: dict = {}      # key -> page
        self.key_of: dict = {}       # page -> key
        self.lru: list = []          # pages held only by the cache, least recently released first
        self.pending: dict = {}      # dst -> src of each queued copy; each src holds a reference
        self.steps = 0               # take_pending_copies calls
        self.cached_in_step: dict = {}  # page -> the step it was cached in when handed out
        self.hit_tokens = 0
        self.query_tokens = 0

    # ------------------------------------------------------------------ helpers
    def _pages(self, num_tokens):
        return -(-num_tokens // self.page_size)

    def _tokens(self, token_ids):
        tokens = list(token_ids)
        if not tokens:
            raise ValueError("expected at least one token id, got none")
        if any(isinstance(t, bool) or not isinstance(t, int) for t in tokens):
            raise TypeError("expected integer token ids")
        if any(not 0 <= t <= 2**31 - 1 for t in tokens):
            raise ValueError("expected token ids in [0, 2**31 - 1]")
        return tokens

    def _seq(self, seq_id):
        if seq_id not in self.tables:
            raise UnknownSequenceError(f"expected a held sequence id, got {seq_id!r}")
        return self.tables[seq_id]

    def _take(self, count, keep, after=-1):
        """``count`` pages after evicting what is needed; ``after``: the page they follow, or a
        list of one such page per page taken (-1: none). Cached pages a run would grow onto are
        evicted for it first, even while other pages are free; then, if short, runs from the least
        recently released page, each run last page first."""
        if count == 0:
            return []
        evictable = [p for p in self.lru if p not in keep]
        if isinstance(after, list):
            grow_onto = [a + 1 for a in after if a >= 0 and a + 1 in evictable]
        else:
            grow_onto = []
            for page in range(after + 1, after + 1 + count) if after >= 0 else ():
                if page in evictable:
                    grow_onto.append(page)
                elif page not in self.allocator.free:
                    break
        needed = max(count - self.allocator.num_free, len(grow_onto))
        if needed > 0:
            if count > self.allocator.num_free + len(evictable):
                raise OutOfPagesError(count, self.allocator.num_free + len(evictable))
            victims = list(dict.fromkeys(grow_onto))[:needed]
            for seed in evictable:
                if len(victims) == needed:
                    break
                if seed in victims:
                    continue
                run = [seed]
                while len(victims) + len(run) < needed and run[-1] + 1 in evictable \
                        and run[-1] + 1 not in victims:
                    run.append(run[-1] + 1)
                victims += run[::-1]
            for page in victims:
                self.lru.remove(page)
                del self.page_of[self.key_of.pop(page)]
            self._drop_copies_into(self.allocator.decref(victims))
        if isinstance(after, list):
            return self.allocator.allocate_many([1] * count, after=after)[0]
        return self.allocator.allocate(count, after=after)

    def _offer_full_pages(self, seq_id):
        """Offer each newly full page to the cache, in order; the cache keeps a reference."""
        if not self.caching:
            return
        keys = prefix_keys(self.tokens[seq_id], self.page_size, self.roots[seq_id])
        for index in range(self.offered[seq_id], len(keys)):
            page = self.tables[seq_id][index]
            if keys[index] not in self.page_of and page not in self.key_of:
                self.page_of[keys[index]] = page
                self.key_of[page] = keys[index]
                self.cached_in_step[page] = self.steps
                self.allocator.incref([page])
        self.offered[seq_id] = len(keys)

    def _holders(self, page):
        """References on ``page`` from tables and the cache (not from queued copies)."""
        return self.allocator.refcount([page])[0] - list(self.pending.values()).count(page)

    def _copy_on_write(self, seq_id, dst):
        """The table's reference on its last page passes to the queued copy; a copy from a page
        that waits for its own copy copies from that copy's source instead."""
        table = self.tables[seq_id]
        src = table[-1]
        table[-1] = dst
        if src in self.pending:
            self.pending[dst] = self.pending[src]
            self.allocator.incref([self.pending[src]])
            self._let_go([src])
        else:
            self.pending[dst] = src

    def _let_go(self, pages):
        """Drop a reference on each page; a cached page left to the cache alone joins the LRU."""
        freed = self.allocator.decref(pages) if pages else []
        for page in pages:
            if page in self.key_of and self.allocator.refcount([page])[0] == 1 and page not in self.lru:
                self.lru.append(page)
        return freed

    def _drop_copies_into(self, freed):
        moot = [page for page in freed if page in self.pending]
        self._let_go([self.pending.pop(page) for page in moot])

    # ------------------------------------------------------------------ the contract
    def add_sequence(self, seq_id, token_ids, cache_salt=None):
        if seq_id in self.tables:
            raise ValueError(f"expected a new seq_id, got {seq_id!r}")
        tokens = self._tokens(token_ids)
        root = root_key(cache_salt)
        num_pages = self._pages(len(tokens))
        if num_pages > self.max_pages_per_seq:
            raise ValueError("expected a prompt within max_pages_per_seq")
        if len(self.tables) == self.max_seqs:
            raise ValueError("expected at most max_seqs sequences")
        hit = []
        if self.caching:
            for key in prefix_keys(tokens, self.page_size, root):
                if key not in self.page_of:
                    break
                hit.append(self.page_of[key])
        if len(hit) * self.page_size == len(tokens):
            hit = hit[:-1]
        fresh = self._take(num_pages - len(hit), set(hit), hit[-1] if hit else -1)
        if hit:
            self.allocator.incref(hit)
            self.lru = [p for p in self.lru if p not in hit]
        self.tables[seq_id] = hit + fresh
        self.tokens[seq_id] = tokens
        self.roots[seq_id] = root
        self.offered[seq_id] = self.own_from[seq_id] = len(hit)
        self._offer_full_pages(seq_id)
        self.hit_tokens += len(hit) * self.page_size
        self.query_tokens += len(tokens)
        return len(hit) * self.page_size

    def append(self, seq_id, token_ids):
        table = self._seq(seq_id)
        tokens = self._tokens(token_ids)
        length = len(self.tokens[seq_id])
        end = self._pages(length + len(tokens))
        if end > self.max_pages_per_seq:
            raise ValueError("expected a sequence within max_pages_per_seq")
        cow = length % self.page_size != 0 and self._holders(table[-1]) > 1
        follows = len(table) - 1 - cow  # the page before the first new one (or the copy)
        fresh = self._take(end - len(table) + cow, set(), table[follows] if follows >= 0 else -1)
        if cow:
            self._copy_on_write(seq_id, fresh.pop(0))
        table.extend(fresh)
        self.tokens[seq_id].extend(tokens)
        self._offer_full_pages(seq_id)
        return [table[p // self.page_size] * self.page_size + p % self.page_size
                for p in range(length, length + len(tokens))]

    def append_tokens(self, seq_ids, token_ids):
        tables = [self._seq(s) for s in seq_ids]
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError("expected distinct seq_ids")
        tokens = list(token_ids)
        if len(tokens) != len(seq_ids):
            raise ValueError("expected one token per sequence")
        if tokens:
            self._tokens(tokens)
        lengths = [len(self.tokens[s]) for s in seq_ids]
        crossing = [i for i, n in enumerate(lengths) if n % self.page_size == 0]
        if any(lengths[i] // self.page_size >= self.max_pages_per_seq for i in crossing):
            raise ValueError("expected sequences within max_pages_per_seq")
        # Sequentially, each sharer of a partly filled page copies it while someone else still
        # holds it; the last holder keeps it.
        holders = {}
        shared = []
        for i, n in enumerate(lengths):
            if n % self.page_size:
                page = tables[i][-1]
                holders.setdefault(page, self._holders(page))
                if holders[page] > 1:
                    shared.append(i)
                    holders[page] -= 1
        before = [(i, len(tables[i]) - 1) for i in crossing] + [(i, len(tables[i]) - 2) for i in shared]
        fresh = self._take(len(crossing) + len(shared), set(),
                           [tables[i][k] if k >= 0 else -1 for i, k in before])
        for i, page in zip(crossing, fresh):
            tables[i].append(page)
        for i, page in zip(shared, fresh[len(crossing):]):
            self._copy_on_write(seq_ids[i], page)
        slots = []
        for seq_id, table, length, token in zip(seq_ids, tables, lengths, tokens):
            slots.append(table[length // self.page_size] * self.page_size + length % self.page_size)
            self.tokens[seq_id].append(token)
            self._offer_full_pages(seq_id)
        return slots

    def fork(self, src_id, dst_id):
        table = self._seq(src_id)
        if dst_id in self.tables:
            raise ValueError(f"expected a new dst_id, got {dst_id!r}")
        if len(self.tables) == self.max_seqs:
            raise ValueError("expected at most max_seqs sequences")
        self.allocator.incref(table)
        self.tables[dst_id] = list(table)
        self.tokens[dst_id] = list(self.tokens[src_id])
        self.roots[dst_id] = self.roots[src_id]
        self.offered[dst_id] = self.offered[src_id]
        self.own_from[dst_id] = len(self.tokens[src_id]) // self.page_size

    def _release(self, released):
        self._drop_copies_into(self._let_go(released))

    def free(self, seq_id):
        self._release(self._seq(seq_id)[::-1])
        del self.tables[seq_id], self.tokens[seq_id], self.offered[seq_id], self.own_from[seq_id], \
            self.roots[seq_id]

    def truncate(self, seq_id, num_tokens):
        table = self._seq(seq_id)
        tokens = self.tokens[seq_id]
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or not 1 <= num_tokens <= len(tokens):
            raise ValueError(f"expected num_tokens in [1, {len(tokens)}]")
        keep = self._pages(num_tokens)
        self._release(table[keep:][::-1])
        del table[keep:], tokens[num_tokens:]
        self.offered[seq_id] = min(self.offered[seq_id], num_tokens // self.page_size)
        self.own_from[seq_id] = min(self.own_from[seq_id], num_tokens // self.page_size)

    def discard(self, seq_id, num_written):
        table = self._seq(seq_id)
        tokens = self.tokens[seq_id]
        if isinstance(num_written, bool) or not isinstance(num_written, int) or not 0 <= num_written <= len(tokens):
            raise ValueError(f"expected num_written in [0, {len(tokens)}]")
        keys = prefix_keys(tokens, self.page_size, self.roots[seq_id]) if self.caching else []
        for index in range(max(num_written // self.page_size, self.own_from[seq_id]), len(keys)):
            page = table[index]
            if self.page_of.get(keys[index]) == page:  # cached from this sequence's unwritten tokens
                del self.page_of[keys[index]], self.key_of[page]
                self.allocator.decref([page])
        if num_written == 0:
            self.free(seq_id)
        else:
            self.truncate(seq_id, num_written)

    def detach(self, seq_id):
        self._seq(seq_id)
        record = (list(self.tokens[seq_id]), self.offered[seq_id], self.roots[seq_id])
        self.free(seq_id)
        return record

    def attach(self, seq_id, record, reuse_cached=False):
        tokens = record[0]
        return self.attach_shared([seq_id], [record], [list(range(self._pages(len(tokens))))], reuse_cached)

    def attach_shared(self, seq_ids, records, page_indices, reuse_cached=False):
        if len(set(seq_ids)) != len(seq_ids) or any(seq_id in self.tables for seq_id in seq_ids):
            raise ValueError(f"expected new, distinct seq_ids, got {seq_ids!r}")
        named = []
        for (tokens, _, _), index in zip(records, page_indices):
            num_pages = self._pages(len(tokens))
            if num_pages > self.max_pages_per_seq:
                raise ValueError("expected a sequence within max_pages_per_seq")
            if len(index) != num_pages or len(set(index)) != num_pages or min(index, default=0) < 0:
                raise ValueError("expected distinct page indices, one per page")
            named += list(index)
        if set(named) != set(range(len(set(named)))):
            raise ValueError("expected every page index named")
        if len(self.tables) + len(seq_ids) > self.max_seqs:
            raise ValueError("expected at most max_seqs sequences")
        hits = {}  # page index -> cached page with the same prefix key (the first sequence naming it)
        if reuse_cached and self.caching:
            for (tokens, _, root), index in zip(records, page_indices):
                for i, key in zip(index, prefix_keys(tokens, self.page_size, root)):
                    if key in self.page_of and i not in hits \
                            and self.cached_in_step[self.page_of[key]] != self.steps:
                        hits[i] = self.page_of[key]  # not one whose KV the coming forward writes
        count = len(set(named))
        fresh = iter(self._take(count - len(hits), set(hits.values())))
        pages = [hits[i] if i in hits else next(fresh) for i in range(count)]
        self.lru = [p for p in self.lru if p not in hits.values()]
        extra = [pages[i] for i in range(count) for _ in range(named.count(i) - (i not in hits))]
        if extra:  # a page named by k sequences holds k references
            self.allocator.incref(extra)
        for seq_id, (tokens, _, root), index in zip(seq_ids, records, page_indices):
            self.tables[seq_id] = [pages[i] for i in index]
            self.tokens[seq_id] = list(tokens)
            self.roots[seq_id] = root
            self.offered[seq_id] = len(tokens) // self.page_size  # its full pages are not offered again
            self.own_from[seq_id] = len(tokens) // self.page_size
        if reuse_cached:
            return pages, [i not in hits for i in range(count)]
        return pages

    def clear_prefix_cache(self):
        pages = list(self.key_of)
        self.page_of.clear()
        self.key_of.clear()
        self.lru.clear()
        if pages:
            self._drop_copies_into(self.allocator.decref(pages))

    def take_pending_copies(self):
        pairs, self.pending = [(src, dst) for dst, src in self.pending.items()], {}
        self.steps += 1
        self._let_go([src for src, _ in pairs])
        return pairs

    def kv_sources(self, pages):
        return [self.pending.get(page, page) for page in pages]

    def seq_len(self, seq_id):
        self._seq(seq_id)
        return len(self.tokens[seq_id])

    def stats(self):
        """The same fields as ManagerStats, as a dict."""
        num_tokens = sum(len(t) for t in self.tokens.values())
        logical = sum(len(t) for t in self.tables.values())
        physical = self.allocator.num_used - len(self.lru)
        return dict(num_seqs=len(self.tables), num_tokens=num_tokens,
                    pages_used=self.allocator.num_used, pages_free=self.allocator.num_free,
                    pages_cached=len(self.lru), fragmentation_tokens=logical * self.page_size - num_tokens,
                    prefix_hit_tokens=self.hit_tokens, prefix_query_tokens=self.query_tokens,
                    sharing_factor=logical / physical if physical else 1.0)
