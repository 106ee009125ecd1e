"""Prefix cache: full pages keyed by a hash chain of their tokens, and an LRU of evictable pages.

A full page's key is ``blake2b(parent_key + token_ids_of_the_page)``, so a key names the whole
prefix up to and including that page, is the same in every process and every Python run (unlike
``hash()``, which is salted per process), and a lookup walks keys from the first page until the
first miss. A sequence's first page chains from ``ROOT_KEY``, or from :func:`salted_root` of a
cache salt: what its KV depends on besides its token ids (a LoRA adapter, the images of a
multimodal prompt, a tenant that must not share pages), so equal token ids under other salts never
share pages. This module is bookkeeping only: the manager owns the references that the cache holds.
"""

import hashlib
from collections import OrderedDict

import numpy as np

__all__ = ["ROOT_KEY", "KEY_BYTES", "page_key", "chain_keys", "salted_root", "check_cache_salt", "PrefixCache"]

ROOT_KEY = b"pagekv-prefix-v1"  # parent of a sequence's first page; versioned in case keys change
KEY_BYTES = 16  # a page key's length: its blake2b digest size


def page_key(parent, token_bytes):
    """Key of a full page: 16-byte blake2b of its parent's key and its int32 little-endian token ids."""
    return hashlib.blake2b(parent + token_bytes, digest_size=KEY_BYTES).digest()


def check_cache_salt(cache_salt):
    """``cache_salt`` as bytes (a str as its UTF-8), or None; TypeError for anything else."""
    if cache_salt is None or isinstance(cache_salt, bytes):
        return cache_salt
    if isinstance(cache_salt, str):
        return cache_salt.encode()
    raise TypeError(f"expected cache_salt None, bytes or str, got {type(cache_salt).__name__} {cache_salt!r:.40}")


def salted_root(cache_salt) -> bytes:
    """The parent key of a sequence's first page: ``ROOT_KEY`` without a salt (None), else a
    16-byte blake2b of the salt (bytes, or a str as its UTF-8) personalised apart from page keys,
    so that no salt's root can equal any page's key."""
    cache_salt = check_cache_salt(cache_salt)
    if cache_salt is None:
        return ROOT_KEY
    return hashlib.blake2b(cache_salt, digest_size=KEY_BYTES, person=b"pagekv-salt-v1").digest()


def chain_keys(tokens, page_size, parent=ROOT_KEY):
    """Keys of the full pages of ``tokens``, chained from ``parent``.

    Parameters
    ----------
    tokens : int32 ndarray [num_tokens]
        Token ids (the int32 bytes, little-endian, are what is hashed).
    page_size : int
    parent : bytes
        Key of the page before ``tokens[0]`` (at the start of a sequence ``ROOT_KEY``, or
        ``salted_root(cache_salt)``).

    Returns
    -------
    list of bytes
        One 16-byte key per full page.
    """
    data = np.ascontiguousarray(tokens, dtype="<i4").tobytes()
    step = 4 * page_size
    keys = []
    for start in range(0, len(data) - step + 1, step):
        parent = page_key(parent, data[start:start + step])
        keys.append(parent)
    return keys


class PrefixCache:
    """Which page holds each cached prefix page, and which cached pages no sequence uses.

    Invariants (the manager keeps them): every cached page holds one reference owned by the cache;
    a cached page is in ``evictable`` exactly when that is its only reference. Eviction order is
    least recently released first; a sequence's pages are released tail first, so a prefix's deep
    pages go before its shared head.
    """

    def __init__(self) -> None:
        self.page_of: dict[bytes, int] = {}
        self.key_of: dict[int, bytes] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self.key_of)

    def lookup(self, keys):
        """Pages of the longest run of ``keys`` from the first that are all cached."""
        pages = []
        for key in keys:
            page = self.page_of.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def insert(self, key, page) -> bool:
        """Cache ``page`` under ``key``; False (nothing done) if the key or the page is cached already."""
        if key in self.page_of or page in self.key_of:
            return False
        self.page_of[key] = page
        self.key_of[page] = key
        return True

    def remove(self, page) -> None:
        """Forget one cached page (the caller drops the cache's reference on it)."""
        del self.page_of[self.key_of.pop(page)]
        self.evictable.pop(page, None)

    def evict(self, count, *, keep=(), prefer=()):
        """Forget ``count`` evictable pages, except those in ``keep``, choosing runs of pages.

        First the pages of ``prefer`` (in its order: the pages right after sequences about to grow,
        so that they grow onto them); then the least recently released page, followed by the pages
        after it while they are evictable, listed last page first (freed in this order, the run's
        first page is handed out first and the rest follow it); and so on.

        Returns (key, page) of each evicted page (the caller drops the cache's reference on each).
        """
        victims, chosen = [], set()

        def evictable(page):
            return page in self.evictable and page not in keep and page not in chosen

        for page in prefer:
            if len(victims) == count:
                break
            if evictable(page):
                victims.append(page)
                chosen.add(page)
        seeds = iter(self.evictable)  # not changed until the victims are chosen
        while len(victims) < count:
            seed = next((page for page in seeds if evictable(page)), None)
            if seed is None:
                break
            run = [seed]
            while len(victims) + len(run) < count and evictable(run[-1] + 1):
                run.append(run[-1] + 1)
            victims.extend(reversed(run))
            chosen.update(run)
        evicted = []
        for page in victims:
            del self.evictable[page]
            key = self.key_of.pop(page)
            del self.page_of[key]
            evicted.append((key, page))
        return evicted

    def clear(self):
        """Forget every cached page; returns them (the caller drops the cache's references)."""
        pages = list(self.key_of)
        self.page_of.clear()
        self.key_of.clear()
        self.evictable.clear()
        return pages
