"""KVCache: the storage of every layer's K and V pages, in one array.

Layout (docs/layout.md): ``data [num_layers, 2, num_pages, num_kv_heads, page_size, head_dim]``;
``k(layer)`` and ``v(layer)`` are the C-contiguous per-layer views the kernels take.
"""

import numpy as np

from pagekv.spec import KVCacheSpec

__all__ = ["KVCache"]

_STORAGE = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}


def _available_memory() -> int | None:
    """Bytes the OS says can still be allocated (MemAvailable), or None where it cannot tell."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class KVCache:
    """Every layer's K and V pages for ``num_pages`` pages of ``spec``, in one array.

    Parameters
    ----------
    spec : KVCacheSpec
    num_pages : int

    Raises
    ------
    MemoryError
        Before touching memory, when the cache is larger than the memory the OS reports available.

    Examples
    --------
    >>> cache = KVCache(KVCacheSpec(num_layers=2, num_kv_heads=4, head_dim=64, dtype="float32"), 8)
    >>> cache.k(1).shape, cache.nbytes
    ((8, 4, 16, 64), 524288)
    """

    def __init__(self, spec: KVCacheSpec, num_pages: int) -> None:
        if not isinstance(spec, KVCacheSpec):
            raise TypeError(f"expected a KVCacheSpec, got {type(spec).__name__}")
        if isinstance(num_pages, bool) or not isinstance(num_pages, (int, np.integer)) or num_pages < 1:
            raise ValueError(f"expected num_pages a positive integer, got {num_pages!r}")
        self.spec = spec
        self.num_pages = int(num_pages)
        nbytes = self.num_pages * spec.bytes_per_page
        available = _available_memory()
        if available is not None and nbytes > available:
            raise MemoryError(f"expected a KV cache within the {available / 2**30:.1f} GiB available, "
                              f"got {self.num_pages} pages x {spec.bytes_per_page} B = "
                              f"{nbytes / 2**30:.1f} GiB")
        shape = (spec.num_layers, 2, self.num_pages, spec.num_kv_heads, spec.page_size, spec.head_dim)
        self.data = np.zeros(shape, _STORAGE[spec.dtype])

    @property
    def nbytes(self) -> int:
        """Total bytes of K and V storage."""
        return self.data.nbytes

    def k(self, layer: int) -> np.ndarray:
        """Keys of one layer: [num_pages, num_kv_heads, page_size, head_dim] (a view)."""
        return self.data[layer, 0]

    def v(self, layer: int) -> np.ndarray:
        """Values of one layer: [num_pages, num_kv_heads, page_size, head_dim] (a view)."""
        return self.data[layer, 1]
