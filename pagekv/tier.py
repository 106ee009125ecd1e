"""OffloadTier: a second, slower pool of KV pages — RAM, or a file-backed memory map.

Same page layout as :class:`pagekv.KVCache` (``[num_layers, 2, num_pages, num_kv_heads, page_size,
head_dim]``) and its own :class:`pagekv.PageAllocator`. Besides swapped-out sequences it keeps
prefix pages spilled from the hot prefix cache, under their prefix keys, least recently used first.
That bookkeeping, without the KV, is :class:`TierPages` (the simulator's host tier is one).

File format (little-endian), so a tier file outlives its process and a new process finds its cached
prefixes again::

    [0, 4096)           header: magic b"PAGEKVT1", version, spec, num_pages, offsets, CRC32s
    [4096, map_offset)  page data, the layout above
    [map_offset, end)   page map: per page a 16-byte prefix key (zeros: none), the CRC32 of the
                        page's bytes, and a use stamp (its LRU position)

The header and page map carry CRC32s: a foreign, truncated or corrupted file is refused with
:class:`TierFileError`. A map entry whose page no longer matches its CRC (the process stopped
between a page's reuse and the next :meth:`OffloadTier.flush`) is dropped on open, not trusted.
"""

import mmap
import os
import struct
import zlib
from collections import OrderedDict
from itertools import islice

import numpy as np

from pagekv._alloc import PageAllocator
from pagekv.cache import _STORAGE, check_fits_in_memory
from pagekv.errors import OutOfPagesError, PageStateError, PagekvError
from pagekv.prefix import KEY_BYTES
from pagekv.spec import KVCacheSpec, pool_shape

__all__ = ["OffloadTier", "TierFileError", "TierPages"]

MAGIC = b"PAGEKVT1"
VERSION = 1
HEADER_BYTES = 4096
_HEADER = struct.Struct("<8sIIIIIIQQQI")  # magic .. map CRC; the header CRC follows it
_DTYPE_CODES = {"float32": 0, "float16": 1, "bfloat16": 2, "float8_e4m3fn": 3}
_MAP_ENTRY = np.dtype([("key", f"S{KEY_BYTES}"), ("crc", "<u4"), ("pad", "<u4"), ("stamp", "<u8")])


class TierFileError(PagekvError, ValueError):
    """A tier file that is not one, is truncated, or fails its checksums."""


def _count(count) -> int:
    """``count`` as an int; ValueError unless it is an integer >= 0."""
    if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 0:
        raise ValueError(f"expected count an integer >= 0, got {count!r}")
    return int(count)


class TierPages:
    """A tier's page bookkeeping, without the KV: its allocator, and the prefix pages spilled from
    the hot prefix cache kept on its pages, under their prefix keys, least recently used first.

    Parameters
    ----------
    num_pages : int

    Attributes
    ----------
    allocator : PageAllocator
    prefixes : OrderedDict[bytes, int]
        Spilled prefix pages: key -> page, least recently used first. Each holds one reference on
        its page; a swapped-out sequence may hold others.
    """

    def __init__(self, num_pages: int) -> None:
        self.allocator = PageAllocator(num_pages)
        self.prefixes: OrderedDict[bytes, int] = OrderedDict()
        self._shared: set[int] = set()  # prefix pages kept with other references on them

    def keep_prefix(self, key: bytes, page: int) -> None:
        """Record that tier ``page`` holds the prefix page ``key`` (a 16-byte ``prefix.page_key``),
        most recently used. The caller allocated the page and hands its reference to the tier; a
        page already kept under ``key`` is released (a key names the same tokens, so the same KV).

        Raises InvalidPageError for a page outside the tier, PageStateError for a free one, and
        ValueError for a key that is not 16 bytes; the tier is then unchanged.
        """
        if not isinstance(key, bytes) or len(key) != KEY_BYTES:
            raise ValueError(f"expected a {KEY_BYTES}-byte prefix key (bytes), got {key!r:.80}")
        references = self.allocator.refcount([page])[0]  # refcount refuses ids outside the tier
        if references == 0:
            raise PageStateError(f"expected a tier page the caller allocated, got free page {page}")
        replaced = self.prefixes.pop(key, None)
        self.prefixes[key] = int(page)
        if references > 1:  # a swapped-out sequence holds it too
            self._shared.add(int(page))
        if replaced is not None:
            self._shared.discard(replaced)
            self.allocator.decref([replaced])

    def take_prefix(self, key: bytes) -> int:
        """Forget ``key`` and return its page; the caller now owns the page's reference."""
        if key not in self.prefixes:
            raise KeyError(f"expected the key of a spilled prefix page, got {key!r:.80}")
        page = self.prefixes.pop(key)
        self._shared.discard(page)
        return page

    def evict_prefixes(self, count: int) -> int:
        """Free up to ``count`` pages by dropping the least recently used spilled prefixes whose page
        nothing else holds; returns how many were freed. A prefix whose page a swapped-out sequence
        shares (a page set aside at swap-out is spilled onto the tier page it was copied to) stays:
        dropping it would free nothing."""
        count = _count(count)
        shared = self._still_shared()
        victims = list(islice((key for key, page in self.prefixes.items() if page not in shared), count))
        pages = [self.prefixes.pop(key) for key in victims]
        if pages:
            self.allocator.decref(pages)
        return len(pages)

    def droppable_pages(self) -> int:
        """Pages :meth:`evict_prefixes` could free: spilled prefixes' pages nothing else holds."""
        return len(self.prefixes) - len(self._still_shared())

    def room(self) -> int:
        """Pages :meth:`take` could get: free ones plus those only spilled prefixes hold."""
        return self.allocator.num_free + self.droppable_pages()

    def take(self, count: int):
        """Allocate ``count`` pages (int32 [count], a reference each), dropping spilled prefixes
        (least recently used first) if the free pages are too few.

        Raises
        ------
        OutOfPagesError
            Fewer than ``count`` pages even after dropping them; nothing changed.
        ValueError
            A ``count`` that is not an integer >= 0.
        """
        count = _count(count)
        if count == 0:  # a swap-out whose pages all have tier pages set aside already
            return np.empty(0, np.int32)
        room = self.room()
        if count > room:
            raise OutOfPagesError(count, room)
        shortfall = count - self.allocator.num_free
        if shortfall > 0:
            self.evict_prefixes(shortfall)
        return self.allocator.allocate(count)

    def _still_shared(self) -> set:
        """The prefix pages other references still hold (their holders let go of the rest): O(the
        pages kept shared), not O(all prefixes), as evictions ask for it every time."""
        pages = np.fromiter(self._shared, np.int32, len(self._shared))
        self._shared = set(pages[self.allocator.refcount(pages) > 1].tolist())
        return self._shared


