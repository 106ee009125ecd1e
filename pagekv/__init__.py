"""pagekv: a paged KV cache for LLM inference on CPUs.

The KV cache is split into fixed-size pages held in one pool; each sequence keeps a page table
(logical page -> physical page); pages are reference-counted so sequences can share them; attention
kernels walk the page tables directly.
"""

from pagekv._alloc import PageAllocator
from pagekv.cache import KVCache
from pagekv.errors import (
    InvalidPageError,
    InvariantError,
    OutOfPagesError,
    PagekvError,
    PageStateError,
    UnknownSequenceError,
)
from pagekv.manager import Batch, KVCacheManager, ManagerStats
from pagekv.spec import KVCacheSpec

__version__ = "0.1.0"

__all__ = [
    "PageAllocator",
    "KVCacheSpec",
    "KVCache",
    "KVCacheManager",
    "ManagerStats",
    "Batch",
    "PagekvError",
    "OutOfPagesError",
    "InvalidPageError",
    "PageStateError",
    "UnknownSequenceError",
    "InvariantError",
]
