"""KVCache: the storage of every layer's K and V pages, in one array.

Layout (docs/layout.md): ``data [num_layers, 2, num_pages, num_kv_heads, page_size, head_dim]``;
``k(layer)`` and ``v(layer)`` are the C-contiguous per-layer views the kernels take.
"""

import numpy as np

from pagekv import _arrays
from pagekv.spec import KVCacheSpec, pool_shape

__all__ = ["KVCache", "check_fits_in_memory"]

_STORAGE = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16, "float8_e4m3fn": np.uint8}


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


def check_fits_in_memory(what: str, num_pages: int, bytes_per_page: int) -> None:
    """MemoryError "expected {what} within the ... GiB available, got N pages x B = ... GiB",
    before any memory is touched, when the pages exceed what the OS reports available (numpy's
    zeros would succeed and the process would be killed later, as pages are written)."""
    nbytes = num_pages * bytes_per_page
    available = _available_memory()
    if available is not None and nbytes > available:
        raise MemoryError(f"expected {what} within the {available / 2**30:.1f} GiB available, got "
                          f"{num_pages} pages x {bytes_per_page} B = {nbytes / 2**30:.1f} GiB")


class KVCache:
    """Every layer's K and V pages for ``num_pages`` pages of ``spec``, in one array.

    Parameters
    ----------
    spec : KVCacheSpec
    num_pages : int
    storage : array, optional
        Memory the caller already owns (a numpy array or a torch CPU tensor) of shape
        ``[num_layers, 2, num_pages, num_kv_heads, page_size, head_dim]``, C-contiguous, of the
        spec's dtype (bfloat16 as ``torch.bfloat16``, ``ml_dtypes.bfloat16`` or uint16 bits;
        float8_e4m3fn as the torch or ml_dtypes dtype of that name, or uint8 bits). It is
        used in place, never copied: writes through pagekv land in the caller's array.

    Raises
    ------
    MemoryError
        Before touching memory, when the cache is larger than the memory the OS reports available.
    ValueError, TypeError
        ``storage`` of another shape, dtype or layout.

    Examples
    --------
    >>> cache = KVCache(KVCacheSpec(num_layers=2, num_kv_heads=4, head_dim=64, dtype="float32"), 8)
    >>> cache.k(1).shape, cache.nbytes
    ((8, 4, 16, 64), 524288)
    """

    def __init__(self, spec: KVCacheSpec, num_pages: int, *, storage=None) -> None:
        shape = pool_shape(spec, num_pages)
        self.spec = spec
        self.num_pages = shape[2]
        if storage is not None:
            self.data = _caller_storage(storage, shape, spec.dtype)
            return
        check_fits_in_memory("a KV cache", self.num_pages, spec.bytes_per_page)
        self.data = _arrays.zeros_on_line(shape, _STORAGE[spec.dtype])

    @property
    def nbytes(self) -> int:
        """Total bytes of K and V storage."""
        return self.data.nbytes

    def k(self, layer: int) -> np.ndarray:
        """Keys of one layer: [num_pages, num_kv_heads, page_size, head_dim] (a view)."""
        return self.data[self._layer(layer), 0]

    def v(self, layer: int) -> np.ndarray:
        """Values of one layer: [num_pages, num_kv_heads, page_size, head_dim] (a view)."""
        return self.data[self._layer(layer), 1]

    def _layer(self, layer) -> int:
        """A layer index, checked (a negative one is refused as page ids are, not counted back)."""
        if (isinstance(layer, (bool, np.bool_)) or not isinstance(layer, (int, np.integer))
                or not 0 <= layer < self.spec.num_layers):
            raise IndexError(f"expected layer in [0, {self.spec.num_layers}), got {layer!r}")
        return int(layer)


def _caller_storage(storage, shape, dtype):
    """A zero-copy numpy view of caller-owned storage, checked against the cache's shape and dtype."""
    array, kind = _arrays.float_storage(storage, "storage", float8=True)
    if kind != dtype:
        raise TypeError(f"expected storage of dtype {dtype} (the spec's), got {kind}")
    if array.shape != shape:
        raise ValueError(f"expected storage of shape {shape}, got {array.shape}")
    if not array.flags.c_contiguous or not array.flags.writeable:
        raise ValueError("expected C-contiguous, writeable storage, got a strided or read-only array")
    return array.view(np.float16) if dtype == "float16" else array