class OffloadTier(TierPages):
    """A pool of ``num_pages`` pages of ``spec`` in RAM, or in a new file at ``path``: the
    bookkeeping of :class:`TierPages` and the pages' KV.

    Parameters
    ----------
    spec : KVCacheSpec
        Must equal the hot cache's spec (the same page shape and dtype).
    num_pages : int
    path : str or os.PathLike, optional
        Create this file (it must not exist) and keep the pages there, memory-mapped: contexts
        larger than RAM, and prefixes that survive a restart (:meth:`open`).

    Attributes
    ----------
    data : [num_layers, 2, num_pages, num_kv_heads, page_size, head_dim]
        float32, float16 or uint16 (bfloat16 bits), like ``KVCache.data``.
    allocator : PageAllocator
    prefixes : OrderedDict[bytes, int]
        Spilled prefix pages (:class:`TierPages`).
    dropped_on_open : int
        Map entries :meth:`open` dropped because their page failed its CRC.
    """

    def __init__(self, spec: KVCacheSpec, num_pages: int, *, path=None) -> None:
        self.spec = spec
        self.num_pages = pool_shape(spec, num_pages)[2]
        if path is None:
            check_fits_in_memory("a RAM tier (path= puts one in a file)", self.num_pages,
                                 spec.bytes_per_page)
        super().__init__(self.num_pages)
        self.path = None if path is None else os.fspath(path)
        self.dropped_on_open = 0
        self._mmap: mmap.mmap | None = None
        shape = self._shape()
        if self.path is None:
            self.data = np.zeros(shape, _STORAGE[spec.dtype])
            return
        empty_map = self._map_bytes(np.zeros(self.num_pages, _MAP_ENTRY))
        with open(self.path, "xb") as f:  # "x": never overwrite a file someone else owns
            f.truncate(self._file_bytes())
            f.write(self._header(zlib.crc32(empty_map)))
            f.seek(self._map_offset())
            f.write(empty_map)
        self._map_file(self.path)

    # ------------------------------------------------------------------ the file
    @classmethod
    def open(cls, path, *, spec: KVCacheSpec | None = None) -> "OffloadTier":
        """Reopen a tier file written by :meth:`flush` (in this process or an earlier one).

        Parameters
        ----------
        path : str or os.PathLike
        spec : KVCacheSpec, optional
            When given, the file's spec must equal it.

        Raises
        ------
        TierFileError
            Not a pagekv tier file, another version, truncated, a header or page map that fails
            its CRC, or a spec other than ``spec``.
        """
        path = os.fspath(path)
        with open(path, "rb") as f:
            head = f.read(HEADER_BYTES)
            size = os.fstat(f.fileno()).st_size
        if len(head) < _HEADER.size + 4 or head[:8] != MAGIC:
            raise TierFileError(f"expected a pagekv tier file (magic {MAGIC!r}), got {head[:8]!r} in {path}")
        fields = _HEADER.unpack_from(head)
        (crc,) = struct.unpack_from("<I", head, _HEADER.size)
        if zlib.crc32(head[:_HEADER.size]) != crc:
            raise TierFileError(f"expected a header matching its CRC32, got a corrupted header in {path}")
        _, version, layers, heads, head_dim, page_size, dtype_code, num_pages, data_offset, map_offset, \
            map_crc = fields
        if version != VERSION:
            raise TierFileError(f"expected tier file version {VERSION}, got {version} in {path}")
        dtype = {code: name for name, code in _DTYPE_CODES.items()}.get(dtype_code)
        if dtype is None:
            raise TierFileError(f"expected a dtype code in {sorted(_DTYPE_CODES.values())}, got {dtype_code}")
        file_spec = KVCacheSpec(num_layers=layers, num_kv_heads=heads, head_dim=head_dim,
                                page_size=page_size, dtype=dtype)
        if spec is not None and spec != file_spec:
            raise TierFileError(f"expected a tier file of {spec}, got one of {file_spec}")
        tier = cls.__new__(cls)
        tier.spec, tier.num_pages, tier.path = file_spec, int(num_pages), path
        tier.dropped_on_open, tier._mmap = 0, None
        if (data_offset, map_offset) != (HEADER_BYTES, tier._map_offset()) or size != tier._file_bytes():
            raise TierFileError(f"expected {tier._file_bytes()} bytes for {num_pages} pages of {file_spec}, "
                                f"got {size}: the file is truncated or damaged")
        TierPages.__init__(tier, tier.num_pages)  # the sizes are checked
        mapping = tier._map_file(path)
        entries = np.frombuffer(mapping, _MAP_ENTRY, tier.num_pages, tier._map_offset()).copy()
        if zlib.crc32(tier._map_bytes(entries)) != map_crc:
            raise TierFileError(f"expected a page map matching its CRC32, got a corrupted page map in {path}")
        tier._restore_prefixes(entries)
        return tier

    def flush(self) -> None:
        """Write the page data and the page map to the file (a no-op for a RAM tier)."""
        if self._mmap is None:
            return
        entries = np.zeros(self.num_pages, _MAP_ENTRY)
        for stamp, (key, page) in enumerate(self.prefixes.items(), start=1):
            entries[page] = (key, self._page_crc(page), 0, stamp)
        self._mmap.flush()  # data before the map that vouches for it
        map_bytes = self._map_bytes(entries)
        self._mmap[self._map_offset():self._map_offset() + len(map_bytes)] = map_bytes
        self._mmap[:HEADER_BYTES] = self._header(zlib.crc32(map_bytes)).ljust(HEADER_BYTES, b"\0")
        self._mmap.flush()

    def close(self) -> None:
        """:meth:`flush`, then unmap the file. The tier is unusable afterwards."""
        self.flush()
        if self._mmap is not None:
            del self.data  # this tier's own view of the mapping
            try:
                self._mmap.close()
            except BufferError:  # views of the pages are still alive: the mapping goes with them
                pass
            self._mmap = None

    @property
    def page_elements(self) -> int:
        """Elements of one page of one layer's K (or V)."""
        return self.spec.num_kv_heads * self.spec.page_size * self.spec.head_dim

    # ------------------------------------------------------------------ helpers
    def _shape(self):
        return pool_shape(self.spec, self.num_pages)

    def _map_offset(self) -> int:
        return HEADER_BYTES + self.num_pages * self.spec.bytes_per_page

    def _file_bytes(self) -> int:
        return self._map_offset() + self.num_pages * _MAP_ENTRY.itemsize

    def _header(self, map_crc: int) -> bytes:
        s = self.spec
        head = _HEADER.pack(MAGIC, VERSION, s.num_layers, s.num_kv_heads, s.head_dim, s.page_size,
                            _DTYPE_CODES[s.dtype], self.num_pages, HEADER_BYTES, self._map_offset(), map_crc)
        return head + struct.pack("<I", zlib.crc32(head))

    @staticmethod
    def _map_bytes(entries) -> bytes:
        return np.ascontiguousarray(entries).tobytes()

    def _map_file(self, path: str) -> mmap.mmap:
        with open(path, "r+b") as f:
            mapping = mmap.mmap(f.fileno(), 0)
        self._mmap = mapping
        self.data = np.frombuffer(mapping, _STORAGE[self.spec.dtype], int(np.prod(self._shape())),
                                  HEADER_BYTES).reshape(self._shape())
        return mapping

    def _page_crc(self, page: int) -> int:
        crc = 0
        for layer in range(self.spec.num_layers):
            for kv in range(2):
                crc = zlib.crc32(self.data[layer, kv, page], crc)
        return crc

    def _restore_prefixes(self, entries):
        """Hold the pages of the map's valid entries (CRC-checked), in LRU order, free the rest."""
        held = self.allocator.allocate(self.num_pages)
        keep = []
        for page in np.argsort(entries["stamp"], kind="stable"):
            entry = entries[page]
            if entry["stamp"] == 0:
                continue
            if self._page_crc(int(page)) != entry["crc"]:
                self.dropped_on_open += 1
                continue
            self.prefixes[bytes(entry["key"]).ljust(KEY_BYTES, b"\0")] = int(page)
            keep.append(int(page))
        release = np.setdiff1d(held, np.array(keep, np.int32)).astype(np.int32)
        if len(release):
            self.allocator.decref(release)
