"""KVCacheSpec: the shape of a model's KV cache, and what it costs in bytes.

The design note computed the cache of a 128K-token context as growing "quadratically" and from a
`hidden` size; it grows linearly with tokens, and per token it costs
``2 (K and V) x num_layers x num_kv_heads x head_dim x itemsize`` bytes.
"""

import operator
from dataclasses import dataclass

import numpy as np

__all__ = ["KVCacheSpec", "DTYPES", "pool_shape"]

# Storage dtype -> bytes per element. bfloat16 is stored as uint16 bit patterns and float8_e4m3fn
# (OCP's float8 E4M3) as uint8 bit patterns (docs/layout.md), so numpy-only users need nothing beyond
# numpy; ml_dtypes and torch views of those dtypes also work.
DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape and dtype of a model's KV cache.

    Parameters
    ----------
    num_layers, num_kv_heads, head_dim : int
    page_size : int
        Tokens per page (default 16).
    dtype : {"float32", "float16", "bfloat16", "float8_e4m3fn"}
        float8_e4m3fn holds twice the tokens of bfloat16 in the same bytes; keys and values are
        rounded to it as they are written (pagekv.attention.write_kv).

    Examples
    --------
    >>> spec = KVCacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16")
    >>> spec.bytes_per_token, spec.bytes_per_page
    (131072, 2097152)
    >>> spec.pages_for_budget(8 * 2**30)
    4096
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int = 16
    dtype: str = "bfloat16"

    def __post_init__(self):
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"expected {name} a positive integer, got {value!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"expected dtype one of {sorted(DTYPES)}, got {self.dtype!r}")

    @property
    def itemsize(self) -> int:
        """Bytes per stored element."""
        return DTYPES[self.dtype]

    @property
    def bytes_per_token(self) -> int:
        """Bytes of K and V for one token over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def bytes_per_page(self) -> int:
        """Bytes of one page over all layers."""
        return self.bytes_per_token * self.page_size

    def pages_for_budget(self, nbytes) -> int:
        """How many whole pages fit in ``nbytes``."""
        nbytes = operator.index(nbytes)
        if nbytes < 0:
            raise ValueError(f"expected a budget >= 0 bytes, got {nbytes}")
        return nbytes // self.bytes_per_page

    def pages_for_tokens(self, num_tokens) -> int:
        """Pages that ``num_tokens`` tokens of one sequence occupy."""
        return -(-operator.index(num_tokens) // self.page_size)


def pool_shape(spec, num_pages) -> tuple:
    """``(num_layers, 2, num_pages, num_kv_heads, page_size, head_dim)``: the one array that holds
    every layer's K and V pages of a pool (KVCache, OffloadTier), after checking both arguments."""
    if not isinstance(spec, KVCacheSpec):
        raise TypeError(f"expected a KVCacheSpec, got {type(spec).__name__}")
    if isinstance(num_pages, bool) or not isinstance(num_pages, (int, np.integer)) or num_pages < 1:
        raise ValueError(f"expected num_pages a positive integer, got {num_pages!r}")
    return (spec.num_layers, 2, int(num_pages), spec.num_kv_heads, spec.page_size, spec.head_dim)
