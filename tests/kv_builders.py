"""Builders of random paged KV caches for the kernel tests (pages in random physical order)."""

from unittest import mock

import numpy as np

from pagekv import attention
from pagekv.kernels import slots
from pagekv.reference import float8

STORAGE = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16,
           "float8_e4m3fn": np.uint8}
# Tolerance on max|out - ref| / max|ref| by output (query) dtype: float32 accumulates in float32,
# the 16-bit kinds round the output once.
TOLERANCE = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}
# bfloat16 and float8 caches on the fast_bf16 path also round the probabilities to bfloat16 (and
# the query, which the tests round in the reference too), whatever the query dtype.
FAST_BF16_TOLERANCE = 5e-3  # measured: <= 2.1e-3 over 400 Hypothesis problems (float32 out)


def takes_fast_bf16(kind, head_dim, page_size, fast_bf16=True, products=None):
    """Whether attention over this cache multiplies in bfloat16 (the contract in pagekv.attention):
    only with bfloat16 products, ``products`` (by default ``attention.BF16_PRODUCTS``: whether
    this CPU has them)."""
    products = attention.BF16_PRODUCTS if products is None else products
    return (fast_bf16 and products and kind in ("bfloat16", "float8_e4m3fn") and head_dim % 16 == 0
            and page_size % 2 == 0)


def bf16_products(enabled):
    """``attention.BF16_PRODUCTS`` set to ``enabled`` inside (a context manager): True runs the
    bfloat16 tiles on any CPU (their portable form where AVX512-BF16 is missing), False the
    float32 products."""
    return mock.patch.object(attention, "BF16_PRODUCTS", enabled)


def slots_per_thread(count):
    """``slots.SLOTS_PER_THREAD`` set to ``count`` inside (a context manager): plans made there cut
    that many slots per thread."""
    return mock.patch.object(slots, "SLOTS_PER_THREAD", count)


def to_storage(values, kind):
    """float32 values in a storage array of ``kind`` (bfloat16 as uint16 bits, float8_e4m3fn as
    uint8 bits; rounded to nearest even)."""
    values = np.asarray(values, np.float32)
    if kind == "bfloat16":
        bits = values.view(np.uint32)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    if kind == "float8_e4m3fn":
        return float8.encode(values)
    return values.astype(STORAGE[kind])


def widen(storage, kind):
    """float64 values of a storage array."""
    if kind == "bfloat16":
        return (storage.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    if kind == "float8_e4m3fn":
        return float8.decode(storage)
    return storage.astype(np.float64)


class PagedKV:
    """K/V caches with each sequence's pages scattered at random over a pool, plus spare pages.

    Attributes: k, v (storage arrays), k64, v64 (float64 values), block_table int32 [num_seqs,
    max_pages] padded with -1, seq_lens int32 [num_seqs].
    """

    def __init__(self, rng, seq_lens, *, num_kv_heads, head_dim, page_size, kind,
                 spare_pages=3, extra_columns=1, contiguous=False):
        self.seq_lens = np.asarray(seq_lens, np.int32)
        pages_needed = [-(-int(n) // page_size) for n in self.seq_lens]
        num_pages = sum(pages_needed) + spare_pages
        order = np.arange(num_pages) if contiguous else rng.permutation(num_pages)
        self.block_table = np.full((len(pages_needed), max(pages_needed + [0]) + extra_columns), -1,
                                   np.int32)
        start = 0
        for s, n in enumerate(pages_needed):
            self.block_table[s, :n] = order[start:start + n]
            start += n
        shape = (num_pages, num_kv_heads, page_size, head_dim)
        self.kind = kind
        self.k = to_storage(rng.standard_normal(shape), kind)
        self.v = to_storage(rng.standard_normal(shape), kind)

    @property
    def k64(self):
        return widen(self.k, self.kind)

    @property
    def v64(self):
        return widen(self.v, self.kind)


def relative_error(got, expected):
    got = np.asarray(got, np.float64)
    scale = max(np.abs(expected).max(), 1e-30)
    return np.abs(got - expected).max() / scale
