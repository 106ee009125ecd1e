"""Numba kernels of pagekv, installed as ``pagekv.kernels`` (source folder ``kernels/``).

The kernels trust their input: shapes, dtypes and page ids are validated by the public wrappers in
``pagekv.attention``. Every kernel is compiled with ``cache=True``: the first call in a fresh
environment compiles (see :func:`warmup`), later processes load the cached machine code.
"""

import os as _os
import pathlib as _pathlib

from pagekv.kernels._stale_cache import drop_stale_cache as _drop_stale_cache

__all__ = ["warmup"]

# The default cache location of Numba (NUMBA_CACHE_DIR moves it, and then it is the user's to manage).
if not _os.environ.get("NUMBA_CACHE_DIR"):
    _drop_stale_cache(_pathlib.Path(__file__).parent, _pathlib.Path(__file__).parent / "__pycache__")


def warmup(*, dtypes=("float32", "bfloat16"), head_dim=128, page_size=16):
    """Compile (or load from Numba's cache) the kernels for the given storage dtypes.

    Runs each public operation once on a tiny problem, so the first real call does not pay for
    compilation. Returns the seconds it took.

    Parameters
    ----------
    dtypes : tuple of {"float32", "float16", "bfloat16"}
        KV storage kinds to prepare; each has its own decode and prefill kernels (its own tiles).
    head_dim, page_size : int
        Only the tiny problem's shape: the kernels are compiled for any shape.
    """
    import time

    import numpy as np

    from pagekv import attention

    start = time.perf_counter()
    storage = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}
    rng = np.random.default_rng(0)
    for kind in dtypes:
        cache = rng.standard_normal((3, 2, page_size, head_dim)).astype(np.float32)
        if kind == "bfloat16":
            cache = (cache.view(np.uint32) >> 16).astype(np.uint16)
        else:
            cache = cache.astype(storage[kind])
        q = np.ones((2, 4, head_dim), storage[kind])  # a 16-bit query compiles its conversions too
        table = np.array([[0, 1], [2, 0]], np.int32)
        lens = np.array([page_size + 1, 3], np.int32)
        attention.paged_decode_attention(q, cache, cache, table, lens)
        one_head = np.ascontiguousarray(cache[:, :1])  # a GQA group of 4: the AMX decode, where present
        attention.paged_decode_attention(q, one_head, one_head, table, lens)
        attention.paged_prefill_attention(q, cache, cache, table, lens, np.array([0, 1, 2], np.int32))
        attention.write_kv(cache[0, :, :2].transpose(1, 0, 2).copy(), cache[1, :, :2].transpose(1, 0, 2).copy(),
                           cache, cache.copy(), np.array([5, -1]))
        attention.copy_pages(cache, cache.copy(), [0], [2])
        attention.gather_kv(cache, cache, table, lens)
    o = np.zeros((1, 1, head_dim), np.float32)
    attention.merge_states(o, np.zeros((1, 1), np.float32), o, np.zeros((1, 1), np.float32))
    return time.perf_counter() - start
